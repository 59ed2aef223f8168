"""The object-store client: one S3-compatible bucket and prefix, through ``obstore``.

Why obstore (the Rust ``object_store`` crate): transfers run in Rust without the GIL, so
multipart uploads and parallel ranged GETs keep the daemon's Python threads free, and it
retries throttling, 5xx and connection errors with jittered exponential backoff itself. Its
multipart upload beat boto3's ``upload_file`` of the same bytes (benchmarks/s3_bench.py) and
its ranged GETs were ~2.5x faster than boto3's ``download_file`` here. Integrity: requests
are signed with their payload's SHA-256 (SigV4 signed payload), which the server checks
against the body; sizes are checked after each upload; what is downloaded is checked by the
format's own digests (index digest, manifest digests, chunk checksums: stage.py, the reader).

Credentials, in the standard AWS order (s3_credentials.py): ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``; else web identity (obstore's, renewed by it);
else the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE`` or ``~/.aws/credentials``,
profile ``AWS_PROFILE`` or ``default``), read again whenever it changes; else what obstore finds
itself (ECS container credentials, EC2 instance metadata). They are never logged. A request that
fails because the credentials cannot be renewed (or expired) raises ``CredentialsError``: retrying
it cannot help until someone fixes them.

Timeouts: listings, HEADs, deletes and GETs of small objects (index.json, manifests) go through a
client whose requests time out in seconds (an endpoint that accepts connections and never answers
fails them in about 15 s); uploads and ranged GETs of data through one that allows minutes
(``SHORT_TIMEOUT``, ``DATA_TIMEOUT``).

Every method blocks: callers run them on their own threads.
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptd.core import storage
from ckptd.core.names import INDEX_NAME, parse_step_dir_name, step_dir_name, temp_name, validate_job
from ckptd.daemon.settings.s3 import S3Settings
from ckptd.daemon.tiers.s3.credentials import CredentialsUnusable, FileCredentials, resolve


class BucketError(Exception):
    """A bucket request failed for good (after obstore's retries); the message says why."""


class CredentialsError(BucketError):
    """A request failed because the credentials could not be renewed or have expired: retrying it
    with the same credentials cannot succeed (uploads give up on the step; the log says why)."""


class SizeMismatch(BucketError):
    """An object whose size is not the one expected (index.json's, or the file uploaded)."""


class TooLarge(BucketError):
    """An object over the size its reader accepts (an index.json no daemon wrote)."""


CONNECT_TIMEOUT = "5s"
# Listings, HEADs, deletes and GETs of small objects (an index.json or manifest up to SMALL_OBJECT_BYTES:
# 200 KB/s suffices) get ``s3.request_timeout`` in all: a third of it per try (the response and its body),
# obstore retrying one that times out until the whole has passed. So an endpoint that never answers fails
# such a call in about that time (a restore of a step this node has, `ckptd ls ROOT`), not in DATA_TIMEOUT.
SMALL_OBJECT_BYTES = 1 << 20
# Data: every upload (a background one may be slow), ranged GETs of ``part_size``, larger GETs.
DATA_TIMEOUT = "300s"
DATA_RETRY_TIMEOUT_S = 120.0

EXPIRED_CODES = ("ExpiredToken", "TokenRefreshRequired", "RequestExpired")


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


def explain(e: BaseException, what: str) -> BucketError:
    """A clear, credential-free reason for a failed request."""
    full = str(e)
    code = re.search(r"<Code>([A-Za-z]+)</Code>", full)
    status = re.search(r"status code: ([0-9]{3})", full)
    detail = code.group(1) if code else (f"HTTP {status.group(1)}" if status else full.split("\n", 1)[0][:300])
    exc = _obstore().exceptions
    if detail in EXPIRED_CODES:
        return CredentialsError(f"{what}: the bucket says the credentials expired ({detail}); credentials from "
                                "the environment cannot be renewed while the daemon runs: use a credentials file "
                                "kept current, web identity or an instance role, or restart with new ones")
    if isinstance(e, (exc.UnauthenticatedError, exc.PermissionDeniedError)) or (status and status.group(1) == "403") \
            or detail in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return BucketError(f"{what}: the bucket refused the credentials ({detail}); check AWS_ACCESS_KEY_ID / "
                           "the credentials file / the instance role")
    if detail == "NoSuchBucket" or (status and status.group(1) == "404" and "list request" in full):
        return BucketError(f"{what}: the bucket does not exist ({detail})")
    if "error sending request" in full or "connect" in full.lower():
        first = full.split(chr(10), 1)[0]       # (its start: the end of a long line cut "Generic" to "ic")
        return BucketError(f"{what}: cannot reach the endpoint ({first[:200]}{'…' if len(first) > 200 else ''})")
    return BucketError(f"{what}: {type(e).__name__}: {detail}")


class Bucket:
    """A bucket and prefix; keys are ``<job>/step-<N>/<file>`` below the prefix (FORMAT.md)."""

    def __init__(self, settings: S3Settings, env: Mapping[str, str] | None = None) -> None:
        assert settings.url is not None
        self.settings = settings
        self.url = settings.url
        self.bucket, self.prefix = split_url(settings.url)
        env = os.environ if env is None else env
        options: Any = {"connect_timeout": CONNECT_TIMEOUT}
        if settings.endpoint and settings.endpoint.startswith("http://"):
            options["allow_http"] = True
        try:
            static, self.credentials = resolve(env)
        except CredentialsUnusable as e:
            raise BucketError(str(e)) from None
        config: Any = {"region": settings.region, **static}
        if settings.endpoint:
            config["endpoint"] = settings.endpoint
        backoff = {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=8), "base": 2}
        self._ob = ob = _obstore()

        def store(timeout: str, retry_timeout: float) -> Any:
            return ob.store.S3Store(self.bucket, prefix=self.prefix or None, config=config,
                                    client_options={**options, "timeout": timeout},
                                    credential_provider=self.credentials,
                                    retry_config={"max_retries": 6, "retry_timeout": timedelta(seconds=retry_timeout),
                                                  "backoff": backoff})
        # Two clients: an endpoint that accepts connections and never answers holds a request until its
        # timeout (obstore retries a timed-out request within retry_timeout). Listings, HEADs, deletes and
        # GETs of small objects go through ``store``, bounded in seconds (a restore, `ckptd ls`); uploads and
        # data through ``data_store``, whose requests may take minutes.
        self.store = store(f"{round(settings.request_timeout * 1000 / 3)}ms", settings.request_timeout)
        self.data_store = store(DATA_TIMEOUT, DATA_RETRY_TIMEOUT_S)

    def _store_for(self, size: int) -> Any:
        """The client for a GET of ``size`` bytes: the short one up to SMALL_OBJECT_BYTES."""
        return self.store if size <= SMALL_OBJECT_BYTES else self.data_store

    @staticmethod
    def step_key(job: str, step: int, name: str = "") -> str:
        return f"{validate_job(job)}/{step_dir_name(step)}/{name}"

    def key_url(self, key: str) -> str:
        """``s3://bucket/prefix/<key>``: how errors name an object."""
        return f"{self.url}/{key}"

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as e:
            raise self._explain(e, what) from None

    def _explain(self, e: BaseException, what: str) -> BucketError:
        creds: FileCredentials | None = self.credentials
        if creds is not None and creds.failure and "credential provider" in str(e):
            return CredentialsError(f"{what}: the S3 credentials could not be renewed: {creds.failure}; fix the "
                                    "file (or whatever writes it) and the next upload uses it")
        return explain(e, what)

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
        part); returns its size, checked against the object's. The file is opened here, never
        through a symlink and only if regular (``storage.open_regular``: OSError, NotRegular), and
        obstore reads that open file (``/proc/self/fd``), not whatever the path names later."""
        s = self.settings
        fd, st = storage.open_regular(path)
        try:
            size = st.st_size
            # A Path: obstore reads the file in Rust, without the GIL.
            self._call(f"upload {key}", self._ob.put, self.data_store, key, Path(f"/proc/self/fd/{fd}"),
                       use_multipart=size > s.part_size, chunk_size=s.part_size, max_concurrency=s.concurrency)
        finally:
            os.close(fd)
        stored = self._call(f"head {key}", self._ob.head, self.store, key)["size"]
        if stored != size:
            raise BucketError(f"upload {key}: the bucket holds {stored} bytes, the file has {size}")
        return size

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(f"upload {key}", self._ob.put, self.data_store, key, data)

    def get_bytes(self, key: str, limit: int) -> bytes:
        size = self._call(f"head {key}", self._ob.head, self.store, key)["size"]
        if size > limit:
            raise TooLarge(f"{key}: {size} bytes, over the {limit}-byte limit")
        return bytes(self._call(f"get {key}", lambda: self._ob.get(self._store_for(size), key).bytes()))

    def get_if_exists(self, key: str, limit: int) -> bytes | None:
        """The object's bytes, None when there is none; over ``limit`` bytes: TooLarge."""
        size = self._size_if_exists(key)
        if size is None:
            return None
        if size > limit:
            raise TooLarge(f"{key}: {size} bytes, over the {limit}-byte limit")
        try:
            return bytes(self._ob.get(self._store_for(size), key).bytes())
        except (self._ob.exceptions.NotFoundError, FileNotFoundError):    # deleted since the HEAD
            return None
        except Exception as e:
            raise self._explain(e, f"get {key}") from None

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", self._ob.delete, self.store, key)

    def exists(self, key: str) -> bool:
        return self._size_if_exists(key) is not None

    def _size_if_exists(self, key: str) -> int | None:
        """The object's size (a HEAD), None when there is none."""
        try:
            return int(self._ob.head(self.store, key)["size"])
        except (self._ob.exceptions.NotFoundError, FileNotFoundError):    # obstore's head: the builtin
            return None
        except Exception as e:
            raise self._explain(e, f"head {key}") from None

    def download(self, key: str, path: str, size: int | None = None,
                 check: Callable[[str], None] | None = None) -> int:
        """Parallel ranged GETs (``concurrency`` parts of ``part_size`` at a time) into ``path``
        via a temp file (fsynced; ``check(temp path)`` may refuse it by raising; then renamed): the
        file appears whole and checked, or not at all. The temp name is one retention knows as ckptd's."""
        total = self._call(f"head {key}", self._ob.head, self.store, key)["size"]
        if size is not None and total != size:
            raise SizeMismatch(f"{key}: the bucket holds {total} bytes, index.json says {size}")
        part, batch = self.settings.part_size, self.settings.part_size * self.settings.concurrency
        tmp = temp_name(path)
        fd = storage.open_for_write(tmp)
        try:
            try:
                for base in range(0, total, batch):
                    starts = list(range(base, min(base + batch, total), part))
                    ends = [min(s + part, total) for s in starts]
                    pieces = self._call(f"get {key}", self._ob.get_ranges, self.data_store, key,
                                        starts=starts, ends=ends)
                    for start, piece in zip(starts, pieces, strict=True):
                        view = memoryview(piece)
                        written = 0
                        while written < len(view):
                            written += os.pwrite(fd, view[written:], start + written)
                os.fsync(fd)
            finally:
                os.close(fd)
            if check is not None:
                check(tmp)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.rename(tmp, path)
        storage.fsync_dir(os.path.dirname(path))   # the entry too: into a staged step already committed, no later
        return total                               # index.json rename fsyncs the directory for it

    def delete_step(self, job: str, step: int) -> None:
        """index.json first (the step stops being committed), then the rest."""
        keys = [k for k, _ in self.names(self.step_key(job, step))]
        index = self.step_key(job, step, INDEX_NAME)
        if index in keys:
            self._call(f"delete {index}", self._ob.delete, self.store, index)
        rest = [k for k in keys if k != index]
        if rest:
            self._call(f"delete {self.step_key(job, step)}", self._ob.delete, self.store, rest)
