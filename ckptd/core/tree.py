"""The state tree: non-tensor training state as tagged JSON, with tensors referenced by name.

Every container is tagged so Python types survive the round trip:
``{"d": [[key, value], ...]}`` dict (keys str or int), ``{"l": [...]}`` list, ``{"t": [...]}``
tuple, ``{"T": name}`` a tensor stored in the data file; bare JSON scalars are leaves.
Decoding builds only dicts, lists, tuples and scalars: nothing on a load path unpickles.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import FormatError
from .names import MAX_TREE_DEPTH

_SCALARS = (str, int, float, bool, type(None))


def encode_tree(obj: Any, on_tensor: Callable[[str, Any], str], on_other: Callable[[str, Any], Any],
                is_tensor: Callable[[Any], bool], path: str = "", depth: int = 0) -> Any:
    """Encode ``obj``; tensors go to ``on_tensor(path, t)`` (returns the stored name), any other
    non-JSON object to ``on_other(path, obj)`` which returns a replacement to encode or raises.
    ``depth``: the JSON levels above ``obj`` (a dict takes 3, a list or tuple 2, a tensor 1); a
    tree deeper than ``MAX_TREE_DEPTH``, which the daemon and every reader refuse, is a TypeError
    naming where, raised here before anything is written (and before Python's recursion limit)."""
    if is_tensor(obj):
        if depth + 1 > MAX_TREE_DEPTH:
            _too_deep(path)
        return {"T": on_tensor(path, obj)}
    if isinstance(obj, _SCALARS):
        if type(obj) is int and obj.bit_length() > MAX_INT_BITS:
            check_int(path, obj)
        return obj
    if isinstance(obj, dict):
        if depth + 3 > MAX_TREE_DEPTH:
            _too_deep(path)
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"cannot store dict key {k!r} of type {type(k).__name__} at "
                                f"{path or '<root>'}: keys must be str or int")
            items.append([k, encode_tree(v, on_tensor, on_other, is_tensor, join_path(path, k), depth + 3)])
        return {"d": items}
    if isinstance(obj, (list, tuple)):
        if depth + 2 > MAX_TREE_DEPTH:
            _too_deep(path)
        tag = "t" if isinstance(obj, tuple) else "l"
        return {tag: [encode_tree(v, on_tensor, on_other, is_tensor, join_path(path, i), depth + 2)
                      for i, v in enumerate(obj)]}
    return encode_tree(on_other(path, obj), on_tensor, on_other, is_tensor, path, depth)


MAX_INT_BITS = 14_000       # an int JSON can write: Python's default limit is 4,300 decimal digits (14,284 bits)


def check_int(path: str, n: int) -> None:
    """TypeError naming ``path`` for an int too long for the tree's JSON (Python's int-to-str limit)."""
    if n.bit_length() <= MAX_INT_BITS:
        return
    raise TypeError(f"cannot checkpoint the int at {path[:200] or '<root>'!r}: {n.bit_length()} bits, over the "
                    f"{MAX_INT_BITS} bits (about 4,200 digits) the state tree's JSON takes; save it as a string "
                    "(str(n)) or bytes in a uint8 tensor")


def _too_deep(path: str) -> None:
    raise TypeError(f"cannot store the state: it nests too deeply at {path[:200] or '<root>'!r} (at most "
                    f"{MAX_TREE_DEPTH} levels of its JSON encoding: a dict takes 3, a list or tuple 2, "
                    f"so about {(MAX_TREE_DEPTH - 1) // 3} nested dicts); keep deep structures out of the "
                    "saved state, or flatten them")


def decode_tree(node: Any, tensor: Callable[[str], Any]) -> Any:
    if isinstance(node, _SCALARS):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (tag, value), = node.items()
        if tag == "T" and isinstance(value, str):
            return tensor(value)
        if tag == "d" and isinstance(value, list):
            out = {}
            for item in value:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))):
                    raise FormatError("malformed dict entry in state tree")
                out[item[0]] = decode_tree(item[1], tensor)
            return out
        if tag in ("l", "t") and isinstance(value, list):
            items = [decode_tree(v, tensor) for v in value]
            return tuple(items) if tag == "t" else items
    raise FormatError(f"malformed state tree node: {str(node)[:80]}")


def join_path(path: str, key: Any) -> str:
    """A child's key path: how tensors are named on save (and found again on restore)."""
    return f"{path}/{key}" if path else str(key)

