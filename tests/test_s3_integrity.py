"""A corrupt step in the bucket (issue 17, defect 2), against the real SeaweedFS of test_s3_tier.

A flipped byte in rank 1's data file of the newest bucket step: rank 1's restore fails naming the
bucket key (the choice: fail, never fall back to an older step silently); the failing rank fetched
the index, the manifests and its own data file, no other rank's; nothing of the step stays on the
node (``ckptd ls`` shows it only in the bucket); restoring the older step then works as is, and
``ckptd verify s3://…`` and ``ckptd ls s3://… --json`` name bucket keys and print JSON.
"""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from test_s3_tier import bucket_of, cli, make_bucket, s3_args

import ckptd_client
from ckptd.core import protocol
from ckptd.core.names import INDEX_NAME, STAGED_NAME
from ckptd.s3_local import SeaweedServer
from ckptd_client import bucket_restore
from ckptd_client.errors import MissingData
from ckptd_client.load_files import StepFiles

JOB = "spot"
WORLD = 2


def rank_state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {"w": torch.randn(3 << 20, generator=g), "meta": {"step": step, "rank": rank}}


def save_all(sock: Path, step: int) -> None:
    """Every rank of a 2-rank job saves ``step`` through the same daemon (local commit)."""
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            ck = ckptd_client.Checkpointer(JOB, rank=rank, world_size=WORLD, socket=str(sock))
            ck.save(step, rank_state(step, rank)).wait(120)
            ck.close()
        except BaseException as e:     # re-raised in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def restore(sock: Path, rank: int, step: int | None) -> tuple[int | None, dict[str, Any]]:
    ck = ckptd_client.Checkpointer(JOB, rank=rank, world_size=WORLD, socket=str(sock), memory=False)
    state = {"w": torch.zeros(3 << 20), "meta": {}}
    try:
        return ck.restore(state, step), state
    finally:
        ck.close()


def staging(sock: Path) -> dict[str, Any]:
    return protocol.request_once(str(sock), {"op": "status"})["uploads"]["staging"]


def flip_a_byte(srv: SeaweedServer, bucket: str, key: str) -> None:
    env = srv.env()
    s3 = boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x40
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def test_a_corrupt_bucket_step_fails_naming_the_key_and_leaves_nothing_staged(seaweed, daemon_factory, tmp):
    bucket = make_bucket(seaweed)
    env = seaweed.env()
    b = bucket_of(seaweed, bucket)
    first = daemon_factory(*s3_args(seaweed, bucket), name="a", root=tmp / "root-a", env=env)
    for step in (4, 8):
        save_all(first.socket, step)
        assert bucket_restore.flush(str(first.socket), JOB, step, 120).uploaded
    first.stop()
    step8 = f"{JOB}/step-000000000008"
    bad_key = f"ckpt/{step8}/rank-00001.data"
    bad_url = f"s3://{bucket}/{bad_key}"
    flip_a_byte(seaweed, bucket, bad_key)
    sizes = dict(b.names(f"{step8}/"))

    # A rescheduled job: a fresh node (root) restores its rank 0 first, whose file is intact.
    node = tmp / "root-b"
    d = daemon_factory(*s3_args(seaweed, bucket), name="b", root=node, env=env)
    got, state = restore(d.socket, 0, None)
    assert got == 8 and torch.equal(state["w"], rank_state(8, 0)["w"])
    staged = node / step8
    assert (staged / STAGED_NAME).exists() and (staged / INDEX_NAME).exists()
    assert not (staged / "rank-00001.data").exists()
    with StepFiles(str(staged)) as files:      # what makes a rank that needs it ask for every rank's files
        with pytest.raises(MissingData):
            files.fd(1)
    listing = cli("ls", str(node), JOB, "--json", "--s3-endpoint", seaweed.endpoint,
                  env={**env, "CKPTD_S3_URL": f"s3://{bucket}/ckpt", "CKPTD_SOCKET": str(d.socket)})
    rows = {r["step"]: r for r in json.loads(listing.stdout)}
    assert (rows[8]["state"], rows[8]["tiers"]) == ("staged", "staged, in bucket"), listing.stdout

    # Rank 1: its data file in the bucket has a flipped byte.
    before = staging(d.socket)["fetched_bytes"]
    with pytest.raises(ckptd_client.CheckpointError) as failed:
        restore(d.socket, 1, None)
    message = str(failed.value)
    assert bad_url in message and "checksum" in message and "older step" in message, message
    assert "root-b" not in message                            # the bucket key, not a local path
    # It fetched its own data file and nothing else (the index and manifests were already here).
    assert staging(d.socket)["fetched_bytes"] - before == sizes[f"{step8}/rank-00001.data"]
    assert not staged.exists()                                # the staged copy is gone, index first
    listing = cli("ls", str(node), JOB, "--json", "--s3-endpoint", seaweed.endpoint,
                  env={**env, "CKPTD_S3_URL": f"s3://{bucket}/ckpt", "CKPTD_SOCKET": str(d.socket)})
    assert listing.returncode == 0, listing.stderr
    rows = {r["step"]: r for r in json.loads(listing.stdout)}
    assert rows[8]["tiers"] == "in bucket" and rows[8]["bytes_on_disk"] == 0, listing.stdout

    # Again, on a node that never staged anything of it: the same error, the index, manifests
    # and rank 1's data fetched (never rank 0's), nothing left behind.
    d.stop()
    fresh = tmp / "root-c"
    d = daemon_factory(*s3_args(seaweed, bucket), name="c", root=fresh, env=env)
    with pytest.raises(ckptd_client.CheckpointError, match=bad_url):
        restore(d.socket, 1, 8)
    fetched = staging(d.socket)
    want = sum(size for key, size in sizes.items() if not key.endswith("rank-00000.data"))
    assert (fetched["fetched_bytes"], fetched["corrupt"]) == (want, 1), (fetched, sizes)
    assert not (fresh / step8).exists()
    # The older step restores on every rank without any cleanup.
    for rank in range(WORLD):
        got, state = restore(d.socket, rank, 4)
        assert got == 4 and torch.equal(state["w"], rank_state(4, rank)["w"])
        assert state["meta"] == {"step": 4, "rank": rank}

    verify = cli("verify", f"s3://{bucket}/ckpt/{step8}", "--s3-endpoint", seaweed.endpoint, env=env)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    faults = [ln for ln in verify.stdout.splitlines() if ln.startswith("FAULT")]
    assert len(faults) == 1 and bad_url in faults[0] and "ckptd-verify-" not in verify.stdout, verify.stdout
    listing = cli("ls", f"s3://{bucket}/ckpt", "--json", "--s3-endpoint", seaweed.endpoint, env=env)
    assert json.loads(listing.stdout) == [{"job": JOB, "step": 4, "state": "in bucket"},
                                          {"job": JOB, "step": 8, "state": "in bucket"}], listing.stdout
