"""``[retention]``: the settings, and the composable keep rules they build (Orbax-style policies).

The planner that applies them to step directories is ckptd.daemon.tiers.fs.retention.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ckptd.daemon.settings.spec import integer, parse_duration, setting, show_duration


class KeepRule(Protocol):
    """One reason to keep committed steps (Orbax-style policies compose the same way)."""

    def keep(self, steps: Sequence[int]) -> dict[int, str]:
        """The steps (ascending, committed) this rule keeps, each with why."""
        ...


@dataclass(frozen=True)
class LatestN:
    """The newest ``n`` committed steps; ``n = 0`` keeps them all."""
    n: int

    def keep(self, steps: Sequence[int]) -> dict[int, str]:
        if self.n == 0:
            return dict.fromkeys(steps, "keep_last = 0 keeps every committed step")
        return dict.fromkeys(steps[-self.n:], f"among the last {self.n}")


@dataclass(frozen=True)
class EveryNSteps:
    """Every step divisible by ``interval``; ``interval = 0`` keeps none."""
    interval: int

    def keep(self, steps: Sequence[int]) -> dict[int, str]:
        if not self.interval:
            return {}
        return {s: f"multiple of keep_every = {self.interval}" for s in steps if s % self.interval == 0}


@dataclass(frozen=True)
class RetentionPolicy:
    """``[retention]`` as the planner takes it: keep rules for committed steps, an age for the rest."""
    keep_last: int = 0                  # 0: keep every committed step
    keep_every: int = 0                 # 0: off
    abandoned_after: float = 86400.0    # seconds since the directory was last touched

    def __post_init__(self) -> None:
        if type(self.keep_last) is not int or self.keep_last < 0:
            raise ValueError(f"keep_last must be an integer >= 0, got {self.keep_last!r}")
        if type(self.keep_every) is not int or self.keep_every < 0:
            raise ValueError(f"keep_every must be an integer >= 0, got {self.keep_every!r}")
        if not self.abandoned_after >= 0:
            raise ValueError(f"abandoned_after must be >= 0, got {self.abandoned_after!r}")

    @property
    def rules(self) -> tuple[KeepRule, ...]:
        """The keep rules in the order their reasons are reported (the first reason wins)."""
        return LatestN(self.keep_last), EveryNSteps(self.keep_every)


_POLICY = RetentionPolicy()


@dataclass(frozen=True)
class RetentionSettings:
    """``[retention]``: applied by the daemon after each commit of a job, and by ``ckptd gc``."""
    keep_last: int = setting(
        _POLICY.keep_last, parse=integer(0), gc=True,
        doc="Keep the newest N committed steps per job; `0` keeps every committed step.")
    keep_every: int = setting(
        _POLICY.keep_every, parse=integer(0), gc=True,
        doc="Also keep every committed step whose number is divisible by K; `0` is off.")
    abandoned_after: float = setting(
        _POLICY.abandoned_after, parse=parse_duration, show=show_duration, gc=True,
        doc="Remove uncommitted step directories nothing has touched for this long. Must be ≥ `step_timeout`.")

    def policy(self) -> RetentionPolicy:
        return RetentionPolicy(self.keep_last, self.keep_every, self.abandoned_after)
