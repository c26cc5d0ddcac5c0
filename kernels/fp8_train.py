"""FP8 training of the grouped expert FFN on Triton (DeepSeek-V3's recipe, block-128):
``fp8_grouped_ffn_train(x, expert_offsets, w1, w2)`` with the signature and arithmetic of
:func:`tritonmoe.fp8_reference.fp8_grouped_ffn_train` (see there for the recipe).

Launches per call (forward): weight quantization (torch ops on the master weights, 128x128
blocks, at each call: the weights change every step), x quantized 1x128 (``fp8_quantize``),
GEMM1 with SwiGLU and A's 1x128 quantization in its epilogue, which also stores the fp32
pre-activation H for backward (``H_OUT``), GEMM2. Backward: dY quantized, ``dA = dY W2^T`` with
the SwiGLU backward and dH's 1x128 quantization in its epilogue (``DSWIGLU``: dH in fp32 for the
weight gradient and in e4m3 for dX), ``dX = dH W1^T`` (both over transposed e4m3 copies of the
weights: the same 128x128 blocks and scales, K-major operands, as FP8 wgmma needs), and the
weight gradients by :func:`._fp8_kernels._fp8_wgrad_kernel` over X^T, dH^T, A^T and dY^T
quantized 1x128 along the rows.

Still separate passes: x's and dY's 1x128 quantization (x arrives permuted in 16 bits, which dW1
also reads; dY is autograd's), A recomputed from H for dW2, and the four transposed 128x1
quantizations of the weight gradients. No host syncs (grids from shapes, segments from the
device offsets).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tritonmoe.core.autograd import first_order
from . import _gemm_config as C
from ._fp8_config import select_fp8
from ._fp8_kernels import _fp8_wgrad_kernel
from ._host import cdiv, device_ctx
from .fp8_gemm import FP8, _check_device, _mm8, _quant_launch, fp8_quantize
from .grouped_gemm import RowSpace

__all__ = ["fp8_grouped_ffn_train"]

_FMT = "e4m3_block128"
_INTERPRETER_WGRAD = C.TileConfig(BM=64, BN=128, BK=32, GROUP_M=2, num_warps=1, num_stages=1)
#: sm90 weight-gradient tiles: 64x128 over 8 warps, 4 stages (pipelined; A, masked in registers,
#: has one shared-memory buffer fewer); 128x128 spills ~300 bytes in the K loop (the accumulator
#: and each step's fp32 partial).
_SM90_WGRAD = C.TileConfig(BM=64, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=4)


def _quantize_weight(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block quantization of [E, N, K] (torch ops, as the reference's
    :func:`tritonmoe.fp8_reference.quantize_weight`)."""
    E, N, K = w_NK.shape
    gn, gk = cdiv(N, 128), cdiv(K, 128)
    wf = torch.nn.functional.pad(w_NK.float(), (0, gk * 128 - K, 0, gn * 128 - N))
    wb = wf.view(E, gn, 128, gk, 128)
    amax = wb.abs().amax(dim=(2, 4))  # [E, gn, gk]
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (wb / s[:, :, None, :, None]).clamp(-448.0, 448.0).to(FP8).view(E, gn * 128, gk * 128)[:, :N, :K]
    return q.contiguous(), s


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    F = h.shape[1] // 2
    g = h[:, :F]
    return g * torch.sigmoid(g) * h[:, F:]


def gemm_config(rows: int, n: int, k: int, num_experts: int, out_dtype: torch.dtype, device: torch.device):
    """The plain block-scaled GEMMs of training (H, dA, dX): the policy's "fp8_mm" tiles, 64 columns
    wide where a 128-row tile writes fp32 (128x128 fp32 spills 24 bytes in the epilogue on sm90)."""
    cfg = select_fp8("fp8_mm", rows=rows, n=n, k=k, num_experts=num_experts, rowwise=False, device=device)
    if out_dtype == torch.float32 and cfg.BM >= 128 and C._arch(device) is not None:
        cfg = replace(cfg, BN=min(cfg.BN, 64))
    return cfg


