"""The object-storage tier as the daemon sees it: the bucket behind the local file-system tier.

Saves and commits go to the local root exactly as without it (FsTier); this room adds the
second level: background uploads of committed steps (uploader.py), staging of steps from the
bucket for restores (stage.py, op ``stage``), flushing the newest step on preemption (op
``flush``), its status and its metrics. The server calls, in order: ``BucketService.create`` (None
when ``s3.url`` is unset), ``start`` once serving, ``committed`` after each local commit,
``pending`` from local retention (steps it must spare), ``finish`` after the drain.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from ckptd.core.errors import ErrorCode
from ckptd.core.names import is_seconds, is_step
from ckptd.core.protocol import Flush, Stage
from ckptd.daemon.runtime import RequestError, TaskSet
from ckptd.daemon.settings.config import DaemonConfig
from ckptd.daemon.tiers.s3.bucket import Bucket, BucketError
from ckptd.daemon.tiers.s3.stage import Stager
from ckptd.daemon.tiers.s3.uploader import Uploader

log = logging.getLogger("ckptd")
MAX_FLUSH_S = 3600.0


class BucketService:
    def __init__(self, bucket: Bucket, root: str, tasks: TaskSet, debug_delay: float = 0.0) -> None:
        self.bucket = bucket
        self.uploader = Uploader(bucket, root, tasks, debug_delay=debug_delay)
        self.stager = Stager(bucket, root)

    @classmethod
    def create(cls, config: DaemonConfig, root: str, tasks: TaskSet, registry: CollectorRegistry
               ) -> BucketService | None:
        if config.s3.url is None:
            return None
        try:
            bucket = Bucket(config.s3)
        except BucketError as e:     # obstore missing, an unreadable credentials file: local saves go on
            log.error("object-storage tier off", extra={"ctx": {"url": config.s3.url, "error": str(e)}})
            return None
        tier = cls(bucket, root, tasks, config.debug.upload_delay)
        registry.register(_UploadCollector(tier.uploader))
        return tier

    def start(self) -> None:
        log.info("object-storage tier", extra={"ctx": {"url": self.bucket.url,
                                                       "endpoint": self.bucket.settings.endpoint or "AWS"}})
        self.uploader.start()

    def committed(self, job: str, step: int) -> None:
        self.uploader.committed(job, step)

    def pending(self, job: str) -> list[int]:
        return self.uploader.pending(job)

    async def finish(self, timeout: float) -> None:
        await self.uploader.finish(timeout)

    def status(self) -> dict[str, Any]:
        return {**self.uploader.status(), "staging": self.stager.stats.view()}

    async def stage(self, s: Stage) -> dict[str, Any]:
        step = _step_or_none(s.step)
        reader = s.reader
        if reader is not None and not (isinstance(reader, list) and len(reader) == 2
                                       and all(type(r) is int for r in reader) and 0 <= reader[0] < reader[1]):
            raise RequestError("stage: reader must be [rank, world_size] or null")
        try:
            return await self.stager.stage(s.job, step, None if reader is None else (reader[0], reader[1]))
        except ValueError as e:      # a bad job name
            raise RequestError(f"stage: {e}") from None

    async def flush(self, f: Flush) -> dict[str, Any]:
        step = _step_or_none(f.step)
        if not is_seconds(f.timeout, MAX_FLUSH_S):     # NaN and 10**400 too
            raise RequestError(f"flush: timeout must be 0..{MAX_FLUSH_S:g} seconds")
        timeout = float(f.timeout)
        try:
            ok, detail = await self.uploader.flush(f.job, step, timeout)
        except ValueError as e:      # a bad job name
            raise RequestError(f"flush: {e}") from None
        (log.info if ok else log.error)("flush " + ("done" if ok else "did not finish"),
                                        extra={"ctx": {"job": f.job, "step": step, "detail": detail}})
        return {"uploaded": ok, "detail": detail}


def _step_or_none(step: Any) -> int | None:
    if step is not None and not is_step(step):
        raise RequestError("step must be a step number or null")
    return step


Handler = Callable[[Any, Any], Awaitable[tuple[dict[str, Any], list[int]]]]


def bucket_ops(tier: BucketService | None) -> dict[type, Handler]:
    """The op-table entries of ``stage`` and ``flush`` (an error when no bucket is configured)."""
    def need() -> BucketService:
        if tier is None:
            raise RequestError("this daemon has no object-storage tier (s3.url is not set)", ErrorCode.NO_BUCKET)
        return tier

    async def stage(_session: Any, s: Stage) -> tuple[dict[str, Any], list[int]]:
        return await need().stage(s), []

    async def flush(_session: Any, f: Flush) -> tuple[dict[str, Any], list[int]]:
        return await need().flush(f), []
    return {Stage: stage, Flush: flush}


class _UploadCollector(Collector):
    """Upload counters per job, read from the uploader at scrape time."""

    def __init__(self, uploader: Uploader) -> None:
        self.uploader = uploader

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        jobs = dict(self.uploader.jobs)
        families = {
            "uploaded": CounterMetricFamily("ckptd_uploads_completed", "Steps committed in the bucket.",
                                            labels=["job"]),
            "skipped": CounterMetricFamily("ckptd_uploads_skipped", "Committed steps not uploaded because a newer "
                                           "one was queued (uploads behind) or the local step was gone.",
                                           labels=["job"]),
            "failures": CounterMetricFamily("ckptd_upload_failures", "Upload attempts that failed (each is retried).",
                                            labels=["job"]),
            "bytes": CounterMetricFamily("ckptd_upload_bytes", "Bytes uploaded to the bucket.", labels=["job"]),
        }
        queued = GaugeMetricFamily("ckptd_upload_queue", "Steps uploading or waiting to upload.", labels=["job"])
        latest = GaugeMetricFamily("ckptd_upload_last_seconds", "Local commit to bucket commit of the last upload.",
                                   labels=["job"])
        for job, j in jobs.items():
            for key, fam in families.items():
                fam.add_metric([job], getattr(j, key))
            queued.add_metric([job], len(j.queued) + (j.uploading is not None))
            if j.last_seconds is not None:
                latest.add_metric([job], j.last_seconds)
        yield from families.values()
        yield queued
        yield latest
        yield GaugeMetricFamily("ckptd_bucket_ok", "1 when the last bucket check or upload succeeded.",
                                value=0.0 if self.uploader.problem else 1.0)


__all__ = ["BucketError", "BucketService", "bucket_ops"]
