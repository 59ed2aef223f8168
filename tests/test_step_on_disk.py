"""One step on disk (issue 18): ``core.step_files``, ``core.shard_writer`` and ``core.publish``,
shared by the daemon's commit and ``ckptd import``.

Real files throughout: shards written by the shared encoder, indexes published by the shared
publisher, and ``ckptd verify`` run as the CLI. An import large enough for the lean index now
writes its side files (before, the importer built its own index without them), and a step whose
pieces do not tile their tensors is refused by the publisher both callers use.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import ckptd.core.publish as publish
from ckptd.core.errors import FormatError
from ckptd.core.names import (
    INDEX_NAME,
    RANK_TABLE_NAME,
    STAGED_NAME,
    rank_data_name,
    rank_manifest_name,
    step_dir,
    temp_name,
)
from ckptd.core.publish import IndexRefused, publish_step
from ckptd.core.rank_record import summarize
from ckptd.core.rank_table import SIDE_FILES, SMALL_INDEX_BYTES
from ckptd.core.reader import StepReader, verify_step
from ckptd.core.schema import Placement, TensorLayout
from ckptd.core.shard_writer import Encoding, ShardHooks, WrittenShard, write_shard
from ckptd.core.step_files import is_committed, remove_step, stray_temps
from ckptd.daemon.tiers.fs.commit import CommitError, write_index
from ckptd.hf.importer import import_hf

ENCODING = Encoding("bplane", 1, 1024)


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=120)


def hf_checkpoint(path: Path, tensors: int) -> dict[str, np.ndarray]:
    """A one-file Hugging Face checkpoint (model.safetensors) of ``tensors`` small tensors."""
    rng = np.random.default_rng(tensors)
    state = {f"model.layers.{i}.mlp.weight": rng.standard_normal((4, 3), dtype=np.float32) for i in range(tensors)}
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    return state


def test_a_large_import_writes_the_side_files_and_verifies(tmp_path: Path) -> None:
    """Enough tensors that index.json's tensor map passes SMALL_INDEX_BYTES: the import writes
    ranks.bin, tensors.json and index-head.json before index.json, ``ckptd verify`` checks them
    against the index, and a reader reads the step; a small import writes none of them."""
    state = hf_checkpoint(tmp_path / "big", 400)
    r = ckptd("import", str(tmp_path / "big"), str(tmp_path / "root"), "big", "--step", "3")
    assert r.returncode == 0, r.stderr
    path = Path(step_dir(str(tmp_path / "root"), "big", 3))
    assert (path / INDEX_NAME).stat().st_size > SMALL_INDEX_BYTES
    assert all((path / name).is_file() for name in SIDE_FILES)
    v = ckptd("verify", str(path))
    assert v.returncode == 0 and v.stdout.strip().endswith(": OK"), v.stdout + v.stderr
    reader = StepReader(str(path))
    assert reader.rank_entry(0)["manifest_digest"] == reader.index["ranks"][0]["manifest_digest"]
    m = reader.manifest(0)
    assert sorted(e.name for e in m.tensors) == sorted(f"model/{k}" for k in state)
    hf_checkpoint(tmp_path / "small", 3)
    assert ckptd("import", str(tmp_path / "small"), str(tmp_path / "root"), "small", "--step", "3").returncode == 0
    small = Path(step_dir(str(tmp_path / "root"), "small", 3))
    assert sorted(p.name for p in small.iterdir()) == sorted([INDEX_NAME, rank_data_name(0), rank_manifest_name(0)])
    assert verify_step(str(small)) == []


def test_a_rank_table_that_is_a_fifo_or_a_directory_is_refused_not_waited_on(tmp_path: Path) -> None:
    """ranks.bin replaced by a FIFO: opening it for reading would block until a writer comes, so
    ``ckptd verify`` and a reader hung; a directory gave a raw OSError. Both are now the format
    error that names the file, at once."""
    hf_checkpoint(tmp_path / "big", 400)
    assert ckptd("import", str(tmp_path / "big"), str(tmp_path / "root"), "big", "--step", "3").returncode == 0
    path = Path(step_dir(str(tmp_path / "root"), "big", 3))
    table = path / RANK_TABLE_NAME
    for make in (lambda: os.mkfifo(table), table.mkdir):
        if table.is_dir():
            table.rmdir()
        else:
            table.unlink()
        make()
        with pytest.raises(FormatError, match="ranks.bin: not a regular file"):
            StepReader(str(path)).rank_entry(0)
        v = ckptd("verify", str(path))
        assert v.returncode != 0 and "ranks.bin: not a regular file" in v.stdout + v.stderr, v.stdout + v.stderr


def test_an_import_the_publisher_refuses_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The importer goes through the publisher's geometry check. A real Hugging Face checkpoint
    cannot fail it — every imported tensor is one whole plain tensor on one rank, which tiles
    itself — so the check is made to report a fault here; the import is refused with the
    publisher's reason and no step directory is left behind."""
    hf_checkpoint(tmp_path / "hf", 2)
    monkeypatch.setattr(publish, "geometry_faults", lambda tensors, world: ["tensor 'x': rank 0 and rank 1 overlap"])
    with pytest.raises(IndexRefused, match="do not tile their tensors: tensor 'x'"):
        import_hf(tmp_path / "hf", tmp_path / "root", "job", 1, progress=False)
    assert not Path(step_dir(str(tmp_path / "root"), "job", 1)).exists()


