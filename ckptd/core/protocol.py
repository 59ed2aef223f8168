"""The wire protocol between ckptd_client and the daemon: framing, messages, version.

The one place both sides import: the frames, the typed requests and their checks. The wire
format (framing, ops, replies, error codes: :class:`~ckptd.core.errors.ErrorCode`, events) is FORMAT.md's.
"""
from __future__ import annotations

import errno
import grp
import os
import socket
import stat
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from typing import Any, ClassVar, get_args

from .commit_wire import decode_body as decode_body  # framing's, with a COMMIT decoded typed
from .commit_wire import encode as encode  # framing's, with a COMMIT encoded by msgspec
from .errors import ErrorCode, ProtocolError
from .framing import FRAME_TIMEOUT_S as FRAME_TIMEOUT_S  # re-exported: protocol.X is how callers name the frame layer
from .framing import HEADER as HEADER
from .framing import MAGIC as MAGIC
from .framing import MAX_FDS_PER_FRAME as MAX_FDS_PER_FRAME
from .framing import MAX_FRAME_BYTES as MAX_FRAME_BYTES
from .framing import PROTOCOL_VERSION as PROTOCOL_VERSION
from .framing import FrameReceiver as FrameReceiver
from .framing import parse_header as parse_header
from .framing import recv_exact_async as recv_exact_async
from .framing import send_frame as send_frame
from .framing import send_frame_async as send_frame_async
from .names import memory_job, short, validate_job


class Op(str, Enum):
    """Client → daemon requests."""
    HELLO = "hello"
    RESIZE = "resize"
    SAVE = "save"
    COMMIT = "commit"
    ABORT = "abort"
    REPORT = "report"
    INFO = "info"
    STATUS = "status"
    STAGE = "stage"            # object-storage tier: fetch a step from the bucket into the local root
    FLUSH = "flush"            # object-storage tier: get a committed step into the bucket now
    MEMORY_FETCH = "memory_fetch"
    SAVE_PART = "save_part"    # the next part of a save streamed through slots smaller than its shard
    SAVE_FILLED = "save_filled"  # how far a filling save's slot is filled (no reply is waited for)
    RECLAIM = "reclaim"        # every slot of this session is kept by the memory tier: give one back


class EventOp(str, Enum):
    """Daemon → client events about a save; they carry the step and come whenever they happen."""
    SLOT_FREE = "slot_free"
    SLOT_HELD = "slot_held"
    DURABLE = "durable"
    COMMITTED = "committed"
    FAILED = "failed"


class CommitMode(str, Enum):
    """Who decides a step is complete: this daemon counting ranks, or rank 0 relaying via c10d."""
    LOCAL = "local"
    RELAY = "relay"


COMMIT_MODES = tuple(m.value for m in CommitMode)


class SaveLevel(str, Enum):
    """``storage`` (encoded and written) or ``memory`` (held by daemons and peers only: FORMAT.md)."""
    STORAGE = "storage"
    MEMORY = "memory"


SAVE_LEVELS = tuple(m.value for m in SaveLevel)


def level_job(job: str, level: object) -> str:
    """The job key of ``job`` at ``level`` (``names.memory_job`` for memory); ValueError if bad."""
    if level not in SAVE_LEVELS:
        raise ValueError(f"level must be one of {', '.join(SAVE_LEVELS)}, not {short(level)}")
    return memory_job(job) if level == SaveLevel.MEMORY.value else validate_job(job)
_JSON = (dict, list, str, int, float, bool, type(None))


# ---- typed requests ------------------------------------------------------------------
# Each request is a frozen dataclass; ``from_wire`` checks field presence and JSON types (a
# mismatch is a ProtocolError: the peer is broken and is disconnected). Semantic checks that
# need daemon state (slot sizes, step lifecycle) are the daemon's and keep the connection.

@dataclass(frozen=True)
class Hello:
    job: str
    rank: int
    world_size: int
    pid: int
    slot_bytes: int
    num_slots: int
    local_ranks: Any = 1        # the job's ranks on this node: a shrunk grant leaves room for the others'
    op: ClassVar[Op] = Op.HELLO


@dataclass(frozen=True)
class Resize:
    slot_bytes: int
    num_slots: Any = 2          # any JSON value: a bad count is the daemon's to refuse, keeping the connection
    op: ClassVar[Op] = Op.RESIZE


