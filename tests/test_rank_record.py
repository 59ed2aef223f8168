"""A COMMIT's rank records (ckptd/core/rank_record.py): ``parse_records`` validates each distinct
tensor entry once and takes an equal entry of a later rank as that one, yet refuses every
malformed record whatever was seen before it, naming the rank."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from ckptd.core.codec import ChunkMeta
from ckptd.core.errors import FormatError
from ckptd.core.rank_record import parse_record, parse_records, summarize
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
