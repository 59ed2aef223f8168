"""What a trainer reads for the two common permission mistakes, run as a real unprivileged user
(``setpriv``, uid 1700, in no group the daemon knows; the tests run as root here and in CI):

- the socket's mode keeps the user out (EACCES): the message says the socket is there and this user
  may not connect — join its group, or ask the operator — never "start a daemon";
- the socket is open but the daemon's allowed_users / allowed_groups refuse the user: restore says
  so as the daemon said it (code ``not_allowed``), never as a failure of its bucket (it has none).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

USER = 1700          # no such user: neither the socket's group nor an allowed one

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the client as another user")

RESTORE = """
import sys, torch, ckptd_client
ck = ckptd_client.Checkpointer("j", socket=sys.argv[1], rank=0, world_size=1)
try:
    ck.restore({"w": torch.zeros(3)})
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
"""


def restore_as_user(sock: Path, tmp: Path) -> str:
    """A restore through the daemon at ``sock`` by uid/gid USER; the exception it raised, as text."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    os.chown(home, USER, USER)
    r = subprocess.run(["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups",
                        sys.executable, "-c", RESTORE, str(sock)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HOME": str(home)}, cwd=home)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@needs_root
def test_a_socket_the_user_may_not_open_says_so(daemon_factory, tmp):
    d = daemon_factory("--socket-mode", "0660")          # root's socket, group root: closed to USER
    said = restore_as_user(d.socket, tmp)
    assert f"cannot connect to the ckptd daemon's socket {d.socket}: Permission denied" in said, said
    assert f"the socket exists (mode 0660, group root) but uid {USER} may not connect to it" in said, said
    assert "usermod -aG root USER" in said and "allowed_users / allowed_groups" in said, said
    assert "Start one" not in said and "ckptd serve" not in said, said


@needs_root
def test_a_user_the_daemon_refuses_is_told_so_not_a_bucket_failure(daemon_factory, tmp):
    d = daemon_factory("--socket-mode", "0666", "--allow-group", "1500")       # no bucket configured
    said = restore_as_user(d.socket, tmp)
    assert said.startswith("DaemonRefused: ckptd refused "), said
    assert f"uid {USER} / gid {USER} is not allowed to use this ckptd daemon" in said, said
    assert "bucket" not in said, said


def test_an_older_daemons_refusal_is_not_called_a_bucket_failure(tmp):
    """A daemon of an older build refuses a user with a fatal error of code ``refused`` (``not_allowed``
    is newer): restore() said "restore from the bucket: … not allowed" of a daemon with no bucket. Any
    fatal refusal of info or stage is now raised as the daemon said it."""
    import socket
    import threading

    import ckptd_client
    from ckptd.core import framing
    from ckptd_client.errors import DaemonRefused

    path = tmp / "old.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    srv.settimeout(30)
    asked: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                head = conn.recv(framing.HEADER.size, socket.MSG_WAITALL)
                if len(head) < framing.HEADER.size:
                    continue
                body = conn.recv(framing.parse_header(head), socket.MSG_WAITALL)
                msg = framing.decode_body(body)
                asked.append(msg["op"])
                framing.send_frame(conn, {"op": "error", "req": msg.get("req", 0), "fatal": True, "code": "refused",
                                          "reason": "uid 1700 / gid 1700 is not allowed to use this ckptd daemon"})
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        ck = ckptd_client.Checkpointer("j", socket=str(path), root=str(tmp / "root"), rank=0, world_size=1)
        with pytest.raises(DaemonRefused) as got:
            ck.restore({"w": torch.zeros(3)})
        assert "is not allowed to use this ckptd daemon" in str(got.value), got.value
        assert "bucket" not in str(got.value), got.value
        assert asked and asked[0] == "info", asked
    finally:
        srv.close()


def test_no_free_slot_says_what_holds_each_slot(daemon_factory):
    """Rank 1 of a local-commit job never saves (dead): rank 0's memory-level saves of steps 1 and 2 wait
    for it in both slots, and its third save found no slot. It was told the daemon "reads none of the saves in flight
    (stopped, or stuck on its disk?)" of a healthy daemon. It is now told what holds each slot, and that a
    rank that stopped or died holds a step until the daemon's step_timeout."""
    import ckptd_client
    from ckptd_client.errors import CheckpointError

    d = daemon_factory("--step-timeout", "120s")
    ck = ckptd_client.Checkpointer("j", socket=str(d.socket), rank=0, world_size=2, commit="local",
                                   commit_timeout=3, num_slots=2)
    try:
        ck.save(1, {"w": torch.ones(1024)}, level="memory")
        ck.save(2, {"w": torch.ones(1024)}, level="memory")
        with pytest.raises(CheckpointError) as got:
            ck.save(3, {"w": torch.ones(1024)})
        said = str(got.value)
        assert said.startswith("no slot came free within 3s (commit_timeout)"), said
        for slot, step in ((0, 1), (1, 2)):
            assert f"slot {slot}: step {step} (memory-level), kept by the daemon's memory tier until a newer step " \
                "of the job commits" in said, said
        assert "a rank that stopped or died holds it until the daemon fails it (120s)" in said, said
    finally:
        ck.close(timeout=1)
