"""torchtitan's stock DCP checkpoint manager with ckptd as DCP's storage (issue 23, acceptance 3):
tests/titan_dcp_worker.py trains torchtitan's llama3 debug model on 2 FSDP2 gloo ranks with
``CkptdDcpCheckpointManager`` (dcp.async_save through ``ckptd_client.dcp.StorageWriter``), is SIGKILLed
two steps after its last save, and resumes in new processes (dcp.load through ``StorageReader``): the
replayed steps' losses equal the ones the run computed before the kill, bit for bit (up to the kill
the killed run *is* the uninterrupted run)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.launch import DaemonProcess

import sharded_trainer as st

WORKER = Path(__file__).with_name("titan_dcp_worker.py")
pytestmark = pytest.mark.timeout(600)


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
    v = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(job / "step-000000000002")],
                       capture_output=True, text=True, timeout=60)
    assert v.returncode == 0, v.stdout + v.stderr
    resumed = st.run_group(2, *common, script=WORKER, timeout=300)
    assert st.lines(resumed[0], "START") == [["2"]]
    for rank in (0, 1):                  # each rank's own batches: its own losses
        got, was = losses(resumed[rank]), losses(killed[rank])
        assert sorted(got) == [3, 4, 5] and {k: got[k] for k in (3, 4)} == {k: was[k] for k in (3, 4)}
    assert (job / "step-000000000005/index.json").exists()
