"""Shared-memory slots on the trainer side: mapping, pinning, layout, and the copy into them."""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ckptd.core.schema import Placement, TensorLayout

from .dtensor import local_tensor
from .errors import CheckpointError
from .state import dtype_name

if TYPE_CHECKING:
    from .plan_cache import Plan, Recheck

ALIGN = 64


def plan_layout(tensors: Sequence[tuple[str, torch.Tensor]],
                placements: Sequence[Placement | None] | None = None) -> tuple[list[TensorLayout], int]:
    """Where each tensor goes in a slot (64-byte aligned), and the bytes the slot must hold.

    ``tensors`` are plain tensors (a DTensor's local shard, see ``FlatState``); ``placements``,
    one per tensor when given, say where a local shard sits in its global tensor."""
    if placements is not None and len(placements) != len(tensors):
        raise ValueError(f"{len(placements)} placements for {len(tensors)} tensors")
    layout: list[TensorLayout] = []
    offset = 0
    for i, (name, t) in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        placement = placements[i] if placements is not None else None
        layout.append(TensorLayout(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes, placement))
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


class ClientSlot:
    """A daemon-made memfd mapped into this process; registered as pinned memory under CUDA."""

    def __init__(self, index: int, fd: int, size: int) -> None:
        self.index = index
        self.size = size
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buffer: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False
        # The last copy list's destinations (``views``): a reused plan copies the same list every save.
        self._views: tuple[list[tuple[TensorLayout, torch.Tensor]], list[torch.Tensor]] | None = None
        if torch.cuda.is_available():
            self._pin()

    def _mapped(self) -> torch.Tensor:
        if self.buffer is None:
            raise ValueError(f"slot {self.index} is closed")
        return self.buffer

    def _pin(self) -> None:
        # cudaHostRegister makes D2H copies into the slot true DMA (non_blocking works).
        rc = torch.cuda.cudart().cudaHostRegister(self._mapped().data_ptr(), self.size, 0)
        self.pinned = int(rc) == 0

    def view(self, entry: TensorLayout, dtype: torch.dtype) -> torch.Tensor:
        """The slot bytes of ``entry`` as a tensor (``dtype``: the source's, equal to entry.dtype)."""
        return self.raw(entry).view(dtype).view(entry.shape)

    def views(self, work: list[tuple[TensorLayout, torch.Tensor]]) -> list[torch.Tensor]:
        """``view`` of each (entry, tensor) of ``work``, the last list's kept (a view costs 5 µs:
        40 ms a save at 8,192 tensors, on the copy thread, holding the GIL)."""
        if self._views is not None and self._views[0] is work:
            return self._views[1]
        views = [self.view(entry, t.dtype) for entry, t in work]
        self._views = (work, views)
        return views

    def raw(self, entry: TensorLayout) -> torch.Tensor:
        """The slot bytes of ``entry``, as bytes."""
        return self._mapped()[entry.offset: entry.offset + entry.nbytes]

    def close(self) -> None:
        if self.pinned and self.buffer is not None:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        self.buffer = None
        self._views = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it


def _copy(slot: ClientSlot, entry: TensorLayout, t: torch.Tensor, non_blocking: bool) -> None:
    slot.view(entry, t.dtype).copy_(t.detach(), non_blocking=non_blocking)


def _copy_all(slot: ClientSlot, work: list[tuple[TensorLayout, torch.Tensor]], lo: int = 0,
              hi: int | None = None) -> None:
    """(Copy thread) every (layout entry, tensor) of ``work[lo:hi]`` into the slot, in one call where
    torch allows: the GIL is then taken once, not per tensor. The tensors are detached (CopySplit)."""
    with torch.no_grad():
        dsts = slot.views(work)[lo:hi]
        srcs = [t for _, t in work[lo:hi]]
        try:
            torch._foreach_copy_(dsts, srcs)
        except (AttributeError, RuntimeError, TypeError):
            for d, src in zip(dsts, srcs, strict=True):
                d.copy_(src)


@dataclass(frozen=True)
class CopySplit:
    """Which tensors a snapshot copies at once, which on the copy thread, which on a CUDA side
    stream (per device): worked out per tensor, so a plan reused save after save (plan_cache)
    keeps its split too, and a save allocates nothing per tensor for it."""
    tensors: list[torch.Tensor]                       # the bytes to copy: a DTensor's local shard, detached
    now: list[int]
    later_cpu: list[tuple[TensorLayout, torch.Tensor]]
    later_gpu: dict[torch.device, list[int]]
    # A filling save's (_Prefix): the deferred tensors' (start, end, CUDA device or None) by offset,
    # and where the last tensor ends.
    deferred_spans: list[tuple[int, int, torch.device | None]]
    end: int

    @classmethod
    def of(cls, layout: list[TensorLayout], tensors: list[tuple[str, torch.Tensor]],
           deferred: frozenset[int]) -> CopySplit:
        local = [local_tensor(t).detach() for _, t in tensors]
        later_gpu: dict[torch.device, list[int]] = {}
        for i in sorted(deferred):
            if local[i].is_cuda:
                later_gpu.setdefault(local[i].device, []).append(i)
        spans = sorted((layout[i].offset, layout[i].offset + layout[i].nbytes,
                        local[i].device if local[i].is_cuda else None) for i in deferred)
        return cls(local, [i for i in range(len(local)) if i not in deferred],
                   [(layout[i], local[i]) for i in sorted(deferred) if not local[i].is_cuda], later_gpu,
                   spans, max((e.offset + e.nbytes for e in layout), default=0))


