"""Every key ckptd_client reads or writes in the job's c10d store, in one place.

All ranks of a job share one store, and ranks may run different processes (and, during a
rolling upgrade, different builds), so a key's spelling is part of the protocol between
ranks: change it here or nowhere. The key space, all under ``ckptd/<job>/``:

``ckptd/<job>/<seq>/r<rank>``
    one rank's outcome of save number ``seq`` (``ok:<manifest digest>`` or ``fail:<reason>``);
    its node's leader deletes them once it has published the node record. See relay.py.
``ckptd/<job>/<seq>/n<node>``
    a node leader's record of save ``seq``: its members' outcomes, in rank order (JSON list of
    ``{"ok": record or digest}`` / ``{"fail": reason}``);
``ckptd/<job>/<seq>/nodes``
    how many node records of save ``seq`` are published (``add``);
``ckptd/<job>/<seq>/ready``
    set by the node leader whose record completed the count; rank 0 waits on it.
``ckptd/<job>/<seq>/result``
    rank 0's verdict on save ``seq``: ``committed`` or ``failed:<reason>``.
``ckptd/<job>/restore/<n>``
    the step rank 0 chose for the job's ``n``-th restore (``-1``: none), so every rank loads the
    same step even if a commit lands while they list the directory.
``ckptd/<job>/preempt-step``
    the step all ranks stop at after a preemption signal (first proposal wins, compare_set).

Save keys are numbered by the client's save sequence, not the step, so saving a step again
never reads a stale outcome; ``<seq>`` is an integer and so never collides with ``restore``.
"""
from __future__ import annotations

PREFIX = "ckptd"


def _job(job: str) -> str:
    return f"{PREFIX}/{job}"


def rank_outcome(job: str, seq: int, rank: int) -> str:
    """Where ``rank`` publishes how save ``seq`` went on its daemon."""
    return f"{_job(job)}/{seq}/r{rank}"


def node_record(job: str, seq: int, node: int) -> str:
    """Where ``node``'s leader publishes its members' outcomes of save ``seq``."""
    return f"{_job(job)}/{seq}/n{node}"


def node_count(job: str, seq: int) -> str:
    """The counter of save ``seq``'s published node records."""
    return f"{_job(job)}/{seq}/nodes"


def nodes_ready(job: str, seq: int) -> str:
    """Set once every node record of save ``seq`` is published."""
    return f"{_job(job)}/{seq}/ready"


def save_result(job: str, seq: int) -> str:
    """Where rank 0 publishes whether save ``seq`` committed."""
    return f"{_job(job)}/{seq}/result"


def restore_choice(job: str, n: int) -> str:
    """Where rank 0 publishes the step of the job's ``n``-th restore."""
    return f"{_job(job)}/restore/{n}"


def preempt_step(job: str) -> str:
    """Where the ranks agree on the step to stop at after a preemption signal."""
    return f"{_job(job)}/preempt-step"
