"""The shard encoder: tensors → one rank's ``rank-NNNNN.data`` and its manifest (FORMAT.md).

Shared by the daemon's writer (tensors from a save's slot) and ``ckptd import`` (tensors read
from safetensors files), so both write the same chunks, codecs, checksums and fsync order:
chunks are encoded on the caller's pool in a bounded window and written in order (memory held
beyond the source is a few chunks); the data file is fsynced, then the manifest is written
atomically. What differs between the callers comes in as parameters: where the bytes are
(``read``), the pool and window, and hooks for the daemon's slot release, abandon check and
debug delay, or the importer's progress bar.

The writer goes at the disk's pace: it has writeback started every ``WRITEBACK_BYTES`` (on a
thread of its own, ``_Writeback``: submitting the writes is work the writer's copies need not
wait for) and waits for the data more than ``PACE_LAG_BYTES`` behind it to reach the disk (dirty
pages per shard stay bounded, and the final fsync only waits for the tail). With
``Encoding.adaptive`` the disk never waits for the codec: codec threads take the *newest* chunk
of the window, the writer the oldest, and a chunk the writer reaches before any codec thread has
started on it is written raw (codec ``none``); and codec threads start on chunks only while the
writer's waits for the disk show that the disk sets the pace (``DISK_BOUND``). When the disk is
the limit, encoding costs the writer nothing and fewer bytes reach the disk; when it is not (a
disk as fast as the writer's own copies into the page cache: this 2-core VM's), the codec would
only take CPU from the writer, and chunks go raw. Each chunk names its codec, so readers need
nothing new. A raw chunk's checksum is taken off the writer's thread too while the codec threads
are idle: they hash untaken chunks ahead of it (newest first, like the encoding), so the
writer's thread only writes — on a 2-core node the hash runs on the core the trainer's copy
frees, beside the writes instead of between them. With ``direct`` (the daemon's ``direct_io``),
raw chunks' whole blocks go around the page cache on a thread of their own (direct_write.py): no
copy into the page cache, the device reads the slot. Adaptive encoding then stays off, whatever
the writer's waits for the disk say: every chunk is raw (an encoded chunk would put the rest of
its tensor off its block; the next tensor is lined up again past a gap, ``DirectWriter.place``).
Whether direct raw chunks beat encoded ones through the page cache is the daemon's measured
choice (write_way.py).
"""
from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from . import storage
from .codec import ChunkMeta, choose_codec, chunk_ranges, encode_chunk
from .direct_write import DirectWriter
from .names import rank_data_name, rank_manifest_name
from .rank_record import RankRecord, summarize
from .schema import Manifest, TensorEntry, TensorLayout, data_length, digest_bytes, encode_json
from .step_files import remove_rank_files

# (tensor, start, length) → those raw bytes of the tensor (``start`` counts from its first byte).
ReadChunk = Callable[[TensorLayout, int, int], memoryview]


# The writer waits for its data this far behind it to be on the disk (the pace; module docstring).
PACE_LAG_BYTES = 8 * storage.WRITEBACK_BYTES
# Adaptive: codec threads start on chunks while the writer's last wait for the disk took over this
# share of the time since the one before it (the disk, not the writer, sets the pace).
DISK_BOUND = 0.5


@dataclass(frozen=True)
class Encoding:
    """How chunks are encoded: ``codec`` (``codec.choose_codec`` per dtype), its ``level``, the raw
    bytes per chunk, and ``adaptive``: codec threads encode only while the disk is the limit, and a
    chunk the writer reaches before any of them took it is written raw (module docstring); otherwise
    every chunk is encoded with ``codec``."""
    codec: str
    level: int
    chunk_bytes: int
    adaptive: bool = False


_CODEC, _WRITER, _HASH = 1, 2, 3      # who took a chunk of the window (_HASH: a codec thread, to write it raw)


