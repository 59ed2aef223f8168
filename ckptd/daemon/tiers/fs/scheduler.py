"""When retention runs: one pass per job at a time after its commits, never two at once.

What a pass deletes is ckptd.daemon.tiers.fs.retention's; the tier runs it on its I/O pool. Each job's
passes share a ``JobMemo`` (the committed steps already looked into), so a pass after a commit costs the
same however many steps the job holds; passes of one job never overlap, so it is never shared at once.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from ckptd.core.names import memory_job
from ckptd.daemon.runtime import TaskSet, describe_error
from ckptd.daemon.settings.retention import RetentionPolicy
from ckptd.daemon.tiers.fs.retention import GcResult, JobMemo
from ckptd.daemon.tiers.fs.tier import FsTier

log = logging.getLogger("ckptd")


class Retention:
    """Retention after commits: one pass per job at a time, and one more after it when commits
    arrived during it (so the last commit is always followed by a pass)."""

    def __init__(self, tier: FsTier, policy: RetentionPolicy, tasks: TaskSet,
                 in_flight: Callable[[str], list[int]], on_done: Callable[[GcResult], None]) -> None:
        self.tier, self.policy = tier, policy
        self._tasks = tasks
        self._in_flight = in_flight
        self._on_done = on_done
        self._running: set[str] = set()
        self._again: set[str] = set()
        self._memos: dict[str, JobMemo] = {}
        self._stopped = False

    def schedule(self, job: str) -> None:
        if self._stopped:
            return
        if job in self._running:
            self._again.add(job)
            return
        self._running.add(job)
        self._tasks.spawn(self._collect(job), f"retention of {job}").add_done_callback(
            lambda _t: self._finished(job))

    def _finished(self, job: str) -> None:
        self._running.discard(job)
        if job in self._again:
            self._again.discard(job)
            self.schedule(job)

    async def _collect(self, job: str) -> None:
        try:
            result = await self.tier.collect(job, self.policy, self._in_flight(job),
                                             self._in_flight(memory_job(job)), self._memos.setdefault(job, JobMemo()))
        except (OSError, ValueError) as e:
            log.warning("retention failed", extra={"ctx": {"job": job, "error": describe_error(e)}})
            return
        self._on_done(result)

    def stop(self) -> None:
        """No new passes (the daemon is draining)."""
        self._stopped = True
