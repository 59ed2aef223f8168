"""Errors the client raises."""
from __future__ import annotations

from ckptd.core.errors import ErrorCode


class CheckpointError(RuntimeError):
    """A save or restore that did not succeed; the message says why."""


class NotDelivered(CheckpointError):
    """A request that never reached the daemon (the connection was already gone)."""


class NoReply(CheckpointError):
    """A request the daemon did not answer in time: it may still be carried out (a slow commit)."""


class MissingData(CheckpointError):
    """A committed step here lacks a data file the restore reads (a step staged from the bucket for
    one rank, read by a rank that needs others' pieces): staging every rank's files can help;
    a checksum failure cannot be helped that way and is a plain CheckpointError."""


class Unreachable(CheckpointError):
    """No daemon listens on the socket (the message says which path and how to start one)."""


class ConnectionLost(CheckpointError):
    """The connection went away before the daemon answered: the request may or may not have been
    carried out."""


class DaemonRefused(CheckpointError):
    """The daemon answered with an error reply: branch on ``code`` (FORMAT.md's error codes), show ``reason``.
    ``fatal``: the daemon ends the connection with it (the session itself is refused, not one request)."""

    def __init__(self, op: str, code: ErrorCode, reason: str, *, fatal: bool = False) -> None:
        super().__init__(f"ckptd refused {op}: {reason}")
        self.op, self.code, self.reason, self.fatal = op, code, reason, fatal


def refuse_closed(closed: bool, what: str) -> None:
    """A closed ``Checkpointer``'s ``what`` (save, restore, prepare) refused before anything is read or
    written, and before the daemon is asked for a session or slots again (close() ended them)."""
    if closed:
        raise CheckpointError(f"checkpointer is closed: {what}() after close() is refused (make a new Checkpointer)")


def needs_extra(module: str, package: str, extra: str, e: ImportError) -> ModuleNotFoundError:
    """The error for an optional framework module (``module``) imported where its ``package`` is not
    installed (or not the version it needs): names the extra to install, the original error in brackets."""
    return ModuleNotFoundError(f"{module} needs {package}: pip install 'ckptd[client,{extra}]' ({e})", name=package)
