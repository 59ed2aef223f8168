"""What a load reads, and from where: ``ReadStats`` counts it; ``HeldShards`` stands for the saved
ranks whose shards a daemon still holds in memory, read there instead of from their files
(held_pieces.py implements it; load_files.StepFiles consults it)."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptd.core.codec import ChunkMeta
from ckptd.core.schema import Manifest


@dataclass
class ReadStats:
    """What a load read, counted as it reads (pass one to ``load_tensor`` or a restore to see the cost).

    ``manifests``: ranks whose manifest was read, in order; ``entries``: (rank, entry name) of every
    piece read from; ``chunks``/``bytes``: data-file chunks read and their stored bytes; ``raw``: the
    raw bytes those chunks decoded to; ``held``: raw bytes copied from shards a daemon held
    (``HeldShards``), by where it had them."""
    manifests: list[int] = field(default_factory=list)
    entries: set[tuple[int, str]] = field(default_factory=set)
    chunks: int = 0
    bytes: int = 0
    raw: int = 0
    held: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_chunk(self, nbytes: int, held: str | None = None, raw: int = 0) -> None:
        """A chunk read: ``nbytes`` stored bytes from a data file (``raw``: what they decoded to), or,
        with ``held``, ``nbytes`` raw bytes copied from a shard held there."""
        with self._lock:
            if held is None:
                self.chunks += 1
                self.bytes += nbytes
                self.raw += raw
            else:
                self.held[held] = self.held.get(held, 0) + nbytes


class HeldShards(ABC):
    """Saved ranks whose shards a daemon holds in memory (held_pieces.py), read there instead of
    from their files. Call order: ``prefetch`` (optional) with the ranks a load will ask for, then
    ``manifest(rank)`` once per rank it needs (None: read the rank's files), then ``read_chunk`` for
    that rank's chunks, from any thread; ``close`` last."""

    @abstractmethod
    def manifest(self, rank: int) -> Manifest | None:
        """The held rank's manifest (its entries' ``offset``: where the raw bytes start), or None."""

    @abstractmethod
    def read_chunk(self, rank: int, pos: int, meta: ChunkMeta, out: memoryview, stats: ReadStats | None) -> None:
        """Copy the raw chunk at ``pos`` into ``out``, checked against ``meta.checksum``."""

    def prefetch(self, ranks: Sequence[int]) -> None:    # noqa: B027 (optional: a no-op by default)
        """Optionally get ready to answer ``manifest`` for each of ``ranks`` (called before them)."""
