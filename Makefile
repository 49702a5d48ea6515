# Two commands do all the set-up: `make demo` and `make test`. Both are idempotent:
# the venv is created once and re-installed only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_ARGS ?=

.PHONY: demo test test-fast bench-check lint docs bench install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

# gemma 2.0.8 (Google's Linen Gemma, a model written by others for the sharding tests)
# without its declared dependencies: kauldron would pull in TensorFlow, and
# gemma.transformer needs only flax, jax and orbax.
$(VENV)/.installed-test: pyproject.toml Makefile $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps gemma==2.0.8
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(PY) examples/language_modeling/train.py $(DEMO_ARGS)

# The full gate (CI): lint, then every test that starts no Ray in 2 processes (the inner
# loop's tiers and the slow runs of one process), then the tests that start a Ray
# cluster in one (each of their runs starts processes of its own). The benchmark
# scripts' tiny runs are left to bench-check.
# The tests without Ray compile at LLVM -O0 without its expensive passes: their programs
# are tiny and compiled once or twice each, and XLA:CPU then compiles them about a
# quarter faster (the non-Ray tier: 30 -> 18 minutes on 2 cores), with the same results
# (LLVM reorders no floating-point arithmetic at any level without fast-math). Not the
# cluster runs: code at -O0 runs slower, and the planner chooses its plan from timings
# (a MAML run picked micro-batches of 1 there).
FAST_COMPILE = --xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true

# The sampler's tests (marked "alone") run in a process of their own, without the
# persistent compilation cache: in a pytest-xdist worker that had run a few hundred
# tests before them, XLA crashed three clean runs out of six (2026-12-07 and -08, CI's
# among them) while compiling or serializing a Sampler's program (a segmentation
# fault in backend_compile_and_load or executable.serialize()), never when they ran
# on their own.
test: lint docs
	XLA_FLAGS='$(FAST_COMPILE)' $(PY) -m pytest -q -n 2 -m "not ray and not bench and not alone" --durations=20
	XLA_FLAGS='$(FAST_COMPILE)' JAX_ENABLE_COMPILATION_CACHE=false $(PY) -m pytest -q -m "alone and not ray and not bench" --durations=5
	$(PY) -m pytest -q -m "ray and not bench" --durations=20

# Every benchmark script at a tiny size: that each still runs and writes valid figures
# (about 7 minutes on 2 cores). Run it after changing a benchmark or an API one calls.
bench-check: lint
	$(PY) -m pytest -q -n 2 -m "bench and not ray" tests/test_benchmarks.py
	$(PY) -m pytest -q -m "bench and ray" tests/test_benchmarks.py

# The inner loop: lint, then everything but the Ray-cluster and slow end-to-end tiers,
# in 2 processes (about 10 minutes on 2 cores).
test-fast: lint
	XLA_FLAGS='$(FAST_COMPILE)' $(PY) -m pytest -q -n 2 -m "not slow and not ray"

lint: install-test
	$(PY) -m ruff check .

# The documentation site (mkdocs.yml), built as CI builds it: any warning (a broken
# link, a page missing from the nav, a docstring mkdocstrings cannot render) fails.
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir .site

bench: install-test
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .site
