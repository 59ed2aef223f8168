"""The process's malloc settings: tuned once at start for the codec's chunk buffers, and the
freed buffers handed back to the kernel once the daemon is idle."""
from __future__ import annotations

import ctypes
from collections.abc import Callable

from ckptd.core.codec import drop_thread_caches


def _libc_fn(name: str) -> Callable[..., int] | None:
    try:
        fn: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None   # not glibc
    return fn


def tune_allocator() -> None:
    """Keep glibc from returning (and re-faulting) the daemon's chunk buffers on every chunk.

    Encoded chunks are a few MiB each: by default glibc mmaps and unmaps such buffers, so each
    is fresh memory faulted in page by page. Raising the mmap and trim thresholds made encoding
    25-30 % faster here; the cost is that the daemon keeps freed memory for reuse while it
    writes — ``release_free_memory`` gives it back once the writes are over.

    One arena for all threads (``M_ARENA_MAX`` 1; call this before the daemon starts its
    threads): ``malloc_trim`` returns the free pages inside every arena but the top of the main
    arena's heap only, so each codec thread's own arena kept its top — the chunk buffers it last
    freed — resident after every save: +20 MiB of steady Pss with 2 codec threads here, +53 MiB
    with 4 (tests/test_idle_daemon_memory.py). One arena cost no measurable speed here (bplane
    encode with 2 and 8 threads: same MB/s, CPU time and context switches; save -> durable of a
    256 MiB state with 2 and 4 threads: within this loaded machine's noise): the codec makes a
    few buffers per 4 MiB chunk, so the arena's lock is rarely contended."""
    mallopt = _libc_fn("mallopt")
    if mallopt is None:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    mallopt(M_MMAP_THRESHOLD, 64 * 1024 * 1024)
    mallopt(M_TRIM_THRESHOLD, 256 * 1024 * 1024)
    mallopt(M_ARENA_MAX, 1)


def release_free_memory() -> None:
    """(I/O thread, no write running) Drop the codec's per-thread buffers and return the heap's free
    pages to the kernel (glibc ``malloc_trim``): kept for speed during a save, they would otherwise
    stay charged to the node between saves."""
    drop_thread_caches()
    trim = _libc_fn("malloc_trim")
    if trim is not None:
        trim(0)
