"""``CheckpointerConfig``: every setting of a ``Checkpointer`` in one typed, frozen value.

``Checkpointer(job, config=CheckpointerConfig(...))`` takes one; its keyword arguments (the
same names) build one, so ``Checkpointer(job, socket=..., num_slots=4)`` keeps working. A
keyword given beside a ``config`` that says otherwise is a TypeError: one value, one place.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

from ckptd.core.names import MAX_RANKS, MAX_SLOTS
from ckptd.core.protocol import CommitMode

from .modes import AUTO, WhenBusy, parse_when_busy
from .overlap import parse_overlap


@dataclass(frozen=True)
class CheckpointerConfig:
    """A ``Checkpointer``'s settings; each default is what a plain ``Checkpointer(job)`` uses."""

    socket: str | None = None
    """The daemon's socket. None: ``$CKPTD_SOCKET``, else /run/ckptd/ckptd.sock (the systemd unit's)."""
    root: str | None = None
    """Where checkpoints live. None: asked from the daemon; given, restores need no daemon at all."""
    rank: int | None = None
    """This process's rank. None: torch.distributed's (0 when it is not initialised)."""
    world_size: int | None = None
    """Ranks in the job. None: torch.distributed's (1 when it is not initialised)."""
    store: Any = None
    """The c10d store for the commit relay and the restore agreement. None: torch.distributed's, if any."""
    num_slots: int = 2
    """Shared-memory slots lent by the daemon. With its memory tier on (the default) the daemon keeps
    the slot of the newest committed step as its resident copy (no second copy in host memory) and
    the next save goes into another: 2 is the least for that; 1 makes the daemon copy the step."""
    commit: CommitMode | str = AUTO
    """``auto``: relay completion through the store when world_size > 1 and a store exists (ranks
    may span daemons), else ``local`` (the daemon counts ranks itself); ``relay`` needs a store."""
    commit_timeout: float = 600.0
    """Seconds a relayed save may take from ``save`` to its commit (the relay's waits derive from it),
    and the longest ``save`` waits for a free slot (CheckpointError after: a stalled daemon)."""
    join_timeout: float | None = None
    """Seconds from this ``Checkpointer``'s start within which rank 0 must tell this rank the run id
    (run_scope.py): the window in which a job's ranks may start apart. A restore, and the relay's
    first save, wait for it at most this long; so does a rank's restore for rank 0's choice of step,
    and rank 0's restore for every rank to read it. None: ``commit_timeout``, but at least 300 s
    (ranks start minutes apart in a large job however short its saves' commits are)."""
    restore_threads: int | None = None
    """Threads that decode and copy on restore. None: the CPUs this process may run on, shared among
    the node's ranks (``local_world_size``, or ``LOCAL_WORLD_SIZE`` as torchrun sets it; else not shared),
    at least one."""
    overlap: bool | str = True
    """``save``'s default copy mode: True (copy params/optimizer state in the background until the
    optimizer step), False (copy everything before returning) or ``"manual"`` (see ``save``)."""
    when_busy: WhenBusy | str = WhenBusy.BLOCK
    """``save`` with every slot still being written: ``block`` waits, ``skip`` saves nothing."""
    memory: bool = True
    """Restore asks the daemon's memory tier first (no storage read); False: storage only."""
    local_world_size: int | None = None
    """Ranks per node (one daemon each), the relay's fan-in group. None: ``$LOCAL_WORLD_SIZE``, else 8."""
    prepare: bool = True
    """After ``restore``, plan the restored state's next save (on the caller's thread) and connect
    and allocate its slots (in the background), so the first save costs what the others do. False: a
    process that only restores (evaluation) does neither."""
    spawn: bool = False
    """Start a private daemon for this one process (one GPU, a notebook): default settings, writing
    to ``root`` (required), on a socket in a temporary directory; stopped by ``close()`` once the saves
    settle, and at interpreter exit. It gets SIGTERM if this process dies (Linux). No ``socket``."""

    def __post_init__(self) -> None:
        # Bad values fail here, where the config is built, not at the first save (nor in the daemon,
        # nor in a relay thread): a wrong type is a TypeError, a value out of range a ValueError, each
        # naming the field, the value and what it takes.
        _check_fields(self)
        object.__setattr__(self, "overlap", parse_overlap(self.overlap))
        object.__setattr__(self, "when_busy", parse_when_busy(self.when_busy))
        if self.spawn and not self.root:
            raise ValueError("spawn=True needs root=: the directory the private daemon writes checkpoints to")
        if self.spawn and self.socket:
            raise ValueError(f"spawn=True starts a private daemon on its own socket; drop socket={self.socket!r} "
                             "to spawn one, or drop spawn=True to use the daemon there")
        if self.commit != AUTO:
            try:
                object.__setattr__(self, "commit", CommitMode(self.commit))
            except ValueError:
                raise ValueError(f"commit must be 'auto', 'local' or 'relay', got {self.commit!r}") from None


