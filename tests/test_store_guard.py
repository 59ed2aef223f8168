"""store_guard.GuardedStore against a real TCPStore whose server's process is SIGSTOPped: every call
ends by its deadline (plus the grace), torch's own connection is untouched, and the store serves again
once its process resumes (a call that timed out does not mark it gone for good)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from procfd import sigstop

from ckptd_client import store_guard
from ckptd_client.store_guard import GuardedStore, store_deadline

SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
st = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timedelta(seconds=60), wait_for_workers=False)
print("up", flush=True)
time.sleep(600)
"""


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], Any]]:
    """A TCPStore server in a process of its own, and torch's client connection to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
        client.set("k", "v")
        yield proc, client
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def _timed(fn: Any) -> tuple[str, float]:
    """``fn()``'s outcome (its value, or its exception's type) and seconds taken, on a daemon thread
    joined for at most 60 s (so a call that never returns fails the test instead of hanging it)."""
    out: dict[str, Any] = {}

    def run() -> None:
        began = time.monotonic()
        try:
            out["r"] = repr(fn())
        except Exception as e:
            out["r"] = type(e).__name__ + ": " + str(e)
        out["t"] = time.monotonic() - began

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(60)
    assert not th.is_alive(), "the store call still blocked after 60 s"
    return out["r"], out["t"]


def test_calls_end_by_their_deadline_and_the_store_serves_again(server: tuple[subprocess.Popen[str], Any]) -> None:
    proc, client = server
    guarded = GuardedStore(client, bound=2.0)
    assert guarded.get("k") == b"v"     # its own connection, opened while the server answers
    sigstop(proc.pid)

    def bounded_get() -> bytes:
        with store_deadline(time.monotonic() + 1.0):
            return guarded.get("k")

    # On its connection: given up 1 s + the grace after the call; then on a new one (its first was shut
    # down), whose opening is given up at the 2 s bound. Each + a watchdog tick and this machine's slack.
    for call, bound in ((bounded_get, 1.0 + store_guard.GRACE_S), (lambda: guarded.check(["k"]), 2.0)):
        result, took = _timed(call)
        assert result.startswith("StoreGone: the job's store (rank 0's TCPStore at 127.0.0.1:"), result
        assert "did not answer" in result and "rank 0 stopped" in result, result
        assert took <= bound + 3.0, took
    os.kill(proc.pid, signal.SIGCONT)
    assert _timed(lambda: guarded.get("k"))[0] == "b'v'"       # a new connection: served again
    assert client.get("k") == b"v"                              # torch's connection was never touched


def test_opening_a_connection_to_a_stopped_store_is_bounded(server: tuple[subprocess.Popen[str], Any]) -> None:
    """A clone of a stopped store blocks too (and retries its connect until its timeout): a new
    connection is cloned from the first one, whose timeout is set to what is left of the bound."""
    proc, client = server
    guarded = GuardedStore(client, bound=1.5)
    assert guarded.add("n", 1) == 1         # its first connection, opened while the server answers
    sigstop(proc.pid)
    result, took = _timed(lambda: guarded.check(["n"]))
    assert result.startswith("StoreGone: ") and "did not answer a check within" in result, result
    for _ in range(2):      # that connection was shut down: each call opens a new one, and gives up
        result, took = _timed(lambda: guarded.add("n", 1))
        assert result.startswith("StoreGone: ") and "did not answer a new connection" in result, result
        assert took <= 1.5 + 3.0, took
    result, took = _timed(lambda: guarded.wait(["never"], timedelta(seconds=1)))
    assert result.startswith("StoreGone: "), result
    assert took <= 1.0 + store_guard.GRACE_S + 3.0, took
    os.kill(proc.pid, signal.SIGCONT)
    assert _timed(lambda: guarded.add("n", 1))[0] == "2"
    assert client.get("n") == b"2"


def test_a_store_without_a_server_is_called_as_it_is(tmp_path: Any) -> None:
    store = dist.FileStore(str(tmp_path / "fs"), 1)
    guarded = GuardedStore(store, bound=1.0)
    guarded.set("a", "1")
    assert guarded.get("a") == b"1" and guarded.add("c", 2) == 2 and guarded.check(["a"])


def test_a_forked_child_bounds_its_calls_with_a_watchdog_of_its_own(server: tuple[subprocess.Popen[str], Any]) -> None:
    """A child forked after the parent's calls started the watchdog (a thread: not in the child) and
    pooled a connection (the parent's socket) still has its calls bounded, on connections of its own."""
    proc, client = server
    assert GuardedStore(client, bound=1.5).add("f", 1) == 1      # the parent's pool and watchdog
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    pid = os.fork()
    if pid == 0:        # the child: its own first connection while the server answers, then a call it cannot
        code = 4
        try:
            mine = GuardedStore(client, bound=1.5)
            mine.add("f", 1)
            os.write(from_child, b"1")
            os.read(to_child, 1)            # the server is stopped now
            mine.check(["f"])
            code = 3
        except store_guard.StoreGone:
            code = 0
        finally:
            os._exit(code)
    status: int | None = None
    try:
        assert os.read(to_parent, 1) == b"1"
        sigstop(proc.pid)
        os.write(from_parent, b"1")
        began = time.monotonic()
        while time.monotonic() - began < 30 and status is None:
            done, raw_status = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw_status) if done else None
            time.sleep(0.1)
        assert status == 0, f"the child's call: exit {status} after {time.monotonic() - began:.1f}s (None: blocked)"
        assert time.monotonic() - began <= 1.5 + 3.0
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for fd in (to_child, from_parent, to_parent, from_child):
            os.close(fd)


def test_abandon_cuts_short_the_calls_in_flight_and_refuses_later_ones(server: tuple[subprocess.Popen[str], Any]
                                                                       ) -> None:
    """A Checkpointer's close() abandons its store object: a call of it blocked on the stopped server
    raises at once (not at its own bound, 60 s away), later calls raise without trying, and another
    object on the same store is not abandoned: it serves again once the server resumes."""
    proc, client = server
    mine, other = GuardedStore(client, bound=60.0), GuardedStore(client, bound=60.0)
    assert mine.get("k") == b"v" and other.get("k") == b"v"
    sigstop(proc.pid)
    result: dict[str, Any] = {}
    call = threading.Thread(target=lambda: result.update(zip("rt", _timed(lambda: mine.get("k")), strict=True)))
    call.daemon = True
    call.start()
    time.sleep(1.0)                 # the call is in flight, on a connection the server does not answer
    mine.abandon()
    call.join(60)
    assert "StoreGone" in result["r"] and "cut short: its caller closed" in result["r"], result
    assert result["t"] <= 1.0 + store_guard.TICK_S + 2.0, result       # not its 60 s bound
    later, took = _timed(lambda: mine.check(["k"]))
    assert "StoreGone" in later and "its caller closed" in later and took < 1.0, (later, took)
    os.kill(proc.pid, signal.SIGCONT)
    assert other.get("k") == b"v"   # a new connection: the other object's calls go on
