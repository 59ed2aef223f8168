"""The sharded model's state dicts, taken once and reused while what they are made of is unchanged.

``get_model_state_dict`` and ``get_optimizer_state_dict`` (what a save of ``{"model": fsdp_model,
"optim": optim}`` is made of, keyed by FQN) rebuild the model's FQN maps on every call: about 16
µs a tensor, most of a save's stall on the trainer's thread for an FSDP2 model (33 ms at 1,536
tensors, 137 ms at 6,144). What they return depends only on the model's modules, parameters and
buffers (names and objects; a DTensor's local storage), on each optimizer's parameters and
per-parameter state objects, and on the optimizer's param groups. ``StateDicts`` keeps the last
result with a signature of those and hands it out again while the signature is equal: the model's
as it was (its values are views of the same storage), the optimizer's with its per-parameter state
as it is now (the same dict objects, which the save walks) and its param groups' values taken anew.
A module with state-dict hooks or extra state, or an optimizer with state-dict hooks, is never
reused (a hook may return something else each time): it is taken every save, as before. The one
hook allowed is FSDP2's own pre-save hook, which puts a module's sharded parameters back in place
(``FSDPParamGroup._to_sharded``): when they are in place, which the signature's parameter objects
show, it does nothing.

The model's state dict holds each DTensor parameter itself in place of the detached DTensor
``get_model_state_dict`` gives for it (the same bytes, layout and name; plain modules' saves hold
their parameters the same way, ``keep_vars``). So where a parameter's local shard lives is read
when the save reads it, not fixed when the dict was taken: a shard re-pointed between saves
(``.data =``, FSDP2's ``reset_sharded_param``) is found by the plan cache's address compare, on
the copy thread for an overlapped save, and that save copies it from its new place
(plan_cache.Recheck). The quick check below therefore leaves those parameters' addresses alone:
reading 2,048 cold DTensors' local shards was 2 ms of an 8,192-tensor save's stall.
"""
from __future__ import annotations

from itertools import chain
from operator import attrgetter, is_
from typing import Any

import torch

from . import dtensor
from .module_watch import WATCH
from .state import packed_groups

_NO_EXTRA_STATE = torch.nn.Module.get_extra_state
_FSDP2_PRE_SAVE = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"


class _NotPlain(Exception):
    """A module with a state-dict hook (other than FSDP2's pre-save one) or extra state: never reused."""


def _model_signature(model: torch.nn.Module) -> list[Any] | None:
    """Each module's type, its parameters' and buffers' names and objects (a parameter's local storage
    too), the buffers left out of the state dict and its children by name, depth first from
    ``model``: what its FQN state dict is made of (the tree's shape is in the counts, so the names
    are the keys, not the dotted FQNs ``named_modules`` would build for every module). None if a
    module has a state-dict hook or extra state. One pass over the modules' own dicts, every save:
    at 2,048 modules it is a few milliseconds of the trainer's stall, so no generator per module."""
    sig: list[Any] = []
    add, extend, key = sig.append, sig.extend, dtensor.storage_key

    def visit(m: torch.nn.Module) -> None:
        if m._state_dict_hooks or type(m).get_extra_state is not _NO_EXTRA_STATE:
            raise _NotPlain
        for h in m._state_dict_pre_hooks.values():
            if getattr(h, "__qualname__", "") != _FSDP2_PRE_SAVE:
                raise _NotPlain
        params, buffers, children = m._parameters, m._buffers, m._modules
        extend((type(m), len(params), len(buffers), len(m._non_persistent_buffers_set), len(children)))
        for k, p in params.items():
            extend((k, id(p), 0 if p is None else key(p)))
        for k, b in buffers.items():
            extend((k, id(b), 0 if b is None else b.data_ptr()))
        if m._non_persistent_buffers_set:
            extend(sorted(m._non_persistent_buffers_set))
        for k, c in children.items():
            add(k)
            if c is None:
                add(None)
            else:
                visit(c)
    try:
        visit(model)
    except _NotPlain:
        return None
    return sig


