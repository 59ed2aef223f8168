"""The step state machine: records, transition tables, the commit rule, and the step table.

Pure state, no I/O and no event loop: :class:`~ckptd.daemon.steps.coordinator.StepCoordinator` drives
it. Each step and shard moves only along the tables below; anything else raises
:class:`IllegalTransition`.

Step (per job and step, as this daemon sees it)::

    WRITING ──▶ DURABLE ──▶ COMMITTING ──▶ COMMITTED
       │  │                     │
       │  └─────────────────────┴──────▶ FAILED
       └──▶ HANDED_OFF   (relay, rank 0 on another daemon: every shard here is durable)

Shard (per rank of a step)::

    WRITING ──▶ DURABLE ──▶ DISCARDED   (its step failed: its files removed)
       │  └──▶ FAILED                   (its write raised; the step fails with it)
       └─────▶ DISCARDED                (its step ended while it was written: it stopped)

A step that ends (COMMITTED, FAILED, HANDED_OFF) leaves the table at once, so a re-save of a
failed step starts afresh; writes of the old one still running stop at their next chunk and
stay in the table's ``writing`` until they have stopped (a second writer of the same files
is refused meanwhile), and a save of the step waits while the coordinator removes the ended
attempt's files (steps.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Generic, TypeVar

from ckptd.core.names import base_job, is_memory_job
from ckptd.core.protocol import CommitMode
from ckptd.core.rank_record import RankRecord
from ckptd.daemon.runtime import RequestError
from ckptd.daemon.service.snapshot import Counters, LastCommit, ShardView, StepView

W = TypeVar("W", bound=Hashable)     # whoever waits for a rank's outcome (a session)


class StepState(str, Enum):
    WRITING = "writing"          # accepted; shards being written, more ranks may join
    DURABLE = "durable"          # the commit rule says every rank is durable; commit starts at once
    COMMITTING = "committing"    # the tier is publishing the step
    COMMITTED = "committed"
    FAILED = "failed"
    HANDED_OFF = "handed_off"    # relay: this daemon's shards are durable; rank 0's daemon commits


class ShardState(str, Enum):
    WRITING = "writing"
    DURABLE = "durable"
    FAILED = "failed"
    DISCARDED = "discarded"


S, H = StepState, ShardState
STEP_TRANSITIONS: Mapping[StepState, frozenset[StepState]] = {
    S.WRITING: frozenset({S.DURABLE, S.FAILED, S.HANDED_OFF}),
    S.DURABLE: frozenset({S.COMMITTING}),        # at once: nothing can fail a step in between
    S.COMMITTING: frozenset({S.COMMITTED, S.FAILED}),
    S.COMMITTED: frozenset(), S.FAILED: frozenset(), S.HANDED_OFF: frozenset(),
}
SHARD_TRANSITIONS: Mapping[ShardState, frozenset[ShardState]] = {
    H.WRITING: frozenset({H.DURABLE, H.FAILED, H.DISCARDED}),
    H.DURABLE: frozenset({H.DISCARDED}),
    H.FAILED: frozenset(), H.DISCARDED: frozenset(),
}
OPEN = frozenset({S.WRITING, S.DURABLE, S.COMMITTING})


class IllegalTransition(RuntimeError):
    """A move the state machine does not have: a daemon bug, never a client's fault."""


@dataclass(eq=False)
class Shard(Generic[W]):
    rank: int
    raw_bytes: int
    started: float
    waiter: W | None                     # told of the step's outcome; None once it need not be
    state: ShardState = ShardState.WRITING
    owner: W | None = None               # the client that saved it (kept: ``waiter`` may be let go)
    digest: str | None = None
    record: RankRecord | None = None     # the durable shard's rank record (the tier's, if it gives one)

    def move(self, to: ShardState) -> None:
        if to not in SHARD_TRANSITIONS[self.state]:
            raise IllegalTransition(f"rank {self.rank} shard: {self.state.value} -> {to.value}")
        self.state = to


