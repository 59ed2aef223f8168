"""A sharded model's and its optimizers' FQN state dicts on a restore: what it reads into, and the
model's load afterwards, skipped when it would change nothing.

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
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import dtensor
from .errors import CheckpointError

_MODULE_LOAD = torch.nn.Module._load_from_state_dict
_MODULE_SET_EXTRA = torch.nn.Module.set_extra_state
_FSDP2_PRE_LOAD = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"
_FSDP2_POST_LOAD = "FSDPParam.__init__.<locals>.<lambda>"


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


def model_values(state: dict[Any, Any], values: dict[Any, Any], model: torch.nn.Module | None) -> Any:
    """The model's entry of ``read_into``'s ``values`` (its ``get_model_state_dict``), if it has one."""
    return next((values[k] for k in values if model is not None and state[k] is model), None)
