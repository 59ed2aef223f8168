"""The client's ways to talk to its daemon: a connection with numbered requests and a reader thread,
and one request answered in the calling thread.

A trainer's session (``hello``, slots, saves) keeps a ``DaemonConnection`` open; a request needing
no ``hello`` (``info``, ``stage``, ``flush``, ``memory_fetch``) is an :class:`Exchange` on a
connection of its own — :func:`ask`, or an ``Exchange`` kept open while the reply's memfd must stay
pinned. Every error reply raises :class:`DaemonRefused` with its code (FORMAT.md, "Wire protocol")."""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ckptd.core import protocol
from ckptd.core.errors import ErrorCode, ProtocolError
from ckptd.core.protocol import EventOp, Op

from .errors import CheckpointError, ConnectionLost, DaemonRefused, NoReply, NotDelivered, Unreachable

log = logging.getLogger("ckptd_client")
REQUEST_TIMEOUT_S = 60.0    # a session request's wait for its answer (a save's hand-off, a resize) unless given

EventHandler = Callable[[EventOp, dict[str, Any]], None]
LostHandler = Callable[[str], None]
# A raw dict is sent as it is (with its ``req`` filled in): for tools and tests that speak the
# wire directly. The client itself only sends typed requests.
Outgoing = protocol.Request | dict[str, Any]


def _frame(msg: Outgoing, req: int) -> tuple[str, dict[str, Any]]:
    """(op name, JSON object) of a request numbered ``req``."""
    if isinstance(msg, dict):
        return str(msg["op"]), {**msg, "req": req}
    return msg.op.value, protocol.to_wire(msg, req)


FD_OPS = (Op.HELLO.value, Op.RESIZE.value, Op.MEMORY_FETCH.value)    # ops whose ok reply carries memfds


def reply_fds(op: str, reply: dict[str, Any]) -> int:
    """How many memfds (SCM_RIGHTS) an ``ok`` reply to ``op`` carries: one per slot for
    ``hello``/``resize``, the held shard's for ``memory_fetch`` (FORMAT.md's request table)."""
    if op in (Op.HELLO.value, Op.RESIZE.value):
        return len(reply.get("slots", ()))
    return 1 if op == Op.MEMORY_FETCH.value else 0


def error_code(reply: dict[str, Any]) -> ErrorCode:
    """An error reply's code; one without (or with an unknown) code reads as REFUSED."""
    try:
        return ErrorCode(reply.get("code", ErrorCode.REFUSED.value))
    except ValueError:
        return ErrorCode.REFUSED


