"""The daemon-to-daemon protocol (peer copies): framing, the mutual HMAC handshake, messages.

TCP, one connection per exchange stream. A frame is a 16-byte header — ``b"CP"``, the version
(u16), the JSON length (u32), the payload length (u64), big-endian — then a UTF-8 JSON object
with an ``op``, then that many payload bytes (a held shard's raw bytes; ``ckptd.core.held``).
JSON bodies are at most 16 MiB (4 KiB before the handshake is done); a payload is at most
what the receiver agreed to take (``limit``), checked before a byte of it is read. See FORMAT.md, "Peer protocol".

Every read and every drain is bounded by ``timeout`` (the daemon's ``peers.io_timeout``): a peer
that sends nothing, or takes nothing, for that long raises :class:`StalledError`, so a stopped or
wedged peer fails the one exchange it is in and never blocks the caller for good. The bound is on
progress, not on a whole transfer: a large shard on a slow link is fine while bytes keep moving.

Handshake, before anything else, both ways (a shared secret, never sent):

    server → {"op": "challenge", "nonce": Ns}
    client → {"op": "auth", "nonce": Nc, "node": name, "mac": HMAC(secret, "ckptd-peer client" Ns Nc)}
    server → {"op": "welcome", "mac": HMAC(secret, "ckptd-peer server" Nc Ns)}   or "refused", then close

Nonces are 32 random bytes (hex); MACs HMAC-SHA256, compared with ``hmac.compare_digest``.
Then the client sends requests, each answered in turn:

    {"op": "put", <held meta>} + payload   → {"op": "ok"} | {"op": "error", "reason"}
    {"op": "get", job, step, rank, digest} → {"op": "held", <held meta>} + payload | {"op": "missing"}
    {"op": "has", job, step, rank, digest} → {"op": "yes"} | {"op": "missing"}

and, with ``[peers] redundancy = "parity"``, the piece ops ``put_piece``, ``get_parity`` and
``get_piece`` (ckptd/daemon/tiers/peers/layout.py), each payload carrying its xxh3-64 ``checksum``.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import struct
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .errors import ProtocolError
from .names import is_hex

PEER_VERSION = 1
PEER_MAGIC = b"CP"
PEER_HEADER = struct.Struct(">2sHIQ")
MAX_PEER_JSON = 16 * 1024 * 1024
MAX_HANDSHAKE_JSON = 4096           # what an unauthenticated side may send
PIECE = 4 * 1024 * 1024             # most payload bytes read at once
SEND_PIECE = 256 * 1024             # payload bytes written (and paced) at once
IO_TIMEOUT_S = 30.0                 # the default of peers.io_timeout
_CLIENT, _SERVER = b"ckptd-peer client", b"ckptd-peer server"
T = TypeVar("T")


class AuthError(ProtocolError):
    """The other side does not know the shared secret (or is not a ckptd peer)."""


class StalledError(ProtocolError):
    """The peer made no progress (sent or took no bytes) within the I/O timeout."""


async def _bounded(what: str, aw: Awaitable[T], timeout: float) -> T:
    """``aw``, or StalledError naming ``what`` when it has not finished within ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise StalledError(f"peer stalled: nothing {what} for {timeout:g} s") from None


async def _read(reader: asyncio.StreamReader, n: int, timeout: float) -> bytes:
    """Exactly ``n`` bytes (IncompleteReadError at EOF), each wait for more bounded by ``timeout``."""
    if n <= 0:
        return b""
    first = await _bounded("received", reader.read(n), timeout)
    if len(first) == n:
        return first
    parts, got = [first], len(first)
    while got < n:
        if not parts[-1]:
            raise asyncio.IncompleteReadError(b"".join(parts), n)
        parts.append(await _bounded("received", reader.read(n - got), timeout))
        got += len(parts[-1])
    return b"".join(parts)


def mac(secret: bytes, role: bytes, first: str, second: str) -> str:
    return hmac.new(secret, role + bytes.fromhex(first) + bytes.fromhex(second), hashlib.sha256).hexdigest()


def _nonce(msg: dict[str, Any]) -> str:
    n = msg.get("nonce")
    if not is_hex(n, 64):
        raise AuthError("bad handshake nonce")
    return n


