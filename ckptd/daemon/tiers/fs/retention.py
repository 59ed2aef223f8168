"""Retention and garbage collection of step directories.

Per job (the same rules as Orbax's ``max_to_keep`` / ``keep_period``):

- committed steps: keep the newest ``keep_last`` and every step divisible by ``keep_every``;
  delete the rest. ``keep_last = 0`` keeps every committed step. The newest committed step
  is never deleted, whatever the settings;
- uncommitted step directories (no index.json) are garbage once nothing has touched them
  for ``abandoned_after`` seconds; younger ones may still be being written (by this daemon
  or, on a shared root, another node's) and are left alone, as is any step the caller
  names as in flight;
- memory-level steps (``<job>/_memory/step-N``) are pruned by the memory tier when it commits one;
  here only their uncommitted directories (a daemon killed mid-save leaves a manifest there) go,
  by the same ``abandoned_after`` rule.

A step is removed by ``ckptd.core.step_files.remove_step``: its directory renamed away to a hidden
name first (``.removing-…``, never taken for a step), so a commit racing the removal fails and a crash
in the middle leaves a leftover invisible to readers, finished by the next pass here
(``step_files.finish_removals``) — never a half-deleted step that still looks committed. A step
another process removed first (the daemon's retention and ``ckptd gc`` racing) is not an error.
Nothing here follows a symlink: symlinked job or step directories are skipped, and the entries of a
step directory are unlinked (a link is removed, never its target). Only names that ckptd itself
creates are removed; a step directory holding anything else is kept whole, and reported.
A step or job directory ckptd cannot read (EACCES: its owner or mode) is never removed — it may be
committed — and is reported (``GcResult.unreadable``, a warning naming the path and the fix); every
other step and job is still collected.

The daemon runs :func:`collect_job` for a job after each commit of it, with the job's ``JobMemo``: the
job's directory listed once, only the steps committed since the last pass (or not looked into for
``abandoned_after``) looked into for stray temps, and with no keep rule the committed steps not gone
through at all, so a pass costs the same however long the job's history. ``ckptd gc`` runs
:func:`collect_root` by hand, with no memo: every step looked at.
"""
from __future__ import annotations

import logging
import math
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from ckptd.core import step_files
from ckptd.core.names import MEMORY_LEVEL_DIR, memory_job, parse_step_dir_name, validate_job
from ckptd.core.reader import StepInfo, list_steps, memory_level_steps
from ckptd.daemon.settings.retention import RetentionPolicy

log = logging.getLogger("ckptd")



class ActionKind(str, Enum):
    """Why a step directory is removed; the value is what JSON, logs and metric labels show."""
    EXPIRED = "expired"         # committed, past retention
    ABANDONED = "abandoned"     # never committed, untouched for abandoned_after
    ABOVE = "above"             # numbered above ``ckptd gc --remove-above N``: a rolled-back run's

    def __str__(self) -> str:   # plain "expired" in f-strings and metric labels, on every Python
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


_DESCRIBE = {ActionKind.EXPIRED: "committed step past retention",
             ActionKind.ABANDONED: "abandoned uncommitted step",
             ActionKind.ABOVE: "step above --remove-above (a rolled-back run's)"}


@dataclass
class Action:
    job: str
    step: int
    path: str
    kind: ActionKind
    done: bool = False
    error: str | None = None
    gone: bool = False          # removed by another process first (not by this pass; no error)

    def describe(self) -> str:
        return f"{self.path}: {_DESCRIBE[self.kind]}"


@dataclass
class GcResult:
    actions: list[Action] = field(default_factory=list)
    kept: list[tuple[str, int, str]] = field(default_factory=list)     # (job, step, why)
    skipped: list[str] = field(default_factory=list)                   # paths not touched, with reason
    stray_temps: list[str] = field(default_factory=list)   # temp files found in committed steps (removed)
    unreadable: list[tuple[str, str]] = field(default_factory=list)     # (path, why): left as they are

    @property
    def removed(self) -> list[Action]:
        return [a for a in self.actions if a.done]

    @property
    def errors(self) -> list[Action]:
        return [a for a in self.actions if a.error]


def last_touched(path: str) -> float:
    """Newest mtime of a step directory and its entries (a write in progress keeps it young)."""
    newest = os.lstat(path).st_mtime
    with os.scandir(path) as it:
        for e in it:
            try:
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                pass
    return newest


