"""The plan cache's tree of a save (``ckptd.core.tree``'s encoding) taken again with new scalars:
only the branches holding a changed one are rebuilt, the rest shared (plan_cache.py)."""
from __future__ import annotations

import math
from bisect import bisect_left
from typing import Any


def scalar_counts(node: Any, counts: dict[int, int]) -> int:
    """Scalar leaves under each container node of an encoded tree (by node id), in tree order."""
    if isinstance(node, dict):
        (tag, value), = node.items()
        if tag == "T":
            return 0
        n = sum(scalar_counts(item[1] if tag == "d" else item, counts) for item in value)
        counts[id(node)] = n
        return n
    return 1


def counts_of(tree: Any) -> dict[int, int]:
    counts: dict[int, int] = {}
    scalar_counts(tree, counts)
    return counts


def zeros(scalars: list[Any]) -> list[int]:
    return [i for i, v in enumerate(scalars) if type(v) is float and v == 0.0]


def _same(a: Any, b: Any) -> bool:
    """Equal as saved: -0.0 is not 0.0, NaN is never the same (rebuilt). Types are equal: the
    tokens hold each scalar's type."""
    return a is b or (a == b and not (type(a) is float and a == 0.0 and math.copysign(1, a) != math.copysign(1, b)))


def refill(tree: Any, old: list[Any], zeros: list[int], counts: dict[int, int], scalars: list[Any]) -> Any:
    """``tree`` (built with scalars ``old``; ``zeros``: where those are float zeros; ``counts``:
    scalar_counts of it), or a copy of the branches that hold a scalar changed since (the rest
    shared: the tree is never changed in place, an earlier SAVE may still be encoding it)."""
    if scalars == old and all(_same(scalars[i], old[i]) for i in zeros):
        return tree
    changed = [i for i, (a, b) in enumerate(zip(scalars, old, strict=True)) if not _same(a, b)]
    return _rebuild(tree, 0, changed, scalars, counts)


def _rebuild(node: Any, lo: int, changed: list[int], scalars: list[Any], counts: dict[int, int]) -> Any:
    if not isinstance(node, dict):
        return scalars[lo]
    (tag, value), = node.items()
    if tag == "T":
        return node
    hi = lo + counts[id(node)]
    i = bisect_left(changed, lo)
    if i == len(changed) or changed[i] >= hi:
        return node
    out = []
    for item in value:
        child = item[1] if tag == "d" else item
        n = counts.get(id(child), 0) if isinstance(child, dict) else 1
        new = _rebuild(child, lo, changed, scalars, counts) if n else child
        out.append([item[0], new] if tag == "d" and new is not child else item if tag == "d" else new)
        lo += n
    new_node = {tag: out}
    counts[id(new_node)] = counts[id(node)]
    return new_node
