"""The global tensor map of a committed step: every tensor name → dtype, global shape, pieces.

Built by the committing daemon from the rank manifests it verifies anyway (one pass, O(entries)),
stored in index.json (format 2), and read by restore, lazy loads, ``ckptd inspect`` and
``ckptd verify``. Two kinds of tensors:

- ``sharded``: saved from DTensors; each piece is one rank's rectangular region of the global
  tensor. Together the pieces tile the tensor exactly (``verify`` checks it). Replicated
  placements are written by one owner only, so they appear once.
- ``local``: plain tensors; every rank that holds one saved its own copy (the whole tensor).
  ``same`` says whether every copy is byte-identical (compared by chunk checksums, no reads), so
  a restore at another world size knows whether it may take any copy. A rank's copy may have its
  own shape and dtype (a ZeRO-style flat partition, a hand-sharded weight, a per-rank buffer):
  the tensor's ``dtype``/``shape`` are the lowest holder's, and each piece carries its own
  (``Piece.dtype``, ``Piece.region``); index.json lists the copies that differ under ``copies``.

``per_rank_keys`` lists the top-level state entries whose content differs between ranks (a data
loader's position, RNG streams): restoring them at another world size needs the user's decision.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .errors import FormatError
from .names import validate_tensor_name
from .piece_grid import PieceGrid, fit_arrays
from .rank_record import RankRecord, RecordEntry, fingerprint, summarize
from .regions import Region
from .schema import DTYPE_ITEMSIZE, Manifest
from .sizes import sizable

__all__ = ["LOCAL", "SHARDED", "GlobalTensor", "Holders", "Piece", "build_from_records", "build_tensor_map",
           "fingerprint", "parse_tensor_map", "per_rank_keys"]

SHARDED, LOCAL = "sharded", "local"


@dataclass(frozen=True)
class Piece:
    """One rank's saved bytes of a tensor: entry ``name`` of that rank's manifest. ``dtype``: a local
    copy's own dtype where it differs from the tensor's (None: the tensor's); a local copy's shape
    is its region's sizes."""
    rank: int
    name: str
    region: Region
    dtype: str | None = None


@dataclass(frozen=True)
class Holders:
    """A local tensor's holders as index.json states them: ``ranks`` (``range(world_size)`` when
    every rank holds a copy: O(1), however large the world) and ``own``, rank → (dtype or None,
    whole region) of each copy whose dtype or shape is not the tensor's."""
    ranks: Sequence[int]
    own: Mapping[int, tuple[str | None, Region]]


@dataclass(frozen=True, eq=False)
class GlobalTensor:
    """``pieces``: every piece, in rank order — the ``listed`` ones, or those of ``grid`` (a
    sharded tensor stored as a rule, piece_grid.py) or ``holders`` (a local tensor's copies as
    read from an index), made on first use. Readers of one region or one rank ask
    :meth:`overlapping`, :meth:`held_by` and :meth:`holder_ranks` instead, which do not make them:
    at 32,768 ranks every tensor would be 32,768 objects on every restoring rank."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str                     # SHARDED or LOCAL
    listed: tuple[Piece, ...]
    same: bool = True             # LOCAL only: every rank's copy is byte-identical
    grid: PieceGrid | None = None
    holders: Holders | None = None

    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        if self.grid is not None:
            return tuple(Piece(rank, self.name, region) for rank, region in self.grid.pieces())
        if self.holders is not None:
            return tuple(self._copy(rank, self.holders) for rank in self.holders.ranks)
        return self.listed

    def _copy(self, rank: int, holders: Holders) -> Piece:
        own = holders.own.get(rank)
        return Piece(rank, self.name, own[1], own[0]) if own else Piece(rank, self.name, Region.whole(self.shape))

    def holder_ranks(self) -> Sequence[int]:
        """The ranks that saved a piece or copy, in order (a range when every rank did)."""
        if self.holders is not None:
            return self.holders.ranks
        return [p.rank for p in self.pieces]

    def overlapping(self, region: Region) -> list[Piece]:
        """The pieces sharing an element with ``region`` (a grid's by arithmetic, O(pieces returned))."""
        if self.grid is not None:
            return [Piece(rank, self.name, r) for rank, r in self.grid.overlapping(region)]
        return [p for p in self.pieces if len(p.region.sizes) == len(region.sizes) and p.region.intersect(region)]

    def held_by(self, rank: int) -> list[Piece]:
        """The pieces saved by ``rank`` (a grid's by arithmetic, holders' by lookup)."""
        if self.grid is not None:
            cell = self.grid.cell_of_rank(rank)
            return [] if cell is None else [Piece(rank, self.name, self.grid.region_of(cell))]
        if self.holders is not None:
            return [self._copy(rank, self.holders)] if rank in self.holders.ranks else []
        return [p for p in self.pieces if p.rank == rank]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GlobalTensor) and (self.name, self.dtype, self.shape, self.kind, self.same,
                                                    self.pieces) == (other.name, other.dtype, other.shape,
                                                                     other.kind, other.same, other.pieces)

    __hash__ = None  # type: ignore[assignment]

    def copy_of(self, p: Piece) -> tuple[str, tuple[int, ...]]:
        """(dtype, shape) of piece ``p``'s saved entry: a local copy's own, a shard's global tensor's."""
        if self.kind == SHARDED:
            return self.dtype, self.shape
        return p.dtype or self.dtype, p.region.sizes

    def to_json(self, world_size: int, *, grids: bool = True) -> dict[str, Any]:
        """index.json's entry. A sharded tensor with a grid as that grid (``grids``; such an index is
        format 3), else its pieces listed. Whether pieces form a grid is the builder's to find
        (``build_from_records``), once: this writes what the tensor has."""
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "kind": self.kind}
        if self.kind == SHARDED:
            if self.grid is not None and grids:
                out["grid"] = self.grid.to_json()
            else:
                out["pieces"] = [{"rank": p.rank, "name": p.name, **p.region.to_json()} for p in self.pieces]
        else:       # whole copies named like the tensor: only who holds one (O(1) when every rank does)
            ranks = self.holder_ranks()
            out["held_by"] = "all" if ranks == range(world_size) or list(ranks) == list(range(world_size)) \
                else list(ranks)
            out["same"] = self.same
            if self.holders is not None:     # (as built or read: only the copies that differ, no Piece made)
                copies = {str(r): {"dtype": d or self.dtype, "shape": list(region.sizes)}
                          for r, (d, region) in sorted(self.holders.own.items())}
            else:
                copies = {str(p.rank): {"dtype": p.dtype or self.dtype, "shape": list(p.region.sizes)}
                          for p in self.pieces if p.dtype is not None or p.region.sizes != self.shape}
            if copies:   # only the copies whose dtype or shape is not the tensor's
                out["copies"] = copies
        return out


