"""Daemon settings: one typed definition per setting, and everything else derived from it.

Each setting is one field of :class:`Settings` (a nested dataclass per TOML table); the
field's :class:`Spec` metadata holds its doc, parser, TOML spelling and command-line flags.
From that one definition come the TOML keys (``retention.keep_last``), the ``CKPTD_*``
environment names, the ``ckptd serve`` / ``ckptd gc`` flags with their help
(``add_setting_flags`` in cli.py), ``serve --check-config`` (:meth:`Effective.render`) and the settings
table of docs/operations.md (:func:`render_settings_table`; rewrite it with
``python -m ckptd.daemon.settings.config --write-docs``). Test-only knobs are :class:`DebugSettings`:
flags only, never read from the file or the environment.

Precedence, lowest first: defaults < the TOML file < environment < command line. The file
is ``/etc/ckptd/ckptd.toml`` unless ``--config`` (or ``$CKPTD_CONFIG``) names another; the
default file may be absent, a named one may not. Every value is validated at start; an
unknown key or a bad value stops the daemon with the key, where it came from and why
(``ConfigError``). Environment names are ``CKPTD_`` + the dotted key upper-cased with
``.`` → ``_`` (``CKPTD_RETENTION_KEEP_LAST``); lists are comma-separated there.
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

from ckptd.core.codec import CODECS
from ckptd.core.protocol import DEFAULT_SOCKET, FRAME_TIMEOUT_S
from ckptd.daemon.settings.metrics import MetricsSettings
from ckptd.daemon.settings.peers import MemorySettings, PeerSettings, check_peers
from ckptd.daemon.settings.retention import RetentionPolicy, RetentionSettings
from ckptd.daemon.settings.s3 import S3Settings
from ckptd.daemon.settings.spec import (
    ENV_PREFIX,
    Flag,
    Key,
    build,
    did_you_mean,
    env_name,
    integer,
    listof,
    mode,
    optional_group,
    parse_duration,
    parse_size,
    path,
    resolve_group,
    resolve_user,
    setting,
    show_duration,
    show_mode,
    show_size,
    size_note,
    socket_path,
    table,
    walk,
)
from ckptd.daemon.settings.write import CODEC_MODES, DIRECT_IO, WriteSettings

DEFAULT_CONFIG_PATH = "/etc/ckptd/ckptd.toml"
ENV_CONFIG = "CKPTD_CONFIG"
ENV_OTHER = {ENV_CONFIG}    # CKPTD_* names set around the daemon that are not settings
MAX_CONFIG_BYTES = 1024 * 1024
LOG_FORMATS = ("json", "plain")
LOG_LEVELS = ("debug", "info", "warning", "error")
MiB = 1024 * 1024
DOCS_PATH = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "operations.md"))
DOC_BEGIN, DOC_END = "<!-- settings-table:begin -->", "<!-- settings-table:end -->"


class ConfigError(ValueError):
    """A configuration that must not start a daemon; the message names the key and the source."""


# ---- the definition ---------------------------------------------------------------------------

def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def _default_slot_memory_limit() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


# Defaults of settings consumed by one library class are that class's own defaults.
_WRITE = WriteSettings()


@dataclass(frozen=True)
class Settings:
    """Every production setting of ``ckptd serve``, in TOML order (tables last)."""
    root: str | None = setting(
        None, parse=path, required=True,
        doc="Directory checkpoints are written under: `<root>/<job>/step-<N>/`. "
            "Every node of a multi-node job must see the same root.")
    socket: str = setting(
        DEFAULT_SOCKET, parse=socket_path,
        doc="Socket the daemon binds when not socket-activated (≤ 107 bytes).")
    socket_mode: int = setting(
        0o660, parse=mode, show=show_mode,
        doc="Permission bits of a socket the daemon binds itself (octal string or `0o660`). Must include "
            "`0600`. Any \"other\" bit is refused unless `allowed_users`/`allowed_groups` restrict peers.")
    socket_group: int | None = setting(
        None, parse=optional_group, default_doc="the daemon's group",
        doc="Group (name or gid) owning a socket the daemon binds itself.")
    allowed_users: list[int] = setting(
        factory=list, parse=listof(resolve_user), repeat=True, flags=(Flag("--allow-user"),),
        doc="Users (names or uids) allowed to connect.")
    allowed_groups: list[int] = setting(
        factory=list, parse=listof(resolve_group), repeat=True, flags=(Flag("--allow-group"),),
        doc="Groups (names or gids) whose members may connect: the peer's primary or any supplementary "
            "group. Both lists empty: anyone who can open the socket. root and the daemon's own user are "
            "always allowed. Unknown names fail at start.")
    slot_memory_limit: int = setting(
        factory=_default_slot_memory_limit, parse=parse_size, show=show_size, default_doc="half of RAM",
        flags=(Flag("--slot-memory-limit"), Flag("--slot-memory-limit-mib", unit=MiB, hidden=True)),
        doc="Total shared memory for all connected ranks' slots, e.g. `\"64GiB\"` (each rank gets 2 slots the "
            "size of its state by default). A rank asking for more than is left gets smaller slots (down to 1 MiB "
            "each; below that an error at `hello`/first save) and its saves stream through them: they still "
            "commit, the trainer stalls for the whole copy, and the step is not kept in the memory tier. ≥ 1 MiB.")
    codec: str = setting(
        _WRITE.codec, choices=CODECS,
        doc="Chunk codec: `bplane` (float-aware byte planes + zstd; non-float tensors use zstd), `zstd`, "
            "or `none`.")
    codec_mode: str = setting(
        "adaptive" if _WRITE.adaptive else "always", choices=CODEC_MODES,
        doc="`adaptive`: codec threads encode only while the disk sets the writer's pace (it waits for the "
            "disk over half the time); else chunks are written raw: a slow disk (network storage, a busy device) "
            "gets every chunk encoded, one that keeps up with the writer gets them raw (compression would only "
            "take the writer's CPU). `always`: every chunk with `codec`.")
    level: int = setting(_WRITE.level, parse=integer(1, 22), doc="zstd level, 1–22.")
    direct_io: str = setting(_WRITE.direct_io, choices=DIRECT_IO, doc="Raw chunks around the page cache (`O_DIRECT`):"
                             " `auto` keeps to the way measured faster (docs/operations.md), or `on`, `off`.")
    chunk_size: int = setting(
        _WRITE.chunk_bytes, parse=parse_size, show=show_size, flags=(Flag("--chunk-mib", unit=MiB, metavar="MIB"),),
        doc="Bytes per independently compressed and checksummed chunk, 64 KiB–1 GiB (the flag counts MiB).")
    threads: int = setting(
        factory=_default_threads, parse=integer(1, 4096), default_doc="CPUs available",
        doc="Compression threads.")
    step_timeout: float = setting(
        600.0, parse=parse_duration, show=show_duration,
        doc="A step not durable on every rank this long after its first save is abandoned.")
    drain_grace: float = setting(
        60.0, parse=parse_duration, show=show_duration,
        doc="On SIGTERM, how long saves in flight get to commit. Keep it below the unit's `TimeoutStopSec`.")
    log_format: str = setting(
        "json", choices=LOG_FORMATS, doc="Log line format: `json` (one object a line) or `plain`.")
    log_level: str = setting(
        "info", choices=LOG_LEVELS, doc="Log level: `debug`, `info`, `warning`, `error`.")
    retention: RetentionSettings = table(RetentionSettings)
    metrics: MetricsSettings = table(MetricsSettings)
    s3: S3Settings = table(S3Settings)
    memory: MemorySettings = table(MemorySettings)
    peers: PeerSettings = table(PeerSettings)

    def to_daemon_config(self, debug: DebugSettings | None = None) -> DaemonConfig:
        """What the daemon reads: these values in the shapes its parts take."""
        if self.root is None:
            raise ConfigError(_NO_ROOT)
        debug = debug or DebugSettings()
        return DaemonConfig(
            root=self.root, socket_path=self.socket, socket_mode=self.socket_mode, socket_group=self.socket_group,
            threads=self.threads, step_timeout=self.step_timeout, slot_memory_limit=self.slot_memory_limit,
            write=WriteSettings(codec=self.codec, level=self.level, chunk_bytes=self.chunk_size,
                                adaptive=self.codec_mode == "adaptive", direct_io=self.direct_io,
                                debug_write_delay=debug.write_delay, debug_commit_delay=debug.commit_delay),
            allowed_uids=frozenset(self.allowed_users) or None, allowed_gids=frozenset(self.allowed_groups) or None,
            drain_grace=self.drain_grace, retention=self.retention.policy(), metrics_address=self.metrics.address,
            s3=self.s3, debug=debug,
            memory=self.memory, peers=self.peers)


@dataclass(frozen=True)
class DebugSettings:
    """Test-only knobs: flags only, never the file or the environment, so no deployed config sets them;
    hidden from ``serve --help`` (docs/operations.md lists them) so no user mistakes them for tuning."""
    write_delay: float = setting(
        0.0, parse=parse_duration, flags=(Flag("--debug-write-delay", metavar="SECONDS", hidden=True),),
        doc="TEST ONLY: sleep this many seconds before writing each chunk, so a test can kill the daemon "
            "while a step is being written.")
    upload_delay: float = setting(
        0.0, parse=parse_duration, flags=(Flag("--debug-upload-delay", metavar="SECONDS", hidden=True),),
        doc="TEST ONLY: sleep this many seconds before uploading each file to the bucket.")
    commit_delay: float = setting(
        0.0, parse=parse_duration, flags=(Flag("--debug-commit-delay", metavar="SECONDS", hidden=True),),
        doc="TEST ONLY: sleep this many seconds before a commit writes its index, so a test can time "
            "out a COMMIT request that still commits.")
    frame_timeout: float = setting(
        FRAME_TIMEOUT_S, parse=parse_duration, flags=(Flag("--debug-frame-timeout", metavar="SECONDS", hidden=True),),
        doc="TEST ONLY: a client's request body must follow its header within this (30 s), or it is disconnected.")


KEYS: dict[str, Key] = {k.name: k for k in walk(Settings)}
DEBUG_KEYS: dict[str, Key] = {k.name: k for k in walk(DebugSettings, "debug.")}
ENV_KEYS = {k.env: k.name for k in KEYS.values()}
_NO_ROOT = "root is not set: give --root, CKPTD_ROOT or root = \"...\" in the config file"


def _default(key: str) -> Any:
    """A DaemonConfig default read from the setting's definition, never restated."""
    return field(default_factory=lambda: KEYS[key].default())


