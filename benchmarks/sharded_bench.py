"""Sharded state: ckptd against DCP ``async_save`` / ``load`` on an FSDP2 job, side by side, in one run.

    .venv/bin/python benchmarks/sharded_bench.py [--quick] [--dim 1024] [--layers 10] [--rounds 6] ...

The state: an MLP of ``--layers`` ``Linear(dim, dim)`` layers sharded with FSDP2
(``fully_shard``) over ``--ranks`` gloo ranks on this machine's CPUs, trained with AdamW
(fp32 weights and both Adam moments: ~12 bytes per parameter), saved in the spelling DCP
documents, ``get_state_dict(model, optim)``'s dicts, by every method.

What it measures, interleaved round by round (the order of the methods rotates each round,
after ``--warmup`` rounds that are not counted), each save in an episode of its own:
- stall: what a save blocks the training loop, the slowest rank's (the next collective waits
  for it). ckptd: ``save(step, state, fence_on=optim)`` + ``fence()`` before the next
  ``optim.step()`` (the parameter and Adam copies overlap the forward/backward that runs in
  between). DCP ``async_save`` with a shared-memory ``DefaultStager`` staging synchronously (the
  call), and with asynchronous staging (the call + waiting for ``staging_completion`` before the
  next ``optim.step()``). DCP saves through a gloo group of its own, as its docs advise.
- time to durable: from the save call until the last rank knows the checkpoint is complete on
  disk (ckptd: its handle committed, index.json in place; DCP: its future done, .metadata written).
- restore at the same world size and at another one (``--ranks`` → ``--reshard-ranks``, a
  fresh rank group): ``Checkpointer.restore`` vs DCP ``load`` (page cache warm, and dropped first)
  into the dicts, each followed by
  ``set_state_dict``; the slowest rank's time. Every restore is checked bit-exact (local shards
  at the same world size; full tensors, gathered, at another).

``--peers`` (``make bench-memory``): two daemons instead of one, each a node of ``--ranks`` / 2
ranks, peers of each other keeping K = 1 copy of the other's shards in memory. Before the
resharding restores, node B's daemon is SIGKILLed: the ``--reshard-ranks`` ranks run on node A
alone and its memory serves B's shards from the copies B sent it (issue 20's node loss).

Results: benchmarks/results/sharded.md and sharded.json (``sharded_peers`` with ``--peers``;
``--out`` to change).
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
import warnings
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptd.launch import spawn_daemon  # noqa: E402

from common import (  # noqa: E402
    RESULTS,
    daemon_shared_memory,
    fmt,
    free_port,
    machine_info,
    median,
    table,
    write_results,
)

HERE = Path(__file__).resolve()
SAVE_METHODS = ("ckptd", "dcp-async", "dcp-async-staged")
RESTORE_METHODS = ("ckptd-memory", "ckptd-memory-objects", "ckptd", "dcp", "dcp-cold")
LABELS = {"ckptd": "ckptd save(fence_on=optim), overlapped",
          "ckptd-restore": "ckptd Checkpointer.restore from storage (memory=False)",
          "ckptd-memory": "ckptd Checkpointer.restore from the daemon's memory",
          "ckptd-memory-objects": "ckptd Checkpointer.restore from the daemon's memory, into the model and "
                                  "optimizer objects (no get_state_dict dicts)",
          "dcp-async": "DCP async_save (shm stager, staging in the call)",
          "dcp-async-staged": "DCP async_save (shm stager, async staging)",
          "dcp": "DCP load",
          "dcp-cold": "DCP load, its files dropped from the page cache first (a replacement node's read)"}
JOB = "sharded"
# Targets this benchmark reports against (ckptd ÷ DCP).
TARGET_STALL = 0.1
TARGET_RESTORE_SAME = 1.0
TARGET_RESTORE_RESHARD = 1.2
TARGET_MEMORY_VS_MEMCPY = 2.0          # restore from memory, same layout ÷ copying the shard's bytes
TARGET_MEMORY_RESHARD = 0.5            # restore from memory, resharding ÷ DCP load resharding

# ---- the rank side ------------------------------------------------------------------------


def build(dim: int, layers: int, seed: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())
                                  for _ in range(layers)])
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class Trainer:
    def __init__(self, model: torch.nn.Module, opt: torch.optim.AdamW, dim: int) -> None:
        self.model, self.opt, self.dim = model, opt, dim
        self.g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
        self.step = 0

    def forward_backward(self) -> None:
        x = torch.randn(16, self.dim, generator=self.g)
        loss = self.model(x).square().mean()
        self.opt.zero_grad()
        loss.backward()

    def optim_step(self) -> None:
        self.opt.step()
        self.step += 1

    def train(self, n: int) -> None:
        for _ in range(n):
            self.forward_backward()
            self.optim_step()


def local_tensors(state: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the dicts, as this rank holds it (DTensors: the local shard), by key path."""
    from torch.distributed.tensor import DTensor
    out: list[tuple[str, torch.Tensor]] = []

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        elif isinstance(obj, DTensor):
            out.append((prefix, obj.to_local()))
        elif isinstance(obj, torch.Tensor):
            out.append((prefix, obj))
    walk("", state)
    return sorted(out, key=lambda kv: kv[0])


