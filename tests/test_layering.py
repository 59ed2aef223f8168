"""The import graph points one way, modules stay small, and imports match the declared dependencies.

Every module under ckptd/ has a rank (RANKS: the longest matching module name or package
prefix); a module may import modules of its own rank or lower, never higher. So ckptd.core imports nothing from the
daemon, the CLI or the client; the daemon nothing from the CLI; config only the mechanisms
below it. ckptd_client is a room of its own: it imports only ckptd.core (and the ``ckptd``
package itself), and nothing under ckptd/ imports it. See docs/architecture.md.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 400

RANKS = {
    "ckptd": 0,                    # the package: __version__
    "ckptd.core": 1,               # the format and the wire: names, errors, protocol, codec, storage, schema, reader
    # The daemon's rooms (docs/architecture.md). Below the tiers: what every room shares.
    "ckptd.daemon": 2,             # runtime (task set, refusal error)
    "ckptd.daemon.settings": 2,    # every setting, typed; imports only core and its own room
    "ckptd.daemon.service": 2,     # logs, systemd, the status snapshot, allocator
    "ckptd.daemon.service.metrics": 3,   # reads the snapshot and retention's results
    "ckptd.hf": 2,                 # Hugging Face safetensors export/import: imports only ckptd.core (checked below)
    "ckptd.spawn": 2,              # a child daemon tied to its parent: imports only ckptd.core (checked below)
    "ckptd.tie": 0,                # the tie itself, run before each daemon's exec: the standard library only
    "ckptd.daemon.tiers.base": 2,  # the tier contract
    "ckptd.daemon.tiers.fs": 3,    # the file-system tier: writer, commit, retention (scheduler: 4)
    "ckptd.daemon.tiers.fs.scheduler": 4,
    "ckptd.daemon.tiers.memory.store": 3,   # held shards in memfds (peers keep replicas there too)
    "ckptd.daemon.tiers.memory": 4,         # the memory tier in front of the file system tier
    "ckptd.daemon.tiers.peers": 4,          # peer listener, links and replication (memory store only)
    "ckptd.daemon.tiers.memory.service": 5, # wires memory tier, peers and replication for the server
    "ckptd.daemon.tiers.s3": 4,    # the bucket: client, credentials, uploads, staging, its facade for the server
    "ckptd.daemon.slot_pool": 4,   # slot memory
    "ckptd.daemon.streamed": 4,    # a save streamed through slots smaller than its shard
    "ckptd.daemon.steps": 5,       # step coordination
    "ckptd.daemon.session": 5,     # one connected trainer rank
    "ckptd.daemon.server": 6,      # lifecycle: wires everything together
    "ckptd.daemon.requests": 6,    # the op table: one handler per request, through every room
    "ckptd.cli": 7,
    "ckptd.cli_steps": 7,          # ls, verify, inspect
    "ckptd.status_text": 7,        # `ckptd status` rendered for a person
    "ckptd.bucket_cli": 7,         # the CLI's object-storage commands
    "ckptd.launch": 7,
    "ckptd.s3_local": 7,           # a local SeaweedFS for tests, benchmarks and `make demo-s3`
    "ckptd.__main__": 8,
}
# Besides ckptd_client itself. ckptd.spawn: Checkpointer(spawn=True) starts a daemon as a subprocess
# with the same code as ckptd.launch (one implementation), and needs none of the daemon to do it.
CLIENT_MAY_IMPORT = ("ckptd", "ckptd.core", "ckptd.hf", "ckptd.spawn")


def modules(package: str) -> dict[str, Path]:
    """Module name → file, for every .py under the package's folder."""
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


