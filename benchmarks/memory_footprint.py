"""Host memory per byte of state: ckptd (each mode) vs DCP async_save vs torch_checkpointing, one run.

What frontier users run out of is host memory, so this measures it the way the kernel charges
it: the sum of Pss (``/proc/PID/smaps_rollup``; shared pages split among their users, memfds and
shared memory included) over the trainer's whole process tree — the trainer, a private ckptd
daemon it started, DCP's or torch_checkpointing's helper processes — sampled every 20 ms.

Per method, in a fresh worker process: build a model + AdamW state of ``--mib`` MiB (weights and
both moments, fp32), take one optimizer step, measure the tree (*before*: no checkpointer yet, so
its daemon, stager or writer process and their buffers all count as extra); set the method up
(ckptd: start a private daemon and connect to it; DCP: process group and stager; torch_checkpointing:
its manager) and measure the tree again (*idle*: nothing prepared or saved yet; for ckptd the
trainer plus an idle daemon, and the daemon's own Pss then, *daemon idle*); ckptd then
``prepare``s; then ``--saves`` rounds of save → optimizer step → wait until that save is durable;
1 s later measure again (*steady*). Before every measure the trainer's own heap is trimmed
(``trim_own_heap``), for every method alike.

Reported per byte of state, two ways: steady − before (the daemon's idle Pss counted as extra, as
if the job started the service), and steady − idle (the issue's definition: ckptd's daemon is a
per-node service already running before the job, shared by its ranks, so the baseline is the
trainer plus the idle daemon; for DCP and torch_checkpointing the trainer with the checkpointer
set up). Also the peak during the saves, both ways. Methods run in rounds, interleaved (this
machine's disk slows down after a few GiB), and the medians are kept.

    python benchmarks/memory_footprint.py [--mib 384] [--saves 4] [--rounds 2] [--out results/memory_footprint]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt, machine_info, median, table, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SLOTS = {"ckptd": 2, "ckptd-no-memory": 2, "ckptd-one-slot": 1}      # shared-memory slots each ckptd mode holds
METHODS = {
    "ckptd": "ckptd (default: 2 slots, memory tier on)",
    "ckptd-no-memory": "ckptd, memory.steps = 0",
    "ckptd-one-slot": "ckptd, 1 slot, memory.steps = 0",
    "dcp-async": "DCP async_save (DefaultStager: shared memory, async staging)",
    "tc-async": "torch_checkpointing async CheckpointManager",
}


# ---- measuring ---------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc/*/stat's ppid)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                parent[int(entry)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def pss(pid: int, field: str = "Pss") -> int:
    """Pss (or another smaps_rollup field) of one process in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss(root: int, field: str = "Pss") -> int:
    return sum(pss(p, field) for p in [root, *children(root)])


