"""The relay's store values (ckptd/core/relay_record.py): each round-trips, and each decode refuses
what no producer writes — truncated, oversize, wrong types, unknown tags — naming the writer.

Also the shared checks the validators are built from (ckptd/core/names.py) and the one size
parser (ckptd/core/sizes.py).
"""
from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from ckptd.core import names
from ckptd.core.codec import ChunkMeta
from ckptd.core.errors import FormatError
from ckptd.core.protocol import EventOp
from ckptd.core.rank_record import RecordWire, parse_record, parse_records, summarize
from ckptd.core.relay_record import (
    MAX_OUTCOME_BYTES,
    MAX_REASON,
    NodeRecord,
    RankOutcome,
    StepResult,
    commit_inputs,
)
from ckptd.core.schema import Manifest, TensorEntry, digest_bytes
from ckptd.core.sizes import parse_size

D0, D1 = "sha256:" + "a" * 64, "sha256:" + "b" * 64


def record(rank: int) -> dict[str, Any]:
    """A real rank record's JSON (what a daemon sends with DURABLE)."""
    w = TensorEntry("w", "float32", [4], 0, [ChunkMeta("none", 16, 16, f"{rank:016x}", [[16, "r"]])])
    m = Manifest("job", 1, rank, 2, [w], {"d": [["w", {"T": "w"}]]}, 16, 16)
    return summarize(m, digest_bytes(b"manifest %d" % rank)).to_json()


# ---- round trips ------------------------------------------------------------------------------

def test_rank_outcomes_round_trip_through_store_values_and_node_members() -> None:
    rec = record(1)
    for o in (RankOutcome.ok(D0), RankOutcome.ok(rec["digest"], rec), RankOutcome.failed("ENOSPC on /ckpt")):
        assert RankOutcome.decode(o.encode(), 1) == o
        assert RankOutcome.decode(o.encode().encode(), 1) == o          # bytes, as the store returns them
        assert RankOutcome.from_member(o.to_member(), 1) == o
    assert RankOutcome.ok(D0).encode() == f"ok:{D0}" and RankOutcome.failed("x").encode() == "fail:x"
    durable = RankOutcome.decode(RankOutcome.ok(rec["digest"], rec).encode(), 1)
    assert durable.durable and durable.record == rec and parse_record(durable.record, 1).digest == rec["digest"]


def as_json(obj: Any) -> Any:
    """``obj`` as JSON reads back (typed records' tuples as lists)."""
    return json.loads(msgspec.json.encode(obj))


def test_node_record_round_trips_and_feeds_the_commit() -> None:
    r2, r3 = record(2), record(3)
    node = NodeRecord(2, (RankOutcome.ok(r2["digest"], r2), RankOutcome.ok(r3["digest"], r3)))
    back = NodeRecord.decode(node.encode().encode(), range(2, 4))
    # Decoded typed (msgspec): the same outcomes, their records as RecordWire.
    assert all(isinstance(o.record, RecordWire) for o in back.outcomes)
    assert as_json([o.to_member() for o in back.outcomes]) == [o.to_member() for o in node.outcomes]
    digests, records = commit_inputs(back.outcomes)
    assert digests == {0: r2["digest"], 1: r3["digest"]} and as_json(records) == [r2, r3]
    assert records is not None and parse_record(records[0], 2) == parse_record(r2, 2)
    # one rank without a record: digests only (the daemon reads the manifests)
    assert commit_inputs([RankOutcome.ok(D0), RankOutcome.ok(r3["digest"], r3)]) == ({0: D0, 1: r3["digest"]}, None)
    with pytest.raises(FormatError, match="rank 1 failed: full"):
        commit_inputs([RankOutcome.ok(D0), RankOutcome.failed("full")])


