"""FP8 (e4m3) experts: the public ops. Validate at the boundary, then dispatch (the reference is
:mod:`tritonmoe.fp8_reference`, the kernels :mod:`tritonmoe.kernels.fp8_gemm`).

* :func:`quantize_experts` - SwiGLU expert weights (tritonmoe's layout) -> :class:`FP8Experts`.
* :func:`load_fp8_experts` - an HF / DeepSeek-V3 FP8 checkpoint's experts (``weight`` e4m3 plus
  ``weight_scale_inv`` fp32 128x128 block scales, or ``weight_scale`` per channel) ->
  :class:`FP8Experts`, kept in FP8 (nothing dequantized).
* :func:`fp8_quantize`, :func:`fp8_permute` (the permute with the activation quantization fused
  into its scatter), :func:`fp8_grouped_ffn` (over a quantized permuted buffer) and
  :func:`fp8_moe_ffn` (routing in, combined output out).

* :func:`fp8_grouped_ffn_train` - training: the FFN over a permuted buffer with FP8 forward,
  dgrad and wgrad (DeepSeek-V3's recipe), master weights in their own dtype.

Formats: ``"e4m3_block128"`` (DeepSeek-V3: 1x128 activation groups, 128x128 weight blocks) and
``"e4m3_rowwise"`` (per activation row, per weight output channel). The inference ops have no
backward (they refuse inputs that require grad).
"""

from __future__ import annotations

from typing import Mapping

import torch

from tritonmoe.core import validation as V
from tritonmoe.core.settings import validation_enabled
from tritonmoe.backends import implementation
from .fp8_reference import BLOCK, FORMATS, FP8Experts, dequantize_gate_up
from .fp8_reference import quantize_experts as _quantize_experts
from tritonmoe.core.types import PermuteInfo, Routing

__all__ = [
    "FORMATS",
    "FP8Experts",
    "check_fp8_experts",
    "dequantize_gate_up",
    "fp8_grouped_ffn",
    "fp8_grouped_ffn_train",
    "pack_fp8_rows",
    "unpack_fp8_rows",
    "fp8_moe_ffn",
    "fp8_permute",
    "fp8_quantize",
    "load_fp8_experts",
    "quantize_experts",
]

FP8 = torch.float8_e4m3fn
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _format(fmt) -> str:
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a str, got {type(fmt).__name__}; use one of {FORMATS}")
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not an FP8 format; use one of {FORMATS}")
    return fmt


def _no_grad_input(name: str, t: torch.Tensor) -> None:
    if torch.is_grad_enabled() and t.requires_grad:
        raise ValueError(f"{name} requires grad, but the FP8 ops are inference-only (no backward yet); "
                         "call them under torch.no_grad() or detach the input")


