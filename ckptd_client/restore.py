"""Restoring a committed step into whatever the live state is, straight from storage (no daemon).

The live state decides what is read. Its tensors are named by key path exactly as a save names
them (``model/<fqn>``, ``optim/state/<fqn>/exp_avg`` …); for each one the checkpoint's entry of
that name is found in index.json's tensor map and:

- a DTensor needs the region its ``to_local()`` holds (``dtensor.local_region``), read into the
  local tensor in place;
- a plain tensor needs the whole tensor: a sharded checkpoint tensor is assembled from its
  pieces (consolidation), a plain one is this rank's own saved copy, or rank 0's when the saved
  world had no rank like this one and every copy is identical.

``reshard.read_needs`` then reads only the pieces and chunks those regions touch. Same world size
and layout: each rank reads its own manifest and own entries and decodes them straight into the
live tensors, as fast as before resharding existed.

Objects: with one DTensor-parametrised model in the state (``dtensor.sharded_model_of``) the model is
restored with ``set_model_state_dict`` and each top-level optimizer with ``set_optimizer_state_dict``
(their state dicts built from the live objects with ``get_model_state_dict`` /
``get_optimizer_state_dict``, which creates Adam's state before the first step as DCP does). A plain
model restores an FQN-keyed (sharded) checkpoint the same way; an FQN-keyed live optimizer restores
an index-keyed one by parameter position. Dict-style state (``get_state_dict``'s output) is loaded in
place; the caller then calls ``set_state_dict``.

Non-tensor state that differs between saved ranks (``per_rank_keys``: a loader's position, RNG
streams) cannot follow a world-size change by itself: the caller says what each gets
(``per_rank``). RNG state is applied after everything else. Nothing here unpickles.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from ckptd.core import storage
from ckptd.core.errors import ChecksumError, FormatError
from ckptd.core.global_index import LOCAL, GlobalTensor
from ckptd.core.reader import StepReader
from ckptd.core.regions import Region
from ckptd.core.schema import Manifest
from ckptd.core.tree import decode_tree

from .dtensor import is_dtensor, local_region, local_tensor, sharded_model_of
from .errors import CheckpointError
from .fqn_load import load_model, load_optimizer, read_into
from .live_state import fqn_keyed, live_tensors, rekey_by_position, tree_items
from .load_files import ReadAt, StepFiles
from .read_stats import HeldShards, ReadStats
from .reshard import DTYPES, Need, decodable_into, read_needs, tensor_bytes
from .restore_check import Check, Outcome, check_plain, saved_leaves
from .restore_threads import RestoreThreads
from .state import RNGState, apply_state

FRESH, RANK0, SAME_RANK = "fresh", "rank0", "same-rank"
PER_RANK_RULES = (FRESH, RANK0, SAME_RANK)

PerRankRule = str | Callable[[int, int, int], "int | None"]
"""What one per-rank entry restores at another world size: ``"fresh"`` (leave the live value as it
is), ``"rank0"`` (saved rank 0's), ``"same-rank"`` (rank r gets saved rank r's; a rank the saved
world did not have stays fresh), or ``f(rank, saved_world_size, world_size) -> saved rank | None``
(None: fresh)."""

PerRank = PerRankRule | Mapping[str, PerRankRule] | None
"""``restore``'s ``per_rank``: one rule for every per-rank entry, or a rule per top-level key."""

__all__ = ["apply_loaded", "load_shard", "restore_state", "tensor_bytes",
           "FRESH", "RANK0", "SAME_RANK", "PerRank", "PerRankRule", "ReadStats"]


def load_shard(files: StepFiles, manifest: Manifest, rank: int, threads: int,
               targets: dict[str, torch.Tensor] | None = None) -> Any:
    """(Format-1 steps) Decode rank ``rank``'s tensors (``manifest``) in parallel and rebuild its
    state tree; checksums are verified.

    ``targets``: tensors of the live state by name; a CPU, contiguous one of the saved dtype and
    shape is decoded into directly (already-touched memory, no second copy) — fresh memory
    would cost a page fault per 4 KiB, which dominates decoding on large states. A chunk per task on
    the restore threads (``restore_threads``: raising, none is decoded into ``targets`` after)."""
    reader, step_path = files.reader, files.path
    tensors: dict[str, torch.Tensor] = {}
    try:
        fd = reader.open_data(rank)
    except FormatError as e:
        raise CheckpointError(f"cannot restore from {step_path}: {e}") from None
    try:
        with RestoreThreads(threads, "ckptd-restore") as pool:
            futures: list[Future[None]] = []
            for entry in manifest.tensors:
                live = (targets or {}).get(entry.name)
                t = live if live is not None and decodable_into(live, entry.dtype, entry.shape) else \
                    torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
                tensors[entry.name] = t
                out = tensor_bytes(t)
                futures += [pool.submit(reader.read_chunk_into, fd, entry, file_pos, raw_pos, meta, out)
                            for file_pos, raw_pos, meta in entry.chunk_spans()]
            for fut in futures:
                fut.result()
    except ChecksumError as e:
        raise CheckpointError(f"corrupt checkpoint: {e}") from None
    finally:
        os.close(fd)
    try:
        return decode_tree(manifest.tree, tensors.__getitem__)
    except (FormatError, KeyError) as e:
        raise CheckpointError(f"{step_path}: bad state tree in rank {rank} manifest: {e}") from None


