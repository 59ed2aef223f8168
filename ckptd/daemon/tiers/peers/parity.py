"""Parity redundancy, this node's side: its held shards' pieces sent to their parity holders
(``[peers] redundancy = "parity"``; layout.py says how ranks map onto members and lanes, parity_hold.py
is the holders' side, rebuild.py decodes a lost shard from its group's survivors).

Sending: when a shard of this node becomes held (``offer``, the memory tier's on_held hook, where
copies are queued in ``copies`` mode) it gets the next lane of its step, is cut into its g − P data
pieces, and each non-empty piece goes to its stripe's P parity holders in the background, paced by
one token bucket (``peers.bandwidth``) and bounded by ``peers.io_timeout``. A step is *protected* on
this node once every piece of every shard of it held here is acknowledged by every parity holder.

A save of this node's shard that fails after (some of) its pieces were sent — protect_now itself, or the
step failing later (an abort, a timeout, a failed commit: the memory tier's abort, ``withdraw``) —, or
that a new save of the shard with another digest replaces, makes this node tell the holders to drop
its pieces (``drop_piece``, bounded by ``peers.io_timeout``; the step's later sends wait for it). A
holder of a build older than drop_piece closes the connection on it and keeps the failed save's
buffers: it is warned of once per holder (upgrade a parity group as a whole), and until it answers a
piece with ``drops`` a memory-level save of that step number is not protected by it (the save fails).

Probing (``peers.probe_interval`` > 0): a holder restarted or replaced empty has lost the parity its
members' acknowledgements still count. Every interval the acknowledged pieces of the newest step held
here of each job are looked for in their holders' records (``group_report``, one question per holder,
bounded by ``peers.io_timeout``): a piece a holder no longer folds stops counting and is sent to it
again (up to ``RESENDS`` times per piece), so the replacement's parity is whole again once every member
of the group has sent its pieces; a holder that cannot be reached has its pieces stop counting, and
they count again when it answers folding them. Older steps are not probed (nor sent again).
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterable

from ckptd.core import peer_protocol as pp
from ckptd.core.codec import checksum
from ckptd.core.errors import ProtocolError
from ckptd.core.held import HeldMeta
from ckptd.core.peer_channel import StalledError
from ckptd.daemon.runtime import TaskSet, describe_error
from ckptd.daemon.tiers.memory.memory_level import NotHeld
from ckptd.daemon.tiers.memory.store import Held, MemoryStore
from ckptd.daemon.tiers.peers import group_state
from ckptd.daemon.tiers.peers.layout import ParityLayout
from ckptd.daemon.tiers.peers.link import PeerLink
from ckptd.daemon.tiers.peers.replicate import QUEUE_MAX, RESENDS, PeerCounts, TokenBucket

log = logging.getLogger("ckptd")
Piece = tuple[tuple[str, int, int], int, int]       # a shard's piece at one holder: (shard key, stripe, q)
LANES_KEPT = 256                 # (job, step)s whose lane numbering this node remembers


class ParityNode:
    def __init__(self, store: MemoryStore, layout: ParityLayout, secret: bytes, bandwidth: int, timeout: float,
                 trim: Callable[[str], None], tls: ssl.SSLContext | None = None,
                 probe_interval: float = 0.0) -> None:
        self.store, self.layout, self.secret, self.timeout, self.trim = store, layout, secret, timeout, trim
        self.tls, self.probe_interval = tls, probe_interval
        self.bucket = TokenBucket(bandwidth)
        self.queue: asyncio.Queue[tuple[Held, int]] = asyncio.Queue(QUEUE_MAX)
        self.lanes: dict[tuple[str, int], dict[int, int]] = {}       # (job, step) → rank → lane
        # shard → (its manifest digest, {(stripe, q)} acknowledged): by digest, as a step that failed may
        # be saved again with other bytes, and its first attempt's acknowledgements say nothing of these
        self.acked: dict[tuple[str, int, int], tuple[str, set[tuple[int, int]]]] = {}
        self.per_peer: dict[str, PeerCounts] = {}
        self.sent: dict[tuple[str, int], dict[int, HeldMeta]] = {}   # (job, step) → rank → the save whose pieces went
        self.dropping: dict[tuple[str, int], set[asyncio.Task[None]]] = {}    # drop_piece in flight, by step
        self.drops = TaskSet()
        # holder → the (job, step)s whose failed save's pieces it kept (an older build: no drop_piece)
        self.kept_by_old: dict[str, set[tuple[str, int]]] = {}
        self.errors: dict[tuple[str, int, int], str] = {}     # a shard's last piece error (protect_now says it)
        self.unsure: set[Piece] = set()       # acknowledged pieces whose holder could not be reached
        self.resent: dict[Piece, int] = {}    # pieces sent again after their holder lost them: how often
        self.down: set[int] = set()           # holders (members) the last probe of them could not reach

    # ---- sending -------------------------------------------------------------------------

    def _lane(self, held: Held) -> int:
        lanes = self.lanes.setdefault((held.job, held.step), {})
        while len(self.lanes) > LANES_KEPT:
            self.lanes.pop(next(iter(self.lanes)))
        for key in [k for k in self.acked if k not in self.store.entries]:
            del self.acked[key]
        for key in [k for k in self.errors if k not in self.store.entries]:
            del self.errors[key]
        while len(self.sent) > LANES_KEPT:
            self.sent.pop(next(iter(self.sent)))
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
        """The sender, and the prober (``probe_interval`` > 0), for as long as the daemon runs."""
        await asyncio.gather(self._sender(), *([self._prober()] if self.probe_interval > 0 else []))

    async def _sender(self) -> None:
        while True:
            held, lane = await self.queue.get()
            if held.gone or held.meta is None:
                continue
            self.store.pin(held)
            try:
                await self._settle(held.meta)
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
            await self._settle(meta)
            self.errors.pop(held.key, None)
            await self._send_all(held, self._lane(held))
        except asyncio.CancelledError:
            self.withdraw([meta])
            raise
        finally:
            self.store.unpin(held)
        old = sorted(a for a in self._holders(meta) if (meta.job, meta.step) in self.kept_by_old.get(a, ()))
        if not old and self.protected(held.job, held.step, held.rank, meta.nbytes, meta.digest):
            return 1
        got = self.acked.pop(held.key, None)
        done = len(got[1]) if got is not None and got[0] == meta.digest else 0
        await self._withdraw(meta)
        why = f"the parity holder(s) {', '.join(old)} run an older build that keeps a failed save's pieces of this " \
            "step (upgrade every member of the parity group together)" if old else \
            self.errors.pop(held.key, "see the daemon log for each holder's error")
        raise NotHeld(f"memory-level step {meta.step}: rank {meta.rank}'s shard is not protected by parity: "
                      f"{done} of its {len(self._needed(meta.nbytes))} pieces reached their parity holders ({why})")

    def withdraw(self, metas: Iterable[HeldMeta]) -> None:
        """(Event loop) These shards' saves failed (their step did, after their pieces went): their
        holders are told to drop them, in the background; a later send of the step waits for it."""
        for meta in metas:
            key = (meta.job, meta.step)
            if (was := self.sent.get(key, {}).get(meta.rank)) is None or was.digest != meta.digest:
                continue        # nothing of it sent (or withdrawn already)
            task = self.drops.spawn(self._withdraw(meta), f"parity drop of {meta.job} step {meta.step} "
                                                         f"rank {meta.rank}")
            pending = self.dropping.setdefault(key, set())
            pending.add(task)

            def done(t: asyncio.Task[None], key: tuple[str, int] = key, pending: set[asyncio.Task[None]] = pending
                     ) -> None:
                pending.discard(t)
                if not pending and self.dropping.get(key) is pending:
                    del self.dropping[key]
            task.add_done_callback(done)

    async def _settle(self, meta: HeldMeta) -> None:
        """Before a shard's pieces go: the step's drops in flight are done, and an earlier save of the
        shard with another digest (a failed one nobody withdrew: a relayed step's other node) withdrawn."""
        if pending := self.dropping.get((meta.job, meta.step)):
            await asyncio.wait(set(pending))
        before = self.sent.get((meta.job, meta.step), {}).get(meta.rank)
        if before is not None and before.digest != meta.digest:
            await self._withdraw(before)
        self.sent.setdefault((meta.job, meta.step), {})[meta.rank] = meta

    def _holders(self, meta: HeldMeta) -> set[str]:
        return {addr for piece in self.layout.cut(meta.nbytes).pieces if piece.length
                for _, addr in self.layout.holders(piece.stripe)}

    async def _withdraw(self, meta: HeldMeta) -> None:
        """Every parity holder of the shard's pieces told that this save of it failed (best effort: a
        holder that does not answer keeps the buffers; a new holder refuses a later save's piece that
        meets them, an old one — it closes the connection on drop_piece — is remembered: ``kept_by_old``)."""
        sent = self.sent.get((meta.job, meta.step), {})
        if (was := sent.get(meta.rank)) is not None and was.digest == meta.digest:
            del sent[meta.rank]

        async def tell(addr: str) -> None:
            link, opened = PeerLink(addr, self.secret, self.layout.me, self.timeout, self.tls), False
            try:
                await link.open()
                opened = True
                await pp.send(link.channel, {"op": "drop_piece", "job": meta.job, "step": meta.step,
                                             "member": self.layout.member, "rank": meta.rank, "digest": meta.digest})
                await pp.recv(link.channel)
            except (OSError, ProtocolError) as e:
                if opened and not isinstance(e, (StalledError, TimeoutError)):
                    self._old_holder(addr, meta, e)
                log.info("parity holder not told of a failed save", extra={"ctx": {
                    "job": meta.job, "step": meta.step, "rank": meta.rank, "peer": addr, "error": describe_error(e)}})
            finally:
                link.close()
        await asyncio.gather(*(tell(a) for a in sorted(self._holders(meta))))

    def _old_holder(self, addr: str, meta: HeldMeta, e: BaseException) -> None:
        """``addr`` closed the connection on drop_piece: an older build, which keeps the failed save's
        pieces and would mix them with a later save of the step. Warned of once per holder."""
        if addr not in self.kept_by_old:
            log.warning("parity holder does not know drop_piece (an older ckptd?): it keeps a failed save's pieces, "
                        "and a memory-level save of that step number is not protected by it until it is upgraded; "
                        "upgrade every member of a parity group together", extra={"ctx": {
                            "peer": addr, "job": meta.job, "step": meta.step, "error": describe_error(e)}})
        self.kept_by_old.setdefault(addr, set()).add((meta.job, meta.step))

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
            if reply.get("drops") is True:           # (a holder upgraded: what an old build kept is gone)
                self.kept_by_old.pop(addr, None)
        except (OSError, ProtocolError) as e:
            counts.failures += 1
            self.errors[held.key] = f"{addr}: {describe_error(e)}"
            log.warning("parity piece not sent", extra={"ctx": {**ctx, "error": describe_error(e)}})
            return
        finally:
            view.release()
            link.close()
        counts.sent_bytes += length
        self._ack(held, s, q)

    # ---- probing (module docstring) ------------------------------------------------------------

    async def _prober(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                await self.check()
            except Exception as e:        # (a bug here must not end the probes, nor the sender)
                log.error("parity probe failed", extra={"ctx": {"error": describe_error(e)}})

    async def check(self) -> None:
        """One probe round: the newest step's acknowledged (and unsure) pieces looked for at their holders."""
        newest = self.store.newest_own()
        for key in [k for k in self.resent if k[0] not in self.store.entries]:
            del self.resent[key]
        self.unsure = {k for k in self.unsure if k[0] in self.store.entries}
        asked: dict[int, list[tuple[Held, int, int, int, int, int]]] = {}     # holder → (held, lane, s, q, at, n)
        for h in self.store.entries.values():      # (no await in this loop)
            meta, got = h.meta, self.acked.get(h.key)
            lane = self.lanes.get((h.job, h.step), {}).get(h.rank)
            if h.origin != "local" or meta is None or h.gone or h.step != newest.get(h.job) or lane is None \
                    or (h.job, h.step) in self.dropping:
                continue
            acks = got[1] if got is not None and got[0] == meta.digest else set()
            for piece in self.layout.cut(meta.nbytes).pieces:
                for q, m in enumerate(self.layout.stripe(piece.stripe).parity) if piece.length else ():
                    if (piece.stripe, q) in acks or (h.key, piece.stripe, q) in self.unsure:
                        asked.setdefault(m, []).append((h, lane, piece.stripe, q, piece.offset, piece.length))
        await asyncio.gather(*(self._check_holder(m, items) for m, items in asked.items()))

    async def _check_holder(self, member: int, items: list[tuple[Held, int, int, int, int, int]]) -> None:
        addr = self.layout.address(member)
        rep = await group_state.bounded_ask(self.layout, member, self.secret, self.timeout, self.tls)
        try:
            folded = set() if isinstance(rep, str) else set(group_state.entries(rep, "folded", 6))
        except (ValueError, TypeError) as e:
            rep = f"a malformed report: {e}"
        if isinstance(rep, str):
            for h, _, s, q, _, _ in items:
                self._unack(h, s, q)
                self.unsure.add((h.key, s, q))
            if member not in self.down:
                log.warning("parity holder unreachable; its pieces no longer count",
                            extra={"ctx": {"peer": addr, "pieces": len(items), "error": rep}})
            self.down.add(member)
            return
        if member in self.down:
            self.down.discard(member)
            log.info("parity holder reachable again", extra={"ctx": {"peer": addr}})
        for h, lane, s, q, at, n in items:
            meta = h.meta
            if meta is None or h.gone:
                continue
            if (h.job, h.step, s, self.layout.member, h.rank, meta.digest) in folded:
                if (h.key, s, q) in self.unsure:
                    self.unsure.discard((h.key, s, q))
                    self._ack(h, s, q)
                continue
            self.unsure.discard((h.key, s, q))
            self._unack(h, s, q)
            ctx = {"job": h.job, "step": h.step, "rank": h.rank, "stripe": s, "peer": addr}
            times = self.resent.get((h.key, s, q), 0)
            if times >= RESENDS:
                log.warning("parity piece lost again; not sent again",
                            extra={"ctx": {**ctx, "times_sent_again": times}})
                continue
            self.resent[(h.key, s, q)] = times + 1
            log.warning("parity piece gone from its holder; sent again", extra={"ctx": ctx})
            self.store.pin(h)
            try:
                await self._send(h, lane, s, at, n, q, addr)
            finally:
                self.store.unpin(h)

    def _ack(self, held: Held, s: int, q: int) -> None:
        assert held.meta is not None
        got = self.acked.get(held.key)
        if got is None or got[0] != held.meta.digest:
            got = self.acked[held.key] = (held.meta.digest, set())
        got[1].add((s, q))

    def _unack(self, held: Held, s: int, q: int) -> None:
        got = self.acked.get(held.key)
        if got is not None and held.meta is not None and got[0] == held.meta.digest:
            got[1].discard((s, q))

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
