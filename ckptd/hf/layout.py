"""What an export writes where: canonical names, the shard split, file names, the index, dtypes.

The split is ``huggingface_hub.split_torch_state_dict_into_shards``'s, rule for rule, so an
exported directory is laid out exactly as ``save_torch_state_dict`` would lay out the same
state dict: tensors in key order fill a shard greedily until the next would push it past the
limit; a tensor larger than the limit gets a shard of its own, placed where it is met (before
the shard being filled); ``model-00001-of-0000N.safetensors`` … plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": …}, "weight_map": …}``,
``json.dump(indent=2)``), or a single ``model.safetensors`` and no index when one shard holds all.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ckptd.core.schema import DTYPE_ITEMSIZE

WRAPPER_SEGMENTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Dotted name segments that wrappers (DDP, torch.compile, FSDP1, activation checkpointing) insert."""
FILENAME_PATTERN = "model{suffix}.safetensors"
SINGLE_FILE = FILENAME_PATTERN.format(suffix="")
INDEX_FILE = SINGLE_FILE + ".index.json"
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
EXPORT_DTYPES = ("bfloat16", "float16", "float32")
_SHARD_RE = re.compile(r"^model-([0-9]{5})-of-([0-9]{5})\.safetensors\Z")


def canonical_name(name: str) -> str:
    """A module's parameter name without the segments wrappers add (``module.``, ``_orig_mod.`` …)."""
    parts = [p for p in name.split(".") if p not in WRAPPER_SEGMENTS]
    return ".".join(parts) if parts else name


def load_rename(path: str) -> dict[str, str]:
    """A ``--rename`` file: a JSON object mapping a canonical name to the name to export it under."""
    with open(path, "rb") as f:
        data = f.read(64 * 1024 * 1024 + 1)
    if len(data) > 64 * 1024 * 1024:
        raise ValueError(f"{path}: rename file over 64 MiB")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:        # (RecursionError: nested too deep)
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not (isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, str) and v for k, v in obj.items())):
        raise ValueError(f"{path}: must be a JSON object mapping names to non-empty names")
    return obj


@dataclass(frozen=True)
class OutTensor:
    """One exported tensor: its checkpoint key, exported name, saved and exported dtypes, shape."""
    key: str
    name: str
    src_dtype: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Plan:
    files: dict[str, list[OutTensor]]     # file name → its tensors, in key order
    total_size: int

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    def index_json(self) -> bytes:
        weight_map = {t.name: f for f, ts in self.files.items() for t in ts}
        return json.dumps({"metadata": {"total_size": self.total_size}, "weight_map": weight_map}, indent=2).encode()


def split(tensors: Sequence[OutTensor], max_shard_size: int) -> Plan:
    """huggingface_hub's split (see the module docstring), over tensors in key order."""
    shards: list[list[OutTensor]] = []
    current: list[OutTensor] = []
    current_size = total = 0
    for t in tensors:
        size = t.nbytes
        total += size
        if size > max_shard_size:
            shards.append([t])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(t)
        current_size += size
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return Plan({SINGLE_FILE: shards[0] if shards else []}, total)
    n = len(shards)
    return Plan({FILENAME_PATTERN.format(suffix=f"-{i + 1:05d}-of-{n:05d}"): s for i, s in enumerate(shards)}, total)


def shard_number(name: str) -> tuple[int, int] | None:
    """(i, n) of ``model-0000i-of-0000n.safetensors``, else None."""
    m = _SHARD_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def convert(raw: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Bytes (uint8) of a ``src`` float tensor as ``dst``. To bfloat16: round to nearest even on the
    float32 bits, as torch does (NaN becomes the quiet NaN 0x7fc0); float64 goes through float32."""
    if src == dst:
        return raw
    if src == "bfloat16":
        f32 = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        f32 = raw.view({"float16": np.float16, "float32": np.float32, "float64": np.float64}[src]).astype(np.float32)
    if dst == "float32":
        return f32.view(np.uint8)
    if dst == "float16":
        with np.errstate(over="ignore"):      # out of range becomes inf, as in torch
            return f32.astype(np.float16).view(np.uint8)
    bits = f32.view(np.uint32)
    out = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    out[np.isnan(f32)] = 0x7FC0
    return out.view(np.uint8)
