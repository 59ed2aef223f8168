"""The chunk codecs: bit-exact round trips for every stored dtype, the bplane byte layout,
checksums and malformed metadata. No timing here (see benchmarks/codec_bench.py)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core import codec
from ckptd.core.codec import CODECS, FLOAT_ITEMSIZE, ChunkMeta
from ckptd.core.errors import ChecksumError
from ckptd.core.schema import DTYPE_ITEMSIZE

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}
FLOAT_DTYPES = sorted(FLOAT_ITEMSIZE)
SMALL_CHUNK = 64 * 1024   # several chunks per tensor, and planes above the sampling threshold


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype: str, numel: int, seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaN payloads, denormals, all of them)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, numel * DTYPE_ITEMSIZE[dtype], dtype=np.uint8)
    return torch.from_numpy(raw).view(TORCH_DTYPES[dtype])


def weight_like(dtype: str, numel: int, seed: int = 0) -> torch.Tensor:
    """Compressible data: small normal floats (the bplane planes become zstd frames)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * 0.02).to(TORCH_DTYPES[dtype])


def encode_all(data: bytes, dtype: str, codec_name: str, chunk_bytes: int = SMALL_CHUNK):
    """Encode ``data`` chunk by chunk like the writer: [(start, stored bytes, meta), ...]."""
    out = []
    view = memoryview(data)
    for start, length in codec.chunk_ranges(len(data), chunk_bytes):
        parts, meta = codec.encode_chunk(view[start: start + length], dtype, codec_name)
        stored = b"".join(bytes(p) for p in parts)
        assert len(stored) == meta.stored_len == sum(s[0] for s in meta.segments)
        assert meta.checksum == codec.checksum(stored)
        out.append((start, stored, meta))
    return out


def decode_all(encoded, nbytes: int, dtype: str) -> bytes:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for start, stored, meta in encoded:
        codec.decode_chunk(stored, ChunkMeta.from_json(meta.to_json()), dtype, view[start: start + meta.raw_len])
    return bytes(buf)


def round_trip(data: bytes, dtype: str, codec_name: str, chunk_bytes: int = SMALL_CHUNK):
    encoded = encode_all(data, dtype, codec_name, chunk_bytes)
    assert decode_all(encoded, len(data), dtype) == data
    return encoded


