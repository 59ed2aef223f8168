"""A parity group in one process: the daemon's own MemoryStore, ParityLayout, ParityHolder, ParityNode,
Rebuilder and PeerServer per node, talking the peer protocol over loopback TCP (no daemon around them,
so a test can hold shards of exact sizes and budgets). What a rebuild and a memory-level step's
protection must do when a step is saved again, or memory is short."""
from __future__ import annotations

import asyncio
import gc
import json
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from ports import free_port

from ckptd.core import peer_protocol as pp
from ckptd.core.codec import checksum
from ckptd.core.errors import ProtocolError
from ckptd.core.held import MAX_HELD_BYTES, HeldMeta, layout_checksums
from ckptd.core.peer_channel import SEND, Channel
from ckptd.core.schema import TensorLayout, digest_bytes
from ckptd.daemon.tiers.memory.memory_level import NotHeld
from ckptd.daemon.tiers.memory.store import Held, MemoryStore, new_memfd
from ckptd.daemon.tiers.peers.layout import ParityLayout
from ckptd.daemon.tiers.peers.link import PeerServer
from ckptd.daemon.tiers.peers.parity import ParityNode
from ckptd.daemon.tiers.peers.parity_hold import ParityHolder
from ckptd.daemon.tiers.peers.rebuild import Rebuilder
from ckptd.daemon.tiers.peers.stripes import piece_size

SECRET = b"s3cret-shared-by-every-node-0123456789"


@pytest.fixture(autouse=True)
def collected() -> Iterator[None]:
    """Each test's leftovers (its event loop's futures, sockets) finalized before the next starts.
    A finalizer that logs a traceback, run by a collection the interpreter starts inside pytest's
    AST rewriting of a module imported later (hypothesis's, at the end of a run of this file alone),
    parses source itself: Python 3.11's AST constructor keeps one depth count for both and raises
    SystemError ("AST constructor recursion depth mismatch")."""
    yield
    gc.collect()
CHUNK = 64 * 1024
JOB, STEP = "job", 5


class Node:
    def __init__(self, addrs: list[str], i: int, g: int, p: int, budget: int = 1 << 30) -> None:
        self.addr = addrs[i]
        self.store = MemoryStore(budget, 2)
        self.layout = ParityLayout.of(list(addrs), self.addr, g, p, 1)
        self.rebuilder = Rebuilder(self.store, self.layout, SECRET, 10.0)
        self.holder = ParityHolder(self.store, self.layout, self.rebuilder.reduce)
        self.server = PeerServer(self.store, SECRET, lambda job: None, lambda: None, 10.0, pieces=self.holder)
        self.parity = ParityNode(self.store, self.layout, SECRET, 0, 10.0, lambda job: None)

    def hold(self, rank: int, world: int, data: bytes, attempt: int = 1) -> Held:
        """Shard ``rank`` of JOB's STEP (one uint8 tensor of ``data``), held here; ``attempt`` makes its digest."""
        n = len(data)
        layout = (TensorLayout("w", "uint8", (n,), 0, n),)
        held = self.store.reserve(JOB, STEP, rank, n, "local")
        assert held is not None
        held.fd, held.mm = new_memfd(f"t-{rank}", n)
        held.mm[:n] = data
        sums = layout_checksums(memoryview(held.mm), layout, CHUNK)
        digest = digest_bytes(repr((JOB, STEP, rank, sums, attempt)).encode())
        self.store.filled(held, HeldMeta(JOB, STEP, rank, world, digest, n, CHUNK, sums, layout, None))
        return held


def group(n: int, g: int, p: int, **kw: Any) -> list[Node]:
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    return [Node(addrs, i, g, p, **kw) for i in range(n)]


async def started(nodes: list[Node]) -> None:
    for nd in nodes:
        host, port = nd.addr.rsplit(":", 1)
        await nd.server.start(host, int(port))


async def stopped(nodes: list[Node]) -> None:
    for nd in nodes:
        await nd.server.stop()


