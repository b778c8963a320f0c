# Two entry points: `make demo` (the main job) and `make test` (the default test run).
# Each builds the virtual environment from this repository's own files first.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The test modules run in two worker processes (pytest-xdist; a module's tests stay in one
# worker and share its fixtures; the demo's two modules, the longest, first). Test trainers wait
# 60 s to hear from a silent rank (tests/support/trainer.py), so one worker's stacks starving
# the other's ranks does not end a world. PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
# A run that hangs (a lost worker whose module xdist still waits for) is interrupted after
# TEST_TIMEOUT seconds, well past a default run's length, so it fails with pytest's summary
# instead of running into CI's limit. A test silent for 15 minutes dumps every thread's stack
# (faulthandler_timeout, pyproject.toml).
TEST_TIMEOUT ?= 2700

.PHONY: demo test lint typecheck protos venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints-cpu.txt scripts/bootstrap_venv.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/bootstrap_venv.sh
	touch $@

demo: $(STAMP)
	$(PY) -m examples.rl_loop

test: $(STAMP)
	timeout --signal=INT --kill-after=60 $(TEST_TIMEOUT) \
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
