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


Level = tuple[int, int]          # (cells, rank stride) of one digit of a dimension's cell index


@dataclass(frozen=True)
class PieceGrid:
    """Dimension ``d`` of a tensor of ``shape`` cut into ``counts[d]`` cells of ``chunks[d]``
    elements. Cell index ``i`` along ``d`` is a number in mixed radix whose digits are
    ``levels[d]`` (outermost first, each (cells, stride)); cell ``c`` is held by rank ``base + Σ
    digit·stride`` over every digit of every dimension. One level ``(k, s)`` is the plain rule
    ``i·s``; two are what FSDP over TP on the same dimension makes (``_StridedShard``: cells
    tp-major, ranks dp-major). A stride is 0 exactly where its level has one cell."""
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    levels: tuple[tuple[Level, ...], ...]
    base: int

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(math.prod(k for k, _ in lv) for lv in self.levels)

    def _axes(self) -> list[tuple[int, int, int, int]]:
        """(stride, cells, dimension, weight of the digit in the cell index) of every level, largest stride first."""
        out = []
        for d, lv in enumerate(self.levels):
            weight = 1
            for k, s in reversed(lv):
                out.append((s, k, d, weight))
                weight *= k
        return sorted(out, key=lambda a: -a[0])

    # ---- geometry ---------------------------------------------------------------------------

    def span(self, d: int, i: int) -> tuple[int, int]:
        """(offset, size) of cell ``i`` along dimension ``d``: torch.chunk's rule, clipped."""
        n, c = self.shape[d], self.chunks[d]
        lo = min(i * c, n)
        return lo, min(lo + c, n) - lo

    def rank_of(self, cell: Sequence[int]) -> int:
        rank = self.base
        for i, lv in zip(cell, self.levels, strict=True):
            for k, s in reversed(lv):
                i, digit = divmod(i, k)
                rank += digit * s
        return rank

    def region_of(self, cell: Sequence[int]) -> Region:
        spans = [self.span(d, i) for d, i in enumerate(cell)]
        return Region(tuple(o for o, _ in spans), tuple(s for _, s in spans))

    def cells(self) -> Iterator[tuple[int, ...]]:
        """Every cell, in increasing rank order (the order a built list has: records by rank)."""
        axes = self._axes()
        for digits in itertools.product(*(range(k) for _, k, _, _ in axes)):
            cell = [0] * len(self.shape)
            for digit, (_, _, d, weight) in zip(digits, axes, strict=True):
                cell[d] += digit * weight
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
        for s, k, d, weight in self._axes():
            if s:
                digit = min(rem // s, k - 1)
                rem -= digit * s
                cell[d] += digit * weight
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
        """A one-level dimension's count and stride are numbers, a several-level one's lists (outermost first)."""
        def one(i: int) -> list[Any]:
            return [lv[0][i] if len(lv) == 1 else [x[i] for x in lv] for lv in self.levels]
        return {"chunks": list(self.chunks), "counts": one(0), "base": self.base, "strides": one(1)}

    @staticmethod
    def decode(obj: dict[str, Any], shape: tuple[int, ...]) -> PieceGrid:
        """The grid of a ``to_json`` object, unchecked (our own output; ``from_json`` checks disk's)."""
        levels = tuple(tuple(zip(k, s, strict=True)) if isinstance(k, list) else ((k, s),)
                       for k, s in zip(obj["counts"], obj["strides"], strict=True))
        return PieceGrid(tuple(shape), tuple(obj["chunks"]), levels, obj["base"])

    @staticmethod
    def from_json(obj: Any, shape: tuple[int, ...], world_size: int, where: str) -> PieceGrid:
        """A grid read from disk, checked to tile ``shape`` with one distinct rank of
        ``world_size`` per cell (FormatError naming ``where`` otherwise)."""
        nd = len(shape)
        if not (isinstance(obj, dict) and _uints(obj.get("chunks"), nd) and type(obj.get("base")) is int
                and obj["base"] >= 0 and _levels(obj.get("counts"), obj.get("strides"), nd)):
            raise FormatError(f"{where}: malformed grid {str(obj)[:120]} (needs chunks, counts, strides "
                              f"of {nd} entries each and a base rank)")
        grid = PieceGrid.decode(obj, shape)
        if problem := grid.fault(world_size):
            raise FormatError(f"{where}: grid {obj}: {problem}")
        return grid

    def fault(self, world_size: int) -> str | None:
        """What keeps this grid from tiling its tensor with distinct ranks of ``world_size``."""
        for d, (n, c, k, lv) in enumerate(zip(self.shape, self.chunks, self.counts, self.levels, strict=True)):
            if not lv or k < 1 or c * k < n or (n and not c):
                return f"dimension {d}: {k} cells of {c} do not cover {n} elements"
            if any((kl > 1) != (sl > 0) for kl, sl in lv):
                return f"dimension {d}: a stride is needed exactly when there are several cells"
        span = 1            # strides sorted ascending must each clear the cells below: ranks are distinct
        for s, k, _, _ in reversed(self._axes()):
            if k > 1:
                if s < span:
                    return "two cells map to the same rank"
                span = s * k
        last = self.base + sum((k - 1) * s for s, k, _, _ in self._axes())
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
    rank order. Vectorised: at 32,768 ranks the commit fits every sharded tensor of the state. One
    stride per dimension is tried first; several levels (FSDP over TP) only when that fails."""
    grid = _fit(shape, ranks, offsets, sizes, nested=False)
    if grid is None and len(ranks) <= _SEQ_PIECES:
        grid = _fit(shape, ranks, offsets, sizes, nested=True)
    return grid


def _fit(shape: tuple[int, ...], ranks: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, *,
         nested: bool) -> PieceGrid | None:
    n, nd = len(ranks), len(shape)
    if n < 2 or nd == 0 or 0 in shape or offsets.shape != (n, nd) or sizes.shape != (n, nd) \
            or not bool(np.all(ranks[1:] > ranks[:-1])):
        return None
    at_zero = offsets == 0
    chunks = tuple(int(sizes[at_zero[:, d], d].max(initial=0)) for d in range(nd))
    if 0 in chunks:
        return None
    base = int(ranks[0])
    at = {tuple(int(x) for x in o): int(r) for o, r in zip(offsets, ranks, strict=True)} if nested else None
    levels: list[tuple[Level, ...]] = []
    for d, (size, c) in enumerate(zip(shape, chunks, strict=True)):
        empties = bool(np.any(sizes[:, d] == 0))
        if c >= size and not empties:
            levels.append(((1, 0),))            # not cut: every piece spans it whole
            continue
        origin = np.zeros(nd, dtype=np.int64)   # cell 1 along d: non-empty, or empty at the end
        origin[d] = min(c, size)
        hit = np.flatnonzero(np.all(offsets == origin, axis=1))
        if not len(hit) or int(ranks[hit[0]]) <= base:
            return None
        stride = int(ranks[hit[0]]) - base
        several = None if empties or at is None else _nested(at, d, nd, -(-size // c), c, base)
        levels.append(several or ((0, stride),))  # one level: its count is found below
    # one-level dimensions' counts: the highest digit any rank decomposes to, + 1
    counts = [1 if lv[0][0] else 0 for lv in levels]
    rem = ranks - base
    for d in sorted((d for d in range(nd) if levels[d][0][0] == 0), key=lambda d: -levels[d][0][1]):
        digit, rem = np.divmod(rem, levels[d][0][1])
        counts[d] = int(digit.max()) + 1
    rem = ranks - base
    grid = PieceGrid(tuple(shape), chunks, tuple(((counts[d], lv[0][1]),) if lv[0][0] == 0 else lv
                                                 for d, lv in enumerate(levels)), base)
    if len(grid) != n or grid.fault(int(ranks[-1]) + 1) is not None:
        return None
    cells = np.zeros((n, nd), dtype=np.int64)
    for s, k, d, weight in grid._axes():
        if s:
            digit = np.minimum(rem // s, k - 1)
            rem = rem - digit * s
            cells[:, d] += digit * weight
    if bool(np.any(rem)):
        return None
    dims = np.array(shape, dtype=np.int64)
    lo = np.minimum(cells * np.array(chunks, dtype=np.int64), dims)     # each piece's cell, by the rule
    hi = np.minimum(lo + np.array(chunks, dtype=np.int64), dims)
    # n distinct ranks, each a distinct cell of a grid of n cells: every cell, once; so equal
    # regions mean the pieces are exactly the grid's.
    return grid if bool(np.array_equal(lo, offsets) and np.array_equal(hi - lo, sizes)) else None


_SEQ_PIECES = 1 << 20       # pieces up to which a nested (several-level) rank map is looked for


def _nested(at: dict[tuple[int, ...], int], d: int, nd: int, count: int, chunk: int,
            base: int) -> tuple[Level, ...] | None:
    """Dimension ``d``'s levels from the ranks of its ``count`` cells (others at cell 0), innermost
    digit found first: the longest run of one stride, then runs of those runs. None when a cell is
    missing or the ranks follow no such rule; a single level is left to the caller (returns None)."""
    seq = []
    for i in range(count):
        key = tuple(i * chunk if e == d else 0 for e in range(nd))
        if key not in at:
            return None
        seq.append(at[key] - base)
    found: list[Level] = []
    period = 1
    while period < count:
        stride = seq[period]
        k = 1
        while period * (k + 1) <= count and seq[period * k] == k * stride:
            k += 1
        if k < 2 or count % (period * k) or stride <= 0:
            return None
        found.append((k, stride))
        period *= k
    return tuple(reversed(found)) if len(found) > 1 else None


def _levels(counts: Any, strides: Any, nd: int) -> bool:
    """``counts`` and ``strides`` of a grid from disk: per dimension a number each, or equal-length lists."""
    if not (isinstance(counts, list) and isinstance(strides, list) and len(counts) == len(strides) == nd):
        return False
    for k, s in zip(counts, strides, strict=True):
        if isinstance(k, list):
            if not (isinstance(s, list) and 0 < len(k) == len(s) <= 8 and _uints(k, len(k)) and _uints(s, len(s))):
                return False
        elif not (type(k) is int and type(s) is int and k >= 0 and s >= 0):
            return False
    return True


def _uints(v: Any, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(type(x) is int and x >= 0 for x in v)
