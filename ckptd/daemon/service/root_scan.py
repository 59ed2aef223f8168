"""What the daemon finds in its root at start, logged once, so an operator hears of it before a restore trips on it.

A daemon or node killed mid-save leaves uncommitted step directories (retention removes them once
``abandoned_after`` passes), and a file system that lost writes can leave a job's newest committed
step unreadable (a truncated ``index.json``): every ``restore()`` without a step then fails on it.
Neither is an error of the daemon's, and it starts as usual; the log says what it found and what to
do; so does a directory it cannot read (a job's or a step's: its owner or mode), which no other job's scan
waits on. Step removals a killed daemon or ``ckptd gc`` left midway (hidden ``.removing-…`` directories) are
finished first. Bounded: at most ``MAX_JOBS`` jobs, per job its step listing and what a restore reads first of its
newest committed step (``StepReader``: the index, or its head when large), on a thread after serving
begins.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ckptd.core import step_files
from ckptd.core.errors import FormatError
from ckptd.core.names import MEMORY_LEVEL_DIR, validate_job
from ckptd.core.reader import StepReader, list_steps

log = logging.getLogger("ckptd")

MAX_JOBS = 1000          # jobs looked at; a root with more is scanned in part (said in the log)
SHOWN = 10               # step numbers listed per finding


@dataclass(frozen=True)
class JobFindings:
    """One job's leftovers: uncommitted step directories, the newest committed step if it does not load,
    and the directories (the job's own, or its steps') that cannot be read, each with why."""
    job: str
    uncommitted: tuple[int, ...]
    newest: int | None
    newest_fault: str | None
    unreadable: tuple[tuple[str, str], ...] = ()


def job_names(root: str) -> tuple[list[str], bool]:
    """The job directories under ``root`` (at most ``MAX_JOBS``), and whether there were more (the scan;
    ``ckptd status``: a restarted daemon's jobs committed before it started)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return [], False
    jobs: list[str] = []
    for name in names:
        path = os.path.join(root, name)
        try:
            validate_job(name)
        except ValueError:
            continue
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        if len(jobs) == MAX_JOBS:
            return jobs, True
        jobs.append(name)
    return jobs, False


def scan(root: str) -> tuple[list[JobFindings], bool]:
    """The jobs under ``root`` with something to report, and whether the scan stopped at ``MAX_JOBS``."""
    jobs, partial = job_names(root)
    found: list[JobFindings] = []
    for name in jobs:
        path = os.path.join(root, name)
        try:
            steps = list_steps(path)
        except OSError as e:            # the job's own directory: reported, the other jobs scanned
            found.append(JobFindings(name, (), None, None, ((path, step_files.os_reason(e)),)))
            continue
        unreadable = tuple((s.path, s.unreadable) for s in steps if s.unreadable is not None)
        steps = [s for s in steps if s.unreadable is None]
        committed = [s for s in steps if s.committed]
        fault = None
        if committed:
            try:
                StepReader(committed[-1].path)
            except (FormatError, OSError, ValueError) as e:
                fault = str(e)
        uncommitted = tuple(s.step for s in steps if not s.committed)
        if uncommitted or fault or unreadable:
            found.append(JobFindings(name, uncommitted, committed[-1].step if committed else None, fault, unreadable))
    return found, partial


def finish_removals(root: str) -> None:
    """Finish the step removals a killed daemon or ``ckptd gc`` left midway (hidden ``.removing-…``
    directories: never read as steps, ``step_files.remove_step``), in each job and its ``_memory``."""
    for name in job_names(root)[0]:
        for path in (os.path.join(root, name), os.path.join(root, name, MEMORY_LEVEL_DIR)):
            if os.path.islink(path):
                continue
            try:
                done, kept = step_files.finish_removals(path)
            except OSError:             # unreadable: the scan reports it
                continue
            if done:
                log.info(f"job {name}: finished {len(done)} step removals killed midway",
                         extra={"ctx": {"job": name, "removed": done[:SHOWN]}})
            for why in kept:
                log.warning(f"job {name}: could not finish a step removal killed midway: {why}",
                            extra={"ctx": {"job": name}})


def report(root: str) -> None:
    """(A thread) Finish interrupted removals, scan ``root`` and log what was found."""
    finish_removals(root)
    found, partial = scan(root)
    for f in found:
        for path, why in f.unreadable:
            log.warning(f"job {f.job}: cannot read {path} ({why}): ckptd neither lists, loads nor removes what is "
                        f"in it (it may be committed); {step_files.UNREADABLE_FIX}",
                        extra={"ctx": {"job": f.job, "path": path}})
        if f.newest_fault is not None:
            log.warning(f"job {f.job}: its newest committed step {f.newest} does not load ({f.newest_fault[:300]}): "
                        f"restore() without a step fails on it; check it with `ckptd verify {root} {f.job} "
                        f"{f.newest}`, and to resume from the step before, remove it: `ckptd gc {root} --job {f.job} "
                        f"--remove-above {f.newest - 1 if f.newest else 0}` (the job's trainers stopped)",
                        extra={"ctx": {"job": f.job, "step": f.newest}})
        if f.uncommitted:
            shown = ", ".join(map(str, f.uncommitted[:SHOWN])) + (" …" if len(f.uncommitted) > SHOWN else "")
            log.info(f"job {f.job}: {len(f.uncommitted)} uncommitted step directories ({shown}): saves that "
                     "never committed (a killed daemon or trainer; or, on a shared root, being written by another "
                     "node's daemon); never loaded, removed by retention once abandoned_after passes",
                     extra={"ctx": {"job": f.job, "steps": list(f.uncommitted[:SHOWN])}})
    if partial:
        log.info(f"start-up scan of {root} looked at its first {MAX_JOBS} jobs only")
