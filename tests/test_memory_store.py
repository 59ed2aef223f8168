"""The memory tier store's budget with real memfds: a shard dropped while a restore reads it."""
from __future__ import annotations

import os

from ckptd.core.held import HeldMeta, layout_checksums
from ckptd.core.schema import TensorLayout, digest_bytes
from ckptd.daemon.tiers.memory.store import Held, MemoryStore, new_memfd

JOB, N, CHUNK = "store", 1 << 20, 1 << 16


def hold(store: MemoryStore, step: int, rank: int) -> Held:
    layout = (TensorLayout("w", "uint8", (N,), 0, N),)
    held = store.reserve(JOB, step, rank, N, "local")
    assert held is not None
    held.fd, held.mm = new_memfd(f"t-{step}-{rank}", N)
    held.mm[:N] = bytes([rank + 1]) * N
    sums = layout_checksums(memoryview(held.mm), layout, CHUNK)
    store.filled(held, HeldMeta(JOB, step, rank, 1, digest_bytes(b"%d" % rank), N, CHUNK, sums, layout, None))
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
