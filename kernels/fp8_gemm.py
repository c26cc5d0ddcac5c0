"""FP8 (e4m3) expert path on Triton: activation quantization (alone or fused into the permute),
block-scaled / rowwise grouped GEMMs, and the SwiGLU expert FFN over a permuted buffer or fused
with the routing (``moe_ffn``).

Launchers with the signatures of :mod:`tritonmoe.fp8_reference` (registered in
:data:`tritonmoe.backends.OPS`); kernels in ``_fp8_kernels.py``, configs in ``_fp8_config.py``.
Formats, scales and weight layouts: see :mod:`tritonmoe.fp8_reference`. Weights are the
checkpoint's ``[E, out, in]`` e4m3 tensors; the kernels read them as ``[E, K, N]`` views (K
contiguous).

Pipeline of :func:`fp8_grouped_ffn` (x already quantized, e.g. by :func:`fp8_permute`): GEMM1
(gate and up accumulators, SwiGLU, the tile quantized 1x128 in its epilogue: e4m3 A and scales
written, no 16-bit A) -> GEMM2 (block-scaled, output dtype). :func:`fp8_moe_ffn`: x quantized
once per token (T rows, not T*k), GEMM1 gathers the token rows through the row map of the
routing, GEMM2 writes each slot's row and the fixed-order weighted combine of the 16-bit path
sums them. Rowwise format: GEMM1 writes A in fp32 and a rowwise quantization pass follows (a
row's scale needs the whole row, which no tile holds).

Precision: fp32 accumulation, per-block scales applied to the fp32 partial of each 128-deep K
block, activation quantized from fp32 (as the reference). No host syncs (the row spaces come
from the device offsets, grids from shapes), except :func:`fp8_permute` with ``num_rows=None``,
which reads R back like :func:`tritonmoe.kernels.permute.permute`.

Training (forward and backward over a permuted buffer) is in :mod:`.fp8_train`. Not built: a
split-K decode GEMM2, a persistent / TMA variant, a backward of the fused ``fp8_moe_ffn``.
"""

from __future__ import annotations


import torch

from tritonmoe.core.types import PermuteInfo, Routing
from . import _gemm_config as C
from ._fp8_config import fp8_supported, select_fp8
from ._fp8_kernels import _fp8_grouped_mm_kernel, _quant_rows_kernel
from ._host import cdiv, device_ctx
from .grouped_gemm import RowSpace, _combine, route_rows
from .permute import _read_num_rows, permute_metadata

__all__ = ["fp8_quantize", "fp8_permute", "fp8_grouped_mm", "fp8_grouped_ffn", "fp8_moe_ffn"]

FP8 = torch.float8_e4m3fn
_BLOCK = 128
_TAIL_ROWS = 256


def _check_device(device: torch.device) -> None:
    if not fp8_supported(device):
        cap = torch.cuda.get_device_capability(device)
        raise TypeError(f"the FP8 kernels need FP8 tensor cores (compute capability >= 8.9); {device} has "
                        f"{cap[0]}.{cap[1]}: dequantize the experts (FP8Experts.dequantize) or use backend='torch'")


def _groups(k: int, fmt: str) -> int:
    return cdiv(k, _BLOCK) if fmt == "e4m3_block128" else 1


def _quant_launch(x_TD, q, s, fmt, *, rows=None, offsets=None, counts=None, num_rows=0, tail=False):
    T, D = x_TD.shape
    E = counts.shape[0] if counts is not None else 0
    scatter = rows is not None
    ng = _groups(D, fmt)
    n_tail = cdiv(num_rows, _TAIL_ROWS) if (scatter and tail) else 0
    grid = (T + E + n_tail,) if scatter else (T,)
    if grid[0] == 0:
        return
    block_d = _BLOCK if fmt == "e4m3_block128" else min(1024, max(16, 1 << max(0, (D - 1).bit_length())))
    dummy = s
    _quant_rows_kernel[grid](
        x_TD, x_TD.stride(0), x_TD.stride(1),
        rows if scatter else dummy, offsets if scatter else dummy, counts if scatter else dummy,
        q, q.stride(0), s, s.stride(0), s.stride(1),
        T, D, E, ng, num_rows, _TAIL_ROWS,
        TOPK=rows.shape[1] if scatter else 1, SCATTER=scatter, ROWWISE=fmt != "e4m3_block128", BLOCK_D=block_d,
        num_warps=4 if x_TD.is_cuda else 1,
    )