def build_tensor_map(manifests: Sequence[Manifest]) -> tuple[dict[str, GlobalTensor], list[str]]:
    """(tensor map, per-rank top-level keys) of a step from all its rank manifests, in rank order."""
    return build_from_records([summarize(m, "") for m in manifests])


def build_from_records(records: Sequence[RankRecord]) -> tuple[dict[str, GlobalTensor], list[str]]:
    """(tensor map, per-rank top-level keys) of a step from every rank's record, in rank order."""
    sharded: dict[str, list[tuple[RecordEntry, int]]] = {}
    local: dict[str, list[tuple[RecordEntry, int]]] = {}
    for rec in records:
        for e in rec.entries:
            (sharded if e.global_shape is not None else local).setdefault(e.key, []).append((e, rec.rank))
    out: dict[str, GlobalTensor] = {}
    for key, held in sharded.items():
        first = held[0][0]
        assert first.global_shape is not None
        for e, rank in held:
            if e.dtype != first.dtype or e.global_shape != first.global_shape:
                raise FormatError(f"tensor {key!r}: rank {rank} saved {e.dtype}{e.global_shape}, rank "
                                  f"{held[0][1]} saved {first.dtype}{first.global_shape}")
        shape = tuple(first.global_shape)
        grid = _grid_of(key, shape, held)
        if grid is not None:        # distinct regions, no replicas: no piece made (O(ranks) objects)
            out[key] = GlobalTensor(key, first.dtype, shape, SHARDED, (), grid=grid)
            continue
        out[key] = GlobalTensor(key, first.dtype, shape, SHARDED,
                                tuple(Piece(rank, e.name, e.region()) for e, rank in held))
        if len(held) > 1:
            _check_replicas(key, held)
    for key, held in local.items():
        if key in out:
            raise FormatError(f"tensor {key!r} is sharded on some ranks and a plain tensor on others")
        out[key] = _local(key, held, len(records))
    return out, per_rank_keys(records, out)


