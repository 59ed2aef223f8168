"""The local file-system tier: checkpoints as files under the root, in FORMAT.md's layout.

Shard writes (compress + write + fsync, seconds to minutes each) run on threads of their
own; commits, cleanups and listings on the daemon's I/O pool, so a commit or the cleanup of
a failed step never queues behind the shard writes of other steps. Retention (garbage
collection after commits) is this tier's too: it deletes step directories.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

from ckptd.core import step_files
from ckptd.core.names import job_dir, rank_data_name, step_dir
from ckptd.core.rank_record import RankRecord
from ckptd.core.rank_table import SIDE_FILES
from ckptd.core.reader import latest_committed
from ckptd.core.schema import TensorLayout
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.settings.retention import RetentionPolicy
from ckptd.daemon.settings.write import WriteSettings
from ckptd.daemon.tiers.base import ShardRef, ShardWritten, SlotLoan, StorageTier, StreamedData
from ckptd.daemon.tiers.fs import retention
from ckptd.daemon.tiers.fs.commit import CommitWithdrawn, PublishGate, write_index
from ckptd.daemon.tiers.fs.write_way import WriteWay
from ckptd.daemon.tiers.fs.writer import write_shard

log = logging.getLogger("ckptd")

T = TypeVar("T")


def remove_uncommitted(step_path: str, ranks: Sequence[int]) -> None:
    """Drop these ranks' files of an uncommitted step, then the directory if that emptied it."""
    if step_files.is_committed(step_path):
        return
    try:
        for rank in ranks:
            step_files.remove_rank_files(step_path, rank)
        step_files.remove_files(os.path.join(step_path, name) for name in SIDE_FILES)   # an earlier attempt's
        os.rmdir(step_path)
    except OSError as e:   # best effort (EROFS, ENOTEMPTY, ...): an uncommitted step is garbage anyway
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
            log.warning("cannot remove uncommitted files", extra={"ctx": {"path": step_path,
                                                                          "error": describe_error(e)}})


class FsTier(StorageTier):
    def __init__(self, root: str, settings: WriteSettings, threads: int, io_pool: Executor) -> None:
        self.root = root
        self.settings = settings
        self.window = 2 * threads + 2          # chunks encoded ahead of the one being written
        self.way = WriteWay(settings.direct_io)   # through the page cache or around it (write_way.py)
        self._codec_pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptd-codec")
        self._write_pool = ThreadPoolExecutor(max(4, threads), thread_name_prefix="ckptd-write")
        self._io_pool = io_pool
        self._gates: set[PublishGate] = set()  # commits whose thread runs (a thread removes its own)
        self._gates_lock = threading.Lock()
        self._withdrawn = False

    def step_path(self, job: str, step: int) -> str:
        return step_dir(self.root, job, step)

    async def _on(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def write_shard(self, ref: ShardRef, data: memoryview | StreamedData, layout: Sequence[TensorLayout],
                          tree: Any, *,
                          released: Callable[[], None], abandoned: Callable[[], bool],
                          loan: SlotLoan | None = None) -> ShardWritten:
        # ``loan`` is for tiers that keep shards resident: files are read from the slot, which is released.
        direct = self.way.pick()
        result = await self._on(self._write_pool, write_shard, self.step_path(ref.job, ref.step), ref.job, ref.step,
                                ref.rank, ref.world_size, data, list(layout), tree, self.settings, self._codec_pool,
                                self.window, released, abandoned, direct)
        self.way.record(direct, result.manifest.raw_bytes, result.direct_bytes, result.seconds)
        return ShardWritten(result.manifest.raw_bytes, result.manifest.stored_bytes, result.digest, result.seconds,
                            result.record, result.manifest, result.direct_bytes)

    def _gate(self) -> PublishGate:
        return PublishGate()

    async def commit(self, job: str, step: int, world_size: int, digests: Mapping[int, str],
                     records: Sequence[RankRecord] | None = None, check: Sequence[int] | None = None) -> None:
        if self._withdrawn:
            raise CommitWithdrawn(f"step {step}: the daemon is shutting down; no commit starts now")
        gate = self._gate()
        with self._gates_lock:   # here, on the loop: withdraw_commits sees every commit started before it
            self._gates.add(gate)

        def run() -> None:
            try:
                if self.settings.debug_commit_delay:
                    time.sleep(self.settings.debug_commit_delay)
                write_index(self.step_path(job, step), job, step, world_size, dict(digests), gate, records, check)
            finally:
                with self._gates_lock:   # once the thread is done (a cancelled caller is not: it may run on)
                    self._gates.discard(gate)
        await self._on(self._io_pool, run)

    async def withdraw_commits(self) -> None:
        """Make every commit's outcome final now: a commit whose index is not in place yet never
        publishes it, one renaming it right now is waited for, and no commit starts after this.
        Then ``is_committed`` tells the truth about each, whatever their threads still do."""
        self._withdrawn = True
        with self._gates_lock:
            gates = list(self._gates)
        if gates:
            await asyncio.get_running_loop().run_in_executor(None, lambda: [g.withdraw() for g in gates])

    async def abort(self, job: str, step: int, ranks: Collection[int]) -> None:
        await self._on(self._io_pool, remove_uncommitted, self.step_path(job, step), sorted(ranks))

    async def is_committed(self, job: str, step: int) -> bool:
        # One stat, on the caller's loop as it always was: a save's checks stay one atomic step.
        return step_files.is_committed(self.step_path(job, step))

    async def refuses_save(self, job: str, step: int) -> bool:
        return step_files.is_committed(self.step_path(job, step))        # (as is_committed: one stat, no suspension)

    async def latest_committed(self, job: str) -> int | None:
        def latest() -> int | None:
            try:
                info = latest_committed(job_dir(self.root, job))
            except (OSError, ValueError):
                return None
            return info.step if info else None
        return await self._on(self._io_pool, latest)

    async def written_bytes(self, ref: ShardRef) -> int:
        def size() -> int:
            try:
                return os.stat(os.path.join(self.step_path(ref.job, ref.step), rank_data_name(ref.rank))).st_size
            except OSError:
                return 0
        return await self._on(self._io_pool, size)

    async def collect(self, job: str, policy: RetentionPolicy, in_flight: Sequence[int],
                      memory_in_flight: Sequence[int] = (), memo: retention.JobMemo | None = None,
                      ) -> retention.GcResult:
        """Apply ``policy`` to the job's steps, sparing ``in_flight`` (and the memory-level
        ``memory_in_flight``); ``memo``: what the job's earlier passes learned (``retention.JobMemo``)."""
        return await self._on(self._io_pool, lambda: retention.collect_job(
            self.root, job, policy, in_flight=in_flight, memory_in_flight=memory_in_flight, memo=memo))

    def close(self) -> None:
        # Writer threads of unfinished saves cannot be interrupted; the process exits without them.
        self._codec_pool.shutdown(wait=False, cancel_futures=True)
        self._write_pool.shutdown(wait=False, cancel_futures=True)
