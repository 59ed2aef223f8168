"""Credentials that expire or rotate (issue 17, defect 8), against a real SeaweedFS.

The daemon reads its credentials from the shared credentials file. The server's key pair is
rotated (it is restarted accepting only a new pair, so the old one is refused), then the file is
rewritten: the upload that was refused goes through with the new pair, without restarting the
daemon. A file that can no longer be used (its profile gone; a stated expiry passed) fails the
upload at once with the reason in the log and in status (never retried for ever, never a
secret in the log), and the next upload after the file is fixed goes through.
"""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import boto3
import pytest
from ports import SPAN
from test_s3_tier import JOB, bucket_of, make_bucket, s3_args, save, wait_for

from ckptd.core import protocol
from ckptd.s3_local import ACCESS_KEY, SECRET_KEY, start_seaweed
from ckptd_client import bucket_restore

NEW_KEY, NEW_SECRET = "ckptd-rotated", "ckptd-rotated-secret-0123456789"


def write_credentials(path: Path, key: str, secret: str, *, profile: str = "default", extra: str = "") -> None:
    """Rewritten the way credential tools do: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"[{profile}]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n{extra}")
    os.replace(tmp, path)


def uploads(sock: Path) -> dict[str, Any]:
    return protocol.request_once(str(sock), {"op": "status"})["uploads"]["jobs"].get(JOB, {})


def refused(endpoint: str, key: str, secret: str) -> bool:
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                      region_name="us-east-1")
    try:
        s3.list_buckets()
    except s3.exceptions.ClientError:
        return True
    return False


def settled_failure(sock: Path, step: int) -> dict[str, Any]:
    """Wait until the upload of ``step`` has ended without reaching the bucket."""
    return wait_for(lambda: (u := uploads(sock)) and u.get("uploading") is None and step not in u.get("queued", [])
                    and (u.get("in_bucket") or 0) < step and u.get("last_error") and u,
                    f"the upload of step {step} to end")


def test_rotated_credentials_are_renewed_and_a_failed_refresh_fails_the_upload_clearly(daemon_factory, tmp):
    srv = start_seaweed(tmp / "sw", port_span=SPAN)      # its own server: restarted with another key pair
    try:
        bucket = make_bucket(srv)
        b = bucket_of(srv, bucket)
        creds = tmp / "aws-credentials"
        write_credentials(creds, ACCESS_KEY, SECRET_KEY)
        env = {"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_REGION": "us-east-1"}
        d = daemon_factory(*s3_args(srv, bucket), env=env)
        save(d.socket, 1, seed=1)
        assert bucket_restore.flush(str(d.socket), JOB, 1, 120).uploaded

        # Rotation: the server now takes only the new pair; the daemon still holds the old one.
        srv.keys = [(NEW_KEY, NEW_SECRET)]
        srv.restart()
        assert refused(srv.endpoint, ACCESS_KEY, SECRET_KEY) and not refused(srv.endpoint, NEW_KEY, NEW_SECRET)
        save(d.socket, 2, seed=2)
        wait_for(lambda: uploads(d.socket).get("failures", 0) > 0, "the old pair refused")
        assert uploads(d.socket).get("uploading") == 2             # refused credentials are retried ...
        write_credentials(creds, NEW_KEY, NEW_SECRET)              # ... and the rewritten file is used
        wait_for(lambda: uploads(d.socket).get("in_bucket") == 2, "step 2 uploaded with the new pair")
        assert "S3 credentials renewed" in d.log_text() and "…" + NEW_KEY[-4:] in d.log_text()
        b = bucket_of(srv, bucket)                                 # the test's own client: the new pair too
        assert b.steps(JOB) == ([1, 2], [])

        # The file loses the profile: that upload fails at once, with the reason, and is not retried.
        write_credentials(creds, NEW_KEY, NEW_SECRET, profile="other")
        save(d.socket, 3, seed=3)
        up = settled_failure(d.socket, 3)
        assert "could not be renewed" in up["last_error"] and "no credentials for profile 'default'" in \
            up["last_error"], up
        assert "S3 credentials refresh failed" in d.log_text()
        flushed = bucket_restore.flush(str(d.socket), JOB, 3, 120)
        ok, detail = flushed.uploaded, flushed.detail
        assert not ok and "could not be renewed" in detail, detail

        # A stated expiry that has passed (session credentials a tool stopped renewing): the same.
        write_credentials(creds, NEW_KEY, NEW_SECRET, extra="aws_expiration = 2020-01-01T00:00:00Z\n")
        save(d.socket, 4, seed=4)
        up = settled_failure(d.socket, 4)
        assert "expired at 2020-01-01" in up["last_error"], up

        # Fixed: the next step uploads; nothing secret was ever logged.
        write_credentials(creds, NEW_KEY, NEW_SECRET)
        save(d.socket, 5, seed=5)
        assert bucket_restore.flush(str(d.socket), JOB, 5, 120).uploaded
        assert b.steps(JOB)[0][-1] == 5
        assert "S3 credentials usable again" in d.log_text()
        log = d.log_text()
        assert SECRET_KEY not in log and NEW_SECRET not in log and NEW_KEY not in log
    finally:
        srv.stop()


def test_a_broken_credentials_file_is_named_at_start(tmp):
    """A credentials file that cannot be parsed: the check says which file, not what is in it."""
    from ckptd.daemon.settings.s3 import S3Settings
    from ckptd.daemon.tiers.s3.bucket import Bucket, BucketError
    creds = tmp / "creds"
    creds.write_text("not an ini file\naws_secret_access_key = hunter2\n")
    with pytest.raises(BucketError, match=str(creds)) as e:
        Bucket(S3Settings(url="s3://b/p", endpoint="http://127.0.0.1:1"), {"AWS_SHARED_CREDENTIALS_FILE": str(creds)})
    assert "hunter2" not in str(e.value)