class _Chunk:
    __slots__ = ("entry", "view", "src", "dtype", "codec", "taken", "encoded", "error", "done")

    def __init__(self, entry: TensorEntry, view: memoryview, src: int, dtype: str, codec: str) -> None:
        self.entry, self.view, self.src, self.dtype, self.codec = entry, view, src, dtype, codec
        self.taken = 0
        self.encoded: tuple[list[Any], ChunkMeta] | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class _Window:
    """The chunks read from the source and not yet written, oldest first. Codec tasks (one
    submitted per chunk added) take untaken chunks: the oldest first, or, when ``adaptive``, the
    newest first (so the oldest stays free for the writer to write raw) and only while the writer
    says the disk is the limit (``disk_bound``)."""

    def __init__(self, level: int, adaptive: bool) -> None:
        self.level, self.adaptive = level, adaptive
        self.lock = threading.Lock()
        self.chunks: collections.deque[_Chunk] = collections.deque()
        self.disk_bound = False

    def __len__(self) -> int:
        return len(self.chunks)

    def add(self, chunk: _Chunk) -> None:
        with self.lock:
            self.chunks.append(chunk)

    @property
    def encoding(self) -> bool:
        """Whether codec threads take chunks now (always, unless adaptive and the disk is not the limit)."""
        return not self.adaptive or self.disk_bound

    def _take(self) -> _Chunk | None:
        with self.lock:
            order = reversed(self.chunks) if self.adaptive else iter(self.chunks)
            chunk = next((c for c in order if not c.taken), None)
            if chunk is not None:
                chunk.taken = _CODEC if self.encoding else _HASH
            return chunk

    def encode_one(self) -> None:
        """A codec task: take untaken chunks while there are any; encode them (adaptive: while the disk
        is the limit) or, adaptive and the disk not the limit, hash them to be written raw."""
        while (chunk := self._take()) is not None:
            try:
                codec = chunk.codec if chunk.taken == _CODEC else "none"
                chunk.encoded = encode_chunk(chunk.view, chunk.dtype, codec, self.level)
            except BaseException as e:   # handed to the writer, which raises it
                chunk.error = e
            finally:
                chunk.done.set()

    def pop_oldest(self) -> tuple[TensorEntry, list[Any], ChunkMeta, int]:
        """The oldest chunk, encoded (waiting for its codec thread) or, adaptive and untaken, raw; and
        where its raw bytes start in the source (``_Chunk.src``)."""
        with self.lock:
            chunk = self.chunks[0]
            raw = self.adaptive and not chunk.taken
            if raw:
                chunk.taken = _WRITER
        if raw:
            parts, meta = encode_chunk(chunk.view, chunk.dtype, "none")
        else:
            chunk.done.wait()   # one chunk's encode: a codec task that took it always finishes
            if chunk.error is not None:
                raise chunk.error
            assert chunk.encoded is not None
            parts, meta = chunk.encoded
        with self.lock:
            self.chunks.popleft()
        return chunk.entry, parts, meta, chunk.src

    def close(self) -> None:
        """Stop: no codec task takes a chunk after this, and the ones encoding have finished (so no
        thread reads the source once this returns); every chunk is dropped."""
        with self.lock:
            for c in self.chunks:
                if not c.taken:
                    c.taken = _WRITER
            busy = [c for c in self.chunks if c.taken in (_CODEC, _HASH)]
        for c in busy:
            c.done.wait()
        with self.lock:
            self.chunks.clear()


class _Writeback:
    """Starts writeback of the ranges the writer hands it on a thread of its own: ``sync_file_range``
    submits the range's writes on the calling thread, which took the writer 40-90 ms per GiB on top
    of its ~250 ms of copies into the page cache on the benchmarks' VM. ``close`` before the file's
    descriptor is closed (no call runs after it); it raises the first error a call met (once)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._error: OSError | None = None
        self._q: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ckptd-writeback", daemon=True)
        self._thread.start()

    def start(self, offset: int, nbytes: int) -> None:
        self._q.put((offset, nbytes))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if self._error is None:
                try:
                    storage.start_writeback(self.fd, *item)
                except OSError as e:
                    self._error = e


@dataclass(frozen=True)
class WrittenShard:
    """A rank's shard, durable: its manifest, the sha256 of the manifest file, the record the commit
    needs of it (``rank_record``), and the seconds it took."""
    manifest: Manifest
    digest: str
    record: RankRecord
    seconds: float
    direct_bytes: int = 0         # of the data file, the bytes written around the page cache (``direct``)


@dataclass(frozen=True)
class ShardHooks:
    """The caller's part of a write. ``released``: the source is read no more (every chunk encoded,
    or the write failed), called exactly once; ``before_write``: before each chunk is written (it may
    raise to stop the write); ``written``: after each, with the chunk's raw length."""
    released: Callable[[], None] | None = None
    before_write: Callable[[], None] | None = None
    written: Callable[[int], None] | None = None


