"""The trainer's stall per save as the tensor count grows, the state's bytes fixed.

    .venv/bin/python benchmarks/stall_bench.py [--size-mib 256] [--counts 16,256,2048,8192] [--rounds 12]

One process, one real daemon (ckptd.launch.spawn_daemon on a temporary root). Per tensor count
the state is an ``nn.Module`` of ``count / 4`` one-parameter blocks (fp32) plus AdamW's state
(``step``, ``exp_avg``, ``exp_avg_sq`` per parameter): ``count`` tensors, ``--size-mib`` in all.
Round by round the methods take turns on the same state:
- ckptd overlapped: ``save(overlap=True)``; stall = save() + fence() after ``--step-ms`` of
  simulated forward/backward (sleep: the CPU idle, as under a GPU);
- DCP ``async_save`` with ``DefaultStager`` and async staging: stall = waiting for the previous
  save's upload (DCP's docs wait before the next save) + async_save() + waiting for its staging
  before the optimizer step mutates the state (DCP's fence);
- torch_checkpointing's async ``CheckpointManager``: when the package is installed (it is not
  installed by this script).
Each save is waited for (committed / uploaded) before the next method's save, so no method's
background work lands in another's stall; then the optimizer step (a slice of every tensor
mutated, its step pre-hook fencing) runs. The first ``--warmup`` saves per method are reported
apart. Then a resumed run: ``restore()`` into a fresh model and optimizer, then a save every
``--steps-before-save`` steps (idle, as above), its first save against the later ones: every one of
them comes after the same gap, so their ratio is what the restore leaves undone (a save after 5 s
idle costs this VM about twice one after 200 ms, whoever saves). Results: benchmarks/results/stall.md
and stall.json.

``--fsdp2``: the same state with every block and the root under FSDP2 ``fully_shard`` (one gloo
rank: DTensor parameters and AdamW state, as a sharded job's rank holds them). ckptd saves the
objects (``{"model": model, "optim": opt}``, keyed by FQN); DCP and torch_checkpointing save what
``get_state_dict(model, opt)`` returns, taken in their save call as torchtitan's wrappers do.
Results: stall_fsdp2.md and .json.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptd.launch import spawn_daemon  # noqa: E402

from common import RESULTS, fmt, machine_info, percentile, table, write_results  # noqa: E402

TOUCH = 4096
TC_MEASURED = ("measured: its async CheckpointManager (use_direct_io=False; torch's file_system sharing "
               "strategy, as file descriptors run out at 2,048 tensors); stall = save() + waiting on manager.lock() "
               "before the optimizer step")


class Block(torch.nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(numel))


class TouchAdamW(torch.optim.AdamW):
    """AdamW's state, built by one real step; later steps mutate a slice of every parameter and
    state tensor (enough for a save that captured a mutated value to differ, without AdamW's cost)."""

    touch_only = False

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if not self.touch_only:
            super().step()
            return
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["step"] += 1
                n = min(TOUCH, p.numel())
                for t in (p, st["exp_avg"], st["exp_avg_sq"]):
                    local(t).view(-1)[:n].mul_(0.999).add_(1e-6)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (--fsdp2), else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def build(count: int, size_mib: int, seed: int = 0, fsdp2: bool = False) -> tuple[torch.nn.Module, TouchAdamW]:
    """``count`` tensors (count / 4 parameters, each with AdamW's three state tensors), ~size_mib;
    ``fsdp2``: every block and the root under ``fully_shard`` on a one-rank mesh."""
    params = max(1, count // 4)
    numel = max(1, size_mib * 2**20 // 12 // params)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(Block(numel) for _ in range(params))
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local(p).normal_(0, 0.02, generator=g)
            p.grad = torch.zeros_like(p)
            local(p.grad).copy_(torch.randn(local(p).shape, generator=g) * 1e-3)
    opt = TouchAdamW(model.parameters(), lr=1e-3)
    opt.step()
    for p in model.parameters():
        p.grad = None
    opt.touch_only = True
    return model, opt


class CkptdOverlap:
    label = "ckptd overlapped"

    def __init__(self, socket: str, root: str, job: str) -> None:
        from ckptd_client import Checkpointer
        self.ck = Checkpointer(job, socket=socket, root=root, commit="local", overlap=True)
        self.handle: Any = None
        self.setups: list[float] = []            # each save's setup_s (connecting, allocating slots)

    def prepare(self, state: dict[str, Any]) -> None:
        self.ck.prepare(state)

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.handle = self.ck.save(step, state)
        self.setups.append(self.handle.setup_s)

    def fence(self) -> None:
        self.ck.fence()

    def settle(self) -> None:
        self.handle.wait(600)

    def close(self) -> None:
        self.ck.close()


class DcpAsyncStaged:
    label = "DCP async_save (DefaultStager, async staging)"

    def __init__(self, workdir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.dcp = dcp
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=True, use_non_blocking_copy=cuda))
        self.workdir = workdir
        self.resp: Any = None
        self.done: list[Path] = []

    def prepare(self, state: dict[str, Any]) -> None:
        pass

    def _wait_upload(self) -> None:
        if self.resp is not None:
            fut = getattr(self.resp, "upload_completion", self.resp)
            fut.result()
            self.resp = None
            while len(self.done) > 2:
                shutil.rmtree(self.done.pop(0), ignore_errors=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        self._wait_upload()
        path = self.workdir / f"dcp-{step}"
        self.resp = self.dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)
        self.done.append(path)

    def fence(self) -> None:
        staging = getattr(self.resp, "staging_completion", None)
        if staging is not None:
            staging.result()

    def settle(self) -> None:
        self._wait_upload()

    def close(self) -> None:
        self._wait_upload()
        self.stager.close()


class TorchCheckpointing:
    """torch_checkpointing's async ``CheckpointManager`` (its default: staging copies on a
    thread, writes in a subprocess), plain files (``use_direct_io=False``). Its fence is
    ``manager.lock()``, which the optimizer step is wrapped in: it waits while staging runs."""
    label = "torch_checkpointing CheckpointManager (async)"

    def __init__(self, workdir: Path) -> None:
        # It hands every staged storage to its writer process; by file descriptor (torch's
        # default) a few saves of 2,048 tensors exceed 20,000 open files.
        torch.multiprocessing.set_sharing_strategy("file_system")
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        self.manager = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        self.workdir = workdir
        self.write: Any = None
        self.done: list[Path] = []

    def prepare(self, state: dict[str, Any]) -> None:
        self.manager.prewarm_staging(self.payload(state))

    @staticmethod
    def payload(state: dict[str, Any]) -> dict[str, Any]:
        return {k: v.state_dict() for k, v in state.items()}

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.settle()
        path = self.workdir / f"tc-{step}"
        self.write = self.manager.save(str(path), self.payload(state))
        self.done.append(path)

    def fence(self) -> None:
        with self.manager.lock():
            pass

    def settle(self) -> None:
        if self.write is not None:
            self.write.result()
            self.write = None
            while len(self.done) > 2:
                shutil.rmtree(self.done.pop(0), ignore_errors=True)

    def close(self) -> None:
        self.settle()
        self.manager.close()


class FqnState:
    """What DCP and torch_checkpointing save of an FSDP2 model (--fsdp2): ``get_state_dict``'s
    FQN-keyed dicts, taken when the save asks (torchtitan's ModelWrapper / OptimizersContainer)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, part: str) -> None:
        self.model, self.opt, self.part = model, opt, part

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        if self.part == "model":
            return get_model_state_dict(self.model)
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise NotImplementedError("the stall benchmark does not load through DCP")


def torch_checkpointing_status() -> str | None:
    """None when torch_checkpointing can be imported, else why it is not in the table."""
    if importlib.util.find_spec("torch_checkpointing") is None:
        return "torch_checkpointing is not installed (pip install torch-checkpointing); not measured"
    return None


def measure(method: Any, state: dict[str, Any], opt: TouchAdamW, first_step: int, saves: int,
            step_s: float) -> list[float]:
    """Stall (save + fence) of ``saves`` saves, each settled before the optimizer step. With
    --fsdp2, ``state`` is ckptd's and DCP / torch_checkpointing get ``get_state_dict``'s (FqnState)."""
    out = []
    for i in range(saves):
        mine = state if isinstance(method, CkptdOverlap) or "fqn" not in state else state["fqn"]
        mine = {k: v for k, v in mine.items() if k != "fqn"}
        t0 = time.perf_counter()
        method.save(first_step + i, mine)
        s = time.perf_counter() - t0
        time.sleep(step_s)                     # forward/backward
        t0 = time.perf_counter()
        method.fence()
        out.append(s + time.perf_counter() - t0)
        method.settle()
        opt.step()
    return out


def run_count(count: int, cfg: argparse.Namespace, socket: str, root: str, base: Path) -> dict[str, Any]:
    model, opt = build(count, cfg.size_mib, fsdp2=cfg.fsdp2)
    state: dict[str, Any] = {"model": model, "optim": opt}
    if cfg.fsdp2:
        state["fqn"] = {"model": FqnState(model, opt, "model"), "optim": FqnState(model, opt, "optim")}
    tensors = sum(1 for _ in model.parameters()) * 4
    raw = sum(p.numel() * 4 * 3 + 4 for p in model.parameters())
    job = f"stall{count}"
    workdir = base / f"dcp{count}"
    workdir.mkdir()
    methods: dict[str, Any] = {"ckptd": CkptdOverlap(socket, root, job), "dcp": DcpAsyncStaged(workdir)}
    if torch_checkpointing_status() is None:
        methods["tc"] = TorchCheckpointing(workdir)
    for name, m in methods.items():
        m.prepare(state if name == "ckptd" or "fqn" not in state else state["fqn"])
    stalls: dict[str, list[float]] = {k: [] for k in methods}
    step = 1
    for r in range(cfg.warmup + cfg.rounds):
        for name, m in methods.items():
            stalls[name] += measure(m, state, opt, step, 1, cfg.step_ms / 1000)
            step += 1
        print(f"  {count} tensors, round {r + 1}: " + ", ".join(f"{k} {1e3 * v[-1]:.1f} ms" for k, v in stalls.items()),
              flush=True)
    for m in methods.values():
        m.close()

    # A resumed run: a fresh model and optimizer (no state yet) restored from the last step, then saved.
    model2, opt2 = build(count, cfg.size_mib, seed=1, fsdp2=cfg.fsdp2)
    state2 = {"model": model2, "optim": opt2}
    ck2 = CkptdOverlap(socket, root, job)
    t0 = time.perf_counter()
    ck2.ck.restore(state2)
    restore_s = time.perf_counter() - t0
    opt2.touch_only = True
    after: list[float] = []
    for i in range(cfg.after_restore):     # a save every --steps-before-save steps, the first one too:
        time.sleep(cfg.steps_before_save * cfg.step_ms / 1000)   # first / later compares saves after the same gap
        after += measure(ck2, state2, opt2, step + i, 1, cfg.step_ms / 1000)
    first_setup = ck2.setups[0]
    ck2.close()
    del model, opt, state, model2, opt2, state2
    gc.collect()
    w = cfg.warmup
    res: dict[str, Any] = {"count": count, "tensors": tensors, "raw_bytes": raw, "restore_s": restore_s,
                           "after_restore_stall_s": after, "after_restore_setup_s": first_setup}
    for name, v in stalls.items():
        res[name] = {"warmup_stall_s": v[:w], "stall_s": v[w:], "p50": percentile(v[w:], 50),
                     "p99": percentile(v[w:], 99)}
    return res


def one_rank_group(prefix: str) -> None:
    """One gloo rank (for FSDP2 on a one-rank mesh), meeting itself through a file."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix=prefix)}", rank=0, world_size=1)


def over_counts(res: dict[str, Any], counts: str, prefix: str, daemon_args: Sequence[str],
                run: Callable[[int, str, str, Path], dict[str, Any]]) -> None:
    """``run(count, socket, root, scratch)`` for each count of ``counts`` ("16,256,…"), against one daemon
    (``daemon_args``) in a scratch directory under /tmp, removed after: ``res`` gets the machine, each
    count's result and the wall time."""
    t_start = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    res["machine"], res["counts"] = machine_info(base), []
    try:
        with spawn_daemon(base / "root", base / "d.sock", *daemon_args) as d:
            for count in (int(x) for x in counts.split(",")):
                res["counts"].append(run(count, str(d.socket), str(base / "root"), base))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t_start


def to_markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = ["# Stall per save vs tensor count" + (", FSDP2" if res.get("fsdp2") else ""), "",
             f"{res['size_mib']} MiB of state (fp32 parameters + AdamW exp_avg, exp_avg_sq, step) split into N "
             "tensors (N / 4 one-parameter modules"
             + ("; every module and the root under FSDP2 fully_shard on one gloo rank: DTensor parameters and "
                "optimizer state; ckptd saves the objects, DCP and torch_checkpointing get_state_dict's dicts taken "
                "in their save call" if res.get("fsdp2") else "") + "); "
             f"{res['rounds']} measured saves per method and count after {res['warmup']} warm-up, methods interleaved "
             f"round by round, each save settled before the next; {res['step_ms']} ms of idle \"forward/backward\" "
             "between save and fence. Stall = save() + fence() (ckptd overlapped); waiting for the previous upload + "
             "async_save() + waiting for staging before the optimizer step (DCP).", "",
             f"Machine: {m['cpu']}, {m['cores_available']} cores available, {m['ram_gib']} GiB RAM, "
             f"torch {m['versions']['torch']}, load average at start {m['loadavg_at_start']}.", "",
             f"torch_checkpointing: {res['torch_checkpointing'] or TC_MEASURED}", ""]
    peers = [(k, lab) for k, lab in (("dcp", "DCP"), ("tc", "torch_checkpointing")) if k in res["counts"][0]]
    headers = ["tensors", "ckptd p50 ms", "ckptd p99 ms"]
    for _, lab in peers:
        headers += [f"{lab} p50 ms", f"{lab} p99 ms", f"ckptd/{lab} p50", f"ckptd/{lab} p99"]
    rows = []
    for r in res["counts"]:
        c = r["ckptd"]
        row = [r["tensors"], fmt(1e3 * c["p50"], 2), fmt(1e3 * c["p99"], 2)]
        for k, _ in peers:
            d = r[k]
            row += [fmt(1e3 * d["p50"], 2), fmt(1e3 * d["p99"], 2), fmt(c["p50"] / d["p50"], 2, "×"),
                    fmt(c["p99"] / d["p99"], 2, "×")]
        rows.append(row)
    lines.append(table(headers, rows))
    gap = res.get("steps_before_save", 1)
    lines += ["", "A resumed run: `restore()` into a fresh model and optimizer (restore prepares the slots in the "
              f"background by default), then a save every {gap} steps of {res['step_ms']} ms (idle), the first one "
              f"too, ckptd overlapped. Every save of it comes after the same {gap} steps, so *first / later* is what "
              "the restore leaves to the first save; the measured saves above come 200 ms apart (on this VM a save "
              "after seconds of idle costs about twice one after 200 ms, whoever saves):", ""]
    rows = []
    for r in res["counts"]:
        a = r["after_restore_stall_s"]
        later = percentile(a[1:], 50) if len(a) > 1 else float("nan")
        rows.append([r["tensors"], fmt(r["restore_s"], 2, " s"), fmt(1e3 * a[0], 2),
                     fmt(1e3 * r.get("after_restore_setup_s", float("nan")), 2), fmt(1e3 * later, 2),
                     fmt(a[0] / later, 2, "×"),
                     " / ".join(fmt(1e3 * x, 1) for x in r["ckptd"]["warmup_stall_s"])])
    lines.append(table(["tensors", "restore", "first save after restore ms", "of it setup ms",
                        "later saves, same gap, p50 ms", "first / later",
                        "warm-up saves of the first run ms"], rows))
    lines += ["", f"Wall time {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--counts", default="16,256,2048,8192")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--after-restore", type=int, default=6)
    ap.add_argument("--step-ms", type=int, default=200)
    ap.add_argument("--steps-before-save", type=int, default=25,
                    help="training steps a resumed run takes before each of its saves")
    ap.add_argument("--fsdp2", action="store_true", help="the state under FSDP2 on one gloo rank (see above)")
    ap.add_argument("--out", default=None, help="results path without extension (default results/stall[_fsdp2])")
    cfg = ap.parse_args()
    cfg.out = cfg.out or str(RESULTS / ("stall_fsdp2" if cfg.fsdp2 else "stall"))
    torch.set_num_threads(1)
    if cfg.fsdp2:
        one_rank_group("ckptd-stall-pg-")
    res: dict[str, Any] = {"size_mib": cfg.size_mib, "rounds": cfg.rounds, "warmup": cfg.warmup, "fsdp2": cfg.fsdp2,
                           "step_ms": cfg.step_ms, "steps_before_save": cfg.steps_before_save,
                           "torch_checkpointing": torch_checkpointing_status()}
    print(f"torch_checkpointing: {res['torch_checkpointing'] or 'measured'}", flush=True)
    over_counts(res, cfg.counts, "ckptd-stall-", ("--keep-last", "2"),
                lambda count, socket, root, base: run_count(count, cfg, socket, root, base))
    write_results(Path(cfg.out), res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
