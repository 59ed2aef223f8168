"""ckptd against torch.save and torch.distributed.checkpoint, side by side, in one run.

    .venv/bin/python benchmarks/run.py [--quick] [--size-mib N] [--compute sleep|matmul] ...

What it measures, per state and method, in a simulated training loop (``--step-ms`` of
"compute" per iteration, a save every ``--save-every`` iterations, an "optimizer step" that
mutates every tensor after each iteration's fence):
- stall: what the trainer waits per save — save() for blocking methods; save() + fence()
  for ckptd overlapped; async_save() plus any wait for the previous save for DCP async.
  p50 and p99 over the measured saves (after ``--warmup`` saves);
- time to committed/durable, from the save call; bytes on disk of one step;
- restore time into the live (scrambled) state, verified bit-exact against a digest taken
  at the last save (the files are in the page cache by then: this is decode + copy speed);
- peak RSS of the trainer process, and of the daemon for ckptd.
Methods: ckptd blocking copy; ckptd overlapped (``save(..., overlap=True)`` + ``fence()``);
``torch.save`` + fsync + rename; DCP ``save``;
DCP ``async_save`` with a shared-memory ``DefaultStager`` (staging in the call:
``use_async_staging=False``; stall_bench.py and sharded_bench.py also measure DCP's async staging,
which hides part of its copy as ckptd's overlap does).
States: a synthetic GPT (bf16 weights, fp32 master weights and Adam moments; ``--size-mib``),
the real all-MiniLM-L6-v2 weights in fp32 and in bf16. Then several ranks (``--ranks``
client processes, commit="local") on one daemon for aggregate throughput, and the codec
micro-benchmark (benchmarks/codec_bench.py).

Each method runs in its own subprocess (clean RSS, no shared warm state) against a fresh
daemon. Results: benchmarks/results/latest.md and latest.json (``--out`` to change).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptd.launch import DaemonProcess, spawn_daemon  # noqa: E402

import codec_bench  # noqa: E402
from common import (  # noqa: E402
    RESULTS,
    MissingBenchDependency,
    fmt,
    machine_info,
    median,
    minilm_path,
    minilm_weights,
    percentile,
    table,
    write_results,
)

HERE = Path(__file__).resolve()
METHODS = ("ckptd-blocking", "ckptd-overlap", "torch-save", "dcp-save", "dcp-async")
LABELS = {"ckptd-blocking": "ckptd, blocking copy", "ckptd-overlap": "ckptd, overlapped",
          "torch-save": "torch.save + fsync", "dcp-save": "DCP save",
          "dcp-async": "DCP async_save (shm stager)"}
PEERS = ("torch-save", "dcp-save", "dcp-async")


# ---- training state ------------------------------------------------------------------

class GPT(torch.nn.Module):
    """GPT-2-shaped: tied token embedding, learned positions, pre-LN blocks, final LN."""

    def __init__(self, d: int, layers: int, vocab: int, ctx: int) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "ln1": torch.nn.LayerNorm(d), "qkv": torch.nn.Linear(d, 3 * d), "proj": torch.nn.Linear(d, d),
            "ln2": torch.nn.LayerNorm(d), "fc": torch.nn.Linear(d, 4 * d), "out": torch.nn.Linear(4 * d, d),
        }) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)


class Weights(torch.nn.Module):
    """A module holding given tensors as parameters (for loaded checkpoints such as MiniLM)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t, requires_grad=False))


class SimOptimizer(torch.optim.Optimizer):
    """Adam-shaped state (step, exp_avg, exp_avg_sq per fp32 master parameter) whose ``step()``
    mutates a slice of every state tensor and refreshes the low-precision model copy: enough
    for a save that captured a mutated value to be caught, without a real optimizer's cost."""

    TOUCH = 4096

    def __init__(self, master: Sequence[torch.Tensor], model: Sequence[torch.Tensor], moments: bool, seed: int) -> None:
        super().__init__(master, {"lr": 1e-3})
        self._model = dict(zip(map(id, master), model, strict=True))
        g = torch.Generator().manual_seed(seed + 1)
        if moments:
            for p in master:
                m = torch.randn(p.shape, generator=g) * 1e-3
                self.state[p] = {"step": torch.tensor(100.0), "exp_avg": m,
                                 "exp_avg_sq": (torch.randn(p.shape, generator=g) * 1e-3) ** 2}

    @torch.no_grad()
    # torch types step() as two overloads (no closure → None, closure → float); this one never takes a closure.
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                n = min(self.TOUCH, p.numel())
                st = self.state.get(p)
                if st:
                    st["step"] += 1
                    st["exp_avg"].view(-1)[:n].mul_(0.9).add_(1e-4)
                    st["exp_avg_sq"].view(-1)[:n].mul_(0.999).add_(1e-8)
                p.view(-1)[:n].sub_(group["lr"] * 1e-2)
                low = self._model[id(p)]
                if low is not p:
                    low.view(-1)[:n].copy_(p.view(-1)[:n])


