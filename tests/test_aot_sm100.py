"""The grouped GEMMs compiled for sm_100a (Blackwell, B200), without a GPU.

No B200 can run them here, so this is what the compiler makes of the kernels on the next
architecture, checked the way ``tests/test_aot_compile.py`` checks sm_90a: a representative set
of its variants (the tile GEMMs at the Mixtral-like and DeepSeek/Qwen3-like presets in every
direction, the persistent TMA GEMMs, the block-scaled FP8 GEMMs) compiled in one subprocess
without ``TRITON_INTERPRET`` for ``GPUTarget("cuda", 100, 32)``, and per variant:

* it compiles and its shared memory fits one block on sm_100 (227 KiB, as on sm_90);
* tiles of BM >= 64 run on Blackwell's tensor cores, ``tcgen05.mma`` into tensor memory: of kind
  ``f16`` for 16-bit operands and ``f8f6f4`` for e4m3 (tiles below 64 rows cannot: tcgen05's
  smallest M is 64, and Triton gives them ``mma.sync``);
* no register spilled inside a loop, except where :data:`KNOWN_LOOP_SPILLS` says so: there the
  test pins the fact (the variant still spills) so that a fix shows up as a failure to update,
  and the table in docs/tuning.md says it.

Run by hand (one JSON line per variant)::

    python tests/test_aot_sm100.py [substring ...]
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aot_compile as aot  # noqa: E402
import test_aot_compile as sm90  # noqa: E402

ARCH = 100
SM100_MAX_SHARED = 227 * 1024

#: The variants compiled (names of test_aot_compile's variants; each must exist there).
NAMES = (
    "moe_ffn.gemm1.mixtral[swiglu,bf16,128x128x64w8s3]",
    "moe_ffn.gemm2.mixtral[mm,bf16,128x256x64w8s3]",
    "moe_ffn.dact.mixtral[dact_swiglu,bf16,128x64x64w8s4]",
    "moe_ffn.dw1.mixtral[wgrad,bf16,128x256x64w8s3]",
    "moe_ffn.gemm1.deepseek[swiglu,bf16,64x128x64w8s4]",
    "moe_ffn.gemm2.deepseek[mm,bf16,64x128x64w4s4]",
    "decode.gemm1.mixtral_T1[swiglu,bf16,16x64x128w4s4]",
    "grouped_ffn.gemm2.mixtral[persistent,mm,bf16,128x256x64w8s3]",
    "grouped_ffn.gemm1_train.qwen3[persistent,swiglu,bf16,128x128x64w8s3]",
    "fp8_moe[gemm1,block128,dsv3,T16384+gather,64x128x128w8s4]",
    "fp8_moe[gemm2,block128,dsv3,T16384+scatter,128x128x128w8s4]",
)

#: Variants that spill inside a loop on sm_100a with the Triton this suite pins (3.9): the
#: 128x128 SwiGLU tiles hold two fp32 accumulators in registers (on sm_100a the tile's
#: accumulator is loaded back from tensor memory for the epilogue, and the two halves do not fit
#: 255 registers). Name -> the Triton version it was seen with.
KNOWN_LOOP_SPILLS = {
    "moe_ffn.gemm1.mixtral[swiglu,bf16,128x128x64w8s3]": "3.9",
    "moe_ffn.dact.mixtral[dact_swiglu,bf16,128x64x64w8s4]": "3.9",
}


def _selected(filters: list[str]) -> list:
    variants = {v.name: v for v in sm90.all_variants()}
    missing = [n for n in NAMES if n not in variants]
    if missing:
        raise KeyError(f"not variants of test_aot_compile (renamed?): {missing}")
    return [variants[n] for n in NAMES if not filters or any(f in n for f in filters)]


def main(filters: list[str]) -> int:
    """Compile the selected variants for sm_100a in forked workers (:func:`aot_compile.compile_many`)."""
    return aot.compile_many({v.name: (v.fn, v.args, dict(num_warps=v.num_warps, num_stages=v.num_stages, arch=ARCH))
                             for v in _selected(filters)})


@pytest.fixture(scope="module")
def compiled() -> dict:
    reason = aot.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot compile for sm_{ARCH}a here: {reason}")
    try:
        return aot.run_compile_script(__file__, timeout=900)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_compiles_for_sm100a(compiled, name):
    rec = compiled[name]
    assert rec["ok"], rec["error"]
    v = sm90.VARIANTS[name]
    facts = {k: rec[k] for k in ("registers", "stack_bytes", "loop_spills", "shared", "tcgen05_kinds", "mma_sync",
                                 "tma_loads")}
    assert rec["arch"] == ARCH
    assert rec["shared"] <= SM100_MAX_SHARED, f"needs {rec['shared']} B of shared memory: {facts}"
    fp8 = "fp8" in name
    if v.wgmma:  # BM >= 64 on sm_90a: a tensor-memory MMA on sm_100a
        assert rec["tcgen05_kinds"] == ["cta_group::1.kind::" + ("f8f6f4" if fp8 else "f16")], facts
        assert not rec["wgmma"], facts  # Hopper's instruction does not exist on sm_100a
    else:
        assert rec["tcgen05_kinds"] == [] and rec["mma_sync"], facts
    if name in KNOWN_LOOP_SPILLS:
        assert rec["loop_spills"] > 0, (
            f"{name} no longer spills inside its loop on sm_100a: remove it from KNOWN_LOOP_SPILLS and the "
            f"docs/tuning.md table: {facts}")
    else:
        assert rec["loop_spills"] == 0, f"spills registers inside a loop on sm_100a: {facts}"


def test_names_are_variants():
    assert len(_selected([])) == len(NAMES)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
