"""Where this node sits in parity redundancy (``[peers] redundancy = "parity"``), and the piece ops' wire.

Every node computes the same layout from the same settings (``peers`` order, G, P, ``jump``):
:func:`stripes.group_of` gives this node its group and member index m; the group's g members have
g stripes (``stripes.rotation``). Ranks onto members: **each held shard of a member (one rank) is
its own member data**, cut by ``stripes.cut(nbytes, g, P, m)``. Several ranks on one node are kept
apart by *lanes*: a node numbers its held shards of a step 0, 1, 2, … in the order they became held
(lane), and a parity holder keeps one parity buffer per (job, step, stripe, lane), folding in at
most one shard per member. Lanes need no agreement between nodes: a holder records which (member,
rank, manifest digest, size) it folded into each buffer, and a rebuild reads that record, so a
replacement node rebuilds rank r by asking for "the buffer of stripe s that holds rank r". A member
with fewer shards in a step than another simply contributes nothing (zeros) to the higher lanes.

Wire (after the peer handshake, ``ckptd.core.peer_protocol``), each payload checked with xxh3-64:

    {"op": "put_piece", job, step, rank, digest, stripe, lane, member, checksum, meta} + piece
        → {"op": "ok", "drops": true} | {"op": "error", "reason"}   (the holder folds it into its parity
          buffer; refused, that buffer dropped, when it is another save's: parity_hold.py)
    {"op": "get_parity", job, step, stripe, rank, digest}
        → {"op": "parity", q, lane, checksum, record, meta} + parity buffer | {"op": "missing"}
    {"op": "get_piece", job, step, rank, digest, stripe}
        → {"op": "piece", checksum} + the held shard's data piece in that stripe | {"op": "missing"}

    {"op": "reduce_piece", job, step, stripe, rank, digest}
        → {"op": "piece", checksum, member, meta} + the named shard's piece in that stripe, decoded by this
          parity holder from its parity and the stripe's other rows (rebuild.py) | {"op": "missing"}
          | {"op": "error", reason}

    {"op": "group_report"} → this node's held shards and its parity buffers' records (group_state.py)

    {"op": "drop_piece", job, step, member, rank, digest} → {"op": "ok", "drops": true, dropped}
        (that member's save of the step failed: the buffers that folded the shard go; a holder of an
        older build closes the connection: parity.py)

``record`` lists ``{member, rank, digest, nbytes}`` of every shard folded into the buffer; ``meta`` is
the named rank's held meta (layout and per-chunk checksums) as the sender sent it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ckptd.daemon.tiers.peers.erasure import ParityCodec, make_codec
from ckptd.daemon.tiers.peers.stripes import Cut, Group, Stripe, cut, group_of, stripe

PIECE_OPS = ("put_piece", "get_parity", "get_piece", "reduce_piece", "group_report", "drop_piece")


@dataclass(frozen=True)
class ParityLayout:
    """This node's group and member index, and the group's codec."""
    peers: tuple[str, ...]
    me: str
    g_setting: int
    p: int
    jump: int
    group: Group
    member: int
    codec: ParityCodec

    @classmethod
    def of(cls, peers: list[str], me: str, g: int, p: int, jump: int) -> ParityLayout:
        if me not in peers:
            raise ValueError(f"this node ({me}) is not in peers")
        group, member = group_of(len(peers), g, p, jump, peers.index(me))
        return cls(tuple(peers), me, g, p, jump, group, member, make_codec(group.size - p, p))

    @property
    def size(self) -> int:
        """g: members of this node's group (G, or more for the last group)."""
        return self.group.size

    def stripe(self, s: int) -> Stripe:
        return stripe(self.size, self.p, s)

    def cut(self, nbytes: int, member: int | None = None) -> Cut:
        return cut(nbytes, self.size, self.p, self.member if member is None else member)

    def address(self, member: int) -> str:
        """The peer address of ``member`` of this node's group."""
        return self.peers[self.group.members[member]]

    def holders(self, s: int) -> list[tuple[int, str]]:
        """(q, address) of stripe ``s``'s parity holders."""
        return [(q, self.address(m)) for q, m in enumerate(self.stripe(s).parity)]
