"""Shared-memory slots: the daemon-wide memory budget, and memfd allocation.

Slots are memfds the daemon creates, pre-faults and hands to the client with SCM_RIGHTS;
they are anonymous, so only the two processes holding the descriptor can see them, and the
kernel frees them when both are gone — a crashed trainer or daemon leaks no shared memory.
"""
from __future__ import annotations

import asyncio
import logging
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from ckptd.core.names import MAX_SLOTS
from ckptd.daemon.runtime import RequestError, describe_error
from ckptd.daemon.shm import new_memfd, shortage

log = logging.getLogger("ckptd")
MIN_SLOT_BYTES = 1 << 20     # less than this per slot left in the budget: refused
# The daemon keeps each slot's memfd (the memory tier may keep the slot as a step's resident copy
# and pass it to a restoring client). Python's mmap keeps a duplicate of the descriptor open for
# the mapping's life before 3.13: one more fd per slot. docs/operations.md has the daemon's fd budget.
NO_FD_COPY: dict[str, bool] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def allocate_slots(name: str, size: int, count: int) -> list[tuple[int, mmap.mmap]]:
    """(memfd, read-only mapping) for each slot, pages allocated (huge where the node allows: shm.py)
    and mapped up front.

    First touch of fresh shared memory is ~15x slower than a warm copy: it must be paid here,
    once per session, not on the trainer's first save or the daemon's first read."""
    made: list[tuple[int, mmap.mmap]] = []
    try:
        for i in range(count):
            made.append(new_memfd(f"{name}-s{i}", size, mmap.PROT_READ, getattr(mmap, "MAP_POPULATE", 0),
                                  **NO_FD_COPY))
    except BaseException:
        for fd, mm in made:
            os.close(fd)
            mm.close()
        raise
    return made


def _close(made: list[tuple[int, mmap.mmap]]) -> None:
    for fd, mm in made:
        os.close(fd)
        mm.close()


def _close_made(fut: Future[list[tuple[int, mmap.mmap]]]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        _close(fut.result())


@dataclass(eq=False)
class Slot:
    """One slot as the daemon sees it: a read-only view of the trainer's copy, and its memfd."""
    index: int
    size: int
    view: memoryview
    mm: mmap.mmap
    fd: int
    busy: bool = False       # a save's shard is still reading it, or the memory tier keeps it (``lent``)
    lent: bool = False       # the memory tier keeps it as a held step's bytes until it lets the step go

    def close(self) -> None:
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a slice is still alive in a writer thread; the mapping goes when it is collected
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotPool:
    """Every session's slots come out of one budget (``slot_memory_limit``).

    The budget is reserved before the (slow) allocation starts and given back on every path
    that does not end with the slots attached to a live session."""

    def __init__(self, limit: int, executor: Executor) -> None:
        self.limit = limit
        self.in_use = 0
        self._executor = executor

    async def allocate(self, owner: str, slot_bytes: int, num_slots: object,
                       abandoned: Callable[[], bool], spare: int = 0) -> tuple[list[Slot], list[int]]:
        """``num_slots`` slots of ``slot_bytes`` (rounded up to pages), or smaller ones where the budget
        has less left: (slots, copies of their memfds to send; the caller closes those once sent).

        The pages are allocated on an I/O thread: GiBs of them must not stall the event loop
        and every other client. ``abandoned`` is asked once they are made: a session that
        closed meanwhile gets nothing, and the budget back."""
        if slot_bytes == 0:
            return [], []
        if not (0 < slot_bytes and type(num_slots) is int and 1 <= num_slots <= MAX_SLOTS):
            raise RequestError(f"bad slot request: {num_slots} slots of {slot_bytes} bytes (1-{MAX_SLOTS} slots)")
        page = mmap.PAGESIZE
        size = -(-slot_bytes // page) * page
        if self.in_use + size * num_slots > self.limit - spare:
            # Smaller slots then: the client streams a save through them (streamed.py); ``spare`` bytes
            # stay for the sessions of the node's other ranks still to come (else one rank that streams
            # takes the whole budget, and they can never save).
            fit = max(0, self.limit - spare - self.in_use) // num_slots // page * page
            if fit < MIN_SLOT_BYTES:
                raise RequestError(
                    f"slot memory limit: {num_slots} x {size} bytes requested, {self.in_use} of "
                    f"{self.limit} bytes already in use, less than {num_slots} x {MIN_SLOT_BYTES} left "
                    "(raise slot_memory_limit)")
            log.info("slots smaller than asked: saves stream through them",
                     extra={"ctx": {"owner": owner, "asked": size, "granted": fit, "slots": num_slots}})
            size = fit
        total = size * num_slots
        made_later = self._executor.submit(allocate_slots, owner, size, num_slots)
        self.in_use += total
        try:
            made = await asyncio.wrap_future(made_later)
        except OSError as e:
            self.in_use -= total
            raise RequestError(f"cannot allocate shared-memory slots: {describe_error(e)}{shortage(e)}") from None
        except BaseException:             # cancelled (shutdown): the thread's slots are closed when it is done
            self.in_use -= total
            made_later.add_done_callback(_close_made)
            raise
        if abandoned():
            self.in_use -= total
            _close(made)
            raise RequestError("connection closed while its slots were allocated")
        slots = [Slot(i, size, memoryview(mm), mm, fd) for i, (fd, mm) in enumerate(made)]
        sent: list[int] = []
        try:
            for s in slots:
                sent.append(os.dup(s.fd))
        except OSError as e:            # out of descriptors
            for fd in sent:
                os.close(fd)
            self.release(slots)
            raise RequestError(f"cannot pass shared-memory slots: {describe_error(e)}") from None
        return slots, sent

    def release(self, slots: Sequence[Slot]) -> None:
        """Give the slots' memory back to the budget; a slot a shard still reads (or the memory tier
        keeps) closes when it is done with it (``Session.slot_free``)."""
        for s in slots:
            self.in_use -= s.size
            if not s.busy:
                s.close()