def plan_job(job_path: str, policy: RetentionPolicy, *, now: float | None = None, in_flight: Iterable[int] = (),
             above: int | None = None, unreadable: list[tuple[str, str]] | None = None,
             steps: list[StepInfo] | None = None, report_kept: bool = True,
             ) -> tuple[list[Action], list[tuple[str, int, str]]]:
    """What to delete in one job directory under ``policy``; nothing is touched. ``above``: every step
    numbered above it goes too, committed or not (``ckptd gc --remove-above``: a rolled-back run's steps,
    which would outrank the new run's), and the newest committed step kept is the newest at or below it.
    A step directory that cannot be read is never planned for removal (it may be committed): it is kept,
    and added to ``unreadable`` as (path, why). ``steps``: the job's listing, when the caller made it;
    ``report_kept`` false (the daemon's passes): with no keep rule (keep_last = 0, no ``above``) the
    committed steps, every one kept, are not gone through at all."""
    now = time.time() if now is None else now
    job = os.path.basename(os.path.normpath(job_path))
    protected = set(in_flight)
    kept: list[tuple[str, int, str]] = []
    listed, steps = (list_steps(job_path) if steps is None else steps), []
    for s in listed:                        # symlinked step directories are already left out
        if s.unreadable is None:
            steps.append(s)
        else:
            _unreadable(job, s.step, s.path, s.unreadable, kept, unreadable)
    if policy.keep_last == 0 and above is None and not report_kept:
        steps = [s for s in steps if not s.committed]       # (keep_last = 0 keeps every committed step)
    actions = [Action(job, s.step, s.path, ActionKind.ABOVE) for s in steps if above is not None and s.step > above]
    steps = [s for s in steps if above is None or s.step <= above]
    committed = [s for s in steps if s.committed]
    keep: dict[int, str] = {}
    if committed:
        keep[committed[-1].step] = "newest committed"
        numbers = [s.step for s in committed]
        for rule in policy.rules:
            for step, why in rule.keep(numbers).items():
                keep.setdefault(step, why)
    for s in steps:
        if s.step in protected:
            kept.append((job, s.step, "in flight"))
        elif s.committed:
            if s.step in keep:
                kept.append((job, s.step, keep[s.step]))
            else:
                actions.append(Action(job, s.step, s.path, ActionKind.EXPIRED))
        else:
            try:
                age = now - last_touched(s.path)
            except FileNotFoundError:
                continue
            except OSError as e:            # EACCES: its age cannot be told, nor what it holds
                _unreadable(job, s.step, s.path, step_files.os_reason(e), kept, unreadable)
                continue
            if age >= policy.abandoned_after:
                actions.append(Action(job, s.step, s.path, ActionKind.ABANDONED))
            else:
                kept.append((job, s.step, f"uncommitted, touched {age:.0f}s ago (may still be written)"))
    return actions, kept


def _unreadable(job: str, step: int, path: str, why: str, kept: list[tuple[str, int, str]],
                unreadable: list[tuple[str, str]] | None) -> None:
    kept.append((job, step, f"unreadable ({why}); never removed while it cannot be read (it may be committed)"))
    if unreadable is not None:
        unreadable.append((path, why))


def plan_memory_level(job_path: str, policy: RetentionPolicy, *, now: float, in_flight: Iterable[int] = (),
                      above: int | None = None, unreadable: list[tuple[str, str]] | None = None) -> list[Action]:
    """The uncommitted memory-level step directories of one job untouched for ``abandoned_after``
    (the memory tier prunes the committed ones), and every one above ``above``; nothing is touched. One
    that cannot be read is never planned, and added to ``unreadable``."""
    root, name = os.path.split(os.path.normpath(job_path))
    job = memory_job(name)
    protected, actions, kept = set(in_flight), list[Action](), list[tuple[str, int, str]]()
    for s in memory_level_steps(root, name):        # (none through a symlinked _memory)
        if s.unreadable is not None:
            _unreadable(job, s.step, s.path, s.unreadable, kept, unreadable)
            continue
        if above is not None and s.step > above:
            actions.append(Action(job, s.step, s.path, ActionKind.ABOVE))
            continue
        if s.committed or s.step in protected:
            continue
        try:
            if now - last_touched(s.path) >= policy.abandoned_after:
                actions.append(Action(job, s.step, s.path, ActionKind.ABANDONED))
        except FileNotFoundError:
            continue
        except OSError as e:
            _unreadable(job, s.step, s.path, step_files.os_reason(e), kept, unreadable)
    return actions


