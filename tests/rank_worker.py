"""A long-lived rank process for round-trip tests: saves and restores states described in JSON.

One process per rank, started once per test and driven line by line over stdin/stdout (so a
property test runs many examples without starting an interpreter per example). The state is
described, not sent: ``spec`` is a JSON tree whose leaves are

- ``{"__t": [dtype, shape, seed]}``: a plain tensor, its bytes drawn from ``seed``;
- ``{"__d": [dtype, global_shape, placement, seed]}``: a DTensor on the 1-D mesh of every rank
  (``"shard0"``, ``"shard1"`` or ``"replicate"``), built with ``from_local`` (no collective);
- anything else: a JSON leaf (dicts and lists nest).

Commands, one JSON object a line; every reply is one JSON line:
``{"op": "save", "step": n, "spec": ...}`` → ``{"committed": bool, "error": str|None}``;
``{"op": "restore", "step": n, "spec": ..., "memory": bool}`` → restores into zeroed tensors of the
spec's shapes with the saving Checkpointer, compares bit for bit with the spec's values →
``{"source": str, "mismatches": [...], "error": str|None}``; ``{"op": "quit"}``.

Run as ``rank_worker.py --socket S --job J --rank R --world W --mode local|relay``; relay mode
joins a gloo group on ``$MASTER_PORT`` (the Checkpointer then relays its commits through the
group's store).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

import ckptd_client
from ckptd_client.errors import CheckpointError

MESH: Any = None


def dtype_of(name: str) -> torch.dtype:
    d = getattr(torch, name)
    assert isinstance(d, torch.dtype), name
    return d


def values(dtype: str, shape: list[int], seed: int) -> torch.Tensor:
    """The tensor a leaf describes: every byte drawn from ``seed`` (any bit pattern, NaNs included)."""
    d = dtype_of(dtype)
    numel = 1
    for n in shape:
        numel *= n
    g = torch.Generator().manual_seed(seed)
    if d is torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=d).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(d).reshape(shape)


def local_chunk(full: torch.Tensor, placement: str, rank: int, world: int) -> torch.Tensor:
    """This rank's local shard of ``full`` as DTensor's Shard(d) splits it (torch.chunk, empty past the end)."""
    if placement == "replicate":
        return full.clone()
    dim = int(placement[-1])
    chunks = list(torch.chunk(full, world, dim=dim)) if full.shape[dim] else []
    if rank < len(chunks):
        return chunks[rank].contiguous()
    shape = list(full.shape)
    shape[dim] = 0
    return torch.empty(shape, dtype=full.dtype)


def build(spec: Any, rank: int, world: int, zero: bool) -> Any:
    """The live state a spec describes; ``zero``: same shapes and dtypes, every byte zero (a restore target)."""
    if isinstance(spec, dict) and "__t" in spec:
        dtype, shape, seed = spec["__t"]
        t = values(dtype, shape, seed)
        return torch.zeros_like(t) if zero else t
    if isinstance(spec, dict) and "__d" in spec:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        dtype, gshape, placement, seed = spec["__d"]
        full = values(dtype, gshape, seed)
        local = local_chunk(full, placement, rank, world)
        if zero:
            local = torch.zeros_like(local)
        p = Replicate() if placement == "replicate" else Shard(int(placement[-1]))
        return DTensor.from_local(local, MESH, [p], run_check=False, shape=full.shape, stride=full.stride())
    if isinstance(spec, dict):
        return {k: build(v, rank, world, zero) for k, v in spec.items()}
    if isinstance(spec, list):
        return [build(v, rank, world, zero) for v in spec]
    return spec


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        t = t.to_local()
    t = t.detach().contiguous().reshape(-1)
    return t.to(torch.uint8) if t.dtype is torch.bool else t.view(torch.uint8)


def compare(want: Any, got: Any, path: str, out: list[str]) -> None:
    """Every difference between the spec's state and the restored one, bit for bit."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            out.append(f"{path}: a tensor was saved, {type(got).__name__} came back")
        elif want.dtype != got.dtype or want.shape != got.shape:
            out.append(f"{path}: saved {want.dtype} {list(want.shape)}, restored {got.dtype} {list(got.shape)}")
        elif not torch.equal(as_bytes(want), as_bytes(got)):
            out.append(f"{path}: bytes differ")
    elif isinstance(want, dict):
        if not isinstance(got, dict) or set(want) != set(got):
            out.append(f"{path}: saved keys {sorted(want) if isinstance(want, dict) else want}, restored "
                       f"{sorted(got) if isinstance(got, dict) else got}")
            return
        for k in want:
            compare(want[k], got[k], f"{path}/{k}", out)
    elif isinstance(want, list):
        if not isinstance(got, list) or len(want) != len(got):
            out.append(f"{path}: saved a list of {len(want)}, restored {got!r:.80}")
            return
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            compare(w, g, f"{path}/{i}", out)
    elif type(want) is not type(got) or want != got:
        out.append(f"{path}: saved {want!r:.80}, restored {got!r:.80}")


def main() -> int:
    global MESH
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--mode", choices=("local", "relay"), required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.mode == "relay":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                rank=a.rank, world_size=a.world)
        MESH = init_device_mesh("cpu", (a.world,))

    def checkpointer(memory: bool = True) -> ckptd_client.Checkpointer:
        if a.mode == "relay":
            return ckptd_client.Checkpointer(a.job, socket=a.socket, commit_timeout=120, memory=memory)
        return ckptd_client.Checkpointer(a.job, socket=a.socket, rank=a.rank, world_size=a.world, commit="local",
                                         commit_timeout=120, memory=memory)

    saver = checkpointer()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        reply: dict[str, Any] = {"error": None}
        try:
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "save":
                h = saver.save(cmd["step"], build(cmd["spec"], a.rank, a.world, zero=False))
                try:
                    h.wait(180)
                except CheckpointError as e:
                    reply["error"] = str(e)
                reply["committed"] = h.committed
            elif cmd["op"] == "restore":
                target = build(cmd["spec"], a.rank, a.world, zero=True)
                saver.memory = cmd["memory"]          # the saving Checkpointer restores (one run, one handshake)
                saver.restore(target, step=cmd["step"])
                assert saver.last_restore is not None
                reply["source"] = saver.last_restore.source
                mismatches: list[str] = []
                compare(build(cmd["spec"], a.rank, a.world, zero=False), target, "", mismatches)
                reply["mismatches"] = mismatches
            elif cmd["op"] == "reconnect":       # the daemon was restarted: a new session
                saver.close(timeout=10)
                saver = checkpointer()
        except Exception as e:        # reported to the driver, which fails the test with it
            reply["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(reply), flush=True)
    saver.close(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
