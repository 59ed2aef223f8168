"""``SaveHandle``: what ``Checkpointer.save`` returns, resolved later by the daemon's events."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.core.protocol import SaveLevel

from .errors import CheckpointError

log = logging.getLogger("ckptd_client")
WATCH_EVERY_S = 2.0     # how often a wait with no timeout asks whether the daemon still answers


class SaveHandle:
    """One save in flight. ``wait()`` returns once the step is committed, or raises why not."""

    def __init__(self, step: int, seq: int, level: SaveLevel = SaveLevel.STORAGE) -> None:
        self.step = step
        self.level = level          # storage, or memory (a memory-level step: Checkpointer.save)
        self.seq = seq              # the client's save number (store keys follow the step, not this)
        self.stall_s = 0.0          # time save() blocked the trainer (copy + hand-off)
        self.fence_s = 0.0          # time a fence blocked the trainer (overlapped copies)
        self.setup_s = 0.0          # of stall_s: connecting and allocating slots (a first save, a resize)
        self.started = time.monotonic()
        self.durable_s: float | None = None
        self.digest: str | None = None  # this rank's manifest digest, as its daemon reported it durable
        self.committed_s: float | None = None
        self.raw_bytes = 0
        self.stored_bytes = 0
        self.slot: int | None = None
        self.skipped = False        # when_busy="skip" found no free slot: nothing was saved
        # Committed as the disk said, but the fsync of the step's directory failed (disk.py): the
        # step loads now and may not survive a crash of its node. None: no such doubt.
        self.sync_error: str | None = None
        self._done = threading.Event()
        self._error: str | None = None
        # Set at the hand-off (DaemonSession.watch): asks whether the daemon still answers, and gives its
        # connection up as lost (settling this handle by the disk's rule) once it has been silent too long.
        self.watch: Callable[[], None] | None = None

    def settle(self, error: str | None) -> None:
        """(The Checkpointer's) settle the outcome: None committed, else why not; the first call wins,
        as events can race a loss."""
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
        """Return once the step is committed; CheckpointError why not: failed, not committed within
        ``timeout`` seconds, or skipped (``when_busy="skip"``: nothing was saved, so nothing committed).
        With no ``timeout`` it still ends: once the daemon has answered nothing for max(commit_timeout,
        its step_timeout) + 5 s (stopped, or wedged) its connection counts as lost and the save fails
        (committed if its index.json is on disk)."""
        if not _wait_done(self, timeout):
            raise CheckpointError(f"step {self.step} not committed within {timeout}s")
        if self._error is not None:
            raise CheckpointError(f"step {self.step} failed: {self._error}")
        if self.skipped:
            raise CheckpointError(f"step {self.step} was skipped: every slot was busy (when_busy=\"skip\"), so "
                                  "nothing was saved; check handle.skipped, or save with when_busy=\"block\"")

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else "committed" if self.committed else \
            ("failed" if self.done() else "pending")
        return f"<SaveHandle step={self.step} {state} stall={self.stall_s * 1e3:.1f}ms>"


def _steps(steps: tuple[int, ...]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


@dataclass(frozen=True)
class CloseReport:
    """What ``Checkpointer.close()`` waited for: the saves still in flight when it was called, by
    outcome. Saves that had settled before (``wait()`` returned) are not in it, so its text says
    "in flight" and never reads as a count of every save the Checkpointer made."""
    committed: tuple[int, ...] = ()
    failed: tuple[tuple[int, str], ...] = ()       # (step, reason)
    skipped: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed

    def __str__(self) -> str:
        n = len(self.committed) + len(self.failed) + len(self.skipped)
        if n == 0:
            return "no save was still in flight at close"
        parts = [f"{len(self.committed)} committed ({_steps(self.committed)})"] if self.committed else []
        if self.skipped:
            parts.append(f"{len(self.skipped)} skipped, no free slot ({_steps(self.skipped)})")
        if self.failed:
            parts.append(f"{len(self.failed)} failed: "
                         + "; ".join(f"step {step}: {reason}" for step, reason in self.failed))
        return f"{n} save(s) still in flight at close: " + ", ".join(parts)

    @staticmethod
    def of(handles: list[SaveHandle]) -> CloseReport:
        done = [h for h in handles if h.done()]
        return CloseReport(tuple(h.step for h in done if h.committed),
                           tuple((h.step, h.error or "") for h in done if h.error is not None),
                           tuple(h.step for h in done if h.skipped))


def await_rank0(handles: list[SaveHandle], commit_timeout: float) -> None:
    """Relay commit, at close: these saves' shards are durable on this rank, so their outcomes are out of
    its hands (in a node record, or in rank 0's commit): settling them "failed" now could contradict an
    index.json rank 0 writes later. Wait for rank 0's decision instead; the relay resolves each within
    2 ``commit_timeout`` (+5 s) of its start (relay.py), which bounds this wait too."""
    log.info("ckptd: close waits for rank 0's decision on step(s) %s (this rank's shards are durable; at most "
             "%gs)", ", ".join(str(h.step) for h in handles), 2 * commit_timeout + 10)
    wait_all(handles, 2 * commit_timeout + 10)


def wait_all(handles: list[SaveHandle], timeout: float | None) -> None:
    """Wait for each handle to its own outcome (a failed one does not stop the others), all within
    ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for h in handles:
        _wait_done(h, None if deadline is None else max(0.0, deadline - time.monotonic()))


def _wait_done(h: SaveHandle, timeout: float | None) -> bool:
    """Whether ``h`` settled within ``timeout``; with none, its daemon is watched meanwhile (``h.watch``):
    a silent daemon's connection is given up as lost, which settles ``h``."""
    if timeout is not None or h.watch is None:
        return h._done.wait(timeout)
    while not h._done.wait(WATCH_EVERY_S):
        h.watch()
    return True


def wait_each(handles: list[SaveHandle], timeout: float | None) -> None:
    """Wait for each handle within ``timeout`` seconds in all; CheckpointError for the first that failed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for h in handles:
        h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
