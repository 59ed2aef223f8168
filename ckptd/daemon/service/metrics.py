"""Prometheus metrics of one daemon (prometheus_client, a registry per daemon).

Counters and gauges are read at scrape time from the daemon's public snapshot
(:class:`~ckptd.daemon.service.snapshot.DaemonSnapshot`, what ``ckptd status`` shows too), so they
cannot drift from it; histograms are
observed as shards become durable, steps commit and clients report their stall. The
HTTP endpoint is off unless ``metrics.address`` is set; a bare port binds loopback.
docs/operations.md lists every metric.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from ckptd.daemon.service.snapshot import DaemonSnapshot
from ckptd.daemon.tiers.fs.retention import GcResult

RATIO_BUCKETS = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 2.0, 3.0, 5.0, 10.0)
THROUGHPUT_BUCKETS = (1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2e9, 4e9, 8e9, 16e9)
WRITE_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
COMMIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# Counters field → (metric name without _total, help)
_STAT_COUNTERS = {
    "saves_started": ("ckptd_saves_started", "Shard saves accepted (one per rank per step)."),
    "saves_durable": ("ckptd_saves_durable", "Shard saves written and fsynced (rank manifest published)."),
    "saves_failed": ("ckptd_saves_failed", "Shard saves whose write failed."),
    "steps_committed": ("ckptd_steps_committed", "Steps committed (index.json published) by this daemon."),
    "steps_failed": ("ckptd_steps_failed", "Steps abandoned uncommitted (a rank failed, timed out, shutdown)."),
    "steps_committed_unsynced": ("ckptd_steps_committed_unsynced",
                                 "Steps committed (index.json renamed into place) whose directory fsync then failed: "
                                 "loadable, but they may not survive a crash."),
    "bytes_raw": ("ckptd_bytes_raw", "Tensor bytes received in durable shards, before compression (storage "
                  "saves; memory-level: ckptd_memory_level_bytes_held)."),
    "bytes_stored": ("ckptd_bytes_stored", "Bytes written to data files for durable shards, after compression."),
    "bytes_direct": ("ckptd_bytes_direct", "Of ckptd_bytes_stored, the bytes written around the page cache "
                     "(O_DIRECT, direct_io)."),
}


class _DaemonCollector(Collector):
    def __init__(self, snapshot: Callable[[], DaemonSnapshot]) -> None:
        self.snapshot = snapshot

    def describe(self) -> Iterable[Any]:
        return []          # names are fixed below; avoids collecting before the daemon is built

    def collect(self) -> Iterable[Any]:
        snap = self.snapshot()
        stats = snap.counters.as_dict()
        for key, (name, doc) in _STAT_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats[key])
        raw, stored = snap.counters.bytes_raw, snap.counters.bytes_stored
        yield GaugeMetricFamily("ckptd_compression_ratio_overall",
                                "Raw over stored bytes of every durable shard since start (0 before any).",
                                value=raw / stored if stored else 0.0)
        yield GaugeMetricFamily("ckptd_queue_depth", "Shard writes in flight (accepted, not yet durable or failed).",
                                value=len(snap.shard_writes))
        yield GaugeMetricFamily("ckptd_steps_in_flight", "Steps begun on this daemon and not yet committed or "
                                "abandoned.", value=len(snap.steps))
        yield GaugeMetricFamily("ckptd_sessions", "Connected trainer ranks (after hello).", value=len(snap.sessions))
        yield GaugeMetricFamily("ckptd_slot_memory_bytes", "Shared-memory slot bytes allocated to sessions.",
                                value=snap.slot_bytes_in_use)
        yield GaugeMetricFamily("ckptd_slot_memory_limit_bytes", "Slot memory budget (slot_memory_limit).",
                                value=snap.slot_memory_limit)
        yield GaugeMetricFamily("ckptd_draining", "1 while the daemon drains after SIGTERM.", value=int(snap.draining))
        yield from _last_commits("", snap.last_committed)
        host = GaugeMetricFamily("ckptd_host_bytes", "Host memory per job, each byte once: kind=slots (trainers' "
                                 "slots not kept by the memory tier), held (this node's steps in memory, kept "
                                 "slots included), replicas (peers' shards held here).", labels=["job", "kind"])
        for job, kinds in sorted(snap.host_bytes().items()):     # (memory-level steps under their job)
            for kind, n in kinds.items():
                host.add_metric([job, kind], n)
        yield host
        yield from _memory_metrics(snap.memory)
        yield from _memory_level_metrics(snap.memory)
        yield InfoMetricFamily("ckptd_build", "ckptd version.", value={"version": snap.version})


_MEMORY_COUNTERS = {
    "held": "Shards that became resident in the memory tier (own and peers' replicas).",
    "evicted": "Shards evicted from the memory tier by its budget.",
    "skipped": "Shards not held because they did not fit the memory budget.",
    "served": "Restores served from the memory tier (from a peer's copy included).",
    "corrupt": "Held or received shards that failed their checksums (never served).",
}


def _memory_metrics(m: Any) -> Iterable[Any]:
    """The memory tier and peer copies (tiers.memory.service.MemoryView), when the daemon has them."""
    if m is None:
        return
    yield GaugeMetricFamily("ckptd_memory_bytes", "Bytes held by the memory tier.", value=m.used)
    yield GaugeMetricFamily("ckptd_memory_budget_bytes", "The memory tier's budget (memory.budget).", value=m.budget)
    yield GaugeMetricFamily("ckptd_memory_shards", "Shards held by the memory tier.", value=len(m.held))
    for key, doc in _MEMORY_COUNTERS.items():
        yield CounterMetricFamily(f"ckptd_memory_{key}_shards", doc, value=getattr(m.totals, key))
    shown = m.to_json()
    held = shown["held"]
    yield GaugeMetricFamily("ckptd_memory_replicated_steps", "Steps held here whose own shards all have K + 1 "
                            "copies in memory.", value=sum(1 for s in held if s["replicated"]))
    yield CounterMetricFamily("ckptd_peer_refused", "Peer connections refused (failed authentication).",
                              value=m.peers_refused)
    yield GaugeMetricFamily("ckptd_memory_degraded_steps", "Steps held here whose own shards are not (yet) fully "
                            "protected by peers: a parity piece not in its holders' parity (parity mode), a shard "
                            "short of its K + 1 copies (copies mode).", value=shown["degraded_steps"])
    yield CounterMetricFamily("ckptd_peer_replication_failures", "Sends to peers that failed: shard copies (copies "
                              "mode) or parity pieces (parity mode).", value=m.replication_failures)
    yield CounterMetricFamily("ckptd_peer_sent_bytes", "Bytes sent to peers: shard copies (copies mode) or parity "
                              "pieces (parity mode).", value=m.replicated_bytes)
    sent = CounterMetricFamily("ckptd_peer_target_sent_bytes", "Bytes of shard copies or parity pieces sent to one "
                               "peer.", labels=["peer"])
    failed = CounterMetricFamily("ckptd_peer_target_replication_failures",
                                 "Shard copies or parity pieces to one peer that failed (stalled, refused, "
                                 "unreachable).", labels=["peer"])
    for peer, c in sorted(m.per_peer.items()):
        sent.add_metric([peer], c.sent_bytes)
        failed.add_metric([peer], c.failures)
    yield sent
    yield failed


# Memory-level steps' counters (MemoryView.level, a Counters) → (metric name without _total, help): held in
# memory with their peers' copies, never compressed or written, so none of them is in the storage counters.
_LEVEL_COUNTERS = {
    "saves_started": ("saves_started", "Memory-level shard saves accepted (one per rank per step)."),
    "saves_durable": ("saves_held", "Memory-level shard saves held here (manifest written, K peer replicas)."),
    "saves_failed": ("saves_failed", "Memory-level shard saves that could not be held or replicated."),
    "bytes_raw": ("bytes_held", "Tensor bytes of memory-level shards held (raw: never compressed or written)."),
    "steps_committed": ("steps_committed", "Memory-level steps committed by this daemon."),
    "steps_failed": ("steps_failed", "Memory-level steps abandoned uncommitted."),
}


def _memory_level_metrics(m: Any) -> Iterable[Any]:
    """Memory-level steps (save(level="memory")): their own counters and newest commit per (base) job."""
    if m is None:
        return
    for key, (name, doc) in _LEVEL_COUNTERS.items():
        yield CounterMetricFamily(f"ckptd_memory_level_{name}", doc, value=getattr(m.level, key))
    yield from _last_commits("memory-level", m.level_last)


def _last_commits(level: str, last: Mapping[str, Any]) -> Iterable[Any]:
    """The newest step this daemon committed per job and its Unix time (``level``: "" for storage steps, or
    "memory-level", which prefixes the names ``ckptd_memory_level_``)."""
    prefix, what = (f"{level.replace('-', '_')}_", f"{level} ") if level else ("", "")
    step = GaugeMetricFamily(f"ckptd_{prefix}last_committed_step", f"Newest {what}step this daemon committed, per job.",
                             labels=["job"])
    unix = GaugeMetricFamily(f"ckptd_{prefix}last_commit_timestamp_seconds",
                             f"Unix time of the newest {what}commit by this daemon, per job.", labels=["job"])
    for job, info in sorted(last.items()):
        step.add_metric([job], info.step)
        unix.add_metric([job], info.unix)
    yield step
    yield unix


class DaemonMetrics:
    """The metrics of one daemon; ``serve()`` exposes them over HTTP.

    ``snapshot`` is called at each scrape, on the HTTP server's thread."""

    def __init__(self, snapshot: Callable[[], DaemonSnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.registry.register(_DaemonCollector(snapshot))
        self.compression_ratio = Histogram(
            "ckptd_compression_ratio", "Raw over stored bytes per durable shard.", buckets=RATIO_BUCKETS, registry=r)
        self.write_throughput = Histogram(
            "ckptd_write_throughput_bytes_per_second",
            "Raw bytes per second per durable shard (slot to fsynced file, compression included).",
            buckets=THROUGHPUT_BUCKETS, registry=r)
        self.write_seconds = Histogram(
            "ckptd_shard_write_seconds", "Seconds to compress, write and fsync one shard.",
            buckets=WRITE_SECONDS_BUCKETS, registry=r)
        self.commit_latency = Histogram(
            "ckptd_commit_latency_seconds", "Seconds from a step's first save request to its commit on this daemon.",
            buckets=COMMIT_BUCKETS, registry=r)
        self.client_stall = Histogram(
            "ckptd_client_stall_seconds", "Time save() blocked the trainer, as each client reports per save.",
            buckets=STALL_BUCKETS, registry=r)
        self.client_fence = Histogram(
            "ckptd_client_fence_seconds", "Time a copy fence blocked the trainer, as each client reports per save.",
            buckets=STALL_BUCKETS, registry=r)
        self.peers_refused = Counter(
            "ckptd_peers_refused", "Connections refused by the allowed_users / allowed_groups check.", registry=r)
        self.gc_removed = Counter(
            "ckptd_gc_removed_steps", "Step directories removed by retention, by kind (expired, abandoned).",
            ["kind"], registry=r)
        self.gc_errors = Counter(
            "ckptd_gc_errors", "Step directories retention failed to remove.", registry=r)
        for kind in ("expired", "abandoned"):
            self.gc_removed.labels(kind)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None

    # ---- observations -----------------------------------------------------

    def shard_durable(self, raw_bytes: int, stored_bytes: int, seconds: float) -> None:
        if stored_bytes > 0:
            self.compression_ratio.observe(raw_bytes / stored_bytes)
        if seconds > 0:
            self.write_throughput.observe(raw_bytes / seconds)
        self.write_seconds.observe(max(0.0, seconds))

    def step_committed(self, latency_s: float) -> None:
        self.commit_latency.observe(max(0.0, latency_s))

    def client_report(self, stall_s: float, fence_s: float) -> None:
        self.client_stall.observe(max(0.0, float(stall_s)))
        self.client_fence.observe(max(0.0, float(fence_s)))

    def gc_done(self, result: GcResult) -> None:
        for a in result.removed:
            self.gc_removed.labels(a.kind).inc()
        if result.errors:
            self.gc_errors.inc(len(result.errors))

    # ---- HTTP ---------------------------------------------------------------

    def serve(self, address: tuple[str, int]) -> tuple[str, int]:
        """Start the /metrics endpoint on a thread; returns the bound (host, port)."""
        from prometheus_client import start_http_server
        host, port = address
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise RuntimeError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
        self._server, self._thread = server, thread
        self.address = (host, server.server_address[1])
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