@dataclass
class DaemonConfig:
    """What the daemon reads (server.py); built by :meth:`Settings.to_daemon_config`."""
    root: str
    socket_path: str
    socket_mode: int = _default("socket_mode")
    threads: int = _default("threads")
    write: WriteSettings = field(default_factory=WriteSettings)
    step_timeout: float = _default("step_timeout")
    slot_memory_limit: int = _default("slot_memory_limit")
    allowed_uids: frozenset[int] | None = None   # None: any peer that can open the socket
    allowed_gids: frozenset[int] | None = None
    drain_grace: float = _default("drain_grace")
    socket_group: int | None = None              # chgrp of a socket the daemon binds itself
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    metrics_address: tuple[str, int] | None = None  # (host, port) of /metrics; None: off
    s3: S3Settings = field(default_factory=S3Settings)  # s3.url None: no object-storage tier
    debug: DebugSettings = field(default_factory=DebugSettings)    # test-only knobs (flags only)
    memory: MemorySettings = field(default_factory=MemorySettings)
    peers: PeerSettings = field(default_factory=PeerSettings)


# ---- loading ------------------------------------------------------------------------------------

@dataclass
class Effective:
    """The validated settings in force, plus where each value came from."""
    settings: Settings
    debug: DebugSettings = field(default_factory=DebugSettings)
    sources: dict[str, str] = field(default_factory=dict)
    config_path: str | None = None
    warnings: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        """A value by dotted key (``"retention.keep_last"``)."""
        return functools.reduce(getattr, key.split("."), self.settings)

    def to_daemon_config(self) -> DaemonConfig:
        return self.settings.to_daemon_config(self.debug)

    def render(self) -> str:
        """The effective settings as a loadable TOML file, each with its source (``--check-config``)."""
        lines, section = [f"# effective ckptd settings; config file: {self.config_path or '(none)'}"], ""
        for key in KEYS.values():
            tbl, _, name = key.name.rpartition(".")
            if tbl != section:
                lines += ["", f"[{tbl}]"]
                section = tbl
            source = self.sources.get(key.name, "default")
            if source == "default" and key.spec.default_doc:
                source += ": " + key.spec.default_doc          # a default computed at start: say from what
            note = size_note(self[key.name]) if key.spec.show is show_size else ""
            lines.append(f"{name} = {key.spec.show(self[key.name])}    # {source}" + (f" ({note})" if note else ""))
        return "\n".join(lines)


