"""The on-disk format: layout, manifest and index schemas, the state tree, readers.

Documented in FORMAT.md; this module is its one implementation. Everything read from
disk is validated here before it is trusted: names, sizes, offsets, digests.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from . import storage
from .codec import FLOAT_ITEMSIZE, ChecksumError, ChunkMeta, checksum, decode_chunk
from .protocol import MAX_TREE_DEPTH, check_tree_depth, validate_job, validate_tensor_name

FORMAT_VERSION = 1
INDEX_NAME = "index.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_RANKS = 1 << 20

_STEP_RE = re.compile(r"^step-([0-9]{12})\Z")   # not \d (any Unicode digit) nor $ (allows "\n")

# Every torch dtype ckptd stores, by the name torch prints after "torch.", with its item size.
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


class FormatError(ValueError):
    """A step directory, index or manifest that is malformed, crafted or corrupt."""


# ---- names -----------------------------------------------------------------

def step_dir_name(step: int) -> str:
    if type(step) is not int or not 0 <= step < 10**12:
        raise ValueError(f"step must be an integer in [0, 10**12), got {step!r}")
    return f"step-{step:012d}"


def parse_step_dir_name(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def rank_data_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def rank_manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def job_dir(root: str, job: str) -> str:
    return os.path.join(root, validate_job(job))


def step_dir(root: str, job: str, step: int) -> str:
    return os.path.join(job_dir(root, job), step_dir_name(step))


def digest_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()


# ---- the state tree ----------------------------------------------------------
# Non-tensor state is a JSON tree in which every container is tagged so types survive:
# {"d": [[key, value], ...]} dict (keys str or int), {"l": [...]} list, {"t": [...]} tuple,
# {"T": name} a tensor stored in the data file; bare JSON scalars are leaves.

_SCALARS = (str, int, float, bool, type(None))


def encode_tree(obj: Any, on_tensor: Callable[[str, Any], str], on_other: Callable[[str, Any], Any],
                is_tensor: Callable[[Any], bool], path: str = "") -> Any:
    """Encode ``obj``; tensors go to ``on_tensor(path, t)`` (returns the stored name), any other
    non-JSON object to ``on_other(path, obj)`` which returns a replacement to encode or raises."""
    if is_tensor(obj):
        return {"T": on_tensor(path, obj)}
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"cannot store dict key {k!r} of type {type(k).__name__} at "
                                f"{path or '<root>'}: keys must be str or int")
            items.append([k, encode_tree(v, on_tensor, on_other, is_tensor, _join(path, k))])
        return {"d": items}
    if isinstance(obj, (list, tuple)):
        tag = "t" if isinstance(obj, tuple) else "l"
        return {tag: [encode_tree(v, on_tensor, on_other, is_tensor, _join(path, i)) for i, v in enumerate(obj)]}
    return encode_tree(on_other(path, obj), on_tensor, on_other, is_tensor, path)


def decode_tree(node: Any, tensor: Callable[[str], Any]) -> Any:
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (tag, value), = node.items()
        if tag == "T" and isinstance(value, str):
            return tensor(value)
        if tag == "d" and isinstance(value, list):
            out = {}
            for item in value:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))):
                    raise FormatError("malformed dict entry in state tree")
                out[item[0]] = decode_tree(item[1], tensor)
            return out
        if tag in ("l", "t") and isinstance(value, list):
            items = [decode_tree(v, tensor) for v in value]
            return tuple(items) if tag == "t" else items
    raise FormatError(f"malformed state tree node: {str(node)[:80]}")


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


# ---- schemas -----------------------------------------------------------------

@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    offset: int          # file offset of the first chunk; chunks follow back to back
    chunks: list[ChunkMeta]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_len for c in self.chunks)

    def chunk_spans(self) -> Iterator[tuple[int, int, ChunkMeta]]:
        """(file offset, raw offset within the tensor, meta) of each chunk, in order."""
        file_pos, raw_pos = self.offset, 0
        for meta in self.chunks:
            yield file_pos, raw_pos, meta
            file_pos += meta.stored_len
            raw_pos += meta.raw_len

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape, "offset": self.offset,
                "chunks": [c.to_json() for c in self.chunks]}


@dataclass
class Manifest:
    job: str
    step: int
    rank: int
    world_size: int
    tensors: list[TensorEntry]
    tree: Any
    raw_bytes: int
    stored_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "kind": "ckptd.rank-manifest", "job": self.job,
                "step": self.step, "rank": self.rank, "world_size": self.world_size,
                "data_file": rank_data_name(self.rank), "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes,
                "tensors": [t.to_json() for t in self.tensors], "tree": self.tree}

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise FormatError(what)


def _is_uint(v: Any) -> bool:
    return type(v) is int and v >= 0


def validate_shape(dtype: Any, shape: Any) -> None:
    _require(isinstance(dtype, str) and dtype in DTYPE_ITEMSIZE, f"unknown dtype {dtype!r}")
    _require(isinstance(shape, list) and len(shape) <= 64 and all(_is_uint(d) for d in shape),
             f"bad shape {shape!r}")


def _load_json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as e:
        raise FormatError(f"{what} is not JSON: {e}") from None
    except RecursionError:
        raise FormatError(f"{what} nests too deeply to parse") from None


def _read_small(path: str, limit: int, what: str) -> bytes:
    """An index or manifest: a regular file (never a link, FIFO or directory) of at most ``limit`` bytes."""
    try:
        return storage.read_limited(path, limit)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise FormatError(f"{path}: cannot read {what}: {reason}") from None


def _check_chunks(entry: TensorEntry) -> None:
    """Chunk metadata consistent with the codec and dtype, so decoding cannot trip over it."""
    for c in entry.chunks:
        _require(c.stored_len <= c.raw_len, f"tensor {entry.name!r}: a chunk stores more bytes than it holds")
        if c.codec == "bplane":
            itemsize = FLOAT_ITEMSIZE.get(entry.dtype)
            _require(itemsize is not None and c.raw_len % itemsize == 0 and len(c.segments) == itemsize,
                     f"tensor {entry.name!r}: bplane chunk does not fit dtype {entry.dtype}")
            _require(all(n == c.raw_len // itemsize for n, kind in c.segments if kind == "r"),
                     f"tensor {entry.name!r}: bplane raw plane of the wrong length")
        else:
            _require(len(c.segments) == 1, f"tensor {entry.name!r}: {c.codec} chunk must have one segment")
            _require(c.codec != "none" or (c.segments[0][1] == "r" and c.stored_len == c.raw_len),
                     f"tensor {entry.name!r}: uncompressed chunk with compressed segment or wrong length")


def parse_manifest(data: bytes, *, job: str, step: int, rank: int) -> Manifest:
    obj = _load_json(data, "manifest")
    _require(isinstance(obj, dict), "manifest is not an object")
    _require(obj.get("format_version") == FORMAT_VERSION,
             f"unsupported manifest format_version {obj.get('format_version')!r} (this build reads {FORMAT_VERSION})")
    _require(obj.get("kind") == "ckptd.rank-manifest", "not a rank manifest")
    _require(obj.get("job") == job and obj.get("step") == step and obj.get("rank") == rank,
             f"manifest names job/step/rank {obj.get('job')!r}/{obj.get('step')!r}/{obj.get('rank')!r}, "
             f"expected {job!r}/{step}/{rank}")
    ws = obj.get("world_size")
    _require(type(ws) is int and 0 < ws <= MAX_RANKS and rank < ws, "bad world_size")
    # Informational only (readers derive the name), but a manifest naming another file is crafted.
    _require(obj.get("data_file") == rank_data_name(rank),
             f"manifest data_file {str(obj.get('data_file'))[:80]!r} is not {rank_data_name(rank)!r}")
    raw_list = obj.get("tensors")
    _require(isinstance(raw_list, list), "manifest has no tensor list")
    tensors, seen = [], set()
    for t in raw_list:
        _require(isinstance(t, dict), "tensor entry is not an object")
        try:
            name = validate_tensor_name(t.get("name"))
            if not isinstance(t.get("chunks"), list):
                raise ValueError("chunks must be a list")
            chunks = [ChunkMeta.from_json(c) for c in t["chunks"]]
        except ValueError as e:
            raise FormatError(f"tensor {t.get('name')!r}: {e}") from None
        _require(name not in seen, f"duplicate tensor {name!r}")
        seen.add(name)
        validate_shape(t.get("dtype"), t.get("shape"))
        _require(_is_uint(t.get("offset")), f"tensor {name!r}: bad offset")
        entry = TensorEntry(name, t["dtype"], t["shape"], t["offset"], chunks)
        _require(sum(c.raw_len for c in chunks) == entry.nbytes,
                 f"tensor {name!r}: chunks hold {sum(c.raw_len for c in chunks)} bytes, shape needs {entry.nbytes}")
        _check_chunks(entry)
        tensors.append(entry)
    try:
        check_tree_depth(obj.get("tree"), MAX_TREE_DEPTH)
    except ValueError as e:
        raise FormatError(f"manifest state tree: {e}") from None
    return Manifest(job, step, rank, ws, tensors, obj.get("tree"),
                    sum(t.nbytes for t in tensors), sum(t.stored_bytes for t in tensors))


def make_index(job: str, step: int, world_size: int, ranks: list[dict[str, Any]], created: float) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "kind": "ckptd.index", "job": job, "step": step,
            "world_size": world_size, "created_unix": created, "ranks": ranks}


def parse_index(data: bytes, *, job: str, step: int) -> dict[str, Any]:
    obj = _load_json(data, "index")
    _require(isinstance(obj, dict) and obj.get("kind") == "ckptd.index", "not a ckptd index")
    _require(obj.get("format_version") == FORMAT_VERSION,
             f"unsupported index format_version {obj.get('format_version')!r} (this build reads {FORMAT_VERSION})")
    _require(obj.get("job") == job and obj.get("step") == step,
             f"index names job/step {obj.get('job')!r}/{obj.get('step')!r}, expected {job!r}/{step}")
    ws = obj.get("world_size")
    _require(type(ws) is int and 0 < ws <= MAX_RANKS, "bad world_size in index")
    ranks = obj.get("ranks")
    _require(isinstance(ranks, list) and len(ranks) == ws, "index must list every rank exactly once")
    for i, r in enumerate(ranks):
        _require(isinstance(r, dict) and type(r.get("rank")) is int and r["rank"] == i
                 and isinstance(r.get("manifest_digest"), str)
                 and _is_uint(r.get("raw_bytes")) and _is_uint(r.get("stored_bytes")),
                 f"bad index entry for rank {i}")
    return obj


# ---- readers -----------------------------------------------------------------

@dataclass
class StepInfo:
    step: int
    path: str
    committed: bool


def list_steps(job_path: str) -> list[StepInfo]:
    """Every step directory of a job, oldest first; ``committed`` means index.json is present."""
    try:
        names = os.listdir(job_path)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        step = parse_step_dir_name(name)
        path = os.path.join(job_path, name)
        if step is None or os.path.islink(path) or not os.path.isdir(path):
            continue
        out.append(StepInfo(step, path, os.path.isfile(os.path.join(path, INDEX_NAME))))
    return sorted(out, key=lambda s: s.step)


def latest_committed(job_path: str) -> StepInfo | None:
    committed = [s for s in list_steps(job_path) if s.committed]
    return committed[-1] if committed else None


def split_step_path(step_path: str) -> tuple[str, str, int]:
    """(root, job, step) of ``<root>/<job>/step-N``; raises FormatError for anything else."""
    step_path = os.path.abspath(step_path)
    job_path, name = os.path.split(step_path)
    root, job = os.path.split(job_path)
    step = parse_step_dir_name(name)
    if step is None:
        raise FormatError(f"{step_path}: not a step directory (expected .../<job>/step-<12 digits>)")
    try:
        validate_job(job)
    except ValueError as e:
        raise FormatError(str(e)) from None
    return root, job, step


class StepReader:
    """Reads one committed step: its index, any rank's manifest, tensors chunk by chunk."""

    def __init__(self, step_path: str) -> None:
        self.path = os.path.abspath(step_path)
        _, self.job, self.step = split_step_path(self.path)
        index_path = os.path.join(self.path, INDEX_NAME)
        if not os.path.isfile(index_path):
            raise FormatError(f"{self.path}: not committed (no {INDEX_NAME})")
        self.index = parse_index(_read_small(index_path, MAX_INDEX_BYTES, "the index"), job=self.job, step=self.step)
        self.world_size: int = self.index["world_size"]

    def manifest(self, rank: int) -> Manifest:
        if not 0 <= rank < self.world_size:
            raise FormatError(f"rank {rank} not in step {self.step} (world size {self.world_size})")
        path = os.path.join(self.path, rank_manifest_name(rank))
        data = _read_small(path, MAX_MANIFEST_BYTES, f"the rank {rank} manifest")
        if digest_bytes(data) != self.index["ranks"][rank]["manifest_digest"]:
            raise FormatError(f"{path}: manifest digest does not match index.json")
        return parse_manifest(data, job=self.job, step=self.step, rank=rank)

    def data_path(self, rank: int) -> str:
        return os.path.join(self.path, rank_data_name(rank))

    def open_data(self, rank: int) -> int:
        """A read-only fd of rank ``rank``'s data file: never through a link, never a FIFO or device."""
        path = self.data_path(rank)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:     # ELOOP: a link, refused; ENOENT: a committed step missing its data
            raise FormatError(f"{path}: cannot open the rank {rank} data file: {e.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FormatError(f"{path}: not a regular file")
        return fd

    def iter_chunks(self, fd: int, entry: TensorEntry) -> Iterator[tuple[int, ChunkMeta, bytes]]:
        """(raw offset within tensor, meta, stored bytes) for each chunk of one tensor."""
        for file_pos, raw_pos, meta in entry.chunk_spans():
            yield raw_pos, meta, storage.read_at(fd, file_pos, meta.stored_len)

    def read_chunk_into(self, fd: int, entry: TensorEntry, file_pos: int, raw_pos: int, meta: ChunkMeta,
                        out: memoryview) -> None:
        """Read, verify and decode one chunk of ``entry`` into its place in ``out`` (the whole tensor);
        chunks are independent, so callers may run these in parallel."""
        try:
            stored = storage.read_at(fd, file_pos, meta.stored_len)
            decode_chunk(stored, meta, entry.dtype, memoryview(out).cast("B")[raw_pos: raw_pos + meta.raw_len])
        except (ChecksumError, EOFError) as e:
            raise ChecksumError(f"tensor {entry.name!r} in {self._data_file_of(fd)}: {e}") from None

    def read_tensor_into(self, fd: int, entry: TensorEntry, out: memoryview) -> None:
        """Decode one tensor into ``out``; raises ChecksumError naming the tensor and file."""
        for file_pos, raw_pos, meta in entry.chunk_spans():
            self.read_chunk_into(fd, entry, file_pos, raw_pos, meta, out)

    def _data_file_of(self, fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return f"fd {fd}"


@dataclass
class Fault:
    file: str
    tensor: str | None
    reason: str

    def __str__(self) -> str:
        where = f"tensor {self.tensor!r} in {self.file}" if self.tensor else self.file
        return f"{where}: {self.reason}"


def verify_step(step_path: str, progress: Callable[[str], None] | None = None) -> list[Fault]:
    """Check every manifest digest and every chunk checksum of a committed step (no decompression)."""
    try:
        reader = StepReader(step_path)
    except (ValueError, OSError) as e:     # FormatError is a ValueError
        return [Fault(os.path.join(step_path, INDEX_NAME), None, str(e))]
    faults: list[Fault] = []
    for rank in range(reader.world_size):
        mpath = os.path.join(reader.path, rank_manifest_name(rank))
        try:
            manifest = reader.manifest(rank)
        except (ValueError, OSError) as e:
            faults.append(Fault(mpath, None, str(e)))
            continue
        dpath = reader.data_path(rank)
        try:
            fd = reader.open_data(rank)
        except (ValueError, OSError) as e:
            faults.append(Fault(dpath, None, str(e)))
            continue
        try:
            for entry in manifest.tensors:
                try:
                    for _, meta, stored in reader.iter_chunks(fd, entry):
                        if checksum(stored) != meta.checksum:
                            raise ChecksumError("chunk checksum mismatch")
                except (ChecksumError, EOFError) as e:
                    faults.append(Fault(dpath, entry.name, str(e)))
        finally:
            os.close(fd)
        if progress:
            progress(f"rank {rank}: {len(manifest.tensors)} tensors checked")
    return faults
