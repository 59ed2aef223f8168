"""The hierarchical relay commit (ckptd_client/relay.py) with real daemons, real Checkpointers
(many per process: benchmarks/scale_worker.py) and one real TCPStore: a COMMIT that outlives its
request timeout still reports committed everywhere; a node that never publishes fails every
live rank, naming it; 256 ranks over 4 daemons commit and restore through the lean index."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import zygote

from ckptd.core.names import HEAD_NAME, INDEX_NAME, RANK_TABLE_NAME, step_dir
from ckptd.core.reader import StepReader, verify_step
from ckptd_client import store_keys
from ckptd_client.relay import StoreWaiter

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "benchmarks" / "scale_worker.py"


@pytest.fixture
def store() -> Any:
    s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    yield s


def run_ranks(store: Any, world: int, groups: list[tuple[int, int, str]], root: Path, *, per_node: int,
              timeout: float, steps: int = 1, restore: bool = False) -> dict[int, dict[str, Any]]:
    """Run each (first, end, sockets) group of ranks in a worker process; every rank's JSON line.
    The ranks of a process share one store connection (each rank's relay still clones its own
    for its blocking waits)."""
    env = {**os.environ, "LOCAL_WORLD_SIZE": str(per_node), "PYTHONPATH": str(REPO)}
    procs = [zygote.popen([sys.executable, str(WORKER), "--store", f"127.0.0.1:{store.port}",
                           "--world", str(world), "--ranks", f"{first}:{end}", "--socket", str(sock),
                           "--root", str(root), "--steps", str(steps), "--timeout", str(timeout),
                           "--share-store", *(["--restore"] if restore else [])],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
            for first, end, sock in groups]
    out: dict[int, dict[str, Any]] = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        for line in stdout.splitlines():
            rec = json.loads(line)
            out[rec["rank"]] = rec
    return out


def test_commit_outliving_its_request_timeout_resolves_every_handle_committed(tmp: Path, daemon_factory,
                                                                               store: Any) -> None:
    """Rank 0's daemon takes longer to publish the index than the COMMIT request waits (the
    issue's false failure): the request times out, the disk settles it, every handle commits."""
    timeout = 6.0
    d0 = daemon_factory("--debug-commit-delay", str(timeout + 2), name="d0")
    d1 = daemon_factory(name="d1")
    out = run_ranks(store, 4, [(0, 4, f"{d0.socket},{d1.socket}")], tmp / "root", per_node=2, timeout=timeout)
    steps = [out[r]["steps"][0] for r in range(4)]
    assert [s["error"] for s in steps] == [None] * 4
    index = json.loads((Path(step_dir(str(tmp / "root"), "scale", 1)) / INDEX_NAME).read_text())
    # The case under test: the index landed more than the COMMIT request's timeout after the last rank was durable.
    assert index["created_unix"] - max(s["durable"] for s in steps) > timeout
    assert all(s["resolved"] >= index["created_unix"] for s in steps)


def test_node_that_never_publishes_fails_every_rank_naming_it(tmp: Path, daemon_factory, store: Any) -> None:
    """World of 4 in nodes of 2; node 1 (ranks 2-3) never runs: ranks 0 and 1 fail naming node 1
    (rank 0's wait for the node records ran out, not the disk's later verdict), nothing is committed."""
    d0 = daemon_factory(name="d0")
    out = run_ranks(store, 4, [(0, 2, str(d0.socket))], tmp / "root", per_node=2, timeout=4.0)
    for r in (0, 1):
        err = out[r]["steps"][0]["error"]
        assert err is not None and "node 1 (ranks 2-3) never published its record" in err, err
    assert not (Path(step_dir(str(tmp / "root"), "scale", 1)) / INDEX_NAME).exists()


def test_256_ranks_over_4_daemons_commit_and_restore(tmp: Path, daemon_factory, store: Any) -> None:
    """Two saves of 256 ranks (64 per daemon, a node each) commit; every rank restores its own
    bytes through the lean index (head + one rank-table block), and ``verify`` finds no fault."""
    daemons = [daemon_factory(name=f"d{i}") for i in range(4)]
    root = tmp / "root"
    out = run_ranks(store, 256, [(0, 256, ",".join(str(d.socket) for d in daemons))], root,
                    per_node=64, timeout=120.0, steps=2, restore=True)
    assert sorted(out) == list(range(256))
    assert [s["error"] for r in range(256) for s in out[r]["steps"]] == [None] * 512
    assert [out[r]["restore"].get("ok") for r in range(256)] == [True] * 256, out[0]["restore"]
    step = Path(step_dir(str(root), "scale", 2))
    assert (step / HEAD_NAME).is_file() and (step / RANK_TABLE_NAME).stat().st_size == 256 * 48
    reader = StepReader(str(step))
    assert reader.rank_entry(200) == reader.index["ranks"][200]        # the block agrees with index.json
    assert verify_step(str(step)) == []
    # Every rank agreed on one run id, and the run left none of its keys: the relay deleted its
    # per-rank and per-node keys, the last reader of each result deleted it, and the handshake's.
    runs = {out[r]["run"] for r in range(256)}
    assert len(runs) == 1 and None not in runs, runs
    scope = store_keys.scope("scale", runs.pop())
    for saved in (1, 2):
        keys = [store_keys.rank_outcome(scope, saved, r) for r in range(256)]
        keys += [store_keys.node_record(scope, saved, n) for n in range(4)]
        keys += [store_keys.save_result(scope, saved), store_keys.readers(store_keys.save_result(scope, saved))]
        assert not any(store.check([k]) for k in keys), saved
    choice = store_keys.restore_choice(scope, 1)
    keys = [store_keys.joined(scope), choice, store_keys.readers(choice), store_keys.all_read(choice)]
    keys += [store_keys.join_request("scale", t) for t in range(1, 256)]
    assert not any(store.check([k]) for k in keys)


STORE_SERVER = """
import sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=600), wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()
"""


def test_a_wait_on_a_store_whose_server_died_raises_and_so_does_every_later_one() -> None:
    """Rank 0's process (the store's server) exits while another rank's relay waits: that wait and
    every later one raise (the save is then left to the disk). A later wait used to clone() the
    dead store, which blocks for the store's whole timeout and again on its retry (a trainer hung
    past its test's guard this way)."""
    server = zygote.popen([sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=600),
                               wait_for_workers=False)
        waiter = StoreWaiter(client)
        client.set("here", "1")
        assert waiter.wait(["here"], 5) and not waiter.wait(["absent"], 0.5)
        outcomes: list[BaseException | bool] = []

        def wait_for_ever() -> None:
            try:
                outcomes.append(waiter.wait(["never"], 600))
            except Exception as e:
                outcomes.append(e)

        def waiting() -> threading.Thread:
            t = threading.Thread(target=wait_for_ever, daemon=True)   # daemon: a hung C++ call must not hold the suite
            t.start()
            return t
        first = waiting()
        server.kill()
        server.wait()
        # Hang guard on each wait: a clone() of the dead store blocks for the store's 600 s timeout.
        first.join(120)
        waiting().join(120)
        waiting().join(120)
        assert len(outcomes) == 3, outcomes
        assert all(isinstance(o, RuntimeError) and "store is gone" in str(o) for o in outcomes), outcomes
    finally:
        server.kill()
        server.wait()
