"""One request answered in the calling thread (``ckptd_client.connection.Exchange``): what ``ask`` and a
restore's ``memory_fetch`` use. Against a real daemon and against a real unix-socket server that
answers as told: the reply and its memfd, events before the reply skipped, an error reply raised with
its code, and every way of not answering (silence, a closed connection, a reply missing its memfd)
raised as the reader-thread connection raises it, within the timeout."""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.core import protocol
from ckptd.core.errors import ErrorCode
from ckptd.core.framing import FrameReceiver, send_frame
from ckptd_client.connection import Exchange, ask
from ckptd_client.errors import ConnectionLost, DaemonRefused, NoReply, Unreachable

Serve = Callable[[socket.socket, dict[str, Any]], None]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[[Serve], str]]:
    """A unix socket whose one connection is answered by the function given (after reading its request)."""
    listeners: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def start(serve: Serve) -> str:
        path = str(tmp_path / f"s{len(listeners)}.sock")
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(path)
        ls.listen(1)
        listeners.append(ls)

        def run() -> None:
            conn, _ = ls.accept()
            with conn:
                msg = FrameReceiver(conn).read()
                assert msg is not None
                serve(conn, msg)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)
        return path
    yield start
    for ls in listeners:
        ls.close()
    for t in threads:
        t.join(timeout=5)


def test_the_reply_comes_after_events_with_its_memfd(server: Callable[[Serve], str]) -> None:
    fd = os.memfd_create("held")
    os.write(fd, b"held bytes")

    def serve(conn: socket.socket, msg: dict[str, Any]) -> None:
        assert msg["op"] == "memory_fetch" and msg["req"] == 1
        send_frame(conn, {"op": "progress", "step": 3})                     # an event: skipped
        send_frame(conn, {"op": "ok", "req": 1, "layout": []}, [fd])
        conn.recv(1)                                                        # until the client closes
    path = server(serve)
    with Exchange(path, protocol.MemoryFetch("j", 0, 1, 3, "storage"), timeout=10) as x:
        assert x.reply["layout"] == []
        (got,) = x.reply["_fds"]
        assert os.pread(got, 10, 0) == b"held bytes"
        os.close(got)
    os.close(fd)


def test_a_fatal_error_for_no_request_ends_it_with_the_reason(server: Callable[[Serve], str]) -> None:
    """The daemon's answer to a frame it could not parse (req 0, fatal) and its close: ConnectionLost
    naming the daemon's reason, not just "closed"."""
    path = server(lambda conn, msg: send_frame(conn, {"op": "error", "req": 0, "code": "refused", "fatal": True,
                                                      "reason": "protocol error: bad frame"}))
    with pytest.raises(ConnectionLost, match="daemon error: protocol error: bad frame"):
        ask(path, protocol.Info(), timeout=10)


def test_an_error_reply_raises_its_code_and_reason(server: Callable[[Serve], str]) -> None:
    path = server(lambda conn, msg: send_frame(conn, {"op": "error", "req": 1, "code": "refused",
                                                      "reason": "not in memory here"}))
    with pytest.raises(DaemonRefused) as e:
        ask(path, protocol.Info())
    assert e.value.code is ErrorCode.REFUSED and e.value.reason == "not in memory here"


def test_silence_raises_no_reply_by_the_timeout(server: Callable[[Serve], str]) -> None:
    gone = threading.Event()

    def silent(conn: socket.socket, msg: dict[str, Any]) -> None:
        gone.wait(10)
    path = server(silent)
    t0 = time.monotonic()
    with pytest.raises(NoReply, match="did not answer info in time"):
        ask(path, protocol.Info(), timeout=0.5)
    assert time.monotonic() - t0 < 5
    gone.set()


def test_a_connection_closed_before_the_reply_is_lost(server: Callable[[Serve], str]) -> None:
    path = server(lambda conn, msg: send_frame(conn, {"op": "progress"}))    # then closes
    with pytest.raises(ConnectionLost, match="daemon closed the connection"):
        ask(path, protocol.Info())


def test_a_fetch_reply_without_its_memfd_is_lost(server: Callable[[Serve], str]) -> None:
    path = server(lambda conn, msg: send_frame(conn, {"op": "ok", "req": 1}))
    with pytest.raises(ConnectionLost, match="without its memfds"):
        Exchange(path, protocol.MemoryFetch("j", 0, 1, 3, "storage"))


def test_no_daemon_is_unreachable(tmp_path: Path) -> None:
    with pytest.raises(Unreachable, match="cannot reach the ckptd daemon"):
        ask(str(tmp_path / "none.sock"), protocol.Info())


def test_a_real_daemon_answers(daemon: Any) -> None:
    assert ask(str(daemon.socket), protocol.Info())["root"] == str(daemon.root)
