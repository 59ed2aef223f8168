"""Prometheus metrics: scrape a real daemon's HTTP endpoint after real saves."""
# mypy: disable-error-code="union-attr,index,operator"
# (replies and pipes are Optional in their types; a None there fails the test, as it should)
from __future__ import annotations

import socket
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import ckptd_client
from ckptd.core import protocol
from ckptd.daemon import shm


def scrape(address: str) -> dict[str, float]:
    """sample name{labels} → value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_metric(address: str, name: str, at_least: float, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(address)
        if m.get(name, 0) >= at_least or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_metrics_off_by_default(daemon):
    st = protocol.request_once(str(daemon.socket), {"op": "status"})
    assert st["metrics"] is None


def test_metrics_after_saves(daemon_factory):
    # a bare port: loopback, ephemeral; every chunk encoded (adaptive would store them raw on a fast disk)
    d = daemon_factory("--metrics-address", "0", "--codec", "zstd", "--codec-mode", "always")
    st = protocol.request_once(str(d.socket), {"op": "status"})
    address = st["metrics"]
    assert address.startswith("127.0.0.1:")

    before = scrape(address)
    assert before["ckptd_saves_started_total"] == 0 and before["ckptd_queue_depth"] == 0
    assert before["ckptd_slot_memory_limit_bytes"] > 0

    ck = ckptd_client.Checkpointer("met", socket=str(d.socket))
    state = {"w": torch.zeros(256, 256), "b": torch.arange(1000, dtype=torch.float32)}
    for step in (1, 2):
        ck.save(step, state).wait(60)
    wait_metric(address, "ckptd_client_stall_seconds_count", 2)   # reports are fire-and-forget
    # 'committed' reaches the client just before the daemon's write task itself finishes.
    deadline = time.monotonic() + 30
    while (m := scrape(address))["ckptd_queue_depth"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)

    assert m["ckptd_saves_started_total"] == 2
    assert m["ckptd_saves_durable_total"] == 2 and m["ckptd_saves_failed_total"] == 0
    assert m["ckptd_steps_committed_total"] == 2
    raw = (256 * 256 + 1000) * 4 * 2
    assert m["ckptd_bytes_raw_total"] == raw
    assert 0 < m["ckptd_bytes_stored_total"] < raw          # zeros and a ramp compress
    assert m["ckptd_compression_ratio_overall"] == pytest.approx(raw / m["ckptd_bytes_stored_total"])
    assert m["ckptd_compression_ratio_count"] == 2
    assert m["ckptd_write_throughput_bytes_per_second_count"] == 2
    assert m["ckptd_shard_write_seconds_count"] == 2
    assert m["ckptd_commit_latency_seconds_count"] == 2
    assert m["ckptd_client_stall_seconds_count"] == 2 and m["ckptd_client_stall_seconds_sum"] > 0
    assert m["ckptd_client_fence_seconds_count"] == 2
    assert m['ckptd_last_committed_step{job="met"}'] == 2
    assert m['ckptd_last_commit_timestamp_seconds{job="met"}'] > 0
    assert m["ckptd_sessions"] == 1 and m["ckptd_slot_memory_bytes"] > 0
    assert m["ckptd_queue_depth"] == 0 and m["ckptd_steps_in_flight"] == 0
    assert m['ckptd_build_info{version="0.1.0"}'] == 1
    ck.close()


def test_report_op_recorded_in_status_and_metrics(daemon_factory):
    d = daemon_factory("--metrics-address", "127.0.0.1:0")
    address = protocol.request_once(str(d.socket), {"op": "status"})["metrics"]
    s = protocol.connect(str(d.socket))
    rx = protocol.FrameReceiver(s)
    try:
        protocol.send_frame(s, {"op": "report", "req": 1, "step": 1, "stall_s": 0.1, "fence_s": 0.0})
        assert rx.read()["op"] == "error"                         # hello first
        protocol.send_frame(s, {"op": "hello", "req": 2, "job": "rep", "rank": 0, "world_size": 1,
                                "pid": 1, "slot_bytes": 0, "num_slots": 0})
        assert rx.read()["op"] == "ok"
        protocol.send_frame(s, {"op": "report", "req": 3, "step": 9, "stall_s": 0.75, "fence_s": 0.25})
        assert rx.read() == {"op": "ok", "req": 3, "step": 9}
        protocol.send_frame(s, {"op": "report", "req": 4, "step": 9, "stall_s": -1, "fence_s": 0})
        bad = rx.read()
        assert bad["op"] == "error" and "non-negative" in bad["reason"]
        protocol.send_frame(s, {"op": "report", "req": 5, "step": 9, "stall_s": 10**400, "fence_s": 0})
        huge = rx.read()                                            # beyond every float: refused, not internal
        assert huge["op"] == "error" and huge["code"] == "refused" and "non-negative" in huge["reason"]
        for req, step in ((6, 10**300), (7, -1)):                 # not a step: refused, not echoed or recorded
            protocol.send_frame(s, {"op": "report", "req": req, "step": step, "stall_s": 0.5, "fence_s": 0})
            assert rx.read() == {"op": "error", "req": req, "code": "refused",
                                 "reason": "report: step must be a step number (0..999999999999)"}
            protocol.send_frame(s, {"op": "abort", "req": 10 + req, "step": step, "reason": "x"})
            assert rx.read() == {"op": "error", "req": 10 + req, "code": "refused",
                                 "reason": "abort: step must be a step number (0..999999999999)"}
        st = protocol.request_once(str(d.socket), {"op": "status"})
        [sess] = [x for x in st["sessions"] if x["job"] == "rep"]
        assert sess["last_report"] == {"step": 9, "stall_s": 0.75, "fence_s": 0.25}
        m = scrape(address)
        assert m["ckptd_client_stall_seconds_count"] == 1 and m["ckptd_client_stall_seconds_sum"] == 0.75
        assert m['ckptd_client_stall_seconds_bucket{le="1.0"}'] == 1
        assert m['ckptd_client_stall_seconds_bucket{le="0.5"}'] == 0
    finally:
        s.close()


def test_metrics_port_in_use_fails_at_start(tmp):
    from conftest import start_daemon
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        with pytest.raises(RuntimeError) as e:
            start_daemon(tmp / "root", tmp / "m.sock", "--metrics-address", f"127.0.0.1:{port}")
        assert f"cannot serve metrics on 127.0.0.1:{port}" in str(e.value)
    finally:
        busy.close()


def test_structured_json_logs_carry_job_rank_step(daemon_factory):
    import json
    d = daemon_factory("--log-format", "json")          # overrides the fixture's plain format
    ck = ckptd_client.Checkpointer("logs", socket=str(d.socket))
    ck.save(3, {"w": torch.ones(10)}).wait(60)
    ck.close()
    d.kill(15)
    records = [json.loads(line) for line in d.log_text().splitlines() if line.startswith("{")]
    assert records and all({"ts", "level", "msg"} <= set(r) for r in records)
    by_msg = {r["msg"]: r for r in records}
    for msg in ("writing", "durable"):
        assert by_msg[msg]["job"] == "logs" and by_msg[msg]["rank"] == 0 and by_msg[msg]["step"] == 3
    assert by_msg["committed"]["job"] == "logs" and by_msg["committed"]["step"] == 3
    assert by_msg["session"]["job"] == "logs" and by_msg["session"]["rank"] == 0
    assert by_msg["stopped"]["steps_committed"] == 1


def test_ckptd_status_shows_ranks_progress_and_last_committed(daemon_factory, capsys):
    import json

    from ckptd.cli import main
    d = daemon_factory("--chunk-mib", "1", "--debug-write-delay", "1")

    def status(*extra: str) -> str:
        capsys.readouterr()
        assert main(["status", "--socket", str(d.socket), *extra]) == 0
        return capsys.readouterr().out

    ck = ckptd_client.Checkpointer("st", socket=str(d.socket))
    ck.save(1, {"w": torch.zeros(4)}).wait(60)
    h = ck.save(2, {"w": torch.randn(1024, 1024)})        # 4 chunks x 1 s of writing
    out = status()
    assert not h.done()
    assert "saves in flight: 1" in out
    assert "job=st step=2 rank=0 written" in out and "of 4.0 MiB raw" in out
    assert "job=st rank=0/1" in out
    assert "last committed step per job:\n  st: 1" in out
    h.wait(60)
    out = status()
    assert "saves in flight: 0" in out
    assert "last committed step per job:\n  st: 2" in out
    js = json.loads(status("--json"))
    assert js["last_committed"]["st"]["step"] == 2
    mode = shm.node_mode()                            # this node's (the daemon reads the same file)
    assert js["shmem_huge_pages"] == mode
    assert f"shared memory pages: {'huge where the kernel can' if mode in shm.HUGE_MODES else '4 KiB'} " \
        f"(memfds, transparent_hugepage/shmem_enabled {mode}" in out
    ck.close()
    capsys.readouterr()
    assert main(["status", "--socket", str(d.socket) + ".nope"]) == 1
    assert "cannot reach the ckptd daemon" in capsys.readouterr().err
    d.stop()                     # a restarted daemon knows the root's jobs: it said "none" until a new commit
    (d.root / "backup").mkdir()  # (a directory with no step is no job to list)
    d = daemon_factory(root=d.root)
    assert "last committed step per job:\n  st: 2\n" in status()
    js = json.loads(status("--json"))
    assert js["last_committed"] == {"st": {"step": 2, "committed_here_unix": None}}
    assert js["last_committed_partial"] is False
    for i in range(1000):        # past the scan's cap: said, not silently cut
        (d.root / f"zz{i:04d}").mkdir()
    assert "last committed step per job: (the root's first 1000 jobs only)\n  st: 2\n" in status()


def test_a_fatal_start_error_is_a_log_line_in_the_log_s_format(tmp):
    """With --log-format json, the one line a pipeline most needs (why the daemon could not start: here,
    the metrics port taken) was printed as plain text. It is now a JSON log line like every other."""
    import json
    import socket
    import subprocess
    import sys
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--root", str(tmp / "root"), "--socket",
                            str(tmp / "d.sock"), "--log-format", "json", "--metrics-address", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert r.returncode == 1, r.stderr
    lines = [json.loads(ln) for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]   # every line is JSON
    fatal = [ln for ln in lines if ln["msg"] == "cannot start"]
    assert fatal and fatal[0]["level"] == "error" and "cannot serve metrics" in fatal[0]["error"], lines


def test_memory_level_saves_counted_apart_from_storage_writes(daemon_factory, capsys):
    """save(level="memory") holds raw bytes, never compressed or written: it is in its own counters
    (ckptd_memory_level_*), not in the storage saves, bytes, ratio, write histograms or per-job gauges."""
    from ckptd.cli import main
    d = daemon_factory("--metrics-address", "0")
    address = protocol.request_once(str(d.socket), {"op": "status"})["metrics"]
    ck = ckptd_client.Checkpointer("ml", socket=str(d.socket))
    state = {"w": torch.randn(1 << 18)}                    # 1 MiB, random: stored about raw
    ck.save(10, state).wait(60)
    for step in (11, 12, 13):
        ck.save(step, state, level="memory").wait(60)
    deadline = time.monotonic() + 30
    while (m := scrape(address))["ckptd_queue_depth"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    raw = 1 << 20
    assert m["ckptd_saves_started_total"] == 1 and m["ckptd_saves_durable_total"] == 1
    assert m["ckptd_steps_committed_total"] == 1
    assert m["ckptd_bytes_raw_total"] == raw
    assert m["ckptd_compression_ratio_overall"] == pytest.approx(raw / m["ckptd_bytes_stored_total"])
    assert m["ckptd_compression_ratio_overall"] < 1.2                  # (was ~4: three unwritten shards in it)
    assert m["ckptd_compression_ratio_count"] == 1
    assert m["ckptd_write_throughput_bytes_per_second_count"] == 1 and m["ckptd_shard_write_seconds_count"] == 1
    assert m["ckptd_memory_level_saves_started_total"] == 3 and m["ckptd_memory_level_saves_held_total"] == 3
    assert m["ckptd_memory_level_saves_failed_total"] == 0 and m["ckptd_memory_level_bytes_held_total"] == 3 * raw
    assert m["ckptd_memory_level_steps_committed_total"] == 3
    assert m['ckptd_memory_level_last_committed_step{job="ml"}'] == 13
    assert m['ckptd_last_committed_step{job="ml"}'] == 10             # storage steps only
    assert not [k for k in m if "_memory\"" in k or "/_memory" in k], [k for k in m if "/_memory" in k]
    assert m['ckptd_host_bytes{job="ml",kind="held"}'] > 0
    st = protocol.request_once(str(d.socket), {"op": "status"})
    assert list(st["last_committed"]) == ["ml"] and st["stats"]["saves_durable"] == 1
    assert list(st["host_bytes"]) == ["ml"], st["host_bytes"]      # not "ml/_memory" beside it
    level = st["memory"]["memory_level"]
    assert level["saves_held"] == 3 and level["last_committed"]["ml"]["step"] == 13
    capsys.readouterr()
    assert main(["status", "--socket", str(d.socket)]) == 0
    out = capsys.readouterr().out
    assert "last committed step per job:\n  ml: 10\n" in out
    assert "memory-level saves: held=3 failed=0 (3.0 MiB held, never written), steps committed=3 failed=0; " \
        "newest ml@13" in out
    ck.close()
