"""Rank processes of tests/test_hf.py (spawned with ``sharded_trainer.launch(..., script=...)``).

Models: ``llama`` (transformers' LlamaForCausalLM on a tiny config made here, no downloads) and
``mlp`` (a stack of square Linear layers, for the memory test). Layouts: ``ddp``
(DistributedDataParallel: names get ``module.``), ``fsdp`` (FSDP2 ``fully_shard`` per block and
the root), ``plain`` (one process). Modes:

- ``save``: build the model (same seed on every rank), one AdamW step on rank-dependent data,
  then save ``{"model", "optim", "step"}`` through the daemon and wait for the commit; rank 0
  writes the full weights (canonical names) to ``--ref`` with safetensors.
- ``restore``: a fresh model (another seed) in ``--layout``, ``Checkpointer.restore({"model": m})``
  from ``--root``/``--job`` (no daemon), then the full weights to ``--ref``.
  Given ``--hf``, then another fresh model loaded by ``ckptd_client.load_hf(model, --hf)`` (each
  rank reading its own slices), its full weights to ``--ref`` + ``.direct``.
"""
from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

import torch
from rank_exit import leave


def llama_config() -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def build(model: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if model == "llama":
        from transformers import LlamaForCausalLM
        return LlamaForCausalLM(llama_config())
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(int(os.environ.get("HF_MLP_LAYERS", "64")))])


def blocks(m: Any) -> list[torch.nn.Module]:
    return list(m.model.layers) if hasattr(m, "model") else list(m)


def wrap(m: torch.nn.Module, layout: str) -> torch.nn.Module:
    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(m)
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for b in blocks(m):
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m


def full_weights(m: Any, layout: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict, whole, under its canonical name (collective)."""
    if layout == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd: dict[str, Any] = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = (m.module if layout == "ddp" else m).state_dict()
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def loss_of(m: torch.nn.Module, model: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    if model == "llama":
        ids = torch.randint(0, 1024, (2, 16), generator=g)
        return m(input_ids=ids, labels=ids).loss
    return m(torch.randn(4, 512, generator=g)).square().mean()


def dump(full: dict[str, torch.Tensor], path: str, rank: int) -> None:
    from safetensors.torch import save_file
    if rank == 0:
        save_file(full, path + ".tmp")
        os.replace(path + ".tmp", path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("save", "restore"))
    p.add_argument("--model", default="llama")
    p.add_argument("--layout", default="plain")
    p.add_argument("--root")
    p.add_argument("--socket")
    p.add_argument("--job", default="hf")
    p.add_argument("--hf")
    p.add_argument("--ref", required=True)
    a = p.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", "0")), int(os.environ.get("RANK", "0"))
    if world > 0:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                             rank=rank, world_size=world, timeout=timedelta(seconds=120))
    import ckptd_client
    m = wrap(build(a.model, 0 if a.mode == "save" else 1), a.layout)
    if a.mode == "save":
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        loss_of(m, a.model, rank).backward()
        opt.step()
        ck = ckptd_client.Checkpointer(a.job, socket=a.socket)
        state = {"model": m, "optim": opt, "step": 1} if a.model == "llama" else {"model": m, "step": 1}
        ck.save(1, state).wait(120)
        print("COMMITTED 1", flush=True)
        ck.close()
    else:
        ck = ckptd_client.Checkpointer(a.job, socket="/nonexistent/ckptd.sock", root=a.root,
                                       rank=rank if world else 0, world_size=max(1, world))
        print("RESTORED", ck.restore({"model": m}), flush=True)
    dump(full_weights(m, a.layout), a.ref, rank)
    if a.hf:
        m = wrap(build(a.model, 2), a.layout)
        ckptd_client.load_hf(m, a.hf)
        dump(full_weights(m, a.layout), a.ref + ".direct", rank)
    if world > 0:
        torch.distributed.barrier()
    leave()


if __name__ == "__main__":
    main()