def reference_planes(data: bytes, itemsize: int) -> list[bytes]:
    """The bplane layout spelled out the slow, obvious way: rotate left one bit, group bytes."""
    ut = {2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    words = np.frombuffer(data, dtype=ut)
    rotated = (words << ut(1)) | (words >> ut(itemsize * 8 - 1))
    by_position = rotated.view(np.uint8).reshape(-1, itemsize)
    return [by_position[:, i].tobytes() for i in range(itemsize)]


# ---- round trips ---------------------------------------------------------------

@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("dtype", sorted(DTYPE_ITEMSIZE))
def test_every_dtype_every_codec_round_trips(dtype: str, codec_name: str) -> None:
    for numel in (1, 3, 7, 1001, 50_021):
        round_trip(tensor_bytes(random_tensor(dtype, numel, seed=numel)), dtype, codec_name)
        if dtype in FLOAT_ITEMSIZE:
            round_trip(tensor_bytes(weight_like(dtype, numel, seed=numel)), dtype, codec_name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bplane_compresses_weights_and_uses_every_plane(dtype: str) -> None:
    data = tensor_bytes(weight_like(dtype, 300_000))
    encoded = round_trip(data, dtype, "bplane")
    for _, _, meta in encoded:
        assert meta.codec == "bplane" and len(meta.segments) == FLOAT_ITEMSIZE[dtype]
        assert meta.segments[-1][1] == "z"           # the exponent plane always shrinks
    assert sum(m.stored_len for _, _, m in encoded) < 0.9 * len(data)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bplane_segments_are_the_documented_planes(dtype: str) -> None:
    """Pins the on-disk layout (FORMAT.md): segment i holds byte i of every rotated element."""
    itemsize = FLOAT_ITEMSIZE[dtype]
    for data in (tensor_bytes(weight_like(dtype, 70_000)), tensor_bytes(random_tensor(dtype, 70_000))):
        parts, meta = codec.encode_chunk(memoryview(data), dtype, "bplane")
        expected = reference_planes(data, itemsize)
        for part, (length, kind), plane in zip(parts, meta.segments, expected, strict=True):
            got = zstandard.ZstdDecompressor().decompress(bytes(part)) if kind == "z" else bytes(part)
            assert len(bytes(part)) == length
            assert got == plane


@pytest.mark.parametrize("codec_name", CODECS)
def test_empty_and_zero_dim_tensors(codec_name: str) -> None:
    for dtype in ("float32", "bfloat16", "int64", "bool", "float8_e4m3fn", "complex128"):
        empty = tensor_bytes(torch.empty(0, 5, dtype=TORCH_DTYPES[dtype]))
        encoded = round_trip(empty, dtype, codec_name)
        assert [(m.codec, m.raw_len, m.stored_len, m.segments) for _, _, m in encoded] == [("none", 0, 0, [[0, "r"]])]
        scalar = tensor_bytes(torch.tensor(3, dtype=torch.int64).to(TORCH_DTYPES[dtype]))
        assert len(scalar) == DTYPE_ITEMSIZE[dtype]
        round_trip(scalar, dtype, codec_name)


@pytest.mark.parametrize("codec_name", CODECS)
def test_non_contiguous_views_round_trip_once_copied(codec_name: str) -> None:
    base = weight_like("float32", 600 * 301).reshape(600, 301)
    for view in (base.t(), base[::3, 1::2], base.bfloat16().t()[5:], base.double()[:, ::7]):
        assert not view.is_contiguous()
        dtype = str(view.dtype).removeprefix("torch.")
        data = tensor_bytes(view)
        back = torch.frombuffer(bytearray(decode_all(encode_all(data, dtype, codec_name), len(data), dtype)),
                                dtype=view.dtype).reshape(view.shape)
        assert tensor_bytes(back) == tensor_bytes(view)
        assert torch.equal(back, view)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("codec_name", CODECS)
def test_special_values_are_bit_exact(dtype: str, codec_name: str) -> None:
    tdt = TORCH_DTYPES[dtype]
    info = torch.finfo(tdt)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, info.tiny, -info.tiny,
                             info.tiny / 4, -info.tiny / 8, info.max, info.min, info.eps], dtype=torch.float64).to(tdt)
    # NaN payloads and signalling NaNs only exist as bit patterns: build them from integers.
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[specials.element_size()]
    payload_nans = torch.tensor([-1, -2, 2**(specials.element_size() * 8 - 2) - 1], dtype=bits).view(tdt)
    mixed = torch.cat([weight_like(dtype, 40_000), specials.repeat(500), payload_nans.repeat(300)])
    mixed = mixed[torch.randperm(len(mixed), generator=torch.Generator().manual_seed(1))]
    data = tensor_bytes(mixed)
    encoded = round_trip(data, dtype, codec_name)
    if codec_name == "bplane":
        assert any(kind == "z" for _, _, m in encoded for _, kind in m.segments)


def test_bplane_falls_back_for_non_floats_and_odd_lengths() -> None:
    assert codec.choose_codec("int64", "bplane") == "zstd"
    assert codec.choose_codec("float8_e4m3fn", "bplane") == "zstd"
    assert codec.choose_codec("bfloat16", "bplane") == "bplane"
    assert codec.choose_codec("int8", "none") == "none"
    with pytest.raises(ValueError, match="unknown codec"):
        codec.choose_codec("float32", "lz4")
    data = bytes(range(7)) * 3                       # 21 bytes: not a whole number of float32s
    parts, meta = codec.encode_chunk(memoryview(data), "float32", "bplane")
    assert meta.codec == "zstd"
    out = bytearray(len(data))
    codec.decode_chunk(b"".join(bytes(p) for p in parts), meta, "float32", memoryview(out))
    assert bytes(out) == data
    with pytest.raises(ValueError, match="unknown codec"):
        codec.encode_chunk(memoryview(data), "float32", "lz4")