def data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class FakePeer:
    """A group member's address answered by an authenticated peer (the real handshake, the real secret)
    that lies: ``answer(request)`` gives its reply, the payload length the reply's header claims and the
    payload bytes it then sends. Every request is kept in ``asked``."""

    def __init__(self, addr: str, answer: Any) -> None:
        host, port = addr.rsplit(":", 1)
        self.lsock = socket.create_server((host, int(port)))
        self.lsock.setblocking(False)
        self.answer, self.asked = answer, list[dict[str, Any]]()
        self.tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._accept())]

    async def _accept(self) -> None:
        while True:
            conn, _ = await asyncio.get_running_loop().sock_accept(self.lsock)
            self.tasks.append(asyncio.ensure_future(self._serve(conn)))

    async def _serve(self, conn: socket.socket) -> None:
        ch = Channel(conn, 10.0)
        try:
            await pp.server_handshake(ch, SECRET)
            msg, _ = await pp.recv(ch)
            self.asked.append(msg)
            reply, claim, payload = self.answer(msg)
            body = json.dumps(reply).encode()
            frame = pp.PEER_HEADER.pack(pp.PEER_MAGIC, pp.PEER_VERSION, len(body), claim) + body + payload
            await ch.run(lambda: ch.sendall(frame), SEND)
            await ch.readable(30.0)          # until the asker hangs up
        except (OSError, ProtocolError):
            pass
        finally:
            ch.close()

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.lsock.close()


async def protect(nd: Node, held: Held) -> int:
    """``protect_now`` as the memory tier sees it: 1, or 0 where it raised NotHeld."""
    try:
        return await nd.parity.protect_now(held)
    except NotHeld:
        return 0


def test_a_step_saved_again_is_protected_by_its_own_pieces_only() -> None:
    """A step's shards were protected, the step failed (dropped) and was saved again with other bytes:
    each member withdraws its first attempt's pieces (drop_piece) before it sends the new ones, so the
    new save is protected by its own pieces, and a lost shard rebuilds to its new bytes. The holders refused the new
    pieces ("lane 0 of stripe 1 already holds member 0's rank 0"): a failed memory-level step's number
    could not be saved at the memory level again (and before that, its first attempt's acknowledgements
    had counted for the new bytes)."""
    sizes = [300_000 + 77_777 * i for i in range(4)]

    async def main() -> tuple[list[tuple[int, bool]], bytes | None]:
        nodes = group(4, 4, 1)
        await started(nodes)
        try:
            for i, nd in enumerate(nodes):
                assert await nd.parity.protect_now(nd.hold(i, 4, data(sizes[i], i))) == 1
            for i, nd in enumerate(nodes):
                nd.store.drop_step(JOB, STEP, {i})
            out, digests = [], {}
            for i, nd in enumerate(nodes):
                h = nd.hold(i, 4, data(sizes[i], 1000 + i), attempt=2)
                assert h.meta is not None
                digests[i] = h.meta.digest
                out.append((await protect(nd, h), nd.parity.protected(JOB, STEP, i, h.meta.nbytes, h.meta.digest)))
            nodes[1].store.drop_step(JOB, STEP, {1})            # node 1 lost its new shard
            held = await nodes[2].rebuilder.rebuild(JOB, STEP, 1, digests[1])
            return out, None if held is None or held.mm is None else bytes(held.mm[:sizes[1]])
        finally:
            await stopped(nodes)

    out, rebuilt = asyncio.run(main())
    assert out == [(1, True)] * 4
    assert rebuilt == data(sizes[1], 1001)


def test_a_rebuild_short_of_memory_never_evicts_the_survivors_shards() -> None:
    """Each holder has room for its shard and its parity, and 3/4 of a shard more: the rows a reduction
    decodes do not fit. It must refuse (the restore reads storage), not evict the shards held here: the
    oldest held, likeliest the very step being rebuilt, whose pieces the other holders' reductions
    fetch. Evicting them failed the rebuild anyway and lost every survivor's own shard from memory."""
    shard = 1_000_000

    async def main() -> tuple[Any, list[list[tuple[str, int, int]]], list[int]]:
        nodes = group(4, 4, 1, budget=shard + 335_872 + (768 << 10))
        await started(nodes)
        try:
            digests = {}
            for i, nd in enumerate(nodes):
                h = nd.hold(i, 4, data(shard, i))
                assert h.meta is not None and await nd.parity.protect_now(h) == 1
                digests[i] = h.meta.digest
            nodes[1].store.drop_step(JOB, STEP, {1})            # node 1 lost its shard
            held = await nodes[2].rebuilder.rebuild(JOB, STEP, 1, digests[1])
            return held, [sorted(nd.store.entries) for nd in nodes], [nd.store.totals.evicted for nd in nodes]
        finally:
            await stopped(nodes)

    held, entries, evicted = asyncio.run(main())
    assert held is None                                       # refused: over budget
    assert entries == [[(JOB, STEP, 0)], [], [(JOB, STEP, 2)], [(JOB, STEP, 3)]]
    assert evicted == [0, 0, 0, 0]


