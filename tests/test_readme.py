"""The README's training loops, run exactly as printed (extracted from README.md): killed with
SIGKILL mid-run, resumed, every loss bit-equal to a run never interrupted."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import zygote

from conftest import start_daemon

WORKER = Path(__file__).resolve().parent / "readme_worker.py"
KILL_AT = 12          # after the save of step 10 (SAVE_EVERY = 5) is committed, mid-way to the next


def run(block: str, sock: Path, losses: Path, kill_at: int | None = None) -> int:
    env = {**os.environ, "CKPTD_SOCKET": str(sock)}
    cmd = [sys.executable, str(WORKER), block, str(losses)] + ([str(kill_at)] if kill_at is not None else [])
    p = zygote.run(cmd, env=env, capture_output=True, text=True, timeout=300)      # forked: torch imported once
    if kill_at is None:
        assert p.returncode == 0, p.stderr[-3000:]
    return p.returncode


def read(losses: Path) -> list[tuple[int, str]]:
    return [(int(s), v) for s, v in (line.split() for line in losses.read_text().splitlines())]


def check(tmp: Path, block: str) -> None:
    straight = start_daemon(tmp / "root-a", tmp / "a.sock")
    resumed = start_daemon(tmp / "root-b", tmp / "b.sock")
    try:
        run(block, straight.socket, tmp / "straight.txt")
        assert run(block, resumed.socket, tmp / "resumed.txt", KILL_AT) == -signal.SIGKILL
        assert [s for s, _ in read(tmp / "resumed.txt")] == list(range(KILL_AT))
        run(block, resumed.socket, tmp / "resumed.txt")
    finally:
        straight.stop()
        resumed.stop()
    uninterrupted, interrupted = dict(read(tmp / "straight.txt")), read(tmp / "resumed.txt")
    assert sorted(uninterrupted) == list(range(24))
    # Trained before the kill: 0..11; the resume starts from the save of step 10 (the state after
    # step 9), so it trains 10 and 11 again — from the same state, to the same losses — then on.
    assert [s for s, _ in interrupted] == list(range(KILL_AT)) + list(range(10, 24))
    differ = [(s, v, uninterrupted[s]) for s, v in interrupted if v != uninterrupted[s]]
    assert not differ, f"losses that differ from the uninterrupted run (step, resumed, straight): {differ[:5]}"


def test_the_readme_loop_resumes_exactly(tmp: Path) -> None:
    check(tmp, "test_the_readme_loop_resumes_exactly")


def test_the_stateful_dataloader_recipe_resumes_exactly(tmp: Path) -> None:
    check(tmp, "test_the_stateful_dataloader_recipe_resumes_exactly")
