"""Shards written around the page cache (``O_DIRECT``: ckptd/core/direct_write.py) hold the same
chunks as through it: the same files byte for byte where the slot's layout lines up with the file
(tensors whose sizes are multiples of 64 bytes: written in runs across tensors), and where it does
not (a tensor whose size is no multiple of the slot's 64-byte alignment) the same chunks with large
tensors moved past gaps that line them up with the slot, with adaptive encoding and with every
chunk encoded, and on tmpfs (which refuses ``O_DIRECT`` before Linux 6.6). A direct
write that fails fails the shard (its files removed) and frees the source first. And the daemon's
choice of way (``direct_io``, tiers/fs/write_way.py)."""
from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ckptd.core import storage
from ckptd.core.direct_write import DirectWriter
from ckptd.core.names import rank_data_name, rank_manifest_name
from ckptd.core.rank_record import summarize
from ckptd.core.schema import TensorLayout, digest_bytes, parse_manifest
from ckptd.core.shard_writer import Encoding, ShardHooks, WrittenShard, write_shard
from ckptd.daemon.tiers.fs.write_way import KEEP, MIN_BYTES, RETRY, WriteWay

MiB = 1 << 20


def slot_of(sizes: list[int]) -> tuple[mmap.mmap, list[TensorLayout]]:
    """A page-aligned mapping (as a daemon's slot) holding float32 tensors of ``sizes`` bytes at
    64-byte aligned offsets, filled with varied bytes."""
    layout, off = [], 0
    for i, n in enumerate(sizes):
        layout.append(TensorLayout(f"t{i}", "float32", (n // 4,), off, n, None))
        off += -(-n // 64) * 64
    mm = mmap.mmap(-1, max(off, mmap.PAGESIZE))
    pattern = os.urandom(1 << 16)
    for at in range(0, off, len(pattern)):
        mm[at:at + min(len(pattern), off - at)] = pattern[:min(len(pattern), off - at)]
    return mm, layout


def write(root: Path, mm: mmap.mmap, layout: list[TensorLayout], direct: bool, adaptive: bool = True,
          hooks: ShardHooks | None = None) -> tuple[WrittenShard, bytes, bytes]:
    view = memoryview(mm)
    with ThreadPoolExecutor(2) as pool:
        w = write_shard(str(root), "j", 1, 0, 1, layout, lambda t, s, n: view[t.offset + s:t.offset + s + n], None,
                        Encoding("bplane", 1, MiB, adaptive), pool, 6, hooks or ShardHooks(),
                        direct=view if direct else None)
    return w, (root / rank_data_name(0)).read_bytes(), (root / rank_manifest_name(0)).read_bytes()


def tensor_bytes(data: bytes, manifest: dict[str, Any]) -> list[bytes]:
    """Each tensor's stored chunks, read at its offset."""
    out = []
    for t in manifest["tensors"]:
        n = sum(c[2] for c in t["chunks"])
        out.append(data[t["offset"]:t["offset"] + n])
    return out


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("sizes", [[4 * MiB, 3 * MiB + 4096, 2 * MiB], [4 * MiB + 64, 3 * MiB + 128, 2 * MiB + 960],
                                   [4 * MiB + 4, 3 * MiB + 12, 5 * MiB + 4096],
                                   [4 * MiB, 4, 3 * MiB, 4, 2 * MiB + 64, 8, 8],
                                   [4, 256 << 10, 4, 128 << 10, 4, 8 << 10, (64 << 10) + 64, 2]],
                         ids=["blocks", "packed", "shifted", "steps", "small"])
def test_direct_shards_hold_the_same_chunks(tmp_path: Path, sizes: list[int], adaptive: bool) -> None:
    """The same tensors and chunks, direct or buffered; a direct file may start a large tensor past a
    gap of under a block (a hole: zeros) that lines it up with the slot, so that its chunks go direct
    too after a tensor whose size is no multiple of the slot's 64 bytes (here: 4-byte optimizer steps)."""
    mm, layout = slot_of(sizes)
    buffered, data, manifest = write(tmp_path / "buffered", mm, layout, direct=False, adaptive=adaptive)
    direct, data_d, manifest_d = write(tmp_path / "direct", mm, layout, direct=True, adaptive=adaptive)
    m, md = json.loads(manifest), json.loads(manifest_d)
    assert (m["stored_bytes"], md["stored_bytes"]) == (len(data), len(data_d))
    assert [{k: v for k, v in t.items() if k != "offset"} for t in md["tensors"]] == \
        [{k: v for k, v in t.items() if k != "offset"} for t in m["tensors"]]
    assert tensor_bytes(data_d, md) == tensor_bytes(data, m)
    end = 0
    for t in md["tensors"]:
        assert 0 <= t["offset"] - end < 4096 and data_d[end:t["offset"]] == bytes(t["offset"] - end)
        end = t["offset"] + sum(c[2] for c in t["chunks"])
    assert end == len(data_d)
    # format 3 where gaps are (a format-2 build would take the chunks' sum for the file's length)
    assert (m["format_version"], md["format_version"]) == (2, 3 if len(data_d) > len(data) else 2)
    assert buffered.direct_bytes == 0
    if not adaptive:
        assert direct.direct_bytes == 0 and data_d == data     # every chunk encoded: none raw, none direct
    elif all(n % 64 == 0 for n in sizes):
        # the slot holds them back to back, as the file: one run across chunks and tensors, only its
        # last partial block through the page cache
        assert data_d == data
        assert direct.direct_bytes == sum(sizes) // 4096 * 4096
    else:
        # each tensor of 8 KiB or more lined up with the slot past a gap (60 bytes after a 4-byte
        # one, at most 1/64 of it): all but its partial end blocks direct
        large = [n for n in sizes if n >= 8192]
        assert len(data_d) > len(data)
        assert direct.direct_bytes >= sum(large) - 2 * 4096 * len(large)


def test_tmpfs_gets_the_same_files(tmp_path: Path) -> None:
    """tmpfs refuses ``O_DIRECT`` (kernels before 6.6: the page cache way then) or takes it as buffered."""
    shm = Path("/dev/shm")
    assert shm.is_dir()
    mm, layout = slot_of([4 * MiB, 2 * MiB])
    root = shm / f"ckptd-direct-{os.getpid()}"
    try:
        w, data, _ = write(root, mm, layout, direct=True)
        assert data == bytes(mm[:6 * MiB])
    finally:
        for p in root.glob("*"):
            p.unlink()
        root.rmdir()


def test_a_failing_direct_write_fails_the_shard_and_frees_the_source_first(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The device refusing a direct write (here: a descriptor opened read-only in its place) fails the
    shard with that error, its files removed, and the source is released only once no write reads it."""
    mm, layout = slot_of([8 * MiB, 8 * MiB])
    order: list[str] = []
    real = DirectWriter.open

    def broken(fd: int, path: str, source: memoryview) -> DirectWriter | None:
        w = real(fd, path, source)
        assert w is not None
        os.close(w.dfd)
        w.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)      # EBADF on write
        close = w._close

        def closed() -> None:          # (finish, then abort on its error, both close: the first counts)
            first = not w._closed
            close()
            if first:
                order.append("direct writes done")
        w._close = closed                                       # type: ignore[method-assign]
        return w
    monkeypatch.setattr(DirectWriter, "open", staticmethod(broken))
    with pytest.raises(OSError) as e:
        write(tmp_path / "s", mm, layout, direct=True, hooks=ShardHooks(released=lambda: order.append("released")))
    assert e.value.errno == 9                                   # EBADF
    assert order == ["direct writes done", "released"]
    assert not (tmp_path / "s" / rank_data_name(0)).exists()
    assert not (tmp_path / "s" / rank_manifest_name(0)).exists()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_the_record_returned_is_the_manifest_files(tmp_path: Path, direct: bool) -> None:
    """The manifest, its digest and its record are built before the last writes finish: what the
    write returns is what the manifest file on disk gives (the commit trusts the record)."""
    mm, layout = slot_of([4 * MiB + 4, 4, 3 * MiB, 2 * MiB + 64, 0])
    w, _, manifest = write(tmp_path / "s", mm, layout, direct=direct)
    assert w.digest == digest_bytes(manifest)
    assert w.record == summarize(parse_manifest(manifest, job="j", step=1, rank=0), w.digest)
    assert [e.name for e in w.record.entries] == [t.name for t in layout]


def test_write_all_at_leaves_the_position(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert storage.write_all_at(fd, [b"abc", memoryview(b"de")], 3) == 5
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        assert os.pread(fd, 8, 0) == b"\0\0\0abcde"
    finally:
        os.close(fd)


def test_auto_measures_each_way_then_keeps_to_the_faster() -> None:
    assert KEEP == 2
    way = WriteWay("auto")
    assert way.pick() is False                       # buffered first
    way.record(False, MIN_BYTES - 1, 0, 0.01)        # too small to tell the disk: not counted
    assert way.pick() is False
    way.record(False, 1 << 30, 0, 2.0)               # 0.5 GiB/s: a slow first shard
    assert way.pick() is True                        # then direct
    way.record(True, 1 << 30, (1 << 29) - 1, 0.1)    # mostly through the page cache: says nothing of direct
    assert way.pick() is True
    way.record(True, 1 << 30, 1 << 30, 0.25)         # 4 GiB/s
    assert way.pick() is False                       # a second sample of each before any choice
    way.record(False, 1 << 30, 0, 0.2)               # 5 GiB/s: the slow first one was noise
    assert way.pick() is True
    way.record(True, 1 << 30, 1 << 30, 0.5)          # 2 GiB/s
    assert way.rates() == {"buffered": 5 << 30, "direct": 4 << 30}     # each way's best of its last KEEP
    picks = [way.pick() for _ in range(2 * RETRY)]
    assert picks.count(True) == 2 and picks[RETRY - 1] is True and picks[2 * RETRY - 1] is True
    way.record(True, 1 << 30, 1 << 30, 0.1)          # direct tried again and faster now
    assert way.pick() is True
    for _ in range(KEEP):                            # until buffered's fast samples are no longer its last
        way.record(False, 1 << 30, 0, 1.0)
    way.record(True, 1 << 30, 1 << 30, 0.5)
    assert way.pick() is True and way.rates() == {"buffered": 1 << 30, "direct": 10 << 30}


def test_the_way_changes_only_on_a_retry_judged_by_its_own_sample() -> None:
    """Samples of the way not in use are old (the disk of RETRY or more shards ago): the way in use
    slowing below them changes nothing until the other way's retry, whose sample replaces them."""
    way = WriteWay("auto")
    for direct, seconds in ((False, 0.9), (True, 0.1), (False, 0.2), (True, 0.1)):  # buffered's best 5 GiB/s
        assert way.pick() is direct
        way.record(direct, 1 << 30, (1 << 30) if direct else 0, seconds)
    assert way.pick() is True                         # direct, 10 GiB/s
    for _ in range(KEEP):
        way.record(True, 1 << 30, 1 << 30, 0.5)       # the disk slows: direct at 2 GiB/s
    assert way.rates() == {"buffered": 5 << 30, "direct": 2 << 30}
    picks = [way.pick() for _ in range(RETRY)]
    assert picks.count(False) == 1                    # buffered's old 5 GiB/s switches nothing; it is retried
    way.record(False, 1 << 30, 0, 1.0)                # the retry: 1 GiB/s, its old samples gone
    assert way.rates() == {"buffered": 1 << 30, "direct": 2 << 30} and way.pick() is True
    picks = [way.pick() for _ in range(RETRY)]
    assert picks.count(False) == 1
    way.record(False, 1 << 30, 0, 0.25)               # a retry at 4 GiB/s: the page cache is faster now
    assert way.pick() is False
    for _ in range(KEEP):
        way.record(False, 1 << 30, 0, 2.0)            # the way in use below direct's samples: kept
    assert way.rates() == {"buffered": 1 << 29, "direct": 2 << 30} and way.pick() is False


@pytest.mark.parametrize("mode,want", [("on", True), ("off", False)])
def test_on_and_off_fix_the_way(mode: str, want: bool) -> None:
    way = WriteWay(mode)
    for _ in range(3):
        assert way.pick() is want
        way.record(want, 1 << 30, 1 << 30 if want else 0, 1.0)
    assert way.rates() == {}


def test_an_unknown_way_is_refused() -> None:
    with pytest.raises(ValueError, match="direct_io must be one of auto, on, off"):
        WriteWay("sideways")


def test_a_daemon_writing_direct_commits_the_same_step(tmp: Path, daemon_factory: Any) -> None:
    """Real daemons, one with ``--direct-io on`` and one ``off`` (raw chunks: ``--codec none``), save the
    same state (a tensor of an odd size among them): the data files hold the same chunks (the direct
    one's last tensor past a gap that lines it up with the slot), the direct one's ``ckptd status``
    counts its bytes written direct (all but a few blocks), and the step restores bit-exact from the
    direct daemon's files. With ``auto`` (the default) a daemon writes its first large shard through
    the page cache and the next direct, and shows both ways' measured rates."""
    import torch

    import ckptd_client
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(4 << 20, generator=g), "b": torch.randn(1 << 20, generator=g).to(torch.bfloat16),
             "c": torch.randn(12345, generator=g), "d": torch.randn(3 << 20, generator=g)}
    roots = {}
    for way in ("on", "off"):
        d = daemon_factory("--codec", "none", "--direct-io", way, name=way, root=tmp / way)
        ck = ckptd_client.Checkpointer("dio", socket=str(d.socket), commit="local")
        ck.save(1, state).wait(60)
        ck.close()
        roots[way] = tmp / way / "dio" / "step-000000000001"
        status = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(d.socket), "--json"],
                                capture_output=True, text=True, timeout=60, check=True)
        st = json.loads(status.stdout)
        stats = st["stats"]
        assert st["direct_io"] == {"mode": way, "bytes_per_s": {}}, st["direct_io"]     # a fixed way measures nothing
        human = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(d.socket)],
                               capture_output=True, text=True, timeout=60, check=True).stdout
        assert f"shard writes: direct_io {way}\n" in human, human
        size = (roots[way] / rank_data_name(0)).stat().st_size
        if way == "on":      # all but the partial blocks at the ends of runs ("d" past a gap after the odd "c")
            assert size - 4 * 4096 < stats["bytes_direct"] < size, (stats, size)
        else:
            assert stats["bytes_direct"] == 0, stats
    on, off = ({"m": json.loads((roots[w] / rank_manifest_name(0)).read_bytes()),
                "d": (roots[w] / rank_data_name(0)).read_bytes()} for w in ("on", "off"))
    assert tensor_bytes(on["d"], on["m"]) == tensor_bytes(off["d"], off["m"])
    assert [t["offset"] for t in on["m"]["tensors"]][:3] == [t["offset"] for t in off["m"]["tensors"]][:3]
    assert 0 < on["m"]["tensors"][3]["offset"] - off["m"]["tensors"][3]["offset"] < 4096     # "d", past its gap
    verify = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(roots["on"])], capture_output=True,
                            text=True, timeout=60)
    assert verify.returncode == 0 and verify.stdout.strip().endswith(": OK"), verify.stdout + verify.stderr
    # auto, a state of 64 MiB or more: the first shard through the page cache, the next direct, each measured
    d = daemon_factory("--codec", "none", name="auto", root=tmp / "auto")
    big = {"w": torch.randn(17 << 20, generator=g)}              # 68 MiB
    ck = ckptd_client.Checkpointer("dio", socket=str(d.socket), commit="local")
    for step in (1, 2):
        ck.save(step, big).wait(60)
    ck.close()
    st = json.loads(subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(d.socket), "--json"],
                                   capture_output=True, text=True, timeout=60, check=True).stdout)
    assert st["direct_io"]["mode"] == "auto" and set(st["direct_io"]["bytes_per_s"]) == {"buffered", "direct"}, st
    assert 0 < st["stats"]["bytes_direct"] <= 68 << 20, st["stats"]          # the second shard's
    d = daemon_factory("--codec", "none", "--direct-io", "on", name="on2", root=tmp / "on")
    fresh = ckptd_client.Checkpointer("dio", socket=str(d.socket), memory=False)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert fresh.restore(out, step=1) == 1
    fresh.close()
    assert all(torch.equal(out[k], state[k]) for k in state)
