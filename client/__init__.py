"""ckptd_client: the training-side library of ckptd.

    ckpt = ckptd_client.Checkpointer(job="gpt-7b")
    pending = ckpt.save(step, {"model": model, "optim": opt, "rng": ckptd_client.RNGState()})
    step = ckpt.restore(state)
"""
from .checkpointer import Checkpointer, SaveHandle
from .errors import CheckpointError
from .state import RNGState

__all__ = ["Checkpointer", "SaveHandle", "CheckpointError", "RNGState"]
