"""The training-side manager: ``Checkpointer`` and the ``SaveHandle`` each save returns."""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckptd.core import names, protocol
from ckptd.core.names import INDEX_NAME, job_dir, step_dir, step_dir_name
from ckptd.core.reader import latest_committed

from .connection import DaemonConnection
from .errors import CheckpointError, NotDelivered
from .relay import StoreRelay
from .restore import load_shard
from .slots import ClientSlot, SlotCopy, plan_layout
from .state import apply_state, flatten_state

log = logging.getLogger("ckptd_client")


class SaveHandle:
    """One save in flight. ``wait()`` returns once the step is committed, or raises why not."""

    def __init__(self, step: int, seq: int) -> None:
        self.step = step
        self.seq = seq
        self.stall_s = 0.0          # time save() blocked the trainer (copy + hand-off)
        self.fence_s = 0.0          # time a fence blocked the trainer (overlapped copies)
        self.started = time.monotonic()
        self.durable_s: float | None = None
        self.committed_s: float | None = None
        self.raw_bytes = 0
        self.stored_bytes = 0
        self.slot: int | None = None
        self.skipped = False        # when_busy="skip" found no free slot: nothing was saved
        self._done = threading.Event()
        self._error: str | None = None

    def _resolve(self, error: str | None) -> None:
        if self._done.is_set():
            return
        self._error = error
        if error is None:
            self.committed_s = time.monotonic() - self.started
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def committed(self) -> bool:
        return self._done.is_set() and self._error is None and not self.skipped

    @property
    def error(self) -> str | None:
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise CheckpointError(f"step {self.step} not committed within {timeout}s")
        if self._error is not None:
            raise CheckpointError(f"step {self.step} failed: {self._error}")

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "committed" if self.committed else \
            ("failed" if self.done() else "pending")
        return f"<SaveHandle step={self.step} {state} stall={self.stall_s * 1e3:.1f}ms>"


def _dist_info() -> tuple[int, int, Any]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        store = None
        try:
            from torch.distributed.distributed_c10d import _get_default_store
            store = _get_default_store()
        except Exception:
            pass
        return dist.get_rank(), dist.get_world_size(), store
    return 0, 1, None


