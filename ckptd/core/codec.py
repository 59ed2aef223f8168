"""Chunk codecs: chunking, float-aware byte planes + zstd, checksums.

Each chunk of a tensor is encoded independently so one tensor (or one chunk) can be
read without touching the rest. A chunk's stored bytes are one or more *segments*
laid end to end; its metadata (see ``ChunkMeta``) names the codec, the raw length,
the stored length, an xxh3-64 checksum of the stored bytes and each segment's
length and whether it is a zstd frame (``"z"``) or raw bytes (``"r"``); an encoded
chunk also carries the xxh3-64 of its raw bytes, so the decoded bytes are checked too,
and two copies of a tensor are known to be identical whichever codec each chunk got.

Codecs:
- ``none``: the raw bytes, one segment.
- ``zstd``: one zstd frame (or the raw bytes, when they do not shrink).
- ``bplane``: for float dtypes (``FLOAT_ITEMSIZE``). Each little-endian element of
  ``k`` bytes is rotated left by one bit, so the sign leaves the exponent and the
  exponent fills the top byte; then plane ``i`` (``i = 0 .. k-1``) holds byte ``i`` of
  every rotated element, and the chunk stores plane 0 first, the top (exponent)
  plane last: exactly ``k`` segments, each ``raw_len / k`` bytes once decoded.
  ZipNN's observation: only exponent bits compress, and they compress well once
  grouped. Every plane goes through zstd with match finding restricted for these
  low-entropy, match-poor symbols, unless a sample shows it would not
  shrink.
Any segment that does not shrink below ``RAW_IF_ABOVE`` of its size is stored raw.

Speed: the byte planes are split with whole-array shifts and narrowing casts (contiguous,
vectorized numpy loops) instead of a strided (n, k) → (k, n) transpose; decoding copies each
plane into its byte of the caller's buffer (a strided copy per plane) and rotates the words
there; the temporaries are per-thread scratch arrays reused across chunks.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
import zstandard

from .errors import ChecksumError

CODECS = ("none", "zstd", "bplane")
# A memory-level step's chunk (FORMAT.md): raw bytes at their offset in a daemon's memfd, never in a file.
HELD_CODEC = "held"
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
RAW_IF_ABOVE = 0.95
# A segment larger than twice this is first judged on a sample of this many bytes, taken
# in _SAMPLE_PIECES pieces spread over it, so incompressible planes cost almost nothing.
_SAMPLE_BYTES = 64 * 1024
_SAMPLE_PIECES = 4

# dtype name (torch's, without "torch.") → item size, for dtypes whose planes are worth splitting.
FLOAT_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
_UINT: dict[int, np.dtype[Any]] = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}

_local = threading.local()
_caches: list[dict[Any, Any]] = []     # every thread's scratch and compressors, for drop_thread_caches
_caches_lock = threading.Lock()


def _thread_cache(name: str) -> dict[Any, Any]:
    cache: dict[Any, Any] | None = _local.__dict__.get(name)
    if cache is None:
        cache = {}
        setattr(_local, name, cache)
        with _caches_lock:
            _caches.append(cache)
    return cache


def drop_thread_caches() -> None:
    """Let every thread's scratch arrays and zstd contexts go (an idle daemon: tens of MiB it would
    otherwise keep between saves); the next chunk a thread encodes makes its own again."""
    with _caches_lock:
        for cache in _caches:
            cache.clear()


def choose_codec(dtype: str, setting: str) -> str:
    """Per-tensor codec: ``bplane`` falls back to ``zstd`` for dtypes it cannot split."""
    if setting not in CODECS:
        raise ValueError(f"unknown codec {setting!r}; choose one of {', '.join(CODECS)}")
    if setting == "bplane" and dtype not in FLOAT_ITEMSIZE:
        return "zstd"
    return setting


def checksum(data: Any) -> str:
    """xxh3-64 of ``data``, as 16 hex digits: every checksum ckptd writes or checks (a stored
    chunk's ``ChunkMeta.checksum``, a held shard's raw chunks) is this one."""
    return xxhash.xxh3_64_hexdigest(data)


def checksum_stream() -> Any:
    """``checksum`` of bytes fed piece by piece: ``update(piece)``, then ``hexdigest()``."""
    return xxhash.xxh3_64()


@dataclass
class ChunkMeta:
    codec: str
    raw_len: int
    stored_len: int
    checksum: str
    segments: list[list[Any]]  # [[stored_len, "z" | "r"], ...]
    # xxh3-64 of the raw bytes, for an encoded chunk (codec zstd or bplane; chunks written before
    # it existed have none); a ``none`` or ``held`` chunk's raw bytes are its stored ones.
    raw_checksum: str | None = None

    def to_json(self) -> list[Any]:
        out = [self.codec, self.raw_len, self.stored_len, self.checksum, self.segments]
        return out if self.raw_checksum is None else [*out, self.raw_checksum]

    @property
    def content(self) -> tuple[int, str]:
        """What identifies the raw bytes, whatever the codec: equal content, equal value (a chunk
        encoded before raw checksums were written is told by its codec and stored checksum)."""
        if self.raw_checksum is not None:
            return self.raw_len, self.raw_checksum
        if self.codec in ("none", HELD_CODEC):
            return self.raw_len, self.checksum
        return self.raw_len, f"{self.codec}:{self.checksum}"

    @classmethod
    def from_json(cls, obj: Any) -> ChunkMeta:
        """Parse a manifest's chunk entry; raises ValueError for anything malformed."""
        if not (isinstance(obj, list) and len(obj) in (5, 6)):
            raise ValueError("chunk entry must be [codec, raw_len, stored_len, checksum, segments, raw checksum?]")
        codec, raw_len, stored_len, digest, segments = obj[:5]
        raw_digest = obj[5] if len(obj) == 6 else None
        if (codec not in CODECS and codec != HELD_CODEC) or not isinstance(digest, str):
            raise ValueError(f"bad chunk codec or checksum: {codec!r}")
        if raw_digest is not None and (codec in ("none", HELD_CODEC) or not isinstance(raw_digest, str)):
            raise ValueError(f"a {codec!r} chunk's raw checksum must be a string, and only an encoded chunk has one")
        if not (type(raw_len) is int and raw_len >= 0 and type(stored_len) is int and stored_len >= 0):
            raise ValueError("chunk lengths must be non-negative integers")
        if not isinstance(segments, list):
            raise ValueError("bad chunk segments")
        total = 0           # (a loop, not generators: a restore parses one entry per chunk, 8,192+ of them)
        for s in segments:
            if not (isinstance(s, list) and len(s) == 2 and type(s[0]) is int and s[0] >= 0 and s[1] in ("z", "r")):
                raise ValueError("bad chunk segments")
            total += s[0]
        if total != stored_len:
            raise ValueError("chunk segments do not add up to its stored length")
        return cls(codec, raw_len, stored_len, digest, segments, raw_digest)


