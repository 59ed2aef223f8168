"""The job's store with every call bounded. A TCPStore call never returns while its server's process
(rank 0's, or the launcher's) is stopped (SIGSTOP, a hung host): the request sits in the kernel's
buffers and the client reads its socket with no end (a ``wait`` with a timeout, a ``clone()`` and the
store's own timeout too). So a bare store call was a wait with no bound, whatever the caller meant.

``GuardedStore`` makes its calls on connections of its own (clones of the job's store: torch's own
connection is never touched), and a watchdog thread shuts our connections to the store down when a
call outlives its deadline (the caller's ``store_deadline`` plus ``GRACE_S``, else the store's
``bound``). The call then raises in its own thread, at once: no thread is left inside a C++ store
call (one still there when the interpreter exits aborts the process), and the caller gets
``StoreGone``, naming the store and the time waited. The next call opens a new connection, so a store
that answers again (rank 0 resumed) serves it. Opening one is bounded the same way: a socket to the
store's port that appeared since the clone began is shut down. Finding the sockets needs Linux's
/proc/self/fd; elsewhere, and for stores with no server process (FileStore, HashStore), calls go to
the store as they are.

Call order: construct (no I/O), then any calls from any threads, each on a connection from the
pool of the process's connections to that store (``clone()`` returns the store itself).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from .proc_sockets import peer_port, shut, shut_new, sockets

GRACE_S = 5.0       # a store call's bound past its caller's deadline (a loaded server answers late)
TICK_S = 0.25       # how often the watchdog looks at the calls in flight

log = logging.getLogger("ckptd_client")
_local = threading.local()


class StoreGone(RuntimeError):
    """The job's store did not answer a call within its bound."""


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


def _tcp_store(store: Any) -> Any:
    """The TCPStore under ``store`` (through PrefixStores), or None."""
    inner = getattr(store, "_underlying_non_prefix_store", None) or store
    return inner if hasattr(inner, "host") and hasattr(inner, "port") else None


def describe(store: Any) -> str:
    """The store as its errors name it: host and port for a TCPStore (through any PrefixStore)."""
    inner = _tcp_store(store)
    return f"rank 0's TCPStore at {inner.host}:{inner.port}" if inner is not None else type(store).__name__


# ---- the watchdog -------------------------------------------------------------------------------

class _Watch:
    __slots__ = ("end", "action", "again", "fired", "owner")

    def __init__(self, end: float, action: Callable[[], None], again: bool, owner: object) -> None:
        self.end, self.action, self.again, self.fired, self.owner = end, action, again, False, owner


class _Watchdog:
    """One thread per process that runs each overdue watch's action once (``again``: every tick
    until it is unwatched). Watching costs a dict insert: the thread looks every ``TICK_S`` while
    anything is watched, and sleeps otherwise."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No watches and no thread (also in a forked child, where its parent's thread does not run)."""
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}
        self._busy = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, end: float, action: Callable[[], None], again: bool = False,
                 owner: object = None) -> Iterator[_Watch]:
        w = _Watch(end, action, again, owner)
        with self._lock:
            self._watches[id(w)] = w
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptd-client-store-watch", daemon=True)
                self._thread.start()
        self._busy.set()
        try:
            yield w
        finally:
            with self._lock:
                self._watches.pop(id(w), None)

    def expire(self, owner: object) -> None:
        """``owner``'s watches are due now: their actions run within ``TICK_S``."""
        with self._lock:
            for w in self._watches.values():
                if w.owner is owner:
                    w.end = 0.0

    def _run(self) -> None:
        while True:
            self._busy.wait()
            time.sleep(TICK_S)
            now = time.monotonic()
            with self._lock:
                due = [w for w in self._watches.values() if w.end <= now and (w.again or not w.fired)]
                for w in due:
                    w.fired = True
                if not self._watches:
                    self._busy.clear()
            for w in due:
                try:
                    w.action()
                except Exception:       # (never: the actions catch their own errors)
                    log.debug("ckptd: store watchdog action failed", exc_info=True)


_watchdog = _Watchdog()


