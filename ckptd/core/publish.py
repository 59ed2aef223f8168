"""Publishing a step's index: the rank records → the global tensor map → index.json (FORMAT.md).

One build and one publication for the daemon's commit and for ``ckptd import``, so every
committed step, however it was written, has passed the same checks — the ranks agree about
each tensor, and the pieces of every sharded tensor tile it exactly (``map_check``) — and a
large index has its lean side files (``rank_table``). The side files are written first and
``index.json`` last (tmp, fsync, rename, fsync dir): its presence is the commit. Deciding
*whether* to publish (the daemon's withdrawable commits) stays with the caller, which may pass
the rename through a gate of its own.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import storage
from .errors import FormatError
from .global_index import build_from_records
from .map_check import geometry_faults
from .names import INDEX_NAME
from .rank_record import RankRecord
from .rank_table import SMALL_INDEX_BYTES, side_files
from .schema import make_index_file
from .step_files import leftovers, remove_files

# Runs the rename that publishes index.json, or refuses by raising (storage.atomic_write's ``publish``).
Rename = Callable[[Callable[[], None], Callable[[], None]], None]     # (rename, then the fsync of its directory)


class IndexRefused(ValueError):
    """The ranks' records do not make a loadable step (they disagree about a tensor, or its pieces
    do not tile it): publishing would make a broken step the latest."""


@dataclass(frozen=True)
class BuiltIndex:
    """A step's index, built and checked but not yet on disk: the object and its bytes."""
    index: dict[str, Any]
    body: bytes


def build_index(job: str, step: int, world_size: int, records: Sequence[RankRecord], *,
                grids: bool = True) -> BuiltIndex:
    """The index of a step from every rank's record, in rank order; IndexRefused when the records
    disagree about a tensor or the ranks' pieces do not tile their tensors. ``grids``: store
    regular shardings as grids (format 3, FORMAT.md), else every piece listed (format 2)."""
    try:
        tensors, per_rank = build_from_records(records)
    except FormatError as e:        # ranks that disagree about one tensor: not a loadable step
        raise IndexRefused(str(e)) from None
    faults = geometry_faults(tensors, world_size)
    if faults:    # pieces that overlap or leave a gap
        more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
        raise IndexRefused(f"the ranks' pieces do not tile their tensors: {faults[0]}{more}")
    return BuiltIndex(*make_index_file(job, step, world_size, [r.index_entry() for r in records], time.time(),
                                       {name: t.to_json(world_size, grids=grids) for name, t in tensors.items()},
                                       per_rank))


def clear_leftovers(step_path: str, world_size: int) -> None:
    """Remove what earlier attempts of this step left (``step_files.leftovers``): nothing of theirs
    may survive inside the committed step. Called before publishing."""
    remove_files(leftovers(step_path, world_size))


def publish_index(step_path: str, built: BuiltIndex, records: Sequence[RankRecord], *,
                  rename: Rename | None = None, small_index_bytes: int = SMALL_INDEX_BYTES) -> None:
    """Write the side files of an index over ``small_index_bytes`` (readers read a smaller one
    whole; any left by an earlier attempt are overwritten), then index.json, durably and last."""
    if len(built.body) > small_index_bytes:
        storage.write_files_durably(step_path, side_files(built.index, records))
    storage.atomic_write(os.path.join(step_path, INDEX_NAME), built.body, rename)


def publish_step(step_path: str, job: str, step: int, world_size: int, records: Sequence[RankRecord], *,
                 small_index_bytes: int = SMALL_INDEX_BYTES) -> dict[str, Any]:
    """Build, check and publish the index of a step whose rank files are all durable in
    ``step_path`` (``ckptd import``); returns the index. IndexRefused: nothing was published."""
    built = build_index(job, step, world_size, records)
    clear_leftovers(step_path, world_size)
    publish_index(step_path, built, records, small_index_bytes=small_index_bytes)
    return built.index