def _local(key: str, held: list[tuple[RecordEntry, int]], world_size: int) -> GlobalTensor:
    """A plain tensor's entry: its holders as a range (every rank: O(1)) or a list, and the copies whose
    dtype or shape is not the lowest holder's — no Piece per rank (made on first use, if ever)."""
    first = held[0][0]
    shape = tuple(first.shape)
    ranks = [rank for _, rank in held]
    own: dict[int, tuple[str | None, Region]] = {}
    wholes: dict[tuple[int, ...], Region] = {}
    for e, rank in held:
        if e.dtype != first.dtype or e.shape != shape:
            region = wholes.get(e.shape) or wholes.setdefault(e.shape, Region.whole(e.shape))
            own[rank] = (None if e.dtype == first.dtype else e.dtype, region)
    same = len(held) == world_size and not own and len({e.fp for e, _ in held}) == 1
    holders = Holders(range(world_size) if ranks == list(range(world_size)) else ranks, own)
    return GlobalTensor(key, first.dtype, shape, LOCAL, (), same=same, holders=holders)


def _grid_of(key: str, shape: tuple[int, ...], held: list[tuple[RecordEntry, int]]) -> PieceGrid | None:
    """The grid ``held``'s pieces (in rank order) form, if they are all named like the tensor."""
    if len(held) < 2 or not shape or any(e.name != key or e.offsets is None for e, _ in held):
        return None
    try:
        return fit_arrays(shape, np.fromiter((r for _, r in held), dtype=np.int64, count=len(held)),
                          np.array([e.offsets for e, _ in held], dtype=np.int64),
                          np.array([e.shape for e, _ in held], dtype=np.int64))
    except ValueError:          # ragged: some piece has another number of dimensions
        return None


def _check_replicas(key: str, held: list[tuple[RecordEntry, int]]) -> None:
    """FormatError when ranks that saved the same region of ``key`` (replicas that cannot tell
    so locally) saved different bytes: readers take any one copy, so they must agree."""
    first: dict[tuple[int, ...], tuple[str, int]] = {}
    for e, rank in held:
        if e.fp is None or e.offsets is None:
            continue
        region = (*e.offsets, *e.shape)
        fp, by = first.setdefault(region, (e.fp, rank))
        if fp != e.fp:
            raise FormatError(f"tensor {key!r}: rank {rank} and rank {by} saved the same region "
                              f"{e.region().to_json()} with different bytes")


def per_rank_keys(records: Sequence[RankRecord], tensors: dict[str, GlobalTensor]) -> list[str]:
    """Top-level state keys whose non-sharded content (tree leaves, plain tensors) differs by rank."""
    if len(records) < 2:
        return []
    differing = {name for name, t in tensors.items() if t.kind == LOCAL and not t.same}
    distinct = list(dict.fromkeys(rec.forms for rec in records))     # ranks mostly repeat theirs: each once
    keys: dict[str, set[str]] = {}
    for forms in distinct:
        for key, form in forms:
            keys.setdefault(key, set()).add(form)
    out = {k for k, forms in keys.items() if len(forms) > 1}
    out |= {top for name in differing for top in _tops_of(name, keys)}
    present = [{k for k, _ in forms} for forms in distinct]
    out |= set[str]().union(*present) - present[0].intersection(*present[1:])    # held by some ranks only
    return sorted(out)


def _tops_of(name: str, tops: Mapping[str, Any]) -> list[str]:
    """The top-level keys a tensor named ``name`` may lie under: a key may itself hold a ``/``
    (``"loader/pos"``), so each prefix of the name at a ``/`` that is a key (both, where keys
    ``"a"`` and ``"a/b"`` could each hold ``"a/b/c"``); its first part where none is."""
    parts = name.split("/")
    found = [k for k in ("/".join(parts[:i]) for i in range(1, len(parts) + 1)) if k in tops]
    return found or [parts[0]]


