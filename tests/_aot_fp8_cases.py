"""The FP8 kernels' launch sites on sm90, as ahead-of-time compile cases for tests/test_aot_compile.py.

Each case is the specialization a launcher in ``kernels/fp8_gemm.py`` emits on an H100/H200 at
the config ``_fp8_config.select_fp8`` chooses there, for DeepSeek-V3's experts (d=7168, f=2048,
E=256, k=8; the block-128 layout of its checkpoints) and Qwen3-30B-A3B's (d=2048, f=768, E=128,
k=8), at prefill (T=16384) and decode (T=64) sizes. What each must compile to:

* the GEMMs: tensor-core MMAs on e4m3 operands with an fp32 accumulator (``wgmma ... f32.e4m3.e4m3``
  for BM >= 64, ``mma.sync`` below), every operand load pipelined through cp.async, and no
  register spilled at all (the block-scaled K loop holds two accumulators and two fp32
  partials: the policy's tiles are sized so that they fit, see ``_fp8_config._policy``);
* the quantization kernels (alone and fused into the permute): no spill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aot_compile import Ptr as P
from tritonmoe.kernels import _fp8_config as FC
from tritonmoe.kernels import _fp8_kernels as FK
from tritonmoe.kernels import _gemm_config as C
from tritonmoe.kernels import fp8_train as FT

__all__ = ["FP8Case", "fp8_cases"]


@dataclass(frozen=True)
class FP8Case:
    name: str
    fn: Any
    args: dict
    num_warps: int
    num_stages: int
    gemm: bool
    wgmma: bool = False
    a_in_registers: bool = False  # A masked in registers before the MMA: one pipeline buffer fewer


_MODELS = {"dsv3": (7168, 2048, 256, 8), "qwen3_30b": (2048, 768, 128, 8)}


def _gemm(name, dev, *, T, model, gemm1, fmt, gather=False, scatter=False, scale=False) -> FP8Case:
    """kernels/fp8_gemm.py::_mm8 as _gemm1 (SwiGLU; block: e4m3 output + 1x128 scales) or as
    GEMM2 (bf16 output) launches it over T*k rows."""
    D, F, E, k = _MODELS[model]
    rowwise = fmt == "e4m3_rowwise"
    rows = T * k
    K, N = (D, F) if gemm1 else (F, D)
    NW = 2 * N if gemm1 else N
    decode = gather or scatter  # the fused moe_ffn path: T <= 64 takes the decode tiles
    cfg = FC.select_fp8("fp8_swiglu" if gemm1 else "fp8_mm", rows=rows, n=N, k=K, num_experts=E, rowwise=rowwise,
                        device=dev, decode_tokens=T if (decode and C.decode_path(T, k)) else None)
    gk, gn = -(-K // 128), -(-NW // 128)
    quant = gemm1 and not rowwise
    args = dict(
        a_ptr=P("fp8e4nv"), as_ptr=P("fp32"), b_ptr=P("fp8e4nv"), bs_ptr=P("fp32"),
        c_ptr=P("fp8e4nv" if quant else ("fp32" if gemm1 else "bf16")), cs_ptr=P("fp32"),
        tiles_ptr=P("i32"), count_ptr=P("i32"), row_map_ptr=P("i64"), w_ptr=P("fp32"),
        N=N, K=K, ROWS_HINT=C.rows_hint(rows, E),
        stride_am=K, stride_ak=1, stride_asm=1 if rowwise else gk, stride_asg=1,
        # B: the [E, K, N'] view of the checkpoint's [E, N', K] (K contiguous)
        stride_be=NW * K, stride_bk=1, stride_bn=K,
        stride_bse=NW if rowwise else gn * gk, stride_bsn=1 if rowwise else gk, stride_bsk=0 if rowwise else 1,
        stride_cm=N, stride_cn=1, stride_csm=-(-N // 128), stride_csg=1,
        h_ptr=P("fp32"), dh_ptr=P("fp32"), stride_hm=2 * N, stride_hn=1,
        SWIGLU=gemm1, ROWWISE=rowwise, QUANT_OUT=quant, GATHER_A=gather, SCATTER_C=scatter, SCALE=scale, TOPK=k,
        EVEN_K=K % cfg.BK == 0, H_OUT=False, DSWIGLU=False, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
    )
    tag = f"{'gemm1' if gemm1 else 'gemm2'},{fmt.split('_')[1]},{model},T{T}"
    flags = "".join(f"+{f}" for f, on in (("gather", gather), ("scatter", scatter), ("scale", scale)) if on)
    return FP8Case(f"fp8_{name}[{tag}{flags},{cfg.BM}x{cfg.BN}x{cfg.BK}w{cfg.num_warps}s{cfg.num_stages}]",
                   FK._fp8_grouped_mm_kernel, args, cfg.num_warps, cfg.num_stages, True, wgmma=cfg.BM >= 64)


def _quant(name, *, D, fmt, scatter, k=8, dtype="bf16") -> FP8Case:
    """kernels/fp8_gemm.py::_quant_launch (fp8_quantize, or fp8_permute with SCATTER)."""
    block = fmt == "e4m3_block128"
    ng = -(-D // 128) if block else 1
    args = dict(
        x_ptr=P(dtype), stride_xt=D, stride_xd=1, rows_ptr=P("i64"), offsets_ptr=P("i64"), counts_ptr=P("i32"),
        q_ptr=P("fp8e4nv"), stride_qm=D, s_ptr=P("fp32"), stride_sm=ng, stride_sg=1,
        T=4096, D=D, E=256, NG=ng, num_rows=4096 * k, TAIL_ROWS=256,
        TOPK=k if scatter else 1, SCATTER=scatter, ROWWISE=not block, BLOCK_D=128 if block else 1024,
    )
    tag = f"{fmt.split('_')[1]},{dtype},D{D}{',permute_k' + str(k) if scatter else ''}"
    return FP8Case(f"fp8_{name}[{tag}]", FK._quant_rows_kernel, args, 4, 3, False)


def _wgrad(model: str, *, T: int, second: bool) -> FP8Case:
    """kernels/fp8_train.py::_wgrad: dW1 = X^T dH ([d, 2f] per expert) or dW2 = A^T dY ([f, d])
    over T*k rows, operands e4m3 [M, R] / [N, R] with 1x128 scales along R."""
    D, F, E, k = _MODELS[model]
    R = T * k
    M, N = (F, D) if second else (D, 2 * F)
    cfg = FT._SM90_WGRAD
    gr = -(-R // 128)
    args = dict(
        a_ptr=P("fp8e4nv"), as_ptr=P("fp32"), b_ptr=P("fp8e4nv"), bs_ptr=P("fp32"), c_ptr=P("bf16"),
        offs_ptr=P("i64"), R=R, M=M, N=N,
        stride_am=R, stride_ar=1, stride_asm=gr, stride_asg=1,
        stride_bn=R, stride_br=1, stride_bsn=gr, stride_bsg=1,
        stride_ce=M * N, stride_cm=N, stride_cn=1,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
    )
    tiles = f"{cfg.BM}x{cfg.BN}x{cfg.BK}w{cfg.num_warps}s{cfg.num_stages}"
    name = f"fp8_wgrad[{'dw2' if second else 'dw1'},{model},T{T},{tiles}]"
    return FP8Case(name, FK._fp8_wgrad_kernel, args, cfg.num_warps, cfg.num_stages, True, wgmma=True, a_in_registers=True)


def _dgrad(model: str, dev, *, T: int, dx: bool) -> FP8Case:
    """kernels/fp8_train.py::_gemm in backward: dA = dY W2^T (K = d) or dX = dH W1^T (K = 2f),
    the weights' transposed e4m3 copies K-major, fp32 / bf16 output."""
    D, F, E, k = _MODELS[model]
    rows = T * k
    K, N = (2 * F, D) if dx else (D, F)
    cfg = FT.gemm_config(rows, N, K, E, torch.bfloat16 if dx else torch.float32, dev)
    gk, gn = -(-K // 128), -(-N // 128)
    args = dict(
        a_ptr=P("fp8e4nv"), as_ptr=P("fp32"), b_ptr=P("fp8e4nv"), bs_ptr=P("fp32"),
        c_ptr=P("bf16" if dx else "fp32"), cs_ptr=P("fp32"),
        tiles_ptr=P("i32"), count_ptr=P("i32"), row_map_ptr=P("i64"), w_ptr=P("fp32"),
        N=N, K=K, ROWS_HINT=C.rows_hint(rows, E),
        stride_am=K, stride_ak=1, stride_asm=gk, stride_asg=1,
        stride_be=N * K, stride_bk=1, stride_bn=K,
        # the scales are the forward's [E, K-blocks, N-blocks] transposed (a strided view)
        stride_bse=gn * gk, stride_bsn=1, stride_bsk=gn,
        stride_cm=N, stride_cn=1, stride_csm=gk, stride_csg=1,
        h_ptr=P("fp32"), dh_ptr=P("fp32"), stride_hm=2 * N, stride_hn=1,
        SWIGLU=False, ROWWISE=False, QUANT_OUT=False, GATHER_A=False, SCATTER_C=False, SCALE=False, TOPK=1,
        EVEN_K=K % cfg.BK == 0, H_OUT=False, DSWIGLU=False, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
    )
    name = f"fp8_dgrad[{'dx' if dx else 'da'},{model},T{T},{cfg.BM}x{cfg.BN}x{cfg.BK}w{cfg.num_warps}s{cfg.num_stages}]"
    return FP8Case(name, FK._fp8_grouped_mm_kernel, args, cfg.num_warps, cfg.num_stages, True, wgmma=cfg.BM >= 64)


def _train_epilogue(model: str, dev, *, T: int, dswiglu: bool) -> FP8Case:
    """kernels/fp8_train.py's fused launches: GEMM1 of training (SwiGLU, A quantized 1x128 and H
    stored fp32: ``H_OUT``) or dA = dY W2^T with the SwiGLU backward and dH's 1x128 quantization
    in its epilogue (``DSWIGLU``), both at the GEMM1 tiles (BN = 128)."""
    D, F, E, k = _MODELS[model]
    rows = T * k
    K, N = D, F
    NW = N if dswiglu else 2 * N  # dA reads W2^T [E, F, D]; GEMM1 W1 [E, 2F, D]
    cfg = FC.select_fp8("fp8_swiglu", rows=rows, n=N, k=K, num_experts=E, rowwise=False, device=dev)
    gk, gn = -(-K // 128), -(-NW // 128)
    args = dict(
        a_ptr=P("fp8e4nv"), as_ptr=P("fp32"), b_ptr=P("fp8e4nv"), bs_ptr=P("fp32"),
        c_ptr=P("fp8e4nv"), cs_ptr=P("fp32"),
        tiles_ptr=P("i32"), count_ptr=P("i32"), row_map_ptr=P("i64"), w_ptr=P("fp32"),
        N=N, K=K, ROWS_HINT=C.rows_hint(rows, E),
        stride_am=K, stride_ak=1, stride_asm=gk, stride_asg=1,
        stride_be=NW * K, stride_bk=1, stride_bn=K,
        # dA: W2's scales [E, D-blocks, F-blocks] transposed (a strided view)
        stride_bse=gn * gk, stride_bsn=1 if dswiglu else gk, stride_bsk=gn if dswiglu else 1,
        stride_cm=2 * N if dswiglu else N, stride_cn=1, stride_csm=2 * (-(-N // 128)) if dswiglu else -(-N // 128),
        stride_csg=1,
        h_ptr=P("fp32"), dh_ptr=P("fp32"), stride_hm=2 * N, stride_hn=1,
        SWIGLU=not dswiglu, ROWWISE=False, QUANT_OUT=True, GATHER_A=False, SCATTER_C=False, SCALE=False, TOPK=1,
        EVEN_K=K % cfg.BK == 0, H_OUT=not dswiglu, DSWIGLU=dswiglu,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
    )
    name = (f"fp8_train_epilogue[{'da_dswiglu' if dswiglu else 'gemm1_hout'},{model},T{T},"
            f"{cfg.BM}x{cfg.BN}x{cfg.BK}w{cfg.num_warps}s{cfg.num_stages}]")
    return FP8Case(name, FK._fp8_grouped_mm_kernel, args, cfg.num_warps, cfg.num_stages, True, wgmma=cfg.BM >= 64)


def fp8_cases(dev: torch.device) -> list[FP8Case]:
    """Every FP8 launch site at sm90 configs (``dev`` is the patched sm90 device of the caller)."""
    out = []
    for model in _MODELS:
        for fmt in ("e4m3_block128", "e4m3_rowwise"):
            for T in (16384, 64, 8):
                out.append(_gemm("moe", dev, T=T, model=model, gemm1=True, fmt=fmt, gather=True))
                out.append(_gemm("moe", dev, T=T, model=model, gemm1=False, fmt=fmt, scatter=True))
            out.append(_gemm("grouped", dev, T=16384, model=model, gemm1=True, fmt=fmt))
            out.append(_gemm("grouped", dev, T=16384, model=model, gemm1=False, fmt=fmt))
        out.append(_gemm("moe", dev, T=16384, model=model, gemm1=False, fmt="e4m3_block128", scatter=True,
                         scale=True))  # top-1: straight into the output, times the gate weight
    for fmt in ("e4m3_block128", "e4m3_rowwise"):
        out.append(_quant("quantize", D=7168, fmt=fmt, scatter=False))
        out.append(_quant("permute", D=7168, fmt=fmt, scatter=True))
    out.append(_quant("quantize", D=2048, fmt="e4m3_rowwise", scatter=False, dtype="fp32"))  # rowwise A of GEMM1
    for model in _MODELS:  # training (kernels/fp8_train.py)
        out += [_wgrad(model, T=16384, second=False), _wgrad(model, T=16384, second=True)]
        # dA runs fused with the SwiGLU backward (_train_epilogue, dswiglu); dX is the plain GEMM
        out += [_dgrad(model, dev, T=16384, dx=True)]
        out += [_train_epilogue(model, dev, T=16384, dswiglu=False), _train_epilogue(model, dev, T=16384, dswiglu=True)]
    return out
