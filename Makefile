# Set-up is part of every target: a fresh machine with Python 3.11 needs nothing else.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONWARNINGS ?= ignore::DeprecationWarning
# Backend of `make demo` and `make bench`: `make demo BACKEND=tensorflow`.
BACKEND ?= jax

.PHONY: demo test test-jax test-tensorflow bench bench-quick bench-peers env clean

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	KERAS_BACKEND=$(BACKEND) $(BIN)/python examples/dlrm_synthetic.py

test: test-jax test-tensorflow

test-jax: $(STAMP)
	KERAS_BACKEND=jax $(BIN)/python -m pytest

test-tensorflow: $(STAMP)
	KERAS_BACKEND=tensorflow $(BIN)/python -m pytest

# The benchmark suite (docs/benchmarks.md): full run ~45 min, quick < 3 min.
bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/run.py --quick

# Optional peers for the suite's TorchRec/FBGEMM rows (CPU builds, ~1 GB).
bench-peers: $(STAMP)
	$(BIN)/python -m pip install -q torch==2.13.0 fbgemm-gpu-cpu==1.8.0

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