def parse_tensor_map(obj: Any, world_size: int) -> dict[str, GlobalTensor]:
    """Validate index.json's ``tensors`` object (everything read from disk is checked here)."""
    if not isinstance(obj, dict):
        raise FormatError("index 'tensors' must be an object")
    out: dict[str, GlobalTensor] = {}
    for name, t in obj.items():
        try:
            validate_tensor_name(name)
        except ValueError as e:
            raise FormatError(f"index tensor map: {e}") from None
        where = f"index tensor {name!r}"
        if not (isinstance(t, dict) and t.get("dtype") in DTYPE_ITEMSIZE and t.get("kind") in (SHARDED, LOCAL)
                and _uints(t.get("shape"))):
            raise FormatError(f"{where}: needs dtype, shape and kind")
        if not sizable(t["shape"], DTYPE_ITEMSIZE[t["dtype"]]):
            raise FormatError(f"{where}: shape {str(t['shape'])[:200]} is beyond any tensor (over 2**62 bytes)")
        shape = tuple(t["shape"])
        same = t.get("same", True)
        if type(same) is not bool:
            raise FormatError(f"{where}: 'same' must be true or false")
        if t["kind"] == LOCAL:
            held: Any = t.get("held_by")
            if held == "all":
                ranks: Sequence[int] = range(world_size)
            elif (_uints(held, limit=world_size) and all(r < world_size for r in held)
                  and len(set(held)) == len(held)):
                ranks = tuple(held)
            else:
                raise FormatError(f"{where}: 'held_by' must be \"all\" or a list of distinct ranks")
            copies = _copies(t.get("copies", {}), t["dtype"], ranks, where)
            out[name] = GlobalTensor(name, t["dtype"], shape, LOCAL, (), same, holders=Holders(ranks, copies))
            continue
        if "grid" in t:
            out[name] = GlobalTensor(name, t["dtype"], shape, SHARDED, (),
                                     grid=PieceGrid.from_json(t["grid"], shape, world_size, where))
            continue
        if not isinstance(t.get("pieces"), list):
            raise FormatError(f"{where}: a sharded tensor needs pieces or a grid")
        pieces = []
        for p in t["pieces"]:
            if not (isinstance(p, dict) and type(p.get("rank")) is int and 0 <= p["rank"] < world_size
                    and isinstance(p.get("name"), str) and _uints(p.get("offsets")) and _uints(p.get("sizes"))
                    and len(p["offsets"]) == len(p["sizes"]) == len(shape)):
                raise FormatError(f"{where}: malformed piece {str(p)[:120]}")
            if p["name"] != name:          # the tensor's own name is validated above
                try:
                    validate_tensor_name(p["name"])
                except ValueError as e:
                    raise FormatError(f"{where}: {e}") from None
            pieces.append(Piece(p["rank"], p["name"], Region(tuple(p["offsets"]), tuple(p["sizes"]))))
        out[name] = GlobalTensor(name, t["dtype"], shape, SHARDED, tuple(pieces))
    return out


def _copies(obj: Any, dtype: str, held: Sequence[int], where: str) -> dict[int, tuple[str | None, Region]]:
    """A local tensor's ``copies``: rank → (its own dtype or None, its own whole region), checked."""
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: 'copies' must be an object of rank → dtype and shape")
    out: dict[int, tuple[str | None, Region]] = {}
    for key, c in obj.items():
        rank = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 7 else -1
        if rank not in held:
            raise FormatError(f"{where}: 'copies' names {key[:20]!r}, not a rank that holds a copy")
        if not (isinstance(c, dict) and c.get("dtype") in DTYPE_ITEMSIZE and _uints(c.get("shape"))):
            raise FormatError(f"{where}: rank {rank}'s copy needs a dtype and a shape")
        out[rank] = (None if c["dtype"] == dtype else c["dtype"], Region.whole(tuple(c["shape"])))
    return out


def _uints(v: Any, limit: int = 64) -> bool:
    return isinstance(v, list) and len(v) <= limit and all(type(x) is int and x >= 0 for x in v)

