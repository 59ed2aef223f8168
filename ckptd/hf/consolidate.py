"""Whole tensors out of a committed step, torch-free: each global tensor assembled from its pieces.

An export needs every tensor whole, one at a time, whatever world size and sharding saved it. A
sharded tensor's distinct pieces (one per region: replicas are read once) must tile it exactly;
each piece's chunks are read, checksum-verified and decoded in parallel, straight into the
output buffer where the piece is one contiguous run of the tensor's row-major bytes (``Shard(0)``
of any world size), else into a buffer of the piece's size and copied into place with numpy.
A plain tensor is read from one rank's copy (all copies must be identical). Memory: the tensor
plus at most one piece in flight.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import Executor, wait
from typing import Any

import numpy as np

from ckptd.core.errors import FormatError
from ckptd.core.global_index import LOCAL, GlobalTensor, Piece
from ckptd.core.reader import StepReader
from ckptd.core.regions import Region, coverage_faults
from ckptd.core.schema import DTYPE_ITEMSIZE, Manifest, TensorEntry


class StepSource:
    """One committed step opened for whole-tensor reads: manifests and data files opened once."""

    def __init__(self, step_dir: str) -> None:
        self.reader = StepReader(step_dir)
        self.tensors, _ = self.reader.tensor_map()
        self._manifests: dict[int, tuple[Manifest, dict[str, TensorEntry]]] = {}
        self._fds: dict[int, int] = {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> StepSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def manifest(self, rank: int) -> tuple[Manifest, dict[str, TensorEntry]]:
        if rank not in self._manifests:
            m = self.reader.manifest(rank)
            self._manifests[rank] = m, m.by_name()
        return self._manifests[rank]

    def fd(self, rank: int) -> int:
        if rank not in self._fds:
            self._fds[rank] = self.reader.open_data(rank)
        return self._fds[rank]

    def key_order(self, prefix: str) -> list[str]:
        """Tensor keys under ``prefix`` in the order rank 0 saved them (its state tree's order, which is
        the module's ``state_dict`` order), then any held only by other ranks in index order."""
        manifest, entries = self.manifest(0)
        seen: dict[str, None] = {}
        stack: list[Any] = [manifest.tree]
        while stack:                       # depth-first, children in order
            node = stack.pop()
            if isinstance(node, dict) and len(node) == 1:
                (tag, value), = node.items()
                if tag == "T" and isinstance(value, str):
                    entry = entries.get(value)
                    key = entry.key if entry is not None else value
                    if key.startswith(prefix) and key in self.tensors:
                        seen[key] = None
                elif tag == "d" and isinstance(value, list):
                    stack.extend(item[1] for item in reversed(value) if isinstance(item, list) and len(item) == 2)
                elif tag in ("l", "t") and isinstance(value, list):
                    stack.extend(reversed(value))
        for key in self.tensors:
            if key.startswith(prefix):
                seen.setdefault(key, None)
        return list(seen)

    def read_whole(self, key: str, pool: Executor) -> np.ndarray:
        """Tensor ``key`` whole: its row-major bytes as a uint8 array. Raises FormatError naming it."""
        t = self.tensors[key]
        itemsize = DTYPE_ITEMSIZE[t.dtype]
        out = np.empty(math.prod(t.shape) * itemsize, dtype=np.uint8)
        for piece in self._pieces(t):
            entry = self._entry(t, piece)
            region = entry.region() if t.kind == LOCAL else piece.region
            if _contiguous(region, t.shape):
                start = _first_byte(region, t.shape, itemsize)
                self._decode(piece.rank, entry, out[start: start + region.numel * itemsize], pool)
                continue
            buf = np.empty(region.numel * itemsize, dtype=np.uint8)
            self._decode(piece.rank, entry, buf, pool)
            dst = out.reshape(*t.shape, itemsize)
            dst[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes, strict=True))] = \
                buf.reshape(*region.sizes, itemsize)
        return out

    def _pieces(self, t: GlobalTensor) -> list[Piece]:
        if t.kind == LOCAL:
            if not t.same and len(t.pieces) > 1:
                raise FormatError(f"tensor {t.name!r}: ranks {[p.rank for p in t.pieces]} saved different "
                                  "copies of it; export a step where they agree")
            return [min(t.pieces, key=lambda p: p.rank)]
        distinct: dict[Region, Piece] = {}
        for p in t.pieces:
            distinct.setdefault(p.region, p)
        faults = coverage_faults(t.shape, [(f"rank {p.rank}", p.region) for p in distinct.values()])
        if faults:
            raise FormatError(f"tensor {t.name!r}: its saved pieces do not tile it: {faults[0]}")
        return list(distinct.values())

    def _entry(self, t: GlobalTensor, piece: Piece) -> TensorEntry:
        _, entries = self.manifest(piece.rank)
        entry = entries.get(piece.name)
        if entry is None or entry.dtype != t.dtype:
            raise FormatError(f"tensor {t.name!r}: rank {piece.rank}'s manifest has no {t.dtype} entry {piece.name!r}")
        if t.kind == LOCAL and tuple(entry.shape) != t.shape:
            raise FormatError(f"tensor {t.name!r}: rank {piece.rank}'s copy has shape {entry.shape}, "
                              f"not {list(t.shape)}")
        return entry

    def _decode(self, rank: int, entry: TensorEntry, out: np.ndarray, pool: Executor) -> None:
        fd = self.fd(rank)
        view = memoryview(out)    # type: ignore[arg-type]
        futures = [pool.submit(self.reader.read_chunk_into, fd, entry, fp, rp, meta, view)
                   for fp, rp, meta in entry.chunk_spans()]
        wait(futures)
        for f in futures:
            f.result()


def _contiguous(region: Region, shape: tuple[int, ...]) -> bool:
    """Whether ``region`` is one contiguous run of a ``shape`` tensor's row-major bytes."""
    partial = [d for d, (a, b) in enumerate(zip(region.sizes, shape, strict=True)) if a != b]
    return not partial or all(region.sizes[d] == 1 for d in range(partial[-1]))


def _first_byte(region: Region, shape: tuple[int, ...], itemsize: int) -> int:
    pos, stride = 0, itemsize
    for o, n in zip(reversed(region.offsets), reversed(shape), strict=True):
        pos += o * stride
        stride *= n
    return pos
