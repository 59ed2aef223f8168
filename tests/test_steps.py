"""The step coordinator in-process: every transition of its state machine and every failure edge.

Real storage: the real file-system tier in a temp dir (shards are really encoded, written,
fsynced and committed). Failures are real too: a write error is a path the writer cannot
create, a commit error a manifest changed after it was reported durable. Timing is held with
gates around the real tier's calls and an injected clock, never with sleeps.

Transitions and where they are exercised (each test asserts the exact path it takes):

  step  WRITING→DURABLE→COMMITTING→COMMITTED  test_local_step_commits, test_relay_leader_commits
        WRITING→HANDED_OFF                    test_relay_step_without_its_leader_is_handed_off
        WRITING→FAILED                        write error, rank lost, timeout, abort, drain tests
        COMMITTING→FAILED                     test_commit_failure_*, test_drain_withdraws_*
  shard WRITING→DURABLE                       every committing test
        WRITING→FAILED                        test_shard_write_error_fails_the_step
        WRITING→DISCARDED                     test_waiter_lost_while_writing_*, test_resave_*
        DURABLE→DISCARDED                     test_shard_write_error_*, test_shard_durable_after_*
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from pathlib import Path
from typing import Any

import pytest

from ckptd.core.names import INDEX_NAME, rank_data_name, rank_manifest_name, step_dir
from ckptd.core.protocol import CommitMode
from ckptd.core.rank_record import RankRecord
from ckptd.core.reader import verify_step
from ckptd.core.schema import TensorLayout
from ckptd.daemon.runtime import RequestError
from ckptd.daemon.settings.write import WriteSettings
from ckptd.daemon.steps.coordinator import (
    SHARD_TRANSITIONS,
    STEP_TRANSITIONS,
    IllegalTransition,
    ShardState,
    StepCoordinator,
    StepState,
)
from ckptd.daemon.steps.machine import Shard, Step
from ckptd.daemon.tiers.base import ShardRef, ShardWritten, SlotLoan, StreamedData
from ckptd.daemon.tiers.fs.commit import PublishGate
from ckptd.daemon.tiers.fs.tier import FsTier

JOB = "unit"
N = 64 * 1024                       # float32 elements per shard: 256 KiB, four 64 KiB chunks
LOCAL, RELAY = CommitMode.LOCAL, CommitMode.RELAY
W, D, C, OK, F, H = (StepState.WRITING, StepState.DURABLE, StepState.COMMITTING, StepState.COMMITTED,
                     StepState.FAILED, StepState.HANDED_OFF)
SW, SD, SF, SX = ShardState.WRITING, ShardState.DURABLE, ShardState.FAILED, ShardState.DISCARDED


class Rank:
    """What a session is to the coordinator: it waits for a rank's outcome and hears events."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.released = 0
        self.on_event: Callable[[dict[str, Any]], object] = lambda msg: None

    def release(self) -> None:
        self.released += 1

    def hear(self, msg: dict[str, Any]) -> None:
        self.events.append(msg)
        self.on_event(msg)

    def ops(self) -> list[str]:
        return [e["op"] for e in self.events]

    def last(self) -> dict[str, Any]:
        return self.events[-1]


class SlowPublish(PublishGate):
    """A commit's publish held on a thread: before its rename (``where="before"``: index.json is not
    in place yet) or inside it (``"inside"``: renamed, the gate's lock still held), until ``go``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.reached = threading.Event()
        self.go = threading.Event()
        self.synced = threading.Event()         # the index's directory fsynced

    def _hold(self) -> None:
        self.reached.set()
        assert self.go.wait(60), "test never released the publish"

    def publish(self, rename: Callable[[], None], sync: Callable[[], None] = lambda: None) -> None:
        if self.where == "before":
            self._hold()
            super().publish(rename, sync)
        else:
            def rename_then_hold() -> None:
                rename()
                self._hold()

            def sync_then_note() -> None:
                sync()
                self.synced.set()
            super().publish(rename_then_hold, sync_then_note)


class GatedTier(FsTier):
    """The real file-system tier; a test may hold a shard before its write starts or before its
    (durable) result is reported, a commit before it starts or at its publish (``slow_publish``),
    and the removal of a failed step's files (``abort_gate``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.before: dict[tuple[int, int], asyncio.Event] = {}
        self.after: dict[tuple[int, int], asyncio.Event] = {}
        self.commit_gate: asyncio.Event | None = None
        self.abort_gate: asyncio.Event | None = None
        self.aborts_held = 0
        self.written: list[tuple[int, int]] = []           # (step, rank) of each write done on disk
        self.slow_publish: SlowPublish | None = None

    def _gate(self) -> PublishGate:
        return self.slow_publish or super()._gate()

    async def abort(self, job: str, step: int, ranks: Any) -> None:
        if self.abort_gate is not None:
            self.aborts_held += 1
            await self.abort_gate.wait()
        await super().abort(job, step, ranks)

    async def write_shard(self, ref: ShardRef, data: memoryview | StreamedData, layout: Sequence[TensorLayout],
                          tree: Any, *,
                          released: Callable[[], None], abandoned: Callable[[], bool],
                          loan: SlotLoan | None = None) -> ShardWritten:
        if (gate := self.before.get((ref.step, ref.rank))) is not None:
            await gate.wait()
        result = await super().write_shard(ref, data, layout, tree, released=released, abandoned=abandoned,
                                           loan=loan)
        self.written.append((ref.step, ref.rank))
        if (gate := self.after.get((ref.step, ref.rank))) is not None:
            await gate.wait()
        return result

    async def commit(self, job: str, step: int, world_size: int, digests: Mapping[int, str],
                     records: Sequence[RankRecord] | None = None, check: Sequence[int] | None = None) -> None:
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        await super().commit(job, step, world_size, digests, records, check)


