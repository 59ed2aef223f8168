"""Where a restore is served from: an explicit chain of sources, tried in order.

    DaemonMemory     this node's daemon's memory tier, or a peer daemon's copy fetched by it: one
                     ``memory_fetch``, in which the daemon tries its own memory, then its peers';
                     for a DTensor state or another world size, every saved rank's shard the
                     restore needs, resharded as a storage restore would (held_pieces.py), with
                     only the ranks no daemon holds read from their files
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
from functools import cached_property
from typing import Any

from ckptd.core import step_files
from ckptd.core.errors import FormatError
from ckptd.core.gc_pause import gc_paused
from ckptd.core.names import memory_job, step_dir
from ckptd.core.reader import StepReader

from .bucket_restore import BucketStaging
from .dtensor import is_dtensor
from .errors import CheckpointError, MissingData
from .held_pieces import DaemonShards
from .live_state import live_tensors
from .memory_restore import MEMORY, PEER, MemoryUnavailable, restore_from_memory
from .read_stats import ReadStats
from .restore import PerRank, restore_state, tree_source
from .restore_check import Outcome, listed

STORAGE = "storage"
ALL_RANKS = "staged-all-ranks"
__all__ = ["MEMORY", "PEER", "STORAGE", "ALL_RANKS", "Reader", "Served", "Unavailable", "RestoreInfo", "Source",
           "DaemonMemory", "LocalFiles", "AllRanksStaged", "restore_chain", "run_chain"]


@dataclass(frozen=True)
class Served:
    """A source loaded the step into the state: ``source`` is what ``RestoreInfo.source`` reports;
    ``outcome``: which entries it loaded and which the step lacked; ``stats``: what it read, and where;
    ``whole``: this rank's own held shard was copied whole into the state's tensors (no region reads)."""
    source: str
    raw_bytes: int = 0
    outcome: Outcome = field(default=Outcome(), compare=False)
    stats: ReadStats | None = field(default=None, compare=False)
    whole: bool = False


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
    ``raw_bytes``: the raw (decoded) bytes the restore read, from every source it used: held shards'
    bytes copied plus data-file chunks decoded (a chunk counts whole, even where a reshard needed
    part of it).
    ``restored``: the top-level keys of the state loaded; ``missing`` (top-level keys) and
    ``missing_tensors`` (key paths inside restored entries): what the step lacked, left as it was
    (only with ``strict=False``; entries a ``per_rank`` rule kept fresh are in neither).
    ``from_memory``/``from_peers``: raw bytes copied from shards this node's daemon held / fetched
    from a peer daemon; ``from_storage``: stored bytes read from data files (a source may combine
    them: a sharded restore reads from storage only the saved ranks no daemon holds). ``whole``:
    served from memory by copying this rank's own held shard whole into its tensors (a plain state, or
    DTensors whose local shards are exactly the saved pieces: the same layout, tensors allocated);
    False: read as regions (storage, or a reshard, or DTensors the state does not have yet)."""
    step: int
    source: str
    seconds: float
    raw_bytes: int = 0
    fallback: str | None = None
    passed: tuple[Unavailable, ...] = ()
    restored: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    missing_tensors: tuple[str, ...] = ()
    from_memory: int = 0
    from_peers: int = 0
    from_storage: int = 0
    level: str = "storage"        # "memory": a memory-level step (memory_level.py)
    whole: bool = False

    @classmethod
    def of(cls, step: int, got: Served, started: float, passed: tuple[Unavailable, ...] = (),
           level: str = "storage") -> RestoreInfo:
        o, st = got.outcome, got.stats or ReadStats()
        raw = sum(st.held.values()) + st.raw if got.stats is not None else got.raw_bytes
        return cls(step, got.source, time.monotonic() - started, raw,
                   fallback=passed[0].reason if passed else None, passed=passed, restored=o.restored,
                   missing=o.missing, missing_tensors=o.missing_tensors, from_memory=st.held.get(MEMORY, 0),
                   from_peers=st.held.get(PEER, 0), from_storage=st.bytes, level=level, whole=got.whole)

    def lacked(self) -> str:
        """What the step lacked, for the restore's log line ("" when nothing)."""
        gone = self.missing + self.missing_tensors
        return f"; not in the step, left as they were: {listed(gone)}" if gone else ""

    def __str__(self) -> str:
        """The restore's log line."""
        return (f"restored {'memory-level ' if self.level == 'memory' else ''}step {self.step} from {self.source} in "
                f"{self.seconds:.3f}s (bytes: {self.from_memory} memory, {self.from_peers} peers, {self.from_storage} "
                f"storage){f' (memory tier: {self.fallback})' if self.fallback else ''}{self.lacked()}")


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
    """The daemons' held copies: this rank's whole shard (memory_restore.py) for a plain state at
    the saved world size, else the saved ranks' pieces the state needs (held_pieces.py)."""
    name = MEMORY

    def __init__(self, reader: Reader, enabled: bool, per_rank: PerRank = None, strict: bool = True,
                 staging: BucketStaging | None = None) -> None:
        self.reader, self.enabled, self.per_rank, self.strict = reader, enabled, per_rank, strict
        self.staging = staging      # (its ``silent``: this restore found the daemon not answering)

    def serve(self, step: int, state: dict[str, Any]) -> Served | Unavailable:
        if not self.enabled:
            return Unavailable(self.name, "memory restore off (memory=False)")
        if self.staging is not None and (silent := self.staging.silent):     # its fetch would wait minutes
            return Unavailable(self.name, f"skipped: {silent}")
        r = self.reader
        sharded = any(is_dtensor(t) for t in live_tensors(state)[0].values())
        index = _Index(step_dir(r.root(), r.job, step))
        # A sharded state at its saved world size is tried as a whole-shard copy too: its local shards
        # are read in place when they are exactly the held pieces (the same layout); else pieces.
        if not sharded or index.world == r.world_size:
            try:
                copy = restore_from_memory(r.socket_path, r.job, step, r.rank, r.world_size, state, r.threads,
                                           self.strict)
            except MemoryUnavailable as e:
                if not sharded and not e.pieces and index.world in (None, r.world_size):
                    return Unavailable(self.name, str(e))
            else:
                stats = ReadStats(held={copy.source: copy.raw_bytes})
                return Served(copy.source, copy.raw_bytes, copy.outcome, stats, whole=True)
        return self._pieces(step, state, index)

    def _pieces(self, step: int, state: dict[str, Any], index: _Index) -> Served | Unavailable:
        """A sharded or resharding restore reading held shards first (held_pieces.py), from the step's
        ``index`` (read once for both this and ``serve``)."""
        r = self.reader
        saved = index.world
        if index.reader is None or saved is None:
            return Unavailable(self.name, f"step {step} of job {r.job!r} has no readable index under {r.root()}")
        stats = ReadStats()
        # The saved ranks this rank's share of the tensors' first dimension came from (FSDP's Shard(0);
        # at the same layout its own), the first of which must be held, and the one whose state tree it
        # takes: their fetches start now, in parallel, while the restore reads the tensor map and plans (a
        # fetch is a round trip to the daemon: 0.7 ms alone, ~4 ms with four ranks on 2 cores); the
        # plan fetches any other.
        first = r.rank * saved // r.world_size
        with DaemonShards(r.socket_path, r.job, step, saved, must=(first,)) as held:
            held.prefetch([tree_source(r.rank, saved), *range(first, max(first + 1, (r.rank + 1) * saved //
                                                                          r.world_size))])
            try:
                outcome = restore_state(index.path, state, rank=r.rank, world_size=r.world_size, threads=r.threads,
                                        per_rank=self.per_rank, strict=self.strict, stats=stats, held=held,
                                        reader=index.reader)
            except MemoryUnavailable as e:
                return Unavailable(self.name, str(e))
            except MissingData as e:
                return Unavailable(self.name, f"a saved rank's shard is neither held nor on disk here: {e}", e)
        raw = sum(stats.held.values())
        return Served(PEER if stats.held.get(PEER) else MEMORY, raw, outcome, stats)


