"""gc_pause: collection is off inside a pause, back on after the last one ends (nested or
overlapping across threads), and never turned on by a pause if it was off before."""
from __future__ import annotations

import gc
import json
import threading
from collections.abc import Iterator

import pytest

from ckptd.core import gc_pause
from ckptd.core.gc_pause import gc_paused


@pytest.fixture(autouse=True)
def restore_gc() -> Iterator[None]:
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_nested_pauses_resume_only_at_the_outermost_end() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_overlapping_pauses_on_two_threads() -> None:
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            assert leave.wait(10)
    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()          # the other thread's pause still holds
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_a_pause_never_enables_a_disabled_collector_and_survives_an_exception() -> None:
    gc.disable()
    with pytest.raises(KeyError), gc_paused():
        raise KeyError("x")
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(KeyError), gc_paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_loads_decodes_small_and_bulk_documents_alike() -> None:
    doc = [{"rank": r, "digest": "x" * 64} for r in range(gc_pause.BULK_BYTES // 40)]
    data = json.dumps(doc).encode()
    assert len(data) >= gc_pause.BULK_BYTES
    assert gc_pause.loads(data) == doc and gc_pause.loads(b'{"a": 1}') == {"a": 1}
    with pytest.raises(ValueError):
        gc_pause.loads(data[:-1])
