"""Rank processes of the sharded-state acceptance tests (tests/test_sharded.py), and how to spawn them.

Run once per rank (``launch`` does it: a group of real processes joined by
``init_process_group("gloo", init_method="tcp://127.0.0.1:<port>")``); one process without a
process group for the ``plain`` layout. A tiny model in one of these layouts:

- ``fsdp``: FSDP2 (``fully_shard``) over a 1-D mesh of every rank, placements ``Shard(0)``
  (uneven and empty shards where a dimension does not divide);
- ``fsdp-shard1``: the same with ``Shard(1)`` for matrices (``shard_placement_fn``);
- ``tp``: a 2×2 ("dp", "tp") mesh: ``parallelize_module`` ColwiseParallel / RowwiseParallel on
  "tp", then ``fully_shard`` on "dp";
- ``plain``: the model as it is, in one process;
- ``ddp``: ``DistributedDataParallel`` on every rank: plain tensors, one replica per rank. Its
  gradients are all-reduced one parameter at a time in a fixed order (``train_step``), not in
  DDP's buckets: DDP lays its buckets out anew after its first iteration, which a restarted run
  does at another step than an uninterrupted one, so the order of the sums (and their last bits)
  could differ between the two runs the tests compare loss by loss.

Modes:

- ``save``: train a few steps with AdamW and a cosine LR schedule; write the reference (each
  rank's local shards, the full tensors gathered and written by rank 0 with ``torch.save``, the
  scalars), then save the same state in both spellings (``get_state_dict`` dicts under
  ``<job>-dicts`` with ``fence_on=optimizer``, the model and optimizer objects under
  ``<job>-objects``) and train two more steps while the saves are in flight.
- ``restore``: build a fresh, differently initialised model in ``--layout``, restore one
  spelling from ``--job``, write what it holds in the reference's format.
- ``train``: FSDP2 training with a per-rank Stateful loader and per-rank RNG streams, saving
  every ``--every`` steps (the reference of each step is written before its save); on start it
  restores the latest step with ``--restore-kwargs`` (JSON) and writes what it restored.

Every mode prints ``SAVED n``, ``COMMITTED n``, ``RESTORED n``, ``LOSS n x`` lines; a restore that
raises prints ``RESTORE-ERROR <exception type>: <message>`` and exits with status 3.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import zygote
from ports import free_port
from rank_exit import leave

HERE = Path(__file__).resolve()
RESTORE_ERROR_EXIT = 3

# ---- spawning (imported by tests/test_sharded.py) ---------------------------------------------



def launch(world: int, *args: str, script: Path = HERE, preload: tuple[str, ...] = ()) -> list[zygote.Proc]:
    """``world`` rank processes of this script (one group, fresh port); world 0 = one process, no group;
    ``preload``: modules the script imports that the zygote should have imported (``zygote.popen``).

    The ranks share one process group of their own (led by rank 0), so ``kill_all`` signals them
    all at once, as a node failure would: no rank sees a peer die first and exits on its own."""
    port = free_port()
    procs: list[zygote.Proc] = []
    for rank in range(max(1, world)):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_PORT": str(port),
               "LOCAL_WORLD_SIZE": str(max(1, world)), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # as torchrun
        leader = procs[0].pid if procs else 0
        procs.append(zygote.popen([sys.executable, str(script), *args], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pgid=leader, preload=preload))
    return procs


def kill_all(procs: list[zygote.Proc], sig: int = signal.SIGKILL) -> None:
    """``sig`` to every rank at once (their process group); returns when all have exited."""
    os.killpg(procs[0].pid, sig)
    for p in procs:
        p.wait(timeout=30)


def kill_after_commit(procs: list[zygote.Proc], step: int) -> list[str]:
    """Read rank 0's output until it reports step ``step`` (or a later one) committed, then SIGKILL
    every rank at once (``kill_all``, also when the read fails); the lines read."""
    seen: list[str] = []
    try:
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            seen.append(line)
            if line.startswith("COMMITTED") and int(line.split()[1]) >= step:
                break
    finally:
        kill_all(procs, signal.SIGKILL)
    return seen


def finish(procs: list[zygote.Proc], timeout: float = 180, expect_rc: int = 0) -> list[str]:
    """Every rank's output; each must exit with ``expect_rc`` (a hung group is killed)."""
    deadline = time.monotonic() + timeout
    outs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        dump = "\n".join(f"--- rank {r}:\n{p.communicate()[0]}" for r, p in enumerate(procs))
        raise AssertionError(f"rank group still running after {timeout:.0f} s:\n{dump}") from None
    bad = [r for r, p in enumerate(procs) if p.returncode != expect_rc]
    if bad:
        dump = "\n".join(f"--- rank {r} (exit {procs[r].returncode}):\n{outs[r][-6000:]}" for r in bad)
        raise AssertionError(f"ranks {bad} did not exit with {expect_rc}:\n{dump}")
    return outs


