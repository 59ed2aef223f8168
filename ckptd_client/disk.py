"""Settling a save by the disk: the step is committed once its index.json is in place — and the
step directory has been fsynced here, since a rename is visible before it is durable.

The daemon publishes index.json with tmp, fsync, rename, then an fsync of the directory; a
client looking at the disk (a lost store or daemon, a COMMIT that timed out) can see the rename
in between, before the directory's fsync, or after that fsync failed. So it fsyncs the directory
itself first (an fsync of a directory flushes its entries whoever renamed them). If that fsync
fails, the step is still reported committed — readers load it, and it cannot be un-published —
but not silently: the error is logged and kept on the handle (``SaveHandle.sync_error``).
"""
from __future__ import annotations

import logging
import os

from ckptd.core import storage
from ckptd.core.names import INDEX_NAME, step_dir
from ckptd.core.reader import StepReader

from .handle import SaveHandle

log = logging.getLogger("ckptd_client")


def committed_on_disk(root: str | None, job: str, step: int, handle: SaveHandle | None = None,
                      rank: int | None = None) -> bool:
    """Whether ``step`` is committed on disk: index.json there, its directory fsynced first. An
    fsync that fails still answers True (the index is in place) and logs it, and sets
    ``handle.sync_error``. With ``handle`` durable and ``rank``: committed by this save, its rank's
    manifest digest the one its daemon reported (another daemon on a shared root may have saved the
    same job's step: its index is not this save's)."""
    if root is None:
        return False
    path = step_dir(root, job, step)
    if not os.path.isfile(os.path.join(path, INDEX_NAME)):
        return False
    if handle is not None and handle.digest is not None and rank is not None:
        try:
            theirs = StepReader(path).rank_entry(rank).get("manifest_digest")
        except (OSError, ValueError, KeyError, IndexError) as e:
            log.error("ckptd: step %d of job %r: its index.json cannot be read (%s): not taken as this save's",
                      step, job, e)
            return False
        if theirs != handle.digest:
            log.error("ckptd: step %d of job %r is committed with another save's rank %d (digest %s, this save's "
                      "%s): another process saved the same job's step (two jobs of one name?)", step, job, rank,
                      theirs, handle.digest)
            return False
    try:
        storage.fsync_dir(path)
    except OSError as e:
        why = (f"step {step} of job {job!r} is committed (its index.json is in place) but fsync of {path} "
               f"failed: {e}; it may not survive a crash of the node that holds it")
        log.error("ckptd: %s", why)
        if handle is not None:
            handle.sync_error = why
    return True
