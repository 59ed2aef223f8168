"""Copies that outlive ``save()``: the copy thread, CUDA side streams, optimizer fences."""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.hooks import RemovableHandle

from ckptd.core.schema import TensorLayout

from .handle import SaveHandle
from .plan_cache import Recheck
from .slots import ClientSlot, CopySplit, FillHooks, SlotCopy
from .state import FlatState

MANUAL = "manual"       # overlap mode: every tensor copied in the background; the caller fences


def parse_overlap(value: object) -> bool | str:
    """``True``, ``False`` or ``"manual"``; anything else is a ValueError."""
    if isinstance(value, bool):
        return value
    if value == MANUAL:
        return MANUAL
    raise ValueError(f"overlap must be True, False or {MANUAL!r}, got {value!r}")


def fence_list(fence_on: object) -> list[torch.optim.Optimizer]:
    """``save``'s ``fence_on`` (None, an optimizer, or a list/tuple of them) as a list."""
    if fence_on is None:
        return []
    items = [fence_on] if isinstance(fence_on, torch.optim.Optimizer) else fence_on
    if not isinstance(items, (list, tuple)) or not all(isinstance(o, torch.optim.Optimizer) for o in items):
        raise TypeError(f"fence_on takes an optimizer or a list of optimizers, got {type(fence_on).__name__}")
    return list(items)


def _hand_off(copy: SlotCopy, send: Callable[[], object], failed: Callable[[BaseException], None]) -> None:
    try:
        copy.wait_host()
        send()
    except BaseException as e:
        failed(e)


def _batch() -> None:
    """(The copy thread, once) scheduled as batch work: woken by ``save()``, it does not preempt the
    trainer's thread that woke it (SCHED_BATCH: no wakeup preemption), which then returns first."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


class OverlapCopies:
    """What a Checkpointer keeps across overlapped saves. At most one copy is unfenced at a
    time: the next save, a restore, close, or an optimizer's step pre-hook calls ``fence``
    (the Checkpointer's, which also reports the fence's cost) before the state can change."""

    def __init__(self, fence: Callable[[], None]) -> None:
        self._fence = fence
        self._pool: ThreadPoolExecutor | None = None
        # optimizer → its pre-hook; weakly: a freed optimizer's address may be a new one's, which
        # (keyed by id) would find an entry and go without its hook, its step() then unfenced
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, RemovableHandle] = weakref.WeakKeyDictionary()
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}   # reused for the Checkpointer's life
        self.inflight: tuple[SaveHandle, SlotCopy] | None = None

    def pool(self) -> ThreadPoolExecutor:
        """The copy thread: background CPU copies and the hand-offs that wait for them."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-client-copy", initializer=_batch)
        return self._pool

    def after_copies(self, fn: Callable[..., object], *args: object) -> None:
        """``fn(*args)`` on the copy thread, after the copies and hand-offs queued there; here, at once,
        once the interpreter's exit has shut that thread down (its queue ran out first)."""
        try:
            self.pool().submit(fn, *args)
        except RuntimeError:            # "cannot schedule new futures after interpreter shutdown"
            fn(*args)

    @staticmethod
    def deferred(flat: FlatState, overlap: bool | str) -> frozenset[int]:
        """The tensors ``snapshot`` leaves to the copy thread: with ``overlap=True`` the deferrable
        ones (fenced by an optimizer's step), with ``overlap="manual"`` every one (the caller
        fences), with False none."""
        return (frozenset(range(len(flat.tensors))) if overlap == MANUAL
                else flat.deferrable if overlap else frozenset())

    def snapshot(self, slot: ClientSlot, layout: list[TensorLayout], flat: FlatState,
                 overlap: bool | str, splits: dict[frozenset[int], CopySplit] | None = None,
                 filled: Callable[[int], None] | None = None, fill: FillHooks | None = None) -> SlotCopy:
        """Copy what must be copied now and schedule the rest (``deferred``). ``splits``: the plan's
        splits by deferred set, filled here (plan_cache); a filling save (handoff.py) whose copy is
        all done here gives ``filled`` (told how far the copy has filled the slot as it goes), an
        overlapped one ``fill`` (its copy thread sends the SAVE and the marks)."""
        deferred = self.deferred(flat, overlap)
        split = splits.get(deferred) if splits is not None else None
        if split is None:
            split = CopySplit.of(layout, flat.tensors, deferred)
            if splits is not None:
                splits[deferred] = split
        return SlotCopy(slot, layout, flat.tensors, deferred, self.pool() if deferred else None,
                        self._side_streams, split, filled, fill)

    def begin(self, handle: SaveHandle, copy: SlotCopy, optimizers: list[torch.optim.Optimizer],
              send: Callable[[], object], failed: Callable[[BaseException], None],
              recheck: Recheck | None = None) -> None:
        """Track ``copy`` as unfenced, make each optimizer's step fence it first, and start it
        (``recheck``: see SlotCopy.start). ``send`` (the hand-off to the daemon, of ``copy.relaid``
        if set) runs on the copy thread once every byte is in the slot; ``failed`` gets what it or
        the copy raised."""
        for opt in optimizers:
            if opt not in self._hooks:
                self._hooks[opt] = opt.register_step_pre_hook(lambda *_: self._fence())
        self.inflight = (handle, copy)
        pool = self.pool()
        copy.start(recheck)               # last: see SlotCopy.start
        pool.submit(_hand_off, copy, send, failed)

    def fence(self) -> SaveHandle | None:
        """Wait for the unfenced copy, if any; return its handle with the wait added to fence_s. The copy
        stays unfenced until its wait returns: a wait interrupted (Ctrl-C caught, and training went on)
        leaves the next fence — the optimizer's hook, ``save``, ``close`` — to wait for it, so the state
        is not changed under a copy still reading it."""
        inflight = self.inflight
        if inflight is None:
            return None
        handle, copy = inflight
        t0 = time.perf_counter()
        copy.fence()
        if self.inflight is inflight:
            self.inflight = None
        handle.fence_s += time.perf_counter() - t0
        return handle

    def unhook(self) -> None:
        for hook in list(self._hooks.values()):
            hook.remove()
        self._hooks.clear()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