def execute(actions: list[Action], dry_run: bool = False) -> None:
    for a in actions:
        if dry_run:
            continue
        try:
            a.done = step_files.remove_step(a.path)
            a.gone = not a.done
        except OSError as e:
            a.error = str(e) if not e.strerror else f"{e.strerror}: {e.filename or a.path}"


@dataclass
class JobMemo:
    """What a daemon's earlier passes over one job learned, so that a pass after a commit costs the same
    however many steps the job holds (``ckptd gc`` keeps none: it looks at everything). ``swept``: each
    committed step directory seen, by name, with when its stray temps were last looked for; each is
    looked into again once ``abandoned_after`` has passed since (a temp is garbage only once untouched
    for that long), and with no keep rule taken for committed meanwhile without a look (committed stays
    committed until removed; a step removed and saved again under its name is looked at, and abandoned
    if never committed, within ``abandoned_after`` more). ``warned``: the unreadable paths logged."""
    swept: dict[str, float] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)


def list_job(job_path: str, *, memo: JobMemo | None = None, trusted: float | None = None,
             ) -> tuple[list[StepInfo], list[str], set[str]]:
    """One listing of a job's directory (the only one a pass makes): its steps as ``list_steps`` lists
    them, the names of removals killed midway (``.removing-…``) and every name listed. With ``trusted``,
    the steps ``memo`` swept at or after it are left out unlooked at (committed, every one kept: no keep
    rule)."""
    try:
        names = os.listdir(job_path)
    except FileNotFoundError:
        return [], [], set()
    listed = set(names)
    if memo is not None and trusted is not None:
        unknown = listed - memo.swept.keys()                   # (set operations: no Python loop per step)
        if memo.swept and min(memo.swept.values()) < trusted:   # some due to be looked into again
            unknown |= {n for n, t in memo.swept.items() if t < trusted and n in listed}
        names = list(unknown)
    steps, removing = [], []
    for name in names:
        step = parse_step_dir_name(name)
        if step is None:
            if step_files.is_removing(name):
                removing.append(name)
            continue
        path = os.path.join(job_path, name)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):      # (a symlink is no step)
                continue
            steps.append(StepInfo(step, path, step_files.committed_or_raise(path)))
        except FileNotFoundError:
            continue
        except OSError as e:
            steps.append(StepInfo(step, path, False, step_files.os_reason(e)))
    return sorted(steps, key=lambda s: s.step), removing, listed


def collect_job(root: str, job: str, policy: RetentionPolicy, *, dry_run: bool = False,
                in_flight: Iterable[int] = (), memory_in_flight: Iterable[int] = (),
                now: float | None = None, above: int | None = None, memo: JobMemo | None = None) -> GcResult:
    """Apply ``policy`` to one job (the daemon calls this after each storage commit of the job),
    sparing the storage steps ``in_flight`` and the memory-level ones ``memory_in_flight``; ``above``:
    see ``plan_job``. What cannot be read (the job's directory, a step's) is left as it is, listed in
    ``unreadable`` and logged; the rest is collected. The job's directory is listed once; with ``memo``
    (the daemon's, one per job) only the steps committed since the last pass, or not looked into for
    ``abandoned_after``, are looked into for stray temps, and with no keep rule the committed steps are
    neither stat'ed nor planned: a pass costs the same however long the job's history."""
    validate_job(job)
    job_path = os.path.join(root, job)
    result = GcResult()
    if os.path.islink(job_path):
        result.skipped.append(f"{job_path}: a symlink; gc does not follow links")
        return result
    now = time.time() if now is None else now
    before = now - policy.abandoned_after       # a temp untouched since then is garbage; so is a sweep
    lean = memo is not None and policy.keep_last == 0 and above is None
    try:
        steps, removing, listed = list_job(job_path, memo=memo, trusted=before if lean else None)
    except OSError as e:                    # the job's directory: nothing in it can be collected
        result.unreadable.append((job_path, step_files.os_reason(e)))
        _warn_unreadable(job, result.unreadable, memo)
        return result
    actions, kept = plan_job(job_path, policy, now=now, in_flight=in_flight, above=above,
                             unreadable=result.unreadable, steps=steps, report_kept=memo is None)
    try:
        actions += plan_memory_level(job_path, policy, now=now, in_flight=memory_in_flight, above=above,
                                     unreadable=result.unreadable)
    except OSError as e:
        result.unreadable.append((os.path.join(job_path, MEMORY_LEVEL_DIR), step_files.os_reason(e)))
    execute(actions, dry_run)
    result.actions, result.kept = actions, kept
    if not dry_run:         # what removals killed midway left (hidden ``.removing-…`` directories)
        _finish_removals(job, job_path, removing, result)
    # A temp file in a committed step is garbage once nothing writes it: one untouched for
    # abandoned_after (a rank staging its files into a step staged from the bucket writes one there).
    planned = {a.path for a in actions}
    for s in steps:
        name = os.path.basename(s.path)
        if not s.committed or s.path in planned:
            if memo is not None:
                memo.swept.pop(name, None)
            continue
        if memo is not None and memo.swept.get(name, -math.inf) >= before:
            continue                        # looked into less than abandoned_after ago
        try:
            result.stray_temps += step_files.stray_temps(s.path, older_than=before)
        except OSError as e:
            result.unreadable.append((s.path, step_files.os_reason(e)))
            continue
        if memo is not None:
            memo.swept[name] = now
    if memo is not None and memo.swept.keys() - listed:       # steps removed since (by gc, another node)
        for name in memo.swept.keys() - listed:
            del memo.swept[name]
    if not dry_run and result.stray_temps:
        step_files.remove_files(result.stray_temps)
        log.info("removed stray temp files", extra={"ctx": {"job": job, "files": result.stray_temps[:20]}})
    for a in result.removed:
        log.info("removed step", extra={"ctx": {"job": a.job, "step": a.step, "reason": a.kind}})
    for a in result.errors:
        log.warning("could not remove step", extra={"ctx": {"job": a.job, "step": a.step, "error": a.error}})
    _warn_unreadable(job, result.unreadable, memo)
    return result


