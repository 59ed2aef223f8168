"""Is a step protected across its whole parity group? (``ckptd status --group``)

A node can tell on its own only that its pieces were acknowledged; a group's step is *protected*
when every stripe of it has its parity: for every shard any member holds of the step, each of its
non-empty pieces is recorded as folded in by every parity holder of that piece's stripe, and every
shard a parity holder folded into the step's parity is still held, with the same manifest digest,
by the member that sent it (a failed save's piece mixed in leaves a parity that decodes nothing; a
member that lost its shard since has spent the stripe's redundancy). A holder that restarted has
lost its parity even though the senders' acknowledgements stand, so this asks every member
(``group_report``: its own held shards and the records of its parity buffers) and checks piece by
piece. A member that does not answer within the timeout makes every step degraded,
named as the reason; nothing is waited for longer (each member's whole exchange is bounded by it). Every
member's reachability is reported too (``members``), so one that does not answer shows even when no
step is held.

Wire (a piece op, ``layout.PIECE_OPS``): ``{"op": "group_report"}`` → ``{"op": "group_report",
"own": [[job, step, rank, digest, nbytes], …], "folded": [[job, step, stripe, member, rank,
digest], …], "copies": [[job, step, rank, digest], …]}`` (copies: shards held that are not the
member's own, e.g. rebuilt after a restart; absent from older members).
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable
from typing import Any

from ckptd.core import peer_protocol as pp
from ckptd.core.errors import ProtocolError
from ckptd.daemon.runtime import describe_error
from ckptd.daemon.tiers.peers.layout import ParityLayout
from ckptd.daemon.tiers.peers.link import PeerLink

REPORT_MAX = 200_000          # entries a member may list (own shards + folded records)


def report(own: Iterable[tuple[str, int, int, str, int]], folded: Iterable[tuple[str, int, int, int, int, str]],
           copies: Iterable[tuple[str, int, int, str]] = ()) -> dict[str, Any]:
    """A member's answer: its own held shards, what its parity buffers folded, and the other shards
    it holds (rebuilt or fetched)."""
    return {"op": "group_report", "own": [list(x) for x in own], "folded": [list(x) for x in folded],
            "copies": [list(x) for x in copies]}


async def ask(layout: ParityLayout, member: int, secret: bytes, timeout: float,
              tls: ssl.SSLContext | None) -> dict[str, Any] | str:
    """Member ``member``'s report, or why there is none."""
    link = PeerLink(layout.address(member), secret, layout.me, timeout, tls)
    try:
        await link.open()
        await pp.send(link.channel, {"op": "group_report"})
        reply, plen = await pp.recv(link.channel)
        if reply.get("op") != "group_report" or plen:
            return f"answered {str(reply.get('op'))[:40]!r}"
        return reply
    except (OSError, ProtocolError) as e:
        return describe_error(e)
    finally:
        link.close()


def entries(rep: dict[str, Any], key: str, n: int) -> list[tuple[Any, ...]]:
    items = rep.get(key)
    if not isinstance(items, list) or len(items) > REPORT_MAX:
        raise ValueError(f"bad {key!r} list")
    out = [tuple(x) for x in items if isinstance(x, list) and len(x) == n]
    if len(out) != len(items):
        raise ValueError(f"bad {key!r} entry")
    return out


def judge(layout: ParityLayout, reports: dict[int, dict[str, Any] | str]) -> list[dict[str, Any]]:
    """Per (job, step) any member holds: ``protected`` or ``degraded`` with the reasons, from every
    member's report (member → report, or why it has none)."""
    lost = {m: why for m, why in reports.items() if isinstance(why, str)}
    own: dict[tuple[str, int], list[tuple[int, int, str, int]]] = {}
    folded: set[tuple[Any, ...]] = set()
    holds: set[tuple[Any, ...]] = set()          # (member, job, step, rank, digest) of every shard held
    for m, rep in reports.items():
        if isinstance(rep, str):
            continue
        try:
            for job, step, rank, digest, nbytes in entries(rep, "own", 5):
                own.setdefault((job, step), []).append((m, rank, digest, nbytes))
                holds.add((m, job, step, rank, digest))
            folded |= {(m, *f) for f in entries(rep, "folded", 6)}
            holds |= {(m, *c) for c in (entries(rep, "copies", 4) if "copies" in rep else ())}
        except (ValueError, TypeError) as e:
            lost[m] = f"a malformed report: {e}"
    out = []
    for (job, step), shards in sorted(own.items(), key=lambda x: (str(x[0][0]), x[0][1])):
        why = [f"member {m} ({layout.address(m)}) unreachable: {r}" for m, r in sorted(lost.items())]
        for m, rank, digest, nbytes in sorted(shards):
            if type(nbytes) is not int or nbytes < 0:
                continue
            for piece in layout.cut(nbytes, m).pieces:
                stripe = layout.stripe(piece.stripe)
                for holder in stripe.parity if piece.length else ():
                    if holder not in lost and (holder, job, step, piece.stripe, m, rank, digest) not in folded:
                        why.append(f"rank {rank}'s piece of stripe {piece.stripe} is not in member {holder}'s parity")
        for holder, _, _, s, m, rank, digest in sorted(f for f in folded if f[1:3] == (job, step)):
            if holder not in lost and m not in lost and (m, job, step, rank, digest) not in holds:
                why.append(f"member {holder}'s parity of stripe {s} folds a shard of rank {rank} that member {m} "
                           "does not hold (another save's, or lost since)")
        out.append({"job": job, "step": step, "group": layout.group.index, "members": layout.size,
                    "ranks": len(shards), "state": "degraded" if why else "protected", "why": why[:20]})
    return out


async def bounded_ask(layout: ParityLayout, member: int, secret: bytes, timeout: float,
                      tls: ssl.SSLContext | None) -> dict[str, Any] | str:
    """``ask``, its whole exchange (connect, handshake, report) within ``timeout`` (each step of it is
    bounded by ``timeout`` alone)."""
    try:
        return await asyncio.wait_for(ask(layout, member, secret, timeout, tls), timeout)
    except asyncio.TimeoutError:
        return f"no answer within {timeout:g}s (peers.io_timeout): stopped, or its network gone?"


async def group_state(layout: ParityLayout, mine: dict[str, Any], secret: bytes, timeout: float,
                      tls: ssl.SSLContext | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """This node's group, every member asked at once (this node's own report is ``mine``): (each held
    step's state, as ``judge`` says; each member's reachability ``{member, address, reachable, why}``)."""
    others = [m for m in range(layout.size) if m != layout.member]
    got = await asyncio.gather(*(bounded_ask(layout, m, secret, timeout, tls) for m in others))
    reports = {layout.member: mine, **dict(zip(others, got, strict=True))}
    members = [{"member": m, "address": layout.address(m) if m != layout.member else "this node",
                "reachable": not isinstance(r, str), "why": r if isinstance(r, str) else None}
               for m, r in sorted(reports.items())]
    return judge(layout, reports), members
