"""Fault injection against real daemons: full and read-only file systems, a SIGKILLed and
restarted daemon, a trainer killed mid-hand-off, a rank that never saves.

Everything here is real: subprocess daemons (tests/conftest.py), unix sockets, signals,
tmpfs mounts (we run as root; a loop-mounted ext4 image is the fallback). The rules under
test (docs/architecture.md, "Failure rules"): a failing save fails its own handle with a clear
reason, never commits half a step, never harms a committed step, and the daemon goes on
serving. No assertion depends on how long anything takes: waits poll the daemon's state
with a generous deadline that only guards against a hang.
"""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import contextlib
import errno
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import zygote

import ckptd_client
from ckptd.core import protocol
from ckptd.core.names import INDEX_NAME, step_dir

REPO = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 120.0


# ---- helpers -----------------------------------------------------------------

def wait_until(pred, what: str, deadline_s: float = HANG_GUARD_S):
    """Poll ``pred`` until it returns something truthy; fail (not flake) only on a hang."""
    end = time.monotonic() + deadline_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what} after {deadline_s:g}s (hang guard)")
        time.sleep(0.05)


def status(sock: Path) -> dict:
    """The daemon's state through the real CLI (`python -m ckptd status --json`)."""
    out = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", str(sock), "--json"],
                         capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def quick_status(sock: Path) -> dict:
    return protocol.request_once(str(sock), {"op": "status"})


