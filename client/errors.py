"""Errors the client raises."""


class CheckpointError(RuntimeError):
    """A save or restore that did not succeed; the message says why."""
