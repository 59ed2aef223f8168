"""Sending this node's shards to K peers in the background, and fetching lost ones back.

Targets: with this node at position i of the ``peers`` list (n entries), its copies go to
``peers[(i + j * peer_jump) % n]`` for j = 1..K, skipping itself (NVIDIA's clique rule: a jump
as large as a rack puts copies in another rack). A shard is queued once it is held in memory,
once per target: each target has its own queue and sender, so a slow, stopped or dead peer
delays only the copies meant for it (each bounded by ``peers.io_timeout``, then failed, logged
with the peer's address and counted), never another peer's. All senders share one token bucket
(``peers.bandwidth``), so replication never delays a local write or commit and never floods
the training network. A shard is pinned only while a sender reads it; when a copy ends, ok or
failed, the job is trimmed again, so a shard a stalled copy kept past ``memory.steps`` goes.
A step is *replicated* on this node once each of its shards held here has K acknowledged peer
copies (K + 1 in memory); *committed* stays what index.json says. Fetching a lost shard back
probes every peer at once and takes the first that holds it, so silent peers cost one timeout
together, not one each.

Acknowledged copies are checked again: every ``peers.probe_interval`` s each target is asked, on
one connection, whether it still holds each copy it acknowledged (``has``, bounded by
``peers.io_timeout``). A copy it no longer holds (restarted, trimmed, evicted), or every copy of a
target that cannot be reached, stops counting, so the step shows degraded within the interval
plus the timeout. A lost copy of the newest step held here for its job (a target restarted empty,
or one that evicted it) is queued for that target again, up to ``RESENDS`` times per copy and
target, so a replaced node gets its copies back within a probe round instead of at the next save;
an older step's lost copy is not (its target trims it again under its own ``memory.steps``; the
newest is what a restore takes). A copy of a target that cannot be reached stays unsent until it
answers again. A target of an older build that does not know ``has`` (it closes the connection)
keeps its acknowledgements (logged once); it is then only checked for being reachable until it has
been seen down.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.core.errors import ChecksumError, FormatError, ProtocolError
from ckptd.core.peer_channel import StalledError
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.tiers.memory.store import Held, MemoryStore
from ckptd.daemon.tiers.peers.link import NotAllocated, PeerLink

log = logging.getLogger("ckptd")
QUEUE_MAX = 1024                # shards waiting per target
RESENDS = 3                     # a lost copy of a job's newest held step, sent again to its target at most


class TokenBucket:
    """``rate`` bytes a second (0: unlimited), bursts of up to one second's worth; shared by the
    senders' threads (``peer_channel``), so it is locked and its wait is a blocking sleep."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.tokens, self.last = float(rate), clock()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        """(A sending thread) Before sending ``n`` bytes: wait until the bucket has paid for them (it
        may run into debt for a piece larger than a burst; the wait then covers the debt)."""
        if self.rate <= 0:
            return
        with self.lock:
            now = self.clock()
            self.tokens = min(float(self.rate), self.tokens + (now - self.last) * self.rate) - n
            self.last = now
            wait = -self.tokens / self.rate
        if wait > 0:
            time.sleep(wait)


def targets(peers: list[str], me: str, k: int, jump: int) -> list[str]:
    """The K peers this node's copies go to (fewer if the list is short)."""
    if me not in peers:
        return []
    i, n, out = peers.index(me), len(peers), []
    for j in range(1, n):
        p = peers[(i + j * jump) % n]
        if p != me and p not in out:
            out.append(p)
        if len(out) == k:
            break
    return out


@dataclass(frozen=True)
class ReplicaView:
    job: str
    step: int
    rank: int
    copies: int                 # in memory: this one plus acknowledged peer copies
    targets: tuple[str, ...]


@dataclass
class PeerCounts:
    """One peer's replication counters (status ``peers``, metrics labelled ``peer``)."""
    sent_bytes: int = 0
    failures: int = 0