class Harness:
    def __init__(self, root: Path, step_timeout: float = 5.0) -> None:
        self.root = root
        self.pool = ThreadPoolExecutor(4)
        self.tier = GatedTier(str(root), WriteSettings(codec="zstd", level=1, chunk_bytes=64 * 1024), 2, self.pool)
        self.now = 1000.0
        self.moves: list[tuple[str, int, Any, Any]] = []     # (kind, step, from, to)
        self.shard_step: dict[int, int] = {}                 # id(shard) -> its step
        self.commits: list[tuple[int, bool]] = []            # (step, its index's directory fsynced) per commit
        self.coord: StepCoordinator[Rank] = StepCoordinator(
            self.tier, lambda r, msg: r.hear(msg), step_timeout=step_timeout, clock=lambda: self.now,
            on_committed=lambda job, step, latency, synced: self.commits.append((step, synced)),
            withdraw_commits=self.tier.withdraw_commits, commit_overtime=0.3)

    async def save(self, who: Rank, step: int, world: int = 1, mode: CommitMode = LOCAL) -> None:
        data = memoryview(hashlib.shake_128(f"{step}/{who.rank}".encode()).digest(N * 4))
        layout = [TensorLayout("w", "float32", (N,), 0, N * 4)]
        await self.coord.save(who, JOB, step, who.rank, world, mode, data, layout, {"T": "w"}, released=who.release)

    def hold(self, step: int, rank: int, after: bool = False) -> asyncio.Event:
        gate = asyncio.Event()
        (self.tier.after if after else self.tier.before)[(step, rank)] = gate
        return gate

    def path(self, step: int) -> Path:
        return Path(step_dir(str(self.root), JOB, step))

    def step_moves(self, step: int) -> list[Any]:
        return [to for kind, s, _, to in self.moves if kind == "step" and s == step]

    def shard_moves(self, step: int, rank: int) -> list[Any]:
        return [to for kind, s, r, to in self.moves if kind == f"shard{rank}" and s == step]

    def files(self, step: int) -> list[str]:
        return sorted(os.listdir(self.path(step))) if self.path(step).exists() else []


