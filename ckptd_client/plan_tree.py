"""The plan cache's tree of a save (``ckptd.core.tree``'s encoding) taken again with new scalars:
only the branches holding a changed one are rebuilt, the rest shared (plan_cache.py).

And the SAVE's size: the tree and the layout travel in one frame (``framing.MAX_FRAME_BYTES``),
which a state holding a large JSON value (a long string) would exceed, failing on the wire with
neither key nor remedy. A plan's encoded size is measured when it is built and kept up to date
by the changed scalars alone (``refill``), so a reused plan costs nothing more; a plan over the
limit is a TypeError naming the largest value, raised before anything is written."""
from __future__ import annotations

import json
import math
from bisect import bisect_left
from collections.abc import Iterator
from json.encoder import encode_basestring_ascii
from typing import Any

from ckptd.core.framing import MAX_FRAME_BYTES
from ckptd.core.tree import MAX_INT_BITS, check_int, join_path

SAVE_FIELDS_BYTES = 1024        # the SAVE's other fields (op, step, slot, commit, level...): less than this


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


def refill(tree: Any, old: list[Any], zeros: list[int], counts: dict[int, int], scalars: list[Any]) -> tuple[Any, int]:
    """``tree`` (built with scalars ``old``; ``zeros``: where those are float zeros; ``counts``:
    scalar_counts of it), or a copy of the branches that hold a scalar changed since (the rest
    shared: the tree is never changed in place, an earlier SAVE may still be encoding it); and by
    how many bytes its encoding grew (the changed scalars' difference)."""
    if scalars == old and all(_same(scalars[i], old[i]) for i in zeros):
        return tree, 0
    changed = [i for i, (a, b) in enumerate(zip(scalars, old, strict=True)) if not _same(a, b)]
    new = _rebuild(tree, 0, changed, scalars, counts)
    if any(type(scalars[i]) is int and scalars[i].bit_length() > MAX_INT_BITS for i in changed):
        for path, leaf in _leaves(new, ""):      # (a cached plan's new scalars meet no encode_tree: named here)
            if type(leaf) is int:
                check_int(path, leaf)
    return new, sum(leaf_bytes(scalars[i]) - leaf_bytes(old[i]) for i in changed)


def _leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every scalar leaf under ``node`` of an encoded tree, with its key path, in tree order."""
    if not isinstance(node, dict):
        yield path, node
        return
    (tag, value), = node.items()
    if tag != "T":
        for i, item in enumerate(value):
            key, child = (item[0], item[1]) if tag == "d" else (i, item)
            yield from _leaves(child, join_path(path, key))


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


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=True)      # as framing.encode does


def leaf_bytes(value: Any) -> int:
    """The bytes of a scalar leaf in the SAVE's JSON (framing.encode's), without encoding the common ones."""
    t = type(value)
    if t is str:
        return len(encode_basestring_ascii(value))
    if t is int or (t is float and math.isfinite(value)):
        return len(repr(value))
    return len(_json(value))        # bool, None, NaN and infinities, int and str subclasses


def save_bytes(tree: Any, wire: list[Any]) -> int:
    """The encoded bytes of a SAVE carrying ``tree`` and the layout ``wire`` (at most; the other fields
    counted as ``SAVE_FIELDS_BYTES``)."""
    return len(_json(tree)) + len(_json(wire)) + SAVE_FIELDS_BYTES


def check_size(tree: Any, wire: list[Any], size: int | None = None) -> int:
    """``size`` (else measured): the SAVE's bytes, or a TypeError naming the largest value when they
    are over the frame limit (re-measured first: ``size`` may be a running count)."""
    if size is None or size > MAX_FRAME_BYTES:
        size = save_bytes(tree, wire)
    if size <= MAX_FRAME_BYTES:
        return size
    path, n = max(((p, leaf_bytes(leaf)) for p, leaf in _leaves(tree, "")), key=lambda pn: pn[1], default=("", 0))
    where = (f"its largest value is at {path or '<root>'!r} ({n:,} bytes encoded)" if n * 4 >= size else
             f"its largest value ({path or '<root>'!r}) takes only {n:,} bytes: the state tree holds many values")
    if len(_json(wire)) * 2 >= size:
        where = f"the layout of its {len(wire):,} tensors takes {len(_json(wire)):,} bytes (their names)"
    raise TypeError(f"cannot checkpoint the state: its JSON part takes {size:,} bytes, over the "
                    f"{MAX_FRAME_BYTES:,}-byte limit of a message to the daemon; {where}. Save large data as "
                    "a tensor (a string s: torch.frombuffer(bytearray(s.encode()), dtype=torch.uint8)) or "
                    "in a file of its own, not as a JSON value")
