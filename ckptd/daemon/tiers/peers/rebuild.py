"""Parity rebuild: a lost shard decoded from its group's survivors, each stripe reduced at its parity holder.

The replacement node (``Rebuilder.rebuild``, when a restore finds the shard neither here nor copied on
a peer) asks, for every stripe of its group at once, the stripe's parity holders in turn for
``reduce_piece``. A holder that folded the shard (its record names the rank and manifest digest)
answers with the lost member's piece of that stripe already decoded, the member and the shard's
meta, and the piece is read straight into the new memfd. So the replacement's ingress is the
shard's size, not (g − P) times it, every survivor sends about one piece per stripe, and the g
stripes are decoded on g holders in parallel (the design's running reduction along the stripe).

A holder's side (``Rebuilder.reduce``, called by parity_hold.py with its own parity row): the
stripe's other data pieces fetched from their members (``get_piece``); only when some are gone, the
stripe's other parity rows (``get_parity``, each with the same record); then the codec's decode.
More than P rows gone in a stripe, a piece failing its transport checksum, a meta that is not the
committed rank's, members that disagree, or a rebuilt shard failing its held checksums (a corrupt
parity or data piece) each give up, logged with the reason: the restore reads storage.
"""
from __future__ import annotations

import asyncio
import logging
import mmap
import ssl
from typing import Any

from ckptd.core import peer_protocol as pp
from ckptd.core.codec import checksum
from ckptd.core.errors import ChecksumError, FormatError, ProtocolError
from ckptd.core.held import MAX_HELD_BYTES, HeldMeta
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.tiers.memory.store import Held, MemoryStore, new_memfd
from ckptd.daemon.tiers.peers.layout import ParityLayout
from ckptd.daemon.tiers.peers.link import PeerLink

log = logging.getLogger("ckptd")
Record = dict[int, dict[str, Any]]          # member → {member, rank, digest, nbytes} folded into a parity row


class GiveUp(Exception):
    """A rebuild (or one stripe's reduction) cannot go on; the message says why."""


def parse_record(rec: Any, size: int) -> Record:
    """A peer's parity record (a list of ``{member, rank, digest, nbytes}``) as member → entry;
    ProtocolError unless each entry names a member of the group (an int below ``size``), once."""
    if not isinstance(rec, list):
        raise ProtocolError("a parity record that is not a list")
    out: Record = {}
    for f in rec:
        m = f.get("member") if isinstance(f, dict) else None
        if type(m) is not int or not 0 <= m < size or m in out:
            raise ProtocolError(f"a parity record entry that names no member of the group once: {str(f)[:80]}")
        out[m] = f
    return out


class _Target:
    """The rebuilt shard's memfd, made when the first reduced piece names the shard's meta and member."""

    def __init__(self, store: MemoryStore, job: str, step: int, rank: int, digest: str) -> None:
        self.store, self.want = store, (job, step, rank, digest)
        self.lock = asyncio.Lock()
        self.held: Held | None = None
        self.meta: HeldMeta | None = None
        self.owner = -1

    async def open(self, wire: Any, owner: Any) -> tuple[HeldMeta, int, mmap.mmap]:
        async with self.lock:
            if self.held is None:
                meta = HeldMeta.from_wire(wire if isinstance(wire, dict) else {})
                if (meta.job, meta.step, meta.rank, meta.digest) != self.want:
                    raise GiveUp("the parity holders' meta is not the committed shard's")
                if type(owner) is not int:
                    raise GiveUp("a parity holder named no member for the shard")
                job, step, rank, _ = self.want
                held = self.store.reserve(job, step, rank, meta.nbytes, "peer")
                if held is None:
                    raise GiveUp("over this daemon's memory budget")
                self.held, self.meta, self.owner = held, meta, owner
                held.fd, held.mm = await asyncio.get_running_loop().run_in_executor(
                    None, new_memfd, f"ckptd-mem-{job}-{step}-r{rank}", meta.nbytes)
            elif owner != self.owner or HeldMeta.from_wire(wire if isinstance(wire, dict) else {}) != self.meta:
                raise GiveUp(f"the parity holders disagree on the shard: member {owner} vs {self.owner}")
            assert self.meta is not None and self.held is not None and self.held.mm is not None
            return self.meta, self.owner, self.held.mm