def test_incompressible_data_is_stored_raw() -> None:
    data = tensor_bytes(random_tensor("uint8", 500_000))
    for codec_name in ("zstd", "bplane"):
        for _, stored, meta in round_trip(data, "uint8", codec_name, chunk_bytes=len(data)):
            assert meta.segments == [[len(data), "r"]] and stored == data


def test_parts_stay_valid_while_later_chunks_are_encoded() -> None:
    """Encoders reuse per-thread scratch: what a chunk returned must not change afterwards."""
    chunks = [tensor_bytes(random_tensor("bfloat16", 40_000, seed=s)) for s in range(3)]
    chunks += [tensor_bytes(weight_like("float32", 40_000, seed=s)) for s in range(3)]
    dtypes = ["bfloat16"] * 3 + ["float32"] * 3
    kept = [codec.encode_chunk(memoryview(c), d, "bplane") for c, d in zip(chunks, dtypes, strict=True)]
    for data, dtype, (parts, meta) in zip(chunks, dtypes, kept, strict=True):
        out = bytearray(len(data))
        codec.decode_chunk(b"".join(bytes(p) for p in parts), meta, dtype, memoryview(out))
        assert bytes(out) == data


def test_threads_encode_and_decode_concurrently() -> None:
    datas = [(tensor_bytes(weight_like(d, 90_000 + 17 * i, seed=i)), d)
             for i, d in enumerate(FLOAT_DTYPES * 4)]

    def work(item: tuple[bytes, str]) -> bool:
        data, dtype = item
        return decode_all(encode_all(data, dtype, "bplane", chunk_bytes=32 * 1024), len(data), dtype) == data

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, datas))


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPE_ITEMSIZE)), codec_name=st.sampled_from(CODECS),
       data=st.binary(max_size=3000), repeat=st.integers(1, 40), chunk=st.integers(1, 5000))
def test_any_bytes_round_trip(dtype: str, codec_name: str, data: bytes, repeat: int, chunk: int) -> None:
    data = data * repeat                              # repeats make some inputs compressible
    data = data[: len(data) - len(data) % DTYPE_ITEMSIZE[dtype]]
    round_trip(data, dtype, codec_name, chunk_bytes=chunk)


def test_chunk_ranges() -> None:
    assert codec.chunk_ranges(0, 4096) == [(0, 0)]
    assert codec.chunk_ranges(10, 4096) == [(0, 10)]
    assert codec.chunk_ranges(10_000, 4096) == [(0, 4096), (4096, 4096), (8192, 1808)]
    assert codec.chunk_ranges(20, 3) == [(0, 8), (8, 8), (16, 4)]          # at least 8, a multiple of 8
    assert codec.chunk_ranges(24, 12) == [(0, 8), (8, 8), (16, 8)]


# ---- corruption -------------------------------------------------------------------

def encoded_chunk(dtype: str = "bfloat16", codec_name: str = "bplane") -> tuple[bytes, ChunkMeta, int]:
    data = tensor_bytes(weight_like(dtype, 50_000))
    parts, meta = codec.encode_chunk(memoryview(data), dtype, codec_name)
    return b"".join(bytes(p) for p in parts), meta, len(data)


@pytest.mark.parametrize("dtype,codec_name", [("bfloat16", "bplane"), ("float64", "bplane"),
                                              ("float32", "zstd"), ("int32", "none")])
