"""A committed step restores, exactly, from every tier, whatever each rank's state looks like.

Two real rank processes (tests/rank_worker.py, started once per test and driven over pipes) save
through a real daemon subprocess, in local commit mode (no process group: the daemon counts the
ranks) and in relay mode (a gloo group: commits relayed through its store). After each commit
``ckptd verify`` must pass, and every rank must get its own state back bit for bit from the
daemon's memory and from storage (``memory=False``), and again after the daemon is restarted.

States are the way users have them: ranks whose tensors differ in shape (a ZeRO-style flat
partition, a hand-sharded Megatron-style weight), in dtype, and in presence (a buffer only one
rank has), 0-d and empty tensors, every supported dtype, nested containers and JSON leaves, and
DTensors beside plain tensors (relay mode). The property test draws such states with hypothesis.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zygote
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ports import free_port

from ckptd import cli
from ckptd.core.global_index import LOCAL
from ckptd.core.reader import StepReader
from ckptd.core.schema import DTYPE_ITEMSIZE
from ckptd.launch import DaemonProcess, spawn_daemon

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "rank_worker.py")
WORLD = 2
REPLY_S = 300.0          # a safety net against a hung worker, not a timing claim
JOB = "rt"


class Rank:
    """One rank_worker process: a command in, one JSON reply out (read on a thread, bounded wait)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log.open("w")
        self.proc = zygote.popen([sys.executable, WORKER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=self.log, text=True, env=env, cwd=REPO)
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put(None)

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        try:
            r = self.replies.get(timeout=REPLY_S)
        except queue.Empty:
            raise AssertionError(f"rank worker gave no reply within {REPLY_S} s; log: {self.log.name}") from None
        assert r is not None, f"rank worker exited ({self.proc.poll()}); log: {Path(self.log.name).read_text()[-3000:]}"
        return r

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Job:
    """A daemon and WORLD rank workers; every command goes to all ranks at once."""

    def __init__(self, base: Path, mode: str) -> None:
        self.base, self.mode = base, mode
        self.root, self.sock = base / "root", base / "d.sock"
        self.daemon: DaemonProcess = self.start_daemon()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if mode == "relay":
            env["MASTER_PORT"] = str(free_port())
        self.ranks = [Rank(["--socket", str(self.sock), "--job", JOB, "--rank", str(r), "--world", str(WORLD),
                            "--mode", mode], env, base / f"rank{r}.log") for r in range(WORLD)]
        for r in self.ranks:
            assert r.reply() == {"ready": True}

    def start_daemon(self) -> DaemonProcess:
        return spawn_daemon(self.root, self.sock, "--step-timeout", "120", log=self.base / "daemon.log")

    def all(self, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for r, cmd in zip(self.ranks, per_rank, strict=True):
            r.send(cmd)
        return [r.reply() for r in self.ranks]

    def restart_daemon(self) -> None:
        self.daemon.kill()
        self.daemon = self.start_daemon()
        assert [r["error"] for r in self.all([{"op": "reconnect"}] * WORLD)] == [None] * WORLD

    def step_dir(self, step: int) -> Path:
        return self.root / JOB / f"step-{step:012d}"

    def stop(self) -> None:
        for r in self.ranks:
            r.stop()
        self.daemon.kill()


def jobs(mode: str) -> Iterator[Job]:
    base = Path(f"/tmp/ckrt-{os.getpid()}-{mode}")
    subprocess.run(["rm", "-rf", str(base)], check=False)
    base.mkdir()
    job = Job(base, mode)
    yield job
    job.stop()
    subprocess.run(["rm", "-rf", str(base)], check=False)


@pytest.fixture(scope="module")
def local_job() -> Iterator[Job]:
    yield from jobs("local")


@pytest.fixture(scope="module")
def relay_job() -> Iterator[Job]:
    yield from jobs("relay")


def has_dtensor(spec: Any) -> bool:
    if isinstance(spec, dict):
        return "__d" in spec or any(has_dtensor(v) for v in spec.values())
    return isinstance(spec, list) and any(has_dtensor(v) for v in spec)


def round_trip(job: Job, step: int, specs: list[dict[str, Any]], *, restart: bool = False) -> None:
    """Save ``specs`` (one per rank) as ``step``; verify; restore from memory and from storage on every rank."""
    saved = job.all([{"op": "save", "step": step, "spec": s} for s in specs])
    assert saved == [{"error": None, "committed": True}] * WORLD, saved
    assert cli.main(["verify", "-q", str(job.step_dir(step))]) == 0
    sources = ["memory", "storage"]
    if restart:
        job.restart_daemon()
        sources = ["storage"]       # the restarted daemon holds nothing: memory=True falls back
    for memory in (True, False):
        got = job.all([{"op": "restore", "step": step, "spec": s, "memory": memory} for s in specs])
        for rank, r in enumerate(got):
            assert r["error"] is None, (rank, memory, r)
            assert r["mismatches"] == [], (rank, memory, r)
        if not memory or restart:
            assert [r["source"] for r in got] == ["storage"] * WORLD
        elif not any(has_dtensor(s) for s in specs):
            assert [r["source"] for r in got] == [sources[0]] * WORLD


def t(dtype: str, shape: list[int], seed: int) -> dict[str, Any]:
    return {"__t": [dtype, shape, seed]}


# ZeRO-style flat optimizer partitions of unequal length, a hand-sharded (Megatron-style) weight,
# a per-rank buffer of another length and dtype, a buffer only rank 1 has, and identical replicas.
PER_RANK_SHAPES = [
    {"model": {"w": t("float32", [4, 3], 1), "b": t("float32", [3], 2)},
     "optim": {"flat": t("float32", [37], 10), "step": 5},
     "buf": t("int64", [5], 20), "mixed": t("float16", [2, 2], 30),
     "loader/pos": t("int64", [1], 50), "cfg/seed": t("int64", [1], 60)},
    {"model": {"w": t("float32", [2, 3], 3), "b": t("float32", [3], 2)},
     "optim": {"flat": t("float32", [36], 11), "step": 5},
     "buf": t("int64", [6], 21), "mixed": t("bfloat16", [3], 31),
     "only1": {"extra": t("uint8", [7], 40)},
     "loader/pos": t("int64", [1], 51), "cfg/seed": t("int64", [1], 60)},
]
# ("loader/pos": a top-level key holding a "/", its tensor differing by rank: per rank under its own
# name, not "loader"; "cfg/seed" the same on both ranks: not per rank.)


@pytest.mark.parametrize("mode", ["local", "relay"])
def test_per_rank_shapes_dtypes_and_presence_round_trip(mode: str, request: pytest.FixtureRequest) -> None:
    job: Job = request.getfixturevalue(f"{mode}_job")
    round_trip(job, 1, PER_RANK_SHAPES)
    reader = StepReader(str(job.step_dir(1)))
    tensors, per_rank = reader.tensor_map()
    buf = tensors["buf"]
    assert buf.kind == LOCAL and not buf.same
    assert [buf.copy_of(p) for p in buf.pieces] == [("int64", (5,)), ("int64", (6,))]
    assert [tensors["mixed"].copy_of(p) for p in tensors["mixed"].pieces] == [("float16", (2, 2)), ("bfloat16", (3,))]
    assert [p.rank for p in tensors["only1/extra"].pieces] == [1]
    assert tensors["model/b"].same
    assert per_rank == ["buf", "loader/pos", "mixed", "model", "only1", "optim"]
    index = json.loads((job.step_dir(1) / "index.json").read_text())
    assert index["tensors"]["buf"]["copies"] == {"1": {"dtype": "int64", "shape": [6]}}
    assert "copies" not in index["tensors"]["model/b"]
    round_trip(job, 2, PER_RANK_SHAPES, restart=True)     # a restarted daemon: restored from storage
    round_trip(job, 3, PER_RANK_SHAPES)                    # and saving goes on after it


# ---- the property: any per-rank state round-trips -------------------------------------------------

DTYPES = sorted(DTYPE_ITEMSIZE)
FLOATS = ["float16", "bfloat16", "float32", "float64"]
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)
seeds = st.integers(0, 2**31 - 1)
plain = st.builds(lambda d, s, seed: t(d, s, seed), st.sampled_from(DTYPES), shapes, seeds)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**53, 2**53),
                      st.floats(allow_nan=False, allow_infinity=False), st.text("abcxyz _-", max_size=6))
