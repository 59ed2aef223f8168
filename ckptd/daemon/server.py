"""The daemon: its lifecycle (the op table routing each request to its handler: requests.py).

Everything with state lives in a room below: sessions (session.py), slot memory
(slot_pool.py), steps and the commit rule (steps/), storage (tiers/). This module
binds the socket, accepts connections, runs the periodic loops, wires the rooms together,
and on stop drains, closes and awaits everything it started before it returns.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ckptd import __version__
from ckptd.core import names
from ckptd.daemon import shm
from ckptd.daemon.requests import Requests
from ckptd.daemon.runtime import TaskSet, describe_error
from ckptd.daemon.service import root_scan, systemd
from ckptd.daemon.service.allocator import release_free_memory
from ckptd.daemon.service.logs import Throttled
from ckptd.daemon.service.metrics import DaemonMetrics
from ckptd.daemon.service.root_check import check_root
from ckptd.daemon.service.snapshot import DaemonSnapshot
from ckptd.daemon.service.unix_socket import bind_socket
from ckptd.daemon.session import Session, peer_allowed, peer_of, refuse
from ckptd.daemon.settings.config import DaemonConfig
from ckptd.daemon.slot_pool import SlotPool
from ckptd.daemon.steps.coordinator import StepCoordinator
from ckptd.daemon.tiers.base import ShardWritten
from ckptd.daemon.tiers.fs.scheduler import Retention
from ckptd.daemon.tiers.fs.tier import FsTier
from ckptd.daemon.tiers.memory.service import MemoryService
from ckptd.daemon.tiers.peers.link import load_secret
from ckptd.daemon.tiers.peers.tls import load_tls
from ckptd.daemon.tiers.s3.service import BucketService

__all__ = ["Daemon", "describe_error", "start_problems"]

log = logging.getLogger("ckptd")
IDLE_TRIM_S = 0.5        # no shard became durable for this long: free heap pages go back to the kernel


def start_problems(config: DaemonConfig) -> list[str]:
    """What would stop a daemon with ``config`` from starting, found without starting one
    (``serve --check-config``): the checks its start runs, each through the same function — the
    ``memory.shm_dir`` (shm.check_dir, as shm.use_dir), the peers' secret and TLS files (load_secret
    and load_tls, as MemoryService loads them: only with peers configured), the root (check_root,
    without creating it). Each problem names its setting. They run as the calling user, in its mount
    namespace: run the check as the daemon's user (a systemd unit's ReadWritePaths= and
    ProtectSystem= are not applied here)."""
    problems: list[str] = []

    def run(key: str, check: Callable[[], object]) -> None:
        try:
            check()
        except RuntimeError as e:                   # (RootNotWritable too)
            problems.append(f"{key}: {e}")

    if config.memory.shm_dir is not None:
        run("memory.shm_dir", lambda: shm.check_dir(config.memory.shm_dir or ""))
    p = config.peers
    if p.secret_file and (p.listen or p.peers):
        run("peers.secret_file", lambda: load_secret(p.secret_file or ""))
        tls = {"peers.tls_cert": p.tls_cert, "peers.tls_key": p.tls_key, "peers.tls_ca": p.tls_ca}
        try:
            load_tls(p.tls_cert, p.tls_key, p.tls_ca)
        except RuntimeError as e:                   # the key(s) whose file the message names
            named = [k for k, path in tls.items() if path and path in str(e)] or list(tls)
            problems.append(f"{', '.join(named)}: {e}")
    run("root", lambda: check_root(config.root, create=False))     # the daemon creates a missing one
    return problems


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        shm.use_dir(config.memory.shm_dir)            # before any shared memory is made (RuntimeError: unfit)
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
        self.refusals = Throttled(log, "refused peer")     # one line per uid a minute (each counted: metrics)

    @property
    def stats(self) -> dict[str, int]:
        return self.steps.counters().as_dict()

    def snapshot(self) -> DaemonSnapshot:
        """What status and metrics show (also called from the metrics HTTP thread: copies only)."""
        views = [s.view() for s in list(self.sessions)]
        address, where = self.metrics.address, shm.place()
        return DaemonSnapshot(
            root=self.root, socket=self.socket_path, pid=os.getpid(), version=__version__, draining=self.draining,
            counters=self.steps.counters(), sessions=tuple(v for v in views if v is not None),
            steps=self.steps.step_views(), shard_writes=self.steps.shard_views(),
            slot_bytes_in_use=self.slots.in_use, slot_memory_limit=self.slots.limit,
            last_committed=dict(self.steps.last_committed),
            metrics_address=f"{address[0]}:{address[1]}" if address else None, memory=self.memory.view(
                self.steps.counters(memory_level=True), dict(self.steps.table.memory_last_committed)),
            shmem_huge_pages=where.mode, shm_dir=where.dir, direct_io=self.tier.way.view())

    def _durable(self, job: str, result: ShardWritten) -> None:
        if names.is_memory_job(job):      # held, never compressed or written: not a write's figures
            return
        self.metrics.shard_durable(result.raw_bytes, result.stored_bytes, result.seconds)
        if self._trim is not None:
            self._trim.cancel()
        self._trim = asyncio.get_running_loop().call_later(IDLE_TRIM_S, self._trim_when_idle)

    def _trim_when_idle(self) -> None:
        """No shard written for a while: the codec's freed buffers go back to the kernel."""
        self._trim = None
        if not self.steps.shard_views():
            self.io_pool.submit(release_free_memory)

    def _committed(self, job: str, step: int, latency_s: float, synced: bool) -> None:
        self.metrics.step_committed(latency_s)
        if names.is_memory_job(job):      # a memory-level step: the memory tier prunes them; never uploaded
            return
        if synced:
            self.retention.schedule(job)
        else:            # its index may not survive a power loss: keep the steps a restore would fall back to
            log.warning("retention skipped after a commit whose durability is unconfirmed",
                        extra={"ctx": {"job": job, "step": step}})
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
        # SIGHUP too: a daemon started by hand (`ckptd serve … &`) gets it when its terminal closes, and
        # its default action killed it at once (no drain: the saves in flight lost, the socket left). But
        # not where it is ignored already: `nohup ckptd serve` asked to outlive its terminal.
        hup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
        for sig in (signal.SIGTERM, signal.SIGINT, *hup):
            try:
                loop.add_signal_handler(sig, self.stop, sig)
            except (RuntimeError, ValueError):
                pass
        where = shm.place()
        log.info("serving", extra={"ctx": {"socket": self.socket_path, "root": self.root,
                                          "threads": self.config.threads, "codec": self.config.write.codec,
                                          "socket_activated": listen_sock is not None, "pid": os.getpid(),
                                          "shmem_huge_pages": where.mode, "shm_dir": where.dir}})
        if not shm.sealed():
            log.warning("shm_dir %s: its files cannot be sealed against resizing: a permitted user who shrinks a "
                        "slot it was given can crash this daemon (SIGBUS); use shm_dir only where every permitted "
                        "user is trusted, or memfds (no shm_dir)", where.dir)
        if where.mode not in shm.HUGE_MODES:
            log.info("shared memory uses 4 KiB pages (%s): restores from memory copy faster with huge pages "
                     "(docs/operations.md)", f"transparent_hugepage/shmem_enabled is {where.mode}" if where.dir is None
                     else f"shm_dir {where.dir}: its tmpfs is mounted huge={where.mode}")
        self.tasks.spawn(asyncio.to_thread(root_scan.report, self.root), "start-up scan of the root")
        accept = self.tasks.spawn(self._accept_loop(sock), "accept loop")
        sweeper = self.tasks.spawn(self._sweep_loop(), "step timeout sweep")
        notifier = self.tasks.spawn(self._notify_loop(), "systemd notify loop")
        if self.s3:
            self.s3.start()
        self.notifier.ready(self.snapshot().status_line())
        try:
            await self._stopped.wait()
            # (Accepting goes on while draining: `ckptd status` is answered, a new session or save is
            # refused at once, not left in the listen backlog until the drain ends.)
            sweeper.cancel()
            self.notifier.stopping(f"draining {len(self.steps.writes)} saves in flight",
                                   extend_s=self.config.drain_grace + 30)
            t_drain = loop.time()
            await self.drain()
            if self.s3:          # the newest committed step gets what is left of the grace to reach the bucket
                await self.s3.finish(self.config.drain_grace - (loop.time() - t_drain))
            await self.events.wait(5)       # committed/failed events of the drain reach their clients
            accept.cancel()
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

    def stop(self, sig: signal.Signals | None = None) -> None:
        if sig is not None and not self.draining:
            log.info(f"stopping on {sig.name}", extra={"ctx": {"signal": sig.name}})
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
            self.refusals.warning(f"uid {peer.uid}", {"pid": peer.pid, "uid": peer.uid, "gid": peer.gid,
                                                      "groups": list(peer.groups)})
            await refuse(sock, peer, f"uid {peer.uid} / gid {peer.gid} is not allowed to use this ckptd daemon "
                                     f"(not in its allowed_users / allowed_groups)")
            return
        session = Session(sock, peer, self.events, self.config.debug.frame_timeout)
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
