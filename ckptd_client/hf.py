"""Hugging Face safetensors from the training side: export and import (``ckptd.hf``, torch-free,
re-exported here), and ``load_hf``: a live, possibly FSDP2-sharded model loaded straight from a
Hugging Face directory, each rank reading only the slices its shards hold."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ckptd.core.errors import FormatError
from ckptd.core.regions import Region
from ckptd.hf import ExportResult, ImportResult, export_hf, import_hf
from ckptd.hf.hf_dir import read_hf_dir
from ckptd.hf.layout import canonical_name

from .dtensor import is_dtensor, local_region, local_tensor
from .errors import CheckpointError
from .reshard import DTYPES


def load_hf(model: torch.nn.Module, hf_dir: str | os.PathLike[str], *, strict: bool = True,
            rename: Mapping[str, str] | None = None) -> list[str]:
    """Load ``hf_dir`` (``model.safetensors.index.json`` + shards, or one ``model.safetensors``) into
    ``model`` in place. Each parameter and buffer is matched by its canonical name (wrapper prefixes
    such as ``module.`` or ``_orig_mod.`` dropped, then ``rename`` applied); a DTensor (FSDP2, TP)
    reads only the region its local shard holds, through ``safe_open(...).get_slice``, so no rank
    reads or holds the whole model. Values are converted to the live dtype. The directory is
    validated first like ``ckptd import`` does. Returns the names of the directory's tensors the
    model does not have (an error when ``strict``, as are model tensors the directory lacks)."""
    from safetensors import safe_open

    try:
        src = read_hf_dir(hf_dir)
    except FormatError as e:
        raise CheckpointError(f"cannot load {os.fspath(hf_dir)}: {e}") from None
    found = {t.name: t for t in src.tensors}
    live = model.state_dict(keep_vars=True)
    wanted = {(rename or {}).get(canonical_name(k), canonical_name(k)): v for k, v in live.items()}
    missing = [n for n in wanted if n not in found and n not in tied_to_found(wanted, found)]
    unexpected = [n for n in found if n not in wanted]
    if strict and (missing or unexpected):
        raise CheckpointError(f"{src.path} does not match the model: missing {missing[:5]}"
                              f"{' …' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                              f"{' …' if len(unexpected) > 5 else ''}")
    handles: dict[str, Any] = {}
    with torch.no_grad():
        for name, t in wanted.items():
            hf = found.get(name)
            if hf is None:
                continue
            if tuple(t.shape) != hf.tensor.shape:
                raise CheckpointError(f"tensor {name!r}: the model has shape {list(t.shape)}, {hf.file} holds "
                                      f"{list(hf.tensor.shape)} ({hf.tensor.dtype})")
            if DTYPES.get(hf.tensor.dtype) is None:
                raise CheckpointError(f"tensor {name!r}: dtype {hf.tensor.dtype} is not known to this torch")
            f = handles.get(hf.file)
            if f is None:
                f = handles[hf.file] = safe_open(os.path.join(src.path, hf.file), framework="pt")
            region, dst = (local_region(t)[0], local_tensor(t)) if is_dtensor(t) else (Region.whole(t.shape), t)
            if not region.sizes:
                value = f.get_tensor(name)
            else:
                value = f.get_slice(name)[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes,
                                                                                strict=True))]
            dst.copy_(value.reshape(dst.shape))
    return unexpected


def tied_to_found(wanted: Mapping[str, torch.Tensor], found: Mapping[str, Any]) -> set[str]:
    """Names the directory lacks whose live tensor is one it has under another name: tied weights
    (``save_pretrained`` writes a tied ``lm_head.weight`` only as ``embed_tokens.weight``); loading
    the one loads the other."""
    def key(t: torch.Tensor) -> tuple[Any, ...]:
        t = local_tensor(t) if is_dtensor(t) else t
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype
    provided = {key(t) for n, t in wanted.items() if n in found and t.numel()}
    return {n for n, t in wanted.items() if n not in found and t.numel() and key(t) in provided}


__all__ = ["export_hf", "import_hf", "load_hf", "ExportResult", "ImportResult"]
