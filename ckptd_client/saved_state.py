"""A saved rank's whole state as new objects (no live state to restore into): what a framework's
``load_checkpoint`` returns. The rank's state tree (tagged JSON) gives the structure; every tensor
it names is read whole through ``reshard.read_needs`` (checksummed). Nothing is unpickled.

``escape_keys`` / ``unescape_keys``: dict keys that cannot be a segment of a tensor name (a path
such as Lightning's ``best_k_models`` keys, ``""``, ``"."``, ``".."``) are stored escaped, and any
key starting with ``%`` too, so the mapping is one to one and undone on load.
"""
from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote, unquote

import torch

from ckptd.core.errors import FormatError
from ckptd.core.global_index import LOCAL
from ckptd.core.regions import Region
from ckptd.core.tree import decode_tree

from .errors import CheckpointError
from .load_files import StepFiles
from .reshard import DTYPES, Need, read_needs

_BAD_SEGMENTS = ("", ".", "..")


def _escape(key: str) -> str:
    if key in _BAD_SEGMENTS or key.startswith("%") or "/" in key or "\\" in key or "\x00" in key:
        return "%" + quote(key, safe="")
    return key


def escape_keys(obj: Any) -> Any:
    """``obj`` with every str dict key that cannot name a tensor path segment escaped (a copy of
    the containers; other values as they are)."""
    if isinstance(obj, dict):
        return {(_escape(k) if isinstance(k, str) else k): escape_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [escape_keys(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(escape_keys(v) for v in obj)
    return obj


def unescape_keys(obj: Any) -> Any:
    """What ``escape_keys`` changed, undone (in place for dicts and lists)."""
    if isinstance(obj, dict):
        items = [(unquote(k[1:]) if isinstance(k, str) and k.startswith("%") else k, unescape_keys(v))
                 for k, v in obj.items()]
        obj.clear()
        obj.update(items)
        return obj
    if isinstance(obj, list):
        obj[:] = [unescape_keys(v) for v in obj]
        return obj
    if isinstance(obj, tuple):
        return tuple(unescape_keys(v) for v in obj)
    return obj


def read_state(step_path: str | os.PathLike[str], rank: int = 0, threads: int = 4) -> Any:
    """Saved rank ``rank``'s state from the committed step at ``step_path``, as new objects: dicts,
    lists, tuples, JSON scalars and CPU tensors (a sharded tensor whole). CheckpointError names
    the file or tensor that is missing or corrupt."""
    with StepFiles(os.fspath(step_path)) as files:
        if not 0 <= rank < files.world_size:
            raise CheckpointError(f"rank {rank} is not in {files.path} (world size {files.world_size})")
        if files.tensors is None:
            raise CheckpointError(f"{files.path} is a format-1 step: read it with Checkpointer.restore")
        manifest = files.manifest(rank)
        entries = {e.name: e for e in manifest.tensors}
        tensors = files.tensors
        needs: dict[str, Need] = {}

        def tensor(name: str) -> torch.Tensor:
            if name in needs:
                return needs[name].out
            t = tensors.get(name) if tensors is not None else None   # (checked above)
            if t is None:
                raise CheckpointError(f"{files.path}: the state tree names tensor {name!r}, which the step lacks")
            if t.kind == LOCAL:
                e = entries.get(name)
                if e is None:
                    raise CheckpointError(f"{files.path}: tensor {name!r} has no copy of rank {rank}")
                dtype, shape, source = e.dtype, tuple(e.shape), rank
            else:
                dtype, shape, source = t.dtype, t.shape, None
            need = needs[name] = Need(name, Region.whole(shape), torch.empty(shape, dtype=DTYPES[dtype]), source)
            return need.out

        try:
            state = decode_tree(manifest.tree, tensor)
        except FormatError as e:
            raise CheckpointError(f"{files.path}: rank {rank}'s state tree: {e}") from None
        read_needs(files, list(needs.values()), threads)
    return state
