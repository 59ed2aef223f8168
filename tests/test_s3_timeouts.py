"""A bucket endpoint that accepts connections and never answers (a hung proxy, a wedged load balancer).

Every bucket request had one 300 s timeout, so such an endpoint held a restore of a step this node has
(the daemon lists the bucket for the newest step first) and `ckptd ls ROOT` with [s3] configured for
300 s each. Listings and HEADs now time out in seconds (``s3.request_timeout`` in all, retries included;
15 s by default, 3 s here); only data transfers keep the long one.
"""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_s3_tier import JOB, assert_state, restore, save

FAKE_KEYS = {"AWS_ACCESS_KEY_ID": "ckptd-test", "AWS_SECRET_ACCESS_KEY": "never-checked", "AWS_REGION": "us-east-1"}
REQUEST_TIMEOUT_S = 3.0     # s3.request_timeout (default 15 s)
BOUND_S = 40.0          # well under the old 300 s, well over the request timeout and a start-up


@pytest.fixture
def blackhole() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a server that accepts every connection, reads and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=lambda c=conn: drain(c), daemon=True).start()

    def drain(conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                pass
        except OSError:
            pass
    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    server.close()
    for conn in held:
        conn.close()


def test_an_endpoint_that_never_answers_holds_a_local_restore_and_ls_for_seconds(daemon_factory, blackhole):
    s3 = ("--s3-url", "s3://bk/ckpt", "--s3-endpoint", blackhole, "--s3-request-timeout", f"{REQUEST_TIMEOUT_S:g}s")
    d = daemon_factory(*s3, env=FAKE_KEYS)
    save(d.socket, 1, seed=1)                  # committed locally; its upload hangs on the endpoint

    done: dict[str, Any] = {}

    def restoring() -> None:
        t0 = time.monotonic()
        done["step"], done["state"] = restore(d.socket)      # the newest step: the bucket is asked first
        done["seconds"] = time.monotonic() - t0
    t = threading.Thread(target=restoring, daemon=True)
    t.start()
    t0 = time.monotonic()
    listing = subprocess.run([sys.executable, "-m", "ckptd", "ls", str(d.root)], capture_output=True, text=True,
                             timeout=BOUND_S, env={**os.environ, **FAKE_KEYS, "CKPTD_S3_URL": "s3://bk/ckpt",
                                                   "CKPTD_S3_ENDPOINT": blackhole, "CKPTD_SOCKET": str(d.socket),
                                                   "CKPTD_S3_REQUEST_TIMEOUT": f"{REQUEST_TIMEOUT_S:g}s"})
    assert time.monotonic() - t0 < BOUND_S
    assert listing.returncode == 0 and "cannot reach the endpoint" in listing.stderr, listing.stderr
    assert [ln.split()[:2] for ln in listing.stdout.splitlines()[1:]] == [[JOB, "1"]], listing.stdout
    t.join(max(1.0, BOUND_S - (time.monotonic() - t0)))
    assert not t.is_alive(), "the restore of a step this node has waited on the bucket"
    assert done["step"] == 1 and done["seconds"] < BOUND_S, done
    assert_state(done["state"], 1)
