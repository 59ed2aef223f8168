"""ckptd as torch.distributed.checkpoint's storage (issue 23, acceptance 1 and 2): FSDP2 ranks on gloo
(tests/dcp_worker.py) save with ``dcp.save`` / ``dcp.async_save`` through ``ckptd_client.dcp.StorageWriter``
to a real daemon; ``dcp.load`` through ``StorageReader`` reads the step back bit for bit on 2 ranks, on
4 (resharded by DCP's planner) and into a plain model in one process; ``ckptd verify`` passes; a
Python object (a DCP byte item) comes back through DCP's own load path. ``dcp.async_save`` in process
mode pickles the writer to DCP's background process, which saves through a ``Checkpointer`` of its own
(its ranks and store: the gloo group DCP sets up there)."""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd_client.config import CheckpointerConfig
from ckptd_client.dcp import StorageWriter
from ckptd_client.errors import CheckpointError

import sharded_trainer as st

WORKER = Path(__file__).with_name("dcp_worker.py")
pytestmark = pytest.mark.timeout(300)


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=60)


def committed_steps(root: Path, job: str) -> set[int]:
    """The steps ``ckptd ls`` shows committed."""
    rows = [line.split() for line in ckptd("ls", str(root), job).stdout.splitlines()[1:]]
    return {int(r[1]) for r in rows if len(r) > 2 and r[2] == "committed"}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in dtype, shape or any bit."""
    assert sorted(a) == sorted(b)
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


def load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def check_loaded(out: Path, tag: str) -> None:
    assert not same(load(out / "saved.full.pt"), load(out / f"{tag}.full.pt"))
    want, got = load(out / "saved.rank0.pt")["scalars"], load(out / f"{tag}.rank0.pt")["scalars"]
    assert got["lr"] == want["lr"] and got["sched_last_epoch"] == want["sched_last_epoch"]


def test_fsdp2_save_then_load_at_2_4_and_1_process(daemon_factory: Any, tmp: Path) -> None:
    d = daemon_factory()
    out = tmp / "out"
    out.mkdir()
    saved = st.run_group(2, "save", "--socket", str(d.socket), "--job", "j", "--out", str(out), script=WORKER)
    assert st.lines(saved[0], "SAVED") == [["3"]] and st.lines(saved[0], "META-EQUAL") == [["True"]]
    step = tmp / "root/j/step-000000000003"
    v = ckptd("verify", str(step))
    assert v.returncode == 0, v.stdout + v.stderr
    common = ("load", "--root", str(tmp / "root"), "--job", "j", "--out", str(out), "--step", "3")
    for world in (2, 4, 0):
        outs = st.run_group(world, *common, *(("--layout", "plain") if world == 0 else ()), script=WORKER)
        assert all(st.lines(o, "EXTRA") == [["Fraction(3,", "7)", "hello"]] for o in outs), outs
        check_loaded(out, f"loaded{world}")
    # An ordinary ckptd step: ls lists it committed, inspect shows DCP's FQNs.
    assert committed_steps(tmp / "root", "j") == {3}
    shown = ckptd("inspect", str(step)).stdout
    assert "model.up.weight" in shown and "extra.frac" in shown
    # ... and export takes it: DCP names tensors by dotted FQN, so --select model is the "model." ones.
    r = ckptd("export", str(step), str(tmp / "hf"))
    assert r.returncode == 0, r.stdout + r.stderr
    from safetensors.torch import load_file
    exported: dict[str, torch.Tensor] = {}
    for f in sorted((tmp / "hf").glob("*.safetensors")):
        exported.update(load_file(f))
    full = load(out / "saved.full.pt")
    want = {k.split("/", 1)[1]: v for k, v in full.items() if k.startswith(("model/", "buffer/"))}
    assert sorted(exported) == sorted(want) and not same(exported, want)


def test_async_save_sigkill_after_resolve_restores(daemon_factory: Any, tmp: Path) -> None:
    d = daemon_factory()
    out = tmp / "out"
    out.mkdir()
    killed = st.finish(st.launch(2, "async", "--socket", str(d.socket), "--job", "j", "--out", str(out),
                                 "--kill", "after", script=WORKER), 180, expect_rc=-9)
    assert all(st.lines(o, "RESOLVED") == [["3"]] for o in killed)
    assert ckptd("verify", str(tmp / "root/j/step-000000000003")).returncode == 0
    st.run_group(2, "load", "--root", str(tmp / "root"), "--job", "j", "--out", str(out), "--step", "3",
                 script=WORKER)
    check_loaded(out, "loaded2")


def test_async_save_sigkill_before_resolve_is_invisible(daemon_factory: Any, tmp: Path) -> None:
    d = daemon_factory()
    out = tmp / "out"
    out.mkdir()
    killed = st.finish(st.launch(2, "async", "--socket", str(d.socket), "--job", "j", "--out", str(out),
                                 "--kill", "before", script=WORKER), 180, expect_rc=-9)
    assert all(st.lines(o, "GATED") == [["3"]] for o in killed)
    job = tmp / "root/j"
    assert (job / "step-000000000001/index.json").exists()
    assert not (job / "step-000000000003/index.json").exists()
    assert committed_steps(tmp / "root", "j") == {1}
    # The step before it is whole: it loads.
    st.run_group(2, "load", "--root", str(tmp / "root"), "--job", "j", "--out", str(out), "--step", "1",
                 script=WORKER)


def test_async_save_in_process_mode(daemon_factory: Any, tmp: Path) -> None:
    """The writer (with a live Checkpointer from a dcp.save at step 1) goes to DCP's background process
    pickled, with each of two async saves (steps 2 and 3); each future resolves once its step is
    committed; step 3 loads bit for bit and both verify."""
    d = daemon_factory()
    out = tmp / "out"
    out.mkdir()
    saved = st.run_group(2, "async", "--process", "--kill", "none", "--socket", str(d.socket), "--job", "j",
                         "--out", str(out), script=WORKER)
    assert all(st.lines(o, "RESOLVED") == [["3"]] and st.lines(o, "WRITER-LAST") == [["1"]] for o in saved), saved
    for step in (2, 3):
        v = ckptd("verify", str(tmp / f"root/j/step-00000000000{step}"))
        assert v.returncode == 0, v.stdout + v.stderr
    assert committed_steps(tmp / "root", "j") == {1, 2, 3}
    outs = st.run_group(2, "load", "--root", str(tmp / "root"), "--job", "j", "--out", str(out), "--step", "3",
                        script=WORKER)
    assert all(st.lines(o, "EXTRA") == [["Fraction(3,", "7)", "hello"]] for o in outs), outs
    check_loaded(out, "loaded2")


def test_a_rank_failing_before_its_daemon_fails_every_rank_at_once(daemon: Any, tmp: Path) -> None:
    """Rank 1's state holds a lock: DCP's planner cannot pickle it (inside ``write_data``), nor can
    ``Checkpointer.save`` store it. Rank 1 publishes its failure on the commit relay, so rank 0's save
    of each step fails naming rank 1's error (not "rank 1 never reported ..." after 0.7 ×
    ``commit_timeout``). The group's bound, 100 s, is below the 0.7 × 300 s the other rank would wait."""
    outs = st.run_group(2, "fail", "--socket", str(daemon.socket), "--job", "j", "--out", str(tmp),
                        "--commit-timeout", "300", timeout=100, script=WORKER)
    lock = "TypeError: cannot pickle '_thread.lock' object"
    leaf = "TypeError: cannot checkpoint value at 'obj': lock is neither a tensor"
    raised = [{int(words[0]): " ".join(words[1:]) for words in st.lines(out, "RAISED")} for out in outs]
    for out, got in zip(outs, raised, strict=True):
        assert sorted(got) == [5, 6], out
        assert "step 5 failed: " in got[5] and f"rank 1: failed before reaching its daemon (DCP's items): {lock}" \
            in got[5], out
        assert "never reported" not in got[5] + got[6], out
        assert st.lines(out, "INDEXES") == [["0"]], out
    assert "step 6 failed: " in raised[0][6] and f"rank 1: failed before reaching its daemon: {leaf}" in raised[0][6]
    assert raised[1][6].startswith(leaf), outs[1]


