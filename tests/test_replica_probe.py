"""A node's count of its peers' copies follows the peers: a copy a target lost, or a target gone, stops
counting within ``peers.probe_interval`` + ``peers.io_timeout``, so the step shows degraded; a lost copy
of the newest step is sent again."""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from procfd import sigstop

import ckptd_client
from ckptd.core import peer_protocol as pp
from ckptd.core import protocol
from ckptd.core.errors import ProtocolError
from ckptd.core.held import MAX_HELD_BYTES
from ckptd.core.peer_channel import Channel

from test_acceptance import free_port
from test_metrics import scrape
from test_peers import peer_args, remove_data_files, secret_file, wait_for

PROBE = ("--peer-probe-interval", "0.5s", "--peer-io-timeout", "2s")


def status(sock: Path) -> dict[str, Any]:
    return protocol.request_once(str(sock), {"op": "status"})


def held_step(sock: Path, job: str, step: int) -> dict[str, Any] | None:
    return next((s for s in status(sock)["memory"]["held"] if s["job"] == job and s["step"] == step), None)


def copies_of(sock: Path, job: str, step: int) -> int | None:
    s = held_step(sock, job, step)
    return None if s is None else s["ranks"]["0"]["copies"]


def save(sock: Path, job: str, *steps: int) -> None:
    with ckptd_client.Checkpointer(job, socket=str(sock)) as ck:
        for step in steps:
            ck.save(step, {"w": torch.randn(200_000, generator=torch.Generator().manual_seed(step))}).wait(60)


def two_nodes(daemon_factory: Any, tmp: Path, a_extra: tuple[str, ...] = (), b_extra: tuple[str, ...] = ()) -> Any:
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", "probe-secret-0123456789abcdef")
    a = daemon_factory(*peer_args(addrs[0], addrs, secret, *PROBE, "--metrics-address", "127.0.0.1:0", *a_extra),
                       name="a")
    b = daemon_factory(*peer_args(addrs[1], addrs, secret, *PROBE, *b_extra), name="b")
    return a, b, addrs, secret


def assert_degraded(a: Any, job: str, step: int) -> None:
    """A's held ``step`` is shown with one copy, not replicated, and counted degraded (status, text, metric)."""
    wait_for(lambda: copies_of(a.socket, job, step) == 1, f"A's step {step} counted with 1 copy", 30)
    s = held_step(a.socket, job, step)
    assert s is not None and not s["replicated"], s
    mem = status(a.socket)["memory"]
    assert mem["degraded_steps"] >= 1, mem
    assert scrape(status(a.socket)["metrics"])["ckptd_memory_degraded_steps"] >= 1
    text = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(a.socket)],
                          capture_output=True, text=True).stdout
    assert f"job={job} step={step} replicated" not in text, text
    assert "1 copies" in text and "degraded" in text, text


@pytest.mark.timeout(120)
def test_a_dead_peers_copies_stop_counting(daemon_factory, tmp):
    """K = 1: A's step is replicated on B (2 copies); B is SIGKILLed. A's probe cannot reach B, so the
    step becomes degraded with 1 copy (it said replicated, 2 copies, for as long as A ran)."""
    a, b, _, _ = two_nodes(daemon_factory, tmp)
    save(a.socket, "dead", 3)
    wait_for(lambda: copies_of(a.socket, "dead", 3) == 2, "A's step 3 replicated on B", 30)
    assert status(a.socket)["memory"]["degraded_steps"] == 0
    b.kill()
    assert_degraded(a, "dead", 3)
    assert "replica target unreachable" in a.log_text()


