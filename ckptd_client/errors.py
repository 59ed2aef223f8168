"""Errors the client raises."""


class CheckpointError(RuntimeError):
    """A save or restore that did not succeed; the message says why."""


class NotDelivered(CheckpointError):
    """A request that never reached the daemon (the connection was already gone)."""
