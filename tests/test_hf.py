"""Hugging Face safetensors export and import (issue 8, acceptance 1-3).

Real 2- and 4-rank gloo groups save through a real daemon; ``ckptd export`` / ``ckptd import`` run
as the CLI in subprocesses; the results are read back by safetensors, huggingface_hub and
transformers (a tiny LlamaConfig made here: nothing is downloaded).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hf_worker
import pytest
import torch
from safetensors.torch import load_file

from ckptd.launch import spawn_daemon

import sharded_trainer as st

WORKER = Path(hf_worker.__file__)
MB = 10**6
GROUP_TIMEOUT = 600        # a hung rank group is killed after this (a safety net on a loaded machine, not a limit)
pytestmark = pytest.mark.timeout(900)


def ckptd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    path = Path(f"/tmp/ckt-hf-{os.getpid()}")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def saved(base: Path) -> dict[str, Path]:
    """A 2-rank DDP and a 2-rank FSDP2 checkpoint of the tiny Llama, and each one's full weights."""
    daemon = spawn_daemon(base / "root", base / "d.sock")
    try:
        for layout in ("ddp", "fsdp"):
            out = st.run_group(2, "save", "--layout", layout, "--socket", str(base / "d.sock"), "--job", layout,
                               "--ref", str(base / f"{layout}.ref"), script=WORKER, timeout=GROUP_TIMEOUT)
            assert "COMMITTED 1" in out[0]
    finally:
        daemon.stop()
    return {layout: base / "root" / layout / "step-000000000001" for layout in ("ddp", "fsdp")}


def llama(state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    from transformers import LlamaForCausalLM
    m = LlamaForCausalLM(hf_worker.llama_config())
    if state is not None:
        m.load_state_dict(state, strict=True)
    return m


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)), k


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_export_matches_huggingface_hub(saved: dict[str, Path], base: Path, layout: str) -> None:
    from huggingface_hub import load_torch_model, save_torch_state_dict
    from transformers import LlamaForCausalLM
    ref = load_file(base / f"{layout}.ref")
    model = llama(ref)
    out = base / f"export-{layout}"
    r = ckptd("export", str(saved[layout]), str(out), "--max-shard-size", "1MB")
    assert r.returncode == 0 and r.stderr == "", r.stderr           # no progress bar when not a terminal
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and sorted(p.name for p in out.iterdir()) == [*files, "model.safetensors.index.json"]
    assert set(index) == {"metadata", "weight_map"} and set(index["metadata"]) == {"total_size"}
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())
    assert list(index["weight_map"]) == list(model.state_dict())          # the model's names, in its order
    got: dict[str, torch.Tensor] = {}
    for f in files:
        shard = load_file(out / f)
        assert all(index["weight_map"][k] == f for k in shard)
        got.update(shard)
    assert_bit_equal(got, ref)
    # The same layout, byte for byte in the index, as huggingface_hub's own writer.
    hub = base / f"hub-{layout}"
    hub.mkdir()
    save_torch_state_dict(model.state_dict(), hub, max_shard_size="1MB")
    assert (hub / "model.safetensors.index.json").read_bytes() == (out / "model.safetensors.index.json").read_bytes()
    for f in files:
        assert sorted(load_file(hub / f)) == sorted(load_file(out / f))
    fresh = llama()
    load_torch_model(fresh, out, strict=True)
    assert_bit_equal(fresh.state_dict(), ref)
    hf_worker.llama_config().save_pretrained(out)
    loaded = LlamaForCausalLM.from_pretrained(out)
    assert_bit_equal(loaded.state_dict(), ref)
    # One shard: a plain model.safetensors, no index, as huggingface_hub writes it.
    one = base / f"one-{layout}"
    assert ckptd("export", str(saved[layout]), str(one)).returncode == 0
    assert [p.name for p in one.iterdir()] == ["model.safetensors"]
    assert_bit_equal(load_file(one / "model.safetensors"), ref)


