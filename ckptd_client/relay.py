"""Cross-daemon commit through the job's c10d store: a two-level fan-in, no polling.

Ranks are grouped into nodes of ``node_size`` consecutive ranks (torchrun's LOCAL_WORLD_SIZE:
one node, one daemon). Every key is the run's (store_keys.py: ``ckptd/<job>/<run>/s<step>/...``,
the run id agreed at start, run_scope.py) and names the step saved, not how many saves a rank
made: so a rank whose save was refused cannot shift its later saves onto other steps' keys (and
the Checkpointer refuses a second save of a step in one run). For each step saved:

1. each rank publishes its outcome (a ``RankOutcome``: durable, with its daemon's DURABLE
   report — digest and the rank record the tensor map needs — or failed, and why);
2. each node's first rank (the node leader) blocks until its members' outcomes are there (a
   store ``wait`` on a cloned store connection: no polling), publishes ONE ``NodeRecord`` (the
   members' outcomes, in order) and deletes the members' keys;
3. rank 0 blocks on the node records ``WAIT_NODES`` at a time, fetching (``multi_get``) and
   decoding each slice as soon as it is whole, while later nodes still save; then it asks its daemon
   to COMMIT with every rank's record (so the daemon builds the index without reading every
   manifest back) — or to ABORT, naming the failed ranks — then
   publishes its ``StepResult`` (committed, or failed and why) under the step's result key;
4. every other rank blocks on the result key. Every store call is bounded (store_guard.py).

Every value is encoded and decoded by ckptd/core/relay_record.py alone (their format: FORMAT.md,
"Commit protocol"); a malformed one fails the save, naming the rank or node that wrote it.

The store's server does O(1) work per rank and save, and rank 0 O(nodes). A step's node records are
deleted by rank 0 once it resolved it, the result by the last rank to read it (every rank counts
its read with ``add``).

Timeouts derive from ``timeout`` (the Checkpointer's ``commit_timeout``, T) from the save's
start: node leaders wait for their members until 0.7 T (a missing member fails the save, named),
rank 0 for the node records until 0.85 T (a missing node fails the save, named: its ranks and
node number). Rank 0's COMMIT request gets T; a COMMIT that times out or a lost store leaves
the save to the disk: committed as soon as its index.json exists (its directory fsynced first:
disk.py), failed when none appeared by 2 T. Followers wait for the result until 2 T plus a
margin, then the disk decides too. So a handle never reports failure for a committed step unless
its commit outlived 2 T. Before any of it, this rank must know the run id (run_scope.py): one
that never learns it leaves its saves to the disk.
"""
from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptd.core.errors import FormatError
from ckptd.core.gc_pause import gc_paused
from ckptd.core.relay_record import NodeRecord, RankOutcome, StepResult, commit_inputs

from . import store_keys
from .api_guard import ProcessOwner
from .errors import CheckpointError, NoReply
from .store_guard import StoreGone, store_deadline
from .store_io import CHUNK, WAIT_SLICE_S, StoreWaiter, abandon, guarded_store, multi_get, read_once

WAIT_NODES = 256          # node records rank 0 waits for, then fetches and decodes, at a time
DISK_POLL_S = 0.2       # how often the disk is looked at while it decides

__all__ = ["CHUNK", "WAIT_SLICE_S", "StoreRelay", "StoreWaiter", "RunSource", "multi_get", "read_once"]


class RunSource(Protocol):
    """Where the relay learns its run id (run_scope.RunScope; FixedRun in benchmarks)."""

    def current(self) -> str | None: ...

    def wait(self, timeout: float | None = None) -> str: ...


@dataclass
class RelayedSave:
    step: int
    start: float
    resolve: Callable[[str | None], None]      # None: committed; str: failure reason
    published: threading.Event = field(default_factory=threading.Event)
    outcome: RankOutcome | None = None         # this rank's, kept until the run id is known


