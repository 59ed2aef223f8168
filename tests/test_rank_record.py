"""A COMMIT's rank records (ckptd/core/rank_record.py): ``parse_records`` validates each distinct
tensor entry once and takes an equal entry of a later rank as that one, yet refuses every
malformed record whatever was seen before it, naming the rank."""
from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.core.codec import ChunkMeta
from ckptd.core.errors import FormatError
from ckptd.core.rank_record import RecordWire, parse_record, parse_records, summarize
from ckptd.core.schema import Manifest, Placement, TensorEntry, digest_bytes


def record(rank: int, world: int = 4) -> dict[str, Any]:
    """A real record: a replicated tensor (same on every rank), a piece of a sharded one (its
    offsets differ per rank) and a plain tensor whose content differs per rank."""
    def chunk(tag: str, n: int) -> list[ChunkMeta]:
        return [ChunkMeta("none", n, n, tag, [[n, "r"]])]
    shared = TensorEntry("shared", "float32", [8], 0, chunk("00000000000000aa", 32))
    piece = TensorEntry("emb", "bfloat16", [2, 3], 32, chunk(f"{rank:016x}", 12),
                        Placement((2 * world, 3), (2 * rank, 0), None))
    own = TensorEntry("own", "int64", [rank + 1], 44, chunk(f"{rank + 100:016x}", 8 * (rank + 1)))
    m = Manifest("job", 1, rank, world, [shared, piece, own], {"d": [["w", {"T": "shared"}], ["step", 3]]}, 60, 60)
    return summarize(m, digest_bytes(b"manifest %d" % rank)).to_json()


def test_records_parse_and_equal_entries_are_shared_across_ranks() -> None:
    objs = [record(r) for r in range(4)]
    parsed = parse_records(objs)
    assert [p.rank for p in parsed] == [0, 1, 2, 3]
    assert parsed == [parse_record(o, r) for r, o in enumerate(objs)]      # same as each parsed alone
    shared = [p.entries[0] for p in parsed]
    assert all(e is shared[0] for e in shared)                              # validated once, one object
    assert len({id(p.entries[1]) for p in parsed}) == 4                     # pieces differ by offsets
    assert [p.entries[1].offsets for p in parsed] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert all(p.forms[0] is parsed[0].forms[0] for p in parsed)


BAD: list[tuple[str, Any]] = [
    ("bad shape", lambda t: t.__setitem__(2, [-8])),
    ("bad shape", lambda t: t.__setitem__(2, "8")),
    ("unknown dtype", lambda t: t.__setitem__(1, "float128")),
    ("needs a fingerprint", lambda t: t.__setitem__(6, "not-a-checksum")),
    ("needs a fingerprint", lambda t: t.__setitem__(5, [0])),
    ("malformed tensor entry", lambda t: t.append(None)),
]


