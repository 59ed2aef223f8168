"""A save handed to the daemon before its slot is full (FORMAT.md: ``save`` with ``filling``, ``save_filled``).

A save that copies every byte inside ``save()`` (``overlap=False``, or a state no optimizer fences)
used to reach the daemon once the whole copy was done, so the daemon's write started a whole copy
after the call: 0.07-0.13 s per GiB of state here, on a GPU node the device-to-host copy. Here the
SAVE goes first, flagged ``filling``, and the copy then tells the daemon every ``slots.FILL_STEP``
bytes how far the slot is filled from its start (``save_filled``, not waited on); the daemon's
writer reads up to there and waits for the rest, so the write runs beside the copy. Only when the
daemon says it takes such saves (its hello reply's ``fills``): an older one would write the slot
as it is. A copy that fails asks the daemon to drop the step and raises; a trainer that dies
mid-copy ends its connection, which fails the step on the daemon (ckptd/daemon/filling.py).
"""
from __future__ import annotations

import contextlib

from ckptd.core import protocol
from ckptd.core.protocol import SaveLevel

from .connection import DaemonConnection
from .errors import CheckpointError
from .handle import SaveHandle
from .overlap import OverlapCopies
from .plan_cache import Plan
from .session import DaemonSession


def fills(session: DaemonSession, plan: Plan, overlap: bool | str, level: SaveLevel) -> bool:
    """Whether this save is handed over filling: its daemon takes such saves, it is a storage-level
    save, and its copy is all done in the ``save()`` call (nothing deferred, nothing to recheck)."""
    return (session.fills and level is SaveLevel.STORAGE and plan.pending is None
            and not OverlapCopies.deferred(plan.flat, overlap))


def report(conn: DaemonConnection, step: int, upto: int) -> None:
    """Tell the daemon the slot's bytes ``[0, upto)`` are in place (no reply waited for)."""
    conn.notify(protocol.SaveFilled(step=step, upto=upto))


def filling_save(session: DaemonSession, conn: DaemonConnection, copies: OverlapCopies, handle: SaveHandle,
                 plan: Plan, commit: str) -> None:
    """SAVE ``plan`` into slot ``handle.slot`` flagged filling, then copy the state into it, telling
    the daemon how far it got; returns once every byte is in the slot."""
    assert handle.slot is not None
    slot = session.slots[handle.slot]
    conn.request(protocol.Save(step=handle.step, slot=handle.slot, tensors=plan.wire, tree=plan.flat.tree,
                               commit=commit, filling=True))
    handle.slot = None                  # the daemon has it now: it gives it back (slot_free)
    step = handle.step
    try:
        copies.snapshot(slot, plan.layout, plan.flat, False, plan.splits, lambda upto: report(conn, step, upto))
        report(conn, step, plan.nbytes)
    except BaseException as e:
        with contextlib.suppress(CheckpointError):     # (a lost daemon has dropped the step already)
            session.abort(step, f"the copy into the slot failed: {e}")
        raise
