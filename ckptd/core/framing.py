"""Frames on a unix socket, the one encoding both sides of the daemon's socket use (FORMAT.md):
an 8-byte header (magic, protocol version, body length), a JSON object body, and file
descriptors (SCM_RIGHTS) riding on a frame's first byte. ``protocol`` says what the frames carry."""
from __future__ import annotations

import array
import asyncio
import json
import socket
import struct
from collections.abc import Sequence
from typing import Any

from . import gc_pause
from .errors import ProtocolError

PROTOCOL_VERSION = 1
MAGIC = b"CK"
HEADER = struct.Struct(">2sHI")
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_FDS_PER_FRAME = 16
RECV_STEP = 64 * 1024        # a body's buffer starts this big and doubles as its bytes arrive
FRAME_TIMEOUT_S = 30.0       # a frame's body must be here this long after its header (the daemon's reads)


def encode(msg: dict[str, Any]) -> bytes:
    return frame(json.dumps(msg, separators=(",", ":"), allow_nan=True).encode())


def frame(body: bytes) -> bytes:
    """An encoded body with its header; ProtocolError (nothing to send) when it is over the limit."""
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, len(body)) + body


def parse_header(header: bytes) -> int:
    """Return the body length, or raise ProtocolError for bad magic, version or size."""
    magic, version, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}: not a ckptd peer")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})")
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return int(length)


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        msg = gc_pause.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"frame body is not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("frame body nests too deeply to parse") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("frame body must be a JSON object with a string 'op'")
    return msg


def send_frame(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Blocking send of one frame, with file descriptors attached to its first byte."""
    data = encode(msg)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


class FrameReceiver:
    """Blocking frame reader that also collects SCM_RIGHTS descriptors (client side)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self.fds: list[int] = []

    def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            data, ancdata, _flags, _addr = self._sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(MAX_FDS_PER_FRAME * 4))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
                    self.fds.extend(fds)
            if not data:
                return False
            self._buf += data
        return True

    def read(self) -> dict[str, Any] | None:
        """Next message, or None at a clean end of stream."""
        if not self._fill(HEADER.size):
            if self._buf:
                raise ProtocolError("connection closed inside a frame header")
            return None
        length = parse_header(bytes(self._buf[: HEADER.size]))
        if not self._fill(HEADER.size + length):
            raise ProtocolError("connection closed inside a frame body")
        body = bytes(self._buf[HEADER.size: HEADER.size + length])
        del self._buf[: HEADER.size + length]
        return decode_body(body)

    def take_fds(self, n: int) -> list[int]:
        if len(self.fds) < n:
            raise ProtocolError(f"expected {n} file descriptors, received {len(self.fds)}")
        taken, self.fds = self.fds[:n], self.fds[n:]
        return taken


async def recv_exact_async(loop: Any, sock: socket.socket, n: int, timeout: float | None = None, *,
                           idle_first: bool = False) -> bytes | None:
    """Exactly ``n`` bytes from a non-blocking socket; None at an end of stream before the first.

    The buffer grows as bytes arrive (from RECV_STEP, doubling), never ahead of them: a header
    alone claiming 16 MiB costs the reader 64 KiB, not 16 MiB. Bytes already here are taken
    without a wait (a small frame arrives whole). ``timeout``: all ``n`` must be here within it,
    else ProtocolError, so a peer stalled inside a frame keeps neither a buffer nor the reader;
    ``idle_first``: the wait for the first byte is not bounded, the rest is (a header: a connection
    may idle between frames, not inside one)."""
    buf = bytearray(min(n, RECV_STEP))
    view = memoryview(buf)
    got = 0
    deadline = None if timeout is None or idle_first else loop.time() + timeout
    while got < n:
        if got == len(buf):              # a new buffer, not a resize: a cancelled read may still hold a view
            bigger = bytearray(min(n, 2 * len(buf)))
            bigger[:got] = buf
            buf, view = bigger, memoryview(bigger)
        try:
            k = sock.recv_into(view[got:])
        except BlockingIOError:
            if deadline is None:
                k = await loop.sock_recv_into(sock, view[got:])
            else:
                try:
                    k = await asyncio.wait_for(loop.sock_recv_into(sock, view[got:]), deadline - loop.time())
                except asyncio.TimeoutError:
                    raise ProtocolError(f"{n - got} of {n} bytes did not arrive within {timeout:g} s of "
                                        f"{'their first' if idle_first else 'the header'} (a peer stalled inside a "
                                        "frame)") from None
        if k == 0:
            if got:
                raise ProtocolError("connection closed inside a frame")
            return None
        got += k
        if deadline is None and timeout is not None:     # (idle_first: the first bytes are here)
            deadline = loop.time() + timeout
    return bytes(buf)


async def send_frame_async(loop: Any, sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Daemon side: send one frame; descriptors ride on its first byte via sendmsg."""
    data = encode(msg)
    if fds:
        while True:
            try:
                sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                break
            except BlockingIOError:
                waiter = loop.create_future()
                loop.add_writer(sock.fileno(), lambda w=waiter: w.done() or w.set_result(None))
                try:
                    await waiter
                finally:
                    loop.remove_writer(sock.fileno())
        data = data[sent:]
    if data:
        await loop.sock_sendall(sock, data)
