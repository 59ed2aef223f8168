"""The values a relayed commit passes through the job's c10d store, encoded and decoded here only.

Three values (FORMAT.md, "Commit protocol", store keys): a rank's outcome of its save
(:class:`RankOutcome`, ``.../s<step>/r<rank>``), a node leader's record of its members' outcomes
(:class:`NodeRecord`, ``.../s<step>/n<node>``) and rank 0's verdict (:class:`StepResult`,
``.../s<step>/result``). Every rank writes and reads them (ckptd_client/relay.py), so each
``decode`` refuses, with a FormatError naming the rank or node, anything a producer here would
not have written: an unknown tag, a truncated or oversize value, a wrong type.

A durable outcome carries its rank's record as the daemon sent it with DURABLE
(``RankRecord.to_json``). Its content is ``rank_record.parse_record``'s to check, and the
daemon that commits checks it (a COMMIT's records): the relay checks only what it acts on (the
rank, the digest, the size), so rank 0 does not parse every rank's record a second time on the
commit's critical path (at 32,768 ranks that is about a second). Rank 0 decodes the node records
with msgspec straight into typed records (``rank_record.RecordWire``): the types and shapes of
4,096 node records checked in the decode, a third of ``json.loads`` and the checks after it.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .errors import FormatError
from .names import MAX_RANKS, check_digest, require, short
from .protocol import MAX_FRAME_BYTES, EventOp
from .rank_record import RecordWire

# A record larger than a COMMIT frame could never reach the daemon: such a rank sends its digest
# alone (the daemon then reads the manifests). A failure reason is cut to MAX_REASON characters.
MAX_OUTCOME_BYTES = MAX_FRAME_BYTES
MAX_REASON = 4096
_OK, _FAIL = "ok:", "fail:"
_COMMITTED, _FAILED = "committed", "failed:"


def _text(raw: bytes | str, limit: int, what: str) -> str:
    """``raw`` as text, refused when over ``limit`` bytes or not UTF-8."""
    require(isinstance(raw, (bytes, str)), f"{what}: not bytes or text but {type(raw).__name__}")
    require(len(raw) <= limit, f"{what}: {len(raw)} bytes, over the {limit}-byte limit")
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode()
    except UnicodeDecodeError as e:
        raise FormatError(f"{what}: not UTF-8 ({e.reason} at byte {e.start})") from None


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:         # truncated, or not JSON at all
        raise FormatError(f"{what}: not JSON ({e})") from None
    except RecursionError:
        raise FormatError(f"{what}: nests too deeply to parse") from None


def _outcome(rank: int) -> str:
    return f"rank {rank}'s outcome"


def _cut(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 3] + "..."


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """How one rank's save of a step went on its daemon: durable (its manifest's digest, and the
    record the commit needs when the daemon sent one) or failed (``reason``). Made by
    :meth:`ok`, :meth:`failed` or :meth:`decode`, which check what they are given."""
    digest: str | None = None                  # durable: sha256 of the rank's manifest
    # durable, from a daemon that sends records: as JSON, or typed where a node record was decoded
    record: dict[str, Any] | RecordWire | None = None
    reason: str | None = None                  # failed: why

    @property
    def durable(self) -> bool:
        return self.reason is None

    @classmethod
    def ok(cls, digest: Any, record: Any = None) -> RankOutcome:
        """Durable: the manifest's ``digest`` and, if not None, its rank record (JSON object)."""
        what = "a durable outcome"
        require(record is None or (isinstance(record, dict) and record.get("digest") == digest),
                f"{what}: its record is not an object naming digest {short(digest)}")
        return cls(check_digest(digest, what), record)

    @classmethod
    def from_event(cls, op: EventOp, event: dict[str, Any]) -> RankOutcome:
        """This rank's outcome from its daemon's DURABLE or FAILED event. Never raises: the event
        comes off the wire, on the connection's reader thread, and a malformed one is a failure."""
        try:
            if op is EventOp.FAILED:
                return cls.failed(event["reason"])
            require(op is EventOp.DURABLE, f"a {op.value} event is no outcome")
            return cls.ok(event.get("digest"), event.get("record"))
        except (FormatError, KeyError) as e:
            return cls.failed(f"its daemon's {op.value} event is malformed: {e}")

    @classmethod
    def failed(cls, reason: str) -> RankOutcome:
        return cls(reason=_cut(str(reason)))

    def encode(self) -> str:
        """The store value: ``ok:<record JSON>``, ``ok:<digest>`` or ``fail:<reason>``."""
        if self.reason is not None:
            return _FAIL + self.reason
        if self.record is not None:
            text = _OK + json.dumps(self.record, separators=(",", ":"))
            if len(text) <= MAX_OUTCOME_BYTES:    # (characters: ASCII JSON, bytes the same)
                return text
        return _OK + str(self.digest)

    @classmethod
    def decode(cls, raw: bytes | str, rank: int) -> RankOutcome:
        """Rank ``rank``'s outcome from its store value; FormatError if it is not one."""
        what = _outcome(rank)
        text = _text(raw, MAX_OUTCOME_BYTES, what)
        if text.startswith(_FAIL):
            return cls._reason(text[len(_FAIL):], rank)
        require(text.startswith(_OK), f"{what}: unknown tag in {short(text[:16])} (not ok: or fail:)")
        body = text[len(_OK):]
        return cls._durable(_json(body, what) if body.startswith("{") else body, rank)

    def to_member(self) -> dict[str, Any]:
        """This outcome as a node record lists it: ``{"ok": record or digest}`` or ``{"fail": reason}``."""
        if self.reason is not None:
            return {"fail": self.reason}
        record = msgspec.to_builtins(self.record) if isinstance(self.record, RecordWire) else self.record
        return {"ok": record if record is not None else self.digest}

    # Rank 0 runs these once per rank of the job: the checks are plain, and a message is built
    # only when one fails.

    @classmethod
    def from_member(cls, obj: Any, rank: int) -> RankOutcome:
        """Inverse of :meth:`to_member`, checked like :meth:`decode`."""
        if not (isinstance(obj, dict) and len(obj) == 1):
            raise FormatError(f"{_outcome(rank)}: not an object with one of ok, fail")
        if "ok" in obj:
            return cls._durable(obj["ok"], rank)
        if "fail" in obj:
            return cls._reason(obj["fail"], rank)
        raise FormatError(f"{_outcome(rank)}: unknown tag {short(next(iter(obj)))} (not ok or fail)")

    @classmethod
    def _reason(cls, reason: Any, rank: int) -> RankOutcome:
        if not isinstance(reason, str):
            raise FormatError(f"{_outcome(rank)}: a failure reason must be text")
        if len(reason) > MAX_REASON:
            raise FormatError(f"{_outcome(rank)}: a failure reason over {MAX_REASON} characters")
        return cls(reason=reason)

    @classmethod
    def _durable(cls, value: Any, rank: int) -> RankOutcome:
        """A durable outcome of a bare digest or of a record (a JSON object, or typed) naming ``rank``."""
        if isinstance(value, RecordWire):
            if value.rank != rank:
                raise FormatError(f"{_outcome(rank)}: its record names rank {short(value.rank)}")
            return cls(check_digest(value.digest, _outcome(rank)), value)
        if isinstance(value, dict):
            named = value.get("rank")
            if not (type(named) is int and named == rank):
                raise FormatError(f"{_outcome(rank)}: its record names rank {short(named)}")
            return cls(check_digest(value.get("digest"), _outcome(rank)), value)
        return cls(check_digest(value, _outcome(rank)))


