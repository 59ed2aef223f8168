"""Runs of one job on a store that outlives them (issue 17, defects 3 and 7): a launcher's
store, or the process group's with two Checkpointers one after the other. Every key is the
run's own (ckptd_client/run_scope.py), so no rank is told "committed" for a step before its
index.json exists, every rank restores the same newest committed step, no earlier run's
preemption step stops a later run, and a rank's retried save cannot shift later commits."""
# mypy: disable-error-code="union-attr,index,operator"
# (pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import zygote
from ports import free_port

import ckptd_client
from ckptd.core.names import INDEX_NAME, step_dir

WORKER = Path(__file__).resolve().parent / "runs_worker.py"



def _start(mode: str, spec: dict) -> zygote.Proc:
    return zygote.popen([sys.executable, str(WORKER), mode, json.dumps(spec)], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)


def _finish(procs: list[zygote.Proc], timeout: float = 240) -> list[list[str]]:
    """Each rank's stdout lines, then (for the failure messages) its stderr's, apart: a log line
    written to a shared pipe can land in the middle of a printed one."""
    outs: list[list[str]] = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            outs.append(stdout.splitlines() + ["--- stderr:"] + stderr.splitlines())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _read_until(proc: zygote.Proc, line: str, seen: list[str]) -> None:
    for got in proc.stdout:
        seen.append(got.rstrip())
        if got.rstrip() == line:
            return
    raise AssertionError(f"rank ended (rc={proc.wait()}) before {line!r}:\n" + "\n".join(seen[-40:]))


def why(rank: int, out: list[str]) -> str:
    return f"rank {rank}:\n" + "\n".join(out)


def _lines(out: list[str], prefix: str) -> list[str]:
    return [line for line in out if line.startswith(prefix)]


