"""Security: crafted steps on disk, names and sizes on the wire, socket permissions, peer credentials,
and shared memory that never appears in /dev/shm."""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from procfd import fd_targets

import ckptd_client
from ckptd.core import protocol
from ckptd.core.errors import FormatError
from ckptd.core.reader import StepReader, verify_step
from ckptd.core.schema import digest_bytes, index_digest

from conftest import start_daemon

NOBODY = 65534
STEP = "step-000000000001"


# ---- a genuine committed step, then crafted copies of it ------------------------------------

@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Iterator[Path]:
    base = Path(f"/tmp/ckt-sec-{os.getpid()}")
    base.mkdir(exist_ok=True)
    d = start_daemon(base / "root", base / "g.sock")
    try:
        ck = ckptd_client.Checkpointer("job", socket=str(d.socket))
        ck.save(1, {"w": torch.arange(64, dtype=torch.float32), "n": 3}).wait(60)
        ck.close()
    finally:
        d.kill()
    yield base / "root" / "job" / STEP
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def step(genuine, tmp) -> Path:
    dst = tmp / "root" / "job" / STEP
    shutil.copytree(genuine, dst)
    return dst


def craft_manifest(step: Path, mutate, mutate_index=None) -> None:
    """Edit rank 0's manifest (and, with ``mutate_index``, the index) AND re-sign them in index.json,
    as an attacker with write access could."""
    m = json.loads((step / "rank-00000.json").read_text())
    mutate(m)
    data = json.dumps(m).encode()
    (step / "rank-00000.json").write_bytes(data)
    idx = json.loads((step / "index.json").read_text())
    idx["ranks"][0]["manifest_digest"] = digest_bytes(data)
    if mutate_index is not None:
        mutate_index(idx)
    idx["digest"] = index_digest(idx)          # the index digest is a checksum, not a signature
    (step / "index.json").write_text(json.dumps(idx))


def craft_index(step: Path, mutate) -> None:
    """Edit index.json and recompute its digest, as an attacker with write access could."""
    idx = json.loads((step / "index.json").read_text())
    mutate(idx)
    idx["digest"] = index_digest(idx)
    (step / "index.json").write_text(json.dumps(idx))


def restore(step: Path) -> int | None:
    ck = ckptd_client.Checkpointer("job", root=str(step.parent.parent), socket="/nonexistent/ckptd.sock")
    return ck.restore({"w": torch.zeros(64), "n": 0}, step=1)


def ckptd_verify(step: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", "verify", "-q", str(step)], capture_output=True,
                          text=True, timeout=120)


def assert_rejected(step: Path, needle: str) -> None:
    """StepReader/verify_step, restore and `ckptd verify` all refuse, naming the problem."""
    faults = verify_step(str(step))
    assert faults and any(needle in str(f) for f in faults), faults
    with pytest.raises(ckptd_client.CheckpointError, match=needle):
        restore(step)
    r = ckptd_verify(step)
    assert r.returncode == 1 and needle in r.stdout, r.stdout + r.stderr


def test_genuine_step_is_accepted(step):
    assert verify_step(str(step)) == [] and restore(step) == 1
    assert ckptd_verify(step).returncode == 0


def test_data_file_with_bytes_appended_rejected(step):
    with open(step / "rank-00000.data", "ab") as f:
        f.write(b"\x00")
    assert_rejected(step, "truncated or appended to")


@pytest.mark.parametrize("field,value", [("created_unix", 1.0), ("raw_bytes", 1), ("stored_bytes", 7),
                                         ("extra", "unknown key")])
def test_any_changed_index_field_rejected(step, field, value):
    """Every byte of index.json is covered: sizes, times and unknown keys too (not re-signed)."""
    idx = json.loads((step / "index.json").read_text())
    if field in ("raw_bytes", "stored_bytes"):
        idx["ranks"][0][field] = value
    else:
        idx[field] = value
    (step / "index.json").write_text(json.dumps(idx))
    assert_rejected(step, "digest mismatch")


@pytest.mark.parametrize("name, needle", [
    ("../../../etc/passwd", "'..' path segment"),
    ("/etc/passwd", "leading '/'"),
    ("a/./b", "'.'"),
    ("w\x00x", "NUL"),
    ("", "invalid tensor name"),
])
def test_crafted_tensor_name_rejected(step, name, needle):
    craft_manifest(step, lambda m: m["tensors"][0].update(name=name))
    assert_rejected(step, needle)