def fp8_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, G]) as :func:`tritonmoe.fp8_reference.quantize_rows`
    (bit for bit). One program per row."""
    M, K = x.shape
    q = torch.empty(M, K, device=x.device, dtype=FP8)
    s = torch.empty(M, _groups(K, fmt), device=x.device, dtype=torch.float32)
    with device_ctx(x.device):
        _quant_launch(x, q, s, fmt)
    return q, s


def fp8_permute(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int, fmt: str, *, pad_to: int = 1,
                num_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, PermuteInfo]:
    """:func:`tritonmoe.kernels.permute.permute` with the quantization fused into its scatter:
    (x_perm e4m3 [N, d], scales fp32 [N, G], info), each token row read and quantized once and
    stored to its k slot rows; padding rows and rows past R are zeros with scale 1. N = R (one
    host sync, as permute) or ``num_rows`` (>= max_permuted_rows, no sync)."""
    info = permute_metadata(topk_ids_TK, num_experts, pad_to)
    exact = num_rows is None
    n = _read_num_rows(info) if exact else num_rows
    D = x_TD.shape[1]
    q = torch.empty(n, D, device=x_TD.device, dtype=FP8)
    s = torch.empty(n, _groups(D, fmt), device=x_TD.device, dtype=torch.float32)
    with device_ctx(x_TD.device):
        _quant_launch(x_TD, q, s, fmt, rows=info.slot_rows.contiguous(), offsets=info.expert_offsets,
                      counts=info.counts, num_rows=n, tail=not exact)
    return q, s, info


def _mm8(a, a_s, space: RowSpace, w_ENK, w_s, fmt, out, out_s=None, *, swiglu=False, gather_a=False,
         scatter=False, scale=None, cfg=None, h_out=None, dswiglu=None):
    """One FP8 grouped GEMM launch over ``space`` (see :func:`_fp8_grouped_mm_kernel`); ``w_ENK``
    is the checkpoint-layout weight [E, N', K], read as its [E, K, N'] view. Training (block
    format, BN = 128): ``h_out`` fp32 [rows, 2N] receives GEMM1's pre-activation; ``dswiglu`` =
    (H, dH) fp32 [rows, 2N]: the output is dH (``out`` e4m3 [rows, 2N], ``out_s`` its scales)."""
    E, NW, K = w_ENK.shape
    N = NW // 2 if swiglu else NW
    rows = space.rows
    if rows == 0 or N == 0:
        return
    dev = a.device
    kind = "fp8_swiglu" if swiglu else "fp8_mm"
    if cfg is None:
        cfg = select_fp8(kind, rows=rows, n=N, k=K, num_experts=E, rowwise=fmt != "e4m3_block128", device=dev)
    tm = space.tile_map(cfg.BM)
    b = w_ENK.transpose(1, 2)
    rowwise = fmt != "e4m3_block128"
    if rowwise:
        bs_strides = (w_s.stride(0), w_s.stride(1), 0)
    else:
        bs_strides = w_s.stride()
    if (h_out is not None or dswiglu is not None) and (cfg.BN != 128 or rowwise or out_s is None):
        raise ValueError("the training epilogues need the block format, BN = 128 and a quantized output")
    hh, dh = (dswiglu if dswiglu is not None else (h_out if h_out is not None else a_s, a_s))
    cs = out_s if out_s is not None else a_s
    rm = space.row_map if space.row_map is not None else space.offsets
    items = tm.bound * cdiv(N, cfg.BN)
    grid = (max(1, min(items, C.max_programs(dev, cfg, 1, swiglu))),)
    C.launch(
        _fp8_grouped_mm_kernel, grid, cfg, ("N", "K", "ROWS_HINT"), dev, 1, swiglu,
        a, a_s, b, w_s, out, cs, tm.tiles, tm.count, rm, scale if scale is not None else a_s,
        N, K, C.rows_hint(rows, E),
        a.stride(0), a.stride(1), a_s.stride(0), a_s.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        *bs_strides,
        out.stride(0), out.stride(1), cs.stride(0), cs.stride(1),
        hh, dh, hh.stride(0), hh.stride(1),
        SWIGLU=swiglu, ROWWISE=rowwise, QUANT_OUT=out_s is not None,
        GATHER_A=gather_a, SCATTER_C=scatter, SCALE=scale is not None, TOPK=space.topk,
        EVEN_K=K % cfg.BK == 0, H_OUT=h_out is not None, DSWIGLU=dswiglu is not None,
    )


def fp8_grouped_mm(a_q, a_s, expert_offsets, w, w_scale, fmt, out_dtype=torch.bfloat16, *, swiglu=False):
    """One grouped GEMM with FP8 operands: rows [offsets[e], offsets[e+1]) of deq(a) times
    deq(w[e])^T (``w`` [E, N', K] e4m3, checkpoint layout), SwiGLU of the gate / up halves with
    ``swiglu``; other rows zero; output [R, N] in ``out_dtype`` (fp32 accumulation)."""
    _check_device(a_q.device)
    R = a_q.shape[0]
    N = w.shape[1] // 2 if swiglu else w.shape[1]
    out = torch.empty(R, N, device=a_q.device, dtype=out_dtype)
    with device_ctx(a_q.device):
        _mm8(a_q, a_s, RowSpace(expert_offsets.contiguous(), R, w.shape[0]), w, w_scale, fmt, out, swiglu=swiglu)
    return out


def _gemm1(x_q, x_s, space, w1, w1_scale, fmt, F, **kw):
    """GEMM1 + SwiGLU -> (A e4m3 [rows, F], scales): quantized in the epilogue (block) or by a
    rowwise pass over an fp32 A (rowwise)."""
    rows, dev = space.rows, x_q.device
    if fmt == "e4m3_block128":
        a_q = torch.empty(rows, F, device=dev, dtype=FP8)
        a_s = torch.empty(rows, cdiv(F, _BLOCK), device=dev, dtype=torch.float32)
        _mm8(x_q, x_s, space, w1, w1_scale, fmt, a_q, a_s, swiglu=True, **kw)
        return a_q, a_s
    a = torch.empty(rows, F, device=dev, dtype=torch.float32)
    _mm8(x_q, x_s, space, w1, w1_scale, fmt, a, swiglu=True, **kw)
    a_q = torch.empty(rows, F, device=dev, dtype=FP8)
    a_s = torch.empty(rows, 1, device=dev, dtype=torch.float32)
    _quant_launch(a, a_q, a_s, fmt)
    return a_q, a_s


def fp8_grouped_ffn(x_q, x_s, expert_offsets, w1, w1_scale, w2, w2_scale, fmt, out_dtype=torch.bfloat16):
    """SwiGLU expert FFN over a quantized permuted buffer (x_q [R, D] e4m3, x_s its scales) ->
    [R, D] in ``out_dtype``; rows outside the segments are zero."""
    _check_device(x_q.device)
    R, D = x_q.shape
    F = w2.shape[2]
    y = torch.empty(R, D, device=x_q.device, dtype=out_dtype)
    with device_ctx(x_q.device):
        space = RowSpace(expert_offsets.contiguous(), R, w1.shape[0])
        a_q, a_s = _gemm1(x_q, x_s, space, w1, w1_scale, fmt, F)
        _mm8(a_q, a_s, space, w2, w2_scale, fmt, y)
    return y


def fp8_moe_ffn(x_TD, routing: Routing, w1, w1_scale, w2, w2_scale, fmt, out_dtype=None):
    """``out[t] = sum_j w[t, j] * round(FFN_{id[t, j]}(x[t]))`` with FP8 experts: x quantized per
    token, GEMM1 gathers token rows through the routing's row map, GEMM2 writes slot rows (k = 1:
    straight into out, times the gate weight), then the fixed-order combine (see the module
    docstring). Uses ``routing.counts`` for the segments."""
    _check_device(x_TD.device)
    out_dtype = out_dtype or x_TD.dtype
    T, D = x_TD.shape
    ids, w_TK = routing.topk_ids, routing.topk_weights
    k = ids.shape[1]
    E = w1.shape[0]
    F = w2.shape[2]
    dev = x_TD.device
    out = torch.empty(T, D, device=dev, dtype=out_dtype)
    if T == 0:
        return out
    with device_ctx(dev):
        x_q, x_s = fp8_quantize(x_TD, fmt)
        decode = C.decode_path(T, k)
        sel = dict(rows=T * k, num_experts=E, rowwise=fmt != "e4m3_block128", device=dev,
                   decode_tokens=T if decode else None)
        cfg1 = select_fp8("fp8_swiglu", n=F, k=D, **sel)
        cfg2 = select_fp8("fp8_mm", n=D, k=F, **sel)
        # T <= 64: one program builds the row map, offsets and tile map (the decode metadata kernel)
        space = route_rows(ids, routing.counts, E, cfg1.BM, decode=decode)
        a_q, a_s = _gemm1(x_q, x_s, space, w1, w1_scale, fmt, F, gather_a=True, cfg=cfg1)
        w_S = w_TK.reshape(-1)
        if k == 1:
            _mm8(a_q, a_s, space, w2, w2_scale, fmt, out, scatter=True, scale=w_S, cfg=cfg2)
        else:
            y = torch.empty(T * k, D, device=dev, dtype=out_dtype)
            _mm8(a_q, a_s, space, w2, w2_scale, fmt, y, scatter=True, cfg=cfg2)
            _combine(y, w_TK, ids, E, T, k, out)
    return out
