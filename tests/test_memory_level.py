"""Memory-level saves (issue 20, acceptance 4): steps held in the daemons' memory and their peers', not written.

Two daemons on loopback stand for two nodes (one shared root, peers of each other, K = 1). Real
FSDP2 ranks (tests/sharded_trainer.py, gloo, one per daemon) save to memory every step and to
storage every 5 steps. A restart after a SIGKILL restores the newest memory-level step (newer than
the newest storage step), bit-exact, and trains on exactly as an uninterrupted run; with every daemon
SIGKILLed the memory-level steps are gone and the restore takes the storage step and says why. A
memory-level step that cannot be held (budget) or replicated (a dead peer) fails its handle; nothing
of it looks committed.
"""
# mypy: disable-error-code="union-attr,index"
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote

import ckptd_client
from ckptd_client import CheckpointError

import sharded_trainer as st
from test_acceptance import free_port
from test_cli_steps import ckptd
from test_memory_tier import status
from test_peers import peer_args, secret_file
from test_sharded import assert_bit_identical
from test_sharded_memory import load, losses, restore_info

pytestmark = pytest.mark.timeout(600)
STEPS, EVERY = 12, 5


def committed_held_steps(root: Path, job: str) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (root / job / "_memory").glob("step-*/index.json"))


def level_line(out: str) -> tuple[str, list[str]]:
    got = st.lines(out, "RESTORE-LEVEL")
    assert len(got) == 1, out
    level, *rest = got[0]
    return level, json.loads(" ".join(rest))


def test_memory_level_steps_restore_newest_then_storage_when_daemons_die(daemon_factory: Any, tmp: Path) -> None:
    addrs = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    a = daemon_factory(*peer_args(addrs[0], addrs, secret), name="a")
    b = daemon_factory(*peer_args(addrs[1], addrs, secret), name="b")
    ref_out, out = tmp / "ref", tmp / "out"
    ref_out.mkdir()
    out.mkdir()
    steps = ("--steps", str(STEPS), "--every", str(EVERY), "--memory-every", "1", "--layout", "fsdp")
    reference = st.run_group(2, "train", "--job", "ref", "--out", str(ref_out), "--socket", f"{a.socket},{b.socket}",
                             *steps)
    assert all("DONE" in o for o in reference)
    # Storage steps 5 and 10 pruned the memory-level steps at or below them; 11 and 12 stay (memory.steps = 1
    # keeps the newest held, the directory of the newest only).
    assert committed_held_steps(a.root, "ref") == [12]
    assert not list((a.root / "ref" / "_memory").glob("step-*/rank-*.data"))      # nothing was written

    # 1. SIGKILL after memory-level step 7 committed: the restart gets the newest memory-level step, not 5.
    common = ("--job", "mem", "--out", str(out), "--socket", f"{a.socket},{b.socket}", *steps)
    procs = st.launch(2, "train", *common, "--step-sleep", "0.3")
    st.kill_after_commit(procs, 7)
    newest = committed_held_steps(a.root, "mem")[-1]
    assert newest >= 7 and newest % EVERY != 0
    outs = st.run_group(2, "train", *common)
    for rank, o in enumerate(outs):
        assert st.lines(o, "RESTORED") == [[str(newest)]], o
        source, mem, peer, storage = restore_info(o)
        assert source in ("memory", "peer") and storage == 0 and mem + peer > 0, o
        assert level_line(o) == ("memory", []), o
        got, want = load(out / f"restored-w2.rank{rank}.pt"), load(out / f"ref-step{newest}.rank{rank}.pt")
        assert_bit_identical(got["local"], want["local"], f"rank {rank}'s shards of memory-level step {newest}")
        assert got["scalars"] == want["scalars"]
        assert torch.equal(got["torch_rng"], want["torch_rng"])
        want_losses = {s: v for s, v in losses(reference[rank]).items() if s > newest}
        assert losses(o) == want_losses and sorted(want_losses) == list(range(newest + 1, STEPS + 1)), o

    # 2. Every daemon SIGKILLed (their memory is gone): fresh daemons; the restore takes storage step 10.
    for d in (a, b):
        d.proc.kill()
        d.proc.wait()
    assert committed_held_steps(a.root, "mem") == [STEPS]
    a2, b2 = daemon_factory(name="a2"), daemon_factory(name="b2")
    outs = st.run_group(2, "train", "--job", "mem", "--out", str(out), "--socket", f"{a2.socket},{b2.socket}",
                        "--steps", str(STEPS + 1), "--every", str(EVERY), "--layout", "fsdp")
    for rank, o in enumerate(outs):
        assert st.lines(o, "RESTORED") == [["10"]], o
        level, passed = level_line(o)
        assert level == "storage" and restore_info(o)[0] == "storage", o
        assert passed and passed[0].startswith(f"memory-level step {STEPS}"), o
        got, want = load(out / f"restored-w2.rank{rank}.pt"), load(out / f"ref-step10.rank{rank}.pt")
        assert_bit_identical(got["local"], want["local"], f"rank {rank}'s shards of storage step 10")


