"""One rank's shard from a save's slot, through the shared encoder (``ckptd.core.shard_writer``).

Runs on an I/O thread; what is the daemon's own is here: chunks are read straight from the
slot, the slot is released as soon as every chunk is encoded (before fsync) so the trainer can
reuse it while the daemon finishes the durable part, an abandoned step stops before its next
chunk is written, and the test setting ``debug_write_delay`` slows each chunk down.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from ckptd.core import shard_writer
from ckptd.core.schema import TensorLayout
from ckptd.core.shard_writer import Encoding, ShardHooks, WrittenShard
from ckptd.daemon.settings.write import WriteSettings
from ckptd.daemon.tiers.base import StreamedData


class WriteAbandoned(Exception):
    """The step was abandoned (another rank failed, a timeout, the client left) mid-write."""


def write_shard(step_path: str, job: str, step: int, rank: int, world_size: int,
                slot: memoryview | StreamedData, tensors: list[TensorLayout], tree: Any,
                settings: WriteSettings, pool: Executor, window: int,
                on_slot_released: Callable[[], None],
                abandoned: Callable[[], bool] | None = None, direct: bool = False) -> WrittenShard:
    """Encode and write one rank's data file and manifest durably; on error remove both.

    ``abandoned`` (polled before each chunk is written): when it turns true, stop and raise
    WriteAbandoned, so a dead client's step stops costing disk bandwidth. ``direct``: raw chunks
    around the page cache where they can be (write_way.py): read from the slot, whole or
    filling (``StreamedData.mapped``), not from the reused slots of a streamed save, whose bytes do
    not sit at their layout's offsets."""
    def read(t: TensorLayout, start: int, length: int) -> memoryview:
        if isinstance(slot, StreamedData):
            return slot.read(t, start, length, abandoned or (lambda: False))
        return slot[t.offset + start: t.offset + start + length]

    def before_write() -> None:
        if settings.debug_write_delay:
            time.sleep(settings.debug_write_delay)
        if abandoned is not None and abandoned():
            raise WriteAbandoned(f"step {step} was abandoned while rank {rank} was being written")
    source = (slot if isinstance(slot, memoryview) else slot.mapped()) if direct else None
    return shard_writer.write_shard(step_path, job, step, rank, world_size, tensors, read, tree,
                                    Encoding(settings.codec, settings.level, settings.chunk_bytes, settings.adaptive),
                                    pool, window,
                                    ShardHooks(released=on_slot_released, before_write=before_write),
                                    direct=source)
