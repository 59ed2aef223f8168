"""The memory tier as the server sees it, wired together: the tier, the peer listener, replication.

The server builds one :class:`MemoryService`; it gives the step coordinator its tier (the memory tier
in front of the file system, or the file system alone when ``memory.steps`` is 0), answers
``memory_fetch`` requests, pins what a client is reading until its connection closes, and says
what status and metrics show (:class:`MemoryView`).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Hashable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from ckptd.core import names
from ckptd.core.protocol import MemoryFetch, level_job
from ckptd.daemon import shm
from ckptd.daemon.runtime import RequestError, TaskSet, describe_error
from ckptd.daemon.service.snapshot import Counters, LastCommit
from ckptd.daemon.settings.config import DaemonConfig
from ckptd.daemon.tiers.base import StorageTier
from ckptd.daemon.tiers.memory.store import Held, HeldView, MemoryStore, MemoryTotals
from ckptd.daemon.tiers.memory.tier import MemoryTier
from ckptd.daemon.tiers.peers.group_state import group_state
from ckptd.daemon.tiers.peers.layout import ParityLayout
from ckptd.daemon.tiers.peers.link import PeerServer, load_secret, split_address
from ckptd.daemon.tiers.peers.parity import ParityNode
from ckptd.daemon.tiers.peers.parity_hold import ParityHolder
from ckptd.daemon.tiers.peers.rebuild import Rebuilder
from ckptd.daemon.tiers.peers.replicate import PeerCounts, Replicator, ReplicaView
from ckptd.daemon.tiers.peers.tls import load_tls

log = logging.getLogger("ckptd")
SETTLE_INTERVAL_S = 0.5
GONE_CHECK_EVERY = 4         # settle rounds between checks for committed memory-level steps removed (2 s)


@dataclass(frozen=True)
class MemoryView:
    """The memory tier and peer copies in ``status`` and metrics."""
    steps: int
    budget: int
    used: int
    totals: MemoryTotals
    held: tuple[HeldView, ...]
    replicas: tuple[ReplicaView, ...]
    k: int
    peer_address: str | None
    peers_refused: int
    replication_failures: int                # sends to peers that failed: shard copies, or parity pieces
    replicated_bytes: int                    # bytes sent to peers: shard copies, or parity pieces
    per_peer: dict[str, PeerCounts]         # each target's counters (replication targets or parity holders)
    redundancy: str = "copies"               # or "parity" (then ``protected`` and ``parity_bytes`` say)
    protected: dict[tuple[str, int, int], bool] = field(default_factory=dict)   # own shards: in their parity
    parity_bytes: int = 0                    # parity buffers this node holds for its group
    parity_sent: int = 0                     # data pieces this node sent to its stripes' parity holders
    rebuild_in: int = 0                      # decoded pieces this node received rebuilding lost shards
    reduce_in: int = 0                       # rows this node fetched as a holder decoding others' pieces
    pieces_out: int = 0                      # pieces and parity this node served (get_piece/parity, reduce)
    level: Counters = field(default_factory=Counters)    # memory-level steps' own counters (steps.machine)
    level_last: dict[str, LastCommit] = field(default_factory=dict)   # newest memory-level commit per base job

    def to_json(self) -> dict[str, Any]:
        copies = {(r.job, r.step, r.rank): r.copies for r in self.replicas}
        steps: dict[tuple[str, int], dict[str, Any]] = {}
        for h in self.held:
            s = steps.setdefault((h.job, h.step), {"job": names.base_job(h.job), "step": h.step,
                                                   "level": "memory" if names.is_memory_job(h.job) else "storage",
                                                   "committed": h.committed, "ranks": {}, "bytes": 0})
            s["ranks"][str(h.rank)] = {"origin": h.origin, "bytes": h.nbytes, "pinned": h.pins,
                                       "copies": copies.get((h.job, h.step, h.rank)), "in_slot": h.in_slot}
            s["bytes"] += h.nbytes
            if self.redundancy == "parity" and h.origin == "local":
                s["protected"] = s.get("protected", True) and self.protected.get((h.job, h.step, h.rank), False)
            s["committed"] = s["committed"] and h.committed
        for s in steps.values():
            own = [r["copies"] for r in s["ranks"].values() if r["copies"] is not None]
            s["replicated"] = bool(own) and self.k > 0 and all(c >= self.k + 1 for c in own)
        # Held steps of this node not (yet) fully protected by its peers: parity, a piece not in its holders'
        # parity; copies (K > 0), a shard short of its K + 1 copies.
        degraded = sum(1 for s in steps.values() if any(r["origin"] == "local" for r in s["ranks"].values())
                       and not (s.get("protected", False) if self.redundancy == "parity"
                                else s["replicated"] or self.k == 0))
        return {"steps_per_job": self.steps, "budget_bytes": self.budget, "used_bytes": self.used,
                "held": sorted(steps.values(), key=lambda s: (s["job"], s["step"], s["level"])),
                "totals": vars(self.totals).copy(), "replicas_k": self.k, "peer_address": self.peer_address,
                "peers_refused": self.peers_refused, "replication_failures": self.replication_failures,
                "replicated_bytes": self.replicated_bytes, "redundancy": self.redundancy,
                "parity_held_bytes": self.parity_bytes, "parity_sent_bytes": self.parity_sent,
                "rebuild_received_bytes": self.rebuild_in, "reduce_fetched_bytes": self.reduce_in,
                "pieces_served_bytes": self.pieces_out,
                "degraded_steps": degraded,
                "memory_level": {"saves_started": self.level.saves_started, "saves_held": self.level.saves_durable,
                                 "saves_failed": self.level.saves_failed, "bytes_held": self.level.bytes_raw,
                                 "steps_committed": self.level.steps_committed,
                                 "steps_failed": self.level.steps_failed,
                                 "last_committed": {j: {"step": c.step, "committed_here_unix": c.unix}
                                                    for j, c in sorted(self.level_last.items())}},
                "peers": {p: {"sent_bytes": c.sent_bytes, "failures": c.failures} for p, c in self.per_peer.items()}}


class MemoryService:
    def __init__(self, config: DaemonConfig, fs: StorageTier, root: str, pool: Executor) -> None:
        self.config = config
        self.store = MemoryStore(config.memory.budget, config.memory.steps)
        p = config.peers
        self.secret = load_secret(p.secret_file) if p.secret_file and (p.listen or p.peers) else None
        self.tls = load_tls(p.tls_cert, p.tls_key, p.tls_ca) if self.secret is not None else None
        client_tls = self.tls.client if self.tls else None      # every PeerLink (copies, fetches, probes, pieces)
        self.replicator: Replicator | None = None
        self.parity: ParityNode | None = None          # redundancy = "parity": this node's pieces, rebuilds
        self.holder: ParityHolder | None = None        # ... and the parity it holds for its group
        self.rebuilder: Rebuilder | None = None        # ... and lost shards of its group decoded
        self.fetcher: Replicator | None = None         # ... and shards their owners hold fetched whole (no copies)
        if self.secret is not None and p.peers and p.redundancy == "parity":
            layout = ParityLayout.of(list(p.peers), p.name or p.listen or "", p.group, p.parity, p.jump)
            self.parity = ParityNode(self.store, layout, self.secret, p.bandwidth, p.io_timeout, self._trim,
                                     tls=client_tls, probe_interval=p.probe_interval)
            self.rebuilder = Rebuilder(self.store, layout, self.secret, p.io_timeout, tls=client_tls)
            self.holder = ParityHolder(self.store, layout, self.rebuilder.reduce)
            # Shards their owners still hold are fetched whole (a restore at another world size reads other
            # nodes' ranks): only a lost one is decoded, and a lost parity holder cannot stop the former.
            self.fetcher = Replicator(self.store, list(p.peers), p.name or p.listen or "", 0, p.jump, self.secret,
                                      p.bandwidth, p.io_timeout, self._trim, tls=client_tls)
        elif self.secret is not None and p.peers:
            self.replicator = Replicator(self.store, list(p.peers), p.name or p.listen or "", p.replicas, p.jump,
                                         self.secret, p.bandwidth, p.io_timeout, self._trim, tls=client_tls,
                                         probe_interval=p.probe_interval)
        r = self.replicator
        on_held = r.offer if r else self.parity.offer if self.parity else lambda h: None
        self.memory = MemoryTier(fs, self.store, root, config.write.chunk_bytes, pool,
                                 on_held=on_held, replicate=r.copy_now if r else self.parity.protect_now
                                 if self.parity else None, k=len(r.targets) if r else 1 if self.parity else 0,
                                 on_failed=self.parity.withdraw if self.parity else lambda metas: None)
        self.tier: StorageTier = self.memory if self.store.enabled else fs
        self.server: PeerServer | None = None
        self.refused = 0
        self.tasks = TaskSet()
        self.reading: dict[Hashable, list[Held]] = {}   # connection → shards it was handed

    async def start(self) -> None:
        p = self.config.peers
        if p.listen is not None and self.secret is not None:
            self.server = PeerServer(self.store, self.secret, self._trim, self._refused, p.io_timeout,
                                     pieces=self.holder, tls=self.tls.server if self.tls else None)
            host, port = await self.server.start(*split_address(p.listen))
            log.info("peer listener", extra={"ctx": {"address": f"{host}:{port}", "peers": list(p.peers),
                                                     "tls": self.tls is not None,
                                                     "targets": self.replicator.targets if self.replicator else []}})
        if self.replicator is not None:
            self.tasks.spawn(self.replicator.run(), "replication")
        if self.parity is not None:
            self.tasks.spawn(self.parity.run(), "parity")
        if self.store.enabled:
            self.tasks.spawn(self._settle_loop(), "memory tier commit check")

    async def _settle_loop(self) -> None:
        """Steps whose commit this daemon does not see (another node's leader committed them, or a
        replica's) become committed here once their index.json is in place; then older ones go (a
        storage step, the memory-level steps at or below it: ``MemoryStore.trim``). Every
        ``GONE_CHECK_EVERY`` rounds, committed memory-level steps whose index.json is gone go too."""
        rounds = 0
        while True:
            await asyncio.sleep(SETTLE_INTERVAL_S)
            for job in sorted({h.job for h in self.store.entries.values() if not h.committed}):
                try:
                    self._trim(job)
                except Exception as e:        # one job's bad entry must not end the check for every job
                    log.error("memory tier commit check failed for a job",
                              extra={"ctx": {"job": job, "error": describe_error(e)}})
            rounds += 1
            if rounds % GONE_CHECK_EVERY == 0:
                self._drop_gone()

    def _drop_gone(self) -> None:
        """Committed memory-level steps held here whose index.json is gone: the daemon that committed a
        newer step removed them (``memory_level.prune``, ``remove_stale``), or a save of the same number
        un-committed it (``retire``). This daemon may never hold a shard of that newer step (not held:
        budget, streamed), so nothing else would tell it; their only use was a restore of that step."""
        for job, step in sorted({(h.job, h.step) for h in self.store.entries.values()
                                 if h.committed and names.is_memory_job(h.job)}):
            try:
                os.stat(os.path.join(names.step_dir(self.memory.root, job, step), names.INDEX_NAME))
                continue
            except FileNotFoundError:
                pass
            except OSError:           # (unreadable now is not gone: kept)
                continue
            log.info("memory-level step no longer committed: dropped from memory",
                     extra={"ctx": {"job": names.base_job(job), "step": step}})
            self.store.drop_committed(job, step)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        await self.tasks.cancel_all()
        if self.parity is not None:
            await self.parity.drops.cancel_all()

    def close(self) -> None:
        if self.holder is not None:
            self.holder.close()
        self.store.close()

    def _refused(self) -> None:
        self.refused += 1

    def _trim(self, job: str) -> None:
        self.store.trim(job, self.memory.committed_now)

    async def fetch(self, conn: Hashable, m: MemoryFetch) -> tuple[dict[str, Any], list[int]]:
        """``memory_fetch``: the shard's layout and a descriptor of its memfd (pinned until ``release``)."""
        job = level_job(m.job, m.level)     # (ValueError: an error reply) before it names any path
        if m.step is not None and not names.is_step(m.step):
            raise RequestError("memory_fetch: step must be a step number or null")
        if not names.is_rank(m.rank, m.world_size):
            raise RequestError(f"bad rank {m.rank} / world size {m.world_size}")
        fetch_peer = self.replicator.fetch if self.replicator is not None else \
            self._fetch_or_rebuild if self.rebuilder is not None else None
        held, source = await self.memory.serve(job, m.step, m.rank, m.world_size, fetch_peer, verify=m.verify)
        self.reading.setdefault(conn, []).append(held)
        assert held.meta is not None
        log.info("restore from memory", extra={"ctx": {"job": job, "step": held.step, "rank": m.rank,
                                                        "bytes": held.meta.nbytes, "source": source}})
        # Read-only: the client neither writes into nor resizes a copy other restores read (shm.py).
        return {**held.meta.to_wire(), "source": source}, [shm.read_only(held.fd)]

    async def _fetch_or_rebuild(self, job: str, step: int, rank: int, digest: str) -> Held | None:
        """(Parity) A shard of another node: from its owner's memory if it still holds it, else decoded."""
        assert self.fetcher is not None and self.rebuilder is not None
        return await self.fetcher.fetch(job, step, rank, digest) or await self.rebuilder.rebuild(job, step, rank,
                                                                                              digest)

    def reclaim(self, slot_fds: set[int]) -> bool:
        """A trainer whose slots (``slot_fds``) are all kept as held steps gets the oldest back."""
        return self.store.give_back_oldest(slot_fds)

    def release(self, conn: Hashable) -> None:
        """The connection closed: the shards it read may be evicted again."""
        for held in self.reading.pop(conn, []):
            self.store.unpin(held)

    def view(self, level: Counters | None = None, level_last: dict[str, LastCommit] | None = None) -> MemoryView:
        """``level``, ``level_last``: the memory-level steps' counters and newest commits (the coordinator's)."""
        r, par = self.replicator, self.parity      # (one or neither: copies or parity mode)
        # Sends to peers, failed and done, per target: shard copies (copies mode) or parity pieces (parity mode).
        counts = r.per_peer if r is not None else par.per_peer if par is not None else {}
        address = self.server.address if self.server is not None else None
        return MemoryView(self.store.steps if self.store.enabled else 0, self.store.budget, self.store.used,
                          MemoryTotals(**vars(self.store.totals)), self.store.views(),
                          r.views() if r is not None else (), self.config.peers.replicas if r is not None else 0,
                          f"{address[0]}:{address[1]}" if address else None, self.refused,
                          sum(c.failures for c in list(counts.values())),
                          sum(c.sent_bytes for c in list(counts.values())),
                          {t: PeerCounts(c.sent_bytes, c.failures) for t, c in list(counts.items())},
                          self.config.peers.redundancy, self._protected(),
                          self.holder.held_bytes() if self.holder else 0,
                          self.parity.sent_bytes if self.parity else 0,
                          self.rebuilder.received if self.rebuilder else 0,
                          self.rebuilder.fetched if self.rebuilder else 0,
                          self.holder.served if self.holder else 0, level or Counters(), dict(level_last or {}))

    async def group_state(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        """Parity mode: every step of this node's group, protected or degraded, and every member's
        reachability (each member asked, each answer bounded by ``peers.io_timeout``); None in copies mode."""
        if self.holder is None or self.secret is None:
            return None
        p = self.config.peers
        return await group_state(self.holder.layout, self.holder.report(), self.secret, p.io_timeout,
                                 self.tls.client if self.tls else None)

    def _protected(self) -> dict[tuple[str, int, int], bool]:
        par = self.parity
        if par is None:
            return {}
        return {(h.job, h.step, h.rank): par.protected(h.job, h.step, h.rank, h.meta.nbytes, h.meta.digest)
                for h in self.store.entries.values() if h.origin == "local" and h.meta is not None}