def saved_world(step_path: str) -> int | None:
    """The world size a committed step was saved by (None: no readable index)."""
    return _Index(step_path).world


class _Index:
    """A committed step's index, read at most once by one source (parsing it costs ~1 ms at 140 tensors
    and four ranks): ``reader`` (None: no readable index) and the world size it was saved by."""

    def __init__(self, path: str) -> None:
        self.path = path

    @cached_property
    def reader(self) -> StepReader | None:
        try:
            return StepReader(self.path)
        except (FormatError, OSError):
            return None

    @property
    def world(self) -> int | None:
        return self.reader.world_size if self.reader is not None else None


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
            if step_files.is_committed(step_dir(r.root(), memory_job(r.job), step)):
                raise CheckpointError(
                    f"step {step} of job {r.job!r} is a memory-level step: no files hold it, only the daemons' "
                    "memory, and none served it (a Checkpointer with memory=False does not ask them; a restart of "
                    "every daemon holding it loses it): restore it with memory=True while a daemon holds it, or "
                    "restore an earlier storage step (`ckptd ls` lists both)")
            raise CheckpointError(f"step {step} of job {r.job!r} does not exist under {r.root()}")
        try:
            stats = ReadStats()
            outcome = restore_state(path, state, rank=r.rank, world_size=r.world_size, threads=r.threads,
                                    per_rank=self.per_rank, strict=self.strict, stats=stats)
        except MissingData as e:      # another rank's data file this node lacks: staging every rank's may help
            return Unavailable(self.name, str(e), e)
        return Served(STORAGE, outcome=outcome, stats=stats)


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
        stats = ReadStats()
        outcome = restore_state(step_dir(r.root(), r.job, step), state, rank=r.rank, world_size=r.world_size,
                                threads=r.threads, per_rank=self.per_rank, strict=self.strict, stats=stats)
        return Served(STORAGE, outcome=outcome, stats=stats)


