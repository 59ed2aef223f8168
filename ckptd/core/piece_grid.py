"""A sharded tensor's pieces as a rule, not a list: O(1) index bytes per tensor, not O(ranks).

FSDP2, tensor parallelism and 2-D meshes cut every dimension of a tensor the way ``torch.chunk``
(DTensor's ``Shard``) does: ``count`` cells of ``chunk`` elements, each cell's offset clipped to
the dimension, so trailing cells may be empty. The rank holding cell ``(i0, i1, …)`` is
``base + Σ i_d·stride_d``. A step whose pieces follow that rule stores the rule (index.json's
``grid``, FORMAT.md) instead of one record per piece — at 32,768 ranks a 4 MB piece list per
tensor becomes ~100 bytes — and a reader finds the pieces a region needs by arithmetic
(:meth:`PieceGrid.overlapping`) instead of scanning every rank's.

:func:`fit` finds the rule for a piece list, or None (replicas, strided or hand-made layouts keep
their list); :meth:`PieceGrid.from_json` validates one read from disk so that what it describes
always tiles the tensor exactly, each cell held by one distinct rank of the world.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import FormatError
from .regions import Region

__all__ = ["PieceGrid", "fit", "fit_arrays"]


@dataclass(frozen=True)
class PieceGrid:
    """Dimension ``d`` of a tensor of ``shape`` cut into ``counts[d]`` cells of ``chunks[d]``
    elements; cell ``c`` held by rank ``base + Σ c[d]·strides[d]`` (a stride is 0 where the count is 1)."""
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    counts: tuple[int, ...]
    base: int
    strides: tuple[int, ...]

    # ---- geometry ---------------------------------------------------------------------------

    def span(self, d: int, i: int) -> tuple[int, int]:
        """(offset, size) of cell ``i`` along dimension ``d``: torch.chunk's rule, clipped."""
        n, c = self.shape[d], self.chunks[d]
        lo = min(i * c, n)
        return lo, min(lo + c, n) - lo

    def rank_of(self, cell: Sequence[int]) -> int:
        return self.base + sum(i * s for i, s in zip(cell, self.strides, strict=True))

    def region_of(self, cell: Sequence[int]) -> Region:
        spans = [self.span(d, i) for d, i in enumerate(cell)]
        return Region(tuple(o for o, _ in spans), tuple(s for _, s in spans))

    def cells(self) -> Iterator[tuple[int, ...]]:
        """Every cell, in increasing rank order (the order a built list has: records by rank)."""
        order = sorted(range(len(self.shape)), key=lambda d: -self.strides[d])
        for idx in itertools.product(*(range(self.counts[d]) for d in order)):
            cell = [0] * len(self.shape)
            for d, i in zip(order, idx, strict=True):
                cell[d] = i
            yield tuple(cell)

    def pieces(self) -> list[tuple[int, Region]]:
        """(rank, region) of every cell, in rank order."""
        return [(self.rank_of(c), self.region_of(c)) for c in self.cells()]

    def __len__(self) -> int:
        return math.prod(self.counts)

    def cell_of_rank(self, rank: int) -> tuple[int, ...] | None:
        """The cell ``rank`` holds, or None when it holds none."""
        rem = rank - self.base
        if rem < 0:
            return None
        cell = [0] * len(self.shape)
        for d in sorted(range(len(self.shape)), key=lambda d: -self.strides[d]):
            if self.strides[d]:
                cell[d] = min(rem // self.strides[d], self.counts[d] - 1)
                rem -= cell[d] * self.strides[d]
        return tuple(cell) if rem == 0 else None

    def overlapping(self, region: Region) -> list[tuple[int, Region]]:
        """(rank, region) of every cell sharing an element with ``region``: O(cells returned)."""
        if len(region.sizes) != len(self.shape) or any(s <= 0 for s in region.sizes):
            return []
        ranges = []
        for d, (o, s) in enumerate(zip(region.offsets, region.sizes, strict=True)):
            c, n = self.chunks[d], self.shape[d]
            if o >= n or c == 0:
                return []
            ranges.append(range(o // c, min((min(o + s, n) - 1) // c, self.counts[d] - 1) + 1))
        return [(self.rank_of(cell), self.region_of(cell)) for cell in itertools.product(*ranges)]

    # ---- index.json ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"chunks": list(self.chunks), "counts": list(self.counts), "base": self.base,
                "strides": list(self.strides)}

    @staticmethod
    def from_json(obj: Any, shape: tuple[int, ...], world_size: int, where: str) -> PieceGrid:
        """A grid read from disk, checked to tile ``shape`` with one distinct rank of
        ``world_size`` per cell (FormatError naming ``where`` otherwise)."""
        nd = len(shape)
        if not (isinstance(obj, dict) and all(_uints(obj.get(k), nd) for k in ("chunks", "counts", "strides"))
                and type(obj.get("base")) is int and obj["base"] >= 0):
            raise FormatError(f"{where}: malformed grid {str(obj)[:120]} (needs chunks, counts, strides "
                              f"of {nd} numbers each and a base rank)")
        grid = PieceGrid(shape, tuple(obj["chunks"]), tuple(obj["counts"]), obj["base"], tuple(obj["strides"]))
        if problem := grid.fault(world_size):
            raise FormatError(f"{where}: grid {obj}: {problem}")
        return grid

    def fault(self, world_size: int) -> str | None:
        """What keeps this grid from tiling its tensor with distinct ranks of ``world_size``."""
        for d, (n, c, k, s) in enumerate(zip(self.shape, self.chunks, self.counts, self.strides, strict=True)):
            if k < 1 or c * k < n or (n and not c):
                return f"dimension {d}: {k} cells of {c} do not cover {n} elements"
            if (k > 1) != (s > 0):
                return f"dimension {d}: a stride is needed exactly when there are several cells"
        span = 1            # strides sorted ascending must each clear the cells below: ranks are distinct
        for s, k in sorted((s, k) for s, k in zip(self.strides, self.counts, strict=True) if k > 1):
            if s < span:
                return "two cells map to the same rank"
            span = s * k
        last = self.base + sum((k - 1) * s for k, s in zip(self.counts, self.strides, strict=True))
        if last >= world_size:
            return f"cells map to rank {last}, the world has {world_size}"
        return None


def fit(shape: tuple[int, ...], pieces: Sequence[tuple[int, Region]]) -> PieceGrid | None:
    """The grid whose cells are exactly ``pieces`` ((rank, region), in rank order), or None."""
    if len(pieces) < 2 or not shape:
        return None
    return fit_arrays(shape, np.array([r for r, _ in pieces], dtype=np.int64),
                      np.array([p.offsets for _, p in pieces], dtype=np.int64),
                      np.array([p.sizes for _, p in pieces], dtype=np.int64))


def fit_arrays(shape: tuple[int, ...], ranks: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> PieceGrid | None:
    """``fit`` of pieces given as arrays: ``ranks`` (n,), ``offsets`` and ``sizes`` (n, ndim), in
    rank order. Vectorised: at 32,768 ranks the commit fits every sharded tensor of the state."""
    n, nd = len(ranks), len(shape)
    if n < 2 or nd == 0 or 0 in shape or offsets.shape != (n, nd) or sizes.shape != (n, nd) \
            or not bool(np.all(ranks[1:] > ranks[:-1])):
        return None
    dims = np.array(shape, dtype=np.int64)
    at_zero = offsets == 0
    chunks = tuple(int(sizes[at_zero[:, d], d].max(initial=0)) for d in range(nd))
    if 0 in chunks:
        return None
    base = int(ranks[0])
    strides = []
    for d, (size, c) in enumerate(zip(shape, chunks, strict=True)):
        if c >= size and not bool(np.any(sizes[:, d] == 0)):
            strides.append(0)                   # not cut: every piece spans it whole
            continue
        origin = np.zeros(nd, dtype=np.int64)   # cell 1 along d: non-empty, or empty at the end
        origin[d] = min(c, size)
        hit = np.flatnonzero(np.all(offsets == origin, axis=1))
        if not len(hit) or int(ranks[hit[0]]) <= base:
            return None
        strides.append(int(ranks[hit[0]]) - base)
    counts, cells, rem = [1] * nd, np.zeros((n, nd), dtype=np.int64), ranks - base
    for d in sorted((d for d in range(nd) if strides[d]), key=lambda d: -strides[d]):
        cells[:, d], rem = np.divmod(rem, strides[d])
        counts[d] = int(cells[:, d].max()) + 1
    grid = PieceGrid(tuple(shape), chunks, tuple(counts), base, tuple(strides))
    if bool(np.any(rem)) or len(grid) != n or grid.fault(int(ranks[-1]) + 1) is not None:
        return None
    lo = np.minimum(cells * np.array(chunks, dtype=np.int64), dims)     # each piece's cell, by the rule
    hi = np.minimum(lo + np.array(chunks, dtype=np.int64), dims)
    # n distinct ranks, each a distinct cell of a grid of n cells: every cell, once; so equal
    # regions mean the pieces are exactly the grid's.
    return grid if bool(np.array_equal(lo, offsets) and np.array_equal(hi - lo, sizes)) else None


def _uints(v: Any, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(type(x) is int and x >= 0 for x in v)
