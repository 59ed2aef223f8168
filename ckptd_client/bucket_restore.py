"""Restores from the object-storage tier: the daemon stages the step locally, the trainer reads it.

Trainers hold no bucket credentials: they ask their daemon (op ``stage``) to make a committed
step readable under its root, from the bucket when the node does not have it (a job rescheduled
onto new nodes), and then restore from the local files as usual. A daemon without a bucket, or
no daemon at all (``root=`` given), leaves everything as it was: local files only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ckptd.core import protocol
from ckptd.core.errors import ProtocolError

from .errors import CheckpointError

log = logging.getLogger("ckptd_client")
STAGE_TIMEOUT_S = 3600.0         # a large step over a slow link; the daemon's own retries bound each request
NO_BUCKET = "no object-storage tier"


@dataclass(frozen=True)
class Staged:
    """What the daemon did: ``bucket`` is False when it has no bucket (or is not reachable)."""
    bucket: bool
    step: int | None = None
    source: str | None = None


def stage(socket_path: str, job: str, step: int | None, rank: int, world_size: int, *,
          all_ranks: bool = False) -> Staged:
    """Ask the daemon to stage ``step`` (None: the newest, local or in the bucket) for this rank
    (every rank's data when ``all_ranks``). CheckpointError when the bucket has it but it cannot be staged."""
    msg = protocol.to_wire(protocol.Stage(job, step, None if all_ranks else [rank, world_size]), 1)
    try:
        reply = protocol.request_once(socket_path, msg, timeout=STAGE_TIMEOUT_S)
    except TimeoutError:
        raise CheckpointError(f"restore from the bucket: no answer from the daemon in {STAGE_TIMEOUT_S:g}s") from None
    except (ConnectionError, FileNotFoundError, ProtocolError, OSError):
        return Staged(False)          # no daemon: restore reads what the root has
    except RuntimeError as e:         # the daemon's error reply
        if NO_BUCKET in str(e):
            return Staged(False)
        raise CheckpointError(f"restore from the bucket: {e}") from None
    got = reply.get("step")
    if got is not None and type(got) is not int:
        raise CheckpointError(f"restore from the bucket: bad step {got!r} in the daemon's reply")
    if reply.get("warning"):
        log.warning("ckptd: the bucket could not be listed; restoring from local files: %s", reply["warning"])
    if reply.get("source") == "bucket":
        log.warning("ckptd: step %s of %s fetched from the bucket (%s bytes)", got, job, reply.get("fetched_bytes"))
    return Staged(True, got, reply.get("source"))


def flush(socket_path: str, job: str, step: int | None, timeout: float) -> tuple[bool, str]:
    """Ask the daemon to get ``step`` into the bucket within ``timeout`` s: (made it, what happened)."""
    msg = protocol.to_wire(protocol.Flush(job, step, timeout), 1)
    try:
        reply = protocol.request_once(socket_path, msg, timeout=timeout + 10.0)
    except (ConnectionError, ProtocolError, OSError, RuntimeError) as e:
        return False, str(e)
    return bool(reply.get("uploaded")), str(reply.get("detail", ""))
