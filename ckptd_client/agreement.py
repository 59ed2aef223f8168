"""What the ranks of a run agree on, through the job's store, for each restore: the step (rank 0's
choice, so a commit landing while they list the directory cannot split them) and, for a
memory-level step, whether every rank restored it (one rank that could not sends all to storage).

Every agreement has keys of its own, numbered by the run's restores (store_keys.py); the last rank to
read one deletes it and sets its ``all-read`` mark, which rank 0 waits for before its restore returns
(:meth:`RestoreAgreements.settle`): without a launcher the store's server is rank 0's process, and a
script whose restore is its last collective (an evaluation, a conversion) would otherwise exit under
a slower rank still reading it ("the job's store is gone"). Every wait is bounded, and so is every store
call (store_guard.py: a stopped rank 0 never answers): by the wait's bound where there is one.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from . import store_keys
from .errors import CheckpointError
from .run_scope import RunScope
from .store_guard import StoreGone, store_deadline
from .store_io import StoreWaiter, guarded_store, read_once, wait_all_read

log = logging.getLogger("ckptd_client")

__all__ = ["RestoreAgreements"]


class RestoreAgreements:
    """One Checkpointer's restore agreements. Call order, per restore: :meth:`step` and
    :meth:`all_ok`, as often as the restore needs, on every rank in the same order; then
    :meth:`settle` (``wait=False`` when the restore failed). Without a run (one rank, or no store)
    each returns this rank's own answer."""

    def __init__(self, store: Any, run: RunScope | None, rank: int, world_size: int, vote_timeout: float) -> None:
        store = guarded_store(store, vote_timeout if run is None else max(vote_timeout, run.timeout))
        self.store, self.run, self.rank, self.world_size = store, run, rank, world_size
        # The memory-level vote's bound: the commit timeout, or the join window where that is longer:
        # rank 0 votes as soon as its own part is planned, and the others may start that far behind it.
        self.vote_timeout = vote_timeout
        self._n = 0                         # the run's agreements so far: each one's keys are its own
        self._owed: list[str] = []          # rank 0: this restore's marks, set once every rank read them

    def step(self, step: int | None) -> int | None:
        """Rank 0's choice of step (its ``step``; None: nothing to restore). Another rank waits for it
        at most the join window (the store's own timeout, 30 min by torch's default, is no bound a user
        chose): then CheckpointError."""
        if self.world_size == 1 or self.run is None:
            return step
        key = store_keys.restore_choice(self._next(), self._n)
        began = time.monotonic()
        try:
            with store_deadline(began + self.run.timeout):
                return self._step(key, step)
        except StoreGone as e:      # a call outlived the join window: rank 0 (the store's host) stopped
            waited = time.monotonic() - began
            raise CheckpointError(f"restore: rank {self.rank} cannot agree the step with rank 0 (waited {waited:.1f}s, "
                                  f"join_timeout {self.run.timeout:g}s): {e}") from None

    def _step(self, key: str, step: int | None) -> int | None:
        assert self.run is not None
        if self.rank == 0:
            self.store.set(key, str(-1 if step is None else step))
            self._owed.append(store_keys.all_read(key))
            return step
        waiter = StoreWaiter(self.store)
        try:
            chosen = waiter.wait([key], self.run.timeout)
        except StoreGone:                   # (it did not answer: said, with the time waited, by ``step``)
            raise
        except RuntimeError as e:            # the store is gone
            raise CheckpointError(f"restore: rank {self.rank} cannot learn rank 0's choice of step: {e}") from None
        finally:
            waiter.forget()
        if not chosen:
            raise CheckpointError(f"restore: rank {self.rank} had no word from rank 0 of which step to restore "
                                  f"within {self.run.timeout:g}s (join_timeout): is rank 0 restoring too? Ranks "
                                  "that make one Checkpointer after another must stay in step (a collective "
                                  "between them)")
        value = int(self.store.get(key).decode())
        read_once(self.store, key, self.world_size - 1, store_keys.all_read(key))
        return None if value < 0 else value

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank answered ``ok`` (restored the memory-level step): one counter of failures,
        one of arrivals, a key the last arrival sets; the last reader deletes them and sets the mark."""
        if self.world_size == 1 or self.run is None:
            return ok
        scope = self._next()
        timeout = max(self.vote_timeout, self.run.timeout)
        began = time.monotonic()
        try:
            with store_deadline(began + timeout):
                return self._all_ok(scope, ok, timeout)
        except StoreGone as e:
            raise CheckpointError(f"restore: rank {self.rank} cannot learn whether every rank can restore the "
                                  f"memory-level step (waited {time.monotonic() - began:.1f}s): {e}") from None

    def _all_ok(self, scope: str, ok: bool, timeout: float) -> bool:
        failed, arrived, done, read = store_keys.restore_votes(scope, self._n)
        mark = store_keys.all_read(store_keys.restore_vote(scope, self._n))
        if not ok:
            self.store.add(failed, 1)
        if self.store.add(arrived, 1) >= self.world_size:
            self.store.set(done, "1")
        waiter = StoreWaiter(self.store)
        ok_all = waiter.wait([done], timeout)
        waiter.forget()
        if not ok_all:
            raise CheckpointError(f"restore: not every rank said within {timeout:g}s whether it can restore "
                                  "the memory-level step (a rank died or hangs)")
        if self.rank == 0:
            self._owed.append(mark)
        bad = int(self.store.add(failed, 0))
        if self.store.add(read, 1) >= self.world_size:
            for key in (failed, arrived, done, read):
                self.store.delete_key(key)
            self.store.set(mark, "1")
        return bad == 0

    def settle(self, wait: bool = True) -> None:
        """(Rank 0; a no-op elsewhere) Wait until every rank has read this restore's agreements. Rank 0's
        load overlapped their reads, so this waits only for the slowest rank to reach its restore, as
        the next collective would; bounded by the join window, then a warning (this restore stands).
        ``wait=False`` (the restore failed): forget them, so that the error is raised at once."""
        owed, self._owed = self._owed, []
        if wait and owed and self.run is not None and \
                not wait_all_read(self.store, owed, self.run.timeout):
            log.warning("ckptd: not every rank read this restore's agreement within %gs (join_timeout); "
                        "a rank died or did not restore", self.run.timeout)

    def _next(self) -> str:
        """The run's key prefix (waits for the run id, bounded); numbers the next agreement (``_n``)."""
        assert self.run is not None
        scope = self.run.scope()
        self._n += 1
        return scope
