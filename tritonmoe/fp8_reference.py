"""Plain-PyTorch reference of the FP8 (e4m3) expert path: formats, quantize / dequantize, and the
expert FFN computed in fp32 from the dequantized operands.

These are the ground truth of the FP8 kernels (:mod:`tritonmoe.kernels.fp8_gemm`) and the CPU
path of :mod:`tritonmoe.fp8`. Everything is fp32 arithmetic on values that are exact in fp32
(e4m3 values and their products), so where the kernels follow the same recipe they match
bitwise (quantization) or to fp32 rounding of the sums (GEMMs).

Formats (``FORMATS``), scales are fp32 *dequantization multipliers* (``x ~= q * s``, which is
what DeepSeek-V3's checkpoints store under the name ``weight_scale_inv``):

* ``"e4m3_block128"`` (DeepSeek-V3): activations in 1x128 groups along K (scale [M, cdiv(K,128)]),
  weights in 128x128 blocks of the ``[out, in]`` matrix (scale [cdiv(out,128), cdiv(in,128)]).
* ``"e4m3_rowwise"`` (torch ``_scaled_mm``'s rowwise): one scale per activation row (scale
  [M, 1]) and per weight output channel (scale [out]).

Quantization of a group with absolute maximum ``amax`` (fp32): ``s = amax / 448`` (1 when
amax = 0), ``q = e4m3(clamp(x / s, -448, 448))`` with IEEE division and round-to-nearest-even
(subnormals kept), i.e. exactly ``torch``'s ``.to(torch.float8_e4m3fn)``.

Expert weights (:class:`FP8Experts`) are stored in the checkpoint (HF) layout ``[E, out, in]``
(K contiguous, which is what Hopper's FP8 tensor cores read): ``w1`` is [E, 2F, D] (gate rows
[0, F), up rows [F, 2F)), ``w2`` is [E, D, F]. The gate and up halves of ``w1`` are blocked
separately (each from its own row 0), so its block scale is [E, 2 cdiv(F,128), cdiv(D,128)]
whatever F is: exactly the layout of the separate ``gate_proj`` / ``up_proj`` tensors of a
DeepSeek-V3 checkpoint.

The FFN (SwiGLU only: the FP8 models use it): x rows quantized 1x128 (or per row), ``H =
deq(x_q) @ deq(w1)^T`` in fp32, ``A = silu(gate) * up`` in fp32, A quantized the same way (no
rounding to 16 bits in between), ``y = deq(A_q) @ deq(w2)^T`` in fp32, rounded once to the
output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonmoe.core.autograd import first_order
from . import reference
from tritonmoe.core.types import Routing

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FORMATS",
    "FP8Experts",
    "dequantize_gate_up",
    "dequantize_rows",
    "dequantize_weight",
    "fp8_grouped_ffn",
    "fp8_grouped_ffn_train",
    "fp8_grouped_mm",
    "fp8_moe_ffn",
    "fp8_permute",
    "fp8_quantize",
    "quantize_experts",
    "quantize_rows",
    "quantize_weight",
    "scale_groups",
    "swiglu_backward",
]

#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Edge of a scale block (1x128 activation groups, 128x128 weight blocks).
BLOCK = 128
FORMATS = ("e4m3_block128", "e4m3_rowwise")
FP8 = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_groups(k: int, fmt: str) -> int:
    """Scale columns of a quantized [M, k] activation: cdiv(k, 128) (block) or 1 (rowwise)."""
    return _cdiv(k, BLOCK) if fmt == "e4m3_block128" else 1


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    s = amax / E4M3_MAX
    return torch.where(amax > 0, s, torch.ones_like(s))


def _quantize(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def _group(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., K] -> [..., G, width] zero-padded (zeros do not change an amax)."""
    k = x.shape[-1]
    g = _cdiv(k, width)
    pad = g * width - k
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], g, width)


