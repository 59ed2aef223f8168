"""How the tests' gloo rank processes leave: the group destroyed, output flushed, and no interpreter
teardown (``os._exit``).

Why not a plain return: a gloo worker thread drops its last reference to a finished collective
(``AsyncAllgatherCoalescedWork`` of a DTensor's ``full_tensor``, say) after the caller's ``wait`` has
returned; when that happens once the interpreter is finalizing, the tensor's PyObject decref needs
the GIL, the thread is ended with ``pthread_exit``, whose forced unwind meets a noexcept frame:
``terminate called without an active exception``, SIGABRT, in a rank whose work was all done. Seen
about once in 12 runs of two ranks ending with ``full_tensor`` (a core's backtrace: torch 2.13's
``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherCoalescedWork`` -> ``decref_pyobject`` ->
``take_gil`` -> ``pthread_exit``); a ``barrier`` first does not help (its work holds the earlier ones).
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(code: int = 0) -> NoReturn:
    """Destroy the default group (if any), flush stdout and stderr, and exit with ``code`` at once."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
