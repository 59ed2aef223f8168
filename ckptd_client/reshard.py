"""Reading regions of global tensors from a committed step: what a restore and a lazy load do.

A :class:`Need` is a rectangular region of one checkpoint tensor (index.json's tensor map names
it) and the CPU tensor it goes into. :func:`read_needs` intersects each need with the pieces of
its tensor and, for every non-empty intersection, reads that piece's rank manifest (once per
load, digest-checked by ``StepReader``) and only the chunks of the piece's entry covering the
bytes the intersection touches (``regions.row_span``: a slice along the first dimension costs
its own bytes, a slice along a later one every row it crosses). Chunks are read, checksum-verified
and decoded in parallel on the restore threads (``restore_threads``: none of them writes into the
destination once the read has raised, a KeyboardInterrupt included).

Where the intersection is contiguous both in the piece and in the destination (a rank reading
its own shard back, a ``Shard(0)`` tensor split at another world size, a whole plain tensor)
chunks decode straight into the destination; only a chunk straddling the intersection's ends
goes through a small buffer. Otherwise (``Shard(0)`` → ``Shard(1)``, a column slice) the chunks
decode into a staging buffer, bounded in total, and one strided copy moves the intersection.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.core.codec import ChunkMeta
from ckptd.core.global_index import LOCAL, GlobalTensor, Piece
from ckptd.core.names import rank_manifest_name
from ckptd.core.regions import Region, row_span
from ckptd.core.schema import DTYPE_ITEMSIZE, TensorEntry

from .errors import CheckpointError
from .load_files import StepFiles
from .restore_threads import RestoreThreads

STAGING_BYTES = 256 * 1024 * 1024       # decoded bytes waiting for a strided copy, at most (one read may exceed it)
BATCH = 4 << 20                         # small whole chunks read in one restore task, about this many bytes

DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                                  if isinstance(d, torch.dtype)}


@dataclass
class Need:
    """``region`` (of the global tensor) of checkpoint tensor ``name``, to be written into ``out``: a
    contiguous CPU tensor of ``region.sizes`` and the checkpoint's dtype. ``source``: for a plain
    (``local``) tensor, the saved rank whose copy to read."""
    name: str
    region: Region
    out: torch.Tensor
    source: int | None = None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (any dtype, 0-d and empty included)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def decodable_into(t: Any, dtype: str, shape: Sequence[int]) -> bool:
    """Whether chunks of a ``dtype`` tensor of ``shape`` can be decoded straight into ``t``'s memory."""
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == DTYPES.get(dtype)
            and tuple(t.shape) == tuple(shape) and t.is_contiguous() and not t.is_conj() and not t.is_neg())


@dataclass
class _Read:
    """Copy ``part`` (global coordinates) of the piece held by ``entry`` of rank ``rank`` into ``need``."""
    rank: int
    entry: TensorEntry
    piece: Region
    part: Region
    need: Need


def _distinct(pieces: Sequence[Piece], prefer: int | None) -> list[Piece]:
    """One piece per region: replicas that each saved the same region (a DTensor replicated over a
    mesh dimension its own mesh does not have) are read once, from ``prefer``'s files if it holds one."""
    by_region: dict[Region, Piece] = {}
    for p in pieces:
        if p.region not in by_region or p.rank == prefer:
            by_region[p.region] = p
    return list(by_region.values())


def plan(files: StepFiles, tensors: dict[str, GlobalTensor], needs: Sequence[Need],
         prefer: int | None = None) -> list[_Read]:
    """Every (piece, intersection) the needs require; reads the manifests of the pieces involved
    (and no other). CheckpointError naming the tensor when the pieces do not cover a need.
    ``prefer``: the rank whose files to read where several ranks saved the same region."""
    chosen = [_pieces_for(files, tensors, need, prefer) for need in needs]
    files.prefetch(sorted({p.rank for _, pieces in chosen for p in pieces}))
    reads: list[_Read] = []
    for need, (t, pieces) in zip(needs, chosen, strict=True):
        covered, first = 0, len(reads)
        for p in pieces:
            entry = files.entry(p.rank, p.name, need.name)
            region = p.region          # a local copy's region is its own whole shape
            dtype = t.copy_of(p)[0]
            if entry.dtype != dtype or entry.region() != region:
                raise CheckpointError(f"{_where(files, need, p)} holds {entry.dtype} {entry.region().to_json()}, "
                                      f"the index says {dtype} {region.to_json()}")
            if len(region.sizes) != len(need.region.sizes):
                raise CheckpointError(f"{_where(files, need, p)} has {len(region.sizes)} dimensions, "
                                      f"{len(need.region.sizes)} are needed")
            part = region.intersect(need.region)
            if part is None:
                continue
            covered += part.numel
            reads.append(_Read(p.rank, entry, region, part, need))
            if files.stats is not None:
                files.stats.entries.add((p.rank, p.name))
        if covered == need.region.numel and len(reads) - first > 1 and _overlap(reads[first:]):
            # overlapping pieces and a gap as large: the count alone hides both (an edited index)
            raise CheckpointError(f"tensor {need.name!r}: the saved pieces overlap and leave a gap in the "
                                  f"{need.region.numel} elements needed ({need.region.to_json()}) in {files.path}")
        if covered != need.region.numel:
            what = "overlap" if covered > need.region.numel else "leave a gap"
            raise CheckpointError(f"tensor {need.name!r}: the saved pieces {what}, covering {covered} of the "
                                  f"{need.region.numel} elements needed ({need.region.to_json()}) in {files.path}")
    return reads


