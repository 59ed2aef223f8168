"""``SaveHandle``: what ``Checkpointer.save`` returns, resolved later by the daemon's events."""
from __future__ import annotations

import threading
import time

from .errors import CheckpointError


class SaveHandle:
    """One save in flight. ``wait()`` returns once the step is committed, or raises why not."""

    def __init__(self, step: int, seq: int) -> None:
        self.step = step
        self.seq = seq              # the client's save number: names this save's c10d store keys
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
        """(Checkpointer) settle the outcome; the first call wins, as events can race a loss."""
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
