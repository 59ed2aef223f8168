"""Importing a framework integration without its framework names the extra to install (as
ckptd_client.lightning does), never a bare ``No module named 'torchtitan'``. The framework is made
unimportable for a subprocess by a ``torchtitan`` package first on its path that raises as a missing
one does."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

IMPORT = """
import importlib, sys
try:
    importlib.import_module(sys.argv[1])
except ImportError as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("imported")
"""


@pytest.mark.parametrize("module", ["ckptd_client.torchtitan", "ckptd_client.dcp.titan"])
def test_without_torchtitan_the_error_names_the_extra(module: str, tmp: Path) -> None:
    (tmp / "torchtitan").mkdir()
    (tmp / "torchtitan" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torchtitan'\", name='torchtitan')\n")
    path = os.pathsep.join([str(tmp), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "-c", IMPORT, module], capture_output=True, text=True, timeout=120,
                       cwd=tmp, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    said = r.stdout.strip()
    assert said.startswith(f"ModuleNotFoundError: {module} needs torchtitan: "
                           "pip install 'ckptd[client,torchtitan]'"), said
    assert "No module named 'torchtitan'" in said, said       # the original error, in brackets
