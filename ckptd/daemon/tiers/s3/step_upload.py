"""One committed local step uploaded to the bucket (blocking, on a thread of the uploader's): its
files checked, then uploaded, then ``index.json`` LAST, and only while the local step still holds
that very index.

An upload takes seconds to minutes, and the local step can go meanwhile: ``ckptd gc --remove-above``
removes a rolled-back run's steps (the bucket's first, then the local ones) with the daemon still
uploading one of them. The data file the upload streams is open, so removing the local files does
not stop it, and an ``index.json`` put at the end would commit in the bucket a step whose files gc
already deleted there (a restore of the job then stages it, or fails on a missing file). So, right
before the put, every object the upload put is HEADed and the local ``index.json`` read again: a
step removed or replaced locally (another index) is withdrawn (nothing published, the files this
upload put deleted, the uploader logs why); an object gone from the bucket with the local step still
committed is a BucketError (the uploader retries). The local step is read once more after the put:
gone by then, the ``index.json`` just put and the files are deleted again. A gc that removes the
local steps after that last read finds the step in the bucket when it lists it again (cli.py).
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable

from ckptd.core import storage
from ckptd.core.names import INDEX_NAME, STAGED_NAME, rank_data_name, rank_manifest_name, step_dir
from ckptd.core.schema import MAX_INDEX_BYTES, parse_index
from ckptd.daemon.tiers.s3.bucket import Bucket, BucketError

log = logging.getLogger("ckptd")


class IncompleteStep(Exception):
    """The local step is a copy staged from the bucket, or lacks files: never uploaded."""


class StepWithdrawn(Exception):
    """The local step was removed or replaced while it uploaded: its index.json is not (or no longer)
    in the bucket, and the files this upload put there are deleted."""


def local_index(root: str, job: str, step: int) -> bytes | None:
    """The local step's index.json, None when it has none (removed, or not committed)."""
    try:
        return storage.read_limited(os.path.join(step_dir(root, job, step), INDEX_NAME), MAX_INDEX_BYTES)
    except (OSError, ValueError):
        return None


def upload_step(bucket: Bucket, root: str, job: str, step: int, bucket_index: Callable[[], bytes | None],
                debug_delay: float = 0.0) -> int:
    """Every file of the committed local step, index.json last; bytes uploaded. ``bucket_index``: the
    bucket's index.json of this step, None when it has none. IncompleteStep: not uploaded;
    StepWithdrawn: the local step went meanwhile, nothing of this upload left in the bucket."""
    path = step_dir(root, job, step)
    index = os.path.join(path, INDEX_NAME)
    index_bytes = storage.read_limited(index, MAX_INDEX_BYTES)   # first: without it, not committed
    if os.path.exists(os.path.join(path, STAGED_NAME)):
        raise IncompleteStep(f"step {step} here is a copy staged from the bucket; not uploaded")
    world = parse_index(index_bytes, job=job, step=step)["world_size"]
    files = [rank_manifest_name(r) for r in range(world)] + [rank_data_name(r) for r in range(world)]
    for name in files:    # all checked before any upload: a refused step leaves nothing in the bucket
        try:
            mode = os.lstat(os.path.join(path, name)).st_mode
        except FileNotFoundError:       # staged here for one rank's restore: never publish a partial step
            raise IncompleteStep(f"step {step} lacks {name} here (staged for a restore); not uploaded") from None
        if not stat.S_ISREG(mode):
            raise IncompleteStep(f"step {step}'s {name} here is "
                                 f"{'a symlink' if stat.S_ISLNK(mode) else 'not a regular file'}; not uploaded "
                                 "(step files are never read through links)")
    index_key = bucket.step_key(job, step, INDEX_NAME)
    there = bucket_index()
    if there is not None and there != index_bytes:
        # Another save of this step number is committed there (a job rolled back and trained on
        # elsewhere, or this node's own earlier commit of it). Its files are about to be replaced one by
        # one: uncommit it first, so that no reader ever takes its index.json over a mix of two saves,
        # nor does one after this upload is killed halfway (the step reads as an upload in progress).
        bucket.delete(index_key)
        log.warning("bucket step replaced: another save of this step number was committed there",
                    extra={"ctx": {"job": job, "step": step}})
    total = 0
    keys = [bucket.step_key(job, step, name) for name in files]
    for name, key in zip(files, keys, strict=True):
        if debug_delay:
            time.sleep(debug_delay)
        try:
            total += bucket.upload_file(os.path.join(path, name), key)
        except storage.NotRegular:
            raise IncompleteStep(f"step {step}'s {name} here is not a regular file; not uploaded") from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise IncompleteStep(f"step {step}'s {name} here is a symlink; not uploaded (step files are "
                                 "never read through links)") from None
    if debug_delay:
        time.sleep(debug_delay)
    missing = [k for k in keys if not bucket.exists(k)]
    if local_index(root, job, step) != index_bytes:          # the last thing before the put
        withdraw(bucket, keys, job, step, "before its index.json was put")
    if missing:
        raise BucketError(f"upload of step {step}: {bucket.key_url(missing[0])} is gone from the bucket "
                          f"({len(missing)} of {len(keys)} files); index.json not put")
    bucket.put_bytes(index_key, index_bytes)
    if local_index(root, job, step) != index_bytes:
        withdraw(bucket, [index_key, *keys], job, step, "while its index.json was put")
    return total + len(index_bytes)


def withdraw(bucket: Bucket, keys: list[str], job: str, step: int, when: str) -> None:
    """The local step is gone or replaced: ``keys`` (index.json first when it was put) deleted, then
    StepWithdrawn. A delete that fails is logged; readers ignore a prefix without index.json."""
    try:
        for key in keys:
            bucket.delete(key)
    except BucketError as e:
        log.warning("withdrawn upload: its files could not all be deleted from the bucket (a prefix without "
                    "index.json, ignored by readers; the next upload's bucket retention removes it)",
                    extra={"ctx": {"job": job, "step": step, "error": str(e)}})
    raise StepWithdrawn(f"step {step} was removed or replaced on this node {when} (ckptd gc --remove-above, "
                        "or a save of that number again): not committed in the bucket, the files this upload "
                        "put there deleted")
