"""Peer copies: this daemon's listener for other daemons, and its side of fetching from them.

A peer is another node's ckptd daemon, from the configured ``peers`` list. Every connection
starts with the mutual HMAC handshake (``ckptd.core.peer_protocol``); a peer that fails it is
refused and logged (never the secret). A received replica is reserved against this daemon's
memory budget before a byte of it is read, and is kept only if every chunk's checksum matches.
Every connect, read and write, both sides, is bounded by ``peers.io_timeout`` (``timeout``
here): a stopped or wedged peer fails that one exchange (``StalledError``) and is let go.
Connections are ``ckptd.core.peer_channel`` channels: payloads move on threads, straight from and
into the held memfds; the event loop accepts, waits for requests and keeps the books.
With ``peers.tls_*`` set every connection is mutual TLS (``tls.py``) underneath the same frames.
Replication (sending our shards out, in the background) is ``replicate.py``.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Any, Protocol

from ckptd.core import peer_protocol as pp
from ckptd.core.errors import ChecksumError, FormatError, ProtocolError
from ckptd.core.held import MAX_HELD_BYTES, HeldMeta
from ckptd.core.peer_channel import Channel
from ckptd.daemon import shm
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.service.logs import Throttled
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


class NotAllocated(Exception):
    """This daemon could not allocate a held shard's memory (its ``memory.shm_dir`` full, the node out
    of memory): the reason. Its payload was read and dropped: the connection goes on."""


async def receive_held(store: MemoryStore, ch: Channel, msg: dict[str, Any], plen: int, origin: str) -> Held | None:
    """A held shard's payload, after its ``msg``: reserved, read into a memfd, checksummed.
    None (payload skipped) when it does not fit the budget; NotAllocated (payload skipped) when its
    memory cannot be allocated; ChecksumError/FormatError when bad."""
    meta = HeldMeta.from_wire(msg)
    if meta.nbytes != plen:
        raise FormatError(f"{meta.what}: payload of {plen} bytes for a shard of {meta.nbytes}")
    held = store.reserve(meta.job, meta.step, meta.rank, meta.nbytes, origin)
    if held is None:
        await pp.skip(ch, plen)
        return None
    loop = asyncio.get_running_loop()
    try:
        try:
            held.fd, mm = await loop.run_in_executor(
                None, new_memfd, f"ckptd-mem-{meta.job}-{meta.step}-r{meta.rank}", meta.nbytes)
        except OSError as e:      # (not a broken connection: said, and the connection kept in step)
            where = shm.place().dir
            in_ = f"memory.shm_dir {where}" if where else "memfds"
            reason = f"{meta.what}: its {meta.nbytes} bytes could not be allocated in this daemon's shared memory " \
                f"({in_}): {describe_error(e)}{shm.shortage(e)}"
            await pp.skip(ch, plen)
            raise NotAllocated(reason) from e
        held.mm = mm
        view = memoryview(mm)

        try:
            await pp.recv_payload(ch, view[:plen])
            await loop.run_in_executor(None, meta.verify, view)
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

    async def handle(self, ch: Channel, msg: dict[str, Any], plen: int, node: str) -> None: ...


class PeerServer:
    """Serves other daemons: ``put`` (keep a replica of their shard), ``get`` (send one we hold) and
    ``has`` (say whether we hold it); in parity mode also the piece ops
    (``layout.PIECE_OPS``). A connection idle or stalled for ``timeout`` s is closed."""

    def __init__(self, store: MemoryStore, secret: bytes, trim: Callable[[str], None],
                 refused: Callable[[], None], timeout: float, pieces: PieceOps | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.store, self.secret, self.trim, self.refused = store, secret, trim, refused
        self.timeout, self.pieces, self.tls = timeout, pieces, tls
        self.listeners: list[socket.socket] = []
        self.accepting: list[asyncio.Task[None]] = []
        self.conns: dict[asyncio.Task[None], Channel] = {}
        self.address: tuple[str, int] | None = None
        self.refusals = Throttled(log, "peer refused")      # one line per remote host a minute (logs.py)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on every address ``host`` resolves to (as ``asyncio.start_server`` would: IPv6
        sockets v6-only, addresses reusable at once after a restart); the first one's (host, port)."""
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            for family, _, _, _, addr in dict.fromkeys(infos):      # (each address once, in order)
                lsock = socket.create_server(addr, family=family, backlog=128)
                self.listeners.append(lsock)
                lsock.setblocking(False)
        except BaseException:
            for lsock in self.listeners:
                lsock.close()
            self.listeners.clear()
            raise
        self.address = self.listeners[0].getsockname()[:2]
        self.accepting = [asyncio.ensure_future(self._accept(lsock)) for lsock in self.listeners]
        return self.address

    async def stop(self) -> None:
        for task in self.accepting:
            task.cancel()
        await asyncio.gather(*self.accepting, return_exceptions=True)
        for lsock in self.listeners:
            lsock.close()
        for task, ch in list(self.conns.items()):
            ch.close()
            task.cancel()
        await asyncio.gather(*self.conns, return_exceptions=True)

    async def _accept(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, remote = await loop.sock_accept(lsock)
            except OSError as e:            # EMFILE and the like: this connection is lost, not the listener
                log.warning("peer accept failed", extra={"ctx": {"reason": describe_error(e)}})
                await asyncio.sleep(0.1)
                continue
            where = f"{remote[0]}:{remote[1]}" if isinstance(remote, tuple) else str(remote)
            ch = Channel(conn, self.timeout)
            task = asyncio.ensure_future(self._serve(ch, where))
            self.conns[task] = ch
            task.add_done_callback(self.conns.pop)

    async def _handshake(self, ch: Channel) -> str:
        if self.tls is not None:
            await ch.start_tls(self.tls)
        return await pp.server_handshake(ch, self.secret)

    async def _serve(self, ch: Channel, where: str) -> None:
        try:
            # One bound on the whole handshake, not only on each wait: a connection that sends a byte
            # now and then would otherwise hold its thread for as long as it likes, and a few dozen
            # would keep every peer with the secret out (cancelled, its blocked read ends at once).
            node = await asyncio.wait_for(self._handshake(ch), self.timeout)
        except (ProtocolError, OSError, asyncio.TimeoutError) as e:      # (3.10: not the builtin TimeoutError)
            self.refused()
            late = isinstance(e, (asyncio.TimeoutError, TimeoutError))
            reason = f"no handshake within {self.timeout:g} s (peers.io_timeout)" if late else \
                tls_error(e) or describe_error(e)
            self.refusals.warning(where.rpartition(":")[0] or where, {"remote": where, "reason": reason})
            ch.close()
            return
        try:
            while True:
                msg, plen = await pp.recv(ch, MAX_HELD_BYTES)
                if msg["op"] == "put":
                    await self._put(ch, msg, plen, node)
                elif msg["op"] == "get" and plen == 0:
                    await self._get(ch, msg)
                elif msg["op"] in PIECE_OPS and self.pieces is not None:
                    await self.pieces.handle(ch, msg, plen, node)
                elif msg["op"] == "has" and plen == 0:
                    await pp.send(ch, {"op": "yes" if self._lookup(msg) is not None else "missing"})
                else:
                    raise ProtocolError(f"unknown peer request {str(msg['op'])[:40]!r}")
        except ProtocolError as e:
            if str(e) != "peer closed the connection":
                log.warning("peer connection dropped", extra={"ctx": {"remote": where, "node": node,
                                                                      "reason": describe_error(e)}})
        except OSError:
            pass
        finally:
            ch.close()

    async def _put(self, ch: Channel, msg: dict[str, Any], plen: int, node: str) -> None:
        try:
            held = await receive_held(self.store, ch, msg, plen, REPLICA)
        except NotAllocated as e:
            log.warning("replica refused", extra={"ctx": {"node": node, "reason": str(e)}})
            await pp.send(ch, {"op": "error", "reason": str(e)[:500]})
            return
        except (ChecksumError, FormatError) as e:
            log.warning("replica refused", extra={"ctx": {"node": node, "reason": describe_error(e)}})
            await pp.send(ch, {"op": "error", "reason": str(e)[:500]})
            if isinstance(e, FormatError):
                raise ProtocolError(str(e)) from None
            return
        if held is None:
            await pp.send(ch, {"op": "error", "reason": "over this peer's memory budget"})
            return
        assert held.meta is not None
        log.info("replica held", extra={"ctx": {"job": held.job, "step": held.step, "rank": held.rank,
                                                "bytes": held.meta.nbytes, "from": node}})
        self.trim(held.job)
        await pp.send(ch, {"op": "ok"})

    def _lookup(self, msg: dict[str, Any]) -> Held | None:
        """The held shard a ``get``/``has`` names (job, step, rank and manifest digest), if any."""
        job, step, rank, digest = msg.get("job"), msg.get("step"), msg.get("rank"), msg.get("digest")
        held = self.store.get(job, step, rank) if isinstance(job, str) and type(step) is int \
            and type(rank) is int else None
        if held is None or held.meta is None or held.mm is None or held.meta.digest != digest:
            return None
        return held

    async def _get(self, ch: Channel, msg: dict[str, Any]) -> None:
        held = self._lookup(msg)
        if held is None or held.meta is None or held.mm is None:
            await pp.send(ch, {"op": "missing"})
            return
        self.store.pin(held)
        try:
            await pp.send(ch, {"op": "held", **held.meta.to_wire()}, memoryview(held.mm)[:held.meta.nbytes])
        finally:
            self.store.unpin(held)


class PeerLink:
    """One authenticated connection to a peer (client side), over TLS when ``tls`` is given; every wait
    bounded by ``timeout`` s."""

    def __init__(self, address: str, secret: bytes, node: str, timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.address, self.secret, self.node, self.timeout, self.tls = address, secret, node, timeout, tls
        self.ch: Channel | None = None

    async def open(self) -> PeerLink:
        host, port = split_address(self.address)
        try:
            self.ch = await Channel.connect(host, port, self.timeout, self.tls)
        except ssl.SSLError as e:
            raise ProtocolError(f"peer {self.address}: {tls_error(e)}") from None
        try:
            await pp.client_handshake(self.ch, self.secret, self.node)
        except ssl.SSLError as e:         # TLS 1.3: the listener refuses our certificate after the handshake
            self.close()
            raise ProtocolError(f"peer {self.address}: {tls_error(e)}") from None
        except BaseException:
            self.close()
            raise
        return self

    @property
    def channel(self) -> Channel:
        """The open connection (after ``open``)."""
        if self.ch is None:
            raise ProtocolError(f"peer {self.address}: link not open")
        return self.ch

    def close(self) -> None:
        if self.ch is not None:
            self.ch.close()
            self.ch = None

    async def put(self, held: Held, pace: Callable[[int], None] | None) -> None:
        """Send a held shard; ProtocolError with the peer's reason if it does not keep it."""
        assert held.meta is not None and held.mm is not None
        view = memoryview(held.mm)[:held.meta.nbytes]
        try:
            await pp.send(self.channel, {"op": "put", **held.meta.to_wire()}, view, pace)
        finally:
            view.release()
        reply, _ = await pp.recv(self.channel)
        if reply.get("op") != "ok":
            raise ProtocolError(f"peer {self.address} did not keep the replica: {reply.get('reason', reply['op'])}")

    async def get(self, store: MemoryStore, job: str, step: int, rank: int, digest: str) -> Held | None:
        """The peer's copy, checked (ChecksumError if corrupt), held in ``store``; None if it has none."""
        await pp.send(self.channel, {"op": "get", "job": job, "step": step, "rank": rank, "digest": digest})
        msg, plen = await pp.recv(self.channel, MAX_HELD_BYTES)
        if msg.get("op") != "held":
            return None
        if (msg.get("job"), msg.get("step"), msg.get("rank"), msg.get("digest")) != (job, step, rank, digest):
            raise ProtocolError(f"peer {self.address} answered with another shard")
        return await receive_held(store, self.channel, msg, plen, "peer")

    async def has(self, job: str, step: int, rank: int, digest: str) -> bool:
        """Whether the peer holds that shard (a probe: no payload moves)."""
        await pp.send(self.channel, {"op": "has", "job": job, "step": step, "rank": rank, "digest": digest})
        msg, plen = await pp.recv(self.channel)
        if plen or msg.get("op") not in ("yes", "missing"):
            raise ProtocolError(f"peer {self.address} answered a probe with {str(msg.get('op'))[:40]!r}")
        return msg["op"] == "yes"
