"""The parity codec (XOR, Reed-Solomon through pyeclib) and the stripe layout: bytes equal after
every erasure pattern up to P losses, incremental folds equal one-shot encodes, every node derives
the same groups and rotation, and bad input is refused with an error that names it."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ckptd.daemon.tiers.peers import stripes
from ckptd.daemon.tiers.peers.erasure import ReedSolomonCodec, XorCodec, make_codec

CODES = [(g, p) for g in (4, 5, 8) for p in (1, 2)]


def _rows(k: int, sizes: list[int], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(sizes[j % len(sizes)]) for j in range(k)]


def _padded(b: bytes | memoryview, n: int) -> bytes:
    return bytes(b) + bytes(n - len(b))


@pytest.mark.parametrize(("g", "p"), CODES)
def test_every_erasure_pattern_up_to_p_decodes_bit_exact(g: int, p: int) -> None:
    k = g - p
    codec = make_codec(k, p)
    assert isinstance(codec, XorCodec if p == 1 else ReedSolomonCodec)
    size = 70_001                                        # over two RS calls, not a multiple of anything
    data = _rows(k, [size, size - 1, 5, 0], seed=g * 10 + p)  # uneven rows: short ones are zero-padded
    parity = codec.encode(data)
    rows = [_padded(d, size) for d in data] + [bytes(x) for x in parity]
    assert all(len(r) == size for r in rows)
    for n in range(1, p + 1):
        for lost in itertools.combinations(range(g), n):
            survivors = {r: (data[r] if r < k else parity[r - k]) for r in range(g) if r not in lost}
            out = codec.decode(survivors, list(lost), size)
            assert sorted(out) == sorted(lost)
            for r in lost:
                assert bytes(out[r]) == rows[r], f"G={g} P={p} lost {lost}: row {r} differs"


@pytest.mark.parametrize(("g", "p"), CODES)
def test_incremental_fold_equals_one_shot_encode(g: int, p: int) -> None:
    k = g - p
    codec = make_codec(k, p)
    size = 100_000
    data = _rows(k, [size, 40_000, 1], seed=7 + g + p)
    expect = [bytes(x) for x in codec.encode(data)]
    frame = 12_345                                       # frames cross RS call boundaries
    for q in range(p):
        folded = bytearray(size)
        order = [(j, o) for j in range(k) for o in range(0, len(data[j]), frame)]
        random.Random(q).shuffle(order)                  # rows and frames arrive in any order
        for j, o in order:
            codec.fold(folded, q, {j: data[j][o:o + frame]}, offset=o)
        assert bytes(folded) == expect[q]
        # the sender-side split: contribution at the data holder, an XOR at the parity holder
        split = bytearray(size)
        for j in range(k):
            codec.fold_contribution(split, codec.contribution({j: data[j]})[q])
        assert bytes(split) == expect[q]
        # several rows at once: one library call folds them all
        batched = bytearray(size)
        codec.fold(batched, q, {j: data[j] for j in range(0, k, 2)})
        codec.fold(batched, q, {j: data[j] for j in range(1, k, 2)})
        assert bytes(batched) == expect[q]


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("total", [0, 1, 2, 3, 4095, 4096, 4097, 3 * 4096 + 17, 100_003])
def test_uneven_shards_round_trip_through_their_pieces(p: int, total: int) -> None:
    """A group of 4 with shards of any size (smaller than G − P bytes, and 0): each member's pieces
    are cut, folded into their stripes' parity, and a lost member's pieces decode to its shard."""
    g = 4
    k = g - p
    rng = random.Random(total)
    shards = [rng.randbytes(total if m != 1 else total // 2 + 1) for m in range(g)]
    cuts = [stripes.cut(len(s), g, p, m) for m, s in enumerate(shards)]
    for c, s in zip(cuts, shards, strict=True):
        assert b"".join(s[x.offset: x.offset + x.length] for x in c.pieces) == s
        assert all(x.length <= c.size and c.size % stripes.PIECE_ALIGN == 0 for x in c.pieces)
    codec = make_codec(k, p)
    sizes = [len(s) for s in shards]
    parity: dict[tuple[int, int], bytearray] = {}
    for st in stripes.rotation(g, p):
        size = stripes.stripe_size(sizes, g, p, st.index)
        for q in range(p):
            parity[st.index, q] = bytearray(size)
        for t, m in enumerate(st.data):
            piece = cuts[m].piece_in(st.index)
            frame = shards[m][piece.offset: piece.offset + piece.length]
            for q in range(p):
                codec.fold(parity[st.index, q], q, {t: frame})
    for lost in range(g):                                 # rebuild each member's shard from the others
        rebuilt = bytearray(sizes[lost])
        for piece in cuts[lost].pieces:
            st = stripes.stripe(g, p, piece.stripe)
            size = stripes.stripe_size(sizes, g, p, st.index)
            survivors: dict[int, bytes | bytearray] = {}
            for m in range(g):
                if m == lost:
                    continue
                row = st.row(m)
                if row < k:
                    x = cuts[m].piece_in(st.index)
                    survivors[row] = shards[m][x.offset: x.offset + x.length]
                else:
                    survivors[row] = parity[st.index, row - k]
            out = codec.decode(survivors, [st.row(lost)], size)
            rebuilt[piece.offset: piece.offset + piece.length] = out[st.row(lost)][: piece.length]
        assert bytes(rebuilt) == shards[lost]


def test_more_than_p_losses_is_refused_clearly() -> None:
    for k, p in ((3, 1), (6, 2)):
        codec = make_codec(k, p)
        data = _rows(k, [1000], seed=1)
        parity = codec.encode(data)
        rows = list(data) + list(parity)
        lost = list(range(p + 1))
        with pytest.raises(ValueError, match="cannot decode.*needs k survivors"):
            codec.decode({r: rows[r] for r in range(k + p) if r not in lost}, lost, 1000)
        with pytest.raises(ValueError, match=f"got {k - 1} survivors"):
            codec.decode({r: rows[r] for r in range(1, k)}, [0], 1000)


def test_numpy_arrays_and_out_buffers_are_used_in_place() -> None:
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, 50_000, dtype=np.uint8) for _ in range(3)]
    for codec in (make_codec(3, 1), make_codec(3, 2)):
        out = [np.zeros(60_000, np.uint8) for _ in range(codec.p)]
        got = codec.encode([d.data for d in data], out=[o.data for o in out])
        for q in range(codec.p):
            assert bytes(got[q]) == out[q][:50_000].tobytes() and not out[q][50_000:].any()
        dst = np.full(50_000, 7, np.uint8)
        survivors = {1: data[1].data, 2: data[2].data, 3: got[0]}
        if codec.p == 2:
            survivors[4] = got[1]
        res = codec.decode(survivors, [0], 50_000, out={0: dst.data})
        assert np.array_equal(dst, data[0]) and bytes(res[0]) == data[0].tobytes()
    frame = b"abc"
    assert make_codec(3, 1).contribution({0: frame})[0].obj is frame     # one XOR frame: no copy


def test_bad_input_names_what_is_wrong() -> None:
    xor, rs = make_codec(3, 1), make_codec(3, 2)
    with pytest.raises(ValueError, match="data rows k must be"):
        make_codec(0, 1)
    with pytest.raises(ValueError, match="k \\+ p must be at most"):
        make_codec(64, 2)
    with pytest.raises(ValueError, match="XOR carries one parity row"):
        XorCodec(3, 2)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 64"):
        ReedSolomonCodec(3, 2, chunk=100)
    for codec in (xor, rs):
        with pytest.raises(ValueError, match="parity row index q must be in"):
            codec.fold(bytearray(10), codec.p, {0: b"x"})
        with pytest.raises(ValueError, match="data row must be in \\[0, 3\\)"):
            codec.fold(bytearray(10), 0, {3: b"x"})
        with pytest.raises(ValueError, match="no frames given"):
            codec.fold(bytearray(10), 0, {})
        with pytest.raises(ValueError, match="10 bytes at offset 5 do not fit parity of 12 bytes"):
            codec.fold(bytearray(12), 0, {0: bytes(10)}, offset=5)
        with pytest.raises(ValueError, match="parity must be writable"):
            codec.fold(bytes(12), 0, {0: bytes(10)})
        with pytest.raises(TypeError, match="frame of data row 0 must be a bytes-like object"):
            codec.fold(bytearray(12), 0, {0: "text"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="encode needs all k = 3 data rows, got 2"):
            codec.encode([b"a", b"b"])
        with pytest.raises(ValueError, match="out must hold one buffer per parity row"):
            codec.contribution({0: b"ab"}, out=[bytearray(2)] * (codec.p + 1))
        rows = {1: b"a", 2: b"b", 3: b"c", 4: b"d"}
        with pytest.raises(ValueError, match="row 1 is both missing and among the survivors"):
            codec.decode(rows, [1], 4)
        with pytest.raises(ValueError, match="survivor row 2 has 1 bytes, more than the stripe's 0"):
            codec.decode({2: b"b"}, [0], 0)
        with pytest.raises(ValueError, match="missing row must be in \\[0, "):
            codec.decode(rows, [9], 4)
        with pytest.raises(ValueError, match="missing rows repeat"):
            codec.decode(rows, [0, 0], 4)
        with pytest.raises(ValueError, match="size must be an integer >= 0"):
            codec.decode(rows, [0], -1)
        with pytest.raises(ValueError, match="out must hold one buffer per missing row"):
            codec.decode({1: b"a", 2: b"b", 3: b"c"}, [0], 4, out={1: bytearray(4)})


# ---- stripes: groups, rotation, pieces -------------------------------------------------------

@pytest.mark.parametrize(("n", "g", "jump"), [(4, 4, 1), (8, 4, 4), (10, 4, 1), (12, 8, 3), (9, 3, 3), (16, 8, 4),
                                              (7, 5, 2), (6, 3, 6)])
def test_groups_cover_every_node_once_and_every_node_agrees(n: int, g: int, jump: int) -> None:
    gs = stripes.groups(n, g, 1, jump)
    members = [m for grp in gs for m in grp.members]
    assert sorted(members) == list(range(n))
    assert len(gs) == n // g and all(g <= grp.size < 2 * g for grp in gs)
    assert [grp.size for grp in gs[:-1]] == [g] * (len(gs) - 1)
    for pos in range(n):                                 # each node, computing alone, finds the same group
        grp, m = stripes.group_of(n, g, 1, jump, pos)
        assert grp in gs and grp.members[m] == pos


def test_a_jump_of_a_rack_puts_a_group_in_different_racks() -> None:
    racks, per_rack = 8, 4                               # peers listed rack by rack
    for grp in stripes.groups(racks * per_rack, 8, 2, jump=per_rack):
        assert len({pos // per_rack for pos in grp.members}) == 8
    for grp in stripes.groups(6 * 4, 4, 1, jump=4):      # G smaller than the rack count
        assert len({pos // 4 for pos in grp.members}) == 4


@pytest.mark.parametrize(("g", "p"), [*CODES, (13, 2), (3, 2)])
def test_rotation_gives_every_member_p_parity_and_g_minus_p_data_stripes(g: int, p: int) -> None:
    rot = stripes.rotation(g, p)
    assert len(rot) == g
    for st in rot:
        assert sorted(st.parity + st.data) == list(range(g))
        assert [st.holder(st.row(m)) for m in range(g)] == list(range(g))
    for m in range(g):
        par = [st.index for st in rot if m in st.parity]
        assert sorted(par) == sorted(stripes.parity_stripes(g, p, m)) and len(par) == p
        c = stripes.cut(10 * stripes.PIECE_ALIGN, g, p, m)
        assert sorted(x.stripe for x in c.pieces) == [st.index for st in rot if m in st.data]
        for x in c.pieces:                               # piece u is data slot (= codec row) u of its stripe
            assert rot[x.stripe].data[x.number] == m and rot[x.stripe].row(m) == x.number
    assert stripes.rotation(g, p) == rot                 # pure: the same on every node


def test_stripe_and_group_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="parity P must be an integer >= 1"):
        stripes.groups(8, 4, 0)
    with pytest.raises(ValueError, match="group size G must be an integer >= P \\+ 1 = 3"):
        stripes.groups(8, 2, 2)
    with pytest.raises(ValueError, match="need at least 8 nodes in peers, got 5"):
        stripes.groups(5, 8, 1)
    with pytest.raises(ValueError, match="jump must be >= 1"):
        stripes.groups(8, 4, 1, jump=0)
    with pytest.raises(ValueError, match="peers position must be in \\[0, 8\\), got 8"):
        stripes.group_of(8, 4, 1, 1, 8)
    with pytest.raises(ValueError, match="stripe index must be in \\[0, 4\\), got 4"):
        stripes.stripe(4, 1, 4)
    with pytest.raises(ValueError, match="member index must be in \\[0, 4\\), got 4"):
        stripes.cut(10, 4, 1, 4)
    with pytest.raises(ValueError, match="shard size must be an integer >= 0, got -1"):
        stripes.cut(-1, 4, 1, 0)
    with pytest.raises(ValueError, match="member 0 holds parity, not data, in stripe 0"):
        stripes.cut(10, 4, 1, 0).piece_in(0)
    with pytest.raises(ValueError, match="need one shard size per member: 4, got 3"):
        stripes.stripe_size([1, 2, 3], 4, 1, 0)
    with pytest.raises(ValueError, match="is not in group 0"):
        stripes.groups(8, 4, 1)[0].member(7)
