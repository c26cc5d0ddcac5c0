#!/usr/bin/env bash
# Creates the project's virtual environment (default .venv) on a fresh machine and installs
# tritonmoe into it in editable mode with what `make test` and `make bench` need (the "dev" extra:
# pytest, hypothesis, numpy, nvidia-ml-py, transformers, matplotlib; offline machines skip what
# they lack, the Hugging Face tests skip without transformers and `--plot` says matplotlib is
# missing). Where it downloads, it installs the versions the suite was tested with
# (constraints-tested.txt). Each step says what it does and how long it took.
#
# * torch and triton already importable by $PYTHON (e.g. the GPU machine, which has no network):
#   the venv sees them through --system-site-packages and nothing is downloaded for them.
# * an NVIDIA GPU (nvidia-smi answers): the default CUDA build of torch from the package index.
# * Liger-Kernel (a benchmark peer) with --no-deps: from .whl/ (make peer-wheels) or, on CPU
#   machines, from the index.
# * otherwise: a CPU build of torch (pinned, never the multi-GB CUDA wheels) and triton, whose
#   interpreter runs the kernels' tests on CPU. Override with TRITONMOE_TORCH_SPEC /
#   TRITONMOE_TRITON_SPEC; a CPU torch may need PIP_EXTRA_INDEX_URL pointing at a CPU wheel index.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."
START=$SECONDS
step() { echo "setup [$((SECONDS - START))s]: $*"; }
step "creating $VENV for $(pwd) (one time; later make calls reuse it)"

quiet_pip() {
  # pip warns once per package about unreadable extra indexes configured on some machines.
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if "$PYTHON" -c "import torch, triton" >/dev/null 2>&1; then
  step "torch and triton found for $PYTHON: virtual environment $VENV reusing them (nothing downloaded for them)"
  "$PYTHON" -m venv --system-site-packages "$VENV"
  # $PYTHON may itself run in a virtual environment (the GPU image's python3 does): a venv made
  # from it sees the base interpreter's site-packages, not that environment's, so list those in
  # a .pth file of the new venv (its own packages still come first).
  parent_sites=$("$PYTHON" -c "import site, sys; print(chr(10).join(site.getsitepackages()) if sys.prefix != sys.base_prefix else '')")
  if [ -n "$parent_sites" ]; then
    child_site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    printf '%s\n' "$parent_sites" > "$child_site/_tritonmoe_parent_env.pth"
  fi
  step "installing tritonmoe from this folder in editable mode (no dependencies downloaded)"
  if "$VENV/bin/python" -c "import setuptools" >/dev/null 2>&1; then
    quiet_pip install -q --no-deps --no-build-isolation -e .
  else
    quiet_pip install -q --no-deps -e .
  fi
  # The "test" and "bench" extras: install what is missing (nothing is downloaded when all are
  # present, e.g. offline).
  missing=$("$VENV/bin/python" - <<'PY'
import importlib.util
need = {"pytest": "pytest>=7", "hypothesis": "hypothesis>=6.80", "numpy": "numpy", "pynvml": "nvidia-ml-py"}
print(" ".join(spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None))
PY
)
  if [ -n "$missing" ]; then
    step "installing the test and bench tools that are missing: $missing"
    quiet_pip install -q -c constraints-tested.txt $missing
  fi
  if ! "$VENV/bin/python" -c "import matplotlib" >/dev/null 2>&1; then
    step "installing matplotlib (bench --plot, scripts/plot_speedup.py)"
    quiet_pip install -q -c constraints-tested.txt matplotlib \
      || step "matplotlib could not be installed (offline?): --plot will say so; everything else works"
  fi
else
  step "virtual environment $VENV; upgrading pip, setuptools and wheel"
  "$PYTHON" -m venv "$VENV"
  quiet_pip install -q --upgrade "pip>=23" setuptools wheel
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "NVIDIA GPU found: installing the CUDA build of torch (several GB, a few minutes)"
    quiet_pip install -q "${TRITONMOE_TORCH_SPEC:-torch==2.13.0}"
  else
    step "no NVIDIA GPU: installing the CPU build of torch (~200 MB, no CUDA wheels) and triton (its interpreter runs the kernels on CPU); a few minutes"
    quiet_pip install -q "${TRITONMOE_TORCH_SPEC:-torch==2.13.0+cpu}" "${TRITONMOE_TRITON_SPEC:-triton==3.9.0}"
  fi
  step "installing tritonmoe in editable mode with its dev extra (pytest, hypothesis, numpy, nvidia-ml-py, transformers, matplotlib)"
  # The tested versions (constraints-tested.txt) except torch and triton, installed just above.
  grep -v -E '^(torch|triton)==' constraints-tested.txt > "$VENV/constraints.txt"
  quiet_pip install -q -c "$VENV/constraints.txt" -e ".[dev]"
fi
# The benchmark peer Liger-Kernel (pure Python + Triton, its fused MoE): from a wheel in .whl/ when
# `make peer-wheels` put one there (the GPU machine has no network), else from the index on CPU
# machines so CI runs the peer-adapter tests; always --no-deps (it must not replace torch/triton).
# Best effort: without it the peer's rows are "unavailable" and its tests skip.
liger_whl=$(ls .whl/liger_kernel-*.whl 2>/dev/null | tail -1 || true)
if [ -n "$liger_whl" ]; then
  quiet_pip install -q --no-deps "$liger_whl" || echo "setup: could not install $liger_whl (peer rows unavailable)"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  quiet_pip install -q --no-deps liger-kernel || echo "setup: liger-kernel not installed (its tests skip)"
fi
"$VENV/bin/python" -c "import torch, tritonmoe; print(f'setup: tritonmoe {tritonmoe.__version__}, torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
step "done in $((SECONDS - START)) s"
touch "$VENV/.tritonmoe-setup"
