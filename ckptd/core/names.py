"""Names and validators: what a job, step, rank file or tensor may be called, and the checks
every message's validator shares (step and rank bounds, digests, ``require``).

Every name that becomes a path (jobs, steps, rank files) or a key (tensor names) is checked
here, once, before it touches a file system; readers of the wire and of disk call the same
functions, so a name from anywhere never escapes its directory. Each message type keeps its
own validator beside its dataclass (schema.py, rank_record.py, relay_record.py, held.py,
protocol.py) and builds it from these checks, so a bound is written once.
"""
from __future__ import annotations

import numbers
import operator
import os
import re
import time
from collections.abc import Sequence
from functools import partial
from itertools import chain, compress
from operator import is_
from typing import Any, TypeGuard

from .errors import FormatError

INDEX_NAME = "index.json"
# The lean index's side files beside index.json (core/rank_table.py says what each holds).
RANK_TABLE_NAME, TENSORS_NAME, HEAD_NAME = "ranks.bin", "tensors.json", "index-head.json"
# A step directory staged from the bucket for a restore (FORMAT.md): a copy, not this root's own commit.
STAGED_NAME = "staged.json"
MAX_RANKS = 1 << 20            # world size (FORMAT.md, "Size limits"); rank files have 5-7 digits
MAX_SLOTS = 8                  # shared-memory slots one client may hold (the daemon's slot pool refuses more)
MAX_STEP = 10**12              # steps are 0 <= step < MAX_STEP: a step directory has 12 digits

_STEP_RE = re.compile(r"^step-([0-9]{12})\Z")   # not \d (any Unicode digit) nor $ (allows "\n")
# \Z, not $: "$" also matches before a trailing newline ("job\n" would pass).
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
MAX_TENSOR_NAME = 1024
# Nesting of a save's JSON state tree (the tagged encoding spends 2-3 levels per Python
# container). Deeper trees are refused on the wire and on disk: every reader must be able
# to parse them without running out of recursion.
MAX_TREE_DEPTH = 256
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")    # a manifest's digest (schema.digest_bytes)
_HEX_RE = re.compile(r"^[0-9a-f]*\Z")
_DIGESTS_RE = re.compile(r"^(?:sha256:[0-9a-f]{64})*\Z")    # digests end to end (each 71 characters)


def short(value: object, limit: int = 80) -> str:
    """repr() for error messages, cut short: the value may be 16 MiB of hostile text."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def rank_spans(ranks: Sequence[int], limit: int = 8) -> str:
    """Sorted ranks as runs for a message (``0, 3-7, 9``), at most ``limit`` runs then how many more
    ranks: a timeout at 32,768 ranks must not log every one."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    rest = sum(b - a + 1 for a, b in runs[limit:])
    return text + (f" and {rest} more" if rest else "")


# ---- checks every validator shares -------------------------------------------

def require(cond: bool, what: str) -> None:
    """FormatError(``what``) unless ``cond``: the one way a validator refuses what it read."""
    if not cond:
        raise FormatError(what)


def is_uint(v: Any) -> TypeGuard[int]:
    """A JSON integer >= 0 (not a bool, not a float)."""
    return type(v) is int and v >= 0


def is_step(v: Any) -> TypeGuard[int]:
    """A step number: an integer in [0, MAX_STEP)."""
    return type(v) is int and 0 <= v < MAX_STEP


def step_number(v: Any) -> int:
    """``v`` as a step number (``check_step``), an integer of another registered integer type (NumPy's:
    ``numbers.Integral``) taken as the int it is; a bool never is one, nor a tensor or an array (whose
    ``__index__`` takes a one-element one)."""
    if type(v) is not int and not isinstance(v, bool) and isinstance(v, numbers.Integral):
        v = operator.index(v)
    return check_step(v)


def check_step(v: Any) -> int:
    """``v`` if it is a step number, else ValueError saying what a step is."""
    if not is_step(v):
        raise ValueError(f"step must be an integer in [0, 10**12), got {short(v)}")
    return int(v)


def is_seconds(v: Any, most: float) -> TypeGuard[int | float]:
    """A JSON number of seconds in [0, ``most``] (not a bool). Compared as it came, before any float():
    an integer beyond every float (JSON's are unbounded) is out of range, not an OverflowError."""
    return type(v) in (int, float) and 0 <= v <= most


