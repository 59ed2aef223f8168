"""Errors the client raises."""


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
