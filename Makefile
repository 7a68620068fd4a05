# Set-up is part of every target: a fresh machine with Python 3.11 needs nothing else.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
export TF_CPP_MIN_LOG_LEVEL ?= 2
export PYTHONWARNINGS ?= ignore::DeprecationWarning
# Backend of `make demo` and `make bench`: `make demo BACKEND=tensorflow`.
BACKEND ?= jax

.PHONY: demo test test-all test-jax test-tensorflow bench bench-quick bench-peers env clean install-check

env: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# uv resolves the same versions from PyPI as pip and downloads them in
	# parallel: 20 s instead of 90 s on a fresh machine (measured). pip is the
	# fallback wherever uv cannot be installed. Bytecode compiled at install, as
	# pip does: with PYTHONDONTWRITEBYTECODE set, every test child would
	# otherwise compile Keras and JAX from source (a resume job 10.7 -> 15.8 s).
	( $(BIN)/python -m pip install -q uv && \
	  $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e ".[dev]" ) || \
	( $(BIN)/python -m pip install -q --upgrade pip && \
	  $(BIN)/python -m pip install -q -e ".[dev]" )
	# The native CPU kernels (sparseopt/native), compiled here once; were the
	# compiler missing, sparseopt would run its pure path (and say so).
	$(BIN)/python -m sparseopt.native || echo "sparseopt: native kernels not built (pure path)"
	touch $(STAMP)

demo: $(STAMP)
	KERAS_BACKEND=$(BACKEND) $(BIN)/python examples/dlrm_synthetic.py

# `make test`: the whole suite on JAX and on TensorFlow. Tests marked
# `backend_independent` (configuration round trips; child processes that pick
# their own backend) run once, in the TensorFlow session; those also marked
# `jax_session` run once in the JAX session instead, to balance the two.
# `make test-all`: the same with the thorough cases: every configuration of
# each registry-driven test where `make test` runs one of each kind (tests
# marked `thorough`, `tests/helpers.kinds`), the child jobs at full scope
# (SPARSEOPT_THOROUGH=1: every sharded layout, every resume variant), and
# 1000 Hypothesis examples per backend instead of 40.
PYTEST_ARGS ?=
SUITE ?= and not thorough
# JAX's persistent compilation cache, shared by both sessions and the child
# processes they start (resume, examples, sharded jobs compile the same steps
# again): 116 -> 88 s for tests/test_resume.py on JAX, measured from cold.
# Keyed by the program, devices and JAX version, so it never changes a result.
# Every program, however quick to compile: tests build many small ones twice.
JAX_CACHE = JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.pytest_tmp/jax_cache \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
# Compiling dominates the suite's time (14 of 23 s in tests/test_dispatch.py on
# JAX, measured with cProfile; a train step compiles in 0.3-0.4 s, in 2.5-6 s
# over 8 devices). The tests' XLA programs skip LLVM's optimizations
# (--xla_backend_optimization_level=0: 25% less compile time) and use
# XLA:CPU's legacy code emitters instead of its MLIR fusion emitters
# (--xla_cpu_use_fusion_emitters=false: a train step compiles in 0.13 s instead
# of 0.29 s; test_dispatch, test_no_vocab_work and test_update_rules on JAX
# 117 -> 74 s). They change how XLA generates code, not what it computes: at
# most the last bits of a float result. The emitters also decide some fusions
# (hence buffers), so the checks that read a compiled program (buffers,
# aliasing, collectives) compile it with the default emitters
# (tests/helpers.py, XLA_PRODUCTION_FUSIONS). `make demo` and the benchmarks
# compile at the defaults.
# A child that mostly runs steps (the soak: 7,000 of them) drops these flags
# (`tests/helpers.child_env(test_xla=False)`): 38.7 -> 22.7 s, measured.
TEST_XLA_FLAGS = --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false
TEST_XLA = SPARSEOPT_TEST_XLA_FLAGS="$(TEST_XLA_FLAGS)" XLA_FLAGS="$(TEST_XLA_FLAGS) $(XLA_FLAGS)"

# The two backends run side by side, each printing its whole output when it
# ends, each on its own half of the processors this process may use (`taskset`,
# where there is one): left to share them, their thread pools (XLA's, TF's, the
# child processes') contend: on this 2-core machine, from a fresh clone, the
# sessions took 10:06 (TensorFlow) and 10:15 (JAX), and `make test` 11:26 with
# the install; pinned, 9:03 and 9:54, and 10:52. `make test-jax` and
# `make test-tensorflow` alone pin nothing.
# (JAX's, the longer session, takes the larger half of an odd count; no list, no pin.)
pin_cpus = $(shell $(PYTHON) -c "import os; c = sorted(os.sched_getaffinity(0)); \
	h = (len(c) + 1) // 2; print(','.join(map(str, (c[:h], c[h:] or c)[$(1)])))" 2>/dev/null)
