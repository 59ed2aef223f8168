"""Lightning's ``CheckpointIO`` over ckptd (needs ``lightning`` or the standalone ``pytorch_lightning``;
the rest of ckptd_client does not import this module).

    trainer = lightning.Trainer(plugins=[CkptdCheckpointIO("my-run")],      # or pytorch_lightning.Trainer
                                callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100, save_last=True)])
    trainer.fit(model, ckpt_path="last")

What a save does: Lightning's checkpoint dict goes to the daemon as a step of the job (tensors
through the slots; every other value into ckptd's JSON state tree — anything that is neither a
tensor, a JSON value nor a container of them is refused with an error naming its key); once the
step is committed, the ``.ckpt`` path Lightning chose gets a small JSON *pointer* (FORMAT.md,
"Framework pointers"), written atomically, so ModelCheckpoint's bookkeeping (``last.ckpt``,
top-k, ``ckpt_path="last"``) works as with files. Lightning saves more than once at one
``global_step`` (top-k, then ``last.ckpt``; an epoch-end checkpoint on a step-end one), each dict
its own (loop progress, callbacks' state), so each save is a step of its own: the k-th save at
global step g is step ``g * SAVES_PER_STEP + k`` (global step 100 → steps 1000, 1001), the first
free one. ``remove_checkpoint`` removes the pointer only; steps are deleted by the daemon's
retention (which counts these steps, not global steps).

``wait=False`` (``AsyncCkptdCheckpointIO``): ``save_checkpoint`` returns once the state is in a
slot; a thread writes the pointer when the step commits, so a pointer never names a step that
is not committed. ``teardown`` (Lightning calls it at the end of ``fit``) waits for them, as does
``wait_for_saves``. ``remove_checkpoint`` also cancels the pointer writes still queued for its path
(top-k drops a checkpoint whose step has not committed yet), so a removed ``.ckpt`` does not come
back; a later save to the same path writes its pointer as usual. A process killed before a step's
pointer is written resumes from the pointer before it (the step itself may have committed:
``ckptd ls`` shows it).

Loading reads the pointed-to step straight from storage (no daemon needed when ``root`` is
given), every chunk checksummed, nothing unpickled.

``lightning`` (``lightning.fabric``) and ``pytorch_lightning`` (``lightning_fabric``) each ship the
same ``CheckpointIO`` as a class of their own, and each Trainer accepts only its own: the plugins
derive from the ``CheckpointIO`` of every one of them that is installed, so the same classes plug
into either Trainer.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.core import storage
from ckptd.core.names import MAX_STEP, step_dir, validate_job

from .checkpointer import Checkpointer
from .config import CheckpointerConfig
from .errors import CheckpointError
from .handle import SaveHandle
from .saved_state import escape_keys, read_state, unescape_keys

POINTER_KIND = "ckptd.pointer"
SAVES_PER_STEP = 10          # steps per global step: the k-th save at global step g is step g * 10 + k
MAX_POINTER_BYTES = 64 * 1024
LIGHTNING_PLUGINS = ("lightning.fabric.plugins", "lightning_fabric.plugins")    # lightning's, pytorch_lightning's


def _checkpoint_io_base() -> type:
    """The ``CheckpointIO`` of each Lightning package installed, as one base class."""
    bases: list[type] = []
    for name in LIGHTNING_PLUGINS:
        try:
            bases.append(importlib.import_module(name).CheckpointIO)
        except ImportError:
            continue
    if not bases:
        raise ImportError("ckptd_client.lightning needs lightning or pytorch_lightning: "
                          "pip install 'ckptd[client,lightning]' (or pytorch_lightning)")
    if len(bases) == 1:
        return bases[0]
    return types.new_class("CheckpointIO", tuple(bases), exec_body=lambda ns: ns.update(__module__=__name__))


if TYPE_CHECKING:       # the test extra installs both
    from lightning.fabric.plugins import CheckpointIO as _LightningIO
    from lightning_fabric.plugins import CheckpointIO as _PytorchLightningIO

    class CheckpointIO(_LightningIO, _PytorchLightningIO):
        ...
else:
    CheckpointIO = _checkpoint_io_base()


def write_pointer(path: str | os.PathLike[str], job: str, step: int, root: str) -> None:
    """``path`` as a pointer to committed step ``step`` of ``job`` under ``root`` (atomic, durable)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"kind": POINTER_KIND, "job": job, "step": step, "root": os.path.abspath(root)}
    storage.atomic_write(path, json.dumps(doc, sort_keys=True).encode())


