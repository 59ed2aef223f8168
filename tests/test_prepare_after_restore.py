"""After ``restore()`` (which knows the state) the slots are connected and allocated in the
background, so a resumed run's first save does no set-up; ``prepare=False`` opts out; a first
save that did set up says how much of its stall it was (``setup_s``)."""
# mypy: disable-error-code="union-attr,index,operator"
from __future__ import annotations

import time

import ckptd_client

from test_memory_tier import assert_equal, state_of, status, zeros_like


def sessions_of(sock, job: str) -> list[dict]:
    return [s for s in status(sock)["sessions"] if s["job"] == job]


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_restore_prepares_the_slots_for_the_first_save(daemon) -> None:
    state = state_of(5, mib=2)
    first = ckptd_client.Checkpointer("prep", socket=str(daemon.socket))
    h = first.save(1, state)
    h.wait(60)
    assert 0 < h.setup_s <= h.stall_s            # the first save connected and allocated its slots
    first.close()
    wait_for(lambda: sessions_of(daemon.socket, "prep") == [], "the first run's session to end")

    resumed = ckptd_client.Checkpointer("prep", socket=str(daemon.socket))
    target = zeros_like(state)
    assert resumed.restore(target) == 1
    assert_equal(state, target)
    # No save yet: the background preparation connects (a session shows at hello, its slots once made).
    wait_for(lambda: [s["slots"] for s in sessions_of(daemon.socket, "prep")] == [2], "slots prepared after restore")
    [sess] = sessions_of(daemon.socket, "prep")
    assert sess["slots"] == 2 and sess["saves"] == 0
    assert sess["slot_bytes"] >= 2 * sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "numel"))
    h2 = resumed.save(2, target)
    h2.wait(60)
    assert sessions_of(daemon.socket, "prep")[0]["saves"] == 1   # the same session: nothing reconnected
    resumed.close()


def test_prepare_false_leaves_a_restore_only_process_without_slots(daemon) -> None:
    state = state_of(6)
    ck = ckptd_client.Checkpointer("noprep", socket=str(daemon.socket))
    ck.save(1, state).wait(60)
    ck.close()
    reader = ckptd_client.Checkpointer("noprep", socket=str(daemon.socket), prepare=False)
    assert reader.restore(zeros_like(state)) == 1
    time.sleep(0.5)
    assert sessions_of(daemon.socket, "noprep") == [] and reader.slots == []
    assert (reader.plans.misses, reader.plans.hits) == (0, 0)      # nor planned a save it will not make
    reader.close()
