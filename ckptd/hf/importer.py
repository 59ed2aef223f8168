"""``ckptd import``: a Hugging Face checkpoint → a committed ckptd step whose state is ``{"model": {...}}``.

The whole directory is validated first (``hf_dir.read_hf_dir``); only then is anything written.
The step is written by the daemon's own encoder and publisher (FORMAT.md): one rank (world size 1),
its data file of chunks encoded on a thread pool (``bplane`` by default) and its manifest
(``core.shard_writer``), then the checked index — its side files when it is large, ``index.json``
last (``core.publish``) — so the step is committed completely or not at all. ``Checkpointer.restore`` then loads it at
any world size and sharding: every tensor is a plain one every rank may read.
"""
from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptd.core import storage
from ckptd.core.codec import CODECS, DEFAULT_CHUNK_BYTES
from ckptd.core.names import step_dir
from ckptd.core.publish import publish_step
from ckptd.core.schema import TensorLayout
from ckptd.core.shard_writer import Encoding, ShardHooks, WrittenShard, write_shard
from ckptd.core.step_files import is_committed

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
    (state ``{"model": {name: tensor}}``). Raises FormatError (a ValueError) for a bad directory,
    publish.IndexRefused (a ValueError) for tensors that do not make a loadable step, and
    FileExistsError when the step directory exists; nothing is left behind on any failure."""
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r}: choose one of {', '.join(CODECS)}")
    src = read_hf_dir(hf_dir)
    path = step_dir(os.path.abspath(os.fspath(root)), job, step)
    if os.path.lexists(path):
        what = "committed" if is_committed(path) else "uncommitted (remove it or `ckptd gc`)"
        raise FileExistsError(f"{path}: step {step} of job {job!r} exists already, {what}")
    storage.make_dirs(os.path.dirname(path))
    os.mkdir(path, 0o750)
    bar = Progress(f"import {job} step {step}", src.total_bytes, progress)
    try:
        shard = _write_rank(src, path, job, step, Encoding(codec, level, DEFAULT_CHUNK_BYTES), threads, bar)
        publish_step(path, job, step, 1, [shard.record])
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        bar.close()
    m = shard.manifest
    return ImportResult(path, len(m.tensors), m.raw_bytes, m.stored_bytes)


def _write_rank(src: HfDir, path: str, job: str, step: int, encoding: Encoding, threads: int,
                bar: Progress) -> WrittenShard:
    """Rank 0's data file and manifest, every tensor read from its safetensors file chunk by chunk."""
    layout = [TensorLayout(f"model/{t.name}", t.tensor.dtype, tuple(t.tensor.shape), t.tensor.begin, t.tensor.nbytes)
              for t in src.tensors]
    fds: dict[str, int] = {}
    file_of = {f"model/{t.name}": t.file for t in src.tensors}

    def read(t: TensorLayout, start: int, length: int) -> memoryview:
        return memoryview(storage.read_at(fds[file_of[t.name]], t.offset + start, length))
    tree = {"d": [["model", {"d": [[t.name, {"T": f"model/{t.name}"}] for t in src.tensors]}]]}
    try:
        for name in src.files:
            fds[name] = open_regular(os.path.join(src.path, name))
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptd-import") as pool:
            return write_shard(path, job, step, 0, 1, layout, read, tree, encoding, pool, 2 * max(1, threads),
                               ShardHooks(written=bar.update))
    finally:
        for fd in fds.values():
            os.close(fd)
