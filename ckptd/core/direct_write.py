"""A shard's raw chunks written around the page cache (``O_DIRECT``), on a thread of their own.

Through the page cache a chunk costs the writer a copy (source → page cache) and the disk's
writeback later; a direct write has the device read the source itself, but returns only once the
device has the bytes. A direct write's source address, file offset and length must lie on block
boundaries. The data file holds raw chunks back to back, as a slot holds its tensors (64-byte
aligned: back to back for tensors whose sizes are multiples of 64), so a run of raw chunks lying
in the source as they lie in the file is written as one stretch of the source: its whole blocks
direct, in writes of up to ``RUN`` bytes that cross chunk and tensor boundaries (on the
benchmarks' VM a GiB took 0.35 s in the ~2.6 MiB writes a GPT-like state's chunks make alone and
0.26 s in 32 MiB ones), its partial first and last blocks through the page cache. Writes are
queued to one I/O thread, up to ``DEPTH`` ahead, while the writer hashes and reads on; a run is
cut for the device early whenever the device is idle. Anything else (an encoded chunk, a chunk
lying elsewhere in the source) goes through the page cache and ends the run. The caller keeps the
source mapped until ``finish`` or ``abort`` returns.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Any

from . import storage

DEPTH = 4          # writes queued ahead of the one the device is writing
RUN = 32 << 20     # bytes of a run written at once, at most
GAP_SHARE = 64     # a tensor may start past a gap (``place``) of at most this share of its bytes


class DirectWriter:
    """One data file's direct writes (``dfd``) beside its writes through the page cache (``fd``), of
    bytes read from ``source`` (mapped from a page boundary)."""

    def __init__(self, fd: int, dfd: int, source: memoryview) -> None:
        self.fd, self.dfd, self.source = fd, dfd, source.cast("B") if source.format != "B" else source
        self.direct_bytes = 0
        # The open run: file bytes [_start, _end) are source bytes [_start + _delta, _end + _delta), not
        # written yet; _start lies on a block boundary once the run's first partial block is written.
        self._open = False
        self._start = self._end = self._delta = 0
        self._q: queue.Queue[tuple[int, int, int] | None] = queue.Queue(DEPTH)   # file [a, b), delta
        self._busy = False                        # the I/O thread is writing
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckptd-direct", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, fd: int, path: str, source: memoryview) -> DirectWriter | None:
        """A writer for the file ``path`` that ``fd`` writes too, or None (no ``O_DIRECT`` there)."""
        dfd = storage.open_direct(path)
        return None if dfd < 0 else cls(fd, dfd, source)

    def place(self, pos: int, src: int, nbytes: int) -> int:
        """Where a tensor of ``nbytes`` whose raw bytes start at source offset ``src`` starts in the
        file: ``pos``, or past a gap of under a block that puts it on its source's block offsets, so
        its raw chunks go direct, when the gap is at most 1/``GAP_SHARE`` of the tensor (a slot pads
        each tensor to 64 bytes and the file does not: one 4-byte tensor, an optimizer's step,
        would otherwise put every later chunk off its block; the gap after it is 60 bytes). The gap
        is never written: a hole, reading as zeros."""
        gap = (src - pos) % storage.DIRECT_BLOCK
        return pos + gap if gap and gap * GAP_SHARE <= nbytes else pos

    def write(self, parts: list[Any], raw: bool, src: int, pos: int) -> int:
        """A chunk for file offset ``pos`` whose raw bytes are the source's from ``src`` (bytes written
        or taken into the run): a raw one continuing the run, or starting one, is left to it; anything
        else ends the run and goes through ``fd`` now."""
        self._raise()
        if not raw or len(parts) != 1 or (src - pos) % storage.DIRECT_BLOCK:
            self._end_run()
            return storage.write_all_at(self.fd, parts, pos)
        n = len(memoryview(parts[0]).cast("B"))
        if self._open and (pos != self._end or src - pos != self._delta):
            self._end_run()
        if not self._open:
            self._open, self._start, self._end, self._delta = True, pos, pos, src - pos
        self._end += n
        if self._end - self._start >= RUN or not (self._busy or self._q.qsize()):
            self._cut()                   # a whole write gathered, or the device idle: go now
        return n

    def _cut(self) -> None:
        """Write the open run up to its last block boundary (a partial first block through the page
        cache now, the whole blocks queued); the rest, under a block, stays open."""
        block = storage.DIRECT_BLOCK
        a, b = self._start, self._end // block * block
        if a % block:
            first = min(-(-a // block) * block, self._end)
            storage.write_all_at(self.fd, [self._bytes(a, first)], a)
            a = first
        if b > a:
            self._q.put((a, b, self._delta))
            a = b
        self._start = a

    def _end_run(self) -> None:
        """Write the open run whole: its last partial block through the page cache."""
        if self._open:
            self._cut()
            if self._start < self._end:
                storage.write_all_at(self.fd, [self._bytes(self._start, self._end)], self._start)
            self._open = False

    def _bytes(self, a: int, b: int) -> memoryview:
        """File bytes [a, b) of the open run, as the source holds them."""
        return self.source[a + self._delta:b + self._delta]

    def finish(self) -> None:
        """Write what is left, wait for every queued write; raise the first error one met. The source
        is free after."""
        try:
            self._end_run()
        finally:
            self._close()
        self._raise()

    def abort(self) -> None:
        """Drop what is queued, wait for the write under way (the source is free after); no error."""
        self._error = self._error or RuntimeError("aborted")
        self._open = False
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
            a, b, delta = item
            self._busy = True
            try:
                while a < b:
                    k = max(os.pwrite(self.dfd, self.source[a + delta:b + delta], a), 0)
                    self.direct_bytes += k
                    a += k
                    if k == 0 or k % block:     # cut short off a block boundary: the rest through the page cache
                        storage.write_all_at(self.fd, [self.source[a + delta:b + delta]], a)
                        break
            except BaseException as e:        # the writer raises it at its next chunk or at finish
                self._error = e
            finally:
                self._busy = False