def test_a_record_msgspec_refuses_is_taken_as_json_and_refused_by_the_commit_parse() -> None:
    """The typed decode is a fast path, not a new rule: a member whose record has a field of another
    type (a float size) is decoded as plain JSON, as before, and the daemon's parse refuses it."""
    r0, r1 = record(0), record(1)
    bad = {**r1, "raw": 16.0}
    back = NodeRecord.decode(_node({"ok": r0}, {"ok": bad}), range(0, 2))
    assert back.outcomes[1].record == bad and back.outcomes[0].record == r0
    _, records = commit_inputs(back.outcomes)
    with pytest.raises(FormatError, match="rank 1 record: bad sizes"):
        parse_records(records or [])


def test_step_result_round_trips() -> None:
    for r in (StepResult(), StepResult("rank 3: ENOSPC")):
        assert StepResult.decode(r.encode().encode(), 7) == r
    assert StepResult().encode() == "committed" and StepResult("x").encode() == "failed:x"
    assert StepResult.decode(b"failed:", 7).reason == ""


def test_producers_bound_what_they_write() -> None:
    long = RankOutcome.failed("x" * (MAX_REASON + 100))
    assert len(long.reason or "") == MAX_REASON and RankOutcome.decode(long.encode(), 0) == long
    rec = record(0)
    huge = {**rec, "k": [["pad", "0" * 16]] * (MAX_OUTCOME_BYTES // 20)}
    assert RankOutcome.ok(rec["digest"], huge).encode() == f"ok:{rec['digest']}"    # the digest alone fits
    with pytest.raises(FormatError, match="bad manifest digest"):
        RankOutcome.ok("sha256:short")
    with pytest.raises(FormatError, match="record is not an object naming digest"):
        RankOutcome.ok(D0, {**rec})                                    # names another digest
    with pytest.raises(FormatError, match="record is not an object naming digest"):
        RankOutcome.ok(D0, [D0])


def test_events_become_outcomes_and_never_raise() -> None:
    rec = record(0)
    assert RankOutcome.from_event(EventOp.DURABLE, {"digest": rec["digest"], "record": rec}) \
        == RankOutcome.ok(rec["digest"], rec)
    assert RankOutcome.from_event(EventOp.DURABLE, {"digest": D0}) == RankOutcome.ok(D0)
    assert RankOutcome.from_event(EventOp.FAILED, {"reason": "EIO"}) == RankOutcome.failed("EIO")
    for op, msg in ((EventOp.DURABLE, {"digest": 5}), (EventOp.DURABLE, {}), (EventOp.FAILED, {}),
                    (EventOp.COMMITTED, {"digest": D0})):
        bad = RankOutcome.from_event(op, msg)
        assert not bad.durable and f"{op.value} event is malformed" in str(bad.reason)


# ---- malformed values are refused, naming the writer ------------------------------------------

@pytest.mark.parametrize("raw, match", [
    (b"", "unknown tag"),
    (b"okay", "unknown tag"),
    (b"OK:" + D0.encode(), "unknown tag"),
    (b"committed", "unknown tag"),
    (b"ok:", "bad manifest digest"),
    (b"ok:sha256:abc", "bad manifest digest"),
    (("ok:" + D0 + "\n").encode(), "bad manifest digest"),
    (("ok:" + D0.upper()).encode(), "bad manifest digest"),
    (b'ok:{"rank":4,"digest":"', "not JSON"),                           # truncated
    (b'ok:{"rank":4', "not JSON"),
    (b"ok:{" + b"[" * 100_000, "not JSON|nests too deeply"),
    (b'ok:{"rank":5,"digest":"' + D0.encode() + b'"}', "names rank 5"),
    (b'ok:{"rank":true,"digest":"' + D0.encode() + b'"}', "names rank True"),
    (b'ok:{"rank":"4","digest":"' + D0.encode() + b'"}', "names rank '4'"),
    (b'ok:{"rank":4}', "bad manifest digest None"),
    (b'ok:{"rank":4,"digest":7}', "bad manifest digest 7"),
    (b"fail:" + b"x" * (MAX_REASON + 1), f"over {MAX_REASON} characters"),
    (b"ok:" + b"a" * MAX_OUTCOME_BYTES, "over the .*-byte limit"),            # oversize
    (b"fail:\xff\xfe", "not UTF-8"),
])
def test_malformed_rank_outcomes_are_refused(raw: bytes, match: str) -> None:
    with pytest.raises(FormatError, match=match) as e:
        RankOutcome.decode(raw, 4)
    assert str(e.value).startswith("rank 4's outcome: ")


@pytest.mark.parametrize("obj, match", [
    (None, "not an object"),
    ([D0], "not an object"),
    ({}, "not an object"),
    ({"ok": D0, "fail": "x"}, "not an object with one of"),
    ({"done": D0}, "unknown tag 'done'"),
    ({"ok": 5}, "bad manifest digest 5"),
    ({"ok": None}, "bad manifest digest None"),
    ({"ok": [D0]}, "bad manifest digest"),
    ({"ok": {"rank": 0, "digest": D0}}, "names rank 0"),
    ({"fail": 5}, "must be text"),
    ({"fail": None}, "must be text"),
    ({"fail": "x" * (MAX_REASON + 1)}, "over"),
])
def test_malformed_node_members_are_refused(obj: Any, match: str) -> None:
    with pytest.raises(FormatError, match=match) as e:
        RankOutcome.from_member(obj, 9)
    assert str(e.value).startswith("rank 9's outcome: ")


def _node(*members: Any) -> bytes:
    return json.dumps(list(members)).encode()


@pytest.mark.parametrize("raw, match", [
    (b"", "not JSON"),
    (_node({"ok": D0}, {"ok": D1})[:-3], "not JSON"),                    # truncated
    (b'{"ok": "x"}', "not a list"),
    (b'"ok:' + D0.encode() + b'"', "not a list"),
    (_node({"ok": D0}), "lists 1 ranks, the node has 2"),
    (_node({"ok": D0}, {"ok": D1}, {"ok": D1}), "lists 3 ranks, the node has 2"),
    (_node({"ok": D0}, {"okk": D1}), "rank 11's outcome: unknown tag"),
    (_node({"ok": D0}, "ok:" + D1), "rank 11's outcome: not an object"),
    (b"[" + b" " * (2 * MAX_OUTCOME_BYTES) + b"]", "over the .*-byte limit"),   # oversize
    (b"\xff[]", "not UTF-8"),
    (123, "not bytes or text"),
])
def test_malformed_node_records_are_refused(raw: Any, match: str) -> None:
    with pytest.raises(FormatError, match=match) as e:
        NodeRecord.decode(raw, range(10, 12))
    assert str(e.value).startswith("the node record of ranks 10-11: ")


@pytest.mark.parametrize("raw, match", [
    (b"", "unknown value"), (b"committed\n", "unknown value"), (b"fail:x", "unknown value"),
    (b"ok:" + D0.encode(), "unknown value"), (b"failed:" + b"x" * MAX_OUTCOME_BYTES, "over the"),
    (b"\xff", "not UTF-8"),
])
def test_malformed_step_results_are_refused(raw: bytes, match: str) -> None:
    with pytest.raises(FormatError, match=match) as e:
        StepResult.decode(raw, 12)
    assert str(e.value).startswith("the result of step 12: ")


# ---- the shared checks -------------------------------------------------------------------------

def test_shared_checks_bound_both_ends() -> None:
    assert names.is_step(0) and names.is_step(names.MAX_STEP - 1)
    for bad in (-1, names.MAX_STEP, True, 1.0, "1", None):
        assert not names.is_step(bad)
        with pytest.raises(ValueError, match=r"step must be an integer in \[0, 10\*\*12\)"):
            names.check_step(bad)
    assert names.step_dir_name(7) == "step-000000000007"
    with pytest.raises(ValueError, match="step must be"):
        names.step_dir_name(names.MAX_STEP)
    assert names.is_rank(0, 1) and names.is_rank(names.MAX_RANKS - 1, names.MAX_RANKS)
    for rank, world in ((0, 0), (1, 1), (-1, 2), (0, names.MAX_RANKS + 1), (True, 2), (0, 2.0)):
        assert not names.is_rank(rank, world)
    assert names.is_digest(D0) and not names.is_digest(D0[:-1]) and not names.is_digest(D0 + "0")
    assert names.is_checksum("0123456789abcdef") and not names.is_checksum("0123456789ABCDEF")
    assert names.is_hex("ab" * 16, 32) and names.is_hex("", 0)
    for not_hex in ("ab" * 16 + "\n", "AB" * 16, "ab" * 15, "ab" * 17, "g" * 32, "٣" * 32, b"ab" * 16, None):
        assert not names.is_hex(not_hex, 32), not_hex
    with pytest.raises(FormatError, match="manifest: bad manifest digest 'sha256:'"):
        names.check_digest("sha256:", "manifest")
    assert names.short("x" * 500).endswith("...") and len(names.short("x" * 500)) == 83


def test_one_size_parser() -> None:
    """SI units are decimal (huggingface_hub's "5GB"), IEC binary; the settings and ckptd export share it."""
    assert [parse_size(v) for v in (10, "4KiB", "1.5 GiB", "2G", "5GB", "1mb", "0", "7 b")] \
        == [10, 4096, 3 * 2**29, 2 * 10**9, 5 * 10**9, 10**6, 0, 7]
    for bad in ("x", "10 parsecs", "-1MB", "MB", True, 1.5, [1], None, -1):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="at least 1 bytes"):
        parse_size("0", minimum=1)


# ---- the relay acts on what the codec says --------------------------------------------------

def _relay_round(rank1_value: str | None = None, node1_value: str | None = None) -> tuple[Any, list[Any], list[Any]]:
    """Rank 0's relay over a HashStore, rank 1 (its own node when ``node1_value`` is set) simulated
    by values written straight into the store: (what resolved, COMMIT calls, ABORT calls)."""
    import threading
    import uuid

    import torch.distributed as dist

    from ckptd_client import store_keys
    from ckptd_client.relay import StoreRelay
    from ckptd_client.run_scope import FixedRun

    store, run = dist.HashStore(), FixedRun(uuid.uuid4().hex)
    scope = store_keys.scope("job", run.run)
    commits: list[Any] = []
    aborts: list[Any] = []
    done, resolved = threading.Event(), []

    def on_resolved(err: str | None) -> None:
        resolved.append(err)
        done.set()
    relay = StoreRelay(store, "job", 0, 2, 5.0, lambda *a: commits.append(a[:3]), lambda *a: aborts.append(a),
                       node_size=1 if node1_value is not None else 2, run=run)
    try:
        if node1_value is not None:
            store.set(store_keys.node_record(scope, 3, 1), node1_value)
        else:
            store.set(store_keys.rank_outcome(scope, 3, 1), rank1_value or "")
        relay.claim(3)
        relay.track(3, on_resolved)
        r0 = record(0)
        relay.publish(3, RankOutcome.ok(r0["digest"], r0))
        assert done.wait(30)
    finally:
        relay.close()
    return resolved[0], commits, aborts


def test_relay_commits_with_every_rank_record() -> None:
    r0, r1 = record(0), record(1)
    err, commits, aborts = _relay_round(RankOutcome.ok(r1["digest"], r1).encode())
    assert err is None and aborts == []
    assert [(s, d, as_json(r)) for s, d, r in commits] == [(3, {0: r0["digest"], 1: r1["digest"]}, [r0, r1])]


def test_relay_fails_the_save_naming_a_malformed_outcome_or_node_record() -> None:
    err, commits, aborts = _relay_round("ok:sha256:nope")
    assert commits == [] and len(aborts) == 1
    assert err == "rank 1: rank 1's outcome: bad manifest digest 'sha256:nope'" == aborts[0][1]
    err, commits, _ = _relay_round("fail:" + "x" * (MAX_REASON + 1))
    assert commits == [] and err == f"rank 1: rank 1's outcome: a failure reason over {MAX_REASON} characters"
    err, commits, _ = _relay_round(node1_value='[{"ok": "sha256:')
    assert commits == [] and str(err).startswith("the node record of ranks 1-1: not JSON")
