"""Lazy partial loads: one named tensor, or a slice of it, from a committed step."""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ckptd.core import storage
from ckptd.core.global_index import LOCAL, GlobalTensor, Piece
from ckptd.core.regions import Region

from .errors import CheckpointError
from .load_files import ReadAt, StepFiles
from .read_stats import ReadStats
from .reshard import DTYPES, Need, read_needs


def load_tensor(step_dir: str | os.PathLike[str], name: str, region: Any = None, *, rank: int | None = None,
                threads: int = 4, stats: ReadStats | None = None, read_at: ReadAt = storage.read_at) -> torch.Tensor:
    """Read tensor ``name`` (its key path in the saved state, e.g. ``"model/layers.0.mlp.w1.weight"``
    or ``"optim/state/layers.0.mlp.w1.weight/exp_avg"``) — or a slice of it — from the committed
    step directory ``step_dir``, reading nothing else: index.json, the manifests of the ranks
    whose pieces overlap the slice, and of those pieces only the chunks covering the rows the
    slice touches (a slice along the first dimension costs its own bytes, a slice along a later
    dimension every row it crosses, rounded out to whole chunks). Checksums are verified. No
    daemon, no process group, no unpickling.

    ``region``: None (the whole tensor), or an index like a tensor's — a slice or int or a tuple of
    them (fewer than the dimensions: the rest whole; slices with step 1; an int drops its
    dimension) — or a ``ckptd.core.regions.Region`` of the global tensor. A sharded (DTensor)
    tensor is read as its global tensor, assembled from whichever pieces overlap the region.

    ``rank``: for a plain tensor each saving rank kept its own copy; which one to read. By default
    rank 0's (any when all copies are identical); a CheckpointError asks for ``rank`` when the
    copies differ. ``stats``: a ``ReadStats`` filled with what was read; ``read_at``: how data
    files are read (``(fd, offset, length) -> bytes``, default ``ckptd.core.storage.read_at``).

    Returns a contiguous CPU tensor of the saved dtype. Raises CheckpointError naming the tensor
    (and file) when the step, the tensor or a chunk is missing or corrupt.
    """
    with StepFiles(os.fspath(step_dir), stats, read_at) as files:
        if files.tensors is None:         # format 1: plain tensors, each rank's own, no tensor map
            src = 0 if rank is None else rank
            if not 0 <= src < files.world_size:
                raise CheckpointError(f"rank {src} is not in step {files.step} (world size {files.world_size})")
            entry = files.manifest(src).by_name().get(name)
            if entry is None:
                raise CheckpointError(f"tensor {name!r} is not in rank {src}'s shard of {files.path}")
            files.tensors = {name: GlobalTensor(name, entry.dtype, tuple(entry.shape), LOCAL,
                                                (Piece(src, name, entry.region()),))}
        t = files.tensors.get(name)
        if t is None:
            raise CheckpointError(f"tensor {name!r} is not in checkpoint step {files.step} ({files.path})")
        source = None
        shape, dtype = t.shape, t.dtype
        if t.kind == LOCAL:
            holders = t.holder_ranks()
            if rank is not None:
                source = rank
            elif 0 in holders and (t.same or len(holders) == 1):
                source = 0
            elif t.same or len(holders) == 1:
                source = holders[0]
            else:
                raise CheckpointError(f"tensor {name!r}: ranks {list(holders)} each saved their own, different copy; "
                                      "pass rank= to say whose")
            if source not in holders:
                raise CheckpointError(f"tensor {name!r}: saved rank {source} holds no copy (held by {list(holders)})")
            entry = files.entry(source, name, name)      # a rank's own copy may differ in shape and dtype
            shape, dtype = tuple(entry.shape), entry.dtype
        try:
            want, result_shape = slice_region(shape, region)
        except (ValueError, TypeError, IndexError) as e:
            raise CheckpointError(f"tensor {name!r} of shape {list(shape)}: {e}") from None
        out = torch.empty(want.sizes, dtype=DTYPES[dtype])
        read_needs(files, [Need(name, want, out, source)], threads)
    return out.reshape(result_shape)



def slice_region(shape: Sequence[int], index: Any) -> tuple[Region, tuple[int, ...]]:
    """(region, result shape) of ``index`` — None, a slice or int, a tuple of them (fewer than the
    dimensions: the rest whole), or a Region — into a tensor of ``shape``. Slices take Python's
    bounds (negative, open, clipped) with step 1; an int picks one index and drops its dimension."""
    if index is None:
        return Region.whole(shape), tuple(shape)
    if isinstance(index, Region):
        if not index.within(shape):
            raise ValueError(f"region {index.to_json()} is not inside shape {list(shape)}")
        return index, index.sizes
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape):
        raise ValueError(f"{len(items)} indices for a tensor of {len(shape)} dimensions")
    offsets, sizes, result = [], [], []
    for d, n in enumerate(shape):
        it = items[d] if d < len(items) else slice(None)
        if isinstance(it, bool) or not isinstance(it, (int, slice)):
            raise TypeError(f"dimension {d}: index with ints and slices, not {type(it).__name__}")
        if isinstance(it, int):
            i = it + n if it < 0 else it
            if not 0 <= i < n:
                raise IndexError(f"index {it} is out of range for dimension {d} of size {n}")
            offsets.append(i)
            sizes.append(1)
            continue
        start, stop, step = it.indices(n)
        if step != 1:
            raise ValueError(f"dimension {d}: only step 1 slices are supported, got step {it.step}")
        offsets.append(start)
        sizes.append(max(0, stop - start))
        result.append(sizes[-1])
    return Region(tuple(offsets), tuple(sizes)), tuple(result)


__all__ = ["load_tensor", "ReadStats", "Region", "slice_region"]