async def until(pred: Callable[[], object], what: str = "condition", timeout: float = 120.0) -> None:
    """Liveness, not speed: a real write and fsync can stall for seconds on a busy CI machine."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


@pytest.fixture
async def h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    """A harness whose steps and shards record every move they make (in ``moves``)."""
    harness = Harness(tmp_path / "root")
    step_move, shard_move, begin = Step.move, Shard.move, harness.coord.table.begin

    def record_step(self: Step[Any], to: StepState) -> None:
        frm = self.state
        step_move(self, to)
        harness.moves.append(("step", self.step, frm, to))

    def record_shard(self: Shard[Any], to: ShardState) -> None:
        frm = self.state
        shard_move(self, to)
        harness.moves.append((f"shard{self.rank}", harness.shard_step[id(self)], frm, to))

    def record_begin(*args: Any) -> tuple[Step[Rank], Shard[Rank]]:
        st, sh = begin(*args)
        harness.shard_step[id(sh)] = st.step
        return st, sh

    monkeypatch.setattr(Step, "move", record_step)
    monkeypatch.setattr(Shard, "move", record_shard)
    monkeypatch.setattr(harness.coord.table, "begin", record_begin)
    yield harness
    for gate in [*harness.tier.before.values(), *harness.tier.after.values()]:
        gate.set()
    if harness.tier.slow_publish is not None:
        harness.tier.slow_publish.go.set()
    if harness.tier.commit_gate is not None:
        harness.tier.commit_gate.set()
    await harness.coord.commits.cancel_all()
    await harness.coord.removals.cancel_all()
    await harness.coord.writes.cancel_all()
    harness.tier.close()
    harness.pool.shutdown(wait=True)


# ---- the tables themselves ---------------------------------------------------------------------

@pytest.mark.parametrize(("frm", "to"), list(product(StepState, StepState)))
def test_step_moves_only_along_its_table(frm: StepState, to: StepState) -> None:
    st: Step[Any] = Step(JOB, 1, 1, LOCAL, 0.0, state=frm)
    if to in STEP_TRANSITIONS[frm]:
        st.move(to)
        assert st.state is to
    else:
        with pytest.raises(IllegalTransition, match=f"{frm.value} -> {to.value}"):
            st.move(to)
        assert st.state is frm


@pytest.mark.parametrize(("frm", "to"), list(product(ShardState, ShardState)))
def test_shard_moves_only_along_its_table(frm: ShardState, to: ShardState) -> None:
    sh: Shard[Any] = Shard(0, 0, 0.0, None, state=frm)
    if to in SHARD_TRANSITIONS[frm]:
        sh.move(to)
        assert sh.state is to
    else:
        with pytest.raises(IllegalTransition):
            sh.move(to)


def test_terminal_states_have_no_way_out() -> None:
    for state in (OK, F, H):
        assert not STEP_TRANSITIONS[state]
    for shard_state in (SF, SX):
        assert not SHARD_TRANSITIONS[shard_state]
    assert set(STEP_TRANSITIONS) == set(StepState) and set(SHARD_TRANSITIONS) == set(ShardState)


# ---- commits ---------------------------------------------------------------------------------

async def test_local_step_commits(h: Harness) -> None:
    r0, r1 = Rank(0), Rank(1)
    gate = h.hold(1, 1)
    await h.save(r0, 1, world=2)
    await h.save(r1, 1, world=2)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    [view] = h.coord.step_views()
    assert (view.state, view.writing, view.durable) == ("writing", (1,), (0,))
    assert h.step_moves(1) == [] and not (h.path(1) / INDEX_NAME).exists()
    gate.set()
    await until(lambda: "committed" in r1.ops(), "the commit")
    assert h.step_moves(1) == [D, C, OK]
    assert h.shard_moves(1, 0) == h.shard_moves(1, 1) == [SD]
    assert r0.ops() == ["durable", "committed"] and r1.ops() == ["durable", "committed"]
    assert r0.events[0]["rank"] == 0 and r0.events[0]["raw_bytes"] == N * 4 and r0.events[0]["digest"]
    assert r0.released == r1.released == 1
    assert verify_step(str(h.path(1))) == []
    assert h.coord.get(JOB, 1) is None and h.coord.step_views() == ()
    await until(lambda: not h.coord.shard_views(), "the write tasks to end")
    c = h.coord.counters()
    assert (c.saves_started, c.saves_durable, c.saves_failed, c.steps_committed, c.steps_failed) == (2, 2, 0, 1, 0)
    assert c.bytes_raw == 2 * N * 4 and 0 < c.bytes_stored
    assert h.coord.last_committed[JOB].step == 1


async def test_relay_leader_commits_on_commit_request(h: Harness) -> None:
    r0, r1 = Rank(0), Rank(1)
    gate = h.hold(1, 0)
    await h.save(r0, 1, world=2, mode=RELAY)
    await h.save(r1, 1, world=2, mode=RELAY)
    await until(lambda: r1.ops() == ["durable"], "rank 1 durable")
    with pytest.raises(RequestError, match="rank 0 is not durable yet"):
        h.coord.leader_step(JOB, 1, 0)
    gate.set()
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    assert h.step_moves(1) == []                  # relay: the daemon waits for rank 0's COMMIT
    with pytest.raises(RequestError, match="no relayed step 1 awaiting commit from rank 0"):
        h.coord.leader_step(JOB, 1, 1)
    with pytest.raises(RequestError, match="no relayed step 2"):
        h.coord.leader_step(JOB, 2, 0)
    st = h.coord.leader_step(JOB, 1, 0)
    await h.coord.commit(st, {0: r0.events[0]["digest"], 1: r1.events[0]["digest"]})
    assert h.step_moves(1) == [D, C, OK]
    assert r0.ops() == ["durable", "committed"]
    assert r1.ops() == ["durable"]                # rank 1's client hears of the commit through the store
    assert verify_step(str(h.path(1))) == []
    with pytest.raises(RequestError, match="no relayed step 1"):
        h.coord.leader_step(JOB, 1, 0)


async def test_relay_step_without_its_leader_is_handed_off(h: Harness) -> None:
    r1, r2 = Rank(1), Rank(2)
    await h.save(r1, 1, world=3, mode=RELAY)
    await h.save(r2, 1, world=3, mode=RELAY)
    await until(lambda: r1.ops() == ["durable"] and r2.ops() == ["durable"], "both durable")
    await until(lambda: h.coord.get(JOB, 1) is None, "the step to leave the table")
    assert h.step_moves(1) == [H]
    assert h.files(1) == sorted([rank_data_name(1), rank_manifest_name(1), rank_data_name(2),
                                 rank_manifest_name(2)])    # rank 0's daemon commits them
    c = h.coord.counters()
    assert (c.steps_committed, c.steps_failed, c.saves_durable) == (0, 0, 2)


# ---- failures --------------------------------------------------------------------------------

async def test_shard_write_error_fails_the_step(h: Harness) -> None:
    """Rank 1's data file cannot be created (a directory is in its way): the step fails, rank 0's
    durable files are removed before anyone is told, both ranks hear why."""
    r0, r1 = Rank(0), Rank(1)
    gate = h.hold(1, 1)
    await h.save(r0, 1, world=2)
    await h.save(r1, 1, world=2)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    (h.path(1) / rank_data_name(1)).mkdir()
    gate.set()
    await until(lambda: "failed" in r0.ops(), "the failure")
    assert h.step_moves(1) == [F]
    assert h.shard_moves(1, 1) == [SF] and h.shard_moves(1, 0) == [SD, SX]
    for r in (r0, r1):
        assert r.last()["op"] == "failed" and "rank 1 shard write failed: EISDIR" in r.last()["reason"]
        assert r.released == 1
    assert h.files(1) == [rank_data_name(1)]     # ours; rank 0's files are gone
    c = h.coord.counters()
    assert (c.saves_failed, c.steps_failed, c.steps_committed) == (1, 1, 0)
    # The failed rank may save again at once (its write is over); the re-save commits.
    (h.path(1) / rank_data_name(1)).rmdir()
    await h.save(r0, 1, world=2)
    await h.save(r1, 1, world=2)
    await until(lambda: r1.ops()[-1] == "committed", "the re-save to commit")
    assert h.step_moves(1) == [F, D, C, OK] and verify_step(str(h.path(1))) == []


async def test_waiter_lost_while_writing_fails_the_step_and_the_write_stops(h: Harness) -> None:
    r0 = Rank(0)
    gate = h.hold(1, 0)
    await h.save(r0, 1)
    await h.coord.waiter_lost(r0)
    assert h.step_moves(1) == [F] and r0.last()["reason"] == "rank 0 disconnected before step 1 committed"
    assert [v.rank for v in h.coord.shard_views()] == [0]       # still running: a re-save must wait
    resave = asyncio.ensure_future(h.save(Rank(0), 1))
    await asyncio.sleep(0.3)
    assert not resave.done()                     # waiting for it (test_resave_of_a_failed_step_waits_...)
    resave.cancel()
    await asyncio.gather(resave, return_exceptions=True)
    gate.set()                                   # the writer now starts, sees its step gone and stops
    await until(lambda: h.shard_moves(1, 0) == [SX], "the write to stop")
    await until(lambda: not h.coord.shard_views(), "the write to be over")
    assert not h.path(1).exists() and r0.released == 1
    assert h.coord.counters().saves_failed == 1


async def test_waiter_lost_after_durable_keeps_a_local_step(h: Harness) -> None:
    """Rank 0's client leaves once durable while rank 1's save is in the step: its shard is safe on
    disk and the step goes on to commit."""
    r0, r1 = Rank(0), Rank(1)
    await h.save(r0, 1, world=2)
    await h.save(r1, 1, world=2)
    await until(lambda: "durable" in r0.ops(), "rank 0 durable")
    await h.coord.waiter_lost(r0)                # (rank 1 may be durable, the step committed, already)
    await until(lambda: r1.ops() == ["durable", "committed"], "the commit")
    assert r0.ops()[0] == "durable" and h.step_moves(1) == [D, C, OK]


async def test_a_save_after_a_durable_ranks_client_left_starts_the_local_step_afresh(h: Harness) -> None:
    """Rank 0's client leaves once durable (killed) before rank 1 saved: a SAVE of the step arriving
    now is another run's as far as the daemon can tell, so the step fails (its files go) instead of
    committing the ended process's shard beside the new one's; the new save starts it afresh."""
    r0, r1 = Rank(0), Rank(1)
    await h.save(r0, 1, world=2)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    await h.coord.waiter_lost(r0)
    assert h.step_moves(1) == []
    await h.save(r1, 1, world=2)
    assert h.step_moves(1) == [F] and h.shard_moves(1, 0)[-1] == SX
    await until(lambda: r1.ops() == ["durable"], "rank 1 durable in the fresh step")
    assert h.step_moves(1) == [F] and not (h.path(1) / "index.json").exists()
    r0b = Rank(0)
    await h.save(r0b, 1, world=2)                # the new run's rank 0: the fresh step commits
    await until(lambda: r0b.ops() == ["durable", "committed"], "the commit")
    assert r1.ops() == ["durable", "committed"] and h.step_moves(1) == [F, D, C, OK]


async def test_relay_leader_lost_after_durable_fails_the_step(h: Harness) -> None:
    r0, r1 = Rank(0), Rank(1)
    await h.save(r0, 1, world=2, mode=RELAY)
    await h.save(r1, 1, world=2, mode=RELAY)
    await until(lambda: r0.ops() == r1.ops() == ["durable"], "both durable")
    await h.coord.waiter_lost(r1)                # a follower's client may go: rank 0 gathers the rest
    assert h.step_moves(1) == []
    await h.coord.waiter_lost(r0)                # the leader may not: nobody would send COMMIT
    assert h.step_moves(1) == [F] and h.shard_moves(1, 0) == h.shard_moves(1, 1) == [SD, SX]
    assert r0.last()["reason"] == "rank 0 disconnected before step 1 committed"
    assert r1.ops() == ["durable"]               # told through the store, not by this daemon
    assert not h.path(1).exists()


async def test_step_timeout_fails_a_step_missing_ranks(h: Harness) -> None:
    r0 = Rank(0)
    await h.save(r0, 1, world=3)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    h.now += 5.0
    await h.coord.expire()
    assert h.step_moves(1) == []                 # not past the timeout yet
    h.now += 0.5
    await h.coord.expire()
    assert h.step_moves(1) == [F] and h.shard_moves(1, 0) == [SD, SX]
    assert r0.last()["reason"] == "timed out after 5s waiting for ranks 1-2 to be durable (the daemon's step_timeout)"
    assert not h.path(1).exists()


async def test_a_committing_step_is_never_timed_out_or_aborted(h: Harness) -> None:
    r0 = Rank(0)
    h.tier.commit_gate = asyncio.Event()
    await h.save(r0, 1)
    await until(lambda: h.step_moves(1) == [D, C], "the commit to start")
    h.now += 60
    await h.coord.expire()
    await h.coord.abort(JOB, 1, 0, "too late")
    assert h.step_moves(1) == [D, C]
    h.tier.commit_gate.set()
    await until(lambda: r0.ops() == ["durable", "committed"], "the commit")
    assert h.step_moves(1) == [D, C, OK]


async def test_abort_request_fails_the_step(h: Harness) -> None:
    r0 = Rank(0)
    await h.save(r0, 1, world=2, mode=RELAY)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    await h.coord.abort(JOB, 1, 0, "rank 1: " + "x" * 2000)
    assert h.step_moves(1) == [F] and h.shard_moves(1, 0) == [SD, SX]
    reason = r0.last()["reason"]
    assert reason.startswith("aborted by rank 0: rank 1: xxx") and len(reason) == len("aborted by rank 0: ") + 500
    await h.coord.abort(JOB, 1, 0, "again")      # nothing left to abort: no-op
    await h.coord.abort(JOB, 99, 0, "never")
    assert h.coord.counters().steps_failed == 1 and not h.path(1).exists()


async def test_commit_failure_fails_a_local_step(h: Harness) -> None:
    """Rank 0's manifest changes after it was reported durable: the index is never written."""
    r0, r1 = Rank(0), Rank(1)
    gate = h.hold(1, 1)
    await h.save(r0, 1, world=2)
    await h.save(r1, 1, world=2)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    with open(h.path(1) / rank_manifest_name(0), "ab") as f:
        f.write(b" ")
    gate.set()
    await until(lambda: "failed" in r1.ops(), "the failure")
    assert h.step_moves(1) == [D, C, F] and h.shard_moves(1, 1) == [SD, SX]
    assert "commit of step 1 failed: rank 0 manifest" in r0.last()["reason"]
    assert "does not match the digest" in r1.last()["reason"]
    assert not h.path(1).exists() and h.coord.counters().steps_committed == 0


