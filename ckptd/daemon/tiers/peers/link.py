"""Peer copies: this daemon's listener for other daemons, and its side of fetching from them.

A peer is another node's ckptd daemon, from the configured ``peers`` list. Every connection
starts with the mutual HMAC handshake (``ckptd.core.peer_protocol``); a peer that fails it is
refused and logged (never the secret). A received replica is reserved against this daemon's
memory budget before a byte of it is read, and is kept only if every chunk's checksum matches.
Every connect, read and write, both sides, is bounded by ``peers.io_timeout`` (``timeout``
here): a stopped or wedged peer fails that one exchange (``StalledError``) and is let go.
With ``peers.tls_*`` set every connection is mutual TLS (``tls.py``) underneath the same frames.
Replication (sending our shards out, in the background) is ``replicate.py``.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any, Protocol

from ckptd.core import peer_protocol as pp
from ckptd.core.errors import ChecksumError, FormatError, ProtocolError
from ckptd.core.held import MAX_HELD_BYTES, HeldMeta, verify
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.tiers.memory.store import REPLICA, Held, MemoryStore, new_memfd
from ckptd.daemon.tiers.peers.layout import PIECE_OPS
from ckptd.daemon.tiers.peers.tls import check_file

log = logging.getLogger("ckptd")
MIN_SECRET_BYTES = 16


def load_secret(path: str) -> bytes:
    """The shared secret: a file only its owner (root or this daemon's user) may read. RuntimeError
    (the daemon does not start) if not."""
    check_file("peer secret file", path, True)
    with open(path, "rb") as f:
        secret = f.read(4096).strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise RuntimeError(f"peer secret file {path}: the secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


def tls_error(e: BaseException) -> str | None:
    """An ``ssl`` failure as one line (its errno means nothing); None for any other error."""
    if isinstance(e, ssl.SSLError):
        return f"TLS handshake failed: {e.reason or e}"
    if isinstance(e, ConnectionAbortedError) and "SSL" in str(e):
        return f"TLS handshake failed: {e}"
    return None


def split_address(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


async def receive_held(store: MemoryStore, reader: asyncio.StreamReader, msg: dict[str, Any], plen: int,
                       origin: str, timeout: float) -> Held | None:
    """A held shard's payload, after its ``msg``: reserved, read into a memfd, checksummed.
    None (payload skipped) when it does not fit the budget; ChecksumError/FormatError when bad."""
    meta = HeldMeta.from_wire(msg)
    if meta.nbytes != plen:
        raise FormatError(f"{meta.what}: payload of {plen} bytes for a shard of {meta.nbytes}")
    held = store.reserve(meta.job, meta.step, meta.rank, meta.nbytes, origin)
    if held is None:
        await pp.skip(reader, plen, timeout=timeout)
        return None
    try:
        held.fd, mm = await asyncio.get_running_loop().run_in_executor(
            None, new_memfd, f"ckptd-mem-{meta.job}-{meta.step}-r{meta.rank}", meta.nbytes)
        held.mm = mm
        view = memoryview(mm)
        try:
            await pp.recv_payload(reader, view[:plen], timeout=timeout)
            for t, sums in zip(meta.layout, meta.checksums, strict=True):
                verify(view[t.offset:t.offset + t.nbytes], sums, meta.chunk_bytes, f"{meta.what} tensor {t.name!r}")
        finally:
            view.release()
    except ChecksumError:
        store.totals.corrupt += 1
        store.cancel(held)
        raise
    except BaseException:
        store.cancel(held)
        raise
    store.filled(held, meta)
    return held


class PieceOps(Protocol):
    """The parity holder's side of the piece ops (parity_hold.py), when ``redundancy = "parity"``."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: dict[str, Any],
                     plen: int, node: str) -> None: ...