def test_manifest_digest_mismatch_rejected(step):
    data = (step / "rank-00000.json").read_bytes().replace(b'"tree":', b'"tree" :')
    (step / "rank-00000.json").write_bytes(data)          # not re-signed
    assert_rejected(step, "manifest digest does not match index.json")


def test_index_naming_another_job_or_step_rejected(step):
    craft_index(step, lambda i: i.update(job="../other"))
    assert_rejected(step, "index names job/step")


def test_index_rank_list_mismatch_rejected(step):
    craft_index(step, lambda i: i.update(world_size=2))
    assert_rejected(step, "index must list every rank exactly once")


def test_manifest_for_another_rank_rejected(step):
    craft_manifest(step, lambda m: m.update(rank=1))
    assert_rejected(step, "manifest names job/step/rank")


def test_chunk_lengths_inconsistent_rejected(step):
    craft_manifest(step, lambda m: m["tensors"][0]["chunks"][0].__setitem__(2, 2**62))
    assert_rejected(step, "chunk segments do not add up")


def test_symlinked_index_not_followed(step, tmp):
    outside = tmp / "outside-index.json"
    shutil.copy(step / "index.json", outside)
    (step / "index.json").unlink()
    os.symlink(outside, step / "index.json")
    faults = verify_step(str(step))
    assert faults and "Too many levels of symbolic links" in str(faults[0])
    with pytest.raises(ckptd_client.CheckpointError, match="symbolic links"):
        restore(step)


def test_symlinked_data_file_not_followed(step, tmp):
    outside = tmp / "outside.data"
    shutil.copy(step / "rank-00000.data", outside)
    (step / "rank-00000.data").unlink()
    os.symlink(outside, step / "rank-00000.data")
    faults = verify_step(str(step))
    assert faults and "Too many levels of symbolic links" in str(faults[0])
    with pytest.raises((ckptd_client.CheckpointError, OSError), match="symbolic links"):
        restore(step)


def test_symlinked_step_directory_not_listed(step, tmp):
    from ckptd.core.reader import list_steps
    os.symlink(step, step.parent / "step-000000000002")
    assert [s.step for s in list_steps(str(step.parent))] == [1]


def test_oversized_index_and_manifest_rejected_by_ckptd_verify(step):
    """Size limits: an index over 64 MiB / a manifest over 256 MiB is refused before it is read.
    (Sparse files: nothing big is written.)"""
    os.truncate(step / "index.json", 65 * 2**20)
    r = ckptd_verify(step)
    assert r.returncode == 1 and "exceeds the 67108864-byte limit" in r.stdout, r.stdout + r.stderr


def test_oversized_index_and_manifest_are_format_errors(step):
    os.truncate(step / "rank-00000.json", 257 * 2**20)
    assert_rejected(step, "exceeds the 268435456-byte limit")
    os.truncate(step / "index.json", 65 * 2**20)
    assert_rejected(step, "exceeds the 67108864-byte limit")
    with pytest.raises(FormatError, match="exceeds the 67108864-byte limit"):
        StepReader(str(step))


def test_crafted_data_file_path_rejected(step):
    craft_manifest(step, lambda m: m.update(data_file="../../../../etc/passwd"))
    assert_rejected(step, "data_file")


# ---- the wire: names and sizes --------------------------------------------------------------

def hello(s: socket.socket, rx: protocol.FrameReceiver, job: str, slot_bytes: int = 0, num_slots: int = 1) -> dict:
    """A raw HELLO as rank 0 of 1 (``num_slots`` slots of ``slot_bytes``, none without); its reply. The
    slots' memfds it lends are closed at once: the wire tests write none of them."""
    protocol.send_frame(s, {"op": "hello", "req": 1, "job": job, "rank": 0, "world_size": 1, "pid": os.getpid(),
                            "slot_bytes": slot_bytes, "num_slots": num_slots if slot_bytes else 0})
    reply = rx.read()
    assert reply is not None, "daemon closed the connection"
    if reply["op"] == "ok":
        for fd in rx.take_fds(len(reply.get("slots", []))):
            os.close(fd)
    return reply


