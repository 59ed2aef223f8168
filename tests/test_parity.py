"""Erasure-coded peer redundancy (issue 24): daemons on loopback stand for nodes of one parity group;
a lost node's rank is rebuilt from the other members' pieces and parity, checked, or storage serves."""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote
from procfd import open_fds

import ckptd_client
from ckptd.daemon.settings.config import ConfigError, load_settings

from test_acceptance import free_port
from test_memory_tier import assert_equal, remove_data_files, status, zeros_like
from test_peers import peer_args, secret_file, wait_for

JOB, STEP, WORLD = "par", 3, 4
PARITY = ("--peer-redundancy", "parity", "--peer-group", "4", "--peer-parity", "1")
PROBE = ("--peer-probe-interval", "0.5s")

# One rank per node: saves STEP of its state (sizes differ per rank) through the relay commit, then waits
# for the others so rank 0's store outlives them.
RANK = textwrap.dedent("""
    import sys, torch, ckptd_client
    from datetime import timedelta
    sys.path.insert(0, sys.argv[5])
    from test_parity import state_for
    sock, job, rank, world, _, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
        sys.argv[5], int(sys.argv[6])
    store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    ck = ckptd_client.Checkpointer(job, socket=sock, rank=rank, world_size=world, store=store, commit="relay",
                                   commit_timeout=60)
    ck.save(int(sys.argv[7]), state_for(rank)).wait(120)
    if sys.argv[8] == "memory":             # and a memory-level step after it: held, never written
        ck.save(int(sys.argv[7]) + 1, state_for(rank, memory=True), level="memory").wait(120)
    ck.close()
    store.set(f"done{rank}", "1")
    if rank == 0:
        store.wait([f"done{r}" for r in range(world)], timedelta(seconds=100))
    print("SAVED", flush=True)
""")


