"""Start a daemon as a child process tied to this one's life, and wait until it answers.

The one implementation behind ``ckptd.launch.spawn_daemon`` (tests, benchmarks, demos) and
``Checkpointer(job, root=..., spawn=True)`` (one GPU, a notebook). It runs ``python -m ckptd
serve`` as a subprocess and speaks only the wire protocol to it, so it imports nothing but
``ckptd.core``: the client may import it without importing the daemon (tests/test_layering.py).

Tied (Linux): the child sets ``PR_SET_PDEATHSIG`` (SIGTERM) and then execs the daemon, so a
spawning process that dies, even by SIGKILL, takes its daemon with it instead of leaving it
holding the socket. The kernel sends the signal when the *thread* that spawned the child exits:
spawn from the main thread (or one that lives as long as the process). The prctl runs after a
fresh ``exec`` of ``python -m ckptd.tie`` (standard library only: ckptd/tie.py), not in a
``preexec_fn``, which the subprocess docs call unsafe in a process with threads (a trainer has many).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core import protocol
from ckptd.core.errors import ProtocolError

logger = logging.getLogger("ckptd")

MAX_SOCKET_PATH = 100          # AF_UNIX paths: 108 bytes with the terminating NUL; keep a margin


@dataclass
class DaemonProcess:
    """A running child daemon. ``close()`` (or ``with``) stops it and removes ``private_dir``."""

    root: Path
    socket: Path
    log: Path
    proc: subprocess.Popen
    private_dir: Path | None = None     # a temporary directory of its own (spawn_private), removed by close()
    owner_pid: int = field(default_factory=os.getpid)   # the process that started it (a fork's close: no-op)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (the daemon drains in-flight saves), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("ckptd: daemon %d did not stop within %gs of SIGTERM; killing it", self.pid, timeout)
                self.proc.kill()
        return self.proc.wait(timeout=60)

    def close(self, timeout: float = 60.0) -> int:
        """``stop(timeout)``, then remove the private directory (its socket and log) if it has one. In a
        forked child of the process that started it, nothing: the daemon and its directory are the parent's."""
        if os.getpid() != self.owner_pid:
            return 0
        try:
            return self.stop(timeout)
        finally:
            if self.private_dir is not None:
                shutil.rmtree(self.private_dir, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
                 env: dict[str, str] | None = None, timeout: float = 60.0, tied: bool = True) -> DaemonProcess:
    """``ckptd serve --root ROOT --socket SOCK *extra`` with plain logs appended to ``log``.

    ``tied`` (the default): the daemon gets SIGTERM when this process (the calling thread) dies."""
    root, sock = Path(root), Path(sock)
    log_path = Path(log) if log else sock.with_suffix(".log")
    serve = [sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--socket", str(sock),
             "--log-format", "plain", *extra]
    args = [sys.executable, "-m", "ckptd.tie", str(os.getpid()), *serve] if tied else serve
    if tied and threading.current_thread() is not threading.main_thread():
        logger.warning(
            "ckptd: daemon spawned from thread %r: it gets SIGTERM when that thread exits; spawn it from "
            "the main thread to tie it to the process", threading.current_thread().name)
    with open(log_path, "ab") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_until_serving(sock, proc, timeout)
    except BaseException as e:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not isinstance(e, Exception):
            raise
        raise RuntimeError(f"{e}; daemon log:\n{log_path.read_text()[-4000:]}") from None
    return DaemonProcess(root, sock, log_path, proc)


def private_dir() -> Path:
    """A new 0700 temporary directory short enough for a socket path in it."""
    d = Path(tempfile.mkdtemp(prefix="ckptd-"))
    if len(str(d / "ckptd.sock")) > MAX_SOCKET_PATH:       # a long $TMPDIR: /tmp instead
        d.rmdir()
        d = Path(tempfile.mkdtemp(prefix="ckptd-", dir="/tmp"))
    return d


def spawn_private(root: os.PathLike | str, *extra: str, timeout: float = 60.0) -> DaemonProcess:
    """A tied daemon for ``root`` on a socket in a private temporary directory, which its
    ``close()`` removes (a SIGKILLed parent leaves the directory with the log, the socket gone).
    Default settings plus ``extra`` flags: a node's /etc/ckptd/ckptd.toml (its peers, bucket,
    metrics port) is not read, so the private daemon cannot collide with the node service."""
    d = private_dir()
    try:
        (d / "ckptd.toml").write_text("# empty: a private daemon takes no settings from /etc/ckptd/ckptd.toml\n")
        daemon = spawn_daemon(root, d / "ckptd.sock", "--config", str(d / "ckptd.toml"), *extra,
                              log=d / "ckptd.log", timeout=timeout)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    daemon.private_dir = d
    return daemon
