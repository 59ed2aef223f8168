"""Parity and a memory-level step that failed and is saved again (real daemons, G = 3, P = 1): the failed
save's pieces are dropped by its holders, and a later save of the number is either protected by its own
pieces only, or fails saying why; never committed as protected and then not rebuildable."""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
import zygote

import ckptd_client
from ckptd.core import protocol
from ckptd.core.names import memory_job

from test_acceptance import free_port
from test_memory_tier import assert_equal, zeros_like
from test_peers import peer_args, secret_file, wait_for

JOB = "resave"
P3 = ("--peer-redundancy", "parity", "--peer-group", "3", "--peer-parity", "1", "--peer-io-timeout", "3")

# Rank RANK of 3 (relay commit): "first": step 9 to storage, then ranks 0 and 1 save memory-level step 10
# and rank 2 never does (the step fails at its commit, after T = 5 s); "again": memory-level step 10
# (rank 0 after DELAY s), saying SAVED-10 or FAILED-10 and why.
RANK = textwrap.dedent("""
    import sys, time, torch, ckptd_client
    from datetime import timedelta
    sys.path.insert(0, sys.argv[8])
    from test_parity_resave import state_of
    sock, rank, port, seed, delay, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
        float(sys.argv[5]), sys.argv[6]
    store = torch.distributed.TCPStore("127.0.0.1", port, 3, rank == 0, timedelta(seconds=60))
    ck = ckptd_client.Checkpointer(sys.argv[7], socket=sock, rank=rank, world_size=3, store=store, commit="relay",
                                   commit_timeout=5 if mode == "first" else 60)
    if mode == "first":
        ck.save(9, state_of(rank, 0)).wait(60)
    time.sleep(delay)
    if mode == "first" and rank == 2:
        store.wait(["failed0"], timedelta(seconds=60))
    else:
        try:
            ck.save(10, state_of(rank, seed), level="memory").wait(60)
            print("SAVED-10", flush=True)
        except Exception as e:
            print("FAILED-10", str(e).replace(chr(10), " "), flush=True)
        if rank == 0:
            store.set("failed0", "1")
    ck.close()
    store.set(f"done{rank}", "1")
    if rank == 0:
        store.wait([f"done{r}" for r in range(3)], timedelta(seconds=60))
""")