# ---- per-thread state ---------------------------------------------------------

def _compressor(level: int, tuned: bool) -> zstandard.ZstdCompressor:
    """One compressor per thread and setting: zstd objects are not thread-safe."""
    cache = _thread_cache("compressors")
    key = (level, tuned)
    comp: zstandard.ZstdCompressor | None = cache.get(key)
    if comp is None:
        if tuned:
            # Byte planes of floats are low-entropy symbols with few real repeats: match
            # finding restricted this way is ~2.5× faster than plain level 1 on them and
            # compresses better (fewer useless short matches), as measured when the codec was
            # tuned; benchmarks/codec_bench.py times the codec as a whole.
            params = zstandard.ZstdCompressionParameters.from_level(
                level, min_match=7, hash_log=6 + max(0, level - 1), search_log=1, window_log=17)
            comp = zstandard.ZstdCompressor(compression_params=params)
        else:
            comp = zstandard.ZstdCompressor(level=level)
        cache[key] = comp
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def _scratch(name: str, dtype: np.dtype[Any], n: int) -> np.ndarray:
    """A per-thread array of ``n`` items, reused across chunks (no allocation, no page faults)."""
    cache = _thread_cache("scratch")
    key = (name, dtype)
    buf: np.ndarray | None = cache.get(key)
    if buf is None or len(buf) < n:
        buf = cache[key] = np.empty(max(n, 1), dtype)
    return buf[:n]


# ---- segments -------------------------------------------------------------------

