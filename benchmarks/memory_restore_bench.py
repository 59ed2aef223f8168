"""Restore from the daemon's memory tier vs from storage vs DCP ``load`` vs a plain memcpy, one run.

State: one rank's shard of ``--mib`` MiB (default 1024) of fp32 GPT-style weights in 8 tensors,
restored in place into the same pre-allocated tensors by every method:

- ``memcpy``: ``ctypes.memmove`` of the same bytes from a second in-memory copy, tensor by
  tensor, one thread: the floor the issue measures the memory tier against;
- ``ckptd memory``: ``Checkpointer.restore`` served by the daemon's memory tier (memfd over
  SCM_RIGHTS, mapped populated and copied into the tensors, every chunk's xxh3 checked, state applied);
- ``ckptd storage``: ``Checkpointer(memory=False).restore``, data files in the page cache (warm);
- ``ckptd storage (cold)``: the same after ``posix_fadvise(DONTNEED)`` on the step's data files;
- ``DCP load``: ``torch.distributed.checkpoint.load`` of the same state saved by ``dcp.save``,
  warm page cache.

Rounds interleave the methods (order rotating each round); medians are reported with ratios to
memcpy and between methods. Every restore is checked bit-exact outside the timing.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptd_client  # noqa: E402
from ckptd.launch import spawn_daemon  # noqa: E402

from common import (  # noqa: E402
    RESULTS,
    daemon_shared_memory,
    fmt,
    machine_info,
    median,
    synthetic_weights,
    table,
    write_results,
)

METHODS = ("memcpy", "ckptd memory", "ckptd storage", "ckptd storage (cold)", "DCP load")
TARGET = 2.0           # the issue: memory-tier restore ≤ 2× a plain memcpy


def make_state(mib: int, n: int = 8) -> dict[str, torch.Tensor]:
    per = mib * 2**20 // 4 // n
    return {f"layer{i}.weight": synthetic_weights(per, torch.float32, seed=i) for i in range(n)}


def memmove(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
    for k, t in src.items():
        ctypes.memmove(dst[k].data_ptr(), t.data_ptr(), t.numel() * t.element_size())


def drop_cache(step_dir: Path) -> None:
    for data in step_dir.glob("rank-*.data"):
        fd = os.open(data, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    a = p.parse_args()
    import torch.distributed.checkpoint as dcp

    started = time.monotonic()
    base = Path(a.dir or tempfile.mkdtemp(prefix="ckptd-membench-"))
    base.mkdir(parents=True, exist_ok=True)
    info = machine_info(base)
    source = make_state(a.mib)
    live = {k: torch.zeros_like(v) for k, v in source.items()}
    daemon = spawn_daemon(base / "root", base / "d.sock", "--memory-budget", f"{2 * a.mib + 256}MiB")
    info["daemon_shared_memory"] = daemon_shared_memory(daemon.socket)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    try:
        ck = ckptd_client.Checkpointer("bench", socket=str(daemon.socket))
        ck.save(1, source).wait(600)
        ck.close()
        dcp_dir = base / "dcp"
        dcp.save(dict(source), checkpoint_id=str(dcp_dir))
        step_dir = base / "root" / "bench" / "step-000000000001"
        mem = ckptd_client.Checkpointer("bench", socket=str(daemon.socket))
        sto = ckptd_client.Checkpointer("bench", socket=str(daemon.socket), memory=False)

        def run(method: str) -> None:
            if method == "memcpy":
                memmove(live, source)
            elif method == "ckptd memory":
                mem.restore(live, 1)
                assert mem.last_restore is not None and mem.last_restore.source == "memory", mem.last_restore
            elif method.startswith("ckptd storage"):
                sto.restore(live, 1)
            else:
                dcp.load(live, checkpoint_id=str(dcp_dir))

        for r in range(a.rounds + 1):                  # round 0 warms up
            order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
            for method in order:
                for t in live.values():
                    t.zero_()
                if method.endswith("(cold)"):
                    drop_cache(step_dir)
                t0 = time.perf_counter()
                run(method)
                dt = time.perf_counter() - t0
                assert all(torch.equal(live[k], source[k]) for k in source), f"{method}: not bit-exact"
                if r:
                    times[method].append(dt)
            print(f"round {r}: " + ", ".join(f"{m} {times[m][-1] * 1e3:.0f} ms" for m in METHODS if r), flush=True)
    finally:
        daemon.stop()
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    med = {m: median(v) for m, v in times.items()}
    gib = a.mib / 1024
    rows = [[m, fmt(med[m] * 1e3, 1, " ms"), fmt(gib / med[m], 2, " GiB/s"), fmt(med[m] / med["memcpy"], 2, "×"),
             fmt(min(times[m]) * 1e3, 1, " ms"), fmt(max(times[m]) * 1e3, 1, " ms")] for m in METHODS]
    ratio = med["ckptd memory"] / med["memcpy"]
    paired = median([m / c for m, c in zip(times["ckptd memory"], times["memcpy"], strict=True)])
    head = [["memory-tier restore ÷ plain memcpy", fmt(ratio, 2, "×"), f"≤ {TARGET:g}×",
             "**met**" if ratio <= TARGET else "**not met**"],
            ["the same, paired by round (median of each round's ratio)", fmt(paired, 2, "×"), f"≤ {TARGET:g}×",
             "**met**" if paired <= TARGET else "**not met**"],
            ["memory-tier restore ÷ ckptd storage restore (warm cache)",
             fmt(med["ckptd memory"] / med["ckptd storage"], 3, "×"), "—", ""],
            ["memory-tier restore ÷ ckptd storage restore (cold cache)",
             fmt(med["ckptd memory"] / med["ckptd storage (cold)"], 3, "×"), "—", ""],
            ["memory-tier restore ÷ DCP load (warm cache)",
             fmt(med["ckptd memory"] / med["DCP load"], 3, "×"), "—", ""]]
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    wall = time.monotonic() - started
    la = ", ".join(f"{x:.2f}" for x in info["loadavg_at_start"])
    md = "\n\n".join([
        "# ckptd memory-tier restore benchmark",
        f"Generated by `benchmarks/memory_restore_bench.py` on {when} in {wall:.0f} s. Machine: {info['cpu']}, "
        f"{info['cores_available']} cores available (a shared VM: other jobs ran on it), {info['ram_gib']} GiB RAM, "
        f"disk {info['disk']['device']} ({info['disk']['fstype']}), Linux {info['kernel']}, torch "
        f"{info['versions']['torch']}, load average at start {la}, shared memory's huge pages "
        f"(transparent_hugepage/shmem_enabled) {info['shmem_huge_pages']}; the daemon's shared memory pages: "
        f"{info['daemon_shared_memory']}.",
        f"State: one rank's shard of {a.mib} MiB (8 fp32 tensors of GPT-style N(0, 0.02²) weights), restored in "
        f"place into the same tensors by every method. {a.rounds} measured rounds after 1 warm-up, methods "
        "interleaved in an order rotating each round; medians; every restore checked bit-exact.",
        "## Headline", table(["figure", "value", "target", "verdict"], head),
        "## All methods", table(["method", "p50", "throughput", "÷ memcpy", "min", "max"], rows),
        "`memcpy` is `ctypes.memmove` per tensor on one thread. `ckptd memory` is the whole "
        "`Checkpointer.restore` (connect, `memory_fetch`, the memfd by SCM_RIGHTS, read with `preadv` "
        "straight into the tensors on the restore threads, xxh3 of every chunk, state applied). Storage restores read "
        "what the daemon wrote: with its default `codec_mode = \"adaptive\"` on this disk, raw chunks, read "
        "straight into the tensors; `(cold)` drops the step's data files from the page cache first "
        "(`posix_fadvise`).",
    ]) + "\n"
    res: dict[str, Any] = {"machine": info, "mib": a.mib, "rounds": a.rounds, "times_s": times, "median_s": med,
                           "ratio_memory_to_memcpy": ratio, "ratio_paired": paired, "wall_s": wall}
    write_results(RESULTS / "memory_restore", res, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
