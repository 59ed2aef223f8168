"""A closed Checkpointer refuses save, restore and prepare before touching anything: no state loaded
(then a RuntimeError from its shut-down copy pool), no session reopened on the daemon holding slots."""
from __future__ import annotations

import time

import pytest
import torch

import ckptd_client
from ckptd.core import protocol


def sessions_of(sock: str, job: str) -> list[dict]:
    return [s for s in protocol.request_once(sock, {"op": "status"})["sessions"] if s["job"] == job]


def test_save_restore_and_prepare_after_close_are_refused_and_change_nothing(daemon) -> None:
    sock = str(daemon.socket)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    ck = ckptd_client.Checkpointer("closed", socket=sock)        # overlap=True, prepare=True: the defaults
    ck.save(1, {"model": model, "optim": opt}).wait(30)
    assert ck.close().ok
    deadline = time.monotonic() + 10
    while sessions_of(sock, "closed") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sessions_of(sock, "closed") == []

    with torch.no_grad():
        model.weight.zero_()
    for call, what in ((lambda: ck.restore({"model": model, "optim": opt}), "restore"),
                       (lambda: ck.prepare({"model": model, "optim": opt}), "prepare"),
                       (lambda: ck.save(2, {"model": model}), "save")):
        with pytest.raises(ckptd_client.CheckpointError, match=rf"checkpointer is closed: {what}\(\) after close"):
            call()
    assert torch.count_nonzero(model.weight) == 0          # nothing was loaded
    assert ck.last_restore is None and ck.slots == []
    time.sleep(0.5)                                         # (a background prepare would have connected by now)
    assert sessions_of(sock, "closed") == []
    assert ck.close().ok                                    # closing again is still fine
