"""The daemon's memory tier store: shards held in memfds, a byte budget, eviction, pins.

Each held shard is one memfd with the rank's raw slot bytes (``ckptd.core.held``), from this
daemon's own writes (``local``) or a peer's replica (``replica``). Rules:

- Every byte counts against ``budget`` from the moment it is reserved (before the copy).
- Per job the newest ``steps`` steps known committed are kept, plus any newer step still in
  flight; older ones go as soon as a newer step is known committed. A storage step known
  committed (on any daemon: ``trim``) supersedes the job's memory-level steps at or below it.
- Under the budget, the oldest shards go first (by arrival), never a pinned one (a restore is
  reading it); a shard that does not fit even after every evictable one would go is not held at
  all (the step is still written to storage as always). A memory-level shard is its committed
  step's only copy: the budget evicts one only for a newer memory-level step of its job, only one
  that step's commit would trim anyway (``steps``), and never one of the job's newest committed
  memory-level step, which must stay restorable whole until a newer one *commits* (the new one may
  still fail); else the new step fails (``NotHeld``, the store's ``short`` saying why). So with
  ``steps = 1`` a memory-level step is held beside the one before it until it commits: the budget
  must fit both.
- A pinned shard dropped (its step failed, or its checksum did) stays counted until unpinned:
  its memory is in use while the restore reads it.

Single-threaded: called on the daemon's event loop only (the copies run on threads, on
memfds that are reserved here and not yet visible).
"""
from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptd.core.held import HeldMeta
from ckptd.core.names import is_memory_job, memory_job
from ckptd.daemon import shm

log = logging.getLogger("ckptd")
LOCAL, REPLICA = "local", "replica"


def new_memfd(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """A memfd of ``nbytes`` (at least a page), allocated up front (huge pages where the node allows:
    ``ckptd.daemon.shm``), mapped read-write."""
    return shm.new_memfd(name, max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE))


@dataclass(eq=False)
class Held:
    """One shard in memory. ``meta`` is None while its bytes are being copied in. Its bytes are
    a memfd of the store's own, or the trainer's slot they were saved from (``give_back`` set:
    closing it hands the slot back instead of freeing it)."""
    job: str
    step: int
    rank: int
    nbytes: int
    origin: str
    fd: int = -1
    mm: mmap.mmap | None = None
    meta: HeldMeta | None = None
    committed: bool = False
    committed_at: float = 0.0     # when this store learned it committed (monotonic): trim's tie to runs
    pins: int = 0
    gone: bool = False            # evicted or dropped: closed once unpinned
    owed: bool = False            # dropped while pinned: its bytes leave the budget when unpinned
    arrived: float = field(default_factory=time.monotonic)
    give_back: Callable[[], None] | None = None     # a kept slot: back to its trainer on close

    @property
    def in_slot(self) -> bool:
        return self.give_back is not None

    @property
    def key(self) -> tuple[str, int, int]:
        return self.job, self.step, self.rank

    def close(self) -> None:
        if self.give_back is not None:
            give_back, self.give_back = self.give_back, None
            self.fd, self.mm = -1, None       # the slot's, not ours
            give_back()
            return
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass              # a view is still alive on a thread; the mapping goes with it
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class HeldView:
    job: str
    step: int
    rank: int
    nbytes: int
    origin: str
    committed: bool
    pins: int
    in_slot: bool                 # the trainer's slot it was saved from, not a copy


@dataclass
class MemoryTotals:
    held: int = 0                 # shards that became resident
    evicted: int = 0              # shards evicted by the budget
    skipped: int = 0              # shards not held: they did not fit the budget
    served: int = 0               # restores served from memory
    corrupt: int = 0              # held or received shards that failed their checksums


