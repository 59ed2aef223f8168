"""Peer copies: daemons on loopback stand for nodes; a lost node's ranks restore from a peer's memory."""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from procfd import fd_targets, memfds_named, open_fds

import ckptd_client
from ckptd.launch import spawn_daemon

from test_acceptance import assert_same_tensors, finish, free_port, launch
from test_memory_tier import assert_equal, remove_data_files, state_of, status, zeros_like


def secret_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def peer_args(listen: str, peers: list[str], secret: Path, *extra: str) -> list[str]:
    out = ["--peer-listen", listen, "--peer-secret-file", str(secret), *extra]
    for p in peers:
        out += ["--peer", p]
    return out


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def held_steps(sock: Path) -> list[dict[str, Any]]:
    return status(sock)["memory"]["held"]


@pytest.fixture
def nodes(daemon_factory, tmp):
    """Two 'nodes' (daemons A and B) on one shared root, peers of each other with K = 1."""
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    a = daemon_factory(*peer_args(addrs[0], addrs, secret), name="a")
    b = daemon_factory(*peer_args(addrs[1], addrs, secret), name="b")
    return a, b, addrs, secret


def test_node_loss_ranks_restore_from_peer_memory(nodes, daemon_factory, tmp):
    """Acceptance 2: 4 ranks on 2 nodes, K = 1. After the commit node B's daemon is SIGKILLed and
    every data file of the job is deleted; a fresh daemon for B serves ranks 2 and 3 from A's memory
    (ranks 0 and 1 from A's own) and the run resumes bit-exact."""
    a, b, addrs, secret = nodes
    finish(launch(4, [a.socket, b.socket], "lost", tmp / "first", "--steps", "8", "--every", "4"))
    wait_for(lambda: any(s["step"] == 8 and s["replicated"] and s["committed"] for s in held_steps(b.socket)),
             "B's step 8 replicated and seen committed")
    wait_for(lambda: any(s["step"] == 8 and s["replicated"] for s in held_steps(a.socket)), "A's step 8 replicated")
    on_a = [s for s in held_steps(a.socket) if s["step"] == 8][0]
    assert sorted(on_a["ranks"]) == ["0", "1", "2", "3"], on_a         # its own two and B's two replicas
    assert {on_a["ranks"][r]["origin"] for r in "23"} == {"replica"}
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(b.socket)],
                         capture_output=True, text=True).stdout
    assert "job=lost step=8 replicated, committed" in out, out

    b.kill()
    assert remove_data_files(a.root, "lost") >= 4
    b2 = daemon_factory(*peer_args(addrs[1], addrs, secret), name="b2")
    restart_on_new_node_b(a, b2, "lost", tmp)


def restart_on_new_node_b(a, b2, job: str, tmp: Path) -> None:
    """4 ranks restart over daemon A and node B's fresh daemon ``b2``: each restores step 8, A's ranks
    from A's memory, B's from a peer's (fetched by b2), bit-identical to what the first run saved."""
    outs = finish(launch(4, [a.socket, b2.socket], job, tmp / "again", "--steps", "8", "--every", "4"))
    for rank, out in enumerate(outs):
        assert "RESTORED 8" in out, out
        assert f"RESTORE_SOURCE {'memory' if rank < 2 else 'peer'}" in out, out
    for rank in range(4):
        assert_same_tensors(tmp / f"first.rank{rank}.safetensors", tmp / f"again.rank{rank}.safetensors")
    assert "fetched from peer" in b2.log_text()


def test_wrong_secret_is_refused_and_logged(daemon_factory, tmp):
    """Acceptance 3 (auth): a daemon with another secret cannot place replicas nor fetch; both sides log it."""
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    good = secret_file(tmp / "good", "the-right-secret-0123456789abcdef")
    bad = secret_file(tmp / "bad", "a-wrong-secret-0123456789abcdef!!")
    a = daemon_factory(*peer_args(addrs[0], addrs, good), name="a")
    c = daemon_factory(*peer_args(addrs[1], addrs, bad), name="c")
    ck = ckptd_client.Checkpointer("auth", socket=str(c.socket))
    state = state_of(3)
    ck.save(2, state).wait(60)
    ck.close()
    wait_for(lambda: status(c.socket)["memory"]["replication_failures"] >= 1, "C's replication to fail")
    assert status(a.socket)["memory"]["peers_refused"] >= 1
    assert "peer refused" in a.log_text() and "wrong shared secret" in a.log_text()
    assert "replication failed" in c.log_text()
    assert not [s for s in held_steps(a.socket) if s["job"] == "auth"]       # nothing was stored on A
    assert not held_steps(c.socket)[0]["replicated"]
    for text in (a.log_text(), c.log_text()):
        assert "the-right-secret" not in text and "a-wrong-secret" not in text
    with socket.create_connection(("127.0.0.1", int(addrs[0].rsplit(":", 1)[1]))) as s:   # not a peer at all
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)
        s.settimeout(10)
        while s.recv(4096):
            pass
    wait_for(lambda: status(a.socket)["memory"]["peers_refused"] >= 2, "the stranger to be refused")


