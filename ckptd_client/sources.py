"""Where a restore is served from: an explicit chain of sources, tried in order.

    DaemonMemory     this node's daemon's memory tier, or a peer daemon's copy fetched by it: one
                     ``memory_fetch``, in which the daemon tries its own memory, then its peers'
    LocalFiles       the step's files under the root; a daemon with a bucket first stages what
                     this node lacks of this rank's files (``stage``), so the bucket fills in for the disk
    AllRanksStaged   the bucket again, every rank's files: for a restore that reads other ranks'
                     pieces (another world size) when only this rank's were staged

Each source answers ``serve`` with :class:`Served`, or :class:`Unavailable` saying why not, and
the chain goes on to the next. A source that can serve but fails — a corrupt chunk, a shape
mismatch, an entry of the state the step lacks (``strict``), a step that is nowhere — raises
CheckpointError: that is the user's error and no later source is tried (the daemon checked whatever
it staged). Every source checks the whole state before it writes into it (restore_check.py). When
no source serves, the first error an Unavailable carried is raised. ``Checkpointer.restore``
picks the step (all ranks agreeing) and runs :func:`run_chain` over :func:`restore_chain`.
"""
from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptd.core.names import step_dir

from .bucket_restore import BucketStaging
from .errors import CheckpointError, MissingData
from .memory_restore import MEMORY, PEER, MemoryUnavailable, restore_from_memory
from .restore import PerRank, restore_state
from .restore_check import Outcome, listed

STORAGE = "storage"
ALL_RANKS = "staged-all-ranks"
__all__ = ["MEMORY", "PEER", "STORAGE", "ALL_RANKS", "Reader", "Served", "Unavailable", "RestoreInfo", "Source",
           "DaemonMemory", "LocalFiles", "AllRanksStaged", "restore_chain", "run_chain"]


@dataclass(frozen=True)
class Served:
    """A source loaded the step into the state: ``source`` is what ``RestoreInfo.source`` reports;
    ``outcome``: which entries it loaded and which the step lacked."""
    source: str
    raw_bytes: int = 0
    outcome: Outcome = field(default=Outcome(), compare=False)


@dataclass(frozen=True)
class Unavailable:
    """A source that cannot serve this restore, and why; ``error`` is raised if no later source serves."""
    source: str
    reason: str
    error: CheckpointError | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class RestoreInfo:
    """How the last ``restore`` went: ``source`` is ``memory`` (this node's daemon), ``peer`` (a
    peer daemon's copy, through this node's daemon) or ``storage``; ``fallback`` says why memory
    was not used; ``passed``: every source that could not serve, in chain order, with its reason.
    ``restored``: the top-level keys of the state loaded; ``missing`` (top-level keys) and
    ``missing_tensors`` (key paths inside restored entries): what the step lacked, left as it was
    (only with ``strict=False``; entries a ``per_rank`` rule kept fresh are in neither)."""
    step: int
    source: str
    seconds: float
    raw_bytes: int = 0
    fallback: str | None = None
    passed: tuple[Unavailable, ...] = ()
    restored: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    missing_tensors: tuple[str, ...] = ()

    def lacked(self) -> str:
        """What the step lacked, for the restore's log line ("" when nothing)."""
        gone = self.missing + self.missing_tensors
        return f"; not in the step, left as they were: {listed(gone)}" if gone else ""


@dataclass(frozen=True)
class Reader:
    """Who restores, shared by every source: the job's rank, its daemon, its threads, its root."""
    socket_path: str
    job: str
    rank: int
    world_size: int
    threads: int
    root: Callable[[], str]        # the checkpoint root (asked from the daemon the first time)


class Source(ABC):
    """One place a restore can come from. Call order: ``serve(step, state)`` at most once per
    restore, only after every source before it in the chain answered Unavailable."""
    name: str

    @abstractmethod
    def serve(self, step: int, state: dict[str, Any]) -> Served | Unavailable:
        """Load ``step`` into ``state`` in place and say so, or say why not (``state`` may then be
        partly loaded: a later source loads all of it again)."""


