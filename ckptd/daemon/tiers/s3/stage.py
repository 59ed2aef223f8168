"""Restore from the bucket: the daemon stages a step's files into the local root for a trainer.

Credentials stay in the daemon: a trainer whose step is not on this node asks (op ``stage``),
the daemon downloads what that rank reads into ``<root>/<job>/step-<N>/`` and the trainer then
restores from the local files as usual. Everything downloaded is checked before it lands:
index.json by its own digest (and that it names this job and step), each manifest by the digest
the index holds for it, each data file by the size the index holds and every chunk's checksum;
names are built locally from validated numbers (core/names.py), never taken from the bucket.

A staged step is a copy, not this root's commit (FORMAT.md, "Staged steps"): ``staged.json`` is
written first, then the files (each whole: temp file, fsync, check, rename), index.json last —
so index.json is there only once every file the directory holds has been verified. Any check
that fails removes the staged directory (index.json first) and names the bucket key: a corrupt
bucket step never looks committed here and every later restore asks the bucket again. A step
this node committed itself (no ``staged.json``) is never removed; a file fetched for it that
fails its check is not kept. Data files come with parallel ranged GETs, only for the ranks
asked (a rank restoring at its saved world size needs only its own; the manifests are small).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from ckptd.core import storage
from ckptd.core.errors import FormatError
from ckptd.core.names import (
    INDEX_NAME,
    STAGED_NAME,
    job_dir,
    parse_rank_file_name,
    rank_data_name,
    rank_manifest_name,
    step_dir,
    validate_job,
)
from ckptd.core.reader import chunk_faults, latest_committed
from ckptd.core.schema import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, Manifest, digest_bytes, parse_index, parse_manifest
from ckptd.core.step_files import is_committed, remove_files, remove_step
from ckptd.daemon.runtime import RequestError
from ckptd.daemon.tiers.s3.bucket import Bucket, BucketError, SizeMismatch
from ckptd.daemon.tiers.s3.upload_jobs import in_thread

log = logging.getLogger("ckptd")


class CorruptInBucket(FormatError):
    """A file of a bucket step fails its check; the message names its key (s3://…)."""


@dataclass
class StageStats:
    """What status shows: bytes fetched from the bucket by stages, and how many failed a check."""
    staged: int = 0
    fetched_bytes: int = 0
    corrupt: int = 0
    last_error: str | None = None

    def view(self) -> dict[str, Any]:
        return {"staged": self.staged, "fetched_bytes": self.fetched_bytes, "corrupt": self.corrupt,
                "last_error": self.last_error}


class Stager:
    def __init__(self, bucket: Bucket, root: str, *, check_chunks: bool = True) -> None:
        self.bucket, self.root = bucket, root
        self.check_chunks = check_chunks          # False: `ckptd verify` checks (and lists) them itself
        self.stats = StageStats()
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    async def stage(self, job: str, step: int | None, reader: tuple[int, int] | None) -> dict[str, Any]:
        """Make ``step`` (None: the newest committed, local or in the bucket) readable here for
        ``reader`` (rank, world size): its own data file when the saved world size is the same,
        every data file otherwise or when None. RequestError on failure, naming the bucket key."""
        job = validate_job(job)
        try:
            if step is None:
                local = latest_committed(job_dir(self.root, job)) if os.path.isdir(job_dir(self.root, job)) else None
                try:
                    remote = await in_thread(lambda: self.bucket.latest(job))
                except BucketError as e:      # the bucket is away: what this node has is all there is
                    if local is None:
                        raise
                    log.warning("bucket not listed; restoring the newest local step",
                                extra={"ctx": {"job": job, "step": local.step, "error": str(e)}})
                    return {"step": local.step, "source": "local", "warning": str(e)}
                candidates = [s for s in (local.step if local else None, remote) if s is not None]
                if not candidates:
                    return {"step": None, "source": None}
                step = max(candidates)
            lock = self._locks.setdefault((job, step), asyncio.Lock())
            async with lock:      # ranks of one node staging one step: each file is fetched once
                fetched = await in_thread(lambda: self.fetch(job, step, reader))
        except CorruptInBucket as e:
            self.stats.corrupt += 1
            self.stats.last_error = str(e)
            raise RequestError(f"cannot stage step {step} of {job!r}: {e}. Restore an older step "
                               f"(restore(state, step=N)); `ckptd verify {self._step_url(job, step)}` lists "
                               "every fault") from None
        except (BucketError, FormatError, OSError, ValueError) as e:
            self.stats.last_error = str(e)
            raise RequestError(f"cannot stage step {step} of {job!r} from {self.bucket.url}: {e}") from None
        return {"step": step, "source": "bucket" if fetched else "local", "fetched_bytes": fetched}

    def _step_url(self, job: str, step: int | None) -> str:
        return self.bucket.key_url(self.bucket.step_key(job, step)).rstrip("/") if step is not None else self.bucket.url

    def fetch(self, job: str, step: int, reader: tuple[int, int] | None) -> int:
        """Stage ``step`` for ``reader`` (None: every rank); bytes fetched. CorruptInBucket when a
        file fails its check (the staged copy is removed first), BucketError when a request fails
        (what landed stays, verified, for the next try, which checks it against the index it fetches)."""
        path = step_dir(self.root, job, step)
        own_commit = is_committed(path) and not os.path.isfile(os.path.join(path, STAGED_NAME))
        t0, tally = time.monotonic(), [0]
        try:
            self._fetch(job, step, reader, path, tally)
        except CorruptInBucket as e:
            fetched = tally[0]
            if not own_commit and os.path.isdir(path):
                remove_step(path)          # index.json first: it stops looking committed at once
            log.error("staging failed: a file in the bucket is corrupt; nothing of it is kept here",
                      extra={"ctx": {"job": job, "step": step, "error": str(e), "fetched_bytes": fetched,
                                     "removed": None if own_commit else path}})
            raise
        finally:
            self.stats.fetched_bytes += tally[0]       # one thread at a time per step; ints under the GIL
        fetched = tally[0]
        if fetched:
            self.stats.staged += 1
            log.info("staged from the bucket", extra={"ctx": {"job": job, "step": step, "fetched_bytes": fetched,
                                                              "reader": reader,
                                                              "stage_s": round(time.monotonic() - t0, 3)}})
        return fetched

    def _get(self, key: str, limit: int, tally: list[int]) -> bytes:
        data = self.bucket.get_bytes(key, limit)
        tally[0] += len(data)
        return data

    def _fetch(self, job: str, step: int, reader: tuple[int, int] | None, path: str, tally: list[int]) -> None:
        index_path = os.path.join(path, INDEX_NAME)
        key = self.bucket.step_key
        url = self.bucket.key_url
        local = is_committed(path)
        if local:
            index_bytes = storage.read_limited(index_path, MAX_INDEX_BYTES)
            index = parse_index(index_bytes, job=job, step=step)
        else:
            index_bytes = self._get(key(job, step, INDEX_NAME), MAX_INDEX_BYTES, tally)
            try:
                index = parse_index(index_bytes, job=job, step=step)
            except FormatError as e:
                raise CorruptInBucket(f"{url(key(job, step, INDEX_NAME))}: {e}") from None
            storage.make_step_dir(path)
            marker = os.path.join(path, STAGED_NAME)
            if not os.path.isfile(marker):     # first: from now on this directory is a staged copy
                storage.atomic_write(marker, json.dumps({
                    "kind": "ckptd.staged", "source": self._step_url(job, step) + "/",
                    "created_unix": round(time.time(), 3)}).encode())
        world = index["world_size"]
        wanted = [reader[0]] if reader is not None and reader[1] == world else list(range(world))
        if not local:
            self._drop_stale(path, index)
        manifests: dict[int, Manifest] = {}
        for rank in range(world):
            name = rank_manifest_name(rank)
            target = os.path.join(path, name)
            if os.path.isfile(target):     # landed only after its digest matched (or written here)
                if rank in wanted:
                    manifests[rank] = parse_manifest(storage.read_limited(target, MAX_MANIFEST_BYTES),
                                                     job=job, step=step, rank=rank)
                continue
            data = self._get(key(job, step, name), MAX_MANIFEST_BYTES, tally)
            where = url(key(job, step, name))
            if digest_bytes(data) != index["ranks"][rank]["manifest_digest"]:
                raise CorruptInBucket(f"{where}: does not match the digest index.json holds for it")
            try:
                manifest = parse_manifest(data, job=job, step=step, rank=rank)
            except FormatError as e:
                raise CorruptInBucket(f"{where}: {e}") from None
            storage.atomic_write(target, data)
            if rank in wanted:
                manifests[rank] = manifest
        for rank in wanted:
            name, size = rank_data_name(rank), index["ranks"][rank]["stored_bytes"]
            target = os.path.join(path, name)
            if os.path.isfile(target) and os.path.getsize(target) == size:
                continue               # landed only after its check (or written here)
            data_key = key(job, step, name)
            try:
                self.bucket.download(data_key, target, size, check=self._checker(manifests[rank], url(data_key)))
            except CorruptInBucket:
                tally[0] += size
                raise
            except SizeMismatch as e:      # a size other than index.json's
                raise CorruptInBucket(f"{url(data_key)}: {e}") from None
            tally[0] += size
        if not local:
            storage.atomic_write(index_path, index_bytes)      # last: every file here has been verified

    @staticmethod
    def _drop_stale(path: str, index: dict[str, Any]) -> None:
        """A partial stage (no index.json yet) keeps what landed for the next try; but the bucket's step
        may have been replaced since (another save of that number uploaded). Every manifest here is
        checked against the digest the index just fetched holds for it: one that differs goes, its data
        file FIRST (a data file here was checked against the manifest beside it, so it is good for the
        new index exactly when that manifest is), and so do rank files beyond the index's world size."""
        world = index["world_size"]
        for entry in os.listdir(path):
            rank = parse_rank_file_name(entry)
            if rank is None or entry not in (rank_data_name(rank), rank_manifest_name(rank)):
                continue                   # not a name ckptd gives (rank-0000003.json): not ours to judge
            if rank >= world:
                remove_files([os.path.join(path, entry)])
                continue
            if entry != rank_manifest_name(rank):
                continue
            manifest = os.path.join(path, entry)
            try:
                same = digest_bytes(storage.read_limited(manifest, MAX_MANIFEST_BYTES)) == \
                    index["ranks"][rank]["manifest_digest"]
            except (OSError, ValueError):
                same = False
            if not same:
                remove_files([os.path.join(path, rank_data_name(rank)), manifest])

    def _checker(self, manifest: Manifest, where: str) -> Any:
        """The check of a downloaded data file: every chunk's checksum against its manifest."""
        def check(tmp: str) -> None:
            if not self.check_chunks:
                return
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                faults = chunk_faults(fd, manifest, first_only=True)
            finally:
                os.close(fd)
            if faults:
                tensor, reason = faults[0]
                raise CorruptInBucket(f"{where}: tensor {tensor!r}: {reason}")
        return check


__all__ = ["CorruptInBucket", "Stager"]
