"""The index's lean side files: what one restoring rank reads instead of the whole index.json.

index.json lists every rank (and every piece of every sharded tensor): a rank that reads it
whole to find its own manifest's digest reads O(world size) bytes, and all ranks restoring at
once read O(world size²). So the commit also writes, before index.json (FORMAT.md, "Lean
index"):

- ``ranks.bin``: one fixed-width record per rank — the manifest's sha256 (32 bytes), raw and
  stored bytes (u64 big-endian each) — in rank order, so rank *r* seeks to ``48·r``;
- ``tensors.json``: index.json's tensor map, byte for byte the same object;
- ``index-head.json``: index.json less ``ranks`` and ``tensors``, plus the sha256 of every
  block of ``BLOCK_RANKS`` records of ``ranks.bin`` and of ``tensors.json``, and its own digest.

They are written only for an index over ``SMALL_INDEX_BYTES``: a smaller one is read whole.
A reader reads the head (O(world size / 256) bytes), the one 12 KiB block holding its record
(checked against the head), and ``tensors.json`` only when it needs the tensor map. index.json
stays the commit marker and the complete record (``ckptd verify`` checks the side files against it).
"""
from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import storage
from .errors import FormatError
from .names import HEAD_NAME, RANK_TABLE_NAME, TENSORS_NAME, is_world
from .rank_record import RankRecord
from .schema import INDEX_VERSIONS, encode_json, index_digest, load_json

SIDE_FILES = (RANK_TABLE_NAME, TENSORS_NAME, HEAD_NAME)
RECORD = struct.Struct(">32sQQ")
BLOCK_RANKS = 256
MAX_HEAD_BYTES = 4 * 1024 * 1024
# Read index.json whole up to this size (one read is cheaper than three); larger: the side files.
SMALL_INDEX_BYTES = 16 * 1024


def encode_table(records: Sequence[RankRecord]) -> bytes:
    return b"".join(RECORD.pack(bytes.fromhex(r.digest.removeprefix("sha256:")), r.raw_bytes, r.stored_bytes)
                    for r in records)


def _block_digests(table: bytes) -> list[str]:
    step = BLOCK_RANKS * RECORD.size
    return [hashlib.sha256(table[i: i + step]).hexdigest() for i in range(0, len(table), step)]


def side_files(index: dict[str, Any], records: Sequence[RankRecord]) -> list[tuple[str, bytes]]:
    """(file name, bytes) of the three side files of ``index`` (head last: it names the others)."""
    table = encode_table(records)
    tensors = encode_json(index.get("tensors", {}))
    head = {k: v for k, v in index.items() if k not in ("ranks", "tensors", "digest")}
    head.update(kind="ckptd.index-head", index_digest=index.get("digest"), block_ranks=BLOCK_RANKS,
                rank_blocks=_block_digests(table), tensors_sha256=hashlib.sha256(tensors).hexdigest(),
                tensors_bytes=len(tensors))
    head["digest"] = index_digest(head)
    return [(RANK_TABLE_NAME, table), (TENSORS_NAME, tensors), (HEAD_NAME, encode_json(head))]


@dataclass(frozen=True)
class IndexHead:
    format_version: int
    world_size: int
    created_unix: Any
    per_rank_keys: list[str]
    rank_blocks: list[str]
    tensors_sha256: str
    tensors_bytes: int
    index_digest: str


