"""A process as seen through /proc: its open descriptors, for tests that find (and flip bytes in) a
daemon's memfds (one place, because the daemon opens and closes descriptors while a test walks the
directory: a descriptor listed and closed before its link is read is skipped, never an error); and
``sigstop``, for tests whose premise is a process stopped (its threads' states)."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def open_fds(pid: int) -> Iterator[tuple[Path, str, int]]:
    """(the /proc link, its target, the file's inode) for each descriptor still open when read."""
    for link in Path(f"/proc/{pid}/fd").iterdir():
        try:
            yield link, os.readlink(link), os.stat(link).st_ino
        except OSError:
            continue


def fd_targets(pid: int) -> list[str]:
    """The targets of the process's open descriptors."""
    return [target for _, target, _ in open_fds(pid)]


def memfds_named(pid: int, name: str) -> list[Path]:
    """The /proc links of the memfds called ``name`` (a mapping's duplicate descriptor included)."""
    return [link for link, target, _ in open_fds(pid) if target.startswith(f"/memfd:{name} ")]


def memfd_inodes(pid: int) -> dict[int, str]:
    """The memfds the process holds by inode (a mapping's descriptor copy counts once, and two
    sessions' memfds of the same name are told apart) and their names."""
    return {ino: target[len("/memfd:"):].split(" ")[0]
            for _, target, ino in open_fds(pid) if target.startswith("/memfd:")}


def sigstop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: a signal is delivered when its
    target is next scheduled, and on a loaded machine the server's thread could answer one more call
    first (a child's ``check`` "answered" 0.2 s after the kill in one run of the suite)."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + 10.0
    while time.monotonic() < end:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:         # (a thread that exited meanwhile)
                continue
        if states and all(st in "Tt" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still running 10 s after SIGSTOP")
