"""The memory tier keeps a written slot with the raw chunk checksums its writer took
(``held.written_checksums``) instead of hashing it a second time: they must be exactly what hashing
the slot gives (``held.layout_checksums``), for raw and encoded chunks alike, and nothing when the
manifest's chunks are not the memory tier's pieces."""
from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core import shard_writer
from ckptd.core.codec import ChunkMeta, chunk_ranges
from ckptd.core.held import layout_checksums, written_checksums
from ckptd.core.schema import Manifest, TensorEntry, TensorLayout
from ckptd.core.shard_writer import Encoding

CHUNK = 64 * 1024


def slot_and_layout() -> tuple[memoryview, list[TensorLayout]]:
    """Tensors of several dtypes and sizes (one spanning many chunks, one empty, one 0-d) in one buffer."""
    g = torch.Generator().manual_seed(3)
    parts = [("w", torch.randn(70_000, generator=g)), ("h", torch.randn(5_000, generator=g).bfloat16()),
             ("i", torch.arange(1_000, dtype=torch.int64)), ("e", torch.empty(0)), ("s", torch.tensor(2.5))]
    layout, blobs, off = [], [], 0
    for name, t in parts:
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        layout.append(TensorLayout(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, len(raw)))
        blobs.append(raw + b"\0" * (-len(raw) % 64))
        off += len(blobs[-1])
    return memoryview(bytearray(b"".join(blobs))), layout


@pytest.mark.parametrize("adaptive", [True, False])
def test_written_checksums_are_the_slots(tmp_path: Path, adaptive: bool) -> None:
    data, layout = slot_and_layout()
    with ThreadPoolExecutor(2) as pool:
        written = shard_writer.write_shard(str(tmp_path / "s"), "j", 1, 0, 1, layout,
                                           lambda t, s, n: data[t.offset + s: t.offset + s + n], {"d": []},
                                           Encoding("bplane", 1, CHUNK, adaptive), pool, 4)
    codecs = {c.codec for e in written.manifest.tensors for c in e.chunks}
    if adaptive:
        assert codecs == {"none"}                 # a small shard never waits on the disk: all raw
    else:
        assert codecs - {"none"}, codecs          # encoded chunks: their raw checksum is the one taken
    assert written_checksums(written.manifest, layout, CHUNK) == layout_checksums(data, layout, CHUNK)
    assert written_checksums(written.manifest, layout, CHUNK * 2) is None       # other pieces: hashed again
    assert written_checksums(written.manifest, layout[:-1], CHUNK) is None


SPOILS = ["none", "raw length", "no raw checksum", "a chunk more", "a chunk less", "another name", "a tensor less"]


@st.composite
def written(draw):
    """A layout, a manifest whose chunks are ``chunk_bytes`` pieces of it with raw checksums, and the
    checksums ``written_checksums`` must give (each raw chunk's stored one, each encoded chunk's raw
    one) — but for at most one spoil, which must give None: one chunk's raw length, its raw checksum
    gone (encoded, none given; or raw with no stored one), a chunk more or less, a tensor renamed or
    missing."""
    chunk = draw(st.integers(1, 100))
    layout, entries, want = [], [], []
    for i in range(draw(st.integers(1, 5))):
        n = draw(st.integers(0, 300))
        layout.append(TensorLayout(f"t{i}", "uint8", (n,), 0, n))
        encoded = draw(st.integers(0, 0xFFFF))          # bit j % 16: chunk j encoded (else stored raw)
        entries.append(TensorEntry(f"t{i}", "uint8", [n], 0, [
            ChunkMeta("zstd", k, k, f"{j:016x}", [], f"{j + 1000:016x}") if encoded >> (j % 16) & 1 else
            ChunkMeta("none", k, k, f"{j:016x}", []) for j, (_, k) in enumerate(chunk_ranges(n, chunk))]))
        want.append(tuple(f"{j + 1000:016x}" if encoded >> (j % 16) & 1 else f"{j:016x}"
                          for j in range(len(chunk_ranges(n, chunk)))))
    spoil = draw(st.sampled_from(SPOILS))
    e = entries[draw(st.integers(0, len(entries) - 1))]
    j = draw(st.integers(0, len(e.chunks) - 1))
    c = e.chunks[j]
    if spoil == "raw length":
        e.chunks[j] = dataclasses.replace(c, raw_len=c.raw_len + draw(st.sampled_from([-1, 1])))
    elif spoil == "no raw checksum":
        e.chunks[j] = dataclasses.replace(c, codec="zstd", raw_checksum=None) if draw(st.booleans()) else \
            dataclasses.replace(c, codec="none", checksum="", raw_checksum=None)
    elif spoil == "a chunk more":
        e.chunks.insert(j, c)
    elif spoil == "a chunk less":
        e.chunks.pop(j)
    elif spoil == "another name":
        e.name = "x"
    elif spoil == "a tensor less":
        entries.remove(e)
    return Manifest("j", 1, 0, 1, entries, {}, 0, 0), layout, chunk, spoil, tuple(want)


@settings(max_examples=1500, deadline=None, database=None)
@given(written())
def test_each_chunks_raw_checksum_or_none_when_spoiled(case) -> None:
    """(Most tensors here are one chunk, which ``written_checksums`` takes in one step; the rest, chunk
    by chunk: both must give the chunks' raw checksums, and None for any spoil.)"""
    manifest, layout, chunk, spoil, want = case
    assert written_checksums(manifest, layout, chunk) == (want if spoil == "none" else None), spoil
