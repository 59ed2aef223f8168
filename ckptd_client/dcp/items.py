"""DCP write items as one rank's ckptd save: pieces of global tensors, byte items as uint8 pieces.

``check_items`` runs in ``prepare_local_plan`` (before DCP's collectives, so a refusal is raised
on every rank and no rank is left waiting for a commit); ``rank_plan`` runs in ``write_data``
and builds the save's ``Plan`` (the layout ``Checkpointer.save`` copies into a slot), which
``ItemPlans`` hands to the rank's ``Checkpointer`` in place of walking a state dict.

Naming: a piece's entry is named by its FQN (``model.layers.0.weight``), so ``ckptd inspect`` and
``ckptd export`` show DCP's names; a rank's second and later chunks of one FQN are entries
``<fqn>/@<k>`` whose placement ``key`` is the FQN. Every piece has a placement (a plain tensor is
one piece covering its whole global tensor), so the index's tensor map lists every FQN as
``sharded`` with the chunks DCP planned.
"""
from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ckptd.core.names import validate_tensor_name
from ckptd.core.schema import DTYPE_ITEMSIZE, Placement
from ckptd.core.tree import encode_tree

from ..dtensor import local_tensor
from ..errors import CheckpointError
from ..plan_cache import Plan, PlanCache
from ..slots import plan_layout
from ..state import FlatState, dtype_name
from .meta import META_KEY, PIECES_KEY


def check_items(items: Sequence[WriteItem]) -> None:
    """Refuse, naming the FQN, any item ckptd cannot store as it is (before anything is written)."""
    for item in items:
        fqn = item.index.fqn
        try:
            validate_tensor_name(fqn)
        except ValueError as e:
            raise CheckpointError(f"cannot save {fqn!r} through ckptd: {e}; rename the state dict key") from None
        if item.type == WriteItemType.BYTE_IO:
            continue
        if item.tensor_data is None:
            raise CheckpointError(f"cannot save {fqn!r} through ckptd: a tensor write item without tensor data")
        props = item.tensor_data.properties
        if props.layout != torch.strided:
            raise CheckpointError(f"cannot save {fqn!r} through ckptd: {props.layout} tensors are not supported "
                                  "(only dense strided tensors); convert it with .to_dense()")
        if dtype_name(props.dtype) not in DTYPE_ITEMSIZE:
            raise CheckpointError(f"cannot save {fqn!r} through ckptd: dtype {props.dtype} is not supported")


@dataclass(frozen=True)
class RankPlan:
    """One rank's save: the ckptd ``Plan`` and, per write item, its entry name and byte count."""
    plan: Plan
    names: list[str]
    sizes: list[int]


class _Ref:
    """A tensor's place in the state tree (encoded as ``{"T": name}``)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _no_other(path: str, obj: Any) -> Any:
    raise TypeError(f"internal: {type(obj).__name__} at {path!r} in a DCP piece list")


def _resolve_tensor(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    data = planner.resolve_data(item)
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"cannot save {item.index.fqn!r}: the planner resolved a {type(data).__name__} "
                              "for a tensor write item")
    t = local_tensor(data.detach())
    chunk = item.tensor_data.chunk if item.tensor_data is not None else None
    if chunk is not None and tuple(t.shape) != tuple(chunk.sizes):
        raise CheckpointError(f"cannot save {item.index.fqn!r}: the resolved tensor has shape {tuple(t.shape)}, "
                              f"the plan's chunk {tuple(chunk.sizes)}")
    return t


def rank_plan(items: Sequence[WriteItem], planner: SavePlanner, record_tree: Any = None) -> RankPlan:
    """The save of this rank's ``items`` (resolved through ``planner``); ``record_tree``: the
    coordinator's DCP record (meta.py), stored in its state tree."""
    tensors: list[tuple[str, torch.Tensor]] = []
    placements: list[Placement | None] = []
    names: list[str] = []
    sizes: list[int] = []
    seen: dict[str, int] = {}
    pieces: dict[str, Any] = {}
    for item in items:
        fqn = item.index.fqn
        k = seen[fqn] = seen.get(fqn, -1) + 1
        name = fqn if k == 0 else f"{fqn}/@{k}"
        if item.type == WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            placement = Placement((t.numel(),), (0,), None if name == fqn else fqn)
            kind = "bytes"
        else:
            assert item.tensor_data is not None          # check_items refused it otherwise
            t = _resolve_tensor(planner, item)
            placement = Placement(tuple(item.tensor_data.size), tuple(item.tensor_data.chunk.offsets),
                                  None if name == fqn else fqn)
            kind = "tensor"
        tensors.append((name, t))
        placements.append(placement)
        names.append(name)
        sizes.append(t.numel() * t.element_size())
        pieces[name] = [fqn, kind, _Ref(name)]
    entries = [[PIECES_KEY, encode_tree({"pieces": pieces}, lambda _p, r: r.name, _no_other,
                                        lambda o: isinstance(o, _Ref))]]
    if record_tree is not None:
        entries.append([META_KEY, record_tree])
    tree = {"d": entries}                                # the state tree, tagged (ckptd.core.tree)
    layout, nbytes = plan_layout(tensors, placements)
    flat = FlatState(tree, tensors, frozenset(), [], placements, {})
    return RankPlan(Plan(flat, layout, nbytes, [e.to_wire() for e in layout]), names, sizes)


class ItemPlans(PlanCache):
    """A ``Checkpointer``'s plans for DCP saves: ``Checkpointer.save`` asks its ``plans`` for the
    plan of the state it is given; for the marker state of ``use`` this is the prepared plan.
    Order: ``use(plan)`` → ``Checkpointer.save(step, marker)`` (one save at a time)."""

    def __init__(self) -> None:
        super().__init__()
        self.marker: dict[str, Any] = {}
        self._pending: Plan | None = None

    def use(self, plan: Plan) -> dict[str, Any]:
        """The state to pass to ``Checkpointer.save`` so that it saves ``plan``."""
        self._pending = plan
        return self.marker

    def plan(self, state: dict[str, Any], fence_on: Sequence[torch.optim.Optimizer] = (), *,
             lazy: bool = False) -> Plan:
        if state is self.marker:
            if self._pending is None:
                raise CheckpointError("internal: a DCP save without a prepared plan")
            plan, self._pending = self._pending, None
            return plan
        return super().plan(state, fence_on, lazy=lazy)
