"""Compile the grouped-FFN kernels for sm_90a without a GPU (used by test_kernels_ffn.py).

Triton's interpreter runs the kernels' Python, not the compiler, so it misses what only the
compiler rejects (non-constexpr globals, control flow the code generator refuses, shared memory
over the limit). This script compiles each kernel with the sm90 policy's tiles and every feature
flag the launchers use, straight from the AST for a CUDA target (Triton's bundled ptxas; no
driver), and prints one JSON line per variant: whether the PTX uses wgmma and the shared memory.
It must run with TRITON_INTERPRET unset. Exit status 1 if a variant fails to compile, needs more
shared memory than sm90 has, or (sm90, tensor-core dtype, BM >= 64) does not use wgmma.

    python tests/sm90_compile_check.py [arch]   # arch 90 (default) or 80
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tritonmoe.kernels._gemm_config as C  # noqa: E402
import tritonmoe.kernels._grouped_gemm_kernels as K  # noqa: E402

SMEM_LIMIT = 227 * 1024


def _compile(fn, ptr_types: dict, consts: dict, warps: int, stages: int, arch: int):
    # Integer arguments are i32 and, like real model shapes, divisible by 16 (Triton specializes
    # such arguments at launch, which is what lets the masked loads vectorize).
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = ptr_types.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def variants(arch: int):
    major = (arch // 10, arch % 10)
    dt = "bf16"
    mm_ptrs = dict(a_ptr=f"*{dt}", b_ptr=f"*{dt}", c_ptr=f"*{dt}", h_ptr=f"*{dt}", offs_ptr="*i64",
                   row_map_ptr="*i64", scale_ptr="*fp32")
    dact_ptrs = dict(a_ptr=f"*{dt}", b_ptr=f"*{dt}", h_ptr=f"*{dt}", dh_ptr=f"*{dt}", offs_ptr="*i64",
                     row_map_ptr="*i64", scale_ptr="*fp32", part_ptr="*fp32")
    wg_ptrs = dict(a_ptr=f"*{dt}", b_ptr=f"*{dt}", c_ptr=f"*{dt}", offs_ptr="*i64", row_map_ptr="*i64",
                   scale_ptr="*fp32")
    unit = dict(stride_ak=1, stride_bn=1, stride_cn=1, stride_hn=1)
    out = []
    for kind, act, flags in [
        ("mm", K.ACT_NONE, dict(GATHER_A=False, SCATTER_C=True, SCALE=True)),
        ("mm_act", K.ACT_GELU, dict(GATHER_A=True, SCATTER_C=False, SCALE=False)),
        ("swiglu", K.ACT_SWIGLU, dict(GATHER_A=True, SCATTER_C=False, SCALE=False)),
    ]:
        for avg in (1024, 128, 8):
            cfg = C._policy(kind, avg, torch.bfloat16, False, major)
            consts = dict(ACT=act, STORE_H=act != K.ACT_NONE, PREC="tf32", EVEN_K=False, SEG=16,
                          BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, **flags, **unit)
            out.append((f"{kind} avg={avg}", cfg, K._grouped_mm_kernel, mm_ptrs, consts))
    for kind, act in [("dact", K.ACT_GELU), ("dact_swiglu", K.ACT_SWIGLU)]:
        cfg = C._policy(kind, 1024, torch.bfloat16, False, major)
        consts = dict(ACT=act, GATHER_A=True, SCALE=True, DGATE=True, PREC="tf32", EVEN_K=True, SEG=16,
                      BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, stride_ak=1, stride_bk=1,
                      stride_hn=1, stride_dn=1)
        out.append((f"{kind} fused", cfg, K._grouped_mm_dact_kernel, dact_ptrs, consts))
    cfg = C._policy("wgrad", 1024, torch.bfloat16, False, major)
    consts = dict(GATHER_A=True, GATHER_B=True, SCALE_B=True, PREC="tf32", BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
                  GROUP_M=cfg.GROUP_M, stride_ac=1, stride_bc=1, stride_cn=1)
    out.append(("wgrad fused", cfg, K._grouped_wgrad_kernel, wg_ptrs, consts))
    cfg = C._policy("mm", 1024, torch.float32, False, major)
    consts = dict(ACT=K.ACT_RELU, STORE_H=True, PREC="ieee", EVEN_K=True, SEG=16, BM=cfg.BM, BN=cfg.BN,
                  BK=cfg.BK, GROUP_M=cfg.GROUP_M, GATHER_A=False, SCATTER_C=False, SCALE=False, **unit)
    fp32_ptrs = {k: v.replace(dt, "fp32") for k, v in mm_ptrs.items()}
    out.append(("mm fp32 ieee", cfg, K._grouped_mm_kernel, fp32_ptrs, consts))
    comb = C.TileConfig(BM=16, BN=16, BK=16, num_warps=4, num_stages=1)
    out.append(("combine", comb, K._combine_kernel, dict(buf_ptr=f"*{dt}", w_ptr="*fp32", out_ptr=f"*{dt}"),
                dict(TOPK=8, HAS_W=True, BT=4, BD=512, stride_bd=1, stride_od=1)))
    return out


def main() -> int:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    failed = 0
    for name, cfg, fn, ptrs, consts in variants(arch):
        rec = {"name": name, "config": f"{cfg.BM}x{cfg.BN}x{cfg.BK} w{cfg.num_warps} s{cfg.num_stages}"}
        try:
            k = _compile(fn, ptrs, consts, cfg.num_warps, cfg.num_stages, arch)
            ptx = k.asm["ptx"]
            tensor_core = fn is not K._combine_kernel and consts.get("PREC") != "ieee"
            expect_wgmma = arch >= 90 and tensor_core and cfg.BM >= 64
            rec.update(ok=True, wgmma="wgmma.mma_async" in ptx, expect_wgmma=expect_wgmma,
                       shared=k.metadata.shared, smem_ok=k.metadata.shared <= SMEM_LIMIT)
            failed += not rec["smem_ok"] or (expect_wgmma and not rec["wgmma"])
        except Exception as exc:  # report every variant, then fail
            rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-800:]}")
            failed += 1
        print(json.dumps(rec), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
