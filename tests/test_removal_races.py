"""Step removals racing commits and each other (retention, `ckptd gc --remove-above`, the daemon's own).

Real files, the daemon's real commit (``write_index``) and real ``ckptd`` processes. A removal renames
the step directory away first (``step_files.remove_step``), so a commit still running fails instead of
publishing an index over files being unlinked; what a killed removal leaves is hidden from every
reader and finished by ``ckptd gc`` and by a daemon's start; a step another remover took first is no
error.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from test_step_on_disk import write_pieces

import ckptd.daemon.tiers.fs.commit as commit
import ckptd_client
from ckptd.core.names import step_dir_name
from ckptd.core.rank_record import summarize
from ckptd.core.reader import verify_step
from ckptd.core.step_files import is_committed, remove_step
from ckptd.daemon.settings.retention import RetentionPolicy
from ckptd.daemon.tiers.fs.retention import execute, plan_job

REMOVING_PREFIX = ".removing-"      # FORMAT.md, "Layout": a step directory being removed


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")})


def test_a_removal_racing_a_commit_never_leaves_a_committed_step_without_its_files(tmp_path: Path, monkeypatch):
    """`ckptd gc --remove-above` (or retention of an abandoned step) removing a step while the daemon
    commits it: the commit checked the manifests, the removal unlinked them, then the commit renamed
    index.json in: a step that looked committed with no rank files, and a handle that said committed.
    Here the widest window, made exact: the commit publishes just before the removal's last act."""
    path = tmp_path / "job" / step_dir_name(1)
    shards = write_pieces(path, [(0, 4), (4, 4)], 8)
    digests = {r: s.digest for r, s in enumerate(shards)}
    records = [summarize(s.manifest, s.digest) for s in shards]
    checked, go = threading.Event(), threading.Event()
    outcome: list[object] = []
    real_remove_files, real_rmdir = commit.remove_files, os.rmdir

    def before_publish(paths: list[str]) -> None:       # the commit's last act before index.json
        checked.set()
        assert go.wait(30)
        real_remove_files(paths)

    def run() -> None:
        try:
            commit.write_index(str(path), "job", 1, 2, digests, commit.PublishGate(), records)
            outcome.append("committed")
        except Exception as e:      # noqa: BLE001 (the outcome is the assertion)
            outcome.append(e)
    monkeypatch.setattr(commit, "remove_files", before_publish)
    t = threading.Thread(target=run)
    t.start()
    assert checked.wait(30)

    def rmdir(p: str, *a: object, **kw: object) -> None:     # the removal's last act: the commit ends first
        go.set()
        t.join(30)
        real_rmdir(p)
    monkeypatch.setattr(os, "rmdir", rmdir)
    try:
        remove_step(str(path))
    except OSError:
        pass
    go.set()
    t.join(30)
    monkeypatch.undo()
    assert len(outcome) == 1
    if is_committed(str(path)):     # whatever the order, a step that looks committed loads
        assert verify_step(str(path)) == []
    assert outcome[0] != "committed" or is_committed(str(path)), "the commit said committed for a step gone"
    assert isinstance(outcome[0], OSError) and not path.exists(), outcome
    assert not [p for p in path.parent.iterdir()], "the removal left something behind"


def test_a_killed_removal_is_hidden_from_readers_and_finished_by_gc_and_by_a_daemon_start(daemon_factory):
    """A removal killed midway leaves its renamed directory (``.removing-…``, some files still in it,
    even index.json): `ckptd ls` and a restore never take it for a step, and `ckptd gc` (or the next
    daemon's start) finishes removing it."""
    d = daemon_factory()
    with ckptd_client.Checkpointer("j", socket=str(d.socket), memory=False) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.full((8,), float(s))}).wait(60)
    job = d.root / "j"
    assert d.stop() == 0
    leftovers = []
    for s in (2, 3):        # as a removal killed just after its rename leaves it: every file still there
        hidden = job / f"{REMOVING_PREFIX}{step_dir_name(s)}-0123abcd"
        os.rename(job / step_dir_name(s), hidden)
        leftovers.append(hidden)
    assert (leftovers[1] / "index.json").exists()
    r = ckptd("ls", str(d.root), "j", "--json")
    assert r.returncode == 0 and '"step": 1' in r.stdout and '"step": 3' not in r.stdout, r.stdout + r.stderr
    with ckptd_client.Checkpointer("j", socket=str(d.root / "none.sock"), root=str(d.root)) as ck:  # storage
        live = {"w": torch.zeros(8)}
        assert ck.restore(live) == 1 and torch.equal(live["w"], torch.full((8,), 1.0))
    r = ckptd("gc", str(d.root), "--job", "j")
    assert r.returncode == 0 and not leftovers[0].exists() and not leftovers[1].exists(), r.stdout + r.stderr
    assert sorted(p.name for p in job.iterdir()) == [step_dir_name(1)]
    # the same leftover (of a memory-level step, too) finished by a daemon's start
    for hidden in (job / f"{REMOVING_PREFIX}{step_dir_name(5)}-00000000",
                   job / "_memory" / f"{REMOVING_PREFIX}{step_dir_name(6)}-00000000"):
        hidden.mkdir(parents=True)
        (hidden / "rank-00000.json").write_text("{}")
        (hidden / "index.json").write_text("{}")
    d2 = daemon_factory(root=d.root, name="d2")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and [p for p in (*job.iterdir(), *(job / "_memory").iterdir())
                                           if p.name.startswith(REMOVING_PREFIX)]:
        time.sleep(0.05)
    assert sorted(p.name for p in job.iterdir()) == ["_memory", step_dir_name(1)]
    assert list((job / "_memory").iterdir()) == []
    assert "job j: finished 1 step removals killed midway" in d2.log.read_text()


def test_a_step_another_remover_took_first_is_no_error(tmp: Path):
    """The daemon's retention and `ckptd gc` racing: the step one planned to remove was removed by the
    other meanwhile. That is not a failure (`FAILED …: No such file or directory`, gc exit 1, the
    daemon's "could not remove step" and ckptd_gc_errors_total): it is gone, as both wanted."""
    root = tmp / "root"
    for s in (1, 2, 3):
        d = root / "j" / step_dir_name(s)
        d.mkdir(parents=True)
        (d / "rank-00000.data").write_bytes(b"x")
        (d / "rank-00000.json").write_text("{}")
        (d / "index.json").write_text("{}")
    actions, _ = plan_job(str(root / "j"), RetentionPolicy(keep_last=1))
    assert [a.step for a in actions] == [1, 2]
    r = ckptd("gc", str(root), "--keep-last", "1")        # the other remover, a real process, first
    assert r.returncode == 0 and "removed 2 step(s)" in r.stdout, r.stdout + r.stderr
    execute(actions)
    assert [a.error for a in actions] == [None, None] and all(a.gone and not a.done for a in actions)
    assert remove_step(str(root / "j" / step_dir_name(1))) is False