@dataclass(frozen=True)
class Save:
    step: int
    slot: int
    tensors: list[Any]          # [[name, dtype, shape, offset, nbytes], ...]: see schema.parse_layout
    tree: Any                   # the state tree (core.tree)
    commit: str
    stream: Any = None          # [total bytes, part bytes]: the shard comes in parts (save_part), this slot part 0
    level: str = "storage"      # SaveLevel
    filling: bool = False       # the slot is still being filled: its bytes come as save_filled says
    op: ClassVar[Op] = Op.SAVE


@dataclass(frozen=True)
class SavePart:
    step: int
    slot: int
    part: int                   # 1, 2, ...: the shard's bytes [part × part bytes, …) in this slot
    op: ClassVar[Op] = Op.SAVE_PART


@dataclass(frozen=True)
class SaveFilled:
    step: int
    upto: int                   # the slot's bytes [0, upto) are in place (it only grows)
    op: ClassVar[Op] = Op.SAVE_FILLED


@dataclass(frozen=True)
class Commit:
    step: int
    digests: dict[str, Any]     # rank (as a string: JSON keys) → manifest digest
    records: Any = None         # optional: every rank's record (core.rank_record), in rank order
    level: str = "storage"      # the step's SaveLevel
    check: Any = None           # optional: the ranks whose manifests are read back (one per node); None: all
    op: ClassVar[Op] = Op.COMMIT


@dataclass(frozen=True)
class Abort:
    step: int
    reason: str
    level: str = "storage"
    op: ClassVar[Op] = Op.ABORT


@dataclass(frozen=True)
class Report:
    step: int
    stall_s: float
    fence_s: float
    op: ClassVar[Op] = Op.REPORT


@dataclass(frozen=True)
class Info:
    op: ClassVar[Op] = Op.INFO


@dataclass(frozen=True)
class Status:
    op: ClassVar[Op] = Op.STATUS
    group: bool = False     # parity mode: also ask the group's members whether each step is protected


@dataclass(frozen=True)
class Stage:            # no hello needed; reply: step (None: no committed step anywhere), source, fetched_bytes
    job: str
    step: Any           # int, or None: the newest committed step, local or in the bucket
    reader: Any = None  # [rank, world_size] restoring: own data file if the saved world matches; None: all
    op: ClassVar[Op] = Op.STAGE


@dataclass(frozen=True)
class Flush:            # wait up to timeout s for step (None: newest local) to be in the bucket; reply: uploaded
    job: str
    step: Any
    timeout: float
    op: ClassVar[Op] = Op.FLUSH


@dataclass(frozen=True)
class MemoryFetch:      # no hello; reply: the held shard's layout (core.held.HeldMeta) + its memfd, pinned till close
    job: str
    rank: int
    world_size: int
    step: Any = None            # None: the newest committed step
    level: str = "storage"      # "memory": a memory-level step's shard
    verify: bool = False        # check the held copy first (the one served failed its checksums): a peer's if bad
    op: ClassVar[Op] = Op.MEMORY_FETCH


@dataclass(frozen=True)
class Reclaim:          # reply: freed (a slot_free event follows when true)
    op: ClassVar[Op] = Op.RECLAIM


Request = (Hello | Resize | Save | SavePart | SaveFilled | Commit | Abort | Report | Info | Status | Stage | Flush
           | MemoryFetch | Reclaim)
REQUEST_TYPES: dict[str, type] = {t.op.value: t for t in get_args(Request)}
# Field → JSON type of each request's required fields (also what the fuzz tests draw from).
_WIRE_TYPES: dict[str, Any] = {"str": str, "int": int, "float": (int, float), "bool": bool, "Any": _JSON,
                               "list[Any]": list, "dict[str, Any]": dict}
REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    op: {f.name: _WIRE_TYPES[str(f.type)] for f in fields(t) if f.default is MISSING}
    for op, t in REQUEST_TYPES.items()}


def to_wire(msg: Request, req: int) -> dict[str, Any]:
    """The JSON object of a request; ``req`` numbers it so the reply can be matched."""
    body = {f.name: getattr(msg, f.name) for f in fields(msg)}
    return {"op": msg.op.value, "req": req, **body}


