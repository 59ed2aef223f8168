"""The daemon: its lifecycle, and the op table that routes each request to one handler.

Everything with state lives in a room below: sessions (session.py), slot memory
(slot_pool.py), steps and the commit rule (steps/), storage (tiers/). This module
binds the socket, accepts connections, runs the periodic loops, wires the rooms together,
and on stop drains, closes and awaits everything it started before it returns.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd import __version__
from ckptd.core import names, protocol
from ckptd.core.errors import ErrorCode, FormatError
from ckptd.core.protocol import Abort, Commit, CommitMode, Hello, Info, MemoryFetch, Report, Resize, Save, Status
from ckptd.core.rank_record import parse_records
from ckptd.core.schema import parse_layout
from ckptd.daemon.runtime import RequestError, TaskSet, bounded, describe_error
from ckptd.daemon.service import systemd
from ckptd.daemon.service.allocator import release_free_memory
from ckptd.daemon.service.metrics import DaemonMetrics
from ckptd.daemon.service.root_check import check_root
from ckptd.daemon.service.snapshot import DaemonSnapshot
from ckptd.daemon.service.unix_socket import bind_socket
from ckptd.daemon.session import Session, peer_allowed, peer_of, refuse
from ckptd.daemon.settings.config import DaemonConfig
from ckptd.daemon.slot_pool import SlotPool
from ckptd.daemon.steps.coordinator import StepCoordinator
from ckptd.daemon.streamed import StreamedShard, check_stream
from ckptd.daemon.tiers.base import ShardRef, ShardWritten
from ckptd.daemon.tiers.fs.commit import CommitError
from ckptd.daemon.tiers.fs.scheduler import Retention
from ckptd.daemon.tiers.fs.tier import FsTier
from ckptd.daemon.tiers.memory.service import MemoryService
from ckptd.daemon.tiers.s3.service import BucketService, bucket_ops

__all__ = ["Daemon", "describe_error"]

log = logging.getLogger("ckptd")
IDLE_TRIM_S = 0.5        # no shard became durable for this long: free heap pages go back to the kernel

Reply = tuple[dict[str, Any], list[int]]          # reply fields, memfds to pass with it


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.root = os.path.abspath(config.root)
        self.socket_path = config.socket_path         # the one served (socket activation may pass another)
        self.draining = False
        self.unfinished: list[str] = []               # saves a drain could not finish
        self.sessions: set[Session] = set()
        self.tasks = TaskSet()                        # connections, loops, retention passes
        self.events = TaskSet()                       # events on their way to clients
        self.io_pool = ThreadPoolExecutor(max(4, config.threads), thread_name_prefix="ckptd-io")
        self.tier = FsTier(self.root, config.write, config.threads, self.io_pool)
        self.slots = SlotPool(config.slot_memory_limit, self.io_pool)
        self.metrics = DaemonMetrics(self.snapshot)
        self.memory = MemoryService(config, self.tier, self.root, self.io_pool)   # memory tier, peer copies
        self.steps: StepCoordinator[Session] = StepCoordinator(
            self.memory.tier, Session.event, step_timeout=config.step_timeout,
            on_durable=self._durable, on_committed=self._committed, withdraw_commits=self.tier.withdraw_commits)
        self.s3 = BucketService.create(config, self.root, self.tasks, self.metrics.registry)   # None: no bucket
        self.retention = Retention(self.tier, config.retention, self.tasks, lambda job: self.steps.open_steps(job)
                                   + (self.s3.pending(job) if self.s3 else []), self.metrics.gc_done)
        self.notifier = systemd.Notifier()
        self.requests = Requests(self)
        self._stopped: asyncio.Event | None = None
        self._trim: asyncio.TimerHandle | None = None

    @property
    def stats(self) -> dict[str, int]:
        return self.steps.counters().as_dict()

    def snapshot(self) -> DaemonSnapshot:
        """What status and metrics show (also called from the metrics HTTP thread: copies only)."""
        views = [s.view() for s in list(self.sessions)]
        address = self.metrics.address
        return DaemonSnapshot(
            root=self.root, socket=self.socket_path, pid=os.getpid(), version=__version__, draining=self.draining,
            counters=self.steps.counters(), sessions=tuple(v for v in views if v is not None),
            steps=self.steps.step_views(), shard_writes=self.steps.shard_views(),
            slot_bytes_in_use=self.slots.in_use, slot_memory_limit=self.slots.limit,
            last_committed=dict(self.steps.last_committed),
            metrics_address=f"{address[0]}:{address[1]}" if address else None, memory=self.memory.view())

    def _durable(self, result: ShardWritten) -> None:
        self.metrics.shard_durable(result.raw_bytes, result.stored_bytes, result.seconds)
        if self._trim is not None:
            self._trim.cancel()
        self._trim = asyncio.get_running_loop().call_later(IDLE_TRIM_S, self._trim_when_idle)

    def _trim_when_idle(self) -> None:
        """No shard written for a while: the codec's freed buffers go back to the kernel."""
        self._trim = None
        if not self.steps.shard_views():
            self.io_pool.submit(release_free_memory)

    def _committed(self, job: str, step: int, latency_s: float) -> None:
        self.metrics.step_committed(latency_s)
        self.retention.schedule(job)
        if self.s3:
            self.s3.committed(job, step)

    # ---- lifecycle -------------------------------------------------------

    async def serve(self, listen_sock: socket.socket | None = None) -> None:
        """Serve until stop(); then drain in-flight writes for up to ``drain_grace`` seconds."""
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        check_root(self.root, create=True)      # before "serving": a save must not be the first write
        if self.config.metrics_address is not None:
            host, port = self.metrics.serve(self.config.metrics_address)
            log.info("metrics", extra={"ctx": {"address": f"{host}:{port}", "path": "/metrics"}})
        sock = listen_sock or bind_socket(self.config.socket_path, self.config.socket_mode, self.config.socket_group)
        await self.memory.start()
        if listen_sock is not None:
            self.socket_path = systemd.socket_path(listen_sock)
            if self.socket_path != self.config.socket_path:
                log.warning("serving the socket systemd passed, not the configured one",
                            extra={"ctx": {"socket": self.socket_path, "configured": self.config.socket_path}})
        sock.setblocking(False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop)
            except (RuntimeError, ValueError):
                pass
        log.info("serving", extra={"ctx": {"socket": self.socket_path, "root": self.root,
                                          "threads": self.config.threads, "codec": self.config.write.codec,
                                          "socket_activated": listen_sock is not None, "pid": os.getpid()}})
        accept = self.tasks.spawn(self._accept_loop(sock), "accept loop")
        sweeper = self.tasks.spawn(self._sweep_loop(), "step timeout sweep")
        notifier = self.tasks.spawn(self._notify_loop(), "systemd notify loop")
        if self.s3:
            self.s3.start()
        self.notifier.ready(self.snapshot().status_line())
        try:
            await self._stopped.wait()
            accept.cancel()
            sweeper.cancel()
            self.notifier.stopping(f"draining {len(self.steps.writes)} saves in flight",
                                   extend_s=self.config.drain_grace + 30)
            t_drain = loop.time()
            await self.drain()
            if self.s3:          # the newest committed step gets what is left of the grace to reach the bucket
                await self.s3.finish(self.config.drain_grace - (loop.time() - t_drain))
            await self.events.wait(5)       # committed/failed events of the drain reach their clients
            notifier.cancel()
            for s in list(self.sessions):
                s.close()
            # Every task started ends here, its exception logged, before the loop goes away. (Every
            # commit's outcome is final by now and told: drain settled each, see StepCoordinator.drain.)
            for tasks in (self.tasks, self.steps.writes, self.steps.commits, self.steps.removals, self.events):
                await tasks.cancel_all()
        finally:
            sock.close()
            await self.memory.stop()
            self.metrics.close()
            self.notifier.close()
            if listen_sock is None:
                try:
                    os.unlink(self.config.socket_path)
                except FileNotFoundError:
                    pass
            self.tier.close()
            self.memory.close()
            if self._trim is not None:
                self._trim.cancel()
            self.io_pool.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        self.draining = True
        self.retention.stop()
        if self._stopped is not None:
            self._stopped.set()

    async def drain(self) -> None:
        """After stop(): in-flight saves get ``drain_grace`` seconds to become durable and commit
        (StepCoordinator.drain); what is not done by then is reported in ``self.unfinished``. When
        this returns, every step's outcome is final and its clients are being told: no index.json
        appears later, whatever threads are left (the caller may exit without waiting for them)."""
        self.unfinished = await self.steps.drain(self.config.drain_grace)

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:        # EMFILE, ECONNABORTED, ...: keep accepting, gently
                log.warning("accept failed", extra={"ctx": {"error": describe_error(e)}})
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            self.tasks.spawn(self._serve_connection(conn), "connection")

    async def _notify_loop(self) -> None:
        """WATCHDOG=1 every half of WATCHDOG_USEC (from the event loop: a wedged loop misses it); STATUS."""
        interval = self.notifier.watchdog_interval
        last_status = None
        while True:
            if interval:
                self.notifier.watchdog()
            line = self.snapshot().status_line()
            if line != last_status:
                self.notifier.status(line)
                last_status = line
            await asyncio.sleep(min(interval or 5.0, 5.0))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.steps.expire()

    async def _serve_connection(self, sock: socket.socket) -> None:
        try:
            peer = peer_of(sock)
        except OSError as e:            # gone before we looked
            log.info("connection lost", extra={"ctx": {"error": describe_error(e)}})
            sock.close()
            return
        if not peer_allowed(peer, self.config.allowed_uids, self.config.allowed_gids):
            self.metrics.peers_refused.inc()
            log.warning("refused peer", extra={"ctx": {"pid": peer.pid, "uid": peer.uid, "gid": peer.gid,
                                                      "groups": list(peer.groups)}})
            await refuse(sock, peer, f"uid {peer.uid} / gid {peer.gid} is not allowed to use this ckptd daemon "
                                     f"(not in its allowed_users / allowed_groups)")
            return
        session = Session(sock, peer, self.events)
        self.sessions.add(session)
        try:
            await session.serve(self.requests.dispatch)
        finally:
            self.sessions.discard(session)
            self.memory.release(session)
            self.slots.release(session.slots)
            session.slots = []
            session.close()
            await self.steps.waiter_lost(session)


