"""The memory tier store's budget with real memfds: a shard dropped while a restore reads it."""
from __future__ import annotations

import os

from ckptd.core.held import HeldMeta, layout_checksums
from ckptd.core.names import memory_job
from ckptd.core.schema import TensorLayout, digest_bytes
from ckptd.daemon.tiers.memory.store import Held, MemoryStore, new_memfd

JOB, N, CHUNK = "store", 1 << 20, 1 << 16


def hold(store: MemoryStore, step: int, rank: int, job: str = JOB, committed: bool = False) -> Held:
    layout = (TensorLayout("w", "uint8", (N,), 0, N),)
    held = store.reserve(job, step, rank, N, "local")
    assert held is not None
    held.fd, held.mm = new_memfd(f"t-{step}-{rank}", N)
    held.mm[:N] = bytes([rank + 1]) * N
    sums = layout_checksums(memoryview(held.mm), layout, CHUNK)
    store.filled(held, HeldMeta(job, step, rank, 1, digest_bytes(b"%d" % rank), N, CHUNK, sums, layout, None))
    if committed:
        store.committed(job, step)
    return held


def test_a_shard_dropped_while_pinned_counts_until_unpinned():
    """drop_step (a failed step) and corrupt (a failed checksum) of a shard a restore has pinned:
    its memfd stays open and mapped while it is read, so its bytes stay in the budget; they
    leave it, once, when the last pin goes."""
    store = MemoryStore(2 * N, 2)
    a = hold(store, 1, 0)
    b = hold(store, 1, 1)
    store.pin(a)
    store.pin(a)
    store.pin(b)
    store.drop_step(JOB, 1, {0})
    store.corrupt(b)
    assert store.get(JOB, 1, 0) is None and store.get(JOB, 1, 1) is None
    assert store.used == 2 * N                        # both still mapped: nothing freed
    assert store.reserve(JOB, 2, 0, N, "local") is None        # so a new shard does not fit
    assert os.fstat(a.fd).st_size == N and a.mm is not None and a.mm[:1] == b"\x01"
    store.unpin(a)
    assert store.used == 2 * N and a.fd >= 0         # one reader left
    store.unpin(a)
    assert store.used == N and a.fd == -1 and a.mm is None
    store.unpin(b)
    assert store.used == 0 and b.fd == -1
    c = hold(store, 2, 0)                             # the budget is whole again
    d = hold(store, 2, 1)
    assert store.used == 2 * N
    store.drop_step(JOB, 2)                           # unpinned: freed at once
    assert store.used == 0 and c.fd == -1 and d.fd == -1


def test_the_budget_evicts_by_arrival_and_never_another_jobs_memory_level_step():
    """Eviction sorted every job's shards by step number: job "bjob" at step 1000 outranked "ajob"'s
    memory-level step 5, whose only copy this is, and a save of bjob's step 1001 evicted it (a restore
    of ajob then found nothing). By arrival, bjob's older step 1000 (on disk too) goes."""
    store = MemoryStore(2 * N + N // 2, 2)
    hold(store, 1000, 0, job="bjob", committed=True)
    mine = hold(store, 5, 0, job=memory_job("ajob"), committed=True)
    assert store.reserve("bjob", 1001, 0, N, "local") is not None
    assert store.get(memory_job("ajob"), 5, 0) is mine and store.get("bjob", 1000, 0) is None
    # nothing else to evict: a storage-level shard is not held rather than evict the memory-level one
    assert store.reserve("bjob", 1002, 0, N, "local") is None
    assert store.get(memory_job("ajob"), 5, 0) is mine


def test_a_memory_level_step_in_flight_evicts_only_what_its_commit_would_trim():
    """Holding memory-level step 5 evicted committed step 4's shard before step 5 committed: a step 5
    that then failed left step 4, the newest committed, unrestorable. With memory.steps = 2 step 3 makes
    room (step 5's commit would trim it) but step 4 stays; with 1, step 4 (the newest committed) stays
    too, though step 5's commit would trim it: step 5 is not held, and the store says why."""
    job = memory_job("fj")
    store = MemoryStore(2 * N, 2)
    three, four = hold(store, 3, 0, job=job, committed=True), hold(store, 4, 0, job=job, committed=True)
    assert store.reserve(job, 5, 0, N, "local") is not None
    assert store.get(job, 3, 0) is None and three.gone and store.get(job, 4, 0) is four
    assert store.reserve(job, 5, 1, N, "local") is None             # and step 4 is not evicted for it
    assert store.get(job, 4, 0) is four and store.short is not None and store.short.kept == N

    store = MemoryStore(2 * N, 1)
    four_ = [hold(store, 4, r, job=job, committed=True) for r in (0, 1)]
    assert store.reserve(job, 5, 0, N, "local") is None
    assert [store.get(job, 4, r) for r in (0, 1)] == four_
    assert store.short is not None and (store.short.evictable, store.short.kept) == (0, 2 * N)
    assert "none evictable" in store.short.text()


def test_a_removed_step_held_as_committed_does_not_outrank_a_newer_runs_step():
    """A daemon that did not commit it held an earlier run's memory-level step 8 as committed. The new run
    (resumed from step 6) committed memory-level step 7, and its commit removed step 8's directory. The
    store kept its newest committed step, the stale 8, and trimmed step 7's replica: the committed step 7
    was lost with its other node. A step held as committed whose index.json is gone now goes first."""
    job = memory_job("ej")
    store = MemoryStore(4 * N, 1)
    eight = hold(store, 8, 0, job=job, committed=True)
    seven = hold(store, 7, 1, job=job)
    on_disk = {7}                                     # step 8's directory removed by step 7's commit
    store.trim(job, lambda j, s: j == job and s in on_disk)
    assert store.get(job, 7, 1) is seven and seven.committed
    assert store.get(job, 8, 0) is None and eight.gone

    def unreadable(j: str, s: int) -> bool:
        raise PermissionError(13, "Permission denied")
    store = MemoryStore(4 * N, 1)
    eight = hold(store, 8, 0, job=job, committed=True)
    store.trim(job, unreadable)                       # a disk that cannot be read now is no proof
    assert store.get(job, 8, 0) is eight


def test_the_step_committed_last_is_kept_until_the_earlier_runs_higher_one_is_gone():
    """The new run's memory-level step 7 committed while the earlier run's step 8 was still on disk (its
    removal follows the commit): trimming by number alone dropped 7, the one the job now restores. And
    step 7's replica, arriving after step 8 had committed, was dropped as a leftover on arrival."""
    job = memory_job("ej")
    store = MemoryStore(4 * N, 1)
    eight = hold(store, 8, 0, job=job, committed=True)
    seven = hold(store, 7, 1, job=job)                # a new run's lower step, in flight
    on_disk = {8}
    store.trim(job, lambda j, s: s in on_disk)
    assert store.get(job, 7, 1) is seven              # not a leftover: it came after step 8 committed
    on_disk = {7, 8}                                  # step 7 commits; step 8 not yet removed
    store.trim(job, lambda j, s: s in on_disk)
    assert store.get(job, 7, 1) is seven and seven.committed and store.get(job, 8, 0) is eight
    on_disk = {7}                                     # step 8 removed
    store.trim(job, lambda j, s: s in on_disk)
    assert store.get(job, 7, 1) is seven and eight.gone

    store = MemoryStore(4 * N, 1)                     # a leftover: in flight before step 8 committed
    six = hold(store, 6, 0, job=job)
    eight = hold(store, 8, 0, job=job)
    store.committed(job, 8)
    store.trim(job, lambda j, s: s == 8)
    assert six.gone and store.get(job, 8, 0) is eight
