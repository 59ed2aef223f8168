"""A daemon SIGSTOPped (alive, its socket open, answering nothing): no Checkpointer call waits for it
without a bound. close() with no timeout gives the daemon up after max(commit_timeout, its
step_timeout) + 5 s of silence (session.py, ``watch``)."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
from procfd import sigstop

import ckptd_client
from ckptd.core.names import INDEX_NAME, step_dir


def _in_thread(fn: Any, limit: float) -> tuple[bool, float, Any]:
    """(still running after ``limit`` s, seconds taken, its result or the exception it raised)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(limit)
    return t.is_alive(), time.monotonic() - t0, out[0] if out else None


def test_close_with_no_timeout_gives_up_a_stopped_daemon(daemon_factory: Any) -> None:
    """Local commit, world size 2: step 1 stays open on the daemon (rank 1 never saves) when it is
    stopped. close() waited forever (only the daemon's events settle a handle); it now returns once
    the daemon has been silent for the documented bound, reporting step 1 failed — and it is: no
    index.json."""
    d = daemon_factory("--step-timeout", "3s")
    ck = ckptd_client.Checkpointer("stopped", socket=str(d.socket), rank=0, world_size=2, commit_timeout=2)
    ck.save(1, {"w": torch.arange(1000, dtype=torch.float32)})
    bound = max(2, 3) + 5.0
    sigstop(d.proc.pid)
    try:
        stuck, took, report = _in_thread(ck.close, bound + 30)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    assert not stuck, f"close() still waiting {bound + 30:.0f}s after the daemon stopped"
    assert took <= bound + 8, took          # (+ the watch's 2 s asks)
    assert isinstance(report, ckptd_client.CloseReport), report
    assert [step for step, _ in report.failed] == [1], report
    assert "answered nothing" in report.failed[0][1] and "commit_timeout" in report.failed[0][1], report
    assert "step_timeout 3s" in report.failed[0][1], report
    assert not os.path.exists(os.path.join(step_dir(d.root, "stopped", 1), INDEX_NAME))


def test_a_save_that_must_grow_the_slots_of_a_stopped_daemon_fails_within_commit_timeout(daemon_factory: Any) -> None:
    """The daemon is stopped while it still reads the slot of save 1; save 2's state is larger, so the
    slots must grow first, which waits until no save reads one. That wait had no bound (acquire's has:
    commit_timeout); it now fails as acquire does, naming commit_timeout."""
    d = daemon_factory("--debug-write-delay", "0.25", "--chunk-mib", "1")
    ck = ckptd_client.Checkpointer("grow", socket=str(d.socket), commit_timeout=3, overlap=False)
    # 16 MiB in 1 MiB chunks, 0.25 s each: 4 s of reading the slot, frozen by the SIGSTOP a moment after
    # save() returns, then finished before close() below returns (1 s a chunk had close wait 16 s).
    ck.save(1, {"w": torch.ones(4 << 20)})
    sigstop(d.proc.pid)
    try:
        stuck, took, raised = _in_thread(lambda: ck.save(2, {"w": torch.ones(6 << 20)}), 40)   # 24 MiB
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    assert not stuck, "save() still waiting to grow the slots 40 s after the daemon stopped"
    assert took <= 3 + 5, took
    assert isinstance(raised, ckptd_client.CheckpointError), raised
    assert "no slot came free within 3s (commit_timeout) to grow the slots" in str(raised), raised
    ck.close(timeout=30)


def test_a_restore_with_root_given_skips_the_memory_of_a_daemon_that_did_not_answer(daemon_factory: Any) -> None:
    """The daemon is stopped after step 1 committed; a restore with root= given asked it whether it has a
    bucket (no answer within 10 s: it goes on without) and then waited 300 s more for its memory tier's
    copy. Once this restore's ask went unanswered the memory source is skipped, saying why: storage
    serves it at once."""
    d = daemon_factory()
    with ckptd_client.Checkpointer("quiet", socket=str(d.socket), commit_timeout=5) as ck:
        ck.save(1, {"w": torch.arange(1000.0)}).wait(30)
    sigstop(d.proc.pid)
    try:
        c2 = ckptd_client.Checkpointer("quiet", socket=str(d.socket), root=str(d.root), commit_timeout=5, prepare=False)
        state = {"w": torch.zeros(1000)}
        stuck, took, got = _in_thread(lambda: c2.restore(state), 60)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    assert not stuck, "restore still waiting 60 s after the daemon stopped"
    assert got == 1 and torch.equal(state["w"], torch.arange(1000.0)), got
    assert took < 20, took
    info = c2.last_restore
    assert info is not None and info.source == "storage", info
    assert "skipped: the daemon at" in str(info) and "did not answer info within 10s" in str(info), info
    c2.close(timeout=5)
