"""The compress + write pipeline for one rank's shard.

Runs on an I/O thread; chunks are encoded on a shared compression pool in a bounded
window and written in order, so memory held beyond the slot is a few chunks. The slot
is released as soon as every chunk is encoded (before fsync), so the trainer can reuse
it while the daemon finishes the durable part.
"""
from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from ckptd.core import storage
from ckptd.core.codec import choose_codec, chunk_ranges, encode_chunk
from ckptd.core.names import rank_data_name, rank_manifest_name
from ckptd.core.schema import Manifest, TensorEntry, TensorLayout, digest_bytes, encode_json
from ckptd.daemon.settings.write import WriteSettings


class WriteAbandoned(Exception):
    """The step was abandoned (another rank failed, a timeout, the client left) mid-write."""


@dataclass
class ShardResult:
    manifest: Manifest
    digest: str
    seconds: float


def write_shard(step_path: str, job: str, step: int, rank: int, world_size: int,
                slot: memoryview, tensors: list[TensorLayout], tree: Any,
                settings: WriteSettings, pool: Executor, window: int,
                on_slot_released: Callable[[], None],
                abandoned: Callable[[], bool] | None = None) -> ShardResult:
    """Encode and write one rank's data file and manifest durably; on error remove both.

    ``abandoned`` (polled before each chunk is written): when it turns true, stop and raise
    WriteAbandoned, so a dead client's step stops costing disk bandwidth."""
    t0 = time.monotonic()
    data_path = os.path.join(step_path, rank_data_name(rank))
    manifest_path = os.path.join(step_path, rank_manifest_name(rank))
    released = False
    fd = -1
    pending: collections.deque[tuple[TensorEntry, Future[Any]]] = collections.deque()
    try:
        # Inside the try: a failure here (EROFS, ENOSPC, EACCES) must still release the slot.
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
            if settings.debug_write_delay:
                time.sleep(settings.debug_write_delay)
            if abandoned is not None and abandoned():
                raise WriteAbandoned(f"step {step} was abandoned while rank {rank} was being written")
            pos += storage.write_all(fd, parts)
            entry.chunks.append(meta)
            if pos - flushed >= storage.WRITEBACK_BYTES:
                storage.start_writeback(fd, flushed, pos - flushed)
                flushed = pos

        view: memoryview | None = None
        for t in tensors:
            codec = choose_codec(t.dtype, settings.codec)
            entry = TensorEntry(t.name, t.dtype, list(t.shape), -1, [], t.placement)
            entries.append(entry)
            for start, length in chunk_ranges(t.nbytes, settings.chunk_bytes):
                view = slot[t.offset + start: t.offset + start + length]
                pending.append((entry, pool.submit(encode_chunk, view, t.dtype, codec, settings.level)))
                while len(pending) > window:
                    drain_one()
        # Offsets are known only once earlier chunks are written; entries drain in order.
        while pending:
            drain_one()
        view = None  # the slot's mapping can only be closed once no slice of it is left
        on_slot_released()
        released = True
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
        storage.atomic_write(manifest_path, data)
        return ShardResult(manifest, digest_bytes(data), time.monotonic() - t0)
    except BaseException:
        for fut in (f for _, f in pending):
            fut.cancel()
        if not released:
            on_slot_released()
        if fd >= 0:
            os.close(fd)
        try:
            remove_rank_files(step_path, rank)
        except OSError:
            pass  # e.g. EROFS: nothing could be written either; the original error says why
        raise


def remove_rank_files(step_path: str, rank: int) -> None:
    """Drop one rank's files of an uncommitted step (never called once index.json exists)."""
    for name in (rank_data_name(rank), rank_manifest_name(rank)):
        try:
            os.unlink(os.path.join(step_path, name))
        except FileNotFoundError:
            pass
