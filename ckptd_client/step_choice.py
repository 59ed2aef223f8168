"""Which step a restore that names none takes: the newest committed one — and never an older one (or
none) because the directory where a newer one may be cannot be read by this user. Resuming from an
older step silently sends the run back in time (its saves then rank below the step it missed), and
from none starts it afresh; a CheckpointError that names the directory and the two ways out does
neither."""
from __future__ import annotations

import os

from ckptd.core.names import job_dir, memory_job
from ckptd.core.reader import StepsUnreadable, latest_committed, newest_committed

from .errors import CheckpointError


def latest_step(root: str, job: str) -> int | None:
    """The newest committed step of ``job`` under ``root`` (None: none); CheckpointError when a
    directory that may hold a newer one cannot be read."""
    return newest_in(job_dir(root, job))


def newest_memory_level(root: str, job: str) -> int | None:
    """The newest committed memory-level step of ``job`` (None: none), as ``latest_step``."""
    path = job_dir(root, memory_job(job))
    return None if os.path.islink(path) else newest_in(path)   # (a symlinked _memory: not this job's)


def newest_readable(root: str | None, job: str) -> int | None:
    """The newest committed step this user can see (never raises): for a warning only."""
    try:
        info = latest_committed(job_dir(root, job)) if root else None
    except OSError:
        return None
    return info.step if info else None


def newest_in(path: str) -> int | None:
    """The newest committed step in the job directory ``path``, as ``latest_step``."""
    try:
        info = newest_committed(path)
    except StepsUnreadable as e:
        older = "no older committed step either" if e.readable is None else \
            f"the newest it can read is step {e.readable}: restore(state, step={e.readable}) takes that one"
        raise CheckpointError(
            f"{e.path} cannot be read ({e.reason}) by uid {os.geteuid()}: it may hold the newest committed step, "
            f"so restore() does not pick an older one (or none) by itself; {older}. Give this user read and "
            "search access (e.g. join the group of the daemon's user; docs/operations.md, "
            "\"Security model\")") from None
    return info.step if info else None
