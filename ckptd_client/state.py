"""Walking training state: Stateful objects, tensors, JSON leaves; RNG capture; in-place restore."""
from __future__ import annotations

import random
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from ckptd.core.names import validate_tensor_name
from ckptd.core.schema import DTYPE_ITEMSIZE
from ckptd.core.tree import encode_tree

from .errors import CheckpointError


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class FlatState(NamedTuple):
    tree: Any
    tensors: list[tuple[str, torch.Tensor]]
    # Indices of tensors an overlapped save may copy while forward/backward run: module
    # parameters and optimizer state, when the state holds an optimizer whose step() the save
    # fences with a pre-hook (training changes parameters in or after that step, never in
    # forward/backward). Everything else (buffers such as BatchNorm statistics, plain
    # tensors) is copied before save() returns.
    deferrable: frozenset[int]
    optimizers: list[torch.optim.Optimizer]


def flatten_state(state: dict[str, Any]) -> FlatState:
    """The JSON tree of ``state`` and its tensors by key path. Fails before any I/O on a bad value."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of names to values, got {type(state).__name__}")
    tensors: list[tuple[str, torch.Tensor]] = []
    names: set[str] = set()
    stable_ptrs: set[int] = set()
    optimizers: list[torch.optim.Optimizer] = []

    def on_tensor(path: str, t: torch.Tensor) -> str:
        if t.is_sparse or t.is_quantized or t.is_meta or t.layout != torch.strided:
            raise TypeError(f"cannot checkpoint tensor at {path!r}: only dense strided tensors are supported")
        if dtype_name(t.dtype) not in DTYPE_ITEMSIZE:
            raise TypeError(f"cannot checkpoint tensor at {path!r}: dtype {t.dtype} is not supported")
        validate_tensor_name(path)
        if path in names:
            raise ValueError(f"two tensors map to the same name {path!r} (a key containing '/'?)")
        names.add(path)
        tensors.append((path, t))
        return path

    def on_other(path: str, obj: Any) -> Any:
        if is_stateful(obj):
            if isinstance(obj, torch.nn.Module):
                stable_ptrs.update(p.data_ptr() for p in obj.parameters() if p.numel())
            elif isinstance(obj, torch.optim.Optimizer):
                optimizers.append(obj)
                stable_ptrs.update(p.data_ptr() for g in obj.param_groups for p in g["params"] if p.numel())
                stable_ptrs.update(v.data_ptr() for st in obj.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor) and v.numel())
            return obj.state_dict()
        if isinstance(obj, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(obj))
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"cannot checkpoint value at {path or '<root>'!r}: {type(obj).__name__} is neither "
                        "a tensor, a JSON-able value, nor an object with state_dict()/load_state_dict()")

    tree = encode_tree(state, on_tensor, on_other, lambda o: isinstance(o, torch.Tensor))
    # Without an optimizer in the state there is no step to fence on: nothing is deferred.
    deferrable = frozenset(i for i, (_, t) in enumerate(tensors)
                           if optimizers and t.numel() and t.data_ptr() in stable_ptrs)
    return FlatState(tree, tensors, deferrable, optimizers)


def apply_state(target: Any, loaded: Any, path: str = "") -> Any:
    """Load ``loaded`` into ``target`` in place where it can (tensors, Stateful, dicts, lists);
    return what the slot holding ``target`` should now hold."""
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor) or loaded.shape != target.shape:
            got = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else type(loaded).__name__
            raise CheckpointError(f"restore {path!r}: checkpoint has {got}, state has shape {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(loaded)
        return target
    if is_stateful(target):
        target.load_state_dict(loaded)
        return target
    if isinstance(target, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            target[k] = apply_state(target[k], v, f"{path}/{k}") if k in target else v
        return target
    if isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        for i, v in enumerate(loaded):
            target[i] = apply_state(target[i], v, f"{path}/{i}")
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