# ---- what each per-rank entry gets at another world size ------------------------------------------

def _check_rule(key: str, rule: Any) -> None:
    if not (callable(rule) or rule in PER_RANK_RULES):
        raise ValueError(f"per_rank[{key!r}]: {rule!r} is not a rule; use 'fresh', 'rank0', 'same-rank' or "
                         "a callable (rank, saved_world_size, world_size) -> saved rank or None")


def _rule_for(per_rank: PerRank, key: str) -> PerRankRule | None:
    if per_rank is None:
        return None
    if isinstance(per_rank, Mapping):
        return per_rank.get(key)
    return per_rank


def _saved_rank(rule: PerRankRule, key: str, rank: int, saved: int, world: int) -> int | None:
    if rule == FRESH:
        return None
    if rule == RANK0:
        return 0
    if rule == SAME_RANK:
        return rank if rank < saved else None
    assert callable(rule)
    src = rule(rank, saved, world)
    if src is not None and not (type(src) is int and 0 <= src < saved):
        raise CheckpointError(f"per_rank[{key!r}] returned {src!r} for rank {rank}: not None or a saved rank "
                              f"in [0, {saved})")
    return src


def tree_source(rank: int, saved_world: int) -> int:
    """The saved rank whose state tree (and plain-tensor copies) rank ``rank``'s non-per-rank entries
    take: its own where the saved world had it, else rank 0's."""
    return rank if rank < saved_world else 0


def _restore_last(obj: Any) -> bool:
    """RNG state goes last, so nothing restored after it (a load that draws random numbers) moves it."""
    return isinstance(obj, RNGState) or getattr(obj, "ckptd_restore_last", False) is True


# ---- the restore ------------------------------------------------------------------------------------

def restore_state(step_path: str, state: dict[str, Any], *, rank: int, world_size: int, threads: int,
                  per_rank: PerRank = None, strict: bool = True, stats: ReadStats | None = None,
                  read_at: ReadAt = storage.read_at, held: HeldShards | None = None,
                  reader: StepReader | None = None, before_write: Callable[[], None] | None = None) -> Outcome:
    """Load committed step ``step_path`` into ``state`` in place, as rank ``rank`` of ``world_size``
    (see the module docstring and ``Checkpointer.restore``); every name, dtype and shape is checked
    first (restore_check.py). ``stats``/``read_at``: as for ``load_tensor``; ``held``: saved ranks
    read from a daemon's memory instead of their files (held_pieces.py); ``reader``: the step's
    index as the caller already read it; ``before_write``: called once everything is checked and
    every shard to read is at hand, before the first byte is written into ``state`` (it may raise
    to stop the restore there: memory_level.py's vote). Raises CheckpointError (ValueError for a
    malformed ``per_rank``)."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of names to values, got {type(state).__name__}")
    if isinstance(per_rank, Mapping):
        for key, rule in per_rank.items():
            _check_rule(str(key), rule)
    elif per_rank is not None:
        _check_rule("*", per_rank)
    with StepFiles(step_path, stats, read_at, held, reader) as files:
        if files.tensors is None:
            files.held = None                # (a format-1 step is read from its files only)
            return _restore_v1(files, state, rank, world_size, threads, strict, before_write)
        return _Restore(files, files.tensors, state, rank, world_size, threads, per_rank, strict, before_write).run()


def _restore_v1(files: StepFiles, state: dict[str, Any], rank: int, world_size: int, threads: int,
                strict: bool, before_write: Callable[[], None] | None) -> Outcome:
    """A format-1 step: this rank's own shard at the same world size, exactly as before format 2."""
    if files.world_size != world_size:
        raise CheckpointError(f"{files.path} was saved by {files.world_size} ranks; this job has {world_size}: "
                              "a format-1 step has no tensor map and cannot be resharded")
    manifest = files.manifest(rank)
    items = tree_items(manifest.tree)
    if items is None:
        raise CheckpointError(f"{files.path}: rank {rank}'s state tree is not a dict")
    entries = manifest.by_name()
    _, outcome = check_plain(state, items, entries.get, f"step {files.step} ({files.path})", strict)
    if before_write is not None:
        before_write()
    targets, _ = live_tensors(state)
    loaded = load_shard(files, manifest, rank, threads, targets)
    apply_loaded(state, {k: v for k, v in loaded.items() if k in state}, None, strict)
    return outcome