ALL = {**modules("ckptd"), **modules("ckptd_client")}


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports(name: str, path: Path, runtime_only: bool = False) -> set[str]:
    """Every module ``name`` imports: at the top, in functions, and (unless ``runtime_only``)
    under ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:     # `from pkg import module` imports pkg.module
                sub = f"{target}.{a.name}"
                found.add(sub if sub in ALL else target)
    return found


def in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def rank(module: str) -> int | None:
    best = max((k for k in RANKS if in_room(module, k)), key=len, default=None)
    return RANKS[best] if best is not None else None


def test_no_module_imports_a_higher_one() -> None:
    bad = []
    for name, path in ALL.items():
        for target in imports(name, path):
            if in_room(name, "ckptd"):
                if in_room(target, "ckptd_client"):
                    bad.append(f"{name} imports the client ({target})")
                elif in_room(target, "ckptd"):
                    mine, theirs = rank(name), rank(target)
                    if mine is not None and theirs is not None and theirs > mine:
                        bad.append(f"{name} (rank {mine}) imports {target} (rank {theirs})")
            elif in_room(target, "ckptd") and not any(in_room(target, r) if r != "ckptd" else target == r
                                                      for r in CLIENT_MAY_IMPORT):
                bad.append(f"{name} imports {target}: the client may import only {', '.join(CLIENT_MAY_IMPORT)}")
    assert not bad, "\n".join(bad)


def test_hf_and_spawn_import_only_core() -> None:
    """ckptd.hf and ckptd.spawn are shared by the CLI and the client, so they stay torch-free and daemon-free."""
    shared = ("ckptd.hf", "ckptd.spawn")
    bad = [f"{name} imports {t}" for name, path in ALL.items() if any(in_room(name, r) for r in shared)
           for t in imports(name, path) if in_room(t, "ckptd") and not (t == "ckptd" or in_room(t, "ckptd.core")
                                                                          or any(in_room(t, r) for r in shared))]
    assert not bad, "\n".join(bad)


def test_tie_imports_only_the_standard_library() -> None:
    """ckptd.tie runs before every tied daemon's exec: an import of ckptd.core there cost 0.28 s of
    CPU per daemon start (it was ``python -m ckptd.spawn``)."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = [t for t in imports("ckptd.tie", ALL["ckptd.tie"]) if t.split(".")[0] not in stdlib]
    assert not bad, f"ckptd.tie imports {bad}: keep it to the standard library"


def test_modules_stay_small() -> None:
    big = {name: n for name, path in ALL.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by responsibility): {big}"


# ---- imports match pyproject's dependencies -------------------------------------------------

def third_party(package: str) -> set[str]:
    """Top-level names of what the package's modules import from outside the repository."""
    own = {"ckptd", "ckptd_client"}
    stdlib = set(sys.stdlib_module_names) | {"tomllib"}     # tomllib: stdlib from 3.11 (tomli before)
    tops = set()
    for name, path in modules(package).items():
        for target in imports(name, path, runtime_only=True):
            top = target.split(".")[0]
            if top and top not in own and top not in stdlib:
                tops.add(top)
    return tops


def declared(section: str) -> set[str]:
    """Import names of pyproject's ``dependencies`` (section "") or of one extra."""
    text = (REPO / "pyproject.toml").read_text()
    if section:
        block = re.search(rf"^{section} = \[(.*?)\]", text, re.S | re.M)
    else:
        block = re.search(r"^dependencies = \[(.*?)\]", text, re.S | re.M)
    assert block, f"pyproject.toml has no {section or 'dependencies'} list"
    names = re.findall(r'"([A-Za-z0-9_.-]+)', block.group(1))
    return {n.lower().replace("-", "_") for n in names}


def test_the_daemon_imports_only_its_declared_dependencies() -> None:
    runtime = declared("")
    used = third_party("ckptd")
    assert "torch" not in used, "the daemon must not import torch (torch comes with the client extra)"
    s3 = declared("s3")          # the object-storage tier's client (an extra: only s3-enabled daemons need it)
    assert s3 <= used, f"s3 extra declares {sorted(s3 - used)} that ckptd does not import"
    used -= s3
    undeclared = used - runtime
    assert not undeclared, f"ckptd imports {sorted(undeclared)} without declaring them in dependencies"
    unused = runtime - used
    assert not unused, f"dependencies {sorted(unused)} are declared but nothing in ckptd/ imports them"


def test_the_client_imports_only_runtime_and_client_dependencies() -> None:
    client = declared("client")
    used = third_party("ckptd_client")
    # ckptd_client.torchtitan and ckptd_client.lightning (imported by nobody else in the client) need
    # the torchtitan and lightning extras.
    undeclared = used - declared("") - client - declared("torchtitan") - declared("lightning")
    assert not undeclared, f"ckptd_client imports {sorted(undeclared)}, declared in neither dependencies nor client"
    assert client <= used, f"client extra declares {sorted(client - used)} that ckptd_client does not import"


# ---- no reach-ins: a module uses only another module's public names ---------------------------

CHECKED_ELSEWHERE = ("benchmarks", "examples")      # they use the package as a user does: public names only


def _module_files() -> dict[str, Path]:
    out = dict(ALL)
    for folder in CHECKED_ELSEWHERE:
        out.update({f"{folder}.{p.stem}": p for p in sorted((REPO / folder).glob("*.py"))})
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assignments, ``self._x = ...`` attributes."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
            out.add(node.target.id)
    return out


