"""This process's sockets, found by Linux's /proc/self/fd: which are TCP connections to a given port,
and shutting one down (its blocked reads and writes then fail at once, in whatever thread). The store
guard (store_guard.py) uses them on connections a C++ store client opened, whose sockets Python never
sees; every fd here is borrowed (``detach``): never closed.
"""
from __future__ import annotations

import os
import socket


def sockets() -> dict[str, int]:
    """This process's sockets: ``socket:[inode]`` → fd."""
    out: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:         # closed meanwhile (or the listing's own fd)
            continue
        if link.startswith("socket:["):
            out[link] = int(name)
    return out


def peer_port(fd: int) -> int | None:
    """The remote port of the TCP socket ``fd`` (None: not one, or gone)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return int(sock.getpeername()[1])
    except OSError:
        return None
    finally:
        sock.detach()       # the fd is the store client's: never closed here


def shut(fd: int, link: str) -> None:
    """Shut the socket down (its blocked reads and writes fail at once), if ``fd`` is still ``link``."""
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != link:
            return
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


def shut_new(before: set[str], port: int) -> None:
    """Shut down every socket to ``port`` that is not in ``before`` (a connection being opened)."""
    for link, fd in sockets().items():
        if link not in before and peer_port(fd) == port:
            shut(fd, link)
