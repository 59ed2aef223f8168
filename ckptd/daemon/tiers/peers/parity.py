"""Parity redundancy, this node's side: its held shards' pieces sent to their parity holders, and a
lost shard rebuilt from its group's survivors (``[peers] redundancy = "parity"``; layout.py says how
ranks map onto members and lanes, parity_hold.py is the holders' side).

Sending: when a shard of this node becomes held (``offer``, the memory tier's on_held hook, where
copies are queued in ``copies`` mode) it gets the next lane of its step, is cut into its g − P data
pieces, and each non-empty piece goes to its stripe's P parity holders in the background, paced by
one token bucket (``peers.bandwidth``) and bounded by ``peers.io_timeout``. A step is *protected* on
this node once every piece of every shard of it held here is acknowledged by every parity holder.

Rebuilding (``rebuild``, when a restore finds the shard neither here nor copied on a peer): the
group's parity holders say which shards they folded (their record: so which member held the lost
one; the rebuilding node is its replacement or any other node of the group) and send their parity;
for each stripe where that member held data, each other data member sends its piece of the recorded
shard, and the codec decodes the lost piece. More than P rows missing in a stripe, a piece failing its transport
checksum, a meta that is not the committed rank's, or a rebuilt shard failing its held checksums
(a corrupted parity or data piece) each give up, logged with the reason: the restore reads storage.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

from ckptd.core import peer_protocol as pp
from ckptd.core.codec import checksum
from ckptd.core.errors import ChecksumError, FormatError, ProtocolError
from ckptd.core.held import MAX_HELD_BYTES, HeldMeta, verify
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.tiers.memory.store import Held, MemoryStore, new_memfd
from ckptd.daemon.tiers.peers.layout import ParityLayout
from ckptd.daemon.tiers.peers.link import PeerLink
from ckptd.daemon.tiers.peers.replicate import QUEUE_MAX, PeerCounts, TokenBucket

log = logging.getLogger("ckptd")
LANES_KEPT = 256                 # (job, step)s whose lane numbering this node remembers


class GiveUp(Exception):
    """A rebuild cannot go on; the message says why (logged, the restore reads storage)."""


class ParityNode:
    def __init__(self, store: MemoryStore, layout: ParityLayout, secret: bytes, bandwidth: int, timeout: float,
                 trim: Callable[[str], None], tls: ssl.SSLContext | None = None) -> None:
        self.store, self.layout, self.secret, self.timeout, self.trim = store, layout, secret, timeout, trim
        self.tls = tls
        self.bucket = TokenBucket(bandwidth)
        self.queue: asyncio.Queue[tuple[Held, int]] = asyncio.Queue(QUEUE_MAX)
        self.lanes: dict[tuple[str, int], dict[int, int]] = {}       # (job, step) → rank → lane
        self.acked: dict[tuple[str, int, int], set[tuple[int, int]]] = {}   # shard → {(stripe, q)} acknowledged
        self.per_peer: dict[str, PeerCounts] = {}
        self.rebuilt = 0

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
        only once they all fold them); 1 when every piece is acknowledged, else 0 (the memory tier's
        ``replicate`` with k = 1)."""
        assert held.meta is not None
        self.store.pin(held)
        try:
            await self._send_all(held, self._lane(held))
        finally:
            self.store.unpin(held)
        return int(self.protected(held.job, held.step, held.rank, held.meta.nbytes))

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
            assert link.reader is not None and link.writer is not None
            await pp.send(link.writer, {"op": "put_piece", "job": meta.job, "step": meta.step, "rank": meta.rank,
                                        "digest": meta.digest, "stripe": s, "lane": lane,
                                        "member": self.layout.member, "checksum": checksum(view),
                                        "meta": meta.to_wire()}, view, self.bucket.take, timeout=self.timeout)
            reply, _ = await pp.recv(link.reader, timeout=self.timeout)
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
        self.acked.setdefault(held.key, set()).add((s, q))

    def protected(self, job: str, step: int, rank: int, nbytes: int) -> bool:
        """Every piece of this node's shard (job, step, rank) is in its parity holders' parity."""
        return self._needed(nbytes) <= self.acked.get((job, step, rank), set())

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self.per_peer.values())

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.per_peer.values())

    # ---- rebuilding ----------------------------------------------------------------------

    async def rebuild(self, job: str, step: int, rank: int, digest: str) -> Held | None:
        """A lost shard of this node's group (this node's own, or another member's restored here) decoded
        from the group's survivors, checked, held here; None (logged) if not."""
        ctx = {"job": job, "step": step, "rank": rank}
        held: Held | None = None
        try:
            stripes = range(self.layout.size)
            answers = await asyncio.gather(*(self._parities(job, step, rank, digest, s) for s in stripes))
            metas = [m for per in answers for _, _, m in per.values()]
            if not metas:
                raise GiveUp("no parity holder of this node's group holds the shard")
            owner = self._owner(answers, rank, digest)
            meta = HeldMeta.from_wire(metas[0])
            if (meta.job, meta.step, meta.rank, meta.digest) != (job, step, rank, digest):
                raise GiveUp("the parity holders' meta is not the committed shard's")
            held = self.store.reserve(job, step, rank, meta.nbytes, "peer")
            if held is None:
                raise GiveUp("over this daemon's memory budget")
            held.fd, mm = await asyncio.get_running_loop().run_in_executor(
                None, new_memfd, f"ckptd-mem-{job}-{step}-r{rank}", meta.nbytes)
            held.mm = mm
            for piece in self.layout.cut(meta.nbytes, owner).pieces:
                if piece.length:
                    out = await self._decode(job, step, piece.stripe, piece.length, owner, answers[piece.stripe])
                    mm[piece.offset:piece.offset + piece.length] = out[:piece.length]
            view = memoryview(mm)
            try:
                for t, sums in zip(meta.layout, meta.checksums, strict=True):
                    verify(view[t.offset:t.offset + t.nbytes], sums, meta.chunk_bytes, f"{meta.what} tensor {t.name!r}")
            finally:
                view.release()
        except (GiveUp, ChecksumError, FormatError, ValueError) as e:
            if isinstance(e, ChecksumError):
                self.store.totals.corrupt += 1
                reason = f"the rebuilt shard fails its checksums (a corrupt parity or data piece): {e}"
            else:
                reason = str(e)
            log.error("parity rebuild failed; the restore reads storage", extra={"ctx": {**ctx, "reason": reason}})
            if held is not None:
                self.store.cancel(held)
            return None
        except BaseException:
            if held is not None:
                self.store.cancel(held)
            raise
        self.store.filled(held, meta)
        self.rebuilt += 1
        log.info("rebuilt from parity", extra={"ctx": {**ctx, "bytes": meta.nbytes}})
        return held

    async def _parities(self, job: str, step: int, rank: int, digest: str,
                        s: int) -> dict[int, tuple[list[dict[str, Any]], bytes, dict[str, Any]]]:
        """Stripe ``s``'s parity rows holding the shard: q → (record, parity bytes, meta)."""
        got = await asyncio.gather(*(self._ask(addr, {"op": "get_parity", "job": job, "step": step, "stripe": s,
                                                       "rank": rank, "digest": digest}, "parity")
                                     for _, addr in self.layout.holders(s)))
        out = {}
        for (q, _), answer in zip(self.layout.holders(s), got, strict=True):
            if answer is not None and answer[0].get("q") == q and isinstance(answer[0].get("record"), list) \
                    and isinstance(answer[0].get("meta"), dict):
                out[q] = (answer[0]["record"], answer[1], answer[0]["meta"])
        return out

    @staticmethod
    def _owner(answers: list[dict[int, tuple[list[dict[str, Any]], bytes, dict[str, Any]]]], rank: int,
               digest: str) -> int:
        """The member whose shard (rank, digest) is, as the parity holders recorded it."""
        owners = {f.get("member") for per in answers for rec, _, _ in per.values() for f in rec
                  if isinstance(f, dict) and (f.get("rank"), f.get("digest")) == (rank, digest)}
        (owner, *more) = owners or {None}
        if more or type(owner) is not int:
            raise GiveUp(f"the parity holders disagree on which member held the shard: {sorted(map(str, owners))}")
        return owner

    async def _decode(self, job: str, step: int, s: int, length: int, owner: int,
                      parities: dict[int, tuple[list[dict[str, Any]], bytes, dict[str, Any]]]) -> memoryview:
        """Member ``owner``'s piece of stripe ``s``: the other rows fetched, the codec's decode."""
        lay = self.layout
        st = lay.stripe(s)
        k = len(st.data)
        if not parities:
            raise GiveUp(f"stripe {s}: no parity holder answered")
        record: dict[int, dict[str, Any]] = {}
        for rec, _, _ in parities.values():
            for f in rec:
                if isinstance(f, dict) and type(f.get("member")) is int:
                    record.setdefault(f["member"], f)
        usable = {q: p for q, (rec, p, _) in parities.items()
                  if {f.get("member") for f in rec if isinstance(f, dict)} == set(record)}
        rows: dict[int, bytes] = {k + q: p for q, p in usable.items()}
        others = [m for m in st.data if m != owner and m in record]
        fetched = await asyncio.gather(*(self._piece(job, step, s, m, record[m]) for m in others))
        rows.update({st.row(m): b for m, b in zip(others, fetched, strict=True) if b is not None})
        rows.update({st.row(m): b"" for m in st.data if m != owner and m not in record})   # nothing folded: zeros
        missing = [r for r in range(k + lay.p) if r not in rows]
        if len(missing) > lay.p:
            lost = [f"member {st.holder(r)}" for r in missing if r != st.row(owner)]
            raise GiveUp(f"stripe {s}: {len(missing)} of its {k + lay.p} pieces are gone (the lost shard's and "
                         f"{', '.join(lost)}), more than P = {lay.p}")
        size = max([len(b) for b in rows.values()] + [length])
        decoded = lay.codec.decode(rows, missing, size)
        return decoded[st.row(owner)]

    async def _piece(self, job: str, step: int, s: int, member: int, f: dict[str, Any]) -> bytes | None:
        """Member ``member``'s data piece of stripe ``s`` (the recorded shard), or None."""
        answer = await self._ask(self.layout.address(member), {"op": "get_piece", "job": job, "step": step,
                                                               "rank": f.get("rank"), "digest": f.get("digest"),
                                                               "stripe": s}, "piece")
        return answer[1] if answer is not None else None

    async def _ask(self, addr: str, msg: dict[str, Any], want: str) -> tuple[dict[str, Any], bytes] | None:
        """One request to a peer; its answer and payload (transport checksum checked), or None (logged)."""
        link = PeerLink(addr, self.secret, self.layout.me, self.timeout, self.tls)
        try:
            await link.open()
            assert link.reader is not None and link.writer is not None
            await pp.send(link.writer, msg, timeout=self.timeout)
            reply, plen = await pp.recv(link.reader, MAX_HELD_BYTES, timeout=self.timeout)
            if reply.get("op") != want:
                return None
            data = bytearray(plen)
            await pp.recv_payload(link.reader, memoryview(data), timeout=self.timeout)
            if checksum(data) != reply.get("checksum"):
                self.store.totals.corrupt += 1
                log.error("parity piece from peer fails its checksum; not used",
                          extra={"ctx": {"peer": addr, "op": msg["op"], "stripe": msg.get("stripe")}})
                return None
            return reply, bytes(data)
        except (OSError, ProtocolError) as e:
            log.warning("parity fetch failed", extra={"ctx": {"peer": addr, "op": msg["op"],
                                                             "error": describe_error(e)}})
            return None
        finally:
            link.close()