def restore_chain(reader: Reader, staging: BucketStaging, *, memory: bool, per_rank: PerRank,
                  strict: bool = True) -> list[Source]:
    """The sources of one restore, in the order they are tried (the module docstring); ``staging``:
    this restore's, which may have staged the newest step while it was being chosen."""
    return [DaemonMemory(reader, memory, per_rank, strict, staging), LocalFiles(reader, staging, per_rank, strict),
            AllRanksStaged(reader, staging, per_rank, strict)]


def run_chain(chain: Sequence[Source], step: int, state: dict[str, Any],
              skipped: Unavailable | None = None) -> RestoreInfo:
    """Try each source in turn until one serves; the RestoreInfo records the ones passed over (first
    ``skipped``: a newer memory-level step that could not be restored, memory_level.py)."""
    started = time.monotonic()
    passed: list[Unavailable] = [] if skipped is None else [skipped]
    for source in chain:
        with gc_paused():     # a trainer's heap is large: a full collection mid-restore cost 17 ms a go
            try:
                got = source.serve(step, state)
            except CheckpointError as e:        # (and why a newer memory-level step could not serve)
                if skipped is not None and type(e) is CheckpointError:
                    raise CheckpointError(f"{e}; before it, " + "; ".join(f"{u.source}: {u.reason}"
                                                                          for u in passed)) from e
                raise
        if isinstance(got, Served):
            return RestoreInfo.of(step, got, started, tuple(passed))
        passed.append(got)
    first = next((u.error for u in passed if u.error is not None), None)
    if first is not None:
        raise first
    raise CheckpointError(f"no source could restore step {step}: " + "; ".join(f"{u.source}: {u.reason}"
                                                                               for u in passed))


def outranked(job: str, restored: int, newest: int) -> str:
    """Why a restore of an explicit step with a newer committed step left behind deserves a warning."""
    return (f"restored step {restored} of job {job!r} while step {newest} is newer: this run's saves rank below it "
            "(retention and restore() go by number); if this run replaces it, remove the newer steps first: "
            f"ckptd gc ROOT --job {job} --remove-above {restored}")
