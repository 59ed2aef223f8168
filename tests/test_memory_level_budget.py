"""Memory-level steps under the memory budget and across peers: what a daemon holds, and for how long.

Real daemons (subprocesses), real ranks (threads of this process, each its own Checkpointer and
connection, a real TCPStore between them), real memfds.
"""
# mypy: disable-error-code="union-attr,index"
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_memory_level import committed_held_steps
from torch.distributed import TCPStore

import ckptd_client
from ckptd_client import CheckpointError

from test_memory_tier import status

pytestmark = pytest.mark.timeout(300)
MiB = 1 << 20


def state(mib: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g)}


def on_ranks(fn: Callable[[int], Any], world: int = 2) -> dict[int, Any]:
    """``fn(rank)`` on a thread per rank at once; each rank's result, or the exception it raised."""
    out: dict[int, Any] = {}

    def go(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as e:
            out[r] = e
    threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == world, out
    return out


def checkpointers(job: str, socks: list[Path], **kw: Any) -> dict[int, ckptd_client.Checkpointer]:
    """Two ranks of ``job``, rank r on ``socks[r]`` (or the one socket), joined through a TCPStore."""
    master = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)

    def make(r: int) -> ckptd_client.Checkpointer:
        store = master if r == 0 else TCPStore("127.0.0.1", master.port, 2, False)
        return ckptd_client.Checkpointer(job, socket=str(socks[r % len(socks)]), rank=r, world_size=2, store=store,
                                         commit_timeout=60, **kw)
    cks = on_ranks(make)
    assert all(isinstance(c, ckptd_client.Checkpointer) for c in cks.values()), cks
    return cks


def held_steps(sock: Path) -> list[tuple[str, int, str, list[str]]]:
    return [(h["job"], h["step"], h["level"], sorted(h["ranks"])) for h in status(sock)["memory"]["held"]]


def test_a_failed_memory_level_save_leaves_the_newest_committed_one_whole(daemon_factory: Any) -> None:
    """Memory-level step 2 committed (4 MiB a rank, 10 MiB budget); step 3 is 4 MiB on rank 0 and 12 MiB
    on rank 1, which never fits. Rank 0's reservation for step 3 evicted step 2's shards (memory.steps = 1:
    step 3's commit would trim it) before step 3 committed; step 3 failed, and committed step 2, its
    index.json still in place, no longer restored: a new run went back to storage step 1. Now step 3
    fails on both ranks saying the budget holds the newest committed memory-level step, and step 2
    restores from memory, bit-exact."""
    d = daemon_factory("--memory-budget", "10MiB")
    cks = checkpointers("j", [d.socket])
    assert on_ranks(lambda r: cks[r].save(1, state(4, 1 + r)).wait(60)) == {0: None, 1: None}
    assert on_ranks(lambda r: cks[r].save(2, state(4, 3 + r), level="memory").wait(60)) == {0: None, 1: None}
    failed = on_ranks(lambda r: cks[r].save(3, state(4 if r == 0 else 12, 5 + r), level="memory").wait(60))
    for r in (0, 1):
        assert isinstance(failed[r], CheckpointError), failed
        assert "does not fit the memory budget" in str(failed[r]), failed
    assert held_steps(d.socket) == [("j", 2, "memory", ["0", "1"])]
    assert committed_held_steps(d.root, "j") == [2]
    on_ranks(lambda r: cks[r].close())

    again = checkpointers("j", [d.socket])

    def restore(r: int) -> tuple[int | None, str, bool]:
        live = {"w": torch.zeros(4 * MiB // 4)}
        step = again[r].restore(live)
        return step, again[r].last_restore.level, torch.equal(live["w"], state(4, 3 + r)["w"])
    assert on_ranks(restore) == {0: (2, "memory", True), 1: (2, "memory", True)}
    on_ranks(lambda r: again[r].close())
    # Either rank's error fails the step; each says what holds the budget.
    assert "the job's newest committed memory-level step, kept whole until a newer one commits" in str(failed[0])
