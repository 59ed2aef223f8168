"""The restore chain (ckptd_client/sources.py), the daemon's error codes, and CheckpointerConfig.

Each source's "cannot serve, because …" is checked against a real daemon in the situation that
causes it; the bucket fallback is shown to follow the error reply's code, not its text (a stand-in
daemon answers with the code and the text swapped); CheckpointerConfig round trips, backs the
keyword arguments, and refuses a keyword that contradicts it.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from procfd import sigstop

import ckptd_client
from ckptd.core import protocol
from ckptd.core.errors import ErrorCode
from ckptd.core.names import rank_data_name, step_dir
from ckptd.core.protocol import CommitMode
from ckptd_client import CheckpointerConfig, Unavailable, bucket_restore
from ckptd_client.bucket_restore import BucketStaging, Staged
from ckptd_client.connection import ask
from ckptd_client.errors import CheckpointError, DaemonRefused, MissingData
from ckptd_client.modes import WhenBusy
from ckptd_client.sources import (
    ALL_RANKS,
    MEMORY,
    STORAGE,
    AllRanksStaged,
    DaemonMemory,
    LocalFiles,
    Reader,
    Served,
)

REPO = Path(__file__).resolve().parent.parent


def state_of(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "meta": {"seed": seed}}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(4096), "meta": {}}


def reader(sock: Path, root: Path, job: str) -> Reader:
    return Reader(str(sock), job, 0, 1, 2, lambda: str(root))


# ---- each source's typed answer, in the situation that causes it ----------------------------------

def test_memory_tier_off_falls_to_storage_with_the_reason_recorded(daemon_factory):
    d = daemon_factory("--memory-steps", "0")
    ck = ckptd_client.Checkpointer("nomem", socket=str(d.socket))
    saved = state_of(1)
    ck.save(3, saved).wait(60)
    target = blank()
    assert ck.restore(target) == 3 and torch.equal(target["w"], saved["w"]) and target["meta"] == {"seed": 1}
    info = ck.last_restore
    assert info is not None and info.source == STORAGE and info.step == 3
    assert [u.source for u in info.passed] == [MEMORY]
    assert "memory tier is off" in info.passed[0].reason and info.fallback == info.passed[0].reason
    got = DaemonMemory(reader(d.socket, d.root, "nomem"), enabled=True).serve(3, blank())
    assert isinstance(got, Unavailable) and got.source == MEMORY and "memory tier is off" in got.reason
    ck.close()


def test_each_source_says_why_it_cannot_serve(daemon, tmp):
    ck = ckptd_client.Checkpointer("why", socket=str(daemon.socket))
    saved = state_of(2)
    ck.save(5, saved).wait(60)
    ck.close()
    r = reader(daemon.socket, daemon.root, "why")
    # Memory serves what it holds; memory=False, no daemon, a step it never held: each says why not.
    target = blank()
    assert DaemonMemory(r, enabled=True).serve(5, target) == Served(MEMORY, saved["w"].nbytes, whole=True)
    assert torch.equal(target["w"], saved["w"])
    assert DaemonMemory(r, enabled=False).serve(5, blank()) == Unavailable(MEMORY, "memory restore off (memory=False)")
    nowhere = Reader(str(tmp / "none.sock"), "why", 0, 1, 2, lambda: str(daemon.root))
    got = DaemonMemory(nowhere, enabled=True).serve(5, blank())
    assert isinstance(got, Unavailable) and "cannot reach the ckptd daemon" in got.reason
    got = DaemonMemory(r, enabled=True).serve(6, blank())
    assert isinstance(got, Unavailable) and "not committed" in got.reason
    # No daemon at all (root given): memory cannot, the local files serve; nothing was staged.
    offline = ckptd_client.Checkpointer("why", socket=str(tmp / "none.sock"), root=str(daemon.root))
    target = blank()
    assert offline.restore(target) == 5 and torch.equal(target["w"], saved["w"])
    assert offline.last_restore is not None and offline.last_restore.source == STORAGE
    assert [u.source for u in offline.last_restore.passed] == [MEMORY]
    assert "cannot reach the ckptd daemon" in offline.last_restore.passed[0].reason
    # A data file this node lacks: the local files cannot (MissingData), and without a bucket the
    # all-ranks staging cannot either, so the restore raises the local files' MissingData.
    os.unlink(os.path.join(step_dir(str(daemon.root), "why", 5), rank_data_name(0)))
    staging = BucketStaging(str(daemon.socket), "why", 0, 1)
    got = LocalFiles(r, staging, None).serve(5, blank())
    assert isinstance(got, Unavailable) and got.source == STORAGE and isinstance(got.error, MissingData)
    assert staging.staged == Staged(False) and not staging.bucket        # the daemon has no bucket
    got = AllRanksStaged(r, staging, None).serve(5, blank())
    assert isinstance(got, Unavailable) and got.source == ALL_RANKS and "no bucket" in got.reason
    fresh = ckptd_client.Checkpointer("why", socket=str(daemon.socket), memory=False)
    with pytest.raises(MissingData, match="cannot restore from"):
        fresh.restore(blank(), 5)
    # A step that is nowhere is the user's error, raised by the local files (no later source helps).
    with pytest.raises(CheckpointError, match="does not exist"):
        LocalFiles(r, staging, None).serve(9, blank())


# ---- error codes, not text ------------------------------------------------------------------------

def test_a_daemon_without_a_bucket_answers_with_the_no_bucket_code(daemon):
    for msg in (protocol.Stage("j", None), protocol.Flush("j", None, 1)):
        with pytest.raises(DaemonRefused) as e:
            ask(str(daemon.socket), msg)
        assert e.value.code is ErrorCode.NO_BUCKET, e.value
    with pytest.raises(DaemonRefused) as e:
        ask(str(daemon.socket), protocol.MemoryFetch("j", 0, 1, 7))
    assert e.value.code is ErrorCode.REFUSED and "not committed" in e.value.reason
    assert bucket_restore.stage(str(daemon.socket), "j", None, 0, 1) == Staged(False)
    assert not bucket_restore.flush(str(daemon.socket), "j", None, 1).bucket


class StandIn:
    """A socket that answers every request with one error reply (a daemon's code and reason, chosen)."""

    def __init__(self, path: Path, code: str, reason: str) -> None:
        self.code, self.reason = code, reason
        self.ops: list[str] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                rx = protocol.FrameReceiver(conn)
                while (msg := rx.read()) is not None:
                    self.ops.append(msg["op"])
                    reply = protocol.error(msg["req"], self.reason)
                    protocol.send_frame(conn, {**reply, "code": self.code})


@pytest.fixture
def stand_in(tmp: Path) -> Iterator[Any]:
    made: list[StandIn] = []

    def make(code: str, reason: str) -> StandIn:
        made.append(StandIn(tmp / f"standin{len(made)}.sock", code, reason))
        return made[-1]
    yield make
    for s in made:
        s.sock.close()


def test_the_bucket_fallback_follows_the_code_not_the_text(daemon, tmp, stand_in):
    ck = ckptd_client.Checkpointer("codes", socket=str(daemon.socket))
    saved = state_of(3)
    ck.save(2, saved).wait(60)
    ck.close()
    # no_bucket, whatever the text says: the restore reads the local files.
    quiet = stand_in(ErrorCode.NO_BUCKET.value, "something else entirely")
    restorer = ckptd_client.Checkpointer("codes", socket=str(tmp / "standin0.sock"), root=str(daemon.root),
                                         prepare=False)     # restores only: no slots (no hello) afterwards
    target = blank()
    assert restorer.restore(target) == 2 and torch.equal(target["w"], saved["w"])
    assert quiet.ops == ["info", "stage", "memory_fetch"]     # a bucket? the newest step; memory; nothing staged after
    assert restorer.last_restore is not None and restorer.last_restore.source == STORAGE
    assert restorer.last_restore.passed[0].reason == "something else entirely"    # memory's refusal
    # The old text under another code is just a refusal: the restore fails, saying so.
    stand_in(ErrorCode.REFUSED.value, "this daemon has no object-storage tier (s3.url is not set)")
    loud = ckptd_client.Checkpointer("codes", socket=str(tmp / "standin1.sock"), root=str(daemon.root))
    with pytest.raises(CheckpointError, match="restore from the bucket: this daemon has no object-storage tier"):
        loud.restore(blank())
    flushed = bucket_restore.flush(str(tmp / "standin1.sock"), "codes", 2, 1)
    assert flushed.bucket and not flushed.uploaded
    # A code this client does not know reads as a refusal too.
    stand_in("from-the-future", "?")
    with pytest.raises(DaemonRefused) as e:
        ask(str(tmp / "standin2.sock"), protocol.Info())
    assert e.value.code is ErrorCode.REFUSED


# ---- CheckpointerConfig ---------------------------------------------------------------------------

def test_checkpointer_config_round_trips_and_backs_the_keywords(daemon, tmp):
    cfg = CheckpointerConfig(socket=str(daemon.socket), root=str(daemon.root), rank=0, world_size=1, num_slots=3,
                             commit="local", commit_timeout=30.0, restore_threads=2, overlap=False,
                             when_busy="skip", memory=False, local_world_size=4)
    assert dataclasses.replace(cfg) == cfg and CheckpointerConfig(**dataclasses.asdict(cfg)) == cfg
    assert cfg.when_busy is WhenBusy.SKIP and cfg.commit is CommitMode.LOCAL     # normalised once, here
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_slots = 4  # type: ignore[misc]
    ck = ckptd_client.Checkpointer("cfg", config=cfg)
    assert ck.config is cfg
    assert (ck.socket_path, ck.root, ck.num_slots, ck.commit_mode, ck.commit_timeout, ck.restore_threads,
            ck.overlap, ck.when_busy, ck.memory, ck.local_world_size) == \
        (str(daemon.socket), str(daemon.root), 3, CommitMode.LOCAL, 30.0, 2, False, WhenBusy.SKIP, False, 4)
    saved = state_of(4)
    ck.save(1, saved).wait(60)
    target = blank()
    assert ck.restore(target) == 1 and torch.equal(target["w"], saved["w"])
    assert ck.last_restore is not None and ck.last_restore.fallback == "memory restore off (memory=False)"
    ck.close()
    # The keyword arguments build the same config; defaults are the config's.
    kw = ckptd_client.Checkpointer("cfg", str(daemon.socket), str(daemon.root), rank=0, world_size=1, num_slots=3,
                                   commit="local", commit_timeout=30.0, restore_threads=2, overlap=False,
                                   when_busy="skip", memory=False, local_world_size=4)
    assert kw.config == cfg
    assert ckptd_client.Checkpointer("cfg", str(daemon.socket)).config == CheckpointerConfig(socket=str(daemon.socket))
    # A keyword that agrees with the config is fine; one that contradicts it is refused, named.
    assert ckptd_client.Checkpointer("cfg", config=cfg, num_slots=3, memory=False).config is cfg
    with pytest.raises(TypeError, match=r"num_slots=4 \(config has 3\)"):
        ckptd_client.Checkpointer("cfg", config=cfg, num_slots=4)
    with pytest.raises(TypeError, match="socket="):
        ckptd_client.Checkpointer("cfg", str(tmp / "other.sock"), config=cfg)
    with pytest.raises(TypeError, match="CheckpointerConfig"):
        ckptd_client.Checkpointer("cfg", config={"num_slots": 3})  # type: ignore[arg-type]
    bads: list[dict[str, Any]] = [{"overlap": "sometimes"}, {"when_busy": "maybe"}, {"commit": "eventually"}]
    for bad in bads:
        with pytest.raises(ValueError):
            CheckpointerConfig(**bad)


def test_every_config_field_is_typed_and_documented():
    tree = ast.parse((REPO / "ckptd_client" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointerConfig")
    body = cls.body
    fields = [(i, n) for i, n in enumerate(body) if isinstance(n, ast.AnnAssign)]
    assert [ast.unparse(n.target) for _, n in fields] == [f.name for f in dataclasses.fields(CheckpointerConfig)]
    for i, n in fields:
        doc = body[i + 1] if i + 1 < len(body) else None
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str) \
            and doc.value.value.strip(), \
            f"field {ast.unparse(n.target)} has no docstring"


def test_torchtitan_config_maps_onto_checkpointer_config():
    titan = pytest.importorskip("ckptd_client.torchtitan")
    c = titan.CkptdCheckpointManager.Config(job="t", socket="/s.sock", root="/r")
    assert c.checkpointer_config() == CheckpointerConfig(socket="/s.sock", root="/r", overlap="manual")


def test_torchtitan_manager_refuses_an_unknown_exclude_from_loading_key(tmp):
    """A misspelt key in exclude_from_loading ("optimzer") was ignored: the resume then loaded the
    optimizer the user meant to leave out. As torchtitan's own manager does, it is refused, here
    when the manager is built, naming the key and the states there are."""
    titan = pytest.importorskip("ckptd_client.torchtitan")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = titan.CkptdCheckpointManager.Config(enable=True, job="t", socket=str(tmp / "none.sock"),
                                              root=str(tmp / "root"), exclude_from_loading=["optimzer"])
    with pytest.raises(ValueError, match=r"names \['optimzer'\], which are not states of this trainer: it has "
                                         r"\['lr_scheduler', 'model', 'optimizer', 'train_state'\]"):
        titan.CkptdCheckpointManager(cfg, dataloader=None, model_parts=[model], optimizers=opt,
                                     lr_schedulers=torch.optim.lr_scheduler.StepLR(opt, 1),
                                     states={"train_state": {"step": 0}})
    cfg.exclude_from_loading = ["optimizer"]
    m = titan.CkptdCheckpointManager(cfg, dataloader=None, model_parts=[model], optimizers=opt,
                                     lr_schedulers=torch.optim.lr_scheduler.StepLR(opt, 1),
                                     states={"train_state": {"step": 0}})
    m.close()


def test_a_stopped_daemon_does_not_hold_a_restore_for_the_bucket_timeout(daemon, tmp):
    """A restore asks its daemon whether the bucket has a newer step, with the hour a download may take
    as the reply's timeout: a stopped daemon (SIGSTOP: a hung node) held the restore that long, with no
    bucket at all. The daemon is now asked first, within 10 s, whether it has a bucket; one that does
    not answer is passed over and the restore reads the root's files."""
    import signal
    import subprocess
    import sys
    ck = ckptd_client.Checkpointer("hung", socket=str(daemon.socket))
    ck.save(1, {"w": torch.arange(8.0)}).wait(60)
    ck.close()
    code = ("import sys, torch, ckptd_client\n"
            f"ck = ckptd_client.Checkpointer('hung', socket={str(daemon.socket)!r}, root={str(daemon.root)!r}, "
            "memory=False, prepare=False)\n"
            "live = {'w': torch.zeros(8)}\n"
            "print('RESTORED', ck.restore(live), live['w'].tolist(), flush=True)\n")
    sigstop(daemon.proc.pid)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert r.returncode == 0, r.stderr
    assert f"RESTORED 1 {[float(i) for i in range(8)]}" in r.stdout, r.stdout + r.stderr
    assert "did not answer within 10s; restoring without its bucket" in r.stderr, r.stderr


def test_a_daemon_whose_info_says_nothing_of_a_bucket_is_not_asked_to_stage(tmp):
    """A daemon from before `info` carried `bucket` (2026-12-01's) answered it without the field, and
    refused `stage` without an error code: a current client asked it to stage anyway and turned the refusal
    into "restore from the bucket: this daemon has no object-storage tier", so a job that upgraded its
    client before its nodes' daemons could not restore, nor even start. FORMAT.md: stage only where info
    says bucket: true. The daemon here is such an old one, speaking the wire protocol on a real socket."""
    from ckptd.core import protocol
    from ckptd_client.bucket_restore import stage
    path = str(tmp / "old.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    asked: list[str] = []

    def serve() -> None:
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                msg = protocol.FrameReceiver(conn).read()
                assert msg is not None
                asked.append(msg["op"])
                if msg["op"] == "info":
                    protocol.send_frame(conn, {"op": "ok", "req": msg["req"], "root": str(tmp), "version": "0.1.0",
                                               "pid": 1})
                else:
                    protocol.send_frame(conn, {"op": "error", "req": msg["req"],
                                               "reason": "this daemon has no object-storage tier (s3.url is not set)"})

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        assert stage(path, "j", None, 0, 1).bucket is False     # no bucket: the root's files decide
        assert asked == ["info"]
    finally:
        server.close()
