"""What a new user reads first: command output that is quiet when piped, sizes a person can read,
help without test-only flags, errors that say "did you mean", exports that behave like the Hugging
Face tools beside them. Commands run as typed, in their own process, against a real daemon."""
from __future__ import annotations

import io
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptd_client
from ckptd.hf.progress import Progress

from conftest import REPO


def ckptd(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, **kw)  # type: ignore[call-overload]


@pytest.fixture
def step(daemon) -> Path:
    """A committed step whose model has 3 tensors of 16 KiB each, saved through a real daemon."""
    ck = ckptd_client.Checkpointer("job", socket=str(daemon.socket))
    ck.save(5, {"model": {f"layer{i}.weight": torch.randn(64, 64) for i in range(3)}}).wait(60)
    ck.close(timeout=60)
    return daemon.root / "job" / "step-000000000005"


# ---- ckptd status ---------------------------------------------------------------------------------

def test_status_into_a_closed_pipe_is_quiet(daemon) -> None:
    """`ckptd status | head`: the reader goes away before ckptd writes. No traceback, exit 141 (SIGPIPE)."""
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "status", "--socket", str(daemon.socket)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()                 # the reader is gone before the daemon has answered
    err = proc.stderr.read()
    assert proc.wait(60) in (0, 141), err
    assert err == "", err


def test_status_shows_byte_counters_as_sizes(step: Path, daemon) -> None:
    r = ckptd("status", "--socket", str(daemon.socket))
    assert r.returncode == 0, r.stderr
    stats = next(ln for ln in r.stdout.splitlines() if ln.startswith("stats "))
    assert "bytes_raw=48.0KiB" in stats and re.search(r"bytes_stored=\d+\.\dKiB\b", stats), stats
    as_json = json.loads(ckptd("status", "--socket", str(daemon.socket), "--json").stdout)
    assert as_json["stats"]["bytes_raw"] == 3 * 16384          # JSON keeps the bytes


# ---- ckptd serve: --check-config, --help, the config file ----------------------------------------------

def test_check_config_says_what_a_size_of_odd_units_is(tmp: Path) -> None:
    r = ckptd("serve", "--root", str(tmp), "--slot-memory-limit", str(12342042 * 1024), "--check-config")
    assert r.returncode == 0, r.stderr
    assert 'slot_memory_limit = "12342042KiB"    # command line (11.8 GiB)' in r.stdout, r.stdout
    r = ckptd("serve", "--root", str(tmp), "--check-config")       # the default: a share of this machine's RAM
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("slot_memory_limit"))
    assert "# default: half of RAM" in line, line


def test_serve_help_has_no_test_flags_and_no_empty_defaults() -> None:
    r = ckptd("serve", "--help")
    assert r.returncode == 0
    assert "--debug-" not in r.stdout and "TEST ONLY" not in r.stdout, r.stdout
    assert "(default: )" not in r.stdout and "default: [])" not in r.stdout, r.stdout
    assert "none by default" in r.stdout
    assert ckptd("serve", "--debug-write-delay", "0", "--root", "/tmp", "--check-config").returncode == 0  # taken


@pytest.mark.parametrize("toml, said", [
    ('[retention]\nkeep_lats = 3\n', "unknown key 'retention.keep_lats' (did you mean 'retention.keep_last'?)"),
    ('rot = "/x"\n', "unknown key 'rot' (did you mean 'root'?)"),
    ('keep_last = 3\n', "unknown key 'keep_last' (did you mean 'retention.keep_last' or 's3.keep_last'?)"),
])
def test_a_typo_in_the_config_gets_a_did_you_mean(tmp: Path, toml: str, said: str) -> None:
    cfg = tmp / "c.toml"
    cfg.write_text('root = "/tmp/x"\n' + toml)
    r = ckptd("serve", "--config", str(cfg), "--check-config")
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert "socket_mode" not in r.stderr        # not every key there is