async def test_commit_failure_fails_a_relayed_step_and_refuses_the_commit(h: Harness) -> None:
    r0 = Rank(0)
    await h.save(r0, 1, world=2, mode=RELAY)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    st = h.coord.leader_step(JOB, 1, 0)
    with pytest.raises(RequestError, match="commit of step 1 failed: .*no durable shard from ranks \\[1\\]"):
        await h.coord.commit(st, {0: r0.events[0]["digest"]})
    assert h.step_moves(1) == [D, C, F] and r0.last()["op"] == "failed"
    with pytest.raises(RequestError, match="already committing"):
        await h.coord.commit(st, {})             # the step is over: no second commit


async def test_shard_durable_after_its_step_failed_is_removed(h: Harness) -> None:
    r0 = Rank(0)
    gate = h.hold(1, 0, after=True)              # written and fsynced, not reported yet
    await h.save(r0, 1, world=2)
    await until(lambda: (h.path(1) / rank_manifest_name(0)).exists(), "rank 0's manifest")
    await h.coord.abort(JOB, 1, 0, "give up")
    assert h.step_moves(1) == [F] and r0.ops() == ["failed"]
    gate.set()
    await until(lambda: h.shard_moves(1, 0) == [SD, SX], "the late shard to be discarded")
    await until(lambda: not h.path(1).exists(), "its files to go")
    assert r0.ops() == ["failed"]                # no durable event for a failed step
    assert h.coord.counters().saves_durable == 1


