"""Errors the client raises."""


class CheckpointError(RuntimeError):
    """A save or restore that did not succeed; the message says why."""


class NotDelivered(CheckpointError):
    """A request that never reached the daemon (the connection was already gone)."""


class NoReply(CheckpointError):
    """A request the daemon did not answer in time: it may still be carried out (a slow commit)."""
