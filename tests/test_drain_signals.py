"""The daemon stopping: reachable while it drains, and SIGHUP (a closed terminal) drains like SIGTERM.

Real daemons, real signals, `ckptd status` as its own process, a real Checkpointer with a save in flight.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptd_client
from ckptd.core.reader import verify_step
from ckptd_client.errors import CheckpointError


def status(sock: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", sock, "--json"], capture_output=True,
                       text=True, timeout=60)
    return r, time.monotonic() - t


def test_a_draining_daemon_answers_status_and_refuses_new_sessions_at_once(daemon_factory):
    """After SIGTERM with a save in flight the daemon stopped accepting: `ckptd status` (and a trainer
    connecting) sat in the listen backlog until the drain ended (up to drain_grace, 60 s), status timed
    out after 10 s and its `(draining)` never showed. Now status answers, draining, and a new session is
    refused at once, saying why; the save in flight still commits."""
    d = daemon_factory("--debug-write-delay", "0.6", "--drain-grace", "20", "--chunk-mib", "1")
    ck = ckptd_client.Checkpointer("j", socket=str(d.socket), memory=False, commit_timeout=60)
    h = ck.save(1, {"w": torch.ones(1 << 20)})             # 4 chunks of 1 MiB, 0.6 s each
    time.sleep(0.5)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    r, took = status(str(d.socket))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["draining"] is True and took < 5, (took, r.stdout)
    t = time.monotonic()
    with pytest.raises(CheckpointError, match="shutting down"):
        with ckptd_client.Checkpointer("k", socket=str(d.socket), memory=False) as late:
            late.save(1, {"w": torch.ones(4)}).wait(30)
    assert time.monotonic() - t < 5
    assert d.proc.poll() is None, "the drain was not waited for"
    h.wait(60)                                               # the save in flight commits in the grace
    ck.close(timeout=30)
    assert d.proc.wait(60) == 0
    assert verify_step(str(d.root / "j" / "step-000000000001")) == []


def serve(tmp, *args: str, hup: object) -> subprocess.Popen[bytes]:
    """``ckptd serve`` on tmp/root and tmp/d.sock (log tmp/d.log) with SIGHUP's disposition set to ``hup``
    first: a daemon inherits it, and the test runner may itself run with SIGHUP ignored (nohup)."""
    from conftest import wait_for_socket
    with open(tmp / "d.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(tmp / "root"),
                                 "--socket", str(tmp / "d.sock"), "--log-format", "plain", *args],
                                stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, hup))   # type: ignore[arg-type]
    wait_for_socket(tmp / "d.sock", proc)
    return proc


def test_sighup_drains_like_sigterm(tmp):
    """`ckptd serve … &` from a terminal that closes gets SIGHUP: it killed the daemon at once (rc 129,
    no drain, no log line, its socket left behind, the save in flight lost). Now it drains: the save
    commits, the log names the signal, the socket is removed, exit 0."""
    proc = serve(tmp, "--debug-write-delay", "0.3", "--drain-grace", "20", "--chunk-mib", "1", hup=signal.SIG_DFL)
    try:
        ck = ckptd_client.Checkpointer("j", socket=str(tmp / "d.sock"), memory=False, commit_timeout=60)
        h = ck.save(1, {"w": torch.ones(1 << 20)})
        time.sleep(0.4)
        proc.send_signal(signal.SIGHUP)
        h.wait(60)
        ck.close(timeout=30)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    assert verify_step(str(tmp / "root" / "j" / "step-000000000001")) == []
    assert not (tmp / "d.sock").exists()
    assert "stopping on SIGHUP" in (tmp / "d.log").read_text()


def test_a_daemon_started_under_nohup_outlives_sighup(tmp):
    """`nohup ckptd serve …` (README, docs/operations.md: to outlive the terminal) starts the daemon
    with SIGHUP ignored; its SIGHUP handler replaced that, so a closing terminal drained and stopped it.
    Where SIGHUP is ignored at start it stays ignored: the daemon goes on serving."""
    proc = serve(tmp, hup=signal.SIG_IGN)
    sock = tmp / "d.sock"
    try:
        proc.send_signal(signal.SIGHUP)
        with ckptd_client.Checkpointer("j", socket=str(sock)) as ck:    # still serving after it
            ck.save(1, {"w": torch.ones(64)}).wait(60)
        r, _ = status(str(sock))
        assert r.returncode == 0 and proc.poll() is None, r.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert "stopping on SIGHUP" not in (tmp / "d.log").read_text()
