"""The torchtitan checkpoint manager (issue 8, acceptance 4): torchtitan's llama3 debug model trained
on CPU by 2 FSDP2 gloo ranks (tests/titan_worker.py says how and why its own loop), SIGKILLed after
a commit, resumed in new processes (from a memory-level step: memory_interval): the remaining steps'
losses equal an uninterrupted run's bit for bit. The resumed run's last save goes out as Hugging Face
safetensors (last_save_in_hf), and a new job starts from that directory (initial_load_in_hf, through
ckptd import)."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptd.launch import DaemonProcess, spawn_daemon

import sharded_trainer as st

WORKER = Path(__file__).with_name("titan_worker.py")
# The worker's torchtitan imports (2.7 s of CPU a rank, 8 ranks): imported once, in the zygote its ranks fork from.
TITAN = ("torchtitan.components.optimizer.lr_scheduler", "torchtitan.components.optimizer.optimizer",
         "torchtitan.models.common.attention", "torchtitan.models.llama3", "ckptd_client.torchtitan")
pytestmark = pytest.mark.timeout(900)         # four rank groups importing torchtitan, on a small machine


@pytest.fixture
def daemon(tmp: Path) -> Iterator[DaemonProcess]:
    d = spawn_daemon(tmp / "root", tmp / "d.sock")
    yield d
    d.stop()


def losses(out: str) -> dict[int, str]:
    return {int(w[0]): w[1] for w in st.lines(out, "LOSS")}


def test_sigkill_resume_matches_uninterrupted_run(daemon: DaemonProcess, tmp: Path) -> None:
    common = ("--socket", str(daemon.socket), "--folder", str(tmp / "titan"), "--steps", "4", "--interval", "2")
    ref = st.run_group(2, *common, "--job", "ref", script=WORKER, preload=TITAN, timeout=600)
    want = losses(ref[0])
    assert sorted(want) == [1, 2, 3, 4]
    # memory_interval=1: memory-level saves at 1 and 3 around the storage save at 2; killed before saving 4.
    memory = ("--memory-interval", "1")
    killed = st.finish(st.launch(2, *common, *memory, "--job", "run", "--kill-at", "4", script=WORKER,
                                 preload=TITAN), 600, expect_rc=-9)
    assert "KILLED 4" in killed[0] and losses(killed[0]) == {k: want[k] for k in (1, 2, 3, 4)}
    steps = sorted(p.name for p in (tmp / "root/run").glob("step-*"))
    assert steps == ["step-000000000002"] and (tmp / "root/run" / steps[0] / "index.json").exists()
    assert (tmp / "root/run/_memory/step-000000000003/index.json").exists()
    resumed = st.run_group(2, *common, *memory, "--job", "run", "--hf-last", "--dump",
                           str(tmp / "final.safetensors"), script=WORKER, preload=TITAN, timeout=600)
    assert st.lines(resumed[0], "START") == [["3"]]      # the memory-level step, newer than storage step 2
    assert losses(resumed[0]) == {4: want[4]}
    # last_save_in_hf: the final model, exported as Hugging Face safetensors, equals the live one.
    final = load_file(tmp / "final.safetensors")
    exported = load_file(tmp / "titan/step-4/model.safetensors")
    assert sorted(exported) == sorted(final)
    assert all(torch.equal(exported[k], final[k]) for k in final)
    # initial_load_in_hf: a new job starts from that directory (imported as its step 0, model only).
    shutil.copytree(tmp / "titan/step-4", tmp / "hf-init")
    fresh = st.run_group(2, *common, "--job", "fine-tune", "--steps", "0", "--hf-init", str(tmp / "hf-init"),
                         "--dump", str(tmp / "init.safetensors"), script=WORKER, preload=TITAN, timeout=600)
    assert st.lines(fresh[0], "START") == [["0"]]
    loaded = load_file(tmp / "init.safetensors")
    assert all(torch.equal(loaded[k], final[k]) for k in final)
    assert (tmp / "root/fine-tune/step-000000000000/index.json").exists()
    # ... and with memory_interval, killed at 3: the resume takes memory-level step 2, not the
    # model-only step 0 (it skipped every memory-level step while step 0 was the newest stored one).
    ft = (*common, "--interval", "100", *memory, "--job", "ft", "--hf-init", str(tmp / "hf-init"))
    killed = st.finish(st.launch(2, *ft, "--kill-at", "3", script=WORKER, preload=TITAN), 600, expect_rc=-9)
    assert "KILLED 3" in killed[0] and (tmp / "root/ft/_memory/step-000000000002/index.json").exists()
    resumed = st.run_group(2, *ft, script=WORKER, preload=TITAN, timeout=600)
    assert st.lines(resumed[0], "START") == [["2"]]
