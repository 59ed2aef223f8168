"""Structured logging: one JSON object a line (default) or plain text, with job/rank/step context."""
from __future__ import annotations

import json
import logging
import sys
import time


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