def test_a_parity_buffer_that_cannot_be_allocated_leaves_no_charge(tmp_path) -> None:
    """A holder whose shared memory is full (a 256 KiB tmpfs as its shm_dir; the buffer needs ~330 KiB)
    refuses the piece: the sender's shard is not protected, and the holder's budget is back to its own
    shard. The charge for the buffer stayed counted for good before, with an empty buffer kept."""
    import subprocess

    from ckptd.daemon import shm

    mnt = tmp_path / "shm"
    mnt.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        async def main() -> tuple[int, list[int], list[int]]:
            nodes = group(4, 4, 1)
            await started(nodes)
            try:
                held = [nd.hold(i, 4, data(1_000_000, i)) for i, nd in enumerate(nodes)]
                own = [nd.store.used for nd in nodes]
                shm.use_dir(str(mnt))          # from here, every buffer this process makes: the full tmpfs
                try:
                    got = await protect(nodes[0], held[0])
                finally:
                    shm.use_dir(None)
                return got, [nd.store.used - o for nd, o in zip(nodes, own, strict=True)], \
                    [len(nd.holder.units) for nd in nodes]
            finally:
                await stopped(nodes)

        protected, extra_used, units = asyncio.run(main())
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    assert protected == 0
    assert extra_used == [0, 0, 0, 0] and units == [0, 0, 0, 0]


def rebuild_past_a_liar(nodes: list[Node], sizes: list[int], *, gone: tuple[int, ...], liar: int,
                        lie: Any, rebuilder: int) -> tuple[bytes | None, list[str]]:
    """Every node holds and protects its rank's shard (``sizes``); node 1 loses it, the ``gone`` nodes
    stop, ``liar`` is replaced by a FakePeer answering with ``lie``, and node ``rebuilder`` rebuilds
    rank 1: (its bytes or None, the ops the liar was asked)."""
    world = len(nodes)

    async def main() -> tuple[bytes | None, list[str]]:
        await started(nodes)
        fake = None
        try:
            digests = {}
            for i, nd in enumerate(nodes):
                h = nd.hold(i, world, data(sizes[i], i))
                assert h.meta is not None and await nd.parity.protect_now(h) == 1
                digests[i] = h.meta.digest
            nodes[1].store.drop_step(JOB, STEP, {1})            # node 1 lost its shard
            for g in gone:
                await nodes[g].server.stop()
            await nodes[liar].server.stop()
            fake = FakePeer(nodes[liar].addr, lie)               # it answers, and lies
            held = await nodes[rebuilder].rebuilder.rebuild(JOB, STEP, 1, digests[1])
            got = bytes(held.mm[:sizes[1]]) if held is not None and held.mm is not None else None
            return got, [m["op"] for m in fake.asked]
        finally:
            if fake is not None:
                fake.close()
            await stopped([nd for i, nd in enumerate(nodes) if i != liar and i not in gone])
    return asyncio.run(main())