@dataclass(eq=False)
class Step(Generic[W]):
    job: str
    step: int
    world_size: int
    mode: CommitMode
    started: float
    state: StepState = StepState.WRITING
    shards: dict[int, Shard[W]] = field(default_factory=dict)
    committing_since: float = 0.0

    def move(self, to: StepState) -> None:
        if to not in STEP_TRANSITIONS[self.state]:
            raise IllegalTransition(f"step {self.step} of {self.job!r}: {self.state.value} -> {to.value}")
        self.state = to

    @property
    def open(self) -> bool:
        return self.state in OPEN

    def ranks(self, state: ShardState) -> list[int]:
        return sorted(r for r, s in list(self.shards.items()) if s.state is state)

    def digests(self) -> dict[int, str]:
        return {r: s.digest for r, s in self.shards.items() if s.state is ShardState.DURABLE and s.digest}

    def records(self) -> list[RankRecord] | None:
        """Every rank's record in rank order, when each durable shard here has one (local commit)."""
        recs = [s.record for _, s in sorted(self.shards.items())]
        return None if any(r is None for r in recs) else [r for r in recs if r is not None]

    def missing(self) -> list[int]:
        return sorted(set(range(self.world_size)) - set(self.ranks(ShardState.DURABLE)))


# ---- the commit rule: who decides that a step is complete (nowhere else) ------------------

def complete_here(st: Step[Any]) -> bool:
    """Local mode: this daemon counted every rank of the world durable."""
    return st.mode is CommitMode.LOCAL and len(st.ranks(ShardState.DURABLE)) == st.world_size


def accepts_commit(st: Step[Any]) -> bool:
    """Relay mode: rank 0's COMMIT (every rank's digest, gathered through the job's store) is
    taken once rank 0's own shard is durable here and the step is not committing yet."""
    leader = st.shards.get(0)
    return (st.mode is CommitMode.RELAY and st.state is StepState.WRITING
            and leader is not None and leader.state is ShardState.DURABLE)


def handed_off(st: Step[Any]) -> bool:
    """Relay mode, rank 0 elsewhere: nothing is left to do here once no shard is writing."""
    return st.mode is CommitMode.RELAY and 0 not in st.shards and not st.ranks(ShardState.WRITING)


def needs_waiter(st: Step[Any], rank: int) -> bool:
    """Whether the step fails when this rank's client leaves: its shard is not durable yet, or
    it is the relay leader whose COMMIT the step still waits for (once the step is committing,
    nobody's leaving changes its outcome)."""
    shard = st.shards[rank]
    return st.state is StepState.WRITING and (
        shard.state is ShardState.WRITING or (st.mode is CommitMode.RELAY and rank == 0))


def orphaned(st: Step[Any]) -> list[int]:
    """Local mode, writing: the ranks whose client left after their shard was durable (a process killed
    before the step committed; one that closes withdraws its open saves). A SAVE of the step arriving
    now comes from another run as far as the daemon can tell: joining would commit a dead process's
    shard beside the new one's, so the step is failed first (``Coordinator.save``)."""
    if st.mode is not CommitMode.LOCAL or st.state is not StepState.WRITING:
        return []
    return sorted(r for r, s in st.shards.items() if s.waiter is None)


def awaits_commit(st: Step[Any]) -> bool:
    """A step a drain should give its grace to: committing, or its leader here could send COMMIT."""
    leader = st.shards.get(0)
    return st.state in (StepState.DURABLE, StepState.COMMITTING) or (
        accepts_commit(st) and leader is not None and leader.waiter is not None)


# ---- the coordinator ---------------------------------------------------------------------------

# ---- the table -------------------------------------------------------------------------

