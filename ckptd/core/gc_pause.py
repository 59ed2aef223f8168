"""Cyclic garbage collection paused while a large job's commit or index is parsed and built.

A commit at tens of thousands of ranks parses and builds object graphs of 10^5–10^6 objects
(the node records, the COMMIT's rank records, the tensor map, index.json). CPython's cyclic
collector runs every few hundred allocations and its older generations walk every live object,
so building such a graph with it on costs several times the build itself: at 32,768 ranks,
1.4 s instead of 0.19 s for rank 0's decode of the node records, 1.7 s instead of 0.12 s for
the daemon's decode of the COMMIT, 2.1 s instead of 0.7 s for the index build (benchmarks/
scale_thin.py). These graphs hold no reference cycles, so deferring collection loses nothing;
it resumes when the last pause ends. Pauses nest and may overlap across threads.
"""
from __future__ import annotations

import gc
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Documents at least this large are decoded with collection paused (smaller ones: no measurable gain).
BULK_BYTES = 256 * 1024

_lock = threading.Lock()
_depth = 0
_resume = False


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()


def loads(data: bytes | str) -> Any:
    """``json.loads``, with collection paused for a bulk document."""
    if len(data) < BULK_BYTES:
        return json.loads(data)
    with gc_paused():
        return json.loads(data)