class DaemonConnection:
    """Replies are matched to requests by ``req``; every other frame is an event for ``on_event``
    (none: events are dropped). Call order: ``request``/``notify`` any number of times, from any
    thread, then ``close`` (or use it as a context manager).

    ``on_lost(reason)`` is called once, from whichever thread notices, when the connection
    goes away; requests still waiting then fail with :class:`ConnectionLost`."""

    def __init__(self, socket_path: str, on_event: EventHandler | None = None, timeout: float = REQUEST_TIMEOUT_S, *,
                 on_lost: LostHandler | None = None, connect_timeout: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._on_event = on_event
        self._on_lost = on_lost
        try:
            self._sock = protocol.connect(socket_path, connect_timeout)
        except ConnectionError as e:
            raise Unreachable(str(e)) from None
        self._rx = protocol.FrameReceiver(self._sock)
        self._send_lock = threading.Lock()
        self._req_ids = itertools.count(1)
        self._pending: dict[int, tuple[str, Future[dict[str, Any]]]] = {}
        self._ops: dict[int, str] = {}       # req → op until its reply is read, so its memfds are always taken
        self._lock = threading.Lock()
        self.lost: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name="ckptd-client-rx", daemon=True)
        self._reader.start()

    def __enter__(self) -> DaemonConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, msg: Outgoing, timeout: float | None = None) -> dict[str, Any]:
        """Number and send a request, wait for its reply (its memfds, if any, in ``reply["_fds"]``:
        the caller's to close). An error reply raises DaemonRefused; no reply in ``timeout``
        seconds, NoReply; a connection that ends first, ConnectionLost; a send that fails, NotDelivered;
        a message over the frame limit, ProtocolError (before anything is sent)."""
        return self.send(msg).result(timeout)

    def send(self, msg: Outgoing) -> Reply:
        """``request`` without the wait: the caller goes on while the daemon answers, and takes the
        reply (or its error) from ``Reply.result`` (which it must call). NotDelivered and
        ProtocolError are raised here."""
        req = next(self._req_ids)
        op, wire = _frame(msg, req)
        data = protocol.encode(wire)
        fut: Future[dict[str, Any]] = Future()
        with self._lock:
            if self.lost:
                raise NotDelivered(f"connection to ckptd at {self.socket_path} lost: {self.lost}")
            self._pending[req] = (op, fut)
            self._ops[req] = op
        try:
            with self._send_lock:
                self._sock.sendall(data)
        except OSError as e:
            with self._lock:
                self._pending.pop(req, None)
            self._mark_lost(f"send failed: {e}")
            raise NotDelivered(f"connection to ckptd at {self.socket_path} lost: {e}") from None
        return Reply(self, req, op, fut)

    def _replied(self, req: int) -> None:
        with self._lock:
            self._pending.pop(req, None)

    def notify(self, msg: protocol.Request) -> None:
        """Send a request whose reply nobody waits for (reports); failures are ignored."""
        try:
            with self._send_lock:
                protocol.send_frame(self._sock, protocol.to_wire(msg, next(self._req_ids)))
        except OSError:
            pass

    def _read_loop(self) -> None:
        reason = "daemon closed the connection"
        try:
            while True:
                msg = self._rx.read()
                if msg is None:
                    break
                op = msg["op"]
                if op in ("ok", "error"):
                    req = msg.get("req", -1)
                    with self._lock:
                        waiting, sent = self._pending.get(req), self._ops.pop(req, None)
                    if op == "ok" and sent in FD_OPS:
                        msg["_fds"] = self._rx.take_fds(reply_fds(sent, msg))
                    if waiting is not None:
                        waiting[1].set_result(msg)
                        continue
                    for fd in msg.get("_fds", ()):      # its requester gave up: nobody else will close them
                        os.close(fd)
                    if op == "error":
                        reason = f"daemon error: {msg.get('reason')}"
                        if msg.get("fatal"):
                            break
                    continue
                try:
                    event = EventOp(op)
                except ValueError:
                    log.debug("ckptd: ignoring unknown event %r", op)   # a newer daemon's, perhaps
                    continue
                if self._on_event is None:
                    continue
                try:
                    self._on_event(event, msg)
                except Exception:  # an event handler bug must not kill the reader
                    log.exception("ckptd event handler failed for %s", op)
        except (OSError, ProtocolError) as e:
            reason = f"{type(e).__name__}: {e}"
        self._mark_lost(reason)

    def _mark_lost(self, reason: str) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = reason
            pending = list(self._pending.values())
        for op, fut in pending:
            if not fut.done():
                fut.set_exception(ConnectionLost(f"connection to ckptd at {self.socket_path} lost before it "
                                                 f"answered {op}: {reason}"))
        for fd in self._rx.fds:
            os.close(fd)
        self._rx.fds.clear()
        if self._on_lost is not None:
            self._on_lost(reason)

    def give_up(self, reason: str) -> None:
        """Count the connection lost (``reason``: a daemon that stopped answering) though its socket is
        open: waiting requests fail, ``on_lost`` runs; the socket is shut down (the daemon, if it ever
        reads again, sees this session end)."""
        self._mark_lost(reason)
        try:
            self._sock.shutdown(2)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self._sock.shutdown(2)
        except OSError:
            pass
        self._reader.join(timeout=5)
        self._sock.close()


