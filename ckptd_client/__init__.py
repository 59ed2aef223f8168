"""ckptd_client: the training-side library of ckptd.

    ckpt = ckptd_client.Checkpointer(job="gpt-7b")
    pending = ckpt.save(step, {"model": model, "optim": opt, "rng": ckptd_client.RNGState()})
    step = ckpt.restore(state)
    w1 = ckptd_client.load_tensor(step_dir, "model/layers.0.w1.weight", (slice(0, 128),))   # one slice, nothing else

    with ckptd_client.PreemptionHandler(ckpt) as preempt:   # SIGTERM → checkpoint, then stop
        for step in range(start, total_steps):
            train_step()
            if preempt.should_stop(step + 1, state):    # the number save() gives the state after `step`
                break
"""
try:
    import torch as _torch  # noqa: F401  (the daemon installs without torch; the client needs it)
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ImportError("ckptd_client needs PyTorch, which the daemon-only install of ckptd leaves out: "
                      "pip install 'ckptd[client]'") from e

from .checkpointer import Checkpointer
from .config import CheckpointerConfig
from .errors import CheckpointError
from .handle import CloseReport, SaveHandle
from .hf import ExportResult, ImportResult, export_hf, import_hf, load_hf
from .lazy import load_tensor
from .modes import WhenBusy
from .preemption import PreemptionHandler
from .read_stats import ReadStats
from .sources import RestoreInfo, Unavailable
from .state import RNGState

__all__ = ["Checkpointer", "CheckpointerConfig", "SaveHandle", "CloseReport", "CheckpointError", "RNGState",
           "PreemptionHandler", "WhenBusy", "load_tensor", "ReadStats", "export_hf", "import_hf", "load_hf",
           "ExportResult", "ImportResult", "RestoreInfo", "Unavailable"]
