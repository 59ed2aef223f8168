"""``StorageReader``: DCP's reads straight from a committed ckptd step (ranged, checksummed)."""
from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.futures import Future

from ckptd.core import protocol
from ckptd.core.global_index import LOCAL, GlobalTensor
from ckptd.core.names import rank_manifest_name, step_dir, validate_job
from ckptd.core.regions import Region

from ..connection import ask
from ..errors import CheckpointError
from ..reshard import DTYPES, Need, StepFiles, decodable_into, read_needs
from .meta import META_KEY, DcpRecord
from .step_id import step_of, step_path_of


def record_of(files: StepFiles) -> DcpRecord:
    """The DCP record of a step (meta.py): in rank 0's state tree, else the first rank that has it."""
    for rank in range(files.world_size):
        tree = files.manifest(rank).tree
        entries = tree.get("d") if isinstance(tree, dict) else None
        for item in entries if isinstance(entries, list) else ():
            if isinstance(item, list) and len(item) == 2 and item[0] == META_KEY:
                return DcpRecord.from_tree(item[1], os.path.join(files.path, rank_manifest_name(rank)))
    raise CheckpointError(f"{files.path} was not written by ckptd_client.dcp.StorageWriter (no DCP record in "
                          "its state trees): restore it with Checkpointer.restore, or read tensors with load_tensor")


class StorageReader(_DcpStorageReader):
    """DCP's ``StorageReader`` over a committed ckptd step. DCP calls: ``reset(checkpoint_id)`` →
    ``read_metadata`` (rebuilt from the index's tensor map and the DCP record, no pickle) →
    ``set_up_storage_reader`` → ``prepare_local_plan`` / ``prepare_global_plan`` (unchanged) →
    ``read_data``: for each ``ReadItem`` the region it covers of its global tensor, read with
    ``ckptd_client.reshard`` (only the pieces and chunks it touches, every chunk checksummed),
    copied into the planner's tensor; a byte item's bytes go to the planner's ``load_bytes``
    (which, like every DCP reader's, unpickles them: DCP's own path for Python objects).

    ``checkpoint_id``: a committed step directory (``<root>/<job>/step-000000000100``), or a step
    of ``job`` (``100``, ``"step-100"``, a torchtitan ``<folder>/step-100``) under ``root`` (asked
    from the daemon at ``socket`` when not given). No daemon is needed when ``root`` is known.
    """

    def __init__(self, job: str | None = None, socket: str | None = None, root: str | None = None, *,
                 step: int | None = None, threads: int | None = None) -> None:
        super().__init__()
        self.job = validate_job(job) if job is not None else None
        self.socket = socket
        self.root = os.path.abspath(root) if root else None
        self.fixed_step = step
        self.path: str | None = None
        self.checkpoint_id: str | os.PathLike[str] | None = None
        self.threads = threads or max(1, len(os.sched_getaffinity(0)))
        self._files: StepFiles | None = None

    def resolve_root(self) -> str:
        if self.root is None:
            self.root = str(ask(self.socket or protocol.default_socket_path(), protocol.Info())["root"])
        return self.root

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.checkpoint_id = checkpoint_id
        self.close()
        self.path = step_path_of(checkpoint_id) if checkpoint_id is not None else None
        if self.path is None:
            step = step_of(checkpoint_id) if checkpoint_id is not None else self.fixed_step
            if step is None or self.job is None:
                raise CheckpointError("ckptd needs a step directory, or a job and a step: pass checkpoint_id "
                                      "('<root>/<job>/step-000000000100', or 'step-100' with StorageReader(job))")
            self.path = step_dir(self.resolve_root(), self.job, step)

    def files(self) -> StepFiles:
        if self._files is None:
            if self.path is None:
                self.reset(None)
            assert self.path is not None
            self._files = StepFiles(self.path)
        return self._files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        files = self.files()
        if files.tensors is None:
            raise CheckpointError(f"{files.path} is a format-1 step (no tensor map): DCP cannot load it")
        return record_of(files).metadata(files.tensors, files.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.files()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        files = self.files()
        try:
            needs: list[Need] = []
            after: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None]] = []
            for item in plan.items:
                fqn = item.storage_index.fqn
                t = (files.tensors or {}).get(fqn)
                if t is None:
                    raise CheckpointError(f"{fqn!r} is not in checkpoint step {files.step} ({files.path})")
                source = _source(t)
                if item.type == LoadItemType.BYTE_IO:
                    out = torch.empty(t.shape, dtype=torch.uint8)
                    needs.append(Need(fqn, Region.whole(t.shape), out, source))
                    after.append((item, out, None))
                    continue
                offsets = tuple(int(a) + int(b) for a, b in
                                zip(item.storage_index.offset or (), item.storage_offsets, strict=True))
                region = Region(offsets, tuple(int(n) for n in item.lengths))
                target = planner.resolve_tensor(item).detach()
                if tuple(target.shape) != region.sizes:
                    raise CheckpointError(f"{fqn!r}: the planner's tensor has shape {tuple(target.shape)}, the read "
                                          f"item {list(region.sizes)}")
                out = target if decodable_into(target, t.dtype, region.sizes) else \
                    torch.empty(region.sizes, dtype=DTYPES[t.dtype])
                needs.append(Need(fqn, region, out, source))
                after.append((item, out, target))
            read_needs(files, needs, self.threads)
            for item, got, dest in after:
                if dest is None:
                    planner.load_bytes(item, io.BytesIO(got.numpy().tobytes()))
                else:
                    if got is not dest:
                        dest.copy_(got)
                    planner.commit_tensor(item, dest)
        finally:
            self.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return step_path_of(checkpoint_id) is not None

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None


def _source(t: GlobalTensor) -> int | None:
    """A plain (``local``) tensor's copy to read: rank 0's if it has one, else the first holder's."""
    if t.kind != LOCAL:
        return None
    ranks = t.holder_ranks()
    return 0 if 0 in ranks else ranks[0]
