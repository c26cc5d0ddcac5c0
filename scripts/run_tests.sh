#!/usr/bin/env bash
# make test: the whole suite. Without CUDA: one pytest run (Triton's interpreter runs the kernels
# on CPU tensors; tests/conftest.py switches it on). With CUDA: the interpreter and the CUDA
# kernels cannot share a process (TRITON_INTERPRET is read once, at import), so the CPU suite runs
# first with the device hidden (exactly what CI runs), then the gpu-marked tests on the device:
# with no pytest arguments as concurrent shards (`python -m bench gpu-tests`, bench/gpu_tests.py:
# Triton's JIT compiles on all cores, a crashing test takes down only its shard; summary and
# shard logs in a temporary directory), with arguments (-k, a file, -x) as one `pytest -m gpu`.
# TRITONMOE_TEST_SPLIT=1 forces the two-pass form (to exercise it on a machine without CUDA).
set -uo pipefail
PY=${1:?usage: run_tests.sh PYTHON [pytest args...]}
shift
if [ "${TRITONMOE_TEST_SPLIT:-}" = 1 ] || "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "test: CUDA present: the CPU suite with the device hidden (interpreter), then the gpu tests on the device"
  CUDA_VISIBLE_DEVICES= "$PY" -m pytest -m "not gpu" "$@"
  rc=$?
  [ $rc -eq 5 ] && rc=0   # no test selected (e.g. -k matched only gpu tests)
  if [ $# -eq 0 ]; then
    out=$(mktemp -d "${TMPDIR:-/tmp}/tritonmoe-gpu-tests.XXXXXX")
    "$PY" -m bench gpu-tests --without-cuda --deadline-s 3600 --out "$out/gpu-tests"
    rc2=$?
  else
    "$PY" -m pytest -m gpu "$@"
    rc2=$?
    [ $rc2 -eq 5 ] && rc2=0
  fi
  [ $rc -ne 0 ] && exit $rc
  exit $rc2
fi
exec "$PY" -m pytest "$@"
