"""``ckptd verify s3://bucket/prefix/JOB/STEP`` takes the step as ``ckptd ls s3://…`` lists it and as
local verify takes it (``4``, ``step-4``, ``step-000000000004``), against the real SeaweedFS of
test_s3_tier; a URL that names no step is a usage error (exit 2), never a FAULT (exit 1: corrupt)."""
from __future__ import annotations

import torch
from test_s3_tier import cli, make_bucket, s3_args

import ckptd_client
from ckptd_client import bucket_restore

JOB = "job"


def test_verify_takes_the_step_as_ls_lists_it(seaweed, daemon_factory, tmp):
    bucket = make_bucket(seaweed)
    env = seaweed.env()
    d = daemon_factory(*s3_args(seaweed, bucket), root=tmp / "root", env=env)
    ck = ckptd_client.Checkpointer(JOB, socket=str(d.socket), rank=0, world_size=1)
    ck.save(4, {"w": torch.arange(100.0)}).wait(60)
    ck.close()
    assert bucket_restore.flush(str(d.socket), JOB, 4, 120).uploaded
    d.stop()
    url = f"s3://{bucket}/ckpt"
    flags = ("--s3-endpoint", seaweed.endpoint)
    listing = cli("ls", url, *flags, env=env)
    assert listing.returncode == 0 and listing.stdout.split() == [JOB, "4", "in", "bucket"], listing.stdout

    for step in ("step-4", "4", "step-000000000004"):
        for target in ([f"{url}/{JOB}/{step}"], [url, JOB, step]):
            r = cli("verify", *target, *flags, env=env)
            assert r.returncode == 0 and r.stdout.rstrip().endswith(": OK"), (target, r.stdout, r.stderr)
            assert "FAULT" not in r.stdout, r.stdout

    missing = cli("verify", f"{url}/{JOB}/step-5", *flags, env=env)
    assert missing.returncode == 1 and "not committed in the bucket" in missing.stdout, missing.stdout

    for bad in (f"{url}/{JOB}/step-x", f"{url}/{JOB}", f"{url}/{JOB}/-4", f"{url}/../step-4", "s3://step-4"):
        r = cli("verify", bad, *flags, env=env)
        assert r.returncode == 2, (bad, r.returncode, r.stdout, r.stderr)
        assert "FAULT" not in r.stdout and "ckptd verify: expected s3://bucket[/prefix]/<job>/step-<N>" in r.stderr, \
            (bad, r.stderr)
