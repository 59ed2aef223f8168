"""Ctrl-C during restore(): once it has raised KeyboardInterrupt, nothing writes into the state — the
caller may start over with a fresh model at once — and no restore thread is left running
(ckptd_client/restore_threads.py). A real SIGINT, sent to the main thread by the first restore thread
to read a chunk (twice for a user pressing Ctrl-C again while the restore stops); each chunk read is
slowed so that chunks are still queued when it lands."""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptd_client
from ckptd_client.held_map import HeldMap
from ckptd_client.load_files import StepFiles

pytestmark = pytest.mark.usefixtures("ctrl_c_raises")    # (conftest.py: a real SIGINT raises)

LAYERS, DIM = 24, 512          # 24 weights of 1 MiB: small chunks, several to a restore task
SLOW_S = 0.02                  # each chunk read takes this much longer: chunks are left when the SIGINT lands
RESTORE_THREADS = ("ckptd-restore", "ckptd-memrestore")


def model_of(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])


def interrupt_first_read(monkeypatch: pytest.MonkeyPatch, cls: type, method: str, presses: int,
                         restoring: threading.Event) -> list[int]:
    """``cls.method`` (one chunk read) slowed; the first call, once its chunk is read, sends ``presses``
    SIGINTs to the main thread while ``restoring`` is set (a thread left running by a restore that has
    raised sends none into what follows). Returns the list of reads started (its length)."""
    real: Callable[..., Any] = getattr(cls, method)
    main = threading.main_thread().ident
    assert main is not None
    lock, started = threading.Lock(), []

    def read(*args: Any, **kwargs: Any) -> Any:
        with lock:
            started.append(1)
            first = len(started) == 1
        out = real(*args, **kwargs)
        time.sleep(SLOW_S)
        if first:
            for press in range(presses):
                if press:
                    time.sleep(0.05)         # the second Ctrl-C: while the restore stops its threads
                if restoring.is_set():
                    signal.pthread_kill(main, signal.SIGINT)
        return out
    monkeypatch.setattr(cls, method, read)
    return started


def restore_interrupted(sock: str, memory: bool, monkeypatch: pytest.MonkeyPatch, presses: int) -> None:
    saved = model_of(0)
    ck = ckptd_client.Checkpointer("intr", socket=sock)
    ck.save(1, {"model": saved}).wait(60)         # (raises unless committed)
    ck.close()

    model = model_of(1)
    r = ckptd_client.Checkpointer("intr", socket=sock, memory=memory, prepare=False, restore_threads=2)
    try:
        cls, method = (HeldMap, "copy_hashed") if memory else (StepFiles, "read_chunk")
        restoring = threading.Event()
        started = interrupt_first_read(monkeypatch, cls, method, presses, restoring)
        restoring.set()
        with pytest.raises(KeyboardInterrupt) as raised:
            r.restore({"model": model})
        restoring.clear()
        alive = [t.name for t in threading.enumerate() if t.name.startswith(RESTORE_THREADS)]
        with torch.no_grad():                  # the user starts over: a fresh model
            for p in model.parameters():
                p.zero_()
        monkeypatch.undo()
        assert started, "the restore read nothing through the hooked path"
        time.sleep(1.0)
        written = [n for n, p in model.named_parameters() if torch.count_nonzero(p)]
        where = raised.traceback[-4:]
        assert written == [], f"written into the state after restore() raised KeyboardInterrupt in {where}: {written}"
        assert alive == [], f"restore threads still running after restore() raised: {alive}; it raised in {where}"
        assert [t.name for t in threading.enumerate() if t.name.startswith(RESTORE_THREADS)] == []
    finally:
        r.close()


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_in_a_storage_restore_leaves_no_thread_writing_into_the_state(daemon_factory, monkeypatch,
                                                                              presses) -> None:
    d = daemon_factory("--memory-steps", "0")
    restore_interrupted(str(d.socket), False, monkeypatch, presses)


def test_ctrl_c_twice_in_a_memory_restore_leaves_no_thread_writing_into_the_state(daemon_factory,
                                                                                   monkeypatch) -> None:
    d = daemon_factory()
    restore_interrupted(str(d.socket), True, monkeypatch, 2)
