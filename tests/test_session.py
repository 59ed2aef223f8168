"""A session's framing and sending over a real socketpair, in-process.

The daemon end is a :class:`Session` on one end of a socketpair; the test plays the client on
the other end with the client's own blocking framing (run on a thread).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from ckptd.core import protocol
from ckptd.core.errors import ProtocolError
from ckptd.daemon.runtime import TaskSet
from ckptd.daemon.session import Peer, Session, peer_allowed, peer_of, refuse


class Pair:
    """A session on the daemon end of a socketpair; ``client`` is the other end."""

    def __init__(self) -> None:
        self.client, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.client.settimeout(10)
        daemon_end.setblocking(False)
        self.tasks = TaskSet()
        self.session = Session(daemon_end, peer_of(daemon_end), self.tasks)
        self.rx = protocol.FrameReceiver(self.client)
        self.seen: list[dict[str, Any]] = []

    async def echo(self, session: Session, msg: dict[str, Any]) -> None:
        """A handler: record the request, answer it."""
        self.seen.append(msg)
        if msg["op"] == "bad":
            raise ProtocolError("field 'x' missing")
        await session.send(protocol.ok(msg["req"], echo=msg.get("x")))

    async def send_raw(self, data: bytes) -> None:
        await asyncio.to_thread(self.client.sendall, data)

    async def read(self) -> dict[str, Any] | None:
        return await asyncio.to_thread(self.rx.read)


# Every test runs on the default loop and on uvloop (the daemon's): they differ in what a read
# or a send does with a socket closed under it.
LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


def run(loop: str, body: Callable[[Pair], Awaitable[None]]) -> None:
    async def main() -> None:
        p = Pair()
        try:
            await body(p)
        finally:
            p.session.close()
            await p.tasks.cancel_all()
            p.client.close()
    if loop == "uvloop":
        uvloop.run(main())
    else:
        asyncio.run(main())


def run_plain(loop: str, body: Awaitable[None]) -> None:
    async def main() -> None:
        await body
    if loop == "uvloop":
        uvloop.run(main())
    else:
        asyncio.run(main())


def frame(msg: dict[str, Any]) -> bytes:
    return protocol.encode(msg)


@LOOPS
def test_good_frames_are_handled_in_order(loop: str) -> None:
    async def case(pair: Pair) -> None:
        serving = asyncio.ensure_future(pair.session.serve(pair.echo))
        data = frame({"op": "info", "req": 1, "x": "a"}) + frame({"op": "info", "req": 2, "x": "é" * 1000})
        await pair.send_raw(data[:3])                       # a header split across reads
        await asyncio.sleep(0.01)
        await pair.send_raw(data[3:])
        await pair.send_raw(frame({"op": "status", "req": 3}))
        replies = [await pair.read() for _ in range(3)]
        assert replies == [{"op": "ok", "req": 1, "echo": "a"}, {"op": "ok", "req": 2, "echo": "é" * 1000},
                           {"op": "ok", "req": 3, "echo": None}]
        assert [m["req"] for m in pair.seen] == [1, 2, 3]
        pair.client.shutdown(socket.SHUT_WR)                # a clean end of stream ends the loop
        await asyncio.wait_for(serving, 10)
        assert not pair.session.closed                      # closing is its owner's (the server's) call

    run(loop, case)


@LOOPS
def test_events_keep_their_order_and_stop_once_closed(loop: str) -> None:
    async def case(pair: Pair) -> None:
        for i in range(20):
            pair.session.event(protocol.event(protocol.EventOp.SLOT_FREE, slot=i))
        assert [(await pair.read() or {})["slot"] for _ in range(20)] == list(range(20))
        await pair.tasks.wait(10)
        pair.session.close()
        assert pair.session.closed
        pair.session.event({"op": "durable", "step": 1})    # nothing is started for a closed session
        assert len(pair.tasks) == 0
        assert await pair.session.send({"op": "ok", "req": 1}) is False
        assert await pair.read() is None                    # the peer sees the end at once

    run(loop, case)


@pytest.mark.parametrize(("header", "needle"), [
    (b"XX\x00\x01\x00\x00\x00\x02", "bad frame magic b'XX': not a ckptd peer"),
    (protocol.HEADER.pack(protocol.MAGIC, 99, 2), "unsupported protocol version 99"),
    (protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, protocol.MAX_FRAME_BYTES + 1),
     f"exceeds the {protocol.MAX_FRAME_BYTES}-byte limit"),
])
@LOOPS
def test_a_bad_header_gets_a_fatal_error_and_ends_the_session(loop: str, header: bytes, needle: str) -> None:
    async def case(pair: Pair) -> None:
        serving = asyncio.ensure_future(pair.session.serve(pair.echo))
        await pair.send_raw(header + b"{}")
        reply = await pair.read()
        assert reply is not None and reply["op"] == "error" and reply["fatal"] is True and reply["req"] == 0
        assert needle in reply["reason"] and reply["reason"].startswith("protocol error: ")
        await asyncio.wait_for(serving, 10)
        assert pair.seen == []                              # no body was read, nothing handled

    run(loop, case)


@pytest.mark.parametrize(("body", "needle"), [(b"\xff\xfe", "not JSON"), (b"[1, 2]", "JSON object"),
                                              (json.dumps({"op": "bad", "req": 5}).encode(), "field 'x' missing")])
@LOOPS
def test_a_bad_body_gets_a_fatal_error(loop: str, body: bytes, needle: str) -> None:
    async def case(pair: Pair) -> None:
        serving = asyncio.ensure_future(pair.session.serve(pair.echo))
        await pair.send_raw(protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, len(body)) + body)
        reply = await pair.read()
        assert reply is not None and reply["fatal"] is True and needle in reply["reason"]
        await asyncio.wait_for(serving, 10)

    run(loop, case)


@LOOPS
def test_a_frame_cut_short_ends_the_session(loop: str) -> None:
    async def case(pair: Pair) -> None:
        serving = asyncio.ensure_future(pair.session.serve(pair.echo))
        await pair.send_raw(frame({"op": "info", "req": 1})[:-2])
        pair.client.shutdown(socket.SHUT_WR)
        reply = await pair.read()
        assert reply is not None and "closed inside a frame" in reply["reason"]
        await asyncio.wait_for(serving, 10)

    run(loop, case)


@LOOPS
def test_closing_under_a_pending_read_ends_the_loop_quietly(loop: str) -> None:
    """The daemon stopping closes sessions whose loops wait for a frame: they end, no exception."""
    async def case(pair: Pair) -> None:
        serving = asyncio.ensure_future(pair.session.serve(pair.echo))
        await asyncio.sleep(0.01)
        pair.session.close()
        await asyncio.wait_for(serving, 10)
        assert serving.exception() is None

    run(loop, case)


@LOOPS
def test_closing_under_a_running_request_ends_the_loop_quietly(loop: str) -> None:
    """A request still being handled when its session closes (a hello allocating slots as the
    daemon stops) must not read the closed socket afterwards: that was uvloop's
    'ValueError: Invalid file descriptor: -1' in a task nobody awaited."""
    async def case(pair: Pair) -> None:
        started, finish = asyncio.Event(), asyncio.Event()

        async def slow(session: Session, msg: dict[str, Any]) -> None:
            started.set()
            await finish.wait()
            await session.send(protocol.ok(msg["req"]))

        serving = asyncio.ensure_future(pair.session.serve(slow))
        await pair.send_raw(frame({"op": "hello", "req": 1}) + frame({"op": "info", "req": 2}))
        await started.wait()
        pair.session.close()
        finish.set()
        await asyncio.wait_for(serving, 10)
        assert serving.exception() is None
        try:
            got = await pair.read()
        except ConnectionResetError:                        # (the unread second request resets the stream)
            got = None
        assert got is None                                  # nothing was sent on the closed session

    run(loop, case)


@LOOPS
def test_refused_peer_gets_the_reason_for_its_first_request(loop: str) -> None:
    async def case() -> None:
        client, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(10)
        daemon_end.setblocking(False)
        try:
            protocol.send_frame(client, {"op": "hello", "req": 41, "job": "j"})
            await refuse(daemon_end, peer_of(daemon_end), "uid 65534 / gid 65534 is not allowed")
            reply = protocol.FrameReceiver(client).read()
            assert reply == {"op": "error", "req": 41, "code": "not_allowed",
                             "reason": "uid 65534 / gid 65534 is not allowed", "fatal": True}
            assert protocol.FrameReceiver(client).read() is None
            assert daemon_end.fileno() == -1
        finally:
            client.close()

    run_plain(loop, case())


@pytest.mark.parametrize("first", [b"", protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 1 << 20)])
@LOOPS
def test_refused_peer_that_sends_nothing_small_still_gets_the_reason(loop: str, first: bytes) -> None:
    async def case() -> None:
        client, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(10)
        daemon_end.setblocking(False)
        try:
            client.sendall(first)                   # nothing at all, or a header announcing a big body
            await refuse(daemon_end, peer_of(daemon_end), "not allowed", timeout=0.2)
            reply = protocol.FrameReceiver(client).read()
            assert reply is not None and reply["req"] == 0 and reply["reason"] == "not allowed"
        finally:
            client.close()

    run_plain(loop, case())


def test_peer_credentials_and_allow_lists() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        me = peer_of(b)
    assert (me.pid, me.uid, me.gid) == (os.getpid(), os.getuid(), os.getgid())
    stranger = Peer(pid=1, uid=4242, gid=4343, groups=(4444,))
    assert peer_allowed(stranger, None, None)                        # no lists: whoever can open the socket
    assert not peer_allowed(stranger, frozenset({1}), None)
    assert peer_allowed(stranger, frozenset({4242}), None)
    assert peer_allowed(stranger, None, frozenset({4343}))           # primary group
    assert peer_allowed(stranger, frozenset({1}), frozenset({4444}))  # supplementary group
    assert not peer_allowed(stranger, frozenset({1}), frozenset({2}))
    assert peer_allowed(Peer(1, 0, 0), frozenset({1}), frozenset({2}))              # root
    assert peer_allowed(Peer(1, os.getuid(), 9), frozenset({1}), frozenset({2}))    # the daemon's own user
