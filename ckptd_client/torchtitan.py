"""A torchtitan checkpoint manager on top of ckptd's ``Checkpointer`` (needs ``torchtitan``; the rest
of ckptd_client does not import this module).

Switch in a torchtitan config: ``checkpoint=CkptdCheckpointManager.Config(enable=True, job="llama3",
interval=100, ...)`` instead of ``CheckpointManager.Config(...)``; the trainer builds and drives it
through torchtitan's interface (``load(step)``, ``save(curr_step, last_step)``,
``maybe_wait_for_staging()``, ``close()``). What the fields mean here:

- ``interval``, ``enable_first_step_checkpoint``, ``load_only``, ``exclude_from_loading``,
  ``load_step``: as torchtitan's manager. Saves are asynchronous: ``save`` returns after the
  memory copy started (overlapped with the next forward/backward); ``maybe_wait_for_staging``,
  which the trainer calls right before ``optimizers.step()``, fences on that copy.
- ``memory_interval``: memory-level saves between the storage saves (``Checkpointer.save(level=
  "memory")``), e.g. every 10 steps in memory and every 500 to storage; ``load`` then restores the
  newest step every rank can restore from the daemons' memory, else the newest stored one.
- ``keep_latest_k``: after each commit, rank 0 removes this job's committed steps older than the
  newest k (index.json first, so a step is never half visible). 0 keeps all.
- ``last_save_model_only`` / ``export_dtype`` / ``last_save_in_hf``: the last step saves only the
  model; with ``last_save_in_hf`` rank 0 then exports it (``export_hf``) to ``<folder>/step-N``
  as Hugging Face safetensors in ``export_dtype``, names renamed by ``hf_rename`` (a JSON file).
  A state-dict adapter that transforms values (Llama3's q/k permutation for HF's rotary layout)
  is not applied: export names only.
- ``initial_load_in_hf`` + ``initial_load_path``: when the job has no committed step, rank 0
  imports the Hugging Face directory as step 0 (``import_hf``) and every rank restores the model
  from it, resharded to its layout; step 0 is loaded model-only, as torchtitan does.

State saved: ``model`` (torchtitan's ``ModelWrapper`` over the model parts), ``optimizer``,
``lr_scheduler``, ``dataloader`` and the trainer's ``states`` (``train_state``). Dataloader states
holding ``bytes`` (torchtitan pickles its loader state) are stored as uint8 tensors and handed
back as bytes: ckptd itself never unpickles; torchtitan's loader does, as with DCP.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from ckptd.core.names import INDEX_NAME, job_dir, step_dir
from ckptd.core.reader import list_steps

from .checkpointer import Checkpointer
from .config import CheckpointerConfig
from .errors import CheckpointError, needs_extra
from .handle import SaveHandle
from .hf import export_hf, import_hf
from .memory_level import newest_held_step

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
except ImportError as e:                # not installed, or not a version with these names
    raise needs_extra(__name__, "torchtitan", "torchtitan", e) from e

log = logging.getLogger("ckptd_client")


class BytesAsTensors:
    """A Stateful whose ``bytes`` leaves travel as uint8 tensors (ckptd stores no bytes)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) if isinstance(v, bytes) else v
                for k, v in self.inner.state_dict().items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        live = self.inner.state_dict()
        self.inner.load_state_dict({k: v.numpy().tobytes() if isinstance(live.get(k), bytes)
                                    and isinstance(v, torch.Tensor) else v for k, v in sd.items()})


class CkptdCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint-manager interface over ckptd (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        job: str = "torchtitan"
        """ckptd job name: steps live under ``<daemon root>/<job>/``."""
        socket: str | None = None
        """Daemon socket (default: $CKPTD_SOCKET or /run/ckptd/ckptd.sock)."""
        root: str | None = None
        """Checkpoint root, if it is not the daemon's (restores read it without the daemon)."""
        hf_rename: str | None = None
        """JSON file mapping canonical names to Hugging Face names, for ``last_save_in_hf``."""
        memory_interval: int = 0
        """A memory-level save every this many steps between the storage saves of ``interval`` (0: none):
        held in the daemons' memory and their peers', never written (``Checkpointer.save(level="memory")``);
        a resume takes the newest step every rank can restore, memory-level or stored."""

        def checkpointer_config(self) -> CheckpointerConfig:
            """These settings as the ``Checkpointer``'s: ``socket`` and ``root`` carried over; the
            copy overlap is ``manual`` (the trainer calls ``maybe_wait_for_staging`` before each
            optimizer step, which fences); everything else as ``CheckpointerConfig``'s defaults."""
            return CheckpointerConfig(socket=self.socket, root=self.root, overlap="manual")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, LR_SCHEDULER: lr_schedulers})
        if dataloader is not None:
            self.states[DATALOADER] = BytesAsTensors(dataloader)
        unknown = [k for k in config.exclude_from_loading if k not in self.states]
        if unknown:         # (torchtitan's own manager refuses them too, at its first load)
            raise ValueError(f"checkpoint.exclude_from_loading names {unknown}, which are not states of this "
                             f"trainer: it has {sorted(self.states)}")
        self.ckpt = Checkpointer(config.job, config=config.checkpointer_config())
        self._last: SaveHandle | None = None
        self._rank = self.ckpt.rank

    def __del__(self) -> None:
        self.close()

    # ---- torchtitan's hooks ------------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        c = self.config
        if c.load_only:
            return False
        if not (last_step or curr_step % c.interval == 0 or (curr_step == 1 and c.enable_first_step_checkpoint)):
            if not (c.memory_interval and curr_step % c.memory_interval == 0):
                return False
            self._last = self.save_future = self.ckpt.save(curr_step, self.states, level="memory")  # type: ignore[assignment]
            return True
        if last_step and c.last_save_model_only:
            self.ckpt.fence()
            self.ckpt.save(curr_step, {MODEL: self.states[MODEL]}).wait()
            if c.last_save_in_hf and self._rank == 0:
                export_hf(step_dir(self.ckpt.resolve_root(), c.job, curr_step),
                          os.path.join(self.folder, f"step-{curr_step}"), dtype=c.export_dtype, rename=c.hf_rename,
                          force=True)
            self._purge()
            return True
        self._last = self.save_future = self.ckpt.save(curr_step, self.states)   # type: ignore[assignment]
        self._purge()
        return True

    def _load(self, step: int = -1) -> bool:
        c = self.config
        loadable = {k: v for k, v in self.states.items() if k not in c.exclude_from_loading}
        if step == -1:
            latest = self.ckpt.latest_step()
            if c.memory_interval and latest != 0:    # the newest step every rank can restore, memory-level if newer
                if self.ckpt.restore(loadable) is not None:
                    return True
            elif c.memory_interval and newest_held_step(self.ckpt.resolve_root(), c.job, 0) is not None:
                # Step 0 is the model alone (initial_load_in_hf): a memory-level step above it is the run's
                # newest. Restored whole if every rank can; else step 0's model below (the full state's
                # restore from step 0 is refused before anything is written: it lacks the optimizer).
                try:
                    if self.ckpt.restore(loadable) is not None:
                        return True
                except CheckpointError as e:
                    log.warning("ckptd: the memory-level steps above step 0 cannot be restored (%s); "
                                "loading step 0's model", e)
            step = -1 if latest is None else latest
        if step == -1 and c.initial_load_in_hf and c.initial_load_path:
            self._import_initial(c.initial_load_path)
            step = 0
        if step == -1:
            return False
        self.ckpt.restore({MODEL: self.states[MODEL]} if step == 0 else loadable, step)
        return True

    def _maybe_wait_for_staging(self) -> None:
        self.ckpt.fence()

    def _wait_for_saving(self) -> None:
        """Until the last save is committed (raises CheckpointError if it failed)."""
        last, self._last, self.save_future = self._last, None, None
        if last is not None:
            last.wait()

    def _close(self) -> None:
        if hasattr(self, "ckpt"):
            self.ckpt.close()

    # ---- helpers -----------------------------------------------------------------------------

    def _import_initial(self, hf_dir: str) -> None:
        """Rank 0 commits ``hf_dir`` as step 0 of the job (once); the others wait for it."""
        if self._rank == 0 and not os.path.exists(os.path.join(step_dir(self.ckpt.resolve_root(), self.config.job, 0),
                                                               INDEX_NAME)):
            import_hf(hf_dir, self.ckpt.resolve_root(), self.config.job, 0)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def _purge(self) -> None:
        """keep_latest_k: drop committed steps beyond the newest k (rank 0; index first)."""
        k = self.config.keep_latest_k
        if k <= 0 or self._rank != 0:
            return
        committed = [s for s in list_steps(job_dir(self.ckpt.resolve_root(), self.config.job)) if s.committed]
        for s in committed[:-k]:
            try:
                os.unlink(os.path.join(s.path, INDEX_NAME))
            except FileNotFoundError:
                continue
            shutil.rmtree(s.path, ignore_errors=True)