def _forget_in_child() -> None:
    """A forked child has no watchdog thread, and our connections are its parent's: it starts afresh."""
    _watchdog.reset()
    _Pool._of.clear()
    _Ours._by_port.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class _Ours:
    """Our connections to one store port, by socket (``socket:[inode]``), and their lines. A call
    that outlives its bound shuts every one of them down: the store is not answering any of them,
    and a call still inside one then raises in its own thread (a call on another line whose own
    bound is not over opens a new connection and goes on). Sockets are found by /proc/self/fd: those
    to the store's port that appeared while a clone of ours was being opened (a socket torch opened
    at that very moment counts too: it is as stuck as ours)."""

    _lock = threading.Lock()
    _by_port: dict[int, _Ours] = {}

    def __init__(self, port: int) -> None:
        self.port = port
        self.sockets: set[str] = set()
        self.lines: weakref.WeakSet[_Line] = weakref.WeakSet()

    @classmethod
    def of(cls, port: int) -> _Ours:
        with cls._lock:
            ours = cls._by_port.get(port)
            if ours is None:
                ours = cls._by_port[port] = cls(port)
            return ours

    def add(self, line: _Line, sockets: set[str], live: set[str]) -> None:
        """``line`` and its ``sockets``; those of ours no longer among this process's ``live`` are forgotten."""
        with self._lock:
            self.sockets = (self.sockets & live) | sockets
            self.lines.add(line)

    def shut_all(self) -> None:
        with self._lock:
            lines = list(self.lines)
        for line in lines:
            line.killed = True
        live = sockets()
        with self._lock:
            self.sockets &= set(live)          # (closed ones forgotten)
            ours = [(link, live[link]) for link in self.sockets]
        for link, fd in ours:
            if peer_port(fd) == self.port:
                shut(fd, link)


