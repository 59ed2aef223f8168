"""Removals of ended steps' files, and the wait a new save of such a step makes for them.

A removal is registered in the same event-loop turn it starts (the coordinator calls ``remove`` as
the step leaves its table), and a save of that step waits (``settled``) until every removal of it is
done: so a re-save — by a client that heard of the failure, or a new session that did not — never
has its files removed by the cleanup of the attempt before it. A shard the ended attempt was still
writing is waited for the same way (``stopped``): its writer stops at its next chunk.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from ckptd.daemon.runtime import RequestError, TaskSet
from ckptd.daemon.tiers.base import StorageTier

STOP_POLL_S = 0.05      # how often a save checks whether an ended attempt's write has stopped


class Removals:
    def __init__(self, tier: StorageTier, wait: float) -> None:
        self.tier, self.wait = tier, wait     # ``wait``: how long a save waits for them (then RequestError)
        self.tasks = TaskSet()
        self._pending: dict[tuple[str, int], set[asyncio.Task[None]]] = {}   # by (job, step)

    async def remove(self, job: str, step: int, ranks: Sequence[int]) -> None:
        """Remove these ranks' files of the ended step (and its directory once empty); registered before
        this first suspends."""
        key = (job, step)
        task = self.tasks.spawn(self.tier.abort(job, step, list(ranks)),
                                f"removal of job={job} step={step} ranks={list(ranks)}")
        pending = self._pending.setdefault(key, set())
        pending.add(task)

        def done(t: asyncio.Task[None]) -> None:
            pending.discard(t)
            if not pending and self._pending.get(key) is pending:
                del self._pending[key]
        task.add_done_callback(done)
        await asyncio.shield(task)

    async def settled(self, job: str, step: int) -> None:
        """Until no removal of an ended attempt of this step runs (RequestError after ``wait``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while pending := self._pending.get((job, step)):
            left = deadline - loop.time()
            if left <= 0:
                raise RequestError(f"step {step} of job {job!r}: the files of its failed attempt are still "
                                   f"being removed; retry shortly")
            await asyncio.wait(set(pending), timeout=left)

    async def stopped(self, writing: Mapping[tuple[str, int, int], tuple[Any, Any]], job: str, step: int,
                      rank: int) -> None:
        """Until a write of this shard by an ended (failed) attempt of the step has stopped: a writer
        stops at its next chunk, a streamed one within a tick; ``wait`` at most (then the save's
        ``begin`` refuses, naming it). A write of a step still open is another save's: not waited for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while (entry := writing.get((job, step, rank))) is not None and not entry[0].open \
                and loop.time() < deadline:
            await asyncio.sleep(STOP_POLL_S)
