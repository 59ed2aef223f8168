"""gc_pause: collection is off inside a pause, back on after the last one ends (nested or
overlapping across threads), and never turned on by a pause if it was off before."""
from __future__ import annotations

import gc
import json
import threading
from collections.abc import Callable, Iterator

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


def _outcome(f: Callable[[bytes | str], object], doc: bytes | str) -> tuple[str, str]:
    try:
        return "value", repr(f(doc))        # repr: tells 1 from 1.0 and shows nan
    except RecursionError:
        return "error", "RecursionError"
    except ValueError as e:                 # json's JSONDecodeError and UnicodeDecodeError both are
        return "error", type(e).__name__


def test_loads_reads_what_json_reads_and_refuses_what_it_refuses() -> None:
    """loads decodes with msgspec and hands json.loads what msgspec refuses: the same value or the
    same error as json.loads, for every kind of document ckptd reads (state trees may hold NaN)."""
    import random
    import struct
    rng = random.Random(7)
    floats = [struct.unpack("d", rng.randbytes(8))[0] for _ in range(2000)]
    docs: list[bytes | str] = [
        b'{"a": 1, "b": [1.0, -0.0, 5e-324, 1e308], "c": null, "d": true, "e": "\\u00e9\\n"}',
        b'[NaN, Infinity, -Infinity]', b'{"loss": NaN}', b'[1e400]', b'[18446744073709551616, -9223372036854775809]',
        b'[' + b'9' * 5000 + b']',          # more digits than Python's int limit: json refuses it
        b'{"k": 1, "k": 2}', b'["\\ud800"]', b'\xef\xbb\xbf[1]', b'["\xff"]', b'[1] x', b'[1', b'', b'{"a" 1}',
        '{"text": "ok"}', b'[' * 100_000 + b']' * 100_000,
        json.dumps(floats, allow_nan=True).encode(),
        json.dumps({"tensors": [{"name": f"t{i}", "shape": [i, 3]} for i in range(20_000)]}).encode(),  # bulk
    ]
    assert len(docs[-1]) > gc_pause.BULK_BYTES
    for doc in docs:
        assert _outcome(gc_pause.loads, doc) == _outcome(json.loads, doc), doc[:60]