class _Line:
    """One connection of ours to the store. ``killed``: its socket was shut down (or is being)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.killed = False


class _Pool:
    """Our connections to one store (torch's store object: every Checkpointer of a process on it
    shares them). A call takes one, or opens one when every one is in use by another call, and gives
    it back: a process holds as many as it makes calls at once, at a run's start one per rank (each
    connection costs the store's server an accept on its one thread: thousands of ranks opening one
    more at once waited minutes). Opens run at once, never one after another.

    New connections are cloned from the first, which is ours, its timeout set to the store's bound:
    a clone of a stopped store retries its connect until that timeout, each try's read shut down by
    the watchdog, so opening one takes at most the later of the call's deadline and the bound. The
    first is cloned from torch's store, with torch's timeout: it is opened with the Checkpointer
    (rank 0 answered a moment ago)."""

    _lock = threading.Lock()
    _of: weakref.WeakValueDictionary[int, _Pool] = weakref.WeakValueDictionary()

    def __init__(self, raw: Any, port: int, bound: float) -> None:
        self.raw, self.port, self.bound = raw, port, bound
        self.idle: list[_Line] = []
        self.source: Any = None
        self.lock = threading.Lock()
        self.dead: str | None = None        # why its server is taken for exited (it closed a connection)

    @classmethod
    def of(cls, raw: Any, port: int, bound: float) -> _Pool:
        with cls._lock:
            pool = cls._of.get(id(raw))
            if pool is None or pool.raw is not raw:
                pool = cls._of[id(raw)] = cls(raw, port, bound)
            return pool

    def take(self, end: float, gone: Callable[[str], StoreGone], owner: object) -> _Line:
        with self.lock:
            while self.idle:
                line = self.idle.pop()
                if not line.killed:
                    return line
        return self._open(end, gone, owner)

    def give(self, line: _Line) -> None:
        if not line.killed:
            with self.lock:
                self.idle.append(line)

    def _open(self, end: float, gone: Callable[[str], StoreGone], owner: object) -> _Line:
        """A new connection (``gone(...)`` raised if the store did not answer it by ``end``)."""
        port, source = self.port, self.source
        before = set(sockets())
        with _watchdog.watching(end, lambda: shut_new(before, port), again=True, owner=owner) as w:
            try:
                conn = (self.raw if source is None else source).clone()
            except Exception as e:
                if w.fired:
                    raise gone("a new connection") from None
                if type(e).__name__ == "DistNetworkError":  # refused, for as long as torch retries: exited
                    self.dead = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                raise
        if w.fired:             # (as it returned: its socket may be shut down)
            raise gone("a new connection")
        if source is None:
            conn.set_timeout(timedelta(seconds=self.bound))
            with self.lock:
                self.source = self.source or conn
        line, live = _Line(conn), sockets()
        _Ours.of(port).add(line, {link for link, fd in live.items() if link not in before and peer_port(fd) == port},
                           set(live))
        return line


class GuardedStore:
    """A c10d store whose every call is bounded (module docstring). ``bound``: seconds a call outside
    any ``store_deadline`` may take. ``raw``: the store itself (torch's connection: never called,
    but for ``set_soon``). Calls go on connections from the process's pool for ``raw`` (``_Pool``)."""

    def __init__(self, store: Any, bound: float) -> None:
        self.raw = store
        self.bound = bound
        self.where = describe(store)
        self.abandoned = False
        inner = _tcp_store(store)
        self._pool = _Pool.of(store, int(inner.port), bound) \
            if inner is not None and os.path.isdir("/proc/self/fd") else None

    def _call(self, name: str, *args: Any, within: float | None = None) -> Any:
        began = time.monotonic()
        if within is None:
            end_at: float | None = getattr(_local, "end", None)
            within = self.bound if end_at is None else max(0.0, end_at - began) + GRACE_S
        pool = self._pool
        if self.abandoned:
            raise StoreGone(f"no more calls to the job's store ({self.where}): its caller closed")
        if pool is None:
            return getattr(self.raw, name)(*args)
        if pool.dead is not None:       # a connection of it was closed by its server: no clone of it to try
            raise RuntimeError(f"the job's store ({self.where}) is gone: {pool.dead}")
        end, port = began + within, pool.port

        def gone(what: str) -> StoreGone:
            if self.abandoned:
                return StoreGone(f"{what} on the job's store ({self.where}) was cut short: its caller closed")
            return StoreGone(f"the job's store ({self.where}) did not answer {what} within "
                             f"{time.monotonic() - began:.1f}s: rank 0 stopped or its host unreachable")
        while True:
            line = pool.take(end, gone, self)
            with _watchdog.watching(end, lambda: _Ours.of(port).shut_all(), owner=self) as w:
                try:
                    value = getattr(line.conn, name)(*args)
                except Exception as e:
                    if w.fired or line.killed:          # shut down by the watchdog
                        if not w.fired and time.monotonic() < end and not self.abandoned:
                            continue    # for another call's deadline: a new connection
                        raise gone(f"{'an' if name[0] in 'aeiou' else 'a'} {name}") from None
                    if type(e).__name__ == "DistStoreError":    # a wait's timeout: the connection is sound
                        pool.give(line)
                    elif type(e).__name__ == "DistNetworkError":   # the server closed it: it exited
                        pool.dead = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    raise               # (else it is not given back: it may be broken)
            pool.give(line)
            return value

    def abandon(self) -> None:
        """No more calls through this object: new ones raise, and those in flight (on a thread that must
        not outlive its owner's ``close()``) end within ``TICK_S``, their connections shut down. Calls
        of other objects on those connections open new ones and go on."""
        self.abandoned = True
        _watchdog.expire(self)

    def set_soon(self, key: str, value: str | bytes) -> None:
        """``set`` on torch's connection, errors dropped: for a caller that must never wait behind
        another call of this store's (a ``set`` is not answered, so it does not block on a stopped server)."""
        with contextlib.suppress(Exception):
            self.raw.set(key, value)

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
        """The store's wait, bounded by its own ``timeout`` or, where later, the caller's deadline
        (plus ``GRACE_S``): a busy server answers a wait's end late, and only a call that outlives
        the caller's own bound is taken for a stopped store."""
        if timeout is None:
            self._call("wait", keys)
            return
        end_at: float | None = getattr(_local, "end", None)
        left = 0.0 if end_at is None else end_at - time.monotonic()
        self._call("wait", keys, timeout, within=max(timeout.total_seconds(), left) + GRACE_S)

    def clone(self) -> GuardedStore:
        """Itself: every call takes a connection of its own from the pool (a store is cloned for a
        blocking wait, which must not hold up the calls of other threads)."""
        return self
