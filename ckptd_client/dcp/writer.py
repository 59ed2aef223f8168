"""``StorageWriter``: DCP's writes through this rank's ``Checkpointer`` to its node's ckptd daemon."""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptd.core.names import step_dir, validate_job
from ckptd.core.step_files import is_committed

from ..checkpointer import Checkpointer
from ..config import CheckpointerConfig
from ..errors import CheckpointError
from ..handle import SaveHandle
from .items import ItemPlans, check_items, rank_plan
from .meta import DcpRecord
from .step_id import step_of


class StorageWriter(_DcpStorageWriter):
    """DCP's ``StorageWriter`` over ckptd. DCP calls, per save: ``reset(checkpoint_id)`` (the step:
    ``step_id.step_of``) → ``set_up_storage_writer`` → ``prepare_local_plan`` (refuses what ckptd
    cannot store, before any collective) → on the coordinator ``prepare_global_plan`` (the DCP
    record, meta.py) → ``write_data`` (this rank's items into a slot of its ``Checkpointer``, then
    waits until the daemon has committed the step: every rank durable, one index.json) → on the
    coordinator ``finish`` (checks index.json is in place).

    Keep one writer per process and reuse it for every save (its ``Checkpointer`` keeps its
    slots and its session); ``close()`` it at the end. ``checkpointer``: share an existing one
    instead (it must not be saving through ``save`` meanwhile). ``config``: the
    ``Checkpointer``'s settings (``socket``, ``root``, ``num_slots``, ``commit_timeout``...);
    ``step``: the step when DCP is given no ``checkpoint_id``.

    The writer pickles (``dcp.async_save``'s process mode sends it to DCP's background process
    with every save) as its job, settings and fixed step alone: never its ``Checkpointer`` (a
    daemon session, threads). An unpickled writer saves through its process's own
    ``Checkpointer`` for that job and settings (``shared_checkpointer``), whose rank, world size
    and store are that process's torch.distributed ones: in DCP's background process, the gloo
    group DCP sets up there (the ranks of the group ``async_save`` was given, over a TCPStore of
    its own), so the commit relay runs through that store.
    """

    def __init__(self, job: str, socket: str | None = None, root: str | None = None, *, step: int | None = None,
                 config: CheckpointerConfig | None = None, checkpointer: Checkpointer | None = None) -> None:
        super().__init__()
        self.job = validate_job(job)
        self.config = config or CheckpointerConfig(socket=socket, root=root)
        if config is not None and (socket or root):
            raise TypeError("pass socket and root in config, or as arguments, not both")
        self.fixed_step = step
        self.step: int | None = step
        self.checkpoint_id: str | os.PathLike[str] | None = None
        self.is_coordinator = False
        self.record: DcpRecord | None = None
        self.last: SaveHandle | None = None          # the last save's handle (stall, durable, committed)
        self._own = checkpointer is None
        self._unpickled = False
        self._ckpt = checkpointer
        self._plans = ItemPlans()
        if checkpointer is not None:
            self._adopt(checkpointer)

    def _adopt(self, ckpt: Checkpointer) -> None:
        if ckpt.job != self.job:
            raise ValueError(f"checkpointer saves job {ckpt.job!r}, the writer job {self.job!r}")
        ckpt.plans = self._plans              # DCP's items are planned here, not by walking a state dict

    @property
    def checkpointer(self) -> Checkpointer:
        """This process's ``Checkpointer`` (made on first use: rank, world size, store from torch.distributed)."""
        if self._ckpt is None:
            if self._unpickled:
                self._ckpt, self._own = shared_checkpointer(self.job, self.config), False
            else:
                self._ckpt = Checkpointer(self.job, config=self.config)
            self._adopt(self._ckpt)
        return self._ckpt

    def __getstate__(self) -> dict[str, Any]:
        """Job, settings and fixed step (see the class docstring). Rank, world size and store are
        left to the unpickling process's torch.distributed; a private daemon (``spawn=True``)
        belongs to this process and cannot be reached from another: refused."""
        config = self._ckpt.config if self._ckpt is not None and not self._own else self.config
        if config.spawn:
            raise CheckpointError("a StorageWriter whose Checkpointer spawns a private daemon (spawn=True) cannot "
                                  "save from another process (dcp.async_save's process mode): use thread mode, "
                                  "or a daemon on a socket")
        return {"job": self.job, "step": self.fixed_step,
                "config": dataclasses.replace(config, rank=None, world_size=None, store=None)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        StorageWriter.__init__(self, state["job"], step=state["step"], config=state["config"])
        self._unpickled = True

    # ---- DCP's calls, in order -------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.checkpoint_id = checkpoint_id
        self.step = step_of(checkpoint_id) if checkpoint_id is not None else self.fixed_step
        self.record = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise CheckpointError("ckptd needs a step to save: pass checkpoint_id ('step-100' or 100) to dcp.save, "
                                  "or StorageWriter(..., step=100)")
        self.is_coordinator = is_coordinator
        self.checkpointer                     # connect-time errors surface here, on every rank  # noqa: B018

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        check_items(plan.items)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.record = DcpRecord.of_plans(plans, self.storage_meta())
        self.record.to_tree()                 # refuses planner data JSON cannot hold, before any write
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.step is not None
        ckpt = self.checkpointer
        try:
            record = self.record.to_tree() if self.is_coordinator and self.record is not None else None
            rp = rank_plan(plan.items, planner, record)
        except BaseException as e:      # on this rank alone, maybe (an object DCP cannot pickle): fail every rank now
            ckpt.fail(self.step, f"failed before reaching its daemon (DCP's items): {type(e).__name__}: {e}")
            raise
        handle = self.last = ckpt.save(self.step, self._plans.use(rp.plan), overlap=False, when_busy="block")
        handle.wait()                         # committed: every rank durable, index.json in place
        results = [WriteResult(index=item.index, size_in_bytes=size, storage_data=name)
                   for item, name, size in zip(plan.items, rp.names, rp.sizes, strict=True)]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.step is not None
        root = self.checkpointer.resolve_root()
        if not is_committed(step_dir(root, self.job, self.step)):
            raise CheckpointError(f"step {self.step} of job {self.job!r} is not committed under {root}")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=uuid.uuid4().hex)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            step_of(checkpoint_id)
        except CheckpointError:
            return False
        return True

    def close(self) -> None:
        """Close the ``Checkpointer`` this writer made (one passed in, or a shared one, stays open)."""
        if self._own and self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None


_SHARED: dict[tuple[str, CheckpointerConfig], Checkpointer] = {}


def shared_checkpointer(job: str, config: CheckpointerConfig) -> Checkpointer:
    """This process's one ``Checkpointer`` for ``job`` and ``config``, made on first use, for the
    writers unpickled here: DCP's background process unpickles a fresh copy of the writer with every
    save, and they all save through it, so its daemon session and slots serve save after save. It
    lives as long as the process (the daemon releases its slots when the connection closes)."""
    ckpt = _SHARED.get((job, config))
    if ckpt is None:
        ckpt = _SHARED[(job, config)] = Checkpointer(job, config=config)
    return ckpt
