"""One peer connection: a blocking TCP socket (TLS-wrapped when configured) whose transfers run on threads.

Why not the event loop's streams: under uvloop (the daemon's loop) a stream reads a large payload
at 0.25-0.35 GB/s over loopback, a blocking ``recv_into`` on a thread at 0.8-1.05 GB/s straight into
the destination memfd (README, "Memory-level saves"). So every transfer is a blocking call on a
thread of one of this module's pools (one per kind of call: ``POOL_THREADS``), and the event loop
only waits: for the call's result, and, before a frame is read, for the socket to become readable
(``readable``), so an idle connection holds no thread.

Every blocking call is bounded by ``timeout`` per step (the socket's timeout: each ``recv`` or
``send`` of a piece), so a peer that sends or takes nothing for that long raises
:class:`StalledError`; a large payload on a slow link is fine while bytes keep moving. A coroutine
cancelled while its call runs shuts the socket down (which ends the call at once) and waits for the
thread before it lets go, so no thread ever writes into a buffer its caller has given up.

Call order: ``connect`` (or ``Channel(accepted socket)``, then ``start_tls`` with TLS, on the listening
side); then, any number of times, ``readable`` before a frame is read and ``run(fn, kind)`` with a
blocking ``fn`` made of ``sendall`` and ``fill`` (``ckptd.core.peer_protocol`` frames that way); then ``close``.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .errors import ProtocolError

PIECE = 4 * 1024 * 1024              # most bytes asked of one recv
T = TypeVar("T")

# One pool per kind of blocking call, so no call can wait on one that cannot start: a send waits
# only for its receiver to read (the other side's RECV pool), a receive starts only once its
# sender's call runs (``readable``, or a payload right after its frame), a dialling side's TLS
# handshake waits for the listener's (ACCEPT). Were they one pool, two nodes whose threads all
# sent to each other would stall until the timeout, with no thread left on either to read.
SEND, RECV, CONNECT, ACCEPT = "send", "recv", "connect", "accept"
POOL_THREADS = {SEND: 32, RECV: 32, CONNECT: 16, ACCEPT: 16}     # threads are started as needed
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


class StalledError(ProtocolError):
    """The peer made no progress (sent or took no bytes) within the I/O timeout."""


def _io_pool(kind: str) -> ThreadPoolExecutor:
    with _pools_lock:
        if kind not in _pools:
            _pools[kind] = ThreadPoolExecutor(POOL_THREADS[kind], thread_name_prefix=f"ckptd-peer-{kind}")
        return _pools[kind]


def _close_dialled(fut: asyncio.Future[socket.socket]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


class Channel:
    """A connected socket in blocking mode with ``timeout`` as its per-call bound."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        sock.setblocking(True)
        sock.settimeout(timeout)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.timeout = sock, timeout
        self._lock = threading.Lock()
        self._busy = 0                   # blocking calls in flight
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def connect(cls, host: str, port: int, timeout: float, tls: ssl.SSLContext | None = None) -> Channel:
        """A connection to ``host:port`` (TLS handshake done when ``tls``). StalledError when no
        connection (or handshake) within ``timeout``; ``ssl.SSLError`` as the handshake raised it."""
        def dial() -> socket.socket:
            try:
                sock = socket.create_connection((host, port), timeout)
            except TimeoutError:
                raise StalledError(f"peer stalled: no connection within {timeout:g} s") from None
            if tls is None:
                return sock
            try:
                sock.settimeout(timeout)
                return tls.wrap_socket(sock, server_hostname=None)
            except TimeoutError:
                sock.close()
                raise StalledError(f"peer stalled: no TLS handshake within {timeout:g} s") from None
            except BaseException:
                sock.close()
                raise
        fut = asyncio.get_running_loop().run_in_executor(_io_pool(CONNECT), dial)
        try:
            return cls(await asyncio.shield(fut), timeout)
        except asyncio.CancelledError:      # the dial is bounded by the timeout; its socket is closed after
            fut.add_done_callback(_close_dialled)
            raise

    async def start_tls(self, tls: ssl.SSLContext) -> None:
        """The listening side's TLS handshake on an accepted connection (``ssl.SSLError`` if refused)."""
        await self.readable()               # (the ClientHello: a silent dialler holds no thread)

        def handshake() -> ssl.SSLSocket:
            try:
                return tls.wrap_socket(self.sock, server_side=True)
            except TimeoutError:
                raise StalledError(f"peer stalled: no TLS handshake within {self.timeout:g} s") from None
        self.sock = await self.run(handshake, ACCEPT)

    def close(self) -> None:
        """Shut the connection down (a blocking call in flight returns at once); the socket is closed
        now, or by the last call in flight when it returns (never under a thread still using it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            busy = self._busy
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)    # the plain socket's: TLS state untouched
        except OSError:
            pass
        if not busy:
            self.sock.close()

    # ---- waiting on the event loop -------------------------------------------------------------

    async def readable(self, timeout: float | None = None) -> None:
        """Until bytes arrive (StalledError after ``timeout``, default the channel's): waited for on the
        event loop, so an idle connection holds no thread."""
        limit = self.timeout if timeout is None else timeout
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()
        if fd < 0:
            raise ProtocolError("peer connection is closed")

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)
        loop.add_reader(fd, wake)
        try:
            await asyncio.wait_for(ready, limit)
        except asyncio.TimeoutError:
            raise StalledError(f"peer stalled: nothing received for {limit:g} s") from None
        finally:
            loop.remove_reader(fd)

    async def run(self, fn: Callable[[], T], kind: str) -> T:
        """``fn`` (blocking I/O on this socket) on a thread of the ``kind`` pool (SEND, RECV: what ``fn``
        waits for the peer to do); a cancelled caller shuts the socket down and waits for the thread
        before the cancellation goes on."""
        with self._lock:
            if self._closed:
                raise ProtocolError("peer connection is closed")
            self._busy += 1
        fut = asyncio.get_running_loop().run_in_executor(_io_pool(kind), self._call, fn)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.close()
            await asyncio.wait([fut])
            raise

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        finally:
            with self._lock:
                self._busy -= 1
                last = self._closed and not self._busy
            if last:
                self.sock.close()

    # ---- blocking steps, for functions handed to ``run`` ---------------------------------------------

    def sendall(self, data: bytes | memoryview) -> None:
        """Send ``data`` (keep it to a piece: the socket's timeout bounds the whole call)."""
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise StalledError(f"peer stalled: nothing taken for {self.timeout:g} s") from None

    def fill(self, out: memoryview, inside: str | None) -> None:
        """Exactly ``len(out)`` bytes into ``out``, however they arrive. ProtocolError when the peer
        closes first: "peer closed the connection" at a frame boundary (``inside`` None, nothing read),
        else "... inside a <inside>"."""
        got = 0
        while got < len(out):
            try:
                k = self.sock.recv_into(out[got:], min(PIECE, len(out) - got))
            except TimeoutError:
                raise StalledError(f"peer stalled: nothing received for {self.timeout:g} s") from None
            if not k:
                where = inside or ("frame" if got else None)
                raise ProtocolError("peer closed the connection" + (f" inside a {where}" if where else ""))
            got += k
