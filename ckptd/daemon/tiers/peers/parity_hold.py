"""The parity holder: other members' data pieces folded into parity buffers, and pieces served back.

Serves the piece ops of ``layout.py`` for :class:`~ckptd.daemon.tiers.peers.link.PeerServer`. A
parity buffer is a memfd charged to the memory store's budget like a replica (before a byte of the
piece is read; a piece that does not fit is refused and the sender's step is not *protected*). It
is keyed by (job, step, stripe, lane) and records which (member, rank, manifest digest, size) it
holds, so a rebuild checks what it decodes against the committed index. A piece folded twice would
cancel itself out: a repeated (member, rank, digest) is acknowledged and not folded again, when the
buffer it names (its lane) is the one it was folded into. A buffer never mixes two saves of a step
number: a piece whose member already folded another shard there (the step saved again after a failed
save), or whose world size is not the buffer's, or whose shard is folded in another lane of the stripe
(another save's numbering), shows that buffer to be another save's. It is dropped, and the piece is
*refused*, naming why: the buffer may hold pieces of this save acknowledged as repeats, now gone, so
this save must not count as protected (its step fails; every member then drops its pieces, and the
next save of the number folds afresh). A member whose save of a step failed says so (``drop_piece``)
and the buffers that folded its shard go. Every ``ok`` says ``drops``: this holder knows ``drop_piece``
(a holder of an older build does not: parity.py). Buffers of a job beyond its newest ``memory.steps +
1`` steps go.
``reduce_piece`` hands a buffer and its record to the rebuild's holder side (``Reducer``: rebuild.py's
``Rebuilder.reduce``), which decodes the named shard's piece of the stripe, and sends that.
"""
from __future__ import annotations

import asyncio
import logging
import mmap
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ckptd.core import peer_protocol as pp
from ckptd.core.codec import checksum
from ckptd.core.errors import FormatError, ProtocolError
from ckptd.core.held import HeldMeta
from ckptd.core.peer_channel import Channel
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.tiers.memory.store import MemoryStore, new_memfd
from ckptd.daemon.tiers.peers import group_state
from ckptd.daemon.tiers.peers.layout import ParityLayout
from ckptd.daemon.tiers.peers.rebuild import GiveUp
from ckptd.daemon.tiers.peers.stripes import piece_size

log = logging.getLogger("ckptd")
MAX_LANES = 1024
# (job, step, stripe, owner member, q, own parity row, record member → folded) → the owner's decoded piece
OK = {"op": "ok", "drops": True}     # (``drops``: this holder knows drop_piece; parity.py's old-holder check)
Reducer = Callable[[str, int, int, int, int, bytes, dict[int, dict[str, Any]]], Awaitable[bytes]]


@dataclass
class Folded:
    member: int
    rank: int
    digest: str
    nbytes: int
    meta: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"member": self.member, "rank": self.rank, "digest": self.digest, "nbytes": self.nbytes}


