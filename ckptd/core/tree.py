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

_SCALARS = (str, int, float, bool, type(None))


def encode_tree(obj: Any, on_tensor: Callable[[str, Any], str], on_other: Callable[[str, Any], Any],
                is_tensor: Callable[[Any], bool], path: str = "") -> Any:
    """Encode ``obj``; tensors go to ``on_tensor(path, t)`` (returns the stored name), any other
    non-JSON object to ``on_other(path, obj)`` which returns a replacement to encode or raises."""
    if is_tensor(obj):
        return {"T": on_tensor(path, obj)}
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"cannot store dict key {k!r} of type {type(k).__name__} at "
                                f"{path or '<root>'}: keys must be str or int")
            items.append([k, encode_tree(v, on_tensor, on_other, is_tensor, join_path(path, k))])
        return {"d": items}
    if isinstance(obj, (list, tuple)):
        tag = "t" if isinstance(obj, tuple) else "l"
        return {tag: [encode_tree(v, on_tensor, on_other, is_tensor, join_path(path, i)) for i, v in enumerate(obj)]}
    return encode_tree(on_other(path, obj), on_tensor, on_other, is_tensor, path)


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

