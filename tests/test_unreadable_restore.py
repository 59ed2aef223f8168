"""A restore that names no step, run by a user who cannot read the newest step's directory (a trainer
not in the daemon's group, a step directory left root-only by a copy): it used to take the newest
step it *could* read — resuming the run from the past, its saves then ranked below the step it
missed — or, with none readable, return None (a fresh start). It now raises, naming the directory,
the reason and the step it could take explicitly; ``restore(step=N)`` still restores that one.

Run as a real unprivileged user (``setpriv``, uid 1700); the tests run as root here and in CI.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptd_client
from ckptd.core.names import step_dir

USER = 1700

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the client as another user")

RESTORE = """
import sys, torch, ckptd_client
step = None if sys.argv[3] == "-" else int(sys.argv[3])
ck = ckptd_client.Checkpointer("j", root=sys.argv[1], socket=sys.argv[2], rank=0, world_size=1, memory=False)
state = {"w": torch.zeros(4)}
try:
    got = ck.restore(state, step=step)
    print("restored", got, state["w"].tolist())
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
"""


def restore_as_user(root: Path, sock: Path, tmp: Path, step: int | None = None) -> str:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    os.chown(home, USER, USER)
    r = subprocess.run(["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", sys.executable, "-c",
                        RESTORE, str(root), str(sock), "-" if step is None else str(step)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(home)}, cwd=home)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def open_to_all(path: Path) -> None:
    subprocess.run(["chmod", "-R", "a+rX", str(path)], check=True)


@needs_root
@pytest.mark.parametrize("older", [True, False], ids=["an-older-step-readable", "none-readable"])
def test_a_newest_step_the_user_cannot_read_is_an_error_not_an_older_step(daemon_factory, tmp, older):
    d = daemon_factory("--socket-mode", "0666", "--allow-group", str(USER), "--allow-group", "0")
    with ckptd_client.Checkpointer("j", socket=str(d.socket), rank=0, world_size=1) as ck:
        if older:
            ck.save(1, {"w": torch.full((4,), 1.0)}).wait(60)
        ck.save(2, {"w": torch.full((4,), 2.0)}).wait(60)
    open_to_all(d.root)
    newest = Path(step_dir(str(d.root), "j", 2))
    os.chmod(newest, 0o700)                      # root's only: uid 1700 cannot look inside
    said = restore_as_user(d.root, d.socket, tmp)
    assert said.startswith("CheckpointError: "), said
    assert f"{newest} cannot be read (EACCES: Permission denied) by uid {USER}" in said, said
    assert "does not pick an older one (or none) by itself" in said, said
    if older:
        assert "the newest it can read is step 1: restore(state, step=1) takes that one" in said, said
        assert restore_as_user(d.root, d.socket, tmp, step=1) == "restored 1 [1.0, 1.0, 1.0, 1.0]"
    else:
        assert "no older committed step either" in said, said
    os.chmod(newest, 0o755)                      # readable again: the newest restores as always
    assert restore_as_user(d.root, d.socket, tmp) == "restored 2 [2.0, 2.0, 2.0, 2.0]"