def _sample(data: memoryview) -> bytes:
    n = len(data)
    piece = _SAMPLE_BYTES // _SAMPLE_PIECES
    step = (n - piece) // (_SAMPLE_PIECES - 1)
    return b"".join(data[i * step: i * step + piece] for i in range(_SAMPLE_PIECES))


def _zstd_or_raw(data: memoryview, level: int, tuned: bool) -> tuple[Any, str]:
    """One segment: a zstd frame of ``data``, or ``data`` itself when that would not shrink it."""
    n = len(data)
    if n == 0:
        return b"", "r"
    comp = _compressor(level, tuned)
    if n > 2 * _SAMPLE_BYTES and len(comp.compress(_sample(data))) > RAW_IF_ABOVE * _SAMPLE_BYTES:
        return data, "r"
    out = comp.compress(data)
    if len(out) > RAW_IF_ABOVE * n:
        return data, "r"
    return out, "z"


def _decode_segment(seg: memoryview, kind: str, size: int) -> Any:
    """The ``size`` decoded bytes of one segment (a view of ``seg`` when it is raw)."""
    if kind == "r":
        if len(seg) != size:
            raise ChecksumError(f"raw segment holds {len(seg)} bytes, expected {size}")
        return seg
    try:
        data = _decompressor().decompress(seg, max_output_size=size)
    except zstandard.ZstdError as e:
        raise ChecksumError(f"zstd frame does not decode: {e}") from None
    if len(data) != size:
        raise ChecksumError(f"zstd frame decodes to {len(data)} bytes, expected {size}")
    return data


# ---- byte planes ------------------------------------------------------------------

def _split_planes(raw: memoryview, itemsize: int) -> np.ndarray:
    """(itemsize, n) uint8 planes of the rotated elements; a fresh array (its rows are returned as parts)."""
    ut = _UINT[itemsize]
    words = np.frombuffer(raw, dtype=ut)
    n = len(words)
    rot = _scratch("a", ut, n)
    tmp = _scratch("b", ut, n)
    np.left_shift(words, ut.type(1), out=rot)
    np.right_shift(words, ut.type(itemsize * 8 - 1), out=tmp)
    np.bitwise_or(rot, tmp, out=rot)
    planes = np.empty((itemsize, n), dtype=np.uint8)
    np.copyto(planes[0], rot, casting="unsafe")          # narrowing cast keeps the low byte
    for i in range(1, itemsize):
        np.right_shift(rot, ut.type(8 * i), out=planes[i], casting="unsafe")
    return planes


def _merge_planes(planes: list[Any], itemsize: int, out: memoryview) -> None:
    """Inverse of ``_split_planes``: the words assembled in ``out``, then rotated right by one bit in place.
    Two planes are widened and shifted into the words; four or eight are each copied into their byte of
    every word (a strided byte copy, one pass per plane): each the faster way for its item size (the strided
    copy: 1.3x the widening way at four, 1.7x at eight; measured alternating on 4 MiB chunks)."""
    ut = _UINT[itemsize]
    words = np.frombuffer(out, dtype=ut)
    n = len(words)
    low = _scratch("a", ut, n)
    if itemsize == 2:
        np.copyto(words, np.frombuffer(planes[0], dtype=np.uint8))
        np.copyto(low, np.frombuffer(planes[1], dtype=np.uint8))
        np.left_shift(low, ut.type(8), out=low)
        np.bitwise_or(words, low, out=words)
    else:
        as_bytes = words.view(np.uint8).reshape(n, itemsize)
        big = ut.byteorder == ">" or (ut.byteorder == "=" and sys.byteorder == "big")
        for i, plane in enumerate(planes):          # plane i: the words' value byte i, wherever it lies in memory
            as_bytes[:, itemsize - 1 - i if big else i] = np.frombuffer(plane, dtype=np.uint8)
    np.right_shift(words, ut.type(1), out=low)
    np.left_shift(words, ut.type(itemsize * 8 - 1), out=words)
    np.bitwise_or(words, low, out=words)


# ---- chunks -------------------------------------------------------------------------

