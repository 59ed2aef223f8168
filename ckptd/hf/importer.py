"""``ckptd import``: a Hugging Face checkpoint → a committed ckptd step whose state is ``{"model": {...}}``.

The whole directory is validated first (``hf_dir.read_hf_dir``); only then is anything written.
The step is written as the daemon writes one (FORMAT.md): one rank (world size 1), its data file
of chunks encoded on a thread pool (``bplane`` by default), its manifest, then ``index.json`` with
the tensor map — data fsynced, manifest and index each tmp → fsync → rename → fsync dir, the index
last, so the step is committed completely or not at all. ``Checkpointer.restore`` then loads it at
any world size and sharding: every tensor is a plain one every rank may read.
"""
from __future__ import annotations

import collections
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptd.core import storage
from ckptd.core.codec import CODECS, DEFAULT_CHUNK_BYTES, choose_codec, chunk_ranges, encode_chunk
from ckptd.core.global_index import build_tensor_map
from ckptd.core.names import INDEX_NAME, rank_data_name, rank_manifest_name, step_dir
from ckptd.core.schema import Manifest, TensorEntry, digest_bytes, encode_json, make_index

from .hf_dir import HfDir, read_hf_dir
from .progress import Progress
from .safetensors_io import open_regular


@dataclass(frozen=True)
class ImportResult:
    step_dir: str
    tensors: int
    raw_bytes: int
    stored_bytes: int


def import_hf(hf_dir: str | os.PathLike[str], root: str | os.PathLike[str], job: str, step: int, *,
              codec: str = "bplane", level: int = 1, threads: int = 4, progress: bool | None = None) -> ImportResult:
    """Commit the Hugging Face checkpoint ``hf_dir`` as step ``step`` of ``job`` under ``root``
    (state ``{"model": {name: tensor}}``). Raises FormatError (a ValueError) for a bad directory
    and FileExistsError when the step directory exists; nothing is left behind on any failure."""
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r}: choose one of {', '.join(CODECS)}")
    src = read_hf_dir(hf_dir)
    path = step_dir(os.path.abspath(os.fspath(root)), job, step)
    if os.path.lexists(path):
        committed = os.path.exists(os.path.join(path, INDEX_NAME))
        what = "committed" if committed else "uncommitted (remove it or `ckptd gc`)"
        raise FileExistsError(f"{path}: step {step} of job {job!r} exists already, {what}")
    storage.make_dirs(os.path.dirname(path))
    os.mkdir(path, 0o750)
    bar = Progress(f"import {job} step {step}", src.total_bytes, progress)
    try:
        manifest, digest = _write_rank(src, path, job, step, codec, level, threads, bar)
        tensors, per_rank = build_tensor_map([manifest])
        index = make_index(job, step, 1, [{"rank": 0, "manifest_digest": digest, "raw_bytes": manifest.raw_bytes,
                                           "stored_bytes": manifest.stored_bytes}],
                           time.time(), {n: t.to_json(1) for n, t in tensors.items()}, per_rank)
        storage.atomic_write(os.path.join(path, INDEX_NAME), encode_json(index))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        bar.close()
    return ImportResult(path, len(manifest.tensors), manifest.raw_bytes, manifest.stored_bytes)


def _write_rank(src: HfDir, path: str, job: str, step: int, codec: str, level: int, threads: int,
                bar: Progress) -> tuple[Manifest, str]:
    entries: list[TensorEntry] = []
    pending: collections.deque[tuple[TensorEntry, Future[Any], int]] = collections.deque()
    window = 2 * max(1, threads)
    fds: dict[str, int] = {}
    out = storage.open_for_write(os.path.join(path, rank_data_name(0)))
    pos = 0

    def drain_one() -> None:
        nonlocal pos
        entry, fut, raw = pending.popleft()
        parts, meta = fut.result()
        pos += storage.write_all(out, parts)
        entry.chunks.append(meta)
        bar.update(raw)

    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptd-import") as pool:
            for t in src.tensors:
                fd = fds.get(t.file)
                if fd is None:
                    fd = fds[t.file] = open_regular(os.path.join(src.path, t.file))
                entry = TensorEntry(f"model/{t.name}", t.tensor.dtype, list(t.tensor.shape), -1, [])
                entries.append(entry)
                chosen = choose_codec(entry.dtype, codec)
                for start, length in chunk_ranges(t.tensor.nbytes, DEFAULT_CHUNK_BYTES):
                    raw = memoryview(storage.read_at(fd, t.tensor.begin + start, length))
                    pending.append((entry, pool.submit(encode_chunk, raw, entry.dtype, chosen, level), length))
                    while len(pending) > window:
                        drain_one()
            while pending:
                drain_one()
        os.fsync(out)
    finally:
        os.close(out)
        for fd in fds.values():
            os.close(fd)
    offset = 0
    for entry in entries:
        entry.offset = offset
        offset += entry.stored_bytes
    tree = {"d": [["model", {"d": [[t.name, {"T": f"model/{t.name}"}] for t in src.tensors]}]]}
    manifest = Manifest(job, step, 0, 1, entries, tree, sum(e.nbytes for e in entries), offset)
    data = encode_json(manifest.to_json())
    storage.atomic_write(os.path.join(path, rank_manifest_name(0)), data)
    return manifest, digest_bytes(data)
