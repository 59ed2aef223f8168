"""Memory-level steps: a rank's shard held in memory with its K peer replicas, never encoded or written.

A save at ``level="memory"`` (its job key is ``names.memory_job(job)``, its directory
``<root>/<job>/_memory/step-N``) is *durable* on its rank once

1. its raw bytes are held here — the trainer's slot kept as the copy where the trainer can spare it
   (``SlotLoan``), else a copy into a daemon memfd — and checksummed per chunk;
2. its manifest is written beside the step's future index: raw ``held`` chunks at their memfd offsets
   (``core.held.held_manifest``, FORMAT.md), whose SHA-256 is the digest the index records and
   every holder checks before serving; a few KiB, the step's only bytes on disk;
3. K peer daemons acknowledged their replica (``[peers] replicas``; none when no peers are set).

Then the coordinator commits it like any step (records, one index.json, agreed across ranks). A shard
that cannot be held within the budget, or not replicated K times, fails its rank's write with the
reason, so the step fails and its handle says why: never committed. Memory-level steps do not survive
a restart of every daemon holding them; their index then names shards nobody serves, and a restore
falls back to the newest storage step (``ckptd_client.memory_level``).

Retention (``prune``): a daemon committing a memory-level step keeps the newest ``memory.steps``
memory-level step directories of the job; one committing a storage step removes the memory-level
steps at or below it (a restore would never pick them). Their held shards go by the store's own rules.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import Executor
from typing import Any

from ckptd.core import storage
from ckptd.core.held import HeldMeta, held_manifest, layout_checksums, span
from ckptd.core.names import INDEX_NAME, rank_manifest_name, step_dir
from ckptd.core.rank_record import summarize
from ckptd.core.reader import memory_level_steps
from ckptd.core.schema import TensorLayout, digest_bytes, encode_json
from ckptd.core.step_files import remove_rank_files, remove_step
from ckptd.daemon import shm
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.tiers.base import ShardRef, ShardWritten, SlotLoan
from ckptd.daemon.tiers.memory.store import LOCAL, Held, MemoryStore, new_memfd

log = logging.getLogger("ckptd")


class NotHeld(Exception):
    """A memory-level shard that could not be held (budget) or replicated (peers): its step fails."""


Replicate = Callable[[Held], Awaitable[int]]      # sends a held shard to every target; acknowledged copies


async def hold_shard(store: MemoryStore, pool: Executor, root: str, chunk_bytes: int, ref: ShardRef,
                     data: memoryview, layout: Sequence[TensorLayout], tree: Any, *, released: Callable[[], None],
                     abandoned: Callable[[], bool], loan: SlotLoan | None,
                     copy_in: Callable[[Held, memoryview, Sequence[TensorLayout], int], tuple[tuple[str, ...], ...]],
                     replicate: Replicate | None, k: int) -> ShardWritten:
    """Hold one rank's shard of a memory-level step (the module docstring): returns once it is held,
    its manifest written and K peers hold their replica; NotHeld (or the I/O error) otherwise, with
    nothing left held and the slot given back."""
    t0, nbytes = time.monotonic(), span(layout)
    held = store.reserve(ref.job, ref.step, ref.rank, nbytes, LOCAL)
    if held is None:
        released()
        why = store.short.text() if store.short is not None else f"{store.used} of {store.budget} bytes in use"
        raise NotHeld(f"memory-level step {ref.step}: rank {ref.rank}'s {nbytes}-byte shard does not fit the "
                      f"memory budget ({why}); raise [memory] budget, keep fewer memory.steps, or save this step "
                      "to storage")
    loop = asyncio.get_running_loop()
    kept = loan is not None and loan.can_lend(store.steps)
    try:
        if kept:
            sums = await loop.run_in_executor(pool, layout_checksums, data, layout, chunk_bytes)
        else:
            def copy() -> tuple[tuple[str, ...], ...]:
                try:
                    held.fd, held.mm = new_memfd(f"ckptd-mem-{ref.step}-r{ref.rank}", nbytes)
                except OSError as e:        # (named: not a write to the root's disk, where one would look)
                    where = shm.place().dir
                    in_ = f"memory.shm_dir {where}" if where else "memfds"
                    raise NotHeld(f"memory-level step {ref.step}: rank {ref.rank}'s {nbytes}-byte copy could not "
                                  f"be made in the daemon's shared memory ({in_}): {describe_error(e)}; free or "
                                  "grow it, or save this step to storage") from e
                return copy_in(held, data, layout, chunk_bytes)
            try:
                sums = await loop.run_in_executor(pool, copy)
            finally:
                released()
        manifest = held_manifest(ref.job, ref.step, ref.rank, ref.world_size, layout, sums, chunk_bytes, tree)
        body = encode_json(manifest.to_json())
        path = step_dir(root, ref.job, ref.step)

        def write() -> None:
            storage.make_step_dir(path)
            storage.atomic_write(os.path.join(path, rank_manifest_name(ref.rank)), body)
        await loop.run_in_executor(pool, write)
        if abandoned() or held.gone:
            raise NotHeld(f"memory-level step {ref.step} ended while rank {ref.rank}'s shard was held")
    except BaseException:
        store.cancel(held)
        if kept:
            released()
        await _remove_manifest(loop, pool, root, ref)
        raise
    digest = digest_bytes(body)
    if kept:
        assert loan is not None
        held.fd, held.mm, held.give_back = loan.fd, loan.mm, loan.give_back
        loan.lend()
    store.filled(held, HeldMeta(ref.job, ref.step, ref.rank, ref.world_size, digest, nbytes, chunk_bytes, sums,
                                tuple(layout), tree))
    try:
        acked = await replicate(held) if replicate is not None and k > 0 else 0
        if acked < k:
            raise NotHeld(f"memory-level step {ref.step}: rank {ref.rank}'s shard reached {acked} of its {k} peer "
                          "replicas (see the daemon log for each peer's error)")
    except BaseException:       # a failed write leaves nothing: the held shard (its slot goes back), the manifest
        store.drop_step(ref.job, ref.step, {ref.rank})
        await _remove_manifest(loop, pool, root, ref)
        raise
    return ShardWritten(nbytes, 0, digest, time.monotonic() - t0, summarize(manifest, digest))


async def _remove_manifest(loop: asyncio.AbstractEventLoop, pool: Executor, root: str, ref: ShardRef) -> None:
    await loop.run_in_executor(pool, remove_rank_files, step_dir(root, ref.job, ref.step), ref.rank)


CLOCK_SLACK_S = 10.0     # remove_stale: how far the file server's clock may be behind this daemon's


def remove_stale(root: str, job: str, step: int, began: float, saved_here: Collection[int] = ()) -> list[int]:
    """(I/O thread) Remove the committed memory-level steps of ``job`` above ``step`` (just committed,
    memory-level or storage, its save begun at wall time ``began``) that were committed before that save
    began, or that this daemon never saw saved (not in ``saved_here``: every step of the run committing
    ``step`` came through this daemon, which holds one of its ranks): another run's.
    A run saves its steps in increasing order, so a higher step committed before a lower one began
    comes from a run that was later restored from an older step (its memory-level step could not be
    read by every rank, so it went to storage): left, the numbers above ``step`` would outrank every
    step of the new run (pruned as soon as committed, its saves of those numbers refused). "Before"
    by ``CLOCK_SLACK_S`` at least: an index's mtime is the file server's clock, ``began`` this
    daemon's, and a server some seconds behind would make this run's own newer step look older."""
    gone = []
    for s in memory_level_steps(root, job):
        if not s.committed or s.step <= step:
            continue
        try:
            stale = s.step not in saved_here \
                or os.stat(os.path.join(s.path, INDEX_NAME)).st_mtime < began - CLOCK_SLACK_S
            if stale:
                remove_step(s.path)
                gone.append(s.step)
        except OSError as e:
            log.warning("could not remove a memory-level step of an earlier run",
                        extra={"ctx": {"job": job, "step": s.step, "error": str(e)}})
    return gone


def retire(root: str, job: str, step: int) -> bool:
    """(On the loop: one unlink and a directory fsync) Un-commit memory-level step ``step`` of job key
    ``job``, saved again (``MemoryTier.refuses_save``): its index.json goes; its rank manifests stay for
    the new save's to replace (another daemon's ranks may be writing theirs into it now), and its lean
    side files for the commit to remove (``step_files.leftovers``). Whether it is no longer committed."""
    path = step_dir(root, job, step)
    try:
        os.unlink(os.path.join(path, INDEX_NAME))
        storage.fsync_dir(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("a memory-level step saved again could not be un-committed: the save is refused",
                    extra={"ctx": {"job": job, "step": step, "error": str(e)}})
        return False
    log.warning("memory-level step saved again: the committed one is replaced (the run saving its number restored "
                "an older step)", extra={"ctx": {"job": job, "step": step}})
    return True


def prune(root: str, job: str, keep: int, at_or_below: int | None) -> list[int]:
    """(I/O thread) Remove memory-level step directories of ``job`` beyond the newest ``keep``
    committed ones, and every one at or below ``at_or_below`` (a committed storage step); returns
    the steps removed."""
    steps = [s for s in memory_level_steps(root, job) if s.committed]
    newest = {s.step for s in steps[-keep:]} if keep > 0 else set()
    gone = []
    for s in steps:
        if s.step not in newest or (at_or_below is not None and s.step <= at_or_below):
            try:
                remove_step(s.path)
                gone.append(s.step)
            except OSError as e:
                log.warning("could not remove a memory-level step", extra={"ctx": {"job": job, "step": s.step,
                                                                                   "error": str(e)}})
    return gone
