"""Retention (keep_last / keep_every / abandoned_after): the planner, `ckptd gc`, and the daemon after commits."""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import ckptd_client
from ckptd.core.names import (
    MEMORY_LEVEL_DIR,
    is_step_file,
    is_step_temp,
    rank_data_name,
    rank_manifest_name,
    step_dir_name,
    temp_name,
)
from ckptd.core.step_files import remove_step
from ckptd.daemon.settings.retention import RetentionPolicy
from ckptd.daemon.tiers.fs.retention import GcResult, JobMemo, collect_job, collect_root, plan_job

DAY = 86400.0


def make_step(root: Path, job: str, step: int, committed: bool, age_s: float = 0.0, memory: bool = False) -> Path:
    """A step directory with the files ckptd writes; mtimes set ``age_s`` in the past. ``memory``: a
    memory-level step's (``<job>/_memory/step-N``: its rank manifests, no data file)."""
    d = root / job / MEMORY_LEVEL_DIR / step_dir_name(step) if memory else root / job / step_dir_name(step)
    d.mkdir(parents=True)
    if not memory:
        (d / "rank-00000.data").write_bytes(b"x" * 10)
    (d / rank_manifest_name(0)).write_text("{}")
    if committed:
        (d / "index.json").write_text("{}")
    t = time.time() - age_s
    for p in [*d.iterdir(), d]:
        os.utime(p, (t, t))
    return d


def steps_left(root: Path, job: str) -> list[int]:
    """The job's step directories (not a removal's hidden ``.removing-…`` one, which is no step)."""
    return sorted(int(p.name[5:]) for p in (root / job).iterdir() if not p.name.startswith("."))


def test_keep_last_and_keep_every(tmp):
    for s in range(1, 13):
        make_step(tmp, "j", s * 10, committed=True)
    r = collect_job(str(tmp), "j", RetentionPolicy(keep_last=3, keep_every=50))
    assert steps_left(tmp, "j") == [50, 100, 110, 120]
    assert sorted(a.step for a in r.removed) == [10, 20, 30, 40, 60, 70, 80, 90]
    assert all(a.kind == "expired" for a in r.actions)


def test_keep_last_zero_keeps_everything_committed(tmp):
    for s in range(5):
        make_step(tmp, "j", s, committed=True, age_s=10 * DAY)
    r = collect_job(str(tmp), "j", RetentionPolicy(keep_last=0, keep_every=3))
    assert r.actions == [] and steps_left(tmp, "j") == [0, 1, 2, 3, 4]


def test_newest_committed_never_deleted(tmp):
    make_step(tmp, "j", 7, committed=True)
    make_step(tmp, "j", 8, committed=False)          # newer, uncommitted and young: kept too
    r = collect_job(str(tmp), "j", RetentionPolicy(keep_last=1, keep_every=1000))
    assert r.actions == [] and steps_left(tmp, "j") == [7, 8]
    # keep_last is at least the newest even if keep_every would not keep it
    make_step(tmp, "k", 3, committed=True)
    make_step(tmp, "k", 4, committed=True)
    collect_job(str(tmp), "k", RetentionPolicy(keep_last=1, keep_every=3))
    assert steps_left(tmp, "k") == [3, 4]


def test_abandoned_uncommitted_removed_only_when_old_and_not_in_flight(tmp):
    make_step(tmp, "j", 1, committed=True, age_s=3 * DAY)
    make_step(tmp, "j", 2, committed=False, age_s=2 * DAY)     # abandoned
    make_step(tmp, "j", 3, committed=False, age_s=2 * DAY)     # old, but the daemon says in flight
    make_step(tmp, "j", 4, committed=False, age_s=60)          # young: may still be written
    r = collect_job(str(tmp), "j", RetentionPolicy(abandoned_after=DAY), in_flight=[3])
    assert [(a.step, a.kind) for a in r.removed] == [(2, "abandoned")]
    assert steps_left(tmp, "j") == [1, 3, 4]
    kept = {step: why for _, step, why in r.kept}
    assert kept[3] == "in flight" and "may still be written" in kept[4] and kept[1] == "newest committed"


