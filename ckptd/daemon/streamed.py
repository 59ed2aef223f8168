"""A save streamed through slots smaller than its shard (FORMAT.md: ``save`` with ``stream``, ``save_part``).

When the slot budget cannot lend a rank slots the size of its state, the state still saves: the
client copies the shard's bytes into its slots part by part (part ``k`` is the layout's bytes
``[k × part, (k + 1) × part)``, in whichever slot is free), and the writer reads on as each part
arrives. A part's slot goes back to the trainer as soon as the writer has read past it (the bytes
it encodes are copied out, so no chunk still being encoded points into a reused slot), and every
slot still held goes back when the write ends, however it ends. So host memory stays at the slots
plus the codec's window, whatever the state's size; the trainer stalls for the whole save.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptd.core.schema import TensorLayout
from ckptd.daemon.runtime import RequestError
from ckptd.daemon.slot_pool import Slot
from ckptd.daemon.tiers.base import StreamedData

MAX_PARTS = 1 << 20
WAIT_TICK_S = 0.2            # how often a writer waiting for a part checks whether to give up


def check_stream(stream: Any, slot_size: int) -> tuple[int, int]:
    """(total bytes, part bytes) of a save's ``stream`` field, checked against its first slot."""
    if not (isinstance(stream, list) and len(stream) == 2 and all(type(x) is int for x in stream)):
        raise RequestError("stream must be [total bytes, part bytes]")
    total, part = stream
    if not (0 < part <= slot_size and part < total and -(-total // part) <= MAX_PARTS):
        raise RequestError(f"stream: {total} bytes in parts of {part} bytes does not fit slots of "
                           f"{slot_size} bytes (at most {MAX_PARTS} parts)")
    return total, part


class StreamedShard(StreamedData):
    """One streamed save's parts as they arrive: ``feed`` (the event loop) hands over part after part,
    ``read`` (the writer's thread) waits for the part it needs, ``finish`` (the loop, once the writer
    stops reading) gives back every slot still held. ``free`` gives one slot back to its trainer."""

    def __init__(self, total: int, part: int, first: Slot, free: Callable[[Slot], None],
                 loop: asyncio.AbstractEventLoop, part_timeout: float) -> None:
        self.total, self.part = total, part
        self.parts = -(-total // part)
        self._slots: dict[int, Slot] = {0: first}
        self._next = 1                  # the part the client sends next
        self._gone = 0                  # parts below this were given back
        self._ended = False
        self._cond = threading.Condition()
        self._free, self._loop, self._timeout = free, loop, part_timeout

    def feed(self, index: int, slot: Slot) -> None:
        """(Loop) part ``index`` is in ``slot``; RequestError if it is not the one expected or too big."""
        size = min(self.part, self.total - index * self.part)
        with self._cond:
            if self._ended:
                raise RequestError("this streamed save has ended (its write finished or failed)")
            if index != self._next or index >= self.parts:
                raise RequestError(f"part {index} out of order: part {self._next} of {self.parts} expected")
            if slot.size < size:
                raise RequestError(f"part {index} needs {size} bytes; slot {slot.index} has {slot.size}")
            self._slots[index] = slot
            self._next += 1
            self._cond.notify_all()

    def read(self, t: TensorLayout, start: int, length: int, stop: Callable[[], bool]) -> memoryview:
        """The bytes ``[start, start + length)`` of ``t``, waiting for their parts. A part's slot goes back
        once its bytes in this read are copied out (reads come in increasing order): a read spanning
        more parts than the trainer has slots waits for parts that can only come in those slots."""
        a = t.offset + start
        self._give_back_below(a // self.part)
        out = bytearray(length)
        pos, end = a, a + length
        while pos < end:
            k = pos // self.part
            slot = self._wait(k, stop)
            upto = min((k + 1) * self.part, end)
            out[pos - a: upto - a] = slot.view[pos - k * self.part: upto - k * self.part]
            pos = upto
            self._give_back_below(pos // self.part)
        return memoryview(out)

    def _wait(self, k: int, stop: Callable[[], bool]) -> Slot:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while k not in self._slots:
                if self._ended or stop():
                    raise RuntimeError(f"streamed save ended while waiting for part {k} of {self.parts}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"part {k} of {self.parts} did not come within {self._timeout:g}s")
                self._cond.wait(WAIT_TICK_S)
            return self._slots[k]

    def _give_back_below(self, k: int) -> None:
        """(Writer thread) the parts below ``k`` are read: their slots go back to the trainer."""
        with self._cond:
            done = [self._slots.pop(i) for i in range(self._gone, k) if i in self._slots]
            self._gone = max(self._gone, k)
        for slot in done:
            self._loop.call_soon_threadsafe(self._free, slot)

    def cancel(self) -> None:
        """(Loop) its trainer is gone: a writer waiting for a part stops now (and then ``finish``es)."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def finish(self) -> None:
        """(Loop) the writer reads no more: every slot still held goes back."""
        with self._cond:
            self._ended = True
            rest, self._slots = list(self._slots.values()), {}
            self._cond.notify_all()
        for slot in rest:
            self._free(slot)
