"""Lightning through ckptd (issue 23, acceptance 4): a real ``lightning.Trainer`` on CPU with
``CkptdCheckpointIO`` (tests/lightning_worker.py) is SIGKILLed after a checkpoint and resumed with
``ckpt_path="last"``: the resumed run's losses equal an uninterrupted run's bit for bit. The plugin
refuses values ckptd cannot store, naming the key, and keeps dict keys that are paths. The same plugin
plugs into the standalone ``pytorch_lightning`` package's Trainer."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote

from ckptd_client.errors import CheckpointError
from ckptd_client.lightning import SAVES_PER_STEP, AsyncCkptdCheckpointIO, CkptdCheckpointIO

WORKER = Path(__file__).with_name("lightning_worker.py")
LIGHTNING = ("lightning.pytorch", "pytorch_lightning")     # the worker's imports: 8 s a run, once in its zygote
pytestmark = pytest.mark.timeout(300)


def fit(io: CkptdCheckpointIO, checkpoint: Any, max_steps: int, ckpt_path: str | None = None) -> list[int]:
    """A tiny module fitted by a real ``lightning.Trainer`` through ``io`` with the ModelCheckpoint
    ``checkpoint``; it logs ``score`` = its global step (newest is best). Returns the global steps it trained."""
    import lightning.pytorch as pl

    steps: list[int] = []

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            steps.append(self.global_step)
            self.log("score", float(self.global_step))
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    trainer = pl.Trainer(max_steps=max_steps, plugins=[io], callbacks=[checkpoint], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return steps


def run(*args: str, expect_rc: int = 0) -> dict[int, str]:
    r = zygote.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=180,
                   preload=LIGHTNING)
    assert r.returncode == expect_rc, r.stdout[-3000:] + r.stderr[-3000:]
    return {int(w[1]): w[2] for w in (line.split() for line in r.stdout.splitlines()) if w and w[0] == "LOSS"}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_then_resume_from_last_matches(daemon_factory: Any, tmp: Path, mode: str) -> None:
    d = daemon_factory()
    extra = ("--async-io",) if mode == "async" else ()
    want = run("--socket", str(d.socket), "--job", "ref", "--dir", str(tmp / "ref"), *extra)
    assert sorted(want) == list(range(12))
    common = ("--socket", str(d.socket), "--job", "run", "--dir", str(tmp / "run"), *extra)
    killed = run(*common, "--kill-at", "9", expect_rc=-9)
    assert killed == {k: want[k] for k in range(9)}
    pointer = json.loads((tmp / "run/last.ckpt").read_text())
    assert pointer["kind"] == "ckptd.pointer" and pointer["job"] == "run"
    assert pointer["step"] == 8 * SAVES_PER_STEP + 1        # global step 8's second save: last.ckpt after top-k
    resumed = run(*common, "--resume")
    assert resumed == {k: want[k] for k in range(8, 12)}
    v = zygote.run([*zygote.CKPTD, "verify", str(tmp / "root"), "run", str(pointer["step"])],
                   capture_output=True, text=True, timeout=60)
    assert v.returncode == 0, v.stdout + v.stderr


def test_pytorch_lightning_trainer_resumes_from_last(daemon_factory: Any, tmp: Path) -> None:
    """A short variant with ``pytorch_lightning.Trainer``: 8 steps, killed after the step-4 save."""
    d = daemon_factory()
    want = run("--pl", "--steps", "8", "--socket", str(d.socket), "--job", "ref", "--dir", str(tmp / "ref"))
    assert sorted(want) == list(range(8))
    common = ("--pl", "--steps", "8", "--socket", str(d.socket), "--job", "run", "--dir", str(tmp / "run"))
    assert run(*common, "--kill-at", "5", expect_rc=-9) == {k: want[k] for k in range(5)}
    assert json.loads((tmp / "run/last.ckpt").read_text())["step"] == 4 * SAVES_PER_STEP + 1
    assert run(*common, "--resume") == {k: want[k] for k in range(4, 8)}


def test_refuses_objects_by_key_and_keeps_path_keys(daemon_factory: Any, tmp: Path) -> None:
    d = daemon_factory()
    io = CkptdCheckpointIO("j", socket=str(d.socket))
    try:
        with pytest.raises(CheckpointError, match=r"'hyper_parameters/cls'"):
            io.save_checkpoint({"global_step": 1, "hyper_parameters": {"cls": object()}}, tmp / "a.ckpt")
        assert not (tmp / "a.ckpt").exists()
        ckpt = {"global_step": 2, "callbacks": {"MC": {"best_k_models": {str(tmp / "e=0.ckpt"): torch.tensor(0.5)},
                                                       "": 1, ".": [2], "%x": (3, "y")}}}
        io.save_checkpoint(ckpt, tmp / "b.ckpt")
        got = io.load_checkpoint(tmp / "b.ckpt")
        assert got["callbacks"]["MC"][""] == 1 and got["callbacks"]["MC"]["."] == [2]
        assert got["callbacks"]["MC"]["%x"] == (3, "y")
        assert torch.equal(got["callbacks"]["MC"]["best_k_models"][str(tmp / "e=0.ckpt")], torch.tensor(0.5))
        with pytest.raises(CheckpointError, match="not a ckptd pointer"):
            (tmp / "c.ckpt").write_text("{}")
            io.load_checkpoint(tmp / "c.ckpt")
    finally:
        io.teardown()


def test_each_save_at_one_global_step_loads_back_as_lightning_gave_it(daemon_factory: Any, tmp: Path) -> None:
    """Lightning saves twice at one global_step (top-k, then last.ckpt; two ModelCheckpoints), each dict its
    own (loop progress, callback state). Every .ckpt path must load back the dict Lightning gave for it;
    a second save at the step had been pointed at the first one's step."""
    import copy
    import os

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    given: dict[str, Any] = {}

    class Recording(CkptdCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            given[os.fspath(path)] = copy.deepcopy(checkpoint)
            super().save_checkpoint(checkpoint, path, storage_options)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def same(a: Any, b: Any, path: str = "") -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            if set(a) != set(b):
                return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
            return [d for k in a for d in same(a[k], b[k], f"{path}/{k}")]
        if isinstance(a, torch.Tensor):
            ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
            return [] if ok else [f"{path}: tensor"]
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}/{i}")]
        return [] if a == b else [f"{path}: saved {a!r}, loaded {b!r}"]

    d = daemon_factory()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    io = Recording("same-step", socket=str(d.socket))
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=tmp / "a", every_n_train_steps=2, save_top_k=2, monitor="train_loss"),
        ModelCheckpoint(dirpath=tmp / "b", every_n_train_steps=2, save_top_k=-1, save_last=True)]
    trainer = pl.Trainer(max_steps=4, plugins=[io], callbacks=callbacks, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", enable_checkpointing=True)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
    by_step: dict[int, int] = {}
    for path, saved in given.items():
        by_step[saved["global_step"]] = by_step.get(saved["global_step"], 0) + 1
        loaded = CkptdCheckpointIO("same-step", socket=str(d.socket)).load_checkpoint(path)
        assert same(saved, loaded) == [], path
    assert max(by_step.values()) >= 2, by_step          # some global step had more than one save


@pytest.mark.parametrize("plugin", [CkptdCheckpointIO, AsyncCkptdCheckpointIO])
def test_resume_from_last_linked_by_save_last_link(daemon_factory: Any, tmp: Path, plugin: type) -> None:
    """``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symlink to the newest ``.ckpt`` (a
    pointer): ``fit(ckpt_path="last")`` follows it. The pointer read had refused any symlink (ELOOP).
    Async, Lightning links before the pointer is written: its directory must exist by then."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = daemon_factory()

    def callback() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp / "ck", every_n_train_steps=2, save_top_k=1, monitor="score",
                               mode="max", save_last="link")

    assert fit(plugin("link", socket=str(d.socket)), callback(), max_steps=4) == [0, 1, 2, 3]
    assert os.readlink(tmp / "ck/last.ckpt") == "epoch=0-step=4.ckpt"
    assert fit(plugin("link", socket=str(d.socket)), callback(), max_steps=6, ckpt_path="last") == [4, 5]
    (tmp / "dir").mkdir()
    (tmp / "ck/dir.ckpt").symlink_to(tmp / "dir")       # what a link resolves to must still be a regular file
    with pytest.raises(CheckpointError, match="not a regular file"):
        CkptdCheckpointIO("link", socket=str(d.socket)).load_checkpoint(tmp / "ck/dir.ckpt")


def test_async_top_k_removed_checkpoints_stay_removed(daemon_factory: Any, tmp: Path) -> None:
    """``ModelCheckpoint(save_top_k=1)`` saving every step removes the previous ``.ckpt`` right after the
    next save, while (async) the previous step's commit, held back by the daemon here, is still pending.
    Its pointer write was still queued and ran after the removal: every removed checkpoint came back.
    ``remove_checkpoint`` cancels it; a save to the removed path after the removal still gets its pointer."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = daemon_factory("--debug-commit-delay", "1")
    callback = ModelCheckpoint(dirpath=tmp / "ck", every_n_train_steps=1, save_top_k=1, monitor="score", mode="max")
    assert fit(AsyncCkptdCheckpointIO("topk", socket=str(d.socket)), callback, max_steps=4) == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp / "ck")) == ["epoch=0-step=4.ckpt"]
    assert json.loads((tmp / "ck/epoch=0-step=4.ckpt").read_text())["step"] == 4 * SAVES_PER_STEP

    io = AsyncCkptdCheckpointIO("reuse", socket=str(d.socket))
    try:
        io.save_checkpoint({"global_step": 1}, tmp / "a.ckpt")
        io.remove_checkpoint(tmp / "a.ckpt")
        io.save_checkpoint({"global_step": 2}, tmp / "a.ckpt")      # Lightning may reuse a name
        io.wait_for_saves()
    finally:
        io.teardown()
    assert json.loads((tmp / "a.ckpt").read_text())["step"] == 2 * SAVES_PER_STEP
    assert io.load_checkpoint(tmp / "a.ckpt") == {"global_step": 2}
