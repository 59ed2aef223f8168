"""Where parity lives: parity groups, the rotation of parity within a group, and a node's pieces.

Pure arithmetic on positions in the ``peers`` list (no I/O, no settings), so every node computes
the same answer from the same (peers order, group size G, parity P, jump) and nothing about the
layout ever has to be agreed over the network.

- Groups (:func:`groups`) follow the jump order copies use (``replicate.targets`` sends node i's
  copies to ``peers[(i + j·jump) % n]``): positions are walked 0, J, 2J, … (mod n), each cycle of
  ``+J`` from its smallest position, and cut into consecutive runs of G. With J = a rack's node
  count, any G ≤ racks consecutive positions of that walk lie in G different racks, so a group
  spans failure domains exactly as far as copies do. When G does not divide n the last group takes
  the remainder (G .. 2G − 1 members): a smaller group would hold more parity per node (P / (G' − P)
  of a shard) and survive the same P losses, a larger one holds less. Fewer than G nodes is an error.
- Rotation (:func:`rotation`): a group of g members has g stripes; stripe s puts parity row q
  (q = 0..P−1) on member (s + q) mod g and data slot t (t = 0..g−P−1) on member (s + P + t) mod g,
  RAID-5/6 style, so every member holds parity in exactly P stripes and data in g − P.
- Pieces (:func:`cut`): member m cuts its S bytes into g − P pieces of one size L (S / (g − P)
  rounded up to ``PIECE_ALIGN``); piece u is data slot u of stripe (m − P − u) mod g. Only the last
  non-empty piece may be short (and pieces past it empty): a piece is zero-padded to L, which costs
  nothing in the codec (zeros contribute zero parity) and is never stored or sent.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

# Piece boundaries fall on page boundaries: a piece is a page-aligned slice of a held shard's memfd
# (sendable and mappable without a copy), and the codec's sub-chunks of it stay aligned.
PIECE_ALIGN = 4096
# ISA-L through pyeclib encodes up to this many pieces per stripe (data + parity), comfortably.
MAX_GROUP = 64


def check_code(g: int, p: int) -> None:
    """Raise ValueError unless a group of ``g`` members can carry ``p`` parity pieces per stripe."""
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"parity P must be an integer >= 1, got {p!r}")
    if not isinstance(g, int) or g < p + 1:
        raise ValueError(f"group size G must be an integer >= P + 1 = {p + 1} (at least one data piece "
                         f"per stripe), got {g!r}")
    if g > MAX_GROUP:
        raise ValueError(f"group size G must be at most {MAX_GROUP}, got {g}")


def jump_order(n: int, jump: int) -> list[int]:
    """Positions 0..n−1 in the order copies spread: each cycle of ``+jump`` (mod n) from its smallest
    position, cycles in order of their smallest position."""
    if n < 1:
        raise ValueError(f"peers must hold at least one node, got n = {n}")
    if jump < 1:
        raise ValueError(f"jump must be >= 1, got {jump}")
    cycles = gcd(n, jump % n) if jump % n else n      # a jump that is a multiple of n: n cycles of one
    length = n // cycles
    return [(r + t * jump) % n for r in range(cycles) for t in range(length)]


@dataclass(frozen=True)
class Group:
    """One parity group: ``members`` are positions in the ``peers`` list, in rotation order (member
    index m is ``members[m]``)."""
    index: int
    members: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    def member(self, position: int) -> int:
        """The member index of the node at ``position`` in ``peers``."""
        try:
            return self.members.index(position)
        except ValueError:
            raise ValueError(f"peers position {position} is not in group {self.index} "
                             f"(members {list(self.members)})") from None


def groups(n: int, g: int, p: int, jump: int = 1) -> tuple[Group, ...]:
    """The parity groups of ``n`` nodes, groups of ``g`` (the last takes the remainder)."""
    check_code(g, p)
    if n < g:
        raise ValueError(f"parity groups of G = {g} need at least {g} nodes in peers, got {n}")
    order = jump_order(n, jump)
    count = n // g
    return tuple(Group(i, tuple(order[i * g: (i + 1) * g if i < count - 1 else n])) for i in range(count))


def group_of(n: int, g: int, p: int, jump: int, position: int) -> tuple[Group, int]:
    """The group of the node at ``position`` in ``peers``, and its member index there."""
    if not 0 <= position < n:
        raise ValueError(f"peers position must be in [0, {n}), got {position}")
    for group in groups(n, g, p, jump):
        if position in group.members:
            return group, group.member(position)
    raise AssertionError("groups cover every position")      # pragma: no cover


@dataclass(frozen=True)
class Stripe:
    """Stripe ``index`` of a group of ``size`` members: ``parity[q]`` is the member holding parity
    row q, ``data[t]`` the member holding data slot t. Codec rows: data slot t is row t, parity row
    q is row (size − P) + q."""
    index: int
    size: int
    parity: tuple[int, ...]
    data: tuple[int, ...]

    def row(self, member: int) -> int:
        """The codec row of ``member``'s piece in this stripe."""
        if member in self.data:
            return self.data.index(member)
        if member in self.parity:
            return len(self.data) + self.parity.index(member)
        raise ValueError(f"member must be in [0, {self.size}), got {member}")

    def holder(self, row: int) -> int:
        """The member holding codec ``row`` in this stripe."""
        if not 0 <= row < self.size:
            raise ValueError(f"row must be in [0, {self.size}), got {row}")
        k = len(self.data)
        return self.data[row] if row < k else self.parity[row - k]