@dataclass
class TrainState:
    description: str
    model: torch.nn.Module
    master: torch.nn.Module | None
    opt: SimOptimizer

    def objects(self) -> dict[str, Any]:
        """What every method saves: the same Stateful objects for all of them."""
        out: dict[str, Any] = {"model": self.model, "optim": self.opt}
        if self.master is not None:
            out["master"] = self.master
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k, obj in self.objects().items():
            if isinstance(obj, torch.nn.Module):
                for name, t in obj.state_dict().items():
                    yield f"{k}/{name}", t
        for i, st in enumerate(self.opt.state.values()):
            for name, t in st.items():
                yield f"optim/{i}/{name}", t

    @property
    def raw_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    def digest(self) -> str:
        h = xxhash.xxh3_128()
        for name, t in self.tensors():
            h.update(name.encode())
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        return h.hexdigest()

    def scramble(self) -> None:
        """Overwrite every tensor, so that a restore that loads nothing is caught."""
        with torch.no_grad():
            for _, t in self.tensors():
                t.reshape(-1).view(torch.uint8).fill_(0x5A)


def gpt_dims(size_bytes: int) -> tuple[int, int, int, int]:
    """(d_model, layers, vocab, ctx) whose 14 bytes/parameter state is close to ``size_bytes``."""
    params = size_bytes / 14          # bf16 weight + fp32 master, exp_avg, exp_avg_sq
    d = 1024 if params >= 150e6 else 768 if params >= 40e6 else 512 if params >= 8e6 else 256
    vocab, ctx = (8192, 1024) if d >= 512 else (2048, 256)
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round((params - (vocab + ctx + 2) * d) / per_layer))
    return d, layers, vocab, ctx


