"""DCP with ckptd as its storage vs DCP's own FileSystemWriter, on the same state.

    .venv/bin/python benchmarks/dcp_backend_bench.py [--size-mib 256] [--tensors 64] [--rounds 6]

One process (``no_dist``), one real daemon (ckptd.launch.spawn_daemon on a temporary root), the
files of both methods on the same file system. The state: ``--tensors`` fp32 weights of ``--size-mib``
in all (normal, std 0.02) plus an AdamW-like pair of moments each, and a few byte items (step, a
note). Round by round the two methods take turns (the first method alternates) on that state:

- ``dcp.async_save(state, storage_writer=ckptd_client.dcp.StorageWriter(...))`` — the writer reused
  for every round, as a trainer keeps it;
- ``dcp.async_save(state, storage_writer=FileSystemWriter(dir))`` — DCP's default (fsync on).

Both with DCP's default stager. Per save: *stall* (``async_save`` returning: DCP's staging copy and
hand-off), *time to durable* (``async_save`` until its future resolves: ckptd's step committed,
index.json fsynced; DCP's files and ``.metadata`` written and fsynced), *bytes* on disk, and
``dcp.load`` into a fresh state of the same shapes (ckptd's ``StorageReader`` vs
``FileSystemReader``), checked bit for bit. Medians over the rounds, and ckptd / DCP ratios.
Results: benchmarks/results/dcp_backend.md and .json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptd.launch import spawn_daemon  # noqa: E402
from ckptd_client.dcp import StorageReader, StorageWriter  # noqa: E402

from common import RESULTS, fmt, machine_info, median, table, write_results  # noqa: E402

METHODS = ("ckptd", "dcp-fs")


def make_state(size_mib: int, tensors: int) -> dict[str, Any]:
    numel = size_mib * 2**20 // 4 // tensors // 3
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(numel, generator=g) * 0.02 for i in range(tensors)}
    optim = {f"layer{i}.weight": {"exp_avg": torch.randn(numel, generator=g) * 1e-3,
                                  "exp_avg_sq": torch.rand(numel, generator=g) * 1e-6} for i in range(tensors)}
    return {"model": model, "optim": optim, "meta": {"step": 100, "note": "dcp backend bench"}}


def zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    return None if not isinstance(state, (int, float)) else type(state)()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def one(method: str, r: int, state: dict[str, Any], work: Path, writer: StorageWriter, root: Path) -> dict[str, float]:
    if method == "ckptd":
        sw: Any = writer
        cid = f"step-{r}"
        where = root / "bench" / f"step-{r:012d}"
        reader: Any = StorageReader("bench", root=str(root))
    else:
        where = work / f"dcp-{r}"
        sw = dcp.FileSystemWriter(str(where))
        cid = str(where)
        reader = dcp.FileSystemReader(str(where))
    t0 = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=cid, storage_writer=sw, no_dist=True)
    stall = time.perf_counter() - t0
    assert isinstance(fut, Future)
    fut.result()
    durable = time.perf_counter() - t0
    fresh = zeros_like(state)
    t1 = time.perf_counter()
    dcp.load(fresh, checkpoint_id=cid, storage_reader=reader, no_dist=True)
    load = time.perf_counter() - t1
    if not same(state, fresh):
        raise AssertionError(f"{method}: round {r} did not load back bit for bit")
    return {"stall_s": stall, "durable_s": durable, "bytes": float(du(where)), "load_s": load}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=256, help="the whole state (weights and two moments)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dir", default=None, help="where both methods write (default: a temporary directory)")
    a = p.parse_args()
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ckptd-dcp-bench-", dir=a.dir))
    state = make_state(a.size_mib, a.tensors)
    state_bytes = sum(t.numel() * 4 for d in (state["model"], *state["optim"].values())
                      for t in (d.values() if isinstance(d, dict) else ()))
    daemon = spawn_daemon(work / "root", work / "d.sock")
    writer = StorageWriter("bench", socket=str(daemon.socket))
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    try:
        for r in range(1, a.rounds + 1):
            for method in (METHODS if r % 2 else METHODS[::-1]):
                runs[method].append(one(method, r, state, work, writer, work / "root"))
                print(f"round {r} {method}: {runs[method][-1]}", flush=True)
    finally:
        writer.close()
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    keys = ("stall_s", "durable_s", "bytes", "load_s")
    med = {m: {k: median([x[k] for x in runs[m]]) for k in keys} for m in METHODS}
    ratio = {k: med["ckptd"][k] / med["dcp-fs"][k] for k in keys}
    machine = machine_info(a.dir or tempfile.gettempdir())
    res = {"state_bytes": state_bytes, "tensors": a.tensors * 3, "rounds": a.rounds, "runs": runs,
           "median": med, "ratio_ckptd_over_dcp": ratio, "machine": machine, "wall_s": time.monotonic() - t_start}
    rows = [(m, fmt(med[m]["stall_s"] * 1e3, 1), fmt(med[m]["durable_s"], 3), fmt(med[m]["bytes"] / 2**20, 1),
             fmt(med[m]["load_s"], 3)) for m in METHODS]
    rows.append(("ratio ckptd / DCP", fmt(ratio["stall_s"], 2), fmt(ratio["durable_s"], 2), fmt(ratio["bytes"], 2),
                 fmt(ratio["load_s"], 2)))
    md = "\n".join([
        "# dcp.async_save: ckptd's StorageWriter vs DCP's FileSystemWriter",
        "",
        f"State: {state_bytes / 2**20:.0f} MiB fp32 in {a.tensors * 3} tensors (weights, two moments) plus byte "
        f"items; {a.rounds} rounds, methods interleaved (first method alternating); medians. Produced by "
        "`make bench-dcp` (benchmarks/dcp_backend_bench.py). Every load checked bit for bit.",
        "",
        table(("method", "stall (ms)", "to durable (s)", "on disk (MiB)", "dcp.load (s)"), rows),
        "",
        f"Machine: {machine['cpu']}, {machine['cores_available']} cores available, {machine['ram_gib']} GiB RAM, "
        f"{machine['disk']['fstype']} on {machine['disk']['device']}; load average at start "
        f"{', '.join(f'{x:.2f}' for x in machine['loadavg_at_start'])}; torch {machine['versions']['torch']}.",
        "",
        "Stall: both go through DCP's DefaultStager (a CPU copy of the state) before async_save returns; "
        "ckptd's writer copies the staged state once more, into its slots, on DCP's save thread. To durable: "
        "ckptd's includes the daemon's compression and the commit (index.json fsynced). On disk: ckptd's "
        "byte-plane + zstd codec vs DCP's raw bytes.",
        "",
    ])
    write_results(RESULTS / "dcp_backend", res, md)
    os.sync()


if __name__ == "__main__":
    main()
