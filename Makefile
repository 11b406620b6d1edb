# make run: set up .venv (once) and replay the bundled sample.  make test: the whole suite (with the
# CI-sized fuzz run).  make fuzz: the long fuzz run (FUZZ_EXAMPLES random cases per command).
# make test-vllm: tests/vllm against each of VLLM_VERSIONS' own code on CPU (a matrix: one release per hook table,
# the newest pre-fix one first), each in its own venv ~/.cache/dcptool-vllm-<version> (built once, ~90 s and 3 GB each).
# make test-oldest: the non-fuzz, non-kernel tests on the oldest numpy pyproject.toml claims (CPU torch 2.13), numpy
# warnings as errors, less tests/engine (the engine's host path still runs there through simulate's recordings),
# tests/vllm, tests/report, test_cli, test_docs, test_limits, test_architecture and test_cubin (Triton compiles, no numpy;
# all run under make test; left out here so that CI keeps under 10 minutes); its own venv .venv-oldest (built once, ~40 s), then about 70 seconds.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
SAMPLE ?= samples/legacy.safetensors
VLLM_VERSIONS ?= 0.29.0 0.30.0 0.33.0 0.34.0
FUZZ_EXAMPLES ?= 10000
# pytest workers (pytest-xdist): one per core
JOBS ?= auto

NUMPY_OLDEST ?= 1.24.4
OLDEST := .venv-oldest

.PHONY: run test venv lint test-vllm bench fuzz test-oldest

venv: $(STAMP)

# CPU torch first (the build on this machine's disk): a bare `torch` requirement in a fresh venv
# would otherwise pull a multi-GB CUDA build. Any torch >= 2.4 already installed is kept.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/dcptool replay $(SAMPLE); rc=$$?; test $$rc -le 1

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n $(JOBS) -m "not kernel"
	@echo "--- the kernel tests, under the Triton interpreter (TRITON_INTERPRET=1 from the start; a GPU machine runs them compiled)"
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(JOBS) -m kernel

$(OLDEST)/.installed-stamp: pyproject.toml
	test -x $(OLDEST)/bin/python || $(PY) -m venv $(OLDEST)
	$(OLDEST)/bin/python -c "import torch" 2>/dev/null || $(OLDEST)/bin/python -m pip install -q torch==2.13.0
	$(OLDEST)/bin/python -m pip install -q -e '.[test]' numpy==$(NUMPY_OLDEST)
	touch $@

test-oldest: $(OLDEST)/.installed-stamp
	$(OLDEST)/bin/python -c "import numpy; assert numpy.__version__ == '$(NUMPY_OLDEST)', numpy.__version__"
	$(OLDEST)/bin/python -m pytest -q -n $(JOBS) -p no:cacheprovider -W error::DeprecationWarning -W error::RuntimeWarning \
		--ignore=tests/test_fuzz.py --ignore=tests/test_reliability.py --ignore=tests/engine --ignore=tests/vllm \
		--ignore=tests/test_limits.py --ignore=tests/test_architecture.py --ignore=tests/report \
		--ignore=tests/test_cli.py --ignore=tests/test_docs.py --ignore=tests/gpu/test_cubin.py -m "not kernel"

test-vllm:
	@failed=""; for v in $(VLLM_VERSIONS); do \
	  venv=$(HOME)/.cache/dcptool-vllm-$$v; \
	  echo "--- vLLM $$v"; \
	  { VLLM_VERSION=$$v VLLM_VENV=$$venv tools/setup_vllm_env.sh && \
	    DCPTOOL_TEST_VLLM=1 $$venv/bin/python -m pytest -q -p no:cacheprovider tests/vllm; } || failed="$$failed $$v"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-vllm failed on vLLM$$failed"; exit 1; fi; echo "test-vllm passed on vLLM $(VLLM_VERSIONS)"

# Not derandomized: every run tries new cases; a failure prints the @reproduce_failure line to replay it.
fuzz: $(STAMP)
	DCPTOOL_FUZZ=long DCPTOOL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q tests/test_fuzz.py tests/test_reliability.py
