"""Randomized crash trials: trainers and daemons killed at random moments, outcomes checked against the disk.

Each trial runs a job through a real daemon: one rank committing ``local``ly, or two gloo ranks
committing through the ``relay`` (a TCPStore hosted by rank 0). At a random moment — inside
``save()``, in the background hand-off after it returned, while a shard is written (``--debug-
write-delay`` and ``--chunk-mib 1`` widen that window), or just as the commit starts (every
manifest in place) — it kills, with SIGKILL or SIGTERM, the trainer (one of the two ranks: the
other then gets SIGTERM, as torchrun does), the daemon, or both. What died is restarted and the
job goes on: a restarted trainer restores the latest committed step (checking it) and saves
more; trainers that outlived their daemon keep saving through its restart.

Trainers print each handle's final outcome (``OUTCOME step committed|failed``) as soon as it is
known; a SIGTERMed trainer stops saving and closes, so it reports every handle; a SIGKILLed one
leaves what it printed. After each trial:

- every step with an index.json verifies (``ckptd verify`` exit 0) and restores, rank by rank,
  bit-exact to what was saved (saved values are a function of step and rank);
- no step a handle reported committed is missing (no acknowledged step lost);
- every reported outcome matches the disk: committed ⇔ index.json present (checked when the
  reporting run ended and again at the end of the trial, so a commit that lands after a
  "failed" is caught), both ranks of a relayed step agree;
- the last run (nothing killed) commits every save: the daemon and the job recover.

The trials are seeded: ``CKPTD_CRASH_SEED`` (default below) and ``CKPTD_CRASH_TRIALS`` (20 in all,
half per commit mode, five per test item) reproduce or widen a run; every assertion names the seed
and the trial.
Trainers are forked from a forkserver that has torch imported, so a (re)start costs milliseconds.
"""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from ports import free_port

from ckptd import cli
from ckptd.core import protocol
from ckptd.core.errors import ProtocolError
from ckptd.core.names import INDEX_NAME, rank_data_name, rank_manifest_name, step_dir

SEED = int(os.environ.get("CKPTD_CRASH_SEED", "20240611"))
TRIALS = int(os.environ.get("CKPTD_CRASH_TRIALS", "20"))
NUMEL = 3 * 1024 * 1024 // 4          # the big tensor: 3 chunks of 1 MiB
HIDDEN = 32
COMMIT_TIMEOUT_S = 4.0                # relay: a save whose peer is gone fails (by the disk) after this
LAST_COMMIT_TIMEOUT_S = 60.0          # ... in the last run, where nothing is killed (a loaded machine is slow)
DAEMON_FLAGS = ("--debug-write-delay", "0.04", "--chunk-mib", "1", "--step-timeout", "20")
HANG_GUARD_S = 120.0
PHASES = ("save", "handoff", "write", "commit")
VICTIMS = ("trainer", "daemon", "both")


# ---- the trainer (runs in a process forked from the forkserver) ------------------------------------