def _quantize_t(a: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a^T [C, R] quantized 1x128 along R into a buffer of R' = cdiv(R, bk) * bk columns whose
    padding is zero (the weight-gradient kernel's loads run unmasked along R)."""
    R, Cc = a.shape
    Rp = cdiv(R, bk) * bk
    q = torch.empty(Cc, Rp, device=a.device, dtype=FP8)
    q[:, R:].zero_()
    s = torch.empty(Cc, cdiv(R, 128), device=a.device, dtype=torch.float32)
    with device_ctx(a.device):
        _quant_launch(a.t(), q, s, _FMT)
    return q, s


def _wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, E: int, dtype: torch.dtype) -> torch.Tensor:
    """Per expert a_e^T @ b_e -> [E, M, N] (a [R, M], b [R, N]) with 128x1 FP8 blocks."""
    R, M = a.shape
    N = b.shape[1]
    out = torch.empty(E, M, N, device=a.device, dtype=dtype)
    if M == 0 or N == 0:
        return out
    cfg = _INTERPRETER_WGRAD if not a.is_cuda else _SM90_WGRAD
    a_q, a_s = _quantize_t(a, cfg.BK)  # [M, R'], 1x128 along R
    b_q, b_s = _quantize_t(b, cfg.BK)  # [N, R']
    cfg = C.TileConfig(BM=min(cfg.BM, max(16, 1 << (M - 1).bit_length())),
                       BN=min(cfg.BN, max(16, 1 << (N - 1).bit_length())), BK=cfg.BK, GROUP_M=cfg.GROUP_M,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (cdiv(M, cfg.BM) * cdiv(N, cfg.BN), E)
    _fp8_wgrad_kernel[grid](
        a_q, a_s, b_q, b_s, out, offsets,
        R, M, N,
        a_q.stride(0), a_q.stride(1), a_s.stride(0), a_s.stride(1),
        b_q.stride(0), b_q.stride(1), b_s.stride(0), b_s.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _gemm1_train(x_q, x_s, space: RowSpace, q1, s1):
    """GEMM1 of training, one launch: H (fp32 [rows, 2F], kept for backward) and A = SwiGLU(H)
    quantized 1x128 in the epilogue (e4m3 [rows, F] and scales), as the inference GEMM1 does."""
    rows, F, dev = space.rows, q1.shape[1] // 2, x_q.device
    h = torch.empty(rows, 2 * F, device=dev, dtype=torch.float32)
    a_q = torch.empty(rows, F, device=dev, dtype=FP8)
    a_s = torch.empty(rows, cdiv(F, 128), device=dev, dtype=torch.float32)
    cfg = select_fp8("fp8_swiglu", rows=rows, n=F, k=q1.shape[2], num_experts=q1.shape[0], rowwise=False, device=dev)
    _mm8(x_q, x_s, space, q1, s1, _FMT, a_q, a_s, swiglu=True, h_out=h, cfg=cfg)
    return h, a_q, a_s


def _dgrad_swiglu(dy_q, dy_s, space: RowSpace, q2t, s2t, h):
    """dA = dY W2^T with the SwiGLU backward and dH's 1x128 quantization in its epilogue:
    (dH fp32 [rows, 2F], dH e4m3, its scales [rows, 2F/128]); F % 128 == 0."""
    rows, F, dev = space.rows, q2t.shape[1], dy_q.device
    dh = torch.empty(rows, 2 * F, device=dev, dtype=torch.float32)
    dh_q = torch.empty(rows, 2 * F, device=dev, dtype=FP8)
    dh_s = torch.empty(rows, 2 * cdiv(F, 128), device=dev, dtype=torch.float32)
    # the GEMM1 tiles: BN = 128 (one 1x128 group per row per tile), 64-row tiles on sm90
    cfg = select_fp8("fp8_swiglu", rows=rows, n=F, k=q2t.shape[2], num_experts=q2t.shape[0], rowwise=False,
                     device=dev)
    _mm8(dy_q, dy_s, space, q2t, s2t, _FMT, dh_q, dh_s, dswiglu=(h, dh), cfg=cfg)
    return dh, dh_q, dh_s


class _FP8GroupedFFNTrainFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, offsets, w1_EDN, w2_EFD):
        R = x_RD.shape[0]
        E = w1_EDN.shape[0]
        space = RowSpace(offsets, R, E)
        w1t = w1_EDN.detach().transpose(1, 2)  # [E, 2F, D]: gate rows, then up rows
        q1, s1 = _quantize_weight(w1t)  # F % 128 == 0: the gate / up blocks tile 2F
        q2, s2 = _quantize_weight(w2_EFD.detach().transpose(1, 2))  # [E, D, F]
        x_q, x_s = fp8_quantize(x_RD.detach(), _FMT)
        h, a_q, a_s = _gemm1_train(x_q, x_s, space, q1, s1)
        y = torch.empty(R, q2.shape[1], device=x_RD.device, dtype=x_RD.dtype)
        _mm8(a_q, a_s, space, q2, s2, _FMT, y, cfg=gemm_config(R, q2.shape[1], q2.shape[2], E, y.dtype, y.device))
        ctx.save_for_backward(x_RD, h, q1, s1, q2, s2)
        ctx.space, ctx.w_dtypes = space, (w1_EDN.dtype, w2_EFD.dtype)
        return y

    @staticmethod
    @first_order("fp8_grouped_ffn_train (Triton)")
    def backward(ctx, dy_RD):
        x_RD, h, q1, s1, q2, s2 = ctx.saved_tensors
        space = ctx.space
        E = q1.shape[0]
        dy = dy_RD.contiguous()
        # dgrad: the weights' e4m3 blocks transposed (K-major for the transposed products); dA's
        # epilogue turns it into dH (fp32 for dW1, e4m3 1x128 for dX): no dA, no dH quantize pass
        dy_q, dy_s = fp8_quantize(dy, _FMT)
        dh, dh_q, dh_s = _dgrad_swiglu(dy_q, dy_s, space, q2.transpose(1, 2).contiguous(), s2.transpose(1, 2), h)
        q1t = q1.transpose(1, 2).contiguous()
        R, D = x_RD.shape
        dx = torch.empty(R, D, device=dy.device, dtype=x_RD.dtype)
        _mm8(dh_q, dh_s, space, q1t, s1.transpose(1, 2), _FMT, dx,
             cfg=gemm_config(R, D, q1t.shape[2], E, dx.dtype, dx.device))  # [R, D]
        dw1 = _wgrad(x_RD.detach(), dh, space.offsets, E, ctx.w_dtypes[0])  # [E, D, 2F]
        dw2 = _wgrad(_swiglu(h), dy, space.offsets, E, ctx.w_dtypes[1])  # [E, F, D]
        return dx, None, dw1, dw2


def fp8_grouped_ffn_train(x_RD, expert_offsets, w1_EDN, w2_EFD):
    """See :func:`tritonmoe.fp8_reference.fp8_grouped_ffn_train`."""
    _check_device(x_RD.device)
    with device_ctx(x_RD.device):
        return _FP8GroupedFFNTrainFn.apply(x_RD, expert_offsets.contiguous(), w1_EDN, w2_EFD)
