"""The job's store with every call bounded. A TCPStore call never returns while its server's process
(rank 0's, or the launcher's) is stopped (SIGSTOP, a hung host): the request sits in the kernel's
buffers and the client reads its socket with no end — a ``wait`` with a timeout too, which past its
timeout asks the server to stop waiting and blocks on that answer. So a bare store call on the
caller's thread was a wait with no bound, whatever timeout the caller meant to keep.

``GuardedStore`` runs each call of one store connection on a worker thread of its own (a clone gets
its own worker: one connection, one thread) and waits for it at most until the caller's deadline
(``store_deadline``, plus ``GRACE_S``), else the store's own ``bound``. A call that outlives its bound
marks the store gone, for it and every clone of it: every later call raises ``StoreGone`` at once,
naming the store and how long it was waited for; the stuck worker (a daemon thread) stays behind until
the server answers or its connection breaks. The callers treat ``StoreGone`` as the store lost (rank 0
dead): saves are settled by the disk, restores fail, saying why.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

GRACE_S = 5.0       # a store call's bound past its caller's deadline (a loaded server answers late)

_local = threading.local()


class StoreGone(RuntimeError):
    """The job's store did not answer a call within its bound (or had not before): every call raises it."""


@contextlib.contextmanager
def store_deadline(end: float) -> Iterator[None]:
    """Every guarded store call this thread makes inside gives up ``GRACE_S`` after ``end`` (a
    ``time.monotonic()`` time). Nested deadlines: the earliest holds."""
    before: float | None = getattr(_local, "end", None)
    _local.end = end if before is None else min(before, end)
    try:
        yield
    finally:
        _local.end = before


def describe(store: Any) -> str:
    """The store as its errors name it: host and port for a TCPStore (through any PrefixStore)."""
    inner = getattr(store, "_underlying_non_prefix_store", None) or store
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if host is not None and port is not None:
        return f"rank 0's TCPStore at {host}:{port}"
    return type(inner).__name__


class _Shared:
    """What a store and its clones share: its name, and why it is gone (None: it is not)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.gone: str | None = None


class _Call:
    __slots__ = ("fn", "args", "done", "value", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class GuardedStore:
    """A c10d store whose calls each run on this connection's worker thread, bounded (module docstring).
    ``bound``: seconds a call outside any ``store_deadline`` may take. ``raw``: the store itself."""

    def __init__(self, store: Any, bound: float, shared: _Shared | None = None) -> None:
        self.raw = store
        self.bound = bound
        self._shared = shared or _Shared(describe(store))
        self._jobs: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def gone(self) -> str | None:
        """Why the store is taken for gone (None: it is not)."""
        return self._shared.gone

    def _work(self) -> None:
        while True:
            call = self._jobs.get()
            try:
                call.value = call.fn(*call.args)
            except BaseException as e:      # handed to the caller
                call.error = e
            call.done.set()

    def _submit(self, name: str, args: tuple[Any, ...]) -> _Call:
        if (why := self._shared.gone) is not None:
            raise StoreGone(why)
        call = _Call(getattr(self.raw, name), args)
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="ckptd-client-store", daemon=True)
                self._worker.start()
        self._jobs.put(call)
        return call

    def _call(self, name: str, *args: Any, within: float | None = None) -> Any:
        began = time.monotonic()
        if within is None:
            end: float | None = getattr(_local, "end", None)
            within = self.bound if end is None else max(0.0, end - began) + GRACE_S
        call = self._submit(name, args)
        if not call.done.wait(within):
            shared = self._shared
            if shared.gone is None:
                shared.gone = (f"the job's store ({shared.where}) did not answer within "
                               f"{time.monotonic() - began:.1f}s: rank 0 stopped or its host unreachable")
            raise StoreGone(shared.gone)
        if call.error is not None:
            raise call.error
        return call.value

    def set_soon(self, key: str, value: str | bytes) -> None:
        """``set``, not waited for (its errors dropped): a caller that must never block. In order with
        this connection's other calls."""
        with contextlib.suppress(StoreGone):
            self._submit("set", (key, value))

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def multi_set(self, keys: list[str], values: list[str] | list[bytes]) -> None:
        self._call("multi_set", keys, values)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """The store's wait, bounded by its own ``timeout`` (plus ``GRACE_S``) when given."""
        if timeout is None:
            self._call("wait", keys)
        else:
            self._call("wait", keys, timeout, within=timeout.total_seconds() + GRACE_S)

    def clone(self) -> GuardedStore:
        """A new connection to the same store, with a worker of its own; it shares this one's gone."""
        return GuardedStore(self._call("clone"), self.bound, self._shared)