def expected(step: int, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` saves at ``step``: exact small integers in float32, different everywhere."""
    base = float(step * 10000 + rank * 1000)
    return {"w": torch.arange(NUMEL, dtype=torch.float32).add_(base),
            "weight": torch.arange(HIDDEN * HIDDEN, dtype=torch.float32).reshape(HIDDEN, HIDDEN).add_(base + 1),
            "bias": torch.full((HIDDEN,), base + 2)}


def make_state() -> dict[str, Any]:
    model = torch.nn.Linear(HIDDEN, HIDDEN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)     # in the state: params are copied in the background
    return {"model": model, "optim": opt, "w": torch.zeros(NUMEL), "meta": {"step": 0, "rank": -1}}


def fill(state: dict[str, Any], step: int, rank: int) -> None:
    want = expected(step, rank)
    with torch.no_grad():
        state["w"].copy_(want["w"])
        state["model"].weight.copy_(want["weight"])
        state["model"].bias.copy_(want["bias"])
    state["meta"] = {"step": step, "rank": rank}


def mismatch(state: dict[str, Any], step: int, rank: int) -> str | None:
    want = expected(step, rank)
    got = {"w": state["w"], "weight": state["model"].weight.detach(), "bias": state["model"].bias.detach()}
    for name, tensor in want.items():
        if not torch.equal(got[name].view(torch.int32), tensor.view(torch.int32)):
            return f"{name} differs"
    if state["meta"] != {"step": step, "rank": rank}:
        return f"meta is {state['meta']}"
    return None


def trainer(spec: dict[str, Any]) -> None:
    """One rank: restore the latest committed step, then save ``saves`` more steps."""
    out = open(spec["out"], "a", buffering=1)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    code = 1
    try:
        code = _train(spec)
    except BaseException as e:
        print(f"CRASHED {type(e).__name__}: {e}", flush=True)
        import traceback
        traceback.print_exc()
    finally:
        out.flush()
        os._exit(code)


def _train(spec: dict[str, Any]) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    import ckptd_client
    torch.set_num_threads(1)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))    # stop saving, close, report
    rank, world = spec["rank"], spec["world"]
    store = None
    if world > 1:
        store = dist.TCPStore("127.0.0.1", spec["port"], world, rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    ck = ckptd_client.Checkpointer(spec["job"], socket=spec["socket"], root=spec["root"], rank=rank,
                                   world_size=world, store=store, commit=spec["mode"],
                                   commit_timeout=spec["commit_timeout"])
    state = make_state()
    start = ck.restore(state) or 0
    if start:
        bad = mismatch(state, start, rank)
        print(f"RESTORED {start}" if bad is None else f"BADRESTORE {start} {bad}", flush=True)
        if bad is not None:
            return 3
    handles: list[Any] = []
    told: set[int] = set()
    lock = threading.Lock()

    def report() -> None:
        with lock:
            for i, h in enumerate(list(handles)):
                if i not in told and h.done():
                    told.add(i)
                    outcome = "committed" if h.committed else "skipped" if h.skipped else "failed"
                    print(f"OUTCOME {h.step} {outcome} {h.error or ''}".rstrip(), flush=True)

    def reporter() -> None:            # outcomes as soon as known: a SIGKILLed rank leaves the most
        while True:
            report()
            time.sleep(0.005)
    threading.Thread(target=reporter, daemon=True).start()

    for step in range(start + 1, start + 1 + spec["saves"]):
        if stopping:
            break
        ck.fence()                            # the background copy of the last save is done
        fill(state, step, rank)
        print(f"SAVING {step}", flush=True)
        # Local mode retries a refused save (daemon down, the step's last attempt still stopping).
        # Relay mode must not: each rank's n-th save() is the job's n-th save (the store keys).
        for _attempt in range(100 if world == 1 else 1):
            try:
                handles.append(ck.save(step, state))
                print(f"SAVED {step}", flush=True)
                break
            except Exception as e:     # CheckpointError; in relay mode also the store's error once rank 0 died
                print(f"REFUSED {step} {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
                if stopping:
                    break
                time.sleep(0.1)
        report()
        time.sleep(spec["gap"])
    ck.close(timeout=60)
    report()
    if store is not None and not stopping:
        # Real ranks run in lockstep (collectives); these do not. Rank 0 hosts the store: it stays
        # until every rank is done, so a rank that fell behind (its saves refused) is not cut off.
        keys = [f"crash-trial/done/{r}" for r in range(world)]
        with contextlib.suppress(Exception):
            store.set(keys[rank], "1")
            deadline = time.monotonic() + 90
            while rank == 0 and not stopping and time.monotonic() < deadline and not store.check(keys):
                time.sleep(0.05)
    print("DONE", flush=True)
    return 0


# ---- the test side ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forkserver() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ckptd_client", __name__])
    return ctx


@dataclass
class Run:
    """The processes of one start of the job (one per rank) and what they printed."""
    name: str
    procs: list[Any]
    outs: list[Path]

    def lines(self, rank: int) -> list[str]:
        try:
            text = self.outs[rank].read_text()
        except FileNotFoundError:
            return []
        return text.split("\n")[:-1]         # complete lines only (a killed rank may leave half of one)

    def outcomes(self, rank: int) -> dict[int, str]:
        got: dict[int, str] = {}
        for line in self.lines(rank):
            if line.startswith("OUTCOME "):
                _, step, outcome, *_ = line.split(" ", 3)
                got[int(step)] = outcome
        return got

    def wait(self, timeout: float = HANG_GUARD_S) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
                p.join(10)
                raise AssertionError(f"{self.name}: a rank did not exit within {timeout:g}s (hang guard)")

    def text(self) -> str:
        return "\n".join(f"--- {self.name} rank {r} (exit {p.exitcode}) ---\n" + "\n".join(self.lines(r))
                         for r, p in enumerate(self.procs))


@dataclass
class Trial:
    seed: int
    n: int
    mode: str
    world: int
    job: str
    root: Path
    sock: Path
    tmp: Path
    ctx: Any
    rng: random.Random
    runs: list[Run] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def where(self) -> str:
        return (f"[seed {self.seed} trial {self.n} ({self.mode}): {'; '.join(self.notes)}; "
                f"rerun with CKPTD_CRASH_SEED={self.seed}]")

    def start(self, saves: int, commit_timeout: float = COMMIT_TIMEOUT_S) -> Run:
        port = free_port()
        name = f"run{len(self.runs)}"
        outs = [self.tmp / f"{self.job}-{name}-r{r}.out" for r in range(self.world)]
        procs = []
        for rank in range(self.world):
            spec = {"socket": str(self.sock), "root": str(self.root), "job": self.job, "rank": rank,
                    "world": self.world, "port": port, "mode": self.mode, "saves": saves,
                    "gap": 0.05, "commit_timeout": commit_timeout, "out": str(outs[rank])}
            p = self.ctx.Process(target=trainer, args=(spec,), name=f"{self.job}-{name}-r{rank}")
            p.start()
            procs.append(p)
        run = Run(name, procs, outs)
        self.runs.append(run)
        return run

    def step_path(self, step: int) -> Path:
        return Path(step_dir(str(self.root), self.job, step))

    def committed_on_disk(self, step: int) -> bool:
        return (self.step_path(step) / INDEX_NAME).is_file()


def wait_for(pred: Any, timeout: float) -> bool:
    """Poll ``pred`` every millisecond; False once ``timeout`` has passed (the moment never came)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.001)
    return False


def daemon_idle(sock: Path, job: str) -> bool:
    try:
        st = protocol.request_once(str(sock), {"op": "status"}, timeout=10)
    except (OSError, RuntimeError, ProtocolError):
        return False
    return not any(x["job"] == job for x in [*st["sessions"], *st["steps"], *st["saves"]])


def verify_ok(path: Path) -> tuple[int, str]:
    """``ckptd verify -q STEP`` (its own code, in this process: a subprocess per step costs too much)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = cli.main(["verify", "-q", str(path)])
    return code, buf.getvalue()


def check_restores(t: Trial, step: int) -> None:
    import ckptd_client
    for rank in range(t.world):
        ck = ckptd_client.Checkpointer(t.job, socket=str(t.tmp / "none.sock"), root=str(t.root), rank=rank,
                                       world_size=t.world, commit="local")
        state = make_state()
        assert ck.restore(state, step=step) == step, t.where()
        bad = mismatch(state, step, rank)
        assert bad is None, f"step {step} rank {rank} restores wrong: {bad} {t.where()}"
        ck.close()


def check_outcomes(t: Trial, runs: list[Run], superseded: set[int]) -> None:
    """Every outcome these runs reported matches the disk now (steps a later run saved again excepted)."""
    for run in runs:
        per_rank = [run.outcomes(r) for r in range(t.world)]
        for rank, outcomes in enumerate(per_rank):
            for step, outcome in outcomes.items():
                if step in superseded:
                    continue
                on_disk = t.committed_on_disk(step)
                assert outcome != "skipped", f"{run.name} rank {rank} skipped step {step} {t.where()}"
                if outcome == "committed":
                    assert on_disk, (f"{run.name} rank {rank}: step {step} reported committed but has no "
                                     f"index.json (an acknowledged step lost) {t.where()}\n{run.text()}")
                else:
                    assert not on_disk, (f"{run.name} rank {rank}: step {step} reported failed but index.json "
                                         f"exists {t.where()}\n{run.text()}")


def check_disk(t: Trial) -> list[int]:
    """Every committed step verifies and restores bit-exact; returns them."""
    job_dir = t.root / t.job
    steps = sorted(int(p.name.split("-")[1]) for p in job_dir.iterdir() if (p / INDEX_NAME).is_file()) \
        if job_dir.exists() else []
    for step in steps:
        code, text = verify_ok(t.step_path(step))
        assert code == 0, f"ckptd verify of step {step} exit {code}: {text} {t.where()}"
        check_restores(t, step)
    return steps


def kill_moment(t: Trial, run: Run, phase: str, step: int, rank: int) -> str:
    """Wait (bounded) for the moment ``phase`` of ``step`` on ``rank``; say what was seen."""
    path = t.step_path(step)
    if phase == "save":            # inside save(): just after the trainer says it calls it
        seen = wait_for(lambda: f"SAVING {step}" in run.lines(rank), 30)
        time.sleep(t.rng.uniform(0, 0.02))
    elif phase == "handoff":       # save() returned; the parameters' copy and the SAVE request run on
        seen = wait_for(lambda: f"SAVED {step}" in run.lines(rank), 30)
        time.sleep(t.rng.uniform(0, 0.03))
    elif phase == "write":         # the shard's data file is being written (a chunk every 40 ms)
        seen = wait_for(lambda: (path / rank_data_name(rank)).exists(), 30)
        time.sleep(t.rng.uniform(0, 0.15))
    else:                          # every manifest in place: the commit starts now
        seen = wait_for(lambda: all((path / rank_manifest_name(r)).exists() for r in range(t.world)), 30)
        time.sleep(t.rng.uniform(0, 0.004))
    return "seen" if seen else "not seen"


def signal_procs(run: Run, ranks: list[int], sig: int) -> None:
    for r in ranks:
        with contextlib.suppress(ProcessLookupError):
            if run.procs[r].pid is not None:
                os.kill(run.procs[r].pid, sig)


def start_daemon(daemon_factory: Any, root: Path | None, grace: str) -> Any:
    daemon = daemon_factory(*DAEMON_FLAGS, "--drain-grace", grace, name="d", root=root)
    daemon.grace = grace
    return daemon


def one_trial(t: Trial, daemon_factory: Any, daemon: Any, victim: str, phase: str) -> Any:
    rng = t.rng
    target = rng.randint(2, 4)
    rank = rng.randrange(t.world)
    sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
    dsig = rng.choice([signal.SIGKILL, signal.SIGTERM])
    # A SIGTERMed daemon drains for its grace: none at all (or barely any) when it is hit mid-commit.
    grace = rng.choice(["0", "0.05"] if phase == "commit" else ["0.05", "0.3", "2"])
    t.notes.append(f"kill the {victim} at {phase} of step {target} (rank {rank}), "
                   f"trainer {signal.Signals(sig).name}, daemon {signal.Signals(dsig).name}")
    if victim != "trainer" and dsig == signal.SIGTERM and daemon.grace != grace:
        assert daemon.stop() == 0, t.where()
        daemon = start_daemon(daemon_factory, t.root, grace)
        t.notes.append(f"drain grace {grace}s")
    first = t.start(saves=6)
    t.notes.append(kill_moment(t, first, phase, target, rank))
    if victim in ("trainer", "both"):
        signal_procs(first, [rank], sig)
        signal_procs(first, [r for r in range(t.world) if r != rank], signal.SIGTERM)
    if victim in ("daemon", "both"):
        daemon.proc.send_signal(dsig)
        daemon.proc.wait(HANG_GUARD_S)
        daemon = start_daemon(daemon_factory, t.root, rng.choice(["0.05", "0.3", "2"]))
    first.wait()
    assert all("BADRESTORE" not in line for r in range(t.world) for line in first.lines(r)), first.text()
    if victim == "daemon":         # the trainers outlived it: they went on saving through the restart
        assert all(p.exitcode == 0 for p in first.procs), f"{t.where()}\n{first.text()}"
    assert wait_for(lambda: daemon_idle(t.sock, t.job), HANG_GUARD_S), f"daemon never idle {t.where()}"
    check_outcomes(t, [first], set())
    # What died is restarted; nothing is killed now: every save of this run must commit.
    last = t.start(saves=2, commit_timeout=LAST_COMMIT_TIMEOUT_S)
    last.wait()
    for r in range(t.world):
        lines = last.lines(r)
        assert last.procs[r].exitcode == 0 and "DONE" in lines, f"{t.where()}\n{last.text()}"
        outcomes = last.outcomes(r)
        assert len(outcomes) == 2 and set(outcomes.values()) == {"committed"}, f"{t.where()}\n{last.text()}"
    assert wait_for(lambda: daemon_idle(t.sock, t.job), HANG_GUARD_S), f"daemon never idle {t.where()}"
    again = set(last.outcomes(0))
    check_outcomes(t, [first], again)
    check_outcomes(t, [last], set())
    committed = check_disk(t)
    assert committed and max(committed) == max(again), f"{committed} {t.where()}"
    told = [o for r in range(t.world) for o in first.outcomes(r).values()]
    t.notes.append(f"first run: {told.count('committed')} committed, {told.count('failed')} failed, "
                   f"exits {[p.exitcode for p in first.procs]}; on disk {committed}")
    return daemon


BATCH = 5                              # trials per test item (each with a daemon of its own)
ITEMS = [(mode, b) for mode in ("local", "relay") for b in range(max(1, (TRIALS // 2 + BATCH - 1) // BATCH))]


@pytest.mark.parametrize(("mode", "batch"), ITEMS)
def test_crash_trials(mode: str, batch: int, daemon_factory: Any, tmp: Path, forkserver: Any) -> None:
    world = 1 if mode == "local" else 2
    seed = SEED + (0 if mode == "local" else 1)
    trials = range(batch * BATCH, min((batch + 1) * BATCH, max(1, TRIALS // 2)))
    daemon = start_daemon(daemon_factory, None, "0.3")
    rng = random.Random(seed)
    plan = [(v, p) for v in VICTIMS for p in PHASES]
    rng.shuffle(plan)
    t0 = time.monotonic()
    for n in trials:
        victim, phase = plan[n % len(plan)]
        t = Trial(seed, n, mode, world, f"{mode}{n}", daemon.root, daemon.socket, tmp, forkserver,
                  random.Random(seed * 1000 + n))
        daemon = one_trial(t, daemon_factory, daemon, victim, phase)
        print(f"trial {n} {victim}/{phase}: {time.monotonic() - t0:.1f}s {t.notes}", flush=True)
    text = daemon.log_text()
    for marker in ("Traceback", "exception was never retrieved", "internal daemon error"):
        assert marker not in text, f"daemon log shows {marker!r} [seed {seed}]:\n{text[-6000:]}"
