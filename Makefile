# All set-up happens here: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch==2.13.0 first: on these machines it is a CPU build on local disk; pyproject keeps torch>=2.4.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test bench install install-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

$(VENV)/.installed-bench: $(VENV)/.installed
	$(PIP) install -q -e '.[bench]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: $(VENV)/.installed-bench
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
