"""The wire protocol between ckptd_client and the daemon: framing, messages, version.

This is the one place both sides import. A frame is an 8-byte header
(``b"CK"``, protocol version as u16, body length as u32, big-endian) followed by
a UTF-8 JSON object with an ``op`` field. Tensor bytes never travel here: they
live in shared-memory slots whose file descriptors the daemon passes once, with
SCM_RIGHTS, in the reply to ``hello``/``resize``.

Requests carry ``req`` (an integer chosen by the client); the daemon answers each
with ``{"op": "ok", "req": ...}`` or ``{"op": "error", "req": ..., "reason": ...}``.
Events about a save (``slot_free``, ``durable``, ``committed``, ``failed``) carry
the step and arrive whenever they happen. See FORMAT.md, "Wire protocol".
"""
from __future__ import annotations

import array
import json
import re
import socket
import struct
from typing import Any

PROTOCOL_VERSION = 1
MAGIC = b"CK"
HEADER = struct.Struct(">2sHI")
MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_FDS_PER_FRAME = 16

# Client → daemon requests and the fields each must carry (name → type).
REQUEST_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "hello": {"job": str, "rank": int, "world_size": int, "pid": int,
              "slot_bytes": int, "num_slots": int},
    "resize": {"slot_bytes": int},
    "save": {"step": int, "slot": int, "tensors": list, "tree": (dict, list, str, int, float, bool, type(None)),
             "commit": str},
    "commit": {"step": int, "digests": dict},
    "abort": {"step": int, "reason": str},
    "report": {"step": int, "stall_s": (int, float), "fence_s": (int, float)},
    "info": {},
    "status": {},
}
COMMIT_MODES = ("local", "relay")

# \Z, not $: "$" also matches before a trailing newline ("job\n" would pass).
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
MAX_TENSOR_NAME = 1024
# Nesting of a save's JSON state tree (the tagged encoding spends 2-3 levels per Python
# container). Deeper trees are refused on the wire and on disk: every reader must be able
# to parse them without running out of recursion.
MAX_TREE_DEPTH = 256


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection is closed after it."""


def _short(value: object, limit: int = 80) -> str:
    """repr() for error messages, cut short: the value may be 16 MiB of hostile text."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validate_job(job: object) -> str:
    """A job name becomes a directory: letters, digits, ``._-``, no leading dot, ≤128 chars."""
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ValueError(
            f"invalid job name {_short(job)}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit")
    return job


def validate_tensor_name(name: object) -> str:
    """Tensor names are key paths (``model/layer.0.weight``); refuse anything path-like that could escape."""
    if not isinstance(name, str) or not name or len(name) > MAX_TENSOR_NAME:
        raise ValueError(f"invalid tensor name {_short(name)}: must be a non-empty string of at most "
                         f"{MAX_TENSOR_NAME} chars")
    if "\x00" in name or "\\" in name or name.startswith("/"):
        raise ValueError(f"invalid tensor name {_short(name)}: NUL, backslash or leading '/' not allowed")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"invalid tensor name {_short(name)}: empty, '.' or '..' path segment")
    return name


def check_tree_depth(tree: Any, limit: int = MAX_TREE_DEPTH) -> None:
    """Raise ValueError if a JSON state tree nests deeper than ``limit`` (checked without recursion)."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                raise ValueError(f"state tree nests deeper than {limit} levels")
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))


def encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":"), allow_nan=True).encode()
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
    return length


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"frame body is not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("frame body nests too deeply to parse") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("frame body must be a JSON object with a string 'op'")
    return msg


def check_request(msg: dict[str, Any]) -> dict[str, Any]:
    """Validate a client request's op, ``req`` and field types; raise ProtocolError naming the field."""
    op = msg["op"]
    fields = REQUEST_FIELDS.get(op)
    if fields is None:
        raise ProtocolError(f"unknown request op {_short(op)}")
    if type(msg.get("req")) is not int:
        raise ProtocolError(f"{op}: missing integer 'req'")
    for name, typ in fields.items():
        value = msg.get(name)
        if name not in msg or not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ProtocolError(f"{op}: field {name!r} missing or not {getattr(typ, '__name__', typ)}")
    return msg


def send_frame(sock: socket.socket, msg: dict[str, Any], fds: list[int] = ()) -> None:
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


async def read_frame_async(loop: Any, sock: socket.socket) -> dict[str, Any] | None:
    """Daemon side: next message from a non-blocking socket, or None at a clean end of stream."""
    header = await _recv_exact_async(loop, sock, HEADER.size)
    if header is None:
        return None
    length = parse_header(header)
    body = await _recv_exact_async(loop, sock, length)
    if body is None:
        raise ProtocolError("connection closed inside a frame body")
    return decode_body(body)


async def _recv_exact_async(loop: Any, sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            if got:
                raise ProtocolError("connection closed inside a frame")
            return None
        got += k
    return bytes(buf)


async def send_frame_async(loop: Any, sock: socket.socket, msg: dict[str, Any], fds: list[int] = ()) -> None:
    """Daemon side: send one frame; descriptors ride on its first byte via sendmsg."""
    data = encode(msg)
    if fds:
        while True:
            try:
                sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                break
            except BlockingIOError:
                waiter = loop.create_future()
                loop.add_writer(sock.fileno(), lambda: waiter.done() or waiter.set_result(None))
                try:
                    await waiter
                finally:
                    loop.remove_writer(sock.fileno())
        data = data[sent:]
    if data:
        await loop.sock_sendall(sock, data)


DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"


def default_socket_path() -> str:
    """``$CKPTD_SOCKET`` if set, else /run/ckptd/ckptd.sock (the systemd unit's RuntimeDirectory)."""
    import os
    return os.environ.get("CKPTD_SOCKET") or DEFAULT_SOCKET


def connect(path: str, timeout: float | None = 10.0) -> socket.socket:
    """Connect to a daemon's socket; the error says which path failed and how to start one."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise ConnectionError(
            f"cannot reach the ckptd daemon at {path}: {e.strerror or e}. Start one with "
            f"`ckptd serve --root DIR --socket {path}` (or `systemctl start ckptd.socket`), "
            f"or point CKPTD_SOCKET / socket= at a running daemon") from None
    sock.settimeout(None)
    return sock


def request_once(path: str, msg: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request on a fresh connection (CLI tools); raises RuntimeError on an error reply."""
    sock = connect(path, timeout)
    try:
        sock.settimeout(timeout)
        send_frame(sock, {"req": 1, **msg})
        reply = FrameReceiver(sock).read()
    finally:
        sock.close()
    if reply is None:
        raise ConnectionError(f"daemon at {path} closed the connection")
    if reply.get("op") != "ok":
        raise RuntimeError(reply.get("reason", "daemon refused the request"))
    return reply
