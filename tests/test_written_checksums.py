"""The memory tier keeps a written slot with the raw chunk checksums its writer took
(``held.written_checksums``) instead of hashing it a second time: they must be exactly what hashing
the slot gives (``held.layout_checksums``), for raw and encoded chunks alike, and nothing when the
manifest's chunks are not the memory tier's pieces."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ckptd.core import shard_writer
from ckptd.core.held import layout_checksums, written_checksums
from ckptd.core.schema import TensorLayout
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
