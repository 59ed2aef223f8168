"""A daemon that cannot write its root refuses to start (and --check-config fails), naming the fix.

Two unwritable roots, both real: a directory of mode 0555, and a root under a regular file
(ENOTDIR). Mode bits do not stop root, so when the tests run as root (CI) the processes under
test are started without CAP_DAC_OVERRIDE (dropped from their bounding set before exec): root
then obeys the mode bits like the daemon's own user would. ``test_the_unwritable_root_is_real``
checks that the setup does stop a write, so no test passes on a root that could be written.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import REPO

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE = 24, 1


def _drop_dac_override() -> None:
    """(preexec_fn) Without CAP_DAC_OVERRIDE in the bounding set, an exec'd root process has it nowhere."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def as_user() -> Callable[[], None] | None:
    return _drop_dac_override if os.geteuid() == 0 else None


@pytest.fixture(params=["mode-0555", "under-a-file"])
def bad_root(request: pytest.FixtureRequest, tmp: Path) -> Path:
    if request.param == "mode-0555":
        root = tmp / "ro"
        root.mkdir()
        root.chmod(0o555)
        return root
    (tmp / "a-file").write_text("not a directory\n")
    return tmp / "a-file" / "root"


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=as_user())


def assert_names_the_fix(text: str, root: Path) -> None:
    assert f"cannot write the checkpoint root {root}" in text, text
    if root.parent.is_file():       # a file in the way: no chown makes it a directory
        assert f"{root.parent} exists and is not a directory (a regular file)" in text, text
        assert "chown" not in text, text
    else:
        assert "chown" in text and "ReadWritePaths=" in text, text


@pytest.mark.parametrize("check", [True, False], ids=["check-config", "serve"])
def test_a_root_that_is_a_file_is_named_as_such(tmp: Path, check: bool) -> None:
    """`--root` naming a regular file: the start failed on makedirs' EEXIST ("File exists; … make the
    root a directory it owns (chown …)"), a fix that cannot work; it says what is wrong now."""
    root = tmp / "a-file"
    root.write_text("not a directory\n")
    r = run("serve", "--root", str(root), "--socket", str(tmp / "d.sock"), *(["--check-config"] if check else []))
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"cannot write the checkpoint root {root}: {root} exists and is not a directory (a regular file); "
            f"give a directory as the root") in r.stderr, r.stderr
    assert "EEXIST" not in r.stderr and "chown" not in r.stderr, r.stderr


def test_the_unwritable_root_is_real(bad_root: Path) -> None:
    """The processes under test really cannot write there (else the tests below prove nothing)."""
    r = subprocess.run([sys.executable, "-c", f"open({str(bad_root / 'x')!r}, 'w')"], capture_output=True,
                       text=True, preexec_fn=as_user())
    assert r.returncode != 0 and ("PermissionError" in r.stderr or "NotADirectoryError" in r.stderr), r.stderr


def test_check_config_fails_for_an_unwritable_root(bad_root: Path, tmp: Path) -> None:
    r = run("serve", "--root", str(bad_root), "--socket", str(tmp / "d.sock"), "--check-config")
    assert r.returncode == 1, r.stdout + r.stderr
    assert_names_the_fix(r.stderr, bad_root)
    assert 'root = "' in r.stdout          # the settings are still printed


def test_check_config_passes_for_a_writable_root_and_leaves_nothing(tmp: Path) -> None:
    (tmp / "root").mkdir()
    r = run("serve", "--root", str(tmp / "root"), "--socket", str(tmp / "d.sock"), "--check-config")
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp / "root") == []           # the probe file is gone
    r = run("serve", "--root", str(tmp / "new" / "root"), "--socket", str(tmp / "d.sock"), "--check-config")
    assert r.returncode == 0, r.stderr              # a missing root the daemon can create is fine
    assert not (tmp / "new").exists()               # and --check-config creates nothing


def test_daemon_refuses_to_serve_an_unwritable_root(bad_root: Path, tmp: Path) -> None:
    sock = tmp / "d.sock"
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(bad_root), "--socket", str(sock),
                             "--log-format", "plain"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=as_user())
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sock.exists(), "the daemon listens on its socket with a root it cannot write"
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    assert "serving" not in out, out
    assert_names_the_fix(out, bad_root)


def test_a_read_only_root_is_named_as_such(tmp: Path) -> None:
    """A root on a read-only mount (a bind mount with -o ro here; ProtectSystem=strict under systemd)
    was refused with "chown …, or chmod u+rwx", which fail the same way there (EROFS). Now the message
    says the file system is read-only, and what to do."""
    from test_shm_dir import mounted_tmpfs
    mounts = mounted_tmpfs(tmp / "ro", "size=1m,ro")
    root = next(mounts)
    try:
        r = run("serve", "--check-config", "--root", str(root), "--socket", str(tmp / "d.sock"))
        text = r.stdout + r.stderr
        assert r.returncode != 0 and "EROFS" in text and "read-only here: remount it read-write" in text, text
        assert "chown" not in text, text
    finally:
        next(mounts, None)
