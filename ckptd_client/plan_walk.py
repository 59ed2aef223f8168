"""One save's walk of its state, for the plan cache (plan_cache.py): what decides whether the last
plan still fits, as a flat list of tokens (containers, keys, leaf types, Stateful objects by
identity, every optimizer's parameter addresses), the tensors and the scalars in tree order, and
the state dicts it took (flatten_state takes them from here on a miss)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import dtensor
from .plan_defer import Segment, Span
from .sharded_sd import StateDicts
from .state import replacement, top_optimizer_ids

_SCALARS = (str, int, float, bool, type(None))     # the tree's leaves (core.tree)
_SCALAR_TYPES = frozenset(_SCALARS)                 # (exactly these: a subclass takes the loop's isinstance)
# Sentinels of the token list: nothing a state holds compares equal to them.
_DICT, _LIST, _TUPLE, _TENSOR, _OBJ, _FENCE = (object() for _ in range(6))


class Walk:
    """One save's walk: tokens, tensors, scalars in tree order, state dicts taken (by object id).
    ``defer``: the last walk's segments, spliced in where their check holds (plan_defer.py);
    ``spliced``: those, each with its first tensor's index; ``spans``: every object walked."""

    def __init__(self, state: dict[str, Any], fence_on: Sequence[torch.optim.Optimizer],
                 sharded: torch.nn.Module | None, memo: StateDicts,
                 defer: dict[int, Segment] | None = None) -> None:
        self.tokens: list[Any] = []
        self.tensors: list[torch.Tensor] = []
        self.scalars: list[Any] = []
        self.taken: dict[int, Any] = {}
        self.objects: list[Any] = []          # kept alive while cached: their ids stay theirs
        self.spans: list[Span] = []
        self.spliced: list[tuple[Segment, int]] = []
        self._defer = defer
        self._keys: list[Any] = []            # the key path, for replacement()'s errors and FQNs
        self.sharded = sharded
        self._memo = memo
        memo.begin(sharded)
        self._top = top_optimizer_ids(state)
        self.walk(state)
        for opt in fence_on:
            self.tokens += (_FENCE, id(opt))
            self.optimizer(opt)

    @classmethod
    def alone(cls, obj: Any, sd: Any = None) -> Walk:
        """(Copy thread) the walk of one module or optimizer as it is now, its tokens after its own two;
        ``sd``: its state dict as the save takes it, where that is not its own (a sharded model's optimizer)."""
        walk = cls({}, (), None, StateDicts())
        walk.tokens.clear()
        if sd is not None:
            walk.taken[id(obj)] = sd
        walk.walk(obj)
        return walk

    def sharded_unchanged(self, takes: int) -> bool:
        """Whether the sharded model is as it was when its state dict was taken for the ``takes``-th time
        (its optimizers' FQN-keyed state dicts still stand: plan_defer.py)."""
        return self.sharded is not None and self._memo.unchanged(self.sharded, takes)

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
            types = list(map(type, obj))
            if _SCALAR_TYPES.issuperset(types):      # all leaves (a param group's 2,048 FQNs): taken in C
                tokens += types
                scalars += obj
                return
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
            seg = self._defer.get(id(obj)) if self._defer else None
            if seg is not None:
                at = len(tensors)
                if seg.splice(self):
                    self.spliced.append((seg, at))
                    return
            start = (len(tokens), len(tensors), len(scalars))
            if id(obj) in self.taken:
                sd = self.taken[id(obj)]
            else:
                sd = self.taken[id(obj)] = _state_of(obj, "/".join(map(str, self._keys)), self.sharded, self._top,
                                                     self._memo)
                self.objects.append(obj)
            mark = None
            if isinstance(obj, torch.optim.Optimizer):
                self.optimizer(obj)
                mark = self._optimizer_dict(sd)
            else:
                self.walk(sd)
            self.spans.append(Span(obj, start, (len(tokens), len(tensors), len(scalars)), mark))

    def _optimizer_dict(self, sd: Any) -> tuple[int, int, int] | None:
        """``walk(sd)`` of an optimizer's state dict; where its ``param_groups`` part starts (plan_defer)."""
        if type(sd) is not dict or list(sd) != ["state", "param_groups"]:
            self.walk(sd)
            return None
        self.tokens += (_DICT, 2, "state")
        self._keys.append("state")
        self.walk(sd["state"])
        self._keys[-1] = "param_groups"
        self.tokens.append("param_groups")
        mark = (len(self.tokens), len(self.tensors), len(self.scalars))
        self.walk(sd["param_groups"])
        self._keys.pop()
        return mark




_MODULE_STATE_DICT = torch.nn.Module.state_dict


def _state_of(obj: Any, path: str, sharded: torch.nn.Module | None, top: set[int], memo: StateDicts) -> Any:
    """``replacement(obj)``; for a module with torch's own ``state_dict`` its parameters and
    buffers themselves (``keep_vars``): no detached copy of each tensor per save (at 8,192 tensors
    a third of the walk), and the same objects every save (``flatten_state`` detaches on a miss).
    The sharded model's and its optimizers' FQN state dicts come through ``memo`` (sharded_sd.py)."""
    if getattr(type(obj), "state_dict", None) is _MODULE_STATE_DICT and obj is not sharded:
        return obj.state_dict(keep_vars=True)
    if sharded is not None:
        if obj is sharded:
            return memo.model(obj)
        if isinstance(obj, torch.optim.Optimizer) and id(obj) in top:
            return memo.optimizer(sharded, obj, path)
    return replacement(obj, path, sharded, top)
