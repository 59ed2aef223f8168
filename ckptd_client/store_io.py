"""Store primitives the relay, the run handshake and the restore's agreements share: waits without
polling, chunked reads, a non-blocking peek, a broadcast's last reader deleting it (and marking it
read, for a writer that must outlast its readers)."""
from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from . import store_keys
from .store_guard import GuardedStore, StoreGone, store_deadline

CHUNK = 1024            # keys per multi_get/check: one huge request is slower than chunks
WAIT_SLICE_S = 10.0     # longest single store wait: bounds how long close() and exit wait for the relay
ABSENT = "\x00ckptd-absent"     # peek's answer for a missing key (never a value ckptd writes)


def guarded_store(store: Any, bound: float) -> Any:
    """``store`` with every call bounded (store_guard.py; ``bound``: a call's seconds outside any
    wait). None stays None; a guarded store is returned as it is (its clones share its fate)."""
    if store is None or isinstance(store, GuardedStore):
        return store
    return GuardedStore(store, bound)


def abandon(store: Any, thread: threading.Thread) -> None:
    """Cut short the calls of a guarded ``store`` still in flight and refuse later ones (a store that
    cannot be guarded: nothing to do), then give ``thread``, which was making them, 5 s to end."""
    if isinstance(store, GuardedStore):
        store.abandon()
        thread.join(timeout=5.0)


class StoreWaiter:
    """Blocking waits on store keys without polling: ``wait`` on a cloned connection (a guarded
    store's clone is itself: its pool gives each call a connection), in slices of at most
    ``WAIT_SLICE_S`` so that ``stop`` ends a wait soon (a thread still inside a C++ store call while
    the interpreter exits aborts the process). Stores that cannot be cloned are
    polled slowly, with jitter. Once the store is found gone (its server, in rank 0's process,
    exited; or, a guarded store, it did not answer by the wait's end: store_guard.py) every wait
    raises at once: a clone() of a dead store would block for the store's whole timeout, and again
    on its retry."""

    def __init__(self, store: Any, stop: threading.Event | None = None) -> None:
        self.store = store
        self.stop = stop or threading.Event()
        self._clone: Any = None
        self.can_clone = True         # until a clone() fails
        self.gone: Exception | None = None

    def _check(self, keys: list[str]) -> bool:
        """Whether every key exists, on the first connection (raises, and remembers, if the store is gone)."""
        if self.gone is not None:
            raise self.gone
        try:
            return bool(self.store.check(keys))
        except StoreGone as e:      # (a guarded store: it did not answer in time; the error says so)
            self.gone = e
            raise
        except Exception as e:
            self.gone = RuntimeError(f"the job's store is gone ({type(e).__name__}: {str(e)[:200]})")
            raise self.gone from None

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """True once every key exists; False after ``timeout`` seconds (or once stopped). Raises if
        the store is gone. A NaN or infinite ``timeout`` is a ValueError: NaN would never end (every
        comparison with it is false) and spin, re-checking the store without waiting."""
        if not math.isfinite(timeout):
            raise ValueError(f"store wait: timeout must be a finite number of seconds, got {timeout!r}")
        keys = list(keys)
        end = time.monotonic() + timeout
        with store_deadline(end):       # a guarded store's calls end with the wait (store_guard.py)
            return self._wait(keys, end)

    def _wait(self, keys: list[str], end: float) -> bool:
        while True:
            left = end - time.monotonic()
            done = self._check(keys)        # (also: the store is alive before any clone)
            if done or left <= 0 or self.stop.is_set():
                return done
            if self._clone is None and self.can_clone:
                self._clone = _clone(self.store)
                self.can_clone = self._clone is not None
            if not self.can_clone:
                time.sleep(min(left, 0.2 + 0.3 * random.random()))
                continue
            piece, began = min(left, WAIT_SLICE_S), time.monotonic()
            try:
                self._clone.wait(keys, timedelta(seconds=piece))
                return True
            except StoreGone as e:
                self.gone = e
                raise
            except Exception:
                if time.monotonic() - began < 0.5 * piece:      # failed rather than timed out
                    self._clone = None
                    time.sleep(min(left, 0.2 + 0.3 * random.random()))

    def forget(self) -> None:
        """No more waits: the cloned connection is dropped, so as not to hold a socket open."""
        self._clone = None


def _clone(store: Any) -> Any:
    try:
        return store.clone()
    except Exception:        # no clone() (a store type without it): the waiter polls instead
        return None


def read_once(store: Any, key: str, readers: int, mark: str | None = None) -> None:
    """This rank has read ``key``, one of ``readers`` that will: the last of them deletes it (and
    its count), so a run leaves none of its broadcasts behind, and sets ``mark`` (if given) for the
    writer to wait on (``wait_all_read``). Best effort (the store may be gone)."""
    count = store_keys.readers(key)
    try:
        if store.add(count, 1) >= readers:
            store.delete_key(key)
            store.delete_key(count)
            if mark is not None:
                store.set(mark, "1")
    except Exception:
        pass


def wait_all_read(store: Any, marks: Sequence[str], timeout: float) -> bool:
    """(The writer of broadcasts) Whether every reader of each broadcast set its mark within ``timeout``
    seconds; the marks are then deleted. Why wait: the store's server may live in this process (rank 0's,
    with ``init_method="tcp://..."`` and no launcher), and a reader still reading when it exits fails.
    False also when the store is gone."""
    waiter = StoreWaiter(store)
    try:
        with store_deadline(time.monotonic() + timeout):
            done = waiter.wait(marks, timeout)
            for mark in marks if done else ():
                store.delete_key(mark)
        return done
    except Exception:
        return False
    finally:
        waiter.forget()


def multi_get(store: Any, keys: Sequence[str]) -> list[bytes]:
    out: list[bytes] = []
    for i in range(0, len(keys), CHUNK):
        out += store.multi_get(list(keys[i: i + CHUNK]))
    return out


def peek(store: Any, key: str) -> str | None:
    """The key's value, or None if it does not exist, without blocking (a ``get`` of a missing key
    waits for it) and without changing it: a compare_set expecting a value no key holds."""
    value = store.compare_set(key, ABSENT, ABSENT)
    text = value.decode() if isinstance(value, bytes) else str(value)
    return None if text == ABSENT else text
