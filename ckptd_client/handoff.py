"""Handing a save's slot to the daemon: once it is full, or while it is filled (FORMAT.md: ``save``
with ``filling``, ``save_filled``).

A save used to reach the daemon once every byte was in its slot, so the daemon's write started a
whole copy after the call: 0.07-0.13 s per GiB of state here, on a GPU node the device-to-host
copy. With a daemon that takes filling saves (its hello reply's ``fills``; an older one would write
the slot as it is) a storage-level save is handed over *filling*: the SAVE goes first, and the copy
tells the daemon every ``slots.FILL_STEP`` bytes how far the slot is filled from its start
(``save_filled``, not waited on); the daemon's writer reads up to there and waits for the rest.

- A save copied whole in the ``save()`` call (``overlap=False``, or nothing an optimizer fences):
  the SAVE, then the copy on the trainer's thread, its CUDA marks events waited for in order.
- An overlapped save: the copy thread sends the SAVE once the plan's recheck passed (a state laid
  out anew by it is handed over full, as before), then copies the deferred CPU tensors in groups;
  deferred CUDA copies report as their side stream passes each mark (``slots.SlotCopy``).

A copy that fails after the SAVE asks the daemon to drop the step; a trainer that dies mid-copy
ends its connection, which fails the step on the daemon (ckptd/daemon/filling.py).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

from ckptd.core import protocol
from ckptd.core.protocol import SaveLevel

from .connection import DaemonConnection, Reply
from .errors import CheckpointError
from .handle import SaveHandle
from .overlap import OverlapCopies
from .plan_cache import Plan
from .session import DaemonSession
from .slots import SlotCopy


def report(conn: DaemonConnection, step: int, upto: int) -> None:
    """Tell the daemon the slot's bytes ``[0, upto)`` are in place (no reply waited for)."""
    conn.notify(protocol.SaveFilled(step=step, upto=upto))


class Fill:
    """One filling save's side of the protocol (``slots.FillHooks``), on whichever thread copies."""

    def __init__(self, session: DaemonSession, conn: DaemonConnection, handle: SaveHandle, plan: Plan,
                 commit: str) -> None:
        self.session, self.conn, self.handle, self.plan, self.commit = session, conn, handle, plan, commit
        self.opened = self.disabled = self.refused = False
        self.sent = 0
        self._reply: Reply | None = None

    def open(self) -> None:
        """Send the SAVE; its reply is waited for once the copy is done (``confirm``), so the copy
        does not wait for the daemon to take in the layout."""
        if self.opened or self.disabled:
            return
        p, h = self.plan, self.handle
        assert h.slot is not None
        self._reply = self.conn.send(_message(h.step, h.slot, p, SaveLevel.STORAGE, self.commit, filling=True))
        self.opened = True

    def confirm(self) -> None:
        """The SAVE's reply (raises a refusal): the daemon has the slot now, and gives it back (slot_free)."""
        reply, self._reply = self._reply, None
        if reply is not None:
            try:
                reply.result()
            except CheckpointError:
                self.refused = True         # no save of this step on the daemon's side: none to drop
                raise
            self.handle.slot = None

    def disable(self) -> None:
        self.disabled = True

    def report(self, upto: int) -> None:
        if self.opened and upto > self.sent:
            self.sent = upto
            report(self.conn, self.handle.step, upto)

    def full(self, send: Callable[[], object]) -> None:
        """(Hand-off, every byte in place) the last mark, or ``send`` (a full slot's SAVE) if never opened."""
        if self.opened:
            self.report(self.plan.nbytes)
            self.confirm()
        else:
            send()

    def failed(self, then: Callable[[BaseException], None], e: BaseException) -> None:
        """After the SAVE: the daemon is asked to drop the step; then ``then`` (the save's failure)."""
        if self.opened and not self.refused:
            with contextlib.suppress(CheckpointError):     # (refused, or a lost daemon: no step to drop)
                self.confirm()
                self.session.abort(self.handle.step, f"the copy into the slot failed: {e}")
        then(e)


def hand_over(session: DaemonSession, conn: DaemonConnection, copies: OverlapCopies, handle: SaveHandle, plan: Plan,
              overlap: bool | str, level: SaveLevel, commit: str, failed: Callable[[BaseException], None]) -> None:
    """Copy ``plan``'s state into slot ``handle.slot`` and hand it to the daemon (module docstring);
    ``failed``: what a failure after ``save()`` returned (on the copy thread) is given."""
    assert handle.slot is not None
    handle.watch = session.watch        # a wait on it with no timeout still ends if the daemon goes silent
    slot = session.slots[handle.slot]
    session.saved_in[handle.slot] = (handle.step, level.value)       # (what holds it, if no slot comes free)
    fill = Fill(session, conn, handle, plan, commit) if session.fills and level is SaveLevel.STORAGE else None
    if fill is not None and not OverlapCopies.deferred(plan.flat, overlap):    # the whole copy here: SAVE first
        fill.open()
        try:
            copies.snapshot(slot, plan.layout, plan.flat, False, plan.splits, fill.report)
            fill.report(plan.nbytes)
            fill.confirm()
        except BaseException as e:
            fill.failed(lambda _: None, e)
            raise
        return
    copy = copies.snapshot(slot, plan.layout, plan.flat, overlap, plan.splits, fill=fill)
    send = partial(_send, conn, handle.step, handle.slot, plan, copy, level, commit)
    if not copy.deferred:           # (a lazy plan's pending keys are of deferred tensors: there are none)
        send()
    elif fill is None:              # the daemon gets the layout once the copy is done
        copies.begin(handle, copy, plan.flat.optimizers, send, failed, plan.pending)
    else:
        copies.begin(handle, copy, plan.flat.optimizers, partial(fill.full, send), partial(fill.failed, failed),
                     plan.pending)


def _send(conn: DaemonConnection, step: int, slot: int, plan: Plan, copy: SlotCopy, level: SaveLevel,
          commit: str) -> None:
    """The SAVE of a full slot: the plan's layout and tree, or the copy's if it laid the slot out anew."""
    conn.request(_message(step, slot, copy.relaid or plan, level, commit, False))


def _message(step: int, slot: int, p: Plan, level: SaveLevel, commit: str, filling: bool) -> protocol.Save:
    """The SAVE of slot ``slot`` laid out as ``p``: full, or ``filling`` (its bytes come as reported)."""
    return protocol.Save(step=step, slot=slot, tensors=p.wire, tree=p.flat.tree, commit=commit, level=level.value,
                         filling=filling)
