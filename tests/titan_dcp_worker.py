"""Rank process of tests/test_titan_dcp.py: tests/titan_worker.py's loop (torchtitan's llama3 debug model,
FSDP2 on gloo, CPU) checkpointed by torchtitan's *stock* DCP checkpoint manager with ckptd as DCP's
storage (``ckptd_client.dcp.titan.CkptdDcpCheckpointManager``, ``async_mode="async"``).

The last step saves the model alone (``last_save_model_only``: torchtitan flattens its FQNs to the top
level); a run that reaches it writes the trained model's full tensors to ``--out`` (rank 0, ``torch.save``).

Prints ``LOSS <step> <float.hex>`` per step and ``START <step>`` after loading. With ``--kill-at N``
every rank waits for the last save (``maybe_wait_for_saving``), prints ``KILLED N`` and SIGKILLs itself
after step N's training step (before its save).
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
from rank_exit import leave
from titan_worker import build_run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--folder", required=True)
    p.add_argument("--out")
    a = p.parse_args()
    rank, model, optimizers, schedulers, loader, train_state = build_run(a.steps)
    from ckptd_client.dcp.titan import CkptdDcpCheckpointManager

    manager = CkptdDcpCheckpointManager.Config(
        enable=True, job=a.job, socket=a.socket, interval=a.interval, keep_latest_k=2, folder=a.folder,
        async_mode="async", last_save_model_only=True,
    ).build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
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
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}      # a collective: every rank
    if rank == 0 and a.out:
        torch.save(full, a.out)
    leave()


if __name__ == "__main__":
    main()