def _overlap(reads: Sequence[_Read]) -> bool:
    """Whether any two of these intersections (one need's) overlap: a sorted sweep, so pieces that
    tile a need cost one comparison each."""
    parts = sorted((r.part for r in reads if r.part.numel), key=lambda r: r.offsets)
    for i, a in enumerate(parts):
        for b in parts[i + 1:]:
            if b.offsets[0] >= a.ends[0]:
                break
            if a.intersect(b) is not None:
                return True
    return False


def _where(files: StepFiles, need: Need, p: Piece) -> str:
    """A piece's entry, named for an error (built only then: a plan meets 16,384 pieces at 8,192 tensors)."""
    return f"tensor {need.name!r}: entry {p.name!r} of {os.path.join(files.path, rank_manifest_name(p.rank))}"


def _pieces_for(files: StepFiles, tensors: dict[str, GlobalTensor], need: Need,
                prefer: int | None) -> tuple[GlobalTensor, list[Piece]]:
    """(The tensor, the pieces to read) for ``need``: its source rank's copy of a local tensor, or the
    pieces overlapping its region of a sharded one (the one exact piece at the same layout)."""
    if (t := tensors.get(need.name)) is None:
        raise CheckpointError(f"tensor {need.name!r} is not in checkpoint step {files.step} ({files.path})")
    if t.kind == LOCAL:
        pieces = t.held_by(need.source) if need.source is not None else []
        if not pieces:
            raise CheckpointError(f"tensor {need.name!r}: saved rank {need.source} holds no copy of it "
                                  f"(held by ranks {list(t.holder_ranks())}) in {files.path}")
        return t, pieces
    if len(t.shape) != len(need.region.sizes):
        raise CheckpointError(f"tensor {need.name!r} has {len(t.shape)} dimensions in {files.path}, "
                              f"{len(need.region.sizes)} are needed")
    pieces = _distinct(t.overlapping(need.region), prefer)    # a grid's by arithmetic, not a scan
    exact = [p for p in pieces if p.region == need.region]    # the same layout: one piece, no intersecting
    return t, exact or pieces


def strides(sizes: Sequence[int], itemsize: int) -> tuple[int, ...]:
    out, acc = [], itemsize
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def contiguous_in(part: Region, outer: Region) -> bool:
    """Whether ``part``'s elements are one contiguous run of ``outer``'s row-major bytes: every
    dimension before the last one ``part`` does not span whole has size 1."""
    partial = [d for d, (a, b) in enumerate(zip(part.sizes, outer.sizes, strict=True)) if a != b]
    return not partial or all(part.sizes[d] == 1 for d in range(partial[-1]))


def _offset(part: Region, outer: Region, itemsize: int) -> int:
    """Byte offset of ``part``'s first element in ``outer``'s row-major bytes."""
    rel = part.relative_to(outer)
    return sum(o * s for o, s in zip(rel.offsets, strides(outer.sizes, itemsize), strict=True))


class _Job:
    """One read's chunks in flight: the last one to finish runs ``finish`` (the strided copy)."""

    def __init__(self, remaining: int, staged: int, finish: Callable[[], None] | None) -> None:
        self.remaining = remaining
        self.staged = staged
        self.finish = finish
        self.ok = True