def write_pieces(path: Path, pieces: list[tuple[int, int]], length: int) -> list[WrittenShard]:
    """One shard per (offset, size) piece of a float32 vector ``w`` of ``length``, by the shared encoder."""
    out = []
    with ThreadPoolExecutor(2) as pool:
        for rank, (offset, size) in enumerate(pieces):
            data = memoryview(np.arange(offset, offset + size, dtype=np.float32).tobytes())
            layout = [TensorLayout("w", "float32", (size,), 0, size * 4, Placement((length,), (offset,)))]

            def read(t: TensorLayout, start: int, n: int, data: memoryview = data) -> memoryview:
                return data[t.offset + start: t.offset + start + n]
            tree = {"d": [["w", {"T": "w"}]]}
            out.append(write_shard(str(path), "job", 1, rank, len(pieces), layout, read, tree, ENCODING, pool, 4))
    return out


def test_the_publisher_refuses_pieces_that_overlap(tmp_path: Path) -> None:
    """Two ranks' pieces of one tensor overlap: no index is published (the daemon's commit gets
    the same refusal, as CommitError: test_geometry)."""
    path = tmp_path / "job" / "step-000000000001"
    shards = write_pieces(path, [(0, 5), (4, 4)], 8)
    with pytest.raises(IndexRefused, match="do not tile their tensors: tensor 'w'"):
        publish_step(str(path), "job", 1, 2, [summarize(s.manifest, s.digest) for s in shards])
    assert not is_committed(str(path))


def test_a_published_step_is_committed_without_stray_temps_and_verifies(tmp_path: Path) -> None:
    """Pieces that tile: the step publishes (side files too, with the threshold at 0), the temp
    files of a killed earlier writer are gone, and it verifies; removal is index.json first."""
    path = tmp_path / "job" / "step-000000000001"
    shards = write_pieces(path, [(0, 5), (5, 3)], 8)
    stray = temp_name(str(path / rank_manifest_name(1)))
    Path(stray).write_bytes(b"{")
    assert stray_temps(str(path)) == [stray] and not is_committed(str(path))
    publish_step(str(path), "job", 1, 2, [summarize(s.manifest, s.digest) for s in shards], small_index_bytes=0)
    assert is_committed(str(path)) and stray_temps(str(path)) == []
    assert all((path / name).is_file() for name in SIDE_FILES)
    assert verify_step(str(path)) == []
    (path / STAGED_NAME).write_text("{}")       # a name ckptd writes: removed with the rest
    remove_step(str(path))
    assert not path.exists()


def test_a_commit_with_records_reads_back_the_check_ranks_or_every_rank(tmp_path: Path) -> None:
    """A relayed COMMIT names one rank per node (``check``): those manifests are read back and a
    changed or missing one fails the commit, named; without ``check`` every rank's is read."""
    path = tmp_path / "job" / "step-000000000001"
    shards = write_pieces(path, [(0, 2), (2, 2), (4, 2), (6, 2)], 8)
    records = [summarize(s.manifest, s.digest) for s in shards]
    digests = {r: s.digest for r, s in enumerate(shards)}
    manifest = path / rank_manifest_name(2)
    good = manifest.read_bytes()
    manifest.write_bytes(good + b" ")               # rank 2's manifest is not what it reported
    for check in (None, [0, 2]):
        with pytest.raises(CommitError, match="rank 2 manifest .* does not match the digest"):
            write_index(str(path), "job", 1, 4, digests, None, records, check)
        assert not is_committed(str(path))
    manifest.unlink()                               # gone, as on a node whose root is not shared
    with pytest.raises(CommitError, match="rank 2 manifest unreadable"):
        write_index(str(path), "job", 1, 4, digests, None, records, [0, 2])
    manifest.write_bytes(good)
    write_index(str(path), "job", 1, 4, digests, None, records, [0, 2])
    assert is_committed(str(path)) and verify_step(str(path)) == []