class Replicator:
    def __init__(self, store: MemoryStore, peers: list[str], me: str, k: int, jump: int, secret: bytes,
                 bandwidth: int, timeout: float, trim: Callable[[str], None],
                 tls: ssl.SSLContext | None = None, probe_interval: float = 0.0) -> None:
        self.store, self.peers, self.me, self.k, self.secret = store, peers, me, k, secret
        self.timeout, self.trim, self.tls, self.probe_interval = timeout, trim, tls, probe_interval
        self.targets = targets(peers, me, k, jump)
        self.bucket = TokenBucket(bandwidth)
        self.queues: dict[str, asyncio.Queue[Held]] = {t: asyncio.Queue(QUEUE_MAX) for t in self.targets}
        self.acked: dict[tuple[str, int, int], set[str]] = {}
        self.per_peer: dict[str, PeerCounts] = {t: PeerCounts() for t in self.targets}
        self.down: set[str] = set()          # targets the last probe round could not reach
        self.no_has: set[str] = set()        # targets (older builds) that do not answer ``has``
        self.unsure: dict[str, set[tuple[str, int, int]]] = {}   # per target: acks dropped as unreachable
        self.resent: dict[tuple[str, tuple[str, int, int]], int] = {}   # (target, shard): times sent again

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.per_peer.values())

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self.per_peer.values())

    def offer(self, held: Held) -> None:
        """(Event loop) Queue a shard that just became resident, for each target; never blocks, a
        full target queue drops it for that target only."""
        if not self.targets:
            return
        for key in [k for k in self.acked if k not in self.store.entries]:
            del self.acked[key]        # evicted or dropped here: its count no longer matters
        for pair in [p for p in self.resent if p[1] not in self.store.entries]:
            del self.resent[pair]
        for target, queue in self.queues.items():
            try:
                queue.put_nowait(held)
            except asyncio.QueueFull:
                self.per_peer[target].failures += 1
                log.warning("replication queue full; shard not replicated",
                            extra={"ctx": {"job": held.job, "step": held.step, "rank": held.rank, "peer": target}})

    async def run(self) -> None:
        """One sender per target, and one prober per target (``probe_interval`` > 0), for as long as
        the daemon runs."""
        probers = [self._prober(t) for t in self.targets] if self.probe_interval > 0 else []
        await asyncio.gather(*(self._sender(t) for t in self.targets), *probers)

    async def _prober(self, target: str) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                await self.check(target)
            except Exception as e:        # (a bug here must not end the probes, nor the senders)
                log.error("replica probe failed", extra={"ctx": {"peer": target, "error": describe_error(e)}})

    def _unack(self, key: tuple[str, int, int], target: str) -> None:
        acks = self.acked.get(key)
        if acks is not None:
            acks.discard(target)

    async def check(self, target: str) -> None:
        """One probe round: each shard held here that ``target`` acknowledged, asked about on one
        connection; an ack it no longer holds, or all of them when it cannot be reached, dropped. The
        copies dropped as unreachable (``unsure``) are asked about too, and count again if it holds them:
        an outage that ends (a restart of the network, a stopped peer resumed) is no lasting "degraded"."""
        unsure = self.unsure.setdefault(target, set())
        asked = [(key, h, h.meta.digest) for key in [*(k for k, acks in self.acked.items() if target in acks),
                                                     *sorted(unsure)]
                 for h in [self.store.entries.get(key)] if h is not None and h.meta is not None and not h.gone]
        unsure.intersection_update(key for key, _, _ in asked)       # (the rest were dropped here meanwhile)
        if not asked:
            return
        link = PeerLink(target, self.secret, self.me, self.timeout, self.tls)
        try:
            try:
                await link.open()
            except (OSError, ProtocolError) as e:
                for key, _, _ in asked:
                    self._unack(key, target)
                    unsure.add(key)
                if target not in self.down:
                    log.warning("replica target unreachable; its copies no longer count",
                                extra={"ctx": {"peer": target, "shards": len(asked), "error": describe_error(e)}})
                self.down.add(target)
                self.no_has.discard(target)      # (a build that comes back may know ``has``)
                return
            if target in self.down:
                log.info("replica target reachable again", extra={"ctx": {"peer": target}})
            self.down.discard(target)
            if target in self.no_has:
                return                    # reachable is all it can say
            for i, (key, held, digest) in enumerate(asked):
                try:
                    there = await link.has(key[0], key[1], key[2], digest)
                except (OSError, ProtocolError) as e:
                    if i == 0 and not isinstance(e, (StalledError, OSError)):
                        self.no_has.add(target)      # closed on its first request: an older build
                        log.warning("replica target does not answer probes (an older ckptd?); its copies "
                                    "are counted as acknowledged", extra={"ctx": {"peer": target,
                                                                                  "error": describe_error(e)}})
                        return
                    for k, _, _ in asked[i:]:
                        self._unack(k, target)
                        unsure.add(k)
                    log.warning("replica probe failed; the copies not confirmed no longer count",
                                extra={"ctx": {"peer": target, "shards": len(asked) - i,
                                               "error": describe_error(e)}})
                    return
                if self.store.entries.get(key) is not held:
                    continue                  # dropped here meanwhile
                if there and key in unsure:
                    unsure.discard(key)
                    self.acked.setdefault(key, set()).add(target)
                    log.info("replica confirmed on peer again; its copy counts",
                             extra={"ctx": {"job": key[0], "step": key[1], "rank": key[2], "peer": target}})
                elif not there:
                    unsure.discard(key)
                    self._unack(key, target)
                    log.warning("replica gone from peer; its copy no longer counts",
                                extra={"ctx": {"job": key[0], "step": key[1], "rank": key[2], "peer": target}})
                    self._send_again(held, target)
        finally:
            link.close()

    def _send_again(self, held: Held, target: str) -> None:
        """(Event loop) A copy ``target`` lost, queued for it again if ``held`` is of the newest step held
        here for its job and has not been sent again ``RESENDS`` times (module docstring)."""
        ctx = {"job": held.job, "step": held.step, "rank": held.rank, "peer": target}
        if held.step != self.store.newest_own().get(held.job):
            return
        times = self.resent.get((target, held.key), 0)
        if times >= RESENDS:
            log.warning("replica lost again; not sent again", extra={"ctx": {**ctx, "times_sent_again": times}})
            return
        try:
            self.queues[target].put_nowait(held)
        except asyncio.QueueFull:
            log.warning("replication queue full; lost replica not sent again", extra={"ctx": ctx})
            return
        self.resent[(target, held.key)] = times + 1
        log.info("replica sent again", extra={"ctx": ctx})

    async def _sender(self, target: str) -> None:
        queue = self.queues[target]
        while True:
            held = await queue.get()
            if held.gone or held.meta is None:
                continue               # evicted or trimmed while it waited: nothing to send
            self.store.pin(held)
            try:
                await self._send(held, target)
            finally:
                self.store.unpin(held)
                if not held.gone:
                    self.trim(held.job)    # a newer commit may have wanted it gone while it was pinned

    async def copy_now(self, held: Held) -> int:
        """A memory-level step's shard sent to every target now, beside the queues (its rank is durable
        only once they all hold it); returns how many acknowledged."""
        self.store.pin(held)
        try:
            sent = await asyncio.gather(*(self._send(held, t) for t in self.targets))
        finally:
            self.store.unpin(held)
        return sum(sent)

    async def _send(self, held: Held, target: str) -> bool:
        ctx = {"job": held.job, "step": held.step, "rank": held.rank, "peer": target}
        link = PeerLink(target, self.secret, self.me, self.timeout, self.tls)
        try:
            await link.open()
            await link.put(held, self.bucket.take)
        except (OSError, ProtocolError) as e:
            self.per_peer[target].failures += 1
            log.warning("replication failed", extra={"ctx": {**ctx, "error": describe_error(e)}})
            return False
        finally:
            link.close()
        assert held.meta is not None
        self.per_peer[target].sent_bytes += held.meta.nbytes
        self.acked.setdefault(held.key, set()).add(target)
        log.info("replicated", extra={"ctx": {**ctx, "bytes": held.meta.nbytes}})
        return True

    async def _probe(self, peer: str, job: str, step: int, rank: int, digest: str) -> bool:
        """Whether ``peer`` holds the shard; False (logged) when it cannot say within the timeout."""
        link = PeerLink(peer, self.secret, self.me, self.timeout, self.tls)
        try:
            await link.open()
            return await link.has(job, step, rank, digest)
        except (OSError, ProtocolError) as e:
            log.warning("peer fetch failed", extra={"ctx": {"peer": peer, "job": job, "step": step, "rank": rank,
                                                            "error": describe_error(e)}})
            return False
        finally:
            link.close()

    async def _get(self, peer: str, job: str, step: int, rank: int, digest: str) -> Held | None:
        """The shard from ``peer`` (checked, held here), or None (logged) if that failed."""
        link = PeerLink(peer, self.secret, self.me, self.timeout, self.tls)
        try:
            await link.open()
            return await link.get(self.store, job, step, rank, digest)
        except ChecksumError as e:
            log.error("corrupt replica from peer; not used", extra={"ctx": {"peer": peer, "job": job, "step": step,
                                                                              "rank": rank, "error": str(e)}})
        except (OSError, ProtocolError, FormatError, NotAllocated) as e:
            log.warning("peer fetch failed", extra={"ctx": {"peer": peer, "job": job, "step": step, "rank": rank,
                                                            "error": describe_error(e)}})
        finally:
            link.close()
        return None

    async def fetch(self, job: str, step: int, rank: int, digest: str) -> Held | None:
        """A lost shard from the peers' memory: every peer probed at once; of those that hold it,
        in the order they answered (ours first among simultaneous answers), the first good copy.
        A silent peer costs at most one ``timeout``, shared by all of them."""
        order = self.targets + [p for p in self.peers if p != self.me and p not in self.targets]
        probes = {asyncio.ensure_future(self._probe(p, job, step, rank, digest)): p for p in order}
        pending = set(probes)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for probe in sorted(done, key=lambda t: order.index(probes[t])):
                    if not probe.result():
                        continue
                    peer = probes[probe]
                    held = await self._get(peer, job, step, rank, digest)
                    if held is not None:
                        log.info("fetched from peer", extra={"ctx": {"peer": peer, "job": job, "step": step,
                                                                     "rank": rank, "bytes": held.nbytes}})
                        return held
            return None
        finally:
            for probe in pending:       # the shard is here: peers still silent need not answer
                probe.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def views(self) -> tuple[ReplicaView, ...]:
        out = []
        for h in self.store.views():
            if h.origin == "local":
                copies = 1 + len(set(self.acked.get((h.job, h.step, h.rank), ())))
                out.append(ReplicaView(h.job, h.step, h.rank, copies, tuple(self.targets)))
        return tuple(out)