FILL_STEP = 32 << 20      # a filling save's copy tells how far it got every this many bytes (handoff.py)


class _FillMarks:
    """A copy's progress through its slot for ``filled(upto)`` (a filling save's, handoff.py): CPU
    copies are done when they return; a non-blocking device-to-host copy only once its stream gets
    past it, so from the first one on each mark is an event per device, waited for in order at the
    end of the copy (where the copy waits for its streams anyway): the writer starts on the first
    marks while later copies still run."""

    def __init__(self, filled: Callable[[int], None] | None) -> None:
        self.filled = filled
        self.last = 0
        self.pending: list[tuple[list[torch.cuda.Event], int]] = []

    def copied(self, end: int, devices: set[torch.device]) -> None:
        if self.filled is None or end - self.last < FILL_STEP:
            return
        self.last = end
        if not devices:
            self.filled(end)
            return
        events = []
        for device in devices:
            e = torch.cuda.Event()
            e.record(torch.cuda.current_stream(device))
            events.append(e)
        self.pending.append((events, end))

    def wait(self) -> None:
        for events, end in self.pending:
            for e in events:
                e.synchronize()
            assert self.filled is not None
            self.filled(end)
        self.pending = []


class FillHooks(Protocol):
    """A filling save's hand-off as an overlapped copy drives it (handoff.py): ``open`` sends the
    SAVE flagged filling once (later calls do nothing; ``disable`` first: never), ``report`` says
    how far the slot is filled."""

    def open(self) -> None: ...
    def disable(self) -> None: ...
    def report(self, upto: int) -> None: ...


class _Prefix:
    """How far from the slot's start an overlapped copy has filled it: every tensor copied at save()
    is in place; a deferred CPU tensor once the copy thread's group holding it is copied
    (``cpu_upto``); a deferred CUDA tensor once its side stream passed a mark at or after its end
    (``gpu_upto``, per device)."""

    def __init__(self, split: CopySplit) -> None:
        self.items = split.deferred_spans
        self.total, self.p = split.end, 0
        self.cpu_upto = 0
        self.gpu_upto: dict[torch.device, int] = {}

    def upto(self) -> int:
        while self.p < len(self.items):
            _, end, device = self.items[self.p]
            if end > (self.cpu_upto if device is None else self.gpu_upto.get(device, 0)):
                return self.items[self.p][0]
            self.p += 1
        return self.total