def test_is_committed_means_an_index_file(tmp_path: Path) -> None:
    step = tmp_path / "step-000000000001"
    step.mkdir()
    assert not is_committed(str(step))
    (step / INDEX_NAME).mkdir()            # not a file: nothing a reader could load
    assert not is_committed(str(step))
    (step / INDEX_NAME).rmdir()
    (step / INDEX_NAME).write_text("{}")
    assert is_committed(str(step))
    assert not is_committed(str(tmp_path / "step-000000000002"))


def write_vector(path: Path, rank: int, world: int, w: np.ndarray, encoding: Encoding,
                 pool: ThreadPoolExecutor, hooks: ShardHooks | None = None) -> WrittenShard:
    """Rank ``rank``'s shard holding the plain (replicated) tensor ``w``, by the shared encoder."""
    data = memoryview(w.tobytes())
    layout = [TensorLayout("w", "float32", w.shape, 0, w.nbytes, None)]

    def read(t: TensorLayout, start: int, n: int) -> memoryview:
        return data[t.offset + start: t.offset + start + n]
    return write_shard(str(path), "job", 1, rank, world, layout, read, {"d": [["w", {"T": "w"}]]}, encoding, pool, 4,
                       hooks or ShardHooks())


def read_back(reader: StepReader, rank: int) -> bytes:
    """Rank ``rank``'s one tensor of a committed step, read and checked by the step reader."""
    entry = reader.manifest(rank).tensors[0]
    out = bytearray(entry.nbytes)
    fd = reader.open_data(rank)
    try:
        reader.read_tensor_into(fd, entry, memoryview(out))
    finally:
        os.close(fd)
    return bytes(out)


def test_adaptive_writes_raw_what_no_codec_thread_took_and_copies_stay_identical(tmp_path: Path) -> None:
    """``Encoding.adaptive``: with every codec thread busy (one thread, held by a task until the
    shard is written), the writer stores every chunk raw itself instead of waiting; with free
    threads and ``adaptive`` off every chunk is encoded. The two ranks' identical copies of ``w``
    got different codecs and still fingerprint the same (raw checksums), so the tensor map calls
    them the same and the step verifies and reads back bit-exact from either rank."""
    path = tmp_path / "job" / "step-000000000001"
    w = (np.random.default_rng(0).standard_normal(3000) * 0.02).astype(np.float32)   # 12 chunks of 1 KiB
    busy = ThreadPoolExecutor(1)
    gate = threading.Event()
    busy.submit(gate.wait, 60)
    try:
        raw = write_vector(path, 0, 2, w, Encoding("bplane", 1, 1024, adaptive=True), busy)
    finally:
        gate.set()
        busy.shutdown()
    with ThreadPoolExecutor(2) as pool:
        encoded = write_vector(path, 1, 2, w, Encoding("bplane", 1, 1024, adaptive=False), pool)
    raw_chunks, enc_chunks = raw.manifest.tensors[0].chunks, encoded.manifest.tensors[0].chunks
    assert len(raw_chunks) == 12 and {c.codec for c in raw_chunks} == {"none"}
    assert {c.codec for c in enc_chunks} == {"bplane"} and all(c.raw_checksum for c in enc_chunks)
    assert encoded.manifest.stored_bytes < raw.manifest.stored_bytes == w.nbytes
    records = [summarize(s.manifest, s.digest) for s in (raw, encoded)]
    assert records[0].entries[0].fp == records[1].entries[0].fp
    publish_step(str(path), "job", 1, 2, records)
    assert verify_step(str(path)) == []
    reader = StepReader(str(path))
    assert reader.tensor_map()[0]["w"].same
    for rank in (0, 1):
        assert read_back(reader, rank) == w.tobytes()



