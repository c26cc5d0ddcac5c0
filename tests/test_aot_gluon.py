"""The warp-specialized Gluon grouped GEMM (``kernels/_gluon_grouped_gemm.py``), compiled for
sm_90a without a GPU.

Gluon kernels do not run under Triton's interpreter, so what can be proven on CPU is what the
compiler makes of the kernel, at the GEMM2 shapes of the two bench presets (Mixtral-like:
K = 14336, N = 4096; Qwen3-30B-A3B-like: K = 768, N = 2048), bf16, 128x256x64 tiles, 4 stages:

* the warps are partitioned: ``setmaxnreg`` raises the consumer warpgroups' registers and lowers
  the producer warp's (to the kernel's ``PRODUCER_REGS``);
* the operands come by TMA (``cp.async.bulk.tensor``), and the consumers multiply with
  ``wgmma`` of shape m64n256k16 (one instruction covers the 64x256 slice of a warpgroup);
* no register is spilled, and the shared memory of the stage ring fits sm_90 (227 KiB).

The same facts hold with Triton 3.6 (checked by hand with a 3.6 install: setmaxnreg 240/232 and
40/24, m64n256k16, 168 registers, no stack). Its results are checked against the reference by
``tests/test_gluon_gemm.py`` on a GPU.

Run by hand: ``python tests/test_aot_gluon.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aot_compile as aot  # noqa: E402

from tritonmoe.kernels import _gluon_grouped_gemm as G  # noqa: E402

PRESETS = {"mixtral_gemm2": (14336, 4096), "qwen3_gemm2": (768, 2048)}
BM, BN, BK, NUM_BUF = 128, 256, 64, 4


def _args(K: int, N: int) -> dict:
    from triton.experimental.gluon import language as gl

    return dict(
        a_desc=aot.GluonDesc("bf16", (BM, BK), gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)),
        b_desc=aot.GluonDesc("bf16", (BK, BN), gl.NVMMASharedLayout.get_default_for([BK, BN], gl.bfloat16)),
        out_ptr=aot.Ptr("bf16"), tiles_ptr=aot.Ptr("i32"), count_ptr=aot.Ptr("i32"), K=K, N=N, stride_om=N,
        BM=BM, BN=BN, BK=BK, NUM_BUF=NUM_BUF, PRODUCER_NREG=G.PRODUCER_REGS, num_warps=8,
    )


def main() -> int:
    return aot.compile_many({name: (G._gluon_grouped_mm_ws_kernel, _args(K, N), dict(num_warps=8, num_stages=1, arch=90))
                             for name, (K, N) in PRESETS.items()})


@pytest.fixture(scope="module")
def compiled() -> dict:
    if not G.AVAILABLE:
        pytest.skip("this triton has no Gluon Hopper API")
    reason = aot.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot compile for sm_90a here: {reason}")
    try:
        return aot.run_compile_script(__file__, timeout=600)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("name", list(PRESETS))
def test_warp_specialized_gemm_compiles_for_sm90a(compiled, name):
    rec = compiled[name]
    assert rec["ok"], rec["error"]
    facts = {k: rec[k] for k in ("registers", "stack_bytes", "shared", "setmaxnreg", "mma_shapes", "tma_loads")}
    # register partitions: the consumers grow, the producer shrinks to PRODUCER_REGS
    incs = [int(x.split()[1]) for x in rec["setmaxnreg"] if x.startswith("inc")]
    decs = [int(x.split()[1]) for x in rec["setmaxnreg"] if x.startswith("dec")]
    assert incs and decs and max(incs) >= 200 and min(decs) <= G.PRODUCER_REGS, facts
    assert G.PRODUCER_REGS in incs + decs, facts
    assert rec["mma_shapes"] == [f"m64n{BN}k16"], facts
    assert rec["tma_loads"] >= 2, facts  # the A and the weight tile
    assert rec["stack_bytes"] == 0 and rec["spills"] == 0, facts
    assert NUM_BUF * (BM * BK + BK * BN) * 2 <= rec["shared"] <= aot.SM90_MAX_SHARED, facts


if __name__ == "__main__":
    sys.exit(main())
