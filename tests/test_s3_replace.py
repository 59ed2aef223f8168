"""A step number the bucket already holds, uploaded again with other content, against the real SeaweedFS.

A job rolled back to step 4 on a fresh node trains to step 8 again: the bucket's step 8 is another
save. Its files were replaced one by one under the old index.json, so for the whole upload (and for
good once the daemon died halfway) the bucket showed a committed step 8 that did not restore; and a
restarted daemon, or a flush, took "index.json of step 8 is there" for "this node's step 8 is there".
"""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from test_s3_tier import JOB, assert_state, bucket_of, cli, make_bucket, restore, s3_args, save, uploads, wait_for

import ckptd_client
from ckptd.core import protocol
from ckptd.core.names import INDEX_NAME, STAGED_NAME, rank_data_name, rank_manifest_name, step_dir_name
from ckptd.daemon.tiers.s3.bucket import Bucket
from ckptd.s3_local import SeaweedServer
from ckptd_client import bucket_restore


def bucket_with_4_and_8(seaweed: SeaweedServer, daemon_factory, tmp: Path) -> tuple[str, Bucket]:
    """Node A's steps 4 and 8 (seeds 4 and 8) committed in a new bucket."""
    bucket = make_bucket(seaweed)
    a = daemon_factory(*s3_args(seaweed, bucket), name="a", root=tmp / "root-a", env=seaweed.env())
    for step in (4, 8):
        save(a.socket, step, seed=step)
        assert bucket_restore.flush(str(a.socket), JOB, step, 60).uploaded
    a.stop()
    return bucket, bucket_of(seaweed, bucket)


