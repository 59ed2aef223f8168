"""Memory-level steps on the restore side: finding the newest, restoring it from the daemons' memory,
and every rank agreeing that it did.

A memory-level step (``save(..., level="memory")``; ``ckptd/daemon/tiers/memory/memory_level.py``)
has an index and raw ``held`` manifests under ``<root>/<job>/_memory/step-N`` and no data files: its
bytes exist only in the daemons' memory (the saving node's and K peers'). ``Checkpointer.restore``
without a step restores the newest memory-level step newer than the newest storage step when every
rank can read all it needs of it from memory or peers (:func:`restore_held`, each saved rank's shard
through ``memory_fetch``, resharded as from storage), and otherwise the storage step, saying why in
``RestoreInfo.passed``. "Every rank" is agreed through the job's store (agreement.py): one
rank that cannot read its pieces (its daemon and the shard's peers gone) sends every rank to storage,
so no run resumes from two different steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ckptd.core import step_files
from ckptd.core.gc_pause import gc_paused
from ckptd.core.names import memory_job, step_dir

from .errors import CheckpointError
from .held_pieces import DaemonShards
from .memory_restore import MEMORY, PEER, MemoryUnavailable
from .read_stats import ReadStats
from .restore import PerRank, restore_state
from .sources import Reader, RestoreInfo, Served, Unavailable, saved_world
from .step_choice import newest_memory_level

MEMORY_LEVEL = "memory-level"


def newest_held_step(root: str, job: str, above: int | None) -> int | None:
    """The newest committed memory-level step of ``job`` newer than ``above`` (None: none; a
    CheckpointError when a memory-level step directory it cannot read may hold a newer one)."""
    newest = newest_memory_level(root, job)
    return newest if newest is not None and (above is None or newest > above) else None


def is_held_step(root: str, job: str, step: int) -> bool:
    """Whether ``step`` is a committed memory-level step of ``job`` and no storage step."""
    return step_files.is_committed(step_dir(root, memory_job(job), step)) \
        and not step_files.is_committed(step_dir(root, job, step))


def serve_held(reader: Reader, step: int, state: dict[str, Any], per_rank: PerRank,
               strict: bool, before_write: Callable[[], None] | None = None) -> Served | Unavailable:
    """This rank's part of memory-level step ``step`` from the daemons' memory: every saved rank it
    needs must be held by this node's daemon or a peer it reaches (there are no files to read).
    ``before_write``: as ``restore_state``'s."""
    job = memory_job(reader.job)
    path = step_dir(reader.root(), job, step)
    saved = saved_world(path)
    if saved is None:
        return Unavailable(MEMORY_LEVEL, f"memory-level step {step} has no readable index under {reader.root()}")
    stats = ReadStats()
    try:
        with DaemonShards(reader.socket_path, job, step, saved, required=True) as held:
            outcome = restore_state(path, state, rank=reader.rank, world_size=reader.world_size,
                                    threads=reader.threads, per_rank=per_rank, strict=strict, stats=stats, held=held,
                                    before_write=before_write)
    except MemoryUnavailable as e:
        return Unavailable(MEMORY_LEVEL, f"memory-level step {step}: {e}")
    return Served(PEER if stats.held.get(PEER) else MEMORY, sum(stats.held.values()), outcome, stats)


def restore_held(reader: Reader, step: int, state: dict[str, Any], per_rank: PerRank, strict: bool,
                 all_ok: Callable[[bool], bool]) -> RestoreInfo | Unavailable:
    """Memory-level step ``step`` into ``state`` on every rank, or on none. Each rank first plans its
    part (every held shard it needs fetched and pinned, everything checked), then votes (``all_ok``:
    whether every rank can), and only then writes: one rank that cannot read it leaves every rank's
    state as it was, and all go on to storage. An error before the vote is raised once this rank has
    voted no; one after it (a shard failing its checksum as it is read) says the state is partly loaded."""
    started = time.monotonic()
    phase = {"voted": False, "writing": False}

    def vote() -> None:
        phase["voted"] = True
        if not all_ok(True):
            raise _Declined
        phase["writing"] = True

    try:
        with gc_paused():     # as run_chain's sources
            got = serve_held(reader, step, state, per_rank, strict, vote)
    except _Declined:
        return Unavailable(MEMORY_LEVEL, f"memory-level step {step}: another rank could not restore it from memory")
    except Exception as e:
        if not phase["voted"]:
            all_ok(False)     # every rank must still reach the agreement, or the others wait for it
        if phase["writing"]:
            raise CheckpointError(f"memory-level step {step} failed after every rank had agreed to restore it, "
                                  f"while reading it: {e}; this rank's state is partly loaded") from e
        raise
    if isinstance(got, Unavailable):
        if phase["writing"]:
            raise CheckpointError(f"{got.reason}, after every rank had agreed to restore it; this rank's state is "
                                  "partly loaded")
        all_ok(False)
        return got
    return RestoreInfo.of(step, got, started, level="memory")


class _Declined(Exception):
    """Another rank cannot restore the memory-level step: nothing was written here."""
