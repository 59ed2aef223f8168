"""A step directory on disk: what makes it committed, and the file operations on it.

One definition for the daemon's commit and cleanup, retention, bucket staging and uploads, the
readers and ``ckptd import`` (FORMAT.md, "Layout"): a step is committed exactly when its
``index.json`` is a file in its directory. A step is deleted by renaming its directory away first (a
hidden name no reader or scan takes for a step: ``remove_step``), then ``index.json``, then the rest: a
commit racing the removal fails, and a crash midway leaves a hidden leftover that is never loaded and
that ``finish_removals`` completes, never a half-deleted step that still looks committed. Only the
names ckptd writes (``names.is_step_file``) are ever removed, and no link is followed.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterable

from .names import (
    INDEX_NAME,
    is_step_file,
    is_step_temp,
    parse_rank_file_name,
    rank_data_name,
    rank_manifest_name,
)
from .rank_table import SIDE_FILES
from .storage import fsync_dir


def is_committed(step_path: str) -> bool:
    """Whether the step at ``step_path`` is committed: its index.json is in place (the commit marker).
    A step whose directory cannot be searched reads as not committed here; listings and retention
    use ``committed_or_raise``, which tells the two apart."""
    try:
        return committed_or_raise(step_path)
    except (OSError, ValueError):        # (as os.path.isfile: any error reads as not there)
        return False


def committed_or_raise(step_path: str) -> bool:
    """``is_committed``, but an index.json that cannot be looked for (EACCES: the step directory's owner
    or mode) raises OSError rather than read as "uncommitted": such a step may well be committed, and
    retention must never take it for an abandoned save."""
    try:
        return stat.S_ISREG(os.stat(os.path.join(step_path, INDEX_NAME)).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def os_reason(e: OSError) -> str:
    """An OS error as ``EACCES: Permission denied`` (the path left out: the caller names it)."""
    if e.errno is None:
        return str(e)
    return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror or os.strerror(e.errno)}"


UNREADABLE_FIX = "give ckptd's user read and search access to it (chown -R, or chmod -R u+rwX)"


def stray_temps(step_path: str, older_than: float | None = None) -> list[str]:
    """Temp files in a step, sorted: a killed writer's (its tmp → rename never happened), or one being
    written now. Once index.json exists only a rank staging its files into a step staged from the
    bucket writes there (FORMAT.md), so in a committed step one untouched for a while is garbage:
    ``older_than`` (a wall time) keeps only those last modified before it."""
    try:       # names first (listdir: a fifth of scandir's cost on a step's 65k files), then lstat the few
        names = [n for n in os.listdir(step_path) if is_step_temp(n)]
    except FileNotFoundError:
        return []
    found = []
    for n in sorted(names):
        p = os.path.join(step_path, n)
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and (older_than is None or st.st_mtime < older_than):
                found.append(p)
        except FileNotFoundError:
            pass
    return found


def leftovers(step_path: str, world_size: int) -> list[str]:
    """What earlier attempts of an uncommitted step left that its commit must not keep, sorted: stray
    temps (a writer killed mid-rename), lean-index side files (a commit killed before index.json: a
    smaller index has none, a larger one writes its own) and the files of ranks at or above
    ``world_size`` (an attempt at a larger world). Removed just before index.json is published."""
    try:       # names only (a 32,768-rank step holds 65k): lstat is for the few temps
        names = os.listdir(step_path)
    except FileNotFoundError:
        return []
    found = [os.path.join(step_path, n) for n in names
             if n in SIDE_FILES or ((r := parse_rank_file_name(n)) is not None and r >= world_size)]
    return sorted(found + stray_temps(step_path))


def remove_files(paths: Iterable[str]) -> None:
    """Unlink each path; one already gone is not an error."""
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def remove_rank_files(step_path: str, rank: int) -> None:
    """Drop one rank's data file and manifest of an uncommitted step; a no-op once index.json exists
    (a committed step's files are removed whole, by ``remove_step``, never one rank's)."""
    if is_committed(step_path):
        return
    remove_files(os.path.join(step_path, name) for name in (rank_data_name(rank), rank_manifest_name(rank)))


# A step being removed is first renamed to ``.removing-<step-dir-name>-<8 hex>`` in its own job directory:
# a name no reader, scan or retention takes for a step (nor for a job: a job name never starts with a dot),
# so it vanishes from every listing at once, and a commit still running for it fails (ckptd writes by
# path). Leftovers of a removal that was killed are finished by ``finish_removals`` (retention, `ckptd gc`).
REMOVING_PREFIX = ".removing-"


def is_removing(name: str) -> bool:
    """Whether ``name`` is a removal's hidden directory (``REMOVING_PREFIX``)."""
    return name.startswith(REMOVING_PREFIX) and len(name) > len(REMOVING_PREFIX)


