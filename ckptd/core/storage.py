"""File-system primitives, kept in one place: durable writes, atomic replace, bounded reads.

Everything that must survive a crash goes through here so the ordering rules
(data fsync → manifest rename → index rename → directory fsync) live in one file.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable, Iterable, Sequence

from .names import MEMORY_LEVEL_DIR, temp_name

FILE_MODE = 0o640
DIR_MODE = 0o750
WRITEBACK_BYTES = 32 * 1024 * 1024
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


def _load_sync_file_range() -> Callable[[int, int, int, int], None] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def call(fd: int, offset: int, nbytes: int, flags: int) -> None:
        # An error must be raised here: waiting (WAIT_AFTER) reports a failed writeback and clears it
        # for this descriptor, so the file's later fsync would succeed with the data not on the disk.
        if fn(fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"writeback: {os.strerror(err)}")
    return call


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range back now, without waiting for it.

    A shard's final fsync then only waits for the tail instead of flushing the whole file,
    which overlaps disk writes with compression. OSError if the kernel refuses (a failed
    writeback of the range is reported by whoever waits for it: ``wait_writeback`` or fsync)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def wait_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Wait until a range written earlier is on the disk (writing back what is not under way yet):
    a writer that calls this for data some way behind it goes at the disk's pace. Not durability
    (no metadata, no cache flush: fsync is). OSError for a failed writeback of the file (EIO,
    ENOSPC on a thin volume): the wait consumes it, and the file's fsync would no longer report it."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes,
                         _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_step_dir(step_path: str) -> None:
    """``make_dirs`` for a step directory (``<root>/<job>[/_memory]/step-N``), refusing (OSError ELOOP)
    a symlink in its place or its job's: ckptd never writes through a link, and a planted one would
    take the step's files outside the root (readers and retention skip linked step directories)."""
    p = os.path.abspath(step_path)
    own = 3 if os.path.basename(os.path.dirname(p)) == MEMORY_LEVEL_DIR else 2
    for _ in range(own):
        if os.path.islink(p):
            raise OSError(errno.ELOOP, "a symlink where a step's (or its job's) directory belongs: ckptd "
                                       "never writes through links (remove it)", p)
        p = os.path.dirname(p)
    make_dirs(step_path)


def make_dirs(path: str) -> None:
    """Create a directory chain and fsync each new parent so the entries are durable."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            pass
        fsync_dir(os.path.dirname(d))


def atomic_write(path: str, data: bytes,
                 publish: Callable[[Callable[[], None], Callable[[], None]], None] | None = None) -> None:
    """Write ``path`` so a crash leaves either the old file or the whole new one, durably.
    ``publish``, if given, runs the rename and then the directory's fsync (it may refuse by raising,
    e.g. a withdrawn commit); the temp file is removed on any failure."""
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        write_all(fd, [data])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    synced = False

    def sync() -> None:
        nonlocal synced
        fsync_dir(os.path.dirname(path) or ".")
        synced = True
    try:
        if publish is None:
            os.rename(tmp, path)
        else:
            publish(lambda: os.rename(tmp, path), sync)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if not synced:
        sync()


def write_files_durably(directory: str, files: Sequence[tuple[str, bytes]]) -> None:
    """Write several files of one directory like ``atomic_write`` each (tmp, fsync, rename), with
    one directory fsync for all of them at the end."""
    for name, data in files:
        path = os.path.join(directory, name)
        tmp = temp_name(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
        try:
            write_all(fd, [data])
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _unlink_quietly(tmp)
            raise
    fsync_dir(directory)


def open_for_write(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)


# O_DIRECT: a direct write's source address, file offset and length are multiples of this (the
# largest logical block size of common devices; 512-byte devices accept it too).
DIRECT_BLOCK = 4096


def open_direct(path: str) -> int:
    """A second descriptor of the existing file ``path`` that writes around the page cache
    (``O_DIRECT``), or -1 where the file system refuses it (tmpfs, some network file systems)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        return os.open(path, os.O_WRONLY | os.O_NOFOLLOW | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return -1
        raise


def write_all_at(fd: int, parts: Iterable[bytes | bytearray | memoryview], offset: int) -> int:
    """``write_all`` at ``offset`` (pwrite: the descriptor's position is neither used nor moved)."""
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            n = os.pwrite(fd, view, offset + total)
            total += n
            view = view[n:]
    return total


def write_all(fd: int, parts: Iterable[bytes | bytearray | memoryview]) -> int:
    """Write every buffer in order (os.writev may write less than asked); return bytes written."""
    total = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            n = os.write(fd, view)
            total += n
            view = view[n:]
    return total


class NotRegular(ValueError):
    """A step file that is a FIFO, device, socket or directory: never read or uploaded."""


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """A read-only fd of a regular file and its stat: never through a symlink (OSError ELOOP),
    never a FIFO, device or directory (NotRegular; O_NONBLOCK: opening a FIFO must not hang)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_limited(path: str, limit: int) -> bytes:
    """Read a whole small file (manifest, index) refusing anything over ``limit`` bytes, and
    anything but a regular file (``open_regular``)."""
    fd, st = open_regular(path)
    try:
        size = st.st_size
        if size > limit:
            raise ValueError(f"{path}: {size} bytes exceeds the {limit}-byte limit for this file")
        return _read_exact(fd, 0, size)          # (its size just taken: read_at would fstat again)
    finally:
        os.close(fd)


def read_into(fd: int, offset: int, out: memoryview) -> None:
    """Exactly ``len(out)`` bytes at ``offset`` read into ``out`` (no buffer between: one copy from
    the page cache); a short file is an error, not a short read."""
    out = memoryview(out).cast("B")
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n == 0:
            raise EOFError(f"file ends at {offset + got}, expected {len(out)} bytes at {offset}")
        got += n


def read_at(fd: int, offset: int, length: int) -> bytes:
    """Exactly ``length`` bytes at ``offset``; a short file is an error, not a short read
    (checked first, so a corrupt length cannot make this allocate more than the file holds)."""
    if length > 0 and offset + length > os.fstat(fd).st_size:
        raise EOFError(f"file ends at {os.fstat(fd).st_size}, expected {length} bytes at {offset}")
    return _read_exact(fd, offset, length)


def _read_exact(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of a file known to hold them; a file that ends early is EOFError."""
    chunks = []
    got = 0
    while got < length:
        data = os.pread(fd, length - got, offset + got)
        if not data:
            raise EOFError(f"file ends at {offset + got}, expected {length - got} more bytes")
        chunks.append(data)
        got += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
