"""The daemon's listening unix socket: bound with a restrictive mode, never over a live daemon's."""
from __future__ import annotations

import os
import socket
import stat


def bind_socket(path: str, mode: int, group: int | None) -> socket.socket:
    """Bind the listening socket with a restrictive mode (replacing a stale socket file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise RuntimeError(f"another daemon is already serving {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    if group is not None:
        try:
            os.chown(path, -1, group)
        except OSError as e:
            sock.close()
            os.unlink(path)
            raise RuntimeError(f"cannot give {path} to group {group}: {e.strerror}") from None
    sock.listen(1024)
    return sock
