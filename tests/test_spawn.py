"""A daemon tied to the process that spawned it: ``Checkpointer(job, root=..., spawn=True)`` and
``ckptd.launch.spawn_daemon``. Real processes, real signals: a parent SIGKILLed takes its
daemon with it (PR_SET_PDEATHSIG), ``close()`` and interpreter exit stop it."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zygote

import ckptd_client
from ckptd.launch import spawn_daemon

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

SPAWN_PARENT = """
import sys, time, torch, ckptd_client
ck = ckptd_client.Checkpointer("nb", root=sys.argv[1], spawn=True)
ck.save(1, {"model": torch.nn.Linear(4, 4)}).wait(120)
print(ck.daemon.pid, ck.socket_path, flush=True)
time.sleep(600)
"""

LAUNCH_PARENT = """
import sys, time
from ckptd.launch import spawn_daemon
d = spawn_daemon(sys.argv[1], sys.argv[2])
print(d.proc.pid, d.socket, flush=True)
time.sleep(600)
"""

EXIT_WITHOUT_CLOSE = """
import sys, torch, ckptd_client
ck = ckptd_client.Checkpointer("nb", root=sys.argv[1], spawn=True)
ck.save(1, {"model": torch.nn.Linear(4, 4)})      # in flight when the script ends: atexit waits for it
print(ck.daemon.pid, ck.socket_path, flush=True)
"""


def gone(pid: int) -> bool:
    """The process has exited (a zombie no one reaped yet counts: it serves nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def socket_dead(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return False
    except (FileNotFoundError, ConnectionRefusedError):
        return True
    finally:
        s.close()


def start_parent(script: str, *args: str) -> tuple[zygote.Proc, int, str]:
    """The parent script running, and the (daemon pid, socket) it printed once its daemon served."""
    proc = zygote.popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout is not None
    line = proc.stdout.readline()          # bounded: the script's own waits are; pytest's timeout backs them
    if not line:
        proc.wait(60)
        pytest.fail(f"the parent exited with {proc.returncode} before its daemon served")
    pid, sock = line.split()
    return proc, int(pid), sock


def kill_parent_and_check(proc: zygote.Proc, pid: int, sock: str) -> None:
    try:
        assert not gone(pid) and not socket_dead(sock), "the daemon should serve while its parent lives"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert wait_gone(pid), f"daemon {pid} still runs 10 s after its parent was SIGKILLed"
        assert socket_dead(sock), f"{sock} still accepts connections"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_spawned_daemon_dies_with_its_sigkilled_parent(tmp: Path) -> None:
    proc, pid, sock = start_parent(SPAWN_PARENT, str(tmp / "root"))
    try:
        kill_parent_and_check(proc, pid, sock)
    finally:        # a SIGKILLed parent leaves its private directory (the daemon's log) for a post-mortem
        shutil.rmtree(Path(sock).parent, ignore_errors=True)
    assert (tmp / "root" / "nb" / "step-000000000001" / "index.json").exists()


def test_launch_spawn_daemon_dies_with_its_sigkilled_parent(tmp: Path) -> None:
    proc, pid, sock = start_parent(LAUNCH_PARENT, str(tmp / "root"), str(tmp / "d.sock"))
    kill_parent_and_check(proc, pid, sock)


def test_spawn_round_trip_and_close_stops_the_daemon(tmp: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with ckptd_client.Checkpointer("nb", root=str(tmp / "root"), spawn=True) as ck:
        assert ck.daemon is not None
        pid, private = ck.daemon.pid, ck.daemon.process.private_dir
        assert private is not None and ck.socket_path.startswith(str(private))
        ck.save(3, {"model": model}).wait(60)
        fresh = torch.nn.Linear(8, 8)
        assert ck.restore({"model": fresh}) == 3
        assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
        assert not gone(pid)
    assert wait_gone(pid, 1.0), "close() returned with the daemon still running"
    assert not private.exists(), "close() left the private socket directory behind"
    # Restores need no daemon: the root is given.
    again = torch.nn.Linear(8, 8)
    assert ckptd_client.Checkpointer("nb", root=str(tmp / "root")).restore({"model": again}, step=3) == 3
    assert torch.equal(again.weight, model.weight)


def test_interpreter_exit_waits_for_the_save_then_stops_the_daemon(tmp: Path) -> None:
    proc = zygote.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp / "root")], capture_output=True,
                      text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pid, sock = proc.stdout.split()
    assert (tmp / "root" / "nb" / "step-000000000001" / "index.json").exists()
    assert wait_gone(int(pid), 1.0) and not Path(sock).parent.exists()


def test_spawn_needs_a_root_and_no_socket(tmp: Path) -> None:
    with pytest.raises(ValueError, match="spawn=True needs root="):
        ckptd_client.Checkpointer("nb", spawn=True)
    with pytest.raises(ValueError, match="drop socket="):
        ckptd_client.Checkpointer("nb", socket=str(tmp / "d.sock"), root=str(tmp), spawn=True)
    with pytest.raises(ValueError, match="one daemon per node"):
        ckptd_client.Checkpointer("nb", root=str(tmp), spawn=True, rank=0, world_size=2)


def test_a_child_whose_parent_is_already_gone_does_not_start() -> None:
    """The check after the prctl: the parent died before the tie took effect (here: a wrong pid)."""
    out = subprocess.run([sys.executable, "-m", "ckptd.tie", "1", sys.executable, "-c", "print('started')"],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode != 0 and "started" not in out.stdout and "parent 1 is gone" in out.stderr


def test_spawn_daemon_still_stops_and_closes(tmp: Path) -> None:
    with spawn_daemon(tmp / "root", tmp / "d.sock") as d:
        assert not socket_dead(str(d.socket))
    assert gone(d.pid) and socket_dead(str(d.socket))
