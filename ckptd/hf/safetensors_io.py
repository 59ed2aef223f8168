"""The safetensors file format, torch-free: header building, hostile-input parsing, dtype names.

A file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (an object: each
tensor name → ``{"dtype", "shape", "data_offsets": [begin, end]}``, plus an optional
``__metadata__`` of strings), then the data: each tensor's row-major little-endian bytes at
``8 + n + begin``. The header is padded with spaces to a multiple of 8 so the data starts
aligned. Parsing checks everything safetensors itself checks (size bounds, JSON, dtypes,
``shape × itemsize == end - begin``, offsets in bounds, contiguous, not overlapping and covering
the data exactly) before a byte of tensor data is trusted.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass

from ckptd.core import storage
from ckptd.core.errors import FormatError
from ckptd.core.schema import DTYPE_ITEMSIZE
from ckptd.core.sizes import sizable

MAX_HEADER_BYTES = 100_000_000       # what safetensors itself accepts
MAX_DIMS = 64

# ckptd dtype name (torch's) → safetensors dtype name.
TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0", "complex64": "C64",
}
FROM_ST = {v: k for k, v in TO_ST.items()}


@dataclass(frozen=True)
class StTensor:
    """One tensor of a safetensors file: ``dtype`` is ckptd's (torch's) name; ``begin``/``end``
    are absolute file offsets of its bytes."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def st_dtype(dtype: str) -> str:
    try:
        return TO_ST[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} has no safetensors equivalent") from None


def build_header(tensors: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[str, int]]]:
    """(header bytes incl. the 8-byte length, [(name, data offset)] in data order) for ``tensors``
    given as (name, ckptd dtype, shape). Data order is safetensors' own: larger item sizes first,
    then by name, so every tensor stays aligned."""
    order = sorted(tensors, key=lambda t: (-DTYPE_ITEMSIZE[t[1]], t[0]))
    obj: dict[str, object] = {}
    if metadata:
        obj["__metadata__"] = dict(metadata)
    pos = 0
    offsets = []
    for name, dtype, shape in order:
        n = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        obj[name] = {"dtype": st_dtype(dtype), "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets.append((name, pos))
        pos += n
    body = json.dumps(obj, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, offsets


def open_regular(path: str) -> int:
    """A read-only fd of a regular file, never through a symbolic link, never a FIFO or device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise FormatError(f"{path}: cannot open: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FormatError(f"{path}: not a regular file")
    return fd


def read_header(fd: int, path: str) -> tuple[list[StTensor], dict[str, str]]:
    """Parse and validate the header of the safetensors file open at ``fd`` (named ``path`` in
    errors). Returns its tensors in data order and its ``__metadata__``."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise FormatError(f"{path}: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", storage.read_at(fd, 0, 8))
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > size:
        raise FormatError(f"{path}: header length {n} runs past the end of the {size}-byte file (truncated?)")
    try:
        obj = json.loads(storage.read_at(fd, 8, n))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:     # (RecursionError: nested too deep)
        raise FormatError(f"{path}: header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: header must be a JSON object")
    meta = obj.pop("__metadata__", {})      # (absent; if present, a map: [] or "" are refused)
    if not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    data_start, data_len = 8 + n, size - 8 - n
    out = []
    for name, t in obj.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{where}: needs exactly dtype, shape and data_offsets")
        dtype = FROM_ST.get(t["dtype"]) if isinstance(t["dtype"], str) else None
        if dtype is None:
            raise FormatError(f"{where}: unsupported dtype {str(t['dtype'])[:40]!r}")
        shape, offs = t["shape"], t["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(x) is int and x >= 0 for x in shape)):
            raise FormatError(f"{where}: shape must be a list of at most {MAX_DIMS} non-negative ints")
        if not sizable(shape, DTYPE_ITEMSIZE[dtype]):
            raise FormatError(f"{where}: shape {str(shape)[:200]} is beyond any tensor (over 2**62 bytes)")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int and x >= 0 for x in offs)
                and offs[0] <= offs[1]):
            raise FormatError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end")
        if offs[1] > data_len:
            raise FormatError(f"{where}: data_offsets {offs} run past the end of the data ({data_len} bytes)")
        want = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        if offs[1] - offs[0] != want:
            raise FormatError(f"{where}: {offs[1] - offs[0]} bytes, but shape {shape} of {t['dtype']} needs {want}")
        out.append(StTensor(name, dtype, tuple(shape), data_start + offs[0], data_start + offs[1]))
    out.sort(key=lambda t: (t.begin, t.end))
    pos = data_start
    for t in out:
        if t.begin != pos:
            what = "overlaps the previous tensor" if t.begin < pos else f"leaves a gap of {t.begin - pos} bytes"
            raise FormatError(f"{path}: tensor {t.name!r} {what}")
        pos = t.end
    if pos != size:
        raise FormatError(f"{path}: the tensors cover {pos - data_start} of the {data_len} data bytes")
    return out, meta
