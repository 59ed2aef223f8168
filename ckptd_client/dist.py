"""What this process's torch.distributed says about the job: its rank, world size and store.

The ``Checkpointer`` defaults its rank and world size from here and relays through the default
group's c10d store; it is apart from relay.py because it reads torch.distributed, not the store.
"""
from __future__ import annotations

from typing import Any


def dist_info() -> tuple[int, int, Any]:
    """(rank, world size, the default group's store or None) of this process's torch.distributed."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        store = None
        try:
            from torch.distributed.distributed_c10d import _get_default_store
            store = _get_default_store()
        except Exception:
            pass
        return dist.get_rank(), dist.get_world_size(), store
    return 0, 1, None
