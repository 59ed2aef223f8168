"""The object-store client: one S3-compatible bucket and prefix, through ``obstore``.

Why obstore (the Rust ``object_store`` crate): transfers run in Rust without the GIL, so
multipart uploads and parallel ranged GETs keep the daemon's Python threads free, and it
retries throttling, 5xx and connection errors with jittered exponential backoff itself. Its
multipart upload beat boto3's ``upload_file`` of the same bytes (benchmarks/s3_bench.py) and
its ranged GETs were ~2.5x faster than boto3's ``download_file`` here. Integrity: requests
are signed with their payload's SHA-256 (SigV4 signed payload), which the server checks
against the body; sizes are checked after each upload; what is downloaded is checked by the
format's own digests (index digest, manifest digests, chunk checksums: stage.py, the reader).

Credentials, in the standard AWS order: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``; else the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE`` or
``~/.aws/credentials``, profile ``AWS_PROFILE`` or ``default``); else what obstore finds itself
(web identity, ECS container credentials, EC2 instance metadata). They are never logged.

Every method blocks: callers run them on their own threads.
"""
from __future__ import annotations

import configparser
import os
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptd.core import storage
from ckptd.core.names import INDEX_NAME, parse_step_dir_name, step_dir_name, temp_name, validate_job
from ckptd.daemon.s3_settings import S3Settings


class BucketError(Exception):
    """A bucket request failed for good (after obstore's retries); the message says why."""


