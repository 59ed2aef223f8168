"""Relayed steps this daemon handed off: their shards here are durable and rank 0's daemon commits them.

The coordinator forgets such a step (steps/coordinator.py), so without a record a second SAVE of one
of its ranks would be taken: it truncates and rewrites the rank's files while the other daemon's
commit publishes the index over them. Each rank is remembered with the client that saved it, until an
ABORT says the step failed or that client leaves: a SAVE by that client (its run goes on, the step may
still commit) is refused; one by a client of a later run (the first died) is a new attempt. The newest
``MAX_HANDED`` steps; a restart forgets them.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

W = TypeVar("W", bound=Hashable)     # a client (the coordinator's waiter)
MAX_HANDED = 4096


class HandedOff(Generic[W]):
    def __init__(self) -> None:
        self._steps: dict[tuple[str, int], dict[int, W | None]] = {}

    def add(self, job: str, step: int, ranks: Iterable[tuple[int, W | None]]) -> None:
        """``ranks`` (rank, its client) of ``step`` were handed off."""
        self._steps.setdefault((job, step), {}).update(ranks)
        while len(self._steps) > MAX_HANDED:
            del self._steps[next(iter(self._steps))]

    def refuses(self, job: str, step: int, rank: int, client: W) -> bool:
        """Whether ``client``'s SAVE of ``rank`` of ``step`` would redo a shard it handed off."""
        ranks = self._steps.get((job, step), {})
        return rank in ranks and ranks[rank] is client

    def ended(self, job: str, step: int) -> None:
        """The step committed or failed: a later SAVE of it is answered as such."""
        self._steps.pop((job, step), None)

    def left(self, client: W) -> None:
        for ranks in self._steps.values():
            for r in [r for r, c in ranks.items() if c is client]:
                del ranks[r]
