"""The peer channel on real loopback TCP: frames and payloads moved on threads, every wait bounded,
a cancelled transfer never leaves a thread writing into its buffer.

The other side of each connection is a plain blocking socket driven by the test, so it can stop,
send garbage or close at any byte.
"""
from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from ckptd.core import peer_protocol as pp
from ckptd.core.errors import ProtocolError
from ckptd.core.peer_channel import Channel, StalledError


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(ours, theirs): a connected loopback TCP pair."""
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        theirs = socket.create_connection(lsock.getsockname())
        ours, _ = lsock.accept()
    yield ours, theirs
    ours.close()
    theirs.close()


def frame(msg: dict[str, object], plen: int, magic: bytes = b"CP") -> bytes:
    body = json.dumps(msg).encode()
    return struct.pack(">2sHIQ", magic, pp.PEER_VERSION, len(body), plen) + body


def test_frame_and_payload_round_trip_paced_in_pieces(pair):
    ours, theirs = pair
    payload = bytes(range(256)) * (9 * 4096)               # 9 MiB: several send pieces, several recvs
    paced: list[int] = []

    async def run() -> tuple[dict[str, object], bytearray]:
        a = Channel(ours, 5.0)
        b = Channel(theirs, 5.0)
        async def receive() -> tuple[dict[str, object], bytearray]:
            msg, plen = await pp.recv(b, limit=len(payload))
            out = bytearray(plen)
            await pp.recv_payload(b, memoryview(out))
            return msg, out
        try:
            _, got = await asyncio.gather(pp.send(a, {"op": "put", "n": 1}, payload, paced.append), receive())
            return got
        finally:
            a.close()
            b.close()

    msg, out = asyncio.run(run())
    assert msg == {"op": "put", "n": 1}
    assert out == payload
    assert sum(paced) == len(payload) and max(paced) == pp.SEND_PIECE


def test_a_silent_peer_stalls_within_the_timeout(pair):
    ours, _theirs = pair

    async def run() -> float:
        ch = Channel(ours, 0.5)
        t0 = time.monotonic()
        try:
            with pytest.raises(StalledError, match="nothing received for 0.5 s"):
                await pp.recv(ch)
        finally:
            ch.close()
        return time.monotonic() - t0

    assert asyncio.run(run()) < 5.0


def test_a_payload_that_stops_midway_stalls_and_one_cut_short_says_so(pair):
    ours, theirs = pair

    async def run() -> None:
        ch = Channel(ours, 0.5)
        theirs.sendall(b"x" * 1000)
        with pytest.raises(StalledError, match="nothing received"):
            await pp.recv_payload(ch, memoryview(bytearray(4000)))
        theirs.sendall(b"y" * 10)
        theirs.close()
        with pytest.raises(ProtocolError, match="peer closed the connection inside a payload"):
            await pp.recv_payload(ch, memoryview(bytearray(4000)))
        ch.close()

    asyncio.run(run())


@pytest.mark.parametrize("bad, error", [
    (frame({"op": "x"}, 0, magic=b"XX"), "bad peer frame magic"),
    (frame({"op": "x"}, 1 << 20), "peer frame too large"),
    (struct.pack(">2sHIQ", b"CP", pp.PEER_VERSION, 3, 0) + b"{{{", "not JSON"),
    (frame({"no": "op"}, 0), "string 'op'"),
    (frame({"op": "x"}, 0)[:10], "peer closed the connection inside a frame"),
])
def test_bad_frames_are_refused_before_their_payload(pair, bad, error):
    ours, theirs = pair
    theirs.sendall(bad)
    theirs.shutdown(socket.SHUT_WR)

    async def run() -> None:
        ch = Channel(ours, 2.0)
        try:
            with pytest.raises(ProtocolError, match=error):
                await pp.recv(ch, limit=1024)
        finally:
            ch.close()

    asyncio.run(run())


def test_cancelled_transfer_waits_for_its_thread_and_closes_the_socket(pair):
    """The receiving coroutine is cancelled while its thread is blocked in recv_into: the cancel shuts
    the socket down, the thread returns, and only then does the coroutine let go: afterwards the
    socket is closed and nothing more lands in the buffer."""
    ours, theirs = pair
    buf = bytearray(1 << 20)

    async def run() -> Channel:
        ch = Channel(ours, 30.0)                 # long: only the cancel can end the call in time
        theirs.sendall(b"z" * 1000)
        task = asyncio.ensure_future(pp.recv_payload(ch, memoryview(buf)))
        await asyncio.sleep(0.3)                 # the thread is blocked waiting for byte 1001
        assert not task.done()
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 5.0
        return ch

    ch = asyncio.run(run())
    assert ch.sock.fileno() == -1                # closed by the thread's last call, which has returned
    try:
        theirs.sendall(b"w" * 1000)              # (the peer may see a reset)
    except OSError:
        pass
    time.sleep(0.2)
    assert bytes(buf[:1000]) == b"z" * 1000 and not any(buf[1000:])


def test_close_from_another_thread_ends_a_blocked_send(pair):
    """A peer that takes nothing: the sending thread blocks in sendall until close() shuts the socket
    down from elsewhere; the send fails at once instead of waiting out the timeout."""
    ours, theirs = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)

    async def run() -> float:
        ch = Channel(ours, 30.0)
        threading.Timer(0.5, ch.close).start()
        t0 = time.monotonic()
        with pytest.raises((OSError, ProtocolError)):
            await pp.send(ch, {"op": "put"}, bytes(64 << 20))
        return time.monotonic() - t0

    assert asyncio.run(run()) < 10.0


def test_more_crossing_transfers_than_send_threads_all_finish():
    """Two "nodes" each send a payload to the other over more connections at once than a pool has
    send threads, with small socket buffers so every send blocks until the other side reads. Each
    receive runs on a pool of its own, so every transfer finishes; with one pool for both, every
    thread would sit in a send that nobody reads and each transfer would stall out."""
    from ckptd.core.peer_channel import POOL_THREADS, SEND
    n, size = POOL_THREADS[SEND] + 8, 1 << 20
    small = 64 << 10
    pairs = []
    with socket.create_server(("127.0.0.1", 0), backlog=n) as lsock:
        for _ in range(n):
            theirs = socket.socket()
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, small)
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, small)
            theirs.connect(lsock.getsockname())
            ours, _ = lsock.accept()
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, small)
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, small)
            pairs.append((ours, theirs))

    async def exchange(a: Channel, b: Channel, i: int) -> tuple[bool, bool]:
        to_b, to_a = bytes([i % 251]) * size, bytes([(i + 7) % 251]) * size

        async def take(ch: Channel) -> bytes:
            _, plen = await pp.recv(ch, limit=size)
            out = bytearray(plen)
            await pp.recv_payload(ch, memoryview(out))
            return bytes(out)
        got_b, got_a, _, _ = await asyncio.gather(take(b), take(a), pp.send(a, {"op": "x"}, to_b),
                                                  pp.send(b, {"op": "x"}, to_a))
        return got_b == to_b, got_a == to_a

    async def run() -> list[tuple[bool, bool]]:
        chans = [(Channel(o, 5.0), Channel(t, 5.0)) for o, t in pairs]
        try:
            return await asyncio.gather(*(exchange(a, b, i) for i, (a, b) in enumerate(chans)))
        finally:
            for a, b in chans:
                a.close()
                b.close()

    assert asyncio.run(run()) == [(True, True)] * n
