"""The shard writer starts writeback on a thread of its own (shard_writer._Writeback): the data file
holds exactly the source's bytes, and the thread is gone when the write returns — and when it fails
midway, before its descriptor is closed (a sync_file_range after the close could reach another file
that took the descriptor's number)."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckptd.core import shard_writer, storage
from ckptd.core.names import rank_data_name, rank_manifest_name
from ckptd.core.schema import TensorLayout
from ckptd.core.shard_writer import Encoding, ShardHooks

CHUNK = 4 << 20


def _writeback_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptd-writeback"]


def _source() -> tuple[memoryview, list[TensorLayout]]:
    """~2.5 writeback ranges of raw bytes in three tensors."""
    n = (5 * storage.WRITEBACK_BYTES // 2) // 4 // 3
    g = torch.Generator().manual_seed(11)
    parts = [torch.randn(n, generator=g) for _ in range(3)]
    layout, blobs, off = [], [], 0
    for i, t in enumerate(parts):
        raw = t.numpy().tobytes()
        layout.append(TensorLayout(f"t{i}", "float32", (n,), off, len(raw)))
        blobs.append(raw + b"\0" * (-len(raw) % 64))
        off += len(blobs[-1])
    return memoryview(bytearray(b"".join(blobs))), layout


def _write(path: Path, data: memoryview, layout: list[TensorLayout], hooks: ShardHooks) -> shard_writer.WrittenShard:
    with ThreadPoolExecutor(2) as pool:
        return shard_writer.write_shard(str(path), "j", 1, 0, 1, layout,
                                        lambda t, s, n: data[t.offset + s: t.offset + s + n], {"d": []},
                                        Encoding("bplane", 1, CHUNK, adaptive=True), pool, 4, hooks)


def test_the_file_holds_the_source_and_the_writeback_thread_is_gone(tmp_path: Path) -> None:
    data, layout = _source()
    seen: list[int] = []
    written = _write(tmp_path / "s", data, layout, ShardHooks(written=lambda n: seen.append(len(_writeback_threads()))))
    assert max(seen) == 1                                   # it ran beside the writer
    assert _writeback_threads() == []
    with open(tmp_path / "s" / rank_data_name(0), "rb") as f:
        body = f.read()
    for t, e in zip(layout, written.manifest.tensors, strict=True):
        assert {c.codec for c in e.chunks} == {"none"}
        assert body[e.offset: e.offset + t.nbytes] == bytes(data[t.offset: t.offset + t.nbytes])


def test_a_write_failing_midway_leaves_no_writeback_thread_and_no_files(tmp_path: Path) -> None:
    data, layout = _source()
    chunks = 0

    def before_write() -> None:
        nonlocal chunks
        chunks += 1
        if chunks * CHUNK > storage.WRITEBACK_BYTES + CHUNK:    # past the first range handed to the thread
            raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        _write(tmp_path / "s", data, layout, ShardHooks(before_write=before_write))
    assert _writeback_threads() == []
    assert not os.path.exists(tmp_path / "s" / rank_data_name(0))
    assert not os.path.exists(tmp_path / "s" / rank_manifest_name(0))
