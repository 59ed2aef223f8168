"""The daemon's per-session memo of the last SAVE layout (ckptd/daemon/session.py ``LayoutMemo``):
an equal tensor list gets the layout parsed before, anything else is parsed and checked in full."""
from __future__ import annotations

import copy
import json

import pytest

from ckptd.core.schema import parse_layout
from ckptd.daemon.session import LayoutMemo

GOOD = [["model/w", "float32", [4, 4], 0, 64],
        ["model/b", "bfloat16", [3], 64, 6, {"shape": [6], "offsets": [3], "key": "model/b"}],
        ["optim/state/model.w/step", "float32", [], 72, 4]]


def test_an_equal_list_reuses_the_layout_parsed_before() -> None:
    memo = LayoutMemo()
    first = memo.parse(GOOD, 4096)
    assert first == parse_layout(GOOD, 4096)
    again = memo.parse(json.loads(json.dumps(GOOD)), 4096)      # decoded anew, as the next SAVE's is
    assert again == first and all(a is b for a, b in zip(again, first, strict=True))
    again.pop()                                                  # a caller's list is its own
    assert len(memo.parse(GOOD, 4096)) == 3


@pytest.mark.parametrize("change,bound,needle", [
    (lambda t: t[1].__setitem__(0, "../b"), 4096, "invalid tensor name"),
    (lambda t: t[2].__setitem__(0, "model/w"), 4096, "duplicate"),
    (lambda t: t[0].__setitem__(4, 65), 4096, "inconsistent"),
    (lambda t: t[1][5].__setitem__("offsets", [4]), 4096, "does not fit"),
    (lambda t: t[0].__setitem__(1, "float31"), 4096, "unknown dtype"),
    (lambda t: None, 70, "outside the slot"),                   # the same list, a smaller slot
])
def test_anything_else_is_checked_in_full(change, bound: int, needle: str) -> None:
    memo = LayoutMemo()
    memo.parse(GOOD, 4096)
    other = copy.deepcopy(GOOD)
    change(other)
    with pytest.raises(ValueError, match=needle):
        memo.parse(other, bound)
    with pytest.raises(ValueError, match=needle):        # and a refused list is not remembered
        memo.parse(other, bound)
    assert memo.parse(GOOD, 4096) == parse_layout(GOOD, 4096)
