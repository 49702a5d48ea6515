# Two commands do all the set-up: `make demo` and `make test`. Both are idempotent:
# the venv is created once and re-installed only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_ARGS ?=

.PHONY: demo test bench install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(PY) examples/language_modeling/train.py $(DEMO_ARGS)

test: install-test
	$(PY) -m pytest -q

bench: install-test
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