def _flatten_toml(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, val in obj.items():
        name = f"{prefix}{k}"
        if isinstance(val, dict) and any(key.startswith(name + ".") for key in KEYS):
            out.update(_flatten_toml(val, name + "."))
        else:
            out[name] = val
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
        raise ConfigError(f"config {path}: " + "; ".join(f"unknown key {k!r}{did_you_mean(k, KEYS)}" for k in unknown)
                          + " (every key is in docs/operations.md)")
    return flat


def load_settings(config_path: str | None = None, env: Mapping[str, str] | None = None,
                  cli: Mapping[str, Any] | None = None, *, require_root: bool = True) -> Effective:
    """Merge defaults < file < environment < CLI, validating each layer's values as they come in.

    ``config_path``: an explicit file (``--config``); must exist. None: ``$CKPTD_CONFIG`` (must
    exist) or /etc/ckptd/ckptd.toml (used if present). ``cli``: dotted key → raw value for
    every flag the user actually gave; ``debug.*`` keys come from here only.
    """
    env = os.environ if env is None else env
    cli = dict(cli or {})
    explicit = config_path or env.get(ENV_CONFIG) or None
    path = explicit or DEFAULT_CONFIG_PATH
    config_used = path if explicit or os.path.exists(path) else None
    warnings: list[str] = []
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_used:
        layers.append((f"config {path}", read_config_file(path)))
    env_layer: dict[str, Any] = {}
    for name, raw in env.items():
        if name in ENV_KEYS:
            env_layer[ENV_KEYS[name]] = raw
        elif name.startswith(ENV_PREFIX) and name not in ENV_OTHER:
            warnings.append(f"ignoring unknown environment variable {name}")
    layers.append(("environment", env_layer))
    unknown = sorted(k for k in cli if k not in KEYS and k not in DEBUG_KEYS)
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]!r}")
    layers.append(("command line", cli))

    keys = {**KEYS, **DEBUG_KEYS}
    flat = {name: key.default() for name, key in keys.items()}
    sources = dict.fromkeys(KEYS, "default")
    for source, layer in layers:
        for name, raw in layer.items():
            where = env_name(name) if source == "environment" else name
            try:
                flat[name] = keys[name].spec.parse(raw)
            except ValueError as e:
                raise ConfigError(f"{source}: {where}: {e}") from None
            sources[name] = source
    debug = build(DebugSettings, flat, "debug.")
    settings = Effective(build(Settings, flat), debug, sources, config_used, warnings)
    _check_consistency(settings, require_root)
    return settings