def local_digest(state: dict[str, Any]) -> str:
    h = xxhash.xxh3_128()
    for name, t in local_tensors(state):
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def full_digest(state: dict[str, Any]) -> str:
    """A digest of every full tensor (gathered: collective, same order on every rank)."""
    from torch.distributed.tensor import DTensor
    h = xxhash.xxh3_128()
    flat: list[tuple[str, Any]] = []

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, torch.Tensor):
            flat.append((prefix, obj))
    walk("", state)
    for name, t in sorted(flat, key=lambda kv: kv[0]):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        h.update(name.encode())
        h.update(full.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def scramble(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for _, t in local_tensors(state):
            if t.numel():
                t.reshape(-1).view(torch.uint8).fill_(0x5A)


def slowest(*values: float) -> list[float]:
    """The maximum of each value over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [float(x) for x in t]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


class Savers:
    """The save methods of one rank group, all on the same dicts."""

    def __init__(self, spec: dict[str, Any], tr: Trainer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        import ckptd_client
        self.spec, self.tr, self.state = spec, tr, state
        self.ck = ckptd_client.Checkpointer(JOB, socket=my_socket(spec), root=spec["root"])
        self.ck.prepare(state)
        self.dcp_group = torch.distributed.new_group(backend="gloo")
        self.stagers = {
            "dcp-async": DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                      use_async_staging=False, use_non_blocking_copy=False)),
            "dcp-async-staged": DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                             use_async_staging=True, use_non_blocking_copy=False)),
        }
        self.last: dict[str, int] = {}
        self.digests: dict[str, dict[str, str]] = {}

    def dcp_dir(self, method: str, step: int) -> Path:
        return Path(self.spec["dcp_dir"]) / f"{method}-step{step}"

    def episode(self, method: str, final: bool) -> dict[str, Any]:
        """Train to a step boundary, save with ``method``, train on while it is written, wait for it."""
        import torch.distributed.checkpoint as dcp
        tr = self.tr
        tr.train(1)
        step = tr.step
        if final:       # what a restore of this checkpoint must give back (outside every timed region)
            self.digests[method] = {"local": local_digest(self.state), "full": full_digest(self.state)}
        torch.distributed.barrier()
        durable: dict[str, float] = {}
        wait_staging = None
        t0 = time.perf_counter()
        tm = time.monotonic()
        if method == "ckptd":
            handle = self.ck.save(step, self.state, fence_on=tr.opt)
        else:
            res = dcp.async_save(self.state, checkpoint_id=str(self.dcp_dir(method, step)),
                                 async_stager=self.stagers[method], process_group=self.dcp_group)
            if isinstance(res, Future):
                fut, wait_staging = res, None
            else:       # AsyncSaveResponse, with async staging
                fut, wait_staging = res.upload_completion, res.staging_completion
            fut.add_done_callback(lambda _f: durable.setdefault("s", time.monotonic() - tm))
        call_s = time.perf_counter() - t0
        tr.forward_backward()                  # the copy may overlap this
        t1 = time.perf_counter()
        if method == "ckptd":
            self.ck.fence()
        elif wait_staging is not None:
            wait_staging.result()
        fence_s = time.perf_counter() - t1
        tr.optim_step()
        for _ in range(self.spec["train_while_writing"]):
            if (handle.done() if method == "ckptd" else fut.done()):
                break
            tr.train(1)
        if method == "ckptd":
            handle.wait(600)
            durable_s = handle.committed_s or float("nan")
            stored = handle.stored_bytes
        else:
            fut.result()
            while "s" not in durable:
                time.sleep(0.001)
            durable_s = durable["s"]
            stored = 0
        stall, call, fence, durable_max = slowest(call_s + fence_s, call_s, fence_s, durable_s)
        torch.distributed.barrier()
        prev = self.last.get(method)
        self.last[method] = step
        nbytes = 0
        if torch.distributed.get_rank() == 0:
            if method == "ckptd":
                from ckptd.core.names import step_dir
                nbytes = dir_bytes(Path(step_dir(self.spec["root"], JOB, step)))
            else:
                nbytes = dir_bytes(self.dcp_dir(method, step))
                if prev is not None:
                    shutil.rmtree(self.dcp_dir(method, prev), ignore_errors=True)
        return {"method": method, "step": step, "stall_s": stall, "call_s": call, "fence_s": fence,
                "durable_s": durable_max, "bytes_on_disk": nbytes, "stored_bytes_rank": stored}

    def close(self) -> None:
        self.ck.close()
        for s in self.stagers.values():
            s.close()


def restore_once(method: str, spec: dict[str, Any], ck: Any, model: torch.nn.Module, opt: torch.optim.AdamW,
                 state: dict[str, Any], step: int, path: str, reshard: bool) -> tuple[float, float]:
    """(The slowest rank's restore + ``set_state_dict``, its restore call alone)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    scramble(state)
    if method == "dcp-cold":
        drop_cache(Path(path))
    torch.distributed.barrier()
    t0 = time.perf_counter()
    objects = method == "ckptd-memory-objects"      # (the dicts share the objects' tensors: checked the same)
    if method in ("ckptd", "ckptd-memory") or objects:
        prof = _profiler(spec, method, reshard)
        got = ck.restore({"model": model, "optim": opt} if objects else state, step=step,
                         **(spec["ckptd_reshard_kwargs"] if reshard else {}))
        if prof is not None:
            prof.disable()
        assert got == step, (got, step)
        want = "storage" if method == "ckptd" else "memory"
        assert ck.last_restore.source == want and (method == "ckptd" or not ck.last_restore.from_storage), \
            (method, ck.last_restore)
    else:
        dcp.load(state, checkpoint_id=path)
    call = time.perf_counter() - t0
    if not objects:                # (the objects restore loaded them through set_*_state_dict itself)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    took, call = slowest(time.perf_counter() - t0, call)
    return took, call


_PROFILES: dict[str, Any] = {}


def _profiler(spec: dict[str, Any], method: str, reshard: bool) -> Any:
    """With --profile, rank 0's ckptd restore calls run under one cProfile per method and layout
    (written to ``<out>-profile-<method>-<same|reshard>.txt`` by ``write_profiles``); else None."""
    if not spec.get("profile") or torch.distributed.get_rank() != 0:
        return None
    import cProfile
    prof = _PROFILES.setdefault(f"{method}-{'reshard' if reshard else 'same'}", cProfile.Profile())
    prof.enable()
    return prof


def write_profiles(spec: dict[str, Any]) -> None:
    import pstats
    for key, prof in _PROFILES.items():
        with open(f"{spec['out']}-profile-{key}.txt", "w") as f:
            stats = pstats.Stats(prof, stream=f)
            stats.sort_stats("cumulative").print_stats(60)
            stats.sort_stats("tottime").print_stats(30)


def drop_cache(directory: Path) -> None:
    """Every file under ``directory`` out of the page cache (clean pages: fsynced by the save)."""
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def restore_rounds(spec: dict[str, Any], model: torch.nn.Module, opt: torch.optim.AdamW, state: dict[str, Any],
                   steps: dict[str, int], digests: dict[str, dict[str, str]], reshard: bool) -> dict[str, Any]:
    import ckptd_client
    cks = {"ckptd": ckptd_client.Checkpointer(JOB, socket=my_socket(spec), root=spec["root"], memory=False,
                                              prepare=False),
           "ckptd-memory": ckptd_client.Checkpointer(JOB, socket=my_socket(spec), prepare=False),
           "ckptd-memory-objects": ckptd_client.Checkpointer(JOB, socket=my_socket(spec), prepare=False),
           "dcp": None, "dcp-cold": None}
    times: dict[str, list[float]] = {m: [] for m in (*RESTORE_METHODS, "memcpy")}
    calls: dict[str, list[float]] = {m: [] for m in RESTORE_METHODS}
    exact: dict[str, bool] = {m: True for m in RESTORE_METHODS}
    dcp_path = str(Path(spec["dcp_dir"]) / f"dcp-async-step{steps['dcp']}")
    paths = {"ckptd": "", "ckptd-memory": "", "ckptd-memory-objects": "", "dcp": dcp_path, "dcp-cold": dcp_path}
    n = len(RESTORE_METHODS)
    for r in range(spec["warmup"] + spec["rounds"]):
        order = RESTORE_METHODS[r % n:] + RESTORE_METHODS[:r % n]
        for m in order:
            src = {"ckptd-memory": "ckptd", "ckptd-memory-objects": "ckptd", "dcp-cold": "dcp"}.get(m, m)
            took, call = restore_once(m, spec, cks[m], model, opt, state, steps[src], paths[m], reshard)
            ok = (full_digest(state) if reshard else local_digest(state)) == \
                digests[src]["full" if reshard else "local"]
            ok = bool(slowest(0.0 if ok else 1.0)[0] == 0.0)
            exact[m] = exact[m] and ok
            if r >= spec["warmup"]:
                times[m].append(took)
                calls[m].append(call)
            say(spec, f"restore{' (reshard)' if reshard else ''} round {r}: {m} {took:.3f} s, bit-exact {ok}")
        if not reshard and r >= spec["warmup"]:
            times["memcpy"].append(copy_shard(state))
            times.setdefault("memfd", []).append(read_memfd(state, spec.get("shm_dir")))
    for ck in cks.values():
        if ck is not None:
            ck.close()
    return {"times": times, "calls": calls, "bit_exact": exact}


def read_memfd(state: dict[str, Any], shm_dir: str | None = None) -> float:
    """The floor of reading shared memory: this rank's local shards read (``preadv``) into the live
    tensors from shared memory like the daemon's — a memfd, or an unnamed file in ``shm_dir`` (its
    ``memory.shm_dir``, a huge-page tmpfs) — whose pages (4 KiB in a memfd unless the node's
    ``shmem_enabled`` allows huge ones) cost the kernel more per byte than a copy between two resident
    buffers (the slowest rank's)."""
    tensors = [t for _, t in local_tensors(state)]
    views = [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in tensors]  # type: ignore[arg-type]
    fd = os.open(shm_dir, os.O_RDWR | os.O_TMPFILE, 0o600) if shm_dir else os.memfd_create("ckptd-bench-floor")
    try:
        os.ftruncate(fd, sum(len(v) for v in views))      # within_size: huge pages only inside the file's size
        pos = 0
        for v in views:
            os.pwrite(fd, v, pos)
            pos += len(v)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        pos = 0
        for v in views:
            if len(v):
                os.preadv(fd, [v], pos)
            pos += len(v)
        (took,) = slowest(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return took


def copy_shard(state: dict[str, Any]) -> float:
    """The floor of a same-layout restore from memory: this rank's local shards copied from
    already-resident memory into the live tensors (the slowest rank's time)."""
    pairs = [(t, t.detach().clone()) for _, t in local_tensors(state)]
    torch.distributed.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
    (took,) = slowest(time.perf_counter() - t0)
    return took


def say(spec: dict[str, Any], msg: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(f"    [{spec['phase']} x{torch.distributed.get_world_size()}] {msg}", flush=True)


def my_socket(spec: dict[str, Any]) -> str:
    """This rank's node's daemon: ranks are laid out node by node, ``node_size`` to a node."""
    return str(spec["sockets"][torch.distributed.get_rank() // spec["node_size"]])


def rank_main(spec: dict[str, Any]) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                                         rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                         timeout=timedelta(seconds=900))
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = build(spec["dim"], spec["layers"], seed=0 if spec["phase"] == "save" else 7)
    tr = Trainer(model, opt, spec["dim"])
    if spec["phase"] == "save":
        tr.train(2)
    msd, osd = get_state_dict(model, opt)         # (initialises Adam's state on a fresh optimizer)
    state = {"model": msd, "optim": osd}
    result: dict[str, Any] = {"world": torch.distributed.get_world_size()}
    if spec["phase"] == "save":
        result["local_bytes_per_rank"] = slowest(float(sum(t.numel() * t.element_size()
                                                           for _, t in local_tensors(state))))[0]
        total = torch.tensor([sum(t.numel() * t.element_size() for _, t in local_tensors(state))])
        torch.distributed.all_reduce(total)
        result["raw_bytes"] = int(total)
        result["params"] = sum(p.numel() for p in model.parameters())
        savers = Savers(spec, tr, state)
        saves: list[dict[str, Any]] = []
        n = spec["warmup"] + spec["rounds"]
        for r in range(n):
            order = SAVE_METHODS[r % 3:] + SAVE_METHODS[:r % 3]
            for m in order:
                rec = savers.episode(m, final=r == n - 1)
                rec["round"] = r
                rec["warmup"] = r < spec["warmup"]
                saves.append(rec)
                say(spec, f"save round {r}: {m} stall {rec['stall_s'] * 1e3:.1f} ms, "
                          f"durable {rec['durable_s']:.2f} s")
        result["saves"] = saves
        result["steps"] = {"ckptd": savers.last["ckptd"], "dcp": savers.last["dcp-async"]}
        result["digests"] = {"ckptd": savers.digests["ckptd"], "dcp": savers.digests["dcp-async"]}
        savers.close()
        result["restore"] = restore_rounds(spec, model, opt, state, result["steps"], result["digests"], False)
    else:
        result["restore"] = restore_rounds(spec, model, opt, state, spec["steps"], spec["digests"], True)
    if torch.distributed.get_rank() == 0:
        Path(spec["result"]).write_text(json.dumps(result))
        write_profiles(spec)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---- the orchestrator ---------------------------------------------------------------------------

def run_ranks(world: int, spec: dict[str, Any], base: Path, timeout: float) -> dict[str, Any]:
    spec = {**spec, "port": free_port(), "result": str(base / f"result-{spec['phase']}.json")}
    path = base / f"spec-{spec['phase']}.json"
    path.write_text(json.dumps(spec))
    procs = [subprocess.Popen([sys.executable, str(HERE), "--rank-worker", str(path)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
                                   "LOCAL_WORLD_SIZE": str(spec["node_size"])})     # as torchrun sets them
             for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{spec['phase']} ranks still running after {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{spec['phase']} ranks exited with {[p.returncode for p in procs]}")
    return json.loads(Path(spec["result"]).read_text())


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    saves = [s for s in res["save"]["saves"] if not s["warmup"]]
    out: dict[str, Any] = {"save": {}, "restore_same": {}, "restore_reshard": {}}
    for m in SAVE_METHODS:
        rows = [s for s in saves if s["method"] == m]
        out["save"][m] = {"stall_p50": p50([s["stall_s"] for s in rows]),
                          "stall_max": max((s["stall_s"] for s in rows), default=float("nan")),
                          "call_p50": p50([s["call_s"] for s in rows]), "fence_p50": p50([s["fence_s"] for s in rows]),
                          "durable_p50": p50([s["durable_s"] for s in rows]),
                          "bytes_on_disk": rows[-1]["bytes_on_disk"] if rows else None, "n": len(rows)}
    for key, phase in (("restore_same", "save"), ("restore_reshard", "reshard")):
        r = res[phase]["restore"]
        for m in RESTORE_METHODS:
            out[key][m] = {"p50": median(r["times"][m]), "min": min(r["times"][m], default=float("nan")),
                           "call_p50": median(r["calls"][m]), "bit_exact": r["bit_exact"][m],
                           "n": len(r["times"][m])}
    memcpy = res["save"]["restore"]["times"]["memcpy"]
    out["memcpy_p50"] = median(memcpy) if memcpy else float("nan")
    memfd = res["save"]["restore"]["times"].get("memfd", [])
    out["memfd_p50"] = median(memfd) if memfd else float("nan")
    s, rs, rr = out["save"], out["restore_same"], out["restore_reshard"]
    best_dcp_stall = min(s["dcp-async"]["stall_p50"], s["dcp-async-staged"]["stall_p50"])
    out["ratios"] = {
        "stall_vs_dcp_async": s["ckptd"]["stall_p50"] / s["dcp-async"]["stall_p50"],
        "stall_vs_dcp_async_staged": s["ckptd"]["stall_p50"] / s["dcp-async-staged"]["stall_p50"],
        "stall_vs_best_dcp": s["ckptd"]["stall_p50"] / best_dcp_stall,
        "durable_vs_dcp_async": s["ckptd"]["durable_p50"] / s["dcp-async"]["durable_p50"],
        "durable_vs_dcp_async_staged": s["ckptd"]["durable_p50"] / s["dcp-async-staged"]["durable_p50"],
        "bytes_vs_dcp": (s["ckptd"]["bytes_on_disk"] / s["dcp-async"]["bytes_on_disk"]
                         if s["ckptd"]["bytes_on_disk"] and s["dcp-async"]["bytes_on_disk"] else None),
        "restore_same_vs_dcp": rs["ckptd"]["p50"] / rs["dcp"]["p50"],
        "restore_reshard_vs_dcp": rr["ckptd"]["p50"] / rr["dcp"]["p50"],
        "memory_same_vs_memcpy": rs["ckptd-memory"]["call_p50"] / out["memcpy_p50"],
        "memory_objects_same_vs_dcp": rs["ckptd-memory-objects"]["p50"] / rs["dcp"]["p50"],
        "memory_objects_reshard_vs_dcp": rr["ckptd-memory-objects"]["p50"] / rr["dcp"]["p50"],
        "memory_same_vs_memfd": rs["ckptd-memory"]["call_p50"] / out["memfd_p50"],
        "memory_same_vs_dcp": rs["ckptd-memory"]["p50"] / rs["dcp"]["p50"],
        "memory_same_vs_storage": rs["ckptd-memory"]["p50"] / rs["ckptd"]["p50"],
        "memory_reshard_vs_dcp": rr["ckptd-memory"]["p50"] / rr["dcp"]["p50"],
        "memory_same_vs_dcp_cold": rs["ckptd-memory"]["p50"] / rs["dcp-cold"]["p50"],
        "memory_reshard_vs_dcp_cold": rr["ckptd-memory"]["p50"] / rr["dcp-cold"]["p50"],
        "memory_reshard_vs_storage": rr["ckptd-memory"]["p50"] / rr["ckptd"]["p50"],
    }
    return out


def verdict(x: float, target: float) -> str:
    return "**met**" if x <= target else "**not met**"


def to_markdown(res: dict[str, Any]) -> str:
    m, cfg, s = res["machine"], res["config"], res["summary"]
    shm = f"a file in {cfg['shm_dir']}" if cfg.get("shm_dir") else "a memfd"
    sv, rs, rr, ra = s["save"], s["restore_same"], s["restore_reshard"], s["ratios"]
    mib = res["save"]["raw_bytes"] / 2**20
    lines = [
        "# ckptd sharded-state benchmark: FSDP2 vs DCP async_save / load",
        "",
        f"Generated by `benchmarks/sharded_bench.py` on {res['started']} in {res['wall_s']:.0f} s. "
        f"Machine: {m['cpu']}, {m['cores_available']} cores available, {m['ram_gib']} GiB RAM, "
        f"disk {m['disk']['device']} ({m['disk']['fstype']}), Linux {m['kernel']}, torch {m['versions']['torch']}, "
        f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}, shared memory's huge pages "
        f"(transparent_hugepage/shmem_enabled) {m['shmem_huge_pages']}; the daemon's shared memory pages: "
        f"{res.get('shared_memory', 'not recorded')}.",
        "",
        f"State: an MLP of {cfg['layers']} Linear({cfg['dim']}, {cfg['dim']}) layers "
        f"({res['save']['params'] / 1e6:.1f} M parameters) sharded with FSDP2 over {cfg['ranks']} gloo ranks "
        f"(processes on this machine's CPUs), AdamW: fp32 weights, exp_avg and exp_avg_sq, {mib:.0f} MiB in all "
        f"({res['save']['local_bytes_per_rank'] / 2**20:.0f} MiB on the largest rank), saved as "
        "`get_state_dict(model, optim)` dicts by every method.",
        "",
        f"Method: {cfg['warmup']} warm-up + {cfg['rounds']} measured rounds; each round runs every method once, "
        "in an order that rotates each round, each save in an episode of its own (a step, the save, the next "
        f"forward/backward, up to {cfg['train_while_writing']} more training steps while it is written, then a wait "
        "for it), so no method's writes overlap another's. Figures are medians over the measured rounds; "
        "ratios are ckptd ÷ DCP (lower is better for ckptd).",
        "",
        "## Headline: ckptd ÷ DCP",
        "",
        table(["figure", "ckptd ÷ DCP", "target", "verdict"], [
            ["save stall p50 vs async_save (staging in the call)", fmt(ra["stall_vs_dcp_async"], 3, "×"),
             f"≤ {TARGET_STALL}×", verdict(ra["stall_vs_dcp_async"], TARGET_STALL)],
            ["save stall p50 vs async_save (async staging)", fmt(ra["stall_vs_dcp_async_staged"], 3, "×"),
             f"≤ {TARGET_STALL}×", verdict(ra["stall_vs_dcp_async_staged"], TARGET_STALL)],
            ["time to durable p50 vs async_save (staging in the call)", fmt(ra["durable_vs_dcp_async"], 3, "×"),
             "—", ""],
            ["time to durable p50 vs async_save (async staging)", fmt(ra["durable_vs_dcp_async_staged"], 3, "×"),
             "—", ""],
            ["bytes on disk", fmt(ra["bytes_vs_dcp"], 3, "×"), "—", ""],
            [f"restore p50, same world size ({cfg['ranks']} ranks)", fmt(ra["restore_same_vs_dcp"], 3, "×"),
             f"≤ {TARGET_RESTORE_SAME}×", verdict(ra["restore_same_vs_dcp"], TARGET_RESTORE_SAME)],
            [f"restore p50, resharding {cfg['ranks']} → {cfg['reshard_ranks']} ranks",
             fmt(ra["restore_reshard_vs_dcp"], 3, "×"), f"≤ {TARGET_RESTORE_RESHARD}×",
             verdict(ra["restore_reshard_vs_dcp"], TARGET_RESTORE_RESHARD)],
            [f"restore from memory p50, same layout, ÷ DCP load (its restore call ÷ copying the shard: "
             f"{fmt(ra['memory_same_vs_memcpy'], 2, '×')}, target ≤ {TARGET_MEMORY_VS_MEMCPY}×: "
             f"{verdict(ra['memory_same_vs_memcpy'], TARGET_MEMORY_VS_MEMCPY)}; ÷ reading the shard from shared "
             "memory like the daemon's: "
             f"{fmt(ra['memory_same_vs_memfd'], 2, '×')})",
             fmt(ra["memory_same_vs_dcp"], 3, "×"), "—", ""],
            [f"restore from memory p50, resharding {cfg['ranks']} → {cfg['reshard_ranks']} ranks",
             fmt(ra["memory_reshard_vs_dcp"], 3, "×"), f"≤ {TARGET_MEMORY_RESHARD}×",
             verdict(ra["memory_reshard_vs_dcp"], TARGET_MEMORY_RESHARD)],
            ["restore from memory p50, same layout, ÷ DCP load from a cold page cache",
             fmt(ra["memory_same_vs_dcp_cold"], 3, "×"), "—", ""],
            [f"restore from memory p50, resharding {cfg['ranks']} → {cfg['reshard_ranks']} ranks, ÷ DCP load from a "
             "cold page cache (as on a node that did not write the lost node's files)",
             fmt(ra["memory_reshard_vs_dcp_cold"], 3, "×"), f"≤ {TARGET_MEMORY_RESHARD}×",
             verdict(ra["memory_reshard_vs_dcp_cold"], TARGET_MEMORY_RESHARD)],
            ["restore from memory into the model and optimizer objects p50, same layout (DCP: load + set_state_dict)",
             fmt(ra.get("memory_objects_same_vs_dcp"), 3, "×"), "—", ""],
            [f"restore from memory into the objects p50, resharding {cfg['ranks']} → {cfg['reshard_ranks']} ranks",
             fmt(ra.get("memory_objects_reshard_vs_dcp"), 3, "×"), "—", ""],
        ]),
        "",
        "## Save",
        "",
        table(["method", "stall p50", "stall max", "call p50", "fence / staging wait p50", "time to durable p50",
               "bytes on disk", "saves"],
              [[LABELS[k], fmt(v["stall_p50"] * 1e3, 1, " ms"), fmt(v["stall_max"] * 1e3, 1, " ms"),
                fmt(v["call_p50"] * 1e3, 1, " ms"), fmt(v["fence_p50"] * 1e3, 1, " ms"),
                fmt(v["durable_p50"], 2, " s"),
                f"{v['bytes_on_disk'] / 2**20:.0f} MiB" if v["bytes_on_disk"] else "n/a", v["n"]]
               for k, v in sv.items()]),
        "",
        "## Restore",
        "",
        table(["method", f"same world size ({cfg['ranks']}) p50", "of it the restore call", "min", "bit-exact",
               f"reshard {cfg['ranks']} → {cfg['reshard_ranks']} p50", "of it the restore call", "min", "bit-exact"],
              [[LABELS["ckptd-restore" if k == "ckptd" else k], fmt(rs[k]["p50"], 3, " s"),
                fmt(rs[k]["call_p50"], 3, " s"), fmt(rs[k]["min"], 3, " s"), rs[k]["bit_exact"],
                fmt(rr[k]["p50"], 3, " s"), fmt(rr[k]["call_p50"], 3, " s"), fmt(rr[k]["min"], 3, " s"),
                rr[k]["bit_exact"]] for k in RESTORE_METHODS]
              + [["copying each rank's local shards from resident memory (torch copy_, the floor)", "",
                  fmt(s["memcpy_p50"], 4, " s"), "", "", "", "", "", ""],
                 [f"reading each rank's local shards from {shm} (preadv, the floor for the daemon's shared memory)",
                  "",
                  fmt(s["memfd_p50"], 4, " s"), "", "", "", "", "", ""]]),
        "",
        "## Notes",
        "",
        "- Stall is the slowest rank's, per save: ckptd = `save()` + `fence()` after the next forward/backward;"
        " DCP = `async_save()` (+ waiting for `staging_completion` with async staging). No save waits for an"
        " earlier one: every episode ends with its save complete.",
        "- Time to durable: from the save call until the last rank learns the checkpoint is complete: ckptd's"
        " handle committed (index.json renamed into place, relayed through the c10d store); DCP's future done"
        " (files fsynced, .metadata written).",
        "- Restores read files the saves just wrote, mostly from the page cache: they measure reading, decoding"
        " and copying into the live shards (and `set_state_dict`), not the disk. The resharding restore runs in a"
        " fresh group of ranks; its bit-exactness check gathers full tensors, outside the timed region.",
        "- Restore from memory: the daemon holds the newest committed step's shards (its memory tier); each rank"
        " reads (`preadv`) the held shards it needs (its own at the same layout; every saved rank whose pieces"
        " it needs after a reshard) and copies their regions, checksummed, into the live shards: no file read,"
        " no decode. " + (
            f"Two daemons stand for two nodes ({cfg['ranks'] // 2} ranks each, one shared root), peers of each other"
            " keeping K = 1 copy of the other's held shards (sent after each commit, authenticated). Before the"
            " resharding restores node B's daemon is SIGKILLed: the ranks run on node A alone, which serves B's"
            " shards from the copies B sent it (issue 20's node loss; ckptd's saves here include that replication)."
            if cfg.get("peers") else
            "One daemon stands for every node here, so a reshard reads shards the daemon holds itself, as node A"
            " does for node B's replicas after B is lost (`--peers` runs that: results/sharded_peers.md); a copy"
            " fetched from a peer at restore time adds a loopback transfer.") +
        " Against the floor (a plain copy of the local shards) the restore"
        " call is compared, without the `set_state_dict` every other method is followed by. The objects row"
        " restores `{\"model\": model, \"optim\": optimizer}` as a training script passes them (ckptd reads into"
        " their FQN state dicts and loads them itself), from the same step.",
        "- The ranks are processes on one machine sharing its cores (and the daemon shares them too); the machine"
        " is shared with other work, so compare rows of one run, not figures across runs.",
        "",
    ]
    return "\n".join(lines)


def spawn_nodes(base: Path, extra: list[str], peers: bool) -> list[Any]:
    """One daemon; with ``peers`` two (nodes A and B, one shared root) that keep a copy of each other's
    held shards (K = 1, authenticated with a shared secret)."""
    if not peers:
        return [spawn_daemon(base / "root", base / "d.sock", *extra, log=base / "daemon.log")]
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = base / "peer-secret"
    secret.write_text("sharded-bench-" + os.urandom(16).hex())
    secret.chmod(0o600)
    daemons = []
    for name, addr in zip("ab", addrs, strict=True):
        args = ["--peer-listen", addr, "--peer-secret-file", str(secret), "--peer-replicas", "1",
                *[x for a in addrs for x in ("--peer", a)]]
        daemons.append(spawn_daemon(base / "root", base / f"{name}.sock", *extra, *args, log=base / f"{name}.log"))
    return daemons


def wait_held(sock: Path, step: int, ranks: int, timeout: float = 120.0) -> None:
    """Until the daemon at ``sock`` holds every one of ``ranks`` saved ranks of ``step`` (its own and the
    copies its peer sent): RuntimeError after ``timeout``."""
    from ckptd.core import protocol
    deadline = time.monotonic() + timeout
    while True:
        held = protocol.request_once(str(sock), {"op": "status"})["memory"]["held"]
        have = {int(r) for h in held if h["job"] == JOB and h["step"] == step and h["level"] == "storage"
                for r in h["ranks"]}
        if have >= set(range(ranks)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"node A holds ranks {sorted(have)} of step {step} after {timeout:.0f} s, "
                               f"not all {ranks}")
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small state and few rounds (a smoke run)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, help="Linear layers (default 10: ~126 MiB of state; quick 2)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--reshard-ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, help="measured rounds (default 6; quick 2)")
    p.add_argument("--warmup", type=int, help="warm-up rounds (default 1)")
    p.add_argument("--train-while-writing", type=int, default=4, help="training steps at most while a save is written")
    p.add_argument("--daemon-threads", type=int, default=None)
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--peers", action="store_true",
                   help="two daemons (nodes) keeping a copy of each other's shards; node B lost before the reshard")
    p.add_argument("--out", type=Path, default=None,
                   help="results path without extension (default: results/sharded, or sharded_peers with --peers)")
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--shm-dir", default=None,
                   help="the daemons' memory.shm_dir (a tmpfs directory, e.g. mounted huge=within_size: "
                        "docs/operations.md); the shared-memory floor is read from a file there too")
    p.add_argument("--profile", action="store_true",
                   help="cProfile rank 0's ckptd restore calls (<out>-profile-<method>-<layout>.txt)")
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_worker:
        rank_main(json.loads(Path(a.rank_worker).read_text()))
        return 0
    a.layers = a.layers or (2 if a.quick else 10)
    a.rounds = a.rounds or (2 if a.quick else 6)
    a.warmup = a.warmup if a.warmup is not None else 1
    t_start = time.time()
    base = Path(tempfile.mkdtemp(prefix="ckptd-sharded-", dir=a.dir))
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(base),
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                                      if k != "rank_worker"}}
    print(f"sharded benchmark in {base}: {res['machine']['cpu']}, {res['machine']['cores_available']} cores, "
          f"load {res['machine']['loadavg_at_start'][0]:.2f}", flush=True)
    a.out = a.out or RESULTS / ("sharded_peers" if a.peers else "sharded")
    extra = ["--keep-last", "2"] + (["--threads", str(a.daemon_threads)] if a.daemon_threads else []) \
        + (["--shm-dir", a.shm_dir] if a.shm_dir else [])
    if a.peers and (a.ranks % 2 or a.reshard_ranks > a.ranks // 2):
        p.error("--peers needs an even --ranks and --reshard-ranks at most half of it (node A alone)")
    daemons = spawn_nodes(base, extra, a.peers)
    res["shared_memory"] = daemon_shared_memory(daemons[0].socket)
    spec: dict[str, Any] = {"dim": a.dim, "layers": a.layers, "rounds": a.rounds, "warmup": a.warmup,
                            "train_while_writing": a.train_while_writing,
                            "sockets": [str(d.socket) for d in daemons], "node_size": a.ranks // len(daemons),
                            "root": str(daemons[0].root), "dcp_dir": str(base / "dcp"),
                            "ckptd_reshard_kwargs": {}, "profile": a.profile, "out": str(a.out),
                            "shm_dir": a.shm_dir}
    (base / "dcp").mkdir()
    try:
        print(f"  {a.ranks} ranks: save rounds, then restore rounds at the same world size …", flush=True)
        res["save"] = run_ranks(a.ranks, {**spec, "phase": "save"}, base, a.timeout)
        res["daemon_peak_rss_bytes"] = max((d.peak_rss() or 0 for d in daemons), default=0) or None
        if a.peers:         # node B lost: its shards of the step are the copies node A holds
            step = res["save"]["steps"]["ckptd"]
            wait_held(daemons[0].socket, step, a.ranks)
            daemons[1].proc.kill()
            daemons[1].proc.wait()
            print(f"  node B's daemon SIGKILLed; node A holds all {a.ranks} ranks of step {step}", flush=True)
        print(f"  {a.reshard_ranks} ranks: resharding restore rounds …", flush=True)
        res["reshard"] = run_ranks(a.reshard_ranks, {**spec, "phase": "reshard", "steps": res["save"]["steps"],
                                                     "digests": res["save"]["digests"],
                                                     "sockets": spec["sockets"][:1], "node_size": a.reshard_ranks},
                                   base, a.timeout)
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)
    res["wall_s"] = time.time() - t_start
    res["summary"] = summarize(res)
    write_results(a.out, res, to_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
