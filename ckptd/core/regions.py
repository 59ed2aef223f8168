"""Rectangular regions of a global tensor: the geometry of sharded saves and resharded restores.

A sharded tensor (a DTensor) is saved as pieces: each piece is the row-major bytes of one
rectangular region of the global tensor (``offsets`` + ``sizes`` per dimension). Restoring into
another layout means intersecting the regions a rank needs with the pieces that were saved, and
reading only the bytes of each piece that the intersection touches. Pure arithmetic, no I/O.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    """``sizes[d]`` elements of dimension ``d`` starting at ``offsets[d]``."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def whole(shape: Sequence[int]) -> Region:
        return Region(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    def within(self, shape: Sequence[int]) -> bool:
        """Inside a global tensor of ``shape`` (same rank, no negative or overhanging extent)."""
        return len(self.offsets) == len(self.sizes) == len(shape) and all(
            o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(self.offsets, self.sizes, shape, strict=True))

    def intersect(self, other: Region) -> Region | None:
        """The common region, or None when they share no element (empty regions share none)."""
        if self == other:          # a restore at the saved layout: every piece is the region it needs
            return self if all(self.sizes) else None
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            return None
        return Region(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))

    def relative_to(self, outer: Region) -> Region:
        """This region's position inside ``outer`` (which must contain it)."""
        return Region(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)), self.sizes)

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}


def row_span(piece: Region, part: Region, itemsize: int) -> tuple[int, int]:
    """The contiguous byte range ``[start, end)`` of ``piece``'s row-major bytes that holds every
    element of ``part`` (a sub-region of ``piece``): whole leading rows from the first to the last
    one ``part`` touches. Reading this range is what a chunk-granular reader must do; a slice along
    the first dimension costs its own bytes, a slice along a later one costs the rows it crosses."""
    if part.numel == 0:
        return 0, 0
    if part == piece:              # the whole piece (a restore at the saved layout)
        return 0, part.numel * itemsize
    rel = part.relative_to(piece)
    strides = _strides(piece.sizes, itemsize)
    first = sum(o * s for o, s in zip(rel.offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(rel.offsets, rel.sizes, strides, strict=True))
    return first, last + itemsize


def _strides(sizes: Sequence[int], itemsize: int) -> tuple[int, ...]:
    out = []
    acc = itemsize
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def coverage_faults(shape: Sequence[int], regions: Sequence[tuple[str, Region]]) -> list[str]:
    """What is wrong with ``regions`` as an exact tiling of a tensor of ``shape``: each out of
    bounds, each overlapping pair, and a gap (fewer elements covered than the tensor has).
    ``regions`` are (who holds it, region) so a fault can name the holder."""
    faults = [f"{who}: region {r.to_json()} is outside the global shape {list(shape)}"
              for who, r in regions if not r.within(shape)]
    if faults:
        return faults
    if not shape:                       # 0-d: one element, held by exactly one piece
        if len(regions) > 1:
            return [f"{' and '.join(who for who, _ in regions)} overlap: each holds the whole 0-d tensor"]
        return [] if regions else ["regions cover 0 of 1 elements: a piece is missing"]
    ordered = sorted(((r, who) for who, r in regions if r.numel), key=lambda x: x[0].offsets)
    for i, (a, who_a) in enumerate(ordered):      # sorted sweep: later regions start at or after a
        for b, who_b in ordered[i + 1:]:
            if b.offsets[0] >= a.ends[0]:
                break
            if a.intersect(b) is not None:
                faults.append(f"{who_a} and {who_b} overlap: {a.to_json()} and {b.to_json()}")
    covered = sum(r.numel for r, _ in ordered)
    if not faults and covered != math.prod(shape):
        faults.append(f"regions cover {covered} of {math.prod(shape)} elements: a piece is missing")
    return faults