class Sampler:
    """The tree's peak Pss, sampled every 20 ms on a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, tree_pss(os.getpid()))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# ---- one method in one worker process -----------------------------------------------------------

def build_state(mib: int) -> tuple[Any, Any, int]:
    import torch
    torch.manual_seed(0)
    width = 1024
    params = mib * 2**20 // 12                       # fp32 weights + exp_avg + exp_avg_sq
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))
    return model, opt, state_bytes


def step(model: Any, opt: Any) -> None:
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
    opt.step()


def trim_own_heap() -> None:
    """The trainer's free heap pages back to the kernel before each measure (every method alike):
    glibc keeps the optimizer step's freed temporaries at random, which is no checkpointer's doing
    (±100 MiB between identical runs here). Helper processes are not trimmed: theirs counts."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def worker(method: str, mib: int, saves: int, tmp: Path) -> dict[str, Any]:
    model, opt, state_bytes = build_state(mib)
    gc.collect()
    time.sleep(0.5)
    trim_own_heap()
    before = tree_pss(os.getpid())       # the trainer alone: what the checkpointer adds is all extra
    # The file-backed part (shared libraries' pages, split among every process mapping them, this
    # tree's or not): recorded to tell a change in the node's other processes from the checkpointer's.
    file_pss = {"before": tree_pss(os.getpid(), "Pss_File")}
    sampler = Sampler()
    idle: dict[str, int] = {}

    def set_up(daemon_pid: int | None) -> None:
        """The checkpointer is set up, nothing prepared or saved: the tree, and an idle daemon's own Pss."""
        gc.collect()
        trim_own_heap()
        idle["tree"] = tree_pss(os.getpid())
        file_pss["idle"] = tree_pss(os.getpid(), "Pss_File")
        idle["daemon"] = pss(daemon_pid) if daemon_pid is not None else 0
        idle["pid"] = daemon_pid or 0

    save, close = saver(method, model, opt, tmp, set_up)
    ready = tree_pss(os.getpid())        # set up (ckptd: daemon started, slots allocated), nothing saved yet
    t0 = time.monotonic()
    durable: list[float] = []
    for i in range(1, saves + 1):
        ts = time.monotonic()
        wait = save(i)
        step(model, opt)
        wait()
        durable.append(time.monotonic() - ts)
    seconds = time.monotonic() - t0
    time.sleep(1.0)
    gc.collect()
    trim_own_heap()
    steady = tree_pss(os.getpid())
    file_pss["steady"] = tree_pss(os.getpid(), "Pss_File")
    steady_daemon = pss(idle["pid"]) if idle["pid"] else 0
    peak = max(sampler.stop(), steady)
    close()
    return {"method": method, "state_bytes": state_bytes, "before": before, "idle": idle["tree"],
            "daemon_idle": idle["daemon"], "daemon_steady": steady_daemon, "file_pss": file_pss,
            "ready": ready, "steady": steady,
            "peak": peak, "extra_per_byte": (steady - before) / state_bytes,
            "peak_per_byte": (peak - before) / state_bytes,
            "extra_per_byte_idle": (steady - idle["tree"]) / state_bytes,
            "peak_per_byte_idle": (peak - idle["tree"]) / state_bytes, "seconds": seconds,
            "durable_s": sorted(durable)[len(durable) // 2]}


def saver(method: str, model: Any, opt: Any, tmp: Path, set_up: Any) -> tuple[Any, Any]:
    """(save(step) -> wait(), close()) for one method; ``set_up(daemon pid or None)`` is called once
    it is set up, before anything is prepared or saved."""
    if method.startswith("ckptd"):
        import ckptd_client
        from ckptd.launch import spawn_daemon
        flags = [] if method == "ckptd" else ["--memory-steps", "0"]
        daemon = spawn_daemon(tmp / "root", tmp / "d.sock", *flags)
        ck = ckptd_client.Checkpointer("mem", socket=str(daemon.socket), rank=0, world_size=1,
                                       num_slots=1 if method == "ckptd-one-slot" else 2)
        set_up(daemon.pid)
        state = {"model": model, "optim": opt}
        ck.prepare(state)

        def save_ckptd(i: int) -> Any:
            h = ck.save(i, state)
            return lambda: h.wait(600)

        def close_ckptd() -> None:
            ck.close()
            daemon.stop()
        return save_ckptd, close_ckptd
    import torch
    if method == "dcp-async":
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                              use_async_staging=True, use_non_blocking_copy=False))
        set_up(None)

        def save_dcp(i: int) -> Any:
            res = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                 checkpoint_id=str(tmp / f"dcp-{i}"), async_stager=stager)
            futs = [res] if hasattr(res, "result") else [res.staging_completion, res.upload_completion]
            return lambda: [f.result() for f in futs]

        def close_dcp() -> None:
            stager.close()
            dist.destroy_process_group()
        return save_dcp, close_dcp
    if method == "tc-async":
        from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        # use_direct_io=False: O_DIRECT refuses its unaligned writes on this file system.
        manager = CheckpointManager(CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(), storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        set_up(None)

        def save_tc(i: int) -> Any:
            fut = manager.save(str(tmp / f"tc-{i}"), {"model": model.state_dict(), "optim": opt.state_dict()})
            return lambda: fut.result() if fut is not None else None
        return save_tc, manager.close
    del torch
    raise SystemExit(f"unknown method {method}")


# ---- the run ------------------------------------------------------------------------------------

def available(method: str) -> str | None:
    """Why ``method`` cannot run here, or None."""
    mod = {"tc-async": "torch_checkpointing"}.get(method)
    if mod is None:
        return None
    probe = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True)
    return None if probe.returncode == 0 else f"{mod} is not installed (pip install torch-checkpointing)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=384)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", type=Path, default=RESULTS / "memory_footprint", help="results: OUT.md and OUT.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory(prefix="ckmem-", dir="/tmp") as tmp:
            print(json.dumps(worker(args.worker, args.mib, args.saves, Path(tmp))))
        return
    methods = [m for m in args.methods.split(",") if m]
    missing = {m: why for m in methods if (why := available(m))}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods if m not in missing}
    t0 = time.time()
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for m in order:
            print(f"round {r + 1}/{args.rounds}: {m} ...", file=sys.stderr, flush=True)
            p = subprocess.run([sys.executable, __file__, "--worker", m, "--mib", str(args.mib),
                                "--saves", str(args.saves)], capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"{m} failed:\n{p.stderr[-4000:]}")
            runs[m].append(json.loads(p.stdout.strip().splitlines()[-1]))
    res = {"machine": machine_info("/tmp"), "mib": args.mib, "saves": args.saves, "rounds": args.rounds,
           "wall_s": time.time() - t0, "missing": missing, "runs": runs,
           "median": {m: {k: median([x[k] for x in v]) for k in ("extra_per_byte", "peak_per_byte", "steady",
                                                                  "before", "peak", "state_bytes", "idle",
                                                                  "daemon_idle", "extra_per_byte_idle",
                                                                  "peak_per_byte_idle")}
                      for m, v in runs.items()}}
    for m, v in runs.items():
        res["median"][m].update({k: median([x[k] for x in v]) for k in ("ready", "durable_s")})
    write_results(args.out, res, render(res))
    print(render(res))


