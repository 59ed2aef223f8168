"""Sharded and resharding restores from the daemons' memory: other ranks' held shards as pieces.

A restore whose state holds DTensors, or that runs at another world size than the step was saved
by, needs regions of global tensors — its own saved rank's pieces at the same layout, pieces of
several saved ranks after a reshard. :class:`DaemonShards` is the ``HeldShards`` a storage restore
(``restore.restore_state``) consults for each saved rank it needs: it asks this node's daemon for
that rank's held shard (``memory_fetch`` with the saved world size; the daemon serves its own
ranks, replicas other nodes sent it, or a copy it fetches from a peer daemon, each checked against
the committed index's manifest digest), keeps the memfd to read from, and answers with the shard as a
manifest whose entries are raw (uncompressed) chunks at their offsets in the memfd. The region
arithmetic, the checks before anything is written and the per-rank rules are then the storage
restore's own; only ranks no daemon holds are read from their files. Each raw chunk is copied out of
the memfd a cache-sized piece at a time (``preadv``) and hashed while in cache (``held_map``); a chunk
failing its checksum raises :class:`MemoryUnavailable` (the restore chain then reads the whole step
from storage: never wrong data). What came from where is counted in ``ReadStats.held`` (``memory``, ``peer``) and
``ReadStats.bytes`` (storage).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ckptd.core.codec import ChunkMeta
from ckptd.core.held import HeldMeta, held_manifest
from ckptd.core.schema import Manifest

from .connection import DaemonConnection
from .held_map import HeldMap
from .memory_restore import MemoryUnavailable, fetch_held
from .read_stats import HeldShards, ReadStats

PREFETCH_THREADS = 8          # held shards asked for at once by one restoring rank


class _Held:
    """One fetched shard: its connection (which keeps it pinned), memfd (read by ``held_map``) and source."""

    def __init__(self, conn: DaemonConnection, meta: HeldMeta, fd: int, source: str) -> None:
        self.conn, self.meta, self.fd, self.source = conn, meta, fd, source
        size = os.fstat(fd).st_size
        if size < meta.nbytes:
            raise MemoryUnavailable(f"held shard of rank {meta.rank} is {size} bytes, its layout needs {meta.nbytes}")
        self.map = HeldMap(fd, meta.nbytes)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
        self.conn.close()                # unpins the shard on the daemon


class DaemonShards(HeldShards):
    """The held shards of step ``step`` (saved by ``world_size`` ranks) of ``job`` (a job key: see
    ``fetch_held``), fetched from the daemon at ``socket_path`` as a restore asks for them; ``refused``:
    each saved rank the daemon could not serve, and why (it is read from storage, or with ``required``
    — a memory-level step, which has no files — fails the restore). Close it (or use ``with``) once the restore
    has copied everything: the memfds go and the daemon may evict the shards again."""

    def __init__(self, socket_path: str, job: str, step: int, world_size: int, *, required: bool = False) -> None:
        self.socket_path, self.job, self.step, self.world_size = socket_path, job, step, world_size
        self.required = required      # a rank no daemon holds is MemoryUnavailable, not read from its files
        self.shards: dict[int, _Held] = {}
        self.refused: dict[int, str] = {}
        self._manifests: dict[int, Manifest] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> DaemonShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def manifest(self, rank: int) -> Manifest | None:
        if rank in self._manifests or rank in self.refused:
            return self._manifests.get(rank)
        try:
            conn, meta, fd, source = fetch_held(self.socket_path, self.job, self.step, rank, self.world_size)
        except MemoryUnavailable as e:
            self.refused[rank] = str(e)
            if self.required:
                raise MemoryUnavailable(f"saved rank {rank}: {e}") from None
            return None
        try:
            shard = _Held(conn, meta, fd, source)
        except BaseException:
            os.close(fd)
            conn.close()
            raise
        with self._lock:
            self.shards[rank] = shard
        m = self._manifests[rank] = held_manifest(meta.job, meta.step, meta.rank, meta.world_size, meta.layout,
                                                  meta.checksums, meta.chunk_bytes, meta.tree)
        return m

    def prefetch(self, ranks: Sequence[int]) -> None:
        """Fetch the shards of ``ranks`` not asked for yet concurrently: each is a request to the daemon
        (which may fetch from a peer first); ``manifest`` then answers from what came."""
        todo = [r for r in ranks if r not in self._manifests and r not in self.refused]
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(min(len(todo), PREFETCH_THREADS), thread_name_prefix="ckptd-held-fetch") as pool:
            list(pool.map(self.manifest, todo))      # (a refusal with ``required`` raises here, as it would later)

    def read_chunk(self, rank: int, pos: int, meta: ChunkMeta, out: memoryview, stats: ReadStats | None) -> None:
        shard = self.shards[rank]
        n = meta.raw_len
        if len(out) != n:
            raise MemoryUnavailable(f"held shard of rank {rank}: chunk at {pos} is {n} bytes, not {len(out)}")
        try:
            digest = shard.map.copy_hashed(pos, out)
        except ValueError as e:
            raise MemoryUnavailable(f"held shard of rank {rank}: {e}") from None
        if digest != meta.checksum:
            raise MemoryUnavailable(f"corrupt: memory copy of rank {rank} (step {self.step}): the chunk at byte {pos} "
                                    "of its held shard fails its checksum")
        if stats is not None:
            stats.add_chunk(n, shard.source)

    def close(self) -> None:
        with self._lock:
            shards, self.shards = list(self.shards.values()), {}
        for s in shards:
            s.close()