def quantize_rows(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation quantization of x [M, K]: (q e4m3 [M, K], s fp32 [M, G]), G = cdiv(K, 128) for
    "e4m3_block128" (1x128 groups along K) or 1 for "e4m3_rowwise"."""
    xf = x.float()
    M, K = xf.shape
    if fmt == "e4m3_block128":
        xg = _group(xf, BLOCK)  # [M, G, 128]
        s = _scale_from_amax(xg.abs().amax(-1))  # [M, G]
        q = _quantize(xg, s[..., None]).reshape(M, xg.shape[1] * BLOCK)[:, :K]
        return q.contiguous(), s
    if fmt == "e4m3_rowwise":
        amax = xf.abs().amax(-1, keepdim=True) if K else torch.zeros(M, 1)
        s = _scale_from_amax(amax)
        return _quantize(xf, s), s
    raise ValueError(f"unknown FP8 format {fmt!r}; use one of {FORMATS}")


def dequantize_rows(q: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of an activation quantized by :func:`quantize_rows`."""
    M, K = q.shape
    if fmt == "e4m3_block128":
        return q.float() * s.repeat_interleave(BLOCK, dim=1)[:, :K]
    return q.float() * s


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight quantization of w [..., out, in] (checkpoint layout): (q e4m3, s fp32), s
    [..., cdiv(out,128), cdiv(in,128)] (128x128 blocks) or [..., out] (one per output channel)."""
    wf = w.float()
    *lead, N, K = wf.shape
    if fmt == "e4m3_block128":
        wg = _group(wf, BLOCK)  # [..., N, GK, 128]
        wg = _group(wg.transpose(-1, -3), BLOCK)  # [..., 128(k), GK, GN, 128(n)]
        s = _scale_from_amax(wg.abs().amax(dim=(-4, -1)))  # [..., GK, GN]
        q = _quantize(wg, s[..., None, :, :, None])  # [..., 128k, GK, GN, 128n]
        gk, gn = wg.shape[-3], wg.shape[-2]
        q = q.reshape(*q.shape[:-2], gn * BLOCK)[..., :N].transpose(-1, -3).reshape(*lead, N, gk * BLOCK)[..., :K]
        return q.contiguous(), s.transpose(-1, -2).contiguous()
    if fmt == "e4m3_rowwise":
        amax = wf.abs().amax(-1) if K else torch.zeros(*lead, N)
        s = _scale_from_amax(amax)
        return _quantize(wf, s[..., None]), s
    raise ValueError(f"unknown FP8 format {fmt!r}; use one of {FORMATS}")


def dequantize_weight(q: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of a weight quantized by :func:`quantize_weight` ([..., out, in])."""
    N, K = q.shape[-2:]
    if fmt == "e4m3_block128":
        full = s.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)[..., :N, :K]
        return q.float() * full
    return q.float() * s[..., None]


@dataclass(frozen=True)
class FP8Experts:
    """Expert weights in e4m3 with fp32 scales (see the module docstring for the layouts).

    w1: e4m3 [E, 2F, D] (gate rows then up rows), w1_scale: fp32 [E, 2 cdiv(F,128),
    cdiv(D,128)] (block: the gate blocks, then the up blocks) or [E, 2F] (rowwise).
    w2: e4m3 [E, D, F], w2_scale: fp32 [E, cdiv(D,128), cdiv(F,128)] or [E, D]."""

    w1: torch.Tensor
    w1_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    format: str

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def d_model(self) -> int:
        return self.w1.shape[2]

    @property
    def d_ffn(self) -> int:
        return self.w2.shape[2]

    @property
    def device(self) -> torch.device:
        return self.w1.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 [E, D, 2F], w2 [E, F, D]) in tritonmoe's layout (of :func:`tritonmoe.moe_ffn`)."""
        w1 = dequantize_gate_up(self.w1, self.w1_scale, self.format)
        w2 = dequantize_weight(self.w2, self.w2_scale, self.format)
        return w1.transpose(1, 2).to(dtype), w2.transpose(1, 2).to(dtype)


