"""Parity redundancy, this node's side: its held shards' pieces sent to their parity holders
(``[peers] redundancy = "parity"``; layout.py says how ranks map onto members and lanes, parity_hold.py
is the holders' side, rebuild.py decodes a lost shard from its group's survivors).

Sending: when a shard of this node becomes held (``offer``, the memory tier's on_held hook, where
copies are queued in ``copies`` mode) it gets the next lane of its step, is cut into its g − P data
pieces, and each non-empty piece goes to its stripe's P parity holders in the background, paced by
one token bucket (``peers.bandwidth``) and bounded by ``peers.io_timeout``. A step is *protected* on
this node once every piece of every shard of it held here is acknowledged by every parity holder.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

from ckptd.core import peer_protocol as pp
from ckptd.core.codec import checksum
from ckptd.core.errors import ProtocolError
from ckptd.core.held import HeldMeta
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.tiers.memory.memory_level import NotHeld
from ckptd.daemon.tiers.memory.store import Held, MemoryStore
from ckptd.daemon.tiers.peers.layout import ParityLayout
from ckptd.daemon.tiers.peers.link import PeerLink
from ckptd.daemon.tiers.peers.replicate import QUEUE_MAX, PeerCounts, TokenBucket

log = logging.getLogger("ckptd")
LANES_KEPT = 256                 # (job, step)s whose lane numbering this node remembers


class ParityNode:
    def __init__(self, store: MemoryStore, layout: ParityLayout, secret: bytes, bandwidth: int, timeout: float,
                 trim: Callable[[str], None], tls: ssl.SSLContext | None = None) -> None:
        self.store, self.layout, self.secret, self.timeout, self.trim = store, layout, secret, timeout, trim
        self.tls = tls
        self.bucket = TokenBucket(bandwidth)
        self.queue: asyncio.Queue[tuple[Held, int]] = asyncio.Queue(QUEUE_MAX)
        self.lanes: dict[tuple[str, int], dict[int, int]] = {}       # (job, step) → rank → lane
        # shard → (its manifest digest, {(stripe, q)} acknowledged): by digest, as a step that failed may
        # be saved again with other bytes, and its first attempt's acknowledgements say nothing of these
        self.acked: dict[tuple[str, int, int], tuple[str, set[tuple[int, int]]]] = {}
        self.per_peer: dict[str, PeerCounts] = {}

    # ---- sending -------------------------------------------------------------------------

    def _lane(self, held: Held) -> int:
        lanes = self.lanes.setdefault((held.job, held.step), {})
        while len(self.lanes) > LANES_KEPT:
            self.lanes.pop(next(iter(self.lanes)))
        for key in [k for k in self.acked if k not in self.store.entries]:
            del self.acked[key]
        return lanes.setdefault(held.rank, len(lanes))

    def offer(self, held: Held) -> None:
        """(Event loop) A shard of this node became held: give it a lane and queue its pieces."""
        if held.origin != "local":
            return
        lane = self._lane(held)
        try:
            self.queue.put_nowait((held, lane))
        except asyncio.QueueFull:
            log.warning("parity queue full; shard not protected",
                        extra={"ctx": {"job": held.job, "step": held.step, "rank": held.rank}})

    async def run(self) -> None:
        while True:
            held, lane = await self.queue.get()
            if held.gone or held.meta is None:
                continue
            self.store.pin(held)
            try:
                await self._send_all(held, lane)
            finally:
                self.store.unpin(held)
                if not held.gone:
                    self.trim(held.job)

    async def protect_now(self, held: Held) -> int:
        """A memory-level step's shard: its pieces sent to their parity holders now (its rank is durable
        only once they all fold them); 1 when every piece is acknowledged (the memory tier's
        ``replicate`` with k = 1), else NotHeld saying so, after the holders that folded some of its
        pieces were told to drop them (``drop_piece``): the step fails, and a later save of its number
        must find no buffer of this one."""
        meta = held.meta
        assert meta is not None
        self.store.pin(held)
        try:
            await self._send_all(held, self._lane(held))
        finally:
            self.store.unpin(held)
        if self.protected(held.job, held.step, held.rank, meta.nbytes, meta.digest):
            return 1
        got = self.acked.pop(held.key, None)
        done = len(got[1]) if got is not None and got[0] == meta.digest else 0
        await self._withdraw(meta)
        raise NotHeld(f"memory-level step {meta.step}: rank {meta.rank}'s shard is not protected by parity: "
                      f"{done} of its {len(self._needed(meta.nbytes))} pieces reached their parity holders "
                      "(see the daemon log for each holder's error)")

    async def _withdraw(self, meta: HeldMeta) -> None:
        """Every parity holder of the shard's pieces told that this save of it failed (best effort: a
        holder that does not answer keeps the buffers, which a later save of the step replaces)."""
        holders = {addr for piece in self.layout.cut(meta.nbytes).pieces if piece.length
                   for _, addr in self.layout.holders(piece.stripe)}

        async def tell(addr: str) -> None:
            link = PeerLink(addr, self.secret, self.layout.me, self.timeout, self.tls)
            try:
                await link.open()
                await pp.send(link.channel, {"op": "drop_piece", "job": meta.job, "step": meta.step,
                                             "member": self.layout.member, "rank": meta.rank, "digest": meta.digest})
                await pp.recv(link.channel)
            except (OSError, ProtocolError) as e:
                log.info("parity holder not told of a failed save", extra={"ctx": {
                    "job": meta.job, "step": meta.step, "rank": meta.rank, "peer": addr, "error": describe_error(e)}})
            finally:
                link.close()
        await asyncio.gather(*(tell(a) for a in sorted(holders)))

    def _needed(self, nbytes: int) -> set[tuple[int, int]]:
        return {(piece.stripe, q) for piece in self.layout.cut(nbytes).pieces if piece.length
                for q in range(self.layout.p)}

    async def _send_all(self, held: Held, lane: int) -> None:
        assert held.meta is not None
        sends = [self._send(held, lane, piece.stripe, piece.offset, piece.length, q, addr)
                 for piece in self.layout.cut(held.meta.nbytes).pieces if piece.length
                 for q, addr in self.layout.holders(piece.stripe)]
        await asyncio.gather(*sends)

    async def _send(self, held: Held, lane: int, s: int, offset: int, length: int, q: int, addr: str) -> None:
        assert held.meta is not None and held.mm is not None
        meta = held.meta
        ctx = {"job": held.job, "step": held.step, "rank": held.rank, "stripe": s, "peer": addr}
        counts = self.per_peer.setdefault(addr, PeerCounts())
        link = PeerLink(addr, self.secret, self.layout.me, self.timeout, self.tls)
        view = memoryview(held.mm)[offset:offset + length]
        try:
            await link.open()
            await pp.send(link.channel, {"op": "put_piece", "job": meta.job, "step": meta.step, "rank": meta.rank,
                                         "digest": meta.digest, "stripe": s, "lane": lane,
                                         "member": self.layout.member, "checksum": checksum(view),
                                         "meta": meta.to_wire()}, view, self.bucket.take)
            reply, _ = await pp.recv(link.channel)
            if reply.get("op") != "ok":
                raise ProtocolError(f"parity holder did not fold the piece: {str(reply.get('reason', reply['op']))}")
        except (OSError, ProtocolError) as e:
            counts.failures += 1
            log.warning("parity piece not sent", extra={"ctx": {**ctx, "error": describe_error(e)}})
            return
        finally:
            view.release()
            link.close()
        counts.sent_bytes += length
        got = self.acked.get(held.key)
        if got is None or got[0] != meta.digest:
            got = self.acked[held.key] = (meta.digest, set())
        got[1].add((s, q))

    def protected(self, job: str, step: int, rank: int, nbytes: int, digest: str) -> bool:
        """Every piece of this node's shard (job, step, rank) with manifest ``digest`` is in its parity
        holders' parity."""
        got = self.acked.get((job, step, rank))
        return got is not None and got[0] == digest and self._needed(nbytes) <= got[1]

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self.per_peer.values())

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.per_peer.values())
