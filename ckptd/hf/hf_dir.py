"""Reading a Hugging Face checkpoint directory, every byte of structure validated before use.

Either ``model.safetensors.index.json`` (``{"metadata": …, "weight_map": {name: file}}``) and the
shards it names, or one ``model.safetensors``. The index's file names must be plain names inside
the directory (``names.validate_file_name``: no ``/``, no ``..``); every named shard must exist as a
regular file (no links) with a valid header (``safetensors_io.read_header``); each shard must hold
exactly the tensors the index places in it; no ``model-*-of-N`` shard may be missing from or extra
to the index. Tensor names become ``model/<name>`` key paths and are validated as such.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ckptd.core import storage
from ckptd.core.errors import FormatError
from ckptd.core.names import validate_file_name, validate_tensor_name

from .layout import INDEX_FILE, SINGLE_FILE, shard_number
from .safetensors_io import StTensor, open_regular, read_header

MAX_INDEX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class HfTensor:
    name: str
    file: str
    tensor: StTensor


@dataclass(frozen=True)
class HfDir:
    path: str
    tensors: tuple[HfTensor, ...]      # in the index's order (one file: the file's data order)

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(t.file for t in self.tensors))

    @property
    def total_bytes(self) -> int:
        return sum(t.tensor.nbytes for t in self.tensors)


def _weight_map(path: str) -> dict[str, str]:
    try:
        data = storage.read_limited(path, MAX_INDEX_BYTES)
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: cannot read the index: {e}") from None
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:     # (RecursionError: nested too deep)
        raise FormatError(f"{path}: not valid JSON: {e}") from None
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise FormatError(f"{path}: needs a non-empty 'weight_map' object of tensor name -> file name")
    if "metadata" in obj and not isinstance(obj["metadata"], dict):
        raise FormatError(f"{path}: 'metadata' must be an object")
    return wm


def read_hf_dir(hf_dir: str | os.PathLike[str], prefix: str = "model") -> HfDir:
    """Validate ``hf_dir`` completely (see the module docstring); FormatError names the file and fault."""
    path = os.path.abspath(os.fspath(hf_dir))
    if not os.path.isdir(path):
        raise FormatError(f"{path}: not a directory")
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.lexists(index_path):
        wm = _weight_map(index_path)
    elif os.path.lexists(os.path.join(path, SINGLE_FILE)):
        wm = None
    else:
        raise FormatError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} is there")
    files = list(dict.fromkeys(wm.values())) if wm is not None else [SINGLE_FILE]
    for f in files:
        try:
            validate_file_name(f)
        except ValueError as e:
            raise FormatError(f"{index_path}: {e}") from None
    _check_shard_family(path, files)
    headers: dict[str, dict[str, StTensor]] = {}
    for f in files:
        fpath = os.path.join(path, f)
        if not os.path.lexists(fpath):
            raise FormatError(f"{fpath}: shard named by the index is missing")
        fd = open_regular(fpath)
        try:
            tensors, _ = read_header(fd, fpath)
        finally:
            os.close(fd)
        headers[f] = {t.name: t for t in tensors}
    if wm is None:
        wm = {name: SINGLE_FILE for name in headers[SINGLE_FILE]}
    out = []
    for name, f in wm.items():
        try:
            validate_tensor_name(f"{prefix}/{name}")
        except ValueError as e:
            raise FormatError(f"{index_path}: {e}") from None
        t = headers[f].get(name)
        if t is None:
            raise FormatError(f"{os.path.join(path, f)}: the index places tensor {name!r} here, but the file lacks it")
        out.append(HfTensor(name, f, t))
    for f, held in headers.items():
        extra = [n for n in held if wm.get(n) != f]
        if extra:
            raise FormatError(f"{os.path.join(path, f)}: holds {len(extra)} tensors the index does not place there, "
                              f"e.g. {extra[0]!r}")
    return HfDir(path, tuple(out))


def _check_shard_family(path: str, files: list[str]) -> None:
    """Every ``model-i-of-N`` shard 1..N is named by the index, and no other one lies in the directory."""
    numbered = {f: n for f in files if (n := shard_number(f)) is not None}
    counts = {n for _, n in numbered.values()}
    if len(counts) > 1:
        raise FormatError(f"{path}: the index names shards of different counts {sorted(counts)}")
    if counts:
        total = counts.pop()
        named = {i for i, _ in numbered.values()}
        missing = sorted(set(range(1, total + 1)) - named)
        if missing:
            raise FormatError(f"{path}: the index names no tensor in shard {missing[0]} of {total} "
                              f"(model-{missing[0]:05d}-of-{total:05d}.safetensors)")
        if any(i < 1 or i > total for i in named):
            raise FormatError(f"{path}: the index names a shard numbered outside 1..{total}")
    extra = sorted(f for f in os.listdir(path) if shard_number(f) is not None and f not in numbered)
    if extra:
        raise FormatError(f"{os.path.join(path, extra[0])}: a shard the index does not name (extra or stale shard)")
