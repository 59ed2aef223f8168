"""Structured logging: one JSON object a line (default) or plain text, with job/rank/step context; warnings
anyone can cause (refused connections) rate-limited (``Throttled``)."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": round(record.created, 6), "level": record.levelname.lower(), "msg": record.getMessage()}
        obj.update(getattr(record, "ctx", {}) or {})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ctx = getattr(record, "ctx", {}) or {}
        extra = " ".join(f"{k}={v}" for k, v in ctx.items())
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        return f"{stamp} {record.levelname.lower():7s} {record.getMessage()}" + (f" {extra}" if extra else "")


def setup(fmt: str = "json", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    logger = logging.getLogger("ckptd")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


THROTTLE_S = 60.0      # Throttled: a source's warning is logged once per this many seconds
THROTTLE_SOURCES = 16   # ... and at most this many sources' per interval


class Throttled:
    """One warning that anyone who can connect may cause (a refused connection), rate-limited: the first
    from each source (a remote host, a uid) in each ``interval`` is logged, at most ``sources`` of them;
    the rest are counted and one line says how many ("<msg>: more not logged one by one", ``count``) at
    the interval's end. Else a flood would write a line per connection, and journald's rate limit would
    then drop the daemon's real messages. Its callers count every event themselves (the metrics).
    On the event loop (the summary is a timer on it; without a running loop, at the next event)."""

    def __init__(self, logger: logging.Logger, msg: str, interval: float = THROTTLE_S,
                 sources: int = THROTTLE_SOURCES, clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.msg, self.interval, self.sources, self.clock = logger, msg, interval, sources, clock
        self.window = -float("inf")            # when this interval began
        self.seen: set[str] = set()            # sources logged in it
        self.more = 0                          # events not logged in it
        self.timer: asyncio.TimerHandle | None = None

    def warning(self, source: str, ctx: dict[str, Any]) -> None:
        now = self.clock()
        if now - self.window >= self.interval:
            self.summary()
            self.window, self.seen = now, set()
        if source not in self.seen and len(self.seen) < self.sources:
            self.seen.add(source)
            self.log.warning(self.msg, extra={"ctx": ctx})
            return
        self.more += 1
        if self.timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self.timer = loop.call_later(max(0.0, self.window + self.interval - now), self.summary)

    def summary(self) -> None:
        """The line saying how many were not logged since the last (none when none were)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.more:
            self.log.warning(f"{self.msg}: more not logged one by one",
                             extra={"ctx": {"count": self.more, "interval_s": self.interval,
                                            "sources_logged": len(self.seen)}})
            self.more = 0