class _Member(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """A node record's entry as msgspec decodes it: one of ``ok`` (a record or a bare digest), ``fail``."""
    ok: RecordWire | str | None = None
    fail: str | None = None


_NODE_DECODER = msgspec.json.Decoder(list[_Member])


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A node leader's record of one step: its members' outcomes, in rank order, from ``first``."""
    first: int
    outcomes: tuple[RankOutcome, ...]

    def encode(self) -> str:
        """The store value: the JSON list of the members' outcomes (``RankOutcome.to_member``)."""
        return json.dumps([o.to_member() for o in self.outcomes], separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str, ranks: range) -> NodeRecord:
        """The record of the node of ``ranks``; FormatError naming them if it is not one."""
        what = f"the node record of ranks {ranks.start}-{ranks.stop - 1}"
        require(0 < len(ranks) <= MAX_RANKS, f"{what}: not a node's ranks")
        text = _text(raw, len(ranks) * MAX_OUTCOME_BYTES, what)
        try:
            typed: list[_Member] | None = _NODE_DECODER.decode(text)
        except (msgspec.ValidationError, msgspec.DecodeError):
            typed = None        # decoded as plain JSON below, which names the fault (or takes a record as JSON)
        try:
            if typed is not None:
                require(len(typed) == len(ranks), f"lists {len(typed)} ranks, the node has {len(ranks)}")
                return cls(ranks.start, tuple(_from_typed(m, r) for r, m in zip(ranks, typed, strict=True)))
            members = _json(text, "")
            require(isinstance(members, list), "not a list")
            require(len(members) == len(ranks), f"lists {len(members)} ranks, the node has {len(ranks)}")
            return cls(ranks.start, tuple(RankOutcome.from_member(m, r) for r, m in zip(ranks, members, strict=True)))
        except FormatError as e:
            raise FormatError(f"{what}: {str(e).removeprefix(': ')}") from None


def _from_typed(m: _Member, rank: int) -> RankOutcome:
    """``RankOutcome.from_member`` of a decoded member: exactly one of ok and fail."""
    if (m.ok is None) == (m.fail is None):
        raise FormatError(f"{_outcome(rank)}: not an object with one of ok, fail")
    return RankOutcome._durable(m.ok, rank) if m.ok is not None else RankOutcome._reason(m.fail, rank)


def commit_inputs(outcomes: Sequence[RankOutcome]) -> tuple[dict[int, str], list[dict[str, Any] | RecordWire] | None]:
    """(digests by rank, records in rank order or None) of every rank's durable outcome, for the
    COMMIT; records only if every rank sent one (the daemon reads the manifests otherwise)."""
    digests: dict[int, str] = {}
    records: list[dict[str, Any] | RecordWire] | None = []
    for r, o in enumerate(outcomes):
        require(o.digest is not None, f"rank {r} failed: {o.reason}")
        digests[r] = str(o.digest)
        if o.record is None:
            records = None
        elif records is not None:
            records.append(o.record)
    return digests, records


@dataclass(frozen=True, slots=True)
class StepResult:
    """Rank 0's verdict on a step: committed (``reason`` None) or failed, and why."""
    reason: str | None = None

    @property
    def committed(self) -> bool:
        return self.reason is None

    def encode(self) -> str:
        """The store value: ``committed`` or ``failed:<reason>``."""
        return _COMMITTED if self.reason is None else _FAILED + self.reason

    @classmethod
    def decode(cls, raw: bytes | str, step: int) -> StepResult:
        what = f"the result of step {step}"
        text = _text(raw, MAX_OUTCOME_BYTES, what)
        if text == _COMMITTED:
            return cls()
        require(text.startswith(_FAILED), f"{what}: unknown value {short(text[:16])} (not committed or failed:)")
        return cls(text[len(_FAILED):])

