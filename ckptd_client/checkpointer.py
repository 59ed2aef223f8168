"""The training-side manager, ``Checkpointer``: saves go through the daemon, restores straight to storage."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from ckptd.core import names, protocol
from ckptd.core.protocol import CommitMode, EventOp, SaveLevel
from ckptd.core.relay_record import RankOutcome

from .agreement import RestoreAgreements
from .api_guard import ApiGuard, guarded
from .bucket_restore import BucketStaging
from .config import CheckpointerConfig, join_window, with_keywords
from .connection import DaemonConnection, daemon_root
from .disk import committed_on_disk
from .dist import dist_info
from .errors import CheckpointError, NotDelivered, refuse_closed
from .handle import CloseReport, SaveHandle, await_rank0, wait_all, wait_each
from .handoff import hand_over
from .memory_level import is_held_step, newest_held_step, restore_held
from .modes import WhenBusy, parse_level, parse_when_busy, resolve_commit_mode
from .overlap import OverlapCopies, fence_list, parse_overlap
from .own_daemon import OwnDaemon
from .plan_cache import PlanCache
from .relay import StoreRelay
from .restore import PerRank
from .run_scope import RunScope
from .session import DaemonSession
from .slots import ClientSlot
from .sources import Reader, RestoreInfo, outranked, restore_chain, run_chain
from .step_choice import latest_step, newest_readable
from .store_io import guarded_store
from .streamed import needs_stream, stream_save

if TYPE_CHECKING:
    from torch.optim import Optimizer

log = logging.getLogger("ckptd_client")


class Checkpointer:
    """Saves through the node's ckptd daemon; restores straight from storage.

    Settings: ``config`` (a :class:`CheckpointerConfig`, whose fields say what each does and its
    default), or the same names as keyword arguments (``socket`` and ``root`` also positionally);
    a keyword that contradicts ``config`` is a TypeError. ``rank``/``world_size``/``store``
    default from torch.distributed. Store keys: run_scope.py. ``overlap``, ``when_busy``: see ``save``.
    ``spawn=True`` (with ``root``): no daemon to run, one is started for this process (own_daemon.py).
    """

    def __init__(self, job: str, socket: str | None = None, root: str | None = None, *,
                 config: CheckpointerConfig | None = None, rank: int | None = None, world_size: int | None = None,
                 store: Any = None, num_slots: int | None = None, commit: CommitMode | str | None = None,
                 commit_timeout: float | None = None, join_timeout: float | None = None,
                 restore_threads: int | None = None, overlap: bool | str | None = None,
                 when_busy: WhenBusy | str | None = None, memory: bool | None = None,
                 local_world_size: int | None = None, spawn: bool | None = None, prepare: bool | None = None) -> None:
        self.guard = ApiGuard()     # one call at a time, in this process only (api_guard.py)
        self.config = c = with_keywords(config, socket=socket, root=root, rank=rank, world_size=world_size,
                                        store=store, num_slots=num_slots, commit=commit, commit_timeout=commit_timeout,
                                        join_timeout=join_timeout, restore_threads=restore_threads, overlap=overlap,
                                        when_busy=when_busy, memory=memory, local_world_size=local_world_size,
                                        spawn=spawn, prepare=prepare)
        self.job = names.validate_job(job)
        self.socket_path = c.socket or protocol.default_socket_path()
        self.root = os.path.abspath(c.root) if c.root else None
        d_rank, d_world, d_store = dist_info()
        self.rank = d_rank if c.rank is None else c.rank
        self.world_size = d_world if c.world_size is None else c.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")
        self.store = guarded_store(c.store if c.store is not None else d_store, max(c.commit_timeout, join_window(c)))
        self.commit_mode = resolve_commit_mode(c.commit, self.world_size, self.store is not None)
        self.commit_timeout = c.commit_timeout
        self.run_scope = RunScope(self.store, self.job, self.rank, self.world_size, join_window(c)) \
            if self.store is not None and (self.world_size > 1 or self.commit_mode is CommitMode.RELAY) else None
        # Ranks per node (one daemon each, sharing its CPUs): the relay's fan-in groups (relay.py), 8 if unknown.
        known = c.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        self.local_world_size, self.num_slots = known or 8, c.num_slots
        self.restore_threads = c.restore_threads or max(1, len(os.sched_getaffinity(0)) // (known or 1))
        self.overlap, self.when_busy = parse_overlap(c.overlap), parse_when_busy(c.when_busy)
        self.daemon: OwnDaemon | None = None          # spawn=True: this process's own daemon (own_daemon.py)
        if c.spawn:
            if self.world_size > 1:
                raise ValueError(f"spawn=True starts a daemon for one process, but world_size is {self.world_size}: "
                                 "run one daemon per node (ckptd serve) and pass socket=")
            self.daemon = OwnDaemon(str(self.root), self, Checkpointer.close)
            self.socket_path = self.daemon.socket
        self._session = DaemonSession(self.socket_path, self.job, self.rank, self.world_size, c.num_slots,
                                      self._on_event, self._on_lost, min(self.world_size, self.local_world_size),
                                      slot_wait=self.commit_timeout)
        self._copies = OverlapCopies(self.fence)
        self.plans = PlanCache()                      # the last save's plan, while the structure holds
        self._handles: dict[int, SaveHandle] = {}      # step → handle (one save per step in flight)
        self._agreements = RestoreAgreements(self.store, self.run_scope, self.rank, self.world_size,
                                             self.commit_timeout)
        self._relays: dict[SaveLevel, StoreRelay] = {}     # relay commit: one per level (its own keys)
        self._seq, self._closed = 0, False
        self.memory = c.memory                         # restore asks the daemon's memory tier first
        self.last_restore: RestoreInfo | None = None   # the source (memory, peer, storage) of the last restore

    @property
    def slots(self) -> list[ClientSlot]:
        """The shared-memory slots now mapped (none before the first save or ``prepare``)."""
        return self._session.slots

    def pending(self, step: int) -> SaveHandle | None:
        """The handle of ``step``'s save while it is in flight (not yet committed or failed)."""
        return self._handles.get(step)

    def _ensure_slots(self, nbytes: int) -> tuple[DaemonConnection, float]:
        """The connection, slots for ``nbytes``, and the seconds that set-up took (``setup_s``)."""
        t0 = time.perf_counter()
        conn = self._session.ensure_slots(nbytes)
        self.root = self.root or self._session.daemon_root
        return conn, time.perf_counter() - t0

    # ---- events from the daemon (reader thread) ----------------------------

    def _on_event(self, op: EventOp, msg: dict[str, Any]) -> None:
        if not isinstance(step := msg.get("step"), int) or (h := self._handles.get(step)) is None:
            return
        if (relay := self._relays.get(h.level)) is not None and op in (EventOp.DURABLE, EventOp.FAILED):
            relay.publish(h.step, RankOutcome.from_event(op, msg))          # this rank's outcome
        if op is EventOp.DURABLE:
            h.durable_s, h.digest = time.monotonic() - h.started, msg.get("digest")
            h.raw_bytes, h.stored_bytes = msg.get("raw_bytes", 0), msg.get("stored_bytes", 0)
        elif op is EventOp.COMMITTED:
            self._finish(h, None)
        elif op is EventOp.FAILED:
            self._finish(h, msg["reason"])

    def _on_lost(self, why: str) -> None:
        reason = f"connection to ckptd at {self.socket_path} lost: {why}"
        for h in list(self._handles.values()):
            if h.durable_s is None and (relay := self._relays.get(h.level)) is not None:
                relay.publish(h.step, RankOutcome.failed(reason))
            if h.durable_s is None or self.commit_mode is CommitMode.LOCAL:
                self._finish(h, reason)     # (committed just before the daemon went away? _finish asks the disk)

    def _finish(self, h: SaveHandle, error: str | None) -> None:
        """Settle a handle. A failure reported after this rank's shard was durable (a lost daemon or peer rank, a
        commit timeout) may hide a commit that happened: the disk decides, so a handle never says failed for a
        committed step (the daemon refuses saves of committed steps, so an index.json there is this save's)."""
        if error is not None and h.durable_s is not None and self._on_disk(h.step, h):
            error = None
        if self._handles.get(h.step) is h:
            del self._handles[h.step]
        h.settle(error)

    def _on_disk(self, step: int, h: SaveHandle | None) -> bool:
        memory = h is not None and h.level is SaveLevel.MEMORY       # (its job key: ``names.memory_job``)
        return committed_on_disk(self.root, names.memory_job(self.job) if memory else self.job, step, h, self.rank)

    # ---- saving ------------------------------------------------------------

    @guarded()
    def prepare(self, state: dict[str, Any]) -> None:
        """Connect and allocate slots sized for ``state`` now, so the first save pays no set-up. Call it once
        the state has its full size (after the first optimizer step: Adam's moments) or a larger first save
        re-allocates the slots."""
        refuse_closed(self._closed, "prepare")
        self.fence()
        self._ensure_slots(self.plans.plan(state).nbytes)

    @guarded()
    def save(self, step: int, state: dict[str, Any], *, overlap: bool | str | None = None,
             when_busy: WhenBusy | str | None = None, fence_on: Optimizer | Sequence[Optimizer] | None = None,
             level: SaveLevel | str = SaveLevel.STORAGE) -> SaveHandle:
        """Snapshot ``state`` into a shared-memory slot and hand it to the daemon (README, "Saving").

        ``overlap=True`` (default): with an optimizer in ``state``, parameters and optimizer state are copied in
        the background while forward/backward run; ``fence()`` — called by a step pre-hook on those optimizers —
        waits for the copy before the first mutation; the rest is copied before ``save()`` returns. Call
        ``fence()`` yourself before changing parameters outside that step. ``fence_on`` (optimizers): for dict
        state (``get_state_dict``'s), whose tensors sharing storage with theirs are then deferred the same way.
        ``overlap="manual"``: every tensor is deferred, and only those optimizers' steps (and the next save,
        restore or close) fence: call ``fence()`` before changing any tensor of ``state`` in place otherwise (a
        tensor changed unfenced may be saved half old, half new). ``overlap=False``: all copied first.

        ``when_busy``: with every slot busy, ``block`` waits, ``skip`` returns ``skipped=True``. Slots smaller
        than the state (the daemon's ``slot_memory_limit``) stream it through part by part.

        ``level="memory"``: a memory-level step, held in the daemons' memory and replicated to their peers (``[peers]
        replicas``), never written: save to memory every few steps, to storage every few hundred. It commits once
        every rank's shard is held with its replicas and fails, saying why, when one cannot be. ``restore()`` takes
        the newest step every rank can restore; memory-level steps do not survive a restart of every daemon
        holding them (memory_level.py).

        DTensors are saved as their local shards (``ckptd_client.dtensor``). A tensor ckptd cannot store is a
        TypeError naming its key, raised before any slot is taken."""
        refuse_closed(self._closed, "save")
        overlap = self.overlap if overlap is None else parse_overlap(overlap)
        busy, level = parse_when_busy(when_busy or self.when_busy), parse_level(level)
        fence_optims = fence_list(fence_on)
        step = names.step_number(step)   # validated (a NumPy int taken as an int)
        try:
            self.fence()
            t0 = time.perf_counter()
            plan = self.plans.plan(state, fence_optims, lazy=overlap is not False)   # raises on a bad value first
        except BaseException as e:      # on this rank alone, maybe (its state): the other ranks' saves fail too
            self.fail(step, f"failed before reaching its daemon: {type(e).__name__}: {e}", level)
            raise
        if step in self._handles:
            raise CheckpointError(f"step {step} is already being saved")
        if self.commit_mode is CommitMode.RELAY:
            self._ensure_relay(level).claim(step)      # a step is saved once per run and level: else CheckpointError
        self._seq += 1
        handle = SaveHandle(step, self._seq, level)
        self._handles[step] = handle
        if self.commit_mode is CommitMode.RELAY:
            self._ensure_relay(level).track(step, lambda err: self._finish(handle, err))
        for attempt in (1, 2):
            try:
                conn, handle.setup_s = self._ensure_slots(plan.nbytes)
                if needs_stream(self._session, plan):     # the daemon lent smaller slots (its budget)
                    stream_save(self._session, conn, handle, plan, self.commit_mode.value, busy is WhenBusy.BLOCK)
                    break
                handle.slot = self._session.acquire(block=busy is WhenBusy.BLOCK)
                if handle.slot is None:
                    handle.skipped = True
                    break
                hand_over(self._session, conn, self._copies, handle, plan, overlap, level, self.commit_mode.value,
                          partial(self._abandon, handle))
                break
            except NotDelivered:
                # The daemon went away (restart) before it saw this save: reconnect and redo it once.
                if attempt == 2:
                    self._abandon(handle, "daemon connection lost twice before the hand-off")
                    raise
                self._session.drop()
                if handle.done() and self.commit_mode is not CommitMode.RELAY:
                    # The loss settled it failed (_on_lost), though no daemon saw it: the redo is a new
                    # save, with a handle of its own (the caller never saw this one), or its commit
                    # would go unheard and the step be reported failed. (Relayed, the loss was already
                    # published to the other ranks as this rank's outcome: the step fails for all.)
                    handle = SaveHandle(step, self._seq, level)
                    self._handles[step] = handle
            except BaseException as e:
                self._abandon(handle, e)
                raise
        if handle.skipped:
            self._abandon(handle, None)
        handle.stall_s = time.perf_counter() - t0
        if self._copies.inflight is None and not handle.skipped:
            self._session.report(step, handle.stall_s, handle.fence_s)
        return handle

    def fence(self) -> None:
        """Wait until the state may be mutated (only an overlapped save's copy can be pending)."""
        done = self._copies.fence()
        if done is not None:     # the metrics report goes from the copy thread, after that save's hand-off
            self._copies.after_copies(self._session.report, done.step, done.stall_s, done.fence_s)

    def fail(self, step: int, reason: str, level: SaveLevel | str = SaveLevel.STORAGE) -> None:
        """This rank's save of ``step`` failed before reaching the daemon: every rank's fails now (relay commit)."""
        if self.commit_mode is CommitMode.RELAY and step not in self._handles and not self._closed:
            self._ensure_relay(parse_level(level)).fail(step, reason)

    def _abandon(self, handle: SaveHandle, error: str | BaseException | None) -> None:
        """A save that never reached the daemon: give its slot back and resolve its handle."""
        if isinstance(error, BaseException):
            error = f"hand-off to the daemon failed: {error}"
        if handle.slot is not None:
            self._session.release(handle.slot)
        if (relay := self._relays.get(handle.level)) is not None:
            relay.publish(handle.step, RankOutcome.failed(error or "skipped (no free slot)"))
        self._finish(handle, error)

    def _ensure_relay(self, level: SaveLevel) -> StoreRelay:
        """The relay of ``level``'s saves, with store keys of its own (a step may be saved at both levels)."""
        if level not in self._relays:
            assert self.run_scope is not None       # (relay mode has a store)
            s, memory = self._session, level is SaveLevel.MEMORY
            self._relays[level] = StoreRelay(
                self.store, names.memory_job(self.job) if memory else self.job, self.rank, self.world_size,
                self.commit_timeout, lambda step, *a: s.commit(step, *a, memory=memory),
                lambda step, why: s.abort(step, why, memory=memory),
                lambda step: self._on_disk(step, self._handles.get(step)),
                node_size=self.local_world_size, run=self.run_scope)
        return self._relays[level]

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every save in flight; raises CheckpointError for the first that failed."""
        wait_each(list(self._handles.values()), timeout)

    # ---- restoring ---------------------------------------------------------

    def resolve_root(self) -> str:
        """The checkpoint root: ``root`` as configured, else the daemon's (asked once)."""
        self.root = self.root or daemon_root(self.socket_path)
        return self.root

    def latest_step(self) -> int | None:
        """The newest committed step (None: none); CheckpointError if one may be in a directory it cannot read."""
        return latest_step(self.resolve_root(), self.job)

    @guarded()
    def restore(self, state: dict[str, Any], step: int | None = None, *, per_rank: PerRank = None,
                strict: bool = True) -> int | None:
        """Load the newest committed step (or ``step``) into ``state`` in place; returns it (None: there is none).

        The live ``state`` says what to read, whatever the saved layout was (README, "Restore"): a DTensor gets
        the region its local shard holds, a plain tensor the whole tensor, assembled from whichever saved pieces
        overlap it, so a step restores at another world size or mesh. ``strict`` (default): an entry of ``state``
        the step lacks is a CheckpointError naming every one; ``strict=False`` leaves them and lists them in
        ``last_restore.missing``. Everything is checked before anything is written; nothing is unpickled.
        Models and optimizers load through ``set_model_state_dict``/``set_optimizer_state_dict``; RNG state last.
        ``per_rank``, at another world size, for entries that differed between saved ranks (loader positions,
        RNG): ``"fresh"``, ``"rank0"``, ``"same-rank"`` or ``(rank, saved_world, world) -> saved rank | None``.

        Sources, in order (sources.py): a newer memory-level step every rank can read from memory; the daemons'
        memory; the files under the root (staged from the bucket first); ``last_restore`` says which served, why
        each before it could not, and the bytes from each. With more than one rank, every rank calls it."""
        refuse_closed(self._closed, "restore")
        self.fence()
        try:
            got = self._restore(state, None if step is None else names.step_number(step), per_rank, strict)
        except BaseException:
            self._agreements.settle(wait=False)     # a failed restore fails the job: say so now
            raise
        self._agreements.settle()
        return got

    def _restore(self, state: dict[str, Any], step: int | None, per_rank: PerRank, strict: bool) -> int | None:
        staging = BucketStaging(self.socket_path, self.job, self.rank, self.world_size)
        reader = Reader(self.socket_path, self.job, self.rank, self.world_size, self.restore_threads,
                        self.resolve_root)
        held, explicit = None, step is not None     # a memory-level step to try first (memory_level.py)
        if step is None:                # the newest committed step, here or in the bucket
            step = self._agreements.step(staging.newest(self.latest_step))
            if self.memory:
                held = self._agreements.step(newest_held_step(self.resolve_root(), self.job, step))
        elif self.memory and is_held_step(self.resolve_root(), self.job, step):
            held = step
        info = None if held is None else restore_held(reader, held, state, per_rank, strict, self._agreements.all_ok)
        if not isinstance(info, RestoreInfo):
            if step is None:
                return None
            chain = restore_chain(reader, staging, memory=self.memory, per_rank=per_rank, strict=strict)
            info = run_chain(chain, step, state, skipped=info)
        self.last_restore = info
        if self.config.prepare and (warmed := self.plans.warm(state)) is not None:
            nbytes, split = warmed                 # the first save then costs what the others do:
            self._session.prepare_soon(nbytes, lambda slots: [s.views(split.later_cpu) for s in slots])
            self._copies.pool().submit(time.sleep, 0)   # and finds its copy thread started
        log.info("ckptd: %s", info)
        if explicit and self.rank == 0 and (newest := newest_readable(self.root, self.job)) is not None \
                and newest > info.step:
            log.warning("ckptd: %s", outranked(self.job, info.step, newest))
        return info.step

    # ---- lifetime ----------------------------------------------------------

    @guarded(in_child=CloseReport)
    def close(self, timeout: float | None = None) -> CloseReport:
        """Wait for every save in flight, each to its own outcome, within ``timeout`` seconds in all;
        then disconnect. Returns a :class:`CloseReport` (failures are also logged, not raised). A save
        still open then is withdrawn (local commit: it cannot commit after its handle said failed); one
        committing, or with relay commit durable on this rank, is waited for (bounded: ``commit_timeout``;
        ``handle.await_rank0``). The rest are settled by the disk: committed if its index.json exists."""
        if self._closed:
            return CloseReport()
        self.fence()
        self._copies.unhook()
        handles = list(self._handles.values())
        wait_all(handles, timeout)
        if self._handles and self.commit_mode is CommitMode.LOCAL:
            self._session.withdraw(list(self._handles.values()), f"close timeout {timeout}s", self.commit_timeout)
        elif durable := [h for h in self._handles.values() if h.durable_s is not None]:
            await_rank0(durable, self.commit_timeout)   # relay: no longer this rank's to withdraw
        self._closed = True
        for relay in self._relays.values():
            relay.close()
        if self.run_scope is not None:
            self.run_scope.close()
        for h in list(self._handles.values()):      # before the disconnect, which would say "lost"
            self._finish(h, f"checkpointer closed before step {h.step} committed (close timeout {timeout}s)")
        self._copies.shutdown()
        self.plans.clear()                          # it holds the last planned state's tensors
        self._session.drop()
        if self.daemon is not None:                 # every save has settled: nothing left for it to drain
            self.daemon.stop()
        report = CloseReport.of(handles)
        if not report.ok:
            log.warning("ckptd: %s", report)
        return report

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
