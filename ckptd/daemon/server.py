"""The daemon: an asyncio (uvloop) server of sessions, shared-memory slots and step writes.

One session per client connection (one trainer rank). Slots are memfds the daemon
creates, pre-faults and hands to the client with SCM_RIGHTS; they are anonymous, so
only the two processes holding the descriptor can see them, and the kernel frees them
when both are gone — a crashed trainer or daemon leaks no shared memory.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import math
import mmap
import os
import signal
import socket
import stat
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptd import __version__

from ckptd.core import names, protocol

from ckptd.daemon import retention

from ckptd.daemon import systemd
from ckptd.daemon.commit import CommitError, CommitTracker, PendingStep, write_index
from ckptd.core.schema import DTYPE_ITEMSIZE, validate_shape
from ckptd.core.errors import FormatError
from ckptd.core.names import INDEX_NAME, job_dir, rank_data_name, step_dir
from ckptd.core.reader import latest_committed
from ckptd.daemon.metrics import DaemonMetrics
from ckptd.core.errors import ProtocolError
from ckptd.core.schema import TensorLayout
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.writer import remove_rank_files, write_shard

log = logging.getLogger("ckptd")

MAX_SLOTS = 8


def tune_allocator() -> None:
    """Keep glibc from returning (and re-faulting) the daemon's chunk buffers on every chunk.

    Encoded chunks are a few MiB each: by default glibc mmaps and unmaps such buffers, so each
    is fresh memory faulted in page by page. Raising the mmap and trim thresholds made encoding
    25-30 % faster here; the cost is that the daemon keeps freed memory for reuse."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 64 * 1024 * 1024)
    mallopt(M_TRIM_THRESHOLD, 256 * 1024 * 1024)