def state_of(rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return {"w": torch.randn(150_000 + 20_000 * rank, generator=g)}


def run_ranks(nodes: list[Any], where: dict[int, int], mode: str, seeds: dict[int, int],
              delays: dict[int, float]) -> dict[int, str]:
    port = free_port()
    procs = {r: zygote.popen([sys.executable, "-c", RANK, str(nodes[where[r]].socket), str(r), str(port),
                              str(seeds[r]), str(delays.get(r, 0)), mode, JOB, str(Path(__file__).parent)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(3)}
    outs = {}
    for r, p in procs.items():
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out + "".join(n.log_text()[-3000:] for n in nodes)
        outs[r] = out
    return outs


def folded(sock: Path, step: int) -> list[dict[str, Any]]:
    """``status --group``'s entries of memory-level ``step`` (a step some member holds a shard of)."""
    return [g for g in protocol.request_once(str(sock), {"op": "status", "group": True})["groups"]
            if (g["job"], g["step"]) == (memory_job(JOB), step)]


def parity_records(addr: str, secret: Path, step: int) -> list[list[Any]]:
    """What the holder at ``addr`` says its parity buffers folded of memory-level ``step`` (group_report)."""
    from ckptd.core import peer_protocol as pp
    from ckptd.daemon.tiers.peers.link import PeerLink

    async def ask() -> dict[str, Any]:
        link = await PeerLink(addr, secret.read_bytes().strip(), "test", 5.0).open()
        try:
            await pp.send(link.channel, {"op": "group_report"})
            return (await pp.recv(link.channel))[0]
        finally:
            link.close()
    return [f for f in asyncio.run(ask())["folded"] if (f[0], f[1]) == (memory_job(JOB), step)]


def test_a_failed_memory_level_step_saved_again_is_rebuilt_or_refused_never_lost(daemon_factory, tmp):
    """The version-skew review's t4, every daemon new: ranks 0 and 1 save memory-level step 10, rank 2
    never does (it fails at its commit); a new run saves step 10 again, ranks 1 and 2 the same bytes,
    rank 0 other bytes 3 s later. Every handle said SAVED, but a holder had replaced the buffer that held
    rank 1's piece (acknowledged as "folded already") for rank 0's new one: status --group said degraded,
    and with rank 1's node lost its shard of the committed step could not be rebuilt. Now the attempt is
    protected by its own pieces (or fails saying why, and the next one is); rank 1 rebuilds, bit-exact."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    nodes = [daemon_factory(*peer_args(a, addrs, secret, *P3), name=f"n{i}") for i, a in enumerate(addrs)]
    where = {0: 1, 1: 2, 2: 0}        # rank 0 on member 1, rank 1 on member 2, rank 2 on member 0
    outs = run_ranks(nodes, where, "first", {0: 1, 1: 1, 2: 1}, {})
    assert all("FAILED-10" in outs[r] for r in (0, 1)), outs
    seeds = {0: 2, 1: 1, 2: 1}
    outs = run_ranks(nodes, where, "again", seeds, {0: 3.0})
    if not all("SAVED-10" in o for o in outs.values()):         # refused, saying why: saved once more
        assert all("FAILED-10" in o for o in outs.values()), outs
        assert any("held another save's pieces" in o for o in outs.values()), outs
        outs = run_ranks(nodes, where, "again", seeds, {})
        assert all("SAVED-10" in o for o in outs.values()), outs
    wait_for(lambda: [g["state"] for g in folded(nodes[0].socket, 10)] == ["protected"], "step 10 protected")
    nodes[2].kill()
    fresh = daemon_factory(*peer_args(addrs[2], addrs, secret, *P3), name="n2b")
    want = state_of(1, 1)
    target = zeros_like(want)
    ck = ckptd_client.Checkpointer(JOB, socket=str(fresh.socket), rank=1, world_size=3)
    assert ck.restore(target, step=10) == 10, "".join(n.log_text()[-3000:] for n in (nodes[0], fresh))
    assert ck.last_restore.level == "memory" and ck.last_restore.from_storage == 0, ck.last_restore
    assert_equal(want, target)
    ck.close()


def test_a_memory_level_step_failing_at_its_commit_has_its_pieces_dropped_by_their_holders(daemon_factory, tmp):
    """Two ranks on one daemon of a group of three, local commit: rank 0 saves memory-level step 4, its
    pieces reach their two holders; rank 1 never saves, so the step fails at the daemon's step_timeout.
    Only a failure of protect_now itself told the holders: the failed save's pieces stayed folded in
    their parity (to mix with a later save of the number). Now every holder drops them."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    nodes = [daemon_factory(*peer_args(a, addrs, secret, *P3, *(("--step-timeout", "3") if i == 0 else ())),
                            name=f"n{i}") for i, a in enumerate(addrs)]
    ck = ckptd_client.Checkpointer(JOB, socket=str(nodes[0].socket), rank=0, world_size=2, commit="local")
    h = ck.save(4, state_of(0, 4), level="memory")
    wait_for(lambda: all(parity_records(a, secret, 4) for a in addrs[1:]), "rank 0's pieces folded")
    try:
        h.wait(60)
        raise AssertionError("step 4 committed without rank 1")
    except Exception as e:
        assert "timed out" in str(e) or "step_timeout" in str(e), e
    ck.close()
    wait_for(lambda: not any(parity_records(a, secret, 4) for a in addrs), "step 4's parity dropped", timeout=20)
    for n in nodes[1:]:
        assert "parity buffers of a failed save dropped" in n.log_text(), n.log_text()[-3000:]
