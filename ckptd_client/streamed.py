"""A save streamed through slots smaller than its shard (FORMAT.md: ``save`` with ``stream``, ``save_part``).

The daemon lends smaller slots when its ``slot_memory_limit`` has less left than the state needs;
the save still works: the shard's bytes (as the plan lays them out) are cut into parts the size of
a slot, and each part is copied into a free slot and handed over while the daemon encodes the
parts before it. The trainer stalls for the whole copy (``stall_s`` says so) and the step is not
kept in the daemon's memory tier; host memory stays at the slots, whatever the state's size.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ckptd.core import protocol
from ckptd.core.protocol import SaveLevel
from ckptd.core.schema import TensorLayout

from .connection import DaemonConnection
from .dtensor import local_tensor
from .errors import CheckpointError, DaemonRefused
from .handle import SaveHandle
from .plan_cache import Plan
from .session import DaemonSession
from .slots import ClientSlot


def needs_stream(session: DaemonSession, plan: Plan) -> bool:
    """Whether the slots the daemon lent are too small for ``plan``'s shard."""
    return bool(session.slots) and min(s.size for s in session.slots) < plan.nbytes


def stream_save(session: DaemonSession, conn: DaemonConnection, handle: SaveHandle, plan: Plan, commit: str,
                block: bool) -> None:
    """Hand ``plan``'s shard to the daemon part by part; returns once the last part is handed over.

    ``handle.skipped`` when ``block`` is False and no slot is free for the first part. A part the
    daemon refused gives its slot back; after the first part the daemon is asked to drop the step
    (its writer waits for parts no more); then it raises. A part sent whose answer never came
    (interrupted, no reply) leaves who holds its slot unknown: the connection is dropped (the
    daemon fails the step and takes every slot of this session back) and the next save reconnects.
    A memory-level save is refused: it is held as one slot. The plan's pending keys (plan_cache)
    are compared here, before any part is copied."""
    handle.watch = session.watch        # a wait on it with no timeout still ends if the daemon goes silent
    if handle.level is SaveLevel.MEMORY:
        raise CheckpointError(f"a memory-level save must fit in one slot: {plan.nbytes} bytes "
                              "stream through smaller ones (the daemon's slot_memory_limit)")
    plan = plan.checked()
    layout = plan.layout
    total = max((t.offset + t.nbytes for t in layout), default=0)
    part = min(s.size for s in session.slots)
    tensors = [local_tensor(t).detach() for _, t in plan.flat.tensors]
    pieces = _Pieces(layout, tensors)
    for k in range(-(-total // part)):
        try:
            slot = session.acquire(block=block or k > 0)
        except CheckpointError:
            if k > 0:           # parts were sent: the connection goes (the daemon fails the step, takes the slots)
                session.drop()
            raise
        if slot is None:
            handle.skipped = True
            return
        lo, hi = k * part, min((k + 1) * part, total)
        handle.slot = slot                  # ours until the daemon has it: given back on failure
        sent = False
        try:
            _fill(session.slots[slot], pieces, lo, hi)
            if k == 0:
                reply = conn.send(protocol.Save(step=handle.step, slot=slot, tensors=plan.wire,
                                                tree=plan.flat.tree, commit=commit, stream=[total, part]))
            else:
                reply = conn.send(protocol.SavePart(step=handle.step, slot=slot, part=k))
            sent = True
            reply.result()
            handle.slot = None              # the daemon has it: it gives it back (slot_free)
        except BaseException as e:
            handle.slot = None
            if sent and not isinstance(e, DaemonRefused):
                # Sent, its answer unknown (interrupted, no reply): whether the daemon holds this slot
                # and the step cannot be told here. The connection goes: the daemon fails the step
                # and takes back every slot of this session; the next save connects afresh.
                session.drop()
                raise
            session.release(slot)           # (the first part's too: else each such failure kept a slot for good)
            if k > 0:
                session.abort(handle.step, f"streamed save failed at part {k}: {e}")
            raise


class _Pieces:
    """The layout's tensors in offset order, each as its bytes once it is first needed."""

    def __init__(self, layout: Sequence[TensorLayout], tensors: Sequence[torch.Tensor]) -> None:
        self.items = sorted(zip(layout, tensors, strict=True), key=lambda lt: lt[0].offset)
        self.first = 0                      # items before it end at or before the last part's start
        self.cached: tuple[int, torch.Tensor] | None = None

    def overlapping(self, lo: int, hi: int) -> Iterator[tuple[TensorLayout, torch.Tensor]]:
        while self.first < len(self.items) and _end(self.items[self.first][0]) <= lo:
            self.first += 1
        for i in range(self.first, len(self.items)):
            entry, t = self.items[i]
            if entry.offset >= hi:
                break
            if entry.nbytes:
                yield entry, self._bytes(i, t)

    def _bytes(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """(A tensor that spans parts is flattened once: a non-contiguous one is copied, once.)"""
        if self.cached is None or self.cached[0] != i:    # (a lazily conjugated or negated view: its values)
            self.cached = (i, t.resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8))
        return self.cached[1]


def _end(entry: TensorLayout) -> int:
    return entry.offset + entry.nbytes


def _fill(slot: ClientSlot, pieces: _Pieces, lo: int, hi: int) -> None:
    """Copy the shard's bytes ``[lo, hi)`` into ``slot`` (at its start)."""
    buf = slot.view(TensorLayout("part", "uint8", (hi - lo,), 0, hi - lo), torch.uint8)
    with torch.no_grad():
        for entry, src in pieces.overlapping(lo, hi):
            a, b = max(lo, entry.offset), min(hi, entry.offset + entry.nbytes)
            buf[a - lo: b - lo].copy_(src[a - entry.offset: b - entry.offset])
