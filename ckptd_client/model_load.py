"""Loading a sharded model's state dict at the end of a restore, skipped when it would change nothing.

A restore reads each tensor straight into the live one (restore.py): for a model under FSDP2 or
DTensor TP, the tensors of ``get_model_state_dict(model)``, which are the parameters' and buffers'
own bytes. ``set_model_state_dict`` then copies every tensor onto itself. At 290 FSDP2 parameters
that copy, and the FQN maps torch builds for it, were 92 ms of a 0.70 s restore from memory; at
2,048 modules under one root, 2 s (``Module.load_state_dict`` filters the whole dict for every
child). :func:`load_model` skips it when it provably changes nothing and calls it otherwise:

- every value to load is the very tensor ``get_model_state_dict`` gave the restore for that key,
  and shares its bytes, shape and strides with one of the model's parameters or buffers;
- no module loads in its own way: no ``_load_from_state_dict`` or ``set_extra_state`` of its
  own, no load hooks but FSDP2's (its pre-load hook puts the sharded parameters in place, which
  ``get_model_state_dict`` already did; its post-load hook re-pads a parameter whose local tensor
  was replaced, and none was).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import dtensor

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
