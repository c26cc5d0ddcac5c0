#!/usr/bin/env bash
# One device call for a short GPU lease (make gpu-lease, or TRITONMOE_BENCH_COMMIT=<sha> bash scripts/gpu_lease.sh
# from the tree's root; it ran in 428 s on an H100): the gpu-marked tests, the gpu-check core set, gpu-memory,
# the profiler's kernel times of the host-bound entries and the grouped-GEMM variants, each capped so that the whole ends inside BUDGET_S; every result
# file is packed into $OUT/results.tgz and the console into $OUT/session.log.
set -u
export PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-560}
OUT=${OUT:-/tmp/gpu-lease-out}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
day=$(date -u +%F)
free_name() {  # bench/results/NAME-<day>[-N]: the harness's free_stem, so a later lease never overwrites
  .venv/bin/python -c "import sys; from bench.gpu_tests import free_stem; print(free_stem(sys.argv[1]))" \
      "bench/results/$1-$day"
}
run() {  # run CAP CMD...: at most CAP seconds, never past the budget less 25 s for packing
  local cap=$1; shift
  local l; l=$(( $(left) - 25 ))
  [ "$cap" -gt "$l" ] && cap=$l
  if [ "$cap" -lt 20 ]; then echo "== skipped (no time left): $*"; return; fi
  echo "== $(date -u +%T) [$cap s] $*"
  timeout -k 10 "$cap" "$@"; echo "== rc=$? after $(( $(date +%s) - start )) s"
}
{
  nvidia-smi -L; nproc
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  make setup
  mem=$(free_name gpu-memory); gemm=$(free_name gemm-variants)
  run ${TESTS_S:-235} .venv/bin/python -m bench gpu-tests --shards ${SHARDS:-8} \
      --deadline-s $(( ${TESTS_S:-235} - 15 )) --results-dir bench/results
  run ${CHECK_S:-170} .venv/bin/python -m bench check --skip-tests --budget-s $(( ${CHECK_S:-170} - 10 ))
  run ${MEMORY_S:-110} .venv/bin/python -m bench.memory --single --json $mem.json
  # device time per kernel of the host-bound entries (their wall time is mostly launches)
  run 60 .venv/bin/python -m bench profile --sections route,permute,decode --impls triton,triton-fused --reps 5
  run 200 .venv/bin/python -m bench gemm --json $gemm.json --markdown $gemm.md
} 2>&1 | tee "$OUT/session.log"
tar czf "$OUT/results.tgz" bench/results
ls -la "$OUT"