def small_state(mib: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(mib)
    return {"w": torch.randn(mib * 1024 * 256, generator=g), "meta": {"step": mib}}


def test_memory_level_step_over_budget_or_unreplicated_fails_its_handle(daemon_factory: Any, tmp: Path) -> None:
    """A memory-level step that cannot be held fails its handle with the reason: over the memory budget,
    or a replica its peer never acknowledged; neither leaves a committed memory-level step. A storage
    save of the same state commits (a shard not held in memory is still written)."""
    d = daemon_factory("--memory-budget", "2MiB", name="small")
    ck = ckptd_client.Checkpointer("budget", socket=str(d.socket), rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="does not fit the memory budget"):
        ck.save(1, small_state(4), level="memory").wait(60)
    assert committed_held_steps(d.root, "budget") == []
    ck.save(2, small_state(4)).wait(60)
    ck.save(3, small_state(1), level="memory").wait(60)       # one that fits commits
    assert committed_held_steps(d.root, "budget") == [3]
    # ls and status show it as a memory-level step, beside the storage step.
    ls = ckptd("ls", str(d.root), "budget", "--json")
    assert ls.returncode == 0, ls.stderr
    assert [(r["step"], r["level"], r["state"]) for r in json.loads(ls.stdout)] == [
        (2, "storage", "committed"), (3, "memory", "memory-level")]
    text = ckptd("ls", str(d.root), "budget").stdout
    assert "memory-level: held in the daemons' memory" in text, text
    held = [(s["job"], s["step"], s["level"]) for s in status(d.socket)["memory"]["held"]]
    assert ("budget", 3, "memory") in held, held
    assert "job=budget memory-level step=3" in ckptd("status", "--socket", str(d.socket)).stdout
    state: dict[str, Any] = {"w": torch.zeros(1024 * 256), "meta": {}}
    assert ck.restore(state) == 3 and ck.last_restore.level == "memory" and ck.last_restore.from_storage == 0
    assert torch.equal(state["w"], small_state(1)["w"]) and state["meta"] == {"step": 1}
    ck.close()

    dead = f"127.0.0.1:{free_port()}"           # a peer nobody listens on
    me = f"127.0.0.1:{free_port()}"
    secret = secret_file(tmp / "secret", "s3cret-shared-by-every-node-0123456789")
    p = daemon_factory(*peer_args(me, [me, dead], secret), "--peer-io-timeout", "2", name="lonely")
    ck = ckptd_client.Checkpointer("lonely", socket=str(p.socket), rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="0 of its 1 peer replicas"):
        ck.save(1, small_state(1), level="memory").wait(60)
    assert committed_held_steps(p.root, "lonely") == []
    # Nothing of it is left: no held shard (its slot went back to the trainer), no manifest.
    assert status(p.socket)["memory"]["held"] == []
    assert not list((p.root / "lonely" / "_memory").glob("step-*/rank-*.json"))
    with pytest.raises(ValueError, match="level must be"):
        ck.save(2, small_state(1), level="disk")
    ck.close()


def test_memory_level_save_needs_the_memory_tier(daemon_factory: Any) -> None:
    d = daemon_factory("--memory-steps", "0", name="nomem")
    ck = ckptd_client.Checkpointer("nomem", socket=str(d.socket), rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="memory-level saves need the memory tier"):
        ck.save(1, small_state(1), level="memory").wait(60)
    ck.save(2, small_state(1)).wait(60)
    ck.close()


def test_an_explicit_memory_level_step_no_daemon_holds_says_so(daemon_factory: Any) -> None:
    """restore(step=N) of a memory-level step the daemons no longer hold (every one restarted), or with
    memory=False (which does not ask them), said "step N does not exist" while `ckptd ls` lists it as
    memory-level. Now the error says what it is, why memory did not serve it, and what to do."""
    d = daemon_factory()
    with ckptd_client.Checkpointer("gone", socket=str(d.socket)) as ck:
        ck.save(4, {"w": torch.full((8,), 4.0)}).wait(60)
        ck.save(5, {"w": torch.full((8,), 5.0)}, level="memory").wait(60)
    with ckptd_client.Checkpointer("gone", socket=str(d.socket), memory=False) as ck:
        with pytest.raises(CheckpointError, match="step 5 of job 'gone' is a memory-level step") as e:
            ck.restore({"w": torch.zeros(8)}, step=5)
        assert "memory=False" in str(e.value)
    d.kill()
    d = daemon_factory(root=d.root)                 # every daemon holding it restarted
    with ckptd_client.Checkpointer("gone", socket=str(d.socket)) as ck:
        with pytest.raises(CheckpointError, match="is a memory-level step") as e:
            ck.restore({"w": torch.zeros(8)}, step=5)
        assert "before it, memory-level: " in str(e.value), str(e.value)
        live = {"w": torch.zeros(8)}
        assert ck.restore(live) == 4 and torch.equal(live["w"], torch.full((8,), 4.0))


VOTE_WORKER = '''
import json, os, sys
import torch, torch.distributed as dist
import ckptd_client
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank, world_size=2)
sock, phase = sys.argv[1].split(",")[rank], sys.argv[2]
ck = ckptd_client.Checkpointer("vote", socket=sock, join_timeout=60, commit_timeout=float(os.environ.get("CT", "60")))
if (phase, rank) in (("restore", 1), ("save", 0)):
    import time
    time.sleep(float(os.environ.get("LATE" if rank else "R0_LATE", "0")))
if phase == "save":
    plus = float(os.environ.get("PLUS", "0"))
    ck.save(3, {"w": torch.full((8,), 100.0 + plus + rank), "meta": {"pos": 77}}, level="memory").wait(60)
    out = {}
else:
    live = {"w": torch.zeros(8), "meta": {"pos": 0}}
    got = ck.restore(live)
    out = {"got": got, "w": live["w"].tolist(), "pos": live["meta"]["pos"], "info": repr(ck.last_restore)}
ck.close()
dist.barrier()
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
'''


def vote_group(script: Path, socks: str, phase: str, **env: str) -> list[dict[str, Any]]:
    """Two gloo ranks of ``script``, rank r on the r-th socket of ``socks``; each one's RESULT line. The
    ranks are forked from the zygote (torch imported once, not twice per group: tests run up to 5 groups)."""
    import subprocess
    import sys

    port = str(free_port())
    procs = [zygote.popen([sys.executable, str(script), socks, phase], text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          env={**os.environ, **env, "RANK": str(r), "MASTER_PORT": port}) for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [json.loads(next(ln for ln in o.splitlines() if ln.startswith("RESULT "))[7:]) for o in outs]


def test_a_memory_level_step_one_rank_cannot_read_is_written_into_no_rank(daemon_factory: Any, tmp: Path) -> None:
    """Memory-level step 3 and no storage step; node B's daemon restarts (its memory gone). Rank 0 could
    read its shard from daemon A, rank 1 cannot: no rank may load it (ranks vote before they write), so
    both restores find nothing and both states stay as they were, not rank 0's half loaded."""
    script = tmp / "vote_worker.py"
    script.write_text(VOTE_WORKER)
    group = functools.partial(vote_group, script)


    a, b = daemon_factory(name="a"), daemon_factory(name="b", root=tmp / "root")
    assert a.root == b.root
    group(f"{a.socket},{b.socket}", "save")
    assert committed_held_steps(a.root, "vote") == [3]
    b.proc.kill()
    b.proc.wait()
    b2 = daemon_factory(name="b2", root=tmp / "root")
    got = group(f"{a.socket},{b2.socket}", "restore")
    for rank, r in enumerate(got):
        assert (r["got"], r["w"], r["pos"], r["info"]) == (None, [0.0] * 8, 0, "None"), (rank, r)


def test_a_memory_level_step_saved_again_after_one_daemon_restarted_replaces_it(daemon_factory: Any,
                                                                                tmp: Path) -> None:
    """Relay commit over daemons A (rank 0) and B (rank 1): memory-level step 3 commits; A restarts (its
    memory gone, B's not), so run 2 cannot restore step 3 and saves it again. A took it for lost and removed
    it while B, which had seen it saved, refused the save as "already committed": the new step failed and
    the old one was gone. A memory-level step saved again now replaces the committed one on every daemon."""
    script = tmp / "vote_worker.py"
    script.write_text(VOTE_WORKER)
    a, b = daemon_factory(name="a"), daemon_factory(name="b", root=tmp / "root")
    vote_group(script, f"{a.socket},{b.socket}", "save")
    assert committed_held_steps(a.root, "vote") == [3]
    a.proc.kill()
    a.proc.wait()
    a2 = daemon_factory(name="a2", root=tmp / "root")
    for delay in ("0", "2"):          # rank 0's save first, or rank 1's: both orders
        vote_group(script, f"{a2.socket},{b.socket}", "save", PLUS="50" if delay == "0" else "60", R0_LATE=delay)
        got = vote_group(script, f"{a2.socket},{b.socket}", "restore")
        want = 150.0 if delay == "0" else 160.0
        for rank, r in enumerate(got):
            assert (r["got"], r["w"], r["pos"]) == (3, [want + rank] * 8, 77), (delay, rank, r)
    assert "memory-level step saved again: the committed one is replaced" in a2.log_text() + b.log_text()


def test_a_rank_that_starts_its_restore_later_than_the_commit_timeout_still_votes(daemon_factory: Any,
                                                                                 tmp: Path) -> None:
    """Ranks may start up to the join window apart; rank 0 plans its part and votes at once. The vote must
    wait that long too, not only the (shorter) commit timeout: rank 1, 8 s late with a 3 s commit timeout,
    and both restore the memory-level step."""
    script = tmp / "vote_worker.py"
    script.write_text(VOTE_WORKER)
    a, b = daemon_factory(name="a"), daemon_factory(name="b", root=tmp / "root")
    vote_group(script, f"{a.socket},{b.socket}", "save")
    got = vote_group(script, f"{a.socket},{b.socket}", "restore", CT="3", LATE="8")
    for rank, r in enumerate(got):
        assert (r["got"], r["w"], r["pos"]) == (3, [100.0 + rank] * 8, 77), (rank, r)


BOTH_LEVELS_WORKER = """
import json, os, sys
import torch, torch.distributed as dist
import ckptd_client
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank, world_size=2)
sock = sys.argv[1].split(",")[rank]
ck = ckptd_client.Checkpointer("both", socket=sock, join_timeout=60, commit_timeout=60)
state = {"w": torch.full((8,), 10.0 + rank)}
ck.save(3, state, level="memory").wait(60)
state["w"] += 1
ck.save(3, state).wait(60)                    # the same step to storage: a save of its own
out = {"mode": ck.commit_mode.value, "latest": ck.latest_step()}
ck.close()
dist.barrier()
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def test_a_step_saved_at_memory_level_can_then_be_saved_to_storage_with_relay_commit(daemon_factory: Any,
                                                                                     tmp: Path) -> None:
    """Relay commit keyed a step's store keys by its number alone, so a step saved at memory level could
    not be saved to storage in the same run ("saved once already"): the storage save a preemption
    handler makes of the step the loop just saved to memory. Each level has its own keys now."""
    script = tmp / "both_worker.py"
    script.write_text(BOTH_LEVELS_WORKER)
    a, b = daemon_factory(name="a"), daemon_factory(name="b", root=tmp / "root")
    got = vote_group(script, f"{a.socket},{b.socket}", "save")
    assert got == [{"mode": "relay", "latest": 3}] * 2, got
    assert committed_held_steps(a.root, "both") == []        # superseded by the storage step
    with ckptd_client.Checkpointer("both", root=str(a.root), memory=False, rank=1, world_size=2) as ck:
        live = {"w": torch.zeros(8)}
        assert ck.restore(live) == 3 and torch.equal(live["w"], torch.full((8,), 12.0))


def earlier_run_then_restart(daemon_factory: Any, tmp: Path, memory_steps: tuple[int, ...],
                             backdate: bool = True) -> tuple[Path, Any]:
    """Run 1 of job "j": storage step 10 (w = 10), then memory-level ``memory_steps`` (w = the step); its
    daemon killed, its memory-level indexes dated a minute back with ``backdate`` (a restart that takes
    longer than remove_stale's clock slack; a test's is at once); (the root, run 2's fresh daemon)."""
    import time
    root = tmp / "root"
    d = daemon_factory(root=root, name="run1")
    with ckptd_client.Checkpointer("j", socket=str(d.socket)) as ck:
        ck.save(10, {"w": torch.full((1024,), 10.0)}).wait(60)
        for s in memory_steps:
            ck.save(s, {"w": torch.full((1024,), float(s))}, level="memory").wait(60)
    assert committed_held_steps(root, "j") == [max(memory_steps)]
    d.proc.kill()
    d.proc.wait()
    for index in (root / "j" / "_memory").glob("step-*/index.json") if backdate else ():
        t = time.time() - 60
        os.utime(index, (t, t))
    return root, daemon_factory(root=root, name="run2")


@pytest.mark.parametrize("lost, saved", [((12,), 11), ((11, 12), 12)])
def test_memory_level_steps_lost_in_a_restart_moments_ago_neither_outrank_nor_block_the_new_run(
        daemon_factory: Any, tmp: Path, lost: tuple[int, ...], saved: int) -> None:
    """Run 1's memory-level steps ``lost`` go with its daemon (SIGKILL) and run 2 starts at once, within
    remove_stale's clock slack, restores storage step 10 and saves memory-level step ``saved``. Below the
    lost step 12, run 2's committed step 11 was pruned at once (memory.steps = 1 kept the lost 12) and the
    restart came back from 10; of the same number, save() raised "already committed". The daemon knows
    which memory-level steps it saw saved: one it never saw nor holds is lost, removed when a lower step
    commits or its number is saved again; run 2's step restores."""
    root, d2 = earlier_run_then_restart(daemon_factory, tmp, lost, backdate=False)
    with ckptd_client.Checkpointer("j", socket=str(d2.socket)) as ck:
        assert ck.restore({"w": torch.zeros(1024)}) == 10
        h = ck.save(saved, {"w": torch.full((1024,), 200.0)}, level="memory")
        h.wait(60)
        assert h.committed and committed_held_steps(root, "j") == [saved]
    with ckptd_client.Checkpointer("j", socket=str(d2.socket)) as ck:
        live = {"w": torch.zeros(1024)}
        assert ck.restore(live) == saved and ck.last_restore is not None and ck.last_restore.level == "memory"
        assert torch.equal(live["w"], torch.full((1024,), 200.0))


def test_after_a_fallback_to_storage_a_new_runs_memory_level_steps_stand(daemon_factory: Any, tmp: Path) -> None:
    """Run 1: storage step 10, memory-level 11..14 (memory.steps = 1 keeps 14); its daemon restarts, so
    run 2 restores storage step 10. Run 2's memory-level saves 11..14 must each stand once committed:
    run 1's step 14, committed before they began, goes (it had outranked them: each was pruned as soon
    as committed, and run 2's save of 14 was refused). A restart of run 2 restores its own step 14."""
    def state(v: float) -> dict[str, Any]:
        return {"w": torch.full((1024,), float(v))}

    root, d2 = earlier_run_then_restart(daemon_factory, tmp, (11, 12, 13, 14))
    with ckptd_client.Checkpointer("j", socket=str(d2.socket)) as ck:
        live = state(0)
        assert ck.restore(live) == 10 and torch.equal(live["w"], state(10)["w"])
        for s in (11, 12, 13, 14):
            h = ck.save(s, state(100 + s), level="memory")
            h.wait(60)
            assert h.committed and committed_held_steps(root, "j") == [s], s
    with ckptd_client.Checkpointer("j", socket=str(d2.socket)) as ck:
        live = state(0)
        assert ck.restore(live) == 14 and torch.equal(live["w"], state(114)["w"])
        assert ck.last_restore.level == "memory"
    assert "memory-level steps of an earlier run removed" in d2.log_text()


def test_a_storage_commit_below_an_earlier_runs_memory_level_steps_removes_them(daemon_factory: Any,
                                                                               tmp: Path) -> None:
    """As above, but run 2 saves a storage step (11) after restoring 10: run 1's memory-level 14, committed
    before that save began, goes with its commit (left, it outranked run 2's storage step 11 in every
    restore that could read it)."""
    root, d2 = earlier_run_then_restart(daemon_factory, tmp, (14,))
    with ckptd_client.Checkpointer("j", socket=str(d2.socket)) as ck:
        assert ck.restore({"w": torch.zeros(1024)}) == 10
        ck.save(11, {"w": torch.full((1024,), 111.0)}).wait(60)
    assert committed_held_steps(root, "j") == []


def test_a_newer_memory_level_step_committed_moments_before_is_not_taken_for_an_earlier_runs(tmp: Path) -> None:
    """remove_stale compares an index's mtime (the file server's clock) with when a save began (this
    daemon's): a step above committed up to CLOCK_SLACK_S "before" (a server clock behind) is this run's
    own, overlapping save, and stays; one committed well before goes."""
    import time

    from ckptd.daemon.tiers.memory.memory_level import CLOCK_SLACK_S, remove_stale

    for step, age in ((105, CLOCK_SLACK_S / 2), (106, CLOCK_SLACK_S * 6)):
        d = tmp / "j" / "_memory" / f"step-{step:012d}"
        d.mkdir(parents=True)
        (d / "index.json").write_text("{}")
        t = time.time() - age
        os.utime(d / "index.json", (t, t))
    assert remove_stale(str(tmp), "j", 100, time.time(), {105, 106}) == [106]
    assert committed_held_steps(tmp, "j") == [105]
    assert remove_stale(str(tmp), "j", 100, time.time(), {106}) == [105]    # never saved through this daemon
