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
"""
from __future__ import annotations

import dataclasses
import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from operator import eq
from typing import Any

import torch

from ckptd.core.schema import TensorLayout

from . import dtensor
from .slots import CopySplit, plan_layout
from .state import FlatState, flatten_state, replacement, top_optimizer_ids

_SCALARS = (str, int, float, bool, type(None))     # the tree's leaves (core.tree)
# Sentinels of the token list: nothing a state holds compares equal to them.
_DICT, _LIST, _TUPLE, _TENSOR, _OBJ, _FENCE = (object() for _ in range(6))


class _Walk:
    """One save's walk: tokens, tensors, scalars in tree order, state dicts taken (by object id)."""

    def __init__(self, state: dict[str, Any], fence_on: Sequence[torch.optim.Optimizer],
                 sharded: torch.nn.Module | None) -> None:
        self.tokens: list[Any] = []
        self.tensors: list[torch.Tensor] = []
        self.scalars: list[Any] = []
        self.taken: dict[int, Any] = {}
        self.objects: list[Any] = []          # kept alive while cached: their ids stay theirs
        self._keys: list[Any] = []            # the key path, for replacement()'s errors and FQNs
        self.sharded = sharded
        self._top = top_optimizer_ids(state)
        self.walk(state)
        for opt in fence_on:
            self.tokens += (_FENCE, id(opt))
            self.optimizer(opt)

    def optimizer(self, opt: torch.optim.Optimizer) -> None:
        """Which tensors are deferrable depends on the optimizer's parameters, by address."""
        self.objects.append(opt)
        self.tokens.append(len(opt.state))
        self.tokens += [p.data_ptr() if type(p) is torch.nn.Parameter else dtensor.storage_key(p)
                        for g in opt.param_groups for p in g["params"]]

    def walk(self, obj: Any) -> None:
        """The same order and cases as ``encode_tree`` with ``flatten_state``'s callbacks; tensor
        and scalar values of a container are taken in its loop (most of a state's nodes)."""
        tokens, tensors, scalars = self.tokens, self.tensors, self.scalars
        if isinstance(obj, torch.Tensor):
            tokens.append(_TENSOR)
            tensors.append(obj)
        elif isinstance(obj, _SCALARS):
            tokens.append(type(obj))
            scalars.append(obj)
        elif isinstance(obj, dict):
            tokens += (_DICT, len(obj))
            for k, v in obj.items():
                tokens.append(k)
                if type(k) is not str:
                    tokens.append(type(k))     # 1, 1.0 and True are equal keys, not equal trees
                if isinstance(v, torch.Tensor):
                    tokens.append(_TENSOR)
                    tensors.append(v)
                elif isinstance(v, _SCALARS):
                    tokens.append(type(v))
                    scalars.append(v)
                else:
                    self._keys.append(k)
                    self.walk(v)
                    self._keys.pop()
        elif isinstance(obj, (list, tuple)):
            tokens += (_TUPLE if isinstance(obj, tuple) else _LIST, len(obj))
            for i, v in enumerate(obj):
                if isinstance(v, _SCALARS):
                    tokens.append(type(v))
                    scalars.append(v)
                else:
                    self._keys.append(i)
                    self.walk(v)
                    self._keys.pop()
        else:
            stateful = callable(getattr(obj, "state_dict", None))
            tokens += (_OBJ, id(obj) if stateful else type(obj))
            if id(obj) in self.taken:
                sd = self.taken[id(obj)]
            else:
                sd = self.taken[id(obj)] = _state_of(obj, "/".join(map(str, self._keys)), self.sharded, self._top)
                self.objects.append(obj)
            if isinstance(obj, torch.optim.Optimizer):
                self.optimizer(obj)
            self.walk(sd)


_MODULE_STATE_DICT = torch.nn.Module.state_dict
_PLAIN = (torch.Tensor, torch.nn.Parameter)      # tensor_key's types that are never DTensors


