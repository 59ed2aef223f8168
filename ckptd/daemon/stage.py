"""Restore from the bucket: the daemon stages a step's files into the local root for a trainer.

Credentials stay in the daemon: a trainer whose step is not on this node asks (op ``stage``),
the daemon downloads what that rank reads into ``<root>/<job>/step-<N>/`` and the trainer then
restores from the local files as usual. Everything downloaded is checked before it lands:
index.json by its own digest (and that it names this job and step), each manifest by the digest
the index holds for it, each data file by the size the index holds (its chunks are checksummed
when read); names are built locally from validated numbers (core/names.py), never taken from
the bucket. Files land whole (temp file, fsync, rename), index.json last: a step staged halfway
is not committed locally. Data files come with parallel ranged GETs, only for the ranks asked
(a rank restoring at its saved world size needs only its own; the manifests are small).
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from ckptd.core import storage
from ckptd.core.errors import FormatError
from ckptd.core.names import INDEX_NAME, job_dir, rank_data_name, rank_manifest_name, step_dir, validate_job
from ckptd.core.reader import latest_committed
from ckptd.core.schema import MAX_INDEX_BYTES, MAX_MANIFEST_BYTES, digest_bytes, parse_index, parse_manifest
from ckptd.daemon.runtime import RequestError
from ckptd.daemon.s3_store import Bucket, BucketError
from ckptd.daemon.uploader import in_thread

log = logging.getLogger("ckptd")


class Stager:
    def __init__(self, bucket: Bucket, root: str) -> None:
        self.bucket, self.root = bucket, root
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    async def stage(self, job: str, step: int | None, reader: tuple[int, int] | None) -> dict[str, Any]:
        """Make ``step`` (None: the newest committed, local or in the bucket) readable here for
        ``reader`` (rank, world size): its own data file when the saved world size is the same,
        every data file otherwise or when None. RequestError on failure."""
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
        except (BucketError, FormatError, OSError, ValueError) as e:
            raise RequestError(f"cannot stage step {step} of {job!r} from {self.bucket.url}: {e}") from None
        return {"step": step, "source": "bucket" if fetched else "local", "fetched_bytes": fetched}

    def fetch(self, job: str, step: int, reader: tuple[int, int] | None) -> int:
        path = step_dir(self.root, job, step)
        index_path = os.path.join(path, INDEX_NAME)
        local = os.path.isfile(index_path)
        if local:
            index_bytes = storage.read_limited(index_path, MAX_INDEX_BYTES)
        else:
            index_bytes = self.bucket.get_bytes(self.bucket.step_key(job, step, INDEX_NAME), MAX_INDEX_BYTES)
        index = parse_index(index_bytes, job=job, step=step)
        world = index["world_size"]
        wanted = [reader[0]] if reader is not None and reader[1] == world else range(world)
        storage.make_dirs(path)
        fetched = 0
        for rank in range(world):
            name = rank_manifest_name(rank)
            if os.path.isfile(os.path.join(path, name)):
                continue
            data = self.bucket.get_bytes(self.bucket.step_key(job, step, name), MAX_MANIFEST_BYTES)
            if digest_bytes(data) != index["ranks"][rank]["manifest_digest"]:
                raise FormatError(f"{name} in the bucket does not match the digest in index.json")
            parse_manifest(data, job=job, step=step, rank=rank)
            storage.atomic_write(os.path.join(path, name), data)
            fetched += len(data)
        for rank in wanted:
            name, size = rank_data_name(rank), index["ranks"][rank]["stored_bytes"]
            target = os.path.join(path, name)
            if os.path.isfile(target) and os.path.getsize(target) == size:
                continue
            fetched += self.bucket.download(self.bucket.step_key(job, step, name), target, size)
        if not local:
            storage.atomic_write(index_path, index_bytes)      # last: now the step is committed here
            fetched += len(index_bytes)
        return fetched