class DaemonMemory(Source):
    """The daemon's held copy of this rank's shard (memory_restore.py): same world size, no DTensor."""
    name = MEMORY

    def __init__(self, reader: Reader, enabled: bool, strict: bool = True) -> None:
        self.reader, self.enabled, self.strict = reader, enabled, strict

    def serve(self, step: int, state: dict[str, Any]) -> Served | Unavailable:
        if not self.enabled:
            return Unavailable(self.name, "memory restore off (memory=False)")
        r = self.reader
        try:
            copy = restore_from_memory(r.socket_path, r.job, step, r.rank, r.world_size, state, r.threads,
                                       self.strict)
        except MemoryUnavailable as e:
            return Unavailable(self.name, str(e))
        return Served(copy.source, copy.raw_bytes, copy.outcome)


class LocalFiles(Source):
    """The step's files under the root, this rank's staged from the bucket first when the daemon has one."""
    name = STORAGE

    def __init__(self, reader: Reader, staging: BucketStaging, per_rank: PerRank, strict: bool = True) -> None:
        self.reader, self.staging, self.per_rank, self.strict = reader, staging, per_rank, strict

    def serve(self, step: int, state: dict[str, Any]) -> Served | Unavailable:
        r = self.reader
        self.staging.for_rank(step)
        path = step_dir(r.root(), r.job, step)
        if not os.path.isdir(path):
            raise CheckpointError(f"step {step} of job {r.job!r} does not exist under {r.root()}")
        try:
            outcome = restore_state(path, state, rank=r.rank, world_size=r.world_size, threads=r.threads,
                                    per_rank=self.per_rank, strict=self.strict)
        except MissingData as e:      # another rank's data file this node lacks: staging every rank's may help
            return Unavailable(self.name, str(e), e)
        return Served(STORAGE, outcome=outcome)


class AllRanksStaged(Source):
    """Every rank's files of the step staged from the bucket, then read as ``LocalFiles`` reads them."""
    name = ALL_RANKS

    def __init__(self, reader: Reader, staging: BucketStaging, per_rank: PerRank, strict: bool = True) -> None:
        self.reader, self.staging, self.per_rank, self.strict = reader, staging, per_rank, strict

    def serve(self, step: int, state: dict[str, Any]) -> Served | Unavailable:
        if not self.staging.bucket:
            return Unavailable(self.name, "no bucket to stage other ranks' files from (or no daemon)")
        r = self.reader
        self.staging.all_ranks(step)
        outcome = restore_state(step_dir(r.root(), r.job, step), state, rank=r.rank, world_size=r.world_size,
                                threads=r.threads, per_rank=self.per_rank, strict=self.strict)
        return Served(STORAGE, outcome=outcome)


def restore_chain(reader: Reader, staging: BucketStaging, *, memory: bool, per_rank: PerRank,
                  strict: bool = True) -> list[Source]:
    """The sources of one restore, in the order they are tried (the module docstring); ``staging``:
    this restore's, which may have staged the newest step while it was being chosen."""
    return [DaemonMemory(reader, memory, strict), LocalFiles(reader, staging, per_rank, strict),
            AllRanksStaged(reader, staging, per_rank, strict)]


def run_chain(chain: Sequence[Source], step: int, state: dict[str, Any]) -> RestoreInfo:
    """Try each source in turn until one serves; the RestoreInfo records the ones passed over."""
    started = time.monotonic()
    passed: list[Unavailable] = []
    for source in chain:
        got = source.serve(step, state)
        if isinstance(got, Served):
            o = got.outcome
            return RestoreInfo(step, got.source, time.monotonic() - started, got.raw_bytes,
                               fallback=passed[0].reason if passed else None, passed=tuple(passed),
                               restored=o.restored, missing=o.missing, missing_tensors=o.missing_tensors)
        passed.append(got)
    first = next((u.error for u in passed if u.error is not None), None)
    if first is not None:
        raise first
    raise CheckpointError(f"no source could restore step {step}: " + "; ".join(f"{u.source}: {u.reason}"
                                                                               for u in passed))