@pytest.mark.parametrize("why,spoil", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_a_malformed_entry_is_refused_after_a_valid_one_was_seen(why: str, spoil: Any) -> None:
    objs = [record(r) for r in range(3)]
    bad = copy.deepcopy(objs[2])
    spoil(bad["t"][0])                 # the replicated entry: ranks 0 and 1 had it valid
    with pytest.raises(FormatError, match=f"rank 2 record: .*{why}"):
        parse_records([objs[0], objs[1], bad])


def test_a_repeated_name_is_refused_even_when_both_entries_were_seen() -> None:
    objs = [record(r) for r in range(2)]
    twice = copy.deepcopy(objs[1])
    twice["t"].append(copy.deepcopy(twice["t"][0]))
    with pytest.raises(FormatError, match="rank 1 record: duplicate tensor 'shared'"):
        parse_records([objs[0], twice])


def test_a_malformed_state_key_is_refused_after_a_valid_one() -> None:
    objs = [record(r) for r in range(2)]
    bad = copy.deepcopy(objs[1])
    bad["k"][0][1] = "zz"
    with pytest.raises(FormatError, match="rank 1 record: malformed state key entry"):
        parse_records([objs[0], bad])


# Typed records (as a COMMIT's decode makes them) are checked in one pass (``_typed_all``) before
# any is parsed alone: whatever a record holds, that pass must decide exactly as the one-by-one
# parse of the same records as JSON, and a refusal must name the same rank and fault.
SPOILS: list[tuple[str, Any]] = [
    ("rank", lambda o: o.__setitem__("rank", o["rank"] + 1)),
    ("digest", lambda o: o.__setitem__("digest", o["digest"][:-1] + "G")),
    ("digest upper", lambda o: o.__setitem__("digest", o["digest"].upper())),
    ("digest short", lambda o: o.__setitem__("digest", o["digest"][:-1])),
    ("digest long", lambda o: o.__setitem__("digest", o["digest"] + "0")),
    ("raw", lambda o: o.__setitem__("raw", -1)),
    ("stored", lambda o: o.__setitem__("stored", -5)),
    ("piece fingerprint", lambda o: o["t"][1].__setitem__(6, "0" * 15 + "g")),
    ("piece fingerprint long", lambda o: o["t"][1].__setitem__(6, "0" * 17)),
    ("plain fingerprint", lambda o: o["t"][2].__setitem__(6, "ABCDEF0123456789")),
    ("plain without fingerprint", lambda o: o["t"][2].__setitem__(6, None)),
    ("plain with offsets", lambda o: o["t"][2].__setitem__(5, [0])),
    ("plain with a key", lambda o: o["t"][2].__setitem__(3, "other")),
    ("piece out of bounds", lambda o: o["t"][1].__setitem__(5, [99, 0])),
    ("bad name", lambda o: o["t"][2].__setitem__(0, "../x")),
    ("bad key", lambda o: o["t"][1].__setitem__(3, "a//b")),
    ("unknown dtype", lambda o: o["t"][0].__setitem__(1, "float128")),
    ("negative size", lambda o: o["t"][2].__setitem__(2, [-1])),
    ("duplicate", lambda o: o["t"].append(copy.deepcopy(o["t"][2]))),
    ("state key hash", lambda o: o["k"][1].__setitem__(1, "zz")),
    ("state key name", lambda o: o["k"][1].__setitem__(0, "x" * 1025)),
]


# Changes that leave a record valid: a piece from an older writer (no fingerprint), another state.
FINE: list[Any] = [lambda o: o["t"][1].__setitem__(6, None), lambda o: o["k"].append(["extra", "00000000000000aa"]),
                   lambda o: o["t"][0].__setitem__(0, "renamed"), lambda o: o.__setitem__("raw", 0)]


def outcome(objs: list[Any]) -> Any:
    try:
        return parse_records(objs)
    except FormatError as e:
        return f"FormatError: {e}"


@pytest.mark.parametrize("why,spoil", SPOILS, ids=[s[0] for s in SPOILS])
def test_typed_records_are_refused_as_their_json_naming_the_same_fault(why: str, spoil: Any) -> None:
    objs = [record(r) for r in range(3)]
    spoil(objs[2])
    as_json = outcome(objs)
    assert isinstance(as_json, str) and as_json.startswith("FormatError: rank 2 record: "), (why, as_json)
    typed = [msgspec.convert(o, RecordWire) for o in objs]
    assert outcome(typed) == as_json


def test_valid_typed_records_parse_as_their_json() -> None:
    objs = [record(r, world=5) for r in range(5)]
    typed = [msgspec.convert(o, RecordWire) for o in objs]
    assert parse_records(typed) == parse_records(objs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(range(len(SPOILS) + len(FINE)))), max_size=3))
def test_typed_and_json_records_decide_alike_whatever_is_changed(changes: list[tuple[int, int]]) -> None:
    objs = [record(r) for r in range(4)]
    for rank, k in changes:
        (SPOILS[k][1] if k < len(SPOILS) else FINE[k - len(SPOILS)])(objs[rank])
    typed = [msgspec.convert(o, RecordWire) for o in objs]
    assert outcome(typed) == outcome(objs)