def run_group(world: int, *args: str, timeout: float = 180, expect_rc: int = 0, script: Path = HERE,
              preload: tuple[str, ...] = ()) -> list[str]:
    return finish(launch(world, *args, script=script, preload=preload), timeout, expect_rc)


def lines(out: str, tag: str) -> list[list[str]]:
    """The words after ``tag`` of every line that starts with it."""
    return [line.split()[1:] for line in out.splitlines() if line.startswith(tag + " ")]


# ---- the model and its layouts ----------------------------------------------------------------

D_IN, D_HID, D_OUT = 16, 64, 10      # 10 rows: uneven FSDP2 shards at 4 ranks, empty ones at 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D_IN)
        self.up = torch.nn.Linear(D_IN, D_HID)
        self.down = torch.nn.Linear(D_HID, D_IN)
        self.head = torch.nn.Linear(D_IN, D_OUT)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, D_IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) + self.shift
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h)


def build(layout: str, seed: int) -> tuple[Any, int, int]:
    """The model in ``layout`` initialised from ``seed``: (model, data-parallel rank, dp size)."""
    from torch.distributed.tensor import Shard

    torch.manual_seed(seed)
    model = Net()
    if layout == "plain":
        return model, 0, 1
    if layout == "ddp":         # plain tensors, a replica on every rank, gradients all-reduced
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, torch.distributed.get_rank(), torch.distributed.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    if layout in ("fsdp", "fsdp-shard1"):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fn = (lambda p: Shard(1) if p.ndim > 1 else Shard(0)) if layout == "fsdp-shard1" else None
        for sub in (model.up, model.down, model.head):
            fully_shard(sub, mesh=mesh, shard_placement_fn=fn)
        fully_shard(model, mesh=mesh, shard_placement_fn=fn)
        return model, rank, world
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        assert world == 4, "the tp layout is a 2x2 mesh"
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for sub in (model.up, model.down, model.head):
            fully_shard(sub, mesh=mesh2["dp"])
        fully_shard(model, mesh=mesh2["dp"])
        return model, mesh2["dp"].get_local_rank(), 2
    raise ValueError(f"unknown layout {layout!r}")


def make_optim(model: Net, t_max: int) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.CosineAnnealingLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)


