"""Time to a protected checkpoint: a memory-level save (held in memory, replicated to a peer node's
daemon) vs a storage save (written and fsynced) vs DCP ``async_save``, one run interleaved.

Two daemons on loopback stand for two nodes (one shared root, each the other's peer, K = 1); two gloo
ranks, rank r on daemon r, each with its own ``--size-mib`` of fp32 state (plus a step counter).
Each round runs every method once, in an order that rotates each round, each save waited for before
the next starts, the slowest rank's time taken:

- ``ckptd save(level="memory")``: until the handle reports the step committed — every rank's shard
  held by its daemon and replicated to the other node's daemon, the step's index committed
  (README, "Memory-level saves");
- ``ckptd save()``: until the step is committed on storage (every shard written and fsynced);
- DCP ``async_save``: until its future is done (files fsynced, ``.metadata`` written).

What "protected" means differs: a memory-level step survives the loss of either node (not of both);
the other two survive anything the disk survives. One machine runs both "nodes" (their daemons,
ranks and the replication traffic share its cores and memory bandwidth). Writes
benchmarks/results/memory_level.md and .json.

    make bench-memory-level        # or: python benchmarks/memory_level_bench.py [--size-mib 256 --rounds 6]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from common import RESULTS, free_port, machine_info, write_results  # noqa: E402

METHODS = ("ckptd-memory", "ckptd-storage", "dcp")
LABELS = {"ckptd-memory": 'ckptd save(level="memory"): held + replicated to the peer, committed',
          "ckptd-storage": "ckptd save(): written, fsynced, committed",
          "dcp": "DCP async_save: written, fsynced, .metadata"}


# ---- one rank ---------------------------------------------------------------------------------

def rank_main(spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptd_client

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    numel = spec["size_mib"] << 18
    state: dict[str, Any] = {f"w{rank}": torch.randn(numel, generator=gen), "step": 0}
    ck = ckptd_client.Checkpointer("ml", socket=spec["sockets"][rank])
    dcp_root = Path(spec["dcp_root"])
    rows: list[dict[str, Any]] = []
    step = 0
    for rnd in range(spec["warmup"] + spec["rounds"]):
        order = METHODS[rnd % len(METHODS):] + METHODS[:rnd % len(METHODS)]
        for method in order:
            step += 1
            state["step"] = step
            with torch.no_grad():
                state[f"w{rank}"].add_(1.0)          # a training step changed the state
            dist.barrier()
            t0 = time.perf_counter()
            if method == "dcp":
                fut = dcp.async_save({k: v for k, v in state.items()}, checkpoint_id=str(dcp_root / f"step-{step}"))
                call = time.perf_counter() - t0
                fut.result()  # type: ignore[union-attr]
            else:
                h = ck.save(step, state, level="memory" if method == "ckptd-memory" else "storage")
                call = time.perf_counter() - t0
                h.wait(300)
                assert h.committed, (method, step)
            took = torch.tensor([time.perf_counter() - t0, call], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            rows.append({"round": rnd, "warmup": rnd < spec["warmup"], "method": method, "step": step,
                         "committed_s": float(took[0]), "call_s": float(took[1])})
            if method == "dcp":
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(dcp_root / f"step-{step}", ignore_errors=True)
            if rank == 0:
                print(f"  round {rnd}{' (warm-up)' if rnd < spec['warmup'] else ''}: {method} "
                      f"{float(took[0]):.3f} s", flush=True)
    ck.close()
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ---- the orchestrator -------------------------------------------------------------------------

def run(a: argparse.Namespace) -> dict[str, Any]:
    from ckptd.spawn import spawn_daemon

    base = Path(tempfile.mkdtemp(prefix="ckptd-memlevel-", dir=a.dir))
    root = base / "root"
    secret = base / "secret"
    secret.write_text("memory-level-bench-secret-0123456789abcdef")
    secret.chmod(0o600)
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    daemons = []
    try:
        for i, listen in enumerate(addrs):
            args = ["--peer-listen", listen, "--peer-secret-file", str(secret), "--keep-last", "1"]
            for peer in addrs:
                args += ["--peer", peer]
            daemons.append(spawn_daemon(root, base / f"d{i}.sock", *args, log=base / f"d{i}.log"))
        spec = {"size_mib": a.size_mib, "rounds": a.rounds, "warmup": a.warmup, "port": free_port(),
                "sockets": [str(d.socket) for d in daemons], "dcp_root": str(base / "dcp"),
                "result": str(base / "result.json")}
        (base / "dcp").mkdir()
        path = base / "spec.json"
        path.write_text(json.dumps(spec))
        started = time.monotonic()
        procs = [subprocess.Popen([sys.executable, str(HERE), "--rank-worker", str(path)],
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
                 for r in range(2)]
        try:
            for p in procs:
                p.wait(max(1.0, a.timeout - (time.monotonic() - started)))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"ranks exited with {[p.returncode for p in procs]} (daemon logs under {base})")
        rows = json.loads(Path(spec["result"]).read_text())
    finally:
        for d in daemons:
            d.stop()
    if a.keep:
        print(f"kept {base} (the daemons' logs: d0.log, d1.log)")
    else:
        shutil.rmtree(base, ignore_errors=True)
    return {"rows": rows}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in METHODS:
        xs = [r["committed_s"] for r in rows if r["method"] == m and not r["warmup"]]
        calls = [r["call_s"] for r in rows if r["method"] == m and not r["warmup"]]
        out[m] = {"committed_p50": statistics.median(xs), "min": min(xs), "max": max(xs),
                  "call_p50": statistics.median(calls), "n": len(xs)}
    mem = out["ckptd-memory"]["committed_p50"]
    out["ratios"] = {"memory_vs_storage": mem / out["ckptd-storage"]["committed_p50"],
                     "memory_vs_dcp": mem / out["dcp"]["committed_p50"],
                     "storage_vs_dcp": out["ckptd-storage"]["committed_p50"] / out["dcp"]["committed_p50"]}
    return out


def to_markdown(res: dict[str, Any]) -> str:
    s, m = res["summary"], res["machine"]
    r = s["ratios"]
    lines = [
        "# Time to a protected checkpoint: memory-level saves vs storage saves vs DCP",
        "",
        f"Generated by `benchmarks/memory_level_bench.py` on {res['when']} in {res['wall_s']:.0f} s. Machine: "
        f"{m['cpu']}, {m['cores_available']} cores available, {m['ram_gib']} GiB RAM, disk {m['disk']['device']} "
        f"({m['disk']['fstype']}), Linux {m['kernel']}, torch {m['versions']['torch']}, load average at start "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}, shared memory's huge pages "
        f"(transparent_hugepage/shmem_enabled) {m['shmem_huge_pages']}.",
        "",
        f"State: 2 gloo ranks, {res['config']['size_mib']} MiB of fp32 each (plus a step counter); two daemons on "
        "loopback standing for two nodes (one shared root, peers of each other, K = 1), rank r on daemon r. "
        f"{res['config']['warmup']} warm-up + {res['config']['rounds']} measured rounds, each running every method "
        "once in an order that rotates each round, each save waited for before the next; the slowest rank's time "
        "from the save call until the step is committed (ckptd: the handle; DCP: its future). Medians.",
        "",
        "| method | save call → committed p50 | min | max | save call p50 |",
        "|---|---|---|---|---|",
    ]
    for k in METHODS:
        x = s[k]
        lines.append(f"| {LABELS[k]} | {x['committed_p50']:.3f} s | {x['min']:.3f} s | {x['max']:.3f} s | "
                     f"{x['call_p50'] * 1e3:.1f} ms |")
    lines += [
        "",
        f"Memory-level ÷ storage save: **{r['memory_vs_storage']:.2f}×**; memory-level ÷ DCP `async_save`: "
        f"**{r['memory_vs_dcp']:.2f}×**; ckptd storage ÷ DCP: {r['storage_vs_dcp']:.2f}×.",
        "",
        "A memory-level step survives the loss of either node (the other holds a copy), not of both; the storage "
        "save and DCP survive what the disk survives. Both nodes share this machine: the replica crosses "
        "loopback, and both daemons and ranks share its cores and memory bandwidth.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="state per rank")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", default=None, help="where the root and DCP's files go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--keep", action="store_true", help="keep the root, DCP's files and the daemons' logs")
    p.add_argument("--out", type=Path, default=RESULTS / "memory_level")
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_worker:
        rank_main(json.loads(Path(a.rank_worker).read_text()))
        return 0
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    machine = machine_info(a.dir or tempfile.gettempdir())
    t = time.monotonic()
    got = run(a)
    res = {"when": when, "machine": machine, "wall_s": time.monotonic() - t,
           "config": {"size_mib": a.size_mib, "rounds": a.rounds, "warmup": a.warmup}, **got,
           "summary": summarize(got["rows"])}
    write_results(a.out, res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
