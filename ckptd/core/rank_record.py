"""A rank record: what the commit needs of one durable rank, without reading its manifest.

The daemon that writes a rank's shard knows its manifest; it reduces it to a record (digest,
sizes, each tensor's name, dtype, shape, placement and — for plain tensors — a fingerprint of
its chunk checksums, and a hash of each top-level state entry's non-tensor content) and sends
it with the DURABLE event (``to_json``). In a relayed commit the records travel through the job's
c10d store inside the ranks' outcomes (core/relay_record.py; one node record per node, see
ckptd_client/relay.py) to the committing daemon, which builds the global
tensor map from them (``global_index.build_from_records``) instead of re-reading every manifest
on the commit's critical path. Nothing is lost by that: a reader checks every manifest it reads
against its digest in the index and against the tensor map, and ``ckptd verify`` checks all of
them. Records come off the wire, so ``parse_record`` validates them like a manifest.

A record travels as JSON (``RankRecord.to_json``). Where many are read at once — rank 0's relay
reading every node's record from the store — they are decoded straight into :class:`RecordWire`
by msgspec, which checks every field's type and each entry's arity as it decodes (4,096 node
records of 8 ranks: 77 ms, against 250 ms for ``json.loads`` and the relay's checks);
``parse_record`` then checks what types cannot say (names, dtypes, digests, bounds), as it does
for a record that came as plain JSON.
"""
from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import msgspec

from .errors import FormatError
from .gc_pause import gc_paused
from .names import are_checksums, are_digests, is_checksum, is_digest, is_uint, validate_tensor_name
from .regions import Region
from .schema import Manifest, Placement, TensorEntry, parse_placement, validate_shape


def fingerprint(entry: TensorEntry) -> tuple[Any, ...]:
    """What makes two saved copies byte-identical, known without reading them (chunk checksums)."""
    return (entry.dtype, tuple(entry.shape), tuple(c.content for c in entry.chunks))


def short_hash(obj: Any) -> str:
    """64-bit hash of a JSON-able value's canonical form: equal content, equal hash."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class RecordEntry(msgspec.Struct, frozen=True, gc=False):
    """One tensor entry of a rank's manifest, as the tensor map needs it. (A msgspec struct, as
    ``RankRecord``: made in C, 12x faster than a frozen dataclass, and untracked by the cyclic
    collector, as it holds only strings, numbers and tuples of them: a 32,768-rank COMMIT makes
    65,536 of these and 32,768 records, 85 of its parse's 270 ms as dataclasses.)"""
    name: str
    dtype: str
    shape: tuple[int, ...]
    key: str                                   # the global tensor it belongs to (its own name when plain)
    global_shape: tuple[int, ...] | None       # set for a piece of a sharded tensor
    offsets: tuple[int, ...] | None
    fp: str | None                             # hash of its fingerprint (None: a piece from an older writer)

    def region(self) -> Region:
        return Region(self.offsets, self.shape) if self.offsets is not None else Region.whole(self.shape)


