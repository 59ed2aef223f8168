"""The memory tier: a storage tier in front of another that keeps each shard's raw bytes resident.

Where the trainer can spare the slot a shard was saved from (``SlotLoan``: it keeps a slot to
fill while the tier keeps ``memory.steps`` steps), the tier keeps *that slot* as the held copy:
no second copy of the step in host memory and no copy beside the codec. The slot goes back to
the trainer when the tier lets the step go (a newer step committed, eviction, a failed step).
Otherwise (one slot, or more steps kept than the trainer has slots) ``write_shard`` copies the
slot into a daemon-owned memfd on a thread *while* the inner tier (the file system) encodes and
writes the same slot, and the slot is released once both have read it.

Either way the held bytes are checksummed per chunk as they become held, and become servable
when the inner write is durable (its manifest digest names them); ``commit``/``abort`` mark or
drop them. Serving (``serve``) hands a committed shard out only after checking that its
manifest digest is the one the committed index.json records for that rank; the client then
checks every chunk's checksum as it loads (``ckptd_client.memory_restore``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from ckptd.core.errors import ChecksumError, FormatError
from ckptd.core.held import HeldMeta, layout_checksums, span, written_checksums
from ckptd.core.names import INDEX_NAME, base_job, is_memory_job, memory_job, step_dir
from ckptd.core.rank_record import RankRecord
from ckptd.core.reader import StepReader
from ckptd.core.schema import TensorLayout
from ckptd.core.step_files import is_committed
from ckptd.daemon.runtime import RequestError, describe_error
from ckptd.daemon.tiers.base import ShardRef, ShardWritten, SlotLoan, StorageTier, StreamedData
from ckptd.daemon.tiers.memory.memory_level import Replicate, hold_shard, prune, remove_stale, retire
from ckptd.daemon.tiers.memory.store import LOCAL, Held, MemoryStore, new_memfd

log = logging.getLogger("ckptd")
MAX_BEGAN = 1024        # memory-level saves whose start is remembered (remove_stale), the newest
COPY_PIECE = 64 * 1024 * 1024
INDEXES_KEPT = 16                 # committed indexes remembered for serving (newest asked last)


def _both(released: Callable[[], None]) -> Callable[[], None]:
    """``released`` once both readers of a slot (the copy and the inner tier) have called this."""
    lock, left = threading.Lock(), [2]

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            released()
    return one


class _HeldBack:
    """A slot's ``released``, held back until the tier knows whether it keeps the slot: the inner
    tier's release (any thread) and the tier's decision (the loop) may come in either order."""

    def __init__(self, released: Callable[[], None]) -> None:
        self._released = released
        self._lock = threading.Lock()
        self._read = False
        self._kept: bool | None = None

    def read(self) -> None:
        """(Any thread) the inner tier no longer reads the slot."""
        with self._lock:
            self._read = True
            go = self._kept is False
        if go:
            self._released()

    def decide(self, kept: bool) -> None:
        with self._lock:
            self._kept = kept
            go = not kept and self._read
        if go:
            self._released()


def copy_in(held: Held, data: memoryview, layout: Sequence[TensorLayout], chunk_bytes: int
            ) -> tuple[tuple[str, ...], ...]:
    """(I/O thread) Copy the slot's used bytes into the held memfd and checksum them there."""
    n = span(layout)
    assert held.mm is not None
    dst = np.frombuffer(held.mm, dtype=np.uint8, count=n)
    src = np.frombuffer(data, dtype=np.uint8, count=n)
    for s in range(0, n, COPY_PIECE):       # numpy drops the GIL for the copy; pieces keep caches warm
        np.copyto(dst[s:s + COPY_PIECE], src[s:s + COPY_PIECE])
    del dst, src
    view = memoryview(held.mm)
    try:
        return layout_checksums(view, layout, chunk_bytes)
    finally:
        view.release()