class _Runner:
    """Decodes chunks on a pool, keeping staged bytes under a budget."""

    def __init__(self, files: StepFiles, threads: int, budget: int) -> None:
        self.files = files
        self.budget = budget
        self.pool = RestoreThreads(threads, "ckptd-restore")     # one thread: each read runs as it is submitted
        self.cond = threading.Condition()
        self.staged = 0
        self.error: BaseException | None = None
        self._batch: list[tuple[Any, ...]] = []     # small whole chunks gathered for one task (_add)
        self._batched = 0                            # their raw bytes

    def run(self, reads: Sequence[_Read]) -> None:
        # Each destination's bytes, once per need (not per read), before any decoding thread runs.
        self.flat: dict[int, tuple[torch.Tensor, memoryview]] = {}
        for r in reads:
            if id(r.need) not in self.flat:
                u8 = r.need.out.detach().reshape(-1).view(torch.uint8)
                self.flat[id(r.need)] = u8, memoryview(u8.numpy())  # type: ignore[arg-type]
        with self.pool:          # raising (a KeyboardInterrupt too): the chunks stop, none written after
            for r in reads:
                if self.error is not None:
                    break
                self._submit(r)
            self._flush()
        if self.error is not None:
            raise self.error

    def _submit(self, r: _Read) -> None:
        itemsize = DTYPE_ITEMSIZE[r.entry.dtype]
        a, b = row_span(r.piece, r.part, itemsize)
        spans = [(fp, rp, m) for fp, rp, m in r.entry.chunk_spans() if rp < b and rp + m.raw_len > a]
        dst_u8, out = self.flat[id(r.need)]
        o = _offset(r.part, r.need.region, itemsize)
        if contiguous_in(r.part, r.piece) and contiguous_in(r.part, r.need.region):
            job = _Job(len(spans), 0, None)
            for fp, rp, m in spans:
                lo, hi = max(a, rp), min(b, rp + m.raw_len)
                if (lo, hi) == (rp, rp + m.raw_len):          # the whole chunk is wanted: decode in place
                    self._add(job, r, fp, m, out[o + rp - a: o + rp - a + m.raw_len])
                else:                                          # a chunk straddling an end: via a buffer
                    self.pool.submit(self._chunk, job, r, fp, m, None, (out[o + lo - a: o + hi - a], lo - rp))
            return
        lo, hi = spans[0][1], spans[-1][1] + spans[-1][2].raw_len
        with self.cond:
            while self.staged and self.staged + (hi - lo) > self.budget and self.error is None:
                self.cond.wait()
            self.staged += hi - lo
        staging = torch.empty(hi - lo, dtype=torch.uint8)
        view = tensor_bytes(staging)

        def copy() -> None:
            size = (*r.part.sizes, itemsize)
            src = staging.as_strided(size, (*strides(r.piece.sizes, itemsize), 1), staging.storage_offset() + a - lo)
            dst = dst_u8.as_strided(size, (*strides(r.need.region.sizes, itemsize), 1), dst_u8.storage_offset() + o)
            dst.copy_(src)

        job = _Job(len(spans), hi - lo, copy)
        for fp, rp, m in spans:
            self.pool.submit(self._chunk, job, r, fp, m, view[rp - lo: rp - lo + m.raw_len], None)

    def _add(self, job: _Job, r: _Read, fp: int, m: ChunkMeta, dst: memoryview) -> None:
        """A whole chunk decoded in place: small ones gathered into one task of about ``BATCH`` bytes
        (a task costs ~15 µs to hand to the pool: a state of thousands of small tensors paid more for
        its tasks than for its bytes)."""
        if m.raw_len >= BATCH:
            self.pool.submit(self._chunk, job, r, fp, m, dst, None)
            return
        self._batch.append((job, r, fp, m, dst, None))
        self._batched += m.raw_len
        if self._batched >= BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            self.pool.submit(self._chunks, self._batch)
            self._batch, self._batched = [], 0

    def _chunks(self, batch: list[tuple[Any, ...]]) -> None:
        for args in batch:
            self._chunk(*args)

    def _chunk(self, job: _Job, r: _Read, file_pos: int, meta: ChunkMeta, dst: memoryview | None,
               partial: tuple[memoryview, int] | None) -> None:
        try:
            if self.error is None and not self.pool.stopping:
                if dst is not None:
                    self.files.read_chunk(r.rank, r.entry, file_pos, meta, dst)
                elif partial is not None:
                    buf = bytearray(meta.raw_len)
                    self.files.read_chunk(r.rank, r.entry, file_pos, meta, memoryview(buf))
                    target, start = partial
                    target[:] = buf[start: start + len(target)]
        except BaseException as e:
            job.ok = False
            with self.cond:
                if self.error is None:
                    self.error = e
                self.cond.notify_all()
        with self.cond:
            job.remaining -= 1
            last = job.remaining == 0
        if not last:
            return
        try:
            if job.finish is not None and job.ok and self.error is None and not self.pool.stopping:
                job.finish()
        except BaseException as e:
            with self.cond:
                if self.error is None:
                    self.error = e
        finally:
            with self.cond:
                self.staged -= job.staged
                self.cond.notify_all()


def read_needs(files: StepFiles, needs: Sequence[Need], threads: int, staging_bytes: int = STAGING_BYTES,
               prefer: int | None = None) -> None:
    """Fill every need's ``out`` from the step (see the module docstring for what is read);
    ``prefer``: the rank whose files to read where several ranks saved the same region."""
    if files.tensors is None:
        raise CheckpointError(f"{files.path} is a format-1 step: it has no tensor map to read regions from")
    for need in needs:
        t = files.tensors.get(need.name)
        if t is None:
            continue
        held = t.held_by(need.source) if t.kind == LOCAL and need.source is not None else []
        dtype = t.copy_of(held[0])[0] if held else t.dtype      # a rank's local copy may have its own dtype
        if not decodable_into(need.out, dtype, need.region.sizes):
            raise CheckpointError(f"tensor {need.name!r}: the destination must be a contiguous CPU "
                                  f"{dtype} tensor of shape {list(need.region.sizes)}")
    reads = plan(files, files.tensors, needs, prefer)
    if reads:
        _Runner(files, threads, staging_bytes).run(reads)
