"""A step or job directory ckptd cannot read (its owner or mode) is reported, and never stops the rest.

One unreadable directory used to end `ckptd ls` (a traceback), `ckptd gc` (every job after it left
uncollected), the daemon's retention of its job (`retention failed` on every pass, the job growing
without bound) and the start-up scan (its task dead, the jobs after it never reported), and an
unreadable step read as "uncommitted". Now it is listed as `unreadable (EACCES: …)`, gc and retention
leave it as it is (it may be committed) and say so with the fix, and every other step and job is
listed, collected and scanned.

Mode bits do not stop root, so when the tests run as root (CI) the processes under test run under
``setpriv --bounding-set -dac_override,-dac_read_search`` (util-linux): root then obeys the mode bits
like the daemon's own user would. ``test_the_unreadable_directories_are_real`` checks the setup does
stop a read, so no test passes on a directory that could be read.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptd_client
from ckptd.core.names import step_dir_name
from ckptd.spawn import DaemonProcess, wait_until_serving

from conftest import REPO


def restricted() -> list[str]:
    """The argv prefix that makes a root process obey mode bits (none for any other user). A missing
    setpriv fails the test: skipping would pass it on a machine that proves nothing."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) not found: these tests need it when run as root"
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*restricted(), sys.executable, "-m", "ckptd", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def save(sock: Path, job: str, steps: range) -> None:
    c = ckptd_client.Checkpointer(job=job, socket=str(sock))
    try:
        for s in steps:
            c.save(s, {"w": torch.arange(4.0) + s, "step": s}).wait(60)
    finally:
        c.close()


def steps_of(root: Path, job: str) -> list[int]:
    return sorted(int(p.name[5:]) for p in (root / job).iterdir() if p.name.startswith("step-"))


@pytest.fixture
def root(daemon_factory, tmp: Path) -> Iterator[Path]:
    """Jobs a, b, c with real committed steps (a: 1-6, b and c: 1-4) and an uncommitted leftover of c's
    (99); then a's step 3 and job b's whole directory made unreadable (mode 000)."""
    d = daemon_factory()
    save(d.socket, "a", range(1, 7))
    save(d.socket, "b", range(1, 5))
    save(d.socket, "c", range(1, 5))
    assert d.stop() == 0
    root = d.root
    (root / "c" / step_dir_name(99)).mkdir()
    bad = [root / "a" / step_dir_name(3), root / "b"]
    for p in bad:
        p.chmod(0)
    yield root
    for p in bad:
        p.chmod(0o755)


def test_the_unreadable_directories_are_real(root: Path) -> None:
    """The processes under test really cannot read them (else the tests below prove nothing)."""
    for p in (root / "a" / step_dir_name(3), root / "b"):
        r = subprocess.run([*restricted(), sys.executable, "-c", f"import os; os.listdir({str(p)!r})"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "PermissionError" in r.stderr, r.stdout + r.stderr


def test_ls_and_gc_report_what_they_cannot_read_and_do_the_rest(root: Path) -> None:
    step3, job_b = root / "a" / step_dir_name(3), root / "b"
    r = ckptd("ls", str(root))
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out
    rows = {(line.split()[0], line.split()[1]): line for line in r.stdout.splitlines()[1:]}
    assert "unreadable (EACCES: Permission denied)" in rows[("a", "3")] and str(step3) in rows[("a", "3")], out
    assert "unreadable (EACCES: Permission denied)" in rows[("b", "-")] and str(job_b) in rows[("b", "-")], out
    assert all("committed" in rows[("a", str(s))] for s in (1, 2, 4, 5, 6)), out
    assert all("committed" in rows[("c", str(s))] for s in (1, 2, 3, 4)), out
    assert "uncommitted" in rows[("c", "99")], out
    assert "chown" in r.stderr, r.stderr

    r = ckptd("gc", str(root), "--keep-last", "2")
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out
    assert f"FAILED {step3}: cannot read it (EACCES: Permission denied)" in r.stdout, out
    assert f"FAILED {job_b}: cannot read it (EACCES: Permission denied)" in r.stdout, out
    assert "chown" in r.stdout, out
    # every other job and step collected; the unreadable step never removed (it may be committed)
    assert steps_of(root, "a") == [3, 5, 6], out
    assert steps_of(root, "c") == [3, 4, 99], out          # (99: young, may still be written)
    job_b.chmod(0o755)
    assert steps_of(root, "b") == [1, 2, 3, 4], out


def test_the_daemon_scans_and_collects_around_what_it_cannot_read(root: Path, tmp: Path) -> None:
    sock, log = tmp / "r.sock", tmp / "r.log"
    serve = [*restricted(), sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--socket", str(sock),
             "--log-format", "plain", "--threads", "2", "--keep-last", "2"]
    with open(log, "ab") as f:
        proc = subprocess.Popen(serve, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    d = DaemonProcess(root, sock, log, proc)
    try:
        wait_until_serving(sock, proc)
        save(sock, "a", range(7, 9))
        deadline = time.monotonic() + 30
        while steps_of(root, "a") != [3, 7, 8] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.stop() == 0
    finally:
        d.close()
    text = log.read_text()
    step3, job_b = root / "a" / step_dir_name(3), root / "b"
    # retention went on around the unreadable step, and never removed it
    assert steps_of(root, "a") == [3, 7, 8], text
    assert f"retention cannot read {step3} (EACCES: Permission denied): left as it is" in text, text
    assert "retention failed" not in text and "daemon task failed" not in text, text
    # the start-up scan named both, the fix with them, and still reported job c after job b
    assert f"job a: cannot read {step3} (EACCES: Permission denied)" in text, text
    assert f"job b: cannot read {job_b} (EACCES: Permission denied)" in text, text
    assert "job c: 1 uncommitted step directories (99)" in text, text
    assert "job a: 1 uncommitted" not in text, text        # an unreadable step is not called uncommitted
    assert text.count("chown") >= 3, text


def test_a_root_the_user_cannot_read_is_one_line_not_a_traceback(tmp):
    """`ckptd ls/verify/inspect` on a root this user cannot read ended in a PermissionError traceback
    (the usual mistake: a user not in the daemon's group). One line now names the path, the reason and
    the fix, exit 2; and a bad job name after an s3:// root is a usage error too, not a ValueError."""
    root = tmp / "root"
    (root / "nj" / step_dir_name(1)).mkdir(parents=True)
    os.chmod(root, 0)
    try:
        for args in (["ls", str(root)], ["verify", str(root), "nj", "1"], ["inspect", str(root), "nj", "1"]):
            r = ckptd(*args)
            assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.returncode, r.stderr)
            assert f"ckptd {args[0]}: {root}: EACCES: Permission denied for uid {os.geteuid()}" in r.stderr, r.stderr
            assert "join its group" in r.stderr, r.stderr
    finally:
        os.chmod(root, 0o755)
    r = ckptd("verify", "s3://bucket/prefix", "bad..job/x", "4")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "invalid job name 'bad..job/x'" in r.stderr, r.stderr