class MemoryTier(StorageTier):
    """``inner`` plus resident copies in ``store``. ``on_held`` hears of each shard made servable
    (peer replication queues it); ``replicate`` sends a memory-level step's shard to its ``k`` peers
    at once (memory_level.py), which must all acknowledge before it counts as durable; ``on_failed``
    hears of this node's held shards of a step that failed (parity: their pieces are withdrawn)."""

    def __init__(self, inner: StorageTier, store: MemoryStore, root: str, chunk_bytes: int, pool: Executor,
                 on_held: Callable[[Held], None] = lambda h: None, replicate: Replicate | None = None,
                 k: int = 0, on_failed: Callable[[list[HeldMeta]], None] = lambda metas: None) -> None:
        self.inner, self.store, self.root = inner, store, root
        self.chunk_bytes, self.pool, self.on_held, self.on_failed = chunk_bytes, pool, on_held, on_failed
        self.replicate, self.k = replicate, k
        self._began: dict[tuple[str, int], float] = {}    # a step's save → when its first shard came here
        # (job key, step) of each memory-level step a shard of came here in this daemon's life, the newest
        # MAX_BEGAN: a committed one above a new commit and not among them is another run's (remove_stale)
        self._saved_here: dict[tuple[str, int], None] = {}
        self._fetching: dict[tuple[str, int, int, str], asyncio.Future[Held | None]] = {}    # (_fetch_once)
        # (job, step) → (index.json's inode, mtime, size; its reader; rank → manifest digest): the
        # ranks of one restore each ask for the same step's index
        self._indexes: dict[tuple[str, int], tuple[tuple[int, int, int], StepReader, dict[int, str]]] = {}

    async def write_shard(self, ref: ShardRef, data: memoryview | StreamedData, layout: Sequence[TensorLayout],
                          tree: Any, *, released: Callable[[], None], abandoned: Callable[[], bool],
                          loan: SlotLoan | None = None) -> ShardWritten:
        self._began.setdefault((ref.job, ref.step), time.time())      # (remove_stale)
        while len(self._began) > MAX_BEGAN:      # steps another daemon committed: never popped here
            del self._began[next(iter(self._began))]
        if is_memory_job(ref.job):                # a memory-level step: held and replicated, not written
            self._saved_here[(ref.job, ref.step)] = None
            while len(self._saved_here) > MAX_BEGAN:
                del self._saved_here[next(iter(self._saved_here))]
            if not isinstance(data, memoryview):
                released()
                raise RequestError("a memory-level save must fit in one slot (it was streamed)")
            return await hold_shard(self.store, self.pool, self.root, self.chunk_bytes, ref, data, layout, tree,
                                    released=released, abandoned=abandoned, loan=loan, copy_in=copy_in,
                                    replicate=self.replicate, k=self.k)
        if not isinstance(data, memoryview) and not data.resident:   # streamed: its host memory is the point
            log.info("not held in memory: streamed through slots smaller than the shard",
                     extra={"ctx": {"job": ref.job, "step": ref.step, "rank": ref.rank}})
            return await self.inner.write_shard(ref, data, layout, tree, released=released, abandoned=abandoned)
        nbytes = span(layout)
        held = self.store.reserve(ref.job, ref.step, ref.rank, nbytes, LOCAL)
        if held is None:
            return await self.inner.write_shard(ref, data, layout, tree, released=released, abandoned=abandoned)
        if loan is not None and loan.can_lend(self.store.steps):
            return await self._write_kept(ref, data, layout, tree, held, loan, released, abandoned)
        loop = asyncio.get_running_loop()
        both = _both(released)

        def copy() -> tuple[tuple[str, ...], ...]:
            try:
                held.fd, held.mm = new_memfd(f"ckptd-mem-{ref.job}-{ref.step}-r{ref.rank}", nbytes)
                # (a slot still being filled: copied once full, beside the writer as ever)
                return copy_in(held, _whole(data, abandoned), layout, self.chunk_bytes)
            finally:
                both()
        copying = loop.run_in_executor(self.pool, copy)
        try:
            result = await self.inner.write_shard(ref, data, layout, tree, released=both, abandoned=abandoned)
        except BaseException:
            await asyncio.gather(copying, return_exceptions=True)
            self.store.cancel(held)
            raise
        try:
            sums = await copying
        except Exception as e:    # the copy failed (ENOMEM): the shard is durable all the same
            log.warning("not held in memory: copy failed", extra={"ctx": {"job": ref.job, "step": ref.step,
                                                                          "rank": ref.rank,
                                                                          "error": describe_error(e)}})
            self.store.cancel(held)
            return result
        self._filled(ref, held, result, sums, layout, tree)
        return result

    async def _write_kept(self, ref: ShardRef, data: memoryview | StreamedData, layout: Sequence[TensorLayout],
                          tree: Any, held: Held, loan: SlotLoan, released: Callable[[], None],
                          abandoned: Callable[[], bool]) -> ShardWritten:
        """The inner tier writes from the slot; once durable the slot itself becomes the held copy
        (``loan.lend``), and goes back when the store lets it go. Its checksums are the raw ones the
        writer took of it (``written_checksums``); only a tier that reports none has it hashed again
        (a second pass over the slot beside the writer cost it 40 % of a 1 GiB write on 2 cores)."""
        back = _HeldBack(released)
        try:
            result = await self.inner.write_shard(ref, data, layout, tree, released=back.read, abandoned=abandoned)
            sums = None if result.manifest is None else written_checksums(result.manifest, layout, self.chunk_bytes)
            if sums is None:
                sums = await asyncio.get_running_loop().run_in_executor(   # (written: a filling slot is full)
                    self.pool, layout_checksums, _whole(data, abandoned), layout, self.chunk_bytes)
        except BaseException:
            self.store.cancel(held)
            back.decide(False)
            raise
        if held.gone:                     # dropped while it was written (its step ended)
            self.store.cancel(held)
            back.decide(False)
            return result
        held.fd, held.mm, held.give_back = loan.fd, loan.mm, loan.give_back
        back.decide(True)
        loan.lend()
        self._filled(ref, held, result, sums, layout, tree)
        return result

    def _filled(self, ref: ShardRef, held: Held, result: ShardWritten, sums: tuple[tuple[str, ...], ...],
                layout: Sequence[TensorLayout], tree: Any) -> None:
        self.store.filled(held, HeldMeta(ref.job, ref.step, ref.rank, ref.world_size, result.digest, span(layout),
                                         self.chunk_bytes, sums, tuple(layout), tree))
        if held.meta is not None:
            self.store.trim(ref.job, self.committed_now)
            self.on_held(held)

    def committed_now(self, job: str, step: int) -> bool:
        """Whether the step is committed on disk now (synchronous: the store trims under its lock)."""
        return is_committed(step_dir(self.root, job, step))

    async def commit(self, job: str, step: int, world_size: int, digests: Mapping[int, str],
                     records: Sequence[RankRecord] | None = None, check: Sequence[int] | None = None) -> None:
        await self.inner.commit(job, step, world_size, digests, records, check)
        self.store.committed(job, step)
        began = self._began.pop((job, step), None)
        if began is not None:           # (a storage step too: memory-level steps above it are as stale)
            try:        # (never an error: the step is committed)
                mine = frozenset(s for j, s in self._saved_here if j == memory_job(base_job(job)))
                stale = await asyncio.get_running_loop().run_in_executor(
                    self.pool, remove_stale, self.root, base_job(job), step, began, mine)
            except Exception as e:
                stale = []
                log.warning("memory-level steps of an earlier run not removed",
                            extra={"ctx": {"job": job, "error": describe_error(e)}})
            for gone in stale:
                self.store.drop_step(memory_job(base_job(job)), gone)
            if stale:
                log.info("memory-level steps of an earlier run removed: this run committed a lower step",
                         extra={"ctx": {"job": base_job(job), "step": step, "removed": stale}})
        self.store.trim(job, self.committed_now)
        # Memory-level steps superseded (a newer one, or a storage step at least as new) go.
        if not is_memory_job(job):
            self.store.drop_before(memory_job(job), step + 1)
        try:         # (never an error: the step is committed)
            await asyncio.get_running_loop().run_in_executor(
                self.pool, prune, self.root, base_job(job), self.store.steps, None if is_memory_job(job) else step)
        except Exception as e:
            log.warning("memory-level steps not pruned", extra={"ctx": {"job": job, "error": describe_error(e)}})

    async def withdraw_commits(self) -> None:
        await self.inner.withdraw_commits()

    async def abort(self, job: str, step: int, ranks: Collection[int]) -> None:
        """The step failed: these ranks' held shards go (``on_failed`` hears of this node's own: their
        parity holders drop their pieces), and the inner tier's files."""
        self._began.pop((job, step), None)
        self.on_failed([h.meta for h in self.store.entries.values() if (h.job, h.step) == (job, step)
                        and h.rank in ranks and h.origin == LOCAL and h.meta is not None])
        self.store.drop_step(job, step, set(ranks))
        await self.inner.abort(job, step, ranks)

    async def is_committed(self, job: str, step: int) -> bool:
        return await self.inner.is_committed(job, step)

    async def refuses_save(self, job: str, step: int) -> bool:
        """A storage step's as the inner tier's. A committed memory-level step saved again is replaced: the
        run saving its number restored an older step (it could not read this one, lost in a daemon restart,
        or went back on purpose), and with several daemons each must take the new save alike. It is
        un-committed here (``retire``: index.json removed, on the loop) and this node's copies of it
        dropped; the rank manifests are replaced as the new save's arrive."""
        if not await self.inner.is_committed(job, step):
            return False
        if not is_memory_job(job) or not retire(self.root, job, step):
            return True
        self.store.drop_step(job, step)
        return False

    async def latest_committed(self, job: str) -> int | None:
        return await self.inner.latest_committed(job)

    async def written_bytes(self, ref: ShardRef) -> int:
        return await self.inner.written_bytes(ref)

    def close(self) -> None:
        self.inner.close()

    # ---- serving -------------------------------------------------------------------------

    async def committed_digest(self, job: str, step: int | None, rank: int, world_size: int) -> tuple[int, str]:
        """(step, rank's manifest digest) of the committed step (the newest when ``step`` is None),
        read from index.json; RequestError when there is none or it was saved by another world."""
        if step is None:
            step = await self.inner.latest_committed(job)
            if step is None:
                raise RequestError(f"no committed step of job {job!r}")
        path = step_dir(self.root, job, step)
        try:        # the index as this daemon last read it, while index.json is the same file
            st = os.stat(os.path.join(path, INDEX_NAME))
            key, seen = (st.st_ino, st.st_mtime_ns, st.st_size), self._indexes.get((job, step))
            if seen is None or seen[0] != key:
                reader = await asyncio.get_running_loop().run_in_executor(self.pool, StepReader, path)
                seen = self._indexes[(job, step)] = (key, reader, {})
                while len(self._indexes) > INDEXES_KEPT:
                    self._indexes.pop(next(iter(self._indexes)))
            reader, digests = seen[1], seen[2]
            if reader.world_size != world_size:
                raise RequestError(f"step {step} was saved by {reader.world_size} ranks, not {world_size} (ask with "
                                   "the step's own world size)")
            if rank not in digests:      # (a large index reads only the rank's block: rank_table.py)
                digests[rank] = str(await asyncio.get_running_loop().run_in_executor(
                    self.pool, lambda: reader.rank_entry(rank)["manifest_digest"]))
        except (FormatError, OSError) as e:
            raise RequestError(f"step {step} of job {job!r} is not committed: {e}") from None
        return step, digests[rank]

    async def serve(self, job: str, step: int | None, rank: int, world_size: int,
                    fetch_peer: Callable[[str, int, int, str], Awaitable[Held | None]] | None,
                    verify: bool = False) -> tuple[Held, str]:
        """The committed shard (pinned: ``store.unpin`` it when the client is done) and where it came
        from (``memory`` or ``peer``); RequestError saying why not (the client reads storage).
        ``verify``: the copy served before failed the client's checksums: this one is checked first,
        and a corrupt one dropped for a peer's."""
        if not self.store.enabled:
            raise RequestError("the memory tier is off on this daemon (memory_steps = 0)")
        step, digest = await self.committed_digest(job, step, rank, world_size)
        held, source = self.store.get(job, step, rank), "memory"
        if held is not None and held.meta is not None and held.meta.digest != digest:
            log.warning("held shard is not the committed one; dropped",
                        extra={"ctx": {"job": job, "step": step, "rank": rank}})
            self.store.drop_step(job, step, {rank})
            held = None
        if held is not None and held.meta is not None and verify and not await self._intact(held):
            held = None
        if held is None and fetch_peer is not None:
            held, source = await self._fetch_once(fetch_peer, job, step, rank, digest), "peer"
            if held is not None and held.gone:
                held = self.store.get(job, step, rank)      # (replaced meanwhile: whatever is held now)
        if held is None or held.meta is None:
            raise RequestError(f"step {step} rank {rank} of job {job!r} is not in memory here"
                               + (" nor on any peer" if fetch_peer is not None else ""))
        self.store.committed(job, step)
        self.store.pin(held)
        self.store.totals.served += 1
        return held, source

    async def _intact(self, held: Held) -> bool:
        """Whether a held shard passes every chunk checksum of its meta (checked on the pool, pinned);
        a corrupt one is dropped and counted (``corrupt``), and logged."""
        meta = held.meta
        assert meta is not None and held.mm is not None
        mm = held.mm

        def check() -> None:
            view = memoryview(mm)
            try:
                meta.verify(view)
            finally:
                view.release()
        self.store.pin(held)
        try:
            await asyncio.get_running_loop().run_in_executor(self.pool, check)
        except ChecksumError as e:
            log.error("held shard corrupt; dropped (a peer's copy is fetched)",
                      extra={"ctx": {"job": held.job, "step": held.step, "rank": held.rank, "error": str(e)}})
            self.store.corrupt(held)
            return False
        finally:
            self.store.unpin(held)
        return True

    async def _fetch_once(self, fetch_peer: Callable[[str, int, int, str], Awaitable[Held | None]], job: str,
                          step: int, rank: int, digest: str) -> Held | None:
        """``fetch_peer`` of a shard, once for all the requests that want it at the same time: each fetch
        reserves the shard anew, which drops the one another fetch is still filling (two restoring ranks
        needing the same lost rank: all but the last were told it was nowhere)."""
        key = (job, step, rank, digest)
        pending = self._fetching.get(key)
        if pending is None:
            pending = self._fetching[key] = asyncio.ensure_future(fetch_peer(job, step, rank, digest))
            pending.add_done_callback(lambda _: self._fetching.pop(key, None))
        return await asyncio.shield(pending)


def _whole(data: memoryview | StreamedData, stop: Callable[[], bool]) -> memoryview:
    """A resident shard's bytes: the slot itself, or a filling slot once every byte is in it."""
    return data if isinstance(data, memoryview) else data.whole(stop)