class SlotCopy:
    """A snapshot into a slot: some tensors copied now, the deferrable rest in the background.

    Background copies of CPU tensors run on a copy thread (``copy_`` releases the GIL); CUDA
    tensors go as non_blocking D2H copies on a per-device side stream that first waits for
    the compute stream, with an event recorded after them. ``fence()`` is what the trainer
    waits on before it mutates the state; ``wait_host()`` is what the hand-off to the daemon
    waits on.
    """

    def __init__(self, slot: ClientSlot, layout: list[TensorLayout], tensors: list[tuple[str, torch.Tensor]],
                 deferred: frozenset[int] = frozenset(), pool: Executor | None = None,
                 side_streams: dict[torch.device, torch.cuda.Stream] | None = None,
                 split: CopySplit | None = None, filled: Callable[[int], None] | None = None,
                 fill: FillHooks | None = None) -> None:
        self._future: Future[None] | None = None
        self.relaid: Plan | None = None       # the plan the copy thread laid out anew (``start``'s recheck)
        self.error: CheckpointError | None = None    # why this copy cannot be handed off (the state may go on)
        self._events: list[tuple[torch.device, torch.cuda.Event]] = []
        self._marks: list[tuple[torch.device, torch.cuda.Event, int]] = []    # (device, event, bytes before it)
        if pool is None:
            deferred = frozenset()
        # The bytes of a DTensor are its local shard's: copy (and fence on) that view.
        split = split or CopySplit.of(layout, tensors, deferred)
        local, later_gpu = split.tensors, split.later_gpu
        marks = _FillMarks(filled)
        with torch.no_grad():
            synced: set[torch.device] = set()
            for i in split.now:
                t = local[i]
                if t.is_cuda:
                    synced.add(t.device)
                _copy(slot, layout[i], t, non_blocking=t.is_cuda and slot.pinned)
                marks.copied(layout[i].offset + layout[i].nbytes, synced)
            for device, idx in later_gpu.items():
                streams = side_streams if side_streams is not None else {}
                side = streams.get(device)
                if side is None:                  # one stream per device for the Checkpointer's life
                    side = streams[device] = torch.cuda.Stream(device=device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    last = 0
                    for i in idx:
                        t = local[i]
                        _copy(slot, layout[i], t, non_blocking=slot.pinned)
                        t.record_stream(side)   # the allocator must not reuse it before the copy
                        end = layout[i].offset + layout[i].nbytes
                        if fill is not None and end - last >= FILL_STEP:      # a filling save's mark
                            last = end
                            mark = torch.cuda.Event()
                            mark.record(side)
                            self._marks.append((device, mark, end))
                    event = torch.cuda.Event()
                    event.record(side)
                self._events.append((device, event))
            marks.wait()
            for device in synced:
                torch.cuda.current_stream(device).synchronize()
        self._pool = pool
        self._cpu_work = split.later_cpu
        self._slot = slot
        self._layout, self._now, self._deferred = layout, split.now, deferred
        self._fill = fill
        self._prefix = _Prefix(split) if fill is not None else None

    @property
    def deferred(self) -> bool:
        """Whether some bytes are (or will be) copied after save() returns."""
        return bool(self._cpu_work) or bool(self._events)

    def start(self, recheck: Recheck | None = None) -> None:
        """Start the background CPU copy. Called as the last thing save() does: the copy thread
        then competes with the trainer for the GIL only after save() has returned. ``recheck``: the
        plan's keys still to compare (plan_cache), on the copy thread before it copies."""
        if (self._cpu_work or recheck is not None) and self._future is None and self._pool is not None:
            self._future = self._pool.submit(self._background, recheck)

    def _background(self, recheck: Recheck | None) -> None:
        if recheck is not None:
            try:
                plan = recheck.run()
                if plan is not None:
                    if self._fill is not None:
                        self._fill.disable()      # the SAVE goes once the slot is laid out anew and full
                    self._relay(plan)
                    return
            except CheckpointError as e:      # the save fails; the trainer's fence does not
                self.error = e
                return
        if self._fill is not None and self._prefix is not None:
            try:
                self._fill.open()             # the SAVE first: the daemon writes what is copied as it is
            except Exception as e:            # the save fails; the trainer's fence does not
                self.error = e if isinstance(e, CheckpointError) else CheckpointError(f"hand-off failed: {e}")
                return
            work, lo, start = self._cpu_work, 0, 0
            for i, (entry, _) in enumerate(work):
                if entry.offset + entry.nbytes - start >= FILL_STEP:
                    _copy_all(self._slot, work, lo, i + 1)
                    lo, start = i + 1, entry.offset + entry.nbytes
                    self._prefix.cpu_upto = start
                    self._fill.report(self._prefix.upto())
            if lo < len(work):
                _copy_all(self._slot, work, lo)
            self._prefix.cpu_upto = self._prefix.total
            self._fill.report(self._prefix.upto())
        elif self._cpu_work:
            _copy_all(self._slot, self._cpu_work)

    def _relay(self, plan: Plan) -> None:
        """(Copy thread) a deferred tensor changed in place over the same bytes since the plan was
        made, or a DTensor's local shard moved: the bytes copied at save() move to ``plan``'s offsets
        and the deferred tensors (as they are until the fence) are copied there from where they now
        are; ``relaid`` is what the daemon is told."""
        slot = self._slot
        if plan.nbytes > slot.size:
            raise CheckpointError(f"a tensor changed in place since the last save and the state now needs "
                                  f"{plan.nbytes} bytes, more than the slot's {slot.size}: this save is dropped; "
                                  "the next one plans the state anew")
        for _, event in self._events:     # the side streams' copies, to the old offsets, land first
            event.synchronize()
        kept = [slot.raw(self._layout[i]).clone() for i in self._now]
        for i, data in zip(self._now, kept, strict=True):
            slot.raw(plan.layout[i]).copy_(data)
        split = CopySplit.of(plan.layout, plan.flat.tensors, self._deferred)
        _copy_all(slot, split.later_cpu)
        with torch.no_grad():
            for idx in split.later_gpu.values():
                for i in idx:
                    _copy(slot, plan.layout[i], split.tensors[i], non_blocking=False)
        self.relaid = plan

    def fence(self) -> None:
        """Return once the state may be mutated. On CUDA the compute stream waits on the copy
        event (no host stall); CPU copies are waited for on the host."""
        for device, event in self._events:
            torch.cuda.current_stream(device).wait_event(event)
        if self._future is not None:
            self._future.result()

    def wait_host(self) -> None:
        """Return once every byte is in the slot (the daemon may read it); raises ``error``. A
        filling save's SAVE is sent here if no CPU copy sent it, and its CUDA marks reported as
        the side streams pass them."""
        if self._future is not None:
            self._future.result()
        if self.error is not None:
            raise self.error
        if self._fill is not None and self._prefix is not None and self.relaid is None:
            self._fill.open()
            self._prefix.cpu_upto = self._prefix.total
            for device, mark, end in self._marks:
                mark.synchronize()
                self._prefix.gpu_upto[device] = end
                self._fill.report(self._prefix.upto())
        for _, event in self._events:
            event.synchronize()
