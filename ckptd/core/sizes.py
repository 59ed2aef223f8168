"""Byte sizes as people write them: the one parser the daemon's settings and ``ckptd export`` share;
and the largest tensor a shape read from disk may describe (``sizable``).

Units, case-insensitive: none or ``B`` (bytes); ``K``/``KB``, ``M``/``MB``, ``G``/``GB``,
``T``/``TB`` are decimal (SI: 1000, as huggingface_hub reads ``"5GB"``); ``KiB``, ``MiB``,
``GiB``, ``TiB`` are binary (IEC: 1024). A fraction is allowed (``"1.5GiB"``) and rounded down.
"""
from __future__ import annotations

import math
import re
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")
_HOW = "write bytes or e.g. \"64GiB\", \"512MiB\", \"5GB\""


def parse_size(v: Any, *, minimum: int = 0) -> int:
    """Bytes of an integer or a string like ``"64GiB"``, ``"512 MiB"``, ``"4M"``; ValueError
    below ``minimum``, or for anything else."""
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif isinstance(v, str):
        m = _SIZE_RE.fullmatch(v)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{v!r} is not a size; {_HOW}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{v!r} is not a size; {_HOW}")
    if n < minimum:
        raise ValueError(f"size {v!r} must be at least {minimum} bytes")
    return n


MAX_TENSOR_BYTES = 1 << 62      # a tensor's bytes (its non-zero dimensions'): torch's strides are int64


def sizable(shape: Any, itemsize: int) -> bool:
    """Whether ``shape`` (a list of non-negative ints) is one torch can make: each dimension and the
    bytes of its non-zero dimensions at most ``MAX_TENSOR_BYTES`` (a zero dimension does not make the
    others' strides fit)."""
    return all(d < MAX_TENSOR_BYTES for d in shape) and \
        math.prod(d for d in shape if d) * itemsize <= MAX_TENSOR_BYTES
