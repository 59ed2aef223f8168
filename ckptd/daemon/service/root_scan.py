"""What the daemon finds in its root at start, logged once, so an operator hears of it before a restore trips on it.

A daemon or node killed mid-save leaves uncommitted step directories (retention removes them once
``abandoned_after`` passes), and a file system that lost writes can leave a job's newest committed
step unreadable (a truncated ``index.json``): every ``restore()`` without a step then fails on it.
Neither is an error of the daemon's, and it starts as usual; the log says what it found and what to
do. Bounded: at most ``MAX_JOBS`` jobs, per job its step listing and what a restore reads first of its
newest committed step (``StepReader``: the index, or its head when large), on a thread after serving
begins.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ckptd.core.errors import FormatError
from ckptd.core.names import validate_job
from ckptd.core.reader import StepReader, list_steps

log = logging.getLogger("ckptd")

MAX_JOBS = 1000          # jobs looked at; a root with more is scanned in part (said in the log)
SHOWN = 10               # step numbers listed per finding


@dataclass(frozen=True)
class JobFindings:
    """One job's leftovers: uncommitted step directories, and the newest committed step if it does not load."""
    job: str
    uncommitted: tuple[int, ...]
    newest: int | None
    newest_fault: str | None


def scan(root: str) -> tuple[list[JobFindings], bool]:
    """The jobs under ``root`` with something to report, and whether the scan stopped at ``MAX_JOBS``."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return [], False
    found: list[JobFindings] = []
    jobs = 0
    for name in names:
        path = os.path.join(root, name)
        try:
            validate_job(name)
        except ValueError:
            continue
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        jobs += 1
        if jobs > MAX_JOBS:
            return found, True
        steps = list_steps(path)
        committed = [s for s in steps if s.committed]
        fault = None
        if committed:
            try:
                StepReader(committed[-1].path)
            except (FormatError, OSError, ValueError) as e:
                fault = str(e)
        uncommitted = tuple(s.step for s in steps if not s.committed)
        if uncommitted or fault:
            found.append(JobFindings(name, uncommitted, committed[-1].step if committed else None, fault))
    return found, False


def report(root: str) -> None:
    """(A thread) Scan ``root`` and log what was found."""
    found, partial = scan(root)
    for f in found:
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
