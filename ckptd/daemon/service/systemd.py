"""systemd integration without libsystemd: socket activation and the sd_notify protocol.

Socket activation (sd_listen_fds(3)): systemd opens ``ckptd.socket`` itself and starts the
daemon with the listening socket as fd 3, ``LISTEN_FDS=1`` and ``LISTEN_PID=<daemon pid>``.
:func:`listen_socket` takes it over (and clears the variables so no child inherits them);
without them the daemon binds its own socket, as when started by hand.

Notification (sd_notify(3)): with ``Type=notify`` systemd passes ``NOTIFY_SOCKET``, a unix
datagram socket (a path, or ``@name`` for the abstract namespace). The daemon sends
``READY=1`` once it accepts connections, ``STATUS=...`` lines, ``WATCHDOG=1`` every half of
``WATCHDOG_USEC`` from its event loop (so a wedged loop is restarted), and ``STOPPING=1``
plus ``EXTEND_TIMEOUT_USEC`` while it drains on SIGTERM. Every function here is a no-op
when the variables are absent.
"""
from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import MutableMapping

log = logging.getLogger("ckptd")

SD_LISTEN_FDS_START = 3


class ActivationError(RuntimeError):
    """Sockets were passed by systemd but are not what the daemon can serve."""


def listen_fds(env: MutableMapping[str, str] | None = None, unset_environment: bool = True) -> list[int]:
    """The descriptors passed by socket activation (fd 3, 4, ...), or [] when not activated.

    Follows sd_listen_fds(3): only if ``LISTEN_PID`` is this process; the fds get
    close-on-exec; ``LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES`` are removed from ``env``.
    """
    env = os.environ if env is None else env
    pid, count = env.get("LISTEN_PID"), env.get("LISTEN_FDS")
    if unset_environment:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            env.pop(name, None)
    if not pid or not count:
        return []
    try:
        if int(pid) != os.getpid():
            return []
        n = int(count)
    except ValueError:
        raise ActivationError(f"bad LISTEN_PID={pid!r} / LISTEN_FDS={count!r}") from None
    if n < 0:
        raise ActivationError(f"bad LISTEN_FDS={count!r}")
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n))
    for fd in fds:
        try:
            os.set_inheritable(fd, False)
        except OSError as e:
            raise ActivationError(f"LISTEN_FDS={n} but fd {fd} is not open: {e.strerror}") from None
    return fds


def listen_socket(env: MutableMapping[str, str] | None = None) -> socket.socket | None:
    """The one listening unix stream socket systemd passed, or None when not socket-activated."""
    fds = listen_fds(env)
    if not fds:
        return None
    if len(fds) != 1:
        raise ActivationError(f"systemd passed {len(fds)} sockets; ckptd serves exactly one "
                              "(one ListenStream= in ckptd.socket)")
    fd = fds[0]
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        raise ActivationError(f"fd {fd} passed by systemd is not a socket")
    sock = socket.socket(fileno=fd)
    try:
        ok = (sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM
              and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        ok = False
    if not ok:
        sock.detach()
        raise ActivationError(f"fd {fd} passed by systemd is not a listening unix stream socket "
                              "(ckptd.socket needs ListenStream=/path and Accept=no)")
    return sock


def socket_path(sock: socket.socket) -> str:
    name = sock.getsockname()
    if isinstance(name, bytes):
        return "@" + name[1:].decode(errors="replace") if name[:1] == b"\0" else name.decode(errors="replace")
    return name


class Notifier:
    """Sends sd_notify datagrams to ``$NOTIFY_SOCKET``; every method is a no-op without it."""

    def __init__(self, env: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET") or ""
        self.address: str | bytes | None = None
        if path.startswith("@"):
            self.address = b"\0" + path[1:].encode()
        elif path.startswith("/"):
            self.address = path
        self._sock: socket.socket | None = None
        self._warned = False
        self.watchdog_usec = 0
        usec, wpid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        try:
            if usec and (not wpid or int(wpid) == os.getpid()):
                self.watchdog_usec = max(0, int(usec))
        except ValueError:
            self.watchdog_usec = 0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the timeout, as sd_watchdog_enabled advises)."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=value`` lines as one datagram; False (logged once) if it cannot be sent."""
        if self.address is None:
            return False
        msg = "\n".join(f.replace("\n", " ") if not f.startswith("STATUS=") else f.split("\n")[0]
                        for f in fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self.address)
            return True
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("sd_notify failed", extra={"ctx": {"socket": str(self.address), "error": str(e)}})
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *( [f"STATUS={status}"] if status else []), f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None, extend_s: float | None = None) -> bool:
        fields = ["STOPPING=1"]
        if status:
            fields.append(f"STATUS={status}")
        if extend_s:
            fields.append(f"EXTEND_TIMEOUT_USEC={int(extend_s * 1e6)}")
        return self.notify(*fields)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
