"""systemd integration without a running systemd: socket activation, sd_notify, SIGTERM drain, unit files.

Everything is real: the listening socket is created here and handed to a daemon subprocess
as fd 3 with LISTEN_FDS/LISTEN_PID; sd_notify datagrams arrive on a unix datagram socket
bound here; SIGTERM is a real signal.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd_client
from ckptd.core import protocol
from ckptd.daemon.service.systemd import ActivationError, Notifier, listen_fds

from conftest import REPO, start_daemon

UNITS = REPO / "packaging" / "systemd"


class NotifyListener:
    """The NOTIFY_SOCKET end systemd would hold: collects sd_notify datagrams."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[dict[str, str]] = []

    def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        for m in self.messages:
            if key in m and (value is None or m[key] == value):
                return m
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                break
            m = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(m)
            if key in m and (value is None or m[key] == value):
                return m
        raise AssertionError(f"no {key}={value or '*'} within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


# ---- socket activation -------------------------------------------------------------------

LAUNCHER = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)            # the activated socket must be fd 3 (SD_LISTEN_FDS_START)
    os.close(fd)
os.set_inheritable(3, True)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_PID"] = os.environ.get("TEST_LISTEN_PID") or str(os.getpid())   # exec keeps the pid
os.execv(sys.executable, [sys.executable, "-m", "ckptd", *sys.argv[2:]])
"""


def activated_daemon(tmp: Path, listener: socket.socket, *args: str, env: dict | None = None) -> subprocess.Popen:
    log = open(tmp / "activated.log", "ab")
    fd = listener.fileno()
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(fd), "serve", "--root", str(tmp / "root"),
                             "--log-format", "plain", *args],
                            pass_fds=(fd,), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def test_socket_activation_serves_the_passed_socket(tmp):
    path = tmp / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    unused = tmp / "configured.sock"
    proc = activated_daemon(tmp, listener, "--socket", str(unused))
    listener.close()               # the daemon holds its own copy now, as with systemd
    try:
        st = protocol.request_once(str(path), {"op": "status"}, timeout=30)   # queued in the backlog until served
        assert st["socket"] == str(path) and st["pid"] == proc.pid
        assert not unused.exists(), "an activated daemon must not bind its own socket"
        model = torch.nn.Linear(4, 2)
        ck = ckptd_client.Checkpointer("act", socket=str(path))
        ck.save(1, {"model": model}).wait(60)
        ck.close()
        assert (tmp / "root" / "act" / "step-000000000001" / "index.json").is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    # systemd owns the socket file: the daemon leaves it in place on exit
    assert path.exists()
    log = (tmp / "activated.log").read_text()
    assert "socket_activated=True" in log


def test_listen_pid_of_another_process_is_ignored(tmp):
    """LISTEN_PID not ours (inherited from a parent): bind the configured socket by hand."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp / "other.sock"))
    listener.listen(1)
    own = tmp / "own.sock"
    proc = activated_daemon(tmp, listener, "--socket", str(own), env={"TEST_LISTEN_PID": "1"})
    listener.close()
    try:
        from conftest import wait_for_socket
        wait_for_socket(own, proc)
        assert protocol.request_once(str(own), {"op": "status"})["socket"] == str(own)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not own.exists(), "a socket the daemon bound itself is removed on exit"


def test_listen_fds_rules():
    assert listen_fds({}) == []
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x"}
    assert listen_fds(env) == [] and env == {}, "not for this pid: ignored, and cleared for children"
    with pytest.raises(ActivationError, match="bad LISTEN_PID"):
        listen_fds({"LISTEN_PID": "me", "LISTEN_FDS": "1"})


def test_activation_with_a_non_listening_fd_fails_clearly(tmp):
    a, b = socket.socketpair()
    proc = activated_daemon(tmp, a)
    rc = proc.wait(60)
    a.close()
    b.close()
    assert rc == 1
    assert "not a listening unix stream socket" in (tmp / "activated.log").read_text()


# ---- sd_notify -------------------------------------------------------------------------------

def test_sd_notify_ready_status_watchdog_stopping(tmp):
    listener = NotifyListener(tmp / "notify.sock")
    try:
        d = start_daemon(tmp / "root", tmp / "n.sock", env={"NOTIFY_SOCKET": str(listener.path),
                                                           "WATCHDOG_USEC": "200000"})
        ready = listener.wait_for("READY", "1")
        assert ready.get("MAINPID") == str(d.proc.pid)
        assert "ranks connected" in listener.wait_for("STATUS")["STATUS"]
        listener.wait_for("WATCHDOG", "1")
        n = sum(1 for m in listener.messages if m.get("WATCHDOG") == "1")
        listener.messages.clear()
        listener.wait_for("WATCHDOG", "1")       # and again: pings keep coming
        assert n >= 1
        d.proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for("STOPPING", "1")
        assert int(stopping["EXTEND_TIMEOUT_USEC"]) > 0
        assert d.proc.wait(60) == 0
    finally:
        listener.close()


