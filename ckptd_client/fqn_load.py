"""A sharded model's and its optimizers' FQN state dicts on a restore: what it reads into, and the
loads afterwards, skipped when they would change nothing (an optimizer's: all but its param groups' settings).

Beside a sharded model (``dtensor.sharded_model_of``, FQN mode) a restore reads into
``get_model_state_dict(model)`` and each top-level optimizer's ``get_optimizer_state_dict``
(:func:`read_into`): their tensors are the live ones, the parameters' and buffers' own bytes for
a model under FSDP2 or DTensor TP. It then loads them back through torch's ``set_*_state_dict``;
the model's copies every tensor onto itself. At 290 FSDP2 parameters that copy, and the FQN maps
torch builds for it, were 73-132 ms of a ~0.5 s restore from memory; at 2,048 modules under one
root, ~0.5 s of a ~4 s restore (``Module.load_state_dict`` filters the whole dict for every
child). :func:`load_model` skips it when it provably changes nothing and calls it otherwise:

- every value to load is the very tensor ``get_model_state_dict`` gave the restore for that key,
  and shares its bytes, shape and strides with one of the model's parameters or buffers;
- no module loads in its own way: no ``_load_from_state_dict`` or ``set_extra_state`` of its
  own, no load hooks but FSDP2's (its pre-load hook puts the sharded parameters in place, which
  ``get_model_state_dict`` already did; its post-load hook re-pads a parameter whose local tensor
  was replaced, and none was).

An optimizer's ``set_optimizer_state_dict`` is skipped the same way (:func:`optimizer_loaded_in_place`;
at 8,192 FSDP2 tensors it was about a fifth of a restore: torch maps FQNs to parameters and looks up
each state tensor's param group in a list, quadratic in the group's size), and only its param groups'
settings (``lr``, ``betas``, a scheduler's ``initial_lr`` …) are set, as torch's load sets them:

- every state tensor loaded is the optimizer's own (``optim.state[param][key]``, which
  ``get_optimizer_state_dict`` gave the restore to read into), of the dtype and device torch's load
  would cast it to, and the optimizer has state for no other parameter and under no other key;
- the loaded param groups name the live groups' parameters, in their order, and have their keys;
- nothing loads in a way of its own: the optimizer's ``load_state_dict`` is torch's, with no load hooks,
  its ``__setstate__`` is torch's (``torch.optim``'s classes only set defaults there), and no module is
  wrapped by FSDP1 (whose optimizer state torch converts on load).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import dtensor
from .errors import CheckpointError

_MODULE_LOAD = torch.nn.Module._load_from_state_dict
_MODULE_SET_EXTRA = torch.nn.Module.set_extra_state
_FSDP2_PRE_LOAD = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"
_FSDP2_POST_LOAD = "FSDPParam.__init__.<locals>.<lambda>"
_OPTIM_LOAD = torch.optim.Optimizer.load_state_dict
_OPTIM_SETSTATE = torch.optim.Optimizer.__setstate__


def _plain_loads(model: torch.nn.Module) -> bool:
    """No module of ``model`` loads its state dict in a way of its own (but FSDP2's hooks)."""
    for m in model.modules():
        cls = type(m)
        if cls._load_from_state_dict is not _MODULE_LOAD or cls.set_extra_state is not _MODULE_SET_EXTRA:
            return False
        for hook in m._load_state_dict_pre_hooks.values():
            if getattr(getattr(hook, "hook", hook), "__qualname__", "") != _FSDP2_PRE_LOAD:
                return False
        for hook in m._load_state_dict_post_hooks.values():
            if getattr(hook, "__qualname__", "") != _FSDP2_POST_LOAD:
                return False
    return True


def loaded_in_place(model: torch.nn.Module, values: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
    """Whether loading ``values`` into ``model`` would copy each tensor onto itself: each is the
    tensor of ``live`` (``get_model_state_dict``'s, which the restore read into) under its key and
    holds a parameter's or buffer's bytes, and no module loads in a way of its own."""
    if not all(isinstance(v, torch.Tensor) and live.get(k) is v for k, v in values.items()):
        return False
    own = {dtensor.tensor_key(t) for t in (*model.parameters(), *model.buffers())}
    return all(dtensor.tensor_key(v) in own for v in values.values()) and _plain_loads(model)


def load_model(model: torch.nn.Module, values: dict[str, Any], live: Mapping[str, Any] | None, strict: bool) -> None:
    """``set_model_state_dict(model, values)``, unless :func:`loaded_in_place` says it changes nothing
    (``live``: what ``get_model_state_dict`` gave the restore; None: unknown, always load)."""
    if live is not None and loaded_in_place(model, values, live):
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, values, options=StateDictOptions(strict=strict))


def _plain_optimizer_load(optim: torch.optim.Optimizer, model: torch.nn.Module) -> bool:
    """``optim``'s load is torch's own (no hooks, torch's ``__setstate__``) and no module of ``model`` is
    FSDP1's, whose optimizer state torch converts on load."""
    cls = type(optim)
    if cls.load_state_dict is not _OPTIM_LOAD or getattr(optim, "_optimizer_load_state_dict_pre_hooks", None) \
            or getattr(optim, "_optimizer_load_state_dict_post_hooks", None):
        return False
    if cls.__setstate__ is not _OPTIM_SETSTATE and not cls.__setstate__.__module__.startswith("torch.optim."):
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel
    return not any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _cast_keeps(value: torch.Tensor, param: torch.Tensor, key: Any, special: bool) -> bool:
    """Whether torch's load would keep ``value`` as it is (``Optimizer._process_value_according_to_param_policy``):
    a ``step`` is cast only for a fused or capturable group (``special``), any other tensor to its
    parameter's device and, beside a floating parameter, dtype."""
    if key == "step":
        return not special or (value.dtype == torch.float32 and value.device == param.device)
    return value.device == param.device and (value.dtype == param.dtype or not param.is_floating_point())


def optimizer_loaded_in_place(model: torch.nn.Module, optim: torch.optim.Optimizer, values: Any, live: Any) -> bool:
    """Whether ``set_optimizer_state_dict(model, optim, values)`` would change only ``optim``'s param
    groups' settings (module docstring): ``values``' state tensors are ``live``'s
    (``get_optimizer_state_dict``'s, read into) and the optimizer's own."""
    if not (isinstance(values, Mapping) and isinstance(live, Mapping)
            and set(values) == set(live) == {"state", "param_groups"}):
        return False
    state, groups = values["state"], values["param_groups"]
    live_state, live_groups = live["state"], live["param_groups"]
    if not (isinstance(state, Mapping) and isinstance(groups, list) and isinstance(live_state, Mapping)
            and isinstance(live_groups, list) and len(groups) == len(live_groups) == len(optim.param_groups)
            and state.keys() == live_state.keys()):
        return False
    params: dict[Any, tuple[torch.Tensor, bool]] = {}
    for saved, named, own in zip(groups, live_groups, optim.param_groups, strict=True):
        if not (isinstance(saved, Mapping) and isinstance(named, Mapping) and saved.keys() == named.keys()
                and saved["params"] == named["params"] and len(named["params"]) == len(own["params"])):
            return False
        special = bool(saved.get("fused") or saved.get("capturable"))
        params.update((fqn, (p, special)) for fqn, p in zip(named["params"], own["params"], strict=True))
    if len(params) != sum(len(g["params"]) for g in optim.param_groups) \
            or len(state) != sum(1 for s in optim.state.values() if s):
        return False
    for fqn, per in state.items():
        found, mine = params.get(fqn), live_state[fqn]
        if found is None or not (isinstance(per, Mapping) and isinstance(mine, Mapping) and per.keys() == mine.keys()):
            return False
        param, special = found
        kept = optim.state.get(param)
        if kept is None or len(kept) != len(per):
            return False
        for key, v in per.items():
            if not (v is mine[key] and kept.get(key) is v and isinstance(v, torch.Tensor)
                    and _cast_keeps(v, param, key, special)):
                return False
    return _plain_optimizer_load(optim, model)


def load_optimizer(model: torch.nn.Module, optim: torch.optim.Optimizer, values: Any, live: Any) -> None:
    """``set_optimizer_state_dict(model, optim, values)``, unless :func:`optimizer_loaded_in_place`
    says only the param groups' settings change: those are then set in the live groups, deep copies of
    the loaded values as torch's load makes (``live``: what ``get_optimizer_state_dict`` gave the restore;
    None: unknown, always load)."""
    if live is not None and optimizer_loaded_in_place(model, optim, values, live):
        for group, saved in zip(optim.param_groups, values["param_groups"], strict=True):
            group.update((k, copy.deepcopy(v)) for k, v in saved.items() if k != "params")
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    set_optimizer_state_dict(model, optim, values)


def read_into(state: dict[Any, Any], keys: Iterable[Any], model: torch.nn.Module | None) -> dict[Any, Any]:
    """Each entry of ``state`` under ``keys`` as a restore reads into it: beside a sharded ``model``
    (dtensor.sharded_model_of, FQN mode) the model's and each top-level optimizer's FQN state dict
    (``get_model_state_dict``/``get_optimizer_state_dict``: the live tensors themselves, an optimizer's
    state created first if it had none); any other entry as it is. CheckpointError naming the entry
    whose state dict torch cannot build."""
    out: dict[Any, Any] = {}
    for k in keys:
        v = state[k]
        try:
            if model is not None and v is model:
                out[k] = dtensor.model_state_dict(model)
            elif model is not None and isinstance(v, torch.optim.Optimizer):
                from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
                out[k] = get_optimizer_state_dict(model, v)
            else:
                out[k] = v
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"restore {str(k)!r}: cannot build its state dict: {type(e).__name__}: {e}") from e
    return out