def test_corrupted_stored_bytes_raise(dtype: str, codec_name: str) -> None:
    stored, meta, n = encoded_chunk(dtype, codec_name)
    out = memoryview(bytearray(n))
    for pos in (0, len(stored) // 2, len(stored) - 1):
        bad = bytearray(stored)
        bad[pos] ^= 0x10
        with pytest.raises(ChecksumError, match="checksum"):
            codec.decode_chunk(bytes(bad), meta, dtype, out)
    with pytest.raises(ChecksumError, match="length"):
        codec.decode_chunk(stored[:-1], meta, dtype, out)
    with pytest.raises(ChecksumError, match="length"):
        codec.decode_chunk(stored, meta, dtype, memoryview(bytearray(n + 1)))
    wrong_digest = ChunkMeta(meta.codec, meta.raw_len, meta.stored_len, "0" * 16, meta.segments)
    with pytest.raises(ChecksumError, match="checksum"):
        codec.decode_chunk(stored, wrong_digest, dtype, out)


@pytest.mark.parametrize("dtype,codec_name", [("float32", "bplane"), ("bfloat16", "bplane"), ("int64", "zstd")])
def test_a_decoded_chunk_is_checked_against_its_raw_checksum(dtype: str, codec_name: str) -> None:
    """An encoded chunk carries the xxh3 of its raw bytes (a ``none`` chunk's stored bytes are its raw
    ones: none); decoding checks it, so a manifest whose stored bytes check out but whose raw
    checksum does not (a decoder fault, a crafted entry) is refused instead of loaded."""
    stored, meta, n = encoded_chunk(dtype, codec_name)
    assert meta.raw_checksum is not None and ChunkMeta.from_json(meta.to_json()) == meta
    out = memoryview(bytearray(n))
    codec.decode_chunk(stored, meta, dtype, out)
    assert codec.checksum(out) == meta.raw_checksum
    lied = ChunkMeta(**{**meta.__dict__, "raw_checksum": "0" * 16})
    with pytest.raises(ChecksumError, match="raw checksum"):
        codec.decode_chunk(stored, lied, dtype, out)
    raw_parts, raw_meta = codec.encode_chunk(out, dtype, "none")
    assert raw_meta.raw_checksum is None and raw_meta.content == meta.content   # same bytes, same content
    with pytest.raises(ValueError, match="only an encoded chunk"):
        ChunkMeta.from_json([*raw_meta.to_json(), meta.raw_checksum])


def forged(stored: bytes, meta: ChunkMeta, **changes) -> tuple[bytes, ChunkMeta]:
    """``stored`` with metadata ``meta`` altered by ``changes`` but carrying a matching checksum
    and stored length: a crafted manifest that lies about the bytes."""
    fields = {**meta.__dict__, **changes, "stored_len": len(stored), "checksum": codec.checksum(stored)}
    return stored, ChunkMeta(**fields)


def test_metadata_that_does_not_fit_the_bytes_raises() -> None:
    stored, meta, n = encoded_chunk("bfloat16", "bplane")
    out = memoryview(bytearray(n))
    cases = [
        forged(stored, meta, segments=[[len(stored), "r"]]),                         # one segment, not two
        forged(stored, meta, segments=[[meta.segments[0][0], "r"], [meta.segments[1][0], "r"]]),  # z read as raw
        forged(stored, meta, segments=[[meta.segments[0][0], "z"], [meta.segments[1][0], "z"]]),  # raw read as z
        forged(b"\x00" * len(stored), meta),                            # garbage frame
    ]
    for bad_stored, bad_meta in cases:
        with pytest.raises(ChecksumError):
            codec.decode_chunk(bad_stored, bad_meta, "bfloat16", out)
    with pytest.raises(ChecksumError, match="does not fit dtype"):
        codec.decode_chunk(stored, meta, "int16", out)                # bplane claimed for an integer
    with pytest.raises(ChecksumError, match="does not fit dtype"):
        codec.decode_chunk(stored, meta, "float32", out)              # 2 planes for a 4-byte float
    zs, zmeta, zn = encoded_chunk("float32", "zstd")
    big = zstandard.ZstdCompressor().compress(b"\x01" * (zn + 64))    # frame decoding to too many bytes
    with pytest.raises(ChecksumError):
        codec.decode_chunk(*forged(big, zmeta, segments=[[len(big), "z"]]), "float32",
                           memoryview(bytearray(zn)))
    raw = b"\x02" * 64
    with pytest.raises(ChecksumError, match="raw"):
        codec.decode_chunk(*forged(raw, zmeta, codec="none", raw_len=64, segments=[[64, "z"]]), "float32",
                           memoryview(bytearray(64)))
    with pytest.raises(ChecksumError, match="one segment"):
        codec.decode_chunk(*forged(raw, zmeta, codec="none", raw_len=64, segments=[[32, "r"], [32, "r"]]),
                           "float32", memoryview(bytearray(64)))


# ---- metadata -----------------------------------------------------------------------

def test_chunk_meta_json_round_trip() -> None:
    _, meta, _ = encoded_chunk()
    assert ChunkMeta.from_json(meta.to_json()) == meta
    assert ChunkMeta.from_json(["none", 0, 0, codec.checksum(b""), [[0, "r"]]]).raw_len == 0


@pytest.mark.parametrize("entry", [
    None, {}, "bplane", [], ["zstd", 1, 1, "ab"], ["zstd", 1, 1, "ab", [[1, "z"]], 0],
    ["lz4", 4, 4, "ab", [[4, "r"]]],                        # unknown codec
    ["zstd", 4, 4, 1234, [[4, "r"]]],                       # checksum not a string
    ["zstd", -1, 4, "ab", [[4, "r"]]],                      # negative length
    ["zstd", 4, -4, "ab", [[-4, "r"]]],
    ["zstd", 4.0, 4, "ab", [[4, "r"]]],                     # float length
    ["zstd", True, 1, "ab", [[1, "r"]]],                    # bool is not a length
    ["zstd", 4, 4, "ab", [[4, "x"]]],                       # unknown segment kind
    ["zstd", 4, 4, "ab", [[4]]],
    ["zstd", 4, 4, "ab", [(4, "r")]],                       # tuple, not a JSON list
    ["zstd", 4, 4, "ab", [[True, "r"]]],
    ["zstd", 4, 4, "ab", "[[4, 'r']]"],
    ["zstd", 4, 5, "ab", [[4, "r"]]],                       # segments do not add up
    ["bplane", 8, 8, "ab", [[4, "r"], [3, "z"]]],
])
def test_chunk_meta_rejects_malformed_entries(entry) -> None:
    with pytest.raises(ValueError):
        ChunkMeta.from_json(entry)


def test_checksum_is_xxh3_64_hex() -> None:
    assert codec.checksum(b"") == "2d06800538d394c2"
    assert len(codec.checksum(b"ckptd")) == 16
    assert codec.checksum(memoryview(b"abc")) == codec.checksum(b"abc")


def test_scratch_is_per_thread() -> None:
    grabbed: list[np.ndarray] = []
    both = threading.Barrier(2)

    def grab() -> None:
        grabbed.append(codec._scratch("probe", np.dtype(np.uint32), 1000))
        both.wait()                                   # both threads hold theirs at once

    threads = [threading.Thread(target=grab) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not np.shares_memory(grabbed[0], grabbed[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_bplane_round_trips_where_words_are_big_endian(monkeypatch, dtype: str) -> None:
    """The decoder copies each plane into its byte of every word; plane i is the word's value byte i,
    which lies at memory byte i only on a little-endian host. With the words' byte order big-endian (as
    numpy's native uints are on such a host, simulated here) 4- and 8-byte floats failed their checksum."""
    monkeypatch.setattr(codec, "_UINT", {2: np.dtype(">u2"), 4: np.dtype(">u4"), 8: np.dtype(">u8")})
    t = torch.randn(10_007).to(getattr(torch, dtype))
    raw = memoryview(t.view(torch.uint8).numpy().tobytes())
    parts, meta = codec.encode_chunk(raw, dtype, "bplane")
    out = bytearray(len(raw))
    codec.decode_chunk(b"".join(bytes(p) for p in parts), meta, dtype, memoryview(out))
    assert bytes(out) == bytes(raw)
