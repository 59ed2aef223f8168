"""Daemons killed and restarted under running trainers: every daemon's log stays clean.

The restarted daemon is hit at once by trainers whose previous connection died mid-save:
they reconnect, send hellos and saves, reports, and (relayed ranks) COMMITs and ABORTs for
steps the new daemon never saw. Then it is restarted gracefully (SIGTERM, as `systemctl
restart` does) while those trainers and a few chatty clients keep sending. Whatever a daemon
does with all that, no task it started may end with an exception nobody looked at — the
daemon used to log "Task exception was never retrieved ... ValueError: Invalid file
descriptor: -1" when a request arrived as it stopped (a closed socket read again).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import zygote
from ports import free_port

from ckptd.core import protocol
from ckptd.core.errors import ProtocolError

from conftest import REPO

HANG_GUARD_S = 120.0
UNOBSERVED = ("Task exception was never retrieved", "exception was never retrieved", "Traceback")
EXTRA = ("--debug-write-delay", "0.02", "--chunk-mib", "1", "--step-timeout", "20")

# A rank that saves a step in a loop and never stops for a failure; it prints what became of each save.
TRAINER = textwrap.dedent("""
    import os, sys, time, torch, ckptd_client
    from datetime import timedelta
    sock, job, rank, world, port, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5]), sys.argv[6]
    store = None
    if world > 1:
        store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    ck = ckptd_client.Checkpointer(job, socket=sock, rank=rank, world_size=world, store=store,
                                   commit="relay" if world > 1 else "local", commit_timeout=10)
    g = torch.Generator().manual_seed(rank)
    state = {"w": torch.randn(512 * 1024, generator=g), "b": torch.randn(4096, generator=g)}
    pending = []
    step = 0
    while not os.path.exists(stop):
        step += 1
        state["w"][:16] += 1
        try:
            pending.append(ck.save(step, state))
        except ckptd_client.CheckpointError as e:       # no daemon right now: try again shortly
            print(f"REFUSED {step} {e}", flush=True)
        for h in [h for h in pending if h.done()]:
            pending.remove(h)
            print(f"{'COMMITTED' if h.committed else 'FAILED'} {h.step} {h.error or ''}", flush=True)
        time.sleep(0.03)
    for h in pending:
        try:
            h.wait(60)
            print(f"COMMITTED {h.step}", flush=True)
        except ckptd_client.CheckpointError as e:
            print(f"FAILED {h.step} {e}", flush=True)
    ck.close()
    if store is not None:       # rank 0's process serves the store: it leaves last, as a job's ranks do
        store.set(f"done{rank}", "1")
        if rank == 0:
            store.wait([f"done{r}" for r in range(world)], timedelta(seconds=100))
    print("DONE", flush=True)
