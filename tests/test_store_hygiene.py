"""A job's c10d store outlives its runs (a launcher's, an elastic agent's): every relayed save and every
run must leave nothing of itself behind in it, however quickly the Checkpointer is closed."""
from __future__ import annotations

import threading

import torch
from torch.distributed import TCPStore

import ckptd_client
from ckptd_client import store_keys

from test_acceptance import free_port


def _keys(store: TCPStore, job: str, run: str, steps: range, world: int) -> list[str]:
    """The keys a run's saves of ``steps`` could leave, spelled by store_keys (the server cannot list)."""
    scope = store_keys.scope(job, run)
    out = []
    for s in steps:
        result = store_keys.save_result(scope, s)
        out += [result, store_keys.readers(result), store_keys.node_record(scope, s, 0)]
        out += [store_keys.rank_outcome(scope, s, r) for r in range(world)]
    return [k for k in out if store.check([k])]


def test_a_relayed_world_of_one_leaves_no_result_per_save(daemon):
    """commit="relay" with one rank: every save left its result key (no other rank reads it, and its
    last reader deletes it), so the store grew by one key per save for the run's life."""
    store = TCPStore("127.0.0.1", free_port(), None, True, wait_for_workers=False)
    ck = ckptd_client.Checkpointer("w1", socket=str(daemon.socket), rank=0, world_size=1, store=store,
                                   commit="relay")
    counts = []
    for step in range(1, 13):
        ck.save(step, {"w": torch.full((256,), float(step))}).wait(60)
        counts.append(store.num_keys())
    run = ck.run_scope.run if ck.run_scope is not None else None
    assert run is not None
    ck.close()
    assert max(counts) <= min(counts) + 1, counts     # (a node record's deletion is off the save's path)
    assert _keys(store, "w1", run, range(1, 13), 1) == []


def test_a_relayed_run_closed_at_once_leaves_no_node_record(daemon):
    """Two ranks save one step, wait, and close at once, three runs in a row. Rank 0's handle settles on
    its daemon's COMMITTED before its relay thread hands the step's node records to the deleting thread,
    and close() stopped that thread first: each run left its last step's node record (3, 4, 5 keys after
    the runs). close() now stops the relay thread first, so the keys it hands over are deleted."""
    port = free_port()
    stores = [TCPStore("127.0.0.1", port, None, True, wait_for_workers=False), TCPStore("127.0.0.1", port, None, False)]
    runs: list[str] = []
    counts = []

    def rank(r: int, step: int) -> None:
        ck = ckptd_client.Checkpointer("quick", socket=str(daemon.socket), rank=r, world_size=2, store=stores[r],
                                       commit="relay", local_world_size=2)
        ck.save(step, {"w": torch.full((1000,), float(r + step))}).wait(60)
        if r == 0 and ck.run_scope is not None and ck.run_scope.run is not None:
            runs.append(ck.run_scope.run)
        ck.close()

    for step in (1, 2, 3):
        threads = [threading.Thread(target=rank, args=(r, step)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        handshake = [store_keys.join_tickets("quick"), store_keys.join_done("quick"), store_keys.join_bell("quick")]
        counts.append(stores[0].num_keys() - sum(stores[0].check([k]) for k in handshake))   # (those come and go)
    assert len(runs) == 3
    assert counts == [counts[0]] * 3, counts     # beside the join handshake's keys (before: one more each run)
    assert [k for i, run in enumerate(runs, 1) for k in _keys(stores[0], "quick", run, range(i, i + 1), 2)] == []