def batch(step: int, dp_rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: the same for every tensor-parallel rank of one data-parallel rank."""
    g = torch.Generator().manual_seed(10_000 * step + dp_rank)
    x = torch.randn(n, D_IN, generator=g)
    return x, torch.randn(n, D_OUT, generator=g)


def train_step(model: Net, opt: torch.optim.Optimizer, sched: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    local = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else contextlib.nullcontext()            # the ``ddp`` layout: see the docstring
    with local:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
    if ddp:
        world = torch.distributed.get_world_size()
        for p in model.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world)
    opt.step()
    sched.step()
    return float(loss.detach())


# ---- what a rank holds, in one format for references and restores ----------------------------

def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def named_tensors(model: Net, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Parameters, buffers and every AdamW tensor keyed by parameter FQN (sorted: the same order on
    every rank, so gathering them is collective-safe)."""
    out: list[tuple[str, torch.Tensor]] = []
    for fqn, p in model.named_parameters():
        out.append((f"model/{fqn}", p.detach()))
        for k, v in sorted(opt.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                out.append((f"optim/{fqn}/{k}", v))
    out += [(f"buffer/{fqn}", b) for fqn, b in model.named_buffers()]
    return sorted(out)


def scalars(opt: torch.optim.Optimizer, sched: Any, meta: dict[str, Any]) -> dict[str, Any]:
    return {"lr": [g["lr"] for g in opt.param_groups], "sched_last_epoch": sched.last_epoch,
            "sched_last_lr": sched.get_last_lr(), "meta": dict(meta)}


def snapshot(out: Path, tag: str, model: Net, opt: torch.optim.Optimizer, sched: Any, meta: dict[str, Any],
             extra: dict[str, Any] | None = None) -> None:
    """``<tag>.rank<r>.pt``: local shards + scalars; ``<tag>.full.pt`` (rank 0): full tensors.
    Collective (every rank gathers the full tensors); written to a temporary name, then renamed."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    local: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    placements: dict[str, str] = {}
    for name, t in named_tensors(model, opt):
        if is_dtensor(t):
            local[name] = t.to_local().detach().clone()   # type: ignore[attr-defined]
            full[name] = t.full_tensor().detach().clone()  # type: ignore[attr-defined]
            placements[name] = str(t.placements)           # type: ignore[attr-defined]
        else:
            local[name] = full[name] = t.detach().clone()
    record = {"local": local, "placements": placements, "scalars": scalars(opt, sched, meta), **(extra or {})}
    _atomic_save(record, out / f"{tag}.rank{rank}.pt")
    if rank == 0:
        _atomic_save(full, out / f"{tag}.full.pt")


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ---- modes ------------------------------------------------------------------------------------

def init_group() -> tuple[int, int]:
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if world > 0:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                             rank=rank, world_size=world, timeout=timedelta(seconds=120))
    return rank, max(1, world)


def checkpointer(a: argparse.Namespace, job: str) -> Any:
    import ckptd_client
    if a.socket:     # "a,b": the ranks spread over the daemons in order (2 nodes: ranks 0-1 on a, 2-3 on b)
        sockets, world = a.socket.split(","), max(1, int(os.environ["WORLD_SIZE"]))
        return ckptd_client.Checkpointer(job, socket=sockets[int(os.environ["RANK"]) * len(sockets) // world])
    alone = int(os.environ["WORLD_SIZE"]) == 0
    return ckptd_client.Checkpointer(job, socket="/nonexistent/ckptd.sock", root=a.root,
                                     rank=0 if alone else None, world_size=1 if alone else None)


def spelled(spelling: str, model: Net, opt: torch.optim.Optimizer, sched: Any,
            meta: dict[str, Any]) -> dict[str, Any]:
    if spelling == "objects":
        return {"model": model, "optim": opt, "sched": sched, "meta": meta}
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched, "meta": meta}


def mode_save(a: argparse.Namespace) -> None:
    init_group()
    model, dp_rank, _ = build(a.layout, seed=1)
    opt, sched = make_optim(model, t_max=20)
    meta: dict[str, Any] = {"epoch": 0, "step": 0, "note": "sharded"}
    for step in range(1, a.steps + 1):
        loss = train_step(model, opt, sched, *batch(step, dp_rank))
        print(f"LOSS {step} {loss!r}", flush=True)
    meta.update(step=a.steps, epoch=a.steps // 2)
    snapshot(Path(a.out), "saved", model, opt, sched, meta)
    handles = []
    cks = []
    for spelling in ("dicts", "objects"):
        ck = checkpointer(a, f"{a.job}-{spelling}")
        cks.append(ck)
        state = spelled(spelling, model, opt, sched, meta)
        kwargs = {"fence_on": opt} if spelling == "dicts" else {}
        handles.append(ck.save(a.steps, state, **kwargs))
        print(f"SAVED {a.steps} {spelling}", flush=True)
    for step in range(a.steps + 1, a.steps + 3):    # mutate everything while the saves are in flight
        print(f"LOSS-AFTER {step} {train_step(model, opt, sched, *batch(step, dp_rank))!r}", flush=True)
    for h in handles:
        h.wait(120)
    print(f"COMMITTED {a.steps}", flush=True)
    for ck in cks:
        ck.close()


def restore_into(a: argparse.Namespace, ck: Any, spelling: str, model: Net, opt: torch.optim.Optimizer,
                 sched: Any, meta: dict[str, Any], extra: dict[str, Any] | None = None) -> int | None:
    """Restore ``spelling`` into the live objects; on an exception print RESTORE-ERROR and exit 3."""
    kwargs = json.loads(a.restore_kwargs)
    state = spelled(spelling, model, opt, sched, meta)
    state.update(extra or {})
    try:
        step = ck.restore(state, **kwargs)
    except Exception as e:
        print(f"RESTORE-ERROR {type(e).__module__}.{type(e).__qualname__}: {e}", flush=True)
        if torch.distributed.is_initialized():
            # Rank 0 holds the TCP store: leave together, so no rank sees its peer vanish mid-restore.
            # (A restore that fails on some ranks only hangs here until the group times out: a failure.)
            torch.distributed.barrier()
        os._exit(RESTORE_ERROR_EXIT)
    info = ck.last_restore
    if info is not None:
        print(f"RESTORE-INFO {info.source} {info.from_memory} {info.from_peers} {info.from_storage}", flush=True)
        print(f"RESTORE-LEVEL {info.level} {json.dumps([u.reason for u in info.passed])}", flush=True)
        print(f"RESTORE-WHOLE {info.whole}", flush=True)
    if spelling == "dicts" and step is not None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta.update(state["meta"])
    return step


def mode_restore(a: argparse.Namespace) -> None:
    init_group()
    model, dp_rank, _ = build(a.layout, seed=2)
    opt, sched = make_optim(model, t_max=20)
    meta: dict[str, Any] = {"epoch": -1, "step": -1, "note": "fresh"}
    ck = checkpointer(a, a.job)
    step = restore_into(a, ck, a.spelling, model, opt, sched, meta)
    print(f"RESTORED {step}", flush=True)
    snapshot(Path(a.out), a.tag, model, opt, sched, meta, {"step": step})
    if a.then_step and step is not None:   # the next training step, as the saving run took it (LOSS-AFTER)
        print(f"LOSS-AFTER {step + 1} {train_step(model, opt, sched, *batch(step + 1, dp_rank))!r}", flush=True)
    ck.close()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()    # rank 0 hosts the store: nobody leaves while a rank still reads it


class RankLoader:
    """A shuffling loader over a fixed dataset; its position and its shuffle stream are per rank.

    Its state (position, and the generator state each epoch's order was drawn from) has the same
    shapes at any world size; at another world size the position indexes another partition of
    the data, so it carries on from there with its own order."""

    def __init__(self, rank: int, world: int, n: int = 256, batch: int = 8) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, D_IN, generator=g)
        self.y = torch.randn(n, D_OUT, generator=g)
        self.rank, self.world, self.batch = rank, world, batch
        self.gen = torch.Generator().manual_seed(100 + rank)
        self.epoch, self.pos, self.served = 0, 0, 0
        self.loaded_from: int | None = None
        self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch_gen = self.gen.get_state()
        self.order = torch.randperm(len(self.x), generator=self.gen)[self.rank::self.world]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > len(self.order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._new_epoch()
        idx = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        self.served += 1
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "epoch": self.epoch, "pos": self.pos, "served": self.served,
                "epoch_gen": self.epoch_gen.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.pos, self.served = sd["epoch"], sd["pos"], sd["served"]
        self.gen.set_state(sd["epoch_gen"])
        self._new_epoch()
        self.loaded_from = sd["rank"]


def mode_train(a: argparse.Namespace) -> None:
    import ckptd_client
    rank, world = init_group()
    out = Path(a.out)
    model, dp_rank, dp = build(a.layout, seed=1)
    opt, sched = make_optim(model, t_max=a.steps)
    meta: dict[str, Any] = {"epoch": 0, "step": 0, "note": "train"}
    # Per-rank RNG streams (dropout, noise); the tensor-parallel ranks of one data-parallel rank
    # share theirs, so their inputs (and the replicas they each update) stay identical.
    torch.manual_seed(1000 + dp_rank)
    loader = RankLoader(dp_rank, dp)
    ck = checkpointer(a, a.job)
    rng = ckptd_client.RNGState()
    extra = {"data": loader, "rng": rng}
    start = restore_into(a, ck, "objects", model, opt, sched, meta, extra) or 0
    if start:
        print(f"RESTORED {start}", flush=True)
        snapshot(out, f"restored-w{world}", model, opt, sched, meta,
                 {"step": start, "loader": {"epoch": loader.epoch, "pos": loader.pos, "served": loader.served,
                                            "from": loader.loaded_from},
                  "torch_rng": torch.get_rng_state()})
    handles: list[Any] = []
    for step in range(start + 1, a.steps + 1):
        x, y = loader.next()
        x = x + 0.01 * torch.randn_like(x)          # consumes the per-rank RNG stream
        loss = train_step(model, opt, sched, x, y)
        if not math.isfinite(loss):
            raise RuntimeError(f"loss {loss} at step {step}")
        print(f"LOSS {step} {loss!r}", flush=True)
        level = "storage" if step % a.every == 0 else "memory" if a.memory_every and step % a.memory_every == 0 \
            else None
        if level is not None:
            meta.update(step=step, epoch=loader.epoch)
            snapshot(out, f"ref-step{step}", model, opt, sched, meta,
                     {"loader": loader.state_dict(), "torch_rng": torch.get_rng_state()})
            handles.append(ck.save(step, {"model": model, "optim": opt, "sched": sched, "meta": meta,
                                          **extra}, level=level))
            print(f"SAVED {step}", flush=True)
        for h in [h for h in handles if h.done()]:
            handles.remove(h)
            h.wait()
            print(f"COMMITTED {h.step}", flush=True)
        if a.step_sleep:
            time.sleep(a.step_sleep)
    for h in handles:
        h.wait(120)
        print(f"COMMITTED {h.step}", flush=True)
    ck.close()
    print("DONE", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("save", "restore", "train"))
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True, help="directory for references and results")
    p.add_argument("--socket", help="daemon socket (saves); without it, restore from --root")
    p.add_argument("--root")
    p.add_argument("--layout", default="fsdp", choices=("fsdp", "fsdp-shard1", "tp", "plain", "ddp"))
    p.add_argument("--spelling", default="objects", choices=("dicts", "objects"))
    p.add_argument("--then-step", action="store_true", help="restore: then take the next training step")
    p.add_argument("--tag", default="restored")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--memory-every", type=int, default=0, help="train: a memory-level save every N steps "
                   "(the steps --every does not save to storage)")
    p.add_argument("--restore-kwargs", default="{}", help="JSON keyword arguments for Checkpointer.restore")
    a = p.parse_args()
    torch.set_num_threads(1)
    {"save": mode_save, "restore": mode_restore, "train": mode_train}[a.mode](a)
    leave()


if __name__ == "__main__":
    sys.exit(main())
