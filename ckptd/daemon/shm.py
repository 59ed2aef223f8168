"""The daemon's shared memory (slots, held shards): memfds, every page allocated up front, in huge
pages where the node lets shared memory have them.

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

Either way every page exists before the memfd is used: a node out of memory fails the allocation
(an OSError the caller reports), never a trainer's copy with SIGBUS later. docs/operations.md says
which mode to choose.
"""
from __future__ import annotations

import errno
import functools
import mmap
import os
import re
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
    module docstring) and mapped shared with ``prot`` and ``flags`` besides MAP_SHARED."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        allocate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED | flags, prot, **mmap_kw)
    except BaseException:
        os.close(fd)
        raise
    return fd, mm
