"""Rank process of tests/test_torchtitan.py: torchtitan's llama3 debug model trained on CPU with gloo
and FSDP2, checkpointed by ``ckptd_client.torchtitan.CkptdCheckpointManager``.

torchtitan's own Trainer needs CUDA (and a tokenizer and dataset from disk), and its debug model's
FlexAttention has no backward on CPU, so this drives torchtitan's components in a loop of its own:
the ``debugmodel`` flavor from torchtitan's llama3 registry with its inner attention switched to
torchtitan's ``ScaledDotProductAttention`` (same parameters), ``default_adamw`` ->
``OptimizersContainer``, ``LRSchedulersContainer`` (warmup + linear decay), a synthetic token
loader (a Stateful with its position), and the manager called where torchtitan's Trainer calls it:
``load(load_step)`` before training, ``maybe_wait_for_staging()`` before ``optimizers.step()``,
``save(step, last_step)`` after each step, ``close()`` at the end.

Prints ``LOSS <step> <float.hex>`` per step and ``START <step>`` after loading. With
``--kill-at N`` every rank waits for the last save to commit, prints ``KILLED N`` and SIGKILLs
itself after step N's training step (before its save).
"""
from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta
from typing import Any

import torch
from rank_exit import leave

BATCH, SEQ, VOCAB = 2, 16, 2048


class TokenLoader:
    """Deterministic synthetic batches per (position, rank); its state is the position."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pos = rank, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.pos + self.rank)
        self.pos += 1
        return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = int(sd["pos"])


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


def build_run(steps: int) -> tuple[int, Any, Any, Any, TokenLoader, TrainState]:
    """Join the gloo group (RANK, WORLD_SIZE, MASTER_PORT) and build the run both torchtitan workers
    train: llama3's debug model under FSDP2, AdamW, the warm-up/linear-decay schedule, the loader
    and the train state. (rank, model, optimizers, lr schedulers, loader, train state)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                         rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel").model
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                              min_lr_factor=0.0).build(optimizers=optimizers, training_steps=steps)
    return rank, model, optimizers, schedulers, TokenLoader(rank), TrainState()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--memory-interval", type=int, default=0, help="memory-level saves every N steps")
    p.add_argument("--folder", required=True)
    p.add_argument("--hf-last", action="store_true", help="last step: model only, exported as HF safetensors")
    p.add_argument("--hf-init", help="initial_load_in_hf from this directory")
    p.add_argument("--dump", help="write the full model weights here (safetensors) at the end")
    a = p.parse_args()
    rank, model, optimizers, schedulers, loader, train_state = build_run(a.steps)
    from ckptd_client.torchtitan import CkptdCheckpointManager

    manager = CkptdCheckpointManager.Config(
        enable=True, job=a.job, socket=a.socket, interval=a.interval, memory_interval=a.memory_interval,
        keep_latest_k=2, folder=a.folder,
        last_save_model_only=a.hf_last, last_save_in_hf=a.hf_last, export_dtype="float32",
        initial_load_in_hf=a.hf_init is not None, initial_load_path=a.hf_init).build(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state}, sd_adapter=None)
    manager.load(step=-1)
    print(f"START {train_state.step}", flush=True)
    while train_state.step < a.steps:
        train_state.step += 1
        tokens = loader.next()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        manager.maybe_wait_for_staging()
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        print(f"LOSS {train_state.step} {float(loss.detach()).hex()}", flush=True)
        if train_state.step == a.kill_at:
            manager.maybe_wait_for_saving()
            print(f"KILLED {a.kill_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        manager.save(train_state.step, last_step=train_state.step == a.steps)
    manager.maybe_wait_for_saving()
    manager.close()
    if a.dump:
        from safetensors.torch import save_file
        from torch.distributed.tensor import DTensor
        # model.state_dict(): its hooks split the fused QKV weight, as the checkpoints see it.
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, a.dump)
    leave()


if __name__ == "__main__":
    main()
