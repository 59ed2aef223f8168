"""Reading this rank's shard of a committed step straight from storage (no daemon needed)."""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeGuard

import torch

from ckptd.core.errors import ChecksumError, FormatError
from ckptd.core.reader import StepReader
from ckptd.core.tree import decode_tree

from . import store_keys
from .errors import CheckpointError

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (any dtype, 0-d and empty included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _decodable_into(t: torch.Tensor | None, dtype: str, shape: list[int]) -> TypeGuard[torch.Tensor]:
    return (t is not None and t.device.type == "cpu" and t.dtype == _DTYPES[dtype]
            and list(t.shape) == shape and t.is_contiguous() and not t.is_conj() and not t.is_neg())


def agree_step(store: Any, job: str, n: int, rank: int, step: int | None) -> int | None:
    """All ranks restore rank 0's choice, so a commit racing the listing cannot split them.
    ``n`` numbers the job's restores: each agreement has its own key."""
    key = store_keys.restore_choice(job, n)
    if rank == 0:
        store.set(key, str(-1 if step is None else step))
    value = int(store.get(key).decode())
    return None if value < 0 else value


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
            futures: list[Future[None]] = []
            for entry in manifest.tensors:
                live = (targets or {}).get(entry.name)
                t = live if _decodable_into(live, entry.dtype, entry.shape) else \
                    torch.empty(entry.shape, dtype=_DTYPES[entry.dtype])
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