@pytest.mark.timeout(120)
def test_a_peer_restarted_empty_gets_the_newest_steps_copy_again(daemon_factory, tmp):
    """B is restarted on the same address with an empty memory: A's probe finds the replica of its
    newest step gone, stops counting it and sends it again, so B holds it and A counts 2 copies
    without another save (before, the step stayed degraded until the next one). The copy B now holds
    is the shard itself: with A's daemon killed and its data files deleted, a rank of A's job restores
    it, bit-exact, from B's memory."""
    a, b, addrs, secret = two_nodes(daemon_factory, tmp)
    save(a.socket, "again", 3, 4)
    wait_for(lambda: copies_of(a.socket, "again", 4) == 2, "A's step 4 replicated on B", 30)
    b.kill()
    b2 = daemon_factory(*peer_args(addrs[1], addrs, secret, *PROBE), name="b2")
    wait_for(lambda: "replica gone from peer" in a.log_text(), "A's probe found its copy gone from B", 30)
    wait_for(lambda: held_step(b2.socket, "again", 4) is not None, "B holds A's step 4 again", 30)
    wait_for(lambda: copies_of(a.socket, "again", 4) == 2, "A counts 2 copies of step 4 again", 30)
    assert held_step(a.socket, "again", 4)["replicated"] and status(a.socket)["memory"]["degraded_steps"] == 0
    assert "replica sent again" in a.log_text()
    assert held_step(b2.socket, "again", 3) is None      # only the newest step is sent again
    a.kill()
    assert remove_data_files(a.root, "again") >= 2
    with ckptd_client.Checkpointer("again", socket=str(b2.socket)) as ck:
        state = {"w": torch.zeros(200_000)}
        assert ck.restore(state) == 4
        info = ck.last_restore                  # (B's own memory: the copy it holds, A being gone)
        assert (info.source, info.from_memory, info.from_storage) == ("memory", 800_000, 0), info
    assert torch.equal(state["w"], torch.randn(200_000, generator=torch.Generator().manual_seed(4)))


@pytest.mark.timeout(180)
def test_a_copy_lost_again_and_again_is_sent_again_at_most_three_times(daemon_factory, tmp):
    """B restarted empty four times: A sends its step's copy again after each of the first three
    (A counts 2 copies again each time), and after the fourth logs that it is not sent again and
    leaves the step degraded: a target that loses a copy over and over does not get it forever."""
    a, b, addrs, secret = two_nodes(daemon_factory, tmp)
    save(a.socket, "flap", 1)
    wait_for(lambda: copies_of(a.socket, "flap", 1) == 2, "A's step 1 replicated on B", 30)
    for n in range(1, 5):
        b.kill()
        b = daemon_factory(*peer_args(addrs[1], addrs, secret, *PROBE), name=f"b{n}")
        if n <= 3:
            wait_for(lambda: held_step(b.socket, "flap", 1) is not None,  # noqa: B023 (called at once)
                     f"B holds A's step 1 again after restart {n}", 30)
            wait_for(lambda: copies_of(a.socket, "flap", 1) == 2, f"2 copies again after restart {n}", 30)
    wait_for(lambda: "replica lost again; not sent again" in a.log_text(), "A gives up on the fourth loss", 30)
    assert a.log_text().count("replica sent again") == 3
    assert_degraded(a, "flap", 1)
    assert held_step(b.socket, "flap", 1) is None


@pytest.mark.timeout(120)
def test_a_replica_the_peer_trimmed_no_longer_counts(daemon_factory, tmp):
    """A keeps two steps in memory, B one: when A's step 6 reaches B, B trims its replica of step 5 while
    A still holds step 5. B answers the probe that it no longer has it: step 5 is degraded (1 copy),
    step 6 stays replicated."""
    a, b, _, _ = two_nodes(daemon_factory, tmp, a_extra=("--memory-steps", "2"), b_extra=("--memory-steps", "1"))
    save(a.socket, "trim", 5, 6)
    wait_for(lambda: copies_of(a.socket, "trim", 6) == 2, "A's step 6 replicated on B", 30)
    wait_for(lambda: [s["step"] for s in status(b.socket)["memory"]["held"] if s["job"] == "trim"] == [6],
             "B trimmed its replica of step 5", 30)
    assert_degraded(a, "trim", 5)
    assert copies_of(a.socket, "trim", 6) == 2 and held_step(a.socket, "trim", 6)["replicated"]
    assert status(a.socket)["memory"]["degraded_steps"] == 1
    assert "replica gone from peer" in a.log_text()


