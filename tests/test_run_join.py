"""The run-id handshake at scale and on a store an earlier run left (ckptd_client/run_scope.py):
rank 0 reads only the tickets taken since the last rank 0 looked, answers them in one batch,
and each rank opens one store connection for its blocking waits, shared by the handshake and
the relay (the store guard's pool, store_guard.py). Real TCPStore, real daemon, real Checkpointers."""
from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ckptd_client
from ckptd_client import store_keys
from ckptd_client.run_scope import RunScope


def _server() -> Any:
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)


def _client(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)


def _opened(port: int) -> int:
    """Connections to ``port`` this machine holds open, or closed in the last minute (TIME_WAIT):
    how many the clients opened, wherever they are now."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] in ("01", "06"):
                n += 1
    return n


def _join(port: int, job: str, world: int) -> list[RunScope]:
    scopes = [RunScope(_client(port), job, r, world, 30.0) for r in range(world)]
    for s in scopes:
        s.wait()
    return scopes


def _join_keys(store: Any, job: str) -> set[str]:
    prefix = f"{store_keys.PREFIX}/{job}/join/"
    return {k for k in store.list_keys() if k.startswith(prefix)}


def test_rank_0_answers_only_tickets_taken_since_the_last_run_and_a_crashed_runs_leftovers_harm_nothing():
    """A crashed run left three tickets: a nonce nobody waits for, a ticket taken but never
    written (its rank killed between the two requests), garbage. A new run of 4 ranks agrees on
    one id; rank 0 deleted the stale answer; only the counter, the cursor and the bell remain.
    A nonce written afterwards under an old ticket is never answered by the next run, whose 4
    ranks agree on a new id: rank 0 starts at the cursor."""
    server = _server()
    store = _client(server.port)
    job = "joins"
    stale = uuid.uuid4().hex
    store.add(store_keys.join_tickets(job), 3)
    store.set(store_keys.join_request(job, 1), stale)
    store.set(store_keys.join_request(job, 3), "not a nonce")

    first = _join(server.port, job, 4)
    assert len({s.current() for s in first}) == 1 and first[0].current() is not None
    for s in first:
        s.close()
    taken = int(store.add(store_keys.join_tickets(job), 0))
    assert taken == 6          # 3 stale + 3 ranks
    assert int(store.add(store_keys.join_done(job), 0)) == taken
    assert not store.check([store_keys.join_answer(job, stale)])
    assert not store.check([store_keys.joined(store_keys.scope(job, str(first[0].current())))])
    assert _join_keys(store, job) <= {store_keys.join_tickets(job), store_keys.join_done(job),
                                      store_keys.join_bell(job)}, _join_keys(store, job)

    late = uuid.uuid4().hex
    store.set(store_keys.join_request(job, 2), late)         # below the cursor: not this run's
    second = _join(server.port, job, 4)
    assert len({s.current() for s in second}) == 1
    assert second[0].current() != first[0].current()
    for s in second:
        s.close()
    assert not store.check([store_keys.join_answer(job, late)])
    assert int(store.add(store_keys.join_done(job), 0)) == int(store.add(store_keys.join_tickets(job), 0)) == 9


def test_ranks_joining_while_rank_0_looks_are_all_answered():
    """48 ranks start in random order around rank 0 (some before it, some long after): every
    one learns the same id (a ticket whose nonce was not written yet when rank 0 looked is
    looked at again on that rank's ring)."""
    server = _server()
    job, world = "trickle", 48
    scopes: dict[int, RunScope] = {}
    lock = threading.Lock()
    order = torch.randperm(world, generator=torch.Generator().manual_seed(7)).tolist()

    def start(r: int, delay: float) -> None:
        time.sleep(delay)
        s = RunScope(_client(server.port), job, r, world, 30.0)
        with lock:
            scopes[r] = s

    threads = [threading.Thread(target=start, args=(r, 0.02 * i)) for i, r in enumerate(order)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runs = {r: s.wait(30) for r, s in scopes.items()}
    assert len(runs) == world and len(set(runs.values())) == 1
    for s in scopes.values():
        s.close()


def test_each_rank_opens_one_connection_for_its_waits_shared_by_the_handshake_and_the_relay(daemon):
    """16 ranks with relay commit save and commit a step. Beyond its own store connection each
    rank opens one more, for blocking waits: the run handshake's, handed to the relay once the
    run id is known (rank 0 may need two: it still answers late joiners while it waits for node
    records). Before, every rank opened two: 2 x 16 more than its own."""
    server = _server()
    world = 16
    stores = [_client(server.port) for _ in range(world)]
    before = _opened(server.port)       # the ranks' own connections and the server object's own
    ckpts = [ckptd_client.Checkpointer("lines", socket=str(daemon.socket), root=str(daemon.root), rank=r,
                                       world_size=world, store=stores[r], commit="relay", commit_timeout=60,
                                       local_world_size=4, overlap=False) for r in range(world)]
    try:
        for ck in ckpts:
            assert ck.run_scope is not None
            ck.run_scope.wait(30)
        handles = [ck.save(1, {"w": torch.full((4,), float(r))}) for r, ck in enumerate(ckpts)]
        for h in handles:
            h.wait(60)
        assert all(h.committed for h in handles)
        opened = _opened(server.port) - before
        assert world - 1 <= opened <= world + 1, opened
    finally:
        for ck in ckpts:
            ck.close(timeout=10)


def test_the_join_window_is_its_own_not_the_commit_timeout(daemon):
    """A job whose saves commit within 2 s (commit_timeout=2) still lets its ranks start further
    apart: rank 1's Checkpointer starts 3.5 s after rank 0's and learns the same run id, and a
    restore agreed through the store works on both. Before, the join window was commit_timeout:
    rank 0 stopped answering after 2 s and rank 1's restore failed (a loaded CI run hit it with
    the crash trials' 4 s). A window set short is kept: rank 1 alone, join_timeout=1.5, fails
    naming the window."""
    server = _server()
    kw: dict[str, Any] = {"socket": str(daemon.socket), "root": str(daemon.root), "world_size": 2,
                          "commit": "relay", "commit_timeout": 2, "overlap": False}
    ck0 = ckptd_client.Checkpointer("window", rank=0, store=_client(server.port), **kw)
    time.sleep(3.5)
    ck1 = ckptd_client.Checkpointer("window", rank=1, store=_client(server.port), **kw)
    try:
        assert ck0.config.join_timeout is None
        assert ck0.run_scope is not None and ck1.run_scope is not None
        assert ck1.run_scope.wait(30) == ck0.run_scope.wait(30)
        results: dict[int, Any] = {}
        t = threading.Thread(target=lambda: results.__setitem__(1, ck1.restore({"w": torch.zeros(4)})))
        t.start()
        results[0] = ck0.restore({"w": torch.zeros(4)})
        t.join(60)
        assert results == {0: None, 1: None}       # nothing saved yet: both agree there is nothing
    finally:
        ck0.close(timeout=10)
        ck1.close(timeout=10)

    lone = ckptd_client.Checkpointer("window-alone", rank=1, store=_client(server.port), join_timeout=1.5, **kw)
    try:
        assert lone.run_scope is not None
        with pytest.raises(ckptd_client.CheckpointError, match="within 1.5s"):
            lone.run_scope.wait(30)
    finally:
        lone.close(timeout=10)
    with pytest.raises(ValueError, match="join_timeout must be a positive"):
        ckptd_client.CheckpointerConfig(join_timeout=0)