class Checkpointer:
    """Saves through the node's ckptd daemon; restores straight from storage.

    ``socket``: the daemon's socket (default ``$CKPTD_SOCKET``, else /run/ckptd/ckptd.sock).
    ``root``: where checkpoints live; asked from the daemon when not given (given, restore
    needs no daemon). ``rank``/``world_size``/``store`` default from torch.distributed.
    ``commit``: ``auto`` relays completion through the c10d store when world_size > 1 and
    a store exists (ranks may span daemons), else the daemon counts ranks itself (``local``).
    """

    def __init__(self, job: str, socket: str | None = None, root: str | None = None, *,
                 rank: int | None = None, world_size: int | None = None, store: Any = None,
                 num_slots: int = 2, commit: str = "auto", commit_timeout: float = 600.0,
                 restore_threads: int | None = None, overlap: bool = True, when_busy: str = "block") -> None:
        self.job = names.validate_job(job)
        self.socket_path = socket or protocol.default_socket_path()
        self.root = os.path.abspath(root) if root else None
        d_rank, d_world, d_store = _dist_info()
        self.rank = d_rank if rank is None else rank
        self.world_size = d_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")
        self.store = store if store is not None else d_store
        if commit == "auto":
            commit = "relay" if self.world_size > 1 and self.store is not None else "local"
        if commit not in protocol.COMMIT_MODES or (commit == "relay" and self.store is None):
            raise ValueError(f"commit must be 'auto', 'local' or 'relay' (relay needs a c10d store), got {commit!r}")
        self.commit_mode = commit
        self.commit_timeout = commit_timeout
        self.num_slots = num_slots
        self.restore_threads = restore_threads or max(1, len(os.sched_getaffinity(0)))
        self._conn: DaemonConnection | None = None
        self._slots: list[ClientSlot] = []
        self._free: set[int] = set()
        self._cond = threading.Condition()
        self._handles: dict[int, SaveHandle] = {}      # step → handle (one save per step in flight)
        self._seq = 0
        self._restores = 0
        self._relay: StoreRelay | None = None
        self._closed = False
        self.overlap = overlap
        self.when_busy = when_busy
        self._inflight: tuple[SaveHandle, SlotCopy] | None = None
        self._copy_pool: ThreadPoolExecutor | None = None
        self._hooks: dict[int, Any] = {}
        self._side_streams: dict[torch.device, Any] = {}   # CUDA copy streams, one per device

    # ---- connection and slots ----------------------------------------------

    def _connect(self, slot_bytes: int) -> DaemonConnection:
        conn = DaemonConnection(self.socket_path, self._on_event)
        try:
            reply = conn.request({"op": "hello", "job": self.job, "rank": self.rank,
                                  "world_size": self.world_size, "pid": os.getpid(),
                                  "slot_bytes": slot_bytes, "num_slots": self.num_slots if slot_bytes else 0})
        except CheckpointError:
            conn.close()
            raise
        if self.root is None:
            self.root = reply["root"]
        self._install_slots(reply)
        self._conn = conn
        return conn

    def _install_slots(self, reply: dict[str, Any]) -> None:
        for s in self._slots:
            s.close()
        self._slots = [ClientSlot(i, fd, size) for i, (fd, size) in enumerate(zip(reply["_fds"], reply["slots"]))]
        with self._cond:
            self._free = set(range(len(self._slots)))

    def _ensure_slots(self, nbytes: int) -> DaemonConnection:
        nbytes = max(nbytes, 1)
        if self._conn is None or self._conn.lost:
            self._drop_connection()
            return self._connect(nbytes)
        if not self._slots or self._slots[0].size < nbytes:
            self._wait_all_slots_free()
            reply = self._conn.request({"op": "resize", "slot_bytes": nbytes, "num_slots": self.num_slots})
            self._install_slots(reply)
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        for s in self._slots:
            s.close()
        self._slots = []
        with self._cond:
            self._free = set()

    def _wait_all_slots_free(self) -> None:
        with self._cond:
            while len(self._free) < len(self._slots) and self._conn is not None and not self._conn.lost:
                self._cond.wait(0.1)

    def _acquire_slot(self, block: bool = True) -> int | None:
        with self._cond:
            while not self._free:
                if self._conn is None or self._conn.lost:
                    raise NotDelivered(f"connection to ckptd at {self.socket_path} lost")
                if not block:
                    return None
                self._cond.wait(0.1)
            return self._free.pop()

    # ---- events from the daemon (reader thread) ----------------------------

    def _on_event(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "slot_free":
            with self._cond:
                self._free.add(msg["slot"])
                self._cond.notify_all()
            return
        if op == "lost":
            with self._cond:
                self._cond.notify_all()
            reason = f"connection to ckptd at {self.socket_path} lost: {msg['reason']}"
            for h in list(self._handles.values()):
                if h.durable_s is None and self._relay is not None:
                    self._relay.publish(h.seq, f"fail:{reason}")
                if h.durable_s is None or self.commit_mode == "local":
                    # The daemon may have committed just before it went away: the index decides.
                    committed = h.durable_s is not None and self.root is not None and os.path.isfile(
                        os.path.join(step_dir(self.root, self.job, h.step), INDEX_NAME))
                    self._finish(h, None if committed else reason)
            return
        h = self._handles.get(msg.get("step"))
        if h is None:
            return
        if op == "durable":
            h.durable_s = time.monotonic() - h.started
            h.raw_bytes, h.stored_bytes = msg.get("raw_bytes", 0), msg.get("stored_bytes", 0)
            if self._relay is not None:
                self._relay.publish(h.seq, f"ok:{msg['digest']}")
        elif op == "committed":
            self._finish(h, None)
        elif op == "failed":
            if self._relay is not None:
                self._relay.publish(h.seq, f"fail:{msg['reason']}")
            self._finish(h, msg["reason"])

    def _finish(self, h: SaveHandle, error: str | None) -> None:
        if self._handles.get(h.step) is h:
            del self._handles[h.step]
        h._resolve(error)

    # ---- public API --------------------------------------------------------

    def prepare(self, state: dict[str, Any]) -> None:
        """Connect and allocate slots sized for ``state`` now, so the first save pays no set-up.

        Call it once the state has its full size — after the first optimizer step, when Adam's
        moments exist — or a larger first save re-allocates the slots."""
        _, nbytes = plan_layout(flatten_state(state).tensors)
        self._ensure_slots(nbytes)

    def save(self, step: int, state: dict[str, Any], *, overlap: bool | None = None,
             when_busy: str | None = None) -> SaveHandle:
        """Snapshot ``state`` into a shared-memory slot and hand it to the daemon.

        Overlapped (``overlap=True``, the default): when ``state`` holds an optimizer, module
        parameters and optimizer state are copied in the background while forward/backward run,
        and ``fence()`` — called automatically by a step pre-hook on those optimizers — waits
        for the copy before the first mutation; everything else is copied before ``save()``
        returns. Call ``fence()`` yourself before changing parameters outside that step.
        Blocking copy (``overlap=False``): all of it is copied first. ``when_busy``: with every slot still being written,
        ``block`` waits for one, ``skip`` returns a handle with ``skipped=True`` at once.
        """
        if self._closed:
            raise CheckpointError("checkpointer is closed")
        overlap = self.overlap if overlap is None else overlap
        when_busy = when_busy or self.when_busy
        if when_busy not in ("block", "skip"):
            raise ValueError(f"when_busy must be 'block' or 'skip', got {when_busy!r}")
        step_dir_name(step)  # validates the step number
        self.fence()
        t0 = time.perf_counter()
        flat = flatten_state(state)
        layout, nbytes = plan_layout(flat.tensors)
        if step in self._handles:
            raise CheckpointError(f"step {step} is already being saved")
        self._seq += 1
        handle = SaveHandle(step, self._seq)
        self._handles[step] = handle
        if self.commit_mode == "relay":
            self._ensure_relay().track(handle.seq, step, lambda err, h=handle: self._finish(h, err))
        for attempt in (1, 2):
            try:
                conn = self._ensure_slots(nbytes)
                handle.slot = self._acquire_slot(block=when_busy == "block")
                if handle.slot is None:
                    handle.skipped = True
                    self._abandon(handle, None)
                    break
                msg = {"op": "save", "step": step, "slot": handle.slot, "tensors": layout, "tree": flat.tree,
                       "commit": self.commit_mode}
                copy = SlotCopy(self._slots[handle.slot], layout, flat.tensors,
                                flat.deferrable if overlap else frozenset(), self._copier() if overlap else None,
                                self._side_streams)
                if copy.deferred:
                    self._hook_optimizers(flat.optimizers)
                    self._inflight = (handle, copy)
                    copier = self._copier()
                    copy.start()                      # last: see SlotCopy.start
                    copier.submit(self._hand_off, conn, handle, msg, copy)
                else:
                    conn.request(msg)
                break
            except NotDelivered:
                # The daemon went away (restart) before it saw this save: reconnect and redo it once.
                if attempt == 2:
                    self._abandon(handle, "daemon connection lost twice before the hand-off")
                    raise
                with self._cond:
                    self._free.discard(handle.slot)
                self._drop_connection()
            except BaseException as e:
                self._abandon(handle, f"hand-off to the daemon failed: {e}")
                raise
        handle.stall_s = time.perf_counter() - t0
        if self._inflight is None and not handle.skipped:
            self._report(handle)
        return handle

    def fence(self) -> None:
        """Wait until the state may be mutated (only an overlapped save's copy can be pending)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        handle, copy = inflight
        t0 = time.perf_counter()
        copy.fence()
        handle.fence_s += time.perf_counter() - t0
        self._report(handle)

    def _copier(self) -> ThreadPoolExecutor:
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-client-copy")
        return self._copy_pool

    def _hook_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(lambda *_: self.fence())

    def _hand_off(self, conn: DaemonConnection, handle: SaveHandle, msg: dict[str, Any], copy: SlotCopy) -> None:
        """(Copy thread) send the layout once every byte of an overlapped copy is in the slot."""
        try:
            copy.wait_host()
            conn.request(msg)
        except BaseException as e:
            self._abandon(handle, f"hand-off to the daemon failed: {e}")

    def _abandon(self, handle: SaveHandle, error: str | None) -> None:
        """A save that never reached the daemon: give its slot back and resolve its handle."""
        if handle.slot is not None:
            with self._cond:
                if 0 <= handle.slot < len(self._slots):
                    self._free.add(handle.slot)
                self._cond.notify_all()
        if self._relay is not None:
            self._relay.publish(handle.seq, f"fail:rank {self.rank}: {error or 'skipped (no free slot)'}")
        self._finish(handle, error)

    def _report(self, handle: SaveHandle) -> None:
        """Tell the daemon what this save cost the trainer (for its metrics); never blocks."""
        if self._conn is not None and not self._conn.lost:
            self._conn.notify({"op": "report", "step": handle.step, "stall_s": handle.stall_s,
                               "fence_s": handle.fence_s})

    def _ensure_relay(self) -> StoreRelay:
        if self._relay is None:
            def commit(step: int, digests: dict[int, str]) -> None:
                self._conn.request({"op": "commit", "step": step, "digests": {str(r): d for r, d in digests.items()}})

            def abort(step: int, reason: str) -> None:
                if self._conn is not None and not self._conn.lost:
                    self._conn.request({"op": "abort", "step": step, "reason": reason})

            self._relay = StoreRelay(self.store, self.job, self.rank, self.world_size, self.commit_timeout,
                                     commit, abort)
        return self._relay

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every save in flight; raises CheckpointError for the first that failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in list(self._handles.values()):
            h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _root(self) -> str:
        if self.root is None:
            try:
                self.root = protocol.request_once(self.socket_path, {"op": "info"})["root"]
            except (ConnectionError, RuntimeError, protocol.ProtocolError) as e:
                raise CheckpointError(f"{e} (or pass root= to restore without a daemon)") from None
        return self.root

    def latest_step(self) -> int | None:
        info = latest_committed(job_dir(self._root(), self.job))
        return info.step if info else None

    def restore(self, state: dict[str, Any], step: int | None = None) -> int | None:
        """Load the latest committed step (or ``step``) into ``state`` in place; None if there is none.

        Tensors are decoded straight into the matching CPU tensors of ``state`` where they can
        be, so a restore that fails (a corrupt chunk) can leave ``state`` partly loaded: restore
        again, e.g. from an older ``step``."""
        self.fence()
        if step is None:
            step = self._agree(self.latest_step())
            if step is None:
                return None
        path = step_dir(self._root(), self.job, step)
        if not os.path.isdir(path):
            raise CheckpointError(f"step {step} of job {self.job!r} does not exist under {self._root()}")
        targets = dict(flatten_state(state).tensors)
        loaded = load_shard(path, self.rank, self.world_size, self.restore_threads, targets)
        apply_state(state, loaded)
        return step

    def _agree(self, step: int | None) -> int | None:
        """All ranks restore rank 0's choice, so a commit racing the listing cannot split them."""
        if self.world_size == 1 or self.store is None:
            return step
        self._restores += 1
        key = f"ckptd/{self.job}/restore/{self._restores}"
        if self.rank == 0:
            self.store.set(key, str(-1 if step is None else step))
        value = int(self.store.get(key).decode())
        return None if value < 0 else value

    def close(self, timeout: float | None = None) -> None:
        """Wait for saves in flight (their failures are logged, not raised), then disconnect."""
        if self._closed:
            return
        self.fence()
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        try:
            self.wait(timeout)
        except CheckpointError as e:
            log.warning("ckptd: a save did not commit before close: %s", e)
        self._closed = True
        if self._relay is not None:
            self._relay.close()
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
        self._drop_connection()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
