"""Checks of a format-2 step's global geometry, shared by ``verify_step``, restore and the tools.

Two halves, both pure (the caller reads the files):

- ``tiling_faults``: every sharded tensor's pieces are in bounds, pairwise disjoint and cover it
  exactly (``regions.coverage_faults``), with a gap located and the ranks that hold no piece named;
- ``MapCheck``: index.json's tensor map agrees with the rank manifests, fed one manifest at a time
  so a big world is checked without holding every manifest: every piece names an entry of that
  rank's manifest with the same dtype, global shape and region; every manifest entry is in the
  map (a piece under its tensor, a plain tensor among its ``held_by``); a local tensor marked
  ``same`` is held by every rank with identical chunk checksums (so are the copies of a piece
  held by several replicas). ``StepReader.manifest`` runs the
  per-rank half on every manifest it returns, so a restore never trusts a map its manifest denies.

Every fault names the tensor, and the rank when one rank's files are concerned.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .global_index import SHARDED, GlobalTensor, Piece, fingerprint
from .regions import Region, coverage_faults
from .schema import Manifest, TensorEntry

MAX_GAP_CELLS = 1 << 20       # locating a gap cuts the tensor at every piece boundary: bounded work


@dataclass(frozen=True)
class MapFault:
    tensor: str | None
    rank: int | None      # whose manifest the fault is about; None: index.json itself
    reason: str


def dim_name(d: int, ndim: int) -> str:
    if ndim == 1:
        return "elements"
    return ("rows", "cols")[d] if d < 2 else f"dim {d}"


def region_text(region: Region, shape: Sequence[int]) -> str:
    """``rows 0:2752 of 11008`` (only the dimensions the region does not span whole); ``whole``."""
    parts = [f"{dim_name(d, len(shape))} {o}:{o + s} of {n}"
             for d, (o, s, n) in enumerate(zip(region.offsets, region.sizes, shape, strict=False)) if (o, s) != (0, n)]
    if len(region.sizes) != len(shape):
        return f"offsets {list(region.offsets)} sizes {list(region.sizes)} (global shape {list(shape)})"
    return ", ".join(parts) or "whole"


def region_phrase(region: Region, shape: Sequence[int]) -> str:
    """``region_text`` in a sentence: ``the whole tensor`` rather than ``whole``."""
    text = region_text(region, shape)
    return "the whole tensor" if text == "whole" else text


def piece_label(tensor: str, p: Piece) -> str:
    return f"rank {p.rank}" + (f" (entry {p.name!r})" if p.name != tensor else "")


def uncovered_block(shape: Sequence[int], regions: Sequence[Region]) -> Region | None:
    """A block of elements no region covers (regions in bounds and disjoint), grown from the first
    uncovered cell of the grid cut at every region boundary; None when all is covered or the grid
    would exceed MAX_GAP_CELLS."""
    cuts = [sorted({0, n, *(x for r in regions for x in (r.offsets[d], r.ends[d]))}) for d, n in enumerate(shape)]
    grid = tuple(len(c) - 1 for c in cuts)
    if math.prod(grid) > MAX_GAP_CELLS or math.prod(shape) == 0:
        return None
    covered = np.zeros(grid, dtype=bool)
    for r in regions:
        covered[tuple(slice(bisect.bisect_left(c, o), bisect.bisect_left(c, e))
                      for c, o, e in zip(cuts, r.offsets, r.ends, strict=True))] = True
    free = np.argwhere(~covered)
    if not len(free):
        return None
    lo = [int(i) for i in free[0]]
    hi = [i + 1 for i in lo]
    for d in reversed(range(len(grid))):         # grow along the last dimensions first
        while hi[d] < grid[d]:
            slab = tuple(slice(lo[k], hi[k]) if k != d else slice(hi[d], hi[d] + 1) for k in range(len(grid)))
            if covered[slab].any():
                break
            hi[d] += 1
    return Region(tuple(c[i] for c, i in zip(cuts, lo, strict=True)),
                  tuple(c[j] - c[i] for c, i, j in zip(cuts, lo, hi, strict=True)))


def tiling_faults(t: GlobalTensor, world_size: int) -> list[str]:
    """What keeps a sharded tensor's pieces from tiling it exactly (empty for a local tensor)."""
    if t.kind != SHARDED or t.grid is not None:     # a grid read from disk was checked to tile it
        return []
    if len(t.pieces) == 1 and t.pieces[0].region.sizes == t.shape and not any(t.pieces[0].region.offsets):
        return []           # one piece that is the whole tensor (a one-rank mesh): nothing to sweep
    # The same region saved by several replicas (data-parallel copies a rank cannot tell from others
    # without asking them) is one piece held several times: readers read it once, and MapCheck
    # requires the copies to be byte-identical. Distinct regions must tile the tensor.
    holders: dict[Region, list[str]] = {}
    for p in t.pieces:
        holders.setdefault(p.region, []).append(piece_label(t.name, p))
    faults = coverage_faults(t.shape, [(who[0], r) for r, who in holders.items()])
    if faults and faults[-1].endswith("a piece is missing"):
        gap = uncovered_block(t.shape, [p.region for p in t.pieces])
        idle = sorted(set(range(world_size)) - {p.rank for p in t.pieces})
        faults[-1] = (f"{faults[-1]}" + (f"; no piece holds {region_phrase(gap, t.shape)}" if gap else "")
                      + (f"; no piece from rank{'s' if len(idle) > 1 else ''} {_ranks(idle)}" if idle else ""))
    return faults


