"""A step directory on disk: what makes it committed, and the file operations on it.

One definition for the daemon's commit and cleanup, retention, bucket staging and uploads, the
readers and ``ckptd import`` (FORMAT.md, "Layout"): a step is committed exactly when its
``index.json`` is a file in its directory; it is deleted ``index.json`` first, so a crash midway
leaves an uncommitted directory, never a half-deleted step that still looks committed. Only the
names ckptd writes (``names.is_step_file``) are ever removed, and no link is followed.
"""
from __future__ import annotations

import os
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
    """Whether the step at ``step_path`` is committed: its index.json is in place (the commit marker)."""
    return os.path.isfile(os.path.join(step_path, INDEX_NAME))


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


def remove_step(path: str) -> None:
    """Delete one step directory: index.json first (it stops being committed), then the rest.

    Raises OSError naming what could not be removed; anything ckptd did not create stays.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory (a symlink?); not removed")
    index = os.path.join(path, INDEX_NAME)
    try:
        os.unlink(index)
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
    if foreign:
        raise OSError(f"{path}: kept, it holds files ckptd did not write: {', '.join(sorted(foreign)[:5])}")
    os.rmdir(path)
    fsync_dir(os.path.dirname(path))