def build_state(kind: str, size_mib: int, seed: int = 0) -> TrainState:
    """The same state for every method (deterministic in ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gpt":
        d, layers, vocab, ctx = gpt_dims(size_mib * 2**20)
        with torch.device("meta"):
            master = GPT(d, layers, vocab, ctx)
        master = master.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in master.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)
        for p in master.parameters():
            p.requires_grad_(False)
        model = _bf16_copy(master)
        opt = SimOptimizer(list(master.parameters()), list(model.parameters()), moments=True, seed=seed)
        n = sum(p.numel() for p in master.parameters())
        return TrainState(f"synthetic GPT (d={d}, {layers} layers, {n / 1e6:.1f} M params): bf16 weights, "
                          "fp32 master weights, fp32 Adam exp_avg and exp_avg_sq", model, master, opt)
    if kind in ("minilm-fp32", "minilm-bf16"):
        dtype = torch.float32 if kind.endswith("fp32") else torch.bfloat16
        model = Weights(minilm_weights(dtype))
        params = list(model.parameters())
        opt = SimOptimizer(params, params, moments=False, seed=seed)
        n = sum(p.numel() for p in params)
        return TrainState(f"all-MiniLM-L6-v2 weights ({n / 1e6:.1f} M params) in {str(dtype)[6:]}", model, None, opt)
    raise ValueError(f"unknown state kind {kind!r}")


def _bf16_copy(master: torch.nn.Module) -> torch.nn.Module:
    """The bf16 model that mixed-precision training keeps next to its fp32 master weights."""
    model = copy.deepcopy(master).to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def compute(seconds: float, mode: str) -> None:
    """Simulated forward/backward: idle CPU (``sleep``, like a GPU job) or one busy core (``matmul``)."""
    if mode == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    a = torch.randn(256, 256)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes of a file, or of every file under a directory."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# ---- methods ------------------------------------------------------------------------

class Method:
    """One way of checkpointing, driven by the training loop in ``run_loop``."""

    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        self.spec = spec
        self.workdir = workdir
        self.committed: dict[int, float] = {}     # step → seconds from the save call to durable

    def unavailable(self) -> str | None:
        return None

    def setup(self, ts: TrainState) -> None:
        pass

    def save(self, step: int, ts: TrainState) -> None:
        raise NotImplementedError

    def fence(self) -> None:
        pass

    def finish(self) -> None:
        """Wait for every save in flight."""

    def step_bytes(self, step: int) -> int:
        raise NotImplementedError

    def restore(self, step: int, ts: TrainState) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Ckptd(Method):
    def __init__(self, spec: dict[str, Any], workdir: Path, overlap: bool) -> None:
        super().__init__(spec, workdir)
        from ckptd_client import Checkpointer
        self.overlap = overlap
        self.Checkpointer = Checkpointer
        self.handles: dict[int, Any] = {}
        self.ck: Any = None
        self.root = spec["root"]
        self.job = spec.get("job", "bench")

    def setup(self, ts: TrainState) -> None:
        self.ck = self.Checkpointer(self.job, socket=self.spec["socket"], root=self.root,
                                    rank=self.spec.get("rank", 0), world_size=self.spec.get("world_size", 1),
                                    commit="local")
        self.ck.prepare(ts.objects())

    def save(self, step: int, ts: TrainState) -> None:
        self.handles[step] = self.ck.save(step, ts.objects(), overlap=self.overlap)

    def fence(self) -> None:
        if self.overlap:
            self.ck.fence()

    def finish(self) -> None:
        self.ck.wait()
        for step, h in self.handles.items():
            if h.committed and h.committed_s is not None:
                self.committed[step] = h.committed_s

    def step_bytes(self, step: int) -> int:
        from ckptd.core.names import step_dir
        return dir_bytes(step_dir(self.root, self.job, step))

    def restore(self, step: int, ts: TrainState) -> None:
        # From its files, as every peer reads its own: through the saving Checkpointer the daemon's memory
        # tier (on by default) served it instead (benchmarks/memory_restore_bench.py measures that path).
        reader = self.Checkpointer(self.job, socket=self.spec["socket"], root=self.root, memory=False,
                                   prepare=False, rank=self.spec.get("rank", 0),
                                   world_size=self.spec.get("world_size", 1), commit="local")
        try:
            reader.restore(ts.objects(), step=step)
            assert reader.last_restore is not None
            self.restore_source = reader.last_restore.source
        finally:
            reader.close()

    def close(self) -> None:
        if self.ck is not None:
            self.ck.close()


class Retained:
    """Peers' checkpoints on disk: keeps the newest two durable ones (like ckptd --keep-last 2)."""

    def __init__(self) -> None:
        self.paths: deque[tuple[int, Path]] = deque()

    def add(self, step: int, path: Path) -> None:
        self.paths.append((step, path))
        while len(self.paths) > 2:
            _, old = self.paths.popleft()
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)