def remove_step(path: str) -> bool:
    """Delete one step directory. It is first renamed away (``REMOVING_PREFIX``): from that instant it is
    no step, and a commit racing the removal (its index.json renamed in by path) fails rather than
    publish an index over files being unlinked. Then index.json (so a leftover is never committed), the
    rest, the directory. False when it was already gone (removed by someone else): not an error.

    Raises OSError naming what could not be removed. A step directory holding names ckptd did not
    write is not touched at all (nothing of it removed: it stays a step, as it was).
    """
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{path} is not a directory (a symlink?); not removed")
        foreign = [n for n in os.listdir(path) if not is_step_file(n)]
    except FileNotFoundError:
        return False
    if foreign:
        raise OSError(f"{path}: kept whole, it holds files ckptd did not write: {', '.join(sorted(foreign)[:5])}")
    parent, name = os.path.split(os.path.normpath(path))
    hidden = os.path.join(parent, f"{REMOVING_PREFIX}{name}-{secrets.token_hex(4)}")
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return False                        # another removal renamed it first
    moved = os.lstat(hidden)
    if (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISDIR(moved.st_mode):
        os.rename(hidden, path)             # replaced between the two (by a link?): never emptied through
        raise OSError(f"{path} changed while being removed (replaced by a symlink?); not removed")
    fsync_dir(parent)
    try:
        foreign = _empty(hidden)
        if foreign:     # (written in the instant between the listing and the rename): stays hidden, named
            raise OSError(f"{hidden}: kept, it holds files ckptd did not write: {', '.join(sorted(foreign)[:5])}")
        _rmdir(hidden)
    except FileNotFoundError:
        pass                                # finished by ``finish_removals`` elsewhere meanwhile
    fsync_dir(parent)
    return True


def _empty(path: str) -> list[str]:
    """Unlink index.json (then fsync), then every other name ckptd writes in ``path``; the names it did
    not write, left in place."""
    try:
        os.unlink(os.path.join(path, INDEX_NAME))
        fsync_dir(path)
    except FileNotFoundError:
        pass
    foreign = []
    with os.scandir(path) as it:
        entries = list(it)
    for e in entries:
        if is_step_file(e.name) and not e.is_dir(follow_symlinks=False):
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass
        else:
            foreign.append(e.name)
    return foreign


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass


def finish_removals(job_path: str, names: Iterable[str] | None = None) -> tuple[list[str], list[str]]:
    """Finish the removals killed midway in one job directory (``REMOVING_PREFIX`` directories): (what
    was removed, why each of the others stays). One finished meanwhile by another process is not
    an error; one holding files ckptd did not write stays and is named. ``names``: those the caller's
    own listing of the directory found (it is not listed again)."""
    if names is None:
        try:
            names = [n for n in os.listdir(job_path) if is_removing(n)]
        except (FileNotFoundError, NotADirectoryError):
            return [], []
    done, kept = [], []
    for n in sorted(names):
        p = os.path.join(job_path, n)
        try:
            if not stat.S_ISDIR(os.lstat(p).st_mode):
                kept.append(f"{p}: not a directory; not removed")
                continue
            foreign = _empty(p)
            if foreign:
                kept.append(f"{p}: kept, it holds files ckptd did not write: {', '.join(sorted(foreign)[:5])}")
                continue
            _rmdir(p)
            done.append(p)
        except FileNotFoundError:
            continue                        # finished by another removal meanwhile
        except OSError as e:
            kept.append(str(e) if not e.strerror else f"{p}: {e.strerror}")
    if done:
        fsync_dir(job_path)
    return done, kept
