"""When and how a step commits.

The commit protocol (also in FORMAT.md):
1. every rank's data file is fsynced, then its manifest is written (tmp, fsync, rename,
   fsync dir); the daemon then reports the rank DURABLE with the manifest's sha256;
2. when all ``world_size`` ranks are durable — counted by this daemon (``local`` mode)
   or gathered by rank 0's client through the job's c10d store and sent in a COMMIT
   (``relay`` mode) — the daemon serving rank 0 checks every manifest's digest on disk
   and writes ``index.json`` (tmp, fsync, rename, fsync dir). Its presence is the commit;
3. any failure before that abandons the step: no index is written, the waiting ranks are
   told why, and the files this daemon wrote for it are removed.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

from ckptd.core import storage
from ckptd.core.names import INDEX_NAME, rank_manifest_name
from ckptd.core.schema import MAX_MANIFEST_BYTES, digest_bytes, encode_json, make_index, parse_manifest


class CommitError(Exception):
    pass


def write_index(step_path: str, job: str, step: int, world_size: int, digests: dict[int, str]) -> dict[str, Any]:
    """Verify every rank's manifest against its digest, then publish index.json atomically."""
    if sorted(digests) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(digests))
        raise CommitError(f"cannot commit step {step}: no durable shard from ranks {missing}")
    if os.path.exists(os.path.join(step_path, INDEX_NAME)):
        raise CommitError(f"step {step} is already committed")
    ranks = []
    for rank in range(world_size):
        path = os.path.join(step_path, rank_manifest_name(rank))
        try:
            data = storage.read_limited(path, MAX_MANIFEST_BYTES)
        except (OSError, ValueError) as e:   # ValueError: over the size limit or not a regular file
            raise CommitError(f"rank {rank} manifest unreadable: {e}") from None
        if digest_bytes(data) != digests[rank]:
            raise CommitError(f"rank {rank} manifest {path} does not match the digest it reported durable")
        m = parse_manifest(data, job=job, step=step, rank=rank)
        if m.world_size != world_size:
            raise CommitError(f"rank {rank} saved with world size {m.world_size}, step has {world_size}")
        ranks.append({"rank": rank, "manifest_digest": digests[rank],
                      "raw_bytes": m.raw_bytes, "stored_bytes": m.stored_bytes})
    index = make_index(job, step, world_size, ranks, time.time())
    storage.atomic_write(os.path.join(step_path, INDEX_NAME), encode_json(index))
    return index


@dataclass
class PendingStep:
    """A step some rank of which is being written by this daemon and that has not committed."""
    job: str
    step: int
    world_size: int
    mode: str
    step_path: str
    started: float
    writing: set[int] = field(default_factory=set)            # ranks whose shard is in flight here
    durable: dict[int, str] = field(default_factory=dict)     # rank → manifest digest
    waiters: dict[int, Hashable] = field(default_factory=dict)  # rank → session awaiting the outcome
    committing: bool = False


class CommitTracker:
    """Bookkeeping for steps in flight on one daemon; pure state, no I/O."""

    def __init__(self, step_timeout: float) -> None:
        self.step_timeout = step_timeout
        self.steps: dict[tuple[str, int], PendingStep] = {}

    def begin(self, job: str, step: int, rank: int, world_size: int, mode: str, step_path: str,
              session: Hashable) -> PendingStep:
        key = (job, step)
        ps = self.steps.get(key)
        if ps is None:
            ps = self.steps[key] = PendingStep(job, step, world_size, mode, step_path, time.monotonic())
        elif ps.world_size != world_size or ps.mode != mode:
            raise CommitError(f"step {step} of job {job!r} is in flight with world size {ps.world_size} "
                              f"({ps.mode} commit); this save says {world_size} ({mode})")
        if rank in ps.writing or rank in ps.durable:
            raise CommitError(f"rank {rank} already has a save of step {step} in flight")
        ps.writing.add(rank)
        ps.waiters[rank] = session
        return ps

    def mark_durable(self, ps: PendingStep, rank: int, digest: str) -> bool:
        """Record a durable shard; True when this daemon should now write the index (local mode)."""
        ps.writing.discard(rank)
        ps.durable[rank] = digest
        ready = ps.mode == "local" and len(ps.durable) == ps.world_size and not ps.committing
        if ready:
            ps.committing = True
        return ready

    def finish(self, ps: PendingStep) -> None:
        self.steps.pop((ps.job, ps.step), None)

    def get(self, job: str, step: int) -> PendingStep | None:
        return self.steps.get((job, step))

    def steps_of(self, session: Hashable) -> list[tuple[PendingStep, int]]:
        return [(ps, r) for ps in self.steps.values() for r, s in ps.waiters.items() if s is session]

    def expired(self, now: float) -> list[PendingStep]:
        return [ps for ps in self.steps.values()
                if not ps.committing and now - ps.started > self.step_timeout]

    def ranks_missing(self, ps: PendingStep) -> list[int]:
        return sorted(set(range(ps.world_size)) - set(ps.durable))


