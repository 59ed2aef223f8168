"""The object-storage tier against a real S3 server (SeaweedFS on loopback): the issue's acceptance.

1. after the upload the local root is deleted; a fresh daemon and trainer restore bit-exact;
2. a daemon killed mid-upload leaves no committed bucket step; the previous one restores; a
   restarted daemon redoes the upload;
3. the server is killed while uploads run: local commits go on, uploads complete once it is back,
   every step committed in the bucket verifies;
4. wrong credentials / a missing bucket: a clear error at start and from --check-config; local
   saves are still served.
"""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import zygote
from ports import SPAN

import ckptd_client
from ckptd.core import protocol
from ckptd.core.names import INDEX_NAME, rank_data_name, step_dir, step_dir_name
from ckptd.daemon.settings.s3 import S3Settings
from ckptd.daemon.tiers.s3.bucket import Bucket
from ckptd.s3_local import SeaweedServer, start_seaweed
from ckptd_client import bucket_restore

from test_acceptance import assert_same_tensors, finish, launch

JOB = "spot"


def make_bucket(srv: SeaweedServer) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    env = srv.env()
    boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1").create_bucket(Bucket=name)
    return name


def s3_args(srv: SeaweedServer, bucket: str, *extra: str) -> tuple[str, ...]:
    return ("--s3-url", f"s3://{bucket}/ckpt", "--s3-endpoint", srv.endpoint, "--s3-part-size", "5MiB",
            "--s3-retry-max-interval", "1s", *extra)


def bucket_of(srv: SeaweedServer, name: str) -> Bucket:
    return Bucket(S3Settings(url=f"s3://{name}/ckpt", endpoint=srv.endpoint, part_size=5 << 20), srv.env())


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def uploads(sock: Path) -> dict[str, Any]:
    return protocol.request_once(str(sock), {"op": "status"})["uploads"]["jobs"].get(JOB, {})


def state_of(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    # ~12 MiB of incompressible floats: the data file is uploaded in several 5 MiB parts.
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.arange(1000, dtype=torch.int64) * seed,
            "meta": {"seed": seed}}


def empty_state() -> dict[str, Any]:
    return {"w": torch.zeros(3 << 20), "b": torch.zeros(1000, dtype=torch.int64), "meta": {"seed": -1}}


def save(sock: Path, step: int, seed: int) -> None:
    ck = ckptd_client.Checkpointer(JOB, socket=str(sock))
    ck.save(step, state_of(seed)).wait(120)
    ck.close()


def restore(sock: Path, step: int | None = None) -> tuple[int | None, dict[str, Any]]:
    ck = ckptd_client.Checkpointer(JOB, socket=str(sock))
    state = empty_state()
    got = ck.restore(state, step)
    ck.close()
    return got, state