def dequantize_gate_up(w1: torch.Tensor, w1_scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 [E, 2F, D] of a quantized w1 whose gate and up halves are blocked separately."""
    F = w1.shape[1] // 2
    if fmt != "e4m3_block128":
        return dequantize_weight(w1, w1_scale, fmt)
    g = _cdiv(F, BLOCK)
    gate = dequantize_weight(w1[:, :F], w1_scale[:, :g], fmt)
    up = dequantize_weight(w1[:, F:], w1_scale[:, g:], fmt)
    return torch.cat([gate, up], 1)


def quantize_experts(w1: torch.Tensor, w2: torch.Tensor, fmt: str = "e4m3_block128") -> FP8Experts:
    """Quantize SwiGLU expert weights in tritonmoe's layout (w1 [E, D, 2F] gate then up, w2
    [E, F, D]) to :class:`FP8Experts` (checkpoint layout; gate and up blocked separately)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; use one of {FORMATS}")
    F = w2.shape[1]
    w1t = w1.transpose(1, 2)  # [E, 2F, D]
    if fmt == "e4m3_block128":
        qg, sg = quantize_weight(w1t[:, :F], fmt)
        qu, su = quantize_weight(w1t[:, F:], fmt)
        q1, s1 = torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
    else:
        q1, s1 = quantize_weight(w1t, fmt)
    q2, s2 = quantize_weight(w2.transpose(1, 2), fmt)
    return FP8Experts(q1.contiguous(), s1.contiguous(), q2.contiguous(), s2.contiguous(), fmt)


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    F = h.shape[1] // 2
    g = h[:, :F]
    return g * torch.sigmoid(g) * h[:, F:]