key = st.sampled_from(["a", "b", "w", "buf", "exp_avg", "layer.0"])
tree = st.recursive(st.one_of(plain, plain, json_leaf),
                    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(key, kids, max_size=3)),
                    max_leaves=8)
TOP = ["model", "optim", "buf", "data", "rng"]


@st.composite
def variant(draw: st.DrawFn, spec: Any) -> Any:
    """``spec`` as another rank has it: each tensor kept, or with its own shape, dtype or values;
    dict entries now and then dropped (a tensor only some ranks hold)."""
    if isinstance(spec, dict) and "__t" in spec:
        dtype, shape, seed = spec["__t"]
        how = draw(st.sampled_from(["same", "same", "shape", "dtype", "values"]))
        if how == "shape":
            shape = draw(shapes)
        elif how == "dtype":
            dtype = draw(st.sampled_from(DTYPES))
        elif how == "values":
            seed = draw(seeds)
        return t(dtype, shape, seed)
    if isinstance(spec, dict):
        return {k: draw(variant(v)) for k, v in spec.items() if draw(st.integers(0, 5))}
    if isinstance(spec, list):
        return [draw(variant(v)) for v in spec]
    return spec


@st.composite
def rank_states(draw: st.DrawFn) -> list[dict[str, Any]]:
    """WORLD ranks' states: one drawn, the others variants of it, each with entries of its own."""
    base = draw(st.dictionaries(st.sampled_from(TOP), tree, min_size=1, max_size=4))
    out = [base]
    for _ in range(WORLD - 1):
        other = draw(variant(base))
        other.update(draw(st.dictionaries(st.sampled_from(TOP), tree, max_size=1)))
        out.append(other or {"model": draw(tree)})
    return out


