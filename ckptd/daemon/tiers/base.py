"""The storage-tier interface: where a step's shards go, and how a step becomes visible.

The daemon's step coordinator talks to storage only through this class, so the local file
system and the memory tier in front of it (which also feeds peer copies) sit behind the same
step logic (the shape follows torch.distributed.checkpoint's StorageWriter/StorageReader).

Call order, per step of a job, on the daemon serving some of its ranks::

    refuses_save(job, step)        at each SAVE, before the step begins here (a committed step is refused,
                                   a memory-level one replaced)
    write_shard(ref, ...)          once per rank served here; ranks run concurrently
    then exactly one of
      commit(job, step, world_size, digests, records)
                                   on the leader (the daemon serving rank 0), once every
                                   rank of the world is durable
      abort(job, step, ranks)                  the step failed: drop these ranks' shards

``write_shard``'s ``data`` lies in a trainer's shared-memory slot. The slot goes back to the trainer
by ``released`` (the usual way) or, where the caller offers a :class:`SlotLoan`, a tier that keeps
shards resident (the memory tier) may instead keep the slot itself as the shard's copy: no second
copy of the step in host memory. See ``SlotLoan`` for that call order.

A shard whose write raises leaves nothing behind (the tier removes its partial bytes).
``commit`` must make the step visible atomically and last: a reader never sees a step
that is not complete. ``abort`` is best effort and never touches a committed step.

A tier that wraps another (the memory tier) implements every call itself and passes each
argument on: there is one commit method, so none can be dropped (tests/test_tier_contract.py).

At shutdown, ``withdraw_commits`` settles commits still running (a drain that ran out of
time reports their true outcome). Reading entry points (status, the drain's checks):
``is_committed``, ``latest_committed``, ``written_bytes``. Every method is a coroutine: a tier
does its blocking I/O on its own threads (or with async I/O), never on the caller's event loop.
"""
from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptd.core.rank_record import RankRecord
from ckptd.core.schema import Manifest, TensorLayout


@dataclass(frozen=True)
class ShardRef:
    """One rank's shard of one step."""
    job: str
    step: int
    rank: int
    world_size: int


@dataclass(frozen=True)
class ShardWritten:
    """What a durable shard reports: its sizes, and the digest of its manifest (the commit checks it)."""
    raw_bytes: int
    stored_bytes: int
    digest: str
    seconds: float
    record: RankRecord | None = None     # what the commit needs of this rank (rank_record.py), if known
    manifest: Manifest | None = None     # the manifest written, where a tier wrote one (its raw chunk checksums)
    direct_bytes: int = 0                # of stored_bytes, those written around the page cache (O_DIRECT)


@dataclass(frozen=True)
class SlotLoan:
    """The trainer's slot that a shard's ``data`` lies in, offered for the tier to keep.

    Call order, all on the event loop: ``can_lend(steps)`` (may the trainer spare this slot while
    the tier keeps up to ``steps`` steps of its job?); then, once the shard is durable, either
    ``released`` as usual, or ``lend()`` *instead*: the slot is the tier's (``fd`` and ``mm``, read
    only, stay valid) until the tier calls ``give_back()``, exactly once, when it lets the shard go.
    The trainer does not write a lent slot; it fills it again only after ``give_back``."""
    fd: int
    mm: mmap.mmap
    can_lend: Callable[[int], bool]
    lend: Callable[[], None]
    give_back: Callable[[], None]


class StreamedData(ABC):
    """A shard that arrives as the writer reads it: in parts, through slots reused as the writer
    reads on (``ckptd/daemon/streamed.py``: a shard larger than its trainer's slots; it keeps
    none of it resident), or in one slot the trainer is still filling (``ckptd/daemon/filling.py``:
    ``resident``, the whole slot is ``whole()`` once filled, and the slot may be lent as usual).
    Stands in for ``data``; a tier reads it in increasing order."""

    resident = False

    @abstractmethod
    def read(self, t: TensorLayout, start: int, length: int, stop: Callable[[], bool]) -> memoryview:
        """(A writer thread) bytes ``start`` … ``start + length`` of tensor ``t``, waiting for them
        to arrive; raises once ``stop()`` is true or they did not come in time."""

    def whole(self, stop: Callable[[], bool]) -> memoryview:
        """(A ``resident`` shard, any thread) the whole slot once every byte is in it; raises as ``read``."""
        raise TypeError("a shard streamed through reused slots is never whole in memory")

    def mapped(self) -> memoryview | None:
        """The slot's whole mapping, whose bytes at a layout's offsets are what ``read`` returned once it
        returned (a ``resident`` shard's), or None (direct writes read the source from it)."""
        return None


class StorageTier(ABC):
    """A place checkpoints are written to; see the module docstring for the call order."""

    @abstractmethod
    async def write_shard(self, ref: ShardRef, data: memoryview | StreamedData, layout: Sequence[TensorLayout],
                          tree: Any, *, released: Callable[[], None], abandoned: Callable[[], bool],
                          loan: SlotLoan | None = None) -> ShardWritten:
        """Store one rank's tensors (``layout`` places them in ``data``) and state tree durably.

        ``released`` is called exactly once, from any thread, as soon as ``data`` is no longer
        read (so the trainer may reuse it before the shard is durable), also on failure — unless
        the tier kept the slot through ``loan`` (see ``SlotLoan``); a tier that keeps nothing
        resident ignores ``loan``.
        ``abandoned`` may be polled from any thread; once it is true the tier stops early,
        removes what it wrote of this shard and raises."""

    @abstractmethod
    async def commit(self, job: str, step: int, world_size: int, digests: Mapping[int, str],
                     records: Sequence[RankRecord] | None = None, check: Sequence[int] | None = None) -> None:
        """Check the ranks' shards against their digests, then publish the step atomically.

        ``records``: every rank's record (rank order) when the ranks sent them, so the index is
        built without reading each manifest back; None: the tier reads the manifests.
        ``check`` (with records only): the ranks whose manifests are read back and checked — one
        per daemon that wrote shards, which proves its files are visible where the index is
        written (each daemon wrote, fsynced and digested its own ranks' manifests); None: every rank."""

    @abstractmethod
    async def withdraw_commits(self) -> None:
        """(Shutdown) make every commit in flight final now: one not yet published never will be,
        one publishing right now is waited for; afterwards ``is_committed`` tells the truth."""

    @abstractmethod
    async def abort(self, job: str, step: int, ranks: Collection[int]) -> None:
        """Remove these ranks' shards of an uncommitted step (and the step, once empty); best effort."""

    @abstractmethod
    async def is_committed(self, job: str, step: int) -> bool:
        """Whether the step is already published."""

    @abstractmethod
    async def refuses_save(self, job: str, step: int) -> bool:
        """Whether a new save of the step must be refused, it being committed (asked once per SAVE, before
        it begins, with no suspension after; the memory tier replaces a memory-level step instead)."""

    @abstractmethod
    async def latest_committed(self, job: str) -> int | None:
        """The newest committed step of the job in this tier, or None."""

    @abstractmethod
    async def written_bytes(self, ref: ShardRef) -> int:
        """Bytes of the shard stored so far (progress of a write in flight; 0 when unknown)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the tier's threads without waiting for writes in flight (the process is exiting)."""