class Requests:
    """The op table: one handler per request type, each returning (reply fields, memfds)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.table: dict[type, Callable[[Session, Any], Awaitable[Reply]]] = {
            Hello: self.hello, Resize: self.resize, Save: self.save, Commit: self.commit, Abort: self.abort,
            Report: self.report, Info: self.info, Status: self.status, MemoryFetch: daemon.memory.fetch,
            protocol.Reclaim: self.reclaim, protocol.SavePart: self.save_part,
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
        return {"root": self.d.root, "version": __version__, "pid": os.getpid()}

    async def info(self, session: Session, _: Info) -> Reply:
        return self._identity(), []

    async def status(self, session: Session, _: Status) -> Reply:
        snap = self.d.snapshot()
        tier = self.d.tier
        progress = {(w.job, w.step, w.rank): await tier.written_bytes(ShardRef(w.job, w.step, w.rank, w.world_size))
                    for w in snap.shard_writes}
        latest = {job: await tier.latest_committed(job) for job in snap.jobs()}
        return {**snap.status(progress, latest), **({"uploads": self.d.s3.status()} if self.d.s3 else {})}, []

    async def hello(self, session: Session, h: Hello) -> Reply:
        if session.job is not None:
            raise RequestError("hello sent twice on one connection")
        job = names.validate_job(h.job)
        if not names.is_rank(h.rank, h.world_size):
            raise RequestError(f"bad rank {h.rank} / world size {h.world_size}")
        session.job, session.rank, session.world_size = job, h.rank, h.world_size
        try:
            session.slots, fds = await self.d.slots.allocate(f"ckptd-{job}-r{h.rank}", h.slot_bytes, h.num_slots,
                                                             lambda: session.closed)
        except RequestError:
            session.job, session.rank, session.world_size = None, -1, 0   # the hello did not happen
            raise
        log.info("session", extra={"ctx": {**session.ctx(), "world_size": session.world_size, "slots": len(fds),
                                          "slot_bytes": h.slot_bytes}})
        return {**self._identity(), "slots": [s.size for s in session.slots]}, fds

    async def resize(self, session: Session, r: Resize) -> Reply:
        job = self._require_hello(session)
        if any(s.busy and not s.lent for s in session.slots):
            raise RequestError("cannot resize slots while a save still holds one")
        self.d.slots.release(session.slots)
        session.slots = []
        session.slots, fds = await self.d.slots.allocate(f"ckptd-{job}-r{session.rank}", r.slot_bytes, r.num_slots,
                                                         lambda: session.closed)
        return {"slots": [s.size for s in session.slots]}, fds

    async def save(self, session: Session, s: Save) -> Reply:
        job = self._require_hello(session)
        if self.d.draining:
            raise RequestError("daemon is shutting down; no new saves")
        if s.commit not in protocol.COMMIT_MODES:
            raise RequestError(f"commit mode must be one of {protocol.COMMIT_MODES}")
        slot = session.idle_slot(s.slot)
        stream = None if s.stream is None else StreamedShard(   # the shard comes in parts (save_part)
            *check_stream(s.stream, slot.size), slot, session.slot_free, asyncio.get_running_loop(),
            self.d.config.step_timeout)
        layout = parse_layout(s.tensors, slot.size if stream is None else stream.total)
        names.check_tree_depth(s.tree)
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

    async def commit(self, session: Session, c: Commit) -> Reply:
        job = self._require_hello(session)
        st = self.d.steps.leader_step(job, c.step, session.rank)
        try:
            digests = {int(r): d for r, d in c.digests.items() if isinstance(d, str)}
        except ValueError:
            raise RequestError("digests must map rank numbers to strings") from None
        records = None
        if c.records is not None:
            if not (isinstance(c.records, list) and len(c.records) == st.world_size):
                raise RequestError(f"records must list all {st.world_size} ranks in order")
            records = await asyncio.get_running_loop().run_in_executor(self.d.io_pool, parse_records, c.records)
        await self.d.steps.commit(st, digests, records)
        return {"step": c.step}, []

    async def abort(self, session: Session, a: Abort) -> Reply:
        job = self._require_hello(session)
        await self.d.steps.abort(job, a.step, session.rank, a.reason)
        return {"step": a.step}, []

    async def reclaim(self, session: Session, _: protocol.Reclaim) -> Reply:
        """The trainer has no slot to fill: the memory tier keeps every one (``Session.kept_slots``)."""
        self._require_hello(session)
        return {"freed": self.d.memory.reclaim(session.kept_slots())}, []

    async def report(self, session: Session, r: Report) -> Reply:
        """A client's account of one save: how long the trainer stalled (metrics and status)."""
        self._require_hello(session)
        try:
            stall, fence = float(r.stall_s), float(r.fence_s)
        except OverflowError:    # an int beyond any float (JSON ints are unbounded)
            stall = fence = math.inf
        if not (math.isfinite(stall) and math.isfinite(fence) and 0 <= stall < 1e6 and 0 <= fence < 1e6):
            raise RequestError("report: stall_s and fence_s must be finite, non-negative seconds")
        session.last_report = {"step": r.step, "stall_s": stall, "fence_s": fence}
        self.d.metrics.client_report(stall, fence)
        log.debug("report", extra={"ctx": {"job": session.job, "rank": session.rank, "step": r.step,
                                           "stall_s": stall, "fence_s": fence}})
        return {"step": r.step}, []

