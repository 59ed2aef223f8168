"""A sharded tensor's pieces as a rule, not a list: O(1) index bytes per tensor, not O(ranks).

FSDP2, tensor parallelism and 2-D meshes cut every dimension of a tensor the way ``torch.chunk``
(DTensor's ``Shard``) does: ``count`` cells of ``chunk`` elements, each cell's offset clipped to
the dimension, so trailing cells may be empty. The rank holding cell ``(i0, i1, …)`` is
``base + Σ i_d·stride_d``. A step whose pieces follow that rule stores the rule (index.json's
``grid``, FORMAT.md) instead of one record per piece — at 32,768 ranks a 4 MB piece list per
tensor becomes ~100 bytes — and a reader finds the pieces a region needs by arithmetic
(:meth:`PieceGrid.overlapping`) instead of scanning every rank's.

:func:`fit` finds the rule for a piece list — one cut per dimension, or two on one dimension
(FSDP over TP) — or None (replicas and hand-made layouts keep their list).
:meth:`PieceGrid.from_json` validates one read from disk so that what it describes always tiles
the tensor exactly, each cell held by one distinct rank of the world.
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


Level = tuple[int, int, int]     # (cells, rank stride, chunk) of one cut of a dimension


@dataclass(frozen=True)
class PieceGrid:
    """Dimension ``d`` of a tensor of ``shape`` is cut by ``levels[d]``, outermost first: each level
    cuts every part the level above made into ``cells`` parts of ``chunk`` elements (torch.chunk's
    rule, clipped, so trailing parts may be empty). A cell's index along ``d`` is the mixed-radix
    number of its digits; cell ``c`` is held by rank ``base + Σ digit·stride`` over every digit of
    every dimension. One level is DTensor's ``Shard``; two are FSDP over TP on one dimension
    (``_StridedShard``: TP's parts, then FSDP's chunks of each). A stride is 0 exactly where its
    level has one cell."""
    shape: tuple[int, ...]
    levels: tuple[tuple[Level, ...], ...]
    base: int

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(math.prod(k for k, _, _ in lv) for lv in self.levels)

    def _axes(self) -> list[tuple[int, int, int, int]]:
        """(stride, cells, dimension, weight of the digit in the cell index) of every level, largest stride first."""
        out = []
        for d, lv in enumerate(self.levels):
            weight = 1
            for k, s, _ in reversed(lv):
                out.append((s, k, d, weight))
                weight *= k
        return sorted(out, key=lambda a: -a[0])

    # ---- geometry ---------------------------------------------------------------------------

    def span(self, d: int, i: int) -> tuple[int, int]:
        """(offset, size) of cell ``i`` along dimension ``d``: each level's chunk of its parent part."""
        lo, size, weight = 0, self.shape[d], self.counts[d]
        for k, _, c in self.levels[d]:
            weight //= k
            digit, i = divmod(i, weight)
            sub = min(digit * c, size)
            lo, size = lo + sub, min(c, size - sub)
        return lo, size

    def rank_of(self, cell: Sequence[int]) -> int:
        rank = self.base
        for i, lv in zip(cell, self.levels, strict=True):
            for k, s, _ in reversed(lv):
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
        """(rank, region) of every non-empty cell sharing an element with ``region``: O(cells returned)."""
        if len(region.sizes) != len(self.shape) or any(s <= 0 for s in region.sizes):
            return []
        hits = [self._hits(d, o, o + s) for d, (o, s) in enumerate(zip(region.offsets, region.sizes, strict=True))]
        return [(self.rank_of(cell), self.region_of(cell)) for cell in itertools.product(*hits)]

    def _hits(self, d: int, start: int, end: int) -> list[int]:
        """Indices of the non-empty cells along ``d`` that overlap ``[start, end)``, level by level."""
        out: list[int] = []
        levels = self.levels[d]

        def walk(level: int, lo: int, size: int, index: int) -> None:
            if level == len(levels):
                out.append(index)
                return
            k, _, c = levels[level]
            if not c or start >= lo + size or end <= lo:
                return
            first, last = max(0, (start - lo) // c), min(k - 1, (min(end, lo + size) - 1 - lo) // c)
            for j in range(first, last + 1):
                if j * c < size:
                    walk(level + 1, lo + j * c, min(c, size - j * c), index * k + j)
        walk(0, 0, self.shape[d], 0)
        return out

    # ---- index.json ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """A one-level dimension's chunk, count and stride are numbers, a several-level one's lists
        (outermost first)."""
        def one(i: int) -> list[Any]:
            return [lv[0][i] if len(lv) == 1 else [x[i] for x in lv] for lv in self.levels]
        return {"chunks": one(2), "counts": one(0), "base": self.base, "strides": one(1)}

    @staticmethod
    def decode(obj: dict[str, Any], shape: tuple[int, ...]) -> PieceGrid:
        """The grid of a ``to_json`` object, unchecked (our own output; ``from_json`` checks disk's)."""
        levels = tuple(tuple(zip(k, s, c, strict=True)) if isinstance(k, list) else ((k, s, c),)
                       for k, s, c in zip(obj["counts"], obj["strides"], obj["chunks"], strict=True))
        return PieceGrid(tuple(shape), levels, obj["base"])

    @staticmethod
    def from_json(obj: Any, shape: tuple[int, ...], world_size: int, where: str) -> PieceGrid:
        """A grid read from disk, checked to tile ``shape`` with one distinct rank of
        ``world_size`` per cell (FormatError naming ``where`` otherwise)."""
        nd = len(shape)
        if not (isinstance(obj, dict) and type(obj.get("base")) is int and obj["base"] >= 0
                and _levels((obj.get("counts"), obj.get("strides"), obj.get("chunks")), nd)):
            raise FormatError(f"{where}: malformed grid {str(obj)[:120]} (needs chunks, counts, strides "
                              f"of {nd} entries each and a base rank)")
        grid = PieceGrid.decode(obj, shape)
        if problem := grid.fault(world_size):
            raise FormatError(f"{where}: grid {obj}: {problem}")
        return grid

    def fault(self, world_size: int) -> str | None:
        """What keeps this grid from tiling its tensor with distinct ranks of ``world_size``."""
        for d, (n, lv) in enumerate(zip(self.shape, self.levels, strict=True)):
            if not lv:
                return f"dimension {d}: no cut"
            part = n
            for k, s, c in lv:
                if k < 1 or c * k < part or (part and not c):
                    return f"dimension {d}: {k} cells of {c} do not cover {part} elements"
                if (k > 1) != (s > 0):
                    return f"dimension {d}: a stride is needed exactly when there are several cells"
                part = min(c, part)
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
    cut per dimension is tried first; two (FSDP over TP) only when that fails, a few candidates."""
    n, nd = len(ranks), len(shape)
    if n < 2 or nd == 0 or 0 in shape or offsets.shape != (n, nd) or sizes.shape != (n, nd) \
            or not bool(np.all(ranks[1:] > ranks[:-1])):
        return None
    chunks = [int(sizes[offsets[:, d] == 0, d].max(initial=0)) for d in range(nd)]
    if 0 in chunks:
        return None
    base = int(ranks[0])
    levels: list[tuple[Level, ...]] = []
    for d, (size, c) in enumerate(zip(shape, chunks, strict=True)):
        if c >= size and not bool(np.any(sizes[:, d] == 0)):
            levels.append(((1, 0, size),))      # not cut: every piece spans it whole
            continue
        origin = np.zeros(nd, dtype=np.int64)   # cell 1 along d: non-empty, or empty at the end
        origin[d] = min(c, size)
        hit = np.flatnonzero(np.all(offsets == origin, axis=1))
        stride = int(ranks[hit[0]]) - base if len(hit) else 0
        levels.append(((0, stride, c),))        # its count is found below
    rem = ranks - base                          # counts: the highest digit any rank decomposes to, + 1
    cut = [d for d in range(nd) if levels[d][0][0] == 0]
    if all(levels[d][0][1] > 0 for d in cut):
        for d in sorted(cut, key=lambda d: -levels[d][0][1]):
            digit, rem = np.divmod(rem, levels[d][0][1])
            levels[d] = ((int(digit.max()) + 1, levels[d][0][1], levels[d][0][2]),)
        grid = PieceGrid(tuple(shape), tuple(levels), base)
        if _fits(grid, ranks, offsets, sizes):
            return grid
    if _repeats(offsets, sizes):
        return None                             # replicas (a region saved by several ranks): never a grid
    for d in cut:                               # one dimension cut twice: TP's parts, FSDP's chunks of each
        for nested in _two_level_candidates(shape[d], d, ranks, offsets, sizes, base):
            others = [lv if e != d else nested for e, lv in enumerate(levels)]
            if any(lv[0][0] == 0 for lv in others):
                continue                        # another dimension's count unknown: not tried
            grid = PieceGrid(tuple(shape), tuple(others), base)
            if _fits(grid, ranks, offsets, sizes):
                return grid
    return None


def _repeats(offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether two non-empty pieces have the same region (checked before the two-level search, whose
    candidates a replicated tensor would otherwise all be tried against)."""
    rows = np.concatenate([offsets, sizes], axis=1)[np.all(sizes > 0, axis=1)]
    return len(np.unique(rows, axis=0)) < len(rows)


def _two_level_candidates(n: int, d: int, ranks: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                          base: int) -> Iterator[tuple[Level, ...]]:
    """(outer, inner) cuts of dimension ``d`` to try: ``K`` pieces along it (the others at their
    first cell) as ``k_out`` parts of ``k_in`` chunks, the outer digit running fastest in rank
    order (FSDP over TP: TP's part is the fast mesh coordinate) or the inner one."""
    along = np.all(np.delete(offsets, d, axis=1) == 0, axis=1)
    steps = ranks[along] - base
    count = len(steps)
    if count < 4 or steps[0] != 0:
        return
    unit = int(steps[1])
    for k_out in range(2, count // 2 + 1):
        if count % k_out:
            continue
        k_in = count // k_out
        c_out = -(-n // k_out)
        c_in = -(-c_out // k_in)
        yield ((k_out, unit, c_out), (k_in, unit * k_out, c_in))
        yield ((k_out, unit * k_in, c_out), (k_in, unit, c_in))


def _fits(grid: PieceGrid, ranks: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """Whether the pieces are exactly the grid's cells: every rank decomposes to a cell whose
    region, by the levels' rule, is the piece's (n distinct ranks, n cells: each cell once)."""
    if len(grid) != len(ranks) or grid.fault(int(ranks[-1]) + 1) is not None:
        return False
    rem = ranks - grid.base
    cells = np.zeros((len(ranks), len(grid.shape)), dtype=np.int64)
    for s, k, d, weight in grid._axes():
        if s:
            digit = np.minimum(rem // s, k - 1)
            rem = rem - digit * s
            cells[:, d] += digit * weight
    if bool(np.any(rem)):
        return False
    for d, (n, lv) in enumerate(zip(grid.shape, grid.levels, strict=True)):
        lo, size = np.zeros(len(ranks), dtype=np.int64), np.full(len(ranks), n, dtype=np.int64)
        index, weight = cells[:, d], grid.counts[d]
        for k, _, c in lv:
            weight //= k
            digit, index = np.divmod(index, weight)
            sub = np.minimum(digit * c, size)
            lo, size = lo + sub, np.minimum(c, size - sub)
        if not (np.array_equal(lo, offsets[:, d]) and np.array_equal(size, sizes[:, d])):
            return False
    return True


def _levels(triple: tuple[Any, Any, Any], nd: int) -> bool:
    """``counts``, ``strides`` and ``chunks`` of a grid from disk: per dimension a number each, or
    equal-length lists (at most 8 levels)."""
    if not all(isinstance(x, list) and len(x) == nd for x in triple):
        return False
    for k, s, c in zip(*triple, strict=True):
        if isinstance(k, list):
            if not (0 < len(k) <= 8 and all(_uints(x, len(k)) for x in (k, s, c))):
                return False
        elif not all(type(x) is int and x >= 0 for x in (k, s, c)):
            return False
    return True


def _uints(v: Any, n: int) -> bool:
    return isinstance(v, list) and len(v) == n and all(type(x) is int and x >= 0 for x in v)
