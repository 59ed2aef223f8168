"""One committed step's files as one load sees them (``StepFiles``): the index's tensor map, each rank
manifest read at most once and digest-checked, data files opened at most once, and chunks read,
verified and decoded from them (or from shards a daemon holds, ``read_stats.HeldShards``). The
region arithmetic and the parallel reads that use it are reshard.py's."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from ckptd.core import storage
from ckptd.core.codec import ChunkMeta
from ckptd.core.errors import ChecksumError, FormatError
from ckptd.core.global_index import GlobalTensor
from ckptd.core.names import rank_manifest_name
from ckptd.core.reader import StepReader, read_decoded
from ckptd.core.schema import Manifest, TensorEntry

from .errors import CheckpointError, MissingData
from .read_stats import HeldShards, ReadStats

ReadAt = Callable[[int, int, int], bytes]
"""``(fd, offset, length) -> exactly length bytes``: how data files are read (``storage.read_at``)."""


class StepFiles:
    """One committed step as one load sees it: the index's tensor map, each rank manifest read at
    most once (digest-checked), data files opened at most once. Every failure is a CheckpointError
    naming the file (and the tensor, where one is concerned). Close it (or use ``with``)."""

    def __init__(self, step_path: str, stats: ReadStats | None = None, read_at: ReadAt = storage.read_at,
                 held: HeldShards | None = None, reader: StepReader | None = None) -> None:
        self.stats = stats
        self.read_at = read_at
        self.held = held
        self.held_ranks: set[int] = set()
        try:                # (``reader``: the step's index already read, by the caller)
            self.reader = reader if reader is not None else StepReader(step_path)
        except (FormatError, OSError) as e:
            raise CheckpointError(f"cannot restore from {step_path}: {e}") from None
        self.path = self.reader.path
        self.world_size = self.reader.world_size
        self.step = self.reader.step
        self._manifests: dict[int, Manifest] = {}
        self._entries: dict[int, dict[str, TensorEntry]] = {}
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.tensors: dict[str, GlobalTensor] | None = None      # None: a format-1 step (no tensor map)
        self.per_rank_keys: list[str] = []
        if self.reader.format_version >= 2:
            try:     # parsed once per reader: the manifests' map check uses the same map
                self.tensors, per_rank_keys = self.reader.tensor_map()
            except FormatError as e:
                raise CheckpointError(f"cannot restore from {self.path}: {e}") from None
            self.per_rank_keys = list(per_rank_keys)

    def __enter__(self) -> StepFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def manifest(self, rank: int) -> Manifest:
        m = self._manifests.get(rank)
        if m is None:
            m = self.held.manifest(rank) if self.held is not None else None
            if m is not None:
                self.held_ranks.add(rank)
            else:
                try:
                    m = self.reader.manifest(rank)
                except (FormatError, OSError) as e:
                    raise CheckpointError(f"cannot restore from {self.path}: {e}") from None
            self._manifests[rank] = m
            self._entries[rank] = m.by_name()
            if self.stats is not None:
                self.stats.manifests.append(rank)
        return m

    def prefetch(self, ranks: Sequence[int]) -> None:
        """Held shards of ``ranks`` asked for at once, before ``manifest`` asks rank by rank (HeldShards)."""
        if self.held is not None:
            self.held.prefetch([r for r in ranks if r not in self._manifests])

    def entry(self, rank: int, name: str, tensor: str) -> TensorEntry:
        """Entry ``name`` of rank ``rank``'s manifest, which holds a piece of ``tensor``."""
        self.manifest(rank)
        e = self._entries[rank].get(name)
        if e is None:
            raise CheckpointError(f"tensor {tensor!r}: the index places a piece in entry {name!r} of "
                                  f"{os.path.join(self.path, rank_manifest_name(rank))}, which has no such entry")
        return e

    def fd(self, rank: int) -> int:
        with self._lock:
            fd = self._fds.get(rank)
            if fd is None:
                try:
                    fd = self._fds[rank] = self.reader.open_data(rank)
                except (FormatError, OSError) as e:
                    kind = CheckpointError if os.path.lexists(self.reader.data_path(rank)) else MissingData
                    raise kind(f"cannot restore from {self.path}: {e}") from None
            return fd

    def read_chunk(self, rank: int, entry: TensorEntry, file_pos: int, meta: ChunkMeta, out: memoryview) -> None:
        """Read, verify and decode one chunk of ``entry`` into ``out`` (``meta.raw_len`` bytes)."""
        if rank in self.held_ranks and self.held is not None:
            return self.held.read_chunk(rank, file_pos, meta, out, self.stats)
        try:
            n = read_decoded(self.fd(rank), file_pos, meta, entry.dtype, out, self.read_at)
            if self.stats is not None:
                self.stats.add_chunk(n, raw=meta.raw_len)
        except (ChecksumError, EOFError, OSError) as e:
            raise CheckpointError(f"corrupt checkpoint: tensor {entry.name!r} in "
                                  f"{self.reader.data_path(rank)}: {e}") from None
