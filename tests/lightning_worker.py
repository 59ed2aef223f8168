"""A Lightning run for tests/test_lightning_plugin.py: a tiny LightningModule trained on CPU by a real
``lightning.Trainer`` whose checkpoints go through ``ckptd_client.lightning.CkptdCheckpointIO``
(ModelCheckpoint every 4 steps, ``save_last=True``). Prints ``LOSS <step> <float.hex>`` per training
step (``step``: optimizer steps done before it). ``--kill-at N`` SIGKILLs the process at the start of
the training step after N steps, once the saves so far are committed and their pointers written. ``--resume``:
``fit(ckpt_path="last")``. ``--pl``: the same run with the standalone ``pytorch_lightning`` package (its
Trainer, LightningModule and ModelCheckpoint) instead of ``lightning``."""
from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import lightning.pytorch
import pytorch_lightning
import torch

from ckptd_client.lightning import AsyncCkptdCheckpointIO, CkptdCheckpointIO


def module_class(pl: Any) -> Any:
    """The tiny LightningModule, a subclass of ``pl.LightningModule`` (each Trainer takes only its own)."""

    class Net(pl.LightningModule):
        def __init__(self, kill_at: int) -> None:
            super().__init__()
            self.layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.kill_at = kill_at

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == self.kill_at:
                io = self.trainer.strategy.checkpoint_io
                assert isinstance(io, CkptdCheckpointIO)
                io.wait_for_saves()             # the last save's pointer is written (async: its commit came)
                print(f"KILLED {self.global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            print(f"LOSS {self.global_step} {float(loss.detach()).hex()}", flush=True)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    return Net


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--socket", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--async-io", action="store_true")
    p.add_argument("--pl", action="store_true")
    a = p.parse_args()
    pl: Any = pytorch_lightning if a.pl else lightning.pytorch
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)     # 4 steps an epoch
    io = (AsyncCkptdCheckpointIO if a.async_io else CkptdCheckpointIO)(a.job, socket=a.socket)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=a.steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=[io],
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=a.dir, every_n_train_steps=4, save_last=True,
                                                                 save_top_k=-1)])
    trainer.fit(module_class(pl)(a.kill_at), loader, ckpt_path="last" if a.resume else None)
    print(f"DONE {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
