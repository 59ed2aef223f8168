"""What torch's global registration hooks tell about watched modules, counted: a parameter, module
or buffer set on one through torch's API since a count was read. What no hook reports (``del
m.x``, a direct write into ``m._parameters``, ``.data =``) is for the reader to check otherwise."""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch


class Watch:
    """Counts registrations (a parameter or module set, a buffer added or removed) on watched
    modules, through torch's global registration hooks: a module segment is spliced only while
    the count is the one it was recorded at (plan_defer). A buffer reassigned under its name does
    not count there (buffers are re-read by name every save), but in ``buffers``, which counts
    every buffer set (sharded_sd's signature holds each buffer)."""

    def __init__(self) -> None:
        self.generation = 0
        self.buffers = 0
        self._watched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._hooked = False

    def watch(self, modules: Iterable[torch.nn.Module]) -> None:
        if not self._hooked:
            from torch.nn.modules import module as m
            m.register_module_parameter_registration_hook(self._changed)
            m.register_module_module_registration_hook(self._changed)
            m.register_module_buffer_registration_hook(self._buffer)
            self._hooked = True
        self._watched.update(modules)

    def _changed(self, module: torch.nn.Module, name: str, value: Any) -> None:
        if module in self._watched:
            self.generation += 1

    def _buffer(self, module: torch.nn.Module, name: str, value: Any) -> None:
        if module in self._watched:
            self.buffers += 1
            if value is None or name not in module._buffers:
                self.generation += 1


WATCH = Watch()