def test_writer_pickles_as_job_config_and_step(tmp: Path) -> None:
    """What process mode sends: no Checkpointer, no rank, world size or store (the receiving
    process's own); a writer whose Checkpointer would spawn a private daemon is refused, naming thread mode."""
    w = StorageWriter("j", step=5, config=CheckpointerConfig(socket=str(tmp / "s.sock"), rank=1, world_size=2,
                                                              store=object(), num_slots=3))
    back = pickle.loads(pickle.dumps(w))
    assert (back.job, back.fixed_step, back.step) == ("j", 5, 5)
    assert back.config == CheckpointerConfig(socket=str(tmp / "s.sock"), num_slots=3)
    spawning = StorageWriter("j", config=CheckpointerConfig(root=str(tmp / "root"), spawn=True))
    with pytest.raises(CheckpointError, match="thread mode"):
        pickle.dumps(spawning)


@pytest.mark.parametrize("checkpoint_id", ["²", "step-٣", "/ckpt/step-١٠٠", "9" * 5000, "step-" + "1" * 14, "-3",
                                           "/ckpt/latest"])
def test_a_checkpoint_id_that_names_no_step_is_refused_as_such(checkpoint_id: str):
    """DCP asks the storage writer whether a checkpoint_id is its own (``validate_checkpoint_id``) before
    anything else. '²' (str.isdigit's) and 5,000 digits (int()'s limit) raised a bare ValueError there,
    and 'step-١٠٠' (\\d's Arabic-Indic digits) was taken as step 100. Now: not a ckptd step, said so."""
    from ckptd_client.dcp.step_id import step_of
    assert StorageWriter.validate_checkpoint_id(checkpoint_id) is False
    with pytest.raises(CheckpointError, match="names no step"):
        step_of(checkpoint_id)


@pytest.mark.parametrize("checkpoint_id,step", [(100, 100), ("100", 100), ("/ckpt/step-100", 100),
                                                ("/r/j/step-000000000100", 100), ("step-0", 0)])
def test_a_checkpoint_id_that_names_a_step(checkpoint_id: Any, step: int):
    from ckptd_client.dcp.step_id import step_of
    assert StorageWriter.validate_checkpoint_id(checkpoint_id) is True
    assert step_of(checkpoint_id) == step
