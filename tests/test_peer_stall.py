"""A peer that stops mid-transfer (SIGSTOP) fails only the copies meant for it, within peers.io_timeout.

Three daemons on loopback stand for nodes B, A1 and A2; B copies its shards to both (K = 2).
A1 is SIGSTOPped while B's first copy to it is being received. Then: that copy fails and is
counted and logged naming A1; later steps still reach A2; B lets the stalled step go per
``memory.steps``; a replacement for B restores from A2 without waiting on A1 (probed at the same
time, A1 first in its order), and a step only a silent peer could have falls back to storage.
"""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import os
import signal
import urllib.request
from pathlib import Path

import pytest
from procfd import memfds_named, sigstop

import ckptd_client

from test_acceptance import free_port
from test_memory_tier import assert_equal, state_of, status, zeros_like
from test_peers import held_steps, peer_args, secret_file, wait_for

IO_TIMEOUT = "2s"
SHARD_MIB = 4


def has_memfd(pid: int, name: str) -> bool:
    """Whether the daemon has a memfd of that name open (a replica it is receiving or holds)."""
    return bool(memfds_named(pid, name))


def peer_counts(sock: Path, peer: str) -> dict[str, int]:
    return status(sock)["memory"]["peers"][peer]


def line_of(log: str, *parts: str) -> int:
    """Index of the first log line containing every one of ``parts``; -1 if none."""
    for i, line in enumerate(log.splitlines()):
        if all(p in line for p in parts):
            return i
    return -1


@pytest.mark.timeout(300)
def test_stalled_peer_fails_its_copy_and_the_rest_go_on(daemon_factory, tmp):
    b_addr, a1_addr, a2_addr = (f"127.0.0.1:{free_port()}" for _ in range(3))
    peers = [b_addr, a1_addr, a2_addr]
    secret = secret_file(tmp / "secret", "stall-secret-0123456789abcdef")
    common = ("--peer-io-timeout", IO_TIMEOUT)
    a1 = daemon_factory(*peer_args(a1_addr, peers, secret, *common), name="a1")
    a2 = daemon_factory(*peer_args(a2_addr, peers, secret, *common), name="a2")
    # 2 shards x 4 MiB at 2 MiB/s take a few seconds: time to stop A1 while its copy is in flight.
    sender = (*common, "--peer-replicas", "2", "--peer-bandwidth", "2MiB")
    b = daemon_factory(*peer_args(b_addr, peers, secret, *sender), "--metrics-address", "127.0.0.1:0", name="b")
    states = {step: state_of(step, mib=SHARD_MIB) for step in (1, 2, 3)}
    stopped = False
    try:
        ck = ckptd_client.Checkpointer("stall", socket=str(b.socket))
        saving = ck.save(1, states[1])
        wait_for(lambda: has_memfd(a1.proc.pid, "ckptd-mem-stall-1-r0"), "A1 to start receiving step 1")
        sigstop(a1.proc.pid)
        stopped = True
        assert "replica held job=stall step=1" not in a1.log_text()        # stopped mid-transfer
        saving.wait(60)
        for step in (2, 3):            # committed while A1's copy of step 1 is stuck (B's pin on it)
            ck.save(step, states[step]).wait(60)
        ck.close()

        # The stalled copy fails, counted and logged with A1's address; A1 never got a byte acknowledged.
        wait_for(lambda: peer_counts(b.socket, a1_addr)["failures"] >= 1, "B's copy to A1 to fail")
        log = b.log_text()
        failed = line_of(log, "replication failed", "step=1", f"peer={a1_addr}")
        assert failed >= 0 and "stalled" in log.splitlines()[failed], log[-3000:]
        assert peer_counts(b.socket, a1_addr)["sent_bytes"] == 0
        scrape = urllib.request.urlopen(f"http://{status(b.socket)['metrics']}/metrics", timeout=10).read().decode()
        assert f'ckptd_peer_target_replication_failures_total{{peer="{a1_addr}"}}' in scrape, scrape

        # Later steps still reach A2, A1 still stopped: its queue is not A2's.
        wait_for(lambda: any(s["job"] == "stall" and s["step"] == 3 for s in held_steps(a2.socket)),
                 "step 3's replica on A2")
        # B logs a copy once A2's acknowledgement is back, which may come after A2 lists it as held.
        wait_for(lambda: line_of(b.log_text(), "replicated", "step=3", f"peer={a2_addr}") >= 0,
                 "B to log step 3's copy to A2", timeout=30)
        log = b.log_text()
        assert line_of(log, "replicated", "step=1", f"peer={a2_addr}") >= 0, log[-3000:]
        # (step 2 may have been let go on B, step 3 being committed, before A2's sender reached it)
        assert peer_counts(b.socket, a2_addr)["sent_bytes"] >= 2 * SHARD_MIB * 2**20
        # B holds memory.steps (1) committed steps again once A1's copies have failed.
        wait_for(lambda: [s["step"] for s in held_steps(b.socket) if s["job"] == "stall"] == [3],
                 "B to let steps 1 and 2 go")
        assert "replicated job=stall" not in "\n".join(x for x in b.log_text().splitlines() if a1_addr in x)

        # B is lost; its replacement asks A1 (its first target, silent) and A2 at once.
        b.kill()
        # B2 waits longer on a silent peer than B did (6 s, not 2): A2's answer must not be taken after
        # A1's timeout only because the machine is loaded, and 6 s leaves A2's fetch ample time.
        b2 = daemon_factory(*peer_args(b_addr, peers, secret, "--peer-io-timeout", "6s", "--peer-replicas", "2"),
                            name="b2")
        ck2 = ckptd_client.Checkpointer("stall", socket=str(b2.socket))
        target = zeros_like(states[3])
        assert ck2.restore(target) == 3
        assert ck2.last_restore.source == "peer", ck2.last_restore
        assert_equal(states[3], target)
        log = b2.log_text()
        fetched = line_of(log, "fetched from peer", f"peer={a2_addr}", "step=3")
        assert fetched >= 0, log[-3000:]
        a1_failed = line_of(log, "peer fetch failed", f"peer={a1_addr}")
        assert a1_failed == -1 or a1_failed > fetched, log[-3000:]        # A1 was not waited for first

        # Step 2 is on no peer that answers (A2 keeps only step 3; A1 is silent): storage, after A1's timeout.
        target = zeros_like(states[2])
        assert ck2.restore(target, step=2) == 2
        assert ck2.last_restore.source == "storage", ck2.last_restore
        assert_equal(states[2], target)
        log = b2.log_text()
        probe = line_of(log, "peer fetch failed", f"peer={a1_addr}", "step=2")
        assert probe >= 0 and "stalled" in log.splitlines()[probe], log[-3000:]
        ck2.close()
    finally:
        if stopped:
            os.kill(a1.proc.pid, signal.SIGCONT)
        for d in (a1, a2, b):
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait(60)