def parse_request(msg: dict[str, Any]) -> tuple[int, Request]:
    """(req, typed request) of a decoded frame; ProtocolError naming the op and field otherwise."""
    op = msg["op"]
    typ = REQUEST_TYPES.get(op)
    if typ is None:
        raise ProtocolError(f"unknown request op {short(op)}")
    req = msg.get("req")
    if type(req) is not int:
        raise ProtocolError(f"{op}: missing integer 'req'")
    values: dict[str, Any] = {}
    for f in fields(typ):
        if f.name not in msg:
            if f.default is MISSING:
                raise ProtocolError(f"{op}: field {f.name!r} missing or not {f.type}")
            continue
        value = msg[f.name]
        want = _WIRE_TYPES[str(f.type)]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ProtocolError(f"{op}: field {f.name!r} missing or not {f.type}")
        values[f.name] = value
    return req, typ(**values)


# ---- events (daemon → client) ----------------------------------------------------

def event(op: EventOp, **body: Any) -> dict[str, Any]:
    """An event frame's JSON object."""
    return {"op": op.value, **body}


def ok(req: int, **body: Any) -> dict[str, Any]:
    return {"op": "ok", "req": req, **body}


def error(req: int, reason: str, *, fatal: bool = False, code: ErrorCode = ErrorCode.REFUSED) -> dict[str, Any]:
    return {"op": "error", "req": req, "code": code.value, "reason": reason, **({"fatal": True} if fatal else {})}


DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"


def default_socket_path() -> str:
    """``$CKPTD_SOCKET`` if set, else /run/ckptd/ckptd.sock (the systemd unit's RuntimeDirectory)."""
    return os.environ.get("CKPTD_SOCKET") or DEFAULT_SOCKET


def connect(path: str, timeout: float | None = 10.0) -> socket.socket:
    """Connect to a daemon's socket; the error says which path failed and how to start one."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        if len(os.fsencode(path)) > 107:        # (AF_UNIX's limit: no daemon can listen there either)
            raise ConnectionError(f"the socket path {path} is {len(os.fsencode(path))} bytes, over AF_UNIX's 107: "
                                  "give the daemon and socket= a shorter path (e.g. under /tmp or /run)") from None
        if e.errno in (errno.EACCES, errno.EPERM):      # a daemon may well be there: starting one is no fix
            raise ConnectionError(not_permitted(path, e)) from None
        raise ConnectionError(
            f"cannot reach the ckptd daemon at {path}: {e.strerror or e}. Start one with "
            f"`ckptd serve --root DIR --socket {path}` (or `systemctl start ckptd.socket`), "
            f"or point CKPTD_SOCKET / socket= at a running daemon") from None
    sock.settimeout(None)
    return sock


def not_permitted(path: str, e: OSError) -> str:
    """Why this user may not connect to the socket at ``path`` (EACCES/EPERM), and what to do: the
    socket's owner, group and mode when it can be seen, else the directory on the way that is closed."""
    who = f"uid {os.geteuid()}"
    head = f"cannot connect to the ckptd daemon's socket {path}: {e.strerror or e}"
    try:
        st = os.stat(path)
    except OSError:
        return (f"{head}: {who} may not reach it (a directory on its path is closed to this user); the daemon's "
                "operator decides who may: its socket_group / socket_mode, allowed_users / allowed_groups")
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return (f"{head}: the socket exists (mode {stat.S_IMODE(st.st_mode):04o}, group {group}) but {who} may not "
            f"connect to it. Join its group (`usermod -aG {group} USER`, then log in again) or ask the daemon's "
            "operator to allow you (socket_group / socket_mode, and its allowed_users / allowed_groups)")


def request_once(path: str, msg: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request on a fresh connection (CLI tools); raises RuntimeError on an error reply."""
    sock = connect(path, timeout)
    try:
        sock.settimeout(timeout)
        send_frame(sock, {"req": 1, **msg})
        reply = FrameReceiver(sock).read()
    finally:
        sock.close()
    if reply is None:
        raise ConnectionError(f"daemon at {path} closed the connection")
    if reply.get("op") != "ok":
        raise RuntimeError(reply.get("reason", "daemon refused the request"))
    return reply