@pytest.mark.parametrize("job", ["../etc", ".hidden", "a/b", "x" * 200, ""])
def test_bad_job_names_refused_on_the_wire(daemon, job):
    s = protocol.connect(str(daemon.socket))
    try:
        reply = hello(s, protocol.FrameReceiver(s), job)
        assert reply["op"] == "error" and "invalid job name" in reply["reason"]
    finally:
        s.close()
    assert not any(p.name != "" for p in daemon.root.iterdir()) if daemon.root.exists() else True


@pytest.mark.parametrize("name", ["../../escape", "/abs", "a//b", "a/../b"])
def test_bad_tensor_names_refused_on_the_wire(daemon, name):
    s = protocol.connect(str(daemon.socket))
    rx = protocol.FrameReceiver(s)
    try:
        assert hello(s, rx, "names", slot_bytes=4096)["op"] == "ok"
        protocol.send_frame(s, {"op": "save", "req": 2, "step": 1, "slot": 0, "commit": "local", "tree": {},
                                "tensors": [[name, "float32", [1], 0, 4]]})
        reply = rx.read()
        assert reply["op"] == "error" and "invalid tensor name" in reply["reason"]
    finally:
        s.close()
    assert not (daemon.root / "names").exists()


def test_a_layout_is_checked_in_full_after_a_valid_one_on_the_same_connection(daemon):
    """The daemon reuses a session's last parsed layout for an equal tensor list (session.LayoutMemo):
    a list of the same length that differs is still checked, and refused."""
    s = protocol.connect(str(daemon.socket))
    rx = protocol.FrameReceiver(s)
    try:
        assert hello(s, rx, "memo", slot_bytes=4096, num_slots=2)["op"] == "ok"
        good = [["w", "float32", [1], 0, 4], ["v", "float32", [2], 8, 8]]
        protocol.send_frame(s, {"op": "save", "req": 2, "step": 1, "slot": 0, "commit": "local", "tree": {},
                                "tensors": good})
        assert _reply(rx, 2)["op"] == "ok"
        for req, (bad, needle) in enumerate([([["w", "float32", [1], 0, 4], ["../v", "float32", [2], 8, 8]],
                                              "invalid tensor name"),
                                             ([["w", "float32", [1], 0, 4], ["v", "float32", [2], 4090, 8]],
                                              "outside the slot"),
                                             ([["w", "float32", [1], 0, 4], ["w", "float32", [2], 8, 8]],
                                              "duplicate")], start=3):
            protocol.send_frame(s, {"op": "save", "req": req, "step": req, "slot": 1, "commit": "local",
                                    "tree": {}, "tensors": bad})
            reply = _reply(rx, req)
            assert reply["op"] == "error" and needle in reply["reason"], reply
    finally:
        s.close()
    for step in (3, 4, 5):
        assert not (daemon.root / "memo" / f"step-{step:012d}").exists()


def _reply(rx: protocol.FrameReceiver, req: int) -> dict:
    """The reply to request ``req`` (events the daemon sends meanwhile are passed over)."""
    while True:
        msg = rx.read()
        assert msg is not None, "daemon closed the connection"
        if msg.get("req") == req:
            return msg


def test_oversized_frame_refused(daemon):
    s = protocol.connect(str(daemon.socket))
    try:
        s.sendall(protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, protocol.MAX_FRAME_BYTES + 1))
        reply = protocol.FrameReceiver(s).read()
        assert reply["op"] == "error" and reply.get("fatal") and "exceeds" in reply["reason"]
        assert s.recv(1) == b""                       # and the connection is closed
    finally:
        s.close()
    assert "protocol error" in daemon.log_text()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _sent_and_read(s: socket.socket, timeout: float = 30.0) -> None:
    """Until the daemon has read every byte sent on ``s`` (the socket's unread send queue is empty)."""
    deadline = time.monotonic() + timeout
    while struct.unpack("i", fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]:
        assert time.monotonic() < deadline, "the daemon did not read what was sent"
        time.sleep(0.02)