class StoreRelay:
    """Runs the fan-in on its own thread, one save after the other, in order; ``resolve`` of each
    tracked save runs there too. ``commit(step, digests, records, timeout, check)`` (``check``: the
    first rank of each node, whose manifest the daemon reads back) and ``abort`` go to
    this rank's daemon (rank 0 only); ``on_disk(step)`` says whether the step's index.json exists
    (durably); ``run`` gives the run id every key is scoped to (the relay waits for it)."""

    def __init__(self, store: Any, job: str, rank: int, world_size: int, timeout: float,
                 commit: Callable[[int, dict[int, str], list[Any] | None, float, list[int]], None],
                 abort: Callable[[int, str], object],
                 on_disk: Callable[[int], bool] = lambda step: False, node_size: int = 8, *,
                 run: RunSource) -> None:
        store = guarded_store(store, 2 * timeout + 5.0)
        self.store, self.job, self.rank, self.world_size = store, job, rank, world_size
        self._run_source = run
        known = run.current()
        self._scope: str | None = None if known is None else store_keys.scope(job, known)
        self.timeout = timeout
        self.node_size = max(1, min(node_size, world_size))
        self.nodes = -(-world_size // self.node_size)
        self.node = rank // self.node_size
        self._commit, self._abort, self._on_disk = commit, abort, on_disk
        self._stop = threading.Event()
        self._waiter = StoreWaiter(store, self._stop)
        self._saves: dict[int, RelayedSave] = {}
        self._claimed: set[int] = set()         # steps this run saved (or tried to)
        self._lock = threading.Lock()
        self._queue: queue.Queue[RelayedSave | None] = queue.Queue()
        self._trash: list[str] = []     # keys to delete once the save in hand resolved (relay thread only)
        self._read: list[str] = []      # results this rank read: the last reader deletes each
        self._closed = False
        self._closing = False          # (close) this rank's outcomes are final: publish ignores later ones
        self._thread = threading.Thread(target=self._run, name="ckptd-client-relay", daemon=True)
        self._thread.start()
        atexit.register(self.close)     # a relay left open must not be inside a store call at exit
        self._owner = ProcessOwner()    # (a forked child's exit must not publish on the parent's store)

    def members(self, node: int) -> range:
        return range(node * self.node_size, min((node + 1) * self.node_size, self.world_size))

    def claim(self, step: int) -> None:
        """Before a save of ``step``: refuse it if this run saved the step already. Its keys are
        spent (a result other ranks read, a failure rank 0 acted on), and keys follow the step, so a
        rank's retry of a refused save would read, or be read as, the first attempt's outcome."""
        with self._lock:
            if step in self._claimed:
                raise CheckpointError(
                    f"step {step} was saved once already in this run: with relay commit a step is saved at most "
                    f"once per run, so that every rank's store keys for it name the same save; save a later step "
                    f"(a new Checkpointer starts a new run)")
            self._claimed.add(step)

    def track(self, step: int, resolve: Callable[[str | None], None]) -> None:
        """Relay this rank's save of ``step`` (claimed first)."""
        s = RelayedSave(step, time.monotonic(), resolve)
        with self._lock:
            self._saves[step] = s
        self._queue.put(s)

    def fail(self, step: int, reason: str) -> bool:
        """This rank's save of ``step`` failed before its daemon saw it (its state could not be planned
        here): claim the step, relay it and publish the failure, so the other ranks' saves of it fail as
        soon as rank 0 reads it, naming ``reason``, instead of waiting 0.7 T for this rank's outcome (a node
        leader still gathers its members; rank 0 still aborts and publishes the result). False, doing
        nothing, when this run claimed the step already (its keys are that save's)."""
        with self._lock:
            if step in self._claimed:
                return False
            self._claimed.add(step)
        self.track(step, lambda error: None)    # the caller raises its own error; the relay still settles it
        self.publish(step, RankOutcome.failed(reason))
        return True

    def publish(self, step: int, outcome: RankOutcome) -> None:
        """How this rank's save of ``step`` went on its daemon. Never blocks: before the run id is
        known it is kept, and the relay thread publishes it once it is. Never raises: with the store
        gone (rank 0 died) the save is settled by the disk instead. Ignored once closing: a save left
        open then was published failed (``close``), and its outcome must not change after that."""
        with self._lock:
            if self._closing:
                return
            s = self._saves.get(step)
            if s is not None:
                s.outcome = outcome
            scope = self._scope
        if scope is not None:
            self._set_outcome(scope, step, outcome)
        if s is not None:
            s.published.set()

    def _set_outcome(self, scope: str, step: int, outcome: RankOutcome) -> None:
        # On torch's connection, unanswered (the caller may be the daemon connection's reader): never waits.
        self.store.set_soon(store_keys.rank_outcome(scope, step, self.rank), outcome.encode())

    def _known_scope(self) -> str:
        """The run's key prefix, waiting for the run id (then publishing the outcomes kept meanwhile)."""
        if self._scope is None:
            scope = store_keys.scope(self.job, self._run_source.wait())
            with self._lock:
                self._scope = scope
                kept = [(s.step, s.outcome) for s in self._saves.values() if s.outcome is not None]
            for step, outcome in kept:
                self._set_outcome(scope, step, outcome)
        return self._scope

    # ---- the relay thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            s = self._queue.get()
            if s is None:
                return
            try:
                with store_deadline(s.start + 2.0 * self.timeout + 5.0):     # every store call, bounded
                    outcome = self._settle(s)
            except Exception as e:      # the store is gone (rank 0 died or stopped) or refused: the disk decides
                outcome = self._by_disk(s, 2.0, str(e) if isinstance(e, StoreGone) else f"{type(e).__name__}: {e}")
            with self._lock:
                self._saves.pop(s.step, None)
            s.resolve(outcome)
            self._delete_keys()

    def _at(self, s: RelayedSave, fraction: float) -> float:
        """Seconds left until ``fraction`` of the timeout after the save started."""
        return s.start + fraction * self.timeout - time.monotonic()

    def _settle(self, s: RelayedSave) -> str | None:
        scope = self._known_scope()     # raises (the disk decides) if this rank never learned the run
        s.published.wait(max(0.0, self._at(s, 0.7)))
        if self.rank == self.node * self.node_size:
            with store_deadline(s.start + 0.7 * self.timeout):
                self._publish_node(scope, s)
        if self.rank == 0:
            return self._lead(scope, s)
        key = store_keys.save_result(scope, s.step)
        if not self._waiter.wait([key], self._at(s, 2.0) + 5.0):
            if self._stop.is_set():
                return self._by_disk(s, 0.0, f"this process closed before rank 0's commit of step {s.step} was known")
            return self._by_disk(s, 0.0, f"timed out after {time.monotonic() - s.start:.1f}s (2 x commit_timeout "
                                 f"{self.timeout:g}s from the save) waiting for rank 0's commit")
        raw = self.store.get(key)
        self._read.append(key)      # counted off this path; the last reader deletes it
        try:
            result = StepResult.decode(raw, s.step)
        except FormatError as e:
            return self._by_disk(s, 0.0, f"rank 0's result is malformed: {e}")
        return None if result.committed else self._by_disk(s, 0.0, str(result.reason))

    def _publish_node(self, scope: str, s: RelayedSave) -> None:
        """Node leader: gather the members' outcomes, publish the node's one record, count it."""
        members = self.members(self.node)
        keys = [store_keys.rank_outcome(scope, s.step, r) for r in members]
        if self._waiter.wait(keys, self._at(s, 0.7)):
            values: list[bytes | None] = list(multi_get(self.store, keys))
        else:                   # someone is missing: which (one key at a time, on this failure path only)
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        # Decoded here, once per node: rank 0 then decodes one document per node, not one per rank.
        why = f"its node leader (rank {self.rank}) closed before this rank reported" if self._stop.is_set() else None
        outcomes = tuple(_member(r, v, 0.7 * self.timeout, why) for r, v in zip(members, values, strict=True))
        self.store.set(store_keys.node_record(scope, s.step, self.node), NodeRecord(members.start, outcomes).encode())
        with contextlib.suppress(Exception):     # the members' keys, now, while rank 0 commits (not on its path:
            for k in keys:                      # 4,096 ranks resolved sooner than with them deleted after, scale.md)
                self.store.delete_key(k)

    def _lead(self, scope: str, s: RelayedSave) -> str | None:
        """Rank 0: wait for every node's record, then commit or abort, and publish the result."""
        node_keys = [store_keys.node_record(scope, s.step, n) for n in range(self.nodes)]
        with store_deadline(s.start + 0.85 * self.timeout):
            nodes = self._receive(s, node_keys)
        if nodes is None:
            if self._stop.is_set():       # (rank 0's own close or exit, not a lost node)
                return self._fail(scope, s, f"rank 0's process closed while step {s.step} was being committed")
            missing = [n for i in range(0, self.nodes, CHUNK) for n, k in enumerate(node_keys[i: i + CHUNK], i)
                       if not self.store.check([k])]
            reason = self._describe_missing(missing)
            return self._fail(scope, s, reason)
        # One record per rank (typed: not tracked by the collector): collection paused (ckptd.core.gc_pause)
        # from here until they are dropped after the COMMIT's answer, so no collection runs on rank 0's path.
        with gc_paused():
            failed, digests, records = self._gather(nodes)
            del nodes
            error, by_disk = None, 0.0
            if failed is None:
                try:
                    self._commit(s.step, digests, records, max(1.0, self.timeout),
                                 [self.members(n)[0] for n in range(self.nodes)])
                except NoReply as e:    # the daemon is still committing, maybe: the disk decides, up to 2 T
                    error, by_disk = f"COMMIT failed: {e}", 2.0
                except Exception as e:  # refused (it settled by the disk first) or the daemon is gone: final now
                    error = f"COMMIT failed: {e}"
            del digests, records
        if failed is not None:
            return self._fail(scope, s, failed)
        outcome = None if error is None else self._by_disk(s, by_disk, error)
        self._finish(scope, s, StepResult(outcome))
        return outcome

    def _receive(self, s: RelayedSave, node_keys: list[str]) -> list[NodeRecord | FormatError] | None:
        """Every node's record, decoded (or why it is malformed) — None when some node's record is not
        there by 0.85 T. Rank 0 waits for the nodes ``WAIT_NODES`` at a time and fetches and decodes
        each slice once it is whole, while later nodes are still saving: what is left to do when the
        last node's record lands is its own slice (at 4,096 nodes the fetch and decode of all of them
        took 0.28 s after the last one)."""
        out: list[NodeRecord | FormatError] = []
        for i in range(0, self.nodes, WAIT_NODES):
            part = node_keys[i: i + WAIT_NODES]
            if not self._waiter.wait(part, self._at(s, 0.85)):
                return None
            raws = multi_get(self.store, part)
            with gc_paused():
                for n, raw in enumerate(raws, i):
                    try:
                        out.append(NodeRecord.decode(raw, self.members(n)))
                    except FormatError as e:    # named: a node whose leader wrote what no leader writes
                        out.append(e)
        return out

    def _gather(self, nodes: list[NodeRecord | FormatError]) -> tuple[str | None, dict[int, str], list[Any] | None]:
        """(why the step fails — a rank failed, or a node record is malformed — or None, the COMMIT's
        digests and records) from every node's record."""
        outcomes: list[RankOutcome] = []
        failures: list[str] = []
        for node in nodes:
            if isinstance(node, FormatError):
                failures.append(str(node))
                continue
            outcomes.extend(node.outcomes)
            failures.extend(f"rank {r}: {o.reason}" for r, o in enumerate(node.outcomes, node.first)
                            if not o.durable)
        if failures:
            more = f" (and {len(failures) - 8} more)" if len(failures) > 8 else ""
            return "; ".join(failures[:8]) + more, {}, None
        return None, *commit_inputs(outcomes)

    def _describe_missing(self, missing: list[int]) -> str:
        named = ", ".join(f"node {n} (ranks {self.members(n)[0]}-{self.members(n)[-1]})" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        return (f"{named}{more} never published {'its' if len(missing) == 1 else 'their'} record within "
                f"{0.85 * self.timeout:g}s (node lost, or its ranks never saved)")

    def _fail(self, scope: str, s: RelayedSave, reason: str) -> str | None:
        try:
            self._abort(s.step, reason)
        except Exception:
            pass            # the daemon is gone: its step is gone with it
        outcome = self._by_disk(s, 0.0, reason)    # (committed only if an index is there after all)
        self._finish(scope, s, StepResult(outcome))
        return outcome

    def _by_disk(self, s: RelayedSave, until: float, reason: str) -> str | None:
        """Committed (None) once the step's index.json exists, up to ``until`` × timeout after the
        save started (looked at once when that is past); else ``reason``."""
        while True:
            if self._on_disk(s.step):
                return None
            if self._at(s, until) <= 0 or self._closed:
                return reason
            time.sleep(DISK_POLL_S)

    def _finish(self, scope: str, s: RelayedSave, result: StepResult) -> None:
        """Publish the result (best effort: without a store the followers settle by the disk), then
        hand this step's other keys to ``_delete_keys`` (the result is its readers' to delete)."""
        try:
            if self.world_size > 1:         # (alone, no rank reads it, so none would delete it)
                self.store.set(store_keys.save_result(scope, s.step), result.encode())
        except Exception:
            return
        self._trash += [store_keys.node_record(scope, s.step, n) for n in range(self.nodes)]

    def _delete_keys(self) -> None:
        """Key deletion off the commit's path: once the save is resolved, on the relay's thread (a thread
        of its own would hold a second connection), and this rank's reads of results counted. Given up
        (keys left behind) if the store does not answer in 5 s."""
        (reads, self._read), (keys, self._trash) = (self._read, []), (self._trash, [])
        with store_deadline(time.monotonic() + 5.0), contextlib.suppress(Exception):
            for key in reads:
                read_once(self.store, key, self.world_size - 1)
            for key in keys:
                self.store.delete_key(key)

    def close(self) -> None:
        """Stop: a wait in progress ends within ``WAIT_SLICE_S`` (its save, already resolved by the
        daemon when the Checkpointer closes, is settled by what the store or the disk says). The
        threads are waited for, so that none uses the job's store after this returns (the caller may
        be waiting on it: one connection is not for two threads at once). Nothing in a forked child."""
        if self._closed or not self._owner.here():
            return
        with self._lock:
            open_saves = [s.step for s in self._saves.values() if not s.published.is_set()]
        for step in open_saves:        # its DURABLE can no longer be relayed: the others hear of it now,
            self.publish(step, RankOutcome.failed(   # and its wait for that event ends (no thread outlives this)
                f"rank {self.rank}'s process closed before its shard of step {step} was durable"))
        with self._lock:
            self._closing = True
        self._closed = True
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout=WAIT_SLICE_S + 5)
        if self._thread.is_alive():     # in a call the store does not answer (rank 0 stopped): cut short
            abandon(self.store, self._thread)
        else:                           # the keys of a step it just settled go too
            self._delete_keys()
        atexit.unregister(self.close)


def _member(rank: int, raw: bytes | None, waited_s: float, why: str | None = None) -> RankOutcome:
    """A member's outcome as its node record lists it: a missing or malformed one is its failure
    (``why`` it is missing, when the wait did not run its course)."""
    if raw is None:
        return RankOutcome.failed(why or f"rank {rank} never reported its outcome within {waited_s:g}s "
                                  "(its process or node is gone?)")
    try:
        return RankOutcome.decode(raw, rank)
    except FormatError as e:
        return RankOutcome.failed(str(e))