def test_a_run_on_a_store_a_crashed_run_left_trusts_none_of_its_keys(daemon, tmp):
    """Run 1 commits steps 2 and 4, then rank 0 dies mid-save of step 6 (rank 1 too, later): its
    keys stay in the launcher's store. Run 2, rank 0 slowed (it sleeps before restoring and
    before each save), saves step 6 again and 8: both ranks restore step 4, and each handle says
    committed only once its step's index.json exists (before, rank 1 read run 1's results and
    restore choice: committed at once, and a restore of None)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    base = {"port": server.port, "socket": str(daemon.socket), "root": str(daemon.root), "job": "runs"}
    first = [_start("launcher", {**base, "rank": r, "phase": 1}) for r in (0, 1)]
    seen: list[str] = []
    try:
        _read_until(first[1], "SAVED 6", seen)
        assert first[0].wait(120) == -9             # rank 0 died mid-save of step 6
    finally:
        for p in first:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert Path(step_dir(str(daemon.root), "runs", 4), INDEX_NAME).is_file()
    assert not Path(step_dir(str(daemon.root), "runs", 6), INDEX_NAME).exists()

    outs = _finish([_start("launcher", {**base, "rank": r, "phase": 2}) for r in (0, 1)])
    for rank, out in enumerate(outs):
        assert _lines(out, "RESTORED") == ["RESTORED 4"], why(rank, out)
        assert sorted(_lines(out, "COMMITTED")) == ["COMMITTED 6 index=True", "COMMITTED 8 index=True"], why(rank, out)
        assert _lines(out, "FAILED") == [], why(rank, out)


def test_a_second_checkpointer_on_the_process_group_store_trusts_none_of_the_firsts_keys(daemon, tmp):
    """Two Checkpointers one after the other in the same two processes, on the process group's
    store (no ``store=``), each preempted by rank 1 five steps in: the first stops at 7, the
    second (rank 0 slowed) restores 7 on both ranks and stops at 14, not at once on the first's
    preemption step; every committed handle finds its index.json."""
    base = {"port": free_port(), "socket": str(daemon.socket), "root": str(daemon.root), "job": "twice"}
    outs = _finish([_start("pg", {**base, "rank": r}) for r in (0, 1)])
    for rank, out in enumerate(outs):
        assert _lines(out, "RESTORED") == ["RESTORED None", "RESTORED 7"], why(rank, out)
        assert _lines(out, "STOPPED") == ["STOPPED 7 saved=7 index=True", "STOPPED 14 saved=14 index=True"], \
            why(rank, out)
        committed = _lines(out, "COMMITTED")
        assert committed and all(line.endswith("index=True") for line in committed), why(rank, out)
        assert sorted(int(line.split()[1]) for line in committed) == [2, 4, 6, 8, 10, 12, 14], why(rank, out)
        assert _lines(out, "FAILED") == [], why(rank, out)


def test_a_refused_save_retried_by_one_rank_is_refused_and_later_steps_commit(daemon_factory, tmp):
    """Rank 1's save of step 2 is refused (its daemon is down) and retried once the daemon is
    back: the retry is refused with a clear error (the step's keys are spent in this run), step 2
    fails on both ranks, and step 3 commits on both. Before, the retry took the next save number:
    rank 1's retried step 2 answered rank 0's step 3, which failed, and so did every later one."""
    d0, d1 = daemon_factory(name="d0"), daemon_factory(name="d1")
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    cks = [ckptd_client.Checkpointer("retry", socket=str(d.socket), root=str(d0.root), rank=r, world_size=2,
                                     store=server, commit_timeout=5, local_world_size=1, overlap=False)
           for r, d in enumerate((d0, d1))]
    try:
        def state(step: int) -> dict:
            return {"w": torch.full((64,), float(step))}
        for h in [ck.save(1, state(1)) for ck in cks]:
            h.wait(60)
        d1.proc.kill()
        d1.proc.wait()
        h0 = cks[0].save(2, state(2))
        with pytest.raises(ckptd_client.CheckpointError):
            cks[1].save(2, state(2))                 # refused: no daemon
        daemon_factory(name="d1", root=d0.root)      # back, on the same socket
        refused = None
        try:
            cks[1].save(2, state(2))                 # the retry
        except ckptd_client.CheckpointError as e:
            refused = str(e)
        with pytest.raises(ckptd_client.CheckpointError, match="failed"):
            h0.wait(60)
        later = [ck.save(3, state(3)) for ck in cks]
        for h in later:
            h.wait(60)                               # raises if step 3 failed on that rank
        assert Path(step_dir(str(d0.root), "retry", 3), INDEX_NAME).is_file()
        assert not Path(step_dir(str(d0.root), "retry", 2), INDEX_NAME).exists()
        assert refused is not None and "step 2 was saved once already in this run" in refused, refused
    finally:
        for ck in cks:
            ck.close(timeout=30)


def test_settling_by_the_disk_fsyncs_the_step_directory_and_says_when_that_fails(daemon, monkeypatch, caplog):
    """What a client decides when the disk settles a save (a lost store, daemon or COMMIT reply):
    it fsyncs the step's directory before calling the step committed (a rename is visible before
    it is durable), and when that fsync fails (EIO, injected: the one fault a test cannot cause
    for real) it still says committed — index.json is in place and loads — but the handle says
    why it may not survive a crash, and the error is logged. No index: not committed, no fsync."""
    import errno

    import ckptd_client.disk as disk
    from ckptd_client.handle import SaveHandle
    ck = ckptd_client.Checkpointer("settle", socket=str(daemon.socket), root=str(daemon.root), overlap=False)
    ck.save(1, {"w": torch.ones(16)}).wait(60)
    ck.close(timeout=30)
    path = step_dir(str(daemon.root), "settle", 1)
    synced: list[str] = []
    failing = False
    real = disk.storage.fsync_dir

    def fsync_dir(p: str) -> None:
        synced.append(p)
        if failing:
            raise OSError(errno.EIO, "Input/output error", p)
        real(p)
    monkeypatch.setattr(disk.storage, "fsync_dir", fsync_dir)
    h = SaveHandle(1, 1)
    assert disk.committed_on_disk(str(daemon.root), "settle", 1, h) and synced == [path] and h.sync_error is None
    failing = True
    assert disk.committed_on_disk(str(daemon.root), "settle", 1, h)
    assert "fsync" in (h.sync_error or "") and "may not survive a crash" in (h.sync_error or ""), h.sync_error
    assert any("step 1" in r.getMessage() and "Input/output error" in r.getMessage() for r in caplog.records)
    assert not disk.committed_on_disk(str(daemon.root), "settle", 2, SaveHandle(2, 2)) and synced == [path, path]