def geometry_faults(tensors: dict[str, GlobalTensor], world_size: int) -> list[str]:
    """``tiling_faults`` of every tensor of a map, each naming its tensor (commit, inspect, verify)."""
    return [f"tensor {name!r}: {f}" for name, t in sorted(tensors.items()) for f in tiling_faults(t, world_size)]


def _ranks(ranks: Sequence[int], limit: int = 16) -> str:
    text = ", ".join(map(str, ranks[:limit]))
    return text + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


class MapCheck:
    """index.json's tensor map against the manifests. ``map_faults()``: the map on its own (tiling, an
    entry listed twice, ``same`` on fewer than every rank); ``rank_faults(m)``: one rank's manifest
    against the map, both ways (what a reader of that rank checks); ``rank(m)``: that, plus the copies
    that must be byte-identical (a ``same`` tensor's, a piece written twice) compared with those of the
    ranks fed before (what verify does, one rank at a time)."""

    def __init__(self, tensors: dict[str, GlobalTensor], world_size: int) -> None:
        self.tensors, self.world_size = tensors, world_size
        self._by_rank: dict[int, dict[str, tuple[GlobalTensor, Piece]]] = {}
        self._twice: list[MapFault] = []
        # Copies that must be byte-identical (a `same` tensor's, a piece written twice): the first fed.
        self._copies: dict[tuple[str, Region], tuple[int, tuple[Any, ...]]] = {}
        self._written: dict[tuple[str, Region], int] = {}
        # Grids and holders read from an index are asked per rank (O(1) each), never enumerated.
        self._lazy = [t for t in tensors.values() if t.grid is not None or t.holders is not None]
        for t in tensors.values():
            for p in t.listed:
                if t.kind == SHARDED:
                    self._written[(t.name, p.region)] = self._written.get((t.name, p.region), 0) + 1
                held = self._by_rank.setdefault(p.rank, {})
                if p.name in held:
                    self._twice.append(MapFault(t.name, p.rank, f"rank {p.rank}'s entry {p.name!r} is listed twice "
                                                                f"in the index (also under {held[p.name][0].name!r})"))
                else:
                    held[p.name] = (t, p)

    def map_faults(self) -> list[MapFault]:
        out = list(self._twice)
        for t in self.tensors.values():
            out += [MapFault(t.name, None, f) for f in tiling_faults(t, self.world_size)]
            if t.kind != SHARDED and t.same and len(t.holder_ranks()) != self.world_size:
                out.append(MapFault(t.name, None, f"marked same on every rank but held by "
                                                  f"{len(t.holder_ranks())} of {self.world_size} ranks"))
        return out

    def rank_faults(self, m: Manifest) -> list[MapFault]:
        out = []
        if m.world_size != self.world_size:
            out.append(MapFault(None, m.rank, f"rank {m.rank}'s manifest says world size {m.world_size}, "
                                              f"the index {self.world_size}"))
        expected = self._expected(m.rank, out)
        matched = 0
        for e in m.tensors:
            found = expected.get(e.name)
            matched += found is not None
            if found is None:
                what = (f"rank {m.rank}'s piece {e.name!r} ({region_text(e.region(), e.global_shape or ())})"
                        if e.placement else f"rank {m.rank}'s copy")
                out.append(MapFault(e.key, m.rank, f"{what} is not in the index's tensor map"))
            elif problem := self._mismatch(*found, e):
                out.append(MapFault(found[0].name, m.rank, f"rank {m.rank}'s entry {e.name!r} {problem}"))
        if matched < len(expected):          # some piece or copy the map lists is not in this manifest
            names = m.by_name()
            for name, (t, p) in expected.items():
                if name not in names:
                    what = (f"a piece from rank {m.rank} (entry {name!r}, {region_text(p.region, t.shape)})"
                            if t.kind == SHARDED else f"a copy on rank {m.rank}")
                    out.append(MapFault(t.name, m.rank, f"the index lists {what} that rank {m.rank}'s "
                                                        f"manifest does not have"))
        return out

    def _expected(self, rank: int, faults: list[MapFault]) -> dict[str, tuple[GlobalTensor, Piece]]:
        """Entry name → (tensor, piece) of what the map says ``rank`` saved; a name listed twice
        goes to ``faults`` (the listed tensors' were found up front)."""
        held = self._by_rank.get(rank, {})
        if not self._lazy:
            return held
        held = dict(held)
        for t in self._lazy:
            for p in t.held_by(rank):
                if p.name in held:
                    faults.append(MapFault(t.name, rank, f"rank {rank}'s entry {p.name!r} is listed twice in the "
                                                         f"index (also under {held[p.name][0].name!r})"))
                else:
                    held[p.name] = (t, p)
        return held

    def rank(self, m: Manifest) -> list[MapFault]:
        out = self.rank_faults(m)
        expected = self._expected(m.rank, [])
        for e in m.tensors:
            found = expected.get(e.name)
            if not found or self._mismatch(*found, e):
                continue
            t, p = found
            if t.kind == SHARDED and self._written.get((t.name, p.region), 1) > 1:    # a grid's: once each
                what = f"copy of {region_phrase(p.region, t.shape)}"
            elif t.kind != SHARDED and t.same:
                what = "copy (marked same on every rank)"
            else:
                continue
            first = self._copies.setdefault((t.name, p.region), (m.rank, fingerprint(e)))
            if first[1] != fingerprint(e):
                out.append(MapFault(t.name, m.rank, f"rank {m.rank}'s {what} differs from rank {first[0]}'s"))
        return out

    @staticmethod
    def _mismatch(t: GlobalTensor, p: Piece, e: TensorEntry) -> str | None:
        saved = f"{e.dtype} {list(e.global_shape or e.shape)}"
        if t.kind == SHARDED:
            if e.placement is None:
                return f"is a plain tensor, the index lists it as a piece of {t.name!r}"
            if e.key != t.name:
                return f"is a piece of {e.key!r}, the index lists it under {t.name!r}"
            if (e.dtype, e.global_shape) != (t.dtype, t.shape):
                return f"is a piece of a {saved} tensor, the index says {t.dtype} {list(t.shape)}"
            region = e.region()
            if region != p.region:
                return (f"holds {region_text(region, t.shape)}, the index says "
                        f"{region_text(p.region, t.shape)}")
            return None
        if e.placement is not None:
            return f"is a piece of a sharded tensor, the index lists {t.name!r} as a plain tensor"
        dtype, shape = t.copy_of(p)        # a rank's copy may have its own dtype and shape
        if (e.dtype, tuple(e.shape)) != (dtype, shape):
            return f"is {saved}, the index says {dtype} {list(shape)}"
        return None
