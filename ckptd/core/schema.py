"""On-disk schemas: the rank manifest and the step index (FORMAT.md is their documentation).

Everything parsed here comes from disk and is validated before it is trusted: names,
dtypes, shapes, sizes, offsets, chunk metadata.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from . import gc_pause
from .codec import FLOAT_ITEMSIZE, ChunkMeta, max_raw
from .errors import FormatError
from .names import (
    MAX_TENSOR_NAME,
    MAX_TREE_DEPTH,
    check_tree_depth,
    is_digest,
    is_rank,
    is_uint,
    is_world,
    rank_data_name,
    require,
    validate_tensor_name,
)
from .regions import Region
from .sizes import sizable

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)     # format 1: no global placement, no tensor map in the index
GRID_INDEX_VERSION = 3         # an index whose tensor map stores some sharded tensor as a grid
INDEX_VERSIONS = (*READABLE_VERSIONS, GRID_INDEX_VERSION)
GAP_MANIFEST_VERSION = 3       # a manifest whose tensors leave gaps in its data (data_length)
MANIFEST_VERSIONS = (*READABLE_VERSIONS, GAP_MANIFEST_VERSION)
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_DIMS = 64                 # a tensor's dimensions at most (torch's own limit is higher)
MAX_DATA_BYTES = 1 << 62       # no chunk of a rank's data file ends past this (off_t is signed 64-bit)

# Every torch dtype ckptd stores, by the name torch prints after "torch.", with its item size.
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


@dataclass(frozen=True)
class Placement:
    """Where a saved piece sits in its global tensor: the region ``offsets`` + the piece's shape.
    ``key`` is the global tensor's name (defaults to the piece's own name)."""
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    key: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": list(self.global_shape), "offsets": list(self.offsets)}
        if self.key is not None:
            out["key"] = self.key
        return out


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor sits in a slot: the one type both sides use for a save's layout.
    ``placement`` is set for a piece of a sharded (DTensor) global tensor."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    placement: Placement | None = None

    def to_wire(self) -> list[Any]:
        out: list[Any] = [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]
        if self.placement is not None:
            out.append(self.placement.to_json())
        return out


_PLACEMENT_KEYS = frozenset(("shape", "offsets", "key"))


def parse_placement(obj: Any, shape: list[int], what: str) -> Placement:
    """A piece's ``global`` object (manifest or wire), checked against the piece's ``shape`` (which
    every caller has checked first: its extents are integers >= 0)."""
    if not (isinstance(obj, dict) and obj.keys() <= _PLACEMENT_KEYS):
        raise FormatError(f"{what}: bad global placement")
    gshape, offsets = obj.get("shape"), obj.get("offsets")
    # (each offset an integer >= 0 and each extent within the global one, which is then one too)
    if not (isinstance(gshape, list) and isinstance(offsets, list) and len(gshape) == len(offsets) == len(shape)
            and all(type(o) is int and type(g) is int and 0 <= o and o + n <= g
                    for o, n, g in zip(offsets, shape, gshape, strict=True))):
        raise FormatError(f"{what}: global placement {str(obj)[:120]} does not fit its shape {shape}")
    key = obj.get("key")
    if key is not None:
        try:
            validate_tensor_name(key)
        except ValueError as e:
            raise FormatError(f"{what}: {e}") from None
    return Placement(tuple(gshape), tuple(offsets), key)


def digest_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()



@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    offset: int          # file offset of the first chunk; chunks follow back to back
    chunks: list[ChunkMeta]
    placement: Placement | None = None      # set for a piece of a sharded (DTensor) tensor

    @property
    def key(self) -> str:
        """The global tensor this entry belongs to."""
        return self.placement.key or self.name if self.placement else self.name

    @property
    def global_shape(self) -> tuple[int, ...] | None:
        return self.placement.global_shape if self.placement else None

    def region(self) -> Region:
        """The part of the global tensor these bytes hold (the whole tensor for a plain one)."""
        if self.placement is None:
            return Region.whole(self.shape)
        return Region(self.placement.offsets, tuple(self.shape))

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
        out = {"name": self.name, "dtype": self.dtype, "shape": self.shape, "offset": self.offset,
               "chunks": [c.to_json() for c in self.chunks]}
        if self.placement is not None:
            out["global"] = self.placement.to_json()
        return out


def data_length(tensors: Sequence[TensorEntry]) -> int:
    """The length of the data a manifest's chunks lie in (its ``stored_bytes``): the furthest end of
    any tensor's chunks. Tensors may start past a gap (direct_write.py), so not the chunks' sum."""
    return max((t.offset + t.stored_bytes for t in tensors), default=0)


@dataclass
class Manifest:
    job: str
    step: int
    rank: int
    world_size: int
    tensors: list[TensorEntry]
    tree: Any
    raw_bytes: int
    stored_bytes: int       # the data file's length (data_length): its chunks, and any gaps between tensors

    def to_json(self) -> dict[str, Any]:
        """Format 3 where the tensors leave gaps (a build reading format 2 takes the chunks' sum for the
        file's length: it refuses the manifest rather than commit or read a step it would get wrong)."""
        gaps = self.stored_bytes != sum(t.stored_bytes for t in self.tensors)
        return {"format_version": GAP_MANIFEST_VERSION if gaps else FORMAT_VERSION,
                "kind": "ckptd.rank-manifest", "job": self.job,
                "step": self.step, "rank": self.rank, "world_size": self.world_size,
                "data_file": rank_data_name(self.rank), "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes,
                "tensors": [t.to_json() for t in self.tensors], "tree": self.tree}

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}


