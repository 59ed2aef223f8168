"""This rank's connection to its daemon and the shared-memory slots the daemon lent it."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ckptd.core import protocol
from ckptd.core.errors import ProtocolError
from ckptd.core.protocol import EventOp, SaveLevel

from .connection import DaemonConnection, EventHandler, LostHandler
from .errors import CheckpointError, DaemonRefused, NoReply, NotDelivered
from .handle import WATCH_EVERY_S, SaveHandle, wait_all
from .slots import ClientSlot

log = logging.getLogger("ckptd")
RECLAIM_EVERY_S = 2.0       # how often a trainer whose slots are all kept asks for one back
PREPARE_SLACK_S = 70.0      # a preparation's bound past slot_wait: a hello or resize's reply (60 s) and some
SILENCE_MARGIN_S = 5.0      # a daemon silent this much past max(commit_timeout, step_timeout) is given up


class DaemonSession:
    """Slots live and die with the connection that lent them, so one object owns both: a lost
    connection takes its slots along, and the next ``ensure_slots`` reconnects (the daemon may
    have restarted). ``slot_free`` and ``slot_held`` events are handled here; every other event and
    the loss itself go on to ``on_event``/``on_lost`` (the Checkpointer's).

    A slot is free (``acquire`` hands it out), in a save (the daemon reads it), or held: the
    daemon's memory tier keeps it as the newest step's resident copy (no second copy in host
    memory) and frees it once a newer step commits or the step fails. A held slot is not waited
    for before the slots are resized."""

    def __init__(self, socket_path: str, job: str, rank: int, world_size: int, num_slots: int,
                 on_event: EventHandler, on_lost: LostHandler, local_ranks: int = 1,
                 slot_wait: float | None = None) -> None:
        self.socket_path = socket_path
        self.slot_wait = slot_wait               # acquire's bound (commit_timeout): a stalled daemon frees none
        self.job, self.rank, self.world_size = job, rank, world_size
        self.local_ranks = local_ranks           # the job's ranks on this node (hello: slot budget shares)
        self.num_slots = num_slots
        self.daemon_root: str | None = None      # where the daemon writes, as its hello said
        self.fills = False                       # its daemon takes a save before the slot is full (handoff.py)
        self.step_timeout: float | None = None   # the daemon's, as its hello said (an older daemon's: unknown)
        self._silent: tuple[float, float] | None = None     # (silent since, last watched): watch()
        self.conn: DaemonConnection | None = None
        self.slots: list[ClientSlot] = []
        self.asked = 0                           # the slot bytes the slots were asked for
        self._free: set[int] = set()
        self._held: set[int] = set()
        self.saved_in: dict[int, tuple[int, str]] = {}     # slot → (step, level) of the save last handed in it
        self._preparing: threading.Thread | None = None
        self._cond = threading.Condition()
        self._on_event = on_event
        self._on_lost = on_lost

    def live(self) -> DaemonConnection | None:
        """The connection, unless there is none or it was lost."""
        conn = self.conn
        return conn if conn is not None and not conn.lost else None

    def commit(self, step: int, digests: dict[int, str], records: list[Any] | None = None,
               timeout: float | None = None, check: list[int] | None = None, *, memory: bool = False) -> None:
        """(Relay, rank 0) every rank is durable: ask this daemon to write the step's index, from
        every rank's record when given (dropped when they would not fit one frame: the daemon then
        reads the manifests), reading back the manifests of ``check`` only (one rank per node; None:
        every rank), waiting ``timeout`` seconds for its answer."""
        conn = self.conn
        if conn is None:
            raise NotDelivered(f"not connected to ckptd at {self.socket_path}")
        wire = {str(r): d for r, d in digests.items()}
        if records is not None:
            try:        # encoded once: a 32,768-rank COMMIT is 4.5 MB of records
                conn.request(protocol.Commit(step=step, digests=wire, records=records, level=_level(memory),
                                             check=check), timeout)
                return
            except ProtocolError:       # over the frame limit, nothing sent: without them
                pass
        conn.request(protocol.Commit(step=step, digests=wire, level=_level(memory)), timeout)

    def abort(self, step: int, reason: str, *, memory: bool = False, timeout: float | None = None) -> str | None:
        """Let this daemon drop the step (if it is still there): some rank failed (relay, rank 0), a
        streamed save broke off between parts, or ``close`` gave up waiting. Returns the daemon's
        ``outcome`` (FORMAT.md: failed, committing or unknown), None when not connected."""
        conn = self.live()
        if conn is None:
            return None
        reply = conn.request(protocol.Abort(step=step, reason=reason, level=_level(memory)), timeout)
        outcome = reply.get("outcome")
        return outcome if isinstance(outcome, str) else None

    def withdraw(self, handles: Sequence[SaveHandle], why: str, timeout: float) -> None:
        """``Checkpointer.close`` gave up on these saves (``why``): abort each on the daemon (its FAILED
        event settles the handle), then wait up to ``timeout`` for those it says are already committing."""
        committing = []
        for h in handles:
            try:
                outcome = self.abort(h.step, f"checkpointer closed before step {h.step} committed ({why})",
                                     memory=h.level is SaveLevel.MEMORY, timeout=timeout)
            except CheckpointError as e:          # no daemon to ask: the disk settles it (close)
                log.warning("ckptd: could not withdraw step %d on close: %s", h.step, e)
                continue
            if outcome == "committing":
                committing.append(h)
        wait_all(committing, timeout)

    def silence_bound(self) -> float:
        """Seconds a daemon may answer nothing before a wait with no timeout gives its connection up."""
        return max(self.slot_wait or 0.0, self.step_timeout or 0.0) + SILENCE_MARGIN_S

    def watch(self) -> None:
        """(A wait on a save with no timeout, every ``WATCH_EVERY_S``) Ask the daemon for its ``info`` on
        this connection. Once it has answered nothing for ``silence_bound()`` seconds (SIGSTOPped, or its
        event loop wedged) the connection is given up as lost: ``on_lost`` settles the saves in flight
        (failed, unless index.json is on disk), as a daemon that died would."""
        conn = self.live()
        if conn is None:
            return
        try:
            conn.request(protocol.Info(), WATCH_EVERY_S)
            self._silent = None
            return
        except NoReply:
            pass
        except CheckpointError:         # lost meanwhile (the loss settles the saves) or refused: it answers
            return
        now = time.monotonic()
        since, last = self._silent or (now - WATCH_EVERY_S, now)
        if now - last > 3 * WATCH_EVERY_S:      # (an earlier silence no wait watched to its end)
            since = now - WATCH_EVERY_S
        self._silent = (since, now)
        if now - since >= self.silence_bound():
            st = "unknown" if self.step_timeout is None else f"{self.step_timeout:g}s"
            conn.give_up(f"the daemon answered nothing for {now - since:.0f}s (the bound: max(commit_timeout "
                         f"{self.slot_wait or 0:g}s, its step_timeout {st}) + {SILENCE_MARGIN_S:g}s): "
                         "stopped, or wedged? (see its log and `ckptd status`)")

    def report(self, step: int, stall_s: float, fence_s: float) -> None:
        """Tell the daemon what a save cost the trainer (for its metrics); never blocks."""
        conn = self.live()
        if conn is not None:
            conn.notify(protocol.Report(step=step, stall_s=stall_s, fence_s=fence_s))

    def prepare_soon(self, nbytes: int, then: Callable[[list[ClientSlot]], object] | None = None) -> None:
        """Connect and size the slots for ``nbytes`` on a thread (after a restore, which knows the
        state), then ``then(slots)`` there (the copy's slot views): the first save then pays no
        set-up. ``ensure_slots`` waits for it; a failure here is left for that save to meet (and report)."""
        try:
            self.settle()
        except CheckpointError as e:        # the one before still runs (a silent daemon): that save meets it
            log.debug("ckptd: slots not prepared after restore: %s", e)
            return
        ready = self.live() is not None and self.slots and self.asked >= nbytes
        if ready and then is None:
            return

        def run() -> None:
            try:
                if not ready:
                    self._ensure(nbytes)
                if then is not None:
                    then(self.slots)
            except (CheckpointError, OSError) as e:
                log.debug("ckptd: slots not prepared after restore: %s", e)
        self._preparing = threading.Thread(target=run, name="ckptd-prepare", daemon=True)
        self._preparing.start()

    def settle(self) -> float:
        """Wait for a ``prepare_soon`` still running; the seconds waited. Bounded: its every wait is (the
        slots' by ``slot_wait``, each request by the connection's timeout), so one that outlives them all
        is a CheckpointError (the preparation is left running: it is waited for again next time)."""
        t = self._preparing
        if t is None or t is threading.current_thread():    # (the preparation itself reconnecting)
            return 0.0
        t0 = time.monotonic()
        bound = (self.slot_wait or 0.0) + PREPARE_SLACK_S
        t.join(bound)
        if t.is_alive():
            raise CheckpointError(f"the slots' preparation (after restore) did not end within {bound:g}s "
                                  f"(commit_timeout + {PREPARE_SLACK_S:g}s): the daemon at {self.socket_path} "
                                  "does not answer (stopped? see its log and `ckptd status`)")
        self._preparing = None
        return time.monotonic() - t0

    def ensure_slots(self, nbytes: int) -> DaemonConnection:
        """A live connection whose slots hold ``nbytes`` each: connect, or grow the slots."""
        self.settle()
        return self._ensure(nbytes)

    def _ensure(self, nbytes: int) -> DaemonConnection:
        nbytes = max(nbytes, 1)
        conn = self.live()
        if conn is None:
            self.drop()
            return self._connect(nbytes)
        if not self.slots or self.asked < nbytes:
            self._wait_all_free()
            try:
                reply = conn.request(protocol.Resize(slot_bytes=nbytes, num_slots=self.num_slots))
            except DaemonRefused:
                # The daemon gave the old slots back before it could not make the new ones: this
                # rank has none now, and its next save asks again (not into slots that are gone).
                self._install({"_fds": [], "slots": []}, 0)
                raise
            self._install(reply, nbytes)
        return conn

    def _connect(self, slot_bytes: int) -> DaemonConnection:
        conn = DaemonConnection(self.socket_path, self._event, on_lost=self._lost)
        hello = protocol.Hello(job=self.job, rank=self.rank, world_size=self.world_size, pid=os.getpid(),
                               local_ranks=self.local_ranks,
                               slot_bytes=slot_bytes, num_slots=self.num_slots if slot_bytes else 0)
        try:
            reply = conn.request(hello)
        except CheckpointError:
            conn.close()
            raise
        self.daemon_root = reply["root"]
        self.fills = reply.get("fills") is True
        st = reply.get("step_timeout")
        self.step_timeout = float(st) if isinstance(st, (int, float)) and st > 0 else None
        self._install(reply, slot_bytes)
        self.conn = conn
        return conn

    def _install(self, reply: dict[str, Any], asked: int) -> None:
        """The slots the daemon lent for ``asked`` bytes each (smaller ones when its budget is short:
        a save then streams through them, ``ckptd_client/streamed.py``; not asked for again)."""
        self.asked = asked
        for s in self.slots:
            s.close()
        lent = zip(reply["_fds"], reply["slots"], strict=True)
        self.slots = [ClientSlot(i, fd, size) for i, (fd, size) in enumerate(lent)]
        with self._cond:
            self._free = set(range(len(self.slots)))
            self._held = set()

    def drop(self) -> None:
        """Close the connection and unmap its slots (a save in flight keeps the daemon's copy)."""
        try:
            self.settle()
        except CheckpointError as e:        # closing regardless: the preparation fails on the closed connection
            log.warning("ckptd: %s", e)
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        for s in self.slots:
            s.close()
        self.slots = []
        self.asked = 0
        with self._cond:
            self._free = set()
            self._held = set()

    def _wait_all_free(self) -> None:
        """Until no save reads a slot (held ones stay with the daemon's memory tier); as ``acquire``, a
        CheckpointError once ``slot_wait`` seconds pass with one still read (a daemon stopped or stuck)."""
        deadline = None if self.slot_wait is None else time.monotonic() + self.slot_wait
        with self._cond:
            while len(self._free | self._held) < len(self.slots) and self.live() is not None:
                if deadline is not None and time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"no slot came free within {self.slot_wait:g}s (commit_timeout) to grow the slots for a "
                        f"larger state: the daemon at {self.socket_path} reads none of the saves in flight "
                        "(stopped, or stuck on its disk? see its log and `ckptd status`)")
                self._cond.wait(0.1)

    def acquire(self, block: bool = True) -> int | None:
        """A free slot's index; None if every slot is busy and ``block`` is False.

        When the memory tier keeps every slot (held steps whose commit this rank's daemon has
        not seen yet, or failed steps it was never told of), the daemon is asked to give the
        oldest back: the trainer's progress comes before a copy in memory (storage has it).
        CheckpointError once ``slot_wait`` seconds pass without one (a daemon stopped or wedged on
        I/O keeps its connection but reads no slot: no save could commit within that time anyway)."""
        asked = -RECLAIM_EVERY_S
        deadline = None if self.slot_wait is None else time.monotonic() + self.slot_wait
        while True:
            with self._cond:
                if self._free:
                    return self._free.pop()
                conn = self.live()
                if conn is None:
                    raise NotDelivered(f"connection to ckptd at {self.socket_path} lost")
                if deadline is not None and time.monotonic() >= deadline:
                    raise CheckpointError(self._no_slot())
                stuck = bool(self.slots) and len(self._held) >= len(self.slots)
                if not block and not stuck:
                    return None
            if stuck and time.monotonic() - asked >= RECLAIM_EVERY_S:
                asked = time.monotonic()
                conn.notify(protocol.Reclaim())
                if not block:
                    return None
            with self._cond:
                if not self._free:
                    self._cond.wait(0.1)

    def _no_slot(self) -> str:
        """Why no slot came free (under ``_cond``): what holds each slot, and the two usual causes."""
        what = []
        for i in range(len(self.slots)):
            step, level = self.saved_in.get(i, (None, ""))
            save = "a save" if step is None else f"step {step}" + (" (memory-level)" if level == "memory" else "")
            what.append(f"slot {i}: {save}, " + ("kept by the daemon's memory tier until a newer step of the job "
                                                  "commits" if i in self._held else "not yet committed"))
        st = f"{self.step_timeout:g}s" if self.step_timeout else "its step_timeout"
        return (f"no slot came free within {self.slot_wait:g}s (commit_timeout) at the daemon {self.socket_path} "
                f"({'; '.join(what)}). A step commits once every rank's shard is durable: a rank that stopped or "
                f"died holds it until the daemon fails it ({st}); else the daemon reads none of the saves (stopped, "
                "or stuck on its disk?). See its log and `ckptd status`")

    def held(self) -> int:
        """How many slots the daemon's memory tier keeps now."""
        with self._cond:
            return len(self._held)

    def release(self, slot: int) -> None:
        """Give back a slot the daemon never received (a save abandoned before its hand-off)."""
        with self._cond:
            if 0 <= slot < len(self.slots):
                self._free.add(slot)
            self._cond.notify_all()

    def _event(self, op: EventOp, msg: dict[str, Any]) -> None:
        if op is EventOp.SLOT_FREE:
            with self._cond:
                self._held.discard(msg["slot"])
                self._free.add(msg["slot"])
                self._cond.notify_all()
            return
        if op is EventOp.SLOT_HELD:
            with self._cond:
                self._held.add(msg["slot"])
                self._cond.notify_all()
            return
        self._on_event(op, msg)

    def _lost(self, reason: str) -> None:
        with self._cond:
            self._cond.notify_all()
        self._on_lost(reason)


def _level(memory: bool) -> str:
    """The wire's level of a step (``memory``: a memory-level step's commit or abort)."""
    return (protocol.SaveLevel.MEMORY if memory else protocol.SaveLevel.STORAGE).value
