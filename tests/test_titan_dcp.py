"""torchtitan's stock DCP checkpoint manager with ckptd as DCP's storage (issue 23, acceptance 3):
tests/titan_dcp_worker.py trains torchtitan's llama3 debug model on 2 FSDP2 gloo ranks with
``CkptdDcpCheckpointManager`` (dcp.async_save through ``ckptd_client.dcp.StorageWriter``), is SIGKILLed
two steps after its last save, and resumes in new processes (dcp.load through ``StorageReader``): the
replayed steps' losses equal the ones the run computed before the kill, bit for bit (up to the kill
the killed run *is* the uninterrupted run). The last step holds the model alone (``last_save_model_only``):
``ckptd export`` writes it, bit for bit the trained model."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptd.launch import DaemonProcess

import sharded_trainer as st

WORKER = Path(__file__).with_name("titan_dcp_worker.py")
pytestmark = pytest.mark.timeout(600)


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=120)


def losses(out: str) -> dict[int, str]:
    return {int(w[0]): w[1] for w in st.lines(out, "LOSS")}


def test_stock_manager_sigkill_resume_matches(daemon: DaemonProcess, tmp: Path) -> None:
    common = ("--socket", str(daemon.socket), "--folder", str(tmp / "titan"), "--job", "run", "--steps", "5",
              "--interval", "2")
    killed = st.finish(st.launch(2, *common, "--kill-at", "4", script=WORKER), 300, expect_rc=-9)
    want = losses(killed[0])
    assert "KILLED 4" in killed[0] and sorted(want) == [1, 2, 3, 4]
    job = tmp / "root/run"
    assert sorted(p.name for p in job.iterdir()) == ["step-000000000002"]
    assert (job / "step-000000000002/index.json").exists()
    v = ckptd("verify", str(job / "step-000000000002"))
    assert v.returncode == 0, v.stdout + v.stderr
    resumed = st.run_group(2, *common, "--out", str(tmp / "trained.pt"), script=WORKER, timeout=300)
    assert st.lines(resumed[0], "START") == [["2"]]
    for rank in (0, 1):                  # each rank's own batches: its own losses
        got, was = losses(resumed[rank]), losses(killed[rank])
        assert sorted(got) == [3, 4, 5] and {k: got[k] for k in (3, 4)} == {k: was[k] for k in (3, 4)}
    assert (job / "step-000000000005/index.json").exists()
    # The last step holds the model alone, its FQNs flat at the top (last_save_model_only): `ckptd export`
    # takes every tensor of it by default, bit for bit the trained model, as does --select "".
    trained = torch.load(tmp / "trained.pt", weights_only=True)
    for out, select in (("hf", ()), ("hf-all", ("--select", ""))):
        r = ckptd("export", str(job / "step-000000000005"), str(tmp / out), *select)
        assert r.returncode == 0, r.stdout + r.stderr
        exported = {k: v for f in sorted((tmp / out).glob("*.safetensors")) for k, v in load_file(f).items()}
        assert sorted(exported) == sorted(trained) and "tok_embeddings.weight" in exported
        assert all(torch.equal(exported[k].view(torch.uint8), trained[k].view(torch.uint8)) for k in trained)
    # Step 4 holds the whole training state flat (DCP byte items: optimizer, scheduler, loader): by default
    # export refuses it, saying so, rather than write an optimizer's moments as a model.
    r = ckptd("export", str(job / "step-000000000004"), str(tmp / "hf4"))
    assert r.returncode == 1 and "holds more than a model" in r.stderr and "--select ''" in r.stderr, r.stderr
    assert not (tmp / "hf4").exists()
