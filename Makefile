# Quickstart: `make bench` runs the benchmark harness, `make test` runs the test suite.
# Each sets up .venv on first use (scripts/setup_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH_ARGS ?=
TEST_ARGS ?=

.PHONY: setup bench test clean

$(VENV)/.tritonmoe-setup: pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)

setup: $(VENV)/.tritonmoe-setup

bench: setup
	$(PY) -m bench $(BENCH_ARGS)

test: setup
	$(PY) -m pytest $(TEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
