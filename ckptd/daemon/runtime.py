"""What every part of the daemon shares: its task set, the refusal error, error texts.

No task the daemon starts may end with an exception nobody looked at: asyncio keeps only a
weak reference to a task, reports its exception ("Task exception was never retrieved") only
when it is collected, long after the fact, and a loop's shutdown cancels whatever is left.
So every task is started through a :class:`TaskSet`, which holds it until it is done and
logs its exception, and the server cancels and awaits the rest before it returns.
"""
from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from ckptd.core.errors import ErrorCode

log = logging.getLogger("ckptd")

T = TypeVar("T")


class RequestError(Exception):
    """A well-formed request that cannot be served; the connection stays open. ``code``: its reply's."""

    def __init__(self, reason: str, code: ErrorCode = ErrorCode.REFUSED) -> None:
        super().__init__(reason)
        self.code = code


def describe_error(e: BaseException) -> str:
    """An error as one line: ``ENOSPC: No space left on device (path)`` for OS errors."""
    if isinstance(e, OSError) and e.errno is not None:
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}" + (f" ({e.filename})" if e.filename else "")
    return f"{type(e).__name__}: {e}"


def bounded(reason: str, limit: int = 2000) -> str:
    """Error text sent back or logged: a hostile request must not make it unbounded."""
    return reason if len(reason) <= limit else reason[:limit] + f"... ({len(reason)} chars)"


class TaskSet:
    """Tasks held until they finish; an exception one ends with is logged, never left unobserved."""

    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task[Any], str] = {}

    def spawn(self, coro: Coroutine[Any, Any, T], what: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks[task] = what
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        what = self._tasks.pop(task, "task")
        if task.cancelled():
            return
        exc = task.exception()     # retrieving it is what keeps asyncio from reporting it again
        if exc is not None:
            log.error("daemon task failed", exc_info=exc, extra={"ctx": {"task": what, "error": describe_error(exc)}})

    def __len__(self) -> int:
        return len(self._tasks)

    def running(self) -> list[str]:
        """What each task still running is (as given to ``spawn``)."""
        return list(self._tasks.values())

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    async def wait(self, timeout: float | None) -> set[asyncio.Task[Any]]:
        """Wait for the tasks running now (not ones started meanwhile); returns those still running."""
        tasks = set(self._tasks)
        if not tasks:
            return set()
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        return pending

    async def cancel_all(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait (bounded) until each has run its cleanup."""
        for _ in range(3):                  # cleanups may start a few more tasks (events)
            tasks = set(self._tasks)
            if not tasks:
                return
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=timeout)
