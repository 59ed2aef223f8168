"""The daemon-to-daemon protocol (peer copies): framing, the mutual HMAC handshake, messages.

TCP, one connection per exchange stream. A frame is a 16-byte header — ``b"CP"``, the version
(u16), the JSON length (u32), the payload length (u64), big-endian — then a UTF-8 JSON object
with an ``op``, then that many payload bytes (a held shard's raw bytes; ``ckptd.core.held``).
JSON bodies are at most 16 MiB (4 KiB before the handshake is done); a payload is at most
what the receiver agreed to take (``limit``), checked before a byte of it is read. See FORMAT.md, "Peer protocol".

Handshake, before anything else, both ways (a shared secret, never sent):

    server → {"op": "challenge", "nonce": Ns}
    client → {"op": "auth", "nonce": Nc, "node": name, "mac": HMAC(secret, "ckptd-peer client" Ns Nc)}
    server → {"op": "welcome", "mac": HMAC(secret, "ckptd-peer server" Nc Ns)}   or "refused", then close

Nonces are 32 random bytes (hex); MACs HMAC-SHA256, compared with ``hmac.compare_digest``.
Then the client sends requests, each answered in turn:

    {"op": "put", <held meta>} + payload   → {"op": "ok"} | {"op": "error", "reason"}
    {"op": "get", job, step, rank, digest} → {"op": "held", <held meta>} + payload | {"op": "missing"}
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import ProtocolError

PEER_VERSION = 1
PEER_MAGIC = b"CP"
PEER_HEADER = struct.Struct(">2sHIQ")
MAX_PEER_JSON = 16 * 1024 * 1024
MAX_HANDSHAKE_JSON = 4096           # what an unauthenticated side may send
PIECE = 4 * 1024 * 1024
HANDSHAKE_TIMEOUT_S = 10.0
_CLIENT, _SERVER = b"ckptd-peer client", b"ckptd-peer server"


class AuthError(ProtocolError):
    """The other side does not know the shared secret (or is not a ckptd peer)."""


def mac(secret: bytes, role: bytes, first: str, second: str) -> str:
    return hmac.new(secret, role + bytes.fromhex(first) + bytes.fromhex(second), hashlib.sha256).hexdigest()


def _nonce(msg: dict[str, Any]) -> str:
    n = msg.get("nonce")
    if not (isinstance(n, str) and len(n) == 64 and all(c in "0123456789abcdef" for c in n)):
        raise AuthError("bad handshake nonce")
    return n


async def send(writer: asyncio.StreamWriter, msg: dict[str, Any], payload: Any = None,
               throttle: Callable[[int], Awaitable[None]] | None = None) -> None:
    """One frame; ``payload`` (a buffer) goes in pieces, each after ``throttle(len)`` allows it."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_PEER_JSON:
        raise ProtocolError(f"peer message of {len(body)} bytes exceeds {MAX_PEER_JSON}")
    view = memoryview(payload) if payload is not None else memoryview(b"")
    writer.write(PEER_HEADER.pack(PEER_MAGIC, PEER_VERSION, len(body), len(view)) + body)
    for s in range(0, len(view), PIECE):
        piece = view[s:s + PIECE]
        if throttle is not None:
            await throttle(len(piece))
        writer.write(piece)
        await writer.drain()
    await writer.drain()


async def recv(reader: asyncio.StreamReader, limit: int = 0, max_json: int = MAX_PEER_JSON
               ) -> tuple[dict[str, Any], int]:
    """(message, payload length); the payload is not read yet (``recv_payload`` or ``skip``).
    ProtocolError for bad magic, version, sizes or JSON; a payload over ``limit`` is refused."""
    try:
        header = await reader.readexactly(PEER_HEADER.size)
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
        msg = json.loads(await reader.readexactly(jlen))
    except asyncio.IncompleteReadError:
        raise ProtocolError("peer closed the connection inside a frame") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"peer frame is not JSON: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("peer frame must be a JSON object with a string 'op'")
    return msg, int(plen)


async def recv_payload(reader: asyncio.StreamReader, out: memoryview) -> None:
    """Read exactly ``len(out)`` payload bytes into ``out``."""
    got = 0
    try:
        while got < len(out):
            piece = await reader.readexactly(min(PIECE, len(out) - got))
            out[got:got + len(piece)] = piece
            got += len(piece)
    except asyncio.IncompleteReadError:
        raise ProtocolError("peer closed the connection inside a payload") from None


async def skip(reader: asyncio.StreamReader, n: int) -> None:
    while n > 0:
        n -= len(await reader.readexactly(min(PIECE, n)))


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes) -> str:
    """Authenticate a connecting peer and prove ourselves; returns the name it gave. AuthError if not."""
    ns = secrets.token_hex(32)
    await send(writer, {"op": "challenge", "nonce": ns})
    msg, _ = await asyncio.wait_for(recv(reader, max_json=MAX_HANDSHAKE_JSON), HANDSHAKE_TIMEOUT_S)
    if msg.get("op") != "auth":
        raise AuthError("peer did not authenticate")
    nc, their = _nonce(msg), msg.get("mac")
    if not (isinstance(their, str) and hmac.compare_digest(their, mac(secret, _CLIENT, ns, nc))):
        await send(writer, {"op": "refused", "reason": "authentication failed"})
        raise AuthError("peer failed authentication (wrong shared secret)")
    await send(writer, {"op": "welcome", "mac": mac(secret, _SERVER, nc, ns)})
    node = msg.get("node")
    return node[:200] if isinstance(node, str) else "?"


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                           node: str) -> None:
    """Answer the server's challenge and check its proof; AuthError if it fails either way."""
    msg, _ = await asyncio.wait_for(recv(reader, max_json=MAX_HANDSHAKE_JSON), HANDSHAKE_TIMEOUT_S)
    if msg.get("op") != "challenge":
        raise AuthError("peer sent no challenge")
    ns, nc = _nonce(msg), secrets.token_hex(32)
    await send(writer, {"op": "auth", "nonce": nc, "node": node, "mac": mac(secret, _CLIENT, ns, nc)})
    msg, _ = await asyncio.wait_for(recv(reader, max_json=MAX_HANDSHAKE_JSON), HANDSHAKE_TIMEOUT_S)
    if msg.get("op") == "refused":
        raise AuthError("the peer refused our authentication (wrong shared secret?)")
    theirs = msg.get("mac")
    if msg.get("op") != "welcome" or not (isinstance(theirs, str)
                                          and hmac.compare_digest(theirs, mac(secret, _SERVER, nc, ns))):
        raise AuthError("the peer failed to prove the shared secret")