def test_frame_headers_alone_make_the_daemon_allocate_nothing_big(daemon):
    """A header claiming 16 MiB and one body byte, on each of many idle connections, must not make the
    daemon hold 16 MiB per connection: the body's buffer grows with the bytes that arrive."""
    n = 16
    probe = protocol.connect(str(daemon.socket))
    rx = protocol.FrameReceiver(probe)
    protocol.send_frame(probe, {"op": "status", "req": 1})
    assert _reply(rx, 1)["op"] == "ok"
    before = _rss_bytes(daemon.pid)
    socks = []
    try:
        for _ in range(n):
            s = protocol.connect(str(daemon.socket))
            socks.append(s)
            s.sendall(protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, protocol.MAX_FRAME_BYTES) + b"{")
        for s in socks:
            _sent_and_read(s)            # the daemon has the header and the byte, and waits for the rest
        grown = _rss_bytes(daemon.pid) - before
        assert grown < n * protocol.MAX_FRAME_BYTES // 8, f"daemon RSS grew {grown >> 20} MiB for {n} bare headers"
        protocol.send_frame(probe, {"op": "status", "req": 2})
        assert _reply(rx, 2)["op"] == "ok"       # and it serves others meanwhile
    finally:
        for s in socks + [probe]:
            s.close()


def test_a_client_stalled_inside_a_frame_is_disconnected_and_an_idle_one_is_not(daemon_factory):
    d = daemon_factory("--debug-frame-timeout", "1")
    idle = protocol.connect(str(d.socket))
    idle_rx = protocol.FrameReceiver(idle)
    stalled = protocol.connect(str(d.socket))
    try:
        stalled.settimeout(60)
        stalled.sendall(protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 100) + b'{"op":')
        reply = protocol.FrameReceiver(stalled).read()
        assert reply["op"] == "error" and reply.get("fatal") and "did not arrive within 1 s" in reply["reason"]
        assert stalled.recv(1) == b""                  # and the connection is closed
        assert "stalled inside a frame" in d.log_text()
        torn = protocol.connect(str(d.socket))         # stalled inside a header (3 of its 8 bytes): the same
        try:
            torn.settimeout(60)
            torn.sendall(protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 100)[:3])
            reply = protocol.FrameReceiver(torn).read()
            assert reply["op"] == "error" and reply.get("fatal") and "did not arrive within 1 s" in reply["reason"]
            assert torn.recv(1) == b""
        finally:
            torn.close()
        idle.settimeout(60)                            # idle between frames for longer than the deadline: served
        protocol.send_frame(idle, {"op": "status", "req": 1})
        assert _reply(idle_rx, 1)["op"] == "ok"
    finally:
        stalled.close()
        idle.close()


# ---- socket permissions and peer credentials --------------------------------------------------