def write_shard(step_path: str, job: str, step: int, rank: int, world_size: int,
                tensors: Sequence[TensorLayout], read: ReadChunk, tree: Any, encoding: Encoding,
                pool: Executor, ahead: int, hooks: ShardHooks = ShardHooks(),
                direct: memoryview | None = None) -> WrittenShard:
    """Encode ``tensors`` and write rank ``rank``'s data file and manifest durably into ``step_path``
    (created if missing), with up to ``ahead`` chunks read before the one being written; on any error
    both files are removed and the error re-raised. ``direct``: the source, mapped from a page
    boundary (a slot), whose bytes at ``t.offset + start`` are what ``read(t, start, n)`` returns
    once it returned; raw chunks then go around the page cache where the file system allows it
    (direct_write.py)."""
    t0 = time.monotonic()
    data_path = os.path.join(step_path, rank_data_name(rank))
    released = False
    fd = -1
    around: DirectWriter | None = None
    writeback: _Writeback | None = None
    window = _Window(encoding.level, encoding.adaptive)

    def release() -> None:
        nonlocal released
        released = True
        if hooks.released is not None:
            hooks.released()
    try:
        # Inside the try: a failure here (EROFS, ENOSPC, EACCES) must still release the source.
        for attempt in range(3):
            storage.make_step_dir(step_path)
            try:
                fd = storage.open_for_write(data_path)
                break
            except FileNotFoundError:   # the cleanup of an ended attempt removed the (empty) directory just now
                if attempt == 2:
                    raise
        if direct is not None:
            around = DirectWriter.open(fd, data_path, direct)
        writeback = _Writeback(fd)
        entries: list[TensorEntry] = []
        pos = 0
        flushed = 0     # bytes already handed to writeback
        paced = 0       # bytes known to be on the disk
        since = time.monotonic()

        def drain_one() -> None:
            nonlocal pos, flushed, paced, since
            if hooks.before_write is not None:     # first: a raise leaves no view of the source in its traceback
                hooks.before_write()
            entry, parts, meta, src = window.pop_oldest()
            if not entry.chunks:          # the tensor's first chunk: the tensor starts here
                if around is not None and meta.codec == "none":
                    pos = around.place(pos, src, entry.nbytes)
                entry.offset = pos
            if around is None:
                pos += storage.write_all(fd, parts)
            else:
                pos += around.write(parts, meta.codec == "none", src, pos)
            entry.chunks.append(meta)
            if hooks.written is not None:
                hooks.written(meta.raw_len)
            if pos - flushed >= storage.WRITEBACK_BYTES:
                assert writeback is not None
                writeback.start(flushed, pos - flushed)
                flushed = pos
                if flushed - PACE_LAG_BYTES > paced:
                    waited = time.monotonic()
                    storage.wait_writeback(fd, paced, flushed - PACE_LAG_BYTES - paced)
                    paced = flushed - PACE_LAG_BYTES
                    now = time.monotonic()
                    # The writer blocked on the disk for a good part of the last batch: the disk is the
                    # limit, and encoding (fewer bytes to it) costs the writer nothing; else it would.
                    # Direct: never (an encoded chunk would put the rest of its tensor off its block).
                    window.disk_bound = around is None and now - waited > DISK_BOUND * (now - since)
                    since = now

        for t in tensors:
            codec = choose_codec(t.dtype, encoding.codec)
            entry = TensorEntry(t.name, t.dtype, list(t.shape), -1, [], t.placement)
            entries.append(entry)
            for start, length in chunk_ranges(t.nbytes, encoding.chunk_bytes):
                window.add(_Chunk(entry, read(t, start, length), t.offset + start, t.dtype, codec))
                pool.submit(window.encode_one)   # (a task finding none left untaken ends at once)
                while len(window) > ahead:
                    drain_one()
        # Offsets are known only once earlier chunks are written; entries drain in order.
        while len(window):
            drain_one()
        # Every chunk is placed: the manifest, its digest and its record are built while the last
        # direct writes (or the kernel's writeback of the tail, started here: the writeback thread
        # would wait for the GIL the build holds) still run, not after the fsync (~2 ms per 250 tensors).
        if pos > flushed:
            storage.start_writeback(fd, flushed, pos - flushed)
        end = 0
        for entry in entries:
            if entry.offset < 0:          # an empty tensor: no chunk placed it
                entry.offset = end
            end = entry.offset + entry.stored_bytes
        manifest = Manifest(job, step, rank, world_size, entries, tree,
                            sum(e.nbytes for e in entries), data_length(entries))
        data = encode_json(manifest.to_json())
        digest = digest_bytes(data)
        record = summarize(manifest, digest)
        if around is not None:
            around.finish()             # every direct write done (or its error raised): the source is free
        release()   # no chunk (no view of the source: a slot's mapping closes only once none is left) remains
        writeback.close()
        writeback = None
        os.fsync(fd)          # (the inode's: the direct writes' blocks and size too, and the device's cache)
        os.close(fd)
        fd = -1
        storage.atomic_write(os.path.join(step_path, rank_manifest_name(rank)), data)
        return WrittenShard(manifest, digest, record, time.monotonic() - t0,
                            around.direct_bytes if around is not None else 0)
    except BaseException:
        window.close()
        if around is not None and not released:
            around.abort()              # before the source is released: no write reads it after
        if not released:
            release()
        if writeback is not None:
            try:
                writeback.close()       # before the descriptor it writes back is closed
            except OSError:
                pass                    # the error being raised already fails the shard
        if fd >= 0:
            os.close(fd)
        try:
            remove_rank_files(step_path, rank)
        except OSError:
            pass  # e.g. EROFS: nothing could be written either; the original error says why
        raise
