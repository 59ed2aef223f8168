"""Steps in flight on this daemon: the coordinator that drives their state machine.

A :class:`StepCoordinator` owns everything about a step — its shards, who waits for it, its
counters (a :class:`~ckptd.daemon.steps.machine.StepTable`) — and moves steps and shards only
along the state machine's tables (step_machine.py has them, and the one commit rule). It does
its I/O through a storage tier and tells clients through a callback, so it runs in a unit
test with a real tier and no sockets.

Two rules about what a step leaves behind:

- The files of a step that ended are removed under the coordinator's ownership (removals.py): a
  re-save of the step waits for them, and never has its files removed by the cleanup of the
  attempt before it.
- A commit, once started, runs to its end in its own task (``commits``): no cancelled caller
  or drain cuts it short, and a COMMITTING step fails only once its commit has failed or been
  withdrawn (the tier's ``withdraw_commits``: its index will then never appear). So nobody is
  told ``failed`` for a step whose index.json may still land.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from ckptd.core.names import rank_spans
from ckptd.core.protocol import CommitMode, EventOp, event
from ckptd.core.rank_record import RankRecord
from ckptd.core.schema import TensorLayout
from ckptd.daemon.runtime import RequestError, TaskSet, describe_error
from ckptd.daemon.service.snapshot import Counters, LastCommit, ShardView, StepView
from ckptd.daemon.steps.handed import HandedOff
from ckptd.daemon.steps.machine import (
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
    orphaned,
)
from ckptd.daemon.steps.removals import Removals
from ckptd.daemon.tiers.base import ShardRef, ShardWritten, SlotLoan, StorageTier, StreamedData

__all__ = ["SHARD_TRANSITIONS", "STEP_TRANSITIONS", "IllegalTransition", "ShardState", "StepCoordinator",
           "StepState"]

log = logging.getLogger("ckptd")

W = TypeVar("W", bound=Hashable)     # whoever waits for a rank's outcome (a session)
REMOVAL_WAIT_S = 30.0                # a save of a step waits this long for the removal of its ended attempt
COMMIT_OVERTIME_S = 10.0             # a commit still running when the drain grace ends gets this much more


class StepCoordinator(Generic[W]):
    """Every step of every job in flight on this daemon."""

    def __init__(self, tier: StorageTier, send_event: Callable[[W, dict[str, Any]], None], *,
                 step_timeout: float, on_durable: Callable[[str, ShardWritten], None] = lambda job, r: None,
                 on_committed: Callable[[str, int, float, bool], None] = lambda job, step, latency, synced: None,
                 withdraw_commits: Callable[[], Awaitable[None]] | None = None,
                 commit_overtime: float = COMMIT_OVERTIME_S, removal_wait: float = REMOVAL_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier
        self.step_timeout = step_timeout
        self._send = send_event
        self._on_durable = on_durable
        self._on_committed = on_committed
        # Makes every commit's outcome final at once (FsTier.withdraw_commits); without it a
        # drain waits for each commit to end, however long that takes.
        self._withdraw_commits = withdraw_commits
        self.commit_overtime = commit_overtime
        self.table: StepTable[W] = StepTable(clock)
        self.writes = TaskSet()               # one task per shard write
        self.commits = TaskSet()              # one task per commit: runs to its end whoever waited for it
        self.removing = Removals(tier, removal_wait)    # ended steps' files (removals.py)
        self.removals = self.removing.tasks
        self.handed: HandedOff[W] = HandedOff()     # relayed steps handed off (handed.py)

    # ---- requests ------------------------------------------------------------------------

    async def save(self, waiter: W, job: str, step: int, rank: int, world_size: int, mode: CommitMode,
                   data: memoryview | StreamedData, layout: Sequence[TensorLayout], tree: Any,
                   released: Callable[[], None], loan: SlotLoan | None = None) -> None:
        """Start writing one rank's shard; ``released`` runs on the event loop once ``data`` is free (or
        the tier keeps its slot through ``loan``: ``SlotLoan``). A step with ``orphaned`` shards fails
        first. Waits (``removal_wait`` at most, then RequestError) while an ended attempt's files go."""
        if (old := self.table.steps.get((job, step))) is not None and (gone := orphaned(old)):
            await self._fail(old, f"rank(s) {rank_spans(gone)} left (killed?) before step {step} committed and "
                                  f"rank {rank} saved it again: it is saved afresh (no shard of an ended process kept)")
        await self.removing.stopped(self.table.writing, job, step, rank)
        await self.removing.settled(job, step)
        if await self.tier.refuses_save(job, step):      # (no suspension from here to begin)
            self.handed.ended(job, step)
            raise RequestError(f"step {step} of job {job!r} is already committed")
        if self.handed.refuses(job, step, rank, waiter):
            raise RequestError(f"rank {rank}'s shard of step {step} of job {job!r} is durable and handed to rank 0's "
                               "daemon for its commit: a step is saved once (it can be saved again once it failed)")
        st, shard = self.table.begin(waiter, job, step, rank, world_size, mode, sum(t.nbytes for t in layout))
        self.writes.spawn(self._write(st, shard, data, list(layout), tree, self._threadsafe(released), loan),
                          f"write of {job} step {step} rank {rank}")

    def leader_step(self, job: str, step: int, rank: int) -> Step[W]:
        """The relayed step a COMMIT from ``rank`` is for (RequestError when there is none)."""
        st = self.table.steps.get((job, step))
        if rank != 0 or st is None or st.mode is not CommitMode.RELAY:
            raise RequestError(f"no relayed step {step} awaiting commit from rank 0 here")
        if not accepts_commit(st):
            raise RequestError(f"step {step}: rank 0 is not durable yet or the step is already committing")
        return st

    async def commit(self, st: Step[W], digests: Mapping[int, str],
                     records: Sequence[RankRecord] | None = None, check: Sequence[int] | None = None) -> None:
        """Rank 0's COMMIT: every rank durable by its digests (and, when given, every rank's record,
        gathered through the store, and the ranks whose manifests are read back: see
        ``CheckpointTier.commit``). RequestError if the commit fails."""
        if not accepts_commit(st):
            raise RequestError(f"step {st.step}: rank 0 is not durable yet or the step is already committing")
        # The ranks durable here are known by their digests: a COMMIT naming others (another step's,
        # an earlier attempt's) would publish an index this step's files do not match.
        wrong = sorted(r for r, sh in st.shards.items() if sh.digest is not None and digests.get(r) != sh.digest)
        if wrong:
            raise RequestError(f"step {st.step}: the COMMIT's digests of rank(s) {wrong[:8]} are not those of their "
                               "shards durable here (another step's or attempt's?)")
        st.move(StepState.DURABLE)
        reason = await self._commit(st, digests, records, check)
        if reason is not None:
            raise RequestError(reason)

    async def abort(self, job: str, step: int, rank: int, reason: str) -> str:
        """Fail the step unless it is already committing; what became of it here: "failed",
        "committing" (too late: its outcome follows as any commit's) or "unknown" (not in flight)."""
        self.handed.ended(job, step)                 # it failed: a retry may save it again
        st = self.table.steps.get((job, step))
        if st is None:
            return "unknown"
        if st.state is StepState.COMMITTING:
            return "committing"
        await self._fail(st, f"aborted by rank {rank}: {reason[:500]}")
        return "failed"

    async def waiter_lost(self, waiter: W) -> None:
        """A client left: fail the steps that cannot complete without it, forget it in the others."""
        self.handed.left(waiter)
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
                                     f"{rank_spans(st.missing())} to be durable (the daemon's step_timeout)")
            except Exception:  # one bad step must not stop every later timeout
                log.exception("failing a timed-out step failed", extra={"ctx": {"job": st.job, "step": st.step}})

    async def drain(self, grace: float) -> list[str]:
        """Shutdown: writes in flight get ``grace`` seconds to become durable and commit, a relayed
        step whose rank 0 is durable here the same grace for its COMMIT; every step still writing
        then fails. A commit in progress is never cut short: it gets ``commit_overtime`` more
        seconds, then is withdrawn and settled by the disk (committed if its index is in place, else
        failed: it can no longer appear). Returns what did not finish: shard writes, and commits
        whose threads still run (neither can be stopped, nor publish anything now)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        unfinished: list[str] = []
        if len(self.writes):
            log.info("draining", extra={"ctx": {"in_flight": len(self.writes), "grace_s": grace}})
            pending = await self.writes.wait(grace)
            unfinished = [f"job={st.job} step={st.step} rank={sh.rank}" for st, sh in list(self.table.writing.values())]
            for task in pending:       # (a task past its write waits for its commit, which runs on regardless)
                task.cancel()
            if unfinished:
                log.error("drain timed out; these saves are left uncommitted",
                          extra={"ctx": {"grace_s": grace, "unfinished": unfinished}})
        while not unfinished and any(awaits_commit(s) for s in list(self.table.steps.values())) \
                and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for st in list(self.table.steps.values()):
            if st.state is StepState.WRITING:
                await self._fail(st, "daemon shut down before every rank was durable (see drain_grace)")
        return unfinished + await self._settle_commits(max(0.0, deadline - loop.time()) + self.commit_overtime)

    async def _settle_commits(self, timeout: float) -> list[str]:
        """Drain: the commits still running after ``timeout`` are withdrawn and settled by the disk."""
        if not await self.commits.wait(timeout):
            return []
        committing = [st for st in list(self.table.steps.values()) if st.state is StepState.COMMITTING]
        names = self.commits.running()
        if self._withdraw_commits is None:      # no way to decide early: the commit's own end decides
            log.warning("drain waits for commits in progress", extra={"ctx": {"commits": names}})
            await self.commits.wait(None)
            return []
        log.warning("commits outlived the drain grace; withdrawing them", extra={"ctx": {"commits": names}})
        await self._withdraw_commits()          # from here no index of these commits can appear any more
        settled: dict[str, str] = {}
        for st in committing:
            if st.state is not StepState.COMMITTING:    # its commit ended meanwhile and told everyone
                settled[_commit_name(st)] = "published" if st.state is StepState.COMMITTED else "failed"
            elif await self.tier.is_committed(st.job, st.step):
                self._committed(st)
                settled[_commit_name(st)] = "published"
            else:
                await self._fail(st, f"daemon shut down before the commit of step {st.step} finished "
                                     f"(withdrawn: its index was not published)", commit_over=True)
                settled[_commit_name(st)] = "withdrawn"
        # Their threads may still run (a slow fsync); they can no longer publish anything.
        return [f"{what} ({settled.get(what, 'settled')}; its thread still runs)" for what in self.commits.running()]

    # ---- writes, commits, failures --------------------------------------------------------

    async def _write(self, st: Step[W], shard: Shard[W], data: memoryview | StreamedData, layout: list[TensorLayout],
                     tree: Any,
                     released: Callable[[], None], loan: SlotLoan | None) -> None:
        rank, totals = shard.rank, self.table.totals_for(st.job)
        ctx = {"job": st.job, "step": st.step, "rank": rank}
        log.info("writing", extra={"ctx": {**ctx, "bytes": shard.raw_bytes}})
        try:
            try:
                result = await self.tier.write_shard(ShardRef(st.job, st.step, rank, st.world_size), data, layout,
                                                     tree, released=released, abandoned=lambda: not st.open,
                                                     loan=loan)
            except Exception as e:
                totals.saves_failed += 1
                if not st.open:
                    # Its step ended meanwhile: the tier removed what it wrote; drop the step if now empty.
                    shard.move(ShardState.DISCARDED)
                    log.info("write stopped", extra={"ctx": {**ctx, "error": describe_error(e)}})
                    await self._remove(st, ())
                    return
                shard.move(ShardState.FAILED)
                reason = f"rank {rank} shard write failed: {describe_error(e)}"
                log.error("write failed", extra={"ctx": {**ctx, "error": reason}})
                self.table.write_over(st, shard)    # its files are gone: a retry told of the failure may start
                await self._fail(st, reason)
                return
            totals.durable(result.raw_bytes, result.stored_bytes, result.direct_bytes)
            self._on_durable(st.job, result)
            shard.move(ShardState.DURABLE)
            shard.digest = result.digest
            shard.record = result.record
            if not st.open:            # the step failed (another rank, a timeout) while this shard was written
                shard.move(ShardState.DISCARDED)
                log.info("shard discarded", extra={"ctx": {**ctx, "reason": f"step {st.step} ended "
                                                           f"({st.state.value}) while it was written"}})
                await self._remove(st, (rank,))
                return
            log.info("durable", extra={"ctx": {**ctx, "raw_bytes": result.raw_bytes,
                                               "stored_bytes": result.stored_bytes, "direct_bytes": result.direct_bytes,
                                               "write_s": round(result.seconds, 6)}})
            self.table.write_over(st, shard)        # before any event: the client may act on it at once
            self._tell(shard, event(EventOp.DURABLE, step=st.step, rank=rank, digest=result.digest,
                                    raw_bytes=result.raw_bytes, stored_bytes=result.stored_bytes,
                                    write_s=round(result.seconds, 6),
                                    **({} if result.record is None else {"record": result.record.to_json()})))
            if st.mode is CommitMode.RELAY and rank != 0:
                shard.waiter = None    # rank 0's client gathers the other ranks through the store
            if complete_here(st):
                st.move(StepState.DURABLE)
                await self._commit(st, st.digests(), st.records())
            elif handed_off(st):
                st.move(StepState.HANDED_OFF)
                self.table.forget(st)
                self.handed.add(st.job, st.step,
                                ((r, sh.owner) for r, sh in st.shards.items() if sh.state is ShardState.DURABLE))
        finally:
            self.table.write_over(st, shard)

    async def _commit(self, st: Step[W], digests: Mapping[int, str],
                      records: Sequence[RankRecord] | None = None, check: Sequence[int] | None = None) -> str | None:
        """Publish the step; returns why it failed (None: committed). The commit runs in a task of its
        own: a caller cancelled meanwhile (a drain, a client gone) leaves it running to its end."""
        st.move(StepState.COMMITTING)
        st.committing_since = self.table.clock()
        task = self.commits.spawn(self._publish(st, dict(digests), records, check), _commit_name(st))
        return await asyncio.shield(task)

    async def _publish(self, st: Step[W], digests: dict[int, str],
                       records: Sequence[RankRecord] | None, check: Sequence[int] | None) -> str | None:
        try:
            await self.tier.commit(st.job, st.step, st.world_size, digests, records, check)
        except Exception as e:    # whatever it is, the step must not stay COMMITTING forever
            reason = f"commit of step {st.step} failed: {describe_error(e) if isinstance(e, OSError) else e}"
            if isinstance(e, OSError) and st.state is StepState.COMMITTING \
                    and await self.tier.is_committed(st.job, st.step):
                # Renamed into place, then an error (the directory's fsync): readers load the step,
                # so it is committed; saying "failed" would be the one false outcome.
                log.error("index published, then its commit failed: committed, durability unconfirmed",
                          extra={"ctx": {"job": st.job, "step": st.step, "error": reason}})
                self.table.totals_for(st.job).steps_committed_unsynced += 1    # (ckptd_steps_committed_unsynced_total)
                self._committed(st, synced=False)
                return None
            await self._fail(st, reason, commit_over=True)      # (no-op when a drain settled it already)
            return reason
        if st.state is StepState.COMMITTING:    # (else a drain settled it: it found this index in place)
            self._committed(st)
        return None

    def _committed(self, st: Step[W], synced: bool = True) -> None:
        """``synced``: its index's directory fsync succeeded (False: committed, durability unconfirmed)."""
        st.move(StepState.COMMITTED)
        self.table.committed(st)
        now = self.table.clock()
        self._on_committed(st.job, st.step, now - st.started, synced)
        log.info("committed", extra={"ctx": {"job": st.job, "step": st.step, "world_size": st.world_size,
                                            "commit_s": round(now - st.committing_since, 6),
                                            "since_first_save_s": round(now - st.started, 6)}})
        for shard in list(st.shards.values()):
            self._tell(shard, event(EventOp.COMMITTED, step=st.step))

    async def _fail(self, st: Step[W], reason: str, *, commit_over: bool = False) -> None:
        """Fail an open step: remove the durable ranks' files, then tell every waiting rank. A
        COMMITTING step fails only here with ``commit_over`` (its commit failed or was withdrawn):
        nothing else may fail it while its index may still appear."""
        if not st.open:
            return
        if st.state is StepState.COMMITTING and not commit_over:
            log.warning("not failing a committing step", extra={"ctx": {"job": st.job, "step": st.step,
                                                                        "reason": reason}})
            return
        st.move(StepState.FAILED)
        self.table.forget(st)
        self.table.totals_for(st.job).steps_failed += 1
        log.warning("step abandoned", extra={"ctx": {"job": st.job, "step": st.step, "reason": reason}})
        # Remove the durable ranks' files BEFORE telling anyone, registered in this same turn of
        # the loop (a save of the step waits for it): a client that retries the step as soon as it
        # hears, or a new session that re-saves it meanwhile, must not have its new files deleted by
        # this cleanup. Ranks still writing stop at their next chunk and remove their own files (_write).
        durable = st.ranks(ShardState.DURABLE)
        try:
            await self._remove(st, durable)
        finally:
            for rank in durable:
                st.shards[rank].move(ShardState.DISCARDED)
            for shard in list(st.shards.values()):
                self._tell(shard, event(EventOp.FAILED, step=st.step, reason=reason))

    async def _remove(self, st: Step[W], ranks: Sequence[int]) -> None:
        """Remove these ranks' files of the ended step ``st`` (removals.py; a shard whose own write ended
        this way stays in ``writing`` until then as well: _write's finally)."""
        if not ranks and self.table.steps.get((st.job, st.step)) is not None:
            return                      # a new attempt of the step owns its directory now: leave it be
        await self.removing.remove(st.job, st.step, ranks)

    def _tell(self, shard: Shard[W], msg: dict[str, Any]) -> None:
        if shard.waiter is not None:
            self._send(shard.waiter, msg)

    @staticmethod
    def _threadsafe(callback: Callable[[], None]) -> Callable[[], None]:
        """``callback`` run on this event loop, whatever thread calls the wrapper."""
        loop = asyncio.get_running_loop()

        def call() -> None:
            with contextlib.suppress(RuntimeError):    # the loop is closed: the daemon is exiting
                loop.call_soon_threadsafe(callback)
        return call

    # ---- what status, metrics and retention see ----------------------------------------------

    def get(self, job: str, step: int) -> Step[W] | None:
        return self.table.steps.get((job, step))

    def open_steps(self, job: str) -> list[int]:
        return self.table.open_steps(job)

    @property
    def last_committed(self) -> dict[str, LastCommit]:
        return self.table.last_committed

    def counters(self, memory_level: bool = False) -> Counters:
        return self.table.memory_counters() if memory_level else self.table.counters()

    def step_views(self) -> tuple[StepView, ...]:
        return self.table.step_views()

    def shard_views(self) -> tuple[ShardView, ...]:
        return self.table.shard_views()


def _commit_name(st: Step[Any]) -> str:
    return f"commit of job={st.job} step={st.step}"
