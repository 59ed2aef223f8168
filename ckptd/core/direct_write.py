"""A shard's raw chunks written around the page cache (``O_DIRECT``), on a thread of their own.

Through the page cache a chunk costs the writer a copy (source → page cache) and the disk's
writeback later; a direct write has the device read the source itself, but returns only once the
device has the bytes. So the whole blocks of each raw chunk are queued to one I/O thread, up to
``DEPTH`` chunks ahead, while the writer hashes and reads the next; the writer waits only when the
queue is full (the disk is then the limit). Each chunk's ends (its bytes before
the first and after the last block boundary of the file) are written through the page cache at
once. A direct write needs its source address, file offset and length on block boundaries, so
only a chunk whose source offset lies as far into a block as its file offset does (the source
mapped from a page boundary: a slot) goes direct. The caller keeps the source mapped until
``finish`` or ``abort`` returns.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Any

from . import storage

DEPTH = 4          # chunks queued ahead of the one the device is writing


class DirectWriter:
    """One data file's direct writes (``dfd``) beside its writes through the page cache (``fd``)."""

    def __init__(self, fd: int, dfd: int) -> None:
        self.fd, self.dfd = fd, dfd
        self.direct_bytes = 0
        self._q: queue.Queue[tuple[memoryview, int] | None] = queue.Queue(DEPTH)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckptd-direct", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, fd: int, path: str) -> DirectWriter | None:
        """A writer for the file ``path`` that ``fd`` writes too, or None (no ``O_DIRECT`` there)."""
        dfd = storage.open_direct(path)
        return None if dfd < 0 else cls(fd, dfd)

    def write(self, parts: list[Any], raw: bool, src: int, pos: int) -> int:
        """Write a chunk at file offset ``pos`` whose raw bytes start at ``src`` in the source (bytes
        written): its whole blocks queued for the device if ``raw`` and ``src`` lines up with
        ``pos``, everything else through ``fd`` now."""
        self._raise()
        block = storage.DIRECT_BLOCK
        if not raw or len(parts) != 1 or (src - pos) % block:
            return storage.write_all_at(self.fd, parts, pos)
        view = memoryview(parts[0]).cast("B")
        n = len(view)
        head = min(n, -pos % block)
        end = head + (n - head) // block * block
        if head:
            storage.write_all_at(self.fd, [view[:head]], pos)
        if end < n:
            storage.write_all_at(self.fd, [view[end:]], pos + end)
        if end > head:
            self._q.put((view[head:end], pos + head))
        return n

    def finish(self) -> None:
        """Wait for every queued write; raise the first error one met. The source is free after."""
        self._close()
        self._raise()

    def abort(self) -> None:
        """Drop what is queued, wait for the write under way (the source is free after); no error."""
        self._error = self._error or RuntimeError("aborted")
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._q.put(None)
            self._thread.join()
            os.close(self.dfd)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        block = storage.DIRECT_BLOCK
        while (item := self._q.get()) is not None:
            if self._error is not None:
                continue
            view, pos = item
            try:
                at = 0
                while at < len(view):
                    k = os.pwrite(self.dfd, view[at:], pos + at)
                    if k <= 0 or k % block:      # cut short off a block boundary: the rest through the page cache
                        at += max(k, 0)
                        storage.write_all_at(self.fd, [view[at:]], pos + at)
                        break
                    at += k
                    self.direct_bytes += k
            except BaseException as e:        # the writer raises it at its next chunk or at finish
                self._error = e
