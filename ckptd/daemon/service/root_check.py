"""Whether the daemon can write its checkpoint root, checked before it says it serves.

A daemon that cannot write its root would accept every save and fail each one (EROFS,
EACCES); the check writes a real file (create, fsync, remove) because permission bits,
read-only mounts, systemd's ProtectSystem= and immutable flags all answer only to a write.
"""
from __future__ import annotations

import errno
import os
import pwd

# A dot-file: never a job name (names.validate_job refuses a leading dot), so ls, gc and
# retention never take a probe left by a killed daemon for a job or a step.
PROBE_PREFIX = ".ckptd-write-probe."


class RootNotWritable(RuntimeError):
    """The root cannot be written; the message names the root, the error and the fix."""


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _fix(root: str, e: OSError) -> str:
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    user = _user()
    head = (f"cannot write the checkpoint root {root}: {code}: {e.strerror or e}"
            + (f" ({e.filename})" if e.filename and e.filename != root else ""))
    if e.errno == errno.EROFS:          # (chown and chmod would fail the same way)
        return (head + "; its file system is read-only here: remount it read-write or give another root; "
                f"under systemd (ProtectSystem=strict makes paths read-only) list it in the unit's "
                f"ReadWritePaths= (`systemctl edit ckptd.service`: [Service] ReadWritePaths={root})")
    return (head + f"; the daemon runs as user {user!r}: make the root a directory it owns "
            f"(`chown {user}: {root}`, or `chmod u+rwx`), and under systemd list it in the unit's "
            f"ReadWritePaths= (`systemctl edit ckptd.service`: [Service] ReadWritePaths={root})")


def probe(directory: str) -> None:
    """Create, fsync and remove a probe file in ``directory``; OSError if any of it fails."""
    path = os.path.join(directory, f"{PROBE_PREFIX}{os.getpid()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"ckptd\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)


def check_root(root: str, *, create: bool) -> None:
    """Raise RootNotWritable unless the daemon can write files in ``root``.

    ``create``: make the root if it is missing (the daemon's start). Without it (``--check-config``)
    a missing root is checked where the daemon would create it: its nearest existing ancestor."""
    root = os.path.abspath(root)
    where = root
    while not os.path.lexists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):    # (a file in the way: no chown or mode makes it a root; EEXIST said so badly)
        raise RootNotWritable(f"cannot write the checkpoint root {root}: {where} exists and is not a directory "
                              f"({_kind(where)}); give a directory as the root, or move {where} away")
    try:
        if create:
            os.makedirs(root, exist_ok=True)
            where = root
        probe(where)
    except OSError as e:
        raise RootNotWritable(_fix(root, e)) from None


def _kind(path: str) -> str:
    if os.path.islink(path):
        return "a symlink to no directory"
    return "a regular file" if os.path.isfile(path) else "not a regular file nor a directory"
