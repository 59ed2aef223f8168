# mypy: disable-error-code="index"
"""The state-tree depth check (ckptd/core/names.py ``check_tree_depth``), which the daemon runs on every
SAVE's tree and every manifest read runs on its tree: it refuses exactly the trees that nest deeper than
the limit, over generated JSON trees; and a real daemon refuses a SAVE whose tree does, writing nothing."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_security import hello

from ckptd.core import protocol
from ckptd.core.names import MAX_TREE_DEPTH, check_tree_depth

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=3),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=3), kids, max_size=4),
                    max_leaves=40)


def depth(x: Any) -> int:
    """Containers on the longest path from the root (a scalar: 0), by recursion: the rule as stated."""
    if isinstance(x, dict):
        return 1 + max(map(depth, x.values()), default=0)
    if isinstance(x, list):
        return 1 + max(map(depth, x), default=0)
    return 0


def refused(tree: Any, limit: int) -> bool:
    try:
        check_tree_depth(tree, limit)
    except ValueError as e:
        assert f"deeper than {limit} levels" in str(e)
        return True
    return False


@settings(max_examples=1500, deadline=None, database=None)
@given(JSON, st.integers(0, 7))
def test_refuses_exactly_the_trees_deeper_than_the_limit(tree: Any, limit: int) -> None:
    assert refused(tree, limit) == (depth(tree) > limit), (depth(tree), limit, tree)


def nested(levels: int) -> Any:
    """``levels`` containers deep, dicts and lists in turn, a leaf dict at the bottom."""
    tree: Any = {"T": "w"}
    for i in range(levels - 1):
        tree = {"k": tree, "n": 1} if i % 2 else [1, tree]
    return tree


@pytest.mark.parametrize("levels", [MAX_TREE_DEPTH, MAX_TREE_DEPTH + 1, 3 * MAX_TREE_DEPTH])
def test_the_limit_itself(levels: int) -> None:
    if levels < 400:            # (deeper, the recursive rule itself would exceed Python's recursion limit)
        assert depth(nested(levels)) == levels
    assert refused(nested(levels), MAX_TREE_DEPTH) == (levels > MAX_TREE_DEPTH)


def test_a_save_whose_tree_nests_too_deep_is_refused_on_the_wire(daemon: Any) -> None:
    s = protocol.connect(str(daemon.socket))
    rx = protocol.FrameReceiver(s)
    try:
        assert hello(s, rx, "deep", slot_bytes=4096)["op"] == "ok"
        protocol.send_frame(s, {"op": "save", "req": 2, "step": 1, "slot": 0, "commit": "local",
                                "tree": nested(MAX_TREE_DEPTH + 1), "tensors": [["w", "float32", [1], 0, 4]]})
        reply = rx.read()
        assert reply["op"] == "error" and "nests deeper" in reply["reason"], reply
    finally:
        s.close()
    assert not (daemon.root / "deep" / f"step-{1:012d}").exists()


def test_a_state_nesting_too_deep_is_a_type_error_naming_where_before_any_save(daemon: Any) -> None:
    """The client refuses what the daemon would: 85 nested dicts around a tensor (256 JSON levels)
    commit and restore; 86 were refused by the daemon saying "256 levels" (the user counts 86), and
    1,500 crashed save() with a RecursionError. Both are now a TypeError naming the key path and the
    limit in the user's terms, raised before a slot is taken: nothing reaches the daemon."""
    import torch

    import ckptd_client

    def state(dicts: int) -> dict[str, Any]:
        d: dict[str, Any] = {"w": torch.arange(3.0)}
        for _ in range(dicts - 1):
            d = {"k": d}
        return d

    with ckptd_client.Checkpointer("nest", socket=str(daemon.socket)) as ck:
        ck.save(1, state(85)).wait(60)
        live = state(85)
        assert ck.restore(live) == 1
        leaf = live
        while "k" in leaf:
            leaf = leaf["k"]
        assert torch.equal(leaf["w"], torch.arange(3.0))
        for dicts in (86, 1500):
            with pytest.raises(TypeError, match=r"nests too deeply at 'k/k/.*about 85 nested dicts"):
                ck.save(2, state(dicts))
    assert not (daemon.root / "nest" / f"step-{2:012d}").exists()
