"""DTensors (FSDP2, tensor parallel, 2-D meshes) as ckptd sees them: pieces of global tensors.

A DTensor is saved as its local shard, never gathered: the bytes of ``to_local()`` plus where
they sit in the global tensor (:func:`local_placement`). Replicated mesh dimensions would make
every replica write the same bytes, so only the replica whose coordinate is 0 on each of them
writes (:func:`writes_bytes`). Save and restore both use these functions, so the region a rank
wrote and the region a rank needs are computed the same way.

Optimizer state of a model with DTensor parameters is keyed by parameter FQN, as
``torch.distributed.checkpoint.state_dict.get_state_dict`` does, also when the caller passes the
optimizer object: its own ``state_dict()`` keys state by parameter index, which means nothing
once the parameters are resharded (:func:`sharded_model_of`).
"""
from __future__ import annotations

from typing import Any

import torch

from ckptd.core.regions import Region
from ckptd.core.schema import Placement

try:    # torch.distributed may be built without DTensor support
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def check_saveable(path: str, t: Any) -> None:
    """TypeError naming the key for a DTensor ckptd cannot store (pending reductions)."""
    if any(isinstance(p, Partial) for p in t.placements):
        raise TypeError(f"cannot checkpoint DTensor at {path!r}: it has Partial placements (a pending reduction); "
                        "call .redistribute() to Shard/Replicate first")


def local_region(t: Any) -> tuple[Region, tuple[int, ...]]:
    """(region of the global tensor this rank's ``to_local()`` holds, global shape)."""
    gshape = tuple(t.shape)
    local_shape, offsets = compute_local_shape_and_global_offset(gshape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(local_shape):   # padded or otherwise unusual local tensors
        raise TypeError(f"DTensor local shard has shape {tuple(local.shape)}, its placements say {local_shape}")
    return Region(tuple(int(o) for o in offsets), tuple(int(n) for n in local_shape)), gshape


def local_placement(t: Any) -> Placement:
    region, gshape = local_region(t)
    return Placement(gshape, region.offsets)


def writes_bytes(t: Any) -> bool:
    """Whether this rank is the one replica that writes ``t``'s local bytes: coordinate 0 on every
    mesh dimension where ``t`` is replicated."""
    coords = t.device_mesh.get_coordinate()
    if coords is None:          # this rank is not in the mesh: holds nothing
        return False
    return all(c == 0 for c, p in zip(coords, t.placements, strict=True) if isinstance(p, Replicate))


def has_dtensor_params(model: torch.nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def sharded_model_of(state: dict[str, Any]) -> torch.nn.Module | None:
    """The one module among ``state``'s top-level values whose parameters are DTensors, if there is
    exactly one: optimizers beside it are then saved and restored keyed by its parameter FQNs."""
    models = [v for v in state.values() if isinstance(v, torch.nn.Module) and has_dtensor_params(v)]
    return models[0] if len(models) == 1 else None
