"""DCP's ``checkpoint_id`` as a ckptd step number: ``100``, ``"100"``, or a path ending in ``step-100``."""
from __future__ import annotations

import os
import re
from typing import Any

from ckptd.core.names import INDEX_NAME, MAX_STEP

from ..errors import CheckpointError

_STEP = re.compile(r"^(?:step-)?([0-9]{1,13})\Z")     # ASCII digits only (\d takes '²' and '٣'), bounded


def step_of(checkpoint_id: Any) -> int:
    """The step a ``checkpoint_id`` names: an int, a decimal string, or a path whose last part is
    ``step-N`` (torchtitan's ``<folder>/step-N``, ckptd's own ``<root>/<job>/step-000000000N``)."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        step = checkpoint_id
    else:
        try:
            base = os.path.basename(os.path.normpath(os.fspath(checkpoint_id)))
        except TypeError:
            base = ""
        m = _STEP.match(base)
        if not m:
            raise CheckpointError(f"checkpoint_id {checkpoint_id!r} names no step: ckptd keeps checkpoints by "
                                  "step number; pass the step (100), or a path ending in 'step-100'")
        step = int(m.group(1))
    if not 0 <= step < MAX_STEP:
        raise CheckpointError(f"checkpoint_id {checkpoint_id!r}: step {step} is not in [0, {MAX_STEP})")
    return step


def step_path_of(checkpoint_id: Any) -> str | None:
    """``checkpoint_id`` itself when it is a committed ckptd step directory (it has index.json)."""
    if isinstance(checkpoint_id, (str, os.PathLike)):
        path = os.fspath(checkpoint_id)
        if os.path.isfile(os.path.join(path, INDEX_NAME)):
            return os.path.abspath(path)
    return None
