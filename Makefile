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
MEMORY_ARGS ?=
GPU_TESTS_ARGS ?=

OUT ?= /tmp/gpu-out
PEER_WHEELS ?= liger-kernel

.PHONY: setup bench test fuzz clean gpu-check gpu-profile gpu-memory gpu-tests gpu-extras gpu-lease gpu-part1 gpu-part2 \
	peer-wheels

$(VENV)/.tritonmoe-setup: pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)

setup: $(VENV)/.tritonmoe-setup

bench: setup
	$(PY) -m bench $(BENCH_ARGS)

test: setup
	bash scripts/run_tests.sh $(PY) $(TEST_ARGS)

# GPU verification on one H100/H200 (no network needed; under 9 minutes): the gpu-marked tests
# (as in gpu-tests, capped at 330 s), the harness's core set against roofs and baselines measured
# in the same run, and the target table with the tests' outcome; writes
# bench/results/<gpu>-<date>.{json,md} and <gpu>-<date>-gpu-tests.{json,md} (<date>-2, -3, ... when that
# day already has results). Without a GPU it runs
# end to end at CPU stand-in shapes and says that the GPU targets are skipped. On a copy of the
# tree without .git, name the commit: make gpu-check TRITONMOE_BENCH_COMMIT=<sha>. To spend one
# device call on the tests and one on the benchmarks: make gpu-tests, then
# make gpu-check CHECK_ARGS=--skip-tests.
gpu-check: setup
	$(PY) -m bench check $(CHECK_ARGS)

# The gpu-marked tests alone (python -m bench gpu-tests, bench/gpu_tests.py): collected once,
# split into up to 8 pytest processes balanced by estimated time and run at once on the one GPU
# (Triton's JIT compiles on all cores; a crash or hang takes down only its shard, whose unstarted
# tests rerun in a new one); one deadline (default 480 s); per-test status and shard, and the tail
# of each failing shard, in bench/results/<gpu>-<date>-gpu-tests.{json,md} (shard logs in the ignored
# bench/out/gpu-tests-logs/).
# E.g. make gpu-tests GPU_TESTS_ARGS="--shards 12 --deadline-s 300 -- -k routing".
gpu-tests: setup
	$(PY) -m bench gpu-tests $(GPU_TESTS_ARGS)

# The same shapes under the PyTorch profiler: the kernels each entry launches, time per call.
gpu-profile: setup
	$(PY) -m bench profile $(CHECK_ARGS)

# MPMoE's memory strategies on one GPU (an expert-parallel group of one rank): the device memory
# held between forward and backward and the peak per (degree, strategy, MI buffers), against the
# memory model, and how much of the offload copies ran behind compute, beside the simulator's
# prediction, at a GPT-XL-like and a wider "overlap" shape (about 1-2 minutes; prints a table).
gpu-memory: setup
	$(PY) -m bench.memory_strategies --single $(MEMORY_ARGS)

# What gpu-check leaves out, for a second device call beside it (a few minutes): the grouped-GEMM
# variants (tile, persistent TMA, torch._grouped_mm) at the issue's presets, and gpu-memory;
# files in bench/results named by date.
gpu-extras: setup
	$(PY) -m bench gemm --json bench/results/gemm-variants-$$(date -u +%F).json \
		--markdown bench/results/gemm-variants-$$(date -u +%F).md
	$(PY) -m bench.memory_strategies --single --json bench/results/gpu-memory-$$(date -u +%F).json $(MEMORY_ARGS)

# The prepared device script (scripts/gpu_device.sh, docs/benchmarking.md), two device calls of a
# 15-minute lease; results in $(OUT) (commit them to bench/results/ with the commit they measured).
# Part one (<= 8 min): untimed warm-up, the check with interleaved rounds, the GEMM variants, the
# profile of the microsecond ops, the launchers' host cost, then tuning with what is left (when
# bench/tune exists). Part two (<= 4 min): the gpu-marked tests, gpu-memory and its step diagnosis.
# Run `make peer-wheels` first on a machine with network: the device command carries .whl/.
gpu-part1:
	bash scripts/gpu_device.sh part1 $(OUT)

gpu-part2:
	bash scripts/gpu_device.sh part2 $(OUT)

# The old name of part one.
gpu-lease: gpu-part1

# The peers' wheels for the device machine (no network there): into the ignored .whl/, installed
# there with --no-deps by scripts/setup_env.sh.
peer-wheels: setup
	mkdir -p .whl
	$(PY) -m pip download --no-deps --only-binary=:all: -d .whl $(PEER_WHEELS)

fuzz: setup
	HYPOTHESIS_PROFILE=fuzz TRITONMOE_FUZZ_FACTOR=$(FUZZ_FACTOR) TRITONMOE_FUZZ_BUDGET_S=$(FUZZ_BUDGET_S) \
		timeout -k 30 $$(( 2 * $(FUZZ_BUDGET_S) )) $(PY) -m pytest -q $(TEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