def test_socket_mode_and_group(daemon_factory):
    d = daemon_factory()
    st = os.stat(d.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    d2 = daemon_factory("--socket-mode", "0600", "--socket-group", str(NOBODY), name="g")
    st = os.stat(d2.socket)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_gid == NOBODY


def _connect_as(path: Path, uid: int, gid: int, groups: list[int], use_client: bool = False) -> dict:
    """Fork; the child drops to uid/gid/groups, connects and says hello; returns what it saw."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                       # child: no pytest, no torch, just the protocol
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                if use_client:
                    from ckptd_client.connection import DaemonConnection
                    conn = DaemonConnection(str(path), lambda op, msg: None)
                    result = conn.request({"op": "hello", "job": "peer", "rank": 0, "world_size": 1,
                                           "pid": os.getpid(), "slot_bytes": 0, "num_slots": 0})
                else:
                    s = protocol.connect(str(path))
                    rx = protocol.FrameReceiver(s)
                    result = hello(s, rx, "peer")
            except ckptd_client.CheckpointError as e:
                result = {"op": "CheckpointError", "reason": str(e)}
            except Exception as e:
                result = {"op": "exception", "reason": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch users")


@needs_root
def test_peer_not_allowed_is_refused_and_logged(daemon_factory):
    # 0666 so the file system lets nobody reach the socket: the credential check must refuse it
    d = daemon_factory("--socket-mode", "0666", "--allow-user", "root")
    reply = _connect_as(d.socket, NOBODY, NOBODY, [])
    assert reply["op"] == "error", reply
    assert f"uid {NOBODY} / gid {NOBODY} is not allowed" in reply["reason"]
    assert "allowed_users / allowed_groups" in reply["reason"]
    assert "refused peer pid=" in d.log_text() and f"uid={NOBODY}" in d.log_text()


@needs_root
def test_refused_peers_are_each_counted_and_logged_rate_limited(daemon_factory):
    """300 connections of a user not allowed: each refused and counted (ckptd_peers_refused_total), one
    'refused peer' line per uid a minute, not 300."""
    import urllib.request
    d = daemon_factory("--socket-mode", "0666", "--allow-user", "root", "--metrics-address", "0")
    address = protocol.request_once(str(d.socket), {"op": "status"})["metrics"]
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for _ in range(300):
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(d.socket))
                    s.shutdown(socket.SHUT_WR)    # no request: the daemon closes it at once
                    while s.recv(65536):
                        pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)

    def refused() -> float:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
            line = next(x for x in r.read().decode().splitlines() if x.startswith("ckptd_peers_refused_total "))
        return float(line.split()[1])
    deadline = time.monotonic() + 30
    while refused() < 300 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refused() == 300
    lines = [x for x in d.log_text().splitlines() if "refused peer" in x]
    assert 1 <= len(lines) < 10, lines


@needs_root
def test_refused_peer_gets_clear_client_error(daemon_factory):
    """The client library's connection, run as nobody, raises a CheckpointError that says why."""
    d = daemon_factory("--socket-mode", "0666", "--allow-user", "root")
    reply = _connect_as(d.socket, NOBODY, NOBODY, [], use_client=True)
    assert reply["op"] == "CheckpointError", reply
    assert "ckptd refused hello" in reply["reason"] and "is not allowed to use this ckptd daemon" in reply["reason"]


@needs_root
def test_allowed_by_user_primary_group_or_supplementary_group(daemon_factory):
    d = daemon_factory("--socket-mode", "0666", "--allow-user", str(NOBODY), name="u")
    assert _connect_as(d.socket, NOBODY, NOBODY, [])["op"] == "ok"
    d = daemon_factory("--socket-mode", "0666", "--allow-group", "4242", name="g")
    assert _connect_as(d.socket, NOBODY, 4242, [])["op"] == "ok"               # primary gid
    assert _connect_as(d.socket, NOBODY, NOBODY, [4242])["op"] == "ok"         # supplementary (SO_PEERGROUPS)
    assert _connect_as(d.socket, NOBODY, NOBODY, [4243])["op"] == "error"


@needs_root
def test_restrictive_socket_mode_keeps_other_users_out(daemon):
    reply = _connect_as(daemon.socket, NOBODY, NOBODY, [])
    assert reply["op"] == "exception" and "Permission denied" in reply["reason"]


# ---- shared memory ------------------------------------------------------------------------------

def test_slots_are_anonymous_memfds_never_in_dev_shm(daemon):
    before = set(os.listdir("/dev/shm"))
    ck = ckptd_client.Checkpointer("shm", socket=str(daemon.socket))
    ck.save(1, {"w": torch.randn(256, 256)}).wait(60)
    try:
        links = fd_targets(daemon.proc.pid)
        slots = [ln for ln in links if ln.startswith("/memfd:ckptd-shm-r0-")]
        assert len(slots) >= 1, links                 # the slots exist, as memfds ...
        assert all("(deleted)" in ln for ln in slots)  # ... with no name in any file system
        new = set(os.listdir("/dev/shm")) - before
        assert not [n for n in new if "ckptd" in n or "shm-r0" in n], new
    finally:
        ck.close()


def _hello_and_commit(sock: str, job: str, data: bytes) -> tuple[socket.socket, int]:
    """A raw client's hello (one slot of len(data) bytes), the slot filled with ``data`` and saved and
    committed as step 1; (its connection, its slot's descriptor)."""
    c = protocol.connect(sock)
    rx = protocol.FrameReceiver(c)
    c.settimeout(30)
    protocol.send_frame(c, {"op": "hello", "req": 1, "job": job, "rank": 0, "world_size": 1, "pid": os.getpid(),
                            "slot_bytes": len(data), "num_slots": 1})
    assert rx.read()["op"] == "ok"
    slot = rx.take_fds(1)[0]
    with mmap.mmap(slot, len(data)) as mm:
        mm[:] = data
    protocol.send_frame(c, {"op": "save", "req": 2, "step": 1, "slot": 0, "commit": "local", "tree": {"T": "w"},
                            "tensors": [["w", "uint8", [len(data)], 0, len(data)]]})
    while True:
        m = rx.read()
        if m["op"] == "durable":
            protocol.send_frame(c, {"op": "commit", "req": 3, "step": 1, "digests": {"0": m["digest"]}})
        if m["op"] in ("committed", "failed"):
            assert m["op"] == "committed", m
            return c, slot


def test_a_client_cannot_resize_its_slot_or_write_a_held_shard(daemon_factory):
    """A slot is passed read-write, but its size is sealed: a client that shrank its slot would have the
    daemon's writer read past the end and die of SIGBUS (every user's saves with it). A held shard is
    passed read-only to a restoring client: it can neither write into nor resize what other restores read."""
    d = daemon_factory("--memory-steps", "1", "--memory-budget", str(64 << 20))
    data = os.urandom(1 << 20)
    c, slot = _hello_and_commit(str(d.socket), "sealed", data)
    with pytest.raises(PermissionError):
        os.ftruncate(slot, 0)
    with pytest.raises(PermissionError):
        os.ftruncate(slot, 2 << 20)
    assert os.fstat(slot).st_size == 1 << 20
    e = protocol.connect(str(d.socket))
    erx = protocol.FrameReceiver(e)
    e.settimeout(30)
    protocol.send_frame(e, {"op": "memory_fetch", "req": 1, "job": "sealed", "rank": 0, "world_size": 1, "step": 1})
    assert erx.read()["op"] == "ok"
    held = erx.take_fds(1)[0]
    assert fcntl.fcntl(held, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    with pytest.raises(OSError):
        os.ftruncate(held, 0)
    with pytest.raises(OSError):
        os.pwrite(held, b"x", 0)
    assert os.pread(held, len(data), 0) == data
    for fd in (slot, held):
        os.close(fd)
    e.close()
    c.close()
    # The daemon is alive and serves: a real save and restore through it.
    ck = ckptd_client.Checkpointer("after", socket=str(d.socket))
    w = torch.randn(64, 64)
    ck.save(1, {"w": w}).wait(60)
    out = {"w": torch.zeros(64, 64)}
    ck.restore(out, 1)
    ck.close()
    assert torch.equal(out["w"], w) and d.proc.poll() is None


def test_a_commit_naming_other_digests_than_the_shards_durable_here_is_refused(daemon):
    """Rank 0's COMMIT for step 5 with step 4's digest and record (and no manifest read back: check=[]):
    the daemon saw rank 0's step 5 shard become durable with another digest, so it refuses, and step 5
    stays uncommitted; with its own digest it commits."""
    import threading

    from ckptd_client.connection import DaemonConnection

    n = 1 << 20
    events: list[dict] = []
    arrived = threading.Condition()

    def on_event(_op, msg):
        with arrived:
            events.append(msg)
            arrived.notify_all()

    def durable(step: int) -> dict:
        with arrived:
            assert arrived.wait_for(lambda: any(e["op"] == "durable" and e["step"] == step for e in events), 60)
            return next(e for e in events if e["op"] == "durable" and e["step"] == step)

    conn = DaemonConnection(str(daemon.socket), on_event=on_event)
    try:
        r = conn.request(protocol.Hello(job="digests", rank=0, world_size=1, pid=os.getpid(), slot_bytes=n,
                                        num_slots=2))
        maps = [mmap.mmap(fd, n) for fd in r["_fds"]]
        for fd in r["_fds"]:
            os.close(fd)
        for step, slot in ((4, 0), (5, 1)):
            maps[slot][:n] = bytes([step]) * n
            conn.request(protocol.Save(step=step, slot=slot, tensors=[["w", "uint8", [n], 0, n]],
                                       tree={"d": [["w", {"T": "w"}]]}, commit="relay"))
        d4, d5 = durable(4), durable(5)
        assert d4["digest"] != d5["digest"]
        conn.request(protocol.Commit(step=4, digests={"0": d4["digest"]}, records=[d4["record"]]))
        with pytest.raises(RuntimeError, match="not those of their shards durable here"):
            conn.request(protocol.Commit(step=5, digests={"0": d4["digest"]}, records=[d4["record"]], check=[]))
        assert not (daemon.root / "digests" / "step-000000000005" / "index.json").exists()
        conn.request(protocol.Commit(step=5, digests={"0": d5["digest"]}, records=[d5["record"]], check=[]))
        assert verify_step(str(daemon.root / "digests" / "step-000000000005")) == []
        for m in maps:
            m.close()
    finally:
        conn.close()


def test_a_relayed_step_handed_off_is_not_saved_again_under_its_commit(daemon_factory, tmp):
    """Two daemons on one root: rank 1's shard of relayed step 5 is durable on daemon B, which hands the
    step to rank 0's daemon A and forgets it. A second SAVE of step 5 by rank 1 used to be taken: B
    truncated rank-00001.data and rewrote it while A's commit published the index over it. It is refused;
    the commit of the first attempt's files verifies; after an ABORT of the step, a retry may save it."""
    import threading

    from ckptd_client.connection import DaemonConnection

    root = tmp / "root"
    a, b = daemon_factory(root=root, name="a"), daemon_factory(root=root, name="b")
    n = 1 << 20

    class Rank:
        def __init__(self, sock, rank):
            self.events: list[dict] = []
            self.cv = threading.Condition()
            self.conn = DaemonConnection(str(sock), on_event=self.on_event)
            r = self.conn.request(protocol.Hello(job="handed", rank=rank, world_size=2, pid=os.getpid(),
                                                 slot_bytes=n, num_slots=3))
            self.maps = [mmap.mmap(fd, n) for fd in r["_fds"]]
            for fd in r["_fds"]:
                os.close(fd)

        def on_event(self, _op, msg):
            with self.cv:
                self.events.append(msg)
                self.cv.notify_all()

        def save(self, step, slot, byte):
            self.maps[slot][:n] = bytes([byte]) * n
            return self.conn.request(protocol.Save(step=step, slot=slot, tensors=[["w", "uint8", [n], 0, n]],
                                                   tree={"d": [["w", {"T": "w"}]]}, commit="relay"))

        def durable(self, step):
            with self.cv:
                assert self.cv.wait_for(lambda: any(e["op"] == "durable" and e["step"] == step for e in self.events),
                                        60)
                return next(e for e in self.events if e["op"] == "durable" and e["step"] == step)

    r1, r0 = Rank(b.socket, 1), Rank(a.socket, 0)
    try:
        r1.save(5, 0, 0x11)
        d1 = r1.durable(5)
        r0.save(5, 0, 0x00)
        d0 = r0.durable(5)
        with pytest.raises(RuntimeError, match="handed to rank 0's daemon"):
            r1.save(5, 1, 0x22)
        r0.conn.request(protocol.Commit(step=5, digests={"0": d0["digest"], "1": d1["digest"]},
                                        records=[d0["record"], d1["record"]], check=[0, 1]))
        assert verify_step(str(root / "handed" / "step-000000000005")) == []
        r1.save(6, 1, 0x33)
        r1.durable(6)
        r1.conn.request(protocol.Abort(step=6, reason="rank 0 failed"))
        r1.save(6, 2, 0x44)                     # the step failed: a retry may save it again
        r1.durable(6)
    finally:
        for r in (r0, r1):
            for m in r.maps:
                m.close()
            r.conn.close()


def test_a_step_directory_planted_as_a_symlink_is_never_written_or_read_through(daemon_factory, tmp):
    """<root>/<job>/step-N planted as a symlink to a directory outside the root: the save wrote its data,
    manifest and index.json there through the link and reported committed; ckptd ls hid the step, and
    restore(step=N) read it back through the link. The save now fails, naming the link, nothing is
    written outside, and a reader refuses the link."""
    import torch

    import ckptd_client
    d = daemon_factory()
    outside = tmp / "outside"
    outside.mkdir()
    (d.root / "lnk").mkdir(parents=True)
    link = d.root / "lnk" / "step-000000000003"
    link.symlink_to(outside)
    ck = ckptd_client.Checkpointer("lnk", socket=str(d.socket))
    ck.save(1, {"w": torch.arange(4.0)}).wait(60)
    with pytest.raises(ckptd_client.CheckpointError, match="a symlink where a step's"):
        ck.save(3, {"w": torch.arange(4.0)}).wait(60)
    ck.save(4, {"w": torch.arange(4.0) + 4}).wait(60)
    ck.close()
    assert list(outside.iterdir()) == [] and link.is_symlink()
    for name in ("rank-00000.data", "rank-00000.json", "index.json"):    # a step written there by other means
        (outside / name).write_bytes(b"{}")
    reader = ckptd_client.Checkpointer("lnk", root=str(d.root), memory=False, prepare=False)
    with pytest.raises(ckptd_client.CheckpointError, match="a symlink, not a step directory"):
        reader.restore({"w": torch.zeros(4)}, step=3)