def encode_chunk(raw: memoryview, dtype: str, codec: str, level: int = 1) -> tuple[list[Any], ChunkMeta]:
    """Encode one chunk; returns the stored parts (write them in order) and their metadata.

    The parts may be views of ``raw`` (raw segments): write them before reusing ``raw``.
    """
    raw = memoryview(raw).cast("B")
    n = len(raw)
    itemsize = FLOAT_ITEMSIZE.get(dtype, 1)
    if codec == "bplane" and (dtype not in FLOAT_ITEMSIZE or n % itemsize):
        codec = "zstd"
    parts: list[Any]
    segments: list[list[Any]]
    if codec == "none" or n == 0:
        parts, segments = [raw], [[n, "r"]]
        codec = "none"
    elif codec == "zstd":
        out, kind = _zstd_or_raw(raw, level, tuned=False)
        parts, segments = [out], [[len(out), kind]]
    elif codec == "bplane":
        parts, segments = [], []
        for plane in _split_planes(raw, itemsize):
            out, kind = _zstd_or_raw(plane.data, level, tuned=True)
            parts.append(out)
            segments.append([len(out), kind])
    else:
        raise ValueError(f"unknown codec {codec!r}")
    h = checksum_stream()
    for p in parts:
        h.update(p)
    digest = h.hexdigest()
    stored = sum(s[0] for s in segments)
    raw_digest = None if codec == "none" else digest if len(parts) == 1 and parts[0] is raw else checksum(raw)
    return parts, ChunkMeta(codec, n, stored, digest, segments, raw_digest)


def decode_chunk(stored: Any, meta: ChunkMeta, dtype: str, out: memoryview) -> None:
    """Verify and decode one chunk into ``out`` (exactly ``meta.raw_len`` bytes).

    Raises ChecksumError when the stored bytes do not match the checksum, do not decode,
    or do not fit the metadata (a corrupt or crafted manifest).
    """
    out = memoryview(out).cast("B")
    if len(out) != meta.raw_len or len(stored) != meta.stored_len:
        raise ChecksumError(f"chunk length mismatch (stored {len(stored)}, expected {meta.stored_len})")
    if checksum(stored) != meta.checksum:
        raise ChecksumError("chunk checksum mismatch")
    stored = memoryview(stored).cast("B")
    if meta.codec == "bplane":
        itemsize = FLOAT_ITEMSIZE.get(dtype)
        if itemsize is None or meta.raw_len % itemsize or len(meta.segments) != itemsize:
            raise ChecksumError(f"a bplane chunk of {meta.raw_len} bytes in {len(meta.segments)} segments "
                                f"does not fit dtype {dtype!r}")
        plane_len = meta.raw_len // itemsize
        planes, pos = [], 0
        for length, kind in meta.segments:
            planes.append(_decode_segment(stored[pos: pos + length], kind, plane_len))
            pos += length
        _merge_planes(planes, itemsize, out)
    else:
        if len(meta.segments) != 1:
            raise ChecksumError(f"a {meta.codec} chunk must have one segment, not {len(meta.segments)}")
        kind = meta.segments[0][1]
        if meta.codec == "none" and kind != "r":
            raise ChecksumError("a 'none' chunk must be stored raw")
        out[:] = _decode_segment(stored, kind, meta.raw_len)
    if meta.raw_checksum is not None and checksum(out) != meta.raw_checksum:
        raise ChecksumError("decoded chunk does not match its raw checksum")


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """``len(chunk_ranges(nbytes, chunk_bytes))``, without the list."""
    chunk_bytes = max(8, chunk_bytes - chunk_bytes % 8)
    return max(1, -(-nbytes // chunk_bytes))


def chunk_ranges(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk of a tensor; an empty tensor has one empty chunk."""
    chunk_bytes = max(8, chunk_bytes - chunk_bytes % 8)
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(chunk_bytes, nbytes - s)) for s in range(0, nbytes, chunk_bytes)]


# zstd's best ratio is an RLE block: 3 bytes of header for 128 KiB (43,690:1); no chunk decodes to more
# than this many times its stored bytes, so a manifest cannot make a reader allocate terabytes for 24 bytes.
MAX_EXPANSION, MAX_EXPANSION_SLACK = 1 << 16, 1 << 17


def max_raw(stored_len: int) -> int:
    """The most raw bytes a chunk of ``stored_len`` stored bytes can decode to, whatever its codec."""
    return MAX_EXPANSION * stored_len + MAX_EXPANSION_SLACK