def _expert_ffn(xq: torch.Tensor, xs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 FFN of quantized rows of one expert, with dequantized fp32 weights w1 [D, 2F], w2 [F, D]."""
    a = _swiglu(dequantize_rows(xq, xs, fmt) @ w1)
    aq, as_ = quantize_rows(a, fmt)
    return dequantize_rows(aq, as_, fmt) @ w2


def _experts(w1, w1_scale, w2, w2_scale, fmt) -> FP8Experts:
    return FP8Experts(w1, w1_scale, w2, w2_scale, fmt)


def _segments(expert_offsets: torch.Tensor, R: int) -> list[tuple[int, int]]:
    offs = [min(max(int(o), 0), R) for o in expert_offsets.tolist()]
    return [(offs[e], max(offs[e + 1], offs[e])) for e in range(len(offs) - 1)]


# ---------------------------------------------------------------------------------------------
# The ops (signatures of the launchers in tritonmoe.kernels.fp8_gemm)
# ---------------------------------------------------------------------------------------------


def fp8_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` (the op's name in the dispatch table)."""
    return quantize_rows(x, fmt)


def fp8_permute(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int, fmt: str, *, pad_to: int = 1,
                num_rows: int | None = None):
    """:func:`tritonmoe.reference.permute` then :func:`quantize_rows` -> (x_perm e4m3, scales,
    info); padding rows and rows past R are zeros with scale 1 (quantized zero rows)."""
    x_perm, info = reference.permute(x_TD, topk_ids_TK, num_experts, pad_to=pad_to, num_rows=num_rows)
    q, s = quantize_rows(x_perm, fmt)
    return q, s, info


def fp8_grouped_mm(a_q, a_s, expert_offsets, w, w_scale, fmt, out_dtype=torch.bfloat16, *, swiglu=False):
    """Rows [offsets[e], offsets[e+1]) of deq(a) @ deq(w[e])^T in fp32 (SwiGLU of the gate / up
    halves, blocked separately, with ``swiglu``), other rows zero, rounded to ``out_dtype``."""
    R = a_q.shape[0]
    wd = (dequantize_gate_up if swiglu else dequantize_weight)(w, w_scale, fmt).transpose(1, 2)
    out = torch.zeros(R, wd.shape[2] // (2 if swiglu else 1), dtype=torch.float32, device=a_q.device)
    for e, (lo, hi) in enumerate(_segments(expert_offsets, R)):
        if hi > lo:
            h = dequantize_rows(a_q[lo:hi], a_s[lo:hi], fmt) @ wd[e]
            out[lo:hi] = _swiglu(h) if swiglu else h
    return out.to(out_dtype)


def fp8_grouped_ffn(x_q, x_s, expert_offsets, w1, w1_scale, w2, w2_scale, fmt, out_dtype=torch.bfloat16):
    """Expert FFN over a quantized permuted buffer (x_q [R, D] e4m3, x_s its scales): rows
    [offsets[e], offsets[e+1]) through expert e, other rows zero; output [R, D] in ``out_dtype``."""
    experts = _experts(w1, w1_scale, w2, w2_scale, fmt)
    R = x_q.shape[0]
    w1d, w2d = experts.dequantize(torch.float32)
    out = torch.zeros(R, experts.d_model, dtype=torch.float32, device=x_q.device)
    for e, (lo, hi) in enumerate(_segments(expert_offsets, R)):
        if hi > lo:
            out[lo:hi] = _expert_ffn(x_q[lo:hi], x_s[lo:hi], w1d[e], w2d[e], fmt)
    return out.to(out_dtype)


def fp8_moe_ffn(x, routing: Routing, w1, w1_scale, w2, w2_scale, fmt, out_dtype=None):
    """``out[t] = sum_j w[t, j] * round(FFN_{id[t, j]}(x[t]))`` over routed slots (ids in [0, E)):
    x quantized per token, each expert output rounded to ``out_dtype`` (x's dtype by default)
    and the k-way weighted sum in fp32, j ascending (as :func:`tritonmoe.reference.moe_ffn`)."""
    experts = _experts(w1, w1_scale, w2, w2_scale, fmt)
    out_dtype = out_dtype or x.dtype
    topk_ids, topk_weights = routing.topk_ids, routing.topk_weights
    T, k = topk_ids.shape
    E = experts.num_experts
    xq, xs = quantize_rows(x, fmt)
    w1d, w2d = experts.dequantize(torch.float32)
    y = torch.zeros(T, k, experts.d_model, dtype=torch.float32, device=x.device)
    for e in range(E):
        t, j = torch.nonzero(topk_ids == e, as_tuple=True)
        if t.numel():
            y[t, j] = _expert_ffn(xq[t], xs[t], w1d[e], w2d[e], fmt).to(out_dtype).float()
    routed = (topk_ids >= 0) & (topk_ids < E)
    w = torch.where(routed, topk_weights.float(), torch.zeros((), device=x.device))
    out = torch.zeros(T, experts.d_model, dtype=torch.float32, device=x.device)
    for j in range(k):
        out += w[:, j, None] * y[:, j]
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Training (DeepSeek-V3's recipe, block-128 only): FP8 forward, dgrad and wgrad
# ---------------------------------------------------------------------------------------------


def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """dH [R, 2F] of ``A = silu(gate) * up`` from the fp32 pre-activation H and dA (fp32)."""
    F = h.shape[1] // 2
    g, u = h[:, :F], h[:, F:]
    sg = torch.sigmoid(g)
    return torch.cat([da * u * (sg * (1.0 + g * (1.0 - sg))), da * (g * sg)], 1)


def _seg_mm(a: torch.Tensor, w_EKN: torch.Tensor, segs) -> torch.Tensor:
    """Rows of segment e times w[e] (fp32), rows outside the segments zero."""
    out = torch.zeros(a.shape[0], w_EKN.shape[2], dtype=torch.float32, device=a.device)
    for e, (lo, hi) in enumerate(segs):
        if hi > lo:
            out[lo:hi] = a[lo:hi] @ w_EKN[e]
    return out


def _deq_t(x: torch.Tensor) -> torch.Tensor:
    """x^T [C, R] quantized 1x128 along R (the 128x1 blocks of x) and dequantized (fp32)."""
    q, s = quantize_rows(x.t(), "e4m3_block128")
    return dequantize_rows(q, s, "e4m3_block128")


def _wgrad(a_t: torch.Tensor, b_t: torch.Tensor, segs, dtype: torch.dtype) -> torch.Tensor:
    """Per expert a_t[:, seg] @ b_t[:, seg]^T -> [E, M, N]."""
    out = torch.zeros(len(segs), a_t.shape[0], b_t.shape[0], dtype=torch.float32, device=a_t.device)
    for e, (lo, hi) in enumerate(segs):
        if hi > lo:
            out[e] = a_t[:, lo:hi] @ b_t[:, lo:hi].t()
    return out.to(dtype)


class _FP8GroupedFFNTrain(torch.autograd.Function):
    """The reference of :func:`fp8_grouped_ffn_train` (see there)."""

    @staticmethod
    def forward(ctx, x, expert_offsets, w1, w2):
        fmt = "e4m3_block128"
        segs = _segments(expert_offsets, x.shape[0])
        ex = quantize_experts(w1.detach(), w2.detach(), fmt)
        w1d, w2d = ex.dequantize(torch.float32)
        xq, xs = quantize_rows(x.detach(), fmt)
        h = _seg_mm(dequantize_rows(xq, xs, fmt), w1d, segs)
        a = _swiglu(h)
        aq, as_ = quantize_rows(a, fmt)
        y = _seg_mm(dequantize_rows(aq, as_, fmt), w2d, segs)
        ctx.save_for_backward(x, h, w1, w2)
        ctx.segs = segs
        return y.to(x.dtype)

    @staticmethod
    @first_order("fp8_grouped_ffn_train (reference)")
    def backward(ctx, dy):
        fmt = "e4m3_block128"
        x, h, w1, w2 = ctx.saved_tensors
        segs = ctx.segs
        ex = quantize_experts(w1.detach(), w2.detach(), fmt)
        w1d, w2d = ex.dequantize(torch.float32)
        dyq, dys = quantize_rows(dy, fmt)
        da = _seg_mm(dequantize_rows(dyq, dys, fmt), w2d.transpose(1, 2), segs)
        dh = swiglu_backward(h, da)
        dhq, dhs = quantize_rows(dh, fmt)
        dx = _seg_mm(dequantize_rows(dhq, dhs, fmt), w1d.transpose(1, 2), segs).to(x.dtype)
        dw1 = _wgrad(_deq_t(x), _deq_t(dh), segs, w1.dtype)
        dw2 = _wgrad(_deq_t(_swiglu(h)), _deq_t(dy), segs, w2.dtype)
        return dx, None, dw1, dw2


def fp8_grouped_ffn_train(x, expert_offsets, w1, w2):
    """SwiGLU expert FFN over a permuted buffer with FP8 compute and master weights w1 [E, D, 2F],
    w2 [E, F, D] (any float dtype), differentiable in x, w1, w2 (DeepSeek-V3's recipe, block-128):

    * forward: weights quantized 128x128 at each call, x and A 1x128, as the inference path (but
      the pre-activation H is kept in fp32 for backward);
    * dgrad: dY and dH quantized 1x128 along their columns, times the same weight blocks
      transposed (``dA = dY W2^T``, ``dH = swiglu'(H) dA``, ``dX = dH W1^T``);
    * wgrad: X, dH, A and dY quantized in 128x1 blocks (1x128 groups of their transposes along
      the rows of the buffer), ``dW1[e] = X_e^T dH_e``, ``dW2[e] = A_e^T dY_e``, fp32 sums rounded
      to the weights' dtype.

    dX and y in x's dtype. Requires F % 128 == 0 (the gate / up blocks then tile 2F)."""
    return _FP8GroupedFFNTrain.apply(x, expert_offsets, w1, w2)
