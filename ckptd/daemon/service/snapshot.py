"""A typed, read-only picture of a running daemon: what ``status`` and the metrics show.

The parts that own the state (sessions, the slot pool, the step coordinator) each build
their piece; the server puts them together in :meth:`Daemon.snapshot`. Readers never reach
into the daemon's live structures, so they can neither disturb them nor drift from them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptd.core.names import base_job


@dataclass
class Counters:
    """Totals since the daemon started (Prometheus counters; ``stats`` in status). The step table
    keeps the one live instance and hands out copies."""
    saves_started: int = 0
    saves_durable: int = 0
    saves_failed: int = 0
    steps_committed: int = 0
    steps_failed: int = 0
    steps_committed_unsynced: int = 0    # index.json in place, then the directory's fsync failed
    bytes_raw: int = 0
    bytes_stored: int = 0
    bytes_direct: int = 0                # of bytes_stored, written around the page cache (direct_io)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def durable(self, raw: int, stored: int, direct: int) -> None:
        """A shard save became durable: ``raw`` tensor bytes, ``stored`` in its data file, ``direct`` of them
        written around the page cache."""
        self.saves_durable += 1
        self.bytes_raw += raw
        self.bytes_stored += stored
        self.bytes_direct += direct


@dataclass(frozen=True)
class SessionView:
    """A connected rank (after hello)."""
    job: str
    rank: int
    world_size: int
    pid: int
    uid: int
    slots: int
    busy_slots: int               # a save reads them
    saves: int
    last_report: Mapping[str, Any] | None
    slot_bytes: int = 0           # all its slots, the memory tier's kept ones included
    held_slots: int = 0           # kept by the memory tier as a held step's bytes


@dataclass(frozen=True)
class StepView:
    """A step begun here and not yet committed or failed."""
    job: str
    step: int
    world_size: int
    mode: str
    state: str
    writing: tuple[int, ...]
    durable: tuple[int, ...]
    age_s: float


@dataclass(frozen=True)
class ShardView:
    """A shard write in flight (including one of a failed step that has not stopped yet)."""
    job: str
    step: int
    rank: int
    world_size: int
    raw_bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class LastCommit:
    step: int
    unix: float


@dataclass(frozen=True)
class DaemonSnapshot:
    root: str
    socket: str
    pid: int
    version: str
    draining: bool
    counters: Counters
    sessions: tuple[SessionView, ...]
    steps: tuple[StepView, ...]
    shard_writes: tuple[ShardView, ...]
    slot_bytes_in_use: int
    slot_memory_limit: int
    last_committed: Mapping[str, LastCommit] = field(default_factory=dict)
    metrics_address: str | None = None
    memory: Any = None           # tiers.memory.service.MemoryView: the memory tier and peer copies
    shmem_huge_pages: str = "unknown"    # the huge page mode the daemon's shared memory follows (shm.py)
    shm_dir: str | None = None           # the tmpfs directory it is made in; None: memfds
    direct_io: Mapping[str, Any] = field(default_factory=dict)   # the fs tier's write way (write_way.py)

    def status_line(self) -> str:
        """One line for systemd's STATUS= (``systemctl status``)."""
        last = ", ".join(f"{j}@{v.step}" for j, v in sorted(self.last_committed.items())[:4])
        return (f"{'draining; ' if self.draining else ''}{len(self.sessions)} ranks connected, "
                f"{len(self.shard_writes)} saves in flight, {self.counters.steps_committed} steps committed"
                + (f" (last {last})" if last else ""))

    def status(self, progress: Mapping[tuple[str, int, int], int], latest: Mapping[str, int | None]
               ) -> dict[str, Any]:
        """The ``status`` reply; ``progress`` (bytes written per shard) and ``latest`` (newest
        committed step per job in storage) come from the tier."""
        sessions = [{"job": s.job, "rank": s.rank, "world_size": s.world_size, "pid": s.pid, "uid": s.uid,
                     "slots": s.slots, "busy_slots": s.busy_slots, "held_slots": s.held_slots,
                     "slot_bytes": s.slot_bytes, "saves": s.saves,
                     "last_report": dict(s.last_report) if s.last_report is not None else None}
                    for s in self.sessions]
        steps = [{"job": p.job, "step": p.step, "world_size": p.world_size, "mode": p.mode,
                  "writing": list(p.writing), "durable": list(p.durable), "age_s": p.age_s} for p in self.steps]
        saves = [{"job": w.job, "step": w.step, "rank": w.rank, "raw_bytes": w.raw_bytes,
                  "written_bytes": progress.get((w.job, w.step, w.rank), 0), "elapsed_s": w.elapsed_s}
                 for w in self.shard_writes]
        last: dict[str, Any] = {}
        for job in sorted({*self.jobs(), *latest}):        # (``latest``: the root's jobs too)
            mine = self.last_committed.get(job)
            known = [s for s in (latest.get(job), mine.step if mine else None) if s is not None]
            last[job] = {"step": max(known, default=None), "committed_here_unix": mine.unix if mine else None}
        return {"root": self.root, "version": self.version, "pid": self.pid, "sessions": sessions,
                "steps": steps, "stats": self.counters.as_dict(), "slot_bytes_in_use": self.slot_bytes_in_use,
                "slot_memory_limit": self.slot_memory_limit, "saves": saves, "last_committed": last,
                "socket": self.socket, "draining": self.draining, "metrics": self.metrics_address,
                "shmem_huge_pages": self.shmem_huge_pages, "shm_dir": self.shm_dir, "direct_io": dict(self.direct_io),
                "memory": self.memory.to_json() if self.memory is not None else None,
                "host_bytes": self.host_bytes()}

    def host_bytes(self) -> dict[str, dict[str, int]]:
        """Host memory per job, each byte counted once: ``slots`` (trainers' slots the memory tier
        does not keep), ``held`` (this node's steps in the memory tier: kept slots and copies),
        ``replicas`` (peers' shards held here)."""
        out: dict[str, dict[str, int]] = {}

        def of(job: str) -> dict[str, int]:
            return out.setdefault(job, {"slots": 0, "held": 0, "replicas": 0})
        for h in self.memory.held if self.memory is not None else ():
            of(base_job(h.job))["replicas" if h.origin == "replica" else "held"] += h.nbytes   # (its memory-level
            # steps are the job's own: "j/_memory" is no job of its own)
        for s in self.sessions:
            of(s.job)["slots"] += s.slot_bytes - (s.slot_bytes // s.slots if s.slots else 0) * s.held_slots
        return out

    def jobs(self) -> list[str]:
        """Every job with a session, a step in flight or a commit here."""
        return sorted({s.job for s in self.sessions} | {p.job for p in self.steps} | set(self.last_committed))
