"""FORMAT.md is the contract another implementation reads and writes ckptd steps from: its exact
statements (the dtype table) are checked against the code they document."""
from __future__ import annotations

import re
from pathlib import Path

from ckptd.core.schema import DTYPE_ITEMSIZE

FORMAT_MD = Path(__file__).resolve().parent.parent / "FORMAT.md"


def format_text() -> str:
    return FORMAT_MD.read_text(encoding="utf-8")


def test_dtype_table_is_every_stored_dtype_with_its_item_size() -> None:
    """The rank manifest's dtype table (item size | dtypes) lists exactly DTYPE_ITEMSIZE."""
    rows = re.findall(r"^  \| (\d+) \| (`[a-z0-9_]+`(?:, `[a-z0-9_]+`)*) \|$", format_text(), re.MULTILINE)
    documented: dict[str, int] = {}
    for size, names in rows:
        for name in re.findall(r"`([a-z0-9_]+)`", names):
            assert name not in documented, f"{name} listed twice"
            documented[name] = int(size)
    assert documented == DTYPE_ITEMSIZE