def test_secret_file_readable_by_others_refuses_to_start(tmp):
    secret = secret_file(tmp / "loose", "a-secret-that-is-long-enough-0123")
    secret.chmod(0o644)
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match="exited"):
        spawn_daemon(tmp / "root", tmp / "loose.sock", *peer_args(addr, [addr], secret), log=tmp / "loose.log")
    assert "chmod 600" in (tmp / "loose.log").read_text()


class FlippingProxy:
    """A TCP relay between two daemons that flips one byte deep in the answering side's stream."""

    def __init__(self, target: str, flip_at: int) -> None:
        self.target, self.flip_at = target, flip_at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.flipped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            host, port = self.target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if flip and seen <= self.flip_at < seen + len(data):
                    buf = bytearray(data)
                    buf[self.flip_at - seen] ^= 0x01
                    data = bytes(buf)
                    self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_replica_corrupted_in_transit_is_detected_and_storage_used(nodes, daemon_factory, tmp):
    """Acceptance 3 (integrity): the replacement daemon fetches B's shard from A through a relay that
    flips a byte of the payload; the checksum catches it, nothing corrupt is served, and the restore
    reads storage (still there) and is exact."""
    a, b, addrs, secret = nodes
    ck = ckptd_client.Checkpointer("transit", socket=str(b.socket))
    state = state_of(4, mib=2)
    ck.save(6, state).wait(60)
    ck.close()
    wait_for(lambda: held_steps(b.socket)[0]["replicated"], "the replica on A")
    b.kill()
    proxy = FlippingProxy(addrs[0], flip_at=1_000_000)     # well inside the 2 MiB payload
    try:
        b2 = daemon_factory(*peer_args(addrs[1], [proxy.address, addrs[1]], secret), name="b2")
        ck2 = ckptd_client.Checkpointer("transit", socket=str(b2.socket))
        target = zeros_like(state)
        assert ck2.restore(target) == 6
        assert proxy.flipped == 1
        assert ck2.last_restore.source == "storage", ck2.last_restore
        assert_equal(state, target)
        assert "corrupt replica from peer" in b2.log_text()
        assert status(b2.socket)["memory"]["totals"]["corrupt"] == 1
        assert not held_steps(b2.socket)          # the bad copy was not kept
        ck2.close()
    finally:
        proxy.close()


def test_peer_settings_are_checked_at_start(tmp):
    """Peers need a secret and this node in the list; the memory tier must be on."""
    from ckptd.daemon.settings.config import ConfigError, load_settings
    secret = secret_file(tmp / "s", "x" * 32)
    me, other = "127.0.0.1:7465", "127.0.0.2:7465"
    base = {"root": str(tmp), "peers.listen": me, "peers.peers": f"{me},{other}"}
    ok = load_settings(cli={**base, "peers.secret_file": str(secret)}, env={})
    assert ok["peers.peers"] == [me, other] and ok["peers.replicas"] == 1 and ok["peers.io_timeout"] == 30.0
    assert load_settings(cli={**base, "peers.secret_file": str(secret), "peers.io_timeout": "2s"},
                         env={})["peers.io_timeout"] == 2.0
    with pytest.raises(ConfigError, match="io_timeout"):       # 0 would be no bound at all
        load_settings(cli={**base, "peers.secret_file": str(secret), "peers.io_timeout": "0"}, env={})
    with pytest.raises(ConfigError, match="secret_file"):
        load_settings(cli=base, env={})
    with pytest.raises(ConfigError, match="not in the list"):
        load_settings(cli={**base, "peers.secret_file": str(secret), "peers.peers": other}, env={})
    with pytest.raises(ConfigError, match="memory.steps is 0"):
        load_settings(cli={**base, "peers.secret_file": str(secret), "memory.steps": "0"}, env={})
    with pytest.raises(ConfigError, match="host:port"):
        load_settings(cli={**base, "peers.peers": "nonsense"}, env={})