class Rebuilder:
    def __init__(self, store: MemoryStore, layout: ParityLayout, secret: bytes, timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.store, self.layout, self.secret, self.timeout, self.tls = store, layout, secret, timeout, tls
        self.received = 0        # bytes of decoded pieces read into rebuilt shards (this node's ingress)
        self.fetched = 0         # bytes of rows fetched as a holder reducing a stripe for another node

    # ---- the replacement's side ------------------------------------------------------------

    async def rebuild(self, job: str, step: int, rank: int, digest: str) -> Held | None:
        """A lost shard of this node's group decoded by its stripes' parity holders, checked, held here;
        None (logged) if not."""
        ctx = {"job": job, "step": step, "rank": rank}
        target = _Target(self.store, job, step, rank, digest)
        try:
            got = await asyncio.gather(*(self._stripe(target, s) for s in range(self.layout.size)),
                                       return_exceptions=True)     # all done before the target may go
            whys: list[str | None] = []
            for g in got:
                if isinstance(g, BaseException):
                    raise g
                whys.append(g)
            if target.held is None or target.meta is None:
                raise GiveUp("no parity holder of this node's group holds the shard"
                             + "".join(f"; {why}" for why in whys if why))
            meta = target.meta
            for piece in self.layout.cut(meta.nbytes, target.owner).pieces:
                if piece.length and whys[piece.stripe] is not None:
                    raise GiveUp(f"stripe {piece.stripe}: {whys[piece.stripe]}")
            assert target.held.mm is not None
            view = memoryview(target.held.mm)
            try:
                meta.verify(view)
            finally:
                view.release()
        except (GiveUp, ChecksumError, FormatError, ValueError) as e:
            if isinstance(e, ChecksumError):
                self.store.totals.corrupt += 1
                reason = f"the rebuilt shard fails its checksums (a corrupt parity or data piece): {e}"
            else:
                reason = str(e)
            log.error("parity rebuild failed; the restore reads storage", extra={"ctx": {**ctx, "reason": reason}})
            if target.held is not None:
                self.store.cancel(target.held)
            return None
        except BaseException:
            if target.held is not None:
                self.store.cancel(target.held)
            raise
        self.store.filled(target.held, meta)
        log.info("rebuilt from parity", extra={"ctx": {**ctx, "bytes": meta.nbytes}})
        return target.held

    async def _stripe(self, target: _Target, s: int) -> str | None:
        """Stripe ``s``'s lost piece from the first of its parity holders that reduces it, read into the
        target; None when done (or the shard has no piece there), else why not."""
        job, step, rank, digest = target.want
        why: list[str] = []
        for q, addr in self.layout.holders(s):
            link = PeerLink(addr, self.secret, self.layout.me, self.timeout, self.tls)
            try:
                await link.open()
                await pp.send(link.channel, {"op": "reduce_piece", "job": job, "step": step, "stripe": s,
                                             "rank": rank, "digest": digest})
                # the holder fetches the other pieces (each bounded by the timeout) before it answers
                reply, plen = await pp.recv(link.channel, MAX_HELD_BYTES, wait=3 * self.timeout)
                if reply.get("op") != "piece":
                    why.append(f"parity holder {q} ({addr}): {str(reply.get('reason', 'does not hold it'))[:300]}")
                    continue
                meta, owner, mm = await target.open(reply.get("meta"), reply.get("member"))
                piece = self.layout.cut(meta.nbytes, owner).piece_in(s)
                if plen != piece.length:
                    raise ProtocolError(f"a reduced piece of {plen} bytes for one of {piece.length}")
                view = memoryview(mm)[piece.offset:piece.offset + piece.length]
                try:
                    await pp.recv_payload(link.channel, view)
                    if checksum(view) != reply.get("checksum"):
                        self.store.totals.corrupt += 1
                        raise ProtocolError("the reduced piece fails its transport checksum")
                finally:
                    view.release()
                self.received += plen
                return None
            except (OSError, ProtocolError) as e:
                why.append(f"parity holder {q} ({addr}): {describe_error(e)}")
                log.warning("parity reduce failed", extra={"ctx": {"peer": addr, "stripe": s,
                                                                  "error": describe_error(e)}})
            finally:
                link.close()
        return "; ".join(why)

    # ---- a parity holder's side ------------------------------------------------------------

    async def reduce(self, job: str, step: int, s: int, owner: int, q: int, own: bytes, record: Record) -> bytes:
        """Member ``owner``'s piece of stripe ``s`` from this holder's parity row ``q`` (``own``, with the
        ``record`` of what it folded), the stripe's other data pieces and, if some are gone, its other
        parity rows. The temporary rows are charged to the memory budget. GiveUp says why not."""
        lay = self.layout
        st, k = lay.stripe(s), len(lay.stripe(s).data)
        size = len(own)          # the parity row: as long as the longest piece its record folded, so any row here
        length = lay.cut(record[owner]["nbytes"], owner).piece_in(s).length
        charge = size * (k - 1 + lay.p)      # the other data pieces and the decoded rows (own is charged)
        # Never by evicting: the oldest shards held here are likeliest the very step being rebuilt, whose
        # pieces this and the other holders' reductions fetch from each other (erasure-coding.md).
        if not self.store.charge(charge, f"parity rebuild {job} step {step} stripe {s}", evict=False):
            raise GiveUp(f"stripe {s}: over parity holder {q}'s memory budget")
        try:
            rows: dict[int, bytes] = {k + q: own}
            others = [m for m in st.data if m != owner and m in record]
            fetched = await asyncio.gather(*(self._piece(job, step, s, m, record[m]) for m in others))
            rows.update({st.row(m): b for m, b in zip(others, fetched, strict=True) if b is not None})
            rows.update({st.row(m): b"" for m in st.data if m != owner and m not in record})   # none folded: zeros
            if len(rows) < k:
                rows.update(await self._other_parities(job, step, s, owner, q, record, size))
            missing = [r for r in range(k + lay.p) if r not in rows]
            if len(missing) > lay.p:
                lost = [f"member {st.holder(r)}" for r in missing if r != st.row(owner)]
                raise GiveUp(f"stripe {s}: {len(missing)} of its {k + lay.p} pieces are gone (the lost shard's "
                             f"and {', '.join(lost)}), more than P = {lay.p}")
            decoded = lay.codec.decode(rows, missing, max([len(b) for b in rows.values()] + [length]))
            return bytes(decoded[st.row(owner)][:length])
        finally:
            self.store.uncharge(charge)

    async def _other_parities(self, job: str, step: int, s: int, owner: int, q: int,
                              record: Record, size: int) -> dict[int, bytes]:
        """Stripe ``s``'s parity rows other than ``q`` (each ``size`` bytes, as this one) whose record is
        this one's: row → bytes."""
        k = len(self.layout.stripe(s).data)
        want = {"op": "get_parity", "job": job, "step": step, "stripe": s, "rank": record[owner]["rank"],
                "digest": record[owner]["digest"]}
        others = [(q2, addr) for q2, addr in self.layout.holders(s) if q2 != q]
        got = await asyncio.gather(*(self._ask(addr, want, "parity", size) for _, addr in others))
        out = {}
        for (q2, addr), answer in zip(others, got, strict=True):
            if answer is None:
                continue
            try:
                theirs = parse_record(answer[0].get("record"), self.layout.size)
            except ProtocolError as e:
                log.warning("parity row not used", extra={"ctx": {"peer": addr, "stripe": s, "error": f"{addr}: {e}"}})
                continue
            if answer[0].get("q") == q2 and theirs.keys() == record.keys():
                out[k + q2] = answer[1]
        return out

    async def _piece(self, job: str, step: int, s: int, member: int, f: dict[str, Any]) -> bytes | None:
        """Member ``member``'s data piece of stripe ``s`` (the recorded shard), or None."""
        length = self.layout.cut(f["nbytes"], member).piece_in(s).length
        answer = await self._ask(self.layout.address(member), {"op": "get_piece", "job": job, "step": step,
                                                               "rank": f.get("rank"), "digest": f.get("digest"),
                                                               "stripe": s}, "piece", length)
        return answer[1] if answer is not None else None

    async def _ask(self, addr: str, msg: dict[str, Any], want: str,
                   length: int) -> tuple[dict[str, Any], bytes] | None:
        """One request to a peer; its answer and payload of exactly ``length`` bytes (transport checksum
        checked), or None (logged). The length is the caller's, never the peer's claim: what is read is
        what the reduction charged to the budget, and a peer claiming more is refused before a byte."""
        link = PeerLink(addr, self.secret, self.layout.me, self.timeout, self.tls)
        try:
            await link.open()
            await pp.send(link.channel, msg)
            reply, plen = await pp.recv(link.channel, length)
            if reply.get("op") != want:
                return None
            if plen != length:
                raise ProtocolError(f"peer {addr} answered {msg['op']} with {plen} bytes for a piece of {length}")
            data = bytearray(plen)
            await pp.recv_payload(link.channel, memoryview(data))
            if checksum(data) != reply.get("checksum"):
                self.store.totals.corrupt += 1
                log.error("parity piece from peer fails its checksum; not used",
                          extra={"ctx": {"peer": addr, "op": msg["op"], "stripe": msg.get("stripe")}})
                return None
            self.fetched += plen
            return reply, bytes(data)
        except (OSError, ProtocolError) as e:
            log.warning("parity fetch failed", extra={"ctx": {"peer": addr, "op": msg["op"],
                                                             "error": describe_error(e)}})
            return None
        finally:
            link.close()