MAX_TIMEOUT_S = 1e9     # seconds (31 years): any wait longer than this is a mistake, and threads' waits overflow


# field → (lowest, highest) of the int fields; None is allowed where the default is None
_INTS = {"rank": (0, MAX_RANKS - 1), "world_size": (1, MAX_RANKS), "num_slots": (1, MAX_SLOTS),
         "local_world_size": (1, MAX_RANKS), "restore_threads": (1, 1 << 16)}
_BOOLS = ("memory", "prepare", "spawn")


def _check_fields(c: CheckpointerConfig) -> None:
    """The numeric and boolean fields' types and ranges (TypeError / ValueError naming the field); an
    integral or real value of another type (a NumPy scalar) is kept as the plain int or float it is."""
    for name, (low, high) in _INTS.items():
        v = getattr(c, name)
        if v is None and name != "num_slots":
            continue
        if not isinstance(v, numbers.Integral) or isinstance(v, bool):   # not a bool, a float or a string
            raise TypeError(f"CheckpointerConfig: {name} must be an int in [{low}, {high}], got {v!r} "
                            f"({type(v).__name__}): pass {name}=int(...)")
        object.__setattr__(c, name, v := int(v))
        if not low <= v <= high:
            raise ValueError(f"CheckpointerConfig: {name} must be an int in [{low}, {high}], got {v!r}")
    if c.rank is not None and c.world_size is not None and not c.rank < c.world_size:
        raise ValueError(f"CheckpointerConfig: rank {c.rank} is not in [0, world_size={c.world_size}): "
                         "ranks count from 0")
    for name in ("commit_timeout", "join_timeout"):
        v = getattr(c, name)
        if v is None and name == "join_timeout":
            continue
        if not isinstance(v, numbers.Real) or isinstance(v, bool):    # (NumPy's bool_ is no numbers.Real)
            raise TypeError(f"CheckpointerConfig: {name} must be a number of seconds, got {v!r} "
                            f"({type(v).__name__}): pass {name}=float(...)")
        object.__setattr__(c, name, v := float(v))
        if not (math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S):
            raise ValueError(f"CheckpointerConfig: {name} must be a positive, finite number of seconds "
                             f"(at most {MAX_TIMEOUT_S:g}), got {v!r}")
    for name in _BOOLS:
        if type(v := getattr(c, name)) is not bool:
            raise TypeError(f"CheckpointerConfig: {name} must be True or False, got {v!r} ({type(v).__name__})")


JOIN_TIMEOUT_FLOOR_S = 300.0      # join_timeout None: commit_timeout, but at least this


def join_window(config: CheckpointerConfig) -> float:
    """The join window ``config`` gives (``CheckpointerConfig.join_timeout``)."""
    if config.join_timeout is not None:
        return config.join_timeout
    return max(config.commit_timeout, JOIN_TIMEOUT_FLOOR_S)


FIELDS = tuple(f.name for f in fields(CheckpointerConfig))


def with_keywords(config: CheckpointerConfig | None, **given: Any) -> CheckpointerConfig:
    """The config a ``Checkpointer`` runs with: ``config``, or one built from the keyword arguments
    ``given`` (None: not given). Keywords beside a ``config`` must agree with it (TypeError)."""
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise TypeError(f"Checkpointer got unexpected keyword arguments {unknown}")
    given = {k: v for k, v in given.items() if v is not None}
    if config is None:
        return CheckpointerConfig(**given)
    if not isinstance(config, CheckpointerConfig):
        raise TypeError(f"config must be a CheckpointerConfig, got {type(config).__name__}")
    clash = [f"{k}={v!r} (config has {getattr(config, k)!r})" for k, v in given.items()
             if getattr(config, k) is not v and getattr(config, k) != v]
    if clash:
        raise TypeError(f"Checkpointer: {', '.join(clash)}: set each setting once, in config= or as a keyword")
    return config
