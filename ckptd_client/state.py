"""Walking training state: Stateful objects, tensors, JSON leaves; RNG capture; in-place restore."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from ckptd.core.names import validate_tensor_name
from ckptd.core.schema import DTYPE_ITEMSIZE, MAX_DIMS, Placement
from ckptd.core.tree import encode_tree

from . import dtensor
from .errors import CheckpointError


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class FlatState(NamedTuple):
    tree: Any
    # The tensors whose bytes this rank writes, by name (the key path): plain tensors as they
    # are, DTensors as their local shard (``to_local()``, a view, no copy). A DTensor that is
    # replicated on a mesh dimension is written by one replica only (dtensor.writers);
    # on the others it is in ``sharded`` and the tree, not here.
    tensors: list[tuple[str, torch.Tensor]]
    # Indices of tensors an overlapped save may copy while forward/backward run: module
    # parameters and optimizer state, when the state holds an optimizer (or the save was given
    # ``fence_on`` optimizers) whose step() the save fences with a pre-hook (training changes
    # parameters in or after that step, never in forward/backward). A tensor found in a dict
    # counts when it shares its storage (dtensor.storage_key) with a parameter or state tensor
    # of one of those optimizers, or a parameter of a module in the state. Everything else
    # (buffers such as BatchNorm statistics, plain tensors) is copied before save() returns.
    deferrable: frozenset[int]
    optimizers: list[torch.optim.Optimizer]
    # Per entry of ``tensors``: where a DTensor's local shard sits in its global tensor (sent as
    # the layout entry's placement); None for a plain tensor.
    placements: list[Placement | None]
    # Every DTensor of the state by name, whether this rank writes its bytes or not.
    sharded: dict[str, Any]


def _check_dense(path: str, t: torch.Tensor) -> None:
    """TypeError naming ``path`` for a tensor whose bytes ckptd cannot store as they are."""
    if t.is_nested:         # first: a strided nested tensor raises on sizes, layout and more
        raise TypeError(f"cannot checkpoint tensor at {path!r}: nested tensors are not supported")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"cannot checkpoint tensor at {path!r}: sparse tensors ({t.layout}) are not supported; "
                        "only dense strided tensors are")
    if t.is_quantized:
        raise TypeError(f"cannot checkpoint tensor at {path!r}: quantized tensors are not supported")
    if t.is_meta:
        raise TypeError(f"cannot checkpoint tensor at {path!r}: it is on the meta device (it has no data)")
    if dtype_name(t.dtype) not in DTYPE_ITEMSIZE:
        raise TypeError(f"cannot checkpoint tensor at {path!r}: dtype {t.dtype} is not supported")
    if t.dim() > MAX_DIMS:
        raise TypeError(f"cannot checkpoint tensor at {path!r}: it has {t.dim()} dimensions, over ckptd's limit of "
                        f"{MAX_DIMS} (FORMAT.md); reshape it before saving")


def replacement(obj: Any, path: str, sharded_model: torch.nn.Module | None, top_optimizers: set[int]) -> Any:
    """What a non-JSON, non-tensor value is saved as (its state dict; a NumPy value as a tensor or
    scalar, restored as NumPy again: ``apply_state``), or a TypeError naming ``path``. The plan
    cache's walk calls it too: one definition."""
    if is_stateful(obj):
        if isinstance(obj, torch.nn.Module):
            return dtensor.model_state_dict(obj) if obj is sharded_model else obj.state_dict()
        if isinstance(obj, torch.optim.Optimizer):
            return (dtensor.optimizer_state_dict(sharded_model, obj, path)
                    if sharded_model is not None and id(obj) in top_optimizers else obj.state_dict())
        return obj.state_dict()
    if isinstance(obj, np.ndarray):
        return _numpy_tensor(obj, path)
    if isinstance(obj, np.generic):
        value = obj.item()
        if isinstance(value, np.generic):       # no Python equivalent (np.longdouble): .item() gives it back
            raise TypeError(f"cannot checkpoint value at {path or '<root>'!r}: a NumPy {obj.dtype} scalar has no "
                            "Python equivalent to save it as; convert it first (float(x), or np.float64(x))")
        return value
    if isinstance(obj, torch.Generator):      # no state_dict(): its state is a tensor it hands out
        raise TypeError(f"cannot checkpoint value at {path or '<root>'!r}: a torch.Generator is not saved "
                        "as it is; save its state, a tensor: {..., 'gen': gen.get_state()}, and after "
                        "restore call gen.set_state(state['gen']) (the global RNGs: ckptd_client.RNGState())")
    raise TypeError(f"cannot checkpoint value at {path or '<root>'!r}: {type(obj).__name__} is neither "
                    "a tensor, a JSON-able value, nor an object with state_dict()/load_state_dict()")


