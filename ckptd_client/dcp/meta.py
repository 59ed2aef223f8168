"""DCP's ``Metadata`` without pickle: rebuilt from ckptd's tensor map plus a small JSON record.

What DCP's ``.metadata`` file holds, and where a ckptd step keeps it:

- ``state_dict_metadata``: every tensor's dtype, global size and chunks is the index's tensor map
  (each chunk is one piece's region); an FQN listed in the record's ``bytes`` is a byte item
  (``BytesStorageMetadata``), stored as a 1-D uint8 piece.
- ``properties`` beyond the dtype: the FQNs whose tensors had ``requires_grad`` or pinned memory
  (the layout is always strided, the memory format contiguous: anything else is refused on save).
- ``planner_data`` (DefaultSavePlanner's flattening map: FQN → its path of keys), ``storage_meta``
  and ``version``: in the record, as ckptd's tagged JSON state tree (tuples stay tuples).
- ``storage_data``: not stored; the reader finds every chunk through the tensor map.

The record is the entry ``dcp_meta`` of the coordinator's state tree (rank 0 with DCP's
default coordinator), written in the same save as its tensors, so it commits with the step.
"""
from __future__ import annotations

from collections import ChainMap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ckptd.core.errors import FormatError
from ckptd.core.global_index import GlobalTensor
from ckptd.core.tree import decode_tree, encode_tree

from ..errors import CheckpointError
from ..reshard import DTYPES

META_KEY = "dcp_meta"
"""The coordinator's state-tree entry holding the record."""
PIECES_KEY = "dcp"
"""Each rank's state-tree entry listing its pieces (FQN and kind by entry name)."""
FORMAT = 1


def _refuse(path: str, obj: Any) -> Any:
    raise TypeError(f"DCP metadata value at {path or '<root>'!r} is a {type(obj).__name__}: ckptd stores "
                    "metadata as JSON (str, int, float, bool, None, lists, tuples, dicts), never pickled")


def to_tree(obj: Any) -> Any:
    """``obj`` as a tagged JSON tree; a value JSON cannot hold is a TypeError naming its key path."""
    return encode_tree(obj, lambda p, t: _refuse(p, t), _refuse, lambda o: False)


@dataclass(frozen=True)
class DcpRecord:
    """The part of DCP's ``Metadata`` that ckptd's tensor map does not hold (module docstring)."""
    byte_items: tuple[str, ...]
    requires_grad: tuple[str, ...]
    pinned: tuple[str, ...]
    planner_data: Any
    checkpoint_id: str | None
    save_id: str | None
    modules: tuple[str, ...]
    version: str | None

    @classmethod
    def of_plans(cls, plans: Sequence[SavePlan], storage_meta: StorageMeta | None,
                 version: str | None = None) -> DcpRecord:
        """The coordinator's record of a save from every rank's plan (``prepare_global_plan``)."""
        byte_items, grad, pinned = set(), set(), set()
        for plan in plans:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    byte_items.add(item.index.fqn)
                elif item.tensor_data is not None:
                    if item.tensor_data.properties.requires_grad:
                        grad.add(item.index.fqn)
                    if item.tensor_data.properties.pin_memory:
                        pinned.add(item.index.fqn)
        data = [p.planner_data for p in plans if p.planner_data is not None]
        if any(not isinstance(d, dict) for d in data):
            bad = next(type(d).__name__ for d in data if not isinstance(d, dict))
            raise CheckpointError(f"cannot save through ckptd: the planner's planner_data is a {bad}; ckptd "
                                  "keeps a dict of JSON values (DefaultSavePlanner's), never a pickle")
        merged = dict(ChainMap(*data)) if data else None
        sm = storage_meta
        return cls(tuple(sorted(byte_items)), tuple(sorted(grad)), tuple(sorted(pinned)), merged,
                   None if sm is None or sm.checkpoint_id is None else str(sm.checkpoint_id),
                   None if sm is None else sm.save_id, tuple(sm.modules) if sm is not None else (), version)

    def to_tree(self) -> Any:
        """The record as the tagged JSON tree it is stored as; TypeError names a value JSON cannot hold."""
        try:
            return to_tree({"format": FORMAT, "bytes": list(self.byte_items),
                            "requires_grad": list(self.requires_grad), "pinned": list(self.pinned),
                            "planner_data": self.planner_data, "checkpoint_id": self.checkpoint_id,
                            "save_id": self.save_id, "modules": list(self.modules), "version": self.version})
        except TypeError as e:
            raise CheckpointError(f"cannot save through ckptd: {e}") from None

    @classmethod
    def from_tree(cls, node: Any, where: str) -> DcpRecord:
        """Parse a stored record, refusing anything no writer produces (naming ``where``)."""
        try:
            obj = decode_tree(node, lambda name: _refuse(name, None))
        except (FormatError, TypeError) as e:
            raise CheckpointError(f"{where}: malformed DCP record: {e}") from None

        def strs(key: str) -> tuple[str, ...]:
            v = obj.get(key)
            if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
                raise CheckpointError(f"{where}: DCP record field {key!r} is not a list of strings")
            return tuple(v)

        def opt(key: str) -> str | None:
            v = obj.get(key)
            if v is not None and not isinstance(v, str):
                raise CheckpointError(f"{where}: DCP record field {key!r} is not a string")
            return v

        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise CheckpointError(f"{where}: DCP record of an unknown format "
                                  f"{obj.get('format') if isinstance(obj, dict) else type(obj).__name__!r}")
        planner_data = obj.get("planner_data")
        if planner_data is not None and not isinstance(planner_data, dict):
            raise CheckpointError(f"{where}: DCP record field 'planner_data' is not a dict")
        return cls(strs("bytes"), strs("requires_grad"), strs("pinned"), planner_data, opt("checkpoint_id"),
                   opt("save_id"), strs("modules"), opt("version"))

    def metadata(self, tensors: dict[str, GlobalTensor], where: str) -> Metadata:
        """DCP's ``Metadata`` of the step whose tensor map is ``tensors``."""
        sd: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        missing = [f for f in self.byte_items if f not in tensors]
        if missing:
            raise CheckpointError(f"{where}: byte items {missing[:5]} are in the DCP record but not in the step")
        byte_items, grad, pinned = set(self.byte_items), set(self.requires_grad), set(self.pinned)
        for fqn, t in tensors.items():
            if fqn in byte_items:
                sd[fqn] = BytesStorageMetadata()
                continue
            dtype = DTYPES.get(t.dtype)
            if dtype is None:
                raise CheckpointError(f"{where}: tensor {fqn!r} has dtype {t.dtype}, which this torch lacks")
            regions = sorted({p.region for p in t.pieces}, key=lambda r: r.offsets)
            chunks = [ChunkStorageMetadata(torch.Size(r.offsets), torch.Size(r.sizes)) for r in regions]
            props = TensorProperties(dtype=dtype, requires_grad=fqn in grad, pin_memory=fqn in pinned)
            sd[fqn] = TensorStorageMetadata(props, torch.Size(t.shape), chunks)
        storage_meta = StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id, modules=list(self.modules))
        return Metadata(sd, planner_data=self.planner_data, storage_meta=storage_meta, version=self.version)
