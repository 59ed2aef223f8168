"""Restores from the object-storage tier: the daemon stages the step locally, the trainer reads it.

Trainers hold no bucket credentials: they ask their daemon (op ``stage``) to make a committed
step readable under its root, from the bucket when the node does not have it (a job rescheduled
onto new nodes), and then restore from the local files as usual. A daemon without a bucket, or
no daemon at all (``root=`` given), leaves everything as it was: local files only. "No bucket"
is the reply's code (``ErrorCode.NO_BUCKET``), never its text.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.core import protocol
from ckptd.core.errors import ErrorCode

from .connection import ask
from .errors import CheckpointError, ConnectionLost, DaemonRefused, NoReply, NotDelivered, Unreachable

log = logging.getLogger("ckptd_client")
STAGE_TIMEOUT_S = 3600.0         # a large step over a slow link; the daemon's own retries bound each request
INFO_TIMEOUT_S = 10.0            # whether the daemon has a bucket: it answers at once, or is not there


@dataclass(frozen=True)
class Staged:
    """What the daemon did: ``bucket`` is False when it has no bucket (or is not reachable); ``silent``:
    why it counts as not answering (its ``info`` had no reply in time), else None."""
    bucket: bool
    step: int | None = None
    source: str | None = None
    silent: str | None = None


def stage(socket_path: str, job: str, step: int | None, rank: int, world_size: int, *,
          all_ranks: bool = False, probe: bool = True) -> Staged:
    """Ask the daemon to stage ``step`` (None: the newest, local or in the bucket) for this rank
    (every rank's data when ``all_ranks``). CheckpointError when the bucket has it but it cannot be staged;
    DaemonRefused (code ``not_allowed``), as it came, when the daemon refuses this user altogether.
    ``probe``: ask first whether it has a bucket (not when an earlier answer of this restore said so)."""
    try:        # first, at once, whether it has a bucket: a daemon that does not answer holds no restore up
        if probe and ask(socket_path, protocol.Info(), timeout=INFO_TIMEOUT_S).get("bucket") is not True:
            return Staged(False)    # (FORMAT.md: stage only where info says bucket: true; an older daemon says nothing)
    except NoReply:
        log.warning("ckptd: the daemon at %s did not answer within %gs; restoring without its bucket "
                    "or its memory, from the files under the root", socket_path, INFO_TIMEOUT_S)
        return Staged(False, silent=f"the daemon at {socket_path} did not answer info within {INFO_TIMEOUT_S:g}s "
                                    "(stopped or overloaded?)")
    except (Unreachable, NotDelivered, ConnectionLost):
        return Staged(False)          # no daemon: restore reads what the root has
    except DaemonRefused as e:
        if e.code is ErrorCode.NOT_ALLOWED or e.fatal:
            raise                     # this user may not use the daemon at all (an older one: fatal refused)
        # it does not say: ``stage`` does
    msg = protocol.Stage(job, step, None if all_ranks else [rank, world_size])
    try:
        reply = ask(socket_path, msg, timeout=STAGE_TIMEOUT_S)
    except NoReply:
        raise CheckpointError(f"restore from the bucket: no answer from the daemon in {STAGE_TIMEOUT_S:g}s") from None
    except (Unreachable, NotDelivered, ConnectionLost):
        return Staged(False)          # no daemon: restore reads what the root has
    except DaemonRefused as e:
        if e.code is ErrorCode.NO_BUCKET:
            return Staged(False)
        if e.code is ErrorCode.NOT_ALLOWED or e.fatal:
            raise
        raise CheckpointError(f"restore from the bucket: {e.reason}") from None
    got = reply.get("step")
    if got is not None and type(got) is not int:
        raise CheckpointError(f"restore from the bucket: bad step {got!r} in the daemon's reply")
    if reply.get("warning"):
        log.warning("ckptd: the bucket could not be listed; restoring from local files: %s", reply["warning"])
    if reply.get("source") == "bucket":
        log.warning("ckptd: step %s of %s fetched from the bucket (%s bytes)", got, job, reply.get("fetched_bytes"))
    return Staged(True, got, reply.get("source"))


@dataclass(frozen=True)
class Flushed:
    """What a flush did: ``uploaded`` (the step is committed in the bucket), ``detail`` (what
    happened, or why not); ``bucket`` is False when the daemon has none."""
    uploaded: bool
    detail: str
    bucket: bool = True


def flush(socket_path: str, job: str, step: int | None, timeout: float) -> Flushed:
    """Ask the daemon to get ``step`` into the bucket within ``timeout`` s."""
    try:
        reply = ask(socket_path, protocol.Flush(job, step, timeout), timeout=timeout + 10.0)
    except DaemonRefused as e:
        return Flushed(False, e.reason, bucket=e.code is not ErrorCode.NO_BUCKET)
    except CheckpointError as e:
        return Flushed(False, str(e))
    return Flushed(bool(reply.get("uploaded")), str(reply.get("detail", "")))


class BucketStaging:
    """One restore's ``stage`` requests, each asked once. Call order: ``newest`` (only when the
    step is not given), then ``for_rank`` (before the local files are read), then ``all_ranks``
    (only when the restore reads other ranks' pieces and ``bucket`` is True)."""

    def __init__(self, socket_path: str, job: str, rank: int, world_size: int) -> None:
        self.socket_path, self.job, self.rank, self.world_size = socket_path, job, rank, world_size
        self.staged: Staged | None = None          # the last answer (None: not asked yet)

    @property
    def silent(self) -> str | None:
        """Why this restore takes the daemon for silent (its ``info`` went unanswered), else None."""
        return None if self.staged is None else self.staged.silent

    @property
    def bucket(self) -> bool:
        """The daemon staged from a bucket (False: no daemon, or one without a bucket)."""
        return self.staged is not None and self.staged.bucket

    def newest(self, local_latest: Callable[[], int | None]) -> int | None:
        """The newest committed step, in the bucket or here (``local_latest`` when there is no bucket)."""
        self.staged = stage(self.socket_path, self.job, None, self.rank, self.world_size)
        return self.staged.step if self.staged.bucket else local_latest()

    def for_rank(self, step: int) -> None:
        """Have this rank's files of ``step`` here: unless the step choice staged this very step
        (or learnt there is no bucket)."""
        if self.staged is None or (self.staged.bucket and self.staged.step != step):
            self.staged = stage(self.socket_path, self.job, step, self.rank, self.world_size,
                                probe=self.staged is None)

    def all_ranks(self, step: int) -> None:
        """Have every rank's files of ``step`` here (asked only once ``bucket`` said there is one)."""
        stage(self.socket_path, self.job, step, self.rank, self.world_size, all_ranks=True, probe=False)
