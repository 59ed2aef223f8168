"""Everything a restore would write, checked before it writes any of it.

A restore decodes straight into the live tensors (no second copy of the state), and torch's
``load_state_dict`` copies the parameters that match before it raises on those that do not; a
mismatch found halfway would leave the state part old, part new. So both sources (storage:
restore.py; the daemon's memory: memory_restore.py) first gather every problem — an entry or a
tensor of the state the step lacks (unless ``strict=False``), a tensor of another dtype or shape,
tensors of the step a module lacks, an optimizer's param groups of other sizes, a tensor that
cannot be written into (on the meta device, or with elements sharing memory) — and raise them
together, each named, before anything is read into the state.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.core.tree import join_path

from .dtensor import is_dtensor, local_tensor
from .errors import CheckpointError
from .live_state import live_tensors, param_group_sizes, tensor_leaves, tree_items

NAMES_AT_MOST = 8          # names listed in one problem
PROBLEMS_AT_MOST = 12      # problems listed in one error
LENIENT = "pass strict=False to restore only what the step has"

__all__ = ["Check", "Outcome", "check_plain", "listed", "saved_leaves"]


def listed(names: Sequence[str], at_most: int = NAMES_AT_MOST) -> str:
    """``'a', 'b' and 3 more``: a bounded list of names for a message."""
    shown = ", ".join(repr(n) for n in names[:at_most])
    return shown + (f" and {len(names) - at_most} more" if len(names) > at_most else "")


@dataclass(frozen=True)
class Outcome:
    """What a restore loaded and what the step lacked (left as it was; only with ``strict=False``):
    ``restored`` and ``missing`` are top-level keys of the state, ``missing_tensors`` key paths of
    tensors inside the restored entries."""
    restored: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    missing_tensors: tuple[str, ...] = ()


def saved_leaves(subtrees: Mapping[Any, Any]) -> dict[Any, list[tuple[str, str]]]:
    """Top-level key → (key path, checkpoint tensor name) of every tensor its saved subtree holds."""
    out: dict[Any, list[tuple[str, str]]] = {}
    for k, sub in subtrees.items():
        out[k] = []
        tensor_leaves(sub, join_path("", k), out[k])
    return out


class Check:
    """The problems of one restore (``where``: the step, as messages name it), gathered while the
    restore plans its reads; ``finish`` adds the whole-state checks and raises them all."""

    def __init__(self, where: str, strict: bool) -> None:
        self.where, self.strict = where, strict
        self.problems: list[str] = []

    def add(self, problem: str) -> None:
        self.problems.append(problem)

    def tensor(self, path: str, live: torch.Tensor, dtype: str, shape: Sequence[int]) -> None:
        """A plain live tensor against the saved tensor's dtype and shape."""
        live_dtype = str(live.dtype).removeprefix("torch.")
        if live_dtype != dtype:
            self.add(f"tensor {path!r}: the checkpoint has {dtype}, the state {live_dtype}")
        elif tuple(live.shape) != tuple(shape):
            self.add(f"tensor {path!r}: the checkpoint's shape is {list(shape)}, the state's {list(live.shape)}")

    def finish(self, state: Mapping[Any, Any], wanted: Iterable[Any], subtrees: Mapping[Any, Any],
               live: Mapping[str, torch.Tensor], lazy: Sequence[str],
               leaves: Mapping[Any, list[tuple[str, str]]] | None = None) -> Outcome:
        """Raise every problem found, or say what the restore will load. ``wanted``: the keys of
        ``state`` to take from the step; ``subtrees``: the saved subtree of each the step has;
        ``live``/``lazy``: ``live_tensors`` of those entries (as the restore will write them);
        ``leaves``: ``saved_leaves(subtrees)``, where the caller has it."""
        missing = [str(k) for k in wanted if k not in subtrees]
        if leaves is None:
            leaves = saved_leaves(subtrees)
        saved = {path for found in leaves.values() for path, _ in found}
        missing_tensors = [p for p in live if p not in saved and not any(p.startswith(x) for x in lazy)]
        absent = []                   # listed first: the likeliest cause of whatever else does not match
        if self.strict and missing:
            absent.append(f"the step has no {listed(missing)} (entries of the state); {LENIENT}")
        if self.strict and missing_tensors:
            one = len(missing_tensors) == 1
            absent.append(f"tensor{'' if one else 's'} {listed(missing_tensors)} of the state {'is' if one else 'are'}"
                          f" not in the checkpoint; {LENIENT}")
        self.problems[:0] = absent
        if missing_tensors and not self.strict:      # (strict: each is a problem already)
            for path, kind in value_clashes(state, subtrees, set(missing_tensors)):
                self.add(f"tensor {path!r} of the state is {kind} in the checkpoint: the restore cannot leave it "
                         "as it is nor load the value into it; give the state the checkpoint's value there, or "
                         "leave that entry out of the state")
        for p in [p for p in live if p in saved]:       # (in the state's order)
            problem = unwritable(live[p])
            if problem is not None:
                self.add(f"tensor {p!r} {problem}")
        for k, sub in subtrees.items():
            target = state[k]
            if isinstance(target, torch.nn.Module) and self.strict:
                extra = [p for p, _ in leaves[k] if p not in live]
                if extra:
                    self.add(f"tensors {listed(extra)} of the checkpoint are not in the state's module {str(k)!r} "
                             f"(another model?); {LENIENT}")
            elif isinstance(target, torch.optim.Optimizer):
                have, got = [len(g["params"]) for g in target.param_groups], param_group_sizes(sub)
                if got is not None and got != have:
                    self.add(f"optimizer {str(k)!r}: the checkpoint has param groups of {got} parameters, the "
                             f"state's {have}")
        if self.problems:
            shown, more = self.problems[:PROBLEMS_AT_MOST], len(self.problems) - PROBLEMS_AT_MOST
            raise CheckpointError(f"cannot restore {self.where}; nothing in the state was changed:\n  "
                                  + "\n  ".join(shown) + (f"\n  and {more} more problems" if more > 0 else ""))
        return Outcome(tuple(str(k) for k in subtrees), tuple(missing), tuple(missing_tensors))