pin = $(if $(shell command -v taskset),$(if $(call pin_cpus,$(1)),taskset -c $(call pin_cpus,$(1))))
JAX_PIN ?=
TF_PIN ?=
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-jax test-tensorflow \
		JAX_PIN="$(call pin,0)" TF_PIN="$(call pin,1)"

test-all: $(STAMP)
	SPARSEOPT_THOROUGH=1 $(MAKE) --no-print-directory -j2 --output-sync=target test-jax \
		test-tensorflow PYTEST_ARGS="--hypothesis-profile=full" SUITE="" \
		JAX_PIN="$(call pin,0)" TF_PIN="$(call pin,1)"

test-jax: $(STAMP)
	mkdir -p .pytest_tmp
	$(JAX_PIN) env $(JAX_CACHE) $(TEST_XLA) KERAS_BACKEND=jax $(BIN)/python -m pytest \
		--basetemp=.pytest_tmp/jax -m "not backend_independent $(SUITE)" $(PYTEST_ARGS)

test-tensorflow: $(STAMP)
	mkdir -p .pytest_tmp
	$(TF_PIN) env $(JAX_CACHE) $(TEST_XLA) KERAS_BACKEND=tensorflow $(BIN)/python -m pytest \
		--basetemp=.pytest_tmp/tensorflow \
		-m "not jax_session $(SUITE)" $(PYTEST_ARGS)

# The benchmark suite (docs/benchmarks.md): full run ~45 min + the production-shaped
# grid (dlrm_step.py) ~40 min + every updater (updaters.py) ~3 min + table precision
# (precision.py, both backends) ~15 min + open vocabularies (open_vocabulary.py) ~4 min;
# quick ~12 min.
bench: $(STAMP)
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/dlrm_step.py
	$(BIN)/python benchmarks/updaters.py
	KERAS_BACKEND=jax $(BIN)/python benchmarks/precision.py
	KERAS_BACKEND=tensorflow $(BIN)/python benchmarks/precision.py
	KERAS_BACKEND=jax $(BIN)/python benchmarks/open_vocabulary.py
	KERAS_BACKEND=tensorflow $(BIN)/python benchmarks/open_vocabulary.py

bench-quick: $(STAMP)
	$(BIN)/python benchmarks/run.py --quick
	$(BIN)/python benchmarks/dlrm_step.py --quick
	$(BIN)/python benchmarks/updaters.py --quick
	KERAS_BACKEND=jax $(BIN)/python benchmarks/precision.py --quick
	KERAS_BACKEND=tensorflow $(BIN)/python benchmarks/precision.py --quick
	KERAS_BACKEND=jax $(BIN)/python benchmarks/open_vocabulary.py --quick
	KERAS_BACKEND=tensorflow $(BIN)/python benchmarks/open_vocabulary.py --quick

# Installed as users install it (not part of `make test`): the wheel built from
# this checkout, installed with its extras into a fresh virtual environment, and
# a small model trained on each backend from outside the checkout, with an empty
# kernel cache (tests/jobs/install_check.py). Catches packaging mistakes: a
# missing package file, a dependency left out, kernels built into the package.
INSTALL_TMP ?= $(or $(TMPDIR),/tmp)/sparseopt-install-check
install-check: $(STAMP)
	rm -rf $(INSTALL_TMP) build && mkdir -p $(INSTALL_TMP)/run
	$(BIN)/python -m pip wheel -q --no-deps -w $(INSTALL_TMP)/dist .
	rm -rf build  # (setuptools' staging: a stale copy there could hide a missing file)
	$(PYTHON) -m venv $(INSTALL_TMP)/venv
	( $(BIN)/uv pip install -q --python $(INSTALL_TMP)/venv/bin/python \
	    "$$(ls $(INSTALL_TMP)/dist/sparseopt-*.whl)[jax,tensorflow]" ) || \
	( $(INSTALL_TMP)/venv/bin/python -m pip install -q \
	    "$$(ls $(INSTALL_TMP)/dist/sparseopt-*.whl)[jax,tensorflow]" )
	cp tests/jobs/install_check.py $(INSTALL_TMP)/run/
	for backend in jax tensorflow; do \
	  ( cd $(INSTALL_TMP)/run && unset SPARSEOPT_NATIVE_DIR SPARSEOPT_NATIVE && \
	    XDG_CACHE_HOME=$(INSTALL_TMP)/cache KERAS_BACKEND=$$backend \
	    $(INSTALL_TMP)/venv/bin/python install_check.py $(CURDIR) ) || exit 1; \
	done

# Optional peers for the suite's TorchRec/FBGEMM rows (CPU builds, ~1 GB).
bench-peers: $(STAMP)
	$(BIN)/python -m pip install -q torch==2.13.0 fbgemm-gpu-cpu==1.8.0

clean:
	rm -rf $(VENV) .pytest_cache .pytest_tmp .hypothesis *.egg-info build
