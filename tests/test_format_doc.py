"""FORMAT.md is the contract another implementation reads and writes ckptd steps from: its exact
statements (the dtype table, the digest's canonical JSON and its worked example, the hash forms)
are checked against the code they document."""
from __future__ import annotations

import hashlib
import json
import math
import re
import socket
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

import ckptd
from ckptd.core import protocol
from ckptd.core.names import HEAD_NAME, RANK_TABLE_NAME, TENSORS_NAME
from ckptd.core.rank_record import RankRecord
from ckptd.core.rank_table import parse_head, side_files
from ckptd.core.schema import DTYPE_ITEMSIZE, _canonical, digest_bytes, make_index_file, parse_index, parse_layout

FORMAT_MD = Path(__file__).resolve().parent.parent / "FORMAT.md"


def format_text() -> str:
    return FORMAT_MD.read_text(encoding="utf-8")


def test_dtype_table_is_every_stored_dtype_with_its_item_size() -> None:
    """The rank manifest's dtype table (item size | dtypes) lists exactly DTYPE_ITEMSIZE."""
    rows = re.findall(r"^  \| (\d+) \| (`[a-z0-9_]+`(?:, `[a-z0-9_]+`)*) \|$", format_text(), re.MULTILINE)
    documented: dict[str, int] = {}
    for size, names in rows:
        for name in re.findall(r"`([a-z0-9_]+)`", names):
            assert name not in documented, f"{name} listed twice"
            documented[name] = int(size)
    assert documented == DTYPE_ITEMSIZE


# ---- the index digest's canonical JSON, written from FORMAT.md's rules (no json.dumps) ----------

