"""Restore time vs tensor count, FSDP2: issue 22's "at real tensor counts" for the way back.

The state of ``stall_bench.py --fsdp2``: ~256 MiB (fp32 parameters + AdamW's exp_avg, exp_avg_sq
and step) split into N tensors (N / 4 one-parameter modules, every module and the root under
FSDP2 ``fully_shard`` on one gloo rank: DTensor parameters and optimizer state). Each count is
saved once by each method, then restored in rounds, the methods in an order rotating each round.
Before each restore every tensor of the live model and optimizer is overwritten (outside the
timing); after it every tensor is compared with the saved bytes (bit-exact, outside the timing).
Each restore goes into the live model and optimizer objects, as a job rolling back does:

- *ckptd, from memory*: ``Checkpointer(memory=True, prepare=False).restore({"model": model,
  "optim": opt})``, the step held in the daemon's memory (``last_restore.source == "memory"``);
- *ckptd, from storage*: the same with ``memory=False`` (its files in the page cache);
- *DCP*: ``get_state_dict``, ``dcp.load`` of what ``dcp.save`` wrote, ``set_state_dict`` (what
  torchtitan's CheckpointManager does), warm page cache;
- *torch_checkpointing*: ``get_state_dict``, ``CheckpointManager.load(into=...)`` (in place),
  ``set_state_dict``, warm page cache.

Wall time of each restore call; p50 per method and count. Results: restore_count.md and .json.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharded_bench import local_digest, scramble  # noqa: E402
from stall_bench import build, one_rank_group, over_counts, torch_checkpointing_status  # noqa: E402

from common import RESULTS, fmt, percentile, table, write_results  # noqa: E402

METHODS = ("ckptd-memory", "ckptd-storage", "dcp", "tc")
LABELS = {"ckptd-memory": "ckptd from memory", "ckptd-storage": "ckptd from storage", "dcp": "DCP load",
          "tc": "torch_checkpointing load"}


def objects(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The parameters and the optimizer's state by FQN, as sharded_bench's digest and scramble walk them."""
    named = dict(model.named_parameters())
    return {"model": named, "optim": {k: opt.state[p] for k, p in named.items()}}


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """Every local tensor's bytes (sharded_bench.local_digest) and every param group setting."""
    return local_digest(objects(model, opt)) + repr([{k: v for k, v in g.items() if k != "params"}
                                                     for g in opt.param_groups])


