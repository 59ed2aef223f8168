"""A process's open descriptors as seen through /proc, for tests that find (and flip bytes in) a
daemon's memfds. One place, because the daemon opens and closes descriptors while a test walks the
directory: a descriptor listed and closed before its link is read is skipped, never an error."""
from __future__ import annotations

import os
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