def test_a_peer_claiming_a_huge_piece_is_refused_before_allocating_and_the_rebuild_goes_on() -> None:
    """P = 2: node 1's shard is lost and node 2, still answering, lies to the parity holders reducing
    a stripe both are data members of: a piece of 1 TiB (as much as a frame may claim). A holder allocated what the
    peer claimed before reading a byte: MemoryError, not caught, killed its connection and every
    stripe's reduction with it, so the rebuild failed. It must ask for the length the record says,
    refuse any other at the header, decode without that row, and rebuild the shard."""
    sizes = [300_000 + 77_777 * i for i in range(4)]

    def lie(msg: dict[str, Any]) -> tuple[dict[str, Any], int, bytes]:
        if msg["op"] == "get_piece":
            return {"op": "piece", "checksum": "0" * 16}, MAX_HELD_BYTES, b""
        if msg["op"] == "get_parity":
            return {"op": "parity", "q": 0, "checksum": "0" * 16, "record": []}, MAX_HELD_BYTES, b""
        return {"op": "missing"}, 0, b""

    got, asked = rebuild_past_a_liar(group(4, 4, 2), sizes, gone=(), liar=2, lie=lie, rebuilder=0)
    assert "get_piece" in asked                               # a holder did ask the liar for its piece
    assert got == data(sizes[1], 1)


def test_a_parity_record_naming_no_member_is_not_used_and_the_rebuild_goes_on() -> None:
    """P = 3 in a group of 5: node 1's shard is lost and node 2 is gone, so a holder of their stripe
    needs another parity row. Node 0, replaced by a liar, answers get_parity with a row of the right
    size and checksum whose record names the member ``[]``: a TypeError (unhashable) escaped the
    holder's reduction and killed its connection, and so for every holder of the stripe. Its row must
    not be used, and the honest holder's row decodes the stripe."""
    n = 300_000
    row = bytes(piece_size(n, 5, 3))

    def lie(msg: dict[str, Any]) -> tuple[dict[str, Any], int, bytes]:
        if msg["op"] == "get_parity":
            q = ParityLayout.of(addrs, addrs[0], 5, 3, 1).stripe(msg["stripe"]).parity.index(0)
            return {"op": "parity", "q": q, "checksum": checksum(row), "record": [{"member": []}]}, len(row), row
        return {"op": "missing"}, 0, b""

    nodes = group(5, 5, 3)
    addrs = [nd.addr for nd in nodes]
    got, asked = rebuild_past_a_liar(nodes, [n] * 5, gone=(2,), liar=0, lie=lie, rebuilder=4)
    assert "get_parity" in asked                              # a holder did ask the liar for its row
    assert got == data(n, 1)


def test_group_state_is_degraded_when_a_parity_folds_a_shard_its_member_does_not_hold() -> None:
    """A parity buffer that folded a failed save's piece next to the committed one decodes neither:
    the step is degraded, named (it read protected: only the held shards' pieces were looked for)."""
    from ckptd.daemon.tiers.peers import group_state
    addrs = [f"127.0.0.1:{9000 + i}" for i in range(3)]
    lay = ParityLayout.of(addrs, addrs[0], 3, 1, 1)
    n = 90_000
    folded = [(JOB, STEP, p.stripe, 2, 0, "new") for p in lay.cut(n, 2).pieces if p.length]
    mine = {m: [x for x in folded if m in lay.stripe(x[2]).parity] for m in range(3)}
    def rep(m: int, extra: list[Any]) -> dict[str, Any]:
        own = [(JOB, STEP, 0, "new", n)] if m == 2 else []
        return group_state.report(own, mine[m] + extra)
    (ok,) = group_state.judge(lay, {m: rep(m, []) for m in range(3)})
    assert ok["state"] == "protected", ok
    stale = [(JOB, STEP, folded[0][2], 1, 1, "failed")]
    holder = next(m for m in range(3) if folded[0] in mine[m])
    (bad,) = group_state.judge(lay, {m: rep(m, stale if m == holder else []) for m in range(3)})
    assert bad["state"] == "degraded" and "member 1 does not hold" in bad["why"][0], bad


