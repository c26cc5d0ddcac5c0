#!/usr/bin/env bash
# The prepared device script (successor of scripts/gpu_lease.sh), in two parts that each fit one
# device call; both plus the machine's start fit a 15-minute lease. Run from the tree's root:
#
#   bash scripts/gpu_device.sh part1 OUTDIR     (make gpu-part1 OUT=DIR)   at most 8 minutes
#   bash scripts/gpu_device.sh part2 OUTDIR     (make gpu-part2 OUT=DIR)   at most 4 minutes
#
# Every step is capped with `timeout` and never runs past the part's budget (BUDGET_S, default 470
# and 230 s) less a reserve; a step that no longer fits is skipped and says so. The steps are
# ranked so that a run cut off early still has the timing-method figures first:
#
#   part1: setup (venv; installs .whl/liger_kernel-*.whl with --no-deps when `make peer-wheels`
#          put it there) -> untimed warm-up (every check entry called once: Triton compiles and
#          autotunes) -> the check with interleaved rounds (python -m bench check --skip-tests)
#          -> the grouped-GEMM variants -> the profiler's kernel times of the microsecond ops ->
#          the launchers' host cost (python -m bench host) -> `python -m bench tune --resume` with
#          whatever time is left, only where bench/tune exists (the tuned table's work).
#   part2: setup -> the gpu-marked tests (concurrent shards, a per-test timeout, so one hung test
#          costs seconds) -> make gpu-memory (offload copy time hidden behind compute, peak
#          memory per strategy, and the step diagnosis of the "keep" step: host syncs, launches).
#
# Results go to OUTDIR (result JSON and markdown named <gpu>-<date>..., the console of each step
# in OUTDIR/steps/, one line per step in OUTDIR/steps.tsv); commit the result files to
# bench/results/ with the commit they measured (TRITONMOE_BENCH_COMMIT=<sha> names it on a copy
# of the tree without .git). Shard logs stay in OUTDIR/logs/ (not committed). The script only
# reads the GPU's state (nvidia-smi -L, NVML); it never changes a clock or any device setting.
# Overrides: BUDGET_S, RESERVE_S, PY (the python, default .venv/bin/python), SETUP_CMD (default
# `make setup`), SHARDS.
set -u
part=${1:-}
OUT=${2:-}
if [ -z "$part" ] || [ -z "$OUT" ] || { [ "$part" != part1 ] && [ "$part" != part2 ]; }; then
  echo "usage: bash scripts/gpu_device.sh part1|part2 OUTDIR" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
if [ "$part" = part1 ]; then BUDGET_S=${BUDGET_S:-470}; else BUDGET_S=${BUDGET_S:-230}; fi
RESERVE_S=${RESERVE_S:-10}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT/steps" "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
start=$(date +%s)
day=$(date -u +%F)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
printf 'step\tcap_s\trc\twall_s\n' > "$OUT/steps.tsv"

# step NAME CAP CMD...: run CMD for at most CAP seconds, never past the budget less RESERVE_S;
# skipped (rc "skipped") when fewer than 15 s are left for it.
step() {
  local name=$1 cap=$2; shift 2
  local l; l=$(( $(left) - RESERVE_S ))
  [ "$cap" -gt "$l" ] && cap=$l
  if [ "$cap" -lt 15 ]; then
    echo "== skipped (no time left): $name"
    printf '%s\t%s\tskipped\t0\n' "$name" "$cap" >> "$OUT/steps.tsv"
    return 0
  fi
  echo "== $(date -u +%T) $name [cap $cap s]: $*"
  local t0; t0=$(date +%s)
  timeout -k 5 "$cap" "$@" > >(tee "$OUT/steps/$name.log") 2>&1
  local rc=$?
  echo "== $name: rc=$rc after $(( $(date +%s) - t0 )) s (part at $(( $(date +%s) - start )) s of $BUDGET_S)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$cap" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
  return 0
}

gpu_slug() {
  "$PY" -c "import re, torch; n = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'; print(re.sub('[^a-z0-9]+', '-', n.lower()).strip('-'))"
}

# The peer wheel (make peer-wheels) into the venv with --no-deps when liger is not importable yet
# (a carried venv skips make setup's own install).
peers() {
  if "$PY" -c "import liger_kernel" >/dev/null 2>&1; then echo "peers: liger-kernel importable"; return 0; fi
  local whl; whl=$(ls .whl/liger_kernel-*.whl 2>/dev/null | tail -1)
  if [ -z "$whl" ]; then echo "peers: no .whl/liger_kernel-*.whl (make peer-wheels, carry .whl): liger rows unavailable"; return 0; fi
  "$PY" -m pip install -q --no-deps --no-index "$whl"
}

part1() {
  step setup 90 ${SETUP_CMD:-make setup}
  peers
  step warmup 100 "$PY" -m bench check --compile-only --skip-tests
  step check 270 "$PY" -m bench check --skip-tests --budget-s $(( $(left) > 285 ? 255 : $(left) - 30 )) \
      --results-dir "$OUT"
  step gemm 60 "$PY" -m bench gemm --rounds 30 --json "$OUT/gemm-variants-$day.json" --markdown "$OUT/gemm-variants-$day.md"
  step profile 40 "$PY" -m bench profile --sections route,permute,decode --impls triton,triton-fused --reps 5
  step host 25 "$PY" -m bench host --json "$OUT/host-$day.json"
  if [ -e bench/tune.py ] || [ -d bench/tune ]; then
    step tune $(( $(left) - RESERVE_S )) "$PY" -m bench tune --resume
    if [ -d kernels/configs ]; then mkdir -p "$OUT/configs" && cp -p kernels/configs/*.json "$OUT/configs/" 2>/dev/null; fi
  else
    echo "== skipped: tune (bench/tune is not in this tree)"
    printf 'tune\t0\tabsent\t0\n' >> "$OUT/steps.tsv"
  fi
}

part2() {
  step setup 90 ${SETUP_CMD:-make setup}
  local gpu; gpu=$(gpu_slug)
  step gpu-tests 140 "$PY" -m bench gpu-tests --shards "${SHARDS:-8}" --deadline-s 125 --test-timeout-s 45 \
      --out "$OUT/$gpu-$day-gpu-tests" --logs-dir "$OUT/logs/gpu-tests"
  step gpu-memory 75 "$PY" -m bench.memory_strategies --single --json "$OUT/gpu-memory-$day.json"
}

{
  echo "== $part: budget $BUDGET_S s, output $OUT, commit ${TRITONMOE_BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  nproc
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  "$part"
  echo "== $part done in $(( $(date +%s) - start )) s"
  column -t "$OUT/steps.tsv" 2>/dev/null || cat "$OUT/steps.tsv"
} 2>&1 | tee "$OUT/$part.log"