class StepTable(Generic[W]):
    """Every open step, every shard write still running (also of ended steps), and the totals.

    Memory-level steps (job key ``<job>/_memory``) are counted apart (``memory_totals``: a held shard
    is "durable" with its raw bytes and none stored; ``memory_last_committed`` by base job), so the
    storage counters, the compression ratio and the per-job last commits are of storage steps only.

    Read from the metrics thread too (views): every walk starts from a copy of a container."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.steps: dict[tuple[str, int], Step[W]] = {}
        self.writing: dict[tuple[str, int, int], tuple[Step[W], Shard[W]]] = {}
        self.totals = Counters()
        self.last_committed: dict[str, LastCommit] = {}
        self.memory_totals = Counters()                          # memory-level steps (their own counters)
        self.memory_last_committed: dict[str, LastCommit] = {}   # ... by base job

    def totals_for(self, job: str) -> Counters:
        """The counters a step of job key ``job`` counts in: memory-level or storage."""
        return self.memory_totals if is_memory_job(job) else self.totals

    def begin(self, waiter: W, job: str, step: int, rank: int, world_size: int, mode: CommitMode,
              raw_bytes: int) -> tuple[Step[W], Shard[W]]:
        """A new shard write (RequestError when the save conflicts with one in flight)."""
        if (job, step, rank) in self.writing:
            # An earlier save of this rank (its step abandoned, e.g. the trainer died) is still
            # writing the same files; a second writer would interleave with it and its cleanup.
            raise RequestError(f"rank {rank} of step {step} is still being written by an earlier, "
                               f"abandoned save; retry once it has stopped")
        st = self.steps.get((job, step))
        if st is not None and (st.world_size != world_size or st.mode is not mode):
            raise RequestError(f"step {step} of job {job!r} is in flight with world size {st.world_size} "
                               f"({st.mode.value} commit); this save says {world_size} ({mode.value})")
        if st is not None and rank in st.shards:
            raise RequestError(f"rank {rank} already has a save of step {step} in flight")
        if st is None:
            st = self.steps[(job, step)] = Step(job, step, world_size, mode, self.clock())
        shard = st.shards[rank] = Shard(rank, raw_bytes, self.clock(), waiter, owner=waiter)
        self.writing[(job, step, rank)] = (st, shard)
        self.totals_for(job).saves_started += 1
        return st, shard

    def write_over(self, st: Step[W], shard: Shard[W]) -> None:
        """The shard's write no longer runs (durable, failed, or stopped and cleaned up)."""
        key = (st.job, st.step, shard.rank)
        entry = self.writing.get(key)
        if entry is not None and entry[1] is shard:
            del self.writing[key]

    def forget(self, st: Step[W]) -> None:
        """The step ended: it leaves the table (its writes still running stay in ``writing``)."""
        if self.steps.get((st.job, st.step)) is st:
            del self.steps[(st.job, st.step)]

    def committed(self, st: Step[W]) -> None:
        self.forget(st)
        self.totals_for(st.job).steps_committed += 1
        last = self.memory_last_committed if is_memory_job(st.job) else self.last_committed
        prev = last.get(base_job(st.job))
        if prev is None or st.step >= prev.step:
            last[base_job(st.job)] = LastCommit(st.step, time.time())

    def open_steps(self, job: str) -> list[int]:
        return [st.step for st in list(self.steps.values()) if st.job == job]

    def counters(self) -> Counters:
        return replace(self.totals)

    def memory_counters(self) -> Counters:
        return replace(self.memory_totals)

    def step_views(self) -> tuple[StepView, ...]:
        now = self.clock()
        return tuple(StepView(st.job, st.step, st.world_size, st.mode.value, st.state.value,
                              tuple(st.ranks(ShardState.WRITING)), tuple(st.ranks(ShardState.DURABLE)),
                              round(now - st.started, 3)) for st in list(self.steps.values()))

    def shard_views(self) -> tuple[ShardView, ...]:
        now = self.clock()
        return tuple(ShardView(st.job, st.step, sh.rank, st.world_size, sh.raw_bytes, round(now - sh.started, 3))
                     for st, sh in list(self.writing.values()))