def test_recent_file_write_keeps_old_directory_young(tmp):
    d = make_step(tmp, "j", 5, committed=False, age_s=2 * DAY)
    os.utime(d / "rank-00000.data")          # a writer touched its data file just now
    actions, _ = plan_job(str(tmp / "j"), RetentionPolicy(abandoned_after=DAY))
    assert actions == []


def test_a_temp_file_being_written_in_a_committed_step_is_left_until_untouched_for_a_while(tmp):
    """A committed step staged from the bucket gets a later rank's data file the same way, a temp file
    renamed into place: a retention pass meanwhile removed it and that rank's staging failed. Only a
    temp file untouched for abandoned_after goes (a killed writer's)."""
    d = make_step(tmp, "j", 5, committed=True)
    live = Path(temp_name(str(d / rank_data_name(1))))
    live.write_bytes(b"\0" * 100)                        # a download into the step, now
    old = Path(temp_name(str(d / rank_manifest_name(2))))
    old.write_bytes(b"{")
    os.utime(old, (time.time() - 2 * DAY, time.time() - 2 * DAY))
    r = collect_job(str(tmp), "j", RetentionPolicy(abandoned_after=DAY))
    assert r.stray_temps == [str(old)] and live.exists() and not old.exists()


def test_dry_run_removes_nothing(tmp):
    for s in range(4):
        make_step(tmp, "j", s, committed=True)
    r = collect_root(str(tmp), RetentionPolicy(keep_last=1), dry_run=True)
    assert sorted(a.step for a in r.actions) == [0, 1, 2] and r.removed == []
    assert steps_left(tmp, "j") == [0, 1, 2, 3]


def test_symlinks_are_never_followed(tmp):
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    make_step(tmp / "root", "j", 1, committed=True)
    make_step(tmp / "root", "j", 2, committed=True)
    # a symlinked step directory and a symlinked job directory pointing outside the root
    os.symlink(outside, tmp / "root" / "j" / step_dir_name(0))
    os.symlink(outside, tmp / "root" / "linkjob")
    r = collect_root(str(tmp / "root"), RetentionPolicy(keep_last=1, abandoned_after=0))
    assert (outside / "precious").read_text() == "keep me"
    assert [a.step for a in r.removed] == [1]
    assert any("linkjob" in s and "symlink" in s for s in r.skipped)
    # a symlink planted inside a step directory is unlinked, its target untouched
    d = make_step(tmp / "root", "j", 3, committed=True)
    make_step(tmp / "root", "j", 9, committed=True)
    os.symlink(outside / "precious", d / "rank-00001.data")
    remove_step(str(d))
    assert not d.exists() and (outside / "precious").read_text() == "keep me"


def test_foreign_files_keep_the_directory(tmp):
    d = make_step(tmp, "j", 1, committed=True)
    make_step(tmp, "j", 2, committed=True)
    (d / "notes.txt").write_text("operator's notes")
    r = collect_job(str(tmp), "j", RetentionPolicy(keep_last=1))
    assert r.removed == [] and len(r.errors) == 1 and "notes.txt" in r.errors[0].error
    # kept whole: nothing of it removed (still committed), the foreign file intact, no hidden leftover
    assert (d / "index.json").exists() and (d / "rank-00000.data").exists() and (d / "notes.txt").exists()
    assert sorted(p.name for p in (tmp / "j").iterdir()) == [step_dir_name(1), step_dir_name(2)]


def _gc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", "gc", *args], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")})