class TorchSave(Method):
    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        super().__init__(spec, workdir)
        self.kept = Retained()

    def path(self, step: int) -> Path:
        return self.workdir / f"step-{step}.pt"

    def save(self, step: int, ts: TrainState) -> None:
        t0 = time.monotonic()
        final = self.path(step)
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save({k: v.state_dict() for k, v in ts.objects().items()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        dfd = os.open(self.workdir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.committed[step] = time.monotonic() - t0
        self.kept.add(step, final)

    def step_bytes(self, step: int) -> int:
        return dir_bytes(self.path(step))

    def restore(self, step: int, ts: TrainState) -> None:
        loaded = torch.load(self.path(step), weights_only=True)
        for k, obj in ts.objects().items():
            obj.load_state_dict(loaded[k])


class DcpSave(Method):
    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        super().__init__(spec, workdir)
        import torch.distributed.checkpoint as dcp
        self.dcp = dcp
        self.kept = Retained()

    def path(self, step: int) -> Path:
        return self.workdir / f"step-{step}"

    def save(self, step: int, ts: TrainState) -> None:
        t0 = time.monotonic()
        self.dcp.save(ts.objects(), checkpoint_id=str(self.path(step)))
        self.committed[step] = time.monotonic() - t0
        self.kept.add(step, self.path(step))

    def step_bytes(self, step: int) -> int:
        return dir_bytes(self.path(step))

    def restore(self, step: int, ts: TrainState) -> None:
        self.dcp.load(ts.objects(), checkpoint_id=str(self.path(step)))


class DcpAsync(DcpSave):
    """``async_save`` with the shared-memory stager; like DCP's docs, each save first waits for
    the previous one (that wait is part of the stall)."""

    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        super().__init__(spec, workdir)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                   use_async_staging=False, use_non_blocking_copy=False))
        self.pending: tuple[int, Any] | None = None

    def save(self, step: int, ts: TrainState) -> None:
        self._wait_pending()
        t0 = time.monotonic()
        fut = self.dcp.async_save(ts.objects(), checkpoint_id=str(self.path(step)), async_stager=self.stager)
        fut.add_done_callback(lambda _f, s=step: self.committed.__setitem__(s, time.monotonic() - t0))
        self.pending = (step, fut)

    def _wait_pending(self) -> None:
        if self.pending is not None:
            step, fut = self.pending
            fut.result()
            self.pending = None
            self.kept.add(step, self.path(step))

    def finish(self) -> None:
        self._wait_pending()
        time.sleep(0.01)   # let the done-callback record the last commit time

    def close(self) -> None:
        self.stager.close()


def make_method(name: str, spec: dict[str, Any], workdir: Path) -> Method:
    if name in ("ckptd-blocking", "ckptd-overlap"):
        return Ckptd(spec, workdir, overlap=name == "ckptd-overlap")
    return {"torch-save": TorchSave, "dcp-save": DcpSave, "dcp-async": DcpAsync}[name](spec, workdir)


# ---- the worker: one method on one state, in its own process -----------------------------

def warm_memcpy_seconds(nbytes: int, reps: int = 5) -> float:
    """Median time of a plain warm copy of ``nbytes`` in this process (same thread setting as
    the loop): the baseline the blocking-copy stall is held to."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return percentile(times, 50)


def run_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """The simulated training loop; returns the figures of one method on one state."""
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    torch.set_num_threads(1)
    workdir = Path(spec["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    name = spec["method"]
    out: dict[str, Any] = {"method": name, "label": LABELS[name]}
    method = make_method(name, spec, workdir)
    why = method.unavailable()
    if why:
        return {**out, "unavailable": why}
    ts = build_state(spec["state"], spec["size_mib"])
    out["raw_bytes"] = ts.raw_bytes
    out["description"] = ts.description
    method.setup(ts)
    saves = spec["warmup"] + spec["saves"]
    stalls: list[float] = []
    save_s: list[float] = []
    fence_s: list[float] = []
    warm: list[float] = []
    steps: list[int] = []
    digest = ""
    say = _sayer(f"{spec['state']}/{name}")
    t_loop = time.perf_counter()
    for i in range(saves * spec["save_every"]):
        saving = i % spec["save_every"] == 0
        step = i + 1
        if saving:
            t0 = time.perf_counter()
            method.save(step, ts)
            s = time.perf_counter() - t0
        compute(spec["step_ms"] / 1000, spec["compute"])
        if saving:
            t0 = time.perf_counter()
            method.fence()
            f = time.perf_counter() - t0
            n = len(steps)
            if n >= spec["warmup"]:
                save_s.append(s)
                fence_s.append(f)
                stalls.append(s + f)
            else:
                warm.append(s + f)
            steps.append(step)
            say(f"save {n + 1}/{saves}{' (warm-up)' if n < spec['warmup'] else ''}: stall {1e3 * (s + f):.1f} ms")
        if saving and len(steps) == saves:
            digest = ts.digest()          # the state the last save captured (nothing mutates it after)
            break
        ts.opt.step()
    method.finish()
    loop_s = time.perf_counter() - t_loop
    measured = steps[spec["warmup"]:]
    commits = [method.committed[s] for s in measured if s in method.committed]
    last = steps[-1]
    out.update({
        "saves": len(measured), "failed_saves": len(measured) - len(commits), "loop_s": loop_s,
        "stall_s": stalls, "save_call_s": save_s, "fence_s": fence_s, "commit_s": commits, "warmup_stall_s": warm,
        "stall_p50": percentile(stalls, 50), "stall_p99": percentile(stalls, 99),
        "stall_mean": sum(stalls) / len(stalls) if stalls else None,
        "commit_p50": percentile(commits, 50), "commit_p99": percentile(commits, 99),
        "bytes_on_disk": method.step_bytes(last),
    })
    ts.scramble()
    t0 = time.perf_counter()
    method.restore(last, ts)
    out["restore_s"] = time.perf_counter() - t0
    out["restore_bit_exact"] = ts.digest() == digest
    out["restore_source"] = getattr(method, "restore_source", "files")     # ckptd's: "storage", never memory
    say(f"restore {out['restore_s']:.2f} s, bit-exact: {out['restore_bit_exact']}")
    method.close()
    out["rss_peak_trainer_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if name == "ckptd-blocking":        # after the RSS reading: its buffers are not the method's
        out["memcpy_s"] = warm_memcpy_seconds(ts.raw_bytes)
    return out


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One of several ranks on one daemon: blocking saves, started together, each waited for."""
    torch.set_num_threads(1)
    ts = build_state("gpt", spec["size_mib"], seed=spec["rank"])
    method = Ckptd(spec, Path(spec["workdir"]), overlap=False)
    method.setup(ts)
    go = Path(spec["barrier"])
    Path(f"{go}.ready-{spec['rank']}").touch()
    while not go.exists():
        time.sleep(0.005)
    rows = []
    for k in range(spec["saves"]):
        step = k + 1
        while not Path(f"{go}.step-{step}").exists():      # all ranks start each step together
            time.sleep(0.002)
        start = time.time()
        t0 = time.perf_counter()
        method.save(step, ts)
        stall = time.perf_counter() - t0
        method.handles[step].wait()
        rows.append({"step": step, "start": start, "committed": time.time(), "stall_s": stall})
        Path(f"{go}.done-{step}-{spec['rank']}").touch()
    method.close()
    return {"rank": spec["rank"], "raw_bytes": ts.raw_bytes, "saves": rows,
            "rss_peak_trainer_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _sayer(prefix: str) -> Callable[[str], None]:
    def say(msg: str) -> None:
        print(f"    [{prefix}] {msg}", flush=True)
    return say


# ---- the orchestrator ---------------------------------------------------------------

def start_bench_daemon(base: Path, name: str, threads: int | None) -> DaemonProcess:
    """A ckptd daemon of our own, as a subprocess on a unix socket in ``base``."""
    extra = ["--keep-last", "2"] + (["--threads", str(threads)] if threads else [])
    return spawn_daemon(base / f"{name}-root", base / f"{name}.sock", *extra, log=base / f"{name}.log")


def spawn_worker(spec: dict[str, Any], base: Path, mode: str = "--worker") -> subprocess.Popen:
    path = base / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    return subprocess.Popen([sys.executable, str(HERE), mode, str(path)])


def worker_result(proc: subprocess.Popen, spec_path_hint: str, timeout: float) -> dict[str, Any]:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"error": f"timed out after {timeout:.0f} s"}
    result = Path(str(proc.args[-1])).with_suffix(".result.json")  # type: ignore[index]  # args: a list here
    if rc != 0 or not result.exists():
        return {"error": f"worker exited with {rc} ({spec_path_hint})"}
    return json.loads(result.read_text())


def run_method(state: str, method: str, cfg: argparse.Namespace, base: Path) -> dict[str, Any]:
    """One method on one state in a fresh subprocess (and, for ckptd, a fresh daemon)."""
    work = base / f"{state}-{method}"
    spec = {"state": state, "method": method, "workdir": str(work), "size_mib": cfg.size_mib,
            "warmup": cfg.warmup, "saves": cfg.saves, "compute": cfg.compute,
            "step_ms": cfg.step_ms if state == "gpt" else cfg.small_step_ms, "save_every": cfg.save_every}
    daemon = None
    if method.startswith("ckptd"):
        daemon = start_bench_daemon(base, f"{state}-{method}", cfg.daemon_threads)
        spec.update(socket=str(daemon.socket), root=str(daemon.root))
    try:
        res = worker_result(spawn_worker(spec, base), f"{state}/{method}", cfg.worker_timeout)
        if daemon is not None:
            res["rss_peak_daemon_bytes"] = daemon.peak_rss()
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
        if daemon is not None:
            shutil.rmtree(daemon.root, ignore_errors=True)
    res.setdefault("method", method)
    res.setdefault("label", LABELS[method])
    return res


def run_ranks(cfg: argparse.Namespace, base: Path) -> dict[str, Any]:
    """``cfg.ranks`` client processes on one daemon, each with 1/ranks of the GPT state."""
    daemon = start_bench_daemon(base, "ranks", cfg.daemon_threads)
    barrier = base / "ranks-go"
    size = max(8, cfg.size_mib // cfg.ranks)
    procs = []
    try:
        for r in range(cfg.ranks):
            spec = {"rank": r, "world_size": cfg.ranks, "size_mib": size, "saves": cfg.rank_saves,
                    "socket": str(daemon.socket), "root": str(daemon.root), "job": "ranks",
                    "workdir": str(base / f"rank-{r}"), "barrier": str(barrier)}
            procs.append(spawn_worker(spec, base, "--rank-worker"))
        deadline = time.monotonic() + cfg.worker_timeout
        while not all(Path(f"{barrier}.ready-{r}").exists() for r in range(cfg.ranks)):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("a rank worker failed before its first save")
            time.sleep(0.05)
        barrier.touch()
        for step in range(1, cfg.rank_saves + 1):
            Path(f"{barrier}.step-{step}").touch()
            while not all(Path(f"{barrier}.done-{step}-{r}").exists() for r in range(cfg.ranks)):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"a rank worker failed during step {step}")
                time.sleep(0.01)
        ranks = [worker_result(p, f"rank {i}", cfg.worker_timeout) for i, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        peak = daemon.peak_rss()
        daemon.stop()
        shutil.rmtree(daemon.root, ignore_errors=True)
    if any("error" in r for r in ranks):
        return {"error": "; ".join(r["error"] for r in ranks if "error" in r)}
    total = sum(r["raw_bytes"] for r in ranks)
    steps = []
    for k in range(cfg.rank_saves):
        rows = [r["saves"][k] for r in ranks]
        wall = max(x["committed"] for x in rows) - min(x["start"] for x in rows)
        steps.append({"step": k + 1, "seconds": wall, "GBps": total / wall / 1e9,
                      "stall_max_s": max(x["stall_s"] for x in rows)})
    measured = steps[1:] or steps
    return {"ranks": cfg.ranks, "raw_bytes_per_step": total, "steps": steps,
            "aggregate_GBps_p50": median([s["GBps"] for s in measured]),
            "commit_s_p50": median([s["seconds"] for s in measured]),
            "stall_s_p50": median([s["stall_max_s"] for s in measured]), "rss_peak_daemon_bytes": peak}


# ---- report -----------------------------------------------------------------------

def _mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.0f} MiB"


def _ms(s: float | None) -> str:
    return fmt(None if s is None else s * 1e3, 1, " ms")


def _sec(s: float | None) -> str:
    return fmt(s, 2, " s")


def headline(state: dict[str, Any]) -> list[dict[str, Any]]:
    """ckptd ÷ each peer, for one state: the best ckptd mode (overlapped when available)."""
    by = {m["method"]: m for m in state["methods"] if "stall_p50" in m}
    ours = by.get("ckptd-overlap") or by.get("ckptd-blocking")
    if ours is None:
        return []
    rows = []
    for peer in PEERS:
        p = by.get(peer)
        if p is None:
            continue
        rows.append({"state": state["state"], "ckptd": ours["method"], "peer": peer,
                     **{k: (ours[k] / p[k] if ours.get(k) and p.get(k) else None)
                        for k in ("stall_p50", "stall_p99", "commit_p50", "bytes_on_disk", "restore_s")}})
    return rows


def to_markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    cfg = res["config"]
    lines = [
        "# ckptd benchmark: ckptd vs torch.save and torch.distributed.checkpoint",
        "",
        f"Generated by `benchmarks/run.py` on {res['started']} in {res['wall_s']:.0f} s. "
        f"Machine: {m['cpu']}, {m['cores_available']} cores available, {m['ram_gib']} GiB RAM, "
        f"disk {m['disk']['device']} ({m['disk']['fstype']}), Linux {m['kernel']}, torch {m['versions']['torch']}, "
        f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}.",
        "",
        f"Loop: {cfg['compute']} compute of {cfg['step_ms']} ms per iteration ({cfg['small_step_ms']} ms for MiniLM), "
        f"a save every {cfg['save_every']} iterations, {cfg['warmup']} warm-up + {cfg['saves']} measured saves per "
        f"method; an optimizer step mutates the state after each iteration's fence. ckptd daemon: "
        f"{cfg['daemon_threads'] or 'default'} compression threads, codec bplane, level 1, 4 MiB chunks.",
        "",
        "## Headline: ckptd ÷ peer (lower is better for ckptd)",
        "",
    ]
    head = [h for s in res["states"] for h in headline(s)]
    lines.append(table(["state", "ckptd mode", "peer", "stall p50", "stall p99", "time to committed p50",
                        "bytes on disk", "restore time"],
                       [[h["state"], LABELS[h["ckptd"]], LABELS[h["peer"]]]
                        + [fmt(h[k], 3, "×") for k in ("stall_p50", "stall_p99", "commit_p50", "bytes_on_disk",
                                                          "restore_s")] for h in head]))
    for s in res["states"]:
        lines += ["", f"## {s['state']}: {s['description']}", "",
                  f"Raw tensor bytes per save: {_mib(s['raw_bytes'])}.", ""]
        blocking = next((r for r in s["methods"] if r.get("method") == "ckptd-blocking" and r.get("memcpy_s")), None)
        if blocking and blocking.get("stall_p50"):
            lines += [f"A plain warm memcpy of the same bytes in the trainer process (same thread setting): "
                      f"{_ms(blocking['memcpy_s'])}; ckptd's blocking-copy stall p50 is "
                      f"{fmt(blocking['stall_p50'] / blocking['memcpy_s'], 2, '×')} that.", ""]
        rows = []
        for r in s["methods"]:
            if "unavailable" in r or "error" in r:
                rows.append([r["label"], r.get("unavailable") or f"error: {r['error']}"] + [""] * 8)
                continue
            rows.append([r["label"], _ms(r["stall_p50"]), _ms(r["stall_p99"]), _sec(r["commit_p50"]),
                         _sec(r["commit_p99"]), _mib(r["bytes_on_disk"]),
                         fmt(r["raw_bytes"] / r["bytes_on_disk"], 3) if r.get("bytes_on_disk") else "n/a",
                         f"{_sec(r['restore_s'])}{'' if r['restore_bit_exact'] else ' (NOT bit-exact)'}",
                         _mib(r["rss_peak_trainer_bytes"]), _mib(r.get("rss_peak_daemon_bytes"))])
        lines.append(table(["method", "stall p50", "stall p99", "committed p50", "committed p99", "bytes on disk",
                            "ratio", "restore", "peak RSS trainer", "peak RSS daemon"], rows))
    r = res.get("ranks") or {}
    lines += ["", f"## {cfg['ranks']} ranks on one daemon", ""]
    if "error" in r:
        lines.append(f"error: {r['error']}")
    elif r:
        lines.append(f"{r['ranks']} client processes (commit=\"local\"), each with a 1/{r['ranks']} GPT-shaped "
                     f"state, {_mib(r['raw_bytes_per_step'])} per step in all, blocking saves started together; "
                     f"after one warm-up step: aggregate {r['aggregate_GBps_p50']:.2f} GB/s from the first save call "
                     f"to the commit (p50, {r['commit_s_p50']:.2f} s per step), slowest rank's stall "
                     f"{r['stall_s_p50'] * 1e3:.0f} ms, daemon peak RSS {_mib(r['rss_peak_daemon_bytes'])}.")
        one = next((m for st in res["states"] if st["state"] == "gpt" for m in st["methods"]
                    if m["method"] == "ckptd-blocking" and m.get("commit_p50")), None)
        if one:
            gbps = one["raw_bytes"] / one["commit_p50"] / 1e9
            lines.append(f"For comparison, one rank saving the whole {_mib(one['raw_bytes'])} GPT state "
                         f"(blocking copy, same daemon settings): {gbps:.2f} GB/s "
                         f"({one['commit_p50']:.2f} s to commit, p50).")
        lines.append("")
        lines.append(table(["step", "seconds to commit", "aggregate GB/s", "slowest stall"],
                           [[x["step"], _sec(x["seconds"]), fmt(x["GBps"], 2), _ms(x["stall_max_s"])]
                            for x in r["steps"]]))
    if res.get("codec"):
        lines += ["", "## Codec micro-benchmark (benchmarks/codec_bench.py)", "", codec_bench.to_markdown(res["codec"])]
    lines += ["", "## Notes", "",
              "- Stall: ckptd blocking = `save()`; ckptd overlapped = `save()` + `fence()`; torch.save and DCP save ="
              " the call (durable when it returns); DCP async = waiting for the previous save + `async_save()`."
              " p99 over 10 saves is close to the maximum.",
              "- Time to committed: from the save call until the step is durable and complete (ckptd: index.json"
              " renamed into place; DCP: `.metadata` written, files fsynced; torch.save: fsync + rename + dir fsync).",
              "- Restore reads files still in the page cache; it measures decode and copy speed, not the disk. ckptd's "
              "reads its files too (a Checkpointer with memory=False: the daemon's memory tier would serve it "
              "otherwise; memory_restore_bench.py measures that).",
              "- Peak RSS: the trainer's counts the shared-memory slots or staging buffers it touched; the"
              " daemon's counts the same slot pages again (shared memory), so the two do not add up.",
              "- The machine is shared with other work; figures vary from run to run by 10-30 %.",
              ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small, CI-friendly run (64 MiB, fewer saves)")
    p.add_argument("--size-mib", type=int, help="synthetic GPT state size (default 1024; quick 64)")
    p.add_argument("--saves", type=int, help="measured saves per method (default 10; quick 5)")
    p.add_argument("--warmup", type=int, help="warm-up saves per method (default 2; quick 1)")
    p.add_argument("--step-ms", type=float, help="simulated compute per iteration, GPT state (default 300; quick 60)")
    p.add_argument("--small-step-ms", type=float, default=40, help="the same for the MiniLM states")
    p.add_argument("--save-every", type=int, default=12, help="iterations between saves")
    p.add_argument("--compute", choices=("sleep", "matmul"), default="sleep",
                   help="sleep: CPU idle during compute (a GPU job); matmul: one busy core")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--states", default="gpt,minilm-fp32,minilm-bf16")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rank-saves", type=int, default=4, help="saves in the multi-rank run (first is warm-up)")
    p.add_argument("--daemon-threads", type=int, default=None, help="ckptd --threads (default: its own)")
    p.add_argument("--no-codec", action="store_true", help="skip the codec micro-benchmark")
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "latest", help="results path without extension")
    p.add_argument("--worker-timeout", type=float, default=600)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    for flag, fn in (("worker", run_loop), ("rank_worker", run_rank)):
        spec_path = getattr(a, flag)
        if spec_path:
            out = fn(json.loads(Path(spec_path).read_text()))
            Path(spec_path).with_suffix(".result.json").write_text(json.dumps(out))
            return 0
    a.size_mib = a.size_mib or (64 if a.quick else 1024)
    a.saves = a.saves or (5 if a.quick else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    a.step_ms = a.step_ms or (60 if a.quick else 300)
    methods = [m for m in a.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods: {', '.join(sorted(unknown))}")
    t_start = time.time()
    base = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir=a.dir))
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(base),
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                                      if k not in ("worker", "rank_worker")}, "states": []}
    print(f"ckptd benchmark in {base}: {res['machine']['cpu']}, {res['machine']['cores_available']} cores, "
          f"torch {torch.__version__}", flush=True)
    try:
        for state in [s for s in a.states.split(",") if s]:
            if state.startswith("minilm"):
                try:
                    minilm_path()
                except MissingBenchDependency as e:
                    print(f"  skipping {state}: {e}", flush=True)
                    continue
            entry: dict[str, Any] = {"state": state, "methods": []}
            for method in methods:
                print(f"  {state}: {LABELS[method]} …", flush=True)
                entry["methods"].append(run_method(state, method, a, base))
            ok = [m for m in entry["methods"] if "raw_bytes" in m]
            entry["raw_bytes"] = ok[0]["raw_bytes"] if ok else None
            entry["description"] = ok[0]["description"] if ok else state
            res["states"].append(entry)
        if a.ranks > 1:
            print(f"  {a.ranks} ranks on one daemon …", flush=True)
            try:
                res["ranks"] = run_ranks(a, base)
            except (RuntimeError, TimeoutError) as e:
                res["ranks"] = {"error": str(e)}
        if not a.no_codec:
            print("  codec micro-benchmark …", flush=True)
            res["codec"] = codec_bench.run(quick=a.quick, progress=lambda s: print(f"    {s}", flush=True))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res["wall_s"] = time.time() - t_start
    res["headline"] = [h for s in res["states"] for h in headline(s)]
    write_results(a.out, res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