def reach_ins() -> list[str]:
    """``from m import _x``, ``m._x`` on an imported module, and ``obj._x`` where ``_x`` is defined only
    in other modules of the repository (an object of another module's class)."""
    files = _module_files()
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
    defined = {name: _defined_privates(tree) for name, tree in trees.items()}
    bad = []
    for name, tree in trees.items():
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if files[name].name == "__init__.py" else 0)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    if f"{target}.{a.name}" in ALL:
                        bound[a.asname or a.name] = f"{target}.{a.name}"
                    elif target in ALL and _private(a.name):
                        bad.append(f"{name}: from {target} import {a.name}")
            elif isinstance(node, ast.Import):
                bound.update({a.asname or a.name.split(".")[0]: a.name for a in node.names if a.name in ALL})
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)):
                continue
            owner = node.value.id
            if owner in bound and bound[owner] != name:
                bad.append(f"{name}: {owner}.{node.attr} (a private name of {bound[owner]})")
            elif owner not in ("self", "cls") and node.attr not in defined[name] \
                    and any(node.attr in d for other, d in defined.items() if other != name):
                bad.append(f"{name}: {owner}.{node.attr} (private to another module)")
    return sorted(set(bad))


def test_no_module_reaches_into_another() -> None:
    bad = reach_ins()
    assert not bad, "private names used across modules (make them public under a good name, or stop " \
                    "using them):\n" + "\n".join(bad)


# ---- the rooms, as a person reads them ---------------------------------------------------------

def room_of(module: str) -> str:
    """A module's room: its package (ckptd.daemon.tiers.fs for ckptd.daemon.tiers.fs.tier)."""
    path = ALL[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0] or module


def room_report() -> str:
    """Each room with its modules and their line counts, then the imports between rooms."""
    rooms: dict[str, list[str]] = {}
    for name in ALL:
        rooms.setdefault(room_of(name), []).append(name)
    lines = []
    for room in sorted(rooms):
        total = sum(len(ALL[m].read_text().splitlines()) for m in rooms[room])
        lines.append(f"{room}  ({len(rooms[room])} modules, {total} lines, rank {rank(room)})")
        for m in sorted(rooms[room]):
            lines.append(f"    {m.rpartition('.')[2] if m != room else '__init__':<22} "
                         f"{len(ALL[m].read_text().splitlines()):>4}")
    edges: dict[tuple[str, str], int] = {}
    for name, path in ALL.items():
        for target in imports(name, path):
            if target in ALL and room_of(target) != room_of(name):
                key = (room_of(name), room_of(target))
                edges[key] = edges.get(key, 0) + 1
    lines.append("imports between rooms (from -> to: import statements' targets):")
    lines += [f"    {a} -> {b}: {n}" for (a, b), n in sorted(edges.items())]
    return "\n".join(lines)


def test_room_report(capsys: object) -> None:
    """Printed with ``python tests/test_layering.py``; here: every room has a docstring saying what it holds."""
    report = room_report()
    assert "ckptd.daemon.tiers.fs" in report
    undocumented = [m for m, p in ALL.items()
                    if p.name == "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not undocumented, f"rooms without a docstring saying what they hold: {undocumented}"


def layout_doc() -> set[str]:
    """The module paths docs/layout.md's tree lists: a folder line (``ckptd/daemon/tiers/fs/``)
    followed by indented ``name.py`` lines, or a top-level ``ckptd/cli.py`` line."""
    section = (REPO / "docs" / "layout.md").read_text()
    tree = section[section.index("```") + 3:]
    tree = tree[: tree.index("```")]
    listed, folder = set(), ""
    for line in tree.splitlines():
        if m := re.match(r"^(\S+/)(?:\s|$)", line):
            folder = m.group(1)
        elif m := re.match(r"^(\S+\.py)(?:\s|$)", line):
            listed.add(m.group(1))
        elif (m := re.match(r"^\s+(\S+\.py)(?:\s|$)", line)) and folder:
            listed.add(folder + m.group(1))
    return listed


def test_layout_doc_names_every_module() -> None:
    """docs/layout.md is where a newcomer looks for a module: every module, and no module that is gone."""
    actual = {str(p.relative_to(REPO)) for p in ALL.values() if p.name != "__init__.py"}
    listed = layout_doc()
    assert not actual - listed, f"docs/layout.md does not list: {sorted(actual - listed)}"
    gone = {p for p in listed - actual if not (REPO / p).is_file()}
    assert not gone, f"docs/layout.md lists modules that do not exist: {sorted(gone)}"


if __name__ == "__main__":
    print(room_report())