# ---- re-saves and refusals ----------------------------------------------------------------------

async def test_resave_of_a_failed_step_waits_for_the_abandoned_write(h: Harness) -> None:
    """A save of a shard whose ended attempt is still writing waits for that write to stop (it was
    refused, "still being written by an earlier, abandoned save", however soon the write would stop),
    removal_wait at most; then it starts and commits."""
    old, new = Rank(0), Rank(0)
    gate = h.hold(1, 0)
    await h.save(old, 1)
    await h.coord.abort(JOB, 1, 0, "trainer restarted")
    resave = asyncio.ensure_future(h.save(new, 1))
    await asyncio.sleep(0.3)
    assert not resave.done()                        # waiting for the abandoned write, not refused
    gate.set()
    await resave
    await until(lambda: new.ops() == ["durable", "committed"], "the re-save to commit")
    assert h.step_moves(1) == [F, D, C, OK] and h.shard_moves(1, 0) == [SX, SD]
    assert old.ops() == ["failed"] and verify_step(str(h.path(1))) == []


async def test_saves_that_conflict_are_refused(h: Harness) -> None:
    r0 = Rank(0)
    h.hold(1, 0)
    await h.save(r0, 1, world=2)
    with pytest.raises(RequestError, match="rank 0 of step 1 is still being written"):
        await h.save(Rank(0), 1, world=2)
    h.coord.table.writing.clear()                # (as if that write were over) the step still has rank 0
    with pytest.raises(RequestError, match="rank 0 already has a save of step 1 in flight"):
        await h.save(Rank(0), 1, world=2)
    with pytest.raises(RequestError, match=r"in flight with world size 2 \(local commit\); this save says 3 "
                                           r"\(local\)"):
        await h.save(Rank(1), 1, world=3)
    with pytest.raises(RequestError, match=r"this save says 2 \(relay\)"):
        await h.save(Rank(1), 1, world=2, mode=RELAY)
    await h.save(Rank(0), 2)
    await until(lambda: h.step_moves(2) == [D, C, OK], "step 2 to commit")
    with pytest.raises(RequestError, match="step 2 of job 'unit' is already committed"):
        await h.save(Rank(0), 2)
    with pytest.raises(ValueError):
        await h.save(Rank(0), -1)                # not a step number (refused before anything starts)
    assert h.coord.counters().saves_started == 2