def test_ckptd_gc_cli(tmp):
    root = tmp / "root"
    for s in range(1, 6):
        make_step(root, "a", s, committed=True)
    make_step(root, "a", 6, committed=False, age_s=3 * DAY)
    make_step(root, "b", 1, committed=True)
    r = _gc(str(root), "--keep-last", "2", "--abandoned-after", "1d", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "would remove" in r.stdout and "would remove 4 step(s)" in r.stdout
    assert steps_left(root, "a") == [1, 2, 3, 4, 5, 6]
    r = _gc(str(root), "--keep-last", "2", "--abandoned-after", "1d", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and not out["dry_run"]
    assert sorted((a["job"], a["step"], a["kind"]) for a in out["actions"]) == [
        ("a", 1, "expired"), ("a", 2, "expired"), ("a", 3, "expired"), ("a", 6, "abandoned")]
    assert steps_left(root, "a") == [4, 5] and steps_left(root, "b") == [1]
    # settings from a config file, a flag over it
    cfg = tmp / "c.toml"
    cfg.write_text(f'root = "{root}"\n[retention]\nkeep_last = 1\n')
    r = _gc("--config", str(cfg), "--job", "a")
    assert r.returncode == 0, r.stderr
    assert steps_left(root, "a") == [5]
    r = _gc(str(root), "--keep-last", "-3")
    assert r.returncode == 2 and "retention.keep_last" in r.stderr


def test_gc_of_a_misspelt_job_is_a_usage_error_with_a_did_you_mean(tmp):
    """`ckptd gc --job train-7B` (the job is train-7b) removed nothing and exited 0, as if retention had
    run; `ckptd ls ROOT train-7B` is a usage error naming the job meant, and so is gc's now."""
    root = tmp / "root"
    for s in (1, 2):
        make_step(root, "train-7b", s, committed=True)
    r = _gc(str(root), "--job", "train-7B", "--keep-last", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"ckptd gc: no job 'train-7B' under {root}; did you mean 'train-7b'? (jobs there: train-7b)" in r.stderr
    assert r.stdout == "" and steps_left(root, "train-7b") == [1, 2]
    r = _gc(str(root), "--job", "train-7b", "--job", ".hidden")         # not a job name at all
    assert r.returncode == 2 and "invalid job name" in r.stderr, r.stderr
    r = _gc(str(root), "--job", "train-7b", "--keep-last", "1")
    assert r.returncode == 0 and steps_left(root, "train-7b") == [2], r.stdout + r.stderr


def storage_steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (root / "j").glob("step-*"))


def test_gc_remove_above_takes_a_rolled_back_runs_steps_away(daemon_factory, tmp, caplog):
    """A run rolled back to step 20 (steps 10, 20, 30 committed, keep_last 2): its steps 21 and 22 sat
    below the abandoned 30, so retention deleted 21 as soon as 22 committed and a restart resumed from 30.
    `ckptd gc --job j --remove-above 20` (with the trainers stopped) removes 30, committed and memory-level
    steps above 20 alike; the new run's steps then stand and a restart resumes from its own step."""
    d = daemon_factory("--keep-last", "2")
    with ckptd_client.Checkpointer("j", socket=str(d.socket)) as ck:
        for s in (10, 20, 30):
            ck.save(s, {"w": torch.full((8,), float(s))}).wait(60)
        ck.save(31, {"w": torch.full((8,), 31.0)}, level="memory").wait(60)
    with ckptd_client.Checkpointer("j", socket=str(d.socket), memory=False) as ck, caplog.at_level("WARNING"):
        assert ck.restore({"w": torch.zeros(8)}, step=20) == 20       # the rollback: the client says what it leaves
    assert "restored step 20 of job 'j' while step 30 is newer" in caplog.text, caplog.text
    assert "ckptd gc ROOT --job j --remove-above 20" in caplog.text
    r = _gc(str(d.root), "--remove-above", "20")
    assert r.returncode == 2 and "--remove-above needs --job" in r.stderr, r.stderr
    for bad in ("-1", "1000000000000", "x"):     # -1 (a script's restored-1 after step 0) removed every step
        r = _gc(str(d.root), "--job", "j", "--remove-above", bad)
        assert r.returncode == 2 and "give a step number" in r.stderr, (bad, r.stderr)
        assert storage_steps(d.root) == [20, 30], bad
    r = _gc(str(d.root), "--job", "j", "--remove-above", "20", "--dry-run")
    assert r.returncode == 0 and storage_steps(d.root) == [20, 30], r.stdout + r.stderr
    r = _gc(str(d.root), "--job", "j", "--remove-above", "20")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step above --remove-above" in r.stdout and storage_steps(d.root) == [20], r.stdout
    assert not list((d.root / "j" / "_memory").glob("step-*"))
    with ckptd_client.Checkpointer("j", socket=str(d.socket), memory=False) as ck:
        live = {"w": torch.zeros(8)}
        assert ck.restore(live) == 20
        for s in (21, 22):
            ck.save(s, {"w": torch.full((8,), float(s))}).wait(60)
    deadline = time.monotonic() + 30             # (retention runs after each commit, off its path)
    while storage_steps(d.root) != [21, 22] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert storage_steps(d.root) == [21, 22]
    with ckptd_client.Checkpointer("j", socket=str(d.socket), memory=False) as ck:
        live = {"w": torch.zeros(8)}
        assert ck.restore(live) == 22 and torch.equal(live["w"], torch.full((8,), 22.0))


def test_gc_removes_every_file_ckptd_names_whole_steps_only(tmp):
    """Rank numbers past 99999 (MAX_RANKS allows 7 digits) and the temp names every writer uses
    (``names.temp_name``: atomic writes, the bucket stager's downloads) belong to ckptd: an expired
    step and an abandoned, half-staged one are removed whole, never left without their index."""
    root = tmp / "root"
    big = make_step(root, "z", 1, committed=True)
    for rank in (99_999, 100_000, (1 << 20) - 1):
        (big / rank_data_name(rank)).write_bytes(b"d")
        (big / rank_manifest_name(rank)).write_text("{}")
    make_step(root, "z", 2, committed=True)
    staged = make_step(root, "z", 3, committed=False, age_s=3 * DAY)    # a daemon killed mid-stage
    data_tmp = Path(temp_name(str(staged / rank_data_name(100_000))))
    data_tmp.write_bytes(b"partial download")
    t = time.time() - 3 * DAY
    os.utime(data_tmp, (t, t))
    os.utime(staged, (t, t))
    assert is_step_temp(data_tmp.name) and is_step_file(data_tmp.name)
    r = _gc(str(root), "--keep-last", "1", "--abandoned-after", "1d")
    assert r.returncode == 0, r.stdout + r.stderr
    assert steps_left(root, "z") == [2]
    assert not big.exists() and not staged.exists()
    # names that are not ckptd's still keep a directory
    assert not is_step_file("rank-1.data") and not is_step_file("rank-00000.data.bak")
    assert not is_step_file("rank-00000.data.tmp.") and not is_step_file("index.json.tmp.1.2.3")


def make_memory_level_step(root: Path, job: str, step: int, committed: bool, age_s: float) -> Path:
    return make_step(root, job, step, committed, age_s, memory=True)


def test_uncommitted_memory_level_steps_are_collected_like_abandoned_steps(tmp):
    """A daemon killed during a memory-level save leaves the step's manifests in _memory/step-N,
    uncommitted: gone once untouched for abandoned_after, unless young or in flight. Committed
    memory-level steps are the memory tier's to prune: left here."""
    make_step(tmp, "j", 10, committed=True)
    make_memory_level_step(tmp, "j", 11, committed=False, age_s=2 * DAY)    # a killed daemon's
    make_memory_level_step(tmp, "j", 12, committed=False, age_s=2 * DAY)    # old, but in flight
    make_memory_level_step(tmp, "j", 13, committed=False, age_s=60)         # young
    make_memory_level_step(tmp, "j", 14, committed=True, age_s=2 * DAY)
    r = collect_job(str(tmp), "j", RetentionPolicy(abandoned_after=DAY), memory_in_flight=[12])
    assert [(a.job, a.step, a.kind) for a in r.removed] == [("j/_memory", 11, "abandoned")]
    assert sorted(p.name for p in (tmp / "j" / MEMORY_LEVEL_DIR).iterdir()) == [
        step_dir_name(s) for s in (12, 13, 14)]
    # `ckptd gc` (no daemon: nothing in flight) collects them too; a symlinked _memory is not followed.
    r2 = subprocess.run([sys.executable, "-m", "ckptd", "gc", str(tmp)], capture_output=True, text=True, timeout=60)
    assert r2.returncode == 0, r2.stderr
    assert sorted(p.name for p in (tmp / "j" / MEMORY_LEVEL_DIR).iterdir()) == [step_dir_name(s) for s in (13, 14)]
    other = tmp / "elsewhere"
    make_memory_level_step(other, "x", 5, committed=False, age_s=2 * DAY)
    make_step(tmp, "k", 1, committed=True)
    (tmp / "k" / MEMORY_LEVEL_DIR).symlink_to(other / "x" / MEMORY_LEVEL_DIR)
    assert collect_job(str(tmp), "k", RetentionPolicy(abandoned_after=DAY)).actions == []
    assert (other / "x" / MEMORY_LEVEL_DIR / step_dir_name(5)).is_dir()


def test_daemon_collects_a_killed_memory_level_save_after_a_storage_commit(daemon_factory):
    """The daemon's retention after a storage commit removes an uncommitted memory-level step
    that an earlier daemon, killed mid-save, left behind."""
    d = daemon_factory()
    stale = make_memory_level_step(d.root, "mlv", 3, committed=False, age_s=2 * DAY)
    young = make_memory_level_step(d.root, "mlv", 4, committed=False, age_s=0)
    ck = ckptd_client.Checkpointer("mlv", socket=str(d.socket))
    ck.save(5, {"w": torch.arange(8.0)}).wait(60)
    ck.close()
    deadline = time.monotonic() + 60
    while stale.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stale.exists() and young.is_dir()
    assert (d.root / "mlv" / step_dir_name(5) / "index.json").exists()


def test_daemon_applies_retention_after_commit(daemon_factory):
    d = daemon_factory("--keep-last", "2", "--keep-every", "3", "--metrics-address", "0")
    model = torch.nn.Linear(4, 4)
    ck = ckptd_client.Checkpointer("ret", socket=str(d.socket))
    for step in range(1, 8):
        ck.save(step, {"model": model}).wait(60)
    ck.close()
    # Retention runs after each commit, asynchronously: the last pass follows step 7's commit.
    # Poll the daemon's status until no pass is running (no timing threshold on its speed).
    from ckptd.core import protocol
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = steps_left(d.root, "ret")
        if left == [3, 6, 7]:
            break
        time.sleep(0.05)
    assert steps_left(d.root, "ret") == [3, 6, 7]
    st = protocol.request_once(str(d.socket), {"op": "status"})
    assert st["last_committed"]["ret"]["step"] == 7
    from test_metrics import wait_metric  # the count follows the deletions on the event loop
    m = wait_metric(st["metrics"], 'ckptd_gc_removed_steps_total{kind="expired"}', 4)
    assert m['ckptd_gc_removed_steps_total{kind="expired"}'] == 4        # steps 1, 2, 4, 5
    assert m['ckptd_gc_removed_steps_total{kind="abandoned"}'] == 0 and m["ckptd_gc_errors_total"] == 0


def test_no_temp_file_survives_in_a_committed_step(daemon_factory, tmp):
    """A daemon killed while writing leaves files behind; the re-saved step commits without them,
    and `ckptd gc` removes temp files it finds in any committed step."""
    import signal
    d = daemon_factory("--debug-write-delay", "0.5", "--chunk-mib", "1")
    ck = ckptd_client.Checkpointer("tmpf", socket=str(d.socket))
    state = {"w": torch.randn(1 << 20)}                 # 4 MiB: four chunks, 2 s of writing
    ck.save(1, state)
    step = d.root / "tmpf" / step_dir_name(1)
    deadline = time.monotonic() + 60
    while not (step / "rank-00000.data").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    ck.close()
    # What a kill between a manifest's tmp write and its rename leaves (the window is too narrow
    # to hit by timing): a temp manifest named as storage.atomic_write names it.
    (step / "rank-00000.json.tmp.4242").write_text("{}")
    d2 = daemon_factory(name="d2", root=d.root)
    ck2 = ckptd_client.Checkpointer("tmpf", socket=str(d2.socket))
    ck2.save(1, state).wait(60)
    ck2.close()
    assert (step / "index.json").exists()
    assert sorted(p.name for p in step.iterdir()) == ["index.json", "rank-00000.data", "rank-00000.json"]
    # gc: temp files in a committed step (here planted after the commit, untouched for abandoned_after
    # since: a younger one may be a rank staging its file into the step) are removed.
    for name in ("index.json.tmp.77", "rank-00000.json.tmp.78"):
        (step / name).write_text("x")
        os.utime(step / name, (time.time() - 30 * DAY, time.time() - 30 * DAY))
    r = subprocess.run([sys.executable, "-m", "ckptd", "gc", str(d.root)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in step.iterdir()) == ["index.json", "rank-00000.data", "rank-00000.json"]


def test_a_symlinked_memory_level_directory_is_never_pruned_through(daemon_factory, tmp):
    """<job>/_memory planted as a symlink to a directory of committed steps elsewhere: a storage commit's
    pruning of memory-level steps (those at or below it, and an earlier run's above it) listed through the
    link and deleted both steps there. The link is not followed: they stay, and so does the link."""
    victim = tmp / "victim"
    for s in (1, 2):
        make_step(victim, "x", s, committed=True, age_s=60)
    d = daemon_factory()
    (d.root / "lnk").mkdir(parents=True)
    (d.root / "lnk" / MEMORY_LEVEL_DIR).symlink_to(victim / "x")
    ck = ckptd_client.Checkpointer("lnk", socket=str(d.socket))
    for step in (1, 3):
        ck.save(step, {"w": torch.arange(4.0)}).wait(60)
    ck.close()
    assert steps_left(victim, "x") == [1, 2]
    assert all((victim / "x" / step_dir_name(s) / "index.json").is_file() for s in (1, 2))
    assert (d.root / "lnk" / MEMORY_LEVEL_DIR).is_symlink()


def _count_dir_calls(monkeypatch) -> dict[str, int]:
    """Calls of os.listdir / os.scandir / os.stat / os.lstat from here on (every path and helper of
    retention and step_files goes through them: os.path.isfile and friends call os.stat); under
    "job listed", how many listings were of the job's own directory."""
    counts = dict.fromkeys(("listdir", "scandir", "stat", "lstat", "job listed"), 0)
    for name in ("listdir", "scandir", "stat", "lstat"):
        real = getattr(os, name)

        def counted(path, *a, _real=real, _name=name, **k):
            counts[_name] += 1
            if _name in ("listdir", "scandir") and os.path.basename(os.fspath(path)) == "j":
                counts["job listed"] += 1
            return _real(path, *a, **k)
        monkeypatch.setattr(os, name, counted)
    return counts


TEMP = "rank-00000.json.tmp.4242.1"     # what a writer killed before its rename leaves


def _one_pass_after_a_commit(tmp: Path, monkeypatch, n: int) -> tuple[dict[str, int], GcResult]:
    """The daemon's pass after a commit (retention off: keep_last 0) in a job of ``n`` committed steps
    of 64 ranks each, its earlier passes' memo kept; then the pass after one more commit, counted."""
    root = tmp / f"n{n}"
    for s in range(1, n + 1):
        d = make_step(root, "j", s, committed=True)
        for rank in range(1, 64):
            (d / rank_data_name(rank)).write_bytes(b"")
            (d / rank_manifest_name(rank)).write_text("{}")
    memo, policy = JobMemo(), RetentionPolicy(abandoned_after=DAY)
    collect_job(str(root), "j", policy, memo=memo)         # the passes before (the daemon's start)
    collect_job(str(root), "j", policy, memo=memo)
    new = make_step(root, "j", n + 1, committed=True)      # a commit: a stale temp in it, and an
    (new / TEMP).write_text("{}")                          # abandoned save beside it
    stale = time.time() - 2 * DAY
    os.utime(new / TEMP, (stale, stale))
    make_step(root, "j", n + 2, committed=False, age_s=2 * DAY)
    with monkeypatch.context() as m:
        counts = _count_dir_calls(m)
        r = collect_job(str(root), "j", policy, memo=memo)
    return counts, r


def test_a_pass_after_a_commit_costs_the_same_however_long_the_history(tmp, monkeypatch):
    """With retention off (the default keep_last 0) every commit is still followed by a pass (abandoned
    saves must go), which listed the job three times, stat'ed every step and listed every committed
    step's directory for stray temps: its cost grew with the job's history (40 ms of daemon CPU per
    save at 5,000 steps). Now one listing of the job, and only the step committed since is looked into:
    the same directory listings and stats at 10 steps as at 200, and the same outcome."""
    small, r_small = _one_pass_after_a_commit(tmp, monkeypatch, 10)
    large, r_large = _one_pass_after_a_commit(tmp, monkeypatch, 200)
    assert small == large, (small, large)
    assert small["job listed"] == 1, small
    for r, n in ((r_small, 10), (r_large, 200)):
        assert [(a.step, a.kind) for a in r.removed] == [(n + 2, "abandoned")]
        assert [os.path.basename(p) for p in r.stray_temps] == [TEMP]
        assert not r.errors and not r.unreadable
