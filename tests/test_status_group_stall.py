"""`ckptd status --group` with a parity member SIGSTOPped: the daemon asks each member within its
peers.io_timeout, so the command waits that long (plus 10 s) rather than its fixed 10 s, and names the
member that did not answer even when no step is held ("parity group: no held steps" alone hid it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ports import SPAN
from procfd import sigstop

from ckptd.s3_local import free_ports

IO_TIMEOUT_S = 12       # above the command's old fixed 10 s


def test_status_group_waits_the_peer_io_timeout_and_names_a_stopped_member(tmp: Path, daemon_factory: Any) -> None:
    secret = tmp / "secret"
    secret.write_text("s3cret-shared-by-every-node-0123456789")
    secret.chmod(0o600)
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3, SPAN)]
    nodes = []
    for i, a in enumerate(addrs):
        args = ["--peer-listen", a, "--peer-secret-file", str(secret), "--peer-redundancy", "parity",
                "--peer-group", "3", "--peer-parity", "1", "--peer-io-timeout", f"{IO_TIMEOUT_S}s"]
        for p in addrs:
            args += ["--peer", p]
        nodes.append(daemon_factory(*args, name=f"n{i}", root=tmp / f"root{i}"))
    cmd = [sys.executable, "-m", "ckptd", "status", "--group", "--socket", str(nodes[0].socket)]
    sigstop(nodes[2].proc.pid)
    try:
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=IO_TIMEOUT_S + 40)
        took = time.monotonic() - t0
    finally:
        os.kill(nodes[2].proc.pid, signal.SIGCONT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < IO_TIMEOUT_S + 10, took
    assert f"member 2 ({addrs[2]}) unreachable: no answer within {IO_TIMEOUT_S}s (peers.io_timeout)" in r.stdout, \
        r.stdout
    assert "parity group: no held steps" in r.stdout, r.stdout