@st.composite
def dtensor_part(draw: st.DrawFn) -> dict[str, Any]:
    """DTensors every rank holds alike (a collective state): global shape, placement, values."""
    out: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(["wq", "wk", "emb", "norm"]), unique=True, max_size=3)):
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))
        placements = ["replicate"] + [f"shard{d}" for d in range(len(shape))]
        out[name] = {"__d": [draw(st.sampled_from(FLOATS)), shape, draw(st.sampled_from(placements)), draw(seeds)]}
    return out


class Steps:
    """Each example saves a new step of the module's job."""
    def __init__(self, first: int) -> None:
        self.next = first

    def take(self) -> int:
        self.next += 1
        return self.next


LOCAL_STEPS, RELAY_STEPS = Steps(100), Steps(100)
EXAMPLES = settings(max_examples=int(os.environ.get("CKPTD_ROUNDTRIP_EXAMPLES", "60")), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@EXAMPLES
@given(states=rank_states())
def test_any_per_rank_state_round_trips_local(local_job: Job, states: list[dict[str, Any]]) -> None:
    round_trip(local_job, LOCAL_STEPS.take(), states)


@EXAMPLES
@given(states=rank_states(), shared=dtensor_part())
def test_any_per_rank_state_with_dtensors_round_trips_relay(relay_job: Job, states: list[dict[str, Any]],
                                                            shared: dict[str, Any]) -> None:
    specs = [{**s, "sharded": shared} if shared else s for s in states]
    round_trip(relay_job, RELAY_STEPS.take(), specs)
