"""The second level of the two-level commit: committed local steps go to the bucket in the background.

A step commits locally exactly as without a bucket; then ``committed`` queues it here. One
upload per job runs at a time: the step's manifests and data files (multipart, parallel), then
its ``index.json`` LAST, so a step is committed in the bucket only once every file it names is
there; an upload killed halfway leaves a prefix without an index, which readers ignore and the
next upload's bucket retention removes. The index.json is put only while the local step still
holds it (step_upload.py): a step removed locally while it uploads (``ckptd gc --remove-above``)
is withdrawn, its uploaded files deleted, never committed in the bucket. A step number the
bucket already holds committed with another index.json (another save of that number) has that
index.json deleted before any file is replaced, so the bucket never shows a committed step
mixing two saves. Whether a step is "in the bucket" is always its index.json there compared byte
for byte with the local one, never its number alone. Nothing here blocks a save or a local commit.

Queue policy (uploads falling behind): per job at most ``queue_depth`` steps wait behind the one
uploading; a commit that finds the queue full drops the oldest waiting step (counted as
skipped in status and metrics), so the newest committed step is always uploaded. A failed
upload is retried with exponential backoff and jitter until it succeeds or a newer step
waits (then it is skipped). At start, the newest committed local step of each job is queued
again when it is newer than the bucket's newest, or the bucket holds its number with another
index.json (an upload a killed daemon left unfinished is redone).

Call order: ``start`` once (on the event loop), ``committed`` after each local commit,
``flush`` when a step must reach the bucket now (preemption), ``finish`` at shutdown.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ckptd.core.errors import FormatError
from ckptd.core.names import INDEX_NAME, job_dir, step_dir, validate_job
from ckptd.core.reader import latest_committed
from ckptd.core.schema import MAX_INDEX_BYTES
from ckptd.core.step_files import is_committed
from ckptd.daemon.runtime import TaskSet, describe_error
from ckptd.daemon.tiers.s3.bucket import Bucket, BucketError, CredentialsError, TooLarge
from ckptd.daemon.tiers.s3.step_upload import IncompleteStep, StepWithdrawn, local_index, upload_step
from ckptd.daemon.tiers.s3.upload_jobs import JobUploads, in_thread

log = logging.getLogger("ckptd")
T = TypeVar("T")


class Uploader:
    def __init__(self, bucket: Bucket, root: str, tasks: TaskSet, *, debug_delay: float = 0.0) -> None:
        self.bucket, self.root, self.tasks = bucket, root, tasks
        self.settings = bucket.settings
        self.debug_delay = debug_delay            # TEST ONLY: seconds slept before each file
        self.jobs: dict[str, JobUploads] = {}
        self.problem: str | None = None           # the start check's or the last failed upload's error
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._committed_at: dict[tuple[str, int], float] = {}
        self._changed = asyncio.Event()
        self._stopped = False

    # ---- entry points ---------------------------------------------------------------------

    def start(self) -> None:
        self.tasks.spawn(self._resume(), "upload resume scan")

    def committed(self, job: str, step: int) -> None:
        if self._stopped:
            return
        self._committed_at[(job, step)] = time.monotonic()
        j = self.jobs.setdefault(job, JobUploads())
        j.removed.discard(step)            # committed again here: uploaded again
        if j.tracks(step):
            return
        j.queued.append(step)
        while len(j.queued) > self.settings.queue_depth:
            dropped = min(j.queued)          # the oldest step, not the first queued: steps may commit out of order
            j.queued.remove(dropped)
            j.skipped += 1
            log.warning("upload skipped: uploads are behind, a newer step is queued",
                        extra={"ctx": {"job": job, "step": dropped, "newer": max(j.queued)}})
        if job not in self._workers:
            self._workers[job] = self.tasks.spawn(self._work(job), f"uploads of {job}")

    def pending(self, job: str) -> list[int]:
        """Steps local retention must spare: uploading or queued."""
        j = self.jobs.get(job)
        if j is None:
            return []
        return ([j.uploading] if j.uploading is not None else []) + list(j.queued)

    async def flush(self, job: str, step: int | None, timeout: float) -> tuple[bool, str]:
        """Wait up to ``timeout`` s for ``step`` (default: the job's newest committed local step) to be
        committed in the bucket, queueing it first if needed; (made it, what happened). ValueError:
        a bad job name. A step neither known here nor committed on this node is not filed (a client
        naming made-up jobs or steps would otherwise grow this daemon's tables without bound)."""
        validate_job(job)
        if step is None:
            info = latest_committed(job_dir(self.root, job))
            if info is None:
                return False, f"job {job!r} has no committed local step"
            step = info.step
        known = self.jobs.get(job)
        if not (known is not None and known.tracks(step)) and not is_committed(step_dir(self.root, job, step)):
            return False, f"step {step} of job {job!r} is not committed on this node"
        j = self.jobs.setdefault(job, JobUploads())
        if step in j.removed and not j.tracks(step):
            return False, self._removed_why(step)
        if not j.tracks(step):
            if await self._same_there(job, step, j):   # there already (a copy staged from it, an upload of a restart)
                return True, f"step {step} is committed in the bucket"
            self.committed(job, step)
        deadline = time.monotonic() + timeout
        while step not in j.known:
            if step != j.uploading and step not in j.queued:      # its upload ended without it
                if step in j.removed:
                    return False, self._removed_why(step)
                return False, f"step {step} did not reach the bucket" + (
                    f": {j.last_error}" if j.last_error else " (skipped: a newer step was queued)")
            left = deadline - time.monotonic()
            if left <= 0:
                return False, f"step {step} not in the bucket after {timeout:g}s" + (
                    f" (last error: {j.last_error})" if j.last_error else "")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        return True, f"step {step} is committed in the bucket"

    def _removed_why(self, step: int) -> str:
        return (f"step {step} was committed in the bucket and then removed by bucket retention (s3.keep_last = "
                f"{self.settings.keep_last}: newer steps are kept there); not uploaded again")

    async def finish(self, timeout: float) -> None:
        """Shutdown: uploads running get ``timeout`` s to complete; logs, per job, whether the
        newest committed step made it to the bucket."""
        self._stopped = True
        jobs = [(job, max([*j.queued, *([] if j.uploading is None else [j.uploading])], default=None))
                for job, j in self.jobs.items()]
        for job, step in jobs:
            if step is None:
                continue
            ok, what = await self.flush(job, step, max(0.0, timeout))
            (log.info if ok else log.error)("upload at shutdown " + ("done" if ok else "did not finish"),
                                            extra={"ctx": {"job": job, "step": step, "detail": what}})

    def status(self) -> dict[str, Any]:
        return {"url": self.bucket.url, "problem": self.problem,
                "jobs": {job: j.view() for job, j in sorted(self.jobs.items())}}

    # ---- work -----------------------------------------------------------------------------

    async def _resume(self) -> None:
        try:
            await in_thread(self.bucket.check)
            self.problem = None
        except BucketError as e:
            self.problem = str(e)
            log.error("bucket unusable; local saves go on, uploads retry", extra={"ctx": {"error": str(e)}})
        try:
            names = sorted(os.listdir(self.root))
        except OSError:
            return
        for job in names:
            try:
                validate_job(job)
                info = latest_committed(job_dir(self.root, job))
            except (ValueError, OSError):
                continue
            if info is None:
                continue
            newest = await self._until_answered(functools.partial(self.bucket.latest, job))
            j = self.jobs.setdefault(job, JobUploads())
            j.in_bucket = newest if j.in_bucket is None else max(j.in_bucket, newest or -1)
            if newest is not None and newest != info.step:
                j.know(newest)
            if newest is None or info.step > newest:
                log.info("upload resumed after restart", extra={"ctx": {"job": job, "step": info.step,
                                                                        "bucket_newest": newest}})
                self.committed(job, info.step)
                continue
            # The bucket holds this step number: this node's save, or another of the same number (a job
            # rolled back and trained on elsewhere), or a re-upload of it killed halfway. Compared by content.
            there = await self._until_answered(functools.partial(self._bucket_index, job, info.step))
            if there is None:
                continue            # older than the bucket's newest and not there: nothing to redo
            if there == self._local_index(job, info.step):
                j.know(info.step)
            else:
                log.info("upload resumed after restart: the bucket's step of this number is another save",
                         extra={"ctx": {"job": job, "step": info.step, "bucket_newest": newest}})
                self.committed(job, info.step)

    async def _same_there(self, job: str, step: int, j: JobUploads) -> bool:
        """Whether the bucket holds ``step`` committed with this node's index.json, byte for byte (then
        it is known); False when it does not, holds another save of that number, or cannot be asked."""
        try:
            there = await in_thread(lambda: self._bucket_index(job, step))
        except BucketError:
            return False
        if there is not None and there == self._local_index(job, step):
            j.know(step)
            return True
        return False

    def _bucket_index(self, job: str, step: int) -> bytes | None:
        """The bucket's index.json of ``step``, None when it has none (blocking)."""
        try:
            return self.bucket.get_if_exists(self.bucket.step_key(job, step, INDEX_NAME), MAX_INDEX_BYTES)
        except TooLarge:
            return b"\0"       # no index a daemon writes: unlike every local one

    def _local_index(self, job: str, step: int) -> bytes | None:
        return local_index(self.root, job, step)

    async def _until_answered(self, fn: Callable[[], T]) -> T:
        """``fn`` (a bucket request) on a thread, again with backoff until the bucket answers."""
        delay, failed = 1.0, False
        while True:
            try:
                got = await in_thread(fn)
            except BucketError as e:
                self.problem, failed = str(e), True
                await asyncio.sleep(self._backoff(delay))
                delay *= 2
                continue
            if failed:
                self.problem = None     # it answers again (nothing may be left to upload that would say so)
            return got

    def _backoff(self, delay: float) -> float:
        return min(delay, self.settings.retry_max_interval) * random.uniform(0.5, 1.0)

    async def _work(self, job: str) -> None:
        j = self.jobs[job]
        try:
            while j.queued:
                step = j.queued.popleft()
                j.uploading = step
                try:
                    await self._upload(job, step, j)
                finally:
                    j.uploading = None
                    self._changed.set()
        finally:
            self._workers.pop(job, None)

    async def _upload(self, job: str, step: int, j: JobUploads) -> None:
        delay = 1.0
        while True:
            t0 = time.monotonic()
            try:
                nbytes = await in_thread(lambda: upload_step(self.bucket, self.root, job, step,
                                                             lambda: self._bucket_index(job, step), self.debug_delay))
            except StepWithdrawn as e:        # ckptd gc --remove-above, or a save of this number again
                j.skipped += 1
                j.last_error = str(e)
                log.warning("upload withdrawn: the local step went while it uploaded",
                            extra={"ctx": {"job": job, "step": step, "error": str(e)}})
                return
            except (IncompleteStep, FormatError, ValueError) as e:
                j.skipped += 1
                j.last_error = str(e)
                log.warning("upload skipped: the local step is not whole", extra={"ctx": {"job": job, "step": step,
                                                                                         "error": str(e)}})
                return
            except CredentialsError as e:      # retrying with credentials that cannot be renewed cannot help
                j.failures += 1
                j.skipped += 1
                j.last_error = self.problem = str(e)
                log.error("upload failed: the S3 credentials cannot be used; not retried (the next step's upload "
                          "tries again)", extra={"ctx": {"job": job, "step": step, "error": str(e)}})
                return
            except (BucketError, OSError) as e:
                j.failures += 1
                j.last_error = describe_error(e) if isinstance(e, OSError) else str(e)
                self.problem = j.last_error     # (ckptd_bucket_ok 0, status's problem) until an upload succeeds
                if not is_committed(step_dir(self.root, job, step)):
                    j.skipped += 1
                    log.warning("upload skipped: the local step is gone", extra={"ctx": {"job": job, "step": step}})
                    return
                if j.queued:
                    j.skipped += 1
                    log.warning("upload failed; a newer step is queued, skipping this one",
                                extra={"ctx": {"job": job, "step": step, "error": j.last_error}})
                    return
                wait = self._backoff(delay)
                log.warning("upload failed; retrying", extra={"ctx": {"job": job, "step": step,
                                                                     "error": j.last_error, "retry_in_s": wait}})
                await asyncio.sleep(wait)
                delay *= 2
                continue
            since = self._committed_at.pop((job, step), t0)
            j.uploaded += 1
            j.bytes += nbytes
            j.last_error = None
            j.last_seconds = time.monotonic() - since
            self.problem = None
            log.info("uploaded", extra={"ctx": {"job": job, "step": step, "bytes": nbytes,
                                                "upload_s": round(time.monotonic() - t0, 3),
                                                "since_commit_s": round(j.last_seconds, 3)}})
            # Retention before the step is known: it may remove this very step (newer ones there), and a
            # flush waiting for it must not answer uploaded for a step already being deleted.
            gone: list[int] = []
            kept: list[int] = []
            try:
                kept = await in_thread(functools.partial(self._bucket_retention, job, step, gone))
            except BucketError as e:
                log.warning("bucket retention failed", extra={"ctx": {"job": job, "error": str(e)}})
            for old in gone:
                j.forget(old)
            if step not in gone:
                j.know(step)
                j.in_bucket = max(step, j.in_bucket if j.in_bucket is not None else -1)
            if j.in_bucket in gone:        # (newer steps are there: retention keeps the newest)
                j.in_bucket = max(kept, default=None)
            self._changed.set()
            return

    def _bucket_retention(self, job: str, newest: int, gone: list[int]) -> list[int]:
        """Keep the newest ``keep_last`` committed steps; drop prefixes older than ``newest``
        that never got an index (uploads killed or skipped halfway). Each committed step it
        removes is put in ``gone`` as its removal starts; returns the committed steps kept."""
        committed, partial = self.bucket.steps(job)
        keep = self.settings.keep_last
        doomed = committed[:-keep] if keep and len(committed) > keep else []
        for step in doomed + [s for s in partial if s < newest]:
            if step in doomed:
                gone.append(step)
            self.bucket.delete_step(job, step)
            log.info("bucket retention removed step", extra={"ctx": {"job": job, "step": step}})
        return [s for s in committed if s not in doomed]