def test_replication_is_paced_by_the_bandwidth_limit(daemon_factory, tmp):
    """3 MiB at `peers.bandwidth = 512KiB` (a one-second burst, then 512 KiB/s) cannot be replicated
    in under 4 s, and the step commits without waiting for it (its log line comes first)."""
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", "pace-secret-0123456789abcdef")
    daemon_factory(*peer_args(addrs[0], addrs, secret), name="a")
    b = daemon_factory(*peer_args(addrs[1], addrs, secret, "--peer-bandwidth", "512KiB"), name="b")
    ck = ckptd_client.Checkpointer("pace", socket=str(b.socket))
    t0 = time.monotonic()
    ck.save(1, state_of(5, mib=3)).wait(60)
    ck.close()
    wait_for(lambda: held_steps(b.socket)[0]["replicated"], "replication")
    assert time.monotonic() - t0 >= 4.0
    log = b.log_text()
    assert log.index("committed job=pace step=1") < log.index("replicated job=pace step=1")


def test_peers_listen_and_replicate_over_ipv6(daemon_factory, tmp):
    """A peer address may be IPv6 ("[::1]:port"): the listener binds that family and a copy arrives,
    bit-exact, restorable by a fresh daemon for the lost node."""
    addrs = [f"[::1]:{free_port()}", f"[::1]:{free_port()}"]
    secret = secret_file(tmp / "secret", "ipv6-secret-0123456789abcdef")
    a = daemon_factory(*peer_args(addrs[0], addrs, secret), name="a")
    b = daemon_factory(*peer_args(addrs[1], addrs, secret), name="b")
    state = state_of(6)
    ck = ckptd_client.Checkpointer("six", socket=str(b.socket))
    ck.save(1, state).wait(60)
    ck.close()
    wait_for(lambda: any(s["job"] == "six" and s["step"] == 1 for s in held_steps(a.socket)), "B's copy on A")
    b.kill()
    assert remove_data_files(a.root, "six") >= 1
    b2 = daemon_factory(*peer_args(addrs[1], addrs, secret), name="b2")
    ck2 = ckptd_client.Checkpointer("six", socket=str(b2.socket))
    target = zeros_like(state)
    assert ck2.restore(target) == 1 and ck2.last_restore.source == "peer", ck2.last_restore
    assert_equal(state, target)
    ck2.close()