_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _doc_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _SHORT:
            out.append(_SHORT[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        elif ord(ch) > 0xFFFF:
            v = ord(ch) - 0x10000
            out.append(f"\\u{0xD800 + (v >> 10):04x}\\u{0xDC00 + (v & 0x3FF):04x}")
        else:
            out.append(f"\\u{ord(ch):04x}")
    return '"' + "".join(out) + '"'


def _doc_float(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    for p in range(17):                     # the fewest significant digits that read back as x
        text = f"{x:.{p}e}"
        if float(text) == x:
            break
    mantissa, exp_text = text.split("e")
    sign = "-" if mantissa.startswith("-") else ""
    digits, exp = mantissa.lstrip("-").replace(".", ""), int(exp_text)
    if -4 <= exp < 16:                      # positional, at least one digit after the point
        if exp < 0:
            whole, frac = "0", "0" * (-exp - 1) + digits
        else:
            padded = digits.ljust(exp + 1, "0")
            whole, frac = padded[:exp + 1], padded[exp + 1:]
        return f"{sign}{whole}.{frac or '0'}"
    point = f"{digits[0]}.{digits[1:]}" if len(digits) > 1 else digits
    return f"{sign}{point}e{'-' if exp < 0 else '+'}{abs(exp):02d}"


def doc_canonical(v: Any) -> str:
    if v is True or v is False or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    if type(v) is int:
        return str(v)
    if type(v) is float:
        return _doc_float(v)
    if isinstance(v, str):
        return _doc_string(v)
    if isinstance(v, list):
        return "[" + ",".join(map(doc_canonical, v)) + "]"
    assert isinstance(v, dict)
    return "{" + ",".join(f"{_doc_string(k)}:{doc_canonical(v[k])}" for k in sorted(v)) + "}"


def digest_example() -> bytes:
    """FORMAT.md's worked example: the code block after its digest-example marker, lines joined."""
    text = format_text()
    start = text.index("```\n", text.index("<!-- digest-example")) + 4
    return text[start: text.index("```", start)].replace("\n", "").encode()


def test_the_worked_digest_example_is_what_the_daemon_writes_and_reads() -> None:
    data = digest_example()
    index = parse_index(data, job="demo", step=1)          # its digest checks, by the code
    rest = {k: v for k, v in index.items() if k != "digest"}
    canonical = doc_canonical(rest).encode()
    assert canonical == _canonical(rest)
    assert len(canonical) == 379 and "sha256:" + hashlib.sha256(canonical).hexdigest() == index["digest"]
    assert index["digest"].startswith("sha256:1d6c871a") and index["digest"].endswith("b07b")
    # the file is those bytes with the digest inserted before the last brace, as make_index_file writes it
    assert data == canonical[:-1] + b',"digest":"' + index["digest"].encode() + b'"}'
    assert make_index_file(index["job"], index["step"], index["world_size"], index["ranks"], index["created_unix"],
                           index["tensors"], index["per_rank_keys"])[1] == data
    # the two misreadings FORMAT.md names hash differently
    utf8 = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert hashlib.sha256(utf8).hexdigest() != index["digest"].removeprefix("sha256:")
    assert digest_bytes(doc_canonical({**rest, "created_unix": 1796000000}).encode()) != index["digest"]


TRICKY: dict[str, Any] = {
    "b": [1.0, 0.1 + 0.2, 1e16, 1.5e16, 9999999999999998.0, 1e-5, 1.5e-5, 0.0001, -0.0, 0.0, 123456789.0, 5e-324,
          1.7976931348623157e308, -2.5e-300, float("nan"), float("inf"), -float("inf"), -12, 0, 10**30],
    "a\x7f\n\u2028é😀\"\\/\x01\x1f\b\f\r\t": True, "\uffff": None, "😀": False, "": {"z": 1, "Z": [], "é": {}},
}


def test_the_canonical_json_rules_are_the_code_s() -> None:
    """Every rule FORMAT.md states (escapes, key order, float forms, NaN tokens) gives _canonical's bytes."""
    assert doc_canonical(TRICKY).encode() == _canonical(TRICKY)


def test_head_digest_is_prefixed_and_block_hashes_bare() -> None:
    """index-head.json: `digest` and `index_digest` carry `sha256:`, `rank_blocks` and `tensors_sha256`
    are bare hex; the head's digest is over its canonical JSON, though its file is not sorted."""
    index = parse_index(digest_example(), job="demo", step=1)
    record = RankRecord(0, index["ranks"][0]["manifest_digest"], 8, 8, (), ())
    files = dict(side_files(index, [record]))
    head = json.loads(files[HEAD_NAME])
    assert head["index_digest"] == index["digest"]
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in [*head["rank_blocks"], head["tensors_sha256"]])
    assert head["tensors_sha256"] == hashlib.sha256(files[TENSORS_NAME]).hexdigest()
    assert head["rank_blocks"] == [hashlib.sha256(files[RANK_TABLE_NAME]).hexdigest()]
    rest = {k: v for k, v in head.items() if k != "digest"}
    assert head["digest"] == "sha256:" + hashlib.sha256(doc_canonical(rest).encode()).hexdigest()
    assert files[HEAD_NAME] != doc_canonical(head).encode()
    parse_head(files[HEAD_NAME], job="demo", step=1)


def test_the_save_piece_example_and_rules_are_parse_layout_s() -> None:
    """FORMAT.md's six-element `save` entry is a piece parse_layout takes; what its rules refuse, it refuses."""
    text = format_text()
    start = text.index("`", text.index("E.g. rank 1's half of a `[4, 6]` float32 tensor split by rows:") + 62) + 1
    example = json.loads(text[start: text.index("`", start)])
    (t,) = parse_layout([example], 48)
    assert t.placement is not None and t.placement.global_shape == (4, 6) and t.placement.offsets == (2, 0)
    assert t.placement.key is None and t.nbytes == 48
    name, dtype, shape, offset, nbytes, glob = example
    for bad in ([name, dtype, shape, offset, nbytes, {**glob, "other": 1}],          # no other member
                [name, dtype, shape, offset, nbytes, {**glob, "offsets": [3, 0]}],  # 3 + 2 > 4
                [name, dtype, shape, offset, nbytes, {**glob, "offsets": [2]}],     # as long as the shape
                [name, dtype, shape, offset, nbytes, {**glob, "key": "/w"}],        # key: a tensor name
                [name, dtype, shape, True, nbytes, glob],                           # integers, not booleans
                [name, dtype, shape, offset, 47, glob],                             # prod(shape) x itemsize
                [name, dtype, shape, 1, nbytes, glob]):                             # within the slot
        with pytest.raises(ValueError):
            parse_layout([bad], 48)
    with pytest.raises(ValueError):                                                  # names unique
        parse_layout([example, example], 96)
    (keyless,) = parse_layout([[name, dtype, shape, offset, nbytes, {**glob, "key": None}]], 48)
    assert keyless.placement is not None and keyless.placement.key is None


# ---- the wire protocol: request field types, fatal errors, versions ----------------------------

_TYPE_WORDS = {"str": "str", "int": "int", "float": "num", "bool": "bool", "Any": "any", "list[Any]": "array",
               "dict[str, Any]": "object"}


def test_the_request_field_types_are_parse_request_s() -> None:
    """FORMAT.md's field-type block (Fatal errors) lists every request op and field as protocol.py types it."""
    text = format_text()
    start = text.index("```\n", text.index("The types\n  (`ckptd.core.protocol`'s request classes")) + 4
    block = text[start: text.index("```", start)]
    documented: dict[str, list[str]] = {}
    op = ""
    for line in block.splitlines():
        line = line.strip()
        if not line:
            continue
        first = line.split()[0]
        if not first.endswith(":") and first != "(none)":
            op, line = first, line[len(first):].strip()
            documented[op] = []
        if line != "(none)":
            documented[op] += [f.strip() for f in line.split(",") if f.strip()]
    expected = {o: [f"{f.name}{'' if f.default is MISSING else '?'}: {_TYPE_WORDS[str(f.type)]}" for f in fields(t)]
                for o, t in protocol.REQUEST_TYPES.items()}
    assert documented == expected


def _frame(body: bytes) -> bytes:
    return protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, len(body)) + body


def _ask(sock_path: Path, data: bytes) -> tuple[dict[str, Any] | None, bool]:
    """(the daemon's first reply to ``data`` on a fresh connection, whether it then closed the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock_path))
        s.sendall(data)
        reply = protocol.FrameReceiver(s).read()
        s.settimeout(5)
        try:
            closed = s.recv(1) == b""
        except ConnectionResetError:    # (closed with bytes of ours unread, a bad header's body: a reset)
            closed = True
        except TimeoutError:
            closed = False
    return reply, closed


def test_fatal_errors_answer_req_0_and_close_and_version_is_the_package_s(daemon) -> None:
    """Against a real daemon: each documented fatal case of a request (unknown op, req missing or not an
    integer, no string op, a required field missing or mistyped) gets req 0, fatal, and the connection
    closed; an ordinary refusal keeps it; info's version is ckptd.__version__, not the protocol version."""
    fatal_bodies = [{"op": "nosuch", "req": 5}, {"op": "ok", "req": 5}, {"op": "info"}, {"op": "info", "req": 1.0},
                    {"op": "info", "req": True}, {"req": 5}, {"op": 7, "req": 5}, {"op": "flush", "req": 5, "job": "j"},
                    {"op": "abort", "req": 5, "step": 1, "reason": 3}]
    for body in fatal_bodies:
        reply, closed = _ask(daemon.socket, _frame(json.dumps(body).encode()))
        assert reply is not None and reply["op"] == "error" and reply.get("fatal") is True, (body, reply)
        assert reply["req"] == 0 and reply["code"] == "refused" and reply["reason"].startswith("protocol error: ")
        assert closed, body
    reply, closed = _ask(daemon.socket, b"XX" + _frame(b"{}")[2:])
    assert reply is not None and reply.get("fatal") is True and "not a ckptd peer" in reply["reason"] and closed
    reply, closed = _ask(daemon.socket, _frame(b'{"op": "resize", "req": 6, "slot_bytes": 1, "bogus": 1}'))
    assert reply == {"op": "error", "req": 6, "code": "refused", "reason": "send hello first"} and not closed
    reply, closed = _ask(daemon.socket, _frame(b'{"op": "info", "req": 7, "op": "nosuch"}'))   # the last key counts
    assert reply is not None and reply["op"] == "error" and reply["req"] == 0 and closed
    reply, _ = _ask(daemon.socket, _frame(b'{"op": "info", "req": 8}'))
    assert reply is not None and reply["op"] == "ok" and reply["req"] == 8
    assert reply["version"] == ckptd.__version__ and isinstance(reply["version"], str)
