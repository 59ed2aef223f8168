"""Fuzzing with hypothesis: hostile bytes and messages on the daemon's socket, hostile index and
manifest files on disk.

The wire half talks raw frames to ONE real daemon for the whole module (a subprocess on a unix
socket, like tests/conftest.py's daemons). After every example the daemon must still be the same
process and answer; every hostile request gets a well-formed error reply (fatal ones close only
that connection); nothing is ever written outside the daemon's root; and a well-behaved
ckptd_client saves and restores through the same daemon in the same test. The daemon's log
must show no unhandled exception.

The disk half copies a genuine committed step and breaks it in every way hypothesis finds:
the readers (StepReader, its manifests and tensors, verify_step, `ckptd verify`) must answer
with FormatError/ValueError (ChecksumError for tensor bytes), never anything else, never hang
on a FIFO and never read through a link that leads out of the step directory.
"""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ckptd_client
from ckptd import cli
from ckptd.core import names as ck_names
from ckptd.core import protocol
from ckptd.core.errors import ChecksumError, FormatError
from ckptd.core.names import INDEX_NAME
from ckptd.core.reader import StepReader, latest_committed, list_steps, split_step_path, verify_step
from ckptd.core.schema import digest_bytes, index_digest, parse_index, parse_manifest
from ckptd.core.tree import decode_tree

from conftest import REPO, start_daemon

HANG_GUARD_S = 60.0
SLOT_BYTES = 4096
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                database=None)


# ---- one daemon for the module ------------------------------------------------------------

@pytest.fixture(scope="module")
def fd_daemon():
    base = Path(f"/tmp/ckf-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    base.mkdir()
    d = start_daemon(base / "root", base / "d.sock", "--slot-memory-limit-mib", "64", "--step-timeout", "30")
    d.base = base  # type: ignore[attr-defined]  # test-only attributes on the launcher's handle
    assert protocol.request_once(str(d.socket), {"op": "info"})["pid"] == d.pid   # the exec'd daemon keeps the pid
    yield d
    d.kill()
    shutil.rmtree(base, ignore_errors=True)


def assert_daemon_healthy(d) -> None:
    assert d.proc.poll() is None, f"daemon died:\n{d.log_text()[-4000:]}"
    assert protocol.request_once(str(d.socket), {"op": "info"})["pid"] == d.pid


# The daemon's refusal of a malformed request: its line echoes the input (escaped), which the fuzzer
# may well have made of these very markers (hypothesis draws strings from the test's own constants).
_REFUSAL = re.compile(r"^\S+ +warning +protocol error ")


def assert_clean_log(d) -> None:
    text = d.log_text()
    own = "\n".join(line for line in text.splitlines() if not _REFUSAL.match(line))
    for marker in ("Traceback", "exception was never retrieved", "Exception in callback", "Logging error",
                   "request failed", "internal daemon error", "timed-out step failed"):
        assert marker not in own, f"daemon log shows an unhandled error:\n{text[-6000:]}"


def assert_nothing_outside_root(d) -> None:
    """Everything the daemon wrote is <root>/<valid job>/step-<12 digits>/<its own file names>."""
    job_re = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
    file_re = re.compile(r"(rank-[0-9]{5}\.(data|json)|index\.json)(\.tmp\.[0-9]+(\.[0-9]+)?)?")   # names.temp_name
    assert sorted(p.name for p in d.base.iterdir()) == ["d.log", "d.sock", "root"]
    for job in (d.base / "root").iterdir():
        assert job.is_dir() and job_re.fullmatch(job.name), job
        for step in job.iterdir():
            assert re.fullmatch(r"step-[0-9]{12}", step.name), step
            try:    # the daemon may be removing a failed step's directory right now
                files = list(step.iterdir())
            except FileNotFoundError:
                continue
            for f in files:
                assert file_re.fullmatch(f.name) and (f.is_file() or not f.exists()), f


def well_behaved_round_trip(d, job: str) -> None:
    ck = ckptd_client.Checkpointer(job, socket=str(d.socket))
    try:
        state: dict[str, Any] = {"w": torch.randn(257), "i": torch.arange(5), "note": "fine"}
        step = (ck.latest_step() or 0) + 1
        ck.save(step, state).wait(HANG_GUARD_S)
        back: dict[str, Any] = {"w": torch.zeros(257), "i": torch.zeros(5, dtype=torch.int64), "note": None}
        assert ck.restore(back, step=step) == step
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["i"], state["i"]) and back["note"] == "fine"
    finally:
        ck.close()


# ---- raw frames --------------------------------------------------------------------------------

def frame(msg: object, *, magic: bytes = protocol.MAGIC, version: int = protocol.PROTOCOL_VERSION,
          length: int | None = None) -> bytes:
    body = msg if isinstance(msg, bytes) else json.dumps(msg, allow_nan=True).encode()
    return protocol.HEADER.pack(magic, version, len(body) if length is None else length) + body