def is_world(world_size: Any) -> TypeGuard[int]:
    """A world size ckptd can hold: an integer in [1, MAX_RANKS]."""
    return type(world_size) is int and 0 < world_size <= MAX_RANKS


def is_rank(rank: Any, world_size: Any) -> bool:
    """``rank`` is a rank of a world of ``world_size`` ranks, and that world is one ckptd can hold."""
    return is_world(world_size) and type(rank) is int and 0 <= rank < world_size


def is_digest(v: Any) -> TypeGuard[str]:
    """A manifest digest: ``sha256:`` and 64 lower-case hex digits."""
    return isinstance(v, str) and _DIGEST_RE.match(v) is not None


def is_hex(v: Any, digits: int) -> TypeGuard[str]:
    """Exactly ``digits`` lower-case hex digits (a nonce, a ticket's answer): nothing else passes."""
    return isinstance(v, str) and len(v) == digits and _HEX_RE.match(v) is not None


def is_checksum(v: Any) -> TypeGuard[str]:
    """16 lower-case hex digits: a ``codec.checksum`` (or a rank record's ``short_hash``)."""
    return is_hex(v, 16)


def are_checksums(values: list[Any]) -> bool:
    """Every item of ``values`` ``is_checksum`` (a held shard has one per chunk of every tensor)."""
    return _all_of_length(values, 16, _HEX_RE)


def are_digests(values: list[Any]) -> bool:
    """Every item of ``values`` ``is_digest`` (a COMMIT has one per rank)."""
    return _all_of_length(values, 71, _DIGESTS_RE)


def _all_of_length(values: list[Any], length: int, pattern: re.Pattern[str]) -> bool:
    """Every item a string of ``length`` characters and their concatenation matched by ``pattern`` in
    one pass: with every item that long, the pattern's repeats fall exactly on the items."""
    if not all(type(v) is str and len(v) == length for v in values):
        return False
    return pattern.match("".join(values)) is not None


def check_digest(v: Any, what: str) -> str:
    """``v`` if it is a manifest digest, else FormatError naming ``what``."""
    if not is_digest(v):
        raise FormatError(f"{what}: bad manifest digest {short(v)}")
    return v


def validate_job(job: object) -> str:
    """A job name becomes a directory: letters, digits, ``._-``, no leading dot, ≤128 chars."""
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ValueError(
            f"invalid job name {short(job)}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit")
    return job


# Memory-level steps (saved to the daemons' memory and peers, not written to storage) live in a
# namespace of their job's own: ``<root>/<job>/_memory/step-N`` (FORMAT.md). Its name can never be a
# job's (a leading ``_``), so a path's meaning is never ambiguous. Inside the daemon (its steps, held
# shards, peers) such a step belongs to the *job key* ``<job>/_memory``.
MEMORY_LEVEL_DIR = "_memory"


def memory_job(job: str) -> str:
    """The job key of ``job``'s memory-level steps."""
    return f"{validate_job(job)}/{MEMORY_LEVEL_DIR}"


def is_memory_job(key: str) -> bool:
    """Whether a job key names memory-level steps (``memory_job``)."""
    return key.endswith("/" + MEMORY_LEVEL_DIR)


def base_job(key: str) -> str:
    """The job a job key belongs to (itself for a plain job)."""
    return key[: -len(MEMORY_LEVEL_DIR) - 1] if is_memory_job(key) else key


def validate_job_key(key: object) -> str:
    """A job name, or the job key of its memory-level steps (``memory_job``); ValueError otherwise."""
    if isinstance(key, str) and is_memory_job(key):
        validate_job(base_job(key))
        return key
    return validate_job(key)


def validate_tensor_name(name: object) -> str:
    """Tensor names are key paths (``model/layer.0.weight``); refuse anything path-like that could escape."""
    if not isinstance(name, str) or not name or len(name) > MAX_TENSOR_NAME:
        raise ValueError(f"invalid tensor name {short(name)}: must be a non-empty string of at most "
                         f"{MAX_TENSOR_NAME} chars")
    if "\x00" in name or "\\" in name or name.startswith("/"):
        raise ValueError(f"invalid tensor name {short(name)}: NUL, backslash or leading '/' not allowed")
    # (A segment is empty, "." or ".." only where one of these shows: the split is made only then.)
    if ("/." in name or "//" in name or name[0] == "." or name[-1] == "/") \
            and any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"invalid tensor name {short(name)}: empty, '.' or '..' path segment")
    return name