def allocate_slots(name: str, size: int, count: int) -> list[tuple[int, mmap.mmap]]:
    """(memfd, read-only mapping) for each slot, pages allocated and mapped up front.

    First touch of fresh shared memory is ~15x slower than a warm copy: it must be paid here,
    once per session, not on the trainer's first save or the daemon's first read."""
    made: list[tuple[int, mmap.mmap]] = []
    try:
        for i in range(count):
            fd = os.memfd_create(f"{name}-s{i}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
            except BaseException:
                os.close(fd)
                raise
            made.append((fd, mm))
    except BaseException:
        for fd, mm in made:
            os.close(fd)
            mm.close()
        raise
    return made


@dataclass(eq=False)
class Slot:
    index: int
    size: int
    view: memoryview
    mm: mmap.mmap
    busy: bool = False

    def close(self) -> None:
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a slice is still alive in a writer thread; the mapping goes when it is collected


@dataclass(eq=False)
class Session:
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    job: str | None = None
    rank: int = -1
    world_size: int = 0
    slots: list[Slot] = field(default_factory=list)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    saves: int = 0
    last_report: dict[str, Any] | None = None     # the client's latest report {step, stall_s, fence_s}

    def describe(self) -> str:
        return f"job={self.job} rank={self.rank} pid={self.pid} uid={self.uid}"

    def ctx(self) -> dict[str, Any]:
        """Structured-log fields of this peer."""
        return {"job": self.job, "rank": self.rank, "pid": self.pid, "uid": self.uid}


def _bounded(reason: str, limit: int = 2000) -> str:
    """Error text sent back or logged: a hostile request must not make it unbounded."""
    return reason if len(reason) <= limit else reason[:limit] + f"... ({len(reason)} chars)"


class RequestError(Exception):
    """A well-formed request that cannot be served; the connection stays open."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)   # Linux >= 4.13


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """Supplementary groups of the peer at connect time (SO_PEERGROUPS); () when unavailable."""
    try:
        data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    except OSError:
        return ()
    return struct.unpack(f"{len(data) // 4}I", data[: len(data) // 4 * 4])


def describe_error(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}" + (f" ({e.filename})" if e.filename else "")
    return f"{type(e).__name__}: {e}"


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.root = os.path.abspath(config.root)
        self.tracker = CommitTracker(config.step_timeout)
        self.sessions: set[Session] = set()
        self.slot_bytes_in_use = 0
        self.codec_pool = ThreadPoolExecutor(config.threads, thread_name_prefix="ckptd-codec")
        self.io_pool = ThreadPoolExecutor(max(4, config.threads), thread_name_prefix="ckptd-io")
        self.writes: set[asyncio.Task] = set()
        self.draining = False
        self.stats = {"saves_started": 0, "saves_durable": 0, "saves_failed": 0, "steps_committed": 0,
                      "steps_failed": 0, "bytes_raw": 0, "bytes_stored": 0}
        self._server_sock: socket.socket | None = None
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics = DaemonMetrics(self)
        self.notifier = systemd.Notifier()
        self.socket_path = config.socket_path         # the one served (socket activation may pass another)
        self.last_committed: dict[str, dict[str, Any]] = {}   # job → {"step", "unix"} committed here
        self.shard_writes: dict[tuple[str, int, int], dict[str, Any]] = {}  # (job, step, rank) → progress
        self.unfinished: list[str] = []               # saves a drain could not finish
        self._events: set[asyncio.Future] = set()
        self._gc_tasks: dict[str, asyncio.Task] = {}
        self._gc_again: set[str] = set()

    # ---- lifecycle -------------------------------------------------------

    def bind(self) -> socket.socket:
        """Bind the listening socket with a restrictive mode (replacing a stale socket file)."""
        path = self.config.socket_path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                raise RuntimeError(f"another daemon is already serving {path}")
            except (ConnectionRefusedError, FileNotFoundError):
                os.unlink(path)
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~self.config.socket_mode)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, self.config.socket_mode)
        if self.config.socket_group is not None:
            try:
                os.chown(path, -1, self.config.socket_group)
            except OSError as e:
                sock.close()
                os.unlink(path)
                raise RuntimeError(f"cannot give {path} to group {self.config.socket_group}: {e.strerror}") from None
        sock.listen(1024)
        return sock

    async def serve(self, listen_sock: socket.socket | None = None) -> None:
        """Serve until stop(); then drain in-flight writes for up to ``drain_grace`` seconds."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        os.makedirs(self.root, exist_ok=True)
        if self.config.metrics_address is not None:
            host, port = self.metrics.serve(self.config.metrics_address)
            log.info("metrics", extra={"ctx": {"address": f"{host}:{port}", "path": "/metrics"}})
        sock = listen_sock or self.bind()
        if listen_sock is not None:
            self.socket_path = systemd.socket_path(listen_sock)
            if self.socket_path != self.config.socket_path:
                log.warning("serving the socket systemd passed, not the configured one",
                            extra={"ctx": {"socket": self.socket_path, "configured": self.config.socket_path}})
        sock.setblocking(False)
        self._server_sock = sock
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._loop.add_signal_handler(sig, self.stop)
            except (RuntimeError, ValueError):
                pass
        log.info("serving", extra={"ctx": {"socket": self.socket_path, "root": self.root,
                                          "threads": self.config.threads, "codec": self.config.write.codec,
                                          "socket_activated": listen_sock is not None,
                                          "pid": os.getpid()}})
        accept = asyncio.ensure_future(self._accept_loop(sock))
        sweeper = asyncio.ensure_future(self._sweep_loop())
        notifier = asyncio.ensure_future(self._notify_loop())
        self.notifier.ready(self.status_line())
        await self._stopped.wait()
        accept.cancel()
        sweeper.cancel()
        self.notifier.stopping(f"draining {len(self.writes)} saves in flight",
                               extend_s=self.config.drain_grace + 30)
        await self.drain()
        # Let committed/failed events scheduled by the drain reach their clients.
        if self._events:
            await asyncio.wait(set(self._events), timeout=5)
        notifier.cancel()
        for task in list(self._gc_tasks.values()):
            task.cancel()
        for s in list(self.sessions):
            self._close_session(s)
        sock.close()
        self.metrics.close()
        self.notifier.close()
        if listen_sock is None:
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass
        self.codec_pool.shutdown(wait=False, cancel_futures=True)
        self.io_pool.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        self.draining = True
        if self._stopped is not None:
            self._stopped.set()

    async def drain(self) -> None:
        """After stop(): in-flight saves get ``drain_grace`` seconds to become durable and commit.

        New saves are refused meanwhile. A relayed step whose rank 0 is durable here also gets
        the grace for its COMMIT to arrive. Whatever is not done by then is reported (log,
        ``failed`` events, ``self.unfinished``) and left uncommitted.
        """
        deadline = time.monotonic() + self.config.drain_grace
        if self.writes:
            log.info("draining", extra={"ctx": {"in_flight": len(self.writes),
                                               "grace_s": self.config.drain_grace}})
            _, pending = await asyncio.wait(set(self.writes), timeout=self.config.drain_grace)
            if pending:
                self.unfinished = [f"job={w['job']} step={w['step']} rank={w['rank']}"
                                   for w in self.shard_writes.values()]
                for task in pending:
                    task.cancel()
                # The writer threads of unfinished saves cannot be interrupted; cleanup gets fresh
                # threads, and the process exits without waiting for them (cli.cmd_serve).
                self.io_pool.shutdown(wait=False, cancel_futures=True)
                self.io_pool = ThreadPoolExecutor(2, thread_name_prefix="ckptd-cleanup")
                log.error("drain timed out; these saves are left uncommitted",
                          extra={"ctx": {"grace_s": self.config.drain_grace, "unfinished": self.unfinished}})
        def awaiting_commit() -> bool:
            return any(ps.committing or (ps.mode == "relay" and 0 in ps.durable and 0 in ps.waiters)
                       for ps in self.tracker.steps.values())
        while not self.unfinished and awaiting_commit() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # Steps still open (waiting for ranks that never came) stay uncommitted.
        for ps in list(self.tracker.steps.values()):
            if not ps.committing:
                await self._fail_step(ps, "daemon shut down before every rank was durable")

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(sock)
            conn.setblocking(False)
            asyncio.ensure_future(self._serve_connection(conn))

    def status_line(self) -> str:
        sessions = sum(1 for s in self.sessions if s.job is not None)
        last = ", ".join(f"{j}@{v['step']}" for j, v in sorted(self.last_committed.items())[:4])
        return (f"{'draining; ' if self.draining else ''}{sessions} ranks connected, {len(self.writes)} saves "
                f"in flight, {self.stats['steps_committed']} steps committed" + (f" (last {last})" if last else ""))

    async def _notify_loop(self) -> None:
        """WATCHDOG=1 every half of WATCHDOG_USEC (from the event loop: a wedged loop misses it); STATUS."""
        interval = self.notifier.watchdog_interval
        last_status = None
        while True:
            if interval:
                self.notifier.watchdog()
            line = self.status_line()
            if line != last_status:
                self.notifier.status(line)
                last_status = line
            await asyncio.sleep(min(interval or 5.0, 5.0))

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for ps in self.tracker.expired(time.monotonic()):
                try:
                    await self._fail_step(ps, f"timed out after {self.config.step_timeout:g}s waiting for ranks "
                                              f"{self.tracker.ranks_missing(ps)} to be durable")
                except Exception:  # one bad step must not stop every later timeout
                    log.exception("failing a timed-out step failed", extra={"ctx": {"job": ps.job, "step": ps.step}})

    # ---- connections -------------------------------------------------------

    async def _serve_connection(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        pid, uid, gid = peer_credentials(sock)
        session = Session(sock, pid, uid, gid)
        groups = peer_groups(sock)
        if not self._peer_allowed(uid, gid, groups):
            self.metrics.peers_refused.inc()
            log.warning("refused peer", extra={"ctx": {"pid": pid, "uid": uid, "gid": gid, "groups": list(groups)}})
            # Answer the peer's first request (so its client matches the refusal to it) rather than
            # closing at once, which can turn into EPIPE on its send and hide the reason.
            req = await self._first_req(loop, sock)
            await self._send(session, {"op": "error", "req": req, "fatal": True, "reason":
                                       f"uid {uid} / gid {gid} is not allowed to use this ckptd daemon "
                                       f"(not in its allowed_users / allowed_groups)"})
            sock.close()
            return
        self.sessions.add(session)
        try:
            while True:
                try:
                    msg = await protocol.read_frame_async(loop, sock)
                    if msg is None:
                        break
                    protocol.check_request(msg)
                except ProtocolError as e:
                    reason = _bounded(f"protocol error: {e}")
                    log.warning("protocol error", extra={"ctx": {**session.ctx(), "error": reason}})
                    await self._send(session, {"op": "error", "req": 0, "reason": reason, "fatal": True})
                    break
                await self._dispatch(session, msg)
        except (ConnectionError, OSError) as e:
            log.info("connection lost", extra={"ctx": {**session.ctx(), "error": str(e)}})
        finally:
            await self._session_lost(session)

    @staticmethod
    async def _first_req(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> int:
        """The ``req`` of a refused peer's first (small) request, read within 5 s; else 0."""
        async def read() -> int:
            header = await protocol.recv_exact_async(loop, sock, protocol.HEADER.size)
            if header is None:
                return 0
            length = protocol.parse_header(header)
            if length > 64 * 1024:          # a refused peer gets no big buffer out of us
                return 0
            body = await protocol.recv_exact_async(loop, sock, length)
            req = protocol.decode_body(body or b"").get("req")
            return req if type(req) is int else 0
        try:
            return await asyncio.wait_for(read(), 5.0)
        except (asyncio.TimeoutError, ProtocolError, OSError):
            return 0

    def _peer_allowed(self, uid: int, gid: int, groups: tuple[int, ...] = ()) -> bool:
        c = self.config
        if c.allowed_uids is None and c.allowed_gids is None:
            return True
        if uid == 0 or uid == os.getuid():
            return True
        return (c.allowed_uids is not None and uid in c.allowed_uids) or \
               (c.allowed_gids is not None and (gid in c.allowed_gids or not c.allowed_gids.isdisjoint(groups)))

    async def _send(self, session: Session, msg: dict[str, Any], fds: list[int] = ()) -> None:
        if session.closed:
            return
        try:
            async with session.send_lock:
                await protocol.send_frame_async(asyncio.get_running_loop(), session.sock, msg, fds)
        except OSError:
            session.closed = True

    def _event(self, session: Session, msg: dict[str, Any]) -> None:
        fut = asyncio.ensure_future(self._send(session, msg))
        self._events.add(fut)
        fut.add_done_callback(self._events.discard)

    async def _dispatch(self, session: Session, msg: dict[str, Any]) -> None:
        op, req = msg["op"], msg["req"]
        handler = getattr(self, f"_op_{op}", None)
        try:
            if handler is None:
                raise RequestError(f"op {op!r} is not served by this daemon")
            reply, fds = await handler(session, msg)
        except (RequestError, CommitError, FormatError, ValueError) as e:
            await self._send(session, {"op": "error", "req": req, "reason": _bounded(str(e))})
            return
        except Exception as e:  # a daemon bug: answer, log it loudly, keep the connection and the daemon
            log.exception("request failed", extra={"ctx": {**session.ctx(), "op": op}})
            await self._send(session, {"op": "error", "req": req,
                                       "reason": _bounded(f"internal daemon error in {op}: {describe_error(e)}")})
            return
        await self._send(session, {"op": "ok", "req": req, **reply}, fds)
        for fd in fds:
            os.close(fd)

    # ---- requests ----------------------------------------------------------

    async def _op_info(self, session: Session, msg: dict[str, Any]) -> tuple[dict, list]:
        return {"root": self.root, "version": __version__, "pid": os.getpid()}, []

    async def _op_status(self, session: Session, msg: dict[str, Any]) -> tuple[dict, list]:
        sessions = [{"job": s.job, "rank": s.rank, "world_size": s.world_size, "pid": s.pid, "uid": s.uid,
                     "slots": len(s.slots), "busy_slots": sum(sl.busy for sl in s.slots), "saves": s.saves,
                     "last_report": s.last_report}
                    for s in self.sessions if s.job is not None]
        steps = [{"job": ps.job, "step": ps.step, "world_size": ps.world_size, "mode": ps.mode,
                  "writing": sorted(ps.writing), "durable": sorted(ps.durable),
                  "age_s": round(time.monotonic() - ps.started, 3)} for ps in self.tracker.steps.values()]
        jobs = sorted({s["job"] for s in sessions} | {p["job"] for p in steps} | set(self.last_committed))
        saves, last = await asyncio.get_running_loop().run_in_executor(
            self.io_pool, self._progress_and_last, [dict(w) for w in self.shard_writes.values()], jobs)
        return {"root": self.root, "version": __version__, "pid": os.getpid(), "sessions": sessions,
                "steps": steps, "stats": dict(self.stats), "slot_bytes_in_use": self.slot_bytes_in_use,
                "slot_memory_limit": self.config.slot_memory_limit, "saves": saves, "last_committed": last,
                "socket": self.socket_path, "draining": self.draining,
                "metrics": (f"{self.metrics.address[0]}:{self.metrics.address[1]}"
                            if self.metrics.address else None)}, []

    def _progress_and_last(self, writes: list[dict[str, Any]], jobs: list[str]) -> tuple[list, dict]:
        """(I/O thread) Progress of shard writes in flight, and the newest committed step of each job."""
        now = time.monotonic()
        saves = []
        for w in writes:
            try:
                written = os.stat(w["data_path"]).st_size
            except OSError:
                written = 0
            saves.append({"job": w["job"], "step": w["step"], "rank": w["rank"], "raw_bytes": w["raw_bytes"],
                          "written_bytes": written, "elapsed_s": round(now - w["started"], 3)})
        last: dict[str, Any] = {}
        for job in jobs:
            mine = self.last_committed.get(job)
            try:
                info = latest_committed(job_dir(self.root, job))
            except (OSError, ValueError):
                info = None
            step = max([x for x in (info.step if info else None, mine["step"] if mine else None) if x is not None],
                       default=None)
            last[job] = {"step": step, "committed_here_unix": mine["unix"] if mine else None}
        return saves, last

    async def _op_report(self, session: Session, msg: dict[str, Any]) -> tuple[dict, list]:
        """A client's account of one save: how long the trainer stalled (metrics and status)."""
        self._require_session(session)
        try:
            stall, fence = float(msg["stall_s"]), float(msg["fence_s"])
        except OverflowError:    # an int beyond any float (JSON ints are unbounded)
            stall = fence = math.inf
        if not (math.isfinite(stall) and math.isfinite(fence) and 0 <= stall < 1e6 and 0 <= fence < 1e6):
            raise RequestError("report: stall_s and fence_s must be finite, non-negative seconds")
        session.last_report = {"step": msg["step"], "stall_s": stall, "fence_s": fence}
        self.metrics.client_report(stall, fence)
        log.debug("report", extra={"ctx": {"job": session.job, "rank": session.rank, "step": msg["step"],
                                           "stall_s": stall, "fence_s": fence}})
        return {"step": msg["step"]}, []

    async def _op_hello(self, session: Session, msg: dict[str, Any]) -> tuple[dict, list]:
        if session.job is not None:
            raise RequestError("hello sent twice on one connection")
        job = names.validate_job(msg["job"])
        rank, world_size = msg["rank"], msg["world_size"]
        if not (0 < world_size <= 1 << 20 and 0 <= rank < world_size):
            raise RequestError(f"bad rank {rank} / world size {world_size}")
        session.job, session.rank, session.world_size = job, rank, world_size
        try:
            fds = await self._make_slots(session, msg["slot_bytes"], msg["num_slots"])
        except RequestError:
            session.job, session.rank, session.world_size = None, -1, 0   # the hello did not happen
            raise
        log.info("session", extra={"ctx": {**session.ctx(), "world_size": session.world_size, "slots": len(fds),
                                          "slot_bytes": msg["slot_bytes"]}})
        return {"root": self.root, "version": __version__, "pid": os.getpid(),
                "slots": [s.size for s in session.slots]}, fds

    async def _op_resize(self, session: Session, msg: dict[str, Any]) -> tuple[dict, list]:
        self._require_session(session)
        if any(s.busy for s in session.slots):
            raise RequestError("cannot resize slots while a save still holds one")
        self._release_slots(session)
        fds = await self._make_slots(session, msg["slot_bytes"], msg.get("num_slots", 2))
        return {"slots": [s.size for s in session.slots]}, fds

    async def _make_slots(self, session: Session, slot_bytes: int, num_slots: int) -> list[int]:
        """Reserve the budget here, allocate on an I/O thread (GiBs of page allocation must not
        stall the event loop and every other client), then attach to the session."""
        if slot_bytes == 0:
            return []
        if not (0 < slot_bytes and type(num_slots) is int and 1 <= num_slots <= MAX_SLOTS):
            raise RequestError(f"bad slot request: {num_slots} slots of {slot_bytes} bytes (1-{MAX_SLOTS} slots)")
        page = mmap.PAGESIZE
        size = -(-slot_bytes // page) * page
        total = size * num_slots
        if self.slot_bytes_in_use + total > self.config.slot_memory_limit:
            raise RequestError(
                f"slot memory limit: {num_slots} x {size} bytes requested, {self.slot_bytes_in_use} of "
                f"{self.config.slot_memory_limit} bytes already in use (raise slot_memory_limit)")
        self.slot_bytes_in_use += total
        try:
            made = await asyncio.get_running_loop().run_in_executor(
                self.io_pool, allocate_slots, f"ckptd-{session.job}-r{session.rank}", size, num_slots)
        except OSError as e:
            self.slot_bytes_in_use -= total
            raise RequestError(f"cannot allocate shared-memory slots: {describe_error(e)}") from None
        if session.closed:                 # the client left while its slots were being made
            self.slot_bytes_in_use -= total
            for fd, mm in made:
                os.close(fd)
                mm.close()
            raise RequestError("connection closed while its slots were allocated")
        session.slots = [Slot(i, size, memoryview(mm), mm) for i, (_, mm) in enumerate(made)]
        return [fd for fd, _ in made]

    def _release_slots(self, session: Session) -> None:
        for s in session.slots:
            self.slot_bytes_in_use -= s.size
            if not s.busy:
                s.close()
        session.slots = []

    def _require_session(self, session: Session) -> None:
        if session.job is None:
            raise RequestError("send hello first")

    async def _op_save(self, session: Session, msg: dict[str, Any]) -> tuple[dict, list]:
        self._require_session(session)
        if self.draining:
            raise RequestError("daemon is shutting down; no new saves")
        step, slot_index, mode = msg["step"], msg["slot"], msg["commit"]
        if mode not in protocol.COMMIT_MODES:
            raise RequestError(f"commit mode must be one of {protocol.COMMIT_MODES}")
        if not 0 <= slot_index < len(session.slots):
            raise RequestError(f"no slot {slot_index}")
        slot = session.slots[slot_index]
        if slot.busy:
            raise RequestError(f"slot {slot_index} is still being written")
        layout = protocol.parse_layout(msg["tensors"], slot.size)
        names.check_tree_depth(msg["tree"])
        path = step_dir(self.root, session.job, step)
        if os.path.exists(os.path.join(path, INDEX_NAME)):
            raise RequestError(f"step {step} of job {session.job!r} is already committed")
        if (session.job, step, session.rank) in self.shard_writes:
            # An earlier save of this rank (its step abandoned, e.g. the trainer died) is still
            # writing the same files; a second writer would interleave with it and its cleanup.
            raise RequestError(f"rank {session.rank} of step {step} is still being written by an earlier, "
                               f"abandoned save; retry once it has stopped")
        ps = self.tracker.begin(session.job, step, session.rank, session.world_size, mode, path, session)
        slot.busy = True
        session.saves += 1
        self.stats["saves_started"] += 1
        task = asyncio.ensure_future(self._write(session, slot, ps, layout, msg["tree"]))
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)
        key = (session.job, step, session.rank)
        self.shard_writes[key] = {"job": session.job, "step": step, "rank": session.rank, "started": time.monotonic(),
                                  "raw_bytes": sum(t.nbytes for t in layout),
                                  "data_path": os.path.join(path, rank_data_name(session.rank))}
        task.add_done_callback(lambda _t, k=key: self.shard_writes.pop(k, None))
        return {"step": step}, []

    async def _op_commit(self, session: Session, msg: dict[str, Any]) -> tuple[dict, list]:
        self._require_session(session)
        step = msg["step"]
        ps = self.tracker.get(session.job, step)
        if session.rank != 0 or ps is None or ps.mode != "relay":
            raise RequestError(f"no relayed step {step} awaiting commit from rank 0 here")
        if 0 not in ps.durable or ps.committing:
            raise RequestError(f"step {step}: rank 0 is not durable yet or the step is already committing")
        try:
            digests = {int(r): d for r, d in msg["digests"].items() if isinstance(d, str)}
        except ValueError:
            raise RequestError("digests must map rank numbers to strings") from None
        ps.committing = True
        await self._commit(ps, digests)
        return {"step": step}, []

    async def _op_abort(self, session: Session, msg: dict[str, Any]) -> tuple[dict, list]:
        self._require_session(session)
        ps = self.tracker.get(session.job, msg["step"])
        if ps is not None and not ps.committing:
            await self._fail_step(ps, f"aborted by rank {session.rank}: {msg['reason'][:500]}")
        return {"step": msg["step"]}, []

    # ---- writes and commits ------------------------------------------------

    async def _write(self, session: Session, slot: Slot, ps: PendingStep, layout: list[TensorLayout],
                     tree: Any) -> None:
        loop = asyncio.get_running_loop()
        rank = session.rank
        key = (ps.job, ps.step, rank)

        def slot_released() -> None:
            loop.call_soon_threadsafe(self._slot_released, session, slot)

        cfg = self.config
        log.info("writing", extra={"ctx": {"job": ps.job, "step": ps.step, "rank": rank,
                                          "bytes": sum(t.nbytes for t in layout)}})
        try:
            result = await loop.run_in_executor(
                self.io_pool, write_shard, ps.step_path, ps.job, ps.step, rank, ps.world_size, slot.view,
                layout, tree, cfg.write, self.codec_pool, 2 * cfg.threads + 2, slot_released,
                lambda: self.tracker.get(ps.job, ps.step) is not ps)
        except Exception as e:
            self.stats["saves_failed"] += 1
            if self.tracker.get(ps.job, ps.step) is not ps:
                # Abandoned meanwhile (WriteAbandoned, or failed anyway): the writer removed its own
                # files; drop the step directory if that left it empty.
                log.info("write stopped", extra={"ctx": {"job": ps.job, "step": ps.step, "rank": rank,
                                                         "error": describe_error(e)}})
                await loop.run_in_executor(self.io_pool, self._remove_uncommitted, ps.step_path, [])
                return
            reason = f"rank {rank} shard write failed: {describe_error(e)}"
            log.error("write failed", extra={"ctx": {"job": ps.job, "step": ps.step, "rank": rank, "error": reason}})
            self.shard_writes.pop(key, None)   # its files are gone: a retry told of the failure may start
            await self._fail_step(ps, reason)
            return
        self.stats["saves_durable"] += 1
        self.stats["bytes_raw"] += result.manifest.raw_bytes
        self.stats["bytes_stored"] += result.manifest.stored_bytes
        self.metrics.shard_durable(result.manifest.raw_bytes, result.manifest.stored_bytes, result.seconds)
        log.info("durable", extra={"ctx": {"job": ps.job, "step": ps.step, "rank": rank,
                                          "raw_bytes": result.manifest.raw_bytes,
                                          "stored_bytes": result.manifest.stored_bytes,
                                          "write_s": round(result.seconds, 6)}})
        if self.tracker.get(ps.job, ps.step) is not ps:
            # The step failed (another rank, a timeout) while this shard was written.
            await loop.run_in_executor(self.io_pool, self._remove_uncommitted, ps.step_path, [rank])
            return
        self.shard_writes.pop(key, None)       # before any event: the client may act on it at once
        commit_now = self.tracker.mark_durable(ps, rank, result.digest)
        await self._send(session, {"op": "durable", "step": ps.step, "rank": rank, "digest": result.digest,
                                   "raw_bytes": result.manifest.raw_bytes,
                                   "stored_bytes": result.manifest.stored_bytes,
                                   "write_s": round(result.seconds, 6)})
        if ps.mode == "relay" and rank != 0:
            ps.waiters.pop(rank, None)     # rank 0's client gathers the rest through the store
            if not ps.writing and 0 not in ps.waiters:
                self.tracker.finish(ps)
        elif commit_now:
            await self._commit(ps, ps.durable)

    def _slot_released(self, session: Session, slot: Slot) -> None:
        slot.busy = False
        if slot not in session.slots:     # resized or session gone while writing
            slot.close()
            return
        self._event(session, {"op": "slot_free", "slot": slot.index})

    async def _commit(self, ps: PendingStep, digests: dict[int, str]) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:
            await loop.run_in_executor(self.io_pool, write_index, ps.step_path, ps.job, ps.step,
                                       ps.world_size, dict(digests))
        except Exception as e:    # whatever it is, the step must not stay "committing" forever
            reason = f"commit of step {ps.step} failed: {describe_error(e) if isinstance(e, OSError) else e}"
            await self._fail_step(ps, reason)
            if ps.mode == "relay":
                raise RequestError(reason) from None
            return
        self.tracker.finish(ps)
        self.stats["steps_committed"] += 1
        self.metrics.step_committed(time.monotonic() - ps.started)
        prev = self.last_committed.get(ps.job)
        if prev is None or ps.step >= prev["step"]:
            self.last_committed[ps.job] = {"step": ps.step, "unix": time.time()}
        self._schedule_gc(ps.job)
        log.info("committed", extra={"ctx": {"job": ps.job, "step": ps.step, "world_size": ps.world_size,
                                            "commit_s": round(time.monotonic() - t0, 6),
                                            "since_first_save_s": round(time.monotonic() - ps.started, 6)}})
        for rank, s in ps.waiters.items():
            self._event(s, {"op": "committed", "step": ps.step})

    def _schedule_gc(self, job: str) -> None:
        """Apply retention to ``job`` after a commit: one pass per job at a time, and one more
        after it when commits arrived during it (so the last commit is always followed by a pass)."""
        if self.draining:
            return
        if job in self._gc_tasks:
            self._gc_again.add(job)
            return
        task = asyncio.ensure_future(self._gc_job(job))
        self._gc_tasks[job] = task

        def done(_t: asyncio.Future) -> None:
            self._gc_tasks.pop(job, None)
            if job in self._gc_again:
                self._gc_again.discard(job)
                self._schedule_gc(job)
        task.add_done_callback(done)

    async def _gc_job(self, job: str) -> None:
        in_flight = [ps.step for ps in self.tracker.steps.values() if ps.job == job]
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self.io_pool, lambda: retention.collect_job(self.root, job, self.config.retention,
                                                            in_flight=in_flight))
        except (OSError, ValueError) as e:
            log.warning("retention failed", extra={"ctx": {"job": job, "error": describe_error(e)}})
            return
        self.metrics.gc_done(result)

    async def _fail_step(self, ps: PendingStep, reason: str) -> None:
        if self.tracker.get(ps.job, ps.step) is not ps:
            return
        self.tracker.finish(ps)
        self.stats["steps_failed"] += 1
        log.warning("step abandoned", extra={"ctx": {"job": ps.job, "step": ps.step, "reason": reason}})
        # Remove the durable ranks' files BEFORE telling anyone: a client that retries the step
        # as soon as it hears must not have its new files deleted by this cleanup. Ranks still
        # writing stop at their next chunk and remove their own files (see _write).
        await asyncio.get_running_loop().run_in_executor(
            self.io_pool, self._remove_uncommitted, ps.step_path, sorted(ps.durable))
        for rank, s in ps.waiters.items():
            self._event(s, {"op": "failed", "step": ps.step, "reason": reason})

    @staticmethod
    def _remove_uncommitted(step_path: str, ranks: list[int]) -> None:
        if os.path.exists(os.path.join(step_path, INDEX_NAME)):
            return
        try:
            for rank in ranks:
                remove_rank_files(step_path, rank)
            os.rmdir(step_path)
        except OSError as e:   # best effort (EROFS, ENOTEMPTY, ...): an uncommitted step is garbage anyway
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                log.warning("cannot remove uncommitted files", extra={"ctx": {"path": step_path,
                                                                              "error": describe_error(e)}})

    async def _session_lost(self, session: Session) -> None:
        self._close_session(session)
        for ps, rank in self.tracker.steps_of(session):
            if rank in ps.writing or (ps.mode == "relay" and rank == 0):
                await self._fail_step(ps, f"rank {rank} disconnected before step {ps.step} committed")
            else:
                ps.waiters.pop(rank, None)

    def _close_session(self, session: Session) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            self._release_slots(session)
        session.closed = True
        try:
            session.sock.close()
        except OSError:
            pass