class RankRecord(msgspec.Struct, frozen=True, gc=False):
    """What the commit needs of one durable rank (see the module's docstring)."""
    rank: int
    digest: str                                # sha256 of the rank's manifest file
    raw_bytes: int
    stored_bytes: int
    entries: tuple[RecordEntry, ...]
    forms: tuple[tuple[str, str], ...]         # (top-level state key, hash of its content)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "digest": self.digest, "raw": self.raw_bytes, "stored": self.stored_bytes,
                "t": [[e.name, e.dtype, list(e.shape), None if e.key == e.name else e.key,
                       None if e.global_shape is None else list(e.global_shape),
                       None if e.offsets is None else list(e.offsets), e.fp] for e in self.entries],
                "k": [list(f) for f in self.forms]}

    def index_entry(self) -> dict[str, Any]:
        """This rank's entry in index.json's ``ranks``."""
        return {"rank": self.rank, "manifest_digest": self.digest, "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes}


class RecordWire(msgspec.Struct, frozen=True, gc=False):
    """A record as ``RankRecord.to_json`` writes it, typed by msgspec's decoder (its fields' types
    and each entry's arity checked there); ``parse_record`` checks the rest. Not tracked by the cyclic
    collector (``gc=False``: it holds only strings, numbers and tuples of them), so 32,768 of them
    held by rank 0 while the node records come in add nothing to a collection."""
    rank: int
    digest: str
    raw: int
    stored: int
    t: tuple[tuple[str, str, tuple[int, ...], str | None, tuple[int, ...] | None, tuple[int, ...] | None,
                   str | None], ...]
    k: tuple[tuple[str, str], ...]


def top_level(tree: Any) -> list[tuple[str, Any]]:
    """(key, content) of a state tree's top-level entries (one unnamed entry for a non-dict tree)."""
    if isinstance(tree, dict) and isinstance(tree.get("d"), list):
        return [(str(k), v) for k, v in (item for item in tree["d"] if isinstance(item, list) and len(item) == 2)]
    return [("", tree)]


def summarize(m: Manifest, digest: str) -> RankRecord:
    """The record of a manifest whose file bytes hash to ``digest``."""
    entries = []
    for e in m.tensors:
        p = e.placement
        entries.append(RecordEntry(e.name, e.dtype, tuple(e.shape), e.key,
                                   None if p is None else tuple(p.global_shape),
                                   None if p is None else tuple(p.offsets),
                                   short_hash(repr(fingerprint(e)))))
    return RankRecord(m.rank, digest, m.raw_bytes, m.stored_bytes, tuple(entries),
                      tuple((k, short_hash(v)) for k, v in top_level(m.tree)))


@functools.lru_cache(maxsize=1 << 16)
def _name_fault(name: Any) -> str | None:
    """Why a tensor name is refused (None: valid); cached, as every rank of a job repeats the names."""
    try:
        validate_tensor_name(name)
        return None
    except ValueError as e:
        return str(e)


def parse_record(obj: Any, rank: int, seen_entries: dict[Any, Any] | None = None) -> RankRecord:
    """A record from the wire or the store, checked as strictly as a manifest (FormatError). (Each
    message is built only on failure: a commit at 32,768 ranks parses 32,768 of these.)
    ``seen_entries`` (one per COMMIT) holds the tensor entries and state keys already validated:
    an entry equal to one of them is that entry, not checked again — ranks repeat replicated
    tensors, names, dtypes and shapes, so each distinct entry is validated once."""
    cache: dict[Any, Any] = {} if seen_entries is None else seen_entries
    def bad(why: str) -> FormatError:
        return FormatError(f"rank {rank} record: {why}")
    if isinstance(obj, RecordWire):
        return _parse_typed(obj, rank, cache, bad)
    if not (isinstance(obj, dict) and obj.get("rank") == rank):
        raise bad(f"not a record of rank {rank}")
    if not is_digest(obj.get("digest")):
        raise bad("bad digest")
    if not (is_uint(obj.get("raw")) and is_uint(obj.get("stored"))):
        raise bad("bad sizes")
    if not (isinstance(obj.get("t"), list) and isinstance(obj.get("k"), list)):
        raise bad("no tensors or keys")
    entries, seen = [], set()
    for t in obj["t"]:
        if not (isinstance(t, list) and len(t) == 7):
            raise bad("malformed tensor entry")
        name, dtype, shape, key, gshape, offsets, fp = t
        ck = _entry_key(t)
        hit = None if ck is None else cache.get(ck)
        if hit is None:      # (a hit's names were validated: checked here before ``in seen`` hashes them)
            fault = (_name_fault(name) if isinstance(name, str) else "a tensor name must be a string") \
                or (None if key is None else _name_fault(key) if isinstance(key, str) else "a key must be a string")
            if fault:
                raise bad(fault)
        if name in seen:
            raise bad(f"duplicate tensor {name!r}")
        seen.add(name)
        if hit is not None:
            entries.append(hit)
            continue
        entry = _entry(name, dtype, shape, key, gshape, offsets, fp, rank, bad)
        if ck is not None:
            cache[ck] = entry
        entries.append(entry)
    return RankRecord(rank, obj["digest"], obj["raw"], obj["stored"], tuple(entries), _forms(obj["k"], cache, bad))


def _entry(name: str, dtype: Any, shape: Any, key: Any, gshape: Any, offsets: Any, fp: Any, rank: int,
           bad: Any) -> RecordEntry:
    """A tensor entry whose name and key were checked, checked for the rest (dtype, shape, placement)."""
    try:
        validate_shape(dtype, shape)
    except FormatError as e:
        raise bad(f"tensor {name!r}: {e}") from None
    place = None if gshape is None else \
        parse_placement({"shape": gshape, "offsets": offsets}, shape, f"rank {rank} record: tensor {name!r}")
    return _placed(name, dtype, tuple(shape), key, place, offsets, fp, bad)


def _placed(name: str, dtype: str, shape: tuple[int, ...], key: Any, place: Placement | None, offsets: Any,
            fp: Any, bad: Any, fps: list[str] | None = None) -> RecordEntry:
    """The entry of a checked dtype, shape and placement (None: a plain tensor), its fingerprint and key
    checked; with ``fps``, a fingerprint that is a string is appended there for the caller to check
    (``are_checksums``) instead."""
    if place is not None:
        if not (fp is None or _fingerprint_ok(fp, fps)):
            raise bad("bad fingerprint")
        return RecordEntry(name, dtype, shape, key or name, place.global_shape, place.offsets, fp)
    if not (key is None and offsets is None and _fingerprint_ok(fp, fps)):
        raise bad(f"plain tensor {name!r} needs a fingerprint and no placement")
    return RecordEntry(name, dtype, shape, name, None, None, fp)


def _fingerprint_ok(fp: Any, fps: list[str] | None) -> bool:
    """``is_checksum(fp)``, or with ``fps`` a string fingerprint appended there, to be checked later."""
    if fps is not None and type(fp) is str:
        fps.append(fp)
        return True
    return is_checksum(fp)


def _forms(items: Any, cache: dict[Any, Any], bad: Any) -> tuple[tuple[str, str], ...]:
    """The record's (state key, content hash) pairs from a JSON record (lists), each distinct one
    checked once (a typed record's: ``_typed_forms``)."""
    forms = []
    for f in items:
        pair = isinstance(f, (list, tuple)) and len(f) == 2
        form = cache.get(("k", f[0], f[1])) if pair and isinstance(f[0], str) and isinstance(f[1], str) else None
        if form is None:
            if not (pair and isinstance(f[0], str) and len(f[0]) <= 1024
                    and is_checksum(f[1])):
                raise bad("malformed state key entry")
            form = cache[("k", f[0], f[1])] = (f[0], f[1])
        forms.append(form)
    return tuple(forms)


def _parse_typed(obj: RecordWire, rank: int, cache: dict[Any, Any], bad: Any,
                 fps: list[str] | None = None) -> RankRecord:
    """``parse_record`` of a typed record: the same checks, less the types msgspec checked; an entry
    is its own cache key (the dict path's ``_entry_key`` makes the same tuples). With ``fps`` the
    caller checks the digest and the new entries' fingerprints (appended there) itself: ``_typed_all``."""
    if obj.rank != rank:
        raise bad(f"not a record of rank {rank}")
    if fps is None and not is_digest(obj.digest):
        raise bad("bad digest")
    if obj.raw < 0 or obj.stored < 0:
        raise bad("bad sizes")
    get = cache.get
    entries = [get(t) or _typed_entry(t, rank, cache, bad, fps) for t in obj.t]
    if len(entries) > 1 and len({e.name for e in entries}) != len(entries):
        names = [e.name for e in entries]
        raise bad(f"duplicate tensor {next(n for n in names if names.count(n) > 1)!r}")
    return RankRecord(rank, obj.digest, obj.raw, obj.stored, tuple(entries), _typed_forms(obj.k, cache, bad))


def _typed_forms(items: tuple[tuple[str, str], ...], cache: dict[Any, Any], bad: Any) -> tuple[tuple[str, str], ...]:
    """``_forms`` of a typed record (pairs of strings, msgspec checked): ``items`` themselves once each
    distinct pair is checked; a pair is its own cache key (no other key of ``cache`` is a 2-tuple)."""
    for f in items:
        if f not in cache:
            if not (len(f[0]) <= 1024 and is_checksum(f[1])):
                raise bad("malformed state key entry")
            cache[f] = f
    return items


def _typed_entry(t: tuple[Any, ...], rank: int, cache: dict[Any, Any], bad: Any,
                 fps: list[str] | None = None) -> RecordEntry:
    """A typed entry not seen yet, checked as ``_entry`` checks a JSON one, but its dtype and shape, and its
    placement, once per distinct value (the ranks of a sharded tensor share them; typed values are exact
    ints, so they can key the cache: 15 % of a 32,768-rank COMMIT's parse); cached."""
    name, dtype, shape, key, gshape, offsets, fp = t
    fault = _name_fault(name) or (None if key is None else _name_fault(key))
    if fault:
        raise bad(fault)
    if ("s", dtype, shape) not in cache:
        try:
            validate_shape(dtype, list(shape))
        except FormatError as e:
            raise bad(f"tensor {name!r}: {e}") from None
        cache[("s", dtype, shape)] = True
    place = None
    if gshape is not None:
        place = cache.get(("p", shape, gshape, offsets))
        if place is None:
            place = cache[("p", shape, gshape, offsets)] = parse_placement(
                {"shape": list(gshape), "offsets": None if offsets is None else list(offsets)}, list(shape),
                f"rank {rank} record: tensor {name!r}")
    entry = cache[t] = _placed(name, dtype, shape, key, place, offsets, fp, bad, fps)
    return entry


def _entry_key(t: list[Any]) -> tuple[Any, ...] | None:
    """A hashable key of a record's tensor entry (its 7 fields, lists as tuples); None when it has
    none (a field of a type no valid entry has: that entry is then checked, and refused)."""
    name, dtype, shape, key, gshape, offsets, fp = t
    if type(shape) is not list or not (gshape is None or type(gshape) is list) \
            or not (offsets is None or type(offsets) is list):
        return None
    k = (name, dtype, tuple(shape), key, None if gshape is None else tuple(gshape),
         None if offsets is None else tuple(offsets), fp)
    try:
        hash(k)
    except TypeError:
        return None
    return k


def parse_records(objs: list[Any]) -> list[RankRecord]:
    """Every rank's record, in rank order (a COMMIT's; collection paused: see gc_pause); each
    distinct tensor entry validated once (``parse_record``'s ``seen_entries``). Typed records are
    checked in one pass first (``_typed_all``); records that fail it, or are not all typed, are
    parsed one by one, which names the first fault."""
    with gc_paused():
        if all(type(o) is RecordWire for o in objs):
            fast = _typed_all(objs)
            if fast is not None:
                return fast
        seen: dict[Any, Any] = {}
        return [parse_record(obj, r, seen) for r, obj in enumerate(objs)]


def _typed_all(objs: list[RecordWire]) -> list[RankRecord] | None:
    """``parse_record`` of every typed record in one loop, their digests and new entries' fingerprints
    each checked in one pass over all of them at the end (at 32,768 ranks: 157 -> 112 ms); None when
    any check fails (nothing of it is kept: the caller's second parse, one by one, finds the fault)."""
    if not are_digests([o.digest for o in objs]):
        return None
    cache: dict[Any, Any] = {}
    fps: list[str] = []
    try:
        out = [_parse_typed(o, r, cache, FormatError, fps) for r, o in enumerate(objs)]
    except FormatError:
        return None
    return out if are_checksums(fps) else None
