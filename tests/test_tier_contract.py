"""The tier contract holds for every tier: one commit method, and a tier that wraps another passes
every call and every argument on (the memory tier once dropped the rank records: its ``commit``
was the only one it overrode, so every commit fell back to reading each manifest back)."""
from __future__ import annotations

import hashlib
import importlib
import pkgutil
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import ckptd.daemon
from ckptd.core.names import step_dir
from ckptd.core.rank_record import RankRecord
from ckptd.core.reader import StepReader, verify_step
from ckptd.core.schema import TensorLayout
from ckptd.daemon.settings.write import WriteSettings
from ckptd.daemon.tiers.base import ShardRef, StorageTier
from ckptd.daemon.tiers.fs.tier import FsTier
from ckptd.daemon.tiers.memory.store import MemoryStore
from ckptd.daemon.tiers.memory.tier import MemoryTier

JOB, N = "contract", 4096

# A tier that wraps another: how to build it around ``inner``. A new wrapping tier must be added here.
Wrap = Callable[[StorageTier, str, Executor], StorageTier]
WRAPPERS: dict[type[StorageTier], Wrap] = {
    MemoryTier: lambda inner, root, pool: MemoryTier(inner, MemoryStore(64 << 20, 2), root, 4096, pool),
}
LEAVES: set[type[StorageTier]] = {FsTier}       # tiers that store bytes themselves


def every_tier() -> set[type[StorageTier]]:
    for m in pkgutil.walk_packages(ckptd.daemon.__path__, "ckptd.daemon."):
        importlib.import_module(m.name)
    out: set[type[StorageTier]] = set()
    todo = [StorageTier]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("ckptd."):
                out.add(sub)
    return out


def test_every_tier_in_the_package_is_checked_here() -> None:
    assert every_tier() == LEAVES | set(WRAPPERS), \
        "a tier was added or removed: list it in WRAPPERS (it wraps another) or LEAVES"


def test_the_contract_has_one_commit_and_no_default_bodies() -> None:
    """Every call is abstract, so a wrapping tier cannot inherit a body that drops an argument."""
    public = {n for n in vars(StorageTier) if not n.startswith("_")}
    assert public == StorageTier.__abstractmethods__
    assert not any(n.startswith("commit_") for n in public)


class Recording(FsTier):
    """The file-system tier, remembering every call made to it."""

    def __init__(self, root: str, pool: Executor) -> None:
        super().__init__(root, WriteSettings(codec="zstd", level=1, chunk_bytes=16 * 1024), 2, pool)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def commit(self, job: str, step: int, world_size: int, digests: Mapping[int, str],
                     records: Sequence[RankRecord] | None = None, check: Sequence[int] | None = None) -> None:
        self.calls.append(("commit", (job, step, world_size, dict(digests), records, check)))
        await super().commit(job, step, world_size, digests, records, check)

    async def abort(self, job: str, step: int, ranks: Collection[int]) -> None:
        self.calls.append(("abort", (job, step, set(ranks))))
        await super().abort(job, step, ranks)

    async def withdraw_commits(self) -> None:
        self.calls.append(("withdraw_commits", ()))
        await super().withdraw_commits()

    async def written_bytes(self, ref: ShardRef) -> int:
        self.calls.append(("written_bytes", (ref,)))
        return await super().written_bytes(ref)


def shard(step: int, rank: int) -> tuple[memoryview, list[TensorLayout]]:
    data = memoryview(bytearray(hashlib.shake_128(f"{step}/{rank}".encode()).digest(N * 4)))
    return data, [TensorLayout("w", "float32", (N,), 0, N * 4)]


async def write(tier: StorageTier, step: int, world: int) -> list[Any]:
    out = []
    for rank in range(world):
        data, layout = shard(step, rank)
        out.append(await tier.write_shard(ShardRef(JOB, step, rank, world), data, layout, {"T": "w"},
                                          released=lambda: None, abandoned=lambda: False))
    return out


@pytest.fixture
def pool() -> Any:
    with ThreadPoolExecutor(4) as p:
        yield p


@pytest.mark.parametrize("kind", list(WRAPPERS), ids=lambda k: k.__name__)
async def test_rank_records_and_check_ranks_reach_the_inner_commit(tmp_path: Path, pool: Executor,
                                                                  kind: type[StorageTier]) -> None:
    inner = Recording(str(tmp_path), pool)
    tier = WRAPPERS[kind](inner, str(tmp_path), pool)
    written = await write(tier, 1, 2)
    records = [w.record for w in written]
    assert all(isinstance(r, RankRecord) for r in records)
    digests = {r: w.digest for r, w in enumerate(written)}
    await tier.commit(JOB, 1, 2, digests, records, [1])
    [(name, args)] = [c for c in inner.calls if c[0] == "commit"]
    assert args[:4] == (JOB, 1, 2, digests)
    assert args[4] is records                      # the very records, not None and not a copy rebuilt
    assert args[5] == [1]
    assert await tier.is_committed(JOB, 1)
    path = step_dir(str(tmp_path), JOB, 1)
    assert verify_step(path) == []
    reader = StepReader(path)
    for rank in range(2):
        assert reader.manifest(rank).tensors[0].name == "w"


@pytest.mark.parametrize("kind", list(WRAPPERS), ids=lambda k: k.__name__)
async def test_every_other_call_reaches_the_inner_tier(tmp_path: Path, pool: Executor,
                                                       kind: type[StorageTier]) -> None:
    inner = Recording(str(tmp_path), pool)
    tier = WRAPPERS[kind](inner, str(tmp_path), pool)
    await write(tier, 2, 1)
    ref = ShardRef(JOB, 2, 0, 1)
    assert await tier.written_bytes(ref) == await inner.written_bytes(ref) > 0
    await tier.abort(JOB, 2, {0})
    assert ("abort", (JOB, 2, {0})) in inner.calls
    assert not Path(step_dir(str(tmp_path), JOB, 2)).exists()
    written = await write(tier, 3, 1)
    await tier.commit(JOB, 3, 1, {0: written[0].digest})          # no records: the tier reads the manifest
    assert ("commit", (JOB, 3, 1, {0: written[0].digest}, None, None)) in inner.calls
    assert await tier.latest_committed(JOB) == await inner.latest_committed(JOB) == 3
    await tier.withdraw_commits()
    assert ("withdraw_commits", ()) in inner.calls
    tier.close()
