"""One connected trainer rank: who it is, its slots, its frame loop and what is sent to it.

The socket is touched only here. A session that is closed (its peer left, a fatal protocol
error, the daemon stopping) sends nothing more and reads nothing more: uvloop raises
ValueError, not OSError, for a socket closed under a pending operation, and a task that
died of it is what left "Task exception was never retrieved" in the log.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckptd.core import protocol
from ckptd.core.errors import ErrorCode, ProtocolError
from ckptd.core.protocol import EventOp
from ckptd.core.schema import TensorLayout, parse_layout
from ckptd.daemon.filling import FillingSlot
from ckptd.daemon.runtime import RequestError, TaskSet, bounded
from ckptd.daemon.service.snapshot import SessionView
from ckptd.daemon.slot_pool import Slot
from ckptd.daemon.streamed import StreamedShard
from ckptd.daemon.tiers.base import SlotLoan

log = logging.getLogger("ckptd")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)   # Linux >= 4.13
REFUSED_REQUEST_LIMIT = 64 * 1024                      # a refused peer gets no big buffer out of us


@dataclass(frozen=True)
class Peer:
    """The process at the other end, as the kernel saw it at connect time."""
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def peer_of(sock: socket.socket) -> Peer:
    """SO_PEERCRED (+ SO_PEERGROUPS where the kernel has it); OSError if the socket is gone."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    try:
        data = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
        groups: tuple[int, ...] = struct.unpack(f"{len(data) // 4}I", data[: len(data) // 4 * 4])
    except OSError:
        groups = ()
    return Peer(pid, uid, gid, groups)


def peer_allowed(peer: Peer, allowed_uids: frozenset[int] | None, allowed_gids: frozenset[int] | None) -> bool:
    """No lists: anyone who can open the socket. Root and the daemon's own user always."""
    if allowed_uids is None and allowed_gids is None:
        return True
    if peer.uid == 0 or peer.uid == os.getuid():
        return True
    return (allowed_uids is not None and peer.uid in allowed_uids) or \
           (allowed_gids is not None and (peer.gid in allowed_gids or not allowed_gids.isdisjoint(peer.groups)))


class LayoutMemo:
    """A session's last SAVE layout: the tensor list as it came off the wire, the slot bound it was
    checked against, and what ``schema.parse_layout`` made of it. A trainer's saves send the same
    list save after save (its plan is reused while its state's structure holds), and parsing it
    runs on the daemon's event loop: 50-80 ms a SAVE at 8,192 tensors on the benchmarks' VM, a rank
    at a time, where comparing it with the last one takes 3 ms. A list equal to the last one (``==``,
    as decoded JSON: the same names and dtypes, numbers equal as numbers, so the same layout) gets
    the last one's layout; any other is parsed and checked in full."""

    def __init__(self) -> None:
        self._last: tuple[Any, int, list[TensorLayout]] | None = None

    def parse(self, tensors: Any, bound: int) -> list[TensorLayout]:
        """``parse_layout(tensors, bound)`` (ValueError as it raises it), reused for an equal input."""
        last = self._last
        if last is not None and last[1] == bound and type(tensors) is list and last[0] == tensors:
            return list(last[2])
        self._last = None
        layout = parse_layout(tensors, bound)
        self._last = (tensors, bound, layout)
        return list(layout)


Handler = Callable[["Session", dict[str, Any]], Awaitable[None]]


class Session:
    """A connection; after hello, one rank of one job."""

    def __init__(self, sock: socket.socket, peer: Peer, tasks: TaskSet,
                 frame_timeout: float = protocol.FRAME_TIMEOUT_S) -> None:
        self.sock = sock
        self.peer = peer
        self.frame_timeout = frame_timeout     # a frame, once its first byte is here, must arrive within this
        self.job: str | None = None
        self.rank = -1
        self.world_size = 0
        self.local_ranks = 1            # the job's ranks on this node, as its hello said (slot budget shares)
        self.slots: list[Slot] = []
        self.streams: dict[int, StreamedShard] = {}     # step → a save streamed through the slots
        self.filling: dict[int, FillingSlot] = {}       # step → a save whose slot is still being filled
        self.saves = 0
        self.last_report: dict[str, Any] | None = None     # the client's latest {step, stall_s, fence_s}
        self.layouts = LayoutMemo()
        self.closed = False
        self._serving = False              # the frame loop runs (and closes the socket when it ends)
        self._tasks = tasks
        self._send_lock = asyncio.Lock()

    def ctx(self) -> dict[str, Any]:
        """Structured-log fields of this peer."""
        return {"job": self.job, "rank": self.rank, "pid": self.peer.pid, "uid": self.peer.uid}

    def view(self) -> SessionView | None:
        if self.job is None:
            return None
        return SessionView(self.job, self.rank, self.world_size, self.peer.pid, self.peer.uid, len(self.slots),
                           sum(s.busy and not s.lent for s in self.slots), self.saves,
                           dict(self.last_report) if self.last_report is not None else None,
                           sum(s.size for s in self.slots), sum(s.lent for s in self.slots))

    # ---- sending ---------------------------------------------------------------

    async def send(self, msg: dict[str, Any], fds: Sequence[int] = ()) -> bool:
        """Send one frame; False (and the session closed) when the peer is gone."""
        if self.closed:
            return False
        async with self._send_lock:        # frames of concurrent senders never interleave, and keep their order
            if self.closed:
                return False
            try:
                await protocol.send_frame_async(asyncio.get_running_loop(), self.sock, msg, fds)
                return True
            except (OSError, ValueError):    # ValueError: closed under the send (uvloop)
                self.close()
                return False

    def event(self, msg: dict[str, Any]) -> None:
        """Send an event without waiting for it (the caller may be a thread's callback)."""
        if not self.closed:
            self._tasks.spawn(self.send(msg), f"event {msg.get('op')} to rank {self.rank} of {self.job}")

    def slot_free(self, slot: Slot) -> None:
        """A save no longer reads ``slot`` (nor the memory tier keeps it): the trainer may fill it again."""
        slot.busy = slot.lent = False
        if slot not in self.slots:         # resized or session gone while writing
            slot.close()
            return
        self.event(protocol.event(EventOp.SLOT_FREE, slot=slot.index))

    def idle_slot(self, index: int) -> Slot:
        """Slot ``index`` of this rank, which no save reads now (RequestError otherwise)."""
        if not 0 <= index < len(self.slots):
            raise RequestError(f"no slot {index}")
        if self.slots[index].busy:
            raise RequestError(f"slot {index} is still being written")
        return self.slots[index]

    def source(self, step: int, slot: Slot, stream: StreamedShard | FillingSlot | None
               ) -> tuple[memoryview | StreamedShard | FillingSlot, Callable[[], None], SlotLoan | None]:
        """What a save writes from (the slot, the slot as it is filled, or the parts streamed through
        the slots), what gives its slots back once the write reads no more, and the slot's loan to the
        memory tier."""
        if stream is None:
            return slot.view, lambda: self.slot_free(slot), self.loan(slot)
        if isinstance(stream, FillingSlot):
            return stream, lambda: self.slot_free(slot), self.loan(slot)

        def end() -> None:
            stream.finish()
            if self.streams.get(step) is stream:
                del self.streams[step]
        return stream, end, None

    def started(self, step: int, slot: Slot, stream: StreamedShard | FillingSlot | None) -> None:
        """A save from ``slot`` was accepted (and, streamed or filling, waits for its next parts or
        bytes here)."""
        slot.busy = True
        if isinstance(stream, FillingSlot):
            self.filling[step] = stream
        elif stream is not None:
            self.streams[step] = stream
        self.saves += 1

    def loan(self, slot: Slot) -> SlotLoan:
        """``slot`` offered to the memory tier to keep as the held copy of the shard saved in it."""
        return SlotLoan(slot.fd, slot.mm, can_lend=lambda steps: self.can_lend(slot, steps),
                        lend=lambda: self.slot_lent(slot), give_back=lambda: self.slot_free(slot))

    def kept_slots(self) -> set[int]:
        """The memfds of this rank's slots when the memory tier keeps every one (held steps whose
        commit this daemon has not seen, or failed relayed steps it was never told of), else none:
        the trainer asks for one back (``reclaim``) when it has nothing to save into."""
        if self.slots and all(s.lent for s in self.slots):
            return {s.fd for s in self.slots}
        return set()

    def can_lend(self, slot: Slot, steps: int) -> bool:
        """Whether the memory tier may keep ``slot`` while it keeps up to ``steps`` steps of this job:
        the trainer must always get a slot back once a newer step commits (or the step fails)."""
        n = len(self.slots)
        return slot in self.slots and (steps < n or sum(s.lent for s in self.slots) + 1 < n)

    def slot_lent(self, slot: Slot) -> None:
        """The memory tier keeps ``slot`` as a held step's bytes; ``slot_free`` when it lets go."""
        slot.lent = True
        if slot in self.slots:
            self.event(protocol.event(EventOp.SLOT_HELD, slot=slot.index))

    def close(self) -> None:
        """Stop reading and sending; the peer sees the end of the stream at once.

        The descriptor itself is closed by the frame loop as it ends (a read pending on a
        descriptor closed under it would never return) or here when no loop runs."""
        if self.closed:
            return
        self.closed = True
        for stream in self.streams.values():     # its parts will never come
            stream.cancel()
        for fill in self.filling.values():       # nor the rest of its bytes
            fill.cancel()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes a pending read with the end of the stream
        except OSError:
            pass
        if not self._serving:
            self.sock.close()

    # ---- receiving -----------------------------------------------------------

    async def _read(self, loop: asyncio.AbstractEventLoop) -> dict[str, Any] | None:
        """The next frame, or None at the end of the stream or once the session is closed."""
        header = await protocol.recv_exact_async(loop, self.sock, protocol.HEADER.size, self.frame_timeout,
                                                 idle_first=True)   # (idle between frames, not inside one)
        if header is None or self.closed:
            return None
        length = protocol.parse_header(header)
        body = await protocol.recv_exact_async(loop, self.sock, length, self.frame_timeout)
        if self.closed:
            return None
        if body is None:
            raise ProtocolError("connection closed inside a frame body")
        return protocol.decode_body(body)

    async def serve(self, handle: Handler) -> None:
        """Read requests and hand each to ``handle`` (one at a time, in order) until the peer
        leaves, sends something that is not our protocol, or the session is closed."""
        loop = asyncio.get_running_loop()
        self._serving = True
        try:
            while not self.closed:
                try:
                    msg = await self._read(loop)
                    if msg is None:
                        break
                    await handle(self, msg)
                except ProtocolError as e:
                    reason = bounded(f"protocol error: {e}")
                    log.warning("protocol error", extra={"ctx": {**self.ctx(), "error": reason}})
                    await self.send(protocol.error(0, reason, fatal=True))
                    break
        except (ConnectionError, OSError) as e:
            log.info("connection lost", extra={"ctx": {**self.ctx(), "error": str(e)}})
        except ValueError:
            if not self.closed:            # a closed socket under a read is an end; anything else is a bug
                raise
        finally:
            self._serving = False
            if self.closed:
                self.sock.close()


async def refuse(sock: socket.socket, peer: Peer, reason: str, timeout: float = 5.0) -> None:
    """Answer a refused peer's first request with the reason (code ``not_allowed``, fatal), then close.

    Closing at once can turn into EPIPE on the peer's send and hide the reason; so read its
    first (small) request within ``timeout`` and answer that request's ``req``."""
    loop = asyncio.get_running_loop()

    async def first_req() -> int:
        header = await protocol.recv_exact_async(loop, sock, protocol.HEADER.size)
        if header is None:
            return 0
        length = protocol.parse_header(header)
        if length > REFUSED_REQUEST_LIMIT:
            return 0
        body = await protocol.recv_exact_async(loop, sock, length)
        req = protocol.decode_body(body or b"").get("req")
        return req if type(req) is int else 0

    try:
        try:
            req = await asyncio.wait_for(first_req(), timeout)
        except (asyncio.TimeoutError, ProtocolError, OSError):
            req = 0
        try:
            await protocol.send_frame_async(loop, sock,
                                            protocol.error(req, reason, fatal=True, code=ErrorCode.NOT_ALLOWED))
        except OSError:
            pass
    finally:
        sock.close()