# ---- shutdown ------------------------------------------------------------------------------------

async def test_drain_fails_steps_still_waiting_for_ranks(h: Harness) -> None:
    r0 = Rank(0)
    await h.save(r0, 1, world=2)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    assert await h.coord.drain(grace=5.0) == []
    assert h.step_moves(1) == [F]
    assert r0.last()["reason"] == "daemon shut down before every rank was durable (see drain_grace)"
    assert not h.path(1).exists()


async def test_drain_lets_writes_in_flight_commit(h: Harness) -> None:
    r0 = Rank(0)
    gate = h.hold(1, 0)
    await h.save(r0, 1)
    asyncio.get_running_loop().call_later(0.2, gate.set)
    assert await h.coord.drain(grace=20.0) == []
    assert h.step_moves(1) == [D, C, OK] and r0.ops() == ["durable", "committed"]


async def test_drain_reports_writes_that_outlive_the_grace(h: Harness) -> None:
    r0 = Rank(0)
    h.hold(2, 0)
    await h.save(r0, 2)
    assert await h.coord.drain(grace=0.2) == ["job=unit step=2 rank=0"]
    assert h.step_moves(2) == [F] and r0.last()["op"] == "failed"


async def test_drain_gives_a_relay_leader_the_grace_to_commit(h: Harness) -> None:
    r0 = Rank(0)
    await h.save(r0, 1, world=1, mode=RELAY)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")

    async def commit_soon() -> None:
        await asyncio.sleep(0.2)
        await h.coord.commit(h.coord.leader_step(JOB, 1, 0), {0: r0.events[0]["digest"]})
    task = asyncio.ensure_future(commit_soon())
    assert await h.coord.drain(grace=20.0) == []
    await task
    assert h.step_moves(1) == [D, C, OK] and r0.ops() == ["durable", "committed"]


# ---- truthful outcomes: cleanups, commits and drains (the "crashes" issue) -------------------------

