# Quickstart: `make bench` runs the benchmark harness, `make test` runs the test suite.
# Each sets up .venv on first use (scripts/setup_env.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH_ARGS ?=
TEST_ARGS ?=
# make fuzz: every hypothesis property, random examples, FUZZ_FACTOR x its CI count; no property
# starts after FUZZ_BUDGET_S seconds, and the whole run is killed at twice that (tests/_fuzz.py).
FUZZ_FACTOR ?= 10
FUZZ_BUDGET_S ?= 1200

CHECK_ARGS ?=

.PHONY: setup bench test fuzz clean gpu-check gpu-profile

$(VENV)/.tritonmoe-setup: pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)

setup: $(VENV)/.tritonmoe-setup

bench: setup
	$(PY) -m bench $(BENCH_ARGS)

test: setup
	bash scripts/run_tests.sh $(PY) $(TEST_ARGS)

# GPU verification on one H100/H200 (no network needed; under 9 minutes): the gpu-marked tests,
# the harness's core set against roofs and baselines measured in the same run, and the target
# table; writes bench/results/<gpu>-<date>.{json,md}. Without a GPU it runs end to end at CPU
# stand-in shapes and says that the GPU targets are skipped. On a copy of the tree without .git,
# name the commit: make gpu-check TRITONMOE_BENCH_COMMIT=<sha>.
gpu-check: setup
	$(PY) -m bench check $(CHECK_ARGS)

# The same shapes under the PyTorch profiler: the kernels each entry launches, time per call.
gpu-profile: setup
	$(PY) -m bench profile $(CHECK_ARGS)

fuzz: setup
	HYPOTHESIS_PROFILE=fuzz TRITONMOE_FUZZ_FACTOR=$(FUZZ_FACTOR) TRITONMOE_FUZZ_BUDGET_S=$(FUZZ_BUDGET_S) \
		timeout -k 30 $$(( 2 * $(FUZZ_BUDGET_S) )) $(PY) -m pytest -q $(TEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
