"""Runs one of the README's tested code blocks exactly as printed, around a tiny model.

``python readme_worker.py BLOCK LOSSES [KILL_AT]``: BLOCK is the marker's test name
(tests/test_readme.py), LOSSES a file that gets one ``step loss`` line per trained step (the
loss's float hex: bit-exact), KILL_AT a step at which the process SIGKILLs itself once the
newest save before it is committed. The daemon is the one at $CKPTD_SOCKET, as the README says.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

README = Path(__file__).resolve().parent.parent / "README.md"
TOTAL_STEPS, SAVE_EVERY, SEQ = 24, 5, 8


def block(test_name: str) -> str:
    """The python block right after ``<!-- tested as printed: ...::test_name -->``."""
    text = README.read_text()
    m = re.search(rf"<!-- tested as printed: tests/test_readme\.py::{re.escape(test_name)} -->\n```python\n(.*?)```",
                  text, re.S)
    if m is None:
        raise SystemExit(f"README.md has no tested block for {test_name}")
    return m.group(1)


def main() -> None:
    name, losses = sys.argv[1], Path(sys.argv[2])
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.manual_seed(1234)          # the same fresh model in every run; a resume overwrites it
    model = torch.nn.Sequential(torch.nn.Linear(SEQ, 32), torch.nn.Dropout(0.2), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    torch.manual_seed(99)            # the global RNG as a fresh run has it (a resume restores its own)
    ns: dict[str, Any] = {}
    out = losses.open("a")

    def train(batch: torch.Tensor) -> None:
        step = ns["step"]
        if kill_at is not None and step == kill_at:
            want = (kill_at // SAVE_EVERY) * SAVE_EVERY
            deadline = time.monotonic() + 60
            while ns["ckpt"].latest_step() != want and time.monotonic() < deadline:
                time.sleep(0.05)
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch[..., :SEQ].float(), batch[..., SEQ:].float()
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if "sched" in ns["state"]:
            scheduler.step()
        out.write(f"{step} {float(loss.item()).hex()}\n")
        out.flush()

    def data(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, SEQ + 1, generator=g)

    import ckptd_client
    ns.update(model=model, optimizer=optimizer, scheduler=scheduler, total_steps=TOTAL_STEPS,
              save_every=SAVE_EVERY, ckptd_client=ckptd_client,
              train_step=lambda: train(data(ns["step"]) + torch.randn(4, SEQ + 1) * 0.01),
              dataset=[data(i)[0] for i in range(20)])
    if name != "test_the_readme_loop_resumes_exactly":
        ns["ckpt"] = ckptd_client.Checkpointer(job="loader")
        ns["train_step"] = lambda batch: train(batch + torch.randn_like(batch) * 0.01)
    exec(compile(block(name), f"README.md:{name}", "exec"), ns)
    out.close()


if __name__ == "__main__":
    main()