class PeerServer:
    """Serves other daemons: ``put`` (keep a replica of their shard), ``get`` (send one we hold) and
    ``has`` (say whether we hold it); in parity mode also the piece ops
    (``layout.PIECE_OPS``). A connection idle or stalled for ``timeout`` s is closed."""

    def __init__(self, store: MemoryStore, secret: bytes, trim: Callable[[str], None],
                 refused: Callable[[], None], timeout: float, pieces: PieceOps | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.store, self.secret, self.trim, self.refused = store, secret, trim, refused
        self.timeout, self.pieces, self.tls = timeout, pieces, tls
        self.server: asyncio.base_events.Server | None = None
        self.address: tuple[str, int] | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        # TLS by the server itself: a connection whose certificate is refused never reaches _serve (the
        # linking side logs the failure). Not start_tls in _serve: a ClientHello that arrives first is lost.
        self.server = await asyncio.start_server(self._serve, host, port, limit=pp.PIECE * 2, ssl=self.tls,
                                                 ssl_handshake_timeout=self.timeout if self.tls else None)
        self.address = self.server.sockets[0].getsockname()[:2]
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = writer.get_extra_info("peername")
        where = f"{remote[0]}:{remote[1]}" if isinstance(remote, tuple) else str(remote)
        try:
            node = await pp.server_handshake(reader, writer, self.secret, timeout=self.timeout)
        except (ProtocolError, OSError) as e:
            self.refused()
            log.warning("peer refused", extra={"ctx": {"remote": where, "reason": tls_error(e) or describe_error(e)}})
            writer.close()
            return
        try:
            while True:
                msg, plen = await pp.recv(reader, MAX_HELD_BYTES, timeout=self.timeout)
                if msg["op"] == "put":
                    await self._put(reader, writer, msg, plen, node)
                elif msg["op"] == "get" and plen == 0:
                    await self._get(writer, msg)
                elif msg["op"] in PIECE_OPS and self.pieces is not None:
                    await self.pieces.handle(reader, writer, msg, plen, node)
                elif msg["op"] == "has" and plen == 0:
                    await pp.send(writer, {"op": "yes" if self._lookup(msg) is not None else "missing"},
                                  timeout=self.timeout)
                else:
                    raise ProtocolError(f"unknown peer request {str(msg['op'])[:40]!r}")
        except ProtocolError as e:
            if "closed the connection" not in str(e):
                log.warning("peer connection dropped", extra={"ctx": {"remote": where, "node": node,
                                                                      "reason": describe_error(e)}})
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _put(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: dict[str, Any],
                   plen: int, node: str) -> None:
        try:
            held = await receive_held(self.store, reader, msg, plen, REPLICA, self.timeout)
        except (ChecksumError, FormatError) as e:
            log.warning("replica refused", extra={"ctx": {"node": node, "reason": describe_error(e)}})
            await pp.send(writer, {"op": "error", "reason": str(e)[:500]}, timeout=self.timeout)
            if isinstance(e, FormatError):
                raise ProtocolError(str(e)) from None
            return
        if held is None:
            await pp.send(writer, {"op": "error", "reason": "over this peer's memory budget"}, timeout=self.timeout)
            return
        assert held.meta is not None
        log.info("replica held", extra={"ctx": {"job": held.job, "step": held.step, "rank": held.rank,
                                                "bytes": held.meta.nbytes, "from": node}})
        self.trim(held.job)
        await pp.send(writer, {"op": "ok"}, timeout=self.timeout)

    def _lookup(self, msg: dict[str, Any]) -> Held | None:
        """The held shard a ``get``/``has`` names (job, step, rank and manifest digest), if any."""
        job, step, rank, digest = msg.get("job"), msg.get("step"), msg.get("rank"), msg.get("digest")
        held = self.store.get(job, step, rank) if isinstance(job, str) and type(step) is int \
            and type(rank) is int else None
        if held is None or held.meta is None or held.mm is None or held.meta.digest != digest:
            return None
        return held

    async def _get(self, writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
        held = self._lookup(msg)
        if held is None or held.meta is None or held.mm is None:
            await pp.send(writer, {"op": "missing"}, timeout=self.timeout)
            return
        self.store.pin(held)
        try:
            await pp.send(writer, {"op": "held", **held.meta.to_wire()}, memoryview(held.mm)[:held.meta.nbytes],
                          timeout=self.timeout)
        finally:
            self.store.unpin(held)


class PeerLink:
    """One authenticated connection to a peer (client side), over TLS when ``tls`` is given; every wait
    bounded by ``timeout`` s."""

    def __init__(self, address: str, secret: bytes, node: str, timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.address, self.secret, self.node, self.timeout, self.tls = address, secret, node, timeout, tls
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> PeerLink:
        host, port = split_address(self.address)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=pp.PIECE * 2, ssl=self.tls,
                                        server_hostname="" if self.tls else None), self.timeout)
        except asyncio.TimeoutError:
            raise pp.StalledError(f"peer stalled: no connection within {self.timeout:g} s") from None
        except ssl.SSLError as e:
            raise ProtocolError(f"peer {self.address}: {tls_error(e)}") from None
        self.reader, self.writer = reader, writer
        try:
            await pp.client_handshake(reader, writer, self.secret, self.node, timeout=self.timeout)
        except ssl.SSLError as e:         # TLS 1.3: the listener refuses our certificate after the handshake
            self.close()
            raise ProtocolError(f"peer {self.address}: {tls_error(e)}") from None
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def put(self, held: Held, throttle: Callable[[int], Any] | None) -> None:
        """Send a held shard; ProtocolError with the peer's reason if it does not keep it."""
        assert self.reader is not None and self.writer is not None and held.meta is not None and held.mm is not None
        view = memoryview(held.mm)[:held.meta.nbytes]
        try:
            await pp.send(self.writer, {"op": "put", **held.meta.to_wire()}, view, throttle, timeout=self.timeout)
        finally:
            view.release()
        reply, _ = await pp.recv(self.reader, timeout=self.timeout)
        if reply.get("op") != "ok":
            raise ProtocolError(f"peer {self.address} did not keep the replica: {reply.get('reason', reply['op'])}")

    async def get(self, store: MemoryStore, job: str, step: int, rank: int, digest: str) -> Held | None:
        """The peer's copy, checked (ChecksumError if corrupt), held in ``store``; None if it has none."""
        assert self.reader is not None and self.writer is not None
        await pp.send(self.writer, {"op": "get", "job": job, "step": step, "rank": rank, "digest": digest},
                      timeout=self.timeout)
        msg, plen = await pp.recv(self.reader, MAX_HELD_BYTES, timeout=self.timeout)
        if msg.get("op") != "held":
            return None
        if (msg.get("job"), msg.get("step"), msg.get("rank"), msg.get("digest")) != (job, step, rank, digest):
            raise ProtocolError(f"peer {self.address} answered with another shard")
        return await receive_held(store, self.reader, msg, plen, "peer", self.timeout)

    async def has(self, job: str, step: int, rank: int, digest: str) -> bool:
        """Whether the peer holds that shard (a probe: no payload moves)."""
        assert self.reader is not None and self.writer is not None
        await pp.send(self.writer, {"op": "has", "job": job, "step": step, "rank": rank, "digest": digest},
                      timeout=self.timeout)
        msg, plen = await pp.recv(self.reader, timeout=self.timeout)
        if plen or msg.get("op") not in ("yes", "missing"):
            raise ProtocolError(f"peer {self.address} answered a probe with {str(msg.get('op'))[:40]!r}")
        return msg["op"] == "yes"
