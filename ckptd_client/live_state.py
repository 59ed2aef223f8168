"""The live state as a restore sees it, and saved state trees as a restore reads them.

A save names every tensor by its key path (``core.tree.encode_tree``: ``model/<fqn>``,
``optim/state/<fqn>/exp_avg``); a restore walks the live state the same way to find, for each
tensor of a saved tree, the live tensor it goes into. Saved trees are read as JSON (their tensor
leaves, their top-level items), and an optimizer state dict saved keyed by parameter index is
re-keyed by the FQNs of a live FQN-keyed one when a plain model's checkpoint restores into a
sharded model. No torch state is touched here but the walk's ``state_dict()`` calls.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckptd.core.tree import join_path

from .errors import CheckpointError
from .state import is_stateful


def live_tensors(values: Mapping[Any, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of ``values`` (top-level key → what it is saved as) by key path, walked the way
    ``core.tree.encode_tree`` walks a save, and the paths of optimizer ``state`` dicts (their
    entries may be missing from a checkpoint: optimizers create state lazily)."""
    found: dict[str, torch.Tensor] = {}
    lazy: list[str] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            found[path] = obj
        elif isinstance(obj, (str, int, float, bool, type(None))):
            return
        elif isinstance(obj, dict):
            if "state" in obj and "param_groups" in obj:
                lazy.append(join_path(path, "state") + "/")
            for k, v in obj.items():
                walk(v, join_path(path, k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, join_path(path, i))
        elif is_stateful(obj):
            walk(obj.state_dict(), path)
        elif isinstance(obj, np.ndarray):
            found[path] = torch.from_numpy(np.ascontiguousarray(obj))

    for k, v in values.items():
        walk(v, join_path("", k))
    return found, lazy


def tensor_leaves(node: Any, path: str, out: list[tuple[str, str]]) -> None:
    """(key path, checkpoint tensor name) of every tensor a saved state tree references."""
    if not (isinstance(node, dict) and len(node) == 1):
        return
    (tag, value), = node.items()
    if tag == "T" and isinstance(value, str):
        out.append((path, value))
    elif tag == "d" and isinstance(value, list):
        for item in value:
            if isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int)):
                tensor_leaves(item[1], join_path(path, item[0]), out)
    elif tag in ("l", "t") and isinstance(value, list):
        for i, v in enumerate(value):
            tensor_leaves(v, join_path(path, i), out)


def tree_items(node: Any) -> list[list[Any]] | None:
    """A saved dict node's ``[key, value]`` items (None when ``node`` is no dict)."""
    if isinstance(node, dict) and len(node) == 1 and isinstance(node.get("d"), list):
        items: list[list[Any]] = [i for i in node["d"] if isinstance(i, list) and len(i) == 2]
        return items
    return None


def _param_lists(optim_node: Any) -> list[list[Any]] | None:
    """A saved optimizer state dict's ``param_groups[i]["params"]`` lists."""
    groups = dict((k, v) for k, v in tree_items(optim_node) or []).get("param_groups")
    if not (isinstance(groups, dict) and isinstance(groups.get("l"), list)):
        return None
    out = []
    for g in groups["l"]:
        params = dict((k, v) for k, v in tree_items(g) or []).get("params")
        if not (isinstance(params, dict) and isinstance(params.get("l"), list)):
            return None
        out.append(params["l"])
    return out


def param_group_sizes(optim_node: Any) -> list[int] | None:
    """How many parameters each param group of a saved optimizer state dict has (None: not one)."""
    lists = _param_lists(optim_node)
    return None if lists is None else [len(ps) for ps in lists]


def fqn_keyed(optim_node: Any) -> bool:
    lists = _param_lists(optim_node)
    return bool(lists) and any(isinstance(p, str) for ps in lists or [] for p in ps)


def rekey_by_position(optim_node: Any, live: Mapping[str, Any], where: str) -> Any:
    """A saved index-keyed optimizer state dict re-keyed by the FQNs of the live FQN-keyed one
    (``live``, ``get_optimizer_state_dict``'s output), matched by position in the param groups."""
    saved_lists = _param_lists(optim_node) or []
    live_lists = [list(g.get("params", [])) for g in live.get("param_groups", [])]
    if [len(x) for x in saved_lists] != [len(x) for x in live_lists]:
        raise CheckpointError(f"restore {where!r}: the checkpoint's optimizer has param groups of "
                              f"{[len(x) for x in saved_lists]} parameters, the live one "
                              f"{[len(x) for x in live_lists]}")
    ids = {i: fqn for saved, fqns in zip(saved_lists, live_lists, strict=True)
           for i, fqn in zip(saved, fqns, strict=True)}

    def rekey_group(g: Any) -> Any:
        return {"d": [[k, {"l": [ids[p] for p in v["l"]]} if k == "params" else v] for k, v in tree_items(g) or []]}

    out = []
    for k, v in tree_items(optim_node) or []:
        if k == "state":
            v = {"d": [[ids.get(i, i), sub] for i, sub in tree_items(v) or []]}
        elif k == "param_groups":
            v = {"l": [rekey_group(g) for g in v["l"]]}
        out.append([k, v])
    return {"d": out}
