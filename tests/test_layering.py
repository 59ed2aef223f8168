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
    "ckptd.daemon.tiers.base": 2,  # the tier contract
    "ckptd.daemon.tiers.fs": 3,    # the file-system tier: writer, commit, retention (scheduler: 4)
    "ckptd.daemon.tiers.fs.scheduler": 4,
    "ckptd.daemon.tiers.memory.store": 3,   # held shards in memfds (peers keep replicas there too)
    "ckptd.daemon.tiers.memory": 4,         # the memory tier in front of the file system tier
    "ckptd.daemon.tiers.peers": 4,          # peer listener, links and replication (memory store only)
    "ckptd.daemon.tiers.memory.service": 5, # wires memory tier, peers and replication for the server
    "ckptd.daemon.tiers.s3": 4,    # the bucket: client, credentials, uploads, staging, its facade for the server
    "ckptd.daemon.slot_pool": 4,   # slot memory
    "ckptd.daemon.steps": 5,       # step coordination
    "ckptd.daemon.session": 5,     # one connected trainer rank
    "ckptd.daemon.server": 6,      # lifecycle and op table: wires everything together
    "ckptd.cli": 7,
    "ckptd.status_text": 7,        # `ckptd status` rendered for a person
    "ckptd.bucket_cli": 7,         # the CLI's object-storage commands
    "ckptd.launch": 7,
    "ckptd.s3_local": 7,           # a local SeaweedFS for tests, benchmarks and `make demo-s3`
    "ckptd.__main__": 8,
}
CLIENT_MAY_IMPORT = ("ckptd", "ckptd.core", "ckptd.hf")   # besides ckptd_client itself


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


def test_hf_imports_only_core() -> None:
    """ckptd.hf is shared by the CLI and the client, so it stays torch-free and daemon-free."""
    bad = [f"{name} imports {t}" for name, path in ALL.items() if in_room(name, "ckptd.hf")
           for t in imports(name, path) if in_room(t, "ckptd") and not (t == "ckptd" or in_room(t, "ckptd.core")
                                                                          or in_room(t, "ckptd.hf"))]
    assert not bad, "\n".join(bad)


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
    # ckptd_client.torchtitan (imported by nobody else in the client) needs the torchtitan extra.
    undeclared = used - declared("") - client - declared("torchtitan")
    assert not undeclared, f"ckptd_client imports {sorted(undeclared)}, declared in neither dependencies nor client"
    assert client <= used, f"client extra declares {sorted(client - used)} that ckptd_client does not import"
