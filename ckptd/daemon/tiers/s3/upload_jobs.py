"""What the uploads keep per job (JobUploads: status, metrics and what a flush trusts), and
``in_thread``: a blocking bucket call run on a daemon thread of its own.

The uploader (uploader.py) owns one JobUploads per job and changes it only on the event loop.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a daemon thread: an upload stuck in the network never holds up the exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:    # handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, e)
            return
        loop.call_soon_threadsafe(settle, result, None)
    threading.Thread(target=run, name="ckptd-upload", daemon=True).start()
    return await fut


KNOWN_KEPT = 64          # steps a job's uploads remember as in the bucket (JobUploads.known)


@dataclass
class JobUploads:
    """One job's uploads (what status and metrics show)."""
    uploading: int | None = None
    queued: deque[int] = field(default_factory=deque)
    in_bucket: int | None = None          # newest step this daemon uploaded or found committed there
    # Steps known committed in the bucket with this node's content (uploaded here, or their index.json
    # there byte for byte this node's), the newest KNOWN_KEPT: what a flush trusts. Not ``step <=
    # in_bucket``: after a restore of an older step the job commits steps below the bucket's newest,
    # and those are not there.
    known: set[int] = field(default_factory=set)
    # Steps bucket retention removed, the newest KNOWN_KEPT: a flush of one answers not uploaded, and why
    # (uploading it again would only have retention remove it again), until it is committed here again.
    removed: set[int] = field(default_factory=set)
    uploaded: int = 0
    skipped: int = 0
    failures: int = 0
    bytes: int = 0
    last_error: str | None = None
    last_seconds: float | None = None     # local commit → bucket commit of the last upload

    def tracks(self, step: int) -> bool:
        """Whether ``step`` is uploading, queued, or known in the bucket (nothing to file for it)."""
        return step == self.uploading or step in self.queued or step in self.known

    def know(self, step: int) -> None:
        """``step`` is committed in the bucket (the newest ``KNOWN_KEPT`` are remembered)."""
        self.known.add(step)
        if len(self.known) > KNOWN_KEPT:
            self.known.discard(min(self.known))

    def forget(self, step: int) -> None:
        """Bucket retention removed ``step`` from the bucket."""
        self.known.discard(step)
        self.removed.add(step)
        if len(self.removed) > KNOWN_KEPT:
            self.removed.discard(min(self.removed))

    def view(self) -> dict[str, Any]:
        return {"uploading": self.uploading, "queued": list(self.queued), "in_bucket": self.in_bucket,
                "uploaded": self.uploaded, "skipped": self.skipped, "failures": self.failures, "bytes": self.bytes,
                "last_error": self.last_error, "last_seconds": self.last_seconds}