async def test_resave_during_the_cleanup_of_a_failed_step_waits_for_it(h: Harness) -> None:
    """A step fails while its durable rank 0's files are being removed; a new session re-saves the
    step in that window (it never heard of the failure). The removal runs under the coordinator's
    ownership: the re-save waits for it, then commits complete. Before, the step had left the table
    and the re-save was admitted at once: the cleanup then removed the NEW rank-0 files, so the
    re-save's commit failed (or, later, committed a step without its data file)."""
    old, new = Rank(0), Rank(0)
    await h.save(old, 1, world=2)
    await until(lambda: old.ops() == ["durable"], "rank 0 durable")
    h.tier.abort_gate = asyncio.Event()
    failing = asyncio.ensure_future(h.coord.abort(JOB, 1, 0, "rank 1 gave up"))
    await until(lambda: h.tier.aborts_held == 1, "the failed attempt's cleanup to start")
    after = h.hold(1, 0, after=True)
    resave = asyncio.ensure_future(h.save(new, 1))
    for _ in range(50):
        await asyncio.sleep(0)
    admitted_during_cleanup = resave.done()
    if admitted_during_cleanup:        # let the wrongly admitted write reach the disk before the cleanup
        await until(lambda: h.tier.written.count((1, 0)) == 2, "the re-save's write")
    h.tier.abort_gate.set()
    await failing
    await resave
    assert old.ops() == ["durable", "failed"]
    after.set()
    await until(lambda: new.ops()[-1:] in (["committed"], ["failed"]), "the re-save's outcome")
    assert new.ops() == ["durable", "committed"], new.events
    assert not admitted_during_cleanup, "the re-save started while the failed attempt's files were removed"
    assert verify_step(str(h.path(1))) == []
    assert h.step_moves(1) == [F, D, C, OK]


async def test_resave_waits_only_so_long_for_a_cleanup(h: Harness) -> None:
    h.coord.removing.wait = 0.2
    r0 = Rank(0)
    await h.save(r0, 1, world=2)
    await until(lambda: r0.ops() == ["durable"], "rank 0 durable")
    h.tier.abort_gate = asyncio.Event()
    failing = asyncio.ensure_future(h.coord.abort(JOB, 1, 0, "rank 1 gave up"))
    await until(lambda: h.tier.aborts_held == 1, "the cleanup to start")
    with pytest.raises(RequestError, match="files of its failed attempt are still being removed; retry"):
        await h.save(Rank(0), 1)
    await h.save(Rank(0), 2)                 # other steps are not held up
    h.tier.abort_gate.set()
    await failing
    assert not h.path(1).exists()