def s3_client(seaweed: SeaweedServer) -> Any:
    env = seaweed.env()
    return boto3.client("s3", endpoint_url=seaweed.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")


def object_bytes(seaweed: SeaweedServer, bucket: str, key: str) -> bytes | None:
    """The bytes of ``key`` (below the prefix) as boto3 reads them; None when there is no such object."""
    s3 = s3_client(seaweed)
    try:
        return bytes(s3.get_object(Bucket=bucket, Key=f"ckpt/{key}")["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None


def verify_8(seaweed: SeaweedServer, bucket: str) -> str:
    """What ``ckptd verify`` says of the bucket's step 8 (its first line: ``s3://…: OK`` when whole)."""
    r = cli("verify", f"s3://{bucket}/ckpt/{JOB}/{step_dir_name(8)}", "--s3-endpoint", seaweed.endpoint,
            env=seaweed.env())
    return r.stdout + r.stderr


def test_a_step_saved_again_is_uncommitted_in_the_bucket_before_its_files_are_replaced(seaweed, daemon_factory, tmp):
    bucket, b = bucket_with_4_and_8(seaweed, daemon_factory, tmp)
    env = seaweed.env()
    root = tmp / "root-b"
    node = daemon_factory(*s3_args(seaweed, bucket, "--debug-upload-delay", "3"), name="b", root=root, env=env)
    got, state = restore(node.socket, 4)
    assert got == 4
    assert_state(state, 4)
    save(node.socket, 8, seed=80)          # step 8 again, another state
    manifest = (root / JOB / step_dir_name(8) / rank_manifest_name(0)).read_bytes()
    key = b.step_key(JOB, 8, rank_manifest_name(0))
    wait_for(lambda: object_bytes(seaweed, bucket, key) == manifest, "node B's manifest of step 8 in the bucket", 60)
    # Mid-upload: the bucket's step 8 is not committed (no index.json over a mix of two saves' files).
    assert b.steps(JOB) == ([4], [8])
    node.kill(signal.SIGKILL)
    assert b.steps(JOB) == ([4], [8])
    assert "not committed in the bucket (no index.json)" in verify_8(seaweed, bucket)

    # Node B's daemon restarts on its root: it finds step 8 newer than the bucket's newest and uploads it.
    again = daemon_factory(*s3_args(seaweed, bucket), name="b2", root=root, env=env)
    assert bucket_restore.flush(str(again.socket), JOB, 8, 60).uploaded
    assert b.steps(JOB) == ([4, 8], [])
    assert verify_8(seaweed, bucket).splitlines()[0].endswith(f"{step_dir_name(8)}: OK")
    fresh = daemon_factory(*s3_args(seaweed, bucket), name="c", root=tmp / "root-c", env=env)
    got, state = restore(fresh.socket)
    assert got == 8
    assert_state(state, 80)


def test_a_restart_and_a_flush_compare_the_buckets_step_with_the_local_one(seaweed, daemon_factory, tmp):
    """Node B commits step 8 again while it has no bucket configured, then restarts with it: the bucket's
    step 8 (node A's, whole and valid) is not node B's, so the restart uploads B's and a flush answers
    uploaded only once the bucket's index.json is B's."""
    bucket, b = bucket_with_4_and_8(seaweed, daemon_factory, tmp)
    env = seaweed.env()
    root = tmp / "root-b"
    node = daemon_factory(*s3_args(seaweed, bucket), name="b", root=root, env=env)
    got, _ = restore(node.socket, 4)
    assert got == 4
    node.stop()
    local = daemon_factory(name="b-local", root=root)
    save(local.socket, 8, seed=80)
    local.stop()
    index = (root / JOB / step_dir_name(8) / INDEX_NAME).read_bytes()
    index_key = b.step_key(JOB, 8, INDEX_NAME)
    assert object_bytes(seaweed, bucket, index_key) not in (None, index)

    again = daemon_factory(*s3_args(seaweed, bucket, "--debug-upload-delay", "1"), name="b2", root=root, env=env)
    flushed = bucket_restore.flush(str(again.socket), JOB, 8, 60)
    assert flushed == bucket_restore.Flushed(True, "step 8 is committed in the bucket"), flushed
    assert object_bytes(seaweed, bucket, index_key) == index        # node B's step 8, not node A's
    assert uploads(again.socket)["uploaded"] == 1
    assert "bucket step replaced" in again.log_text()
    assert verify_8(seaweed, bucket).splitlines()[0].endswith(f"{step_dir_name(8)}: OK")
    fresh = daemon_factory(*s3_args(seaweed, bucket), name="c", root=tmp / "root-c", env=env)
    got, state = restore(fresh.socket, 8)
    assert got == 8
    assert_state(state, 80)


def rank_state(rank: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return {"w": torch.randn(1 << 18, generator=g), "meta": {"seed": seed, "rank": rank}}


def save_both_ranks(sock: Path, step: int, seed: int) -> None:
    """Ranks 0 and 1 of a 2-rank job save ``step`` through one daemon (a local commit)."""
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            ck = ckptd_client.Checkpointer(JOB, rank=rank, world_size=2, socket=str(sock))
            ck.save(step, rank_state(rank, seed)).wait(120)
            ck.close()
        except BaseException as e:     # re-raised in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_partial_stage_from_a_bucket_step_since_replaced_is_not_reused(seaweed, daemon_factory, tmp):
    """A stage that a bucket error interrupts keeps what landed (staged.json, the manifests, rank 0's data)
    for the next try. The bucket's step is then replaced by another save of its number: the next stage
    checked nothing it found against the new index.json (a manifest there was taken as verified, a data
    file of the right size as landed), wrote the new index over the old files, and the step never restored."""
    bucket, env = make_bucket(seaweed), seaweed.env()
    a = daemon_factory(*s3_args(seaweed, bucket), name="a", root=tmp / "root-a", env=env)
    save_both_ranks(a.socket, 8, seed=8)
    assert bucket_restore.flush(str(a.socket), JOB, 8, 60).uploaded
    a.stop()
    data_1 = f"{JOB}/{step_dir_name(8)}/{rank_data_name(1)}"
    saved = object_bytes(seaweed, bucket, data_1)
    assert saved is not None
    s3_client(seaweed).delete_object(Bucket=bucket, Key=f"ckpt/{data_1}")       # a fault: rank 1's data not there

    c = daemon_factory(*s3_args(seaweed, bucket), name="c", root=tmp / "root-c", env=env)
    with pytest.raises(RuntimeError, match="cannot stage step 8"):
        protocol.request_once(str(c.socket), {"op": "stage", "job": JOB, "step": 8, "reader": None}, timeout=120)
    staged = tmp / "root-c" / JOB / step_dir_name(8)
    assert sorted(p.name for p in staged.iterdir()) == [
        rank_data_name(0), rank_manifest_name(0), rank_manifest_name(1), STAGED_NAME]

    # Meanwhile node B saves step 8 again (another state) and uploads it whole: a valid bucket step.
    b = daemon_factory(*s3_args(seaweed, bucket), name="b", root=tmp / "root-b", env=env)
    save_both_ranks(b.socket, 8, seed=80)
    assert bucket_restore.flush(str(b.socket), JOB, 8, 60).uploaded
    b.stop()

    for rank in range(2):
        ck = ckptd_client.Checkpointer(JOB, rank=rank, world_size=2, socket=str(c.socket), memory=False)
        state: dict[str, Any] = {"w": torch.zeros(1 << 18), "meta": {}}
        try:
            assert ck.restore(state, 8) == 8
        finally:
            ck.close()
        want = rank_state(rank, 80)
        assert torch.equal(state["w"], want["w"]) and state["meta"] == want["meta"], rank
    verify = cli("verify", str(tmp / "root-c"), JOB, "8")
    assert verify.returncode == 0, verify.stdout + verify.stderr