class Exchange:
    """One request on a connection of its own, sent and answered in the calling thread (``reply``; its
    memfds in ``reply["_fds"]``, the caller's to close). No reader thread is started and joined: with
    four ranks fetching held shards at once on a 2-core VM that was ~0.5 ms of each fetch's 2.4 ms.
    The connection stays open until ``close`` (or the ``with`` block's end): a ``memory_fetch``'s
    shard stays pinned meanwhile. Events the daemon sends before the reply are dropped; a fatal error
    (a protocol error, req 0) is ConnectionLost with its reason, as for a ``DaemonConnection``. Raises as
    ``DaemonConnection.request`` does (Unreachable when no daemon listens); every wait ends by
    ``timeout``."""

    def __init__(self, socket_path: str, msg: Outgoing, timeout: float = 10.0, connect_timeout: float = 10.0) -> None:
        try:
            self._sock = protocol.connect(socket_path, connect_timeout)
        except ConnectionError as e:
            raise Unreachable(str(e)) from None
        try:
            self.reply = self._exchange(socket_path, msg, timeout)
        except BaseException:
            self._sock.close()
            raise

    def _exchange(self, socket_path: str, msg: Outgoing, timeout: float) -> dict[str, Any]:
        op, wire = _frame(msg, 1)
        data = protocol.encode(wire)      # (ProtocolError for an oversized message: nothing sent)
        deadline = time.monotonic() + timeout
        self._sock.settimeout(timeout)
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise NotDelivered(f"connection to ckptd at {socket_path} lost: {e}") from None
        rx = protocol.FrameReceiver(self._sock)
        try:
            while True:
                self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    reply = rx.read()
                except TimeoutError:
                    raise NoReply(f"ckptd at {socket_path} did not answer {op} in time: nothing within "
                                  f"{timeout:g}s; stopped or overloaded?") from None
                except (OSError, ProtocolError) as e:
                    raise ConnectionLost(f"connection to ckptd at {socket_path} lost before it answered {op}: "
                                         f"{type(e).__name__}: {e}") from None
                if reply is None:
                    raise ConnectionLost(f"connection to ckptd at {socket_path} lost before it answered {op}: "
                                         "daemon closed the connection")
                if reply.get("op") in ("ok", "error") and reply.get("req") == 1:
                    break
                if reply.get("op") == "error" and reply.get("fatal"):   # the daemon ends the connection: say why
                    raise ConnectionLost(f"connection to ckptd at {socket_path} lost before it answered {op}: "
                                         f"daemon error: {reply.get('reason')}")
            if reply["op"] == "ok" and op in FD_OPS:
                try:
                    reply["_fds"] = rx.take_fds(reply_fds(op, reply))
                except ProtocolError as e:
                    raise ConnectionLost(f"ckptd at {socket_path} answered {op} without its memfds: {e}") from None
        finally:
            for fd in rx.fds:          # any not taken (a malformed reply's, an event's)
                os.close(fd)
            rx.fds.clear()
        if reply["op"] != "ok":
            raise DaemonRefused(op, error_code(reply), str(reply.get("reason", "no reason given")),
                                fatal=reply.get("fatal") is True)
        return reply

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()


def ask(socket_path: str, msg: Outgoing, timeout: float = 10.0) -> dict[str, Any]:
    """One request on a connection of its own (no ``hello``: ``info``, ``stage``, ``flush``), as
    ``DaemonConnection.request`` raises (and Unreachable when no daemon listens)."""
    with Exchange(socket_path, msg, timeout) as x:
        return x.reply


def daemon_root(socket_path: str) -> str:
    """The checkpoint root of the daemon at ``socket_path`` (``info``)."""
    try:
        return str(ask(socket_path, protocol.Info())["root"])
    except CheckpointError as e:
        raise CheckpointError(f"{e} (or pass root= to restore without a daemon)") from None


class Reply:
    """A sent request's reply to come (``DaemonConnection.send``)."""

    def __init__(self, conn: DaemonConnection, req: int, op: str, fut: Future[dict[str, Any]]) -> None:
        self._conn, self._req, self._op, self._fut = conn, req, op, fut

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The reply; raises as ``DaemonConnection.request`` does."""
        conn = self._conn
        bound = timeout if timeout is not None else conn.timeout
        try:
            reply = self._fut.result(bound)
        except TimeoutError:
            which = "" if timeout is not None else " (REQUEST_TIMEOUT_S, the client's request timeout)"
            raise NoReply(f"ckptd at {conn.socket_path} did not answer {self._op} in time: nothing within {bound:g}s"
                          f"{which}; stopped or overloaded? see its log and `ckptd status`") from None
        finally:
            conn._replied(self._req)
        if reply.get("op") != "ok":
            raise DaemonRefused(self._op, error_code(reply), str(reply.get("reason", "no reason given")),
                                fatal=reply.get("fatal") is True)
        return reply
