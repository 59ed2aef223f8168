"""ckptd_client: the training-side library of ckptd.

    ckpt = ckptd_client.Checkpointer(job="gpt-7b")
    pending = ckpt.save(step, {"model": model, "optim": opt, "rng": ckptd_client.RNGState()})
    step = ckpt.restore(state)

    with ckptd_client.PreemptionHandler(ckpt) as preempt:   # SIGTERM → checkpoint, then stop
        for step in ...:
            if preempt.should_stop(step, state):
                break
"""
from .checkpointer import Checkpointer, SaveHandle
from .errors import CheckpointError
from .preemption import PreemptionHandler
from .state import RNGState

__all__ = ["Checkpointer", "SaveHandle", "CheckpointError", "RNGState", "PreemptionHandler"]