def _optimizer_signature(opt: torch.optim.Optimizer) -> list[Any] | None:
    """Each param group's keys and parameters, each parameter's state object; None with state-dict hooks."""
    if opt._optimizer_state_dict_pre_hooks or opt._optimizer_state_dict_post_hooks:
        return None
    state = opt.state
    sig: list[Any] = [len(state)]
    for g in opt.param_groups:
        sig.append(tuple(g))
        for p in g["params"]:
            sig += (id(p), id(state.get(p)))
    return sig


def _with_parameters(sd: dict[str, Any], model: torch.nn.Module) -> frozenset[int]:
    """Put each DTensor parameter of ``model`` into ``sd`` (``get_model_state_dict``'s) in place of
    the detached DTensor it holds under the parameter's name with the same bytes and layout; the
    ids of the parameters put in. A name ``get_model_state_dict`` changed (a wrapper's prefix) keeps
    its detached DTensor, whose address the quick check then compares (``_Frame``)."""
    put = set()
    for name, p in model.named_parameters():
        v = sd.get(name)
        if type(p) is dtensor.DTensor and type(v) is dtensor.DTensor and dtensor.tensor_key(v) == dtensor.tensor_key(p):
            sd[name] = p
            put.add(id(p))
    return frozenset(put)


_HOOKS = attrgetter("_state_dict_hooks", "_state_dict_pre_hooks")
_LOCAL = attrgetter("_local_tensor")
_PTR = torch.Tensor.data_ptr
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Frame:
    """What a model's signature was computed from, to tell cheaply that it still stands. A save
    after an optimizer step finds most of the model out of the CPU's caches: the signature's Python
    pass costs 7-8 ms at 2,050 FSDP2 modules there, and comparing each dict's keys and values by
    identity still 4 ms. So what torch's API changes is counted as it happens (``module_watch``: a
    parameter, buffer or module set on any of the model's modules) and only what no hook reports
    is compared: each module's type (a parametrization); the size of each buffer and child dict
    that had entries (``del m.x``: an entry added is counted, so an empty one can only stay so);
    each parameter by identity (``m.p = None`` is the one registration torch reports to no hook);
    its state-dict hooks (their keys are handle ids, never reused: a hook added is a new key); its
    non-persistent buffer names; and where each recorded buffer's and parameter's (local) bytes
    start (``.data =``), less the DTensor parameters the state dict holds themselves (``hold``: the
    plan cache compares their addresses, module docstring). FSDP2's own writes into
    ``m._parameters`` during forward and backward (its unsharded parameters) show as a change: a
    save then finds the signature changed and takes the state dict anew, as before. Not seen: a
    buffer or child module put into ``m._buffers`` or ``m._modules`` directly, past torch's API."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.mods = list(model.modules())
        WATCH.watch(self.mods)
        self.counts = (WATCH.generation, WATCH.buffers)
        self.types = list(map(type, self.mods))
        self.dicts: list[dict[str, Any]] = [d for m in self.mods for d in (m._buffers, m._modules) if d]
        self.lens = list(map(len, self.dicts))
        self.params: list[dict[str, Any]] = [m._parameters for m in self.mods if m._parameters]
        self.param_values = self._param_values()
        self.hooks: list[dict[int, Any]] = list(chain.from_iterable(map(_HOOKS, self.mods)))
        self.hook_ids = self._hook_ids()
        self.sets = [m._non_persistent_buffers_set for m in self.mods]
        self.names = [frozenset(x) for x in self.sets]
        tensors = [t for m in self.mods for d in (m._parameters, m._buffers) for t in d.values()
                   if isinstance(t, torch.Tensor)]
        self.dtensors = [t for t in tensors if type(t) is dtensor.DTensor]
        self.plain = [t for t in tensors if type(t) in _PLAIN]
        self.other = [t for t in tensors if type(t) is not dtensor.DTensor and type(t) not in _PLAIN]
        self.where = self._where()

    def hold(self, held: frozenset[int]) -> None:
        """Leave the addresses of the DTensors ``held`` (ids) to the plan cache from now on."""
        if held:
            self.dtensors = [t for t in self.dtensors if id(t) not in held]
            self.where = self._where()

    def _param_values(self) -> list[Any]:
        return list(chain.from_iterable(map(dict.values, self.params)))

    def _hook_ids(self) -> list[int]:
        return list(chain.from_iterable(map(dict.keys, self.hooks)))

    def _where(self) -> tuple[list[int], list[int], list[int]]:
        return (list(map(_PTR, map(_LOCAL, self.dtensors))), list(map(_PTR, self.plain)),
                list(map(dtensor.storage_key, self.other)))

    def same(self) -> bool:
        try:
            if ((WATCH.generation, WATCH.buffers) != self.counts or list(map(type, self.mods)) != self.types
                    or list(map(len, self.dicts)) != self.lens or self._hook_ids() != self.hook_ids
                    or self.sets != self.names):
                return False
            params = self._param_values()
            return (len(params) == len(self.param_values) and all(map(is_, params, self.param_values))
                    and self._where() == self.where)
        except (AttributeError, TypeError, RuntimeError):
            return False


class StateDicts:
    """What ``dtensor.model_state_dict`` and ``dtensor.optimizer_state_dict`` return, reused while
    unchanged (see the module's docstring). One per ``PlanCache``, on the trainer's thread: a save's
    walk calls ``begin`` with the sharded model, then ``model`` and ``optimizer`` as it meets them."""

    def __init__(self) -> None:
        # the model, its signature, its state dict and the _Frame its signature was computed with
        self._model: tuple[torch.nn.Module, list[Any], dict[str, Any], _Frame | None] | None = None
        self._optims: dict[int, tuple[torch.optim.Optimizer, list[Any], dict[str, Any]]] = {}
        self._now: list[Any] | None = None        # this save's signature of the sharded model
        self._frame: _Frame | None = None         # what ``_now`` was computed from
        self._held: frozenset[int] = frozenset()  # the DTensor parameters the model's state dict holds
        self.reused = 0
        self.takes = 0                            # times the model's state dict was taken anew
        self.framed = 0                           # saves whose signature the last _Frame stood for

    def begin(self, model: torch.nn.Module | None) -> None:
        last = self._model
        if model is None:
            self._now = None
            return
        if last is not None and last[0] is model and last[3] is not None and last[3].same():
            self._now = last[1]                   # nothing it was computed from changed
            self.framed += 1
            return
        self._now = _model_signature(model)
        self._frame = None if self._now is None else _Frame(model)
        if last is not None and last[0] is model and last[1] == self._now:
            if self._frame is not None:          # (the signature holds each parameter's address: unmoved)
                self._frame.hold(self._held)
            self._model = (model, self._now, last[2], self._frame)    # the same: compared faster next save

    def _same_model(self, model: torch.nn.Module) -> bool:
        last = self._model
        return (self._now is not None and last is not None and last[0] is model
                and (last[1] is self._now or last[1] == self._now))

    def unchanged(self, model: torch.nn.Module, takes: int) -> bool:
        """Whether ``model`` is as this save's signature found it and its state dict was last taken
        for the ``takes``-th time (what an optimizer's FQNs recorded then still name)."""
        return self.takes == takes and self._same_model(model)

    def model(self, model: torch.nn.Module) -> dict[str, Any]:
        if self._same_model(model):
            self.reused += 1
            return self._model[2]  # type: ignore[index]
        self.takes += 1
        sd = dtensor.model_state_dict(model)
        self._held = _with_parameters(sd, model)
        if self._frame is not None:
            self._frame.hold(self._held)
        self._model = None if self._now is None else (model, self._now, sd, self._frame)
        self._optims.clear()            # keyed by the model's FQNs
        return sd

    def optimizer(self, model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> dict[str, Any]:
        sig = _optimizer_signature(opt)
        last = self._optims.get(id(opt))
        if sig is not None and last is not None and last[0] is opt and last[1] == sig and self._same_model(model):
            self.reused += 1
            osd = last[2]
            return {"state": osd["state"],
                    "param_groups": packed_groups(opt, [old["params"] for old in osd["param_groups"]])}
        osd = dtensor.optimizer_state_dict(model, opt, path)
        if sig is None or self._now is None:
            self._optims.pop(id(opt), None)
        else:
            self._optims[id(opt)] = (opt, sig, osd)
        return osd
