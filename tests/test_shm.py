"""The daemon's shared memory (ckptd/daemon/shm.py): the node's huge-page mode read from sysfs text,
and memfds whose every page exists before use, by either allocation path (``posix_fallocate``, or
a MADV_HUGEPAGE mapping populated for ``advise`` nodes); a node that cannot give the memory fails
the allocation with OSError."""
from __future__ import annotations

import errno
import mmap
import os
import sys
from pathlib import Path

import pytest
import zygote

from ckptd.daemon import shm

MIB = 1 << 20


@pytest.mark.parametrize(("text", "mode"), [
    ("always within_size advise [never] deny force\n", "never"),
    ("always within_size [advise] never deny force\n", "advise"),
    ("always [within_size] advise never deny force\n", "within_size"),
    ("[always] within_size advise never deny force\n", "always"),
    ("always never\n", "unknown"),                  # nothing chosen
    ("", "unknown"),
])
def test_node_mode_is_the_bracketed_word(tmp_path: Path, text: str, mode: str) -> None:
    f = tmp_path / "shmem_enabled"
    f.write_text(text)
    assert shm.shmem_thp(str(f)) == mode


def test_no_sysfs_file_is_unknown(tmp_path: Path) -> None:
    assert shm.shmem_thp(str(tmp_path / "absent")) == "unknown"
    assert shm.node_mode() == shm.shmem_thp()       # this node's, read once


@pytest.mark.parametrize("mode", ["never", "advise", "within_size"])
def test_every_page_is_allocated_before_use(mode: str) -> None:
    """Whatever the mode (the node's own decides the page size; a mode the node lacks still allocates),
    the memfd's blocks are all there after ``allocate`` and it reads back as zeros, then as written."""
    size = 8 * MIB
    fd = os.memfd_create("ckptd-test-shm", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        assert os.fstat(fd).st_blocks == 0
        shm.allocate(fd, size, mode)
        assert os.fstat(fd).st_blocks * 512 >= size
        assert os.pread(fd, size, 0) == bytes(size)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            mm[size - 3:] = b"end"
        assert os.pread(fd, 3, size - 3) == b"end"
    finally:
        os.close(fd)


def test_new_memfd_maps_what_it_allocated() -> None:
    fd, mm = shm.new_memfd("ckptd-test-shm", 4 * MIB, mmap.PROT_READ)
    try:
        assert os.fstat(fd).st_size == len(mm) == 4 * MIB and os.fstat(fd).st_blocks * 512 >= 4 * MIB
        with pytest.raises(TypeError):
            mm[0] = 1                                   # read-only as asked
    finally:
        mm.close()
        os.close(fd)


def test_memory_the_process_cannot_have_fails_the_allocation() -> None:
    """Under an address-space limit the ``advise`` path cannot map the memfd: OSError (ENOMEM) from
    ``allocate`` itself, not swallowed (only EINVAL, a kernel without MADV_POPULATE_WRITE, falls back)."""
    code = """
import errno, os, resource
from ckptd.daemon import shm
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
fd = os.memfd_create("ckptd-test-shm", os.MFD_CLOEXEC)
os.ftruncate(fd, 2 << 30)
try:
    shm.allocate(fd, 2 << 30, "advise")
except OSError as e:
    print("ERRNO", e.errno)
else:
    print("ALLOCATED")
"""
    out = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ERRNO", str(errno.ENOMEM)]
