# Two entry points: `make demo` (the main job) and `make test` (the default test run).
# Each builds the virtual environment from this repository's own files first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The default run spreads its test modules over worker processes (pytest-xdist; a module's
# tests stay in one worker and share its fixtures). In one process its multi-process tests
# leave a 2-core machine's second core idle much of the time: two workers took the run from
# 27 to 20.5 minutes there. Modules go out in collection order, the demo's (the
# longest) first: ordered by their number of tests (xdist's default) it started eight
# minutes in, and the run took 21:05 against 20:21. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2

.PHONY: demo test lint typecheck protos venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints-cpu.txt scripts/bootstrap_venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/bootstrap_venv.sh
	touch $@

demo: $(STAMP)
	$(PY) -m examples.rl_loop

test: $(STAMP)
	$(PY) -m pytest -m "not gpu and not slow" -n $(PYTEST_WORKERS) --dist loadscope \
		--no-loadscope-reorder $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

protos: $(STAMP)
	$(PY) -m trainer_refit.codegen

clean:
	rm -rf $(VENV)
