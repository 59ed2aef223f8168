"""The command line's object-storage side: ``ckptd ls|verify s3://...``, the tier column of
``ckptd ls ROOT``, and the bucket check of ``ckptd serve --check-config``.

The bucket's endpoint and region come from the same settings as the daemon's (config file,
``CKPTD_S3_*``, or ``--s3-endpoint``); credentials from the standard AWS chain.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ckptd import cli_steps  # (it imports this module too: its names are read at call time)
from ckptd.core import protocol
from ckptd.core.errors import ProtocolError
from ckptd.core.names import INDEX_NAME, step_dir_name, validate_job
from ckptd.core.reader import Fault, verify_step
from ckptd.daemon.settings.config import ConfigError, load_settings
from ckptd.daemon.settings.s3 import S3Settings
from ckptd.daemon.tiers.s3.bucket import Bucket, BucketError
from ckptd.daemon.tiers.s3.stage import Stager


def add_bucket_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--s3-endpoint", help="S3 endpoint of a non-AWS store (default: s3.endpoint of the config)")
    parser.add_argument("--config", help="TOML config file for the [s3] settings (default: as serve)")


def s3_settings(args: argparse.Namespace, url: str | None = None) -> S3Settings:
    cli: dict[str, object] = {"s3.url": url} if url else {}
    if getattr(args, "s3_endpoint", None):
        cli["s3.endpoint"] = args.s3_endpoint
    return load_settings(getattr(args, "config", None), cli=cli, require_root=False).settings.s3


def check_bucket(s3: S3Settings) -> str | None:
    """Why the configured bucket is unusable (credentials, missing bucket, unreachable), or None."""
    if s3.url is None:
        return None
    try:
        Bucket(s3).check()
    except BucketError as e:
        return str(e)
    return None


def remove_above(s3: S3Settings, jobs: list[str], above: int, dry_run: bool) -> tuple[list[str], list[str]]:
    """``ckptd gc --remove-above``'s bucket side: the steps of ``jobs`` numbered above ``above`` in the
    configured bucket (else none), removed unless ``dry_run`` (``index.json`` first, as bucket retention
    does): left there, restore() would stage the abandoned step back. (what was, or would be, removed;
    errors)"""
    if s3.url is None:
        return [], []
    done: list[str] = []
    errors: list[str] = []
    try:
        bucket = Bucket(s3)
        for job in jobs:
            committed, partial = bucket.steps(job)
            for step in sorted(s for s in committed + partial if s > above):
                if not dry_run:
                    bucket.delete_step(job, step)
                done.append(f"{s3.url.rstrip('/')}/{job}/step-{step:012d}")
    except BucketError as e:
        errors.append(str(e))
    return done, errors


def sweep_above(s3: S3Settings, jobs: list[str], above: int, passes: int = 3,
                pause: float = 0.5) -> tuple[list[str], list[str]]:
    """``ckptd gc --remove-above``'s bucket side again, after the local steps are gone: an upload the
    daemon had in flight when gc began may have put files or index.json there since its first pass.
    The uploader puts a step's index.json only while the local step still holds it, and reads it again
    after the put (withdrawing it if gone), so once the local steps are removed one more listing finds
    whatever an upload published before; passes (``pause`` s apart) go on while one finds something, at
    most ``passes``. (what was removed; errors)"""
    done: list[str] = []
    for n in range(passes):
        if n:
            time.sleep(pause)
        found, errors = remove_above(s3, jobs, above, dry_run=False)
        done += found
        if errors or not found:
            return done, errors
    return done, []


def ls_bucket(args: argparse.Namespace) -> int:
    try:
        bucket = Bucket(s3_settings(args, args.root))
        jobs = [validate_job(args.job)] if args.job else bucket.jobs()
        rows = []
        for job in jobs:
            committed, partial = bucket.steps(job)
            rows += [(job, s, "in bucket") for s in committed] + [(job, s, "incomplete") for s in partial]
    except (BucketError, ConfigError, ValueError) as e:
        print(f"ckptd ls: {e}", file=sys.stderr)
        return 2
    if getattr(args, "json", False):
        print(json.dumps([{"job": job, "step": step, "state": state} for job, step, state in sorted(rows)], indent=1))
        return 0
    if not rows:
        print("no checkpoints")
    for job, step, state in sorted(rows):
        print(f"{job[:20]:20s} {step:>10d} {state}")
    return 0


def step_url(text: str) -> tuple[str, str, int]:
    """``s3://bucket[/prefix]/<job>/<step>`` → (bucket URL, job, step); the step as local verify takes
    it (``4``, ``step-4`` or ``step-000000000004``, what ``ckptd ls s3://…`` lists by number).
    UsageError when it names no step."""
    parts = text.rstrip("/").rsplit("/", 2)
    form = f"expected s3://bucket[/prefix]/<job>/step-<N>, got {text!r}"
    if len(parts) != 3 or not parts[0].startswith("s3://") or len(parts[0]) <= len("s3://"):
        raise cli_steps.UsageError(form)
    url, job, step = parts
    try:
        return url, validate_job(job), cli_steps.parse_step(step)
    except ValueError as e:       # (UsageError too)
        raise cli_steps.UsageError(f"{form}: {e}") from None


def bucket_faults(args: argparse.Namespace, progress: Callable[[str], None] | None) -> list[Fault]:
    """Download ``s3://bucket/prefix/<job>/step-<N>`` to a temp dir and verify it there; each fault
    names the bucket key (``s3://…/rank-00001.data``), never the temp copy. A URL that names no step
    is a usage error, as a local one is: its message on stderr and exit 2 (SystemExit), never a FAULT
    (exit 1 says the step is corrupt)."""
    try:
        url, job, step = step_url(args.step_dir)
    except cli_steps.UsageError as e:
        print(f"ckptd verify: {e}", file=sys.stderr)
        raise SystemExit(cli_steps.USAGE) from None
    step_name = step_dir_name(step)
    remote = f"{url}/{job}/{step_name}"
    try:
        bucket = Bucket(s3_settings(args, url))
        with tempfile.TemporaryDirectory(prefix="ckptd-verify-") as tmp:
            if not bucket.exists(bucket.step_key(job, step, INDEX_NAME)):
                faults = [Fault(args.step_dir, None, "not committed in the bucket (no index.json)")]
            else:
                fetched = Stager(bucket, tmp, check_chunks=False).fetch(job, step, None)   # verify lists them all
                if progress:
                    progress(f"downloaded {fetched} bytes")
                local = os.path.join(tmp, job, step_name)
                faults = [Fault(bucket_path(f.file, local, remote), f.tensor, f.reason)
                          for f in verify_step(local, progress)]
    except (BucketError, ConfigError, ValueError, OSError) as e:
        faults = [Fault(args.step_dir, None, str(e))]
    return faults


def bucket_path(path: str, local: str, remote: str) -> str:
    """The bucket key a path of the temp copy stands for."""
    local = os.path.abspath(local)
    path = os.path.abspath(path)
    return remote + path[len(local):] if path == local or path.startswith(local + os.sep) else path


def add_tiers(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """With a bucket configured: each row's ``tiers`` (local / uploading / in bucket), and a row
    for each step only the bucket has."""
    try:
        settings = load_settings(getattr(args, "config", None), require_root=False)
        s3 = s3_settings(args)
    except ConfigError:
        return
    if s3.url is None:
        return
    uploading: dict[str, set[int]] = {}
    try:
        st = protocol.request_once(settings["socket"], {"op": "status"}, timeout=5)
        for job, j in (st.get("uploads") or {}).get("jobs", {}).items():
            uploading[job] = {s for s in [j.get("uploading"), *j.get("queued", [])] if s is not None}
    except (OSError, RuntimeError, ProtocolError):
        pass          # no daemon here: local and bucket only
    try:
        bucket = Bucket(s3)
    except BucketError as e:
        print(f"ckptd ls: s3: {e}", file=sys.stderr)
        return
    jobs = sorted({r["job"] for r in rows} | ({args.job} if args.job else set()))
    for job in jobs:
        try:
            in_bucket = set(bucket.steps(job)[0])
        except BucketError as e:
            print(f"ckptd ls: {e}", file=sys.stderr)
            in_bucket = set()
        for r in (r for r in rows if r["job"] == job):
            here = "staged" if r["state"] in ("staged", "staging") else "local"     # a copy, not a commit
            where = [here] + (["uploading"] if r["step"] in uploading.get(job, ()) else []) \
                + (["in bucket"] if r["step"] in in_bucket else [])
            r["tiers"] = ", ".join(where)
        local = {r["step"] for r in rows if r["job"] == job}
        rows += [{"job": job, "step": s, "state": "committed", "bytes_on_disk": 0, "raw_bytes": None,
                  "stored_bytes": None, "sizes_verified": True, "ratio": None, "age_s": None, "tiers": "in bucket"}
                 for s in sorted(in_bucket - local)]
    rows.sort(key=lambda r: (r["job"], -1 if r["step"] is None else r["step"]))       # (None: an unreadable job)
