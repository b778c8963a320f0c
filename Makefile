# Two entry points: `make demo` (the main job) and `make test` (the default test run).
# Each builds the virtual environment from this repository's own files first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck protos venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints-cpu.txt scripts/bootstrap_venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/bootstrap_venv.sh
	touch $@

demo: $(STAMP)
	$(PY) -m examples.rl_loop

test: $(STAMP)
	$(PY) -m pytest -m "not gpu and not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

protos: $(STAMP)
	$(PY) -m trainer_refit.codegen

clean:
	rm -rf $(VENV)
