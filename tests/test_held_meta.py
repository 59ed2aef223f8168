"""A held shard's description from the wire (ckptd/core/held.py ``HeldMeta.from_wire``): what a
restore from memory trusts before it reads a byte. Round trips exactly; every malformed field is
refused naming it; and the quick checks it is built from (tensor names, checksum lists, chunk
counts) decide exactly as the plain rules they stand for, over generated inputs."""
from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core import names
from ckptd.core.codec import chunk_count, chunk_ranges
from ckptd.core.errors import FormatError
from ckptd.core.held import HeldMeta
from ckptd.core.schema import parse_layout

CHUNK = 64 * 1024


def wire() -> dict[str, Any]:
    tensors = [["model/a.weight", "float32", [100, 1000], 0, 400_000],
               ["model/b", "bfloat16", [7], 400_000, 14, {"shape": [14], "offsets": [7]}],
               ["optim/state/a.weight/step", "float32", [], 400_064, 4]]
    return {"job": "j", "step": 3, "rank": 1, "world_size": 2, "digest": "sha256:" + "ab" * 32, "nbytes": 400_068,
            "chunk_bytes": CHUNK, "checksums": [[f"{i:016x}" for i in range(7)], ["00ff00ff00ff00ff"], ["0" * 16]],
            "tensors": tensors, "tree": {"d": [["model", {"T": "model/a.weight"}]]}}


def test_round_trip() -> None:
    meta = HeldMeta.from_wire(wire())
    assert meta.to_wire() == wire()
    assert [t.name for t in meta.layout] == ["model/a.weight", "model/b", "optim/state/a.weight/step"]
    assert meta.layout[1].placement is not None and meta.layout[1].placement.offsets == (7,)


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    msg = wire()
    node: Any = msg
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return msg


@pytest.mark.parametrize("path,value,match", [
    (("checksums", 0, 3), "0123456789ABCDEF", "checksums do not match"),        # upper case
    (("checksums", 0, 3), "0123456789abcde", "checksums do not match"),         # 15 digits
    (("checksums", 0, 3), 12345, "checksums do not match"),
    (("checksums", 0), [f"{i:016x}" for i in range(6)], "checksums do not match"),  # a chunk short
    (("checksums", 1), [], "checksums do not match"),
    (("checksums",), [[]], "checksums do not match"),
    (("tensors", 0, 0), "model/../escape", "segment"),
    (("tensors", 0, 0), "model//a", "segment"),
    (("tensors", 0, 0), "./a", "segment"),
    (("tensors", 0, 0), "a/", "segment"),
    (("tensors", 0, 0), "/abs", "leading"),
    (("tensors", 1, 0), "model/a.weight", "duplicate"),
    (("tensors", 0, 1), "float31", "unknown dtype"),
    (("tensors", 0, 2), [100, -1000], "bad shape"),
    (("tensors", 0, 4), 400_001, "inconsistent"),
    (("tensors", 2, 3), 400_065, "outside the slot"),
    (("tensors", 1, 5), {"shape": [13], "offsets": [7]}, "does not fit"),
    (("chunk_bytes",), 1024, "chunk"),
    (("step",), 10**12, "bad step"),               # past names.MAX_STEP: no path could name it
    (("digest",), "sha256:xyz", "digest"),
])
def test_malformed_fields_are_refused(path: tuple[Any, ...], value: Any, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        HeldMeta.from_wire(_set(path, value))


def plain_name_rule(name: str) -> bool:
    """The tensor name rule as stated (names.validate_tensor_name's docstring and messages)."""
    return (0 < len(name) <= names.MAX_TENSOR_NAME and "\x00" not in name and "\\" not in name
            and not name.startswith("/") and all(part not in ("", ".", "..") for part in name.split("/")))


def accepted(name: str) -> bool:
    try:
        names.validate_tensor_name(name)
    except ValueError:
        return False
    return True


@settings(max_examples=3000, deadline=None, database=None)
@given(st.text(alphabet="/.a\\\x00", max_size=9))
def test_tensor_name_quick_check_is_the_plain_rule(name: str) -> None:
    assert accepted(name) == plain_name_rule(name), name


@settings(max_examples=1500, deadline=None, database=None)
@given(st.lists(st.one_of(st.text(alphabet="0123456789abcdefABg", min_size=14, max_size=17), st.integers(), st.none()),
                max_size=5))
def test_checksum_list_check_is_each_item_checked(values: list[Any]) -> None:
    assert names.are_checksums(values) == all(names.is_checksum(v) for v in values), values


@settings(max_examples=1500, deadline=None, database=None)
@given(st.integers(0, 1 << 20), st.integers(1, 1 << 16))
def test_chunk_count_is_the_number_of_chunk_ranges(nbytes: int, chunk_bytes: int) -> None:
    assert chunk_count(nbytes, chunk_bytes) == len(chunk_ranges(nbytes, chunk_bytes))


def test_layout_refusal_names_the_tensor() -> None:
    tensors = copy.deepcopy(wire()["tensors"])
    tensors[1][2] = [8]
    with pytest.raises(ValueError, match="'model/b'"):
        parse_layout(tensors, 1 << 20)


def test_to_wire_is_the_callers_own_dict() -> None:
    """(Its lists are built once per shard and shared between calls: a caller adds keys of its own.)"""
    meta = HeldMeta.from_wire(wire())
    first = meta.to_wire()
    first["source"], first["step"] = "peer", 99
    assert meta.to_wire() == wire()