_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}\Z")


def validate_file_name(name: object) -> str:
    """A file name read from disk (a Hugging Face index's shard names): one plain name inside its
    directory — letters, digits, ``._-``, no leading dot, no separator — so it can never escape it."""
    if not isinstance(name, str) or not _FILE_RE.match(name):
        raise ValueError(f"invalid file name {short(name)}: a plain name of 1-255 of [A-Za-z0-9._-], "
                         "starting with a letter or digit (no directories)")
    return name


_IS_DICT = partial(is_, dict)
_IS_LIST = partial(is_, list)
_CONTAINERS = frozenset((dict, list))


def check_tree_depth(tree: Any, limit: int = MAX_TREE_DEPTH) -> None:
    """Raise ValueError if a JSON state tree (dicts, lists and scalars, as ``json.loads`` makes them)
    nests deeper than ``limit``. Level by level, without recursion, each level's children gathered
    and its containers picked by C iterators (``compress``): the daemon checks every SAVE's tree on
    its event loop, ~65,000 nodes at 8,192 tensors, where a Python step per node took 44 ms."""
    level = [tree] if type(tree) in _CONTAINERS else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise ValueError(f"state tree nests deeper than {limit} levels")
        types = list(map(type, level))
        kids = list(chain(chain.from_iterable(map(dict.values, compress(level, map(_IS_DICT, types)))),
                          chain.from_iterable(compress(level, map(_IS_LIST, types)))))
        level = list(compress(kids, map(_CONTAINERS.__contains__, map(type, kids))))



# ---- names -----------------------------------------------------------------

def step_dir_name(step: int) -> str:
    return f"step-{check_step(step):012d}"


def parse_step_dir_name(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_rank_file_name(name: str) -> int | None:
    """The rank of a rank file's name (``rank-NNNNN.data`` or ``.json``), else None."""
    m = _RANK_FILE_RE.match(name)
    return int(m.group(1)) if m else None


def rank_data_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def rank_manifest_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def temp_name(path: str) -> str:
    """Where a file is written before its rename to ``path``: ``<path>.tmp.<pid>.<ns>``, unique per
    process and call, and recognised by ``is_step_file`` (retention removes what a killed writer left)."""
    return f"{path}.tmp.{os.getpid()}.{time.monotonic_ns()}"


# Every file ckptd writes in a step directory, and the temp names they are written under. Rank
# numbers have 5 digits and more up to MAX_RANKS (7 digits); temp suffixes ``.tmp.<pid>[.<ns>]``.
_STEP_FILE = (rf"(?:rank-[0-9]{{5,7}}\.(?:data|json)|{re.escape(INDEX_NAME)}|{re.escape(RANK_TABLE_NAME)}"
              rf"|{re.escape(TENSORS_NAME)}|{re.escape(HEAD_NAME)}|{re.escape(STAGED_NAME)})")
_TEMP_SUFFIX = r"\.tmp\.[0-9]+(?:\.[0-9]+)?"
_STEP_FILE_RE = re.compile(rf"^{_STEP_FILE}(?:{_TEMP_SUFFIX})?\Z")
_RANK_FILE_RE = re.compile(r"^rank-([0-9]{5,7})\.(?:data|json)\Z")
_STEP_TEMP_RE = re.compile(rf"^{_STEP_FILE}{_TEMP_SUFFIX}\Z")


def is_step_file(name: str) -> bool:
    """Whether ``name`` is a file ckptd writes in a step directory (a temp name included)."""
    return _STEP_FILE_RE.match(name) is not None


def is_step_temp(name: str) -> bool:
    """Whether ``name`` is the temp name of a step file (left behind if its writer was killed)."""
    return ".tmp." in name and _STEP_TEMP_RE.match(name) is not None    # (the substring: 10× a step's 65k names)


def job_dir(root: str, job: str) -> str:
    """``<root>/<job>``, or ``<root>/<job>/_memory`` for a memory-level job key."""
    return os.path.join(root, *validate_job_key(job).split("/"))


def step_dir(root: str, job: str, step: int) -> str:
    return os.path.join(job_dir(root, job), step_dir_name(step))