def _obstore() -> Any:
    """obstore, imported when a bucket is first used: it is the ``[s3]`` extra, so a daemon or CLI
    installed without it runs everything but the object-storage tier."""
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as e:
        raise BucketError(f"the object-storage tier needs obstore ({e}); install it with "
                          "`pip install 'ckptd[s3]'`") from None
    return obstore


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → (bucket, prefix)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def load_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """Static credentials from the environment, else the shared credentials file; {} if neither."""
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        creds = {"access_key_id": env["AWS_ACCESS_KEY_ID"], "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
        if env.get("AWS_SESSION_TOKEN"):
            creds["token"] = env["AWS_SESSION_TOKEN"]
        return creds
    path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except configparser.Error as e:
        raise BucketError(f"cannot parse the shared credentials file {path}: {type(e).__name__}") from None
    section = env.get("AWS_PROFILE") or "default"
    if parser.has_section(section) and parser.has_option(section, "aws_access_key_id"):
        s = parser[section]
        creds = {"access_key_id": s["aws_access_key_id"], "secret_access_key": s.get("aws_secret_access_key", "")}
        if s.get("aws_session_token"):
            creds["token"] = s["aws_session_token"]
        return creds
    return {}


def explain(e: BaseException, what: str) -> BucketError:
    """A clear, credential-free reason for a failed request."""
    full = str(e)
    code = re.search(r"<Code>([A-Za-z]+)</Code>", full)
    status = re.search(r"status code: ([0-9]{3})", full)
    detail = code.group(1) if code else (f"HTTP {status.group(1)}" if status else full.split("\n", 1)[0][:300])
    exc = _obstore().exceptions
    if isinstance(e, (exc.UnauthenticatedError, exc.PermissionDeniedError)) or (status and status.group(1) == "403") \
            or detail in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return BucketError(f"{what}: the bucket refused the credentials ({detail}); check AWS_ACCESS_KEY_ID / "
                           "the credentials file / the instance role")
    if detail == "NoSuchBucket" or (status and status.group(1) == "404" and "list request" in full):
        return BucketError(f"{what}: the bucket does not exist ({detail})")
    if "error sending request" in full or "connect" in full.lower():
        return BucketError(f"{what}: cannot reach the endpoint ({full.split(chr(10), 1)[0][-200:]})")
    return BucketError(f"{what}: {type(e).__name__}: {detail}")


class Bucket:
    """A bucket and prefix; keys are ``<job>/step-<N>/<file>`` below the prefix (FORMAT.md)."""

    def __init__(self, settings: S3Settings, env: Mapping[str, str] | None = None) -> None:
        assert settings.url is not None
        self.settings = settings
        self.url = settings.url
        self.bucket, self.prefix = split_url(settings.url)
        env = os.environ if env is None else env
        options: Any = {"connect_timeout": "5s", "timeout": "300s"}
        if settings.endpoint and settings.endpoint.startswith("http://"):
            options["allow_http"] = True
        config: Any = {"region": settings.region, **load_credentials(env)}
        if settings.endpoint:
            config["endpoint"] = settings.endpoint
        retry: Any = {"max_retries": 6, "retry_timeout": timedelta(seconds=120),
                      "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=8),
                                  "base": 2}}
        self._ob = ob = _obstore()
        self.store = ob.store.S3Store(self.bucket, prefix=self.prefix or None, config=config,
                                      client_options=options, retry_config=retry)

    @staticmethod
    def step_key(job: str, step: int, name: str = "") -> str:
        return f"{validate_job(job)}/{step_dir_name(step)}/{name}"

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except (OSError, ValueError, RuntimeError, Exception) as e:
            raise explain(e, what) from None

    # ---- checks and listings ------------------------------------------------------------

    def check(self) -> None:
        """BucketError unless the bucket exists and takes these credentials (one LIST request)."""
        def first() -> None:
            for _batch in self._ob.list(self.store, chunk_size=1):
                break
        self._call(f"{self.url}", first)

    def names(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of every object under ``prefix`` (below the bucket prefix)."""
        def listing() -> list[tuple[str, int]]:
            return [(m["path"], m["size"]) for batch in self._ob.list(self.store, prefix=prefix, chunk_size=1000)
                    for m in batch]
        return list(self._call(f"list {self.url}/{prefix}", listing))

    def jobs(self) -> list[str]:
        out = self._call(f"list {self.url}", self._ob.list_with_delimiter, self.store)
        jobs = []
        for p in out["common_prefixes"]:
            name = p.rstrip("/").rsplit("/", 1)[-1]
            try:
                jobs.append(validate_job(name))
            except ValueError:
                continue     # not ours: a bucket name never escapes (names.py)
        return sorted(jobs)

    def steps(self, job: str) -> tuple[list[int], list[int]]:
        """(committed, uncommitted) step numbers of ``job`` in the bucket, each sorted."""
        seen: dict[int, bool] = {}
        for key, _size in self.names(f"{validate_job(job)}/"):
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != job:
                continue
            step = parse_step_dir_name(parts[1])
            if step is not None:
                seen[step] = seen.get(step, False) or parts[2] == INDEX_NAME
        return sorted(s for s, c in seen.items() if c), sorted(s for s, c in seen.items() if not c)

    def latest(self, job: str) -> int | None:
        committed, _ = self.steps(job)
        return committed[-1] if committed else None

    # ---- transfers ----------------------------------------------------------------------

    def upload_file(self, path: str, key: str) -> int:
        """Upload one local file (multipart, ``concurrency`` parts in flight when larger than a
        part); returns its size, checked against the object's."""
        size = os.path.getsize(path)
        s = self.settings

        # A Path: obstore reads the file in Rust, without the GIL.
        self._call(f"upload {key}", self._ob.put, self.store, key, Path(path), use_multipart=size > s.part_size,
                   chunk_size=s.part_size, max_concurrency=s.concurrency)
        stored = self._call(f"head {key}", self._ob.head, self.store, key)["size"]
        if stored != size:
            raise BucketError(f"upload {key}: the bucket holds {stored} bytes, the file has {size}")
        return size

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(f"upload {key}", self._ob.put, self.store, key, data)

    def get_bytes(self, key: str, limit: int) -> bytes:
        size = self._call(f"head {key}", self._ob.head, self.store, key)["size"]
        if size > limit:
            raise BucketError(f"{key}: {size} bytes, over the {limit}-byte limit")
        return bytes(self._call(f"get {key}", lambda: self._ob.get(self.store, key).bytes()))

    def exists(self, key: str) -> bool:
        try:
            self._ob.head(self.store, key)
            return True
        except self._ob.exceptions.NotFoundError:
            return False
        except Exception as e:
            raise explain(e, f"head {key}") from None

    def download(self, key: str, path: str, size: int | None = None) -> int:
        """Parallel ranged GETs (``concurrency`` parts of ``part_size`` at a time) into ``path``
        (via a temp file, fsynced, renamed): the file appears whole or not at all."""
        total = self._call(f"head {key}", self._ob.head, self.store, key)["size"]
        if size is not None and total != size:
            raise BucketError(f"{key}: the bucket holds {total} bytes, expected {size}")
        part, batch = self.settings.part_size, self.settings.part_size * self.settings.concurrency
        tmp = temp_name(path)
        fd = storage.open_for_write(tmp)
        try:
            for base in range(0, total, batch):
                starts = list(range(base, min(base + batch, total), part))
                ends = [min(s + part, total) for s in starts]
                pieces = self._call(f"get {key}", self._ob.get_ranges, self.store, key, starts=starts, ends=ends)
                for start, piece in zip(starts, pieces, strict=True):
                    view = memoryview(piece)
                    written = 0
                    while written < len(view):
                        written += os.pwrite(fd, view[written:], start + written)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, path)
        return total

    def delete_step(self, job: str, step: int) -> None:
        """index.json first (the step stops being committed), then the rest."""
        keys = [k for k, _ in self.names(self.step_key(job, step))]
        index = self.step_key(job, step, INDEX_NAME)
        if index in keys:
            self._call(f"delete {index}", self._ob.delete, self.store, index)
        rest = [k for k in keys if k != index]
        if rest:
            self._call(f"delete {self.step_key(job, step)}", self._ob.delete, self.store, rest)
