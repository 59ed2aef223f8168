"""The daemon's shared memory (slots, held shards): memfds, every page allocated up front, in huge
pages where the node lets shared memory have them — or unnamed files on a tmpfs mount of the
operator's (``memory.shm_dir``), in huge pages where that mount's ``huge=`` option gives them.

A memfd's pages are 4 KiB unless the node enables transparent huge pages for shared memory
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled``). Huge pages make every pass over the bytes
cheaper: reading a 512 MiB memfd with ``preadv`` (how a restore from the daemon's memory copies)
took 1.55× a plain copy of the same bytes with 4 KiB pages and 1.17× with 2 MiB ones (this
project's 2-core VM), and the trainer's copy into a slot maps fewer, larger pages. By mode:

- ``always`` / ``within_size`` (``force``): the kernel gives the memfd huge pages by itself;
  ``posix_fallocate`` allocates them.
- ``advise``: only a mapping marked ``MADV_HUGEPAGE`` gets them, and ``posix_fallocate`` (which has
  no mapping) would allocate 4 KiB pages: the pages are allocated through such a mapping instead
  (``MADV_POPULATE_WRITE``, Linux 5.14; ``posix_fallocate`` where the kernel lacks it).
- ``never`` / ``deny`` (or no such file): 4 KiB pages, ``posix_fallocate``.

A tmpfs mounted with ``huge=within_size`` gives its files huge pages whatever the node's mode (but
``deny``), so ``shm_dir`` gets them without a node-wide change (the VM above: a 256 MiB read took
18 ms from such a file against 39 ms from a memfd and 13.5 ms for a plain copy). Its files are made
with ``O_TMPFILE``: like memfds they have no name and are freed with their last descriptor.

Either way every page exists before the memfd is used: a node out of memory (or a mount out of
space) fails the allocation (an OSError the caller reports), never a trainer's copy with SIGBUS
later. docs/operations.md says which mode to choose.

A memfd's size is sealed once allocated (``F_SEAL_SHRINK | F_SEAL_GROW``): a client is handed
slots read-write, and a slot it shrank with ``ftruncate`` would kill the daemon with SIGBUS when
its writer read a page past the new end. Files in ``shm_dir`` cannot be sealed (only memfds can),
so there a permitted user can still do that; ``sealed`` tells which, and the daemon warns at start.
A held shard is passed to a restoring client read-only (``read_only``).
"""
from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)      # Linux 5.14; Python 3.11 lacks the name
HUGE_MODES = ("always", "within_size", "advise", "force")


def shmem_thp(path: str = SHMEM_ENABLED) -> str:
    """The node's shared-memory huge page mode (the bracketed word of ``path``), or ``unknown``."""
    try:
        with open(path) as f:
            m = re.search(r"\[([a-z_]+)\]", f.read(4096))
    except OSError:
        return "unknown"
    return m.group(1) if m else "unknown"


@functools.cache
def node_mode() -> str:
    """``shmem_thp()`` of this node, read once per process (a daemon's memfds follow the mode it started with)."""
    return shmem_thp()


@dataclass(frozen=True)
class Place:
    """Where the daemon's shared memory is made: memfds (``dir`` None) or unnamed files in ``dir``, a
    tmpfs directory; ``mode``: the huge page mode they follow (the node's, or the mount's)."""
    dir: str | None
    mode: str


_dir: Place | None = None     # set once at the daemon's start (use_dir); memfds until then


def place() -> Place:
    return _dir if _dir is not None else Place(None, node_mode())


def use_dir(path: str | None) -> Place:
    """Make this process's shared memory in ``path`` (None: memfds), once it is checked: a directory on
    tmpfs that root or this user owns and no one else may write. RuntimeError naming the fix if not."""
    global _dir
    _dir = None if path is None else Place(os.path.realpath(path), check_dir(path))
    return place()


def check_dir(path: str) -> str:
    """The huge page mode of files made in ``path``; RuntimeError unless it is a fit ``shm_dir``."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise RuntimeError(f"shm_dir {path}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"shm_dir {path}: not a directory")
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise RuntimeError(f"shm_dir {path}: must be owned by root or the daemon's user and writable by no one "
                           f"else (chmod go-w)")
    fstype, options = mount_of(os.path.realpath(path))
    if fstype != "tmpfs":
        raise RuntimeError(f"shm_dir {path}: on a {fstype} file system, not tmpfs (the daemon's shared memory "
                           "would be written to a disk): mount a tmpfs there, e.g. "
                           "`mount -t tmpfs -o huge=within_size,size=64G,mode=0700 ckptd-shm " + path + "`")
    try:
        os.close(os.open(path, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600))
    except OSError as e:
        raise RuntimeError(f"shm_dir {path}: cannot make a file there: {e.strerror}") from None
    node = node_mode()
    if node in ("deny", "force"):       # the node overrides every mount's huge= option
        return "never" if node == "deny" else "always"
    huge = [o.split("=", 1)[1] for o in options if o.startswith("huge=")]
    return huge[-1] if huge else "never"


def mount_of(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, list[str]]:
    """(file system type, super options) of the mount ``path`` (a real path) lies on."""
    best = -1
    found: tuple[str, list[str]] = ("unknown", [])
    with open(mountinfo) as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if len(fields) < 5 or len(rest) < 3:
                continue
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= best:       # the last of equal ones is the one on top
                best, found = len(point), (rest[0], rest[2].split(","))
    return found


def shortage(e: OSError) -> str:
    """What to do about a failed allocation, for its error message ("" when nothing to add)."""
    where = place()
    if where.dir is not None and e.errno == errno.ENOSPC:
        return f" (shm_dir {where.dir} is full: mount its tmpfs with a larger size=)"
    return ""


def allocate(fd: int, size: int, mode: str | None = None) -> None:
    """Every page of memfd ``fd``'s first ``size`` bytes (its size already), in huge pages where
    ``mode`` (default: the node's) allows; OSError when the node cannot (out of memory)."""
    if size > 0 and (mode or node_mode()) == "advise" and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                mm.madvise(mmap.MADV_HUGEPAGE)
                mm.madvise(MADV_POPULATE_WRITE)
            return
        except OSError as e:
            if e.errno != errno.EINVAL:      # EINVAL: a kernel without MADV_POPULATE_WRITE
                raise
    os.posix_fallocate(fd, 0, size)


def new_memfd(name: str, size: int, prot: int = mmap.PROT_READ | mmap.PROT_WRITE, flags: int = 0,
              **mmap_kw: Any) -> tuple[int, mmap.mmap]:
    """(memfd, mapping) of ``size`` bytes (a positive multiple of the page size), allocated (see the
    module docstring) and mapped shared with ``prot`` and ``flags`` besides MAP_SHARED. In ``shm_dir``
    (``use_dir``) an unnamed file there stands for the memfd (``name`` is then not shown in /proc)."""
    where = place()
    if where.dir is None:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    else:
        fd = os.open(where.dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        allocate(fd, size, where.mode)
        if where.dir is None:         # its size fixed for good: no holder of the fd can shrink it (module docstring)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED | flags, prot, **mmap_kw)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def sealed() -> bool:
    """Whether this process's shared memory is sealed against resizing (memfds, not ``shm_dir``)."""
    return place().dir is None


def read_only(fd: int) -> int:
    """A new read-only descriptor of the file ``fd`` is open on (for a reader that must not write or
    resize it: a held shard passed to a restoring client)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