def value_clashes(state: Mapping[Any, Any], subtrees: Mapping[Any, Any], paths: set[str]) -> list[tuple[str, str]]:
    """(key path, what the step holds there) of each live tensor in ``paths`` (ones the step has no
    tensor for) where the step holds a value or container instead, reached through the plain dicts
    and lists the restore walks into (state.apply_state, which would raise there halfway through;
    modules, optimizers and Stateful objects load their own way)."""
    out: list[tuple[str, str]] = []

    def walk(live: Any, node: Any, path: str) -> None:
        if isinstance(live, torch.Tensor):
            if path in paths and not (isinstance(node, dict) and set(node) == {"T"}):
                out.append((path, _kind(node)))
        elif isinstance(live, dict) and (items := tree_items(node)) is not None:
            saved = {key: sub for key, sub in items if isinstance(key, (str, int))}
            for k, v in live.items():
                if k in saved:
                    walk(v, saved[k], join_path(path, k))
        elif isinstance(live, list) and isinstance(node, dict) and isinstance(node.get("l"), list) \
                and len(node["l"]) == len(live):
            for i, v in enumerate(live):
                walk(v, node["l"][i], join_path(path, i))

    for k, sub in subtrees.items():
        walk(state[k], sub, join_path("", k))
    return out


def _kind(node: Any) -> str:
    if isinstance(node, dict) and len(node) == 1:
        return {"d": "a dict", "l": "a list", "t": "a tuple"}.get(next(iter(node)), "a value")
    return {bool: "a bool", int: "an int", float: "a float", str: "a string"}.get(type(node), "None")


def unwritable(t: torch.Tensor) -> str | None:
    """Why a restore cannot write the saved bytes into live tensor ``t`` (a DTensor: its local shard),
    or None. A meta tensor has no memory (every copy into it is a no-op: the restore would report it
    restored); one with a stride of 0 over a dimension of 2 or more (``expand``) has elements that
    share memory (a copy into it raises halfway through the restore)."""
    if is_dtensor(t):
        t = local_tensor(t)
    if t.is_meta:
        return "is on the meta device: materialize the state first (module.to_empty(device=...), then restore)"
    stride = t.stride()
    if 0 in stride and any(st == 0 and n > 1 for st, n in zip(stride, t.shape, strict=True)):
        return ("has elements that share memory (a stride of 0, as expand() makes): give the state a tensor "
                "of its own (.clone()) to restore into")
    return None


def check_plain(state: Mapping[Any, Any], items: Sequence[Sequence[Any]], saved: Callable[[str], Any],
                where: str, strict: bool,
                walked: tuple[dict[str, torch.Tensor], list[str], dict[Any, list[tuple[str, str]]]] | None = None,
                ) -> tuple[dict[Any, Any], Outcome]:
    """A restore of this rank's own saved tree into plain tensors (the memory tier, format-1 steps):
    the saved subtree of each entry of ``state`` the tree's ``items`` have, and the Outcome, once
    every tensor is checked. ``saved(name)``: the saved tensor's ``.dtype`` and ``.shape`` holder,
    or None (not checked here: the caller says what a name without one means). ``walked``: the
    caller's ``live_tensors`` and ``saved_leaves`` of those entries, not walked again here."""
    have = {key: sub for key, sub in items}
    subtrees = {k: have[k] for k in state if k in have}
    check = Check(where, strict)
    if walked is None:
        live, lazy = live_tensors({k: state[k] for k in subtrees})
        leaves = saved_leaves(subtrees)
    else:
        live, lazy, leaves = walked
    for found in leaves.values():
        for path, name in found:
            t, meta = live.get(path), saved(name)
            if t is not None and meta is not None:
                check.tensor(path, t, meta.dtype, meta.shape)
    return subtrees, check.finish(state, list(state), subtrees, live, lazy, leaves)