def stripe(g: int, p: int, s: int) -> Stripe:
    """Stripe ``s`` of a group of ``g`` members with ``p`` parity rows."""
    check_code(g, p)
    if not 0 <= s < g:
        raise ValueError(f"stripe index must be in [0, {g}), got {s}")
    return Stripe(s, g, tuple((s + q) % g for q in range(p)), tuple((s + p + t) % g for t in range(g - p)))


def rotation(g: int, p: int) -> tuple[Stripe, ...]:
    """All ``g`` stripes of a group: every member holds parity in ``p`` of them and data in ``g − p``."""
    return tuple(stripe(g, p, s) for s in range(g))


def parity_stripes(g: int, p: int, member: int) -> tuple[int, ...]:
    """The stripes where ``member`` holds parity (row q of stripe (member − q) mod g)."""
    check_code(g, p)
    _check_member(g, member)
    return tuple((member - q) % g for q in range(p))


@dataclass(frozen=True)
class Piece:
    """Data piece ``number`` of a member's shard: bytes [offset, offset + length) of the shard, which
    is data slot ``number`` (codec row ``number``) of ``stripe``; zero-padded to the cut's ``size``."""
    number: int
    stripe: int
    offset: int
    length: int


@dataclass(frozen=True)
class Cut:
    """How one member's shard of ``total`` bytes is cut into ``g − p`` pieces of ``size`` bytes."""
    total: int
    g: int
    p: int
    member: int
    size: int
    pieces: tuple[Piece, ...]

    def piece_in(self, s: int) -> Piece:
        """This member's data piece in stripe ``s`` (ValueError where it holds parity there)."""
        for piece in self.pieces:
            if piece.stripe == s:
                return piece
        raise ValueError(f"member {self.member} holds parity, not data, in stripe {s} "
                         f"(group of {self.g}, P = {self.p})")


def piece_size(total: int, g: int, p: int) -> int:
    """L: the size every data piece of a shard of ``total`` bytes is padded to."""
    check_code(g, p)
    if not isinstance(total, int) or total < 0:
        raise ValueError(f"shard size must be an integer >= 0, got {total!r}")
    per = -(-total // (g - p))
    return -(-per // PIECE_ALIGN) * PIECE_ALIGN


def cut(total: int, g: int, p: int, member: int) -> Cut:
    """Member ``member``'s shard of ``total`` bytes as its ``g − p`` data pieces."""
    size = piece_size(total, g, p)
    _check_member(g, member)
    starts = [min(u * size, total) for u in range(g - p + 1)]
    pieces = tuple(Piece(u, (member - p - u) % g, starts[u], min(starts[u] + size, total) - starts[u])
                   for u in range(g - p))
    return Cut(total, g, p, member, size, pieces)


def stripe_size(totals: list[int] | tuple[int, ...], g: int, p: int, s: int) -> int:
    """The size of stripe ``s``'s parity pieces, given every member's shard size (``totals[m]``):
    the largest piece size among its data members (shorter pieces are zero-padded to it)."""
    if len(totals) != g:
        raise ValueError(f"need one shard size per member: {g}, got {len(totals)}")
    st = stripe(g, p, s)
    return max(piece_size(totals[m], g, p) for m in st.data)


def _check_member(g: int, member: int) -> None:
    if not isinstance(member, int) or not 0 <= member < g:
        raise ValueError(f"member index must be in [0, {g}), got {member!r}")