def _state_of(obj: Any, path: str, sharded: torch.nn.Module | None, top: set[int]) -> Any:
    """``replacement(obj)``; for a module with torch's own ``state_dict`` its parameters and
    buffers themselves (``keep_vars``): no detached copy of each tensor per save (at 8,192 tensors
    a third of the walk), and the same objects every save (``flatten_state`` detaches on a miss)."""
    if getattr(type(obj), "state_dict", None) is _MODULE_STATE_DICT and obj is not sharded:
        return obj.state_dict(keep_vars=True)
    return replacement(obj, path, sharded, top)


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything that decides which bytes a tensor's copy reads, so the last plan's tensor (a
    view of the same bytes while this is equal) is copied in its place: address, shape,
    strides, dtype, device, lazy conj/neg bits; a DTensor's placements, mesh and global shape.
    Copying the last plan's tensors, not this save's, leaves nothing of the walk alive after
    ``plan()``: a module's state_dict() hands out new tensor objects each save, and keeping
    those until the copy ends promotes them into CPython's oldest generation, whose collection
    (0.2 s in a torch process) they then set off every few saves."""
    if type(t) not in _PLAIN and dtensor.is_dtensor(t):
        return (*tensor_key(dtensor.local_tensor(t)), tuple(t.placements), id(t.device_mesh),  # type: ignore[attr-defined]
                t.shape)
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t.is_conj(), t.is_neg())


def _scalar_counts(node: Any, counts: dict[int, int]) -> int:
    """Scalar leaves under each container node of an encoded tree (by node id), in tree order."""
    if isinstance(node, dict):
        (tag, value), = node.items()
        if tag == "T":
            return 0
        n = sum(_scalar_counts(item[1] if tag == "d" else item, counts) for item in value)
        counts[id(node)] = n
        return n
    return 1


@dataclass(frozen=True)
class Plan:
    """What a save needs of its state: the flat state, its slot layout and its wire form."""
    flat: FlatState
    layout: list[TensorLayout]
    nbytes: int
    wire: list[Any]
    # deferred set → how its snapshot splits the copy (SlotCopy), kept while the plan is reused
    splits: dict[frozenset[int], CopySplit] = dataclasses.field(default_factory=dict)


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


class PlanCache:
    """The last save's plan, reused while the structure is unchanged (see the module's docstring).
    It holds that state's tensors and Stateful objects until the next plan or ``clear()``."""

    def __init__(self) -> None:
        self._last: _Cached | None = None
        self.hits = 0
        self.misses = 0

    def clear(self) -> None:
        self._last = None

    def warm(self, state: dict[str, Any]) -> int | None:
        """Plan ``state`` now (after a restore: ``load_state_dict`` gives an optimizer new state
        tensors, so the next save would pay the full plan); its bytes in a slot, or None: a state
        that cannot be saved is left for ``save`` to refuse."""
        try:
            plan = self.plan(state)
        except (TypeError, ValueError):
            self._last = None
            return None
        d = plan.flat.deferrable       # and the copy's split for an overlapped save (the default)
        if d not in plan.splits:
            plan.splits[d] = CopySplit.of(plan.layout, plan.flat.tensors, d)
        return plan.nbytes

    def plan(self, state: dict[str, Any], fence_on: Sequence[torch.optim.Optimizer] = ()) -> Plan:
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict of names to values, got {type(state).__name__}")
        last = self._last
        sharded = last.sharded if last is not None else dtensor.sharded_model_of(state)
        try:
            walk = _Walk(state, fence_on, sharded)
        except (TypeError, ValueError, RuntimeError, AttributeError):
            walk = None          # flatten_state raises the error with its message
        if walk is not None and last is not None and walk.tokens == last.tokens:
            # Key by key, each dropped once compared: a list of them would live through young
            # collections into the oldest generation, and set off its collection (0.2 s).
            try:
                same = len(walk.tensors) == len(last.keys) and all(map(eq, map(tensor_key, walk.tensors), last.keys))
            except (RuntimeError, TypeError, AttributeError):
                same = False
            if same:
                self.hits += 1
                return self._reuse(last, walk)
        self.misses += 1
        self._last = None
        if walk is not None and sharded is not dtensor.sharded_model_of(state):
            walk = None          # its state dicts were taken for another sharded model: not reused
        flat = flatten_state(state, fence_on, walk.taken if walk is not None else None)
        layout, nbytes = plan_layout(flat.tensors, flat.placements)
        plan = Plan(flat, layout, nbytes, [e.to_wire() for e in layout])
        if walk is not None:
            counts: dict[int, int] = {}
            if _scalar_counts(flat.tree, counts) == len(walk.scalars):   # else: never reused
                self._last = _Cached(plan, walk.tokens, [tensor_key(t) for t in walk.tensors], walk.scalars,
                                     _zeros(walk.scalars), counts, walk.objects, len(counts), walk.sharded)
        return plan

    def _reuse(self, last: _Cached, walk: _Walk) -> Plan:
        """The last plan with this save's scalars (its tensors: see tensor_key)."""
        p = last.plan
        tree = _refill(last, walk.scalars)
        if tree is not p.flat.tree:
            known = last.counts if len(last.counts) <= 2 * last.nodes else _counts(tree)
            last = self._last = dataclasses.replace(
                last, plan=dataclasses.replace(p, flat=p.flat._replace(tree=tree)), scalars=walk.scalars,
                zeros=_zeros(walk.scalars), counts=known)
        return last.plan


def _counts(tree: Any) -> dict[int, int]:
    counts: dict[int, int] = {}
    _scalar_counts(tree, counts)
    return counts


def _zeros(scalars: list[Any]) -> list[int]:
    return [i for i, v in enumerate(scalars) if type(v) is float and v == 0.0]


def _same(a: Any, b: Any) -> bool:
    """Equal as saved: -0.0 is not 0.0, NaN is never the same (rebuilt). Types are equal: the
    tokens hold each scalar's type."""
    return a is b or (a == b and not (type(a) is float and a == 0.0 and math.copysign(1, a) != math.copysign(1, b)))


def _refill(last: _Cached, scalars: list[Any]) -> Any:
    """The cached tree, or a copy of the branches that hold a scalar changed since it was built
    (the rest shared: the tree is never changed in place, an earlier SAVE may still be encoding it)."""
    old = last.scalars
    if scalars == old and all(_same(scalars[i], old[i]) for i in last.zeros):
        return last.plan.flat.tree
    changed = [i for i, (a, b) in enumerate(zip(scalars, old, strict=True)) if not _same(a, b)]
    return _rebuild(last.plan.flat.tree, 0, changed, scalars, last.counts)


def _rebuild(node: Any, lo: int, changed: list[int], scalars: list[Any], counts: dict[int, int]) -> Any:
    if not isinstance(node, dict):
        return scalars[lo]
    (tag, value), = node.items()
    if tag == "T":
        return node
    hi = lo + counts[id(node)]
    i = bisect_left(changed, lo)
    if i == len(changed) or changed[i] >= hi:
        return node
    out = []
    for item in value:
        child = item[1] if tag == "d" else item
        n = counts.get(id(child), 0) if isinstance(child, dict) else 1
        new = _rebuild(child, lo, changed, scalars, counts) if n else child
        out.append([item[0], new] if tag == "d" and new is not child else item if tag == "d" else new)
        lo += n
    new_node = {tag: out}
    counts[id(new_node)] = counts[id(node)]
    return new_node