def parse_head(data: bytes, *, job: str, step: int) -> IndexHead:
    obj = load_json(data, "index head")
    if not (isinstance(obj, dict) and obj.get("kind") == "ckptd.index-head"):
        raise FormatError("not a ckptd index head")
    if obj.get("format_version") not in INDEX_VERSIONS or obj.get("job") != job or obj.get("step") != step:
        raise FormatError(f"index head names format/job/step {obj.get('format_version')!r}/{obj.get('job')!r}/"
                          f"{obj.get('step')!r}, expected {job!r}/{step}")
    ws, blocks, keys = obj.get("world_size"), obj.get("rank_blocks"), obj.get("per_rank_keys")
    if not (is_world(ws) and obj.get("block_ranks") == BLOCK_RANKS
            and isinstance(blocks, list) and len(blocks) == -(-ws // BLOCK_RANKS)
            and all(isinstance(b, str) and len(b) == 64 for b in blocks)
            and isinstance(keys, list) and all(isinstance(k, str) for k in keys)
            and isinstance(obj.get("tensors_sha256"), str) and type(obj.get("tensors_bytes")) is int
            and isinstance(obj.get("index_digest"), str)):
        raise FormatError("malformed index head")
    if obj.get("digest") != index_digest(obj):
        raise FormatError("index-head.json digest mismatch: a field was changed after the commit (corrupt or edited)")
    return IndexHead(obj["format_version"], ws, obj.get("created_unix"), keys, blocks, obj["tensors_sha256"],
                     obj["tensors_bytes"], obj["index_digest"])


def read_block(step_path: str, head: IndexHead, block: int) -> list[dict[str, Any]]:
    """The index entries (``ranks`` items) of one block of ranks, checked against the head."""
    first = block * BLOCK_RANKS
    count = min(BLOCK_RANKS, head.world_size - first)
    path = os.path.join(step_path, RANK_TABLE_NAME)
    try:
        fd, _ = storage.open_regular(path)
    except OSError as e:
        raise FormatError(f"{path}: cannot read the rank table: {e.strerror}") from None
    except storage.NotRegular as e:
        raise FormatError(f"cannot read the rank table: {e}") from None
    try:
        data = storage.read_at(fd, first * RECORD.size, count * RECORD.size)
    except EOFError:
        raise FormatError(f"{path}: shorter than its {head.world_size} ranks") from None
    finally:
        os.close(fd)
    if hashlib.sha256(data).hexdigest() != head.rank_blocks[block]:
        raise FormatError(f"{path}: block {block} does not match index-head.json (corrupt or edited)")
    return [{"rank": first + i, "manifest_digest": "sha256:" + d.hex(), "raw_bytes": raw, "stored_bytes": stored}
            for i, (d, raw, stored) in enumerate(RECORD.iter_unpack(data))]


def read_tensors(step_path: str, head: IndexHead, limit: int) -> Any:
    """The tensor map object of tensors.json, checked against the head (still to be parsed)."""
    path = os.path.join(step_path, TENSORS_NAME)
    try:
        data = storage.read_limited(path, limit)
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: cannot read the tensor map: {e}") from None
    if len(data) != head.tensors_bytes or hashlib.sha256(data).hexdigest() != head.tensors_sha256:
        raise FormatError(f"{path}: does not match index-head.json (corrupt or edited)")
    return load_json(data, "tensor map")


def side_file_faults(step_path: str, index: dict[str, Any]) -> list[str]:
    """What disagrees between index.json and its side files (none for a step without them)."""
    if not os.path.exists(os.path.join(step_path, HEAD_NAME)):
        return []
    try:
        data = storage.read_limited(os.path.join(step_path, HEAD_NAME), MAX_HEAD_BYTES)
        head = parse_head(data, job=index["job"], step=index["step"])
        if head.index_digest != index.get("digest") or head.world_size != index["world_size"]:
            return [f"{HEAD_NAME} belongs to another index.json (digest or world size differs)"]
        faults = []
        for block in range(len(head.rank_blocks)):
            first = block * BLOCK_RANKS
            if read_block(step_path, head, block) != index["ranks"][first: first + BLOCK_RANKS]:
                faults.append(f"{RANK_TABLE_NAME}: ranks {first}.. differ from index.json")
        if read_tensors(step_path, head, 1 << 62) != index.get("tensors", {}):
            faults.append(f"{TENSORS_NAME} differs from index.json's tensor map")
        return faults
    except (OSError, ValueError) as e:      # FormatError is a ValueError
        return [str(e)]
