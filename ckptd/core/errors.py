"""Exceptions shared by the daemon, the client and the tools."""
from __future__ import annotations


class FormatError(ValueError):
    """A step directory, index or manifest that is malformed, crafted or corrupt."""


class ChecksumError(Exception):
    """Stored bytes that do not match their checksum (corruption on disk or in transit)."""


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection is closed after it."""
