"""The daemon-to-daemon protocol (peer copies): framing, the mutual HMAC handshake, messages.

TCP, one connection per exchange stream. A frame is a 16-byte header — ``b"CP"``, the version
(u16), the JSON length (u32), the payload length (u64), big-endian — then a UTF-8 JSON object
with an ``op``, then that many payload bytes (a held shard's raw bytes; ``ckptd.core.held``).
JSON bodies are at most 16 MiB (4 KiB before the handshake is done); a payload is at most
what the receiver agreed to take (``limit``), checked before a byte of it is read. See FORMAT.md, "Peer protocol".

Frames move over a :class:`~ckptd.core.peer_channel.Channel`: blocking sockets on threads, each
wait bounded by its ``timeout`` (the daemon's ``peers.io_timeout``): a peer that sends nothing, or
takes nothing, for that long raises :class:`~ckptd.core.peer_channel.StalledError`, so a stopped
or wedged peer fails the one exchange it is in and never blocks the caller for good. The bound is
on progress, not on a whole transfer: a large shard on a slow link is fine while bytes keep moving.

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

import hashlib
import hmac
import json
import secrets
import struct
from collections.abc import Callable
from typing import Any

from .errors import ProtocolError
from .names import is_hex
from .peer_channel import ACCEPT, RECV, SEND, Channel

PEER_VERSION = 1
PEER_MAGIC = b"CP"
PEER_HEADER = struct.Struct(">2sHIQ")
MAX_PEER_JSON = 16 * 1024 * 1024
MAX_HANDSHAKE_JSON = 4096           # what an unauthenticated side may send
SEND_PIECE = 256 * 1024             # payload bytes written (and paced) at once
IO_TIMEOUT_S = 30.0                 # the default of peers.io_timeout
_CLIENT, _SERVER = b"ckptd-peer client", b"ckptd-peer server"


class AuthError(ProtocolError):
    """The other side does not know the shared secret (or is not a ckptd peer)."""


def mac(secret: bytes, role: bytes, first: str, second: str) -> str:
    return hmac.new(secret, role + bytes.fromhex(first) + bytes.fromhex(second), hashlib.sha256).hexdigest()


def _nonce(msg: dict[str, Any]) -> str:
    n = msg.get("nonce")
    if not is_hex(n, 64):
        raise AuthError("bad handshake nonce")
    return n


async def send(ch: Channel, msg: dict[str, Any], payload: Any = None,
               pace: Callable[[int], None] | None = None) -> None:
    """One frame, on one of the channel's threads; ``payload`` (a buffer) goes in ``SEND_PIECE``
    pieces, each after ``pace(len)`` (blocking) allows it (small pieces: a slow link that keeps taking
    bytes is progress; ``ch.timeout`` s without it raise StalledError)."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_PEER_JSON:
        raise ProtocolError(f"peer message of {len(body)} bytes exceeds {MAX_PEER_JSON}")
    view = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
    head = PEER_HEADER.pack(PEER_MAGIC, PEER_VERSION, len(body), len(view)) + body

    small = pace is None and len(view) <= SEND_PIECE

    def frame() -> None:
        ch.sendall(head + view if small else head)
        if not small:
            for s in range(0, len(view), SEND_PIECE):
                part = view[s:s + SEND_PIECE]
                if pace is not None:
                    pace(len(part))
                ch.sendall(part)
    await ch.run(frame, SEND)


