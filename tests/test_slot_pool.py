"""The slot pool's budget and memfd allocation, in-process with real memfds and mappings."""
from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptd.daemon.runtime import RequestError
from ckptd.daemon.slot_pool import MAX_SLOTS, SlotPool

PAGE = mmap.PAGESIZE


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(2)
    yield executor
    executor.shutdown(wait=True)


def never() -> bool:
    return False


async def test_allocate_rounds_to_pages_and_counts_the_budget(pool: ThreadPoolExecutor) -> None:
    slots = SlotPool(64 * PAGE, pool)
    made, fds = await slots.allocate("ckptd-t-r0", 3 * PAGE + 1, 2, never)
    try:
        assert [s.size for s in made] == [4 * PAGE, 4 * PAGE] and [s.index for s in made] == [0, 1]
        assert slots.in_use == 8 * PAGE
        assert [os.fstat(fd).st_size for fd in fds] == [4 * PAGE, 4 * PAGE]
        # The daemon's mapping sees what the trainer writes through its descriptor.
        os.pwrite(fds[1], b"trainer bytes", PAGE)
        assert bytes(made[1].view[PAGE: PAGE + 13]) == b"trainer bytes"
        more, more_fds = await slots.allocate("ckptd-t-r1", PAGE, 1, never)
        assert slots.in_use == 9 * PAGE
        slots.release(more)
        assert slots.in_use == 8 * PAGE
    finally:
        for fd in fds + more_fds:
            os.close(fd)
    slots.release(made)
    assert slots.in_use == 0
    assert all(s.mm.closed for s in made)


async def test_over_the_limit_is_refused_and_nothing_is_reserved(pool: ThreadPoolExecutor) -> None:
    slots = SlotPool(10 * PAGE, pool)
    first, fds = await slots.allocate("a", 4 * PAGE, 2, never)
    before = open_fds()
    with pytest.raises(RequestError, match=rf"slot memory limit: 2 x {4 * PAGE} bytes requested, {8 * PAGE} of "
                                           rf"{10 * PAGE} bytes already in use"):
        await slots.allocate("b", 4 * PAGE, 2, never)
    assert slots.in_use == 8 * PAGE and open_fds() == before
    second, more = await slots.allocate("c", PAGE, 2, never)     # what is left still fits
    assert slots.in_use == 10 * PAGE
    slots.release(first + second)
    assert slots.in_use == 0
    for fd in fds + more:
        os.close(fd)


@pytest.mark.parametrize(("slot_bytes", "num_slots"), [(PAGE, 0), (PAGE, MAX_SLOTS + 1), (PAGE, "2"), (PAGE, 2.0),
                                                       (PAGE, True), (-1, 2)])
async def test_bad_requests_are_refused(pool: ThreadPoolExecutor, slot_bytes: int, num_slots: object) -> None:
    slots = SlotPool(1 << 30, pool)
    with pytest.raises(RequestError, match="bad slot request"):
        await slots.allocate("x", slot_bytes, num_slots, never)
    assert slots.in_use == 0


async def test_no_slot_bytes_means_no_slots(pool: ThreadPoolExecutor) -> None:
    slots = SlotPool(PAGE, pool)
    assert await slots.allocate("x", 0, "ignored", never) == ([], [])
    assert slots.in_use == 0


async def test_a_busy_slot_outlives_its_release_until_its_reader_is_done(pool: ThreadPoolExecutor) -> None:
    slots = SlotPool(8 * PAGE, pool)
    made, fds = await slots.allocate("x", PAGE, 2, never)
    for fd in fds:
        os.close(fd)
    made[0].busy = True                          # a shard write still reads it
    slots.release(made)
    assert slots.in_use == 0                     # the budget is back at once
    assert not made[0].mm.closed and made[1].mm.closed
    made[0].close()                              # what the session does once the write releases it
    assert made[0].mm.closed


async def test_session_closed_during_allocation_gets_nothing(pool: ThreadPoolExecutor) -> None:
    slots = SlotPool(64 * PAGE, pool)
    before = open_fds()
    closed = False

    def gone() -> bool:
        return closed

    async def allocate() -> None:
        await slots.allocate("x", 16 * PAGE, 4, gone)

    task = asyncio.ensure_future(allocate())
    await asyncio.sleep(0)                       # the allocation has started on its thread
    assert slots.in_use == 64 * PAGE
    closed = True
    with pytest.raises(RequestError, match="connection closed while its slots were allocated"):
        await task
    assert slots.in_use == 0 and open_fds() == before


async def test_cancelled_allocation_returns_budget_and_descriptors(pool: ThreadPoolExecutor) -> None:
    slots = SlotPool(1 << 30, pool)
    before = open_fds()
    task = asyncio.ensure_future(slots.allocate("x", 64 << 20, 2, never))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slots.in_use == 0
    pool.shutdown(wait=True)                     # the thread finishes; its memfds are closed then
    assert open_fds() == before


async def test_a_budget_short_of_the_request_lends_smaller_slots(pool: ThreadPoolExecutor) -> None:
    """Smaller slots rather than a refusal: the client streams a larger save through them."""
    MiB = 1 << 20
    slots = SlotPool(9 * MiB, pool)
    made, fds = await slots.allocate("big", 64 * MiB, 2, never)
    try:
        assert [s.size for s in made] == [(9 * MiB // 2) // PAGE * PAGE] * 2
        assert slots.in_use == sum(s.size for s in made) <= 9 * MiB
        with pytest.raises(RequestError, match="slot memory limit"):   # under 1 MiB a slot left: refused
            await slots.allocate("more", 64 * MiB, 2, never)
    finally:
        slots.release(made)
        for fd in fds:
            os.close(fd)
    assert slots.in_use == 0
