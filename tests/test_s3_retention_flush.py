"""A flush after bucket retention removed the step, against the real SeaweedFS of test_s3_tier.

Retention (``s3.keep_last``) deleted steps from the bucket but the uploads kept them as known, and a
step was known before retention ran after its own upload: a flush answered uploaded for a step the
bucket no longer held. And ``ckptd gc --remove-above`` against the bucket: an upload in flight must not
put back a step gc removed.
"""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import os
import time

import zygote
from test_s3_tier import JOB, assert_state, bucket_of, make_bucket, restore, s3_args, save, uploads, wait_for

from ckptd import cli
from ckptd.core.names import rank_data_name
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
    bucket = make_bucket(seaweed)
    b = bucket_of(seaweed, bucket)
    d = daemon_factory(*s3_args(seaweed, bucket), env=seaweed.env())
    for step in (10, 20, 30):
        save(d.socket, step, seed=step)
    assert bucket_restore.flush(str(d.socket), JOB, 30, 60).uploaded
    gc = [*zygote.CKPTD, "gc", str(d.root), "--job", JOB, "--remove-above", "20",
          "--s3-url", f"s3://{bucket}/ckpt", "--s3-endpoint", seaweed.endpoint]
    env = {**os.environ, **seaweed.env()}
    r = zygote.run([*gc, "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and f"would remove s3://{bucket}/ckpt/{JOB}/step-000000000030" in r.stdout, r.stdout
    assert 30 in b.steps(JOB)[0]
    r = zygote.run(gc, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(s <= 20 for s in b.steps(JOB)[0] + b.steps(JOB)[1]), b.steps(JOB)
    save(d.socket, 21, seed=21)
    got, _ = restore(d.socket)
    assert got == 21


def test_gc_remove_above_during_an_upload_of_a_step_above_leaves_it_out_of_the_bucket(seaweed, daemon_factory):
    """`ckptd gc --remove-above 20` while the daemon uploads step 30: gc deleted the bucket's files of 30, then
    the local step, but the upload streamed its already-open data file on and put index.json last: the bucket
    held step 30 committed with no data files, and restore() failed on it (HTTP 404). The uploader now puts
    index.json only while the local step still holds it: the upload is withdrawn, nothing of 30 stays."""
    zygote.run([*zygote.CKPTD, "--help"], capture_output=True, timeout=120, check=True)   # the zygote started
    bucket = make_bucket(seaweed)
    b = bucket_of(seaweed, bucket)
    # Each file of an upload waits 2 s first: index.json comes 2 s after the data file is in the bucket (gc,
    # forked from the zygote with ckptd.cli imported, takes a fraction of that).
    d = daemon_factory(*s3_args(seaweed, bucket, "--debug-upload-delay", "2"), env=seaweed.env())
    save(d.socket, 20, seed=20)
    save(d.socket, 30, seed=30)           # the rolled-back run's step; its upload waits behind 20's
    data_30 = b.step_key(JOB, 30, rank_data_name(0))
    wait_for(lambda: b.exists(data_30), "step 30's data file in the bucket")
    assert 30 not in b.steps(JOB)[0]      # its index.json not yet: gc runs in the upload's last wait
    gc = [*zygote.CKPTD, "gc", str(d.root), "--job", JOB, "--remove-above", "20",
          "--s3-url", f"s3://{bucket}/ckpt", "--s3-endpoint", seaweed.endpoint]
    r = zygote.run(gc, capture_output=True, text=True, env={**os.environ, **seaweed.env()}, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: uploads(d.socket).get("uploading") is None and not uploads(d.socket).get("queued"),
             "step 30's upload to end")
    time.sleep(2)
    committed, partial = b.steps(JOB)
    assert committed == [20] and partial == [], (committed, partial)
    assert "upload withdrawn" in d.log_text(), d.log_text()[-3000:]
    got, state = restore(d.socket)
    assert got == 20
    assert_state(state, 20)


def test_gc_remove_above_removes_a_bucket_step_an_upload_landed_while_gc_ran(seaweed, daemon_factory, tmp,
                                                                             monkeypatch, capsys):
    """An upload that checked the local step just before gc removed it lands its index.json after gc's first
    listing of the bucket: gc lists the bucket again once the local steps are gone and removes it, saying so."""
    bucket = make_bucket(seaweed)
    b = bucket_of(seaweed, bucket)
    d = daemon_factory(*s3_args(seaweed, bucket), env=seaweed.env())
    for step in (20, 30):
        save(d.socket, step, seed=step)
    assert bucket_restore.flush(str(d.socket), JOB, 30, 60).uploaded
    d.proc.kill()                           # the trainers and the daemon stopped; the upload below stands in
    prefix = b.step_key(JOB, 30)
    files = {key: b.get_bytes(key, 1 << 30) for key, _ in b.names(prefix)}
    real_collect = cli.collect_root

    def collect_then_an_upload_lands(*args, **kw):
        result = real_collect(*args, **kw)
        for key, data in sorted(files.items(), key=lambda kv: kv[0].endswith("index.json")):   # index.json last
            b.put_bytes(key, data)
        return result
    monkeypatch.setattr(cli, "collect_root", collect_then_an_upload_lands)
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    code = cli.main(["gc", str(d.root), "--job", JOB, "--remove-above", "20", "--s3-url", f"s3://{bucket}/ckpt",
                     "--s3-endpoint", seaweed.endpoint])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"removed s3://{bucket}/ckpt/{JOB}/step-000000000030: a bucket step above --remove-above that an " \
           "upload in flight put there while gc ran" in out, out
    assert b.steps(JOB) == ([20], []), b.steps(JOB)
