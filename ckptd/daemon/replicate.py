"""Sending this node's shards to K peers in the background, and fetching lost ones back.

Targets: with this node at position i of the ``peers`` list (n entries), its copies go to
``peers[(i + j * peer_jump) % n]`` for j = 1..K, skipping itself (NVIDIA's clique rule: a jump
as large as a rack puts copies in another rack). A shard is queued once it is held in memory;
a single sender drains the queue, its bytes paced by a token bucket (``peer_bandwidth``), so
replication never delays a local write or commit and never floods the training network. A
step is *replicated* on this node once each of its shards held here has K acknowledged peer
copies (K + 1 in memory); *committed* stays what index.json says.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.core.errors import ChecksumError, FormatError, ProtocolError
from ckptd.daemon.memory_store import Held, MemoryStore
from ckptd.daemon.peers import PeerLink
from ckptd.daemon.runtime import describe_error

log = logging.getLogger("ckptd")
QUEUE_MAX = 1024


class TokenBucket:
    """``rate`` bytes a second (0: unlimited), bursts of up to one second's worth."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.tokens, self.last = float(rate), clock()

    async def take(self, n: int) -> None:
        """Before sending ``n`` bytes: wait until the bucket has paid for them (it may run into debt
        for a piece larger than a burst; the wait then covers the debt)."""
        if self.rate <= 0:
            return
        now = self.clock()
        self.tokens = min(float(self.rate), self.tokens + (now - self.last) * self.rate) - n
        self.last = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


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


class Replicator:
    def __init__(self, store: MemoryStore, peers: list[str], me: str, k: int, jump: int, secret: bytes,
                 bandwidth: int) -> None:
        self.store, self.peers, self.me, self.k, self.secret = store, peers, me, k, secret
        self.targets = targets(peers, me, k, jump)
        self.bucket = TokenBucket(bandwidth)
        self.queue: asyncio.Queue[Held] = asyncio.Queue(QUEUE_MAX)
        self.acked: dict[tuple[str, int, int], set[str]] = {}
        self.sent_bytes = 0
        self.failures = 0

    def offer(self, held: Held) -> None:
        """(Event loop) Queue a shard that just became resident; never blocks, drops when full."""
        if not self.targets:
            return
        for key in [k for k in self.acked if k not in self.store.entries]:
            del self.acked[key]        # evicted or dropped here: its count no longer matters
        try:
            self.queue.put_nowait(held)
        except asyncio.QueueFull:
            log.warning("replication queue full; shard not replicated",
                        extra={"ctx": {"job": held.job, "step": held.step, "rank": held.rank}})

    async def run(self) -> None:
        while True:
            held = await self.queue.get()
            if held.gone or held.meta is None:
                continue
            self.store.pin(held)
            try:
                for target in self.targets:
                    await self._send(held, target)
            finally:
                self.store.unpin(held)

    async def _send(self, held: Held, target: str) -> None:
        ctx = {"job": held.job, "step": held.step, "rank": held.rank, "peer": target}
        link = PeerLink(target, self.secret, self.me)
        try:
            await link.open()
            await link.put(held, self.bucket.take)
        except (OSError, ProtocolError, asyncio.TimeoutError) as e:
            self.failures += 1
            log.warning("replication failed", extra={"ctx": {**ctx, "error": describe_error(e)}})
            return
        finally:
            link.close()
        assert held.meta is not None
        self.sent_bytes += held.meta.nbytes
        self.acked.setdefault(held.key, set()).add(target)
        log.info("replicated", extra={"ctx": {**ctx, "bytes": held.meta.nbytes}})

    async def fetch(self, job: str, step: int, rank: int, digest: str) -> Held | None:
        """A lost shard from the peers' memory (ours first, then the rest): the first good copy."""
        order = self.targets + [p for p in self.peers if p != self.me and p not in self.targets]
        for peer in order:
            link = PeerLink(peer, self.secret, self.me)
            try:
                await link.open()
                held = await link.get(self.store, job, step, rank, digest)
            except ChecksumError as e:
                log.error("corrupt replica from peer; not used", extra={"ctx": {"peer": peer, "job": job,
                                                                                  "step": step, "rank": rank,
                                                                                  "error": str(e)}})
                continue
            except (OSError, ProtocolError, FormatError, asyncio.TimeoutError) as e:
                log.warning("peer fetch failed", extra={"ctx": {"peer": peer, "job": job, "step": step,
                                                                "rank": rank, "error": describe_error(e)}})
                continue
            finally:
                link.close()
            if held is not None:
                log.info("fetched from peer", extra={"ctx": {"peer": peer, "job": job, "step": step, "rank": rank,
                                                             "bytes": held.nbytes}})
                return held
        return None

    def views(self) -> tuple[ReplicaView, ...]:
        out = []
        for h in self.store.views():
            if h.origin == "local":
                copies = 1 + len(set(self.acked.get((h.job, h.step, h.rank), ())))
                out.append(ReplicaView(h.job, h.step, h.rank, copies, tuple(self.targets)))
        return tuple(out)
