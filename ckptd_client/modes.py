"""The Checkpointer's modes as enums; users may still pass the plain strings (str enums)."""
from __future__ import annotations

from enum import Enum

from ckptd.core.protocol import CommitMode, SaveLevel

AUTO = "auto"


class WhenBusy(str, Enum):
    """What ``save()`` does when every slot is still being written by the daemon."""
    BLOCK = "block"     # wait for a slot
    SKIP = "skip"       # return a handle with ``skipped=True`` at once; nothing is saved


def parse_when_busy(value: WhenBusy | str) -> WhenBusy:
    try:
        return WhenBusy(value)
    except ValueError:
        raise ValueError(f"when_busy must be 'block' or 'skip', got {value!r}") from None


def parse_level(value: SaveLevel | str) -> SaveLevel:
    """A save's level: ``storage`` (encoded and written; survives anything the disk does) or ``memory``
    (held in the daemons' memory and K peers' only: fast and frequent, lost if every holder restarts)."""
    try:
        return SaveLevel(value)
    except ValueError:
        raise ValueError(f"level must be 'storage' or 'memory', got {value!r}") from None


def resolve_commit_mode(value: CommitMode | str, world_size: int, has_store: bool) -> CommitMode:
    """``auto`` relays through the c10d store when ranks may span daemons (world_size > 1 and a
    store exists); otherwise the daemon counts ranks itself. ``relay`` without a store is refused."""
    if value == AUTO:
        return CommitMode.RELAY if world_size > 1 and has_store else CommitMode.LOCAL
    try:
        mode = CommitMode(value)
    except ValueError:
        mode = None
    if mode is None or (mode is CommitMode.RELAY and not has_store):
        raise ValueError(f"commit must be 'auto', 'local' or 'relay' (relay needs a c10d store), got {value!r}")
    return mode
