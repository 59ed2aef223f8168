"""How a step commits on the local file system (the decision when is ckptd.daemon.steps.coordinator's).

The commit protocol is FORMAT.md's ("Commit protocol"); the index build, the geometry check and
the publish itself are ckptd.core.publish's. What is the daemon's here: every manifest checked
against the digest its rank reported (on a pool of threads, while the index is built), and the
publish decided once:

Whether the index is published is decided once, under a :class:`PublishGate`: the rename of
index.json into place and a withdrawal (a daemon that cannot wait for the commit any longer)
exclude each other, so once ``withdraw`` has answered, the step's outcome is final: its index
is in place, or it never will be, whatever the commit's thread does afterwards.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd.core import storage
from ckptd.core.gc_pause import gc_paused
from ckptd.core.names import rank_manifest_name
from ckptd.core.publish import BuiltIndex, IndexRefused, build_index, publish_index
from ckptd.core.rank_record import RankRecord, summarize
from ckptd.core.schema import MAX_MANIFEST_BYTES, digest_bytes, parse_manifest
from ckptd.core.step_files import is_committed, leftovers, remove_files

# Threads that check manifests: enough to overlap a shared file system's latency, never more
# than the CPUs (each file costs ~10 µs of Python under the GIL: at 32,768 local files 16 threads
# on 2 CPUs took 1.33 s, 2 threads 0.57 s, 1 thread 0.39 s).
CHECK_THREADS = min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class CommitError(Exception):
    """The step cannot be committed: a rank is missing or its manifest is not what it reported."""


class CommitWithdrawn(CommitError):
    """The commit was withdrawn before its index was published: the step will never be committed."""


class PublishGate:
    """One commit's decision: its index.json is renamed into place (published), or never (withdrawn)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.published = False
        self.withdrawn = False

    def publish(self, rename: Callable[[], None], sync: Callable[[], None] = lambda: None) -> None:
        """Run ``rename`` (the publishing act) unless the commit was withdrawn (CommitWithdrawn), then
        ``sync`` (the directory's fsync) before letting go: a drain that finds it published then
        reports a durable commit, not one whose rename a power loss could still undo."""
        with self._lock:
            if self.withdrawn:
                raise CommitWithdrawn("the commit was withdrawn (the daemon is shutting down) before its index "
                                      "was published")
            rename()
            self.published = True
            sync()

    def withdraw(self) -> bool:
        """Decide now: True when the index will never be published, False when it already is. Waits
        for a rename and its directory fsync in progress (the only thing that holds the lock)."""
        with self._lock:
            if not self.published:
                self.withdrawn = True
            return self.withdrawn

    def check(self) -> None:
        """CommitWithdrawn if withdrawn already (so a withdrawn commit does no more work)."""
        if self.withdrawn:
            raise CommitWithdrawn("the commit was withdrawn (the daemon is shutting down) before it started")


def write_index(step_path: str, job: str, step: int, world_size: int, digests: dict[int, str],
                gate: PublishGate | None = None, records: Sequence[RankRecord] | None = None,
                check: Sequence[int] | None = None) -> dict[str, Any]:
    """Merge every rank's record into the global tensor map, then publish the lean side files and
    index.json atomically (``core.publish``; under ``gate`` when given: see PublishGate). ``records`` (one per rank,
    in rank order, reported by the daemons that wrote the shards) spare reading every manifest;
    without them each manifest is read and checked against its digest here. With records, the
    manifests of ``check`` (default: every rank) are read back and checked beside the build."""
    if gate is not None:
        gate.check()
    if sorted(digests) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(digests))
        raise CommitError(f"cannot commit step {step}: no durable shard from ranks {missing}")
    if is_committed(step_path):
        raise CommitError(f"step {step} is already committed")
    # What earlier attempts left (step_files.leftovers: stray temps, side files, ranks beyond the world),
    # listed beside the build: a 32,768-rank step directory holds 65,536 names (0.1 s to list).
    strays = _soon(lambda path: leftovers(path, world_size), step_path)
    with gc_paused():       # a large job's records, tensor map and index: see gc_pause
        if records is None:
            records = [_read_record(step_path, job, step, world_size, rank, digests[rank])
                       for rank in range(world_size)]
            checked = _nothing
        else:
            if [r.rank for r in records] != list(range(world_size)) \
                    or any(r.digest != digests[r.rank] for r in records):
                raise CommitError(f"cannot commit step {step}: the rank records do not match the durable digests")
            checked = check_manifests(step_path, digests if check is None else {r: digests[r] for r in check})
        try:
            built = _build(job, step, world_size, records)
        finally:
            checked()     # (re-raises the check's CommitError; waits for it also when the build failed)
    remove_files(strays())
    publish_index(step_path, built, records, rename=None if gate is None else gate.publish)
    return built.index


def _nothing() -> None:
    pass


def _soon(fn: Callable[[str], list[str]], arg: str) -> Callable[[], list[str]]:
    """Run ``fn(arg)`` on a thread of its own now; the returned function waits for its result (or raises
    what it raised)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-commit-list")
    fut = pool.submit(fn, arg)
    pool.shutdown(wait=False)
    return fut.result


def _build(job: str, step: int, world_size: int, records: Sequence[RankRecord]) -> BuiltIndex:
    """The checked index, from every rank's record (core.publish)."""
    try:
        return build_index(job, step, world_size, records)
    except IndexRefused as e:       # committing would make a broken step the latest
        raise CommitError(f"cannot commit step {step}: {e}") from None


def _manifest_bytes(step_path: str, rank: int, digest: str) -> bytes:
    path = os.path.join(step_path, rank_manifest_name(rank))
    try:
        data = storage.read_limited(path, MAX_MANIFEST_BYTES)
    except (OSError, ValueError) as e:   # ValueError: over the size limit or not a regular file
        raise CommitError(f"rank {rank} manifest unreadable: {e}") from None
    if digest_bytes(data) != digest:
        raise CommitError(f"rank {rank} manifest {path} does not match the digest it reported durable")
    return data


def check_manifests(step_path: str, digests: dict[int, str]) -> Callable[[], None]:
    """Start checking that every manifest is there (visible on this node: a shared file system) and
    hashes to its digest, on a pool of threads, so the check runs beside the index's build rather
    than before it; the returned function waits for it and raises CommitError naming the lowest
    failing rank. The records already hold what the index needs: nothing is parsed here."""
    ranks = sorted(digests)
    k = max(1, min(CHECK_THREADS, len(ranks)))

    def check(part: list[int]) -> tuple[int, CommitError] | None:
        for r in part:          # a slice per thread: one task each, not one per rank
            try:
                _manifest_bytes(step_path, r, digests[r])
            except CommitError as e:
                return r, e
        return None
    pool = ThreadPoolExecutor(k, thread_name_prefix="ckptd-commit")
    parts = [pool.submit(check, ranks[i::k]) for i in range(k)]
    pool.shutdown(wait=False)

    def result() -> None:
        failed = [f for f in (p.result() for p in parts) if f is not None]
        if failed:
            raise min(failed, key=lambda f: f[0])[1]
    return result


def _read_record(step_path: str, job: str, step: int, world_size: int, rank: int, digest: str) -> RankRecord:
    """A rank's record from its manifest on disk, checked against the digest it reported durable."""
    data = _manifest_bytes(step_path, rank, digest)
    m = parse_manifest(data, job=job, step=step, rank=rank)
    if m.world_size != world_size:
        raise CommitError(f"rank {rank} saved with world size {m.world_size}, step has {world_size}")
    return summarize(m, digest)
