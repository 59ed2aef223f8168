"""A flush after bucket retention removed the step, against the real SeaweedFS of test_s3_tier.

Retention (``s3.keep_last``) deleted steps from the bucket but the uploads kept them as known, and a
step was known before retention ran after its own upload: a flush answered uploaded for a step the
bucket no longer held.
"""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

from test_s3_tier import JOB, bucket_of, make_bucket, restore, s3_args, save, uploads, wait_for

from ckptd_client import bucket_restore


def test_a_flush_of_a_step_bucket_retention_removed_answers_not_uploaded(seaweed, daemon_factory):
    bucket = make_bucket(seaweed)
    b = bucket_of(seaweed, bucket)
    d = daemon_factory(*s3_args(seaweed, bucket, "--s3-keep-last", "1"), "--keep-last", "5", env=seaweed.env())
    for step in (1, 2):
        save(d.socket, step, seed=step)
        assert bucket_restore.flush(str(d.socket), JOB, step, 60).uploaded
    wait_for(lambda: b.steps(JOB) == ([2], []), "bucket retention down to step 2")
    # Step 1 is still committed on this node (local retention keeps 5), not in the bucket.
    flushed = bucket_restore.flush(str(d.socket), JOB, 1, 10)
    assert not flushed.uploaded and "removed by bucket retention" in flushed.detail, flushed
    assert b.steps(JOB) == ([2], [])          # and not uploaded again
    assert uploads(d.socket)["in_bucket"] == 2

    # A step that commits below the bucket's newest: uploaded, then removed by the retention that follows
    # its own upload (the bucket keeps only the newest, 2). Its flush does not answer uploaded.
    save(d.socket, 0, seed=0)
    flushed = bucket_restore.flush(str(d.socket), JOB, 0, 60)
    assert not flushed.uploaded and "removed by bucket retention" in flushed.detail, flushed
    assert b.steps(JOB) == ([2], [])
    up = uploads(d.socket)
    assert up["in_bucket"] == 2 and up["uploaded"] == 3, up


def test_gc_remove_above_takes_the_buckets_steps_above_too(seaweed, daemon_factory, tmp):
    """A run rolled back to step 20 of a job whose step 30 reached the bucket: `ckptd gc --remove-above 20`
    removed the local step 30, and the next restore() staged it back from the bucket and resumed there. With
    the bucket given (its config, CKPTD_S3_*, or --s3-url), gc removes the bucket's steps above 20 too."""
    import os
    import subprocess
    import sys
    bucket = make_bucket(seaweed)
    b = bucket_of(seaweed, bucket)
    d = daemon_factory(*s3_args(seaweed, bucket), env=seaweed.env())
    for step in (10, 20, 30):
        save(d.socket, step, seed=step)
    assert bucket_restore.flush(str(d.socket), JOB, 30, 60).uploaded
    gc = [sys.executable, "-m", "ckptd", "gc", str(d.root), "--job", JOB, "--remove-above", "20",
          "--s3-url", f"s3://{bucket}/ckpt", "--s3-endpoint", seaweed.endpoint]
    env = {**os.environ, **seaweed.env()}
    r = subprocess.run([*gc, "--dry-run"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and f"would remove s3://{bucket}/ckpt/{JOB}/step-000000000030" in r.stdout, r.stdout
    assert 30 in b.steps(JOB)[0]
    r = subprocess.run(gc, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(s <= 20 for s in b.steps(JOB)[0] + b.steps(JOB)[1]), b.steps(JOB)
    save(d.socket, 21, seed=21)
    got, _ = restore(d.socket)
    assert got == 21