def test_export_options_and_refusals(saved: dict[str, Path], base: Path) -> None:
    import ckptd_client
    ref = load_file(base / "fsdp.ref")
    out = base / "opts"
    rename = base / "rename.json"
    rename.write_text(json.dumps({"lm_head.weight": "output.weight"}))
    r = ckptd_client.export_hf(saved["fsdp"], out, dtype="bfloat16", rename=rename, max_shard_size="1MiB")
    got = {}
    for f in r.files:
        got.update(load_file(out / f))
    assert "output.weight" in got and "lm_head.weight" not in got
    assert torch.equal(got.pop("output.weight").view(torch.int16), ref["lm_head.weight"].bfloat16().view(torch.int16))
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v.view(torch.int16), ref[k].bfloat16().view(torch.int16)), k
    # Refused: an existing OUT without --force (untouched), a --select with no tensors, a bad size.
    before = sorted(p.name for p in out.iterdir())
    r2 = ckptd("export", str(saved["fsdp"]), str(out))
    assert r2.returncode == 1 and "exists" in r2.stderr and sorted(p.name for p in out.iterdir()) == before
    assert ckptd("export", str(saved["fsdp"]), str(out), "--force").returncode == 0
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    r3 = ckptd("export", str(saved["fsdp"]), str(base / "none"), "--select", "nothing")
    assert r3.returncode == 1 and "no tensors under 'nothing'" in r3.stderr and not (base / "none").exists()
    # Optimizer state exported on request: its own names, no model tensors.
    r4 = ckptd_client.export_hf(saved["fsdp"], base / "optim", select="optim/state")
    assert r4.tensors > 0 and not any(p.name.startswith(".") for p in base.iterdir())


def test_export_of_a_flat_state_dict(daemon: Any, base: Path) -> None:
    """A step with no ``model`` entry that holds a flat state dict alone (``save(step, model.state_dict())``)
    is exported whole by default, as ``--select ""`` does any step; one that holds more (an optimizer's
    nested entries) is refused by default, naming its entries and ``--select ''``."""
    import ckptd_client
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    want = {k: v.detach().clone() for k, v in net.state_dict().items()}
    opt = torch.optim.Adam(net.parameters())
    with ckptd_client.Checkpointer("flat", socket=str(daemon.socket)) as ck:
        ck.save(1, dict(net.state_dict())).wait(60)
        net(torch.ones(2, 4)).sum().backward()
        opt.step()                          # its moments: tensors under optim/state
        ck.save(2, {**net.state_dict(), "optim": opt}).wait(60)
    flat = daemon.root / "flat"
    for out, select in (("flat1", ()), ("flat1-all", ("--select", ""))):
        r = ckptd("export", str(flat / "step-000000000001"), str(base / out), *select)
        assert r.returncode == 0, r.stderr
        assert_bit_equal(load_file(base / out / "model.safetensors"), want)
    r = ckptd("export", str(flat / "step-000000000002"), str(base / "flat2"))
    assert r.returncode == 1 and "no tensors under 'model'" in r.stderr and "--select ''" in r.stderr, r.stderr
    assert not (base / "flat2").exists()


def test_bfloat16_conversion_matches_torch() -> None:
    import numpy as np

    from ckptd.hf.layout import convert
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(100_000, generator=g) * 10.0 ** torch.randint(-40, 38, (100_000,), generator=g),
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38, 1e-45,
                                 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20])])   # ties round to even
    for src in (torch.float32, torch.float16, torch.float64):
        t = x.to(src)
        raw = np.frombuffer(t.numpy().tobytes(), dtype=np.uint8)
        name = str(src).removeprefix("torch.")
        got = convert(raw, name, "bfloat16").view(np.uint16)
        assert np.array_equal(got, t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)), name
    bf = x.to(torch.bfloat16)
    raw = np.frombuffer(bf.view(torch.int16).numpy().tobytes(), dtype=np.uint8)
    assert np.array_equal(convert(raw, "bfloat16", "float16").view(np.float16), bf.to(torch.float16).numpy())


@pytest.fixture(scope="module")
def mlp_step(base: Path) -> Path:
    """A 4-rank FSDP2 checkpoint of 64 square Linear(512) layers (67 MB), full weights in mlp.ref."""
    daemon = spawn_daemon(base / "root4", base / "d4.sock")
    try:
        out = st.run_group(4, "save", "--model", "mlp", "--layout", "fsdp", "--socket", str(base / "d4.sock"),
                           "--job", "mlp", "--ref", str(base / "mlp.ref"), script=WORKER,
                           timeout=GROUP_TIMEOUT)
        assert "COMMITTED 1" in out[0]
    finally:
        daemon.stop()
    return base / "root4/mlp/step-000000000001"