@dataclass(frozen=True)
class Shortfall:
    """Why the last reservation did not fit: bytes in use, the part of them that could have been
    evicted for it, and the part that is the job's newest committed memory-level step(s), kept until
    a newer one commits (``making`` a memory-level step)."""
    need: int
    used: int
    budget: int
    evictable: int
    kept: int = 0

    def text(self) -> str:
        what = "none evictable" if self.evictable == 0 else f"only {self.evictable} evictable"
        kept = f", {self.kept} of them the job's newest committed memory-level step, kept whole until a newer " \
            "one commits" if self.kept else ""
        return f"{self.used} of {self.budget} bytes in use, {what}{kept}"


class MemoryStore:
    """Held shards by (job, step, rank); see the module docstring."""

    def __init__(self, budget: int, steps: int) -> None:
        self.budget = budget
        self.steps = steps
        self.used = 0
        self.entries: dict[tuple[str, int, int], Held] = {}
        self.totals = MemoryTotals()
        self.short: Shortfall | None = None      # why the last reservation that did not fit did not

    @property
    def enabled(self) -> bool:
        return self.steps > 0 and self.budget > 0

    # ---- reserving and adding -----------------------------------------------------------

    def reserve(self, job: str, step: int, rank: int, nbytes: int, origin: str) -> Held | None:
        """Budget for a shard about to be copied in (evicting the oldest as needed); None: not held."""
        self.short = None
        if not self.enabled:
            return None
        old = self.entries.get((job, step, rank))
        if old is not None and old.pins == 0:
            self._remove(old)
        elif old is not None:
            return None           # a restore reads the old copy: keep it, hold no second one
        need = max(mmap.PAGESIZE, nbytes)
        if not self._make_room(need, {"job": job, "step": step, "rank": rank, "bytes": nbytes}, (job, step)):
            return None
        held = Held(job, step, rank, need, origin)
        self.entries[held.key] = held
        self.used += need
        return held

    def charge(self, nbytes: int, what: str, evict: bool = True) -> bool:
        """Budget ``nbytes`` for something other than a held shard (a parity buffer), evicting the
        oldest unpinned shards as ``reserve`` does (not with ``evict=False``: it fits in what is free,
        or not at all); False (nothing charged) when it cannot fit."""
        if not self.enabled:
            return False
        if not evict and self.used + nbytes > self.budget:
            log.warning("not charged: over the memory budget",
                        extra={"ctx": {"what": what, "bytes": nbytes, "budget": self.budget, "used": self.used}})
            return False
        if evict and not self._make_room(nbytes, {"what": what, "bytes": nbytes}):
            return False
        self.used += nbytes
        return True

    def _make_room(self, need: int, ctx: dict[str, object], making: tuple[str, int] | None = None) -> bool:
        """Evict the oldest unpinned shards (by arrival: step numbers of two jobs do not compare) until
        ``need`` bytes fit the budget; False (nothing evicted, counted as skipped) when even evicting all
        of them would not make room. Memory-level shards are a committed step's only copy: none goes
        for another job's shard or a parity buffer; for ``making`` (a memory-level step of the same job
        being held), only those its commit will trim anyway (older than the newest ``steps`` - 1 kept),
        and never the newest committed one: the new step has not committed, and may yet fail."""
        victims = sorted((h for h in self.entries.values() if h.pins == 0 and h.meta is not None
                          and not is_memory_job(h.job)), key=lambda h: h.arrived)
        kept_bytes = 0
        if making is not None and is_memory_job(making[0]):
            job, step = making
            mine = [h for h in self.entries.values() if h.job == job and h.meta is not None]
            kept = sorted({h.step for h in mine if h.committed}, reverse=True)[: max(1, self.steps - 1)]
            victims += sorted((h for h in mine if h.committed and h.step < step and h.step not in kept
                               and h.pins == 0), key=lambda h: (h.step, h.arrived))
            kept_bytes = sum(h.nbytes for h in mine if h.committed and h.step in kept)
        free = self.budget - self.used
        evictable = sum(h.nbytes for h in victims)
        if free + evictable < need:
            self.short = Shortfall(need, self.used, self.budget, evictable, kept_bytes)
            self.totals.skipped += 1
            log.warning("not held in memory: over the memory budget",
                        extra={"ctx": {**ctx, "budget": self.budget, "used": self.used}})
            return False
        for h in victims:
            if free >= need:
                break
            log.info("evicted from memory", extra={"ctx": {"job": h.job, "step": h.step, "rank": h.rank,
                                                           "bytes": h.nbytes, "reason": "memory budget"}})
            self.totals.evicted += 1
            free += h.nbytes
            self._remove(h)
        return True

    def uncharge(self, nbytes: int) -> None:
        """What ``charge`` budgeted is freed."""
        self.used -= nbytes

    def filled(self, held: Held, meta: HeldMeta) -> None:
        """Its bytes are in and checked: it may be served (once its step is committed and verified)."""
        if held.gone:
            held.close()
            return
        held.meta = meta
        self.totals.held += 1

    def cancel(self, held: Held) -> None:
        """A reservation whose copy failed or whose step ended (called by whoever copies into it: its
        memfd is closed here, not by ``_remove``, which leaves one being copied into alone)."""
        if self.entries.get(held.key) is held:
            self._remove(held)
        if held.pins == 0:
            held.close()

    # ---- lifecycle of steps -----------------------------------------------------------

    def committed(self, job: str, step: int) -> None:
        now = time.monotonic()
        for h in self.entries.values():
            if h.job == job and h.step == step:
                h.committed, h.committed_at = True, now

    def drop_step(self, job: str, step: int, ranks: object = None) -> None:
        """A failed step: its shards are of no use."""
        for h in [h for h in self.entries.values() if h.job == job and h.step == step
                  and (ranks is None or h.rank in ranks)]:       # type: ignore[operator]
            self._remove(h)

    def drop_before(self, job: str, step: int) -> None:
        """Every unpinned shard of ``job`` older than ``step``: superseded (a storage step at least as
        new as these memory-level steps committed)."""
        for h in [h for h in self.entries.values() if h.job == job and h.step < step and h.pins == 0]:
            self._remove(h)

    def trim(self, job: str, is_committed: Callable[[str, int], bool]) -> None:
        """Keep the newest ``steps`` committed steps of ``job`` and anything newer (see above). A
        storage step this call learns committed (from its index.json: another daemon committed it)
        drops the job's committed memory-level steps at or below it, as ``MemoryTier.commit`` does on
        the daemon that committed it; steps in flight stay (a resumed run's lower steps are saved while
        an earlier run's higher storage steps are held).

        A job resumed from an older step saves lower numbers than an earlier run's steps, and its first
        commit removes those (``remove_stale``) — on disk, not in other daemons' memory. So: a step held
        as committed whose index.json is gone is dropped first; the step whose commit this store learned
        last is kept whatever its number (else the earlier run's higher step, until its removal shows,
        would trim the new run's committed one away); and a step in flight below the newest committed is
        a leftover only if it was here before that one committed (else it is the new run's)."""
        mine = [h for h in self.entries.values() if h.job == job and h.meta is not None]
        for step in {h.step for h in mine if h.committed}:
            if not still_committed(is_committed, job, step):
                self.drop_committed(job, step)      # another run's, removed: it must not outrank newer ones
        mine = [h for h in mine if not h.gone]
        now, newly = time.monotonic(), set()
        for h in mine:
            if not h.committed and is_committed(job, h.step):
                h.committed, h.committed_at = True, now
                newly.add(h.step)
        known = {h.step: h.committed_at for h in mine if h.committed}
        if not known:
            return
        kept = sorted(known, reverse=True)[: self.steps]
        last = max(known.values())
        keep = {*kept, max(s for s, at in known.items() if at == last)}
        for h in mine:
            stale = h.step not in keep if h.committed else h.step < kept[0] and h.arrived <= known[kept[0]]
            if stale and h.pins == 0:
                self._remove(h)
        if newly and not is_memory_job(job):      # a storage step this store just learned committed
            self.drop_committed_before(memory_job(job), max(newly) + 1)

    def drop_committed_before(self, job: str, step: int) -> None:
        """The unpinned shards of ``job``'s committed steps older than ``step`` (a storage step at least as
        new committed: they are superseded); a step in flight stays (its save decides: a resumed run's)."""
        for h in [h for h in self.entries.values() if h.job == job and h.step < step and h.committed
                  and h.pins == 0]:
            self._remove(h)

    def drop_committed(self, job: str, step: int) -> None:
        """The shards of ``step`` held as committed (not a new save of the same number, in flight): the
        step is no longer committed (its index.json is gone: superseded and removed, or saved again)."""
        for h in [h for h in self.entries.values() if h.job == job and h.step == step and h.committed]:
            self._remove(h)

    # ---- serving ---------------------------------------------------------------------

    def get(self, job: str, step: int, rank: int) -> Held | None:
        h = self.entries.get((job, step, rank))
        return h if h is not None and h.meta is not None and not h.gone else None

    def pin(self, held: Held) -> None:
        held.pins += 1

    def unpin(self, held: Held) -> None:
        held.pins -= 1
        if held.pins == 0 and held.gone:
            if held.owed:
                held.owed = False
                self.used -= held.nbytes
            held.close()

    def give_back_oldest(self, fds: set[int]) -> bool:
        """Let go of the oldest unpinned shard kept in one of these slots (``fds``): its trainer
        needs a slot to save into. False when there is none to let go: a memory-level step's shard goes
        only once a newer one of its job committed (in flight or the newest committed, it is that step's
        only copy); the trainer then waits for that commit (or failure) to free a slot, or skips."""
        newest: dict[str, int] = {}      # each job's newest committed memory-level step: kept whole
        for h in self.entries.values():
            if h.committed and is_memory_job(h.job):
                newest[h.job] = max(h.step, newest.get(h.job, h.step))
        mine = [h for h in self.entries.values() if h.in_slot and h.fd in fds and h.pins == 0
                and not (is_memory_job(h.job) and (not h.committed or newest.get(h.job) == h.step))]
        if not mine:        # (a memory-level step in flight, or the newest committed: its only copy)
            return False
        h = min(mine, key=lambda h: (is_memory_job(h.job), h.arrived))     # a memory-level step's last
        log.info("memory tier let a step go", extra={"ctx": {"job": h.job, "step": h.step, "rank": h.rank,
                                                             "reason": "its trainer needs the slot"}})
        self.totals.evicted += 1
        self._remove(h)
        return True

    def corrupt(self, held: Held) -> None:
        self.totals.corrupt += 1
        self._remove(held)

    def _remove(self, held: Held) -> None:
        if self.entries.get(held.key) is held:
            del self.entries[held.key]
            if held.pins == 0:
                self.used -= held.nbytes
            else:                 # a restore still reads it: its memory is in use until unpinned
                held.owed = True
        held.gone = True
        if held.pins == 0 and held.meta is not None:
            held.close()          # (one still being copied into is closed by whoever copies: cancel/filled)

    def newest_own(self) -> dict[str, int]:
        """Each job's newest step of which this node holds its own (``local``) shards, filled and not
        dropped: the step the peers' probes send again when a copy of it is lost (replicate, parity)."""
        newest: dict[str, int] = {}
        for h in self.entries.values():
            if h.origin == "local" and h.meta is not None and not h.gone:
                newest[h.job] = max(h.step, newest.get(h.job, h.step))
        return newest

    def views(self) -> tuple[HeldView, ...]:
        return tuple(HeldView(h.job, h.step, h.rank, h.nbytes, h.origin, h.committed, h.pins, h.in_slot)
                     for h in sorted(list(self.entries.values()), key=lambda h: h.key) if h.meta is not None)

    def close(self) -> None:
        for h in list(self.entries.values()):
            h.pins = 0
            self._remove(h)
            h.close()


def still_committed(is_committed: Callable[[str, int], bool], job: str, step: int) -> bool:
    """Whether a step held as committed still is (its index.json in place). A disk that cannot be read
    now says nothing: it is kept."""
    try:
        return is_committed(job, step)
    except OSError:
        return True
