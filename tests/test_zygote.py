"""tests/zygote.py, which most rank processes of the suite are forked from: each child must look to
its test like the ``python`` command it replaces (exit codes, signals, streams, env, cwd, groups)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zygote

PY = sys.executable


def test_exit_codes_and_streams_are_the_commands() -> None:
    ok = zygote.run([PY, "-c", "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr)", "a", "b"],
                    capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "out ['a', 'b']\n", "err\n")
    assert zygote.run([PY, "-c", "raise SystemExit(3)"], timeout=60).returncode == 3
    msg = zygote.run([PY, "-c", "raise SystemExit('no good')"], capture_output=True, text=True, timeout=60)
    assert msg.returncode == 1 and msg.stderr == "no good\n"
    boom = zygote.run([PY, "-c", "raise KeyError('k')"], capture_output=True, text=True, timeout=60)
    assert boom.returncode == 1 and "KeyError: 'k'" in boom.stderr and "Traceback" in boom.stderr


def test_a_script_runs_as_main_with_its_env_cwd_and_atexit(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import atexit, os, sys, threading, time\n"
                      "assert __name__ == '__main__' and sys.path[0] == os.path.dirname(os.path.abspath(__file__))\n"
                      "print(os.environ['ZYG'], os.getcwd(), sys.argv[1], flush=True)\n"
                      "atexit.register(lambda: print('atexit', flush=True))\n"
                      "threading.Thread(target=lambda: (time.sleep(0.2), print('thread', flush=True))).start()\n")
    r = zygote.run([PY, str(script), "x"], capture_output=True, text=True, timeout=60,
                   env={**os.environ, "ZYG": "set"}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n") == [f"set {tmp_path} x", "thread", "atexit", ""]


def test_signals_groups_and_wait() -> None:
    lead = zygote.popen([PY, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                        stdout=subprocess.PIPE, text=True, pgid=0)
    peer = zygote.popen([PY, "-c", "import time; time.sleep(60)"], pgid=lead.pid)
    assert isinstance(lead, zygote.Process) and lead.stdout is not None
    assert lead.stdout.readline() == "up\n"
    assert os.getpgid(lead.pid) == lead.pid and os.getpgid(peer.pid) == lead.pid
    with pytest.raises(subprocess.TimeoutExpired):
        lead.wait(0.2)
    assert lead.poll() is None
    os.killpg(lead.pid, signal.SIGKILL)
    assert (lead.wait(30), peer.wait(30)) == (-signal.SIGKILL, -signal.SIGKILL)
    term = zygote.popen([PY, "-c", "import time; time.sleep(60)"])
    term.terminate()
    assert term.wait(30) == -signal.SIGTERM


def test_what_it_cannot_fork_runs_as_a_plain_subprocess() -> None:
    p = zygote.popen([PY, "-m", "json.tool", "--help"], stdout=subprocess.DEVNULL)
    assert isinstance(p, subprocess.Popen) and p.wait(60) == 0


def test_children_draw_their_own_random_numbers() -> None:
    """As fresh interpreters do: a generator the zygote seeded once must not hand every child the same draws."""
    code = "import random, numpy; print(random.random(), numpy.random.random())"
    draws = [zygote.run([PY, "-c", code], capture_output=True, text=True, timeout=60).stdout.split() for _ in range(3)]
    assert len({d[0] for d in draws}) == 3 and len({d[1] for d in draws}) == 3, draws


def test_output_read_before_a_communicate_timeout_is_kept() -> None:
    """A hung rank group is killed and its output dumped (sharded_trainer.finish): the second
    ``communicate`` must return what the first read before it timed out, as ``subprocess.Popen``'s does."""
    p = zygote.popen([PY, "-c", "import time; print('got this far', flush=True); time.sleep(60)"], text=True,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with pytest.raises(subprocess.TimeoutExpired):
        p.communicate(timeout=3)
    p.kill()
    assert p.communicate(timeout=30)[0] == "got this far\n"


def test_preloaded_modules_and_a_pythonpath_of_its_own() -> None:
    """``preload``: forked from a zygote that imported those modules too; an env with another PYTHONPATH
    (what a fresh interpreter imports from) runs as a plain subprocess."""
    code = "import sys; print('json.tool' in sys.modules, 'ckptd.cli' in sys.modules)"
    r = zygote.run([PY, "-c", code], capture_output=True, text=True, timeout=60, preload=("json.tool",))
    assert (r.returncode, r.stdout) == (0, "True True\n"), r.stderr
    p = zygote.popen([PY, "-c", "pass"], env={**os.environ, "PYTHONPATH": "/nonexistent"})
    assert isinstance(p, subprocess.Popen) and p.wait(60) == 0