def test_sd_notify_abstract_socket_and_no_socket():
    name = f"ckptd-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(10)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "4000000"})
        assert n.enabled and n.watchdog_interval == 2.0
        assert n.status("line one\nline two")
        assert s.recv(100) == b"STATUS=line one"
    finally:
        s.close()
    quiet = Notifier({})
    assert not quiet.enabled and not quiet.ready("x") and quiet.watchdog_interval is None
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "5", "WATCHDOG_PID": "1"}).watchdog_interval is None


# ---- SIGTERM drain ---------------------------------------------------------------------------

def _slow_state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(1024, 1024)}        # 4 MiB: 4 chunks of 1 MiB


def test_sigterm_drains_in_flight_save_then_exits_0(tmp):
    listener = NotifyListener(tmp / "notify.sock")
    d = start_daemon(tmp / "root", tmp / "d.sock", "--chunk-mib", "1", "--debug-write-delay", "0.5",
                     "--drain-grace", "120", env={"NOTIFY_SOCKET": str(listener.path)})
    try:
        listener.wait_for("READY", "1")
        ck = ckptd_client.Checkpointer("drain", socket=str(d.socket))
        h = ck.save(1, _slow_state())
        d.proc.send_signal(signal.SIGTERM)
        listener.wait_for("STOPPING", "1")
        assert not h.done(), "the write takes 2s; it must still be in flight when the drain starts"
        # no new saves while draining
        with pytest.raises(ckptd_client.CheckpointError, match="shutting down"):
            ck.save(2, {"x": torch.zeros(3)})
        h.wait(120)                                   # the in-flight save commits during the drain
        assert h.committed
        assert d.proc.wait(120) == 0
        assert (d.root / "drain" / "step-000000000001" / "index.json").is_file()
        assert not (d.root / "drain" / "step-000000000002").exists()
        ck.close()
    finally:
        listener.close()
        d.kill()


def test_drain_grace_expiry_reports_and_leaves_uncommitted(tmp):
    listener = NotifyListener(tmp / "notify.sock")
    d = start_daemon(tmp / "root", tmp / "d.sock", "--chunk-mib", "1", "--debug-write-delay", "3",
                     "--drain-grace", "0.5", env={"NOTIFY_SOCKET": str(listener.path)})
    try:
        listener.wait_for("READY", "1")
        ck = ckptd_client.Checkpointer("late", socket=str(d.socket))
        h = ck.save(5, _slow_state())               # 4 chunks x 3 s: cannot finish in 0.5 s
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(120) == 0
        with pytest.raises(ckptd_client.CheckpointError):
            h.wait(60)
        assert not (d.root / "late" / "step-000000000005" / "index.json").exists()
        log = d.log_text()
        assert "drain timed out" in log and "job=late step=5 rank=0" in log
        ck.close()
    finally:
        listener.close()
        d.kill()


# ---- unit files ------------------------------------------------------------------------------

def _systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "systemd"], check=False, capture_output=True,
                       timeout=600, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.fail("systemd-analyze is missing and could not be installed (apt-get install systemd)")
    return exe


def test_units_pass_systemd_analyze_verify(tmp):
    exe = _systemd_analyze()
    ckptd_bin = Path(sys.executable).parent / "ckptd"
    assert ckptd_bin.exists(), "the venv's ckptd entry point"
    service = (UNITS / "ckptd.service").read_text()
    assert "ExecStart=/usr/local/bin/ckptd serve" in service
    # verify checks that ExecStart exists: point it at this venv's ckptd
    (tmp / "ckptd.service").write_text(service.replace("/usr/local/bin/ckptd", str(ckptd_bin)))
    shutil.copy(UNITS / "ckptd.socket", tmp / "ckptd.socket")
    r = subprocess.run([exe, "verify", "--man=no", "ckptd.socket", "ckptd.service"], cwd=tmp,
                       capture_output=True, text=True, timeout=120)
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if "ckptd." in ln]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr


def test_unit_contents():
    service = (UNITS / "ckptd.service").read_text()
    sock = (UNITS / "ckptd.socket").read_text()
    for line in ("Type=notify", "Restart=on-failure", "WatchdogSec=", "RuntimeDirectory=ckptd",
                 "RuntimeDirectoryPreserve=yes", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "ProtectHome=yes", "PrivateTmp=yes", "Requires=ckptd.socket"):
        assert line in service, line
    assert "ListenStream=/run/ckptd/ckptd.sock" in sock and "SocketMode=0660" in sock
    # the socket path is the client's default
    assert protocol.DEFAULT_SOCKET == "/run/ckptd/ckptd.sock"
