"""The COMMIT frame's typed codec (ckptd/core/commit_wire.py): what it encodes decodes to the same
request, its records typed; anything it cannot type is decoded as any frame is, so the daemon's
checks name the fault as they did; other frames are framing.py's."""
from __future__ import annotations

import json
from typing import Any

import pytest

from ckptd.core import framing, protocol
from ckptd.core.codec import ChunkMeta
from ckptd.core.errors import FormatError, ProtocolError
from ckptd.core.rank_record import RecordWire, parse_records, summarize
from ckptd.core.schema import Manifest, TensorEntry, digest_bytes


def record(rank: int) -> dict[str, Any]:
    w = TensorEntry("w", "float32", [4], 0, [ChunkMeta("none", 16, 16, f"{rank:016x}", [[16, "r"]])])
    m = Manifest("j", 1, rank, 2, [w], {"d": [["w", {"T": "w"}]]}, 16, 16)
    return summarize(m, digest_bytes(f"manifest {rank}".encode())).to_json()


def body(frame: bytes) -> bytes:
    assert protocol.parse_header(frame[:protocol.HEADER.size]) == len(frame) - protocol.HEADER.size
    return frame[protocol.HEADER.size:]


def test_a_commit_round_trips_with_its_records_typed() -> None:
    recs = [record(0), record(1)]
    wire = protocol.to_wire(protocol.Commit(step=1, digests={"0": recs[0]["digest"], "1": recs[1]["digest"]},
                                            records=recs, check=[0]), 7)
    frame = protocol.encode(wire)
    assert json.loads(body(frame)) == wire              # the same JSON as framing's encoder writes
    msg = protocol.decode_body(body(frame))
    assert all(isinstance(r, RecordWire) for r in msg["records"])
    req, commit = protocol.parse_request(msg)
    assert req == 7 and isinstance(commit, protocol.Commit) and commit.check == [0] and commit.step == 1
    assert parse_records(commit.records) == parse_records(recs)


def test_a_commit_without_records_and_other_frames_decode_as_before() -> None:
    wire = protocol.to_wire(protocol.Commit(step=2, digests={}), 1)
    msg = protocol.decode_body(body(protocol.encode(wire)))
    assert msg == framing.decode_body(body(framing.encode(wire))) and msg["records"] is None
    hello = {"op": "hello", "req": 1, "x": float("nan")}
    assert body(protocol.encode(hello)) == body(framing.encode(hello))          # NaN stays json's
    assert protocol.decode_body(body(framing.encode(hello)))["op"] == "hello"


@pytest.mark.parametrize("bad, match", [
    ({"raw": 16.5}, "rank 1 record: bad sizes"),
    ({"t": [["w", "float32", [4], None, None, None]]}, "rank 1 record: malformed tensor entry"),
    ({"t": [["w", "float99", [4], None, None, None, "00000000000000aa"]]}, "unknown dtype"),
    ({"k": [["w"]]}, "malformed state key entry"),
    ({"k": [["w", "zz"]]}, "malformed state key entry"),                     # typed: checked by the parse
    ({"k": [["x" * 1025, "00000000000000aa"]]}, "malformed state key entry"),
])
def test_a_record_the_typed_decode_refuses_is_refused_by_the_parse_naming_it(bad: dict[str, Any], match: str) -> None:
    recs = [record(0), {**record(1), **bad}]
    frame = protocol.encode(protocol.to_wire(protocol.Commit(step=1, digests={}, records=recs), 3))
    msg = protocol.decode_body(body(frame))
    _, commit = protocol.parse_request(msg)
    assert isinstance(commit, protocol.Commit)
    with pytest.raises(FormatError, match=match):
        parse_records(commit.records)


def test_a_commit_frame_that_is_not_json_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not JSON"):
        protocol.decode_body(b'{"op":"commit","req":1,"records":[')