@pytest.mark.timeout(300)
def test_connections_that_never_finish_the_handshake_are_cut_and_hold_no_peers_threads(daemon_factory, tmp):
    """40 connections without the secret each send a valid header announcing a 4 KiB auth frame, then
    its body a byte at a time, each wait well within peers.io_timeout: none of them ever stalls. They
    must not hold the threads an authenticated peer's requests are read on (its probe answers while
    they trickle), and the daemon cuts each once the whole handshake has taken io_timeout; then a new
    peer with the secret gets in."""
    import asyncio
    import socket
    import struct
    import threading

    from ckptd.daemon.tiers.peers.link import PeerLink

    port = free_port()
    secret = secret_file(tmp / "secret", "0123456789abcdef0123456789abcdef\n")
    # The daemon cuts a handshake after 8 s; the authenticated peer's probe gives up after 4: shared
    # threads would answer it only once the tricklers were cut.
    d = daemon_factory(*peer_args(f"127.0.0.1:{port}", [], secret, "--peer-io-timeout", "8s"),
                       "--memory-steps", "1", "--memory-budget", str(64 << 20))
    key = secret.read_bytes().strip()
    digest = "sha256:" + "0" * 64
    stop = threading.Event()
    cut: list[bool] = []
    joined = threading.Barrier(41)

    def trickle() -> None:
        c = socket.create_connection(("127.0.0.1", port))
        c.settimeout(1.0)
        c.recv(4096)                                   # the challenge
        c.sendall(struct.pack(">2sHIQ", b"CP", 1, 4096, 0))
        joined.wait()
        while not stop.is_set():
            try:
                c.send(b" ")
                if c.recv(1) == b"":                 # closed by the daemon
                    break
            except TimeoutError:
                continue                             # nothing from the daemon: trickle on
            except OSError:
                break
        else:
            c.close()
            return
        cut.append(True)
        c.close()

    async def probe() -> bool:
        link = await PeerLink(f"127.0.0.1:{port}", key, "legit", 10).open()
        try:
            return await link.has("job", 1, 0, digest)
        finally:
            link.close()

    async def authenticated_during_attack() -> bool:
        link = await PeerLink(f"127.0.0.1:{port}", key, "legit", 4).open()    # in before the attack
        try:
            threads = [threading.Thread(target=trickle, daemon=True) for _ in range(40)]
            for t in threads:
                t.start()
            await asyncio.get_running_loop().run_in_executor(None, joined.wait)
            return await link.has("job", 1, 0, digest)      # read on a thread no trickler holds
        finally:
            link.close()

    assert asyncio.run(authenticated_during_attack()) is False      # answered: "missing"
    wait_for(lambda: len(cut) == 40, "the daemon to cut every connection that never authenticated")
    stop.set()
    assert asyncio.run(probe()) is False
    assert "no handshake within 8 s (peers.io_timeout)" in d.log_text()
