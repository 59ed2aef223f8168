"""A save's plan reused while the state's structure stays the same (as DCP caches its save plans).

Walking a state, validating every tensor, laying it out and building the wire form cost the
trainer per tensor (tens of microseconds each, and enough allocations to set off CPython's full
collections: 0.2 s each in a torch process) on every save. The structure rarely changes between
saves, so each save first takes one lean walk that records the structure as a flat list of
tokens (containers, keys, leaf types, Stateful objects by identity, every optimizer's parameter
addresses) and, per tensor, a key of everything that decides which bytes it holds (address,
shape, strides, dtype, device, lazy conj/neg bits; a DTensor's placements and mesh too). When
both equal the last save's, the last plan is used: its tensors (views of the same bytes), its
layout and wire form, its deferrable set. Only the JSON leaves (scalars: learning rates, loader
positions, RNG state) are taken anew, and only the branches of the tree holding a changed one
are rebuilt. Anything else is a miss: the full ``flatten_state`` and ``plan_layout`` run, from
the state dicts this walk already took. A module's custom ``state_dict`` that leaves a parameter
out is keyed by what it returns, not by the module's parameters.

Comparing every key is most of a hit's cost (about 0.8 µs a tensor: seven torch calls; 4 µs a
DTensor). For a save whose copy runs on the copy thread (``plan(..., lazy=True)``), the tensors the
copy defers (parameters and optimizer state, unchanged until the fence; a DTensor by its local
shard) are compared by address only on the trainer's thread; their full keys are compared on the
copy thread, before it copies (``Plan.pending``, a ``Recheck``). A plain tensor changed in place
over the same bytes (reshaped, re-typed, transposed) is found there and that save re-laid out
(``Recheck.run``); a DTensor so changed fails that save, saying why, and the next one plans anew,
while a DTensor whose local shard moved with its layout unchanged (a sharded model's parameter
re-pointed: its state dict holds the parameter itself, sharded_sd.py) is copied from where it is.
Everything else (buffers, tensors the copy does not defer, DTensors this rank does not write) is
compared in full on the trainer's thread. Such a save does not walk its modules and optimizers
there either: the last walk's part of each is spliced in while a quick check holds, and the copy
thread walks them for real in its ``Recheck`` (plan_defer.py; the walk itself: plan_walk.py).
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from operator import eq
from typing import Any, NoReturn

import torch

from ckptd.core.schema import TensorLayout

from . import dtensor
from .errors import CheckpointError
from .plan_defer import Segment, segments
from .plan_tree import check_size, counts_of, refill, scalar_counts, zeros
from .plan_walk import Walk
from .sharded_sd import StateDicts
from .slots import CopySplit, plan_layout
from .state import FlatState, flatten_state

log = logging.getLogger("ckptd_client")
_PLAIN = (torch.Tensor, torch.nn.Parameter)      # tensor_key's types that are never DTensors
_PLAIN_KEY = 7                                    # a plain tensor's key length (a DTensor's is longer)
# A tensor's key (dtensor.tensor_key): while it is equal, the last plan's tensor (a view of the same
# bytes) is copied in its place. Copying the last plan's tensors, not this save's, leaves nothing of
# the walk alive after ``plan()``: a module's state_dict() hands out new tensor objects each save, and
# keeping those until the copy ends promotes them into CPython's oldest generation, whose collection
# (0.2 s in a torch process) they then set off every few saves.
tensor_key = dtensor.tensor_key


@dataclass(frozen=True)
class Plan:
    """What a save needs of its state: the flat state, its slot layout and its wire form."""
    flat: FlatState
    layout: list[TensorLayout]
    nbytes: int
    wire: list[Any]
    # deferred set → how its snapshot splits the copy (SlotCopy), kept while the plan is reused
    splits: dict[frozenset[int], CopySplit] = dataclasses.field(default_factory=dict)
    # This save's keys still to compare on the copy thread (a lazy hit), else None.
    pending: Recheck | None = None

    def checked(self) -> Plan:
        """This plan with its pending keys compared now, on the caller's thread (a save that does not
        copy on the copy thread after all: streamed)."""
        return (self.pending.run() if self.pending is not None else None) or self


@dataclass(frozen=True)
class _Cached:
    plan: Plan
    tokens: list[Any]
    keys: list[tuple[Any, ...]]
    scalars: list[Any]
    zeros: list[int]                 # where scalars holds a float zero: its sign is not seen by ==
    # Scalar leaves per container node (by id) of plan.flat.tree: nodes a rebuild makes are
    # added, so an id is never read stale (a node of the tree is alive, and its entry is its own).
    counts: dict[int, int]
    objects: list[Any]
    nodes: int                       # container nodes of the tree as first built
    # The sharded model (dtensor.sharded_model_of) the last save found: the walk takes it as
    # this save's, since a model whose parameters became (or stopped being) DTensors hands out
    # other tensors, whose keys differ: a miss, which checks it.
    sharded: torch.nn.Module | None
    # Walk indices of the tensors a deferred copy takes (plain ones, and DTensors this rank writes;
    # flat index in ``flat_of``), whose full keys a lazy hit compares on the copy thread; ``eager``:
    # every other walk index.
    lazy: list[int]
    eager: list[int]
    flat_of: dict[int, int]
    # Modules and optimizers a lazy walk splices (plan_defer.py), by id; ``lazy_free``: the lazy
    # indices outside them (the ones whose address the trainer's thread compares when all splice).
    segments: dict[int, Segment]
    lazy_free: list[int]
    size: int                        # the SAVE's encoded bytes (plan_tree.check_size), kept by refill's count


class PlanCache:
    """The last save's plan, reused while the structure is unchanged (see the module's docstring).
    It holds that state's tensors and Stateful objects until the next plan or ``clear()``."""

    def __init__(self) -> None:
        self._last: _Cached | None = None
        self.state_dicts = StateDicts()      # the sharded model's and its optimizers' (sharded_sd.py)
        self.hits = 0
        self.misses = 0
        self.deferring = True                # whether lazy walks splice (off after a Recheck found a change)
        self.spliced = 0                     # hits whose every module and optimizer was spliced (plan_defer.py)

    def clear(self) -> None:
        self._last = None
        self.state_dicts = StateDicts()

    def warm(self, state: dict[str, Any]) -> tuple[int, CopySplit] | None:
        """Plan ``state`` now (after a restore: ``load_state_dict`` gives an optimizer new state
        tensors, so the next save would pay the full plan); its bytes in a slot and the copy's split
        for an overlapped save (the default), or None: a state that cannot be saved is left for
        ``save`` to refuse."""
        try:
            plan = self.plan(state)
        except (TypeError, ValueError):
            self._last = None
            return None
        d = plan.flat.deferrable
        if d not in plan.splits:
            plan.splits[d] = CopySplit.of(plan.layout, plan.flat.tensors, d)
        return plan.nbytes, plan.splits[d]

    def plan(self, state: dict[str, Any], fence_on: Sequence[torch.optim.Optimizer] = (), *,
             lazy: bool = False) -> Plan:
        """This save's plan. ``lazy``: the caller's copy defers ``flat.deferrable`` to the copy thread,
        which then runs ``Plan.pending`` before it copies (see the module's docstring)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict of names to values, got {type(state).__name__}")
        last = self._last
        sharded = last.sharded if last is not None else dtensor.sharded_model_of(state)
        defer = last.segments if lazy and self.deferring and last is not None else None
        walk = self._walk(state, fence_on, sharded, defer)
        if walk is not None and last is not None and walk.tokens == last.tokens:
            # Key by key, each dropped once compared: a list of them would live through young
            # collections into the oldest generation, and set off its collection (0.2 s).
            try:
                free = len(walk.spliced) == len(last.segments)
                same = len(walk.tensors) == len(last.keys) and _same_keys(walk.tensors, last, lazy, free)
            except (RuntimeError, TypeError, AttributeError):
                same = False
            if same:
                self.hits += 1
                self.spliced += bool(free and last.segments)
                plan = self._reuse(last, walk)
                if defer and not free:       # re-armed from this walk where a check failed (a registration)
                    last = self._last = dataclasses.replace(last, segments={**last.segments, **segments(
                        walk.spans, walk.tokens, walk.tensors, walk.scalars, walk.taken, last.flat_of,
                        self._takes(walk), walk.sharded)})
                if lazy and last.lazy:
                    return dataclasses.replace(plan, pending=Recheck(self, walk.tensors, walk.spliced))
                return plan
        self.misses += 1
        self._last = None
        if walk is not None and walk.spliced:
            walk = self._walk(state, fence_on, sharded, None)      # the state's own parts, not the last walk's
        if walk is not None and sharded is not dtensor.sharded_model_of(state):
            walk = None          # its state dicts were taken for another sharded model: not reused
        flat = flatten_state(state, fence_on, walk.taken if walk is not None else None)
        layout, nbytes = plan_layout(flat.tensors, flat.placements)
        plan = Plan(flat, layout, nbytes, [e.to_wire() for e in layout])
        size = check_size(flat.tree, plan.wire)      # over the frame limit: a TypeError naming the largest value
        if walk is not None:
            counts: dict[int, int] = {}
            if scalar_counts(flat.tree, counts) == len(walk.scalars):   # else: never reused
                lazy_at = _lazy_indices(walk.tensors, flat)
                segs = segments(walk.spans, walk.tokens, walk.tensors, walk.scalars, walk.taken, lazy_at,
                                self._takes(walk), walk.sharded)
                inside = {s.at + i for s in segs.values() for i in range(len(s.tensors))}
                self._last = _Cached(plan, walk.tokens, [tensor_key(t) for t in walk.tensors], walk.scalars,
                                     zeros(walk.scalars), counts, walk.objects, len(counts), walk.sharded,
                                     list(lazy_at), [i for i in range(len(walk.tensors)) if i not in lazy_at],
                                     lazy_at, segs, [i for i in lazy_at if i not in inside], size)
        return plan

    def _takes(self, walk: Walk) -> int | None:
        """Beside a sharded model: how often its state dict was taken (plan_defer.segments); else None."""
        return self.state_dicts.takes if walk.sharded is not None else None

    def _walk(self, state: dict[str, Any], fence_on: Sequence[torch.optim.Optimizer],
              sharded: torch.nn.Module | None, defer: dict[int, Segment] | None) -> Walk | None:
        try:
            return Walk(state, fence_on, sharded, self.state_dicts, defer)
        except (TypeError, ValueError, RuntimeError, AttributeError):
            return None          # flatten_state raises the error with its message

    def relaid(self, changed: dict[int, torch.Tensor]) -> Plan:
        """(Copy thread, a lazy hit's ``Recheck``) the cached plan with the lazy tensors at walk
        indices ``changed`` taken as they are now, laid out anew; cached in its place. Names, tree,
        placements and what is deferred stay: the structure was equal, and each tensor changed lies over
        the bytes it did, was rebound to new memory of its shape and dtype, or is a DTensor whose local
        shard moved, its layout unchanged."""
        last = self._last
        assert last is not None
        p = last.plan
        tensors = list(p.flat.tensors)
        keys = list(last.keys)
        for i, t in changed.items():
            name, _ = tensors[last.flat_of[i]]
            if len(keys[i]) != _PLAIN_KEY:
                tensors[last.flat_of[i]] = (name, dtensor.local_tensor(t))
            else:
                tensors[last.flat_of[i]] = (name, t.detach() if t.requires_grad else t)
            keys[i] = tensor_key(t)
        layout, nbytes = plan_layout(tensors, p.flat.placements)
        plan = Plan(p.flat._replace(tensors=tensors), layout, nbytes, [e.to_wire() for e in layout])
        self._last = dataclasses.replace(last, plan=plan, keys=keys)
        return plan

    def _reuse(self, last: _Cached, walk: Walk) -> Plan:
        """The last plan with this save's scalars (its tensors: see tensor_key)."""
        p = last.plan
        tree, grew = refill(p.flat.tree, last.scalars, last.zeros, last.counts, walk.scalars)
        if tree is not p.flat.tree:
            size = check_size(tree, p.wire, last.size + grew)     # only the changed scalars counted
            known = last.counts if len(last.counts) <= 2 * last.nodes else counts_of(tree)
            last = self._last = dataclasses.replace(
                last, plan=dataclasses.replace(p, flat=p.flat._replace(tree=tree)), scalars=walk.scalars,
                zeros=zeros(walk.scalars), counts=known, size=size)
        return last.plan


class Recheck:
    """A lazy hit's full key comparison of the tensors the copy defers, run on the copy thread before
    it copies them (they stay as they are until the fence). ``run``: None when every key is equal, else
    the save's plan laid out for the tensors as they now are (``PlanCache.relaid``). The modules and
    optimizers the walk spliced are walked here first (plan_defer.py): their tensors as they are now."""

    def __init__(self, cache: PlanCache, walked: list[torch.Tensor], spliced: list[tuple[Segment, int]]) -> None:
        self._cache, self._walked, self._spliced = cache, walked, spliced

    def run(self) -> Plan | None:
        last = self._cache._last
        if last is None:        # cleared (close) before the copy ran: nothing to compare with
            return None
        walked, spliced = self._walked, self._spliced
        self._walked, self._spliced = [], []           # held no longer than the copy
        now: dict[int, torch.Tensor] = {}
        for seg, at in spliced:
            if seg.sharded_model:
                continue                # its state dict was the one reused: walked, it is this part
            try:
                fresh = Walk.alone(seg.obj, seg.state_now())
                same = seg.same(fresh.tokens[2:])
            except KeyError:
                same = False
            except (TypeError, ValueError, RuntimeError, AttributeError) as e:
                self._stop(f"walking it again failed ({e})")
            if not same:
                self._stop("its structure changed (a parameter re-pointed with .data, a buffer or module "
                           "added without torch's registration, a state-dict hook added)")
            for i in seg.lazy:
                now[at + i] = fresh.tensors[i]
        changed = {}
        for i in last.lazy:
            t = now[i] if i in now else walked[i]
            key, was = tensor_key(t), last.keys[i]
            if key != was:
                if i in now and t.data_ptr() != was[0]:
                    if len(was) == _PLAIN_KEY and key[1:] == was[1:]:
                        # Rebound to new memory of the same shape and dtype (``state["m"] = 0.9 * m + g``
                        # in an optimizer's step): the bytes to save are there now.
                        changed[i] = t
                        continue
                    self._stop("a parameter or optimizer state tensor moved to other memory and changed its "
                               "shape, strides or dtype")
                if len(was) != _PLAIN_KEY and key[1:] != was[1:]:
                    self._cache.clear()
                    raise CheckpointError("a DTensor of the state changed since the last save (its local shard's "
                                          "shape, strides or dtype, or its placements): this save is dropped; the "
                                          "next one plans the state anew")
                changed[i] = t          # a DTensor's local shard moved, the same layout: copied from where it is
        return self._cache.relaid(changed) if changed else None

    def _stop(self, why: str) -> NoReturn:
        """A spliced model or optimizer is not what the last walk saw: this save fails; the cache
        stops splicing (its later saves walk everything on the trainer's thread)."""
        self._cache.clear()
        self._cache.deferring = False
        err = CheckpointError(f"the model or optimizer changed since the last save, unseen by save(): {why}. This "
                              "save is dropped; this Checkpointer's later saves walk the whole state before "
                              "save() returns")
        log.warning("ckptd: %s", err)        # an overlapped save's failure is otherwise only on its handle
        raise err


def _same_keys(tensors: list[torch.Tensor], last: _Cached, lazy: bool, free: bool) -> bool:
    """Whether this walk's tensors are the last plan's: every key in full, or with ``lazy`` the lazy
    ones by address only (their full keys: ``Recheck``), and with ``free`` (every segment spliced)
    only those outside the segments (the rest: ``Recheck`` too)."""
    if not lazy or not last.lazy:
        return all(map(eq, map(tensor_key, tensors), last.keys))
    keys = last.keys
    return (all(_at(tensors[i], keys[i]) for i in (last.lazy_free if free else last.lazy))
            and all(tensor_key(tensors[i]) == keys[i] for i in last.eager))


def _at(t: torch.Tensor, key: tuple[Any, ...]) -> bool:
    """Whether ``t`` is of ``key``'s kind (plain or DTensor) with its bytes (a local shard's) at its address."""
    if len(key) == _PLAIN_KEY:
        return type(t) in _PLAIN and t.data_ptr() == key[0]
    if type(t) is dtensor.DTensor:
        return bool(t._local_tensor.data_ptr() == key[0])  # type: ignore[attr-defined]
    return type(t) not in _PLAIN and dtensor.is_dtensor(t) and dtensor.local_tensor(t).data_ptr() == key[0]


def _lazy_indices(walked: list[torch.Tensor], flat: FlatState) -> dict[int, int]:
    """Walk index → flat index of the tensors an overlapped copy defers (``flat.deferrable``; a
    DTensor's local shard that this rank writes): the ones whose full key a lazy hit may compare on
    the copy thread. ``flat.tensors`` is in walk order, less the DTensors this rank does not write;
    anything out of step: none are lazy."""
    if not flat.deferrable:
        return {}
    out: dict[int, int] = {}
    j = 0
    for i, t in enumerate(walked):
        written = flat.tensors[j][1] if j < len(flat.tensors) else None
        if type(t) in _PLAIN:
            if written is None or written.data_ptr() != t.data_ptr() or written.shape != t.shape:
                return {}
            if j in flat.deferrable and t.numel():
                out[i] = j
            j += 1
        elif dtensor.is_dtensor(t):
            if written is not None and written is dtensor.local_tensor(t):
                if j in flat.deferrable and t.numel():
                    out[i] = j
                j += 1
        else:
            return {}
    return out if j == len(flat.tensors) else {}
