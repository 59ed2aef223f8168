"""The run id every rank of one run agrees on through the job's store, so no rank ever trusts a
key an earlier run wrote (a store that outlives a run: a launcher's, or a process group's with
two ``Checkpointer`` s one after the other).

Rank 0 makes the id (uuid4 hex) and knows it at once. Every other rank takes a ticket (``add``
on ``join/n``), writes a fresh nonce under ``join/t<ticket>``, rings the bell, and waits (a
store wait on a cloned connection: no polling) for rank 0's answer under ``join/a<nonce>``. No
earlier run can have written that key: the nonce is new. Rank 0, on a thread of its own, reads
the tickets taken since its last look (the first look starts where the previous rank 0 stopped,
``join/done``) and answers them all with one ``multi_set`` — a stale nonce too, harmlessly, as
nobody waits for it — on its first look and again each time the bell rings, until
``world_size - 1`` ranks took the id or the join timeout passes. It deletes the bell before each
look, so a ring is never lost: a nonce written after a look rings after that deletion. A ticket
taken whose nonce is not there yet (its rank is between the two requests) is looked at again on
the next ring, which that rank's own ring guarantees.

So each look costs rank 0 O(tickets since the last one), not O(world size): at 2,048 ranks the
old design (rank 0 peeking one request key per rank on every ring) took minutes to let everyone
join. Ranks may start in any order and at any time within the timeout, and an earlier run's keys
(crashed or not) change nothing. The run's keys live under ``ckptd/<job>/<run>/``
(store_keys.py). Assumes one live process per rank: a previous run's process still running as
rank r could take a ticket of this run.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ckptd.core.names import is_hex

from . import store_keys
from .errors import CheckpointError
from .store_guard import store_deadline
from .store_io import CHUNK, WAIT_SLICE_S, StoreWaiter, abandon, guarded_store, multi_get, peek

log = logging.getLogger("ckptd_client")

class FixedRun:
    """A run id known in advance (benchmarks that drive a relay by hand)."""

    def __init__(self, run: str) -> None:
        self.run = run

    def current(self) -> str | None:
        return self.run

    def wait(self, timeout: float | None = None) -> str:
        return self.run


class RunScope:
    """This Checkpointer's run id, agreed with the job's other ranks through ``store`` within
    ``timeout`` seconds of its start (the Checkpointer's join window, ``config.join_window``).
    ``current()`` never blocks; ``wait()`` does (bounded)."""

    def __init__(self, store: Any, job: str, rank: int, world_size: int, timeout: float) -> None:
        store = guarded_store(store, timeout)     # every call bounded (store_guard.py): by the join window's end
        self.store, self.job, self.rank, self.world_size = store, job, rank, world_size
        self.timeout = timeout
        self.started = time.monotonic()
        self.run: str | None = uuid.uuid4().hex if rank == 0 else None
        self.error: str | None = None
        self._ready = threading.Event()
        if self.run is not None:
            self._ready.set()
        self._stop = threading.Event()
        self._waiter = StoreWaiter(store, self._stop)
        self._thread = threading.Thread(target=self._bounded(self._serve if rank == 0 else self._join),
                                        name="ckptd-client-run", daemon=True)
        self._thread.start()
        atexit.register(self.close)     # the thread must not be inside a store call at exit

    def current(self) -> str | None:
        """The run id once agreed (rank 0: at once), else None."""
        return self.run

    def scope(self) -> str:
        """The key prefix of this run (``wait`` first)."""
        return store_keys.scope(self.job, self.wait())

    def wait(self, timeout: float | None = None) -> str:
        """The run id; waits until rank 0 answered (at most the join timeout). CheckpointError if
        it never did: this rank cannot take part in anything decided through the store."""
        left = self.started + self.timeout - time.monotonic() + 1.0 if timeout is None else timeout
        self._ready.wait(max(0.0, left))
        if self.run is None:
            raise CheckpointError(self.error or f"rank {self.rank} has not learned the run id of job {self.job!r} "
                                                f"from rank 0 yet")
        return self.run

    def _bounded(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with store_deadline(self.started + self.timeout):
                body()
        return run

    # ---- rank > 0 ---------------------------------------------------------------------------

    def _join(self) -> None:
        store, job = self.store, self.job
        nonce = uuid.uuid4().hex
        answer = store_keys.join_answer(job, nonce)
        try:
            ticket = int(store.add(store_keys.join_tickets(job), 1))
            store.set(store_keys.join_request(job, ticket), nonce)
            store.set(store_keys.join_bell(job), "1")
            answered = self._waiter.wait([answer], self.timeout)
            self._waiter.forget()       # before anyone learns the run id: the relay takes this clone
            if not answered:
                self.error = (f"rank 0 never told rank {self.rank} the run id of job {job!r} within "
                              f"{self.timeout:g}s (join_timeout): is rank 0 running a Checkpointer of this job on this "
                              f"store? Ranks that start further apart need a larger join_timeout")
                return
            run = store.get(answer).decode()
            store.delete_key(answer)
            store.delete_key(store_keys.join_request(job, ticket))
            self.run = run
            if store.add(store_keys.joined(store_keys.scope(job, run)), 1) >= self.world_size - 1:
                store.set(store_keys.join_bell(job), "1")        # the last one: rank 0 may stop
            self._ready.set()   # counted first: a rank 0 closed once every rank has the id finds them all
        except Exception as e:
            self.error = self.error or f"rank {self.rank} could not learn the run id: {type(e).__name__}: {e}"
        finally:
            self._waiter.forget()
            self._ready.set()

    # ---- rank 0 -----------------------------------------------------------------------------

    def _serve(self) -> None:
        store, job, run = self.store, self.job, self.run
        assert run is not None
        bell, count = store_keys.join_bell(job), store_keys.joined(store_keys.scope(job, run))
        tickets, done = store_keys.join_tickets(job), store_keys.join_done(job)
        answered: dict[int, str] = {}      # ticket: the nonce answered under it
        junk: list[int] = []                # tickets holding anything but a nonce
        try:
            seen = int(store.add(done, 0))      # tickets an earlier rank 0 looked at: not this run's
            waiting: list[int] = []             # tickets taken whose nonce was not there yet
            while True:
                store.delete_key(bell)
                if store.add(count, 0) >= self.world_size - 1:     # everyone took the id
                    if len(answered) > self.world_size - 1 or junk:
                        self._sweep(answered, junk)
                    store.delete_key(count)
                    return
                if self._stop.is_set():
                    return
                taken = int(store.add(tickets, 0))
                if taken < seen:        # the counter was deleted under us: its tickets start at 1 again
                    store.set(done, "0")
                    seen = 0
                found, bad, waiting = _requests(store, job, waiting + list(range(seen + 1, taken + 1)))
                if found:
                    store.multi_set([store_keys.join_answer(job, n) for n in found.values()], [run] * len(found))
                    answered.update(found)
                junk += bad
                if taken > seen:
                    store.add(done, taken - seen)
                    seen = taken
                left = self.started + self.timeout - time.monotonic()
                if left <= 0:
                    log.warning("ckptd: %d of %d ranks of job %r did not join run %s within %gs",
                                self.world_size - 1 - store.add(count, 0), self.world_size - 1, job, run,
                                self.timeout)
                    return
                self._waiter.wait([bell], left)
        except Exception as e:      # the store is gone: nothing to answer through any more
            log.warning("ckptd: stopped answering ranks of job %r: %s: %s", job, type(e).__name__, e)
        finally:
            self._waiter.forget()

    def _sweep(self, answered: dict[int, str], junk: list[int]) -> None:
        """Everyone joined, and some tickets were not this run's (a crashed run's, or garbage):
        delete every ticket and answer this rank 0 handled (this run's ranks deleted their own
        already: no-ops), so a run that ends leaves only the counter, the cursor and the bell."""
        for ticket, nonce in answered.items():
            self.store.delete_key(store_keys.join_answer(self.job, nonce))
            self.store.delete_key(store_keys.join_request(self.job, ticket))
        for ticket in junk:
            self.store.delete_key(store_keys.join_request(self.job, ticket))

    def close(self) -> None:
        """Stop answering or waiting (within one store-wait slice)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=WAIT_SLICE_S + 5)
            if self._thread.is_alive():     # in a call the store does not answer: cut short
                abandon(self.store, self._thread)
        atexit.unregister(self.close)


def _requests(store: Any, job: str, tickets: list[int]) -> tuple[dict[int, str], list[int], list[int]]:
    """({ticket: nonce} for the tickets holding one — a uuid4 hex —, the tickets holding anything
    else, the tickets whose nonce is not written yet). Whole chunks are read with one
    ``multi_get`` when all their keys exist (the common case); a chunk with a gap, key by key."""
    found: dict[int, str] = {}
    bad: list[int] = []
    missing: list[int] = []
    for i in range(0, len(tickets), CHUNK):
        part = tickets[i: i + CHUNK]
        keys = [store_keys.join_request(job, t) for t in part]
        if store.check(keys):
            values: list[str | None] = [v.decode(errors="replace") for v in multi_get(store, keys)]
        else:
            values = [peek(store, k) for k in keys]
        for t, v in zip(part, values, strict=True):
            if v is None:
                missing.append(t)
            elif is_hex(v, 32):
                found[t] = v
            else:
                bad.append(t)
    return found, bad, missing
