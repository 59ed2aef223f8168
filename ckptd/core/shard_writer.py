"""The shard encoder: tensors → one rank's ``rank-NNNNN.data`` and its manifest (FORMAT.md).

Shared by the daemon's writer (tensors from a save's slot) and ``ckptd import`` (tensors read
from safetensors files), so both write the same chunks, codecs, checksums and fsync order:
chunks are encoded on the caller's pool in a bounded window and written in order (memory held
beyond the source is a few chunks); the data file is fsynced, then the manifest is written
atomically. What differs between the callers comes in as parameters: where the bytes are
(``read``), the pool and window, and hooks for the daemon's slot release, abandon check and
debug delay, or the importer's progress bar.
"""
from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from . import storage
from .codec import choose_codec, chunk_ranges, encode_chunk
from .names import rank_data_name, rank_manifest_name
from .schema import Manifest, TensorEntry, TensorLayout, digest_bytes, encode_json
from .step_files import remove_rank_files

# (tensor, start, length) → those raw bytes of the tensor (``start`` counts from its first byte).
ReadChunk = Callable[[TensorLayout, int, int], memoryview]


@dataclass(frozen=True)
class Encoding:
    """How chunks are encoded: ``codec`` (a codec name or ``auto``: ``codec.choose_codec`` per dtype),
    its ``level``, and the raw bytes per chunk."""
    codec: str
    level: int
    chunk_bytes: int


@dataclass(frozen=True)
class WrittenShard:
    """A rank's shard, durable: its manifest, the sha256 of the manifest file, and the seconds it took."""
    manifest: Manifest
    digest: str
    seconds: float


@dataclass(frozen=True)
class ShardHooks:
    """The caller's part of a write. ``released``: the source is read no more (every chunk encoded,
    or the write failed), called exactly once; ``before_write``: before each chunk is written (it may
    raise to stop the write); ``written``: after each, with the chunk's raw length."""
    released: Callable[[], None] | None = None
    before_write: Callable[[], None] | None = None
    written: Callable[[int], None] | None = None


def write_shard(step_path: str, job: str, step: int, rank: int, world_size: int,
                tensors: Sequence[TensorLayout], read: ReadChunk, tree: Any, encoding: Encoding,
                pool: Executor, window: int, hooks: ShardHooks = ShardHooks()) -> WrittenShard:
    """Encode ``tensors`` and write rank ``rank``'s data file and manifest durably into ``step_path``
    (created if missing); on any error both files are removed and the error re-raised."""
    t0 = time.monotonic()
    data_path = os.path.join(step_path, rank_data_name(rank))
    released = False
    fd = -1
    pending: collections.deque[tuple[TensorEntry, Future[Any]]] = collections.deque()

    def release() -> None:
        nonlocal released
        released = True
        if hooks.released is not None:
            hooks.released()
    try:
        # Inside the try: a failure here (EROFS, ENOSPC, EACCES) must still release the source.
        for attempt in range(3):
            storage.make_dirs(step_path)
            try:
                fd = storage.open_for_write(data_path)
                break
            except FileNotFoundError:   # the cleanup of an ended attempt removed the (empty) directory just now
                if attempt == 2:
                    raise
        entries: list[TensorEntry] = []
        pos = 0
        flushed = 0     # bytes already handed to writeback

        def drain_one() -> None:
            nonlocal pos, flushed
            entry, fut = pending.popleft()
            parts, meta = fut.result()
            if hooks.before_write is not None:
                hooks.before_write()
            pos += storage.write_all(fd, parts)
            entry.chunks.append(meta)
            if hooks.written is not None:
                hooks.written(meta.raw_len)
            if pos - flushed >= storage.WRITEBACK_BYTES:
                storage.start_writeback(fd, flushed, pos - flushed)
                flushed = pos

        view: memoryview | None = None
        for t in tensors:
            codec = choose_codec(t.dtype, encoding.codec)
            entry = TensorEntry(t.name, t.dtype, list(t.shape), -1, [], t.placement)
            entries.append(entry)
            for start, length in chunk_ranges(t.nbytes, encoding.chunk_bytes):
                view = read(t, start, length)
                pending.append((entry, pool.submit(encode_chunk, view, t.dtype, codec, encoding.level)))
                while len(pending) > window:
                    drain_one()
        # Offsets are known only once earlier chunks are written; entries drain in order.
        while pending:
            drain_one()
        view = None  # a slot's mapping can only be closed once no slice of it is left
        release()
        offset = 0
        for entry in entries:
            entry.offset = offset
            offset += entry.stored_bytes
        os.fsync(fd)
        os.close(fd)
        fd = -1
        manifest = Manifest(job, step, rank, world_size, entries, tree,
                            sum(e.nbytes for e in entries), offset)
        data = encode_json(manifest.to_json())
        storage.atomic_write(os.path.join(step_path, rank_manifest_name(rank)), data)
        return WrittenShard(manifest, digest_bytes(data), time.monotonic() - t0)
    except BaseException:
        for fut in (f for _, f in pending):
            fut.cancel()
        if not released:
            release()
        if fd >= 0:
            os.close(fd)
        try:
            remove_rank_files(step_path, rank)
        except OSError:
            pass  # e.g. EROFS: nothing could be written either; the original error says why
        raise