def _check_consistency(s: Effective, require_root: bool) -> None:
    c, src = s.settings, s.sources
    if require_root and not c.root:
        raise ConfigError(_NO_ROOT)
    if c.slot_memory_limit < MiB:
        raise ConfigError(f"{src['slot_memory_limit']}: slot_memory_limit: "
                          f"{c.slot_memory_limit} bytes is too small (at least 1MiB)")
    if not 64 * 1024 <= c.chunk_size <= 1024**3:
        raise ConfigError(f"{src['chunk_size']}: chunk_size: must be between 64KiB and 1GiB, got {c.chunk_size}")
    if c.step_timeout <= 0:
        raise ConfigError(f"{src['step_timeout']}: step_timeout: must be positive")
    if c.retention.abandoned_after < c.step_timeout:
        raise ConfigError(
            f"{src['retention.abandoned_after']}: retention.abandoned_after: "
            f"{c.retention.abandoned_after:g}s is shorter than step_timeout ({c.step_timeout:g}s); "
            "a slow step still being written could be removed")
    check_peers(c.memory, c.peers, src, ConfigError)
    if c.socket_mode & 0o007 and not (c.allowed_users or c.allowed_groups):
        raise ConfigError(
            f"{src['socket_mode']}: socket_mode: {c.socket_mode:04o} lets every local user connect; "
            "drop the 'other' bits or restrict peers with allowed_users / allowed_groups")


# ---- the docs table (the flags are derived in cli.py) --------------------------------------------

def render_settings_table() -> str:
    """The settings reference of docs/operations.md (between its settings-table markers)."""
    rows = ["| key | environment | flag | default | meaning |", "|---|---|---|---|---|"]
    for key in KEYS.values():
        flags = ", ".join(f"`{f.name}`" + (" (repeat)" if key.spec.repeat else "")
                          for f in key.flags if not f.hidden)
        rows.append(f"| `{key.name}` | `{key.env}` | {flags} | {key.shown_default('`')} | {key.doc} |")
    rows += ["", "Flags for tests only (hidden from `--help`; never read from the file or the environment):", ""]
    for key in DEBUG_KEYS.values():
        flag = " ".join(filter(None, (key.flags[0].name, key.flags[0].metavar)))
        rows.append(f"- `{flag}`: {key.doc.removeprefix('TEST ONLY: ')}")
    return "\n".join(rows)


def update_docs(path: str = DOCS_PATH, *, write: bool = True) -> bool:
    """Replace the text between the settings-table markers of ``path``; True if it was current."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    begin, end = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    new = text[:begin] + "\n" + render_settings_table() + "\n" + text[end:]
    if new != text and write:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new == text


if __name__ == "__main__":     # --doc-table (the default): print it; --write-docs: update the doc
    print(f"{DOCS_PATH}: " + ("already current" if update_docs() else "settings table rewritten")
          if "--write-docs" in sys.argv[1:] else render_settings_table())