async def recv(ch: Channel, limit: int = 0, max_json: int = MAX_PEER_JSON, *,
               wait: float | None = None, kind: str = RECV) -> tuple[dict[str, Any], int]:
    """(message, payload length); the payload is not read yet (``recv_payload`` or ``skip``).
    ProtocolError for bad magic, version, sizes or JSON; a payload over ``limit`` is refused;
    StalledError when the peer sends nothing for ``wait`` s (default ``ch.timeout``: the first byte
    is waited for on the event loop, the rest of the frame on a thread of pool ``kind``)."""
    await ch.readable(wait)

    def frame() -> tuple[Any, int]:
        header = bytearray(PEER_HEADER.size)
        ch.fill(memoryview(header), None)
        magic, version, jlen, plen = PEER_HEADER.unpack(header)
        if magic != PEER_MAGIC:
            raise ProtocolError(f"bad peer frame magic {bytes(magic)!r}: not a ckptd peer")
        if version != PEER_VERSION:
            raise ProtocolError(f"peer speaks protocol version {version}, this daemon {PEER_VERSION}")
        if jlen > max_json or plen > limit:
            raise ProtocolError(f"peer frame too large ({jlen} bytes of JSON, {plen} of payload; limit {limit})")
        body = bytearray(jlen)
        ch.fill(memoryview(body), "frame")
        try:
            return json.loads(body), int(plen)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ProtocolError(f"peer frame is not JSON: {e}") from None
    msg, plen = await ch.run(frame, kind)
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("peer frame must be a JSON object with a string 'op'")
    return msg, plen


async def recv_payload(ch: Channel, out: memoryview) -> None:
    """Read exactly ``len(out)`` payload bytes into ``out`` on one of the channel's threads (the
    timeout bounds each wait for more bytes, not the whole payload)."""
    await ch.run(lambda: ch.fill(out, "payload"), RECV)


async def skip(ch: Channel, n: int) -> None:
    """Read and drop ``n`` payload bytes (a payload this side will not keep)."""
    def drop() -> None:
        scratch = memoryview(bytearray(min(n, 4 << 20)))
        left = n
        while left:
            k = min(left, len(scratch))
            ch.fill(scratch[:k], "payload")
            left -= k
    if n > 0:
        await ch.run(drop, RECV)


async def server_handshake(ch: Channel, secret: bytes) -> str:
    """Authenticate a connecting peer and prove ourselves; returns the name it gave. AuthError if not
    (StalledError when it goes silent). Its frame is read on the ACCEPT pool, not RECV: connections
    no one has authenticated yet (one sending a byte now and then) never hold the threads that
    authenticated peers' transfers need. The caller bounds the whole handshake (link.py)."""
    ns = secrets.token_hex(32)
    await send(ch, {"op": "challenge", "nonce": ns})
    msg, _ = await recv(ch, max_json=MAX_HANDSHAKE_JSON, kind=ACCEPT)
    if msg.get("op") != "auth":
        raise AuthError("peer did not authenticate")
    nc, their = _nonce(msg), msg.get("mac")
    if not (isinstance(their, str) and hmac.compare_digest(their, mac(secret, _CLIENT, ns, nc))):
        await send(ch, {"op": "refused", "reason": "authentication failed"})
        raise AuthError("peer failed authentication (wrong shared secret)")
    await send(ch, {"op": "welcome", "mac": mac(secret, _SERVER, nc, ns)})
    node = msg.get("node")
    return node[:200] if isinstance(node, str) else "?"


async def client_handshake(ch: Channel, secret: bytes, node: str) -> None:
    """Answer the server's challenge and check its proof; AuthError if it fails either way
    (StalledError when the server goes silent)."""
    msg, _ = await recv(ch, max_json=MAX_HANDSHAKE_JSON)
    if msg.get("op") != "challenge":
        raise AuthError("peer sent no challenge")
    ns, nc = _nonce(msg), secrets.token_hex(32)
    await send(ch, {"op": "auth", "nonce": nc, "node": node, "mac": mac(secret, _CLIENT, ns, nc)})
    msg, _ = await recv(ch, max_json=MAX_HANDSHAKE_JSON)
    if msg.get("op") == "refused":
        raise AuthError("the peer refused our authentication (wrong shared secret?)")
    theirs = msg.get("mac")
    if msg.get("op") != "welcome" or not (isinstance(theirs, str)
                                          and hmac.compare_digest(theirs, mac(secret, _SERVER, nc, ns))):
        raise AuthError("the peer failed to prove the shared secret")
