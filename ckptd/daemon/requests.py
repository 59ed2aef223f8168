"""The op table: one handler per request type, each checking its request and acting through the daemon's rooms.

Handlers answer (reply fields, memfds) or raise RequestError (an error reply; the connection stays);
``dispatch`` turns a malformed frame into a ProtocolError (the session ends it) and a daemon bug into
an internal-error reply, logged. The wire itself is FORMAT.md's, "Wire protocol".
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ckptd import __version__
from ckptd.core import names, protocol
from ckptd.core.errors import ErrorCode, FormatError
from ckptd.core.gc_pause import gc_paused
from ckptd.core.held import span
from ckptd.core.protocol import Abort, Commit, CommitMode, Hello, Info, MemoryFetch, Report, Resize, Save, Status
from ckptd.core.rank_record import parse_records
from ckptd.daemon.filling import FillingSlot
from ckptd.daemon.runtime import RequestError, bounded, describe_error
from ckptd.daemon.service import root_scan
from ckptd.daemon.session import Session
from ckptd.daemon.slot_pool import MIN_SLOT_BYTES
from ckptd.daemon.streamed import StreamedShard, check_stream
from ckptd.daemon.tiers.base import ShardRef
from ckptd.daemon.tiers.fs.commit import CommitError
from ckptd.daemon.tiers.s3.service import bucket_ops

if TYPE_CHECKING:
    from ckptd.daemon.server import Daemon

log = logging.getLogger("ckptd")
Reply = tuple[dict[str, Any], list[int]]          # reply fields, memfds to pass with it
MAX_REPORT_S = 1e6                                # a report's stall_s and fence_s: at most 11.6 days


class Requests:
    """The op table: one handler per request type, each returning (reply fields, memfds)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.table: dict[type, Callable[[Session, Any], Awaitable[Reply]]] = {
            Hello: self.hello, Resize: self.resize, Save: self.save, Commit: self.commit, Abort: self.abort,
            Report: self.report, Info: self.info, Status: self.status, MemoryFetch: daemon.memory.fetch,
            protocol.Reclaim: self.reclaim, protocol.SavePart: self.save_part,
            protocol.SaveFilled: self.save_filled,
            **bucket_ops(daemon.s3),
        }

    async def dispatch(self, session: Session, msg: dict[str, Any]) -> None:
        """Answer one request. A malformed one raises ProtocolError (the session ends it); one
        that cannot be served gets an error reply; a daemon bug is logged and answered too."""
        req, request = protocol.parse_request(msg)
        op = request.op.value
        try:
            reply, fds = await self.table[type(request)](session, request)
        except (RequestError, CommitError, FormatError, ValueError) as e:
            code = e.code if isinstance(e, RequestError) else ErrorCode.REFUSED
            await session.send(protocol.error(req, bounded(str(e)), code=code))
            return
        except Exception as e:  # a daemon bug: answer, log it loudly, keep the connection and the daemon
            log.exception("request failed", extra={"ctx": {**session.ctx(), "op": op}})
            await session.send(protocol.error(req, bounded(f"internal daemon error in {op}: {describe_error(e)}"),
                                              code=ErrorCode.INTERNAL))
            return
        try:
            await session.send(protocol.ok(req, **reply), fds)
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def _require_hello(session: Session) -> str:
        if session.job is None:
            raise RequestError("send hello first")
        return session.job

    def _identity(self) -> dict[str, Any]:
        return {"root": self.d.root, "version": __version__, "pid": os.getpid(), "bucket": self.d.s3 is not None,
                "step_timeout": self.d.config.step_timeout}

    async def info(self, session: Session, _: Info) -> Reply:
        # peer_io_timeout: how long `status --group` may take here (each member asked within it)
        return {**self._identity(), "peer_io_timeout": self.d.config.peers.io_timeout}, []

    async def status(self, session: Session, req: Status) -> Reply:
        snap = self.d.snapshot()
        state = await self.d.memory.group_state() if req.group else None
        groups, members = (None, None) if state is None else state
        tier = self.d.tier
        progress = {(w.job, w.step, w.rank): await tier.written_bytes(ShardRef(w.job, w.step, w.rank, w.world_size))
                    for w in snap.shard_writes}
        on_disk, partial = await asyncio.get_running_loop().run_in_executor(None, root_scan.job_names, self.d.root)
        latest = {job: await tier.latest_committed(job) for job in sorted({*snap.jobs(), *on_disk})}
        latest = {job: s for job, s in latest.items() if s is not None or job in snap.jobs()}   # (a stray dir: no job)
        return {**snap.status(progress, latest), "last_committed_partial": partial,
                **({"uploads": self.d.s3.status()} if self.d.s3 else {}),
                **({"groups": groups, "group_members": members} if req.group else {})}, []

    async def hello(self, session: Session, h: Hello) -> Reply:
        if session.job is not None:
            raise RequestError("hello sent twice on one connection")
        if self.d.draining:     # (status and info are still answered while the daemon drains)
            raise RequestError("daemon is shutting down; no new sessions")
        job = names.validate_job(h.job)
        if not names.is_rank(h.rank, h.world_size):
            raise RequestError(f"bad rank {h.rank} / world size {h.world_size}")
        session.job, session.rank, session.world_size = job, h.rank, h.world_size
        session.local_ranks = h.local_ranks if type(h.local_ranks) is int and 1 <= h.local_ranks <= h.world_size \
            else 1
        try:
            session.slots, fds = await self.d.slots.allocate(f"ckptd-{job}-r{h.rank}", h.slot_bytes, h.num_slots,
                                                             lambda: session.closed, self._spare(session, h.num_slots))
        except RequestError:
            session.job, session.rank, session.world_size = None, -1, 0   # the hello did not happen
            raise
        log.info("session", extra={"ctx": {**session.ctx(), "world_size": session.world_size, "slots": len(fds),
                                          "slot_bytes": h.slot_bytes}})
        # fills: this daemon takes a save before its slot is full (filling.py); a client asks only then
        return {**self._identity(), "slots": [s.size for s in session.slots], "fills": True}, fds

    async def resize(self, session: Session, r: Resize) -> Reply:
        job = self._require_hello(session)
        if self.d.draining:
            raise RequestError("daemon is shutting down; no new slots")
        if any(s.busy and not s.lent for s in session.slots):
            raise RequestError("cannot resize slots while a save still holds one")
        self.d.slots.release(session.slots)
        session.slots = []
        session.slots, fds = await self.d.slots.allocate(f"ckptd-{job}-r{session.rank}", r.slot_bytes, r.num_slots,
                                                         lambda: session.closed, self._spare(session, r.num_slots))
        return {"slots": [s.size for s in session.slots]}, fds

    def _spare(self, session: Session, num_slots: object) -> int:
        """Slot bytes a shrunk grant leaves for the job's ranks on this node not connected yet (the
        smallest slots each: ``MIN_SLOT_BYTES``), so a rank whose state streams cannot lock them out."""
        others = {s.rank for s in self.d.sessions if s is not session and s.job == session.job and not s.closed}
        missing = max(0, session.local_ranks - 1 - len(others))
        return missing * MIN_SLOT_BYTES * (num_slots if type(num_slots) is int and num_slots > 0 else 1)

    def _job_key(self, session: Session, level: str) -> str:
        """The session's job, or its memory-level job key for ``level="memory"`` (memory tier on)."""
        job = protocol.level_job(self._require_hello(session), level)
        if names.is_memory_job(job) and not self.d.memory.store.enabled:
            raise RequestError("memory-level saves need the memory tier: set [memory] steps ≥ 1 and a budget")
        return job

    async def save(self, session: Session, s: Save) -> Reply:
        job = self._job_key(session, s.level)
        if self.d.draining:
            raise RequestError("daemon is shutting down; no new saves")
        if s.commit not in protocol.COMMIT_MODES:
            raise RequestError(f"commit mode must be one of {protocol.COMMIT_MODES}")
        if s.stream is not None and names.is_memory_job(job):
            raise RequestError("a memory-level save must fit in one slot: this state streams through slots "
                               "smaller than it (raise slot_memory_limit, or save this step to storage)")
        if s.filling and (s.stream is not None or names.is_memory_job(job)):
            raise RequestError("filling is for a storage-level save in one slot, not a streamed or memory-level one")
        slot = session.idle_slot(s.slot)
        stream: StreamedShard | FillingSlot | None = None if s.stream is None else StreamedShard(   # save_part
            *check_stream(s.stream, slot.size), slot, session.slot_free, asyncio.get_running_loop(),
            self.d.config.step_timeout)
        layout = session.layouts.parse(s.tensors, slot.size if stream is None else stream.total)
        names.check_tree_depth(s.tree)
        if s.filling:            # the slot's bytes come as save_filled says (filling.py)
            stream = FillingSlot(slot.view, span(layout), self.d.config.step_timeout)
        data, released, loan = session.source(s.step, slot, stream)
        await self.d.steps.save(session, job, s.step, session.rank, session.world_size, CommitMode(s.commit),
                                data, layout, s.tree, released=released, loan=loan)
        session.started(s.step, slot, stream)   # the write task starts only after this returns
        return {"step": s.step}, []

    async def save_part(self, session: Session, p: protocol.SavePart) -> Reply:
        self._require_hello(session)
        stream = session.streams.get(p.step)
        if stream is None:
            raise RequestError(f"no streamed save of step {p.step} is in progress on this connection")
        slot = session.idle_slot(p.slot)
        stream.feed(p.part, slot)
        slot.busy = True
        return {"step": p.step}, []

    async def save_filled(self, session: Session, f: protocol.SaveFilled) -> Reply:
        self._require_hello(session)
        fill = session.filling.get(f.step)
        if fill is None:
            raise RequestError(f"no filling save of step {f.step} is in progress on this connection")
        fill.feed(f.upto)
        if fill.complete:
            del session.filling[f.step]
        return {"step": f.step}, []

    async def commit(self, session: Session, c: Commit) -> Reply:
        job = self._job_key(session, c.level)
        digests = commit_digests(c.digests)
        st = self.d.steps.leader_step(job, c.step, session.rank)
        check = None
        if c.check is not None:
            if not (isinstance(c.check, list) and all(type(r) is int and 0 <= r < st.world_size for r in c.check)):
                raise RequestError(f"check must list rank numbers below the world size {st.world_size}")
            if c.records is None:
                raise RequestError("check needs records: without them every manifest is read")
            check = sorted(set(c.check))
        if c.records is not None and not (isinstance(c.records, list) and len(c.records) == st.world_size):
            raise RequestError(f"records must list all {st.world_size} ranks in order")
        with gc_paused():       # the records, from their parse until the commit dropped them: see gc_pause
            records = None if c.records is None else \
                await asyncio.get_running_loop().run_in_executor(self.d.io_pool, parse_records, c.records)
            await self.d.steps.commit(st, digests, records, check)
            del records
        return {"step": c.step}, []

    async def abort(self, session: Session, a: Abort) -> Reply:
        job = protocol.level_job(self._require_hello(session), a.level)
        if not names.is_step(a.step):
            raise RequestError(f"abort: step must be a step number (0..{names.MAX_STEP - 1})")
        outcome = await self.d.steps.abort(job, a.step, session.rank, a.reason)
        return {"step": a.step, "outcome": outcome}, []

    async def reclaim(self, session: Session, _: protocol.Reclaim) -> Reply:
        """The trainer has no slot to fill: the memory tier keeps every one (``Session.kept_slots``)."""
        self._require_hello(session)
        return {"freed": self.d.memory.reclaim(session.kept_slots())}, []

    async def report(self, session: Session, r: Report) -> Reply:
        """A client's account of one save: how long the trainer stalled (metrics and status)."""
        self._require_hello(session)
        if not (names.is_seconds(r.stall_s, MAX_REPORT_S) and names.is_seconds(r.fence_s, MAX_REPORT_S)):
            raise RequestError("report: stall_s and fence_s must be finite, non-negative seconds")
        if not names.is_step(r.step):
            raise RequestError(f"report: step must be a step number (0..{names.MAX_STEP - 1})")
        stall, fence = float(r.stall_s), float(r.fence_s)
        session.last_report = {"step": r.step, "stall_s": stall, "fence_s": fence}
        self.d.metrics.client_report(stall, fence)
        log.debug("report", extra={"ctx": {"job": session.job, "rank": session.rank, "step": r.step,
                                           "stall_s": stall, "fence_s": fence}})
        return {"step": r.step}, []


def commit_digests(wire: dict[str, Any]) -> dict[int, str]:
    """A COMMIT's ``digests``: rank numbers as JSON writes them (decimal, no sign, no leading zero,
    nothing around) to manifest digests, as ints to strings; RequestError for anything else, before
    the step is looked up. (``int()`` alone takes " 1", "1_0" and "01" as ranks: two spellings of one
    rank would collapse into one entry.)"""
    keys = list(wire)
    try:
        ranks = list(map(int, keys))
    except ValueError:
        ranks = None
    if ranks is None or list(map(str, ranks)) != keys or min(ranks, default=0) < 0 \
            or not names.are_digests(list(wire.values())):
        raise RequestError("digests must map rank numbers (decimal JSON keys) to manifest digests "
                           "(sha256: and 64 lower-case hex digits)")
    return dict(zip(ranks, wire.values(), strict=True))