def assert_state(state: dict[str, Any], seed: int) -> None:
    want = state_of(seed)
    assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"])
    assert state["meta"] == {"seed": seed}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ckptd ARGS`` in a process of its own, forked from the zygote (ckptd.cli imported once, not per call)."""
    return zygote.run([*zygote.CKPTD, *args], capture_output=True, text=True, timeout=120,
                      env={**os.environ, **(env or {})})


def test_restore_from_the_bucket_after_the_local_root_is_gone(seaweed, daemon_factory, tmp):
    """Acceptance 1: a 2-rank DDP job saves with the S3 tier on; its node's root is deleted; a fresh
    daemon on a fresh root and a fresh trainer restore the last step bit-exact from the bucket."""
    bucket = make_bucket(seaweed)
    env = seaweed.env()
    d = daemon_factory(*s3_args(seaweed, bucket), name="a", root=tmp / "root-a", env=env)
    finish(launch(2, [d.socket], JOB, tmp / "first", "--steps", "8", "--every", "4"))
    wait_for(lambda: uploads(d.socket).get("in_bucket") == 8, "step 8 in the bucket")
    assert bucket_of(seaweed, bucket).steps(JOB) == ([4, 8], [])

    listing = cli("ls", str(tmp / "root-a"), "--s3-endpoint", seaweed.endpoint,
                  env={**env, "CKPTD_S3_URL": f"s3://{bucket}/ckpt", "CKPTD_SOCKET": str(d.socket)})
    assert listing.returncode == 0, listing.stderr
    assert [ln.split()[-2:] for ln in listing.stdout.splitlines()[1:]] == [["in", "bucket"]] * 2, listing.stdout
    d.stop()
    shutil.rmtree(tmp / "root-a")

    assert cli("ls", f"s3://{bucket}/ckpt", "--s3-endpoint", seaweed.endpoint, env=env).stdout.split() == [
        JOB, "4", "in", "bucket", JOB, "8", "in", "bucket"]
    verify = cli("verify", f"s3://{bucket}/ckpt/{JOB}/step-000000000008", "--s3-endpoint", seaweed.endpoint, env=env)
    assert verify.returncode == 0 and verify.stdout.strip().endswith(": OK"), verify.stdout + verify.stderr

    fresh = daemon_factory(*s3_args(seaweed, bucket), name="b", root=tmp / "root-b", env=env)
    outs = finish(launch(2, [fresh.socket], JOB, tmp / "again", "--steps", "8", "--every", "4"))
    assert all("RESTORED 8" in out for out in outs), outs
    for rank in range(2):
        assert_same_tensors(tmp / f"first.rank{rank}.safetensors", tmp / f"again.rank{rank}.safetensors")
    assert "fetched from the bucket" in outs[0] + outs[1]


def test_daemon_killed_mid_upload_leaves_no_bucket_step_and_a_restart_redoes_it(seaweed, daemon_factory, tmp):
    """Acceptance 2."""
    bucket = make_bucket(seaweed)
    env = seaweed.env()
    b = bucket_of(seaweed, bucket)
    root = tmp / "root"
    first = daemon_factory(*s3_args(seaweed, bucket), name="a0", root=root, env=env)
    save(first.socket, 1, seed=1)
    wait_for(lambda: b.steps(JOB)[0] == [1], "step 1 in the bucket")
    first.stop()
    # The same node's daemon again, its uploads slowed (5 s before each file) so one can be caught mid-way.
    d = daemon_factory(*s3_args(seaweed, bucket, "--debug-upload-delay", "5"), name="a", root=root, env=env)
    save(d.socket, 2, seed=2)
    # Step 2 is committed locally; its upload is under way (its manifest is in the bucket, its index is not).
    wait_for(lambda: b.names(f"{JOB}/step-000000000002/"), "the first file of step 2 in the bucket")
    listing = cli("ls", str(root), "--json", "--s3-endpoint", seaweed.endpoint,
                  env={**env, "CKPTD_S3_URL": f"s3://{bucket}/ckpt", "CKPTD_SOCKET": str(d.socket)})
    assert [(r["step"], r["tiers"]) for r in json.loads(listing.stdout)] == [
        (1, "local, in bucket"), (2, "local, uploading")], listing.stdout   # (the upload sleeps 5 s per file)
    d.kill(signal.SIGKILL)
    assert (root / JOB / "step-000000000002" / INDEX_NAME).exists()
    assert b.steps(JOB) == ([1], [2])

    # A job rescheduled elsewhere (a fresh root) restores the newest step committed in the bucket: 1.
    other = daemon_factory(*s3_args(seaweed, bucket), name="b", root=tmp / "other", env=env)
    got, state = restore(other.socket)
    assert got == 1
    assert_state(state, 1)
    other.stop()

    # The node comes back: its daemon finds step 2 committed locally and not in the bucket, and uploads it.
    again = daemon_factory(*s3_args(seaweed, bucket), name="c", root=root, env=env)
    wait_for(lambda: b.steps(JOB) == ([1, 2], []), "step 2 committed in the bucket (the partial prefix replaced)")
    assert "upload resumed after restart" in again.log_text()
    third = daemon_factory(*s3_args(seaweed, bucket), name="d", root=tmp / "third", env=env)
    got, state = restore(third.socket)
    assert got == 2
    assert_state(state, 2)


def test_server_down_while_uploading_local_commits_go_on_and_uploads_complete(daemon_factory, tmp):
    """Acceptance 3: its own server, SIGKILLed mid-upload and restarted on the same dir and ports."""
    srv = start_seaweed(tmp / "sw", port_span=SPAN)
    try:
        bucket = make_bucket(srv)
        b = bucket_of(srv, bucket)
        env = srv.env()
        d = daemon_factory(*s3_args(srv, bucket, "--debug-upload-delay", "0.5"), name="a", env=env)
        save(d.socket, 1, seed=1)
        wait_for(lambda: uploads(d.socket).get("uploading") == 1, "the upload of step 1")
        srv.kill()
        for step in (2, 3):        # saves and local commits go on while the bucket is away
            save(d.socket, step, seed=step)
            assert os.path.exists(os.path.join(step_dir(str(d.root), JOB, step), INDEX_NAME))
        wait_for(lambda: uploads(d.socket).get("failures", 0) > 0, "a failed upload attempt")
        # ... and it says so: uploads.problem and ckptd_bucket_ok 0 (they stayed None and 1 while every upload
        # failed; only the start-up check set them)
        assert protocol.request_once(str(d.socket), {"op": "status"})["uploads"]["problem"]
        srv.start()
        wait_for(lambda: uploads(d.socket).get("in_bucket") == 3, "step 3 in the bucket after the server returned")
        assert protocol.request_once(str(d.socket), {"op": "status"})["uploads"]["problem"] is None
        up = uploads(d.socket)
        assert up["skipped"] >= 1 and up["last_error"] is None, up      # step 2 was behind step 3: skipped
        committed, _ = b.steps(JOB)
        assert committed and committed[-1] == 3
        for step in committed:        # nothing corrupt is ever visible
            r = cli("verify", f"s3://{bucket}/ckpt/{JOB}/step-{step:012d}", "--s3-endpoint", srv.endpoint, env=env)
            assert r.returncode == 0, r.stdout + r.stderr
    finally:
        srv.stop()


def test_a_bucket_that_answers_again_clears_the_problem_with_nothing_left_to_upload(daemon_factory, tmp):
    """A daemon restarted while the bucket was down set uploads.problem (ckptd_bucket_ok 0) on its first
    listing; the bucket came back, every local step was already in it, and with nothing left to upload
    nothing ever cleared the problem: a false alert that never ended. An answer clears it."""
    srv = start_seaweed(tmp / "sw", port_span=SPAN)
    try:
        bucket = make_bucket(srv)
        env = srv.env()
        d = daemon_factory(*s3_args(srv, bucket), name="a", env=env)
        save(d.socket, 1, seed=1)
        wait_for(lambda: uploads(d.socket).get("in_bucket") == 1, "step 1 in the bucket")
        d.stop()
        srv.stop()
        d = daemon_factory(*s3_args(srv, bucket), name="b", root=d.root, env=env)     # the bucket down at start
        wait_for(lambda: protocol.request_once(str(d.socket), {"op": "status"})["uploads"]["problem"],
                 "the problem said")
        srv.restart()
        wait_for(lambda: protocol.request_once(str(d.socket), {"op": "status"})["uploads"]["problem"] is None,
                 "the problem cleared once the bucket answers", timeout=60)
        assert uploads(d.socket).get("in_bucket") == 1
    finally:
        srv.stop()


@pytest.mark.parametrize("problem", ["credentials", "bucket"])
def test_wrong_credentials_or_missing_bucket_fail_clearly_and_local_saves_go_on(seaweed, daemon_factory, tmp,
                                                                                problem):
    """Acceptance 4."""
    bucket = make_bucket(seaweed)
    env = seaweed.env()
    if problem == "credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
        expected = "the bucket refused the credentials"
    else:
        bucket = "no-such-bucket-" + uuid.uuid4().hex[:8]
        expected = "the bucket does not exist"
    check = cli("serve", "--root", str(tmp / "root"), "--check-config", *s3_args(seaweed, bucket), env=env)
    assert check.returncode == 1 and expected in check.stderr, check.stderr
    assert "not-the-secret" not in check.stdout + check.stderr

    d = daemon_factory(*s3_args(seaweed, bucket), env=env)
    wait_for(lambda: expected in d.log_text(), "the error in the daemon's log")
    save(d.socket, 1, seed=1)
    assert (d.root / JOB / "step-000000000001" / INDEX_NAME).exists()
    got, state = restore(d.socket)
    assert got == 1
    assert_state(state, 1)
    st = protocol.request_once(str(d.socket), {"op": "status"})["uploads"]
    assert expected in (st["problem"] or "") + str(st["jobs"].get(JOB, {}).get("last_error"))
    assert "not-the-secret" not in d.log_text()


def test_without_the_s3_extra_local_saves_go_on_and_the_fix_is_named(daemon_factory, tmp):
    """obstore is the ``[s3]`` extra: a daemon installed without it serves local saves, and a bucket
    in its settings says what to install (a module that fails to import stands in for the missing one)."""
    block = tmp / "no-obstore"
    block.mkdir()
    (block / "obstore.py").write_text("raise ImportError(\"No module named 'obstore'\")\n")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(block), os.environ.get("PYTHONPATH")) if p)}
    check = cli("serve", "--root", str(tmp / "root"), "--check-config", "--s3-url", "s3://b/ckpt", env=env)
    assert check.returncode == 1 and "pip install 'ckptd[s3]'" in check.stderr, check.stderr
    d = daemon_factory("--s3-url", "s3://b/ckpt", env=env)
    wait_for(lambda: "ckptd[s3]" in d.log_text(), "the missing extra named in the daemon's log")
    save(d.socket, 1, seed=1)
    got, state = restore(d.socket)
    assert got == 1
    assert_state(state, 1)
    listing = cli("ls", str(d.root), env=env)
    assert listing.returncode == 0 and JOB in listing.stdout, listing.stderr


def test_daemon_without_bucket_refuses_bucket_ops(daemon):
    for msg in ({"op": "stage", "job": JOB, "step": None}, {"op": "flush", "job": JOB, "step": None, "timeout": 1}):
        with pytest.raises(RuntimeError, match="no object-storage tier"):
            protocol.request_once(str(daemon.socket), msg)



def test_retention_per_tier_and_flush(seaweed, daemon_factory):
    """keep 1 step locally, 2 in the bucket; the flush op waits for each step to be committed there."""
    bucket = make_bucket(seaweed)
    b = bucket_of(seaweed, bucket)
    d = daemon_factory(*s3_args(seaweed, bucket, "--s3-keep-last", "2"), "--keep-last", "1", env=seaweed.env())
    for step in (1, 2, 3):
        save(d.socket, step, seed=step)
        assert bucket_restore.flush(str(d.socket), JOB, step, 60) == \
            bucket_restore.Flushed(True, f"step {step} is committed in the bucket")
    wait_for(lambda: b.steps(JOB) == ([2, 3], []), "bucket retention down to 2 steps")
    wait_for(lambda: sorted(p.name for p in (d.root / JOB).iterdir()) == ["step-000000000003"], "local retention")
    got, state = restore(d.socket, 2)      # not local any more: staged from the bucket
    assert got == 2
    assert_state(state, 2)


def test_flush_of_a_bad_job_or_a_step_not_committed_here_files_nothing(seaweed, daemon_factory):
    """A flush names a job and step from the wire: a bad name is refused, and a step this node has not
    committed is not queued (each would otherwise stay in the uploader's tables and its status for good)."""
    bucket = make_bucket(seaweed)
    d = daemon_factory(*s3_args(seaweed, bucket), env=seaweed.env())
    save(d.socket, 1, seed=1)
    for job in ("../escape", "x" * 100_000, ""):
        with pytest.raises(RuntimeError, match="flush: "):
            protocol.request_once(str(d.socket), {"op": "flush", "job": job, "step": 1, "timeout": 0})
    for job, step in (("made-up", 1), (JOB, 7)):
        assert bucket_restore.flush(str(d.socket), job, step, 0) == \
            bucket_restore.Flushed(False, f"step {step} of job {job!r} is not committed on this node")
    assert bucket_restore.flush(str(d.socket), JOB, 1, 60).uploaded
    jobs = protocol.request_once(str(d.socket), {"op": "status"})["uploads"]["jobs"]
    assert sorted(jobs) == [JOB]


def test_a_flush_timeout_out_of_range_is_refused_not_an_internal_error(seaweed, daemon_factory):
    """A flush's timeout is checked as the number it came as: an integer beyond every float (JSON's are
    unbounded) raised OverflowError in float() and came back as an internal daemon error, with a
    traceback in the log for every such request any permitted user sent."""
    d = daemon_factory(*s3_args(seaweed, make_bucket(seaweed)), env=seaweed.env())
    s = protocol.connect(str(d.socket))
    rx = protocol.FrameReceiver(s)
    try:
        for req, timeout in enumerate((10**400, -10**400, float("nan"), float("inf"), -1, 3600.5, True), 1):
            protocol.send_frame(s, {"op": "flush", "req": req, "job": JOB, "step": None, "timeout": timeout})
            assert rx.read() == {"op": "error", "req": req, "code": "refused",
                                 "reason": "flush: timeout must be 0..3600 seconds"}, timeout
        protocol.send_frame(s, {"op": "flush", "req": 99, "job": JOB, "step": None, "timeout": 0})
        assert rx.read()["op"] == "ok"                 # the connection and the op still serve
    finally:
        s.close()
    assert "Traceback" not in d.log_text() and "internal" not in d.log_text()


def test_steps_that_commit_below_the_buckets_newest_are_uploaded(seaweed, daemon_factory):
    """The uploads took "step <= the newest step in the bucket" for "in the bucket". Steps 4 and 8 uploaded;
    the job restores 4 and commits 5: 5 is uploaded, and flush says so only once it is there (it answered
    uploaded for a step never sent). Then 9 uploading, 11 queued, 10 committing after 11 (one queue slot):
    the oldest step gives way, not the newest (11 was dropped)."""
    import time

    bucket = make_bucket(seaweed)
    b = bucket_of(seaweed, bucket)
    d = daemon_factory(*s3_args(seaweed, bucket, "--debug-upload-delay", "1"), env=seaweed.env())
    for step in (4, 8):
        save(d.socket, step, seed=step)
        assert bucket_restore.flush(str(d.socket), JOB, step, 60).uploaded
    got, state = restore(d.socket, 4)
    assert got == 4
    save(d.socket, 5, seed=5)
    assert bucket_restore.flush(str(d.socket), JOB, 5, 60) == \
        bucket_restore.Flushed(True, "step 5 is committed in the bucket")
    assert 5 in b.steps(JOB)[0]
    for step in (9, 11, 10):
        save(d.socket, step, seed=step)
        if step == 9:
            wait_for(lambda: uploads(d.socket)["uploading"] == 9, "step 9's upload to start")
    assert uploads(d.socket)["queued"] == [11] and uploads(d.socket)["uploading"] == 9
    assert bucket_restore.flush(str(d.socket), JOB, 11, 60).uploaded
    deadline = time.monotonic() + 60
    while uploads(d.socket)["uploading"] is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert 11 in b.steps(JOB)[0] and 10 not in b.steps(JOB)[0]


def test_preemption_flushes_the_step_to_the_bucket(seaweed, daemon_factory):
    bucket = make_bucket(seaweed)
    d = daemon_factory(*s3_args(seaweed, bucket), env=seaweed.env())
    ck = ckptd_client.Checkpointer(JOB, socket=str(d.socket))
    with ckptd_client.PreemptionHandler(ck, signals=(signal.SIGUSR1,), bucket_timeout=60) as preempt:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preempt.should_stop(5, state_of(5))
    ck.close()
    assert preempt.saved_step == 5 and preempt.in_bucket is True
    assert bucket_of(seaweed, bucket).steps(JOB) == ([5], [])


def test_a_data_file_with_gaps_round_trips_through_the_bucket(seaweed, daemon_factory, tmp):
    """A data file written around the page cache holds gaps: a large tensor after a 4-byte one (an
    optimizer's step) starts past a hole that lines it up with the slot (ckptd/core/direct_write.py).
    The index records the file's length, not its chunks' sum; the upload and the fetch move that
    many bytes, ``ckptd verify`` passes the bucket's copy, and a fresh daemon on a fresh root
    restores it bit-exact from the bucket."""
    bucket, env = make_bucket(seaweed), seaweed.env()
    d = daemon_factory(*s3_args(seaweed, bucket), "--direct-io", "on", "--codec", "none", name="a",
                       root=tmp / "root-a", env=env)
    g = torch.Generator().manual_seed(11)
    state = {"step": torch.tensor(7.0), "w": torch.randn(3 << 20, generator=g),
             "b": torch.randn(1001, generator=g).to(torch.bfloat16), "v": torch.randn(1 << 20, generator=g)}
    ck = ckptd_client.Checkpointer(JOB, socket=str(d.socket), memory=False)
    ck.save(1, state).wait(120)
    ck.close()
    wait_for(lambda: uploads(d.socket).get("in_bucket") == 1, "step 1 in the bucket")
    step_path = Path(step_dir(str(tmp / "root-a"), JOB, 1))
    manifest = json.loads((step_path / "rank-00000.json").read_bytes())
    offsets = {t["name"]: t["offset"] for t in manifest["tensors"]}
    chunks = sum(c[2] for t in manifest["tensors"] for c in t["chunks"])
    size = (step_path / "rank-00000.data").stat().st_size
    assert offsets["w"] == 64 and offsets["v"] % 64 == 0 and size > chunks, (offsets, size, chunks)   # two gaps
    index = json.loads((step_path / INDEX_NAME).read_bytes())
    assert index["ranks"][0]["stored_bytes"] == size
    d.stop()
    shutil.rmtree(tmp / "root-a")
    verify = cli("verify", f"s3://{bucket}/ckpt/{JOB}/step-000000000001", "--s3-endpoint", seaweed.endpoint, env=env)
    assert verify.returncode == 0 and verify.stdout.strip().endswith(": OK"), verify.stdout + verify.stderr
    fresh = daemon_factory(*s3_args(seaweed, bucket), name="b", root=tmp / "root-b", env=env)
    ck = ckptd_client.Checkpointer(JOB, socket=str(fresh.socket))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ck.restore(out) == 1
    info = ck.last_restore
    ck.close()
    assert info is not None and info.source == "storage" and info.from_storage == chunks, info   # the gaps unread
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_symlinked_step_file_is_never_uploaded(seaweed, daemon_factory, tmp):
    """A committed step whose data file was replaced by a symlink (to a file only the daemon's user
    may read) is not uploaded: the link is refused, not followed, and the bucket gets nothing of
    that step; the next step uploads as usual."""
    d = daemon_factory()
    save(d.socket, 1, seed=1)
    d.stop()
    secret = tmp / "secret.txt"
    secret.write_bytes(b"not for the bucket\n")
    os.chmod(secret, 0o600)
    data = d.root / JOB / step_dir_name(1) / rank_data_name(0)
    data.unlink()
    data.symlink_to(secret)
    bucket = make_bucket(seaweed)
    d2 = daemon_factory(*s3_args(seaweed, bucket), name="d2", root=d.root, env=seaweed.env())
    got = wait_for(lambda: (lambda u: u if u.get("skipped") or u.get("uploaded") else None)(uploads(d2.socket)),
                   "the uploader to take up step 1")
    assert got["uploaded"] == 0 and got["skipped"] == 1 and "symlink" in got["last_error"]
    b = bucket_of(seaweed, bucket)
    assert b.steps(JOB) == ([], []) and not b.exists(b.step_key(JOB, 1, rank_data_name(0)))
    verify = cli("verify", f"s3://{bucket}/ckpt/{JOB}/{step_dir_name(1)}", "--s3-endpoint", seaweed.endpoint,
                 env=seaweed.env())
    assert verify.returncode != 0 and "not committed in the bucket (no index.json)" in verify.stdout + verify.stderr
    save(d2.socket, 2, seed=2)
    assert bucket_restore.flush(str(d2.socket), JOB, 2, 60).uploaded
    assert b.steps(JOB) == ([2], [])


def test_a_downloaded_file_has_its_directory_entry_synced(seaweed, tmp, monkeypatch):
    """A data file staged into a step already committed locally (a restore reading more ranks) is renamed
    into place with no index.json rename after it: its directory entry was never fsynced, so a power loss
    could lose a file of a committed step. download now fsyncs the directory after its rename."""
    from ckptd.core import storage
    name = make_bucket(seaweed)
    b = bucket_of(seaweed, name)
    b.put_bytes("ckpt/x/blob", b"z" * 1000)
    synced: list[tuple[str, bool]] = []
    real = storage.fsync_dir

    def spy(path: str) -> None:               # the real fsync, recorded with whether the file was in place
        synced.append((path, (tmp / "dl" / "blob").exists()))
        real(path)
    monkeypatch.setattr(storage, "fsync_dir", spy)
    (tmp / "dl").mkdir()
    assert b.download("ckpt/x/blob", str(tmp / "dl" / "blob"), 1000) == 1000
    assert (tmp / "dl" / "blob").read_bytes() == b"z" * 1000
    assert (str(tmp / "dl"), True) in synced, synced