def render(res: dict[str, Any]) -> str:
    med = res["median"]
    gib = 2**30
    mib = 2**20

    def beyond(m: str, v: dict[str, Any], base: str) -> str:
        return fmt((v["steady"] - v[base] - SLOTS[m] * v["state_bytes"]) / mib, 0, " MiB") if m in SLOTS else "—"

    rows = [[METHODS[m], fmt(v["extra_per_byte"], 2, "×"), fmt(v["extra_per_byte_idle"], 2, "×"),
             fmt(v["peak_per_byte"], 2, "×"), fmt(v["peak_per_byte_idle"], 2, "×"),
             fmt(v["daemon_idle"] / mib, 0, " MiB") if m in SLOTS else "—",
             fmt((v["steady"] - v["before"]) / gib, 2, " GiB"),
             f"{beyond(m, v, 'before')} / {beyond(m, v, 'idle')}" if m in SLOTS else "—",
             fmt(v["durable_s"], 2, " s")]
            for m, v in med.items()]
    m = res["machine"]
    lines = [
        "# Host memory per byte of state: ckptd vs DCP async_save vs torch_checkpointing",
        "",
        f"Generated by `benchmarks/memory_footprint.py --mib {res['mib']} --saves {res['saves']} --rounds "
        f"{res['rounds']}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"in {res['wall_s']:.0f} s. Machine: {m['cpu']}, {m['cores_available']} cores available, {m['ram_gib']} GiB "
        f"RAM, disk {m['disk']['device']} ({m['disk']['fstype']}), Linux {m['kernel']}, "
        f"torch {m['versions']['torch']}, "
        f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}.",
        f"State: {res['mib']} MiB (fp32 weights + AdamW moments), {res['saves']} saves per run, "
        f"{res['rounds']} rounds interleaved, medians. Pss summed over the trainer's process tree "
        "(the daemon, stagers and helper processes included).",
        "",
        table(["method", "steady extra ÷ state, daemon's idle Pss counted as extra",
               "steady extra ÷ state over trainer + idle daemon", "peak extra ÷ state, daemon's idle Pss counted",
               "peak extra ÷ state over trainer + idle daemon", "daemon idle Pss", "steady extra (idle Pss counted)",
               "steady extra beyond the slots (idle Pss counted / over idle daemon)", "save → committed, median"],
              rows),
        "",
        "Two baselines. *Daemon's idle Pss counted as extra*: extra = tree after the saves − the trainer "
        "alone before any checkpointer was imported or started (as if the job started ckptd's daemon). "
        "*Over trainer + idle daemon*: the issue's definition — ckptd's daemon is a per-node service "
        "running before the job and shared by its ranks — extra = tree after the saves − tree once set up, "
        "before anything was prepared or saved (ckptd: daemon started and connected to; DCP: process group "
        "and stager made; torch_checkpointing: manager made). *Daemon idle Pss*: the daemon process alone "
        "at that moment (its interpreter and imports; shared-library pages split with the trainer).",
        "",
        "*Beyond the slots*: the steady extra less the slots' bytes (ckptd: number of slots × state) —"
        " the daemon process, its buffers, and any copy of a held step.",
    ]
    if res["missing"]:
        lines += ["", "Not run: " + "; ".join(f"{k}: {v}" for k, v in res["missing"].items())]
    if "ckptd" in med and "dcp-async" in med:
        ck, dcp = med["ckptd"], med["dcp-async"]
        lines += ["", "ckptd default ÷ DCP async_save at steady state: "
                      f"{fmt(ck['extra_per_byte'] / max(dcp['extra_per_byte'], 1e-9), 2, '×')} (idle Pss counted), "
                      f"{fmt(ck['extra_per_byte_idle'] / max(dcp['extra_per_byte_idle'], 1e-9), 2, '×')} "
                      "(over trainer + idle daemon)"]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
