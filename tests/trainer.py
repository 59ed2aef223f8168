"""A small but real DDP training job used by the acceptance tests (run as a subprocess per rank).

Dropout, AdamW, a cosine LR schedule, a shuffling Stateful data loader and RNG state all go
through ckptd; on start it restores the latest committed step, so a killed run resumes.
Prints ``SAVED n`` / ``COMMITTED n`` / ``RESTORED n`` lines and writes the final model and
optimizer tensors to ``--out`` (a safetensors file per rank) at the end.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from rank_exit import leave
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

import ckptd_client


class ShuffledLoader:
    """Deterministic shuffling loader over an in-memory dataset; its position is checkpointed."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int, rank: int, world: int, seed: int) -> None:
        self.x, self.y, self.batch, self.rank, self.world, self.seed = x, y, batch, rank, world, seed
        self.epoch, self.pos = 0, 0

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.x), generator=g)[self.rank::self.world]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        order = self._order()
        if self.pos + self.batch > len(order):
            self.epoch, self.pos = self.epoch + 1, 0
            order = self._order()
        idx = order[self.pos: self.pos + self.batch]
        self.pos += self.batch
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.pos = sd["epoch"], sd["pos"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sockets", required=True, help="comma-separated daemon sockets; ranks split evenly")
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=64)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sockets = a.sockets.split(",")
    sock = sockets[rank * len(sockets) // world]

    torch.manual_seed(1234 + rank)          # per-rank dropout streams
    data_g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 32, generator=data_g)
    y = (x @ torch.randn(32, 1, generator=data_g)).squeeze(1)
    init_g = torch.Generator().manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(32, a.hidden), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(a.hidden, 1))
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=init_g) * 0.1)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
    loader = ShuffledLoader(x, y, batch=16, rank=rank, world=world, seed=11)
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "data": loader,
                             "rng": ckptd_client.RNGState(), "meta": {"note": "trainer", "step": 0}}

    ckpt = ckptd_client.Checkpointer(a.job, socket=sock)
    start = ckpt.restore(state) or 0
    if start:
        print(f"RESTORED {start}", flush=True)
        assert ckpt.last_restore is not None
        print(f"RESTORE_SOURCE {ckpt.last_restore.source} {ckpt.last_restore.fallback or ''}", flush=True)
    assert state["meta"]["step"] == start
    pending: list[ckptd_client.SaveHandle] = []
    for step in range(start, a.steps):
        bx, by = loader.next()
        loss = torch.nn.functional.mse_loss(ddp(bx).squeeze(1), by)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        done = step + 1
        if done % a.every == 0:
            state["meta"]["step"] = done
            pending.append(ckpt.save(done, state))
            print(f"SAVED {done}", flush=True)
        for h in [h for h in pending if h.done()]:
            pending.remove(h)
            h.wait()
            print(f"COMMITTED {h.step}", flush=True)
        if a.step_sleep:
            time.sleep(a.step_sleep)
    for h in pending:
        h.wait(120)
        print(f"COMMITTED {h.step}", flush=True)
    ckpt.close()

    out = {f"model/{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{pid}/{k}"] = v.detach().clone().contiguous().reshape(v.shape)
    save_file(out, f"{a.out}.rank{rank}.safetensors")
    leave()


if __name__ == "__main__":
    sys.exit(main())
