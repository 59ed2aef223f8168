"""How a setting is declared: field metadata, value parsers and their TOML spellings.

A setting is a dataclass field made with :func:`setting`; its :class:`Spec` says how to
parse a raw TOML / environment / flag value (raising ``ValueError(reason)``; config.py adds
the key and where the value came from), how to spell a value back as a TOML literal
(``--check-config`` prints it, the docs show defaults with it), its doc and its flags.
:func:`walk` turns a dataclass of settings into :class:`Key` rows, one per dotted TOML key.
Nothing here knows ckptd's own settings: those are config.py's.
"""
from __future__ import annotations

import dataclasses
import difflib
import grp
import math
import os
import pwd
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptd.core.sizes import parse_size as parse_size  # the settings' size parser is core's (one for all)

T = TypeVar("T")
ENV_PREFIX = "CKPTD_"
DEFAULT_METRICS_PORT = 9464


# ---- declaring settings -------------------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    """A command-line spelling of a setting; ``unit`` scales an integer flag (``--chunk-mib``)."""
    name: str
    unit: int = 1
    hidden: bool = False
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


@dataclass(frozen=True)
class Spec:
    """What one dataclass field needs beyond its type and default to be a setting."""
    doc: str                                   # first sentence: flag help; all of it: the docs table
    parse: Callable[[Any], Any]                # raw TOML / env / flag value → typed value, or ValueError
    show: Callable[[Any], str]                 # typed value → TOML literal (--check-config, docs)
    flags: tuple[Flag, ...] = ()               # empty: one flag, --<field-name>
    repeat: bool = False                       # the flag is given once per list item
    gc: bool = False                           # `ckptd gc` takes the flag too
    choices: tuple[str, ...] = ()
    default_doc: str = ""                      # how a default computed at start is described
    required: bool = False


_SPEC, _TABLE = "ckptd.setting", "ckptd.table"


def setting(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
            parse: Callable[[Any], Any] | None = None, show: Callable[[Any], str] | None = None,
            choices: tuple[str, ...] = (), **spec: Any) -> Any:
    """A dataclass field that is a setting (``**spec``: the other :class:`Spec` fields).

    Without ``parse`` the value is one of ``choices``; without ``show`` it is spelled plainly."""
    meta = {_SPEC: Spec(parse=parse or choice(choices), show=show or show_plain, choices=choices, **spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def table(cls: type[T]) -> T:
    """A field holding a TOML table: its own dataclass of settings."""
    return field(default_factory=cls, metadata={_TABLE: cls})


def env_name(key: str) -> str:
    """``retention.keep_last`` → ``CKPTD_RETENTION_KEEP_LAST``."""
    return ENV_PREFIX + key.upper().replace(".", "_")


@dataclass(frozen=True)
class Key:
    """One setting as the loaders see it: its dotted TOML key, its spec and its dataclass field."""
    name: str
    spec: Spec
    field: dataclasses.Field[Any]

    @property
    def doc(self) -> str:
        return self.spec.doc

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def flags(self) -> tuple[Flag, ...]:
        return self.spec.flags or (Flag("--" + self.field.name.replace("_", "-")),)

    def default(self) -> Any:
        factory = self.field.default_factory
        return factory() if callable(factory) else self.field.default

    def shown_default(self, quote: str = "") -> str:
        """The default as help and docs show it: described if computed at start, else its TOML spelling."""
        if self.spec.required:
            return "(required)"
        return self.spec.default_doc or quote + self.spec.show(self.default()) + quote

    def help(self) -> str:
        """Flag help: the doc's first sentence as plain text, and the default."""
        first = re.split(r"(?<=\.)\s+(?=[A-Z])", self.doc, maxsplit=1)[0].rstrip(".").replace("`", "")
        if not re.match(r"[A-Z]{2}", first):         # "TEST ONLY", "SIGTERM" stay as written
            first = first[:1].lower() + first[1:]
        default = self.shown_default().strip('"')
        shown = ("no default" if self.spec.required else
                 f"default: {default}" if default not in ("", "[]") else "none by default")
        return f"{first} ({'repeatable; ' if self.spec.repeat else ''}{shown})"


def did_you_mean(key: str, keys: Iterable[str]) -> str:
    """``" (did you mean 'retention.keep_last'?)"`` for a misspelt key, or one outside its table."""
    def score(k: str) -> float:
        leaf, known_leaf = key.rpartition(".")[2], k.rpartition(".")[2]
        return max(difflib.SequenceMatcher(None, key, k).ratio(),
                   difflib.SequenceMatcher(None, leaf, known_leaf).ratio())
    scored = sorted(((score(k), k) for k in keys), reverse=True)
    best = [k for sc, k in scored if sc >= 0.75 and sc == scored[0][0]]
    return f" (did you mean {' or '.join(map(repr, sorted(best)[:2]))}?)" if best else ""


def walk(cls: type, prefix: str = "") -> Iterator[Key]:
    """The settings of a dataclass, its own fields first, then each table's (TOML needs tables last)."""
    fields = dataclasses.fields(cls)
    for f in fields:
        if _SPEC in f.metadata:
            yield Key(prefix + f.name, f.metadata[_SPEC], f)
    for f in fields:
        if _TABLE in f.metadata:
            yield from walk(f.metadata[_TABLE], prefix + f.name + ".")


def build(cls: type[T], flat: Mapping[str, Any], prefix: str = "") -> T:
    """An instance of ``cls`` from parsed values by dotted key (the inverse of :func:`walk`)."""
    kwargs = {f.name: build(f.metadata[_TABLE], flat, prefix + f.name + ".") if _TABLE in f.metadata
              else flat[prefix + f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**kwargs)


# ---- value parsers ------------------------------------------------------------------------------

_DURATION_UNITS = {"": 1, "s": 1, "ms": 0.001, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_duration(v: Any) -> float:
    """Seconds: a number, or a string like ``"90s"``, ``"10m"``, ``"6h"``, ``"2d"``."""
    if isinstance(v, bool):
        raise ValueError("must be a duration in seconds (number) or a string like \"10m\"")
    if isinstance(v, (int, float)):
        s = float(v)
    elif isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", v)
        if not m or m.group(2).lower() not in _DURATION_UNITS:
            raise ValueError(f"{v!r} is not a duration; write seconds or e.g. \"90s\", \"10m\", \"6h\"")
        s = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    else:
        raise ValueError("must be a duration in seconds (number) or a string like \"10m\"")
    if not math.isfinite(s) or s < 0:
        raise ValueError("must be a finite, non-negative duration")
    return s


def integer(lo: int, hi: int | None = None) -> Callable[[Any], int]:
    """An integer in [lo, hi]; digit strings (environment, flags) are accepted."""
    def parse(v: Any) -> int:
        if isinstance(v, str) and re.fullmatch(r"\s*-?\d+\s*", v):
            v = int(v)
        if type(v) is not int:
            raise ValueError(f"must be an integer, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"must be between {lo} and {hi}, got {v}" if hi is not None
                             else f"must be at least {lo}, got {v}")
        return v
    return parse


def choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    """One of ``options``, case-insensitively; the lower-case spelling is kept."""
    def parse(v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {v!r}")
        return v.lower()
    return parse


def path(v: Any) -> str:
    """An absolute path (``~`` expanded), so the daemon's working directory never matters."""
    if not isinstance(v, str) or not v.strip():
        raise ValueError("must be a non-empty path string")
    if "\x00" in v:
        raise ValueError("must not contain NUL")
    return os.path.abspath(os.path.expanduser(v))


def socket_path(v: Any) -> str:
    """A path that fits ``sockaddr_un`` (bind fails later, less clearly, otherwise)."""
    p = path(v)
    if len(os.fsencode(p)) > 107:
        raise ValueError(f"unix socket paths are limited to 107 bytes; {p!r} has {len(os.fsencode(p))}")
    return p


def mode(v: Any) -> int:
    """A permission mode: an integer (TOML ``0o660``) or an octal string (``"0660"``, ``"660"``)."""
    if isinstance(v, str):
        s = v.strip().lower().removeprefix("0o")
        if not re.fullmatch(r"[0-7]{1,4}", s):
            raise ValueError(f"{v!r} is not an octal mode like \"0660\"")
        v = int(s, 8)
    if type(v) is not int or not 0 <= v <= 0o777:
        raise ValueError(f"must be a permission mode between 0 and 0o777 (e.g. \"0660\"), got {v!r}")
    if v & 0o600 != 0o600:
        raise ValueError(f"{oct(v)} does not let the daemon's own user read and write its socket (needs 0o600)")
    return v


def listof(item: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
    """A TOML array, or a comma-separated string (environment, repeated flags joined)."""
    def parse(v: Any) -> list[Any]:
        if isinstance(v, str):
            v = [p.strip() for p in v.split(",") if p.strip()]
        if not isinstance(v, list):
            raise ValueError(f"must be a list, got {type(v).__name__}")
        return [item(x) for x in v]
    return parse


def resolve_user(v: Any) -> int:
    """A user name or a numeric uid (a uid needs no passwd entry: containers)."""
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if type(v) is int:
        if not 0 <= v < 2**32 - 1:
            raise ValueError(f"uid {v} out of range")
        return v
    if not isinstance(v, str) or not v:
        raise ValueError(f"users are names or numeric uids, got {v!r}")
    try:
        return pwd.getpwnam(v).pw_uid
    except KeyError:
        raise ValueError(f"no such user {v!r}") from None


def resolve_group(v: Any) -> int:
    """A group name or a numeric gid."""
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if type(v) is int:
        if not 0 <= v < 2**32 - 1:
            raise ValueError(f"gid {v} out of range")
        return v
    if not isinstance(v, str) or not v:
        raise ValueError(f"groups are names or numeric gids, got {v!r}")
    try:
        return grp.getgrnam(v).gr_gid
    except KeyError:
        raise ValueError(f"no such group {v!r}") from None


def optional_group(v: Any) -> int | None:
    """A group, or ``""``: leave the socket's group as created."""
    if v is None or v == "":
        return None
    return resolve_group(v)


def parse_metrics_address(v: Any) -> tuple[str, int] | None:
    """``""``/``"off"`` → None; ``"9464"`` → loopback:9464; ``"host:port"``, ``"[::1]:port"``."""
    if v is None or v is False:
        return None
    if type(v) is int:
        v = str(v)
    if not isinstance(v, str):
        raise ValueError(f"must be \"host:port\", a port, or \"\" (off), got {v!r}")
    s = v.strip()
    if s.lower() in ("", "off", "none", "false", "no"):
        return None
    m = re.fullmatch(r"(?:\[([0-9A-Fa-f:.]+)\]|([^:\[\]]*)):(\d+)", s) or re.fullmatch(r"()()(\d+)", s)
    if not m:
        raise ValueError(f"{v!r} is not \"host:port\" (e.g. \"127.0.0.1:{DEFAULT_METRICS_PORT}\") or a port")
    host = m.group(1) or m.group(2) or "127.0.0.1"
    port = int(m.group(3))
    if port > 65535:
        raise ValueError(f"port {port} out of range")
    return host, port


# ---- TOML spellings ---------------------------------------------------------------------------

def show_plain(v: Any) -> str:
    """A TOML literal for a plain value; None (unset) is the empty string."""
    if v is None:
        return '""'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple, frozenset)):
        return "[" + ", ".join(show_plain(x) for x in v) + "]"
    return repr(v)


def show_size(n: int) -> str:
    """``"4MiB"`` when a whole number of a binary unit, else bytes."""
    for unit, mult in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % mult == 0:
            return f'"{n // mult}{unit}"'
    return str(n)


def size_note(n: int) -> str:
    """A person's reading of a size ``show_size`` can spell exactly only in small units (a share of
    RAM: ``"12342042KiB"``): ``"11.8 GiB"``; ``""`` when the literal reads well as it is."""
    if n < 1024**3 or n % 1024**2 == 0:
        return ""
    return f"{n / 1024**3:.1f} GiB" if n < 1024**4 else f"{n / 1024**4:.1f} TiB"


def show_duration(s: float) -> str:
    """``"10m"``, ``"24h"``: the largest unit giving a whole number of at least 2; else seconds."""
    for unit, mult in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= 2 * mult and s % mult == 0:
            return f'"{int(s // mult)}{unit}"'
    return repr(float(s))


def show_mode(v: int) -> str:
    return f'"{v:04o}"'


def show_address(v: tuple[str, int] | None) -> str:
    if v is None:
        return '""'
    host, port = v
    return f'"[{host}]:{port}"' if ":" in host else f'"{host}:{port}"'


def peer_address(v: Any) -> str:
    """A peer daemon's ``"host:port"`` (``"[v6]:port"``), kept as written: it names the node in ``peers``."""
    if not isinstance(v, str):
        raise ValueError(f"must be \"host:port\", got {v!r}")
    s = v.strip()
    m = re.fullmatch(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(\d+)", s)
    if not m or not 0 < int(m.group(1)) <= 65535:
        raise ValueError(f"{v!r} is not \"host:port\" (e.g. \"10.0.0.7:7465\")")
    return s


def optional_peer_address(v: Any) -> str | None:
    """A peer address, or ``""``: off."""
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "off")):
        return None
    return peer_address(v)


def optional_path(v: Any) -> str | None:
    """A path, or ``""``: unset."""
    if v is None or v == "":
        return None
    return path(v)