def verify(step_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", "verify", "-q", str(step_path)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)


def state_of(seed: int, numel: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(numel, generator=g), "meta": {"seed": seed, "numel": numel}}


def assert_restores(ck: ckptd_client.Checkpointer, step: int, expected: dict) -> None:
    """Restore ``step`` into fresh tensors and compare bit for bit."""
    target = {"w": torch.zeros_like(expected["w"]), "meta": None}
    assert ck.restore(target, step=step) == step
    assert torch.equal(target["w"].view(torch.int32), expected["w"].view(torch.int32)), f"step {step} differs"
    assert target["meta"] == expected["meta"]


def assert_invisible(root: Path, job: str, step: int) -> None:
    """An uncommitted step: no index.json and no rank file left behind."""
    path = Path(step_dir(str(root), job, step))
    assert not (path / INDEX_NAME).exists(), f"{path} has an index.json: a failed save committed"
    leftovers = sorted(p.name for p in path.iterdir()) if path.exists() else []
    assert not leftovers, f"{path} still holds {leftovers}"


def assert_no_tracebacks(daemon) -> None:
    text = daemon.log_text()
    for marker in ("Traceback", "exception was never retrieved", "Exception in callback", "Logging error",
                   "request failed", "internal daemon error", "timed-out step failed"):
        assert marker not in text, f"daemon log shows an unhandled error:\n{text[-4000:]}"


# ---- small file systems ----------------------------------------------------------

class SmallFS:
    """A size-limited file system mounted at ``path``: tmpfs, else a loop-mounted ext4 image."""

    def __init__(self, base: Path, size_mib: int) -> None:
        self.path = base / "smallfs"
        self.path.mkdir()
        self.image: Path | None = None
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755", "tmpfs", str(self.path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            self.image = base / "smallfs.img"
            with open(self.image, "wb") as f:
                f.truncate(max(size_mib, 2) * 1024 * 1024)
            mk = subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], capture_output=True, text=True)
            lo = subprocess.run(["mount", "-o", "loop", str(self.image), str(self.path)],
                                capture_output=True, text=True) if mk.returncode == 0 else mk
            if lo.returncode != 0:
                pytest.skip(f"cannot mount a small file system here (tmpfs: {r.stderr.strip()}; "
                            f"loop: {lo.stderr.strip()})")
        self.mounted = True

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], check=True, capture_output=True)

    def unmount(self) -> None:
        if self.mounted:
            if subprocess.run(["umount", str(self.path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False


@pytest.fixture
def small_fs(tmp: Path):
    fs = SmallFS(tmp, 2)
    yield fs
    fs.unmount()


# ---- disk full, read-only file system ----------------------------------------------

def test_disk_full_fails_one_save_and_keeps_serving(small_fs, daemon_factory):
    root = small_fs.path / "root"
    d = daemon_factory(root=root)
    ck = ckptd_client.Checkpointer("full", socket=str(d.socket))
    first = state_of(1, 16 * 1024)                   # 64 KiB: fits
    ck.save(1, first).wait(HANG_GUARD_S)
    huge = state_of(2, 1024 * 1024)                  # 4 MiB of random floats: cannot fit in 2 MiB
    h = ck.save(2, huge)
    with pytest.raises(ckptd_client.CheckpointError) as err:
        h.wait(HANG_GUARD_S)
    assert "ENOSPC" in str(err.value) or "No space" in str(err.value), str(err.value)
    assert "step 2" in str(err.value)
    assert_invisible(root, "full", 2)

    # The daemon goes on: the trainer retries the step at once (smaller), then saves the next.
    second = state_of(22, 16 * 1024)
    ck.save(2, second).wait(HANG_GUARD_S)
    third = state_of(3, 16 * 1024)
    ck.save(3, third).wait(HANG_GUARD_S)
    assert_restores(ck, 1, first)
    assert_restores(ck, 2, second)
    assert_restores(ck, 3, third)
    assert ck.latest_step() == 3
    assert verify(Path(step_dir(str(root), "full", 1))).returncode == 0
    st = quick_status(d.socket)
    assert st["steps"] == [] and st["stats"]["steps_failed"] == 1 and st["stats"]["steps_committed"] == 3
    ck.close()
    assert_no_tracebacks(d)


def test_disk_full_at_every_save_never_leaks_slots(small_fs, daemon_factory):
    """More failures in a row than the client has slots: each must give its slot back."""
    root = small_fs.path / "root"
    d = daemon_factory(root=root)
    ck = ckptd_client.Checkpointer("full2", socket=str(d.socket), num_slots=2)
    for step in range(1, 6):
        with pytest.raises(ckptd_client.CheckpointError, match="ENOSPC|No space"):
            ck.save(step, state_of(step, 1024 * 1024)).wait(HANG_GUARD_S)
        assert_invisible(root, "full2", step)
    ok = state_of(9, 1024)
    ck.save(9, ok).wait(HANG_GUARD_S)
    assert_restores(ck, 9, ok)
    ck.close()
    assert_no_tracebacks(d)


def test_read_only_file_system_fails_saves_cleanly(small_fs, daemon_factory):
    """The file system goes read-only (what ext4 does after an I/O error): EROFS at mkdir/open."""
    root = small_fs.path / "root"
    d = daemon_factory(root=root)
    ck = ckptd_client.Checkpointer("ro", socket=str(d.socket), num_slots=2)
    first = state_of(1, 4096)
    ck.save(1, first).wait(HANG_GUARD_S)
    small_fs.remount("ro")
    try:
        # Three failures with two slots: a failure that kept its slot would hang the third save.
        for step in (2, 3, 4):
            with pytest.raises(ckptd_client.CheckpointError, match="EROFS|Read-only"):
                ck.save(step, state_of(step, 4096)).wait(HANG_GUARD_S)
        st = quick_status(d.socket)
        assert st["steps"] == []
        assert [s["busy_slots"] for s in st["sessions"]] == [0]
    finally:
        small_fs.remount("rw")
    for step in (2, 3, 4):
        assert not Path(step_dir(str(root), "ro", step), INDEX_NAME).exists()
    again = state_of(5, 4096)
    ck.save(5, again).wait(HANG_GUARD_S)
    assert_restores(ck, 1, first)
    assert_restores(ck, 5, again)
    ck.close()
    assert_no_tracebacks(d)


class ThinFS:
    """ext4 on a loop device whose backing file lives on a tiny tmpfs: a thin-provisioned volume.
    write() lands in the page cache and succeeds; when writeback finds the pool full, the block
    layer fails the I/O and fsync reports it (ENOSPC or EIO, by kernel). grow() adds space."""

    def __init__(self, base: Path) -> None:
        self.pool, self.path = base / "pool", base / "thin"
        self.pool.mkdir()
        self.path.mkdir()
        self.mounted: list[Path] = []
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(self.pool)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
        self.mounted.append(self.pool)
        image = self.pool / "volume.img"
        with open(image, "wb") as f:
            f.truncate(32 * 1024 * 1024)
        mk = subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(image)],
                            capture_output=True, text=True)
        lo = subprocess.run(["mount", "-o", "loop", str(image), str(self.path)], capture_output=True, text=True) \
            if mk.returncode == 0 else mk
        if lo.returncode != 0:
            self.unmount()
            pytest.skip(f"cannot loop-mount an ext4 image here: {lo.stderr.strip()}")
        self.mounted.append(self.path)

    def grow(self) -> None:
        subprocess.run(["mount", "-o", "remount,size=64m", str(self.pool)], check=True, capture_output=True)

    def unmount(self) -> None:
        while self.mounted:
            p = self.mounted.pop()
            if subprocess.run(["umount", str(p)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(p)], capture_output=True)


@pytest.fixture
def thin_fs(tmp: Path):
    fs = ThinFS(tmp)
    yield fs
    fs.unmount()


def test_io_error_at_fsync_on_a_full_thin_volume(thin_fs, daemon_factory):
    """The write error that only fsync sees: the save fails (its slot already back with the
    trainer), the committed step is untouched, and once the pool grows saves commit again."""
    root = thin_fs.path / "root"
    d = daemon_factory(root=root)
    ck = ckptd_client.Checkpointer("thin", socket=str(d.socket))
    first = state_of(1, 16 * 1024)
    ck.save(1, first).wait(HANG_GUARD_S)
    h = ck.save(2, state_of(2, 2 * 1024 * 1024))          # 8 MiB: the pool holds ~2.5 MiB more
    with pytest.raises(ckptd_client.CheckpointError, match="ENOSPC|EIO|No space|Input/output") as err:
        h.wait(HANG_GUARD_S)
    assert "step 2" in str(err.value) and "rank 0" in str(err.value)
    assert_invisible(root, "thin", 2)
    assert_restores(ck, 1, first)
    thin_fs.grow()
    third = state_of(3, 64 * 1024)
    ck.save(3, third).wait(HANG_GUARD_S)
    for step, expected in ((1, first), (3, third)):
        assert_restores(ck, step, expected)
        assert verify(Path(step_dir(str(root), "thin", step))).returncode == 0
    st = quick_status(d.socket)
    assert st["steps"] == [] and [s["busy_slots"] for s in st["sessions"]] == [0]
    ck.close()
    assert_no_tracebacks(d)


def test_a_writeback_error_met_while_pacing_fails_the_shard(thin_fs, monkeypatch):
    """The writer paces itself by waiting for the writeback of data some way behind it
    (``sync_file_range`` with WAIT_AFTER). That wait reports a failed writeback and clears it for
    the descriptor, so the data file's fsync later succeeds: the error must fail the shard there.
    Here the pool runs out under the first few MiB and grows again (a transient fault ending)
    before the rest and the fsync; the shard must fail, its files removed. (The pacing distances
    are scaled down from 32/256 MiB so that a 12 MiB shard meets them; the writes, the file system
    and its failure are real.)"""
    from concurrent.futures import ThreadPoolExecutor

    from ckptd.core import shard_writer, storage
    from ckptd.core.schema import TensorLayout

    monkeypatch.setattr(storage, "WRITEBACK_BYTES", 1 << 20)
    monkeypatch.setattr(shard_writer, "PACE_LAG_BYTES", 2 << 20)
    n = 12 << 20
    src = memoryview(bytearray(torch.randint(0, 256, (n,), dtype=torch.uint8).numpy().tobytes()))
    step_path = str(thin_fs.path / "job" / "step-000000000001")
    written = []

    def before_write() -> None:
        written.append(1)
        if len(written) == 7:         # 6 MiB in, the pool long full: the fault ends (the old code then
            thin_fs.grow()            # fsynced without an error and reported the shard durable)

    with ThreadPoolExecutor(2) as pool, pytest.raises(OSError) as err:
        shard_writer.write_shard(step_path, "job", 1, 0, 1, [TensorLayout("w", "uint8", (n,), 0, n)],
                                 lambda t, start, k: src[t.offset + start:t.offset + start + k], {"T": "w"},
                                 shard_writer.Encoding("none", 1, 1 << 20), pool, 2,
                                 shard_writer.ShardHooks(before_write=before_write))
    assert err.value.errno in (errno.ENOSPC, errno.EIO), err.value
    assert sorted(p.name for p in Path(step_path).iterdir()) == []


# ---- daemon restart ----------------------------------------------------------------

SLOW = ("--debug-write-delay", "1.0", "--chunk-mib", "1")


def test_daemon_restart_fails_in_flight_save_and_clients_reconnect(daemon_factory):
    d = daemon_factory(*SLOW)
    root = d.root
    ck = ckptd_client.Checkpointer("restart", socket=str(d.socket))
    idle = ckptd_client.Checkpointer("restart-idle", socket=str(d.socket))
    first = state_of(1, 1024)
    ck.save(1, first).wait(HANG_GUARD_S)
    idle_first = state_of(11, 1024)
    idle.save(1, idle_first).wait(HANG_GUARD_S)

    big = state_of(2, 8 * 1024 * 1024 // 4)          # 8 chunks of 1 MiB, one second each
    h = ck.save(2, big)
    wait_until(lambda: any(p["step"] == 2 and p["writing"] == [0] for p in quick_status(d.socket)["steps"]),
               "step 2 to be in flight")
    assert d.kill(signal.SIGKILL) == -signal.SIGKILL
    with pytest.raises(ckptd_client.CheckpointError, match="lost") as err:
        h.wait(HANG_GUARD_S)
    assert "step 2" in str(err.value)
    assert not Path(step_dir(str(root), "restart", 2), INDEX_NAME).exists()

    # With no daemon, a save fails at once and says where it tried.
    with pytest.raises(ckptd_client.CheckpointError, match="cannot reach"):
        ck.save(3, state_of(3, 1024))

    d2 = daemon_factory(name="d", root=root)        # same socket path, same root
    assert d2.socket == d.socket
    third = state_of(3, 1024)
    ck.save(3, third).wait(HANG_GUARD_S)             # reconnects by itself
    # The half-written step 2 left debris; saving step 2 again over it commits cleanly.
    again = state_of(22, 8 * 1024)
    ck.save(2, again).wait(HANG_GUARD_S)
    # The client that was idle when the daemon died reconnects on its next save too.
    idle_second = state_of(12, 1024)
    idle.save(2, idle_second).wait(HANG_GUARD_S)

    for step, expected in ((1, first), (2, again), (3, third)):
        assert_restores(ck, step, expected)
        assert verify(Path(step_dir(str(root), "restart", step))).returncode == 0
    assert_restores(idle, 1, idle_first)
    assert_restores(idle, 2, idle_second)
    sessions = {s["job"] for s in quick_status(d2.socket)["sessions"]}
    assert sessions == {"restart", "restart-idle"}
    ck.close()
    idle.close()
    assert_no_tracebacks(d2)


# ---- a trainer killed mid-hand-off ----------------------------------------------------

CHILD_SAVE = textwrap.dedent("""
    import sys, time, torch, ckptd_client
    sock, job, step, numel = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ck = ckptd_client.Checkpointer(job, socket=sock)
    h = ck.save(step, {"w": torch.randn(numel)})
    print("HANDED-OFF", flush=True)
    time.sleep(3600)
""")


def spawn_saver(sock: Path, job: str, step: int, numel: int) -> zygote.Proc:
    p = zygote.popen([sys.executable, "-c", CHILD_SAVE, str(sock), job, str(step), str(numel)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = p.stdout.readline()
    if line.strip() != "HANDED-OFF":
        p.kill()
        raise AssertionError(f"child did not hand off: {line!r} {p.stderr.read()}")
    return p


def test_client_killed_mid_handoff_frees_everything(daemon_factory):
    d = daemon_factory(*SLOW)
    child = spawn_saver(d.socket, "victim", 5, 6 * 1024 * 1024 // 4)     # 6 chunks, a second each
    st = status(d.socket)
    assert [p["writing"] for p in st["steps"] if p["job"] == "victim"] == [[0]]
    assert st["slot_bytes_in_use"] > 0
    child.send_signal(signal.SIGKILL)
    assert child.wait(HANG_GUARD_S) == -signal.SIGKILL

    def freed():
        s = status(d.socket)
        return s if (s["slot_bytes_in_use"] == 0 and not s["sessions"] and not s["steps"]) else None
    st = wait_until(freed, "the daemon to drop the dead client's session, slots and step")
    assert st["stats"]["steps_failed"] == 1

    # The daemon keeps serving another client meanwhile.
    ck = ckptd_client.Checkpointer("bystander", socket=str(d.socket))
    other = state_of(7, 1024)
    ck.save(1, other).wait(HANG_GUARD_S)
    assert_restores(ck, 1, other)

    # The abandoned write cleans up after itself: no index.json, no rank files, no step dir.
    victim = Path(step_dir(str(d.root), "victim", 5))
    wait_until(lambda: not victim.exists(), f"{victim} to be removed")
    ck.close()
    assert_no_tracebacks(d)


def test_same_step_resaved_while_a_dead_clients_write_is_in_flight(daemon_factory):
    """A restarted trainer saves the step its dead predecessor was writing. Whatever the
    interleaving, the step either is refused with a reason or commits complete and exact."""
    d = daemon_factory(*SLOW)
    child = spawn_saver(d.socket, "phoenix", 5, 3 * 1024 * 1024 // 4)    # 3 chunks
    child.send_signal(signal.SIGKILL)
    child.wait(HANG_GUARD_S)
    wait_until(lambda: not quick_status(d.socket)["sessions"], "the dead client's session to go")

    ck = ckptd_client.Checkpointer("phoenix", socket=str(d.socket))
    mine = state_of(55, 8 * 1024 * 1024 // 4)        # 8 chunks: outlives the dead client's write
    refusals = []

    def try_save():
        try:
            ck.save(5, mine).wait(HANG_GUARD_S)
            return True
        except ckptd_client.CheckpointError as e:
            refusals.append(str(e))
            assert "step 5" in str(e) or "rank 0" in str(e), str(e)
            return False
    wait_until(try_save, "a re-save of step 5 to commit")
    path = Path(step_dir(str(d.root), "phoenix", 5))
    # Let the dead client's write finish and clean up; it must not touch the new commit.
    wait_until(lambda: not quick_status(d.socket)["steps"], "no step in flight")
    wait_until(lambda: not quick_status(d.socket)["saves"], "no shard write in flight")
    r = verify(path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_restores(ck, 5, mine)
    ck.close()
    assert_no_tracebacks(d)


# ---- a rank that never saves --------------------------------------------------------

CHILD_RANK = textwrap.dedent("""
    import json, sys, torch, ckptd_client
    sock, job, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ck = ckptd_client.Checkpointer(job, socket=sock, rank=rank, world_size=2, commit="local")
    def state(step):
        return {"w": torch.randn(1024, generator=torch.Generator().manual_seed(100 * step + rank))}
    def say(**kw):
        print(json.dumps(kw), flush=True)
    handles = {}
    for line in sys.stdin:             # commands from the test, one a line
        cmd, *args = line.split()
        if cmd == "prepare":           # connected, slots allocated, nothing saved
            ck.prepare(state(0))
            say(prepared=True)
        elif cmd == "save":
            handles[int(args[0])] = ck.save(int(args[0]), state(int(args[0])))
            say(handed=int(args[0]))
        elif cmd == "wait":            # "wait N [retry]": on failure, re-save N at once
            step = int(args[0])
            try:
                handles[step].wait(600)
                say(ok=True)
            except ckptd_client.CheckpointError as e:
                if args[1:] == ["retry"]:
                    handles[step] = ck.save(step, state(step))
                say(ok=False, error=str(e))
        elif cmd == "quit":
            break
    ck.close()
""")


class Rank:
    def __init__(self, sock: Path, job: str, rank: int) -> None:
        self.p = zygote.popen([sys.executable, "-c", CHILD_RANK, str(sock), job, str(rank)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO)

    def __call__(self, command: str) -> dict:
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"rank process died: {self.p.stderr.read()}"
        return json.loads(line)

    def close(self) -> int:
        with contextlib.suppress(OSError):
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
        try:
            return self.p.wait(HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()


def test_rank_that_never_saves_fails_the_step_after_the_timeout(daemon_factory):
    d = daemon_factory("--step-timeout", "3")
    r0, r1 = Rank(d.socket, "duo", 0), Rank(d.socket, "duo", 1)
    try:
        assert r1("prepare") == {"prepared": True}        # rank 1 is connected but never saves step 7
        assert r0("save 7") == {"handed": 7}
        result = r0("wait 7")
        assert result["ok"] is False
        assert "timed out after 3s waiting for ranks 1 to be durable" in result["error"], result["error"]
        assert "step 7" in result["error"]
        # By the time the failure is reported, rank 0's durable files are gone.
        assert_invisible(d.root, "duo", 7)
        st = quick_status(d.socket)
        assert sorted(s["rank"] for s in st["sessions"]) == [0, 1] and st["stats"]["steps_failed"] == 1

        # Saving step 7 again works: with both ranks, it commits complete and exact.
        assert r0("save 7") == {"handed": 7}
        assert r1("save 7") == {"handed": 7}
        assert r0("wait 7") == {"ok": True} and r1("wait 7") == {"ok": True}
        path = Path(step_dir(str(d.root), "duo", 7))
        r = verify(path)
        assert r.returncode == 0, r.stdout + r.stderr
        for rank in (0, 1):
            ck = ckptd_client.Checkpointer("duo", root=str(d.root), socket=str(d.socket), rank=rank,
                                           world_size=2, commit="local")
            target = {"w": torch.zeros(1024)}
            assert ck.restore(target, step=7) == 7
            expected = torch.randn(1024, generator=torch.Generator().manual_seed(700 + rank))
            assert torch.equal(target["w"], expected)

        # The daemon served everybody throughout.
        ck = ckptd_client.Checkpointer("solo", socket=str(d.socket))
        solo = state_of(8, 1024)
        ck.save(1, solo).wait(HANG_GUARD_S)
        assert_restores(ck, 1, solo)
        ck.close()
    finally:
        codes = [r0.close(), r1.close()]
    assert codes == [0, 0]
    assert_no_tracebacks(d)