def parse_replies(buf: bytes) -> list[dict]:
    """The daemon's replies: every one must be a well-formed frame holding a JSON object."""
    out = []
    while buf:
        assert len(buf) >= protocol.HEADER.size, f"daemon sent a truncated header {buf!r}"
        magic, version, length = protocol.HEADER.unpack(buf[:protocol.HEADER.size])
        assert magic == protocol.MAGIC and version == protocol.PROTOCOL_VERSION
        body = buf[protocol.HEADER.size: protocol.HEADER.size + length]
        assert len(body) == length, "daemon sent a truncated body"
        msg = json.loads(body)
        assert isinstance(msg, dict) and isinstance(msg.get("op"), str), msg
        out.append(msg)
        buf = buf[protocol.HEADER.size + length:]
    return out


def exchange(d, *chunks: bytes) -> list[dict]:
    """Send raw bytes on a fresh connection, half-close, read every reply until the daemon closes."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(HANG_GUARD_S)
    s.connect(str(d.socket))
    try:
        for data in chunks:
            try:
                s.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                break          # the daemon already closed on a fatal error; its reply is buffered
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while True:
            try:
                data, anc, _flags, _addr = s.recvmsg(1 << 20, socket.CMSG_SPACE(16 * 4))
            except ConnectionResetError:
                break
            for level, kind, payload in anc:   # close any slot fds a hello handed over
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    for fd in struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4]):
                        os.close(fd)
            if not data:
                break
            buf += data
    finally:
        s.close()
    return parse_replies(buf)


def session(d, *msgs: dict, job: str = "fuzz", hello: bool = True) -> list[dict]:
    """A valid hello (slots of SLOT_BYTES), then ``msgs``, each followed by an ``info`` probe that
    proves the connection still works; returns the replies to requests (hello's first), in order,
    without the events (slot_free, durable, ...) that may come in between."""
    out = []
    if hello:
        out.append(frame({"op": "hello", "req": 1, "job": job, "rank": 0, "world_size": 1, "pid": 1,
                          "slot_bytes": SLOT_BYTES, "num_slots": 2}))
    for m in msgs:
        out.append(frame(m))
        out.append(frame({"op": "info", "req": 999_999}))
    return [r for r in exchange(d, *out) if r["op"] in ("ok", "error")]


def assert_error(reply: dict, *needles: str, fatal: bool = False) -> None:
    assert reply["op"] == "error", reply
    assert isinstance(reply.get("reason"), str) and reply["reason"], reply
    assert len(reply["reason"]) < 5000, "error text must stay bounded"
    if needles:
        assert any(n in reply["reason"] for n in needles), (needles, reply["reason"])
    assert bool(reply.get("fatal")) == fatal, reply


def assert_probe_ok(reply: dict, d) -> None:
    assert reply["op"] == "ok" and reply["req"] == 999_999 and reply["pid"] == d.pid, reply


# ---- strategies ------------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)

HOSTILE_NAMES = ["../x", "a/../../b", "..", ".", "/etc/passwd", "a//b", "a/", "x\x00y", "\x00",
                 "a\\..\\b", "", "x" * 1025, "/", "./a", "a/./b"]
hostile_names = st.one_of(st.sampled_from(HOSTILE_NAMES),
                          st.builds(lambda a, b: f"{a}/../{b}", st.text(max_size=5), st.text(max_size=5)),
                          st.text(max_size=10).map(lambda t: t + "\x00"),
                          st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2))
HOSTILE_JOBS = ["../x", "a/../../b", "..", ".", ".hidden", "-x", "_x", "a/b", "x\x00", "job\n", "jöb", "a b",
                "x" * 129, "", "\n", "ジョブ", "job/", "C:\\x", "٣"]
hostile_jobs = st.one_of(st.sampled_from(HOSTILE_JOBS), st.integers(), st.none(),
                         st.text(min_size=1, max_size=40).filter(
                             lambda s: not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", s)))
bad_ints = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**31), st.just(2**63), st.just(10**30))
big_ints = st.sampled_from([10**400, -10**400, 2**1024, 10**4000])     # beyond any float
non_ints = st.one_of(st.floats(), st.text(max_size=5), st.none(), st.booleans(), st.lists(st.integers(), max_size=2))


def good_tensor(name: str = "w") -> list:
    return [name, "float32", [4], 0, 16]


def save_msg(**over) -> dict:
    msg = {"op": "save", "req": 7, "step": 1, "slot": 0, "tensors": [good_tensor()], "tree": {"T": "w"},
           "commit": "local"}
    msg.update(over)
    return msg


@st.composite
def hostile_tensor(draw) -> list:
    """A tensor entry with exactly one thing wrong with it."""
    name, dtype, shape, offset, nbytes = good_tensor()
    kind = draw(st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "entry", "consistency"]))
    if kind == "name":
        name = draw(hostile_names)
    elif kind == "dtype":
        dtype = draw(st.one_of(st.text(max_size=10).filter(lambda s: s not in protocol_dtypes()), non_ints))
    elif kind == "shape":
        shape = draw(st.one_of(
            st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
            st.lists(st.one_of(st.floats(), st.text(max_size=2), st.booleans(), st.none()), min_size=1, max_size=3),
            st.lists(st.integers(0, 1), min_size=65, max_size=70),
            st.just([[4]]), json_scalars))
    elif kind == "offset":
        offset = draw(st.one_of(st.integers(max_value=-1), st.integers(SLOT_BYTES - 15, 2**80), non_ints))
    elif kind == "nbytes":
        nbytes = draw(st.one_of(st.integers().filter(lambda n: n != 16), non_ints))
    elif kind == "consistency":       # big shape, honest nbytes, far outside the slot
        dims = draw(st.lists(st.integers(1, 2**40), min_size=1, max_size=4))
        assume(math.prod(dims) * 4 > SLOT_BYTES)
        shape, nbytes = dims, math.prod(dims) * 4
    else:
        return draw(st.one_of(json_scalars, st.lists(json_scalars, max_size=7).filter(lambda v: len(v) != 5)))
    return [name, dtype, shape, offset, nbytes]


def protocol_dtypes() -> set[str]:
    from ckptd.core.schema import DTYPE_ITEMSIZE
    return set(DTYPE_ITEMSIZE)


# ---- the wire: framing -------------------------------------------------------------------------------

@FUZZ
@given(magic=st.binary(min_size=2, max_size=2).filter(lambda m: m != protocol.MAGIC), body=st.binary(max_size=64))
def test_bad_magic(fd_daemon, magic, body):
    replies = exchange(fd_daemon, frame(body, magic=magic))
    assert len(replies) == 1
    assert_error(replies[0], "bad frame magic", fatal=True)
    assert_daemon_healthy(fd_daemon)


@FUZZ
@given(version=st.integers(0, 65535).filter(lambda v: v != protocol.PROTOCOL_VERSION))
def test_wrong_version(fd_daemon, version):
    replies = exchange(fd_daemon, frame({"op": "info", "req": 1}, version=version))
    assert len(replies) == 1
    assert_error(replies[0], "unsupported protocol version", fatal=True)
    assert_daemon_healthy(fd_daemon)


@FUZZ
@given(length=st.integers(protocol.MAX_FRAME_BYTES + 1, 2**32 - 1), tail=st.binary(max_size=32))
def test_huge_declared_length(fd_daemon, length, tail):
    replies = exchange(fd_daemon, frame(tail, length=length))
    assert len(replies) == 1
    assert_error(replies[0], "exceeds", fatal=True)
    assert_daemon_healthy(fd_daemon)


@FUZZ
@given(msg=st.sampled_from([{"op": "info", "req": 1}, {"op": "status", "req": 2},
                            save_msg(), {"op": "hello", "req": 1, "job": "j", "rank": 0, "world_size": 1,
                                         "pid": 1, "slot_bytes": 0, "num_slots": 0}]),
       data=st.data())
def test_truncated_frames(fd_daemon, msg, data):
    whole = frame(msg)
    cut = data.draw(st.integers(1, len(whole) - 1))
    replies = exchange(fd_daemon, whole[:cut])
    assert len(replies) == 1
    assert_error(replies[0], "closed inside a frame", fatal=True)
    assert_daemon_healthy(fd_daemon)


def test_empty_connection_gets_no_reply(fd_daemon):
    assert exchange(fd_daemon) == []
    assert_daemon_healthy(fd_daemon)


@FUZZ
@given(body=st.binary(max_size=200))
def test_non_json_bodies(fd_daemon, body):
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        parsed = None
    assume(not isinstance(parsed, dict))
    replies = exchange(fd_daemon, frame(body))
    assert len(replies) == 1
    assert_error(replies[0], "not JSON", "JSON object", fatal=True)
    assert_daemon_healthy(fd_daemon)


@FUZZ
@given(value=json_values.filter(lambda v: not isinstance(v, dict)))
def test_json_non_objects(fd_daemon, value):
    replies = exchange(fd_daemon, frame(value))
    assert len(replies) == 1
    assert_error(replies[0], "JSON object", fatal=True)
    assert_daemon_healthy(fd_daemon)


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_deeply_nested_json_body(fd_daemon, depth):
    for body in (b"[" * depth + b"]" * depth, b'{"op":"info","req":1,"x":' + b"[" * depth + b"]" * depth + b"}"):
        replies = exchange(fd_daemon, frame(body))
        assert len(replies) == 1
        assert_error(replies[0], "nests too deeply", fatal=True)
    assert_daemon_healthy(fd_daemon)


@FUZZ
@given(op=st.one_of(st.text(max_size=30).filter(lambda o: o not in protocol.REQUEST_FIELDS),
                    st.sampled_from(["__init__", "_op_info", "ok", "error", "durable", "committed", "x" * 100_000,
                                     "\x00" * 100_000])),
       extra=st.dictionaries(st.text(max_size=5), json_scalars, max_size=3))
def test_unknown_ops(fd_daemon, op, extra):
    replies = exchange(fd_daemon, frame({**extra, "op": op, "req": 1}))
    assert len(replies) == 1
    assert_error(replies[0], "unknown request op", fatal=True)
    assert_daemon_healthy(fd_daemon)


@FUZZ
@given(op=st.sampled_from(sorted(protocol.REQUEST_FIELDS)), data=st.data())
def test_wrong_field_types(fd_daemon, op, data):
    hello = {"job": "j", "rank": 0, "world_size": 1, "pid": 1, "slot_bytes": 0, "num_slots": 0}
    goods: dict[str, dict[str, Any]] = {
        "hello": hello, "resize": {"slot_bytes": 4096}, "save": save_msg(), "commit": {"step": 1, "digests": {}},
        "abort": {"step": 1, "reason": "r"}, "report": {"step": 1, "stall_s": 0.1, "fence_s": 0.0},
        "info": {}, "status": {}, "stage": {"job": "j", "step": None},
        "flush": {"job": "j", "step": None, "timeout": 1.0},
        "memory_fetch": {"job": "j", "rank": 0, "world_size": 1}, "reclaim": {},
        "save_part": {"step": 1, "slot": 0, "part": 1}, "save_filled": {"step": 1, "upto": 4096}}
    good = goods[op]
    msg = {**good, "op": op, "req": 1}
    fields = sorted(protocol.REQUEST_FIELDS[op]) + ["req"]
    field = data.draw(st.sampled_from(fields))
    typ = protocol.REQUEST_FIELDS[op].get(field, int)
    if typ == protocol.REQUEST_FIELDS["save"]["tree"] or data.draw(st.booleans()):   # any JSON value is valid
        del msg[field]
    else:
        msg[field] = data.draw(json_values.filter(
            lambda v: not isinstance(v, typ) or (typ is int and isinstance(v, bool))))
    replies = exchange(fd_daemon, frame(msg))
    assert len(replies) == 1
    assert_error(replies[0], repr(field) if field != "req" else "'req'", fatal=True)
    assert_daemon_healthy(fd_daemon)


# ---- the wire: hostile values in well-formed requests ---------------------------------------------------

@FUZZ
@given(job=hostile_jobs)
def test_hostile_job_names_refused(fd_daemon, job):
    h = {"op": "hello", "req": 1, "job": job, "rank": 0, "world_size": 1, "pid": 1,
         "slot_bytes": SLOT_BYTES, "num_slots": 1}
    if not isinstance(job, str):
        replies = exchange(fd_daemon, frame(h))
        assert_error(replies[0], "'job'", fatal=True)
    else:
        replies = session(fd_daemon, h, hello=False)
        assert_error(replies[0], "invalid job name")
        assert_probe_ok(replies[1], fd_daemon)
    assert_daemon_healthy(fd_daemon)
    assert_nothing_outside_root(fd_daemon)


@FUZZ
@given(field=st.sampled_from(["rank", "world_size", "slot_bytes", "num_slots"]), data=st.data())
def test_hostile_hello_values_then_a_good_hello(fd_daemon, field, data):
    value = {"rank": st.one_of(st.integers(max_value=-1), st.integers(min_value=1)),
             "world_size": st.one_of(st.integers(max_value=0), st.integers(min_value=2**20 + 1)),
             # (more than the budget is no refusal: the daemon lends smaller slots, test_slot_pool)
             "slot_bytes": st.integers(max_value=-1),
             "num_slots": st.one_of(st.integers(max_value=0), st.integers(min_value=9))}[field]
    bad = {"op": "hello", "req": 1, "job": "fuzz-hello", "rank": 0, "world_size": 1, "pid": 1,
           "slot_bytes": SLOT_BYTES, "num_slots": 1, field: data.draw(value)}
    if field == "rank":
        bad["world_size"] = 1 if bad["rank"] >= 0 else 4
    good = {**bad, field: {"rank": 0, "world_size": 1, "slot_bytes": SLOT_BYTES, "num_slots": 1}[field], "req": 2}
    if field == "rank":
        good["world_size"] = 1
    replies = session(fd_daemon, bad, good, hello=False)
    assert_error(replies[0])
    assert_probe_ok(replies[1], fd_daemon)
    assert replies[2]["op"] == "ok" and replies[2]["req"] == 2, replies[2]   # a failed hello leaves no half session
    assert_daemon_healthy(fd_daemon)
    assert protocol.request_once(str(fd_daemon.socket), {"op": "status"})["slot_bytes_in_use"] == 0


@FUZZ
@given(tensor=hostile_tensor())
def test_hostile_tensor_layouts_refused(fd_daemon, tensor):
    replies = session(fd_daemon, save_msg(tensors=[tensor]), job="fuzz-layout")
    assert replies[0]["op"] == "ok"
    assert_error(replies[1])
    assert_probe_ok(replies[2], fd_daemon)
    assert_daemon_healthy(fd_daemon)
    assert_nothing_outside_root(fd_daemon)


@FUZZ
@given(kind=st.sampled_from(["slot", "step", "commit", "duplicate", "tensors", "deep-tree"]), data=st.data())
def test_hostile_save_fields_refused(fd_daemon, kind, data):
    if kind == "slot":
        msg = save_msg(slot=data.draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=2))))
    elif kind == "step":
        msg = save_msg(step=data.draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=10**12))))
    elif kind == "commit":
        msg = save_msg(commit=data.draw(st.text(max_size=10).filter(lambda c: c not in protocol.COMMIT_MODES)))
    elif kind == "duplicate":
        msg = save_msg(tensors=[good_tensor(), good_tensor()])
    elif kind == "tensors":
        msg = save_msg(tensors=[good_tensor(), data.draw(hostile_tensor())])
    else:
        # Over the limit, but well under Python's recursion limit for json.dumps in this process.
        depth = data.draw(st.integers(ck_names.MAX_TREE_DEPTH + 1, ck_names.MAX_TREE_DEPTH + 100))
        tree: object = "leaf"
        for _ in range(depth):
            tree = [tree]
        msg = save_msg(tree=tree)
    replies = session(fd_daemon, msg, job="fuzz-save")
    assert replies[0]["op"] == "ok"
    assert_error(replies[1])
    assert_probe_ok(replies[2], fd_daemon)
    assert_daemon_healthy(fd_daemon)
    assert_nothing_outside_root(fd_daemon)


@FUZZ
@given(msg=st.one_of(
    st.builds(lambda r, s: {"op": "resize", "req": 3, "slot_bytes": r, "num_slots": s},
              st.one_of(st.integers(max_value=-1), st.integers(min_value=65 * 2**20)), json_scalars),
    st.builds(lambda d: {"op": "commit", "req": 3, "step": 1, "digests": d},
              st.dictionaries(st.text(max_size=5), json_scalars, max_size=3)),
    st.builds(lambda s, r: {"op": "abort", "req": 3, "step": s, "reason": r},
              st.integers(-2**70, 2**70), st.text(max_size=3000)),
    st.builds(lambda s, a, b: {"op": "report", "req": 3, "step": s, "stall_s": a, "fence_s": b},
              st.integers(-2**70, 2**70), st.one_of(st.floats(), st.integers(-10**400, 10**400), big_ints),
              st.one_of(st.floats(), st.integers(-10**400, 10**400), big_ints))))
def test_hostile_other_requests(fd_daemon, msg):
    replies = session(fd_daemon, msg, job="fuzz-other")
    assert replies[0]["op"] == "ok"
    assert replies[1]["op"] in ("ok", "error") and replies[1].get("req") == 3 and not replies[1].get("fatal"), replies
    assert_probe_ok(replies[2], fd_daemon)
    assert_daemon_healthy(fd_daemon)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(tensors=st.lists(st.one_of(hostile_tensor(), st.builds(good_tensor, st.text(min_size=1, max_size=8))),
                        min_size=1, max_size=4),
       tree=json_values, step=st.integers(-5, 10**12 + 5), slot=st.integers(-1, 2))
def test_random_saves_accepted_only_when_sound(fd_daemon, tensors, tree, step, slot):
    """Anything goes; whatever the daemon accepts must be sound, and is written as a real step."""
    replies = session(fd_daemon, save_msg(tensors=tensors, tree=tree, step=step, slot=slot), job="fuzz-rand")
    assert replies[0]["op"] == "ok"
    if replies[1]["op"] == "ok":
        assert 0 <= step < 10**12 and slot in (0, 1)
        names = [t[0] for t in tensors]
        assert len(set(names)) == len(names)
        for name, _dtype, _shape, offset, nbytes in tensors:
            ck_names.validate_tensor_name(name)
            assert 0 <= offset and offset + nbytes <= SLOT_BYTES
    else:
        assert_error(replies[1])
    assert_probe_ok(replies[-1], fd_daemon)
    assert_daemon_healthy(fd_daemon)
    assert_nothing_outside_root(fd_daemon)


def test_enormous_tree_commits_and_reads_back(fd_daemon):
    """A ~12 MiB state tree (frames are limited to 16 MiB) goes through and reads back."""
    tree = {"d": [["blob", {"l": ["x" * 1000 + str(i) for i in range(12_000)]}], ["w", {"T": "w"}]]}
    s = protocol.connect(str(fd_daemon.socket))
    s.settimeout(HANG_GUARD_S)
    try:
        rx = protocol.FrameReceiver(s)
        protocol.send_frame(s, {"op": "hello", "req": 1, "job": "fuzz-big", "rank": 0, "world_size": 1,
                                "pid": 1, "slot_bytes": SLOT_BYTES, "num_slots": 1})
        assert rx.read()["op"] == "ok"
        for fd in rx.take_fds(1):
            os.close(fd)
        protocol.send_frame(s, save_msg(tree=tree, step=1))
        events: list[dict | None] = []
        while not events or events[-1]["op"] not in ("committed", "failed"):
            events.append(rx.read())
        assert events[0]["op"] == "ok" and events[-1]["op"] == "committed", events
    finally:
        s.close()
    step = fd_daemon.base / "root" / "fuzz-big" / "step-000000000001"
    assert verify_step(str(step)) == []
    assert StepReader(str(step)).manifest(0).tree == tree
    assert_daemon_healthy(fd_daemon)


def test_daemon_survived_everything_and_serves_a_client(fd_daemon):
    """Runs last in this module: the same daemon still serves a real client, logged no crash."""
    well_behaved_round_trip(fd_daemon, "fuzz-client")
    assert_daemon_healthy(fd_daemon)
    assert_nothing_outside_root(fd_daemon)
    assert_clean_log(fd_daemon)


# ---- on disk: hostile index and manifest files ---------------------------------------------------------

@pytest.fixture(scope="module")
def genuine_step(fd_daemon) -> Path:
    ck = ckptd_client.Checkpointer("src", socket=str(fd_daemon.socket))
    state = {"f32": torch.randn(3000), "bf16": torch.randn(64).to(torch.bfloat16), "i64": torch.arange(70),
             "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5), "meta": {"lr": 0.1, "names": ["a", "b"]}}
    ck.save(1, state).wait(HANG_GUARD_S)
    ck.close()
    path = fd_daemon.base / "root" / "src" / "step-000000000001"
    assert verify_step(str(path)) == []
    return path


@pytest.fixture(scope="module")
def disk_area(fd_daemon, genuine_step):
    area = Path(f"/tmp/ckd-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    area.mkdir()
    # A byte-identical copy of the genuine step OUTSIDE every crafted step directory: reading
    # it through a link would succeed, so a reader that follows links is caught.
    decoy = area / "outside" / "src" / "step-000000000001"
    shutil.copytree(genuine_step, decoy)
    yield area, decoy
    shutil.rmtree(area, ignore_errors=True)


class Crafted:
    counter = 0

    def __init__(self, area: Path, genuine: Path) -> None:
        Crafted.counter += 1
        self.path = area / f"c{Crafted.counter}" / "src" / "step-000000000001"
        shutil.copytree(genuine, self.path)

    def manifest(self) -> dict:
        return json.loads((self.path / "rank-00000.json").read_bytes())

    def write_manifest(self, data: bytes, sign: bool = True) -> None:
        (self.path / "rank-00000.json").write_bytes(data)
        if sign:   # re-sign in index.json, as an attacker with write access would, so parsing is reached
            idx = json.loads((self.path / INDEX_NAME).read_bytes())
            idx["ranks"][0]["manifest_digest"] = digest_bytes(data)
            idx["digest"] = index_digest(idx)
            (self.path / INDEX_NAME).write_bytes(json.dumps(idx).encode())

    def cleanup(self) -> None:
        shutil.rmtree(self.path.parent.parent, ignore_errors=True)


def exercise_readers(path: Path) -> str:
    """Run every reader over a step; returns "ok" or the clean error's message. Anything but
    FormatError/ValueError (ChecksumError for tensor bytes) fails the test."""
    # verify_step reports faults, never raises; the CLI says OK or lists faults.
    faults = verify_step(str(path))
    assert isinstance(faults, list)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["verify", "-q", str(path)])
    assert rc == (1 if faults else 0), out.getvalue()
    try:
        reader = StepReader(str(path))
        for rank in range(min(reader.world_size, 4)):
            m = reader.manifest(rank)
            fd = reader.open_data(rank)
            tensors = {}
            try:
                for entry in m.tensors:
                    if entry.nbytes > 64 * 2**20:
                        continue
                    buf = bytearray(entry.nbytes)
                    try:
                        reader.read_tensor_into(fd, entry, memoryview(buf))
                    except ChecksumError as e:
                        return f"checksum: {e}"
                    tensors[entry.name] = bytes(buf)
            finally:
                os.close(fd)

            def lookup(name: str, tensors: dict[str, bytes] = tensors) -> bytes:
                if name not in tensors:
                    raise FormatError(f"tree names unknown tensor {name!r}")
                return tensors[name]
            decode_tree(m.tree, lookup)
    except ValueError as e:          # FormatError is a ValueError
        assert str(e)
        return f"error: {e}"
    assert not faults, faults
    return "ok"


hostile_values = st.one_of(json_values, st.integers(0, 20), st.sampled_from(
    ["../../outside/src/step-000000000001/rank-00000.data", "/etc/passwd", "a/../../b", "x\x00",
     -1, 2**63, 10**30, -(2**63), float("nan"), float("inf"), True, [], {}, [[]], "", "DEEP",
     # plausible values in the wrong place: dtypes, codecs, segment kinds of other tensors
     "int32", "int16", "uint16", "float16", "bfloat16", "float32", "int64", "bool", "float8_e4m3fn",
     "bplane", "zstd", "none", "z", "r", [[0, "r"]], [[1, "z"]]]))


def all_paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from all_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            yield from all_paths(v, prefix + (i,))


def pick_path(data, obj):
    """A path into ``obj``, drawn so that every kind of place (top-level field, tensor field, chunk,
    chunk field, segment, ...) is as likely as any other, however many of each there are."""
    groups: dict = {}
    for path in all_paths(obj):
        key = (len(path),) + tuple(p for p in path if isinstance(p, str))
        groups.setdefault(key, []).append(path)
    key = data.draw(st.sampled_from(sorted(groups, key=repr)))
    return data.draw(st.sampled_from(groups[key]))


def mutate(obj, path, value, delete: bool):
    # A private copy: sampled values are shared objects ([[0, "r"]], {}, ...) that a later
    # mutation could otherwise write into, changing the strategy itself between examples.
    value = copy.deepcopy(value)
    if not path:
        return value
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


def dumps_with_deep(obj) -> bytes:
    text = json.dumps(obj, allow_nan=True)
    return text.replace('"DEEP"', "[" * 5000 + "]" * 5000).encode()


DISK = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture],
                database=None)


@DISK
@given(data=st.data())
def test_hostile_manifests(disk_area, genuine_step, data):
    area, _ = disk_area
    c = Crafted(area, genuine_step)
    try:
        m = c.manifest()
        for _ in range(data.draw(st.integers(1, 2))):
            m = mutate(m, pick_path(data, m), data.draw(hostile_values), delete=data.draw(st.booleans()))
        c.write_manifest(dumps_with_deep(m))
        exercise_readers(c.path)
    finally:
        c.cleanup()


def test_a_manifest_offset_past_what_a_file_can_hold_is_refused(disk_area, genuine_step):
    """Found by test_hostile_manifests: an entry at byte 2**63 reached os.preadv (OverflowError)."""
    area, _ = disk_area
    c = Crafted(area, genuine_step)
    try:
        m = c.manifest()
        m["tensors"][0]["offset"] = 2 ** 63
        c.write_manifest(dumps_with_deep(m))
        with pytest.raises(FormatError, match="past byte"):
            StepReader(str(c.path)).manifest(0, check_map=False)
        exercise_readers(c.path)
    finally:
        c.cleanup()


@DISK
@given(data=st.data())
def test_inconsistent_chunk_metadata(disk_area, genuine_step, data):
    """Metadata that parses but contradicts itself (codec vs dtype, segment count and kinds,
    lengths), on stored bytes whose checksums still match: decoding gets as far as it can."""
    from ckptd.core.schema import DTYPE_ITEMSIZE
    area, _ = disk_area
    c = Crafted(area, genuine_step)
    try:
        m = c.manifest()
        t = data.draw(st.sampled_from([t for t in m["tensors"] if t["chunks"]]))
        chunk = t["chunks"][0]           # [codec, raw_len, stored_len, checksum, segments]
        for what in data.draw(st.lists(st.sampled_from(["codec", "dtype", "segments", "kinds", "lengths",
                                                        "not-a-list", "huge"]),
                                       min_size=1, max_size=3, unique=True)):
            if what == "codec":
                chunk[0] = data.draw(st.sampled_from(["none", "zstd", "bplane"]))
            elif what == "dtype":
                size = DTYPE_ITEMSIZE[t["dtype"]]
                t["dtype"] = data.draw(st.sampled_from(sorted(k for k, v in DTYPE_ITEMSIZE.items() if v == size)))
            elif what == "segments":
                n = data.draw(st.integers(0, 9))
                total = chunk[2]
                k = max(n - 1, 0)
                cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=k, max_size=k)))
                bounds = [0] + cuts + [total]
                chunk[4] = [[b - a, data.draw(st.sampled_from("zr"))]
                            for a, b in zip(bounds, bounds[1:], strict=False)] if n else []
                if not n:
                    chunk[2] = 0
            elif what == "huge":         # claims 2**42+ bytes: no reader may try to allocate them
                size = DTYPE_ITEMSIZE[t["dtype"]]
                t["shape"], t["chunks"] = [2**42], [chunk]
                chunk[1] = chunk[2] = 2**42 * size
                k = size if chunk[0] == "bplane" else 1
                chunk[4] = [[chunk[1] // k, "r"]] * k
                if chunk[0] == "zstd":
                    chunk[0] = "none"
            elif what == "not-a-list":
                t["chunks"] = data.draw(st.one_of(json_scalars, st.dictionaries(st.text(max_size=3), json_scalars)))
            elif what == "kinds":
                chunk[4] = [[n, data.draw(st.sampled_from("zr"))] for n, _ in chunk[4]]
            else:
                chunk[1] = data.draw(st.integers(0, 2 * chunk[1] + 8))
        c.write_manifest(json.dumps(m).encode())
        exercise_readers(c.path)
    finally:
        c.cleanup()


@DISK
@given(data=st.data())
def test_hostile_index(disk_area, genuine_step, data):
    area, _ = disk_area
    c = Crafted(area, genuine_step)
    try:
        how = data.draw(st.sampled_from(["mutate", "bytes", "json"]))
        if how == "mutate":
            idx = json.loads((c.path / INDEX_NAME).read_bytes())
            idx = mutate(idx, pick_path(data, idx), data.draw(hostile_values),
                         delete=data.draw(st.booleans()))
            blob = dumps_with_deep(idx)
        elif how == "bytes":
            blob = data.draw(st.binary(max_size=300))
        else:
            blob = dumps_with_deep(data.draw(json_values))
        (c.path / INDEX_NAME).write_bytes(blob)
        result = exercise_readers(c.path)
        if how != "mutate":
            assert result.startswith("error"), result
    finally:
        c.cleanup()


@DISK
@given(raw=st.binary(max_size=400), sign=st.booleans())
def test_garbage_manifest_bytes(disk_area, genuine_step, raw, sign):
    area, _ = disk_area
    c = Crafted(area, genuine_step)
    try:
        c.write_manifest(raw, sign=sign)
        assert exercise_readers(c.path).startswith("error")
    finally:
        c.cleanup()


@pytest.mark.parametrize("victim", [INDEX_NAME, "rank-00000.json", "rank-00000.data"])
@pytest.mark.parametrize("kind", ["symlink-out", "symlink-abs", "fifo", "directory", "missing", "empty"])
def test_files_that_are_not_plain_files(disk_area, genuine_step, victim, kind):
    """Links out of the step (to a byte-identical copy: following them would succeed), FIFOs
    (opening one would hang), directories, missing and empty files: all clean errors."""
    area, decoy = disk_area
    c = Crafted(area, genuine_step)
    try:
        target = c.path / victim
        target.unlink()
        if kind == "symlink-out":
            os.symlink(os.path.relpath(decoy / victim, c.path), target)
        elif kind == "symlink-abs":
            os.symlink(decoy / victim, target)
        elif kind == "fifo":
            os.mkfifo(target)
        elif kind == "directory":
            target.mkdir()
        elif kind == "empty":
            target.write_bytes(b"")
        result = exercise_readers(c.path)
        assert result.startswith(("error", "checksum")), result
        if kind in ("fifo", "symlink-out"):       # and the real command line, in its own process
            r = subprocess.run([sys.executable, "-m", "ckptd", "verify", "-q", str(c.path)], cwd=REPO,
                               capture_output=True, text=True, timeout=HANG_GUARD_S)
            assert r.returncode == 1 and "FAULT" in r.stdout, r.stdout + r.stderr
    finally:
        c.cleanup()


def test_data_file_field_never_followed(disk_area, genuine_step):
    """A manifest naming a data file outside the step, with the step's own data file gone:
    the reader uses rank-00000.data only, so it fails rather than reading the decoy."""
    area, decoy = disk_area
    c = Crafted(area, genuine_step)
    try:
        m = c.manifest()
        m["data_file"] = os.path.relpath(decoy / "rank-00000.data", c.path)
        c.write_manifest(json.dumps(m).encode())
        (c.path / "rank-00000.data").unlink()
        assert exercise_readers(c.path).startswith("error")
    finally:
        c.cleanup()


@pytest.mark.parametrize("name", ["step-000000000001\n", "step-" + "\u0661" * 12, "step-1", "step-0000000000001",
                                  "step-00000000000a", "step-000000000001/..", ".."])
def test_hostile_step_directory_names(disk_area, genuine_step, name):
    area, _ = disk_area
    job = area / "names" / "src"
    job.mkdir(parents=True, exist_ok=True)
    path = job / name
    if name not in ("step-000000000001/..", ".."):
        shutil.copytree(genuine_step, path)
    try:
        with pytest.raises(FormatError):
            split_step_path(str(path))
        with pytest.raises(FormatError):
            StepReader(str(path))
        assert [s.path for s in list_steps(str(job))] == []
        assert latest_committed(str(job)) is None
    finally:
        shutil.rmtree(area / "names", ignore_errors=True)


@settings(max_examples=150, deadline=None, database=None)
@given(obj=json_values, job=st.sampled_from(["src", "x"]), step=st.integers(0, 3), rank=st.integers(0, 2))
def test_parsers_on_arbitrary_json(obj, job, step, rank):
    data = json.dumps(obj, allow_nan=True).encode()
    for parse in (lambda: parse_manifest(data, job=job, step=step, rank=rank),
                  lambda: parse_index(data, job=job, step=step)):
        with pytest.raises(FormatError):
            parse()
