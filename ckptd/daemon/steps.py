"""Steps in flight on this daemon: the coordinator that drives their state machine.

A :class:`StepCoordinator` owns everything about a step — its shards, who waits for it, its
counters (a :class:`~ckptd.daemon.step_machine.StepTable`) — and moves steps and shards only
along the state machine's tables (step_machine.py has them, and the one commit rule). It does
its I/O through a storage tier and tells clients through a callback, so it runs in a unit
test with a real tier and no sockets.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from ckptd.core.protocol import CommitMode, EventOp, event
from ckptd.core.schema import TensorLayout
from ckptd.core.tier import ShardRef, ShardWritten, StorageTier
from ckptd.daemon.runtime import RequestError, TaskSet, describe_error
from ckptd.daemon.snapshot import Counters, LastCommit, ShardView, StepView
from ckptd.daemon.step_machine import (
    SHARD_TRANSITIONS,
    STEP_TRANSITIONS,
    IllegalTransition,
    Shard,
    ShardState,
    Step,
    StepState,
    StepTable,
    accepts_commit,
    awaits_commit,
    complete_here,
    handed_off,
    needs_waiter,
)

__all__ = ["SHARD_TRANSITIONS", "STEP_TRANSITIONS", "IllegalTransition", "ShardState", "StepCoordinator",
           "StepState"]

log = logging.getLogger("ckptd")

W = TypeVar("W", bound=Hashable)     # whoever waits for a rank's outcome (a session)


class StepCoordinator(Generic[W]):
    """Every step of every job in flight on this daemon."""

    def __init__(self, tier: StorageTier, send_event: Callable[[W, dict[str, Any]], None], *,
                 step_timeout: float, on_durable: Callable[[ShardWritten], None] = lambda r: None,
                 on_committed: Callable[[str, int, float], None] = lambda job, step, latency: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier
        self.step_timeout = step_timeout
        self._send = send_event
        self._on_durable = on_durable
        self._on_committed = on_committed
        self.table: StepTable[W] = StepTable(clock)
        self.writes = TaskSet()               # one task per shard write

    # ---- requests ------------------------------------------------------------------------

    async def save(self, waiter: W, job: str, step: int, rank: int, world_size: int, mode: CommitMode,
                   data: memoryview, layout: Sequence[TensorLayout], tree: Any,
                   released: Callable[[], None]) -> None:
        """Start writing one rank's shard; ``released`` runs on the event loop once ``data`` is free."""
        if await self.tier.is_committed(job, step):
            raise RequestError(f"step {step} of job {job!r} is already committed")
        st, shard = self.table.begin(waiter, job, step, rank, world_size, mode, sum(t.nbytes for t in layout))
        self.writes.spawn(self._write(st, shard, data, list(layout), tree, self._threadsafe(released)),
                          f"write of {job} step {step} rank {rank}")

    def leader_step(self, job: str, step: int, rank: int) -> Step[W]:
        """The relayed step a COMMIT from ``rank`` is for (RequestError when there is none)."""
        st = self.table.steps.get((job, step))
        if rank != 0 or st is None or st.mode is not CommitMode.RELAY:
            raise RequestError(f"no relayed step {step} awaiting commit from rank 0 here")
        if not accepts_commit(st):
            raise RequestError(f"step {step}: rank 0 is not durable yet or the step is already committing")
        return st

    async def commit(self, st: Step[W], digests: Mapping[int, str]) -> None:
        """Rank 0's COMMIT: every rank durable by its digests. RequestError if the commit fails."""
        if not accepts_commit(st):
            raise RequestError(f"step {st.step}: rank 0 is not durable yet or the step is already committing")
        st.move(StepState.DURABLE)
        await self._commit(st, digests)

    async def abort(self, job: str, step: int, rank: int, reason: str) -> None:
        st = self.table.steps.get((job, step))
        if st is not None and st.state is not StepState.COMMITTING:
            await self._fail(st, f"aborted by rank {rank}: {reason[:500]}")

    async def waiter_lost(self, waiter: W) -> None:
        """A client left: fail the steps that cannot complete without it, forget it in the others."""
        for st in list(self.table.steps.values()):
            for rank, shard in list(st.shards.items()):
                if shard.waiter is not waiter or not st.open:
                    continue
                if needs_waiter(st, rank):
                    await self._fail(st, f"rank {rank} disconnected before step {st.step} committed")
                else:
                    shard.waiter = None

    async def expire(self) -> None:
        """Fail the steps not committing after ``step_timeout`` (called about once a second)."""
        now = self.table.clock()
        for st in [s for s in list(self.table.steps.values()) if s.state is StepState.WRITING]:
            if now - st.started <= self.step_timeout:
                continue
            try:
                await self._fail(st, f"timed out after {self.step_timeout:g}s waiting for ranks "
                                     f"{st.missing()} to be durable")
            except Exception:  # one bad step must not stop every later timeout
                log.exception("failing a timed-out step failed", extra={"ctx": {"job": st.job, "step": st.step}})

    async def drain(self, grace: float) -> list[str]:
        """Shutdown: writes in flight get ``grace`` seconds to become durable and commit, a relayed
        step whose rank 0 is durable here the same grace for its COMMIT; every step still open
        then fails. Returns the shard writes that did not finish (their threads cannot be stopped)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        unfinished: list[str] = []
        if len(self.writes):
            log.info("draining", extra={"ctx": {"in_flight": len(self.writes), "grace_s": grace}})
            pending = await self.writes.wait(grace)
            if pending:
                unfinished = [f"job={st.job} step={st.step} rank={sh.rank}"
                              for st, sh in list(self.table.writing.values())]
                for task in pending:
                    task.cancel()
                log.error("drain timed out; these saves are left uncommitted",
                          extra={"ctx": {"grace_s": grace, "unfinished": unfinished}})
        while not unfinished and any(awaits_commit(s) for s in list(self.table.steps.values())) \
                and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for st in list(self.table.steps.values()):
            if st.state is not StepState.COMMITTING:
                await self._fail(st, "daemon shut down before every rank was durable")
        return unfinished

    # ---- writes, commits, failures --------------------------------------------------------

    async def _write(self, st: Step[W], shard: Shard[W], data: memoryview, layout: list[TensorLayout], tree: Any,
                     released: Callable[[], None]) -> None:
        rank, totals = shard.rank, self.table.totals
        ctx = {"job": st.job, "step": st.step, "rank": rank}
        log.info("writing", extra={"ctx": {**ctx, "bytes": shard.raw_bytes}})
        try:
            try:
                result = await self.tier.write_shard(ShardRef(st.job, st.step, rank, st.world_size), data, layout,
                                                     tree, released=released, abandoned=lambda: not st.open)
            except Exception as e:
                totals.saves_failed += 1
                if not st.open:
                    # Its step ended meanwhile: the tier removed what it wrote; drop the step if now empty.
                    shard.move(ShardState.DISCARDED)
                    log.info("write stopped", extra={"ctx": {**ctx, "error": describe_error(e)}})
                    await self.tier.abort(st.job, st.step, ())
                    return
                shard.move(ShardState.FAILED)
                reason = f"rank {rank} shard write failed: {describe_error(e)}"
                log.error("write failed", extra={"ctx": {**ctx, "error": reason}})
                self.table.write_over(st, shard)    # its files are gone: a retry told of the failure may start
                await self._fail(st, reason)
                return
            totals.saves_durable += 1
            totals.bytes_raw += result.raw_bytes
            totals.bytes_stored += result.stored_bytes
            self._on_durable(result)
            log.info("durable", extra={"ctx": {**ctx, "raw_bytes": result.raw_bytes,
                                               "stored_bytes": result.stored_bytes,
                                               "write_s": round(result.seconds, 6)}})
            shard.move(ShardState.DURABLE)
            shard.digest = result.digest
            if not st.open:            # the step failed (another rank, a timeout) while this shard was written
                shard.move(ShardState.DISCARDED)
                await self.tier.abort(st.job, st.step, (rank,))
                return
            self.table.write_over(st, shard)        # before any event: the client may act on it at once
            self._tell(shard, event(EventOp.DURABLE, step=st.step, rank=rank, digest=result.digest,
                                    raw_bytes=result.raw_bytes, stored_bytes=result.stored_bytes,
                                    write_s=round(result.seconds, 6)))
            if st.mode is CommitMode.RELAY and rank != 0:
                shard.waiter = None    # rank 0's client gathers the other ranks through the store
            if complete_here(st):
                st.move(StepState.DURABLE)
                await self._commit(st, st.digests())
            elif handed_off(st):
                st.move(StepState.HANDED_OFF)
                self.table.forget(st)
        finally:
            self.table.write_over(st, shard)

    async def _commit(self, st: Step[W], digests: Mapping[int, str]) -> None:
        st.move(StepState.COMMITTING)
        t0 = self.table.clock()
        try:
            await self.tier.commit(st.job, st.step, st.world_size, dict(digests))
        except Exception as e:    # whatever it is, the step must not stay COMMITTING forever
            reason = f"commit of step {st.step} failed: {describe_error(e) if isinstance(e, OSError) else e}"
            await self._fail(st, reason)
            if st.mode is CommitMode.RELAY:
                raise RequestError(reason) from None
            return
        st.move(StepState.COMMITTED)
        self.table.committed(st)
        now = self.table.clock()
        self._on_committed(st.job, st.step, now - st.started)
        log.info("committed", extra={"ctx": {"job": st.job, "step": st.step, "world_size": st.world_size,
                                            "commit_s": round(now - t0, 6),
                                            "since_first_save_s": round(now - st.started, 6)}})
        for shard in list(st.shards.values()):
            self._tell(shard, event(EventOp.COMMITTED, step=st.step))

    async def _fail(self, st: Step[W], reason: str) -> None:
        if not st.open:
            return
        st.move(StepState.FAILED)
        self.table.forget(st)
        self.table.totals.steps_failed += 1
        log.warning("step abandoned", extra={"ctx": {"job": st.job, "step": st.step, "reason": reason}})
        # Remove the durable ranks' files BEFORE telling anyone: a client that retries the step
        # as soon as it hears must not have its new files deleted by this cleanup. Ranks still
        # writing stop at their next chunk and remove their own files (see _write).
        durable = st.ranks(ShardState.DURABLE)
        try:
            await self.tier.abort(st.job, st.step, durable)
        finally:
            for rank in durable:
                st.shards[rank].move(ShardState.DISCARDED)
            for shard in list(st.shards.values()):
                self._tell(shard, event(EventOp.FAILED, step=st.step, reason=reason))

    def _tell(self, shard: Shard[W], msg: dict[str, Any]) -> None:
        if shard.waiter is not None:
            self._send(shard.waiter, msg)

    @staticmethod
    def _threadsafe(callback: Callable[[], None]) -> Callable[[], None]:
        """``callback`` run on this event loop, whatever thread calls the wrapper."""
        loop = asyncio.get_running_loop()

        def call() -> None:
            try:
                loop.call_soon_threadsafe(callback)
            except RuntimeError:       # the loop is closed: the daemon is exiting
                pass
        return call

    # ---- what status, metrics and retention see ----------------------------------------------

    def get(self, job: str, step: int) -> Step[W] | None:
        return self.table.steps.get((job, step))

    def open_steps(self, job: str) -> list[int]:
        return self.table.open_steps(job)

    @property
    def last_committed(self) -> dict[str, LastCommit]:
        return self.table.last_committed

    def counters(self) -> Counters:
        return self.table.counters()

    def step_views(self) -> tuple[StepView, ...]:
        return self.table.step_views()

    def shard_views(self) -> tuple[ShardView, ...]:
        return self.table.shard_views()
