"""Start a private daemon as a child process and wait until it answers (public helper).

For jobs that bring their own daemon rather than use a node service: single-node jobs,
notebooks, the test suite, `make demo`, the benchmarks and the GPU check::

    daemon = spawn_daemon(root, "/tmp/ckptd-job.sock", "--threads", "4")
    ckpt = ckptd_client.Checkpointer(job="job", socket=str(daemon.socket))
    ...
    daemon.stop()

Node services run under systemd instead (packaging/systemd, docs/operations.md).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ckptd.core import protocol
from ckptd.core.errors import ProtocolError


@dataclass
class DaemonProcess:
    root: Path
    socket: Path
    log: Path
    proc: subprocess.Popen

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the daemon drains in-flight saves), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self, sig: int = signal.SIGKILL) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def peak_rss(self) -> int | None:
        """VmHWM (peak resident set) of the daemon in bytes, while it runs."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None


def wait_until_serving(sock: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the daemon answers ``info`` on ``sock``; raise if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode} before serving {sock}")
        if sock.exists():
            try:
                protocol.request_once(str(sock), {"op": "info"}, timeout=5)
                return
            except (OSError, RuntimeError, ProtocolError):
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon did not serve {sock} within {timeout:g}s")
        time.sleep(0.05)


def spawn_daemon(root: os.PathLike | str, sock: os.PathLike | str, *extra: str, log: os.PathLike | str | None = None,
                 env: dict[str, str] | None = None, timeout: float = 60.0) -> DaemonProcess:
    """``ckptd serve --root ROOT --socket SOCK *extra`` with plain logs appended to ``log``."""
    root, sock = Path(root), Path(sock)
    log = Path(log) if log else sock.with_suffix(".log")
    args = [sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--socket", str(sock),
            "--log-format", "plain", *extra]
    with open(log, "ab") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_until_serving(sock, proc, timeout)
    except Exception as e:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise RuntimeError(f"{e}; daemon log:\n{log.read_text()[-4000:]}") from None
    return DaemonProcess(root, sock, log, proc)
