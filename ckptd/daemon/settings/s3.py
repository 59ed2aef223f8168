"""``[s3]``: the object-storage tier behind the local root (off unless ``s3.url`` is set).

Credentials are not settings: they come from the standard AWS chain (see s3_store.py) so they
never sit in ckptd's config file, its flags or its logs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ckptd.daemon.settings.spec import Flag, integer, parse_duration, parse_size, setting, show_duration, show_size

MiB = 1024 * 1024


def parse_bucket_url(v: object) -> str | None:
    """``s3://bucket[/prefix]``; empty: off."""
    if v is None or v == "":
        return None
    if not isinstance(v, str) or not v.startswith("s3://") or not v[5:].split("/", 1)[0]:
        raise ValueError(f"expected s3://bucket[/prefix], got {str(v)[:80]!r}")
    return v.rstrip("/")


def parse_endpoint(v: object) -> str | None:
    if v is None or v == "":
        return None
    if not isinstance(v, str) or not v.startswith(("http://", "https://")):
        raise ValueError(f"expected an http:// or https:// URL, got {str(v)[:80]!r}")
    return v.rstrip("/")


def parse_part_size(v: object) -> int:
    n = parse_size(v)
    if not 5 * MiB <= n <= 1024 * MiB:
        raise ValueError(f"must be between 5MiB and 1GiB (S3's multipart limits), got {n}")
    return n


def parse_region(v: object) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[a-z0-9-]{1,64}", v):
        raise ValueError(f"expected a region name like us-east-1, got {str(v)[:80]!r}")
    return v


def parse_request_timeout(v: object) -> float:
    s = parse_duration(v)
    if not 1.0 <= s <= 3600.0:
        raise ValueError(f"must be between 1s and 1h, got {s:g}s")
    return s


def _show_opt(v: object) -> str:
    return '""' if v is None else f'"{v}"'


@dataclass(frozen=True)
class S3Settings:
    """``[s3]``: uploads of committed steps to an S3-compatible bucket, and restores from it."""
    url: str | None = setting(
        None, parse=parse_bucket_url, show=_show_opt, default_doc="off", flags=(Flag("--s3-url"),), gc=True,
        doc="Bucket and prefix, `\"s3://bucket/prefix\"`: each committed step is uploaded to "
            "`<prefix>/<job>/step-<N>/` (index.json last). Unset: no object-storage tier.")
    endpoint: str | None = setting(
        None, parse=parse_endpoint, show=_show_opt, default_doc="AWS", flags=(Flag("--s3-endpoint"),), gc=True,
        doc="S3 API endpoint of a non-AWS store (MinIO, Ceph RGW, SeaweedFS, GCS): `\"https://host:port\"`. "
            "`http://` is allowed (for a loopback or private endpoint).")
    region: str = setting(
        "us-east-1", parse=parse_region, flags=(Flag("--s3-region"),), gc=True,
        doc="Region of the bucket (signing region for other stores).")
    request_timeout: float = setting(
        15.0, parse=parse_request_timeout, show=show_duration, flags=(Flag("--s3-request-timeout"),), gc=True,
        doc="How long a listing, HEAD, delete or GET of a small object (an index.json, a manifest) may take, "
            "retries included, before it fails; each try gets a third of it. What an endpoint that accepts "
            "connections and never answers costs a restore of a step this node has, or `ckptd ls`. Uploads and "
            "data GETs have their own, longer bounds (5 min a request, retried for 2 min).")
    concurrency: int = setting(
        8, parse=integer(1, 256), flags=(Flag("--s3-concurrency"),),
        doc="Parallel requests per file: multipart upload parts and ranged GETs.")
    part_size: int = setting(
        16 * MiB, parse=parse_part_size, show=show_size,
        flags=(Flag("--s3-part-size"),),
        doc="Multipart part size and ranged-GET size, 5 MiB–1 GiB; files up to this size go in one request.")
    keep_last: int = setting(
        10, parse=integer(0),
        flags=(Flag("--s3-keep-last"),),
        doc="Keep the newest N committed steps per job in the bucket; `0` keeps all. Local retention is "
            "`[retention]`'s.")
    queue_depth: int = setting(
        1, parse=integer(1, 1000),
        flags=(Flag("--s3-queue-depth"),),
        doc="Committed steps per job waiting for upload behind the one uploading. When a commit finds the "
            "queue full the oldest waiting step is skipped (the newest is always uploaded); see "
            "`ckptd_uploads_skipped_total`.")
    retry_max_interval: float = setting(
        30.0, parse=parse_duration, show=show_duration,
        flags=(Flag("--s3-retry-max-interval"),),
        doc="A failed upload is retried forever (until a newer step replaces it), backing off exponentially "
            "with jitter up to this interval.")
