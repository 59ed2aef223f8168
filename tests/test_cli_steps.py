"""Steps as users name them: ``ckptd verify ROOT JOB STEP``, paths in ``ckptd ls``, usage errors.

A wrong name or path is a usage error (exit 2) that says what was probably meant; exit 1 stays
for a step that is really broken. Every command runs as a user types it, in its own process,
against steps a real daemon committed.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptd_client

from conftest import REPO

JOB = "myjob"


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def root(daemon) -> Path:
    """Steps 10 and 20 of JOB, committed by a real daemon."""
    ck = ckptd_client.Checkpointer(JOB, socket=str(daemon.socket))
    for step in (10, 20):
        ck.save(step, {"model": {"w": torch.arange(4096, dtype=torch.float32)}}).wait(60)
    ck.close(timeout=60)
    return daemon.root


def test_verify_and_inspect_take_root_job_step(root: Path) -> None:
    for step in ("20", "step-20", "step-000000000020"):
        r = ckptd("verify", str(root), JOB, step)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == f"{root}/{JOB}/step-000000000020: OK"
    r = ckptd("verify", "-q", str(root / JOB / "step-000000000010"))       # the path form still works
    assert r.returncode == 0 and r.stdout.strip().endswith(": OK"), r.stdout + r.stderr
    r = ckptd("inspect", str(root), JOB, "10")
    assert r.returncode == 0 and "job myjob, step 10" in r.stdout, r.stdout + r.stderr


def test_ls_shows_each_steps_path(root: Path) -> None:
    r = ckptd("ls", str(root))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[-1] == "PATH"
    paths = [f"{root}/{JOB}/step-000000000010", f"{root}/{JOB}/step-000000000020"]
    assert [ln.split()[-1] for ln in lines[1:]] == paths
    rows = json.loads(ckptd("ls", str(root), JOB, "--json").stdout)
    assert [r["path"] for r in rows] == paths
    # what ls shows is what verify takes
    assert ckptd("verify", "-q", rows[1]["path"]).returncode == 0


@pytest.mark.parametrize("args, said", [
    (["{root}/myjob/step-20"], "did you mean {root}/myjob/step-000000000020 (or `ckptd verify {root} myjob 20`)?"),
    (["{root}/myjb/step-000000000020"], "did you mean {root}/myjob/step-000000000020?"),
    (["{root}/myjob"], "is a job's directory, not a step; give a step: `ckptd verify {root} myjob 20`"),
    (["{root}"], "is a checkpoint root, not a step; give a job and a step: `ckptd verify {root} JOB STEP`"),
    (["{root}", "myjb", "20"], "no job 'myjb' under {root}; did you mean 'myjob'?"),
    (["{root}", "myjob", "21"], "job 'myjob' under {root} has no step 21; did you mean 20?"),
    (["{root}", "myjob", "twenty"], "step 'twenty': give a step number, e.g. 20 or step-20"),
    (["{root}", "myjob"], "give the step too: `ckptd verify {root} myjob STEP` (its steps: 10, 20)"),
])
def test_a_wrong_step_name_is_a_usage_error_with_a_did_you_mean(root: Path, args: list[str], said: str) -> None:
    r = ckptd("verify", *[a.format(root=root) for a in args])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "FAULT" not in r.stdout, r.stdout
    assert said.format(root=root) in r.stderr, r.stderr


def test_inspect_names_the_step_it_could_not_find(root: Path) -> None:
    r = ckptd("inspect", str(root / JOB / "step-20"))
    assert r.returncode == 2 and f"did you mean {root}/{JOB}/step-000000000020" in r.stderr, r.stderr


def test_a_real_fault_is_still_exit_1(root: Path) -> None:
    data = root / JOB / "step-000000000020" / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    r = ckptd("verify", "-q", str(root), JOB, "20")
    assert r.returncode == 1 and "FAULT" in r.stdout, r.stdout + r.stderr


def test_ls_of_a_job_that_is_not_there_fails_with_a_did_you_mean(root: Path) -> None:
    r = ckptd("ls", str(root), "myjb")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"no job 'myjb' under {root}; did you mean 'myjob'? (jobs there: myjob)" in r.stderr, r.stderr
    assert ckptd("ls", str(root), "myjb", "--json").returncode == 2
    r = ckptd("ls", str(root / "nowhere"))
    assert r.returncode == 2 and "no such directory" in r.stderr, r.stderr


def test_a_step_removed_after_ls_listed_it_is_left_out_not_a_crash(root: Path) -> None:
    """Retention or gc may remove a step between ls listing the job and reading the step: that step is
    left out (it was a FileNotFoundError traceback, or 'invalid' when its index had just gone)."""
    import shutil
    import time

    from ckptd.cli_steps import _row
    from ckptd.core.reader import list_steps

    listed = list_steps(str(root / JOB))
    assert [s.step for s in listed] == [10, 20]
    shutil.rmtree(listed[0].path)                       # step 10 goes after the listing
    (Path(listed[1].path) / "index.json").unlink()     # step 20 loses its index as it is read ...
    shutil.rmtree(listed[1].path)                       # ... and then the rest
    assert [_row(JOB, s, time.time()) for s in listed] == [None, None]
    assert ckptd("ls", str(root), JOB).returncode == 0


def test_a_step_whose_index_went_after_ls_listed_it_is_uncommitted_not_invalid(root: Path) -> None:
    """Listed committed, then its index.json unlinked while ls read it (a removal's first act, a
    memory-level step saved again, torchtitan's keep_latest_k), the directory still there: `ckptd ls`
    showed `invalid (... not committed (no index.json))`, a false alarm; the row says what it is now."""
    import time

    from ckptd.cli_steps import _row
    from ckptd.core.reader import list_steps

    listed = list_steps(str(root / JOB))
    assert [s.committed for s in listed] == [True, True]
    (Path(listed[0].path) / "index.json").unlink()     # step 10 loses its index after the listing
    (Path(listed[0].path) / "rank-00000.json").unlink()    # and a file more, as a removal goes on
    rows = [_row(JOB, s, time.time()) for s in listed]
    assert [(r["step"], r["state"]) for r in rows if r] == [(10, "uncommitted"), (20, "committed")], rows
    r = ckptd("ls", str(root), JOB)
    assert r.returncode == 0 and "invalid" not in r.stdout and "uncommitted" in r.stdout, r.stdout + r.stderr


def test_a_memory_level_step_is_verified_on_disk_found_by_number_and_refused_by_export(root: Path, daemon,
                                                                                     tmp: Path) -> None:
    """A memory-level step has its index and manifests on disk and its bytes only in the daemons' memory:
    verify checked its data files (a FAULT, exit 1), ROOT JOB STEP did not find it although `ckptd ls`
    lists it by number, and export failed on the missing data file."""
    ck = ckptd_client.Checkpointer(JOB, socket=str(daemon.socket))
    ck.save(21, {"model": {"w": torch.arange(4096, dtype=torch.float32)}}, level="memory").wait(60)
    ck.close(timeout=60)
    held = root / JOB / "_memory" / "step-000000000021"
    said = (f"{held}: OK (memory-level step: its index and manifests check out; its bytes are only in the "
            "daemons' memory, not checked here)")
    for args in ([str(held)], [str(root), JOB, "21"]):
        r = ckptd("verify", "-q", *args)
        assert r.returncode == 0 and r.stdout.strip() == said, r.stdout + r.stderr
    r = ckptd("inspect", str(root), JOB, "21")
    assert r.returncode == 0 and "memory-level step: its bytes are only in the daemons' memory" in r.stdout, r.stderr
    r = ckptd("verify", str(root), JOB, "22")
    assert r.returncode == 2 and "has no step 22; did you mean 21? (its steps near 22: 10, 20, 21)" in r.stderr
    r = ckptd("export", str(held), str(tmp / "hf"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("memory-level step 21 has no files: its bytes are only in the daemons' memory; save it to storage "
            '(level="storage") to export it') in r.stderr, r.stderr
    assert not (tmp / "hf").exists()
    manifest = held / "rank-00000.json"              # what is on disk is still checked: a FAULT, exit 1
    manifest.write_bytes(manifest.read_bytes().replace(b'"step":21', b'"step":22'))
    r = ckptd("verify", "-q", str(root), JOB, "21")
    assert r.returncode == 1 and "manifest digest does not match index.json" in r.stdout, r.stdout + r.stderr