def _warn_unreadable(job: str, unreadable: list[tuple[str, str]], memo: JobMemo | None) -> None:
    """A warning per unreadable path (the daemon: once, until it is readable again)."""
    paths = {p for p, _ in unreadable}
    if memo is not None:
        memo.warned &= paths
    for path, why in unreadable:
        if memo is not None:
            if path in memo.warned:
                continue
            memo.warned.add(path)
        log.warning(f"retention cannot read {path} ({why}): left as it is (it may be committed), the job's other "
                    f"steps collected; {step_files.UNREADABLE_FIX}", extra={"ctx": {"job": job, "path": path}})


def _finish_removals(job: str, job_path: str, removing: list[str], result: GcResult) -> None:
    """The job's ``removing`` (from its one listing) and its _memory's."""
    memory_path = os.path.join(job_path, MEMORY_LEVEL_DIR)
    for path in [job_path] + ([] if os.path.islink(memory_path) else [memory_path]):
        try:
            done, kept = step_files.finish_removals(path, removing if path == job_path else None)
        except OSError as e:
            if not any(p == path for p, _ in result.unreadable):
                result.unreadable.append((path, step_files.os_reason(e)))
            continue
        result.skipped += kept
        if done:
            log.info("finished removals killed midway", extra={"ctx": {"job": job, "removed": done[:20]}})
        for why in kept:
            log.warning("could not finish a removal killed midway", extra={"ctx": {"job": job, "error": why}})


def collect_root(root: str, policy: RetentionPolicy, *, dry_run: bool = False, jobs: Iterable[str] | None = None,
                 now: float | None = None, above: int | None = None) -> GcResult:
    """Apply ``policy`` to every job under ``root`` (``ckptd gc``), or ``jobs``; ``above``: see ``plan_job``."""
    result = GcResult()
    if jobs is None:
        try:
            names = sorted(os.listdir(root))
        except FileNotFoundError:
            raise FileNotFoundError(f"{root}: no such directory") from None
        jobs = []
        for name in names:
            path = os.path.join(root, name)
            try:
                validate_job(name)
            except ValueError:
                result.skipped.append(f"{path}: not a job directory name")
                continue
            if os.path.islink(path):
                result.skipped.append(f"{path}: a symlink; gc does not follow links")
            elif os.path.isdir(path):
                jobs.append(name)
    for job in jobs:        # (collect_job reports what it cannot read: one job never stops the others)
        r = collect_job(root, job, policy, dry_run=dry_run, now=now, above=above)
        result.actions += r.actions
        result.kept += r.kept
        result.skipped += r.skipped
        result.stray_temps += r.stray_temps
        result.unreadable += r.unreadable
    return result