def _numpy_tensor(arr: np.ndarray[Any, Any], path: str) -> torch.Tensor:
    """A NumPy array as the tensor it is saved as (a view where it is contiguous), or a TypeError naming
    ``path`` for one torch cannot hold (object, str, bytes, datetime, structured, longdouble, non-native
    byte order)."""
    if not arr.dtype.isnative:
        raise TypeError(f"cannot checkpoint NumPy array at {path or '<root>'!r}: its dtype {arr.dtype.str} is not "
                        "in this machine's byte order; convert it first: arr.astype(arr.dtype.newbyteorder('='))")
    try:
        return torch.from_numpy(np.ascontiguousarray(arr))
    except (TypeError, ValueError):
        raise TypeError(f"cannot checkpoint NumPy array at {path or '<root>'!r}: dtype {arr.dtype} has no torch "
                        "equivalent; only arrays of numbers (bool, int, uint, float16/32/64, complex64/128) are "
                        "saved as arrays: convert it (arr.astype(...)), or save it as JSON (arr.tolist())") from None


def packed_groups(opt: torch.optim.Optimizer, params: Sequence[Any]) -> list[dict[str, Any]]:
    """``opt``'s param groups as its state dict packs them (the values as they are now, ``params``
    last) with ``params[i]`` as group i's parameter list: a state dict taken earlier has those
    (indices, or FQNs), and they stand while the groups hold the same parameters."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": p}
            for g, p in zip(opt.param_groups, params, strict=True)]


def top_optimizer_ids(state: dict[str, Any]) -> set[int]:
    return {id(v) for v in state.values() if isinstance(v, torch.optim.Optimizer)}


def flatten_state(state: dict[str, Any], fence_on: Sequence[torch.optim.Optimizer] = (),
                  taken: dict[int, Any] | None = None) -> FlatState:
    """The JSON tree of ``state`` and its tensors by key path. Fails before any I/O on a bad value.

    ``fence_on``: optimizers whose step the save fences although they need not be in ``state``
    (dict-style state, e.g. ``get_state_dict``'s output): tensors sharing storage with their
    parameters or state become deferrable. DTensors: see ``ckptd_client.dtensor`` (local shards,
    one writer per replicated placement, optimizer objects keyed by FQN beside a sharded model).
    ``taken``: id(object) → what ``replacement`` already returned for it this save (the plan
    cache's walk), so no state_dict() is taken twice.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of names to values, got {type(state).__name__}")
    for opt in fence_on:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"fence_on takes optimizers, got {type(opt).__name__}")
    # (name, bytes to write, placement, the DTensor or None) in walk order; who writes which
    # DTensor is decided once all of them are known (dtensor.writers)
    found: list[tuple[str, torch.Tensor, Placement | None, Any]] = []
    names: set[str] = set()
    stable: set[int] = set()
    optimizers: list[torch.optim.Optimizer] = []
    sharded_model = dtensor.sharded_model_of(state)
    top_optimizers = top_optimizer_ids(state)
    taken = taken or {}

    def add_optimizer(opt: torch.optim.Optimizer) -> None:
        if all(o is not opt for o in optimizers):
            optimizers.append(opt)
        stable.update(dtensor.storage_key(p) for g in opt.param_groups for p in g["params"])
        stable.update(dtensor.storage_key(v) for st in opt.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor))

    def claim(path: str) -> str:
        validate_tensor_name(path)
        if path in names:
            raise ValueError(f"two tensors map to the same name {path!r} (a key containing '/', or an int key "
                             "and a str key of the same text?): rename one of the keys")
        names.add(path)
        return path

    def on_tensor(path: str, t: torch.Tensor) -> str:
        if dtensor.is_dtensor(t):
            dtensor.check_saveable(path, t)
            local = dtensor.local_tensor(t)
            _check_dense(path, local)
            try:
                placement = dtensor.local_placement(t)
            except TypeError as e:
                raise TypeError(f"cannot checkpoint DTensor at {path!r}: {e}") from None
            found.append((claim(path), local, placement, t))
            return path
        _check_dense(path, t)
        found.append((claim(path), t.detach() if t.requires_grad else t, None, None))   # (a module's keep_vars)
        return path

    def on_other(path: str, obj: Any) -> Any:
        sd = taken[id(obj)] if id(obj) in taken else replacement(obj, path, sharded_model, top_optimizers)
        if isinstance(obj, torch.optim.Optimizer):
            add_optimizer(obj)        # after: get_optimizer_state_dict may create the state
        return sd

    tree = encode_tree(state, on_tensor, on_other, lambda o: isinstance(o, torch.Tensor))
    sharded = {name: dt for name, _, _, dt in found if dt is not None}
    writes = iter(dtensor.writers(list(sharded.values())))
    tensors: list[tuple[str, torch.Tensor]] = []
    placements: list[Placement | None] = []
    for name, t, placement, dt in found:
        if dt is None or next(writes):
            tensors.append((name, t))
            placements.append(placement)
    for opt in fence_on:
        add_optimizer(opt)
    stable.discard(0)
    # Without an optimizer whose step is fenced there is nothing to fence on: nothing is deferred. Only what
    # the fence guards is: a fenced optimizer's parameters and state. A module's other parameters (an EMA
    # model, frozen layers) may change when no step runs (an AMP scaler skips one, then the EMA updates).
    deferrable = frozenset(i for i, (_, t) in enumerate(tensors)
                           if optimizers and t.numel() and t.data_ptr() in stable)
    return FlatState(tree, tensors, deferrable, optimizers, placements, sharded)


