"""torchtitan's stock DCP checkpoint manager writing and reading through ckptd (needs ``torchtitan``;
nothing else in ckptd_client imports this module).

Switch in a torchtitan config: ``checkpoint=CkptdDcpCheckpointManager.Config(enable=True, job="llama3",
interval=100, async_mode="async", ...)`` instead of ``CheckpointManager.Config(...)``. Everything is
torchtitan's own manager (``dcp.save`` / ``dcp.async_save`` of its flattened states, ``dcp.load``,
the model's ``load_state_dict``) with four changes, each a small override:

- saves pass ``storage_writer=ckptd_client.dcp.StorageWriter`` (one per manager, reused), loads
  ``storage_reader=StorageReader``; a checkpoint's id is its ckptd step directory
  ``<root>/<job>/step-000000000100``, so ``folder`` is unused for training checkpoints;
- the step to resume is the job's newest committed step (index.json present), not a folder scan
  for DCP's ``.metadata``;
- ``keep_latest_k``: rank 0 removes committed steps older than the newest k, index.json first;
- ``async_mode="async_with_pinned_mem"`` saves from a separate process, which cannot share this
  process's ckptd session: refused (use ``"async"``; ckptd's own ``CkptdCheckpointManager`` copies
  into pinned slots and overlaps the copy).

``last_save_in_hf`` and ``initial_load_in_hf`` still go through torchtitan's Hugging Face writer and
reader (files in ``folder``), unchanged.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp

from ckptd.core.names import INDEX_NAME, job_dir, step_dir
from ckptd.core.reader import list_steps

from ..config import CheckpointerConfig
from ..errors import needs_extra
from ..step_choice import newest_in
from .reader import StorageReader
from .writer import StorageWriter

try:
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
except ImportError as e:                # not installed, or not a version with these names
    raise needs_extra(__name__, "torchtitan", "torchtitan", e) from e


class CkptdDcpCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with ckptd as DCP's storage (see the module docstring).
    torchtitan drives it as its own: ``load(step)``, ``save(step, last_step)``,
    ``maybe_wait_for_staging()``, ``maybe_wait_for_saving()``, ``close()``."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        job: str = "torchtitan"
        """ckptd job name: steps live under ``<daemon root>/<job>/``."""
        socket: str | None = None
        """Daemon socket (default: $CKPTD_SOCKET or /run/ckptd/ckptd.sock)."""
        root: str | None = None
        """Checkpoint root, if it is not the daemon's (loads read it without the daemon)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
                raise ValueError("async_mode='async_with_pinned_mem' saves from another process, which cannot "
                                 "use this process's ckptd session: use 'async' (or CkptdCheckpointManager)")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.writer = StorageWriter(config.job, config=CheckpointerConfig(socket=config.socket, root=config.root))
        self.root = self.writer.checkpointer.resolve_root()
        self.reader = StorageReader(config.job, root=self.root)
        self.job = config.job
        # torchtitan's folder (as its __init__ joins it): Hugging Face exports only
        self.hf_folder = os.path.join(kwargs.get("base_folder", ""), config.folder)
        self.folder = job_dir(self.root, config.job)

    # ---- where checkpoints are ---------------------------------------------------------------

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        if folder or not hasattr(self, "root"):
            return super()._create_checkpoint_id(step, folder)
        return step_dir(self.root, self.job, step)

    def _find_load_step(self, folder: str = "") -> int:
        if folder:
            return super()._find_load_step(folder)
        step = newest_in(self.folder)      # (never an older step for one it cannot read: step_choice)
        return step if step is not None else -1

    # ---- saving and loading through ckptd ----------------------------------------------------

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:
            return super().dcp_save(state_dict, os.path.join(self.hf_folder, os.path.basename(checkpoint_id)),
                                    async_mode, enable_garbage_collection, to_hf)
        if async_mode == AsyncMode.ASYNC:
            return dcp.async_save(state_dict, storage_writer=self.writer, checkpoint_id=checkpoint_id,
                                  process_group=self.pg)
        dcp.save(state_dict, storage_writer=self.writer, checkpoint_id=checkpoint_id)
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=self.reader)
        if MODEL in self.states:        # as torchtitan's: the model's states were flattened into state_dict
            self.states[MODEL].load_state_dict(state_dict)

    def _purge_stale_checkpoints(self) -> None:
        """keep_latest_k: rank 0 drops committed steps beyond the newest k (index.json first)."""
        if not self._should_purge():
            return
        committed = [s for s in list_steps(self.folder) if s.committed]
        for s in committed[: -self.keep_latest_k]:
            try:
                os.unlink(os.path.join(s.path, INDEX_NAME))
            except FileNotFoundError:
                continue
            shutil.rmtree(s.path, ignore_errors=True)

    def _close(self) -> None:
        super()._close()
        if hasattr(self, "writer"):
            self.writer.close()
