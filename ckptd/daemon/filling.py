"""A save handed over before its slot is full (FORMAT.md: ``save`` with ``filling``, ``save_filled``).

A trainer that copies its whole state inside ``save()`` (nothing deferred to its copy thread) sends
the SAVE first and then copies, saying every few tens of MiB how far the slot is filled from its
start; the writer reads up to there and waits for more. The write then runs beside the copy
instead of after it: time to durable loses the copy (0.07-0.13 s per GiB here; on a GPU node the
device-to-host copy). Everything else is a normal save's: the bytes stay in the trainer's slot (no
copy, the memory tier may keep the slot), and the slot goes back as usual. A trainer that dies
before its slot is full ends the wait (``cancel``: its session closed) and so the write: the step
fails, and no part of it is ever committed; one that stalls fails it after ``timeout``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ckptd.core.schema import TensorLayout
from ckptd.daemon.runtime import RequestError
from ckptd.daemon.tiers.base import StreamedData

WAIT_TICK_S = 0.2            # how often a writer waiting for bytes checks whether to give up


class FillingSlot(StreamedData):
    """One filling save's slot: ``feed`` (the event loop) moves the filled mark, ``read`` (the
    writer's thread) waits for the bytes it needs and returns them in place, ``cancel`` (the loop)
    ends every wait: the trainer is gone."""

    resident = True

    def __init__(self, view: memoryview, total: int, timeout: float) -> None:
        self.view, self.total, self._timeout = view, total, timeout
        self._filled = 0
        self._ended = False
        self._cond = threading.Condition()

    @property
    def complete(self) -> bool:
        return self._filled >= self.total

    def feed(self, upto: int) -> None:
        """(Loop) the slot's bytes ``[0, upto)`` are in place. A mark below the last one is ignored (a
        stale report); one past the slot, or after the save ended, is a RequestError."""
        if upto < 0 or upto > len(self.view):
            raise RequestError(f"save_filled: {upto} is outside the {len(self.view)}-byte slot")
        with self._cond:
            if self._ended:
                raise RequestError("this save has ended (its write finished or failed)")
            if upto > self._filled:
                self._filled = upto
                self._cond.notify_all()

    def read(self, t: TensorLayout, start: int, length: int, stop: Callable[[], bool]) -> memoryview:
        a = t.offset + start
        self._wait(min(a + length, self.total), stop)
        return self.view[a: a + length]

    def mapped(self) -> memoryview:
        return self.view

    def whole(self, stop: Callable[[], bool]) -> memoryview:
        self._wait(self.total, stop)
        return self.view

    def _wait(self, end: int, stop: Callable[[], bool]) -> None:
        if self._filled >= end:
            return
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while self._filled < end:
                if self._ended or stop():
                    raise RuntimeError(f"the save ended with its slot filled to byte {self._filled} of {self.total}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the trainer filled its slot to byte {self._filled} of {self.total} and no "
                                       f"further within {self._timeout:g}s")
                self._cond.wait(WAIT_TICK_S)

    def cancel(self) -> None:
        """(Loop) its trainer is gone: a writer waiting for bytes stops now."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()