def validate_shape(dtype: Any, shape: Any) -> None:
    # (Messages built only on failure: a commit validates every rank's tensors, 65k at 32k ranks.)
    if not (isinstance(dtype, str) and dtype in DTYPE_ITEMSIZE):
        raise FormatError(f"unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(is_uint(d) for d in shape)):
        raise FormatError(f"bad shape {str(shape)[:200]}: not a list of at most {MAX_DIMS} non-negative sizes")
    if not sizable(shape, DTYPE_ITEMSIZE[dtype]):
        raise FormatError(f"shape {str(shape)[:200]} of {dtype} is beyond any tensor (over 2**62 bytes)")



def parse_layout(tensors: list[Any], slot_size: int) -> list[TensorLayout]:
    """A save's tensor layout, checked against its slot: names, dtypes, shapes, bounds (ValueError).
    An optional sixth element places the tensor as a piece of a sharded global tensor."""
    out, names = [], set()
    for t in tensors:
        if not (isinstance(t, list) and len(t) in (5, 6)):
            raise ValueError("each tensor must be [name, dtype, shape, offset, nbytes] (+ optional placement)")
        name, dtype, shape, offset, nbytes = t[:5]
        validate_tensor_name(name)
        if name in names:
            raise ValueError(f"duplicate tensor name {name!r}")
        names.add(name)
        try:
            validate_shape(dtype, shape)
        except FormatError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
        if type(offset) is not int or type(nbytes) is not int or offset < 0 \
                or nbytes != math.prod(shape) * DTYPE_ITEMSIZE[dtype] or offset + nbytes > slot_size:
            raise ValueError(f"tensor {name!r}: offset/size outside the slot or inconsistent with its shape")
        try:
            placement = parse_placement(t[5], shape, f"tensor {name!r}") if len(t) == 6 else None
        except FormatError as e:
            raise ValueError(str(e)) from None
        out.append(TensorLayout(name, dtype, tuple(shape), offset, nbytes, placement))
    return out


def load_json(data: bytes, what: str) -> Any:
    """A JSON document read from disk or the wire; FormatError naming ``what`` when it is not one."""
    try:
        return gc_pause.loads(data)
    except ValueError as e:
        raise FormatError(f"{what} is not JSON: {e}") from None
    except RecursionError:
        raise FormatError(f"{what} nests too deeply to parse") from None


def _check_chunks(entry: TensorEntry) -> None:
    """Chunk metadata consistent with the codec and dtype, so decoding cannot trip over it. (Each
    message built only on failure: this runs for every chunk of a manifest a restore parses.)"""
    for c in entry.chunks:
        if c.stored_len > c.raw_len:
            raise FormatError(f"tensor {entry.name!r}: a chunk stores more bytes than it holds")
        if c.raw_len > max_raw(c.stored_len):
            raise FormatError(f"tensor {entry.name!r}: a chunk of {c.stored_len} stored bytes claims {c.raw_len}, "
                              "more than any codec expands to")
        if c.codec == "bplane":
            itemsize = FLOAT_ITEMSIZE.get(entry.dtype, 0)
            if not (itemsize > 0 and c.raw_len % itemsize == 0 and len(c.segments) == itemsize):
                raise FormatError(f"tensor {entry.name!r}: bplane chunk does not fit dtype {entry.dtype}")
            if not all(n == c.raw_len // itemsize for n, kind in c.segments if kind == "r"):
                raise FormatError(f"tensor {entry.name!r}: bplane raw plane of the wrong length")
        elif len(c.segments) != 1:
            raise FormatError(f"tensor {entry.name!r}: {c.codec} chunk must have one segment")
        elif c.codec in ("none", "held") and not (c.segments[0][1] == "r" and c.stored_len == c.raw_len):
            raise FormatError(f"tensor {entry.name!r}: uncompressed chunk with compressed segment or wrong length")


def parse_manifest(data: bytes, *, job: str, step: int, rank: int) -> Manifest:
    obj = load_json(data, "manifest")
    require(isinstance(obj, dict), "manifest is not an object")
    require(obj.get("format_version") in MANIFEST_VERSIONS,
             f"unsupported manifest format_version {obj.get('format_version')!r} (this build reads "
             f"{', '.join(map(str, MANIFEST_VERSIONS))}; a newer ckptd wrote it: upgrade ckptd here to read it)")
    require(obj.get("kind") == "ckptd.rank-manifest", "not a rank manifest")
    require(obj.get("job") == job and obj.get("step") == step and obj.get("rank") == rank,
             f"manifest names job/step/rank {obj.get('job')!r}/{obj.get('step')!r}/{obj.get('rank')!r}, "
             f"expected {job!r}/{step}/{rank}")
    ws = obj.get("world_size")
    require(is_rank(rank, ws), "bad world_size")
    # Informational only (readers derive the name), but a manifest naming another file is crafted.
    require(obj.get("data_file") == rank_data_name(rank),
             f"manifest data_file {str(obj.get('data_file'))[:80]!r} is not {rank_data_name(rank)!r}")
    raw_list = obj.get("tensors")
    require(isinstance(raw_list, list), "manifest has no tensor list")
    # (Every message below is built only on failure: a restore parses its rank's manifest, 8,192+
    # entries for a large model, and eager f-strings were a third of that.)
    tensors: list[TensorEntry] = []
    seen: set[str] = set()
    chunk_meta = ChunkMeta.from_json
    raw_total = end = 0
    for t in raw_list:
        if not isinstance(t, dict):
            raise FormatError("tensor entry is not an object")
        try:
            name = validate_tensor_name(t.get("name"))
            raw_chunks = t.get("chunks")
            if not isinstance(raw_chunks, list):
                raise ValueError("chunks must be a list")
            chunks = [chunk_meta(c) for c in raw_chunks]
        except ValueError as e:
            raise FormatError(f"tensor {t.get('name')!r}: {e}") from None
        if name in seen:
            raise FormatError(f"duplicate tensor {name!r}")
        seen.add(name)
        dtype: Any = t.get("dtype")
        shape: Any = t.get("shape")
        offset: Any = t.get("offset")
        validate_shape(dtype, shape)
        if not is_uint(offset):
            raise FormatError(f"tensor {name!r}: bad offset")
        placement = parse_placement(t["global"], shape, f"tensor {name!r}") if "global" in t else None
        entry = TensorEntry(name, dtype, shape, offset, chunks, placement)
        raw = stored = 0
        for c in chunks:
            raw += c.raw_len
            stored += c.stored_len
        if raw != entry.nbytes:
            raise FormatError(f"tensor {name!r}: chunks hold {raw} bytes, shape needs {entry.nbytes}")
        if offset + stored > MAX_DATA_BYTES:     # a file offset the OS can seek to
            raise FormatError(f"tensor {name!r}: its chunks end past byte {MAX_DATA_BYTES} of the data file")
        _check_chunks(entry)
        tensors.append(entry)
        raw_total += raw
        end = max(end, offset + stored)        # data_length: tensors may start past a gap
    try:
        check_tree_depth(obj.get("tree"), MAX_TREE_DEPTH)
    except ValueError as e:
        raise FormatError(f"manifest state tree: {e}") from None
    return Manifest(job, step, rank, ws, tensors, obj.get("tree"), raw_total, end)


def make_index(job: str, step: int, world_size: int, ranks: list[dict[str, Any]], created: float,
               tensors: dict[str, Any] | None = None, per_rank_keys: list[str] | None = None) -> dict[str, Any]:
    """index.json's object; format 2 adds the global tensor map (core.global_index) and a digest
    over every other field, so no byte of the index goes unchecked."""
    return make_index_file(job, step, world_size, ranks, created, tensors, per_rank_keys)[0]


def make_index_file(job: str, step: int, world_size: int, ranks: list[dict[str, Any]], created: float,
                    tensors: dict[str, Any] | None = None,
                    per_rank_keys: list[str] | None = None) -> tuple[dict[str, Any], bytes]:
    """(index.json's object, its file bytes), encoded once: the file is the canonical JSON the
    digest is taken over, with the digest field appended (a 32,768-rank index is 4.5 MB: a second
    encoding cost the commit 70 ms)."""
    version = GRID_INDEX_VERSION if any("grid" in t for t in (tensors or {}).values()) else FORMAT_VERSION
    index: dict[str, Any] = {"format_version": version, "kind": "ckptd.index", "job": job, "step": step,
                             "world_size": world_size, "created_unix": created, "ranks": ranks,
                             "tensors": tensors or {}, "per_rank_keys": per_rank_keys or []}
    canonical = _canonical(index)
    index["digest"] = digest_bytes(canonical)
    return index, canonical[:-1] + b',"digest":' + json.dumps(index["digest"]).encode() + b"}"


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def index_digest(index: dict[str, Any]) -> str:
    """SHA-256 of the index's canonical JSON (sorted keys) without its own ``digest`` field."""
    return digest_bytes(_canonical({k: v for k, v in index.items() if k != "digest"}))


def parse_index(data: bytes, *, job: str, step: int) -> dict[str, Any]:
    obj = load_json(data, "index")
    require(isinstance(obj, dict) and obj.get("kind") == "ckptd.index", "not a ckptd index")
    require(obj.get("format_version") in INDEX_VERSIONS,
             f"unsupported index format_version {obj.get('format_version')!r} (this build reads "
             f"{', '.join(map(str, INDEX_VERSIONS))}; a newer ckptd wrote it: upgrade ckptd here to read it)")
    require(obj.get("job") == job and obj.get("step") == step,
             f"index names job/step {obj.get('job')!r}/{obj.get('step')!r}, expected {job!r}/{step}")
    ws = obj.get("world_size")
    require(is_world(ws), "bad world_size in index")
    ranks = obj.get("ranks")
    require(isinstance(ranks, list) and len(ranks) == ws, "index must list every rank exactly once")
    for i, r in enumerate(ranks):
        require(isinstance(r, dict) and type(r.get("rank")) is int and r["rank"] == i
                 and is_digest(r.get("manifest_digest"))
                 and is_uint(r.get("raw_bytes")) and is_uint(r.get("stored_bytes")),
                 f"bad index entry for rank {i}")
    if obj["format_version"] >= 2:
        keys = obj.get("per_rank_keys")
        require(isinstance(obj.get("tensors"), dict), "index has no tensor map")
        require(isinstance(keys, list) and all(isinstance(k, str) and len(k) <= MAX_TENSOR_NAME for k in keys),
                 "bad per_rank_keys in index")
        # Last, so a malformed index still gets its specific error; anything else changed is caught here.
        require(obj.get("digest") == index_digest(obj),
                 "index.json digest mismatch: a field was changed after the commit (corrupt or edited)")
    index: dict[str, Any] = obj
    return index