# ---- ckptd export / import -----------------------------------------------------------------------------

def test_export_writes_into_an_empty_directory_and_refuses_a_full_one_in_cli_words(step: Path, tmp: Path) -> None:
    out = tmp / "hf"
    out.mkdir()                     # as huggingface_hub / save_pretrained callers make it first
    r = ckptd("export", str(step), str(out), "--max-shard-size", "20KB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{out}: 3 tensors, 48.0 KiB in 3 file(s)", r.stdout
    again = ckptd("export", str(step), str(out))
    assert again.returncode == 1, again.stderr
    assert "is not an empty directory; --force replaces it" in again.stderr and "force=True" not in again.stderr
    with pytest.raises(FileExistsError, match=r"export_hf\(\.\.\., force=True\) replaces it") as e:
        ckptd_client.export_hf(step, out)
    assert "--force" not in str(e.value)
    assert ckptd("export", str(step), str(out), "--force").returncode == 0


def test_export_index_has_the_shards_mode(step: Path, tmp: Path) -> None:
    out = tmp / "hf"
    assert ckptd("export", str(step), str(out), "--max-shard-size", "20KB").returncode == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors.index.json" in modes and len(modes) == 4, modes
    assert len(set(modes.values())) == 1, modes


def test_import_prints_sizes(step: Path, tmp: Path) -> None:
    assert ckptd("export", str(step), str(tmp / "hf")).returncode == 0
    r = ckptd("import", str(tmp / "hf"), str(tmp / "root2"), "imp", "--step", "1")
    assert r.returncode == 0, r.stderr
    assert re.search(r"committed, 3 tensors, 48\.0 KiB \(\d+\.\d KiB stored\)$", r.stdout.strip()), r.stdout


def test_progress_off_a_terminal_prints_a_line_now_and_then() -> None:
    out = io.StringIO()                     # not a terminal: a batch job's log
    bar = Progress("export x", 200, stream=out, interval=0.0)
    bar.update(100)
    bar.update(100)
    bar.close()                             # and a last line, as lines were printed
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue(), lines
    assert lines[0].startswith("export x: 50.0% ") and lines[2].startswith("export x: 100.0% "), lines
    quiet = io.StringIO()
    Progress("export x", 200, stream=quiet).update(200)     # under the interval: nothing yet
    assert quiet.getvalue() == ""
    off = io.StringIO()
    bar = Progress("export x", 200, enabled=False, stream=off, interval=0.0)
    bar.update(200)
    bar.close()
    assert off.getvalue() == ""


# ---- the client -----------------------------------------------------------------------------------

def test_a_generator_in_the_state_is_refused_with_the_recipe(daemon) -> None:
    gen = torch.Generator().manual_seed(7)
    with ckptd_client.Checkpointer("gen", socket=str(daemon.socket)) as ck:
        with pytest.raises(TypeError, match=r"torch\.Generator .*gen\.get_state\(\).*gen\.set_state"):
            ck.save(1, {"gen": gen})
        ck.save(1, {"gen": gen.get_state()}).wait(60)      # the recipe the error gives works
        want = torch.rand(4, generator=gen)
        state = {"gen": torch.Generator().get_state()}
        assert ck.restore(state) == 1
    fresh = torch.Generator()
    fresh.set_state(state["gen"])
    assert torch.equal(torch.rand(4, generator=fresh), want)
    assert os.path.isdir(daemon.root / "gen")


def test_operations_guide_says_nothing_twice() -> None:
    """No run of 10 words appears twice in docs/operations.md (a pasted paragraph tail, a generated
    remark repeated on every line)."""
    words = (REPO / "docs" / "operations.md").read_text().split()
    seen: dict[str, int] = {}
    twice = []
    for i in range(len(words) - 9):
        run = " ".join(words[i:i + 10])
        if run in seen and i - seen[run] >= 10:
            twice.append(run)
        seen.setdefault(run, i)
    assert not twice, twice[:5]
