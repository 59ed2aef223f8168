"""The restore threads: work that writes into the caller's state, all of it stopped before a restore raises.

A restore decodes and copies into the live tensors on a few threads: ``reshard``'s chunk reads (every
storage restore, a sharded or resharding one from the daemons' memory through ``held_pieces``, a
restore through the bucket once staged, ``load_tensor``, DCP's reader), ``restore.load_shard``'s
format-1 chunks and ``memory_restore``'s copies out of a held memfd. Once the restore has raised —
a worker's error, or a KeyboardInterrupt (Ctrl-C) that lands on the restoring thread, most often
while it waits for them — none of them may write into the state again: the caller may be
re-initialising it. A pool left as it was (``ThreadPoolExecutor``'s join abandoned by the
interrupt) went on decoding every queued chunk into the tensors after ``restore()`` had raised.

:class:`RestoreThreads` is how every one of those pools ends. Left by an exception (any
BaseException), or interrupted in the join at the end of its ``with`` block, it tells the workers
to stop (``stopping``: each checks it before its next piece; one running finishes its current
piece), cancels every queued task, joins the threads — a further KeyboardInterrupt is held off
until they have stopped, which takes a piece each — and then re-raises the exception. A
KeyboardInterrupt held off while the pool stopped for another error is raised once it has (the
other error its context), so a Ctrl-C is never lost. With ``threads`` <= 1 there is no thread:
each task runs in the restoring thread as it is submitted.

The wait is on the futures of the tasks submitted (each finished or cancelled), never on
``Thread.join`` alone: a join interrupted by a KeyboardInterrupt marks the thread stopped while it
still runs (CPython 3.11's bpo-45274 handling), so every later join returned at once and the
workers wrote on. The threads are joined once no task is left, when all they have to do is exit.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")
PRUNE_AT = 1024               # futures kept before the done ones are dropped (then twice those left, and this)


class RestoreThreads:
    """``threads`` workers named ``name``_N for one restore's writes into the state; use it as a
    context manager (see the module docstring)."""

    def __init__(self, threads: int, name: str) -> None:
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name) if threads > 1 else None
        self._futures: list[Future[Any]] = []     # the tasks submitted to the pool, less those seen done
        self._prune_at = PRUNE_AT

    @property
    def stopping(self) -> bool:
        """The restore has raised: a worker writes nothing more (it returns before its next piece)."""
        return self._stop.is_set()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on a worker; with no thread, run now (its exception raised here, not kept)."""
        if self._pool is not None:
            fut = self._pool.submit(fn, *args)
            self._futures.append(fut)
            if len(self._futures) >= self._prune_at:     # (a large restore submits a task per 4 MiB)
                self._futures = [f for f in self._futures if not f.done()]
                self._prune_at = 2 * len(self._futures) + PRUNE_AT
            return fut
        done: Future[T] = Future()
        done.set_result(fn(*args))
        return done

    def __enter__(self) -> RestoreThreads:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._pool is None:
            return
        if exc is None:
            try:
                self._wait_idle()                   # every task done: the normal end
                self._pool.shutdown(wait=True)
                return
            except BaseException:                   # a KeyboardInterrupt in the join: stop them, then raise it
                self._stop_and_join()
                raise
        late = self._stop_and_join()
        if late is not None and not isinstance(exc, KeyboardInterrupt):
            raise late                              # the Ctrl-C held off while stopping for ``exc``

    def _stop_and_join(self) -> KeyboardInterrupt | None:
        """Workers told to stop, queued tasks cancelled, threads joined whatever KeyboardInterrupt
        arrives meanwhile (the first one is returned)."""
        self._stop.set()
        late: KeyboardInterrupt | None = None
        assert self._pool is not None
        while True:
            try:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._wait_idle()                   # the running tasks' current pieces
                self._pool.shutdown(wait=True)      # (idle threads: they only exit)
                return late
            except KeyboardInterrupt as e:          # held off: each thread finishes only its current piece
                late = late or e

    def _wait_idle(self) -> None:
        """Until every task submitted has finished or been cancelled (waiting again after an interrupt
        is safe). Each future is waited for itself: ``concurrent.futures.wait`` never counts one that
        ``shutdown(cancel_futures=True)`` cancelled as done."""
        for fut in self._futures:
            if not fut.done():
                try:
                    fut.exception()                 # (its error is the caller's to see, not raised here)
                except CancelledError:
                    pass