async def test_shard_durable_after_its_step_failed_is_logged_as_discarded(h: Harness,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Its files are removed, and the log says so: not "durable" (it was never reported durable)."""
    caplog.set_level(logging.INFO, logger="ckptd")
    r0 = Rank(0)
    gate = h.hold(1, 0, after=True)
    await h.save(r0, 1, world=2)
    await until(lambda: (h.path(1) / rank_manifest_name(0)).exists(), "rank 0's manifest")
    await h.coord.abort(JOB, 1, 0, "give up")
    gate.set()
    await until(lambda: h.shard_moves(1, 0) == [SD, SX], "the late shard to be discarded")
    await until(lambda: not h.path(1).exists(), "its files to go")
    said = [r.getMessage() for r in caplog.records if getattr(r, "ctx", {}).get("step") == 1]
    assert "durable" not in said, said
    assert "shard discarded" in said, said
    [line] = [r for r in caplog.records if r.getMessage() == "shard discarded"]
    assert "step 1 ended (failed) while it was written" in line.ctx["reason"]     # type: ignore[attr-defined]


async def test_drain_withdraws_a_commit_that_outlives_it_and_reports_failed(h: Harness) -> None:
    """SIGTERM while index.json is being written: the drain's grace (and the commit's overtime) run
    out with the commit's thread before its rename. The drain withdraws it — its index can no longer
    appear — and only then tells the client "failed". Before, the drain cancelled the task, told
    nobody, and the thread went on to publish index.json after the client was told it was lost."""
    r0 = Rank(0)
    h.tier.slow_publish = slow = SlowPublish("before")
    await h.save(r0, 1)
    await until(slow.reached.is_set, "the commit to reach its rename")
    unfinished = await h.coord.drain(grace=0.1)
    assert r0.ops() == ["durable", "failed"] and "withdrawn" in r0.last()["reason"]
    assert unfinished == ["commit of job=unit step=1 (withdrawn; its thread still runs)"]
    assert h.step_moves(1) == [D, C, F]
    slow.go.set()                              # the thread goes on: it must not publish
    await until(lambda: not h.coord.commits.running(), "the commit's task to end")
    assert h.files(1) == []                    # no index.json, no rank file (its temp file is gone too)
    assert r0.ops() == ["durable", "failed"]


async def test_drain_waits_for_an_index_rename_in_progress_and_reports_committed(h: Harness) -> None:
    """The grace runs out while index.json is being renamed into place: the drain waits for the
    rename to finish and reports what is true, committed."""
    r0 = Rank(0)
    h.tier.slow_publish = slow = SlowPublish("inside")
    await h.save(r0, 1)
    await until(slow.reached.is_set, "the rename")
    asyncio.get_running_loop().call_later(0.6, slow.go.set)
    told = asyncio.get_running_loop().create_future()

    def on_event(msg: dict[str, Any]) -> None:
        if msg["op"] == "committed" and not told.done():
            told.set_result(slow.synced.is_set())
    r0.on_event = on_event
    unfinished = await h.coord.drain(grace=0.1)
    assert r0.ops() == ["durable", "committed"]
    assert told.done() and told.result() is True       # told committed only once the directory is fsynced
    assert all("(published; its thread still runs)" in u for u in unfinished), unfinished
    assert h.step_moves(1) == [D, C, OK] and verify_step(str(h.path(1))) == []


async def test_commit_runs_to_its_end_when_the_relay_leader_goes_mid_commit(h: Harness) -> None:
    """Rank 0's COMMIT request is cancelled (its connection task, at daemon stop) and its client is
    lost while the index is written: the commit neither stops nor fails. Before, the cancel left
    the step COMMITTING forever, and losing rank 0 failed it and removed its files mid-commit."""
    r0, r1 = Rank(0), Rank(1)
    await h.save(r0, 1, world=2, mode=RELAY)
    await h.save(r1, 1, world=2, mode=RELAY)
    await until(lambda: r0.ops() == r1.ops() == ["durable"], "both durable")
    h.tier.commit_gate = asyncio.Event()
    digests = {0: r0.events[0]["digest"], 1: r1.events[0]["digest"]}
    request = asyncio.ensure_future(h.coord.commit(h.coord.leader_step(JOB, 1, 0), digests))
    await until(lambda: h.step_moves(1) == [D, C], "the commit to start")
    request.cancel()
    await h.coord.waiter_lost(r0)
    await h.coord.abort(JOB, 1, 0, "too late")
    assert h.step_moves(1) == [D, C]
    h.tier.commit_gate.set()
    await until(lambda: h.step_moves(1) == [D, C, OK], "the commit to end")
    assert verify_step(str(h.path(1))) == []
    assert request.cancelled()


async def test_drain_never_reports_failed_for_an_index_that_lands_later(h: Harness,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit's thread is slow to start writing the index (a slow disk) when the drain runs out:
    whatever the drain tells rank 0 must still hold once that thread has ended."""
    import ckptd.daemon.tiers.fs.tier as fs_tier
    started, go = threading.Event(), threading.Event()
    real = fs_tier.write_index

    def slow_write_index(*args: Any) -> Any:
        started.set()
        assert go.wait(60)
        return real(*args)
    monkeypatch.setattr(fs_tier, "write_index", slow_write_index)
    r0 = Rank(0)
    await h.save(r0, 1)
    await until(started.is_set, "the commit's thread")
    await h.coord.drain(grace=0.1)
    told = r0.ops()
    go.set()
    await until(lambda: not h.coord.commits.running() and not h.coord.writes.running(), "the commit to end")
    await asyncio.sleep(0.2)
    assert told in (["durable", "failed"], ["durable", "committed"]), f"drain returned without telling: {told}"
    assert (h.path(1) / INDEX_NAME).exists() == (told[-1] == "committed")
    assert r0.ops() == told


async def test_an_index_in_place_is_committed_whatever_fails_after_its_rename(h: Harness,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory's fsync fails after index.json was renamed into place: readers load the step,
    so the daemon says committed (before, it said failed for a loadable step)."""
    import errno

    import ckptd.daemon.tiers.fs.commit as commit
    real = commit.storage.fsync_dir

    def fsync_dir(path: str) -> None:
        if os.path.exists(os.path.join(path, INDEX_NAME)):
            raise OSError(errno.EIO, "Input/output error", path)
        real(path)
    monkeypatch.setattr(commit.storage, "fsync_dir", fsync_dir)
    r0 = Rank(0)
    await h.save(r0, 1)
    await until(lambda: len(r0.ops()) == 2, "the outcome")
    assert r0.ops() == ["durable", "committed"] and h.step_moves(1) == [D, C, OK]
    assert verify_step(str(h.path(1))) == []
    c = h.coord.counters()          # said, not silent: counted (a metric) as well as logged
    assert (c.steps_committed, c.steps_committed_unsynced) == (1, 1)
    # ... and the daemon hears it unsynced: it runs no retention after it (server._committed), which
    # could delete the steps a restore falls back to if this index does not survive a power loss.
    monkeypatch.setattr(commit.storage, "fsync_dir", real)
    await h.save(r0, 2)
    await until(lambda: len(r0.ops()) == 4, "the second outcome")
    assert h.commits == [(1, False), (2, True)]


def test_rank_spans_names_runs_and_cuts_long_lists() -> None:
    """A timed-out step at thousands of ranks names them as runs, not one by one."""
    from ckptd.core.names import rank_spans
    assert rank_spans([2, 1]) == "1-2"
    assert rank_spans(range(512, 4096)) == "512-4095"
    assert rank_spans([0, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 24]) == "0, 3-5, 7, 9, 11, 13, 15, 17 and 4 more"
    assert rank_spans([]) == ""