def test_export_peak_rss_is_bounded_by_shards_not_the_model(mlp_step: Path, base: Path) -> None:
    """Acceptance 2: the 4-rank FSDP2 checkpoint exported with 1 MB shards in a fresh process."""
    ref = load_file(base / "mlp.ref")
    model_bytes = sum(v.numel() * v.element_size() for v in ref.values())
    assert model_bytes > 60 * MB
    # VmHWM: this process image's peak RSS (ru_maxrss would also count the forked copy of pytest).
    code = ("import re, sys; from ckptd.cli import main; import numpy, zstandard, xxhash; "
            "peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)); "
            "before = peak(); "
            f"rc = main(['export', {str(mlp_step)!r}, {str(base / 'mlp-out')!r}, "
            "'--max-shard-size', '1MB', '--threads', '4']); "
            "print('RSS', before, peak()); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    before_kib, after_kib = (int(x) for x in r.stdout.split("RSS")[1].split())
    grown = (after_kib - before_kib) * 1024
    print(f"export peak RSS: {before_kib / 1024:.0f} MiB after imports, {after_kib / 1024:.0f} MiB peak, "
          f"model {model_bytes / MB:.0f} MB")
    # Measured 4.4 MiB: one 1 MB tensor at a time plus decode buffers; holding the model would be 67 MB.
    assert grown < model_bytes / 4, f"export grew RSS by {grown / MB:.1f} MB for a {model_bytes / MB:.0f} MB model"
    got = {}
    for f in json.loads((base / "mlp-out/model.safetensors.index.json").read_text())["weight_map"].values():
        got.update(load_file(base / "mlp-out" / f))
    assert_bit_equal(got, ref)


@pytest.fixture(scope="module")
def hub_dir(base: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama written by huggingface_hub.save_torch_state_dict in 1 MB shards, and its weights."""
    from huggingface_hub import save_torch_state_dict
    torch.manual_seed(7)
    sd = {k: v.clone() for k, v in llama().state_dict().items()}
    path = base / "hub-src"
    path.mkdir()
    save_torch_state_dict(sd, path, max_shard_size="1MB")
    assert len(list(path.glob("model-*.safetensors"))) >= 2
    return path, sd


def test_import_restores_bit_exact_at_any_layout(hub_dir: tuple[Path, dict[str, torch.Tensor]], base: Path) -> None:
    hub, sd = hub_dir
    root = base / "imported"
    r = ckptd("import", str(hub), str(root), "llama", "--step", "5")
    assert r.returncode == 0, r.stderr
    assert ckptd("verify", str(root / "llama/step-000000000005")).returncode == 0
    for world, layout in ((2, "fsdp"), (0, "plain")):
        ref = base / f"imported-{layout}.ref"
        direct = ("--hf", str(hub)) if layout == "fsdp" else ()      # then also load_hf straight from the HF dir
        out = st.run_group(world, "restore", "--layout", layout, "--root", str(root), "--job", "llama",
                           "--ref", str(ref), *direct, script=WORKER, timeout=GROUP_TIMEOUT)
        assert "RESTORED 5" in out[0]
        assert_bit_equal(load_file(ref), sd)
    # The direct path: each FSDP2 rank read its own slices from the HF directory.
    assert_bit_equal(load_file(f"{base / 'imported-fsdp.ref'}.direct"), sd)
    # A single model.safetensors (no index) imports too, and restores into a plain model in this process.
    from huggingface_hub import save_torch_state_dict

    import ckptd_client
    single = base / "hub-single"
    single.mkdir()
    save_torch_state_dict(sd, single)
    assert [p.name for p in single.iterdir()] == ["model.safetensors"]
    ckptd_client.import_hf(single, root, "single", 0)
    model = llama()
    ck = ckptd_client.Checkpointer("single", socket="/nonexistent/ckptd.sock", root=str(root), rank=0, world_size=1)
    assert ck.restore({"model": model}) == 0
    assert_bit_equal(model.state_dict(), sd)
    # Importing over an existing step is refused.
    again = ckptd("import", str(hub), str(root), "llama", "--step", "5")
    assert again.returncode == 1 and "exists already" in again.stderr


def _header(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("<Q", len(body)) + body


def _hostile_cases(hub: Path) -> dict[str, tuple[Callable[[Path], Any], str]]:
    shards = sorted(p.name for p in hub.glob("model-*.safetensors"))

    def edit_index(fn: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
        def apply(d: Path) -> None:
            obj = json.loads((d / "model.safetensors.index.json").read_text())
            fn(obj)
            (d / "model.safetensors.index.json").write_text(json.dumps(obj))
        return apply

    def set_first(value: str) -> Callable[[dict[str, Any]], None]:
        def fn(obj: dict[str, Any]) -> None:
            obj["weight_map"][next(iter(obj["weight_map"]))] = value
        return fn

    def write(name: str, data: bytes) -> Callable[[Path], Any]:
        return lambda d: (d / name).write_bytes(data)

    def relink(d: Path) -> None:
        (d / shards[0]).unlink()
        (d / shards[0]).symlink_to(hub / shards[0])

    one = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    return {
        "truncated header": (write(shards[0], struct.pack("<Q", 10_000) + b'{"w":'), "runs past the end"),
        "header over the limit": (write(shards[0], struct.pack("<Q", 2**40)), "exceeds the"),
        "header not JSON": (write(shards[0], struct.pack("<Q", 4) + b"{no}"), "not valid JSON"),
        "header nested too deep": (write(shards[0], struct.pack("<Q", 400_000) + b"[" * 200_000 + b"]" * 200_000),
                                   "not valid JSON"),
        "__metadata__ not a map": (write(shards[0], _header({**one, "__metadata__": []}) + b"\0" * 16),
                                   "__metadata__ must map"),
        "index nested too deep": (lambda d: (d / "model.safetensors.index.json").write_bytes(
            b"[" * 200_000 + b"]" * 200_000), "not valid JSON"),
        "offsets past the end": (write(shards[0], _header(one) + b"\0" * 8), "run past the end of the data"),
        "overlapping offsets": (write(shards[0], _header(
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}) + b"\0" * 12), "overlaps"),
        "size does not match shape": (write(shards[0], _header(
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}) + b"\0" * 8), "needs 12"),
        "unknown dtype": (write(shards[0], _header(
            {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}) + b"\0" * 16), "unsupported dtype"),
        "index naming ../x": (edit_index(set_first("../x.safetensors")), "invalid file name"),
        "index naming an absolute path": (edit_index(set_first("/etc/passwd")), "invalid file name"),
        "missing shard": (lambda d: (d / shards[-1]).unlink(), "missing"),
        "extra shard": (write(f"model-00009-of-{len(shards):05d}.safetensors", b""), "does not name"),
        "shard lacks an indexed tensor": (edit_index(lambda o: o["weight_map"].update({"ghost": shards[0]})),
                                          "lacks it"),
        "shard is a link": (relink, "cannot open"),
    }


def test_import_refuses_hostile_inputs(hub_dir: tuple[Path, dict[str, torch.Tensor]], base: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Each case through the CLI's entry point in this process (one through a real subprocess)."""
    from ckptd.cli import main
    hub, _ = hub_dir
    root = base / "hostile-root"
    for i, (what, (spoil, message)) in enumerate(_hostile_cases(hub).items()):
        d = base / f"hostile-{i}"
        shutil.copytree(hub, d)
        spoil(d)
        if i == 0:
            r = ckptd("import", str(d), str(root), "bad", "--step", str(i))
            rc, err = r.returncode, r.stderr
        else:
            rc, err = main(["import", str(d), str(root), "bad", "--step", str(i)]), capsys.readouterr().err
        assert rc == 1, what
        assert message in err and err.startswith("ckptd import: "), (what, err)
        assert not (root / "bad" / f"step-{i:012d}").exists(), what


def test_killed_export_leaves_nothing_at_out(mlp_step: Path, base: Path) -> None:
    """SIGKILL while the export writes (its temporary directory exists): OUT never appears."""
    out = base / "killed-out"
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "export", str(mlp_step), str(out), "--max-shard-size",
                             "1MB", "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and not list(base.glob(".killed-out.tmp-*/model-00002-of-*")):
            time.sleep(0.001)                    # until the second shard is being written
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the export finished before it could be killed"
    assert not out.exists()
    assert list(base.glob(".killed-out.tmp-*"))           # the half-written work is hidden beside OUT


def test_export_refuses_a_corrupt_chunk(saved: dict[str, Path], base: Path) -> None:
    step = base / "corrupt/ddp/step-000000000001"
    shutil.copytree(saved["ddp"], step)
    data = step / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF                                   # inside the first model tensor
    data.write_bytes(bytes(raw))
    r = ckptd("export", str(step), str(base / "corrupt-out"))
    assert r.returncode == 1 and "checksum" in r.stderr and not (base / "corrupt-out").exists()
    assert not list(base.glob(".corrupt-out.tmp-*"))


def test_split_matches_huggingface_hub_rule_for_rule() -> None:
    """Greedy fill in key order; a tensor over the limit alone in its shard, placed where it is met."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from ckptd.hf.layout import OutTensor, split
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        sizes = torch.randint(1, 40, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        sd = {f"t{i}": torch.zeros(n, dtype=torch.float32) for i, n in enumerate(sizes)}
        limit = int(torch.randint(8, 200, (1,), generator=g))
        hub = split_torch_state_dict_into_shards(sd, max_shard_size=limit)
        ours = split([OutTensor(k, k, "float32", "float32", tuple(v.shape)) for k, v in sd.items()], limit)
        assert {f: [t.name for t in ts] for f, ts in ours.files.items()} == hub.filename_to_tensors, trial
        assert ours.total_size == hub.metadata["total_size"]


def test_names_sizes_and_progress() -> None:
    import io

    from ckptd.core.sizes import parse_size
    from ckptd.hf.layout import canonical_name
    from ckptd.hf.progress import Progress
    assert canonical_name("module._orig_mod.layers.0._checkpoint_wrapped_module.w1.weight") == "layers.0.w1.weight"
    assert canonical_name("_fsdp_wrapped_module.embed.weight") == "embed.weight"
    assert (parse_size("5GB"), parse_size("1MB"), parse_size("2MiB"), parse_size(1234)) == (5 * 10**9, MB, 2**21, 1234)
    for bad in ("5XB", "-1MB", "MB", 1.5, True):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError, match="at least 1 bytes"):       # a shard limit (ckptd export) is > 0
        parse_size("0", minimum=1)
    out = io.StringIO()
    bar = Progress("export x", 200, enabled=True, stream=out)
    bar.update(200)
    bar.close()
    assert "100.0%" in out.getvalue() and out.getvalue().endswith("\n")
    quiet = io.StringIO()
    Progress("export x", 200, stream=quiet).close()       # StringIO is not a terminal
    assert quiet.getvalue() == ""


def test_load_hf_strict_names_the_mismatch(hub_dir: tuple[Path, dict[str, torch.Tensor]]) -> None:
    import ckptd_client
    hub, sd = hub_dir
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ckptd_client.CheckpointError, match="does not match the model: missing \\['weight', 'bias'\\]"):
        ckptd_client.load_hf(model, hub)
    m = llama()
    assert ckptd_client.load_hf(m, hub) == []
    assert_bit_equal(m.state_dict(), sd)


def test_load_hf_strict_takes_a_tied_weight_from_its_twin(tmp_path: Path) -> None:
    """transformers' save_pretrained writes tied weights once (GPT-2's lm_head.weight is
    transformer.wte.weight): strict load_hf refused every such checkpoint as missing
    lm_head.weight, which from_pretrained loads. A live tensor that is another loaded tensor
    (same storage, offset, shape, stride) is loaded with it; an untied one still counts as missing."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import ckptd_client
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    src = GPT2LMHeadModel(cfg)
    src.save_pretrained(tmp_path / "gpt2")
    assert "lm_head.weight" not in load_file(tmp_path / "gpt2" / "model.safetensors")
    torch.manual_seed(1)
    model = GPT2LMHeadModel(cfg)
    assert ckptd_client.load_hf(model, tmp_path / "gpt2") == []
    assert model.lm_head.weight is model.transformer.wte.weight
    assert_bit_equal(model.state_dict(), src.state_dict())
    untied = GPT2LMHeadModel(cfg)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    with pytest.raises(ckptd_client.CheckpointError, match=r"missing \['lm_head.weight'\]"):
        ckptd_client.load_hf(untied, tmp_path / "gpt2")