def test_adaptive_raw_chunks_are_hashed_by_idle_codec_threads_not_the_writer(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive, the disk not the limit: chunks go raw, and a free codec thread takes the checksum of
    an untaken one ahead of the writer, whose own thread then only writes it. The writer is held
    before its first write until a codec thread has hashed a chunk (bounded); that chunk is written
    raw with the checksum the codec thread took, and the shard verifies and reads back bit-exact."""
    import ckptd.core.shard_writer as shard_writer
    from ckptd.core.codec import ChunkMeta, encode_chunk
    hashed_by: list[tuple[str, str]] = []              # (thread name, codec) per chunk encoded
    pool_hashed = threading.Event()

    def encode(raw: memoryview, dtype: str, codec: str, level: int = 1) -> tuple[list[Any], ChunkMeta]:
        out = encode_chunk(raw, dtype, codec, level)
        name = threading.current_thread().name
        hashed_by.append((name, codec))
        if name.startswith("codec") and codec == "none":
            pool_hashed.set()
        return out
    monkeypatch.setattr(shard_writer, "encode_chunk", encode)
    writer = threading.current_thread().name
    path = tmp_path / "job" / "step-000000000001"
    w = (np.random.default_rng(3).standard_normal(3000) * 0.02).astype(np.float32)   # 12 chunks of 1 KiB

    def held() -> None:
        if not pool_hashed.wait(20):
            raise AssertionError("no codec thread hashed a chunk ahead of the writer")
    with ThreadPoolExecutor(2, thread_name_prefix="codec") as pool:
        shard = write_vector(path, 0, 1, w, Encoding("bplane", 1, 1024, adaptive=True), pool,
                             ShardHooks(before_write=held))
    chunks = shard.manifest.tensors[0].chunks
    assert len(chunks) == 12 and {c.codec for c in chunks} == {"none"}
    assert ("codec", "none") in {(n[:5], c) for n, c in hashed_by}, hashed_by
    assert len(hashed_by) == 12 and all(c == "none" for _, c in hashed_by)          # each chunk hashed once
    assert sum(n == writer for n, _ in hashed_by) < 12
    publish_step(str(path), "job", 1, 1, [summarize(shard.manifest, shard.digest)])
    assert verify_step(str(path)) == []
    assert read_back(StepReader(str(path)), 0) == w.tobytes()


def test_adaptive_encodes_once_the_disk_is_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adaptive writer writes raw until its waits for the disk show the disk sets the pace; then
    the codec threads encode (fewer bytes to a disk that is the limit). The disk is made slow by
    delaying each of the writer's waits for its writeback (pacing every 8 KiB, 16 KiB behind):
    chunks before the first wait are raw, encoded ones follow, and the shard reads back bit-exact."""
    import ckptd.core.shard_writer as shard_writer
    from ckptd.core import storage
    monkeypatch.setattr(storage, "WRITEBACK_BYTES", 8192)
    monkeypatch.setattr(shard_writer, "PACE_LAG_BYTES", 16384)
    real_wait = storage.wait_writeback

    def slow_disk(fd: int, offset: int, nbytes: int) -> None:
        time.sleep(0.02)
        real_wait(fd, offset, nbytes)
    monkeypatch.setattr(storage, "wait_writeback", slow_disk)
    path = tmp_path / "job" / "step-000000000001"
    w = (np.random.default_rng(2).standard_normal(40_000) * 0.02).astype(np.float32)     # 40 chunks of 4 KiB
    with ThreadPoolExecutor(2) as pool:
        shard = write_vector(path, 0, 1, w, Encoding("bplane", 1, 4096, adaptive=True), pool)
    codecs = [c.codec for c in shard.manifest.tensors[0].chunks]
    assert codecs[:4] == ["none"] * 4 and "bplane" in codecs[8:], codecs
    assert shard.manifest.stored_bytes < w.nbytes
    publish_step(str(path), "job", 1, 1, [summarize(shard.manifest, shard.digest)])
    assert read_back(StepReader(str(path)), 0) == w.tobytes() and verify_step(str(path)) == []


def test_a_commit_keeps_nothing_an_earlier_killed_attempt_left(daemon: Any) -> None:
    """A daemon killed while publishing a large index left its side files (index-head.json, ranks.bin,
    tensors.json), and an attempt at world size 2 left rank 1's files. The re-saved step at world size 1
    committed with them inside: `ckptd verify` failed it ("index-head.json belongs to another index.json")
    and `ls` counted rank 1's bytes. The commit now removes every leftover before index.json is published."""
    import torch

    import ckptd_client
    path = Path(step_dir(str(daemon.root), "left", 3))
    path.mkdir(parents=True)
    for name in SIDE_FILES:
        (path / name).write_bytes(b"{\"from\": \"a killed attempt with a larger index\"}")
    (path / rank_data_name(1)).write_bytes(b"\0" * 4096)
    (path / rank_manifest_name(1)).write_text("{}")
    with ckptd_client.Checkpointer("left", socket=str(daemon.socket)) as ck:
        ck.save(3, {"w": torch.ones(8)}).wait(60)
    assert sorted(p.name for p in path.iterdir()) == [INDEX_NAME, rank_data_name(0), rank_manifest_name(0)]
    assert verify_step(str(path)) == []
    v = ckptd("verify", str(path))
    assert v.returncode == 0, v.stdout + v.stderr
