"""One connection to the node's daemon: requests, and a reader thread for events."""
from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ckptd.core import protocol
from ckptd.core.errors import ProtocolError
from ckptd.core.protocol import EventOp

from .errors import CheckpointError, NoReply, NotDelivered

log = logging.getLogger("ckptd_client")

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


class DaemonConnection:
    """Replies are matched to requests by ``req``; every other frame is an event for ``on_event``.

    ``on_lost(reason)`` is called once, from whichever thread notices, when the connection
    goes away; requests still waiting then fail with the reason."""

    def __init__(self, socket_path: str, on_event: EventHandler, timeout: float = 60.0, *,
                 on_lost: LostHandler | None = None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._on_event = on_event
        self._on_lost = on_lost
        try:
            self._sock = protocol.connect(socket_path)
        except ConnectionError as e:
            raise CheckpointError(str(e)) from None
        self._rx = protocol.FrameReceiver(self._sock)
        self._send_lock = threading.Lock()
        self._req_ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.lost: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name="ckptd-client-rx", daemon=True)
        self._reader.start()

    def request(self, msg: Outgoing, timeout: float | None = None) -> dict[str, Any]:
        """Number and send a request, wait for its reply; an error reply raises CheckpointError."""
        req = next(self._req_ids)
        op, wire = _frame(msg, req)
        fut: Future[dict[str, Any]] = Future()
        with self._lock:
            if self.lost:
                raise NotDelivered(f"connection to ckptd at {self.socket_path} lost: {self.lost}")
            self._pending[req] = fut
        try:
            with self._send_lock:
                protocol.send_frame(self._sock, wire)
        except OSError as e:
            with self._lock:
                self._pending.pop(req, None)
            self._mark_lost(f"send failed: {e}")
            raise NotDelivered(f"connection to ckptd at {self.socket_path} lost: {e}") from None
        try:
            reply = fut.result(timeout if timeout is not None else self.timeout)
        except TimeoutError:
            raise NoReply(f"ckptd at {self.socket_path} did not answer {op} in time") from None
        finally:
            with self._lock:
                self._pending.pop(req, None)
        if reply.get("op") != "ok":
            raise CheckpointError(f"ckptd refused {op}: {reply.get('reason', 'no reason given')}")
        return reply

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
                    if "slots" in msg and op == "ok":
                        msg["_fds"] = self._rx.take_fds(len(msg["slots"]))
                    fut = self._pending.get(msg.get("req", -1))
                    if fut is not None:
                        fut.set_result(msg)
                    elif op == "error":
                        reason = f"daemon error: {msg.get('reason')}"
                        if msg.get("fatal"):
                            break
                    continue
                try:
                    event = EventOp(op)
                except ValueError:
                    log.debug("ckptd: ignoring unknown event %r", op)   # a newer daemon's, perhaps
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
        for fut in pending:
            if not fut.done():
                fut.set_result({"op": "error", "reason": f"connection lost: {reason}"})
        for fd in self._rx.fds:
            os.close(fd)
        self._rx.fds.clear()
        if self._on_lost is not None:
            self._on_lost(reason)

    def close(self) -> None:
        try:
            self._sock.shutdown(2)
        except OSError:
            pass
        self._reader.join(timeout=5)
        self._sock.close()