def quantize_experts(w1: torch.Tensor, w2: torch.Tensor, format: str = "e4m3_block128") -> FP8Experts:
    """Quantize SwiGLU expert weights to e4m3 with fp32 scales.

    Args:
        w1: [E, d, 2f] (gate columns then up columns, tritonmoe's layout), fp16/bf16/fp32/fp64.
        w2: [E, f, d].
        format: "e4m3_block128" (128x128 blocks, gate and up blocked separately) or
            "e4m3_rowwise" (one scale per output channel).

    Returns: :class:`FP8Experts` in the checkpoint layout (w1 [E, 2f, d], w2 [E, d, f]).
    Raises ValueError for non-finite weights (a NaN or inf would poison a whole block's scale).
    """
    fmt = _format(format)
    V.float_tensor("w1", w1, 3)
    V.float_tensor("w2", w2, 3)
    E, D, N1 = w1.shape
    if N1 % 2 or tuple(w2.shape) != (E, N1 // 2, D):
        raise ValueError(f"w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} are not SwiGLU experts: expected w1 "
                         f"[E, d, 2f] and w2 [E, f, d] (the FP8 path supports activation='swiglu' only)")
    V.same_device(w1=w1, w2=w2)
    if not (torch.isfinite(w1).all() and torch.isfinite(w2).all()):  # offline op: the host sync is fine
        raise ValueError("w1 / w2 hold NaN or inf; FP8 scales need finite weights")
    return _quantize_experts(w1.detach(), w2.detach(), fmt)


def _get(state_dict: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state_dict:
        raise ValueError(f"the checkpoint has no {key!r}; load_fp8_experts expects '<prefix><j>.gate_proj.weight' "
                         "(and up_proj, down_proj) with their 'weight_scale_inv' or 'weight_scale'")
    return state_dict[key]


def _load_proj(sd, key: str, out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    w = _get(sd, key + ".weight")
    if w.dtype != FP8:
        raise TypeError(f"{key}.weight is {w.dtype}, not torch.float8_e4m3fn; quantize_experts quantizes 16-bit "
                        "experts")
    if tuple(w.shape) != (out_f, in_f):
        raise ValueError(f"{key}.weight has shape {tuple(w.shape)}, expected [{out_f}, {in_f}]")
    if key + ".weight_scale_inv" in sd:
        s = sd[key + ".weight_scale_inv"]
        want = (_cdiv(out_f, BLOCK), _cdiv(in_f, BLOCK))
        fmt = "e4m3_block128"
    else:
        s = _get(sd, key + ".weight_scale")
        s = s.reshape(-1) if s.dim() == 2 and s.shape[1] == 1 else s
        want = (out_f,)
        fmt = "e4m3_rowwise"
    if tuple(s.shape) != want:
        raise ValueError(f"{key}'s scale has shape {tuple(s.shape)}, expected {list(want)} for {fmt} "
                         "(128x128 blocks: [cdiv(out,128), cdiv(in,128)]; per channel: [out] or [out, 1])")
    if not s.is_floating_point():
        raise TypeError(f"{key}'s scale is {s.dtype}; expected a float tensor")
    return w, s.float(), fmt


def load_fp8_experts(state_dict: Mapping[str, torch.Tensor], prefix: str, num_experts: int, *,
                     device: torch.device | str | None = None) -> FP8Experts:
    """Experts of one MoE layer from an FP8 checkpoint's state dict, kept in e4m3.

    Keys (DeepSeek-V3 / Qwen3 FP8 layout): ``f"{prefix}{j}.{proj}.weight"`` (e4m3 [out, in]) and
    ``.weight_scale_inv`` (fp32 [cdiv(out,128), cdiv(in,128)], the dequantization multiplier of
    each 128x128 block) or ``.weight_scale`` (per output channel: "e4m3_rowwise"), for ``proj``
    in gate_proj [f, d], up_proj [f, d], down_proj [d, f] and experts j < ``num_experts``; e.g.
    ``prefix="model.layers.3.mlp.experts."``. All projections must use one format.

    Returns: :class:`FP8Experts` (w1 = gate rows then up rows, each keeping its own blocks).
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    E = V.positive_int("num_experts", num_experts)
    gate0 = _get(state_dict, f"{prefix}0.gate_proj.weight")
    if gate0.dim() != 2:
        raise ValueError(f"{prefix}0.gate_proj.weight has {gate0.dim()} dims, expected [f, d]")
    F, D = gate0.shape
    w1, s1, w2, s2, fmts = [], [], [], [], set()
    for j in range(E):
        g, gs, f1 = _load_proj(state_dict, f"{prefix}{j}.gate_proj", F, D)
        u, us, f2 = _load_proj(state_dict, f"{prefix}{j}.up_proj", F, D)
        d, ds, f3 = _load_proj(state_dict, f"{prefix}{j}.down_proj", D, F)
        fmts |= {f1, f2, f3}
        w1.append(torch.cat([g, u], 0))
        s1.append(torch.cat([gs, us], 0))
        w2.append(d)
        s2.append(ds)
    if len(fmts) > 1:
        raise ValueError(f"the experts under {prefix!r} mix scale formats {sorted(fmts)}; expected one")
    out = [torch.stack(t).to(device) if device is not None else torch.stack(t) for t in (w1, s1, w2, s2)]
    return FP8Experts(*out, fmts.pop())


def check_fp8_experts(ex: FP8Experts) -> None:
    """Raise TypeError / ValueError unless ``ex`` has the layouts of :mod:`tritonmoe.fp8_reference`
    (an FP8Experts built by hand may not have them)."""
    if not isinstance(ex, FP8Experts):
        raise TypeError(f"experts must be tritonmoe.fp8.FP8Experts, got {type(ex).__name__}")
    if ex.format not in FORMATS:
        raise ValueError(f"experts.format={ex.format!r}; use one of {FORMATS}")
    for name in ("w1", "w2"):
        t = getattr(ex, name)
        if not isinstance(t, torch.Tensor) or t.dtype != FP8 or t.dim() != 3:
            raise TypeError(f"experts.{name} must be a 3-D torch.float8_e4m3fn tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    E, N1, D = ex.w1.shape
    F = N1 // 2
    if N1 % 2 or tuple(ex.w2.shape) != (E, D, F):
        raise ValueError(f"experts.w1 {tuple(ex.w1.shape)} and w2 {tuple(ex.w2.shape)} are not [E, 2f, d] and "
                         "[E, d, f] (the checkpoint layout, gate rows then up rows)")
    if ex.format == "e4m3_block128":
        want1, want2 = (E, 2 * _cdiv(F, BLOCK), _cdiv(D, BLOCK)), (E, _cdiv(D, BLOCK), _cdiv(F, BLOCK))
    else:
        want1, want2 = (E, 2 * F), (E, D)
    for name, want in (("w1_scale", want1), ("w2_scale", want2)):
        t = getattr(ex, name)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != want:
            raise ValueError(f"experts.{name} must be fp32 {list(want)} for {ex.format}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def _check_experts(experts, x: torch.Tensor, d: int) -> FP8Experts:
    if not isinstance(experts, FP8Experts):
        raise TypeError(f"experts must be tritonmoe.fp8.FP8Experts (from quantize_experts / load_fp8_experts), "
                        f"got {type(experts).__name__}")
    check_fp8_experts(experts)
    if experts.d_model != d:
        raise ValueError(f"the experts' d_model is {experts.d_model} but the input has {d} columns")
    V.same_device(x=x, w1=experts.w1, w2=experts.w2, w1_scale=experts.w1_scale, w2_scale=experts.w2_scale)
    return experts


def fp8_quantize(x: torch.Tensor, format: str = "e4m3_block128", *, backend: str | None = None):
    """Quantize x [M, K] -> (e4m3 [M, K], fp32 scales [M, cdiv(K,128)] or [M, 1])."""
    fmt = _format(format)
    V.float_tensor("x", x, 2)
    return implementation("fp8_quantize", backend, x.device, x.dtype)(x, fmt)


def fp8_permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, format: str = "e4m3_block128", *,
                pad_to: int = 1, num_rows: int | None = None, backend: str | None = None):
    """:func:`tritonmoe.permute` with the activation quantization fused in: (x_perm e4m3 [R, d]
    (or [num_rows, d]), scales, :class:`PermuteInfo`); zero rows have scale 1. Same host-sync
    rule as permute (none with ``num_rows``)."""
    fmt = _format(format)
    V.permute_args(x, topk_ids, num_experts, pad_to, num_rows)
    if validation_enabled():
        V.ids_values(topk_ids, int(num_experts))
    impl = implementation("fp8_permute", backend, x.device, x.dtype)
    return impl(x, topk_ids, int(num_experts), fmt, pad_to=int(pad_to),
                num_rows=None if num_rows is None else int(num_rows))


def fp8_grouped_ffn(x_q: torch.Tensor, x_scale: torch.Tensor, expert_offsets: torch.Tensor, experts: FP8Experts, *,
                    out_dtype: torch.dtype = torch.bfloat16, backend: str | None = None) -> torch.Tensor:
    """SwiGLU expert FFN over a quantized permuted buffer (from :func:`fp8_permute`): rows
    [offsets[e], offsets[e+1]) through expert e, rows outside zero; fp32 accumulation, the
    activation requantized 1x128 (or per row) for the second GEMM; output [R, d] in ``out_dtype``."""
    if not isinstance(x_q, torch.Tensor) or x_q.dtype != FP8 or x_q.dim() != 2:
        raise TypeError("x_q must be a 2-D torch.float8_e4m3fn tensor (from fp8_permute / fp8_quantize)")
    ex = _check_experts(experts, x_q, x_q.shape[1])
    R, D = x_q.shape
    G = _cdiv(D, BLOCK) if ex.format == "e4m3_block128" else 1
    if not isinstance(x_scale, torch.Tensor) or x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (R, G):
        raise ValueError(f"x_scale must be fp32 [{R}, {G}] for {ex.format}, got "
                         f"{getattr(x_scale, 'dtype', type(x_scale))} {tuple(getattr(x_scale, 'shape', ()))}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype}; use one of {_OUT_DTYPES}")
    V.offsets_args("expert_offsets", expert_offsets, ex.num_experts)
    if validation_enabled():
        V.offsets_values("expert_offsets", expert_offsets, R, allow_tail=True)
    impl = implementation("fp8_grouped_ffn", backend, x_q.device, None)
    return impl(x_q, x_scale, expert_offsets, ex.w1, ex.w1_scale, ex.w2, ex.w2_scale, ex.format, out_dtype)


def fp8_moe_ffn(x: torch.Tensor, routing: Routing, experts: FP8Experts, *, backend: str | None = None) -> torch.Tensor:
    """The expert path of a MoE layer with FP8 experts: ``out[t] = sum_j w[t, j] *
    FFN_{id[t, j]}(x[t])`` (x quantized per token; see :mod:`tritonmoe.fp8_reference` for the
    arithmetic); output in x's dtype. Inference only."""
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a tritonmoe.Routing, got {type(routing).__name__}")
    V.float_tensor("x", x, 2)
    if x.dtype not in _OUT_DTYPES:
        raise TypeError(f"x is {x.dtype}; the FP8 path takes bf16 / fp16 / fp32 activations")
    ex = _check_experts(experts, x, x.shape[1])
    if routing.num_experts != ex.num_experts:
        raise ValueError(f"routing is over {routing.num_experts} experts but experts has {ex.num_experts}")
    if routing.topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"routing is for {routing.topk_ids.shape[0]} tokens but x has {x.shape[0]}")
    V.same_device(x=x, topk_ids=routing.topk_ids, topk_weights=routing.topk_weights, counts=routing.counts)
    for name, t in (("x", x), ("routing.topk_weights", routing.topk_weights)):
        _no_grad_input(name, t)
    if validation_enabled():
        V.ids_values(routing.topk_ids, ex.num_experts)
        V.counts_values(routing)
    impl = implementation("fp8_moe_ffn", backend, x.device, x.dtype)
    return impl(x, routing, ex.w1, ex.w1_scale, ex.w2, ex.w2_scale, ex.format, x.dtype)


def fp8_grouped_ffn_train(x: torch.Tensor, expert_offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
                          backend: str | None = None) -> torch.Tensor:
    """SwiGLU expert FFN over a permuted buffer with FP8 compute in forward and backward
    (DeepSeek-V3's recipe, "e4m3_block128"), differentiable in x, w1 and w2, which stay in their
    own dtype (master weights): each call quantizes the weights in 128x128 blocks, activations
    and output gradients in 1x128 groups for the forward and dgrad GEMMs and in 128x1 blocks for
    the weight gradients (see :func:`tritonmoe.fp8_reference.fp8_grouped_ffn_train`).

    Args:
        x: [R, d] permuted rows (fp16 / bf16 / fp32; fp64 runs the reference).
        expert_offsets: [E+1] segment starts (rows at or past offsets[E] give zeros).
        w1: [E, d, 2f] (gate, then up), w2: [E, f, d], with f a multiple of 128.
    """
    V.float_tensor("x", x, 2)
    V.float_tensor("w1", w1, 3)
    V.float_tensor("w2", w2, 3)
    E, D, N1 = w1.shape
    if x.shape[1] != D or N1 % 2 or tuple(w2.shape) != (E, N1 // 2, D):
        raise ValueError(f"x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}: expected x [R, d], "
                         "w1 [E, d, 2f] and w2 [E, f, d] (SwiGLU experts)")
    if (N1 // 2) % BLOCK:
        raise ValueError(f"d_ffn={N1 // 2} is not a multiple of {BLOCK}: FP8 training needs the gate and up "
                         "128x128 blocks to tile 2*d_ffn (dgrad quantizes dH in 128-column groups of it)")
    V.same_device(x=x, w1=w1, w2=w2)
    V.offsets_args("expert_offsets", expert_offsets, E)
    if validation_enabled():
        V.offsets_values("expert_offsets", expert_offsets, x.shape[0], allow_tail=True)
    impl = implementation("fp8_grouped_ffn_train", backend, x.device, x.dtype)
    return impl(x, expert_offsets, w1, w2)


def pack_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 rows [R, D] and their fp32 scales [R, G] as one uint8 buffer [R, D + 4G] (each row's
    bytes, then its scales' bytes): what an all-to-all moves when the dispatched activations
    travel in FP8 (D + 4G bytes a row against 2D for bf16)."""
    if q.dtype != FP8 or scale.dtype != torch.float32 or q.dim() != 2 or scale.shape[0] != q.shape[0]:
        raise TypeError(f"expected e4m3 [R, D] and fp32 [R, G], got {q.dtype} {tuple(q.shape)} and "
                        f"{scale.dtype} {tuple(scale.shape)}")
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], 1)


def unpack_fp8_rows(packed: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_fp8_rows` for rows of ``d`` e4m3 values: (e4m3 [R, d] (a view),
    fp32 scales [R, G])."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or (packed.shape[1] - d) % 4 or packed.shape[1] <= d:
        raise ValueError(f"packed FP8 rows must be uint8 [R, {d} + 4G], got {packed.dtype} {tuple(packed.shape)}")
    return packed[:, :d].view(FP8), packed[:, d:].contiguous().view(torch.float32)
