"""One Checkpointer: one call at a time, in the process that made it.

Two threads making their first save at once both connected (the daemon then held two sessions for
one Checkpointer), and one unmapped the slots the other's copy thread was writing into: a SIGSEGV,
or a committed step holding the other save's bytes. So the calls that start work (``save``,
``prepare``, ``restore``, ``close``) take one lock; a second thread's call waits until the first
returns (a save returns once handed off, its commit waited for apart).

A forked child (a DataLoader worker, a multiprocessing pool) inherits the Checkpointer's daemon
connection, slot mappings, store connections and at-exit hooks, but none of its threads. A save in
the child went through the parent's session (the parent's reader took its reply), and a child that
exited closed the parent's socket, or removed its private daemon's directory. So those calls refuse
in a child, naming the fix, and every close and at-exit hook does nothing there (``ProcessOwner``).
"""
from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from .errors import CheckpointError

P = ParamSpec("P")
R = TypeVar("R")


class ProcessOwner:
    """The process that made an object; ``here()`` is False in a forked child of it."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def here(self) -> bool:
        return os.getpid() == self.pid


class ApiGuard(ProcessOwner):
    """The owning process and the lock of one Checkpointer's calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.RLock()

    def refuse_elsewhere(self, what: str) -> None:
        if not self.here():
            raise CheckpointError(
                f"{what}() in process {os.getpid()}, a fork of process {self.pid} that made this Checkpointer: its "
                f"daemon session, slots and store connections are the parent's, and none of its threads run "
                f"here; make a new Checkpointer in this process (or save from the parent)")


class Guarded(Protocol):
    guard: ApiGuard


G = TypeVar("G", bound=Guarded)


def guarded(in_child: Callable[[], Any] | None = None) -> Callable[[Callable[Concatenate[G, P], R]],
                                                                     Callable[Concatenate[G, P], R]]:
    """A method of an object with a ``guard``: run under its lock, and refused in a forked child
    (or, with ``in_child``, answered by it there without touching anything: ``close``)."""
    def wrap(method: Callable[Concatenate[G, P], R]) -> Callable[Concatenate[G, P], R]:
        @functools.wraps(method)
        def call(self: G, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if in_child is not None and not self.guard.here():
                return in_child()
            self.guard.refuse_elsewhere(method.__name__)
            with self.guard.lock:
                return method(self, *args, **kwargs)
        return call
    return wrap