async def send(writer: asyncio.StreamWriter, msg: dict[str, Any], payload: Any = None,
               throttle: Callable[[int], Awaitable[None]] | None = None, *, timeout: float) -> None:
    """One frame; ``payload`` (a buffer) goes in ``SEND_PIECE`` pieces, each after ``throttle(len)``
    allows it and each drained before the next (small pieces: a slow link that keeps taking bytes
    is progress; ``timeout`` s without it raise StalledError)."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_PEER_JSON:
        raise ProtocolError(f"peer message of {len(body)} bytes exceeds {MAX_PEER_JSON}")
    view = memoryview(payload) if payload is not None else memoryview(b"")
    writer.write(PEER_HEADER.pack(PEER_MAGIC, PEER_VERSION, len(body), len(view)) + body)
    for s in range(0, len(view), SEND_PIECE):
        part = view[s:s + SEND_PIECE]
        if throttle is not None:
            await throttle(len(part))
        writer.write(part)
        await _bounded("taken", writer.drain(), timeout)
    await _bounded("taken", writer.drain(), timeout)


async def recv(reader: asyncio.StreamReader, limit: int = 0, max_json: int = MAX_PEER_JSON, *,
               timeout: float) -> tuple[dict[str, Any], int]:
    """(message, payload length); the payload is not read yet (``recv_payload`` or ``skip``).
    ProtocolError for bad magic, version, sizes or JSON; a payload over ``limit`` is refused;
    StalledError when the peer sends nothing for ``timeout`` s."""
    try:
        header = await _read(reader, PEER_HEADER.size, timeout)
    except asyncio.IncompleteReadError:
        raise ProtocolError("peer closed the connection") from None
    magic, version, jlen, plen = PEER_HEADER.unpack(header)
    if magic != PEER_MAGIC:
        raise ProtocolError(f"bad peer frame magic {magic!r}: not a ckptd peer")
    if version != PEER_VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this daemon {PEER_VERSION}")
    if jlen > max_json or plen > limit:
        raise ProtocolError(f"peer frame too large ({jlen} bytes of JSON, {plen} of payload; limit {limit})")
    try:
        msg = json.loads(await _read(reader, jlen, timeout))
    except asyncio.IncompleteReadError:
        raise ProtocolError("peer closed the connection inside a frame") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"peer frame is not JSON: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("peer frame must be a JSON object with a string 'op'")
    return msg, int(plen)


async def recv_payload(reader: asyncio.StreamReader, out: memoryview, *, timeout: float) -> None:
    """Read exactly ``len(out)`` payload bytes into ``out``, whatever arrives at a time (so the
    ``timeout`` bounds each wait for more bytes, not the whole payload)."""
    got = 0
    while got < len(out):
        piece = await _bounded("received", reader.read(min(PIECE, len(out) - got)), timeout)
        if not piece:
            raise ProtocolError("peer closed the connection inside a payload")
        out[got:got + len(piece)] = piece
        got += len(piece)


async def skip(reader: asyncio.StreamReader, n: int, *, timeout: float) -> None:
    """Read and drop ``n`` payload bytes (a payload this side will not keep)."""
    while n > 0:
        piece = await _bounded("received", reader.read(min(PIECE, n)), timeout)
        if not piece:
            raise ProtocolError("peer closed the connection inside a payload")
        n -= len(piece)


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, *,
                           timeout: float) -> str:
    """Authenticate a connecting peer and prove ourselves; returns the name it gave. AuthError if not
    (StalledError when it goes silent)."""
    ns = secrets.token_hex(32)
    await send(writer, {"op": "challenge", "nonce": ns}, timeout=timeout)
    msg, _ = await recv(reader, max_json=MAX_HANDSHAKE_JSON, timeout=timeout)
    if msg.get("op") != "auth":
        raise AuthError("peer did not authenticate")
    nc, their = _nonce(msg), msg.get("mac")
    if not (isinstance(their, str) and hmac.compare_digest(their, mac(secret, _CLIENT, ns, nc))):
        await send(writer, {"op": "refused", "reason": "authentication failed"}, timeout=timeout)
        raise AuthError("peer failed authentication (wrong shared secret)")
    await send(writer, {"op": "welcome", "mac": mac(secret, _SERVER, nc, ns)}, timeout=timeout)
    node = msg.get("node")
    return node[:200] if isinstance(node, str) else "?"


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                           node: str, *, timeout: float) -> None:
    """Answer the server's challenge and check its proof; AuthError if it fails either way
    (StalledError when the server goes silent)."""
    msg, _ = await recv(reader, max_json=MAX_HANDSHAKE_JSON, timeout=timeout)
    if msg.get("op") != "challenge":
        raise AuthError("peer sent no challenge")
    ns, nc = _nonce(msg), secrets.token_hex(32)
    await send(writer, {"op": "auth", "nonce": nc, "node": node, "mac": mac(secret, _CLIENT, ns, nc)},
               timeout=timeout)
    msg, _ = await recv(reader, max_json=MAX_HANDSHAKE_JSON, timeout=timeout)
    if msg.get("op") == "refused":
        raise AuthError("the peer refused our authentication (wrong shared secret?)")
    theirs = msg.get("mac")
    if msg.get("op") != "welcome" or not (isinstance(theirs, str)
                                          and hmac.compare_digest(theirs, mac(secret, _SERVER, nc, ns))):
        raise AuthError("the peer failed to prove the shared secret")
