# One command each (see README): `make demo` and `make test` set everything up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# Python 3.12 (megatron-core >= 0.17 needs it): python3.12 on PATH if it really runs (a pyenv shim
# for a version that is not selected does not), else pyenv's own install. Evaluated only when used.
PYTHON312 ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(wildcard /root/.pyenv/versions/3.12*/bin/python3.12),$(shell $(p) -c 'import sys; print(sys.executable if sys.version_info[:2] == (3, 12) else "")' 2>/dev/null)))

# Older megatron-core releases tested beside the primary one (python/requirements-test.txt): each
# is installed without dependencies into $(VENV)/mcore/<version> and put first on PYTHONPATH.
MCORE_MATRIX := 0.13.1 0.15.0 0.16.1
MCORE_DIRS := $(foreach v,$(MCORE_MATRIX),$(VENV)/mcore/$(v)/.installed)
# A side venv with torch 2.3.1 (the oldest torch whose DCP must load our output).
TORCH231 := $(VENV)/torch231

.PHONY: setup setup-test build demo test test-matrix

# The stamp names the Python version: a venv made by another Python (the 3.11 one of earlier
# releases) is removed and made again, never layered on.
$(VENV)/.installed-py312: python/requirements-test.txt python/requirements-quant-ref.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (looked for python3.12 on PATH and in ~/.pyenv/versions/3.12*); install it, or pass PYTHON312=/path/to/python3.12" >&2; exit 1; }
	@if ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then \
		echo "creating $(VENV) with $(PYTHON312)"; rm -rf $(VENV) && $(PYTHON312) -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r python/requirements-test.txt
	$(PY) -m pip install -q --no-deps -r python/requirements-quant-ref.txt
	touch $@

$(VENV)/mcore/%/.installed: $(VENV)/.installed-py312
	rm -rf $(VENV)/mcore/$*
	$(PY) -m pip install -q --no-deps --target $(VENV)/mcore/$* megatron-core==$*
	touch $@

$(TORCH231)/.installed: python/requirements-torch231.txt $(VENV)/.installed-py312
	rm -rf $(TORCH231)
	$(PYTHON312) -m venv $(TORCH231)
	$(TORCH231)/bin/python -m pip install -q --no-deps -r python/requirements-torch231.txt
	touch $@

# The demo needs the main venv only; the tests also need the older releases and torch 2.3.1.
setup: $(VENV)/.installed-py312
setup-test: setup $(MCORE_DIRS) $(TORCH231)/.installed

# Builds the Rust extension and installs the package (and the `shardwise` command) into the venv.
# Not -q: the first build takes minutes (BENCHMARKS.md "Build time") and cargo's lines show it moving.
build: setup
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release

demo: build
	$(PY) python/examples/demo_megatron.py

# The version matrix: the same test file once per older megatron-core (the primary one runs it in
# the full suite). SHARDWISE_MCORE tells the tests which version they must find.
# The oldest release also loads from-hf's output (issue 23: a release of the matrix besides 0.19).
define run_matrix
	@for v in $(MCORE_MATRIX); do \
		echo "== megatron-core $$v"; \
		PYTHONPATH=$(abspath $(VENV))/mcore/$$v SHARDWISE_MCORE=$$v $(PY) -m pytest -q python/tests/test_megatron_versions.py || exit 1; \
	done
	PYTHONPATH=$(abspath $(VENV))/mcore/$(firstword $(MCORE_MATRIX)) SHARDWISE_MCORE=$(firstword $(MCORE_MATRIX)) \
		$(PY) -m pytest -q python/tests/test_from_hf.py -k megatron_loads_it_strictly
endef

test-matrix: build setup-test
	$(run_matrix)

test: build setup-test
	$(PY) tools/long_functions.py
	cargo test --release
	$(PY) -m pytest python/tests
	$(run_matrix)
