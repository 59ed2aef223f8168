"""Shared-memory slots on the trainer side: mapping, pinning, layout, and the copy into them."""
from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from .state import dtype_name

ALIGN = 64


def plan_layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[list[Any]], int]:
    """Slot offsets for each tensor (64-byte aligned) and the bytes the slot must hold."""
    layout, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        layout.append([name, dtype_name(t.dtype), list(t.shape), offset, nbytes])
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


class ClientSlot:
    """A daemon-made memfd mapped into this process; registered as pinned memory under CUDA."""

    def __init__(self, index: int, fd: int, size: int) -> None:
        self.index = index
        self.size = size
        try:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False
        if torch.cuda.is_available():
            self._pin()

    def _pin(self) -> None:
        # cudaHostRegister makes D2H copies into the slot true DMA (non_blocking works).
        rc = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.size, 0)
        self.pinned = int(rc) == 0

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        return self.buffer[offset: offset + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        self.buffer = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it


def copy_into_slot(slot: ClientSlot, layout: list[list[Any]], tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy every tensor into its place; GPU tensors go as non_blocking D2H, then one sync."""
    any_cuda = False
    with torch.no_grad():
        for (name, dtype, shape, offset, nbytes), (_, t) in zip(layout, tensors):
            dst = slot.view(offset, nbytes, t.dtype, shape)
            if t.is_cuda:
                any_cuda = True
                dst.copy_(t.detach(), non_blocking=slot.pinned)
            else:
                dst.copy_(t.detach())
    if any_cuda:
        torch.cuda.synchronize()
