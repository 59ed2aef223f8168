"""``ckptd ls | verify | inspect``: steps named as users know them (ROOT JOB STEP), paths shown.

Users see jobs and step numbers, never ``step-000000000020``; so verify and inspect take
``ROOT JOB STEP`` (``20`` or ``step-20``) as well as a step directory, ``ls`` shows each
step's path, and a wrong name is a usage error (exit 2, with a "did you mean") rather than
a FAULT (exit 1), which is kept for what is really wrong with a step.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import time
from collections.abc import Iterable
from typing import Any

from ckptd import bucket_cli
from ckptd.core.describe import describe_step, human_size, render_step
from ckptd.core.names import INDEX_NAME, MEMORY_LEVEL_DIR, STAGED_NAME, parse_step_dir_name, step_dir_name, validate_job
from ckptd.core.reader import (
    Fault,
    StepInfo,
    StepReader,
    is_memory_level,
    list_steps,
    memory_level_steps,
    verify_step,
)
from ckptd.core.step_files import UNREADABLE_FIX, os_reason

USAGE = 2       # argparse's exit status for a usage error; 1 stays a FAULT (or a failed command)
_STEP_ARG = re.compile(r"^(?:step-)?([0-9]{1,12})\Z")
STEP_FORMS = "STEP_DIR | ROOT JOB STEP"
HELD_BYTES = "its bytes are only in the daemons' memory"      # a memory-level step's (FORMAT.md)


class UsageError(ValueError):
    """A name or path that does not name what the command needs; the text says what would."""


def _age(seconds: float) -> str:
    for unit, div in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= div:
            return f"{seconds / div:.1f}{unit}"
    return f"{seconds:.0f}s"


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``options``, or ``""``."""
    close = difflib.get_close_matches(word, list(options), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def parse_step(text: str) -> int:
    """``20``, ``step-20`` or ``step-000000000020`` → 20."""
    m = _STEP_ARG.match(text)
    if not m:
        raise UsageError(f"step {text!r}: give a step number, e.g. 20 or step-20")
    return int(m.group(1))


def step_argument(text: str) -> int:
    """``parse_step`` as an option's type: a bad step (negative, too long, not a number) is a usage error
    (exit 2) before anything is looked at, never a number that widens what the option touches."""
    try:
        return parse_step(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def jobs_under(root: str) -> list[str]:
    """The job directories under a root (names a job may have; dot-files and others are not jobs)."""
    out = []
    for name in sorted(os.listdir(root)):
        try:
            validate_job(name)
        except ValueError:
            continue
        if os.path.isdir(os.path.join(root, name)):
            out.append(name)
    return out


def _listed(items: list[str], limit: int = 8) -> str:
    return ", ".join(items[:limit]) + (f", ... ({len(items)} in all)" if len(items) > limit else "") or "none"


def job_path(root: str, job: str) -> str:
    """``ROOT/JOB``, which must exist; UsageError naming the jobs there otherwise."""
    if not os.path.isdir(root):
        raise UsageError(f"{root}: no such directory")
    try:
        validate_job(job)
    except ValueError as e:
        raise UsageError(str(e)) from None
    path = os.path.join(root, job)
    if not os.path.isdir(path):
        jobs = jobs_under(root)
        raise UsageError(f"no job {job!r} under {root}{did_you_mean(job, jobs)} (jobs there: {_listed(jobs)})")
    return path


def _steps_text(steps: list[StepInfo], near: int | None = None) -> str:
    numbers = [s.step for s in steps]
    if near is not None:
        numbers = sorted(sorted(numbers, key=lambda n: abs(n - near))[:5])
    return _listed([str(n) for n in numbers])


def job_steps(root: str, job: str) -> list[StepInfo]:
    """A job's steps, storage and memory-level (``<job>/_memory``) alike, oldest first."""
    return sorted(list_steps(job_path(root, job)) + memory_level_steps(root, job), key=lambda s: s.step)


def step_path(root: str, job: str, step: str) -> str:
    """``ROOT JOB STEP`` → the step directory, which must exist (an s3:// ROOT → the step's URL): the
    storage step N, else the memory-level step N (``ckptd ls`` lists both by number)."""
    n = parse_step(step)
    if root.startswith("s3://"):
        try:
            validate_job(job)
        except ValueError as e:
            raise UsageError(str(e)) from None
        return f"{root.rstrip('/')}/{job}/{step_dir_name(n)}"
    path = os.path.join(job_path(root, job), step_dir_name(n))
    if os.path.lexists(path):
        return path
    steps = job_steps(root, job)
    held = [s.path for s in steps if s.step == n]        # no storage step N: a memory-level one
    if held:
        return held[0]
    nearest = min(steps, key=lambda s: abs(s.step - n)).step if steps else None
    raise UsageError(f"job {job!r} under {root} has no step {n}"
                     + (f"; did you mean {nearest}? (its steps near {n}: {_steps_text(steps, n)})" if steps
                        else "; it has no steps"))


def _not_a_step(path: str, command: str) -> UsageError:
    """Why ``path`` is not a step directory, and what the user probably meant."""
    p = os.path.abspath(path)
    if os.path.isdir(p):
        steps = list_steps(p)
        if steps:
            return UsageError(f"{path} is a job's directory, not a step; give a step: `ckptd {command} "
                              f"{os.path.dirname(p)} {os.path.basename(p)} {steps[-1].step}` (its steps: "
                              f"{_steps_text(steps)})")
        jobs = jobs_under(p)
        if jobs:
            return UsageError(f"{path} is a checkpoint root, not a step; give a job and a step: "
                              f"`ckptd {command} {path} JOB STEP` (jobs there: {_listed(jobs)})")
        return UsageError(f"{path}: not a step directory (give {STEP_FORMS})")
    where, missing = p, []
    while not os.path.isdir(where):
        missing.append(os.path.basename(where))
        where = os.path.dirname(where)
    wrong, rest = missing[-1], missing[-2::-1]
    hint = ""
    m = _STEP_ARG.match(wrong)
    if m and os.path.isdir(os.path.join(where, step_dir_name(int(m.group(1))))):
        hint = (f"; did you mean {os.path.join(where, step_dir_name(int(m.group(1))))} "
                f"(or `ckptd {command} {os.path.dirname(where)} {os.path.basename(where)} {int(m.group(1))}`)?")
    else:
        names = sorted(n for n in os.listdir(where) if not n.startswith("."))     # (.removing-…: no step)
        close = difflib.get_close_matches(wrong, names, n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {os.path.join(where, close[0], *rest)}?"
    return UsageError(f"{path}: no such step directory{hint}")


def resolve(targets: list[str], command: str) -> str:
    """A step directory (or s3:// URL) from ``STEP_DIR`` or ``ROOT JOB STEP``; UsageError if neither."""
    if len(targets) == 3:
        return step_path(*targets)
    if len(targets) == 2 and not targets[0].startswith("s3://"):     # ROOT JOB: the step is missing
        steps = job_steps(*targets)
        raise UsageError(f"give the step too: `ckptd {command} {targets[0]} {targets[1]} STEP` "
                         f"(its steps: {_steps_text(steps)})")
    if len(targets) != 1:
        raise UsageError(f"give {STEP_FORMS}, got {len(targets)} arguments")
    path = targets[0]
    if path.startswith("s3://"):
        return path
    if parse_step_dir_name(os.path.basename(os.path.abspath(path))) is not None and os.path.lexists(path):
        return path
    raise _not_a_step(path, command)


def _dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        try:
            total += os.lstat(os.path.join(path, name)).st_size
        except OSError:
            pass
    return total


def _row(job: str, info: StepInfo, now: float, memory: bool = False) -> dict[str, Any] | None:
    """The ``ls`` row of a listed step; None when the step is gone by now (retention or ``gc`` removed
    it after it was listed). A step whose directory cannot be read is a row of its own state
    (``unreadable (EACCES: Permission denied)``), never an error that ends the listing."""
    try:
        return _row_of(job, info, now, memory)
    except FileNotFoundError:
        return None
    except OSError as e:
        return _unreadable_row(job, info.step, info.path, os_reason(e), memory, now)


def _unreadable_row(job: str, step: int | None, path: str, why: str, memory: bool, now: float) -> dict[str, Any]:
    """A step (or, ``step`` None, a whole job) whose directory ckptd cannot read: its owner or mode."""
    try:
        age: float | None = round(now - os.lstat(path).st_mtime, 1)
    except OSError:
        age = None
    return {"job": job, "step": step, "state": f"unreadable ({why})", "level": "memory" if memory else "storage",
            "path": path, "bytes_on_disk": None, "raw_bytes": None, "stored_bytes": None,
            "sizes_verified": False, "ratio": None, "age_s": age}


def _row_of(job: str, info: StepInfo, now: float, memory: bool) -> dict[str, Any] | None:
    if info.unreadable is not None:
        return _unreadable_row(job, info.step, info.path, info.unreadable, memory, now)
    raw = stored = None
    verified = False        # format 2: the index's digest covers the sizes shown
    state = ("memory-level" if memory else "committed") if info.committed else "uncommitted"
    if os.path.isfile(os.path.join(info.path, STAGED_NAME)):    # a copy from the bucket, not a commit here
        state = "staged" if info.committed else "staging"
    if info.committed:
        try:
            index = StepReader(info.path).index
            raw = sum(r["raw_bytes"] for r in index["ranks"])
            stored = sum(r["stored_bytes"] for r in index["ranks"])
            verified = index["format_version"] >= 2
        except (ValueError, OSError) as e:      # FormatError, or a file over its size limit
            if not os.path.lexists(info.path):
                return None                     # removed while read, not invalid
            if not os.path.lexists(os.path.join(info.path, INDEX_NAME)):
                # un-committed since it was listed (its index.json went first: a removal, a memory-level
                # step saved again): what it is now, not a false alarm
                state = "uncommitted" if state != "staged" else "staging"
            else:
                state = f"invalid ({e})"
    return {"job": job, "step": info.step, "state": state, "level": "memory" if memory else "storage",
            "path": info.path, "bytes_on_disk": _dir_bytes(info.path),
            "raw_bytes": raw, "stored_bytes": stored, "sizes_verified": verified,
            "ratio": round(raw / stored, 3) if raw and stored else None,
            "age_s": round(now - os.stat(info.path).st_mtime, 1)}


def cmd_ls(args: argparse.Namespace) -> int:
    if args.root.startswith("s3://"):
        return bucket_cli.ls_bucket(args)
    missing: UsageError | None = None
    try:
        if not os.path.isdir(args.root):
            raise UsageError(f"{args.root}: no such directory")
        if args.job:
            job_path(args.root, args.job)
    except UsageError as e:
        missing = e
    now = time.time()
    listed = [] if missing else [
        row for job in ([args.job] if args.job else jobs_under(args.root)) for row in _job_rows(args.root, job, now)]
    rows = sorted(listed, key=lambda r: (r["job"], -1 if r["step"] is None else r["step"], r["level"]))
    unreadable = [r for r in rows if r["state"].startswith("unreadable")]
    if missing is None or args.job:
        bucket_cli.add_tiers(rows, args)       # a job the bucket has is listed on a node that has none of it
    if missing is not None and not rows:
        print(f"ckptd ls: {missing}", file=sys.stderr)
        return USAGE
    for r in rows:
        r.setdefault("path", None)             # a step only the bucket has
    if unreadable:
        print(f"ckptd ls: cannot read {len(unreadable)} director{'y' if len(unreadable) == 1 else 'ies'} (listed as "
              f"unreadable; what is in them is not listed), e.g. {unreadable[0]['path']}: {UNREADABLE_FIX}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 1 if unreadable else 0
    if not rows:
        print(f"no checkpoints under {args.root}" + (f" for job {args.job}" if args.job else ""))
        return 0
    print(f"{'JOB':20s} {'STEP':>10s} {'STATE':12s} {'ON DISK':>11s} {'RAW':>11s} {'RATIO':>6s} {'AGE':>7s}  PATH")
    for r in rows:
        raw_text = "-" if r["raw_bytes"] is None else human_size(r["raw_bytes"]) + ("" if r["sizes_verified"] else "*")
        on_disk = "-" if r["bytes_on_disk"] is None else human_size(r["bytes_on_disk"])
        print(f"{r['job'][:20]:20s} {'-' if r['step'] is None else r['step']:>10} {r['state']:12s} {on_disk:>11s} "
              f"{raw_text:>11s} {format(r['ratio'], '.3f') if r['ratio'] else '-':>6} "
              f"{_age(r['age_s']) if r['age_s'] is not None else '-':>7s}  {r['path'] or '-'}"
              + (f"  {r['tiers']}" if "tiers" in r else ""))
    if any(r["level"] == "memory" for r in rows):
        print("memory-level: held in the daemons' memory and their peers' only (ON DISK: its index and manifests); "
              "gone once every daemon holding it restarted")
    if any(r["raw_bytes"] is not None and not r["sizes_verified"] for r in rows):
        print("* format-1 step: sizes from an index with no digest (unverified; `ckptd verify` checks the data)")
    return 1 if unreadable else 0


def _job_rows(root: str, job: str, now: float) -> list[dict[str, Any]]:
    """One job's ``ls`` rows, storage and memory-level; a directory that cannot be read (the job's, its
    ``_memory``) is one row, ``unreadable (…)``, with no step."""
    rows = []
    for memory in (False, True):
        path = os.path.join(root, job, *([MEMORY_LEVEL_DIR] if memory else []))
        try:
            steps = list_steps(path)
        except OSError as e:
            rows.append(_unreadable_row(job, None, path, os_reason(e), memory, now))
            break           # (its _memory is inside it: not reached either)
        rows += [r for r in (_row(job, info, now, memory) for info in steps) if r is not None]
    return rows


def cmd_verify(args: argparse.Namespace) -> int:
    try:
        args.step_dir = resolve(args.target, "verify")
    except UsageError as e:
        print(f"ckptd verify: {e}", file=sys.stderr)
        return USAGE
    progress = None if args.quiet else (lambda m: print(m, file=sys.stderr))
    try:
        faults = (bucket_cli.bucket_faults(args, progress) if args.step_dir.startswith("s3://")
                  else verify_step(args.step_dir, progress=progress))
    except (ValueError, OSError, EOFError) as e:     # e.g. an index or manifest over its size limit
        faults = [Fault(args.step_dir, None, str(e))]
    for f in faults:
        print(f"FAULT {f}")
    if faults:
        print(f"{args.step_dir}: {len(faults)} fault(s)")
        return 1
    held = f" (memory-level step: its index and manifests check out; {HELD_BYTES}, not checked here)"
    print(f"{args.step_dir}: OK" + (held if is_memory_level(args.step_dir) else ""))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        step_dir = resolve(args.target, "inspect")
        if step_dir.startswith("s3://"):
            raise UsageError("inspect reads a local step; `ckptd verify` takes s3:// URLs")
    except UsageError as e:
        print(f"ckptd inspect: {e}", file=sys.stderr)
        return USAGE
    try:
        desc = describe_step(StepReader(step_dir))
    except (ValueError, OSError) as e:     # FormatError, or a file over its size limit
        print(f"ckptd inspect: {e}", file=sys.stderr)
        return 1
    print(json.dumps(desc, indent=1) if args.json else "\n".join(render_step(desc, human_size)))
    if not args.json and is_memory_level(step_dir):
        print(f"memory-level step: {HELD_BYTES} (on disk: its index and manifests)")
    return 0


def add_parsers(sub: Any) -> None:
    s = sub.add_parser("ls", help="list steps", description=(
        "List steps, committed or not, with their paths, sizes and ratios. A JOB that is not under ROOT "
        "is a usage error (exit 2)."))
    s.add_argument("root", help="checkpoint root, or a bucket: s3://bucket/prefix")
    s.add_argument("job", nargs="?")
    s.add_argument("--json", action="store_true")
    bucket_cli.add_bucket_flags(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("verify", help="check every checksum and the geometry of a step",
                       usage=f"%(prog)s [-h] [-q] [--s3-endpoint URL] [--config FILE] {STEP_FORMS}", description=(
        "Verify every manifest digest and chunk checksum, and (format 2) that the index's tensor map agrees "
        "with the manifests and its sharded tensors' pieces tile them exactly (a memory-level step: its index "
        "and manifests; its bytes are only in the daemons' memory). Exit 1 on any fault; exit 2 when the "
        "arguments name no step."))
    s.add_argument("target", nargs="+", metavar="STEP",
                   help="ROOT JOB STEP (STEP: 20 or step-20; ROOT may be s3://bucket/prefix), or one step "
                        "directory, e.g. from `ckptd ls` (or s3://bucket/prefix/JOB/step-N)")
    s.add_argument("-q", "--quiet", action="store_true")
    bucket_cli.add_bucket_flags(s)
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("inspect", help="list a step's tensors and how they are split",
                       usage=f"%(prog)s [-h] [--json] {STEP_FORMS}", description=(
        "Every tensor's dtype, global shape and split (sharded: each piece's rank and region; local: which "
        "ranks hold a copy, the same or per rank), the per-rank keys, world size and sizes. Reads index.json "
        "only (format 1: the manifests); `ckptd verify` checks the bytes."))
    s.add_argument("target", nargs="+", metavar="STEP", help="ROOT JOB STEP (STEP: 20 or step-20), or a step directory")
    s.add_argument("--json", action="store_true", help="everything, every piece, as JSON")
    s.set_defaults(func=cmd_inspect)