def apply_loaded(state: dict[str, Any], loaded: dict[Any, Any], model: torch.nn.Module | None,
                 strict: bool = True, live: Mapping[Any, Any] | None = None) -> None:
    """Apply ``loaded``'s top-level entries to ``state``; RNG state last; FQN-keyed objects through
    torch's ``set_*_state_dict`` when ``model`` is set (skipped, or for an optimizer all but its param
    groups' settings, when the restore read into ``live``, ``fqn_load.read_into``'s state dicts, in
    place: fqn_load.py). ``strict``: as ``restore``'s, for modules. (Shared by the storage and memory
    restores, after restore_check found nothing wrong.)"""
    later = [k for k in loaded if k in state and _restore_last(state[k])]
    for k in [k for k in loaded if k not in later] + later:
        v = loaded[k]
        if k not in state:
            state[k] = v
            continue
        target = state[k]
        try:
            if model is not None and target is model:
                load_model(model, v, live.get(k) if live is not None else None, strict)
            elif model is not None and isinstance(target, torch.optim.Optimizer):
                load_optimizer(model, target, v, live.get(k) if live is not None else None)
            else:
                state[k] = apply_state(target, v, str(k), strict)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"restore {str(k)!r}: {type(e).__name__}: {e}") from e


class _Restore:
    def __init__(self, files: StepFiles, tensors: dict[str, GlobalTensor], state: dict[str, Any], rank: int,
                 world_size: int, threads: int, per_rank: PerRank, strict: bool,
                 before_write: Callable[[], None] | None = None) -> None:
        self.files, self.tensors, self.state, self.strict = files, tensors, state, strict
        self.before_write = before_write
        self.rank, self.world_size, self.threads, self.per_rank = rank, world_size, threads, per_rank
        self.saved = files.world_size
        self.changed = self.saved != world_size
        self.default_source = tree_source(rank, self.saved)
        self._partial: dict[tuple[Any, ...], bool] = {}

    def where(self) -> str:
        return f"step {self.files.step} ({self.files.path})"

    def sources(self) -> dict[Any, int | None]:
        """Each live top-level key → the saved rank it restores from (None: left as it is)."""
        per_rank_keys = set(self.files.per_rank_keys)
        out: dict[Any, int | None] = {}
        undecided = []
        for k in self.state:
            if not (self.changed and str(k) in per_rank_keys):
                out[k] = self.default_source
                continue
            rule = _rule_for(self.per_rank, str(k))
            if rule is None:
                undecided.append(str(k))
            else:
                out[k] = _saved_rank(rule, str(k), self.rank, self.saved, self.world_size)
        if undecided:
            keys = ", ".join(repr(k) for k in undecided)
            example = ", ".join(f"{k!r}: 'fresh'" for k in undecided)
            raise CheckpointError(
                f"{self.where()} was saved by {self.saved} ranks and this job has {self.world_size}; these entries "
                f"of the state differ between the saved ranks, so it is not clear what each rank should get: {keys}. "
                f"Say it with restore(state, per_rank={{{example}}}): 'fresh' leaves the live value as it is, "
                "'rank0' loads saved rank 0's, 'same-rank' gives rank r saved rank r's (ranks the saved world did "
                "not have stay fresh), or a callable (rank, saved_world_size, world_size) -> saved rank or None")
        return out

    def subtrees(self, sources: dict[Any, int | None]) -> dict[Any, tuple[int, Any]]:
        """Live top-level key → (saved rank, its saved subtree) of everything to restore."""
        def top(src: int) -> list[list[Any]]:
            items = tree_items(self.files.manifest(src).tree)
            if items is None:
                raise CheckpointError(f"{self.where()}: rank {src}'s state tree is not a dict")
            return items
        out: dict[Any, tuple[int, Any]] = {}
        for k, src in sources.items():       # saved entries the live state lacks are not read
            if src is None:
                continue
            for key, sub in top(src):
                if key == k and type(key) is type(k):
                    out[k] = (src, sub)
        return out

    def run(self) -> Outcome:
        sources = self.sources()
        subtrees = self.subtrees(sources)
        model = sharded_model_of(self.state)
        optims = [k for k, v in self.state.items() if isinstance(v, torch.optim.Optimizer) and k in subtrees]
        if model is None and any(fqn_keyed(subtrees[k][1]) for k in optims):
            modules = [v for v in self.state.values() if isinstance(v, torch.nn.Module)]
            model = modules[0] if len(modules) == 1 else None      # a plain model from a sharded checkpoint
        live_values = read_into(self.state, subtrees, model)
        for k, (src, sub) in subtrees.items():
            if live_values[k] is not self.state[k] and isinstance(self.state[k], torch.optim.Optimizer) \
                    and not fqn_keyed(sub):
                subtrees[k] = (src, rekey_by_position(sub, live_values[k], str(k)))
        live, lazy = live_tensors(live_values)

        needs: list[Need] = []
        resolved: dict[str, torch.Tensor] = {}
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        check = Check(self.where(), self.strict)
        trees = {k: sub for k, (_, sub) in subtrees.items()}
        for k, leaves in saved_leaves(trees).items():
            for path, name in leaves:
                try:
                    need, target = self.need(path, name, subtrees[k][0], live.get(path), copy_back)
                except CheckpointError as e:     # every mismatch named at once, before anything is read
                    check.add(str(e))
                    continue
                if need is not None:
                    needs.append(need)
                resolved[name] = target
        outcome = check.finish(self.state, [k for k, src in sources.items() if src is not None], trees, live, lazy)
        if self.before_write is not None:
            self.before_write()
        read_needs(self.files, needs, self.threads, prefer=self.rank if self.rank < self.saved else None)
        with torch.no_grad():
            for dst, src_t in copy_back:
                dst.copy_(src_t)
        loaded: dict[Any, Any] = {}
        for k, (src, sub) in subtrees.items():
            try:
                loaded[k] = decode_tree(sub, resolved.__getitem__)
            except (FormatError, KeyError) as e:
                raise CheckpointError(f"{self.where()}: bad state tree under {str(k)!r} in rank {src}'s "
                                      f"manifest: {e}") from None
        apply_loaded(self.state, loaded, model, self.strict, live_values)
        return outcome

    def need(self, path: str, name: str, src: int, live: torch.Tensor | None,
             copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Need | None, torch.Tensor]:
        """What tensor ``name`` (at ``path`` of the state) needs read (None: nothing, a DTensor whose local
        shard here is empty: a rank outside its mesh, or an uneven split's), and what the loaded tree gets."""
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"tensor {name!r} (rank {src}'s state tree, at {path!r}) is not in the tensor "
                                  f"map of {self.where()}")
        source = None
        shape, dtype = t.shape, t.dtype
        if t.kind == LOCAL:
            holders = t.holder_ranks()
            source = src if src in holders else (holders[0] if t.same and holders else None)
            if source is None:
                raise CheckpointError(f"tensor {name!r}: saved rank {src} has no copy and the copies of ranks "
                                      f"{list(holders)} differ, in {self.where()}")
            entry = self.files.entry(source, name, name)
            shape, dtype = tuple(entry.shape), entry.dtype
        if live is None:                  # in the checkpoint, not in the state: a fresh whole tensor
            out = torch.empty(shape, dtype=DTYPES[dtype])
            return Need(name, Region.whole(shape), out, source), out
        live_dtype = str(live.dtype).removeprefix("torch.")
        if live_dtype != dtype:
            raise CheckpointError(f"tensor {path!r}: the checkpoint has {dtype}, the state {live_dtype}")
        if is_dtensor(live):
            placements = tuple(live.placements)     # type: ignore[attr-defined]
            partial = self._partial.get(placements)
            if partial is None:                  # once per distinct placement tuple, not per tensor
                from torch.distributed.tensor import Partial  # importable: live is a DTensor
                partial = self._partial[placements] = any(isinstance(p, Partial) for p in placements)
            if partial:
                raise CheckpointError(f"cannot restore into DTensor {path!r}: it has Partial placements")
            try:
                region, gshape = local_region(live)
            except TypeError as e:
                raise CheckpointError(f"cannot restore into DTensor {path!r}: {e}") from None
            if tuple(gshape) != tuple(shape):
                raise CheckpointError(f"tensor {path!r}: the checkpoint's global shape is {list(shape)}, the "
                                      f"state's {list(gshape)}")
            local = local_tensor(live)      # to_local()'s bytes, without building an autograd view per tensor
            if region.numel == 0:
                return None, live
        else:
            if tuple(live.shape) != tuple(shape):
                raise CheckpointError(f"tensor {path!r}: the checkpoint's shape is {list(shape)}, the state's "
                                      f"{list(live.shape)}")
            region, local = Region.whole(shape), live
        if decodable_into(local, dtype, region.sizes):
            out = local
        else:                             # another device, layout or stride: decode aside, copy after
            out = torch.empty(region.sizes, dtype=DTYPES[dtype])
            copy_back.append((local, out))
        return Need(name, region, out, source), live