""")



class Trainer:
    """One rank process; a thread collects its lines."""

    def __init__(self, sock: Path, job: str, rank: int, world: int, port: int, stop: Path) -> None:
        self.p = zygote.popen([sys.executable, "-c", TRAINER, str(sock), job, str(rank), str(world), str(port),
                               str(stop)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))

    def finish(self) -> None:
        try:
            self.p.wait(HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self._reader.join(10)


class Chatter:
    """Clients that keep a few requests on the wire all the time (info, status, hellos), so a
    daemon that stops is always in the middle of reading or answering some of them."""

    def __init__(self, sock: Path, n: int = 3) -> None:
        self.sock = sock
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        req = 0
        while not self.stopped.is_set():
            try:
                s = protocol.connect(str(self.sock), timeout=5)
            except ConnectionError:
                time.sleep(0.01)
                continue
            try:
                s.settimeout(5)
                rx = protocol.FrameReceiver(s)
                protocol.send_frame(s, {"op": "hello", "req": 0, "job": f"chatter{i}", "rank": 0, "world_size": 1,
                                        "pid": os.getpid(), "slot_bytes": 8 << 20, "num_slots": 2})
                while not self.stopped.is_set():
                    req += 1
                    protocol.send_frame(s, {"op": "info" if req % 3 else "status", "req": req})
                    if rx.read() is None:
                        break
            except (OSError, ProtocolError):
                pass
            finally:
                for fd in getattr(locals().get("rx"), "fds", []):
                    os.close(fd)
                s.close()

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(30)


def commits_here(sock: Path) -> int:
    """Steps the daemon now serving ``sock`` has committed itself."""
    try:
        return int(protocol.request_once(str(sock), {"op": "status"}, timeout=30)["stats"]["steps_committed"])
    except (OSError, RuntimeError, ProtocolError):
        return 0


def wait_until(pred, what: str, procs: list[Trainer]) -> None:
    end = time.monotonic() + HANG_GUARD_S
    while not pred():
        for t in procs:
            if t.p.poll() is not None:
                raise AssertionError(f"a trainer exited early while waiting for {what}:\n" + "\n".join(t.lines))
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what} (hang guard)")
        time.sleep(0.05)


def assert_clean(log: str, which: str) -> None:
    for marker in UNOBSERVED:
        assert marker not in log, f"{which} daemon log shows {marker!r}:\n{log[-6000:]}"


def run_restarts(daemon_factory, tmp: Path, world: int) -> None:
    d = daemon_factory(*EXTRA)
    root, sock, log = d.root, d.socket, d.log
    stop = tmp / "stop"
    port = free_port()
    trainers = [Trainer(sock, "restarted", rank, world, port, stop) for rank in range(world)]
    logs: dict[str, str] = {}
    chatter = None
    try:
        wait_until(lambda: commits_here(sock) >= 2, "two commits before the first kill", trainers)
        # 1. SIGKILL mid-save (a small write delay keeps one in flight), restart on the same socket.
        assert d.kill(signal.SIGKILL) == -signal.SIGKILL
        logs["first"] = log.read_text()
        log.unlink()
        time.sleep(0.3)                         # the trainers find no daemon for a while
        d = daemon_factory(*EXTRA, name="d", root=root)
        assert d.socket == sock
        wait_until(lambda: commits_here(sock) >= 2, "later steps to commit on the restarted daemon", trainers)
        # 2. Graceful restart while the trainers save and clients keep requests on the wire.
        chatter = Chatter(sock)
        time.sleep(0.5)
        assert d.stop() == 0
        logs["restarted"] = log.read_text()
        log.unlink()
        d = daemon_factory(*EXTRA, name="d", root=root)
        wait_until(lambda: commits_here(sock) >= 2, "later steps to commit after the graceful restart", trainers)
        chatter.stop()
        stop.touch()
        for t in trainers:
            t.finish()
            assert t.p.returncode == 0, "\n".join(t.lines)
            assert "DONE" in t.lines, "\n".join(t.lines)
        assert d.stop() == 0
        logs["last"] = log.read_text()
    finally:
        if chatter is not None:
            chatter.stop()
        stop.touch()
        for t in trainers:
            if t.p.poll() is None:
                t.p.kill()
    for which, text in logs.items():
        assert_clean(text, which)
    assert "committed job=restarted" in logs["restarted"] and "committed job=restarted" in logs["last"]


def test_restart_under_a_single_rank_trainer(daemon_factory, tmp):
    run_restarts(daemon_factory, tmp, world=1)


def test_restart_under_relayed_ranks(daemon_factory, tmp):
    run_restarts(daemon_factory, tmp, world=2)


def test_sigterm_without_grace_tells_each_save_what_the_disk_says(daemon_factory, tmp):
    """SIGTERM with no drain grace, just as a step's commit starts (its manifest in place) or a
    moment later, round after round, with the next saves in flight: the daemon exits 0 with a
    clean log, and every handle's outcome is what the disk says (committed ⇔ index.json). A drain
    that ran out mid-commit used to tell nobody while the commit's thread went on to publish the
    index (the client, seeing the connection close first, could say "failed"); now it lets the
    commit end, or withdraws it, before anyone is told."""
    import random

    import torch

    import ckptd_client
    from ckptd.core.names import INDEX_NAME, rank_manifest_name, step_dir
    rng = random.Random(7)
    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}        # 1 MiB: one chunk
    root = tmp / "root"
    for rnd in range(10):
        job = f"term{rnd}"
        d = daemon_factory("--drain-grace", "0", "--debug-write-delay", "0.01", "--chunk-mib", "1",
                           name="d", root=root)
        ck = ckptd_client.Checkpointer(job, socket=str(d.socket), root=str(root))
        handles = [ck.save(step, state) for step in (1, 2)]
        manifest = os.path.join(step_dir(str(root), job, 1), rank_manifest_name(0))
        end = time.monotonic() + HANG_GUARD_S
        while not os.path.exists(manifest) and time.monotonic() < end:
            time.sleep(0.0002)
        time.sleep(rng.choice([0, 0, rng.uniform(0, 0.003)]))
        assert d.stop() == 0, d.log_text()[-3000:]
        ck.close(timeout=HANG_GUARD_S)
        for h in handles:
            assert h.done(), f"round {rnd}: step {h.step} unresolved"
            on_disk = os.path.exists(os.path.join(step_dir(str(root), job, h.step), INDEX_NAME))
            assert h.committed == on_disk, f"round {rnd}: step {h.step} says {h!r}, index.json {on_disk}: {h.error}"
        assert_clean(d.log_text(), f"round {rnd}")
        d.log.unlink()


def test_a_save_redone_on_a_restarted_daemon_reports_its_commit(daemon_factory, tmp, monkeypatch):
    """The daemon dies after save() found its connection live and before the SAVE went out (a restart:
    the new daemon serves the same socket path). save() reconnects and redoes it there, and it commits:
    the handle must say committed. The connection loss had settled the handle failed, so the commit
    event found no handle and wait() raised for a committed step. (The patch only times the restart.)"""
    import torch

    import ckptd_client
    from ckptd_client import connection

    root = tmp / "root"
    a = daemon_factory(root=root, name="a")
    b = daemon_factory(root=root, name="b")
    ck = ckptd_client.Checkpointer("redo", socket=str(a.socket), root=str(root))
    state = {"w": torch.arange(1024, dtype=torch.float32)}
    ck.save(1, state).wait(HANG_GUARD_S)
    send = connection.DaemonConnection.send

    def restart_first(self, msg):
        if isinstance(msg, protocol.Save) and a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait()
            os.rename(b.socket, a.socket)            # its successor serves the path
            deadline = time.monotonic() + HANG_GUARD_S
            while not self.lost and time.monotonic() < deadline:
                time.sleep(0.001)                    # the reader thread has seen the loss
        return send(self, msg)

    monkeypatch.setattr(connection.DaemonConnection, "send", restart_first)
    state["w"] += 1
    h = ck.save(2, state)
    monkeypatch.setattr(connection.DaemonConnection, "send", send)
    h.wait(HANG_GUARD_S)                             # raised "connection ... lost" before
    assert h.committed and (root / "redo" / "step-000000000002" / "index.json").exists()
    out = {"w": torch.zeros(1024)}
    assert ck.restore(out) == 2 and torch.equal(out["w"], state["w"])
    ck.close()


def test_a_daemon_says_at_start_what_it_found_in_its_root(daemon_factory, tmp):
    """A root left by a killed daemon and a file system that lost writes: step 2's index.json truncated,
    step 3 never committed. The daemon started as usual and said nothing; every restore() then failed on
    step 2 with no earlier word. It now logs both at start, with what to run."""
    import torch

    import ckptd_client
    root = tmp / "root"
    d = daemon_factory(root=root, name="first")
    with ckptd_client.Checkpointer("scan", socket=str(d.socket)) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((8,), float(s))}).wait(60)
    d.close()
    index = root / "scan" / "step-000000000002" / "index.json"
    index.write_bytes(index.read_bytes()[:40])
    (root / "scan" / "step-000000000003").mkdir()
    (root / "scan" / "step-000000000003" / "rank-00000.json").write_text("{}")
    d2 = daemon_factory(root=root, name="second")
    deadline = time.monotonic() + 30
    while "uncommitted step directories" not in d2.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = d2.log_text()
    assert "job scan: its newest committed step 2 does not load" in log, log
    assert f"ckptd gc {root} --job scan --remove-above 1" in log, log
    assert "job scan: 1 uncommitted step directories (3)" in log, log