class OldPeer:
    """A peer of an older build: it keeps replicas (``put`` answered ``ok``, the payload read off) and, as
    builds before ``has`` did, closes the connection on any other request."""

    def __init__(self, secret: bytes) -> None:
        self.secret, self.closed_on = secret, 0
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.lsock.setblocking(False)
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_until_complete, args=(self._accept(),), daemon=True).start()

    async def _accept(self) -> None:
        while True:
            conn, _ = await self.loop.sock_accept(self.lsock)
            asyncio.ensure_future(self._serve(Channel(conn, 5.0)))

    async def _serve(self, ch: Channel) -> None:
        try:
            await pp.server_handshake(ch, self.secret)
            while True:
                msg, plen = await pp.recv(ch, MAX_HELD_BYTES)
                if msg["op"] != "put":
                    self.closed_on += 1
                    return
                await pp.skip(ch, plen)
                await pp.send(ch, {"op": "ok"})
        except (ProtocolError, OSError):
            pass
        finally:
            ch.close()


@pytest.mark.timeout(120)
def test_a_peer_that_does_not_know_the_probe_keeps_its_copies_counted(daemon_factory, tmp):
    """A's target is an older build that closes the connection on ``has``: its acknowledged copy keeps
    counting (the probe cannot tell), A logs that once, and later rounds only check it is reachable."""
    secret = secret_file(tmp / "secret", "probe-secret-0123456789abcdef")
    old = OldPeer(secret.read_bytes().strip())
    me = f"127.0.0.1:{free_port()}"
    a = daemon_factory(*peer_args(me, [me, old.address], secret, *PROBE), name="a")
    save(a.socket, "old", 7)
    wait_for(lambda: copies_of(a.socket, "old", 7) == 2, "A's step 7 replicated on the old peer", 30)
    wait_for(lambda: old.closed_on >= 1, "a probe reached the old peer", 30)
    time.sleep(2.0)                               # several more probe rounds
    assert copies_of(a.socket, "old", 7) == 2 and held_step(a.socket, "old", 7)["replicated"]
    assert status(a.socket)["memory"]["degraded_steps"] == 0
    assert old.closed_on == 1                     # one `has`, then handshakes only
    assert a.log_text().count("does not answer probes") == 1


def test_probe_interval_is_off_at_0_and_else_at_least_a_tenth_of_a_second(tmp):
    from ckptd.daemon.settings.config import ConfigError, load_settings
    secret = secret_file(tmp / "s", "x" * 32)
    me = "127.0.0.1:7465"
    base = {"root": str(tmp), "peers.listen": me, "peers.peers": f"{me},127.0.0.2:7465",
            "peers.secret_file": str(secret)}
    assert load_settings(cli=base, env={})["peers.probe_interval"] == 10.0
    assert load_settings(cli={**base, "peers.probe_interval": "0"}, env={})["peers.probe_interval"] == 0.0
    assert load_settings(cli={}, env={"CKPTD_PEERS_PROBE_INTERVAL": "1m", "CKPTD_ROOT": str(tmp)})[
        "peers.probe_interval"] == 60.0
    with pytest.raises(ConfigError, match="probe_interval"):
        load_settings(cli={**base, "peers.probe_interval": "0.01s"}, env={})


@pytest.mark.timeout(120)
def test_a_peer_back_from_an_outage_counts_again(daemon_factory, tmp):
    """B stopped (SIGSTOP) for a few seconds: A's probe could not reach it and dropped its copies, as it
    should; but once B answered again nothing asked about them, so A's step stayed degraded for as long
    as it was held (and "reachable again" was never logged). The copies dropped as unreachable are now
    asked about again and count once B confirms it holds them."""
    import os
    import signal
    a, b, _, _ = two_nodes(daemon_factory, tmp)
    save(a.socket, "blip", 1)
    wait_for(lambda: copies_of(a.socket, "blip", 1) == 2, "A's step 1 replicated on B", 30)
    sigstop(b.proc.pid)
    try:
        assert_degraded(a, "blip", 1)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    wait_for(lambda: copies_of(a.socket, "blip", 1) == 2, "A's step 1 counted with 2 copies again", 30)
    s = held_step(a.socket, "blip", 1)
    assert s is not None and s["replicated"], s
    assert status(a.socket)["memory"]["degraded_steps"] == 0
    wait_for(lambda: "replica target reachable again" in a.log_text(), "the log says B is reachable again", 30)
    assert "replica confirmed on peer again" in a.log_text()
