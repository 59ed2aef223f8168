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
the memfd a cache-sized piece at a time (``preadv``) and hashed while in cache (``held_map``). A chunk
failing its checksum has the shard asked for once more with ``memory_fetch verify`` (the daemon checks
its copy and drops a corrupt one for a peer's replica) and is read again from that; failing again it
raises :class:`MemoryUnavailable` (the restore chain then reads the whole step from storage: never
wrong data). What came from where is counted in ``ReadStats.held`` (``memory``, ``peer``) and
``ReadStats.bytes`` (storage).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ckptd.core.codec import ChunkMeta
from ckptd.core.held import HeldMeta, held_manifest
from ckptd.core.schema import Manifest

from .connection import Exchange
from .held_map import HeldMap
from .memory_restore import MemoryUnavailable, fetch_held
from .read_stats import HeldShards, ReadStats

PREFETCH_THREADS = 8          # held shards asked for at once by one restoring rank


class _Held:
    """One fetched shard: its connection (which keeps it pinned), memfd (read by ``held_map``) and source."""

    def __init__(self, conn: Exchange, meta: HeldMeta, fd: int, source: str) -> None:
        self.conn, self.meta, self.fd, self.source = conn, meta, fd, source
        size = os.fstat(fd).st_size
        if size < meta.nbytes:
            raise MemoryUnavailable(f"held shard of rank {meta.rank} is {size} bytes, its layout needs {meta.nbytes}")
        self.map = HeldMap(fd, meta.nbytes)
        self.readers = 0              # chunk reads in progress (DaemonShards._lock): a replaced shard is
        self.replaced = False         # closed once the last of them ends

    @staticmethod
    def taking(conn: Exchange, meta: HeldMeta, fd: int, source: str) -> _Held:
        """A fetched shard as ``_Held``; its memfd and connection closed if it is refused."""
        try:
            return _Held(conn, meta, fd, source)
        except BaseException:
            os.close(fd)
            conn.close()
            raise

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

    def __init__(self, socket_path: str, job: str, step: int, world_size: int, *, required: bool = False,
                 must: Collection[int] = ()) -> None:
        self.socket_path, self.job, self.step, self.world_size = socket_path, job, step, world_size
        self.required = required      # a rank no daemon holds is MemoryUnavailable, not read from its files
        self.must = frozenset(must)   # ranks that are so whatever ``required`` says (a restoring rank's own)
        self.shards: dict[int, _Held] = {}
        self.refused: dict[int, str] = {}
        self._manifests: dict[int, Manifest] = {}
        self._pending: dict[int, Future[Manifest | None]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._asked_again: dict[int, threading.Lock] = {}   # rank → held while its checked copy is fetched
        self._checked: set[int] = set()                     # ranks served a checked copy already

    def __enter__(self) -> DaemonShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def manifest(self, rank: int) -> Manifest | None:
        """Saved rank ``rank``'s held shard as a manifest of raw chunks, fetched now unless ``prefetch``
        already asked for it (then its answer is waited for); None: not held (read it from storage)."""
        with self._lock:
            pending = self._pending.get(rank)
        if pending is not None:
            pending.result()            # (raises as ``_fetch`` does)
        elif rank not in self._manifests and rank not in self.refused:
            self._fetch(rank)
        if rank in self.refused and (self.required or rank in self.must):
            raise MemoryUnavailable(f"saved rank {rank}: {self.refused[rank]}" if self.required else self.refused[rank])
        return self._manifests.get(rank)

    def _fetch(self, rank: int) -> Manifest | None:
        try:
            conn, meta, fd, source = fetch_held(self.socket_path, self.job, self.step, rank, self.world_size)
        except MemoryUnavailable as e:
            with self._lock:
                self.refused[rank] = str(e)
            return None
        shard = _Held.taking(conn, meta, fd, source)
        m = held_manifest(meta.job, meta.step, meta.rank, meta.world_size, meta.layout, meta.checksums,
                          meta.chunk_bytes, meta.tree)
        with self._lock:
            self.shards[rank] = shard
            self._manifests[rank] = m
        return m

    def prefetch(self, ranks: Sequence[int]) -> None:
        """Start fetching the shards of ``ranks`` not asked for yet, concurrently, and return: each is a
        round trip to the daemon (which may fetch from a peer first) that the restore's own work (the
        index, the plan) overlaps; ``manifest`` then waits for the one it needs."""
        with self._lock:
            todo = [r for r in dict.fromkeys(ranks)
                    if r not in self._manifests and r not in self.refused and r not in self._pending]
            if not todo:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="ckptd-held-fetch")
            for r in todo:
                self._pending[r] = self._pool.submit(self._fetch, r)

    def read_chunk(self, rank: int, pos: int, meta: ChunkMeta, out: memoryview, stats: ReadStats | None) -> None:
        n = meta.raw_len
        if len(out) != n:
            raise MemoryUnavailable(f"held shard of rank {rank}: chunk at {pos} is {n} bytes, not {len(out)}")
        shard = self._use(rank)
        try:
            digest = self._copy(rank, shard, pos, out)
        finally:
            self._done(shard)
        if digest != meta.checksum:
            bad = (f"corrupt: memory copy of rank {rank} (step {self.step}): the chunk at byte {pos} of its held "
                   "shard fails its checksum")
            shard = self._checked_copy(rank, shard, bad)
            try:
                digest = self._copy(rank, shard, pos, out)
            finally:
                self._done(shard)
            if digest != meta.checksum:
                raise MemoryUnavailable(f"{bad}, and so does the checked copy the daemon served next")
        if stats is not None:
            stats.add_chunk(n, shard.source)

    def _use(self, rank: int) -> _Held:
        with self._lock:
            shard = self.shards[rank]
            shard.readers += 1
            return shard

    def _done(self, shard: _Held) -> None:
        with self._lock:
            shard.readers -= 1
            last = shard.replaced and shard.readers == 0
        if last:
            shard.close()

    @staticmethod
    def _copy(rank: int, shard: _Held, pos: int, out: memoryview) -> str:
        try:
            return shard.map.copy_hashed(pos, out)
        except ValueError as e:
            raise MemoryUnavailable(f"held shard of rank {rank}: {e}") from None

    def _checked_copy(self, rank: int, seen: _Held, bad: str) -> _Held:
        """Rank ``rank``'s shard once more, checked by the daemon (``verify``), in place of ``seen`` whose
        chunk failed its checksum (``bad`` says which), in use (``_done`` it); once per rank: a thread that
        finds it replaced already uses the replacement, one that finds the checked copy bad too raises."""
        with self._lock:
            gate = self._asked_again.setdefault(rank, threading.Lock())
        with gate:
            with self._lock:
                current = self.shards[rank]
                if current is not seen:
                    current.readers += 1
                    return current
                if rank in self._checked:
                    raise MemoryUnavailable(f"{bad}, and so does the checked copy the daemon served next")
                self._checked.add(rank)
            try:
                conn, meta, fd, source = fetch_held(self.socket_path, self.job, self.step, rank, self.world_size,
                                                    verify=True)
            except MemoryUnavailable as e:
                raise MemoryUnavailable(f"{bad}; asked again for a checked copy: {e}") from None
            fresh = _Held.taking(conn, meta, fd, source)
            if (meta.layout, meta.checksums, meta.chunk_bytes) != \
                    (seen.meta.layout, seen.meta.checksums, seen.meta.chunk_bytes):
                fresh.close()
                raise MemoryUnavailable(f"{bad}; the checked copy the daemon served next has another layout")
            with self._lock:
                self.shards[rank] = fresh
                fresh.readers += 1
                seen.replaced = True
                close_seen = seen.readers == 0
            if close_seen:
                seen.close()
            return fresh

    def close(self) -> None:
        """Every fetch started is waited for (each bounded by its timeout), then every shard let go."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            shards, self.shards = list(self.shards.values()), {}
        for s in shards:
            s.close()
