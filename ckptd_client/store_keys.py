"""Every key ckptd_client reads or writes in the job's c10d store, in one place.

All ranks of a job share one store, and ranks may run different processes (and, during a
rolling upgrade, different builds), so a key's spelling is part of the protocol between
ranks: change it here or nowhere. What the relay's keys hold is ckptd/core/relay_record.py's
to encode and decode, and FORMAT.md's ("Commit protocol") to document; below, only what each
key is for.

A store can outlive a run (a launcher holds it, or two ``Checkpointer`` s run one after the
other on a process group's store), and a run that crashed leaves its keys behind. So every key
a run decides anything by lives under that run's own id, ``ckptd/<job>/<run>/`` (``<run>``: 32
hex digits, fresh per run, agreed when the ``Checkpointer`` starts: run_scope.py), and the only
keys outside it are the handshake's, whose values a rank trusts only when they answer a nonce it
made itself a moment ago.

The handshake (``ckptd/<job>/join/...``; see run_scope.py):

``ckptd/<job>/join/n``
    the ticket counter (``add``): a rank (> 0) takes the next ticket to ask for the run id;
``ckptd/<job>/join/t<ticket>``
    that rank's fresh nonce: "tell me the run id" (deleted by the rank once answered);
``ckptd/<job>/join/done``
    the tickets a rank 0 has looked at (``add``): where the next run's rank 0 starts, so it reads
    only tickets taken since (counter and cursor stay in the store: two numbers per job);
``ckptd/<job>/join/a<nonce>``
    rank 0's answer to that nonce: the run id (read, then deleted, by the rank that asked);
``ckptd/<job>/join/bell``
    rung (set) by a rank after it wrote its nonce, or completed the count; rank 0 waits on it
    (deleting it before each look), so it answers without polling. It holds nothing (a stale
    ring costs the next run's rank 0 one more look);
``ckptd/<job>/<run>/joined``
    how many ranks took the run id (``add``); rank 0 stops answering at ``world_size - 1``.

A run's keys (``<step>`` is the step number, so a rank's keys follow the step it saves, never
how many times it called ``save``; a step is saved at most once per run in ``relay`` mode):

``ckptd/<job>/<run>/s<step>/r<rank>``
    one rank's outcome of its save of ``step`` (a ``RankOutcome``: durable with its rank record,
    or failed and why); its node's leader deletes them once it has published the node record.
``ckptd/<job>/<run>/s<step>/n<node>``
    a node leader's record of ``step`` (a ``NodeRecord``): its members' outcomes, in rank order;
``ckptd/<job>/<run>/s<step>/result``
    rank 0's verdict (a ``StepResult``: committed, or failed and why); ``.../result/read`` counts
    the ranks that read it (``add``), and the last of them deletes both.
``ckptd/<job>/<run>/restore/<n>``
    the step rank 0 chose for the run's ``n``-th restore (``-1``: none), so every rank loads the
    same step even if a commit lands while they list the directory; ``.../read`` as above, and the
    last reader also sets ``.../all-read``, which rank 0 waits for before its restore returns (the
    store's server may be rank 0's process: it must not exit while a rank still reads) and deletes.
``ckptd/<job>/<run>/restore/<n>/vote/...``
    the agreement on whether every rank restored a memory-level step: counters of failures,
    arrivals and readers, ``done`` once all arrived, ``all-read`` as above.
``ckptd/<job>/<run>/preempt-step``
    the step all ranks stop at after a preemption signal (first proposal wins, compare_set);
    ``.../read`` counts the ranks that know it (all of them), and the last deletes both.
"""
from __future__ import annotations

PREFIX = "ckptd"


def _job(job: str) -> str:
    return f"{PREFIX}/{job}"


def scope(job: str, run: str) -> str:
    """The prefix of every key of one run of ``job``: what the other functions take as ``scope``."""
    return f"{_job(job)}/{run}"


# ---- the run handshake (outside any run) ----------------------------------------------------

def join_tickets(job: str) -> str:
    """The ticket counter: a rank asking for the run id takes the next number (``add``)."""
    return f"{_job(job)}/join/n"


def join_request(job: str, ticket: int) -> str:
    """Where the rank holding ``ticket`` asks for the run id with a fresh nonce."""
    return f"{_job(job)}/join/t{ticket}"


def join_done(job: str) -> str:
    """How many tickets a rank 0 has looked at (``add``): the next run's rank 0 starts there."""
    return f"{_job(job)}/join/done"


def join_answer(job: str, nonce: str) -> str:
    """Where rank 0 answers ``nonce`` with the run id."""
    return f"{_job(job)}/join/a{nonce}"


def join_bell(job: str) -> str:
    """Rung after a nonce is written or the count completes: wakes rank 0."""
    return f"{_job(job)}/join/bell"


def joined(scope: str) -> str:
    """How many ranks (besides rank 0) took this run's id."""
    return f"{scope}/joined"


# ---- one run's keys ---------------------------------------------------------------------------

def rank_outcome(scope: str, step: int, rank: int) -> str:
    """Where ``rank`` publishes how its save of ``step`` went on its daemon."""
    return f"{scope}/s{step}/r{rank}"


def node_record(scope: str, step: int, node: int) -> str:
    """Where ``node``'s leader publishes its members' outcomes of ``step``."""
    return f"{scope}/s{step}/n{node}"


def save_result(scope: str, step: int) -> str:
    """Where rank 0 publishes whether ``step`` committed."""
    return f"{scope}/s{step}/result"


def restore_choice(scope: str, n: int) -> str:
    """Where rank 0 publishes the step of the run's ``n``-th restore."""
    return f"{scope}/restore/{n}"


def restore_votes(scope: str, n: int) -> tuple[str, str, str, str]:
    """The run's ``n``-th restore agreement on a memory-level step: (failures, arrivals, all
    arrived, readers) counters and flag; ``all_read(restore_vote(scope, n))`` is its last reader's mark."""
    base = restore_vote(scope, n)
    return f"{base}/failed", f"{base}/arrived", f"{base}/done", f"{base}/read"


def restore_vote(scope: str, n: int) -> str:
    """The prefix of the run's ``n``-th restore agreement on a memory-level step."""
    return f"{scope}/restore/{n}/vote"


def preempt_step(scope: str) -> str:
    """Where the ranks agree on the step to stop at after a preemption signal."""
    return f"{scope}/preempt-step"


def readers(key: str) -> str:
    """The count of ranks that read ``key`` (a result, a restore choice, the preemption step)."""
    return f"{key}/read"


def all_read(key: str) -> str:
    """Set by the last reader of a restore's ``key`` (its choice of step, its vote); rank 0 waits for it."""
    return f"{key}/all-read"
