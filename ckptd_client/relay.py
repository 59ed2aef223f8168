"""Cross-daemon commit through the job's c10d store (ranks spread over several nodes).

Each rank publishes ``ok:<manifest digest>`` or ``fail:<reason>`` under its outcome key
(``store_keys.rank_outcome``) once its daemon reports it durable (or failed). Rank 0 gathers
all of them, asks its daemon to COMMIT with the digests (or to ABORT), and publishes
``committed`` or ``failed:<reason>`` under the save's result key for the others.

When the store or the commit request fails (rank 0 died, the store went with it, the COMMIT
timed out on a slow file system), the step may still commit, or already have: from then on the
save is settled by the disk only — committed as soon as its index.json exists, failed when the
commit timeout runs out without one. A handle never reports failure for a committed step.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from . import store_keys

POLL_S = 0.01


@dataclass
class RelayedSave:
    seq: int
    step: int
    deadline: float
    resolve: Callable[[str | None], None]      # None: committed; str: failure reason
    own_published: bool = False
    lost: str | None = None                    # why the store/commit path failed: the disk decides now


# What one poll of a save yields: False (not decided yet), None (committed), or the failure reason.
Outcome = Literal[False] | None | str


class StoreRelay:
    """Polls the store on its own thread; ``resolve`` of each tracked save runs there too."""

    def __init__(self, store: Any, job: str, rank: int, world_size: int, timeout: float,
                 commit: Callable[[int, dict[int, str]], None], abort: Callable[[int, str], None],
                 on_disk: Callable[[int], bool] = lambda step: False) -> None:
        self.store, self.job, self.rank, self.world_size = store, job, rank, world_size
        self.timeout = timeout
        self._commit, self._abort = commit, abort
        self._on_disk = on_disk                 # is the step's index.json there?
        self._saves: dict[int, RelayedSave] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckptd-client-relay", daemon=True)
        self._thread.start()

    def track(self, seq: int, step: int, resolve: Callable[[str | None], None]) -> None:
        with self._lock:
            self._saves[seq] = RelayedSave(seq, step, time.monotonic() + self.timeout, resolve)

    def publish(self, seq: int, outcome: str) -> None:
        """``outcome`` is ``ok:<digest>`` or ``fail:<reason>`` for this rank. Never raises: with the
        store gone (rank 0 died) the save is settled by the disk instead."""
        try:
            self.store.set(store_keys.rank_outcome(self.job, seq, self.rank), outcome)
            lost = None
        except Exception as e:
            lost = f"{type(e).__name__}: {e}"
        with self._lock:
            if seq in self._saves:
                self._saves[seq].own_published = True
                if lost is not None and self._saves[seq].lost is None:
                    self._saves[seq].lost = lost
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(POLL_S)
            self._wake.clear()
            with self._lock:
                saves = sorted(self._saves.values(), key=lambda s: s.seq)
            for s in saves:
                outcome: Outcome = False
                if s.lost is None:
                    try:
                        outcome = self._leader_step(s) if self.rank == 0 else self._follower_step(s)
                    except Exception as e:  # store gone (rank 0 died), commit refused or timed out
                        s.lost = f"{type(e).__name__}: {e}"
                if outcome is False:
                    if (s.lost is not None or time.monotonic() > s.deadline) and self._on_disk(s.step):
                        outcome = None
                        if self.rank == 0:
                            self._publish_quietly(s, "committed")
                    elif time.monotonic() > s.deadline:
                        outcome = s.lost or f"timed out after {self.timeout:g}s waiting for the other ranks' commit"
                        if self.rank == 0:
                            self._publish_quietly(s, f"failed:{outcome}")
                    else:
                        continue
                with self._lock:
                    self._saves.pop(s.seq, None)
                s.resolve(outcome)

    def _leader_step(self, s: RelayedSave) -> Outcome:
        if not s.own_published:
            return False
        keys = [store_keys.rank_outcome(self.job, s.seq, r) for r in range(self.world_size)]
        if not self.store.check(keys):
            return False
        values = [self.store.get(k).decode() for k in keys]
        failures = [f"rank {r}: {v[5:]}" for r, v in enumerate(values) if not v.startswith("ok:")]
        if failures:
            reason = "; ".join(failures)
            try:
                self._abort(s.step, reason)
            finally:
                self._finish(s, f"failed:{reason}")
            return reason
        # A failing COMMIT request raises: the daemon may still publish the index, so the outcome is
        # left to the disk (above), and the others are told only once it is known.
        self._commit(s.step, {r: v[3:] for r, v in enumerate(values)})
        self._finish(s, "committed")
        return None

    def _publish_quietly(self, s: RelayedSave, result: str) -> None:
        try:
            self._finish(s, result)
        except Exception:       # the store is gone: the others settle by the disk as well
            pass

    def _finish(self, s: RelayedSave, result: str) -> None:
        self.store.set(store_keys.save_result(self.job, s.seq), result)
        for r in range(self.world_size):
            try:
                self.store.delete_key(store_keys.rank_outcome(self.job, s.seq, r))
            except Exception:
                pass

    def _follower_step(self, s: RelayedSave) -> Outcome:
        key = store_keys.save_result(self.job, s.seq)
        if not self.store.check([key]):
            return False
        result = self.store.get(key).decode()
        return None if result == "committed" else result.removeprefix("failed:")

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