def test_two_fetches_of_a_lost_rank_at_once_are_both_served(daemon_factory, tmp):
    """Parity over 4 nodes; node 0's daemon is replaced (its memory gone) and two fetches of its rank of
    a memory-level step reach the new daemon at once (two restoring ranks needing that saved rank). The
    shard is rebuilt once and both are served: each fetch had reserved it anew, dropping the other's
    reservation, and all but the last were told it was nowhere."""
    import os

    import torch

    from ckptd.core.names import memory_job
    from ckptd_client.memory_restore import fetch_held

    addrs = [f"127.0.0.1:{free_port()}" for _ in range(4)]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    root = tmp / "root"

    def node(i: int, name: str) -> Any:
        return daemon_factory(*peer_args(addrs[i], addrs, secret, "--peer-redundancy", "parity", "--peer-group", "4",
                                         "--peer-parity", "1"), name=name, root=root)

    nodes = [node(i, f"n{i}") for i in range(4)]
    with ckptd_client.Checkpointer("conc", socket=str(nodes[0].socket)) as ck:
        ck.save(4, {"w": torch.randn(1_000_000)}, level="memory").wait(60)
    nodes[0].proc.kill()
    nodes[0].proc.wait()
    fresh = node(0, "n0b")
    results: list[str] = ["", ""]

    def fetch(i: int) -> None:
        try:
            conn, meta, fd, source = fetch_held(str(fresh.socket), memory_job("conc"), 4, 0, 1)
            results[i] = f"{source} {meta.nbytes}"
            os.close(fd)
            conn.close()
        except Exception as e:
            results[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == ["peer 4000000", "peer 4000000"], results
    assert fresh.log_text().count("rebuilt from parity") == 1


def test_a_corrupt_held_copy_of_its_own_gives_way_to_the_peers_replica(nodes, tmp):
    """Node B's own held copy of its rank's shard goes bad (a flipped byte in its memfd) and the data files
    are gone; A holds an intact replica. The restore found the bad checksum and gave up on memory (storage:
    MissingData), and B served the same bad copy on every try. Now the client asks B again for a checked
    copy: B finds its own corrupt, drops it (counted), fetches A's replica, and the restore is bit-exact."""

    import torch
    a, b, addrs, secret = nodes
    state = {"w": torch.randn(300_000, generator=torch.Generator().manual_seed(3))}
    ck = ckptd_client.Checkpointer("lc", socket=str(b.socket), num_slots=1)
    ck.save(6, state).wait(60)
    wait_for(lambda: any(s["step"] == 6 and s["replicated"] for s in held_steps(b.socket)), "B's step 6 replicated")
    fds = memfds_named(b.proc.pid, "ckptd-mem-lc-6-r0")
    assert fds, fd_targets(b.proc.pid)           # (one memfd, maybe dup'ed)
    with open(fds[0], "r+b") as f:               # one bit of B's own copy flipped
        f.seek(4000)
        byte = f.read(1)
        f.seek(4000)
        f.write(bytes([byte[0] ^ 0x10]))
    assert remove_data_files(b.root, "lc") == 1
    target = {"w": torch.zeros(300_000)}
    assert ck.restore(target) == 6
    assert ck.last_restore is not None and ck.last_restore.source == "peer", ck.last_restore
    assert torch.equal(target["w"].view(torch.int32), state["w"].view(torch.int32))
    assert status(b.socket)["memory"]["totals"]["corrupt"] == 1
    ck.close()


def test_a_corrupt_held_copy_read_as_pieces_gives_way_to_the_peers_replica(nodes, tmp):
    """The pieces path (memory-level steps, DTensor and resharding restores read held shards as pieces):
    node B's own held copy of a memory-level step goes bad (a flipped bit) while A holds an intact
    replica. The chunk failing its checksum made the restore fail after the ranks had agreed to it (the
    state partly loaded). Now the shard is asked for again, checked by B (which drops its copy and
    fetches A's), the chunk read again from that, and the restore is bit-exact from the peer."""

    import torch
    a, b, addrs, secret = nodes
    w = torch.randn(300_000, generator=torch.Generator().manual_seed(4))
    state: dict[str, Any] = {"w": w, "n": 3}
    ck = ckptd_client.Checkpointer("lp", socket=str(b.socket), num_slots=2)
    ck.save(7, state, level="memory").wait(60)
    wait_for(lambda: any(s["step"] == 7 and s["replicated"] for s in held_steps(b.socket)), "B's step 7 replicated")
    slots = {t: p for p, t, _ in open_fds(b.proc.pid) if t.startswith("/memfd:ckptd-lp-r0-s")}
    assert len(slots) == 2, sorted(fd_targets(b.proc.pid))   # the step is held in its slot
    for fd in slots.values():                    # one bit of B's own copy flipped (and of the free slot)
        with open(fd, "r+b") as f:
            f.seek(4000)
            byte = f.read(1)
            f.seek(4000)
            f.write(bytes([byte[0] ^ 0x10]))
    out = torch.zeros(300_000)
    target: dict[str, Any] = {"w": out, "n": 0}
    assert ck.restore(target) == 7
    assert ck.last_restore is not None and (ck.last_restore.source, ck.last_restore.level) == ("peer", "memory"), \
        ck.last_restore
    assert torch.equal(out.view(torch.int32), w.view(torch.int32)) and target["n"] == 3
    assert status(b.socket)["memory"]["totals"]["corrupt"] == 1
    ck.close()


def test_refused_peer_connections_are_counted_each_and_logged_rate_limited(daemon_factory, tmp):
    """500 unauthenticated connections to the peer port: every one counted (peers_refused), but one
    'peer refused' line per remote host a minute, not 500 (journald would then drop the daemon's own)."""
    addr = f"127.0.0.1:{free_port()}"
    d = daemon_factory(*peer_args(addr, [addr], secret_file(tmp / "s", "the-right-secret-0123456789abcdef")))
    host, port = addr.rsplit(":", 1)
    for _ in range(500):
        socket.create_connection((host, int(port)), timeout=10).close()
    wait_for(lambda: status(d.socket)["memory"]["peers_refused"] == 500, "500 refusals counted")
    lines = [line for line in d.log_text().splitlines() if "peer refused" in line]
    assert 1 <= len(lines) < 10, lines


def test_throttled_logs_first_per_source_then_a_summary(caplog):
    """logs.Throttled: the first event of each source in an interval logged, the rest counted and said in
    one line at the interval's end (a timer on the loop)."""
    import asyncio
    import logging

    from ckptd.daemon.service.logs import Throttled
    logger = logging.getLogger("ckptd.test_throttled")

    async def flood() -> None:
        t = Throttled(logger, "peer refused", interval=0.3)
        for i in range(100):
            t.warning(f"10.0.0.{i % 2}", {"remote": f"10.0.0.{i % 2}:{1000 + i}"})
        await asyncio.sleep(0.6)
        t.warning("10.0.0.0", {"remote": "10.0.0.0:1"})        # a new interval: logged again
    with caplog.at_level(logging.WARNING, logger="ckptd.test_throttled"):
        asyncio.run(flood())
    msgs = [(r.getMessage(), getattr(r, "ctx", {})) for r in caplog.records]
    assert [m for m, _ in msgs] == ["peer refused", "peer refused", "peer refused: more not logged one by one",
                                    "peer refused"], msgs
    assert msgs[2][1]["count"] == 98 and msgs[2][1]["sources_logged"] == 2
