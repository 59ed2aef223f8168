"""``memory.shm_dir``: the daemon makes its shared memory (slots, held shards) as unnamed files on
an operator's tmpfs mount instead of memfds. A mount with ``huge=within_size`` gives them 2 MiB
pages although this node's ``shmem_enabled`` is ``never`` (ckptd/daemon/shm.py); saves and a
restore from the daemon's memory work the same. A directory that is no fit (on a disk, writable by
others, missing) stops the daemon at start with the fix named."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from procfd import fd_targets

import ckptd_client
from ckptd.daemon import shm


def mounted_tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` for the test. Only a non-root user (who may not mount) skips: as
    root, CI's case, a mount that fails fails the test."""
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "ckptd-test-shm", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        if os.geteuid() == 0:
            pytest.fail(f"cannot mount a tmpfs as root: {r.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs as uid {os.geteuid()}: {r.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def huge_tmpfs(tmp: Path) -> Iterator[Path]:
    """A tmpfs mounted with ``huge=within_size``, mode 0700."""
    yield from mounted_tmpfs(tmp / "shm", "huge=within_size,size=512m,mode=0700")


@pytest.fixture
def small_tmpfs(tmp: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, mode 0700."""
    yield from mounted_tmpfs(tmp / "small-shm", "size=8m,mode=0700")


def pmd_mapped_kib(pid: int) -> int:
    """KiB of shared memory the process maps with 2 MiB page table entries (huge pages)."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
                total += int(line.split()[1])
    return total


def status(sock: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(sock), "--json"],
                       capture_output=True, text=True, timeout=60, check=True)
    return json.loads(r.stdout)


def test_a_daemon_makes_its_shared_memory_in_shm_dir(huge_tmpfs: Path, daemon_factory) -> None:
    d = daemon_factory("--shm-dir", str(huge_tmpfs), "--memory-steps", "1")
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(8 << 20, generator=g), "b": torch.randn(1001, generator=g).to(torch.bfloat16),
             "step": torch.tensor(3.0)}
    ck = ckptd_client.Checkpointer("shm", socket=str(d.socket))
    ck.save(1, state).wait(60)
    ck.close()
    mine = [t for t in fd_targets(d.proc.pid) if t.startswith(f"{huge_tmpfs}/#")]
    assert len(mine) >= 2, fd_targets(d.proc.pid)               # the slots (and the step held in one)
    assert not [t for t in fd_targets(d.proc.pid) if t.startswith("/memfd:ckptd-")]
    node = shm.node_mode()
    want = "never" if node == "deny" else "always" if node == "force" else "within_size"
    st = status(d.socket)
    assert (st["shm_dir"], st["shmem_huge_pages"]) == (str(huge_tmpfs.resolve()), want), st
    if want != "never":
        assert pmd_mapped_kib(d.proc.pid) >= 2048               # its slots mapped in 2 MiB pages
    human = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(d.socket)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"(tmpfs {huge_tmpfs.resolve()} huge={want}" in human, human

    fresh = ckptd_client.Checkpointer("shm", socket=str(d.socket))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert fresh.restore(out) == 1
    assert fresh.last_restore is not None and fresh.last_restore.source == "memory", fresh.last_restore
    fresh.close()
    assert all(torch.equal(out[k], v) for k, v in state.items())


def serve_fails(tmp: Path, shm_dir: Path) -> str:
    """``ckptd serve --shm-dir`` that must not start: its stderr."""
    r = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--root", str(tmp / "root"), "--socket",
                        str(tmp / "refused.sock"), "--shm-dir", str(shm_dir)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert not (tmp / "refused.sock").exists()
    return r.stderr


def test_an_unfit_shm_dir_stops_the_daemon_at_start(tmp: Path, huge_tmpfs: Path) -> None:
    on_disk = tmp / "on-disk"
    on_disk.mkdir(mode=0o700)
    assert "not tmpfs" in serve_fails(tmp, on_disk)
    assert "No such file or directory" in serve_fails(tmp, tmp / "missing")
    shared = huge_tmpfs / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    assert "writable by no one else" in serve_fails(tmp, shared)


def test_a_full_shm_dir_refuses_the_slots_and_names_it(small_tmpfs: Path, daemon_factory) -> None:
    """Slots that do not fit the mount are refused at ``hello`` (the trainer's save raises, naming the
    mount and the fix), as a node out of memory would; the daemon goes on serving saves that fit."""
    d = daemon_factory("--shm-dir", str(small_tmpfs))
    ck = ckptd_client.Checkpointer("big", socket=str(d.socket))
    with pytest.raises(ckptd_client.CheckpointError, match=f"ENOSPC.*shm_dir {small_tmpfs.resolve()} is full"):
        ck.save(1, {"w": torch.zeros(4 << 20)})                      # 2 slots x 16 MiB in 8 MiB
    ck.close()
    ck = ckptd_client.Checkpointer("small", socket=str(d.socket), memory=False)
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}         # 2 slots x 1 MiB
    ck.save(1, state).wait(60)
    out = {"w": torch.zeros(1 << 18)}
    assert ck.restore(out) == 1 and torch.equal(out["w"], state["w"])
    ck.close()
    assert d.proc.poll() is None


def test_a_memory_level_save_that_does_not_fit_shm_dir_names_it(tmp: Path, daemon_factory) -> None:
    """A memory-level save whose held copy does not fit memory.shm_dir failed with "rank 0 shard write
    failed: ENOSPC", sending the user to the root's disk; a memory-level step writes no shard. The
    reason now names the daemon's shared memory (the shm_dir) and what to do."""
    mounts = mounted_tmpfs(tmp / "mnt16", "size=16m,mode=0700")
    mnt = next(mounts)
    try:
        shm_dir = mnt / "shm"
        shm_dir.mkdir(mode=0o700)
        d = daemon_factory("--shm-dir", str(shm_dir), "--memory-steps", "1")
        ck = ckptd_client.Checkpointer("j", socket=str(d.socket), num_slots=1)
        state = {"w": torch.randn(9 << 18)}                            # 9 MiB: a slot and no second copy fit
        ck.save(1, state).wait(60)
        with pytest.raises(ckptd_client.CheckpointError) as e:
            ck.save(2, state, level="memory").wait(60)
        assert f"shared memory (memory.shm_dir {shm_dir.resolve()})" in str(e.value), str(e.value)
        assert "ENOSPC" in str(e.value) and "save this step to storage" in str(e.value)
        out = {"w": torch.zeros(9 << 18)}
        assert ck.restore(out) == 1 and torch.equal(out["w"], state["w"])
        ck.close()
    finally:
        next(mounts, None)
