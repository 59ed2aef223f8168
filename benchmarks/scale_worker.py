"""Many simulated ranks in one process: each one a real ``Checkpointer`` (real client library,
its own daemon connection, slots and relay), all of the job's ranks sharing one real TCPStore.

Used by benchmarks/scale_bench.py and tests/test_scale_commit.py. Each rank saves ``--steps``
tiny states (so the protocol, not the bytes, is the cost), waits for every handle, then (with
``--restore``) restores the last step into a zeroed state and checks it byte for byte. One JSON
line per rank on stdout: rank, per step the wall time it was durable and resolved, and the
error if any; then the restore's outcome.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ckptd_client


def state(rank: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((4,), float(rank * 1000 + step)), "shared": torch.arange(8, dtype=torch.float32),
            "step": step}


def where_threads(*_: Any) -> None:
    """SIGUSR1: where each relay / run-handshake thread is (innermost ckptd_client frame), counted
    per place, with the node leaders' and rank 0's named: what a stuck run is waiting on."""
    names = {t.ident: t.name for t in threading.enumerate()}
    places: Counter[str] = Counter()
    leaders: list[str] = []
    for ident, frame in sys._current_frames().items():
        stack = []
        f: Any = frame
        while f is not None:
            if "ckptd_client" in f.f_code.co_filename:
                stack.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}:{f.f_lineno}")
            f = f.f_back
        if not stack:
            continue
        place = f"{names.get(ident)} {' < '.join(stack[:3])}"
        places[place] += 1
        g: Any = frame
        while g is not None:
            me = g.f_locals.get("self")
            if me is not None and type(me).__name__ == "StoreRelay":
                if me.rank % me.node_size == 0:
                    leaders.append(f"rank {me.rank}: {place}")
                break
            g = g.f_back
    print(f"--- {time.strftime('%H:%M:%S')} threads by place", file=sys.stderr)
    for place, n in places.most_common(20):
        print(f"{n:6d} {place}", file=sys.stderr)
    for line in leaders:
        print("leader " + line, file=sys.stderr)
    sys.stderr.flush()


def main() -> int:
    signal.signal(signal.SIGUSR1, where_threads)
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True, help="host:port of the job's TCPStore")
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--ranks", required=True, help="first:end (end excluded)")
    ap.add_argument("--socket", required=True,
                    help="the daemons' sockets, comma-separated: node n (ranks n*LOCAL_WORLD_SIZE...) uses the "
                         "(n mod count)-th")
    ap.add_argument("--root", required=True)
    ap.add_argument("--job", default="scale")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--restore", action="store_true")
    ap.add_argument("--workers", type=int, default=1, help="worker processes of this job: each step starts together")
    ap.add_argument("--share-store", action="store_true",
                    help="one store connection for all ranks of this process (tests: fewer connects)")
    a = ap.parse_args()
    host, port = a.store.rsplit(":", 1)
    first, end = (int(x) for x in a.ranks.split(":"))
    ranks = range(first, end)
    def connect() -> Any:
        return dist.TCPStore(host, int(port), a.world, is_master=False, timeout=timedelta(seconds=a.timeout * 3),
                             wait_for_workers=False)
    shared = connect() if a.share_store else None
    sync = connect()

    def barrier(name: str) -> None:
        """Every worker process reaches ``name`` before any goes on (the ranks save at once)."""
        if sync.add(f"bench/{a.job}/{name}", 1) == a.workers:
            sync.set(f"bench/{a.job}/{name}/go", "1")
        sync.wait([f"bench/{a.job}/{name}/go"], timedelta(seconds=a.timeout * 10))

    def client() -> Any:      # one store connection per rank, as each rank's own process would have
        return shared or connect()
    sockets = a.socket.split(",")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "8"))
    phases: dict[str, float] = {}
    t = time.monotonic()
    pool = ThreadPoolExecutor(16)
    stores = dict(zip(ranks, pool.map(lambda _: client(), ranks), strict=True))
    ckpts = {r: ckptd_client.Checkpointer(a.job, socket=sockets[(r // per_node) % len(sockets)], root=a.root,
                                          rank=r, world_size=a.world, store=stores[r], commit="relay",
                                          commit_timeout=a.timeout, overlap=False) for r in ranks}
    out: dict[int, dict[str, Any]] = {r: {"rank": r, "steps": []} for r in ranks}
    list(pool.map(lambda r: ckpts[r].prepare(state(r, 0)), ranks))    # connect and get slots up front
    phases["start_s"], t = time.monotonic() - t, time.monotonic()
    for step in range(1, a.steps + 1):
        barrier(f"save-{step}")
        started = time.time()
        handles = {r: ck.save(step, state(r, step)) for r, ck in ckpts.items()}

        def settle(r: int, step: int = step, handles: dict[int, Any] = handles, started: float = started) -> None:
            h = handles[r]
            err = None
            try:
                h.wait(a.timeout * 3)
            except Exception as e:
                err = str(e)
            resolved = time.time()
            durable = None if h.durable_s is None else time.time() - (time.monotonic() - h.started - h.durable_s)
            out[r]["steps"].append({"step": step, "started": started, "durable": durable, "resolved": resolved,
                                    "error": err})
        list(pool.map(settle, ranks))
    phases["save_s"], t = time.monotonic() - t, time.monotonic()
    if a.restore:
        def restore(r: int) -> None:
            live: dict[str, Any] = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
                                    for k, v in state(r, 0).items()}
            t0 = time.time()
            try:
                got = ckpts[r].restore(live)
                want = state(r, a.steps)
                ok = got == a.steps and all(torch.equal(live[k], want[k]) for k in ("w", "shared")) \
                    and live["step"] == a.steps
                out[r]["restore"] = {"ok": ok, "started": t0, "ended": time.time()}
            except Exception as e:
                out[r]["restore"] = {"ok": False, "error": str(e)}
        barrier("restore")
        # Rank 0 on a thread of its own: its restore returns only once every rank read its choice, and
        # the pool's threads may all be other ranks waiting for that choice.
        lead = threading.Thread(target=restore, args=(0,)) if first == 0 else None
        if lead is not None:
            lead.start()
        list(pool.map(restore, [r for r in ranks if r != 0]))
        if lead is not None:
            lead.join()
    phases["restore_s"], t = time.monotonic() - t, time.monotonic()
    list(pool.map(lambda ck: ck.close(timeout=10), ckpts.values()))
    phases["close_s"] = time.monotonic() - t
    print(json.dumps({k: round(v, 3) for k, v in phases.items()}), file=sys.stderr, flush=True)
    for r in ranks:
        scope = ckpts[r].run_scope
        out[r]["run"] = None if scope is None else scope.current()     # the run id its keys were under
        print(json.dumps(out[r]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