def state_for(rank: int, memory: bool = False) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state: shards of different sizes, so pieces and parity buffers differ too."""
    g = torch.Generator().manual_seed(100 + rank + 1000 * memory)
    return {"w": torch.randn(200_000 + 37_000 * rank, generator=g), "b": torch.randn(1000, generator=g).bfloat16()}


def start_group(daemon_factory, tmp: Path, memory: bool = False, n: int = WORLD, per_node: int = 1,
                parity: tuple[str, ...] = PARITY) -> tuple[list[Any], list[str], Path]:
    """``n`` nodes in parity groups (``parity``: G = 4, P = 1), ``per_node`` ranks each (rank r on node
    r // per_node); step STEP saved (and STEP + 1 at the memory level with ``memory``) and protected
    on every node."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    nodes = [daemon_factory(*peer_args(a, addrs, secret, *parity), name=f"n{i}") for i, a in enumerate(addrs)]
    port, world = free_port(), n * per_node
    procs = [zygote.popen([sys.executable, "-c", RANK, str(nodes[r // per_node].socket), JOB, str(r), str(world),
                           str(Path(__file__).parent), str(port), str(STEP), "memory" if memory else "storage"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0 and "SAVED" in out, out + "".join(n.log_text() for n in nodes)
    for node in nodes:
        wait_for(lambda: protected(node.socket), f"{node} step {STEP} protected")   # noqa: B023 (called at once)
    return nodes, addrs, secret


@pytest.fixture
def group(daemon_factory, tmp):
    return start_group(daemon_factory, tmp)


def protected(sock: Path) -> bool:
    return any(s["step"] == STEP and s["committed"] and s.get("protected") for s in status(sock)["memory"]["held"])


def group_status(sock: Path) -> list[dict[str, Any]]:
    from ckptd.core import protocol
    return [g for g in protocol.request_once(str(sock), {"op": "status", "group": True})["groups"]
            if g["job"] == JOB]


def restore_rank(sock: Path, rank: int, world: int = WORLD) -> ckptd_client.Checkpointer:
    want = state_for(rank)
    target = zeros_like(want)
    ck = ckptd_client.Checkpointer(JOB, socket=str(sock), rank=rank, world_size=world)
    assert ck.restore(target, step=STEP) == STEP
    assert_equal(target, want)
    return ck


def test_lost_node_rebuilt_from_parity_bit_exact(daemon_factory, tmp):
    """Acceptance 1: 4 daemons, G = 4, P = 1, 8 ranks (2 per daemon): after the commit every node's step
    is protected and each node holds parity for the group; node 1's daemon is SIGKILLed and every data
    file deleted; a survivor, then a fresh daemon for node 1, rebuilds ranks 2 and 3 from the other
    three nodes (no byte from storage), bit-exact. The survivors' probes then find the pieces node 1
    held gone and send them to the fresh daemon again: the group is protected again, and its parity
    is right: node 3 lost next, its ranks are rebuilt through the fresh node's parity, bit-exact."""
    nodes, addrs, secret = start_group(daemon_factory, tmp, per_node=2, parity=PARITY + PROBE)
    st = status(nodes[0].socket)["memory"]
    assert st["redundancy"] == "parity" and st["parity_held_bytes"] > 0
    text = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(nodes[0].socket)],
                          capture_output=True, text=True, timeout=60).stdout
    assert f"job={JOB} step={STEP} protected, committed" in text, text
    assert "parity, " in text and "of parity held" in text, text
    (whole,) = group_status(nodes[0].socket)                 # every member asked: all the group's parity is there
    assert (whole["step"], whole["state"], whole["ranks"], whole["why"]) == (STEP, "protected", 2 * WORLD, []), whole
    nodes[1].kill()
    (after,) = group_status(nodes[2].socket)
    assert after["state"] == "degraded" and after["why"][0].startswith(f"member 1 ({addrs[1]}) unreachable"), after
    assert remove_data_files(nodes[0].root, JOB) == 2 * WORLD
    ck = restore_rank(nodes[2].socket, 2, world=2 * WORLD)       # any survivor of the group rebuilds it too
    assert ck.last_restore.source == "peer" and ck.last_restore.from_storage == 0, ck.last_restore
    fresh = daemon_factory(*peer_args(addrs[1], addrs, secret, *PARITY, *PROBE), name="n1b")
    for rank in (2, 3):
        ck = restore_rank(fresh.socket, rank, world=2 * WORLD)
        assert ck.last_restore.source == "peer" and ck.last_restore.from_storage == 0, ck.last_restore
    log = fresh.log_text()
    assert "rebuilt from parity" in log and "fetched from peer" in log, log[-3000:]
    # Rank 2, which node 2 rebuilt above and holds, is fetched whole from it; rank 3 is decoded, each
    # stripe at its parity holder: the fresh node took in exactly rank 3's bytes by rebuild.
    mem = status(fresh.socket)["memory"]
    (held,) = [s for s in mem["held"] if s["step"] == STEP]
    shard3 = sum(t.numel() * t.element_size() for t in state_for(3).values())
    assert sorted(held["ranks"]) == ["2", "3"] and shard3 <= mem["rebuild_received_bytes"] < shard3 + 4096, mem
    assert sum(status(n.socket)["memory"]["reduce_fetched_bytes"] for n in (nodes[0], nodes[2], nodes[3])) > 0
    # The replacement started with none of the parity member 1 held; the other members' probes send
    # their pieces to it again, and the group's step is protected again.
    wait_for(lambda: [g["state"] for g in group_status(nodes[0].socket)] == ["protected"],
             "the group protected again", 60)
    for n in (nodes[0], nodes[2], nodes[3]):
        assert "parity piece gone from its holder; sent again" in n.log_text()
    assert fresh.log_text().count("parity piece folded") > 0
    nodes[3].kill()                 # node 3 lost next: its stripes decode through the fresh node's parity too
    fresh3 = daemon_factory(*peer_args(addrs[3], addrs, secret, *PARITY), name="n3b")
    for rank in (6, 7):
        ck = restore_rank(fresh3.socket, rank, world=2 * WORLD)
        assert ck.last_restore.source == "peer" and ck.last_restore.from_storage == 0, ck.last_restore


def test_memory_level_step_rebuilt_from_parity(daemon_factory, tmp):
    """A memory-level step is durable once its pieces are in their parity; with node 1 lost, its rank
    restores the memory-level step rebuilt from the group, no byte from storage."""
    nodes, addrs, secret = start_group(daemon_factory, tmp, memory=True)
    held = {(s["step"], s.get("protected")) for s in status(nodes[1].socket)["memory"]["held"]}
    assert (STEP + 1, True) in held, held          # (only the memory level has that step)
    nodes[1].kill()
    fresh = daemon_factory(*peer_args(addrs[1], addrs, secret, *PARITY), name="n1b")
    want = state_for(1, memory=True)
    target = zeros_like(want)
    ck = ckptd_client.Checkpointer(JOB, socket=str(fresh.socket), rank=1, world_size=WORLD)
    assert ck.restore(target) == STEP + 1
    assert ck.last_restore.level == "memory" and ck.last_restore.from_storage == 0, ck.last_restore
    assert_equal(target, want)


def test_two_ranks_per_node_two_lost_with_p2(daemon_factory, tmp):
    """Acceptance 2 (P = 2, lighter: 5 daemons, G = 5, 2 ranks per node, so two lanes): nodes 1 and 3
    lost; a fresh daemon for node 1 rebuilds ranks 2 and 3 (Reed-Solomon), bit-exact, none from storage."""
    p2 = ("--peer-redundancy", "parity", "--peer-group", "5", "--peer-parity", "2")
    nodes, addrs, secret = start_group(daemon_factory, tmp, n=5, per_node=2, parity=p2)
    nodes[1].kill()
    nodes[3].kill()
    assert remove_data_files(nodes[0].root, JOB) == 10
    fresh = daemon_factory(*peer_args(addrs[1], addrs, secret, *p2), name="n1b")
    for rank in (2, 3):
        ck = restore_rank(fresh.socket, rank, world=10)
        assert ck.last_restore.source == "peer", ck.last_restore


def test_two_lost_with_p1_falls_back_to_storage_and_says_why(group, daemon_factory):
    """Acceptance 2 (P = 1): two nodes of the group lost; the rebuild gives up and the restore reads storage."""
    nodes, addrs, secret = group
    nodes[1].kill()
    nodes[2].kill()
    fresh = daemon_factory(*peer_args(addrs[1], addrs, secret, *PARITY, "--peer-io-timeout", "2"), name="n1b")
    ck = restore_rank(fresh.socket, 1)
    assert ck.last_restore.source == "storage", ck.last_restore
    log = fresh.log_text()
    assert "parity rebuild failed" in log and "more than P = 1" in log, log[-3000:]


def test_a_live_members_shard_is_fetched_from_it_when_a_parity_holder_is_lost(group):
    """Node 1 lost, every data file deleted: a restore on node 0 of ranks 2 and 3 (another world's
    reads: shards node 0 does not hold) went through each stripe's parity holder, and where that was
    node 1 it gave up and read storage, which was gone. Their owners, alive, hold them: they are fetched
    from there, bit-exact, and no byte comes from storage; node 1's own rank is still decoded."""
    nodes, addrs, secret = group
    nodes[1].kill()
    assert remove_data_files(nodes[0].root, JOB) == WORLD
    for rank in (2, 3, 1):
        ck = restore_rank(nodes[0].socket, rank)
        assert ck.last_restore.source == "peer" and ck.last_restore.from_storage == 0, (rank, ck.last_restore)
        ck.close()
    log = nodes[0].log_text()
    assert "fetched from peer" in log and "rebuilt from parity" in log, log[-3000:]


def test_corrupt_parity_is_detected_never_served(group, daemon_factory):
    """Acceptance 3: a byte flipped in a holder's parity buffer (its memfd, through /proc) is caught by
    the rebuilt shard's checksums; the restore reads storage, bit-exact."""
    nodes, addrs, secret = group
    flipped = set()
    for fd, target, inode in open_fds(nodes[0].pid):
        # stripe 0 holds rank 1's first piece, its parity on member 0 (the buffer's fd and its mapping's dup)
        if f"ckptd-parity-{JOB}-{STEP}-s0-" in target and inode not in flipped:
            with open(fd, "r+b") as f:
                f.seek(100)
                b = f.read(1)
                f.seek(100)
                f.write(bytes([b[0] ^ 0x40]))
            flipped.add(inode)
    assert len(flipped) == 1
    nodes[1].kill()
    fresh = daemon_factory(*peer_args(addrs[1], addrs, secret, *PARITY), name="n1b")
    ck = restore_rank(fresh.socket, 1)
    assert ck.last_restore.source == "storage", ck.last_restore
    assert "fails its checksums" in fresh.log_text()


def test_piece_ops_check_checksums_sizes_and_repeats(group):
    """The piece ops on the wire: a holder answers get_parity with the record and meta; a put_piece
    whose payload fails its checksum is refused (nothing folded), one of the wrong size drops the
    connection, a repeated piece is acknowledged without folding it twice (the parity is unchanged)."""
    nodes, addrs, secret = group
    from ckptd.core import peer_protocol as pp
    from ckptd.core.codec import checksum
    from ckptd.core.errors import ProtocolError
    from ckptd.daemon.tiers.peers.link import PeerLink
    from ckptd.daemon.tiers.peers.stripes import cut

    async def ask(msg: dict[str, Any], payload: bytes | None = None) -> tuple[dict[str, Any], bytes]:
        link = await PeerLink(addrs[0], secret.read_bytes().strip(), "test", 5.0).open()
        try:
            await pp.send(link.channel, msg, payload)
            reply, plen = await pp.recv(link.channel, 1 << 30)
            data = bytearray(plen)
            await pp.recv_payload(link.channel, memoryview(data))
            return reply, bytes(data)
        finally:
            link.close()

    async def run() -> None:
        # stripe 0's parity is on member 0 (node 0); rank 1 (member 1) has its first piece there
        reply, parity = await ask({"op": "get_parity", "job": JOB, "step": STEP, "stripe": 0, "rank": 1,
                                   "digest": status_digest()})
        assert reply["op"] == "parity" and reply["q"] == 0 and checksum(parity) == reply["checksum"]
        assert sorted(f["rank"] for f in reply["record"]) == [1, 2, 3]       # member 0 holds parity there
        meta = reply["meta"]
        piece = cut(meta["nbytes"], 4, 1, 1).piece_in(0)
        body = bytes(range(256)) * (piece.length // 256) + bytes(piece.length % 256)
        put = {"op": "put_piece", "job": JOB, "step": STEP, "rank": 1, "digest": meta["digest"], "stripe": 0,
               "lane": 0, "member": 1, "meta": meta}
        bad, _ = await ask({**put, "lane": 1, "checksum": "0" * 16}, body)
        assert bad["op"] == "error" and "checksum" in bad["reason"], bad
        with pytest.raises((ProtocolError, OSError)):       # refused before its payload is read: dropped
            await ask({**put, "lane": 1, "checksum": checksum(body[:-1])}, body[:-1])
        again, _ = await ask({**put, "checksum": checksum(body)}, body)
        assert again["op"] == "ok"                       # lane 0 already holds member 1's rank 1: not refolded
        reply2, parity2 = await ask({"op": "get_parity", "job": JOB, "step": STEP, "stripe": 0, "rank": 1,
                                     "digest": meta["digest"]})
        assert parity2 == parity and reply2["record"] == reply["record"]

    def status_digest() -> str:
        from ckptd.core.names import step_dir
        from ckptd.core.reader import StepReader
        return str(StepReader(step_dir(str(nodes[0].root), JOB, STEP)).rank_entry(1)["manifest_digest"])

    asyncio.run(run())


def test_parity_settings_are_checked(tmp):
    """G >= P + 2 and at least G nodes in peers, said at start with the key."""
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    addrs = [f"127.0.0.1:{7000 + i}" for i in range(3)]
    env = {"CKPTD_ROOT": str(tmp), "CKPTD_PEERS_LISTEN": addrs[0], "CKPTD_PEERS_PEERS": ",".join(addrs),
           "CKPTD_PEERS_SECRET_FILE": str(secret), "CKPTD_PEERS_REDUNDANCY": "parity"}
    with pytest.raises(ConfigError, match="need at least 4 nodes in peers"):
        load_settings(None, env={**env, "CKPTD_PEERS_GROUP": "4"})
    with pytest.raises(ConfigError, match="G >= P \\+ 2"):
        load_settings(None, env={**env, "CKPTD_PEERS_GROUP": "3", "CKPTD_PEERS_PARITY": "2"})
    with pytest.raises(ConfigError, match="must be one of"):
        load_settings(None, env={**env, "CKPTD_PEERS_REDUNDANCY": "raid"})
    assert load_settings(None, env={**env, "CKPTD_PEERS_GROUP": "3"})["peers.group"] == 3


def test_parity_piece_sends_and_failures_in_status_and_metrics(daemon_factory, tmp, capsys):
    """Parity mode's sends are its pieces: status and the ckptd_peer_* metrics count them (they read only
    copies mode's replicator, so a node whose holders were all gone showed 0 failures, 0 bytes sent), the
    text says pieces, and ckptd_memory_degraded_steps counts the held step left unprotected."""
    from ckptd.cli import main

    from test_metrics import scrape
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    args = ("--peer-redundancy", "parity", "--peer-group", "3", "--peer-parity", "1", "--peer-io-timeout", "2",
            "--metrics-address", "0")
    nodes = [daemon_factory(*peer_args(a, addrs, secret, *args), name=f"n{i}") for i, a in enumerate(addrs)]
    address = status(nodes[0].socket)["metrics"]
    ck = ckptd_client.Checkpointer(JOB, socket=str(nodes[0].socket))
    ck.save(1, {"w": torch.randn(1 << 18)}).wait(60)
    wait_for(lambda: any(s.get("protected") for s in status(nodes[0].socket)["memory"]["held"]), "step 1 protected")
    m = scrape(address)
    assert m["ckptd_peer_sent_bytes_total"] == 1 << 20 and m["ckptd_peer_replication_failures_total"] == 0
    assert sum(v for k, v in m.items() if k.startswith("ckptd_peer_target_sent_bytes_total{")) == 1 << 20
    assert m["ckptd_memory_degraded_steps"] == 0
    nodes[1].kill()
    nodes[2].kill()
    ck.save(2, {"w": torch.randn(1 << 18)}).wait(60)
    wait_for(lambda: status(nodes[0].socket)["memory"]["replication_failures"] == 2, "both piece sends failed")
    mem = status(nodes[0].socket)["memory"]
    assert mem["degraded_steps"] == 1 and {c["failures"] for c in mem["peers"].values()} == {1}
    m = scrape(address)
    assert m["ckptd_peer_replication_failures_total"] == 2 and m["ckptd_memory_degraded_steps"] == 1
    assert {m[f'ckptd_peer_target_replication_failures_total{{peer="{a}"}}'] for a in addrs[1:]} == {1}
    capsys.readouterr()
    assert main(["status", "--socket", str(nodes[0].socket)]) == 0
    out = capsys.readouterr().out
    assert "piece failures=2 sent 1.0 MiB of pieces, 1 held step(s) degraded" in out, out
    assert f"  peer {addrs[1]}: sent 0.5 MiB, 1 failed pieces" in out, out
    ck.close()


PROBED_TRIO = ("--peer-redundancy", "parity", "--peer-group", "3", "--peer-parity", "1", "--peer-io-timeout", "1",
               *PROBE)


def probed_trio(daemon_factory: Any, tmp: Path) -> tuple[list[Any], list[str], Path, Any]:
    """3 nodes (G = 3, P = 1, probe 0.5 s), node 0 having saved step 1 (one rank, 1 MiB); and a
    function telling whether node 0 counts step 1 protected."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    nodes = [daemon_factory(*peer_args(a, addrs, secret, *PROBED_TRIO), name=f"n{i}") for i, a in enumerate(addrs)]
    with ckptd_client.Checkpointer(JOB, socket=str(nodes[0].socket)) as ck:
        ck.save(1, {"w": torch.randn(1 << 18)}).wait(60)

    def counted() -> bool | None:
        (one,) = [s for s in status(nodes[0].socket)["memory"]["held"] if s["step"] == 1]
        return one.get("protected")
    wait_for(lambda: counted() is True, "step 1 protected")
    return nodes, addrs, secret, counted


def test_a_stopped_parity_holders_pieces_stop_counting_and_count_again_when_it_answers(daemon_factory, tmp):
    """The probe in parity mode: with a holder stopped (SIGSTOP), node 0's newest step is no longer
    counted protected (its pieces there cannot be confirmed: degraded_steps 1); resumed, the holder
    answers folding them, and the step counts as protected again without a piece sent twice."""
    import signal

    from procfd import sigstop
    nodes, _, _, counted = probed_trio(daemon_factory, tmp)
    sigstop(nodes[1].proc.pid)
    try:
        wait_for(lambda: counted() is False, "step 1 no longer counted protected", 30)
        assert status(nodes[0].socket)["memory"]["degraded_steps"] == 1
    finally:
        os.kill(nodes[1].proc.pid, signal.SIGCONT)
    wait_for(lambda: counted() is True, "step 1 protected again", 30)
    assert status(nodes[0].socket)["memory"]["degraded_steps"] == 0
    log = nodes[0].log_text()
    assert log.count("parity holder unreachable; its pieces no longer count") == 1   # (once, not per round)
    assert "parity holder reachable again" in log and "sent again" not in log


def test_a_holder_that_loses_its_parity_again_and_again_gets_the_pieces_at_most_three_times(daemon_factory, tmp):
    """Holder node 1 restarted empty four times: node 0 sends its pieces there again after each of the
    first three (the restarted holder holds parity, node 0's step counts protected again), and after
    the fourth logs that they are not sent again and leaves the step degraded."""
    nodes, addrs, secret, counted = probed_trio(daemon_factory, tmp)
    holder = nodes[1]
    for n in range(1, 5):
        holder.kill()
        holder = daemon_factory(*peer_args(addrs[1], addrs, secret, *PROBED_TRIO), name=f"n1-{n}")
        if n <= 3:
            wait_for(lambda: status(holder.socket)["memory"]["parity_held_bytes"] > 0,  # noqa: B023
                     f"the holder has parity again after restart {n}", 30)
            wait_for(lambda: counted() is True, f"step 1 protected again after restart {n}", 30)
    wait_for(lambda: "parity piece lost again; not sent again" in nodes[0].log_text(), "node 0 gives up", 30)
    wait_for(lambda: counted() is False, "step 1 degraded", 30)
    assert status(holder.socket)["memory"]["parity_held_bytes"] == 0
    assert nodes[0].log_text().count("parity piece gone from its holder; sent again") == 3


# Two ranks of a run whose third node is down: step 9 to storage, memory-level step 10 fails (its
# pieces for the dead node's stripes have nowhere to go), after the other node folded some of them.
FAILING = textwrap.dedent("""
    import sys, torch, ckptd_client
    from datetime import timedelta
    sys.path.insert(0, sys.argv[5])
    from test_parity import state_for
    sock, job, rank, world, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[6])
    store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    ck = ckptd_client.Checkpointer(job, socket=sock, rank=rank, world_size=world, store=store, commit="relay",
                                   commit_timeout=60)
    ck.save(9, state_for(rank)).wait(120)
    try:
        ck.save(10, state_for(rank, memory=True), level="memory").wait(120)
        print("SAVED-10", flush=True)
    except Exception as e:
        print("FAILED-10", str(e).replace(chr(10), " "), flush=True)
    ck.close()
    store.set(f"done{rank}", "1")
    if rank == 0:
        store.wait([f"done{r}" for r in range(world)], timedelta(seconds=100))
""")


def test_a_failed_memory_level_steps_pieces_never_mix_with_a_later_save_of_its_number(daemon_factory, tmp):
    """G = 3, P = 1, node C down: two ranks on A and B fail memory-level step 10 (A and B had folded each
    other's pieces); C back empty, one rank on C saves memory-level step 10 again; C lost and back empty,
    its rank restores that step 10, rebuilt from A's and B's parity, bit-exact. The failed save's pieces
    stayed in the parity buffers, the new save's folded into them: reported protected, but it rebuilt
    nothing ("2 of its 3 pieces are gone") and the restore read step 9."""
    p3 = ("--peer-redundancy", "parity", "--peer-group", "3", "--peer-parity", "1")
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    a, b = (daemon_factory(*peer_args(addrs[i], addrs, secret, *p3), name=f"n{i}") for i in range(2))
    port = free_port()
    procs = [zygote.popen([sys.executable, "-c", FAILING, str(n.socket), JOB, str(r), "2", str(Path(__file__).parent),
                           str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}) for r, n in enumerate((a, b))]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0 and "FAILED-10" in out, out + a.log_text() + b.log_text()
        assert "not protected by parity" in out and "peer replicas" not in out, out
    c = daemon_factory(*peer_args(addrs[2], addrs, secret, *p3), name="n2")
    want = {"w": torch.randn(150_000, generator=torch.Generator().manual_seed(7)), "step": torch.tensor([10])}
    ck = ckptd_client.Checkpointer(JOB, socket=str(c.socket))
    ck.save(10, want, level="memory").wait(120)         # the failed step's number, saved again: protected
    ck.close()
    from ckptd.core import protocol
    from ckptd.core.names import memory_job
    (g,) = [x for x in protocol.request_once(str(c.socket), {"op": "status", "group": True})["groups"]
            if (x["job"], x["step"]) == (memory_job(JOB), 10)]
    assert g["state"] == "protected", g
    c.kill()
    c2 = daemon_factory(*peer_args(addrs[2], addrs, secret, *p3), name="n2b")
    target = zeros_like(want)
    ck = ckptd_client.Checkpointer(JOB, socket=str(c2.socket))
    assert ck.restore(target) == 10, (ck.last_restore, a.log_text()[-3000:])
    assert ck.last_restore.level == "memory" and ck.last_restore.from_storage == 0, ck.last_restore
    assert_equal(want, target)
    ck.close()