def read_pointer(path: str | os.PathLike[str]) -> str:
    """The step directory the pointer at ``path`` names; CheckpointError for anything else. A symlink
    is followed (``ModelCheckpoint(save_last="link")`` links ``last.ckpt`` to the newest ``.ckpt``):
    what it resolves to must be a regular file, and its contents are checked like any pointer's."""
    try:
        doc = json.loads(storage.read_limited(os.path.realpath(os.fspath(path)), MAX_POINTER_BYTES))
        if not isinstance(doc, dict) or doc.get("kind") != POINTER_KIND:
            raise ValueError(f"not a ckptd pointer (kind {doc.get('kind') if isinstance(doc, dict) else None!r})")
        root, step = doc.get("root"), doc.get("step")
        if not isinstance(root, str) or type(step) is not int:
            raise ValueError("its root or step is malformed")
        return step_dir(root, validate_job(doc.get("job")), step)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load {os.fspath(path)!r} through ckptd: {e}") from None


class CkptdCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` saving through ckptd (see the module docstring). Lightning calls
    ``save_checkpoint`` on global rank 0 only, so the ``Checkpointer`` is a world of one
    (rank 0, no store); ``load_checkpoint`` on every rank reads the step from storage.
    ``config``: the ``Checkpointer``'s settings (``socket``, ``root``, ...)."""

    def __init__(self, job: str, socket: str | None = None, root: str | None = None, *, wait: bool = True,
                 config: CheckpointerConfig | None = None) -> None:
        super().__init__()
        self.job = validate_job(job)
        base = config or CheckpointerConfig(socket=socket, root=root)
        self.config = dataclasses.replace(base, rank=0, world_size=1, commit="local", overlap=False)
        self.wait = wait
        self._ckpt: Checkpointer | None = None
        self._next: tuple[int, int] = (-1, 0)           # (global step, the k its next save tries first)
        self._pointers: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._queued: dict[str, list[_QueuedPointer]] = {}     # absolute path → its pointer writes to come
        self._lock = threading.Lock()           # a pointer write against remove_checkpoint of its path

    @property
    def checkpointer(self) -> Checkpointer:
        if self._ckpt is None:
            self._ckpt = Checkpointer(self.job, config=self.config)
        return self._ckpt

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"CkptdCheckpointIO takes no storage_options (got {storage_options!r})")
        step = checkpoint.get("global_step")
        if type(step) is not int:
            raise CheckpointError(f"checkpoint for {os.fspath(path)!r} has no integer 'global_step' "
                                  f"(got {step!r}): ckptd keeps checkpoints by step")
        try:
            handle = self.checkpointer.save(self._step_for(step, path), escape_keys(checkpoint))
        except TypeError as e:       # a value ckptd cannot store: the message names its key
            raise CheckpointError(f"cannot save {os.fspath(path)!r} through ckptd: {e}") from None
        if self.wait:
            self._point(handle, path)
            return
        # The directory now, as Lightning's own CheckpointIO makes it at save: save_last="link" links
        # last.ckpt to this path in it before the pointer is written (the link dangles until then).
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-pointers")
        self._pointers = [f for f in self._pointers if not f.done() or f.exception() is not None]
        queued = _QueuedPointer()
        with self._lock:
            self._queued.setdefault(os.path.abspath(path), []).append(queued)
        self._pointers.append(self._pool.submit(self._point, handle, path, queued))

    def _step_for(self, global_step: int, path: str | Path) -> int:
        """The step this save at ``global_step`` goes to: the first of its ``SAVES_PER_STEP`` not yet
        used, here or by an earlier run (a step directory exists: committed, or a save of it failed)."""
        if not 0 <= global_step < MAX_STEP // SAVES_PER_STEP:
            raise CheckpointError(f"cannot save {os.fspath(path)!r} through ckptd: global_step {global_step} "
                                  f"is out of range (0 to {MAX_STEP // SAVES_PER_STEP - 1})")
        first = self._next[1] if self._next[0] == global_step else 0
        root = self.checkpointer.resolve_root()
        for k in range(first, SAVES_PER_STEP):
            step = global_step * SAVES_PER_STEP + k
            if not os.path.lexists(step_dir(root, self.job, step)):
                self._next = (global_step, k + 1)
                return step
        raise CheckpointError(f"cannot save {os.fspath(path)!r} through ckptd: {SAVES_PER_STEP} checkpoints "
                              f"were saved at global_step {global_step} already (steps "
                              f"{global_step * SAVES_PER_STEP}..{global_step * SAVES_PER_STEP + SAVES_PER_STEP - 1})")

    def _point(self, handle: SaveHandle, path: str | Path, queued: _QueuedPointer | None = None) -> None:
        """``path`` as a pointer to ``handle``'s step once it commits, unless ``remove_checkpoint(path)``
        cancelled this write meanwhile (under the lock: a removal never runs between check and write)."""
        try:
            handle.wait()
            with self._lock:
                if queued is None or not queued.cancelled:
                    write_pointer(path, self.job, handle.step, self.checkpointer.resolve_root())
        finally:
            if queued is not None:
                with self._lock:
                    key = os.path.abspath(path)
                    writes = self._queued.get(key, [])
                    if queued in writes:        # not when remove_checkpoint took the list
                        writes.remove(queued)
                    if not writes:
                        self._queued.pop(key, None)

    def load_checkpoint(self, path: str | Path, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        state = unescape_keys(read_state(read_pointer(path)))
        if not isinstance(state, dict):
            raise CheckpointError(f"{os.fspath(path)!r}: the step holds a {type(state).__name__}, not a checkpoint")
        if map_location is not None and not callable(map_location):
            state = _to(state, map_location)
        return state

    def remove_checkpoint(self, path: str | Path) -> None:
        """Unlink the pointer at ``path`` and cancel the pointer writes queued for it so far (async: its
        step may commit after Lightning dropped the path); a save to ``path`` after this one is not."""
        with self._lock:
            for queued in self._queued.pop(os.path.abspath(path), []):
                queued.cancelled = True
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def wait_for_saves(self) -> None:
        """Until every save so far is committed and its pointers written (raises the first failure)."""
        pending, self._pointers = self._pointers, []
        for f in pending:
            f.result()

    def teardown(self) -> None:
        """``wait_for_saves``, then close (Lightning calls it at the end of ``fit``)."""
        try:
            self.wait_for_saves()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._ckpt is not None:
                self._ckpt.close()
                self._ckpt = None
            self._next = (-1, 0)


@dataclasses.dataclass(eq=False)
class _QueuedPointer:
    """One pointer write waiting for its step's commit; ``cancelled`` by ``remove_checkpoint``."""
    cancelled: bool = False


class AsyncCkptdCheckpointIO(CkptdCheckpointIO):
    """``CkptdCheckpointIO(wait=False)``: saves return once the state is in a slot."""

    def __init__(self, job: str, socket: str | None = None, root: str | None = None, *,
                 config: CheckpointerConfig | None = None) -> None:
        super().__init__(job, socket, root, wait=False, config=config)


def _to(obj: Any, device: Any) -> Any:
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj
