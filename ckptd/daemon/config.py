"""Daemon configuration: one TOML file, ``CKPTD_*`` environment overrides, CLI flags over both.

Precedence, lowest first: built-in defaults < the TOML file < environment < command line.
The file is ``/etc/ckptd/ckptd.toml`` unless ``--config`` (or ``$CKPTD_CONFIG``) names
another; the default file may be absent, a named one may not. Every key is validated when
the daemon starts; an unknown key or a bad value stops it with the key, where it came
from and why (``ConfigError``). docs/operations.md has the reference; this module's
``KEYS`` table is its one implementation.

The file is flat, with two tables::

    root = "/var/lib/ckptd"
    socket = "/run/ckptd/ckptd.sock"
    allowed_groups = ["ckptd"]
    [retention]
    keep_last = 3
    [metrics]
    address = "127.0.0.1:9464"

Environment names are ``CKPTD_`` + the dotted key upper-cased with ``.`` → ``_``
(``CKPTD_RETENTION_KEEP_LAST``); lists are comma-separated there.
"""
from __future__ import annotations

import grp
import math
import os
import pwd
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ckptd.core.codec import CODECS, DEFAULT_CHUNK_BYTES
from ckptd.core.protocol import DEFAULT_SOCKET
from ckptd.daemon.retention import RetentionPolicy
from ckptd.daemon.writer import WriteSettings

DEFAULT_CONFIG_PATH = "/etc/ckptd/ckptd.toml"
ENV_PREFIX = "CKPTD_"
ENV_CONFIG = "CKPTD_CONFIG"
MAX_CONFIG_BYTES = 1024 * 1024
LOG_FORMATS = ("json", "plain")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_METRICS_PORT = 9464


class ConfigError(ValueError):
    """A configuration that must not start a daemon; the message names the key and the source."""


# ---- value parsers: raw TOML / env / CLI value → normalized value, or ValueError(reason) --------

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
               "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_DURATION_UNITS = {"": 1, "s": 1, "ms": 0.001, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_size(v: Any) -> int:
    """Bytes: an integer, or a string like ``"64GiB"``, ``"512 MiB"``, ``"4M"`` (SI: 1000, IEC: 1024)."""
    if isinstance(v, bool):
        raise ValueError("must be a size in bytes (integer) or a string like \"64GiB\"")
    if isinstance(v, int):
        n = v
    elif isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", v)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"{v!r} is not a size; write bytes or e.g. \"64GiB\", \"512MiB\"")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    else:
        raise ValueError("must be a size in bytes (integer) or a string like \"64GiB\"")
    if n < 0:
        raise ValueError("must not be negative")
    return n


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


def _int(lo: int, hi: int | None = None) -> Callable[[Any], int]:
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


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if not isinstance(v, str) or v.lower() not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {v!r}")
        return v.lower()
    return parse


def _path(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError("must be a non-empty path string")
    if "\x00" in v:
        raise ValueError("must not contain NUL")
    return os.path.abspath(os.path.expanduser(v))


def _socket_path(v: Any) -> str:
    p = _path(v)
    if len(os.fsencode(p)) > 107:
        raise ValueError(f"unix socket paths are limited to 107 bytes; {p!r} has {len(os.fsencode(p))}")
    return p


def _mode(v: Any) -> int:
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


def _list(item: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
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


def _socket_group(v: Any) -> int | None:
    if v is None or v == "":
        return None
    return resolve_group(v)


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def _default_slot_memory_limit() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


@dataclass
class DaemonConfig:
    root: str
    socket_path: str
    socket_mode: int = 0o660
    threads: int = field(default_factory=_default_threads)
    write: WriteSettings = field(default_factory=WriteSettings)
    step_timeout: float = 600.0
    slot_memory_limit: int = field(default_factory=_default_slot_memory_limit)
    allowed_uids: frozenset[int] | None = None   # None: any peer that can open the socket
    allowed_gids: frozenset[int] | None = None
    drain_grace: float = 60.0
    socket_group: int | None = None              # chgrp of a socket the daemon binds itself
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    metrics_address: tuple[str, int] | None = None  # (host, port) of /metrics; None: off


@dataclass(frozen=True)
class Key:
    name: str                           # dotted: "retention.keep_last"
    parse: Callable[[Any], Any]
    default: Any                        # a value or a zero-argument callable
    doc: str


KEYS: dict[str, Key] = {k.name: k for k in [
    Key("root", _path, None, "directory checkpoints are written under (required)"),
    Key("socket", _socket_path, DEFAULT_SOCKET, "unix socket path when the daemon binds its own socket"),
    Key("socket_mode", _mode, 0o660, "permission bits of a socket the daemon binds itself"),
    Key("socket_group", _socket_group, None, "group owning a socket the daemon binds itself"),
    Key("allowed_users", _list(resolve_user), [], "users (names or uids) allowed to connect"),
    Key("allowed_groups", _list(resolve_group), [], "groups (names or gids) whose members may connect"),
    Key("slot_memory_limit", parse_size, _default_slot_memory_limit, "total shared-memory slot budget"),
    Key("codec", _choice(CODECS), "bplane", "chunk codec"),
    Key("level", _int(1, 22), 1, "zstd level"),
    Key("chunk_size", parse_size, DEFAULT_CHUNK_BYTES, "bytes per independently compressed chunk"),
    Key("threads", _int(1, 4096), _default_threads, "compression threads"),
    Key("step_timeout", parse_duration, 600.0, "how long a step may wait for all its ranks"),
    Key("drain_grace", parse_duration, 60.0, "on SIGTERM, how long in-flight saves get to commit"),
    Key("log_format", _choice(LOG_FORMATS), "json", "log line format"),
    Key("log_level", _choice(LOG_LEVELS), "info", "log level"),
    Key("retention.keep_last", _int(0), 0, "keep the newest N committed steps per job (0: keep all)"),
    Key("retention.keep_every", _int(0), 0, "also keep every step divisible by K (0: off)"),
    Key("retention.abandoned_after", parse_duration, 86400.0,
        "remove uncommitted step directories untouched for this long"),
    Key("metrics.address", parse_metrics_address, None, "Prometheus endpoint host:port (off by default)"),
]}


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper().replace(".", "_")


ENV_KEYS = {env_name(k): k for k in KEYS}
# CKPTD_* names that are not daemon settings but are legitimately set around it.
ENV_OTHER = {ENV_CONFIG}


@dataclass
class Settings:
    """The validated, effective configuration, plus where each value came from."""
    values: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)
    config_path: str | None = None
    warnings: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def to_daemon_config(self, **extra: Any) -> DaemonConfig:
        """The server's DaemonConfig for these settings (``extra``: test-only knobs)."""
        v = self.values
        write = WriteSettings(codec=v["codec"], level=v["level"], chunk_bytes=v["chunk_size"],
                              debug_write_delay=extra.pop("debug_write_delay", 0.0))
        return DaemonConfig(
            root=v["root"], socket_path=v["socket"], socket_mode=v["socket_mode"], threads=v["threads"],
            write=write, step_timeout=v["step_timeout"], slot_memory_limit=v["slot_memory_limit"],
            allowed_uids=frozenset(v["allowed_users"]) if v["allowed_users"] else None,
            allowed_gids=frozenset(v["allowed_groups"]) if v["allowed_groups"] else None,
            drain_grace=v["drain_grace"], socket_group=v["socket_group"],
            retention=RetentionPolicy(keep_last=v["retention.keep_last"], keep_every=v["retention.keep_every"],
                                      abandoned_after=v["retention.abandoned_after"]),
            metrics_address=v["metrics.address"], **extra)

    def render(self) -> str:
        """The effective settings as TOML, each with its source (``serve --check-config``)."""
        lines = [f"# effective ckptd settings; config file: {self.config_path or '(none)'}"]
        section = ""
        for k in KEYS:
            table, _, name = k.rpartition(".")
            if table != section:
                lines += ["", f"[{table}]"]
                section = table
            v = self.values[k]
            if k == "socket_mode":
                shown = f'"{v:04o}"'
            elif k == "metrics.address":
                shown = '""' if v is None else f'"{_format_address(v)}"'
            elif v is None:
                shown = '""'
            elif isinstance(v, str):
                shown = '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                shown = repr(v)
            lines.append(f"{name} = {shown}    # {self.sources.get(k, 'default')}")
        return "\n".join(lines)


def _format_address(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _flatten_toml(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and any(key.startswith(name + ".") for key in KEYS):
            out.update(_flatten_toml(v, name + "."))
        else:
            out[name] = v
    return out


def read_config_file(path: str) -> dict[str, Any]:
    """Flattened keys of one TOML file; raises ConfigError for I/O, syntax and unknown keys."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config {path}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config {path}: not valid TOML: {e}") from None
    flat = _flatten_toml(doc)
    unknown = sorted(k for k in flat if k not in KEYS)
    if unknown:
        raise ConfigError(f"config {path}: unknown key {unknown[0]!r}"
                          + (f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else "")
                          + f"; known keys: {', '.join(KEYS)}")
    return flat


def load_settings(config_path: str | None = None, env: Mapping[str, str] | None = None,
                  cli: Mapping[str, Any] | None = None, *, require_root: bool = True) -> Settings:
    """Merge defaults < file < environment < CLI, validating each layer's values as they come in.

    ``config_path``: an explicit file (``--config``); must exist. None: ``$CKPTD_CONFIG`` (must
    exist) or /etc/ckptd/ckptd.toml (used if present). ``cli``: dotted key → raw value for
    every flag the user actually gave.
    """
    env = os.environ if env is None else env
    cli = dict(cli or {})
    explicit = config_path or env.get(ENV_CONFIG) or None
    path = explicit or DEFAULT_CONFIG_PATH
    settings = Settings({}, {})
    layers: list[tuple[str, dict[str, Any]]] = []
    if explicit or os.path.exists(path):
        layers.append((f"config {path}", read_config_file(path)))
        settings.config_path = path
    env_layer: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name in ENV_KEYS:
            env_layer[ENV_KEYS[name]] = raw
        elif name not in ENV_OTHER:
            settings.warnings.append(f"ignoring unknown environment variable {name}")
    layers.append(("environment", env_layer))
    unknown = sorted(k for k in cli if k not in KEYS)
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]!r}")
    layers.append(("command line", cli))

    for key, spec in KEYS.items():
        settings.values[key] = spec.default() if callable(spec.default) else spec.default
        settings.sources[key] = "default"
    for source, layer in layers:
        for key, raw in layer.items():
            where = f"{env_name(key)}" if source == "environment" else key
            try:
                settings.values[key] = KEYS[key].parse(raw)
            except ValueError as e:
                raise ConfigError(f"{source}: {where}: {e}") from None
            settings.sources[key] = source
    _check_consistency(settings, require_root)
    return settings


def _check_consistency(s: Settings, require_root: bool) -> None:
    v = s.values
    if require_root and not v["root"]:
        raise ConfigError("root is not set: give --root, CKPTD_ROOT or root = \"...\" in the config file")
    if v["slot_memory_limit"] < 1024 * 1024:
        raise ConfigError(f"{s.sources['slot_memory_limit']}: slot_memory_limit: "
                          f"{v['slot_memory_limit']} bytes is too small (at least 1MiB)")
    if not 64 * 1024 <= v["chunk_size"] <= 1024**3:
        raise ConfigError(f"{s.sources['chunk_size']}: chunk_size: must be between 64KiB and 1GiB, "
                          f"got {v['chunk_size']}")
    if v["step_timeout"] <= 0:
        raise ConfigError(f"{s.sources['step_timeout']}: step_timeout: must be positive")
    if v["retention.abandoned_after"] < v["step_timeout"]:
        raise ConfigError(
            f"{s.sources['retention.abandoned_after']}: retention.abandoned_after: "
            f"{v['retention.abandoned_after']:g}s is shorter than step_timeout ({v['step_timeout']:g}s); "
            "a slow step still being written could be removed")
    if v["socket_mode"] & 0o007 and not (v["allowed_users"] or v["allowed_groups"]):
        raise ConfigError(
            f"{s.sources['socket_mode']}: socket_mode: {v['socket_mode']:04o} lets every local user connect; "
            "drop the 'other' bits or restrict peers with allowed_users / allowed_groups")
