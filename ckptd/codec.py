"""Chunk codecs: chunking, float-aware byte planes + zstd, checksums.

Each chunk of a tensor is encoded independently so one tensor (or one chunk) can be
read without touching the rest. A chunk's stored bytes are one or more *segments*
laid end to end; its metadata (see ``ChunkMeta``) names the codec, the raw length,
the stored length, an xxh3-64 checksum of the stored bytes and each segment's
length and whether it is zstd-compressed.

Codecs:
- ``none``: the raw bytes, one segment.
- ``zstd``: one zstd frame.
- ``bplane``: for float dtypes. Each element is rotated left by one bit so the sign
  leaves the exponent and the exponent fills the top byte, then bytes are grouped by
  position into planes (ZipNN's observation: only exponent bits compress). The top
  plane goes through zstd with match finding tuned for it; lower planes are stored
  raw unless a sample shows they shrink.
Any segment that does not shrink below ``RAW_IF_ABOVE`` of its size is stored raw.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
import zstandard

CODECS = ("none", "zstd", "bplane")
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
RAW_IF_ABOVE = 0.95
_SAMPLE_BYTES = 64 * 1024

# dtype name (torch's, without "torch.") → item size, for dtypes whose planes are worth splitting.
FLOAT_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}

_local = threading.local()


def choose_codec(dtype: str, setting: str) -> str:
    """Per-tensor codec: ``bplane`` falls back to ``zstd`` for dtypes it cannot split."""
    if setting not in CODECS:
        raise ValueError(f"unknown codec {setting!r}; choose one of {', '.join(CODECS)}")
    if setting == "bplane" and dtype not in FLOAT_ITEMSIZE:
        return "zstd"
    return setting


def checksum(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(data)


@dataclass
class ChunkMeta:
    codec: str
    raw_len: int
    stored_len: int
    checksum: str
    segments: list[list[Any]]  # [[stored_len, "z" | "r"], ...]

    def to_json(self) -> list[Any]:
        return [self.codec, self.raw_len, self.stored_len, self.checksum, self.segments]

    @classmethod
    def from_json(cls, obj: Any) -> "ChunkMeta":
        if not (isinstance(obj, list) and len(obj) == 5):
            raise ValueError("chunk entry must be [codec, raw_len, stored_len, checksum, segments]")
        codec, raw_len, stored_len, digest, segments = obj
        if codec not in CODECS or not isinstance(digest, str):
            raise ValueError(f"bad chunk codec or checksum: {codec!r}")
        if not all(type(v) is int and v >= 0 for v in (raw_len, stored_len)):
            raise ValueError("chunk lengths must be non-negative integers")
        if not isinstance(segments, list) or not all(
                isinstance(s, list) and len(s) == 2 and type(s[0]) is int and s[0] >= 0 and s[1] in ("z", "r")
                for s in segments):
            raise ValueError("bad chunk segments")
        if sum(s[0] for s in segments) != stored_len:
            raise ValueError("chunk segments do not add up to its stored length")
        return cls(codec, raw_len, stored_len, digest, segments)


def _compressor(level: int, tuned: bool) -> zstandard.ZstdCompressor:
    """One compressor per thread and setting: zstd objects are not thread-safe."""
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, tuned)
    comp = cache.get(key)
    if comp is None:
        if tuned:
            # Exponent planes are low-entropy symbols with short repeats: restricted match
            # finding is both faster and no worse there (ANCHORS.md).
            params = zstandard.ZstdCompressionParameters.from_level(
                level, min_match=7, hash_log=6 + max(0, level - 1), search_log=1, window_log=17)
            comp = zstandard.ZstdCompressor(compression_params=params)
        else:
            comp = zstandard.ZstdCompressor(level=level)
        cache[key] = comp
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _zstd_or_raw(data: Any, level: int, tuned: bool, try_sample: bool = False) -> tuple[Any, str]:
    n = len(data)
    if n == 0:
        return b"", "r"
    comp = _compressor(level, tuned)
    if try_sample and n > 2 * _SAMPLE_BYTES:
        sample = comp.compress(data[:_SAMPLE_BYTES])
        if len(sample) > RAW_IF_ABOVE * _SAMPLE_BYTES:
            return data, "r"
    out = comp.compress(data)
    if len(out) > RAW_IF_ABOVE * n:
        return data, "r"
    return out, "z"


def _to_planes(raw: memoryview, itemsize: int) -> np.ndarray:
    words = np.frombuffer(raw, dtype=_UINT[itemsize])
    bits = itemsize * 8
    rotated = (words << np.array(1, words.dtype)) | (words >> np.array(bits - 1, words.dtype))
    return np.ascontiguousarray(rotated.view(np.uint8).reshape(-1, itemsize).T)


def _from_planes(planes: np.ndarray, itemsize: int, out: memoryview) -> None:
    words = np.ascontiguousarray(planes.T).view(_UINT[itemsize]).reshape(-1)
    bits = itemsize * 8
    target = np.frombuffer(out, dtype=_UINT[itemsize])
    np.bitwise_or(words >> np.array(1, words.dtype), words << np.array(bits - 1, words.dtype), out=target)


def encode_chunk(raw: memoryview, dtype: str, codec: str, level: int = 1) -> tuple[list[Any], ChunkMeta]:
    """Encode one chunk; returns the stored parts (write them in order) and their metadata."""
    raw = memoryview(raw).cast("B")
    n = len(raw)
    itemsize = FLOAT_ITEMSIZE.get(dtype, 1)
    if codec == "bplane" and (dtype not in FLOAT_ITEMSIZE or n % itemsize):
        codec = "zstd"
    if codec == "none" or n == 0:
        parts, segments = [raw], [[n, "r"]]
        codec = "none"
    elif codec == "zstd":
        out, kind = _zstd_or_raw(raw, level, tuned=False)
        parts, segments = [out], [[len(out), kind]]
    elif codec == "bplane":
        planes = _to_planes(raw, itemsize)
        parts, segments = [], []
        for i in range(itemsize):
            top = i == itemsize - 1
            out, kind = _zstd_or_raw(planes[i].data, level, tuned=top, try_sample=not top)
            parts.append(out)
            segments.append([len(out), kind])
    else:
        raise ValueError(f"unknown codec {codec!r}")
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    stored = sum(s[0] for s in segments)
    return parts, ChunkMeta(codec, n, stored, h.hexdigest(), segments)


class ChecksumError(Exception):
    """Stored bytes whose checksum does not match the manifest."""


def decode_chunk(stored: Any, meta: ChunkMeta, dtype: str, out: memoryview) -> None:
    """Verify and decode one chunk into ``out`` (exactly ``meta.raw_len`` bytes)."""
    out = memoryview(out).cast("B")
    if len(out) != meta.raw_len or len(stored) != meta.stored_len:
        raise ChecksumError(f"chunk length mismatch (stored {len(stored)}, expected {meta.stored_len})")
    if checksum(stored) != meta.checksum:
        raise ChecksumError("chunk checksum mismatch")
    stored = memoryview(stored)
    if meta.codec == "bplane":
        itemsize = FLOAT_ITEMSIZE[dtype]
        plane_len = meta.raw_len // itemsize
        planes = np.empty((itemsize, plane_len), dtype=np.uint8)
        pos = 0
        for i, (length, kind) in enumerate(meta.segments):
            _decode_segment(stored[pos: pos + length], kind, memoryview(planes[i]))
            pos += length
        _from_planes(planes, itemsize, out)
        return
    _decode_segment(stored, meta.segments[0][1] if meta.segments else "r", out)


def _decode_segment(seg: memoryview, kind: str, out: memoryview) -> None:
    if kind == "r":
        if len(seg) != len(out):
            raise ChecksumError("raw segment length mismatch")
        out[:] = seg
        return
    try:
        data = _decompressor().decompress(seg, max_output_size=len(out))
    except zstandard.ZstdError as e:
        raise ChecksumError(f"zstd frame does not decode: {e}") from None
    if len(data) != len(out):
        raise ChecksumError("decoded segment length mismatch")
    out[:] = data


def chunk_ranges(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk of a tensor; an empty tensor has one empty chunk."""
    chunk_bytes = max(8, chunk_bytes - chunk_bytes % 8)
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(chunk_bytes, nbytes - s)) for s in range(0, nbytes, chunk_bytes)]