def test_a_piece_meeting_another_saves_buffer_is_refused_and_the_next_save_is_protected() -> None:
    """Every member protected a step; member 0's daemon then forgot it (restarted: no drop_piece sent)
    and saves the step with other bytes, after the others sent theirs again (the same bytes: acknowledged
    as folded already). The holders replaced the buffers holding member 0's old piece with fresh ones,
    taking the others' acknowledged pieces with them: committed as protected, not rebuildable. Now each
    such buffer is dropped and member 0's piece refused, saying why (its save fails); the save after it
    is protected by its own pieces, and a lost shard rebuilds to its bytes."""
    sizes = [300_000 + 77_777 * i for i in range(4)]

    async def main() -> tuple[str, list[int], bytes | None]:
        nodes = group(4, 4, 1)
        await started(nodes)
        try:
            held = [nd.hold(i, 4, data(sizes[i], i)) for i, nd in enumerate(nodes)]
            for nd, h in zip(nodes, held, strict=True):
                assert await nd.parity.protect_now(h) == 1
            nodes[0].parity = ParityNode(nodes[0].store, nodes[0].layout, SECRET, 0, 10.0, lambda job: None)
            for nd, h in zip(nodes[1:], held[1:], strict=True):
                assert await nd.parity.protect_now(h) == 1            # repeats
            held[0] = nodes[0].hold(0, 4, data(sizes[0], 1000), attempt=2)
            with pytest.raises(NotHeld) as refused:
                await nodes[0].parity.protect_now(held[0])
            again = [await protect(nd, h) for nd, h in zip(nodes, held, strict=True)]     # saved once more
            digest = held[1].meta.digest if held[1].meta else ""
            nodes[1].store.drop_step(JOB, STEP, {1})            # node 1 lost its shard
            got = await nodes[2].rebuilder.rebuild(JOB, STEP, 1, digest)
            return str(refused.value), again, None if got is None or got.mm is None else bytes(got.mm[:sizes[1]])
        finally:
            await stopped(nodes)

    refused, again, rebuilt = asyncio.run(main())
    assert "held another save's pieces (member 0's rank 0): dropped; this save is not protected" in refused, refused
    assert again == [1, 1, 1, 1]
    assert rebuilt == data(sizes[1], 1)


def test_a_holder_that_does_not_know_drop_piece_is_warned_of_and_its_kept_step_is_not_protected(caplog) -> None:
    """Member 2 is an older build: it folds pieces (its ``ok`` says nothing of ``drops``) and closes the
    connection on drop_piece, keeping a failed save's pieces. Member 0's step fails after its pieces went;
    the warning names the fix once, and a save of that step number again is not protected (NotHeld
    saying why) where it was committed "protected" over the old pieces; another step number is."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]

    async def main() -> tuple[str, int]:
        nodes = [Node(addrs, i, 3, 1) for i in range(3)]
        holder = nodes[2].holder
        new = holder.handle

        async def old(ch: Channel, msg: dict[str, Any], plen: int, node: str) -> None:
            if msg["op"] == "drop_piece":
                raise ProtocolError("bad peer request 'drop_piece'")       # (the server closes the connection)
            if msg["op"] != "put_piece":
                return await new(ch, msg, plen, node)
            reply = await holder._put(ch, msg, plen, node)
            reply.pop("drops", None)
            await pp.send(ch, reply)
        holder.handle = old          # type: ignore[method-assign]
        await started(nodes)
        try:
            nd = nodes[0]
            first = nd.hold(0, 2, data(3000, 1))
            assert await nd.parity.protect_now(first) == 1
            assert first.meta is not None
            nd.parity.withdraw([first.meta])          # the step failed later (the memory tier's abort)
            await nd.parity.drops.wait(None)
            again = nd.hold(0, 2, data(3000, 2), attempt=2)
            with pytest.raises(NotHeld) as refused:
                await nd.parity.protect_now(again)
            other = nd.store.reserve(JOB, STEP + 1, 0, 3000, "local")
            assert other is not None
            other.fd, other.mm = new_memfd("t-other", 3000)
            sums = layout_checksums(memoryview(other.mm), (TensorLayout("w", "uint8", (3000,), 0, 3000),), CHUNK)
            nd.store.filled(other, HeldMeta(JOB, STEP + 1, 0, 2, digest_bytes(b"other"), 3000, CHUNK, sums,
                                            (TensorLayout("w", "uint8", (3000,), 0, 3000),), None))
            return str(refused.value), await nd.parity.protect_now(other)
        finally:
            await stopped(nodes)

    with caplog.at_level("WARNING", logger="ckptd"):
        refused, other = asyncio.run(main())
    assert "run an older build that keeps a failed save's pieces" in refused, refused
    assert other == 1
    warned = [r for r in caplog.records if "does not know drop_piece" in r.getMessage()]
    assert len(warned) == 1 and "upgrade every member of a parity group together" in warned[0].getMessage()
