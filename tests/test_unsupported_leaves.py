"""Leaves ckptd cannot store fail at once with a TypeError naming their key path, before anything is
written (README, "Saving"): NumPy values torch cannot hold, a NumPy scalar with no Python equivalent,
and a JSON value too large for the SAVE message (on a fresh plan and on the cached plan's path)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptd_client
from ckptd.core.framing import MAX_FRAME_BYTES
from ckptd_client.plan_cache import PlanCache

BAD: list[tuple[str, Any]] = [
    ("longdouble scalar", np.longdouble(1.5)),
    ("clongdouble scalar", np.clongdouble(1 + 2j)),
    ("object array", np.array([None, 1], dtype=object)),
    ("str array", np.array(["a", "b"])),
    ("bytes array", np.array([b"ab"])),
    ("datetime64 array", np.array(["2024-01-01"], dtype="datetime64[D]")),
    ("structured array", np.zeros(2, dtype=[("a", "i4")])),
    ("big-endian array", np.arange(4, dtype=">f4")),
    ("longdouble array", np.zeros(2, dtype=np.longdouble)),
    ("20 MiB string", "x" * (20 << 20)),
    ("int of 5,000 digits", 10 ** 5000),       # (JSON's int-to-str limit: a ValueError naming nothing)
]


def steps_on_disk(root: Path, job: str) -> list[str]:
    d = root / job
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.mark.parametrize(("what", "leaf"), BAD, ids=[w for w, _ in BAD])
def test_an_unsupported_leaf_is_a_type_error_naming_its_key_before_anything_is_written(
        daemon: Any, what: str, leaf: Any) -> None:
    ck = ckptd_client.Checkpointer("leaves", socket=str(daemon.socket), overlap=False)
    try:
        base = {"model": {"w": torch.ones(10)}}
        with pytest.raises(TypeError, match="cannot checkpoint") as got:
            ck.save(1, {**base, "data": {"leaf": leaf}})
        assert "'data/leaf'" in str(got.value), str(got.value)
        assert steps_on_disk(daemon.root, "leaves") == [] and ck.slots == []    # no slot taken, nothing written
        h = ck.save(2, base)                                  # the Checkpointer is fine afterwards
        h.wait(30)
        assert h.committed
    finally:
        ck.close(timeout=10)


def test_a_json_value_grown_past_the_frame_limit_on_the_cached_plan_is_refused_naming_it(daemon: Any) -> None:
    ck = ckptd_client.Checkpointer("grown", socket=str(daemon.socket), overlap=False)
    try:
        state: dict[str, Any] = {"model": torch.nn.Linear(4, 4), "meta": {"step": 0, "notes": "n" * (8 << 20)}}
        for step in (1, 2):
            state["meta"]["step"] = step
            h = ck.save(step, state)
            h.wait(30)
            assert h.committed
        hits, misses = ck.plans.hits, ck.plans.misses
        state["meta"]["notes"] = "é" * (3 << 20)             # 3 Mi characters, 18 MiB as JSON (\u00e9 each)
        state["meta"]["step"] = 3
        with pytest.raises(TypeError) as got:
            ck.save(3, state)
        text = str(got.value)
        assert "'meta/notes'" in text and f"{MAX_FRAME_BYTES:,}-byte limit" in text and "tensor" in text, text
        assert (ck.plans.hits, ck.plans.misses) == (hits + 1, misses)    # refused on the cached plan's path
        assert "step-000000000003" not in steps_on_disk(daemon.root, "grown")
        state["meta"]["notes"] = "n" * ((16 << 20) - (64 << 10))   # just under: saved (the count is exact)
        h = ck.save(4, state)
        h.wait(30)
        assert h.committed
        state["meta"]["notes"] = "short"
        h = ck.save(5, state)
        h.wait(30)
        assert h.committed and ck.plans.hits > hits
    finally:
        ck.close(timeout=10)


def test_the_cached_plans_running_size_matches_a_fresh_measure() -> None:
    from ckptd_client.plan_tree import save_bytes
    cache = PlanCache()
    state: dict[str, Any] = {"w": torch.ones(3), "m": {"a": 0, "b": "x", "c": 1.5, "d": None, "e": [True, -0.0]}}
    cache.plan(state)
    values = [(1, "é" * 100, float("nan"), None, [False, 2.0]), (10**30, "\n\"", float("inf"), None, [True, -1e300])]
    for a, b, c, d, e in values:
        state["m"].update(a=a, b=b, c=c, d=d, e=e)
        plan = cache.plan(state)
        last = cache._last
        assert last is not None and last.size == save_bytes(plan.flat.tree, plan.wire)
    assert cache.hits == len(values)


def test_an_int_grown_past_jsons_limit_on_the_cached_plan_is_refused_naming_it(daemon: Any) -> None:
    """A scalar that changes between saves takes the cached plan's path (no encode_tree): an int grown past
    JSON's 4,300 digits raised a bare ValueError from deep inside; it is the keyed TypeError there too."""
    ck = ckptd_client.Checkpointer("bigint", socket=str(daemon.socket), overlap=False)
    try:
        state: dict[str, Any] = {"w": torch.ones(4), "meta": {"n": 5}}
        for step in (1, 2):
            ck.save(step, state).wait(30)
        hits = ck.plans.hits
        state["meta"]["n"] = 10 ** 5000
        with pytest.raises(TypeError, match=r"cannot checkpoint the int at 'meta/n': 16610 bits"):
            ck.save(3, state)
        assert ck.plans.hits == hits + 1 and "step-000000000003" not in steps_on_disk(daemon.root, "bigint")
        state["meta"]["n"] = 2 ** 70
        h = ck.save(4, state)
        h.wait(30)
        assert h.committed
    finally:
        ck.close(timeout=10)
