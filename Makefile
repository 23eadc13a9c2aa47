# One command each (see README): `make demo` and `make test` set everything up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup build demo test

$(VENV)/.installed: python/requirements-test.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r python/requirements-test.txt
	touch $@

setup: $(VENV)/.installed

# Builds the Rust extension and installs the package (and the `shardwise` command) into the venv.
build: setup
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release -q

demo: build
	$(PY) python/examples/demo_megatron.py

test: build
	cargo test --release
	$(PY) -m pytest python/tests