def scramble_all(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Overwrite every tensor and a param group setting, so that a restore that misses one is seen."""
    scramble(objects(model, opt))
    for g in opt.param_groups:
        g["lr"] = 0.5


def restorers(socket: str, root: str, job: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
              workdir: Path) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """(Each method's restore, a close for them all), every method having saved the current state once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckptd_client
    state = {"model": model, "optim": opt}
    ck = ckptd_client.Checkpointer(job, socket=socket, root=root, commit="local")
    ck.save(1, state).wait(600)
    ck.close()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(workdir / "dcp"))
    cks = {m: ckptd_client.Checkpointer(job, socket=socket, root=root, commit="local", prepare=False,
                                        memory=m == "ckptd-memory") for m in ("ckptd-memory", "ckptd-storage")}

    def ckptd(m: str) -> Callable[[], None]:
        def run() -> None:
            assert cks[m].restore(state) == 1
            info = cks[m].last_restore
            assert info is not None and info.source == ("memory" if m == "ckptd-memory" else "storage"), info
        return run

    def dcp_load() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(workdir / "dcp"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    out: dict[str, Callable[[], None]] = {"ckptd-memory": ckptd("ckptd-memory"),
                                          "ckptd-storage": ckptd("ckptd-storage"), "dcp": dcp_load}
    manager: Any = None
    if torch_checkpointing_status() is None:
        torch.multiprocessing.set_sharing_strategy("file_system")   # (as stall_bench: fds run out at 2,048)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        manager = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        manager.save(str(workdir / "tc"), {"model": msd, "optim": osd}).result()

        def tc_load() -> None:
            msd, osd = get_state_dict(model, opt)
            got = manager.load(str(workdir / "tc"), into={"model": msd, "optim": osd})
            set_state_dict(model, opt, model_state_dict=got["model"], optim_state_dict=got["optim"])
        out["tc"] = tc_load

    def close() -> None:
        for c in cks.values():
            c.close()
        if manager is not None:
            manager.close()
    return out, close


def run_count(count: int, cfg: argparse.Namespace, socket: str, root: str, base: Path) -> dict[str, Any]:
    model, opt = build(count, cfg.size_mib, fsdp2=True)
    tensors = sum(1 for _ in model.parameters()) * 4
    workdir = base / f"w{count}"
    workdir.mkdir()
    want = digest(model, opt)
    methods, close = restorers(socket, root, f"restore{count}", model, opt, workdir)
    times: dict[str, list[float]] = {m: [] for m in methods}
    exact = {m: True for m in methods}
    last: dict[str, float] = {}
    names = list(methods)
    try:
        for r in range(cfg.warmup + cfg.rounds):
            for m in names[r % len(names):] + names[:r % len(names)]:
                scramble_all(model, opt)
                gc.collect()
                t0 = time.perf_counter()
                methods[m]()
                took = time.perf_counter() - t0
                exact[m] = exact[m] and digest(model, opt) == want
                last[m] = took
                if r >= cfg.warmup:
                    times[m].append(took)
            print(f"  {count} tensors, round {r + 1}{' (warm-up)' if r < cfg.warmup else ''}: "
                  + ", ".join(f"{m} {t:.3f} s" for m, t in last.items()), flush=True)
    finally:
        close()
    del model, opt
    gc.collect()
    return {"count": count, "tensors": tensors,
            "methods": {m: {"times_s": v, "p50": percentile(v, 50), "bit_exact": exact[m]} for m, v in times.items()}}


def to_markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    la = ", ".join(f"{x:.2f}" for x in m["loadavg_at_start"])
    lines = ["# Restore time vs tensor count, FSDP2", "",
             f"Generated by `benchmarks/restore_count_bench.py` on {res['date']} in {res['wall_s']:.0f} s. Machine: "
             f"{m['cpu']}, {m['cores_available']} cores available, {m['ram_gib']} GiB RAM, "
             f"torch {m['versions']['torch']}, load average at start {la}.", "",
             f"{res['size_mib']} MiB of state (fp32 parameters + AdamW exp_avg, exp_avg_sq, step) split into N "
             "tensors (N / 4 one-parameter modules, every module and the root under FSDP2 fully_shard on one gloo "
             "rank). Each method saved it once; then "
             f"{res['rounds']} measured rounds after {res['warmup']} warm-up, the methods in an order rotating each "
             "round, each restore into the live model and optimizer after every tensor and the learning rate were "
             "overwritten, and checked bit-exact afterwards (outside the timing). ckptd from memory: the step held "
             "in the daemon's memory; from storage and the peers: their files in the page cache. DCP and "
             "torch_checkpointing: get_state_dict, their load (in place), set_state_dict, as torchtitan does.", ""]
    if res["torch_checkpointing"]:
        lines += [f"torch_checkpointing: {res['torch_checkpointing']}", ""]
    present = [k for k in METHODS if any(k in c["methods"] for c in res["counts"])]
    rows = []
    for c in res["counts"]:
        ms = c["methods"]
        row: list[Any] = [c["tensors"]] + [fmt(ms[k]["p50"], 3, " s") if k in ms else "" for k in present]
        for k in ("ckptd-memory", "ckptd-storage"):
            row += [fmt(ms[k]["p50"] / ms[peer]["p50"], 2, "×") if peer in ms else ""
                    for peer in ("dcp", "tc") if peer in present]
        row.append("yes" if all(v["bit_exact"] for v in ms.values()) else "**no**")
        rows.append(row)
    peers = [p for p in ("dcp", "tc") if p in present]
    ratio_heads = [f"{short} ÷ {LABELS[p]}" for short in ("memory", "storage") for p in peers]
    lines.append(table(["tensors", *[f"{LABELS[k]} p50" for k in present], *ratio_heads, "bit-exact"], rows))
    lines += ["", f"Wall time {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--counts", default="16,256,2048,8192")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "restore_count"), help="results path without extension")
    cfg = ap.parse_args()
    torch.set_num_threads(1)
    one_rank_group("ckptd-restore-pg-")
    res: dict[str, Any] = {"size_mib": cfg.size_mib, "rounds": cfg.rounds, "warmup": cfg.warmup,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "torch_checkpointing": torch_checkpointing_status()}
    over_counts(res, cfg.counts, "ckptd-restore-count-", ("--memory-budget", "2GiB"),
                lambda count, socket, root, base: run_count(count, cfg, socket, root, base))
    write_results(Path(cfg.out), res, to_markdown(res))
    return 0 if all(v["bit_exact"] for c in res["counts"] for v in c["methods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
