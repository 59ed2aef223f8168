"""Exceptions shared by the daemon, the client and the tools."""
from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """An error reply's ``code`` (``protocol.error``): what a client branches on, while ``reason``
    is for people. FORMAT.md, "Wire protocol". A reply without a code (an older daemon) reads as REFUSED."""
    REFUSED = "refused"        # the request cannot be served; nothing more specific to say
    NO_BUCKET = "no_bucket"    # stage/flush: this daemon has no object-storage tier (s3.url unset)
    INTERNAL = "internal"      # a daemon bug, logged there; the connection stays open
    NOT_ALLOWED = "not_allowed"    # (fatal) this connection's uid/gid is not in allowed_users / allowed_groups


class FormatError(ValueError):
    """A step directory, index or manifest that is malformed, crafted or corrupt."""


class ChecksumError(Exception):
    """Stored bytes that do not match their checksum (corruption on disk or in transit)."""


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection is closed after it."""