@dataclass(eq=False)
class ParityUnit:
    """One parity buffer: row ``q`` of stripe ``stripe``, lane ``lane`` of (job, step)."""
    job: str
    step: int
    stripe: int
    lane: int
    q: int
    size: int = 0
    fd: int = -1
    mm: mmap.mmap | None = None
    record: dict[int, Folded] = field(default_factory=dict)    # member → what it folded in

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ParityHolder:
    def __init__(self, store: MemoryStore, layout: ParityLayout, reduce: Reducer) -> None:
        self.store, self.layout, self.reduce = store, layout, reduce
        self.units: dict[tuple[str, int, int, int], ParityUnit] = {}
        self.lock = asyncio.Lock()
        self.served = 0          # bytes of pieces, parity and decoded pieces sent to other nodes

    # ---- serving ---------------------------------------------------------------------------

    async def handle(self, ch: Channel, msg: dict[str, Any], plen: int, node: str) -> None:
        op = msg["op"]
        if op == "put_piece":
            try:
                reply = await self._put(ch, msg, plen, node)
            except (FormatError, ValueError) as e:
                log.warning("parity piece refused", extra={"ctx": {"from": node, "reason": describe_error(e)}})
                raise ProtocolError(str(e)) from None
            await pp.send(ch, reply)
        elif op == "get_parity" and plen == 0:
            await self._get_parity(ch, msg)
        elif op == "get_piece" and plen == 0:
            await self._get_piece(ch, msg)
        elif op == "reduce_piece" and plen == 0:
            await self._reduce_piece(ch, msg, node)
        elif op == "group_report" and plen == 0:
            await pp.send(ch, self.report())
        elif op == "drop_piece" and plen == 0:
            async with self.lock:
                reply = self._forget(msg, node)
            await pp.send(ch, reply)
        else:
            raise ProtocolError(f"bad peer request {str(op)[:40]!r} with {plen} payload bytes")

    async def _put(self, ch: Channel, msg: dict[str, Any], plen: int, node: str) -> dict[str, Any]:
        lay = self.layout
        wire = msg.get("meta")
        meta = HeldMeta.from_wire(wire if isinstance(wire, dict) else {})
        s, lane, member, want = msg.get("stripe"), msg.get("lane"), msg.get("member"), msg.get("checksum")
        if (msg.get("job"), msg.get("step"), msg.get("rank"), msg.get("digest")) != \
                (meta.job, meta.step, meta.rank, meta.digest):
            raise FormatError("put_piece: names a shard its meta does not describe")
        if not (type(s) is int and 0 <= s < lay.size and type(lane) is int and 0 <= lane < MAX_LANES
                and type(member) is int and isinstance(want, str)):
            raise FormatError("put_piece: bad stripe, lane, member or checksum")
        st = lay.stripe(s)
        if lay.member not in st.parity or member not in st.data:
            raise FormatError(f"put_piece: member {member} has no data piece in stripe {s} whose parity is here")
        piece = lay.cut(meta.nbytes, member).piece_in(s)
        if plen != piece.length or plen == 0:
            raise FormatError(f"put_piece: {plen} bytes for a piece of {piece.length}")
        key = (meta.job, meta.step, s, lane)
        unit = self.units.get(key)
        if unit is not None and member in unit.record and self._same(unit.record[member], meta):
            await pp.skip(ch, plen)
            return dict(OK)                         # folded already: once more would cancel it out
        size = piece_size(meta.nbytes, lay.size, lay.p)
        grow = max(0, size - (unit.size if unit is not None else 0))
        if grow and not self.store.charge(grow, f"parity {meta.job} step {meta.step} stripe {s}"):
            await pp.skip(ch, plen)
            return {"op": "error", "reason": "over this peer's memory budget"}
        data = bytearray(plen)
        try:
            await pp.recv_payload(ch, memoryview(data))
        finally:
            if grow:
                self.store.uncharge(grow)   # the reservation; charged again exactly below, under the lock
        if checksum(data) != want:
            self.store.totals.corrupt += 1
            log.warning("parity piece refused: checksum", extra={"ctx": {"from": node, "job": meta.job,
                                                                         "step": meta.step, "rank": meta.rank}})
            return {"op": "error", "reason": "piece fails its checksum"}
        async with self.lock:                # one fold (and growth) at a time
            unit = self.units.get(key)
            if unit is not None and member in unit.record and self._same(unit.record[member], meta):
                return dict(OK)
            stale = {k: why for k, u in self.units.items() if k[:3] == key[:3]
                     and (why := self._stale(u, k == key, member, meta)) is not None}
            if stale:       # another save's: dropped, with whatever this save had in them; this piece refused
                for k, why in stale.items():
                    log.warning("parity buffer of another save dropped; the piece is refused", extra={"ctx": {
                        "job": meta.job, "step": meta.step, "stripe": s, "lane": k[3], "from": node, "why": why,
                        "held": [(f.member, f.rank) for f in self.units[k].record.values()]}})
                    self._drop(k)
                return {"op": "error", "reason": f"parity buffer of step {meta.step} stripe {s} held another save's "
                        f"pieces ({next(iter(stale.values()))}): dropped; this save is not protected — save again"}
            need = max(0, size - (unit.size if unit is not None else 0))
            if need and not self.store.charge(need, f"parity {meta.job} step {meta.step} stripe {s}"):
                return {"op": "error", "reason": "over this peer's memory budget"}
            made = unit is None
            if unit is None:
                unit = self.units[key] = ParityUnit(meta.job, meta.step, s, lane, st.parity.index(lay.member))
                self._trim(meta.job)
                if key not in self.units:
                    self.store.uncharge(need)
                    return {"op": "error", "reason": f"step {meta.step} is older than the steps kept here"}
            if need:
                try:
                    await self._grow(unit, size)
                except OSError as e:         # no memory (or a full shm_dir): the charge and an empty unit go
                    self.store.uncharge(need)
                    if made and self.units.get(key) is unit:
                        del self.units[key]
                    log.warning("parity piece refused: no memory for its buffer",
                                extra={"ctx": {"from": node, "job": meta.job, "step": meta.step, "error": str(e)}})
                    return {"op": "error", "reason": f"cannot grow the parity buffer here: {e}"}
            assert unit.mm is not None
            view = memoryview(unit.mm)[:unit.size]
            try:
                lay.codec.fold(view, unit.q, {st.row(member): data})
            finally:
                view.release()
            unit.record[member] = Folded(member, meta.rank, meta.digest, meta.nbytes, meta.to_wire())
        log.info("parity piece folded", extra={"ctx": {"job": meta.job, "step": meta.step, "rank": meta.rank,
                                                       "stripe": s, "lane": lane, "bytes": plen, "from": node}})
        return dict(OK)

    @staticmethod
    def _same(f: Folded, meta: HeldMeta) -> bool:
        return (f.rank, f.digest) == (meta.rank, meta.digest)

    @staticmethod
    def _stale(unit: ParityUnit, own: bool, member: int, meta: HeldMeta) -> str | None:
        """Why ``unit`` (the piece's own buffer when ``own``, else another lane of its stripe) folds
        another save of the step than the piece ``member`` sends of ``meta``, or None: its own buffer
        holds another shard of that member (a failed save's, the step saved again) or a shard saved by
        another world size; another lane holds this very rank of that member (a save gives a shard one
        lane). Folded together they decode neither save."""
        f = unit.record.get(member)
        if own and f is not None:
            return f"member {member}'s rank {f.rank}"
        if not own and f is not None and f.rank == meta.rank:
            return f"member {member}'s rank {f.rank} in lane {unit.lane}"
        other = next((x for x in unit.record.values() if x.meta.get("world_size") != meta.world_size), None)
        if own and other is not None:
            return f"member {other.member}'s rank {other.rank}, saved by {other.meta.get('world_size')} ranks"
        return None

    def _forget(self, msg: dict[str, Any], node: str) -> dict[str, Any]:
        """``drop_piece``: a member's save of a step failed after (some of) its pieces were folded; every
        buffer of the step that folded that shard goes (the step did not commit, so nothing else in
        them is needed, and a later save of the step number must not fold into them)."""
        job, step, member, rank, digest = (msg.get(k) for k in ("job", "step", "member", "rank", "digest"))
        gone = [key for key, u in self.units.items() if (u.job, u.step) == (job, step) and type(member) is int
                and (f := u.record.get(member)) is not None and (f.rank, f.digest) == (rank, digest)]
        for key in gone:
            self._drop(key)
        if gone:
            log.info("parity buffers of a failed save dropped", extra={"ctx": {
                "job": job, "step": step, "rank": rank, "buffers": len(gone), "from": node}})
        return {**OK, "dropped": len(gone)}

    async def _grow(self, unit: ParityUnit, size: int) -> None:
        fd, mm = await asyncio.get_running_loop().run_in_executor(
            None, new_memfd, f"ckptd-parity-{unit.job}-{unit.step}-s{unit.stripe}-l{unit.lane}", size)
        if unit.mm is not None:     # (under the holder's lock: nothing folds into it meanwhile)
            mm[:unit.size] = unit.mm[:unit.size]
        unit.close()
        unit.fd, unit.mm, unit.size = fd, mm, size

    def _find(self, msg: dict[str, Any]) -> tuple[ParityUnit, Folded] | None:
        job, step, s, rank, digest = (msg.get(k) for k in ("job", "step", "stripe", "rank", "digest"))
        for (j, t, ss, _), unit in self.units.items():
            if (j, t, ss) == (job, step, s):
                for f in unit.record.values():
                    if (f.rank, f.digest) == (rank, digest):
                        return unit, f
        return None

    async def _found(self, ch: Channel, msg: dict[str, Any]) -> tuple[ParityUnit, Folded] | None:
        """The buffer holding the rank the request names, or None (``missing`` answered)."""
        found = self._find(msg)
        if found is None or found[0].mm is None:
            await pp.send(ch, {"op": "missing"})
            return None
        return found

    async def _get_parity(self, ch: Channel, msg: dict[str, Any]) -> None:
        if (found := await self._found(ch, msg)) is None:
            return
        unit, f = found
        assert unit.mm is not None
        view = memoryview(unit.mm)[:unit.size]
        try:
            await pp.send(ch, {"op": "parity", "q": unit.q, "lane": unit.lane, "checksum": checksum(view),
                               "record": [x.to_wire() for x in unit.record.values()], "meta": f.meta}, view)
            self.served += len(view)
        finally:
            view.release()

    async def _reduce_piece(self, ch: Channel, msg: dict[str, Any], node: str) -> None:
        if (found := await self._found(ch, msg)) is None:
            return
        unit, f = found
        assert unit.mm is not None
        own, record = bytes(unit.mm[:unit.size]), {m: x.to_wire() for m, x in unit.record.items()}
        try:
            piece = await self.reduce(unit.job, unit.step, unit.stripe, f.member, unit.q, own, record)
        except (GiveUp, ValueError) as e:           # (ValueError: the codec's)
            log.warning("parity reduce refused", extra={"ctx": {"for": node, "job": unit.job, "step": unit.step,
                                                                "stripe": unit.stripe, "reason": str(e)}})
            await pp.send(ch, {"op": "error", "reason": str(e)})
            return
        await pp.send(ch, {"op": "piece", "checksum": checksum(piece), "member": f.member, "meta": f.meta}, piece)
        self.served += len(piece)

    async def _get_piece(self, ch: Channel, msg: dict[str, Any]) -> None:
        job, step, rank, digest, s = (msg.get(k) for k in ("job", "step", "rank", "digest", "stripe"))
        held = self.store.get(job, step, rank) if isinstance(job, str) and type(step) is int \
            and type(rank) is int else None
        if held is None or held.meta is None or held.mm is None or held.meta.digest != digest \
                or type(s) is not int or not 0 <= s < self.layout.size \
                or self.layout.member not in self.layout.stripe(s).data:
            await pp.send(ch, {"op": "missing"})
            return
        piece = self.layout.cut(held.meta.nbytes).piece_in(s)
        self.store.pin(held)
        try:
            view = memoryview(held.mm)[piece.offset:piece.offset + piece.length]
            try:
                await pp.send(ch, {"op": "piece", "checksum": checksum(view)}, view)
                self.served += len(view)
            finally:
                view.release()
        finally:
            self.store.unpin(held)

    def report(self) -> dict[str, Any]:
        """This node's part of its group's state (group_state.py): its own held shards, and what each of
        its parity buffers folded."""
        live = [(h, h.meta) for h in self.store.entries.values() if h.meta is not None and not h.gone]
        own = [(h.job, h.step, h.rank, m.digest, m.nbytes) for h, m in live if h.origin == "local"]
        copies = [(h.job, h.step, h.rank, m.digest) for h, m in live if h.origin != "local"]
        folded = [(u.job, u.step, u.stripe, f.member, f.rank, f.digest) for u in self.units.values()
                  for f in u.record.values()]
        return group_state.report(own, folded, copies)

    # ---- lifecycle -------------------------------------------------------------------------

    def _trim(self, job: str) -> None:
        keep = sorted({u.step for u in self.units.values() if u.job == job}, reverse=True)[: self.store.steps + 1]
        for key, unit in list(self.units.items()):
            if unit.job == job and unit.step not in keep:
                self._drop(key)

    def _drop(self, key: tuple[str, int, int, int]) -> None:
        unit = self.units.pop(key)
        self.store.uncharge(unit.size)
        unit.close()

    def held_bytes(self) -> int:
        return sum(u.size for u in self.units.values())

    def close(self) -> None:
        for key in list(self.units):
            self._drop(key)
