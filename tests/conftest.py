"""Shared fixtures: real daemons as subprocesses on real unix sockets in a temp dir."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ports import SPAN

from ckptd.launch import DaemonProcess, spawn_daemon
from ckptd.s3_local import SeaweedServer, start_seaweed

REPO = Path(__file__).resolve().parent.parent


DaemonProc = DaemonProcess


def wait_for_socket(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Until something accepts connections on ``path`` (a daemon, or a socket-activated one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode} before listening")
        if path.exists():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(path))
                return
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.05)
    raise TimeoutError(f"daemon did not listen on {path} within {timeout}s")


def start_daemon(root: Path, sock: Path, *extra: str, log: Path | None = None,
                 env: dict[str, str] | None = None) -> DaemonProcess:
    return spawn_daemon(root, sock, *extra, log=log, env=env)


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    # Unix socket paths must stay under ~108 bytes; pytest's tmp_path can be long.
    short = Path(f"/tmp/ckt-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    short.mkdir()
    yield short
    subprocess.run(["rm", "-rf", str(short)], check=False)


@pytest.fixture
def daemon_factory(tmp: Path):
    procs: list[DaemonProc] = []

    def make(*extra: str, name: str = "d", root: Path | None = None, env: dict[str, str] | None = None) -> DaemonProc:
        d = start_daemon(root or tmp / "root", tmp / f"{name}.sock", *extra, env=env)
        procs.append(d)
        return d

    yield make
    for d in procs:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One real S3-compatible server (SeaweedFS) for every bucket test of the session."""
    srv = start_seaweed(tmp_path_factory.mktemp("seaweed"), port_span=SPAN)
    yield srv
    srv.stop(grace=2.0)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProc:
    return daemon_factory()


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C as an interactive Python has it: KeyboardInterrupt. A runner started in the background by a
    non-interactive shell ignores SIGINT, and Python then leaves it ignored: the tests that send a real
    SIGINT set it here."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


# ---- in CI a skip is a failure -------------------------------------------------------------------
# Every test needs only what .ci/run installs (root, apt, pip): a test that skips there hides a missing
# install step or a broken environment, so under CI=true a skipped test fails the run, named.

_SKIPPED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and os.environ.get("CI") == "true":
        _SKIPPED.append(f"{report.nodeid}: {report.longrepr}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _SKIPPED:
        print("\nCI=true and these tests were skipped (each needs only what .ci/run installs):", *_SKIPPED, sep="\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
