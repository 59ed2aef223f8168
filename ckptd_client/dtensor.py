"""DTensors (FSDP2, tensor parallel, 2-D meshes) as ckptd sees them: pieces of global tensors.

A DTensor is saved as its local shard, never gathered: the bytes of ``to_local()`` plus where
they sit in the global tensor (:func:`local_placement`). Replicated mesh dimensions would make
every replica write the same bytes, so only the replica whose coordinate is 0 on each of them
writes (:func:`writes_bytes`; :func:`writers` adds the replicas implied by a DTensor on a slice
of a larger mesh, as FSDP2 + TP makes of parameters outside the TP plan). Save and restore both
use these functions, so the region a rank wrote and the region a rank needs are computed the
same way.

Optimizer state of a model with DTensor parameters is keyed by parameter FQN, as
``torch.distributed.checkpoint.state_dict.get_state_dict`` does, also when the caller passes the
optimizer object: its own ``state_dict()`` keys state by parameter index, which means nothing
once the parameters are resharded (:func:`sharded_model_of`).

FQN mode, exactly: when :func:`sharded_model_of` finds the one module with DTensor parameters among
the state's top-level values, that module is saved as ``get_model_state_dict(model)`` (for FSDP2
the same FQNs and the same DTensor objects as ``model.state_dict()``) and every top-level
optimizer object as ``get_optimizer_state_dict(model, optim)`` (default options: sharded, not
full), unchanged: ``state`` keyed by parameter FQN, ``param_groups[i]["params"]`` a list of FQNs.
Restore must use the same predicate and load them back with ``set_optimizer_state_dict(model, optim,
loaded)`` and ``set_model_state_dict(model, loaded)`` (FQNs are torch's cleaned ones, without
``_orig_mod.``/``module.`` wrapper prefixes, the same in both dicts). As with torch, the optimizer state of an
optimizer that has never stepped is first initialised by ``get_optimizer_state_dict`` (a step
with zero gradients and lr 0). Models without DTensor parameters (plain, DDP) and state given
as dicts (``get_state_dict``'s output) are saved as they are.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from ckptd.core.regions import Region
from ckptd.core.schema import Placement


class _NoDTensor:
    """``DTensor`` until ``torch.distributed.tensor`` is imported: nothing is one."""


# Bound by _bind once the process has imported torch.distributed.tensor. Importing it here would
# cost every trainer 0.7 s of start-up (a third of ``import ckptd_client``), and no DTensor can
# exist before it is imported: so a tensor that is not of the bound class is asked again
# (``is_dtensor``), which binds them as soon as the module is there.
DTensor: Any = _NoDTensor
Partial: Any = None
Replicate: Any = None
compute_local_shape_and_global_offset: Any = None


def _bind() -> bool:
    global DTensor, Partial, Replicate, compute_local_shape_and_global_offset
    if "torch.distributed.tensor" not in sys.modules:
        return False
    try:
        from torch.distributed.tensor import DTensor as dt
        from torch.distributed.tensor import Partial as partial
        from torch.distributed.tensor import Replicate as replicate
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as local_shape
    except ImportError:  # pragma: no cover - torch built without DTensor support
        return False
    Partial, Replicate, compute_local_shape_and_global_offset = partial, replicate, local_shape
    DTensor = dt            # last: a thread that sees it bound finds the rest bound
    return True


def _ensure() -> None:
    """(Functions given a DTensor) what they use bound, if no ``is_dtensor`` call bound it yet."""
    if DTensor is _NoDTensor:
        _bind()


def is_dtensor(t: Any) -> bool:
    if DTensor is _NoDTensor and not _bind():
        return False
    return isinstance(t, DTensor)


_CACHE_MAX = 4096


def _bounded(cache: dict[Any, Any]) -> dict[Any, Any]:
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    return cache


# placements → whether any is Partial (placements are immutable and hashable; isinstance on
# them is slow enough to matter per tensor)
_PARTIAL: dict[tuple[Any, ...], bool] = {}


def check_saveable(path: str, t: Any) -> None:
    """TypeError naming the key for a DTensor ckptd cannot store (pending reductions)."""
    _ensure()
    placements = tuple(t.placements)
    partial = _PARTIAL.get(placements)
    if partial is None:
        partial = _bounded(_PARTIAL)[placements] = any(isinstance(p, Partial) for p in placements)
    if partial:
        raise TypeError(f"cannot checkpoint DTensor at {path!r}: it has Partial placements (a pending reduction); "
                        "call .redistribute() to Shard/Replicate first")


# (id(mesh), placements, global shape) → (mesh, local shape, region). The mesh is kept and
# compared by identity, so an id reused by another mesh never hits; a rank's coordinate in a
# mesh never changes, so neither does the region a given placement gives it.
_REGIONS: dict[tuple[int, tuple[Any, ...], tuple[int, ...]], tuple[Any, tuple[int, ...], Region]] = {}


def local_region(t: Any) -> tuple[Region, tuple[int, ...]]:
    """(region of the global tensor this rank's ``to_local()`` holds, global shape)."""
    _ensure()
    gshape = tuple(t.shape)
    mesh = t.device_mesh
    placements = tuple(t.placements)
    key = (id(mesh), placements, gshape)
    hit = _REGIONS.get(key)
    if hit is None or hit[0] is not mesh:
        local_shape, offsets = compute_local_shape_and_global_offset(gshape, mesh, placements)
        lshape = tuple(int(n) for n in local_shape)
        if mesh.get_coordinate() is None:    # a rank outside the mesh holds nothing: torch says ((0,), ())
            region = Region((0,) * len(gshape), (0,) * len(gshape))
        else:
            region = Region(tuple(int(o) for o in offsets), lshape)
        hit = (mesh, lshape, region)
        _bounded(_REGIONS)[key] = hit
    _, lshape, region = hit
    local = local_tensor(t)
    if tuple(local.shape) != lshape:   # padded or otherwise unusual local tensors
        raise TypeError(f"DTensor local shard has shape {tuple(local.shape)}, its placements say {lshape}")
    return region, gshape


def local_placement(t: Any) -> Placement:
    region, gshape = local_region(t)
    return Placement(gshape, region.offsets)


# id(mesh) → (mesh, this rank's coordinate in it or None): constant for a mesh's life.
_COORDS: dict[int, tuple[Any, Any]] = {}


def _coordinate(mesh: Any) -> Any:
    hit = _COORDS.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        coords = mesh.get_coordinate()
        hit = (mesh, None if coords is None else tuple(coords))
        _bounded(_COORDS)[id(mesh)] = hit
    return hit[1]


def writes_bytes(t: Any) -> bool:
    """Whether this rank is the one replica that writes ``t``'s local bytes: coordinate 0 on every
    mesh dimension where ``t`` is replicated."""
    _ensure()
    return _writes(_coordinate(t.device_mesh), tuple(t.placements))


def _writes(coords: tuple[int, ...] | None, placements: tuple[Any, ...]) -> bool:
    if coords is None:          # this rank is not in the mesh: holds nothing
        return False
    return all(c == 0 for c, p in zip(coords, placements, strict=True) if isinstance(p, Replicate))


def _root_mesh(mesh: Any) -> Any:
    get = getattr(mesh, "_get_root_mesh", None)     # DeviceMesh's parent of sliced/flattened meshes
    root = get() if callable(get) else None
    return root if root is not None else mesh


def _spanned_dims(mesh: Any, root: Any, coords: Sequence[int]) -> frozenset[int]:
    """The dimensions of ``root`` that ``mesh`` (a slice or flattening of it holding this rank,
    at root coordinates ``coords``) extends along: those where this rank's neighbour is in it."""
    if mesh is root:
        return frozenset(range(root.ndim))
    members = set(mesh.mesh.flatten().tolist())
    grid = root.mesh
    dims = set()
    for j, n in enumerate(grid.shape):
        if n > 1:
            c = list(coords)
            c[j] = (c[j] + 1) % n
            if int(grid[tuple(c)]) in members:
                dims.add(j)
    return frozenset(dims)


def writers(dts: Sequence[Any]) -> list[bool]:
    """For each DTensor of one rank's state, whether this rank writes its local bytes.

    ``writes_bytes`` (replicated dimensions of the DTensor's own mesh), and also: a DTensor on a
    slice of a larger mesh (FSDP2 + TP: a norm weight not in the TP plan lives on ``mesh["dp"]``
    of a ("dp", "tp") mesh) is held the same by the ranks along the root dimensions its slice
    lacks, when some DTensor of the same state is placed along them (the TP parameters span
    "tp"): those dimensions are replicas, and only coordinate 0 on them writes. A root
    dimension that no DTensor of the state spans (pipeline stages: each stage saves its own
    parameters) is not assumed replicated: every slice along it writes. Plain data parallelism
    around DTensors (DDP over TP, no DTensor along "dp") cannot be told apart from stages
    without asking the other ranks, so every data-parallel replica writes there (pieces
    overlap; ``ckptd verify`` reports it)."""
    _ensure()
    meshes = [t.device_mesh for t in dts]
    info: dict[int, tuple[Any, tuple[int, ...], frozenset[int]] | None] = {}
    spanned: dict[int, set[int]] = {}       # id(root) → root dimensions some DTensor spans
    for mesh in meshes:
        if id(mesh) not in info:
            i = info[id(mesh)] = _mesh_info(mesh)
            if i is not None:
                spanned.setdefault(id(i[0]), set()).update(i[2])
    memo: dict[tuple[int, tuple[Any, ...]], bool] = {}    # the meshes are alive: ids are theirs
    out = []
    for mesh, t in zip(meshes, dts, strict=True):
        placements = tuple(t.placements)
        key = (id(mesh), placements)
        w = memo.get(key)
        if w is None:
            i = info[id(mesh)]
            if i is None:
                w = False
            else:
                root, coords, dims = i
                w = _writes(_coordinate(mesh), placements) and all(coords[j] == 0 for j in spanned[id(root)] - dims)
            memo[key] = w
        out.append(w)
    return out


# id(mesh) → (mesh, (root mesh, this rank's root coordinate, root dimensions the mesh spans), or
# None where this rank is not in the mesh): constant for a mesh's life
_MESH_INFO: dict[int, tuple[Any, tuple[Any, tuple[int, ...], frozenset[int]] | None]] = {}


def _mesh_info(mesh: Any) -> tuple[Any, tuple[int, ...], frozenset[int]] | None:
    hit = _MESH_INFO.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        root = _root_mesh(mesh)
        coords = _coordinate(root)
        if coords is None or _coordinate(mesh) is None:
            hit = (mesh, None)
        else:
            hit = (mesh, (root, coords, _spanned_dims(mesh, root, coords)))
        _bounded(_MESH_INFO)[id(mesh)] = hit
    return hit[1]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this rank holds: a DTensor's ``to_local()`` (no copy), else ``t``."""
    if type(t) is DTensor:                 # most calls (per tensor per save): no isinstance, no getattr default
        return t._local_tensor  # type: ignore[attr-defined]
    if is_dtensor(t):
        # what to_local() returns with grad disabled, without its autograd wrapper
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            return local
        with torch.no_grad():
            local = t.to_local()  # type: ignore[attr-defined]
        return local
    return t


def storage_key(t: torch.Tensor) -> int:
    """Where ``t``'s (local) bytes start: equal for a DTensor, its local shard and views of it at
    offset 0, so a tensor found in a state dict is matched to a live parameter or optimizer
    state tensor by this. 0 for tensors without bytes."""
    local = local_tensor(t)
    return local.data_ptr() if local.numel() else 0


_PLAIN = (torch.Tensor, torch.nn.Parameter)      # tensor_key's types that are never DTensors


def tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything that decides which bytes a copy of ``t`` reads: address, shape, strides, dtype,
    device, lazy conj/neg bits; a DTensor's placements, mesh and global shape too. Two tensors
    with equal keys are the same bytes laid out the same way (plan_cache.py, sharded_sd.py)."""
    if type(t) not in _PLAIN and is_dtensor(t):
        return (*tensor_key(local_tensor(t)), tuple(t.placements), id(t.device_mesh),  # type: ignore[attr-defined]
                t.shape)
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t.is_conj(), t.is_neg())


def has_dtensor_params(model: torch.nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def sharded_model_of(state: dict[str, Any]) -> torch.nn.Module | None:
    """The one module among ``state``'s top-level values whose parameters are DTensors, if there is
    exactly one: optimizers beside it are then saved and restored keyed by its parameter FQNs."""
    models = [v for v in state.values() if isinstance(v, torch.nn.Module) and has_dtensor_params(v)]
    return models[0] if len(models) == 1 else None


def model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """FQN mode: what the sharded model is saved as (``get_model_state_dict``, no copies)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model)


def optimizer_state_dict(model: torch.nn.Module, optim: torch.optim.Optimizer, path: str) -> dict[str, Any]:
    """FQN mode: what an optimizer beside the sharded model is saved as
    (``get_optimizer_state_dict``, no copies); refused, naming ``path``, when it holds a
    parameter that is not the model's (its state would have no FQN)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for g in optim.param_groups for p in g["params"]):
        raise ValueError(f"cannot checkpoint optimizer at {path!r}: it holds parameters that are not the "
                         f"sharded model's ({type(model).__name__}), so its state cannot be keyed by FQN; "
                         "save get_optimizer_state_dict(model, optim) output (a dict) instead")
    return get_optimizer_state_dict(model, optim)
