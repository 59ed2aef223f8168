"""Reading this rank's shard of a committed step straight from storage (no daemon needed)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckptd.core.errors import ChecksumError
from ckptd.core.errors import FormatError
from ckptd.core.reader import StepReader
from ckptd.core.tree import decode_tree

from .errors import CheckpointError

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (any dtype, 0-d and empty included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _decodable_into(t: torch.Tensor | None, dtype: str, shape: list[int]) -> bool:
    return (t is not None and t.device.type == "cpu" and t.dtype == _DTYPES[dtype]
            and list(t.shape) == shape and t.is_contiguous() and not t.is_conj() and not t.is_neg())


def load_shard(step_path: str, rank: int, world_size: int, threads: int,
               targets: dict[str, torch.Tensor] | None = None) -> Any:
    """Decode this rank's tensors (in parallel) and rebuild its state tree; checksums are verified.

    ``targets``: tensors of the live state by name; a CPU, contiguous one of the saved dtype and
    shape is decoded into directly (already-touched memory, no second copy) — fresh memory
    would cost a page fault per 4 KiB, which dominates decoding on large states."""
    try:
        reader = StepReader(step_path)
        if reader.world_size != world_size:
            raise CheckpointError(f"{step_path} was saved by {reader.world_size} ranks; this job has {world_size} "
                                  "(resharding is not supported yet)")
        manifest = reader.manifest(rank)
    except (FormatError, OSError) as e:
        raise CheckpointError(f"cannot restore from {step_path}: {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    try:
        fd = reader.open_data(rank)
    except FormatError as e:
        raise CheckpointError(f"cannot restore from {step_path}: {e}") from None
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptd-restore") as pool:
            futures = []
            for entry in manifest.tensors:
                t = (targets or {}).get(entry.name)
                if not _decodable_into(t, entry.dtype, entry.shape):
                    t = torch.empty(entry.shape, dtype=_DTYPES[entry.dtype])
                tensors[entry.name] = t
                out = tensor_bytes(t)
                futures += [pool.submit(reader.read_chunk_into, fd, entry, file_pos, raw_pos, meta, out)
                            for file_pos, raw_pos, meta in entry.chunk_spans()]
            for fut in futures:
                fut.result()
    except ChecksumError as e:
        raise CheckpointError(f"corrupt checkpoint: {e}") from None
    finally:
        os.close(fd)
    try:
        return decode_tree(manifest.tree, tensors.__getitem__)
    except (FormatError, KeyError) as e:
        raise CheckpointError(f"{step_path}: bad state tree in rank {rank} manifest: {e}") from None
