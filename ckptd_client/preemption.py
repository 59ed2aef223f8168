"""Opt-in preemption handling: checkpoint at the next step boundary after SIGTERM, then stop.

Spot instances and schedulers announce an eviction with a signal (usually SIGTERM) and
a grace period before SIGKILL. ``PreemptionHandler`` turns that signal into a flag; the
training loop polls it at each step boundary, where the state is consistent::

    ckpt = ckptd_client.Checkpointer(job="gpt-7b")
    with ckptd_client.PreemptionHandler(ckpt) as preempt:      # SIGTERM by default
        for step in range(start, total_steps):
            train_step()
            if preempt.should_stop(step + 1, state):
                break             # step + 1 is committed (or preempt.error says why not)
    ckpt.close()                  # then let the process exit normally (exit code 0)

``should_stop(n, state)`` takes the number ``save`` would give ``state`` now — the step to train
next, ``step + 1`` after ``step`` trained (README: a resume trains ``restore()``'s step first), so
the preemption checkpoint resumes bit-exact; passing ``step`` would train it twice. It costs one
flag check until a signal arrives. After one, it saves ``state`` as ``n`` (unless that step is
already committed or being saved to storage: a memory-level save of it does not outlive the
node, so it is saved again), waits until every save in flight has committed (at most
``timeout`` seconds) and returns True.
If the checkpoint fails it still returns True — the machine is going away — and logs the
reason, which ``error`` keeps. ``saved_step`` is the step it committed.

Multi-rank jobs: every rank must save the same step. With ``world_size > 1`` and a c10d
store (the Checkpointer's), the rank that first sees the signal proposes "stop at
``step + margin``" in the store; every rank checks the store each ``sync_every`` steps
and stops at the agreed step, so a signal delivered to one rank, or to all ranks at
slightly different steps, still yields one consistent checkpoint. ``margin`` (default 2)
must exceed how many steps ranks can drift apart (collectives keep data-parallel ranks
within one step). Without a store, each rank acts on its own signal, so several ranks
sharing a step need the signal at the same boundary (or call ``request()`` themselves
after agreeing some other way); a rank that saves alone leaves a step that never commits.
The proposal lives under the run's id (run_scope.py), so an earlier run's (a store that
outlives runs) never stops this one; until the ranks have agreed that id, nothing is read.

Signals: handlers are installed on construction (from the main thread) and the previous
ones restored by ``close()``/``__exit__``. A second signal while the checkpoint is being
taken is logged and otherwise ignored; once ``close()`` has run, the previous disposition
(for SIGTERM usually "terminate") applies again.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

from ckptd.core.names import step_dir
from ckptd.core.protocol import SaveLevel
from ckptd.core.step_files import is_committed

from . import bucket_restore, store_keys
from .checkpointer import Checkpointer
from .errors import CheckpointError
from .modes import WhenBusy
from .store_io import peek, read_once

log = logging.getLogger("ckptd_client")


class PreemptionHandler:
    """Checkpoint at the next step boundary after a preemption signal, then tell the loop to stop.

    ``checkpointer``: the job's ``Checkpointer``. ``signals``: signals that mean "preempted"
    (default SIGTERM). ``timeout``: seconds to wait for the commit (None: no limit; the
    scheduler's SIGKILL is the real limit). ``sync_every``/``margin``: multi-rank agreement,
    see the module docstring. ``bucket_timeout``: with a daemon that has a bucket, rank 0 then
    waits this long for the step to be committed in the bucket and logs whether it was.
    """

    def __init__(self, checkpointer: Checkpointer, signals: Iterable[int] = (signal.SIGTERM,), *,
                 timeout: float | None = None, sync_every: int = 1, margin: int = 2,
                 bucket_timeout: float = 30.0) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler must be created in the main thread (signal handlers live there)")
        if sync_every < 1 or margin < 1:
            raise ValueError("sync_every and margin must be >= 1")
        self.ckpt = checkpointer
        self.signals = tuple(signals)
        if not self.signals:
            raise ValueError("give at least one signal")
        self.timeout = timeout
        self.sync_every = sync_every
        self.margin = margin
        self.signal_received: int | None = None      # the signal number, once one arrived
        self.saved_step: int | None = None           # the step committed on preemption
        self.error: str | None = None                # why that checkpoint failed, if it did
        self.bucket_timeout = bucket_timeout         # rank 0: seconds to get the step into the bucket (0: don't)
        self.in_bucket: bool | None = None           # rank 0 with a bucket: whether that step reached it
        self.stop_step: int | None = None            # multi-rank: the agreed step
        self._handling = False
        self._done = False
        self._polls = 0
        self._previous: dict[int, Any] = {}
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._scope = checkpointer.run_scope if checkpointer.world_size > 1 else None   # (None: no store)
        self._store: Any = checkpointer.store if self._scope is not None else None

    # ---- signal side --------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_received is None:
            self.signal_received = signum
            log.warning("ckptd: received %s; will checkpoint at the next step boundary and stop",
                        signal.Signals(signum).name)
        elif self._handling:
            log.warning("ckptd: %s again while the preemption checkpoint is being taken; still finishing it",
                        signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        """A preemption signal has arrived here (or, multi-rank, on some rank: see ``should_stop``)."""
        return self.signal_received is not None or self.stop_step is not None

    def request(self) -> None:
        """Ask for a preemption checkpoint as if a signal had arrived (e.g. from a health check)."""
        self._on_signal(self.signals[0], None)

    # ---- training-loop side -------------------------------------------------

    def should_stop(self, step: int, state: dict[str, Any]) -> bool:
        """Call once per step boundary with the number ``save`` would give ``state`` (the step to train
        next); True once the preemption checkpoint is done (stop training)."""
        if self._done:
            return True
        if self._store is not None:
            stop_step = self._agreed(step)
            if stop_step is None or step < stop_step:
                return False
            if step > stop_step:
                log.error("ckptd: rank passed the agreed preemption step %d at step %d; saving %d instead "
                          "(raise margin)", stop_step, step, step)
        elif self.signal_received is None:
            return False
        self._checkpoint(step, state)
        return True

    def _agreed(self, step: int) -> int | None:
        """Multi-rank: propose a stop step if signalled here; learn the agreed one from the store,
        under this run's key only (an earlier run's proposal must not stop this one)."""
        if self.stop_step is not None:
            return self.stop_step
        store, scope = self._store, self._scope
        assert scope is not None
        if self.signal_received is not None:
            try:
                key = store_keys.preempt_step(scope.scope())     # (waits, bounded, for the run id)
                value = store.compare_set(key, "", str(step + self.margin))
            except Exception as e:      # no run id, or the store gone or silent (store_guard.py)
                log.error("ckptd: cannot agree a preemption step with the other ranks (%s); saving step %d "
                          "alone", e, step)
                self.stop_step = step
                return step
            self.stop_step = int(value.decode() if isinstance(value, bytes) else value)
            log.warning("ckptd: preemption agreed at step %d", self.stop_step)
            read_once(store, key, self.ckpt.world_size)
            return self.stop_step
        self._polls += 1
        run = scope.current()
        if self._polls % self.sync_every or run is None:      # (the run id not agreed yet: nothing to read)
            return None
        key = store_keys.preempt_step(store_keys.scope(self.ckpt.job, run))
        try:
            value = peek(store, key)
        except Exception as e:      # the store is gone or did not answer (store_guard.py): no word this poll
            log.warning("ckptd: cannot read the preemption agreement from the job's store: %s", e)
            return None
        if value:
            self.stop_step = int(value)
            log.warning("ckptd: another rank was preempted; stopping at step %d", self.stop_step)
            read_once(store, key, self.ckpt.world_size)
        return self.stop_step

    def _checkpoint(self, step: int, state: dict[str, Any]) -> None:
        self._handling = True
        t0 = time.monotonic()
        try:
            handle = self.ckpt.pending(step)       # the loop already saved this step?
            if handle is not None and handle.level is SaveLevel.MEMORY:
                # A memory-level step does not outlive its daemons (the node is going away): let it
                # settle, then save the step to storage as well.
                try:
                    handle.wait(self.timeout)
                except CheckpointError as e:
                    log.warning("ckptd: memory-level save of step %d failed (%s); saving it to storage", step, e)
                handle = None
            if handle is None and not self._committed(step):
                # Block for a free slot even if the Checkpointer skips saves when busy.
                handle = self.ckpt.save(step, state, when_busy=WhenBusy.BLOCK)
            if handle is not None:
                handle.wait(self.timeout)
            self.saved_step = step
            log.warning("ckptd: preemption checkpoint of step %d committed in %.2fs", step, time.monotonic() - t0)
            self._flush(step)
        except (CheckpointError, OSError) as e:
            self.error = str(e)
            log.error("ckptd: preemption checkpoint of step %d failed: %s", step, e)
        finally:
            try:        # earlier saves still in flight get the same chance to commit
                self.ckpt.wait(self.timeout)
            except CheckpointError as e:
                log.warning("ckptd: an earlier save did not commit before preemption: %s", e)
            self._handling = False
            self._done = True

    def _committed(self, step: int) -> bool:
        """Whether ``step`` is committed already (saved to storage before the signal: a save of it again
        would be refused)."""
        return is_committed(step_dir(self.ckpt.resolve_root(), self.ckpt.job, step))

    def _flush(self, step: int) -> None:
        """Rank 0: have the daemon upload the step to its bucket now (nodes and disks may not come back)."""
        if self.ckpt.rank != 0 or self.bucket_timeout <= 0:
            return
        flushed = bucket_restore.flush(self.ckpt.socket_path, self.ckpt.job, step, self.bucket_timeout)
        if not flushed.bucket:
            return
        self.in_bucket = flushed.uploaded
        if flushed.uploaded:
            log.warning("ckptd: preemption checkpoint of step %d is committed in the bucket", step)
        else:
            log.error("ckptd: preemption checkpoint of step %d did not reach the bucket: %s", step, flushed.detail)

    # ---- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Restore the signal handlers that were installed before this one."""
        for sig, prev in self._previous.items():
            try:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        self._previous = {}

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