def apply_state(target: Any, loaded: Any, path: str = "", strict: bool = True) -> Any:
    """Load ``loaded`` into ``target`` in place where it can (tensors, Stateful, dicts, lists);
    return what the slot holding ``target`` should now hold. ``strict``: a module's (torch's
    ``load_state_dict(strict=)``: False leaves the parameters ``loaded`` lacks as they are)."""
    if loaded is target:               # read in place already (a memory restore): nothing to copy
        return target
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor) or loaded.shape != target.shape:
            got = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else type(loaded).__name__
            raise CheckpointError(f"restore {path!r}: checkpoint has {got}, state has shape {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(loaded)
        return target
    if isinstance(target, np.ndarray) and isinstance(loaded, torch.Tensor):
        # Saved as a tensor (``replacement``); back into the array itself, as NumPy (a contiguous one
        # was read in place: the tensor is a view of it).
        arr = loaded.detach().cpu().numpy()
        if arr.shape != target.shape or arr.dtype != target.dtype:
            raise CheckpointError(f"restore {path!r}: checkpoint has {arr.dtype} {arr.shape}, state has "
                                  f"{target.dtype} {target.shape}")
        if not np.may_share_memory(arr, target):     # (read in place: the same bytes)
            np.copyto(target, arr, casting="no")
        return target
    if isinstance(target, np.generic) and isinstance(loaded, (bool, int, float, complex)):
        return type(target)(loaded)   # saved as its .item(): the same NumPy scalar type again
    if isinstance(target, torch.nn.Module):
        target.load_state_dict(loaded, strict=strict)
        return target
    if is_stateful(target):
        target.load_state_dict(loaded)
        return target
    if isinstance(target, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            target[k] = apply_state(target[k], v, f"{path}/{k}", strict) if k in target else v
        return target
    if isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        for i, v in enumerate(loaded):
            target[i] = apply_state(target[i], v, f"{path}/{i}", strict)
        return target
    return loaded


class RNGState:
    """Python ``random``, NumPy's global RNG, torch's CPU generator and every CUDA generator."""

    def state_dict(self) -> dict[str, Any]:
        legacy = cast("tuple[str, np.ndarray[Any, Any], int, int, float]", np.random.get_state(legacy=True))
        name, keys, pos, has_gauss, cached = legacy
        sd: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        version, internal, gauss = sd["python"]
        random.setstate((version, tuple(internal), gauss))
        n = sd["numpy"]
        np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        torch.set_rng_state(sd["torch"])
        cuda = sd.get("cuda") or []
        if cuda:
            if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda):
                raise CheckpointError(f"checkpoint has RNG state for {len(cuda)} CUDA devices, this process "
                                      f"sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
            torch.cuda.set_rng_state_all(cuda)
