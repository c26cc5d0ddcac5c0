"""Grouped expert FFN on Triton: ``grouped_gemm``, ``grouped_ffn`` and the fused ``moe_ffn``.

Launchers with the signatures of :mod:`tritonmoe.reference` (registered in
:data:`tritonmoe.dispatch.OPS`); the kernels are in ``_grouped_gemm_kernels.py`` and the
launch parameters in ``_gemm_config.py``.

Shape letters: T tokens, k slots per token, E experts, D d_model, F d_ffn, N1 the first GEMM's
columns (2F for SwiGLU: gate then up), R rows of a permuted buffer. In the fused path the row
space has T*k rows, one per (token, slot), grouped by expert (``row_map`` gives the slot of each
row), and its tail [offsets[E], T*k) holds the unrouted slots.

Paths:

* ``grouped_gemm(x [R, K], offsets, w [E, K, N])``: one grouped GEMM; backward = a grouped GEMM
  with ``w^T`` (a strided view, no copy) for dx and per-expert ``x_e^T dy_e`` for dw.
* ``grouped_ffn(x [R, D], offsets, w1, w2, act)``: GEMM1 with the activation in its epilogue
  writes the activation A [R, F] (and the pre-activation H [R, N1] when backward will need it,
  see :func:`tritonmoe.kernels._gemm_config.ffn_preact_mode`), GEMM2 writes y [R, D].
  Backward: ``dH = act'(H) * (dy @ w2^T)`` in one kernel (activation backward in the epilogue),
  ``dx = dH @ w1^T``, ``dw1 = x^T dH``, ``dw2 = A^T dy`` per expert.
* ``moe_ffn(x [T, D], routing, w1, w2, act)``: GEMM1 reads token rows of x through the routing
  metadata (no x_perm), GEMM2 writes each row's output in slot order into a [T*k, D] buffer
  (k = 1: straight into the output, times its gate weight), and a fixed-order combine sums the k
  rows of each token times their gate weights in fp32 (no y_perm in expert order, no atomics).
  Backward gathers the output gradient by token inside the kernels, reduces the gate-weight
  gradient in the ``dH`` kernel's epilogue (partial sums per column tile, summed in a fixed
  order), scatters dx rows to slot order and combines them like the forward.

Nothing here reads device values on the host: tile maps are built on the device from the offsets
(see ``_grouped_gemm_kernels``), grids are sized from shapes. Every output element is written by
exactly one program and every reduction runs in a fixed order, so results are deterministic run
to run.

Precision: fp32 accumulation everywhere; fp16/bf16 operands use the tensor cores; fp32 operands
use IEEE fp32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set, then TF32 (read at each
call, like torch's own matmuls). fp64 inputs have no tensor-core path: the launchers refuse them
and :mod:`tritonmoe.dispatch` sends them to :mod:`tritonmoe.reference`.

Backward and the pre-activation: saved by default (one extra [rows, N1] write in forward),
recomputed by rerunning GEMM1 with ``TRITONMOE_FFN_PREACT=recompute`` or
``_gemm_config.preact_mode("recompute")``; both give the same bits (see
:func:`tritonmoe.kernels._gemm_config.ffn_preact_mode` for the reasoning). The activation A is
written by the forward anyway (GEMM2 reads it) and is kept for dw2 in "save" mode.
"""

from __future__ import annotations

import torch
import triton
from torch.autograd.function import once_differentiable

from ..types import Routing
from . import _gemm_config as C
from . import _grouped_gemm_persistent as P
from ._grouped_gemm_kernels import (
    ACT_GELU,
    ACT_NONE,
    ACT_RELU,
    ACT_SWIGLU,
    _combine_kernel,
    _grouped_mm_dact_kernel,
    _grouped_mm_kernel,
    _grouped_wgrad_kernel,
)

__all__ = ["grouped_gemm", "grouped_ffn", "moe_ffn", "route_rows"]

_ACT = {"swiglu": ACT_SWIGLU, "gelu": ACT_GELU, "relu": ACT_RELU}


def _tf32(dtype: torch.dtype) -> bool:
    """fp32 GEMMs use TF32 only where the caller allowed it for torch's own matmuls."""
    return dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)


def _prec(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "tf32" if _tf32(dtype) else "ieee"
    return "tf32"  # the setting only chooses TF32 vs IEEE for fp32 operands; 16-bit ones ignore it


def _seg(E: int) -> int:
    return triton.next_power_of_2(E + 1)


# ---------------------------------------------------------------------------------------------
# Launch helpers (inputs validated by the public API; they write every output element once)
# ---------------------------------------------------------------------------------------------


def _mm(
    a: torch.Tensor,
    offsets: torch.Tensor,
    b_EKN: torch.Tensor,
    out: torch.Tensor,
    *,
    rows: int,
    act: int = ACT_NONE,
    h: torch.Tensor | None = None,
    row_map: torch.Tensor | None = None,
    topk: int = 1,
    gather_a: bool = False,
    scatter: bool = False,
    scale: torch.Tensor | None = None,
) -> None:
    """``out[row] = act(a[row'] @ b[seg(row)])`` over the row space of ``rows`` rows (see
    :func:`_grouped_mm_kernel`). For SwiGLU, ``b`` holds gate then up columns and ``out`` gets half
    of them."""
    E, K, NB = b_EKN.shape
    dual = act == ACT_SWIGLU
    N = NB // 2 if dual else NB
    if rows == 0 or N == 0:
        return
    dev = a.device
    kind = "swiglu" if dual else ("mm" if act == ACT_NONE else "mm_act")
    cfg = C.select(kind, rows=rows, n=N, k=K, num_experts=E, dtype=a.dtype, tf32=_tf32(a.dtype), device=dev)
    if cfg.variant == "persistent":  # the one variant switch (kernels/_grouped_gemm_persistent.py)
        P.mm(a, offsets, b_EKN, out, cfg, rows=rows, act=act, h=h, row_map=row_map, topk=topk, gather_a=gather_a,
             scatter=scatter, scale=scale, prec=_prec(a.dtype))
        return
    num_pid_m = triton.cdiv(rows, cfg.BM) + E
    grid = (num_pid_m * triton.cdiv(N, cfg.BN),)
    # Arguments a flag switches off are never dereferenced: any tensor stands in for them.
    hh = h if h is not None else out
    C.launch(
        _grouped_mm_kernel, grid, cfg, ("N", "K", "ROWS_HINT"), dev, a.element_size(), dual,
        a, b_EKN, out, hh, offsets, row_map if row_map is not None else offsets, scale if scale is not None else out,
        rows, N, K, E, topk, num_pid_m, C.rows_hint(rows, E),
        a.stride(0), a.stride(1),
        b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
        out.stride(0), out.stride(1),
        hh.stride(0), hh.stride(1),
        ACT=act, STORE_H=h is not None, GATHER_A=gather_a, SCATTER_C=scatter, SCALE=scale is not None,
        PREC=_prec(a.dtype), EVEN_K=K % cfg.BK == 0, SEG=_seg(E),
    )


def _dact(
    g: torch.Tensor,
    offsets: torch.Tensor,
    w2t_EDF: torch.Tensor,
    h: torch.Tensor,
    act: int,
    *,
    rows: int,
    row_map: torch.Tensor | None = None,
    topk: int = 1,
    gather: bool = False,
    scale: torch.Tensor | None = None,
    dgate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dH [rows, N1] = act'(H) * round(g @ w2^T) (see :func:`_grouped_mm_dact_kernel`), and with
    ``dgate`` the gate-weight gradient per slot (fp32 [rows], indexed by ``row_map``'s slots)."""
    E, D, F = w2t_EDF.shape
    N1 = h.shape[1]
    dev = g.device
    dh = torch.empty(rows, N1, device=dev, dtype=g.dtype)
    kind = "dact_swiglu" if act == ACT_SWIGLU else "dact"
    cfg = C.select(kind, rows=rows, n=F, k=D, num_experts=E, dtype=g.dtype, tf32=_tf32(g.dtype), device=dev)
    n_tiles = triton.cdiv(F, cfg.BN)
    part = torch.empty(rows, n_tiles, device=dev, dtype=torch.float32) if dgate else None
    if rows == 0 or F == 0:
        if dgate:
            return dh, torch.zeros(rows, device=dev, dtype=torch.float32)
        return dh, None
    num_pid_m = triton.cdiv(rows, cfg.BM) + E
    grid = (num_pid_m * n_tiles,)
    C.launch(
        _grouped_mm_dact_kernel, grid, cfg, ("N", "K", "ROWS_HINT"), dev, g.element_size(), False,
        g, w2t_EDF, h, dh, offsets, row_map if row_map is not None else offsets,
        scale if scale is not None else dh, part if part is not None else dh,
        rows, F, D, E, topk, num_pid_m, C.rows_hint(rows, E),
        g.stride(0), g.stride(1),
        w2t_EDF.stride(0), w2t_EDF.stride(1), w2t_EDF.stride(2),
        h.stride(0), h.stride(1),
        dh.stride(0), dh.stride(1),
        n_tiles,
        ACT=act, GATHER_A=gather, SCALE=scale is not None, DGATE=dgate,
        PREC=_prec(g.dtype), EVEN_K=D % cfg.BK == 0, SEG=_seg(E),
    )
    # Fixed-order reduction of the column-tile partials: deterministic.
    return dh, (part.sum(dim=1) if dgate else None)


def _wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    num_experts: int,
    out_dtype: torch.dtype,
    *,
    row_map: torch.Tensor | None = None,
    topk: int = 1,
    gather_a: bool = False,
    gather_b: bool = False,
    scale_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert ``a_e^T @ b_e`` -> [E, M, N] (see :func:`_grouped_wgrad_kernel`)."""
    M, N = a.shape[1], b.shape[1]
    E = num_experts
    dev = a.device
    out = torch.empty(E, M, N, device=dev, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    rows = row_map.shape[0] if row_map is not None else a.shape[0]  # size of the row space
    cfg = C.select("wgrad", rows=rows, n=N, k=M, num_experts=E, dtype=a.dtype, tf32=_tf32(a.dtype), device=dev)
    grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN), E)
    C.launch(
        _grouped_wgrad_kernel, grid, cfg, ("M", "N", "ROWS_HINT"), dev, a.element_size(), False,
        a, b, out, offsets, row_map if row_map is not None else offsets, scale_b if scale_b is not None else out,
        rows, M, N, topk, C.rows_hint(rows, E),
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        GATHER_A=gather_a, GATHER_B=gather_b, SCALE_B=scale_b is not None, PREC=_prec(a.dtype),
    )
    return out


def _combine(buf: torch.Tensor, w_flat: torch.Tensor | None, T: int, topk: int, out: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j (w[t, j] *) buf[t*k + j] in fp32, j ascending (see :func:`_combine_kernel`)."""
    D = out.shape[1]
    if T == 0 or D == 0:
        return out
    BT, BD, warps = C.combine_config(out.device)
    grid = (triton.cdiv(T, BT), triton.cdiv(D, BD))
    _combine_kernel[grid](
        buf, w_flat if w_flat is not None else buf, out, T, D,
        buf.stride(0), buf.stride(1), out.stride(0), out.stride(1),
        TOPK=topk, HAS_W=w_flat is not None, BT=BT, BD=BD, num_warps=warps,
    )
    return out


def route_rows(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row space of the fused path, built with a few device ops (no host sync).

    Returns ``offsets`` int64 [E+1] (segment starts; offsets[E] = routed slots) and ``row_map``
    int64 [T*k]: the slot ``t*k + j`` held by each row, rows grouped by expert and, inside an
    expert, ordered by token then slot (the order of :func:`tritonmoe.reference.permute`);
    unrouted slots (id -1; any id outside [0, E) is treated alike) form the tail.
    Example: ids [[1, 0], [1, 2], [-1, 1]], E=3 -> offsets [0, 1, 4, 5], row_map [1, 0, 2, 5, 3, 4].
    """
    E = num_experts
    flat = topk_ids_TK.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
    row_map = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts[:E], 0, out=offsets[1:])
    return offsets, row_map


# ---------------------------------------------------------------------------------------------
# Autograd functions
# ---------------------------------------------------------------------------------------------


def _needs_grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


class _GroupedGemmFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RK, offsets, w_EKN):
        R = x_RK.shape[0]
        y = torch.empty(R, w_EKN.shape[2], device=x_RK.device, dtype=x_RK.dtype)
        _mm(x_RK, offsets, w_EKN, y, rows=R)
        ctx.save_for_backward(x_RK, offsets, w_EKN)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_RN):
        x_RK, offsets, w_EKN = ctx.saved_tensors
        R = x_RK.shape[0]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x_RK, memory_format=torch.contiguous_format)
            _mm(dy_RN, offsets, w_EKN.transpose(1, 2), dx, rows=R)
        if ctx.needs_input_grad[2]:
            dw = _wgrad(x_RK, dy_RN, offsets, w_EKN.shape[0], w_EKN.dtype)
        return dx, None, dw


def _ffn_first(x, offsets, w1, act, rows, save_h, **gather):
    """GEMM1 with the activation epilogue -> (A [rows, F], H [rows, N1] or None)."""
    E, D, N1 = w1.shape
    F = N1 // 2 if act == ACT_SWIGLU else N1
    a = torch.empty(rows, F, device=x.device, dtype=x.dtype)
    h = torch.empty(rows, N1, device=x.device, dtype=x.dtype) if save_h else None
    _mm(x, offsets, w1, a, rows=rows, act=act, h=h, **gather)
    return a, h


class _GroupedFFNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, offsets, w1_EDN, w2_EFD, activation, needs_grad):
        R = x_RD.shape[0]
        act = _ACT[activation]
        save = needs_grad and C.ffn_preact_mode() == "save"
        a_RF, h_RN = _ffn_first(x_RD, offsets, w1_EDN, act, R, save)
        y_RD = torch.empty(R, w2_EFD.shape[2], device=x_RD.device, dtype=x_RD.dtype)
        _mm(a_RF, offsets, w2_EFD, y_RD, rows=R)
        ctx.act = act
        if needs_grad:
            if save:
                ctx.save_for_backward(x_RD, offsets, w1_EDN, w2_EFD, a_RF, h_RN)
            else:
                ctx.save_for_backward(x_RD, offsets, w1_EDN, w2_EFD)
        return y_RD

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_RD):
        saved = ctx.saved_tensors
        x_RD, offsets, w1_EDN, w2_EFD = saved[:4]
        act = ctx.act
        R = x_RD.shape[0]
        if len(saved) == 6:
            a_RF, h_RN = saved[4:]
        else:
            a_RF, h_RN = _ffn_first(x_RD, offsets, w1_EDN, act, R, True)
        need_x, need_w1, need_w2 = ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        dx = dw1 = dw2 = None
        if need_x or need_w1:
            dh_RN, _ = _dact(dy_RD, offsets, w2_EFD.transpose(1, 2), h_RN, act, rows=R)
            if need_x:
                dx = torch.empty(R, x_RD.shape[1], device=x_RD.device, dtype=x_RD.dtype)
                _mm(dh_RN, offsets, w1_EDN.transpose(1, 2), dx, rows=R)
            if need_w1:
                dw1 = _wgrad(x_RD, dh_RN, offsets, w1_EDN.shape[0], w1_EDN.dtype)
        if need_w2:
            dw2 = _wgrad(a_RF, dy_RD, offsets, w2_EFD.shape[0], w2_EFD.dtype)
        return dx, None, dw1, dw2, None, None


class _MoEFFNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_weights_TK, topk_ids_TK, w1_EDN, w2_EFD, activation, needs_grad):
        T, D = x_TD.shape
        k = topk_ids_TK.shape[1]
        E = w1_EDN.shape[0]
        act = _ACT[activation]
        rows = T * k
        offsets, row_map = route_rows(topk_ids_TK, E)
        # Gate weights per slot; unrouted slots weigh 0 whatever their stored weight (as in unpermute).
        ids_S = topk_ids_TK.reshape(-1)
        routed_S = (ids_S >= 0) & (ids_S < E)
        w_flat = torch.where(routed_S, topk_weights_TK.reshape(-1).to(torch.float32), 0.0)
        save = needs_grad and C.ffn_preact_mode() == "save"
        gather = dict(row_map=row_map, topk=k, gather_a=True)
        a_RF, h_RN = _ffn_first(x_TD, offsets, w1_EDN, act, rows, save, **gather)
        out_TD = torch.empty(T, w2_EFD.shape[2], device=x_TD.device, dtype=x_TD.dtype)
        if k == 1:
            # One slot per token: the epilogue writes w * y straight into the token's row.
            _mm(a_RF, offsets, w2_EFD, out_TD, rows=rows, row_map=row_map, scatter=True, scale=w_flat)
        else:
            # y rows in slot order (t*k + j), then the fixed-order weighted sum over j.
            y_SD = torch.empty(rows, w2_EFD.shape[2], device=x_TD.device, dtype=x_TD.dtype)
            _mm(a_RF, offsets, w2_EFD, y_SD, rows=rows, row_map=row_map, scatter=True)
            _combine(y_SD, w_flat, T, k, out_TD)
        ctx.act, ctx.k = act, k
        if needs_grad:
            extra = (a_RF, h_RN) if save else ()
            ctx.save_for_backward(x_TD, topk_weights_TK, w1_EDN, w2_EFD, offsets, row_map, w_flat, *extra)
        return out_TD

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_TD):
        saved = ctx.saved_tensors
        x_TD, topk_weights_TK, w1_EDN, w2_EFD, offsets, row_map, w_flat = saved[:7]
        act, k = ctx.act, ctx.k
        T, D = x_TD.shape
        rows = T * k
        gather = dict(row_map=row_map, topk=k)
        if len(saved) == 9:
            a_RF, h_RN = saved[7:]
        else:
            a_RF, h_RN = _ffn_first(x_TD, offsets, w1_EDN, act, rows, True, gather_a=True, **gather)
        need_x, need_w, need_w1, need_w2 = (ctx.needs_input_grad[i] for i in (0, 1, 3, 4))
        dx = dgate = dw1 = dw2 = None
        if need_x or need_w or need_w1:
            dh_RN, dgate_S = _dact(dout_TD, offsets, w2_EFD.transpose(1, 2), h_RN, act, rows=rows,
                                   gather=True, scale=w_flat, dgate=need_w, **gather)
            if need_w:
                dgate = dgate_S.view(T, k).to(topk_weights_TK.dtype)
            if need_x:
                dx = torch.empty(T, D, device=x_TD.device, dtype=x_TD.dtype)
                if k == 1:
                    _mm(dh_RN, offsets, w1_EDN.transpose(1, 2), dx, rows=rows, scatter=True, **gather)
                else:
                    dx_SD = torch.empty(rows, D, device=x_TD.device, dtype=x_TD.dtype)
                    _mm(dh_RN, offsets, w1_EDN.transpose(1, 2), dx_SD, rows=rows, scatter=True, **gather)
                    _combine(dx_SD, None, T, k, dx)
            if need_w1:
                dw1 = _wgrad(x_TD, dh_RN, offsets, w1_EDN.shape[0], w1_EDN.dtype, gather_a=True, **gather)
        if need_w2:
            dw2 = _wgrad(a_RF, dout_TD, offsets, w2_EFD.shape[0], w2_EFD.dtype, gather_b=True, scale_b=w_flat, **gather)
        return dx, dgate, None, dw1, dw2, None, None


# ---------------------------------------------------------------------------------------------
# Public launchers (the signatures of tritonmoe.reference)
# ---------------------------------------------------------------------------------------------


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"the Triton grouped GEMMs run on tensor cores in fp16/bf16/fp32 (tf32), got {x.dtype}; "
            "tritonmoe.dispatch sends fp64 to tritonmoe.reference"
        )


def grouped_gemm(x_RK: torch.Tensor, expert_offsets: torch.Tensor, w_EKN: torch.Tensor) -> torch.Tensor:
    """Rows in [offsets[e], offsets[e+1]) times w[e]; rows at or past offsets[E] are zero."""
    _check_dtype(x_RK)
    return _GroupedGemmFn.apply(x_RK, expert_offsets.contiguous(), w_EKN)


def grouped_ffn(
    x_RD: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1_EDN: torch.Tensor,
    w2_EFD: torch.Tensor,
    activation: str = "swiglu",
) -> torch.Tensor:
    """grouped_gemm(act(grouped_gemm(x, w1)), w2) with the activation fused into GEMM1's epilogue
    (fp32 accumulator, rounded once to the input dtype)."""
    _check_dtype(x_RD)
    needs_grad = _needs_grad(x_RD, w1_EDN, w2_EFD)
    return _GroupedFFNFn.apply(x_RD, expert_offsets.contiguous(), w1_EDN, w2_EFD, activation, needs_grad)


def moe_ffn(
    x_TD: torch.Tensor,
    routing: Routing,
    w1_EDN: torch.Tensor,
    w2_EFD: torch.Tensor,
    activation: str = "swiglu",
) -> torch.Tensor:
    """permute -> grouped_ffn -> unpermute, fused: token rows are gathered inside GEMM1 and the
    gate-weighted combine follows GEMM2 without an expert-ordered y buffer."""
    _check_dtype(x_TD)
    w_TK = routing.topk_weights
    needs_grad = _needs_grad(x_TD, w_TK, w1_EDN, w2_EFD)
    return _MoEFFNFn.apply(x_TD, w_TK, routing.topk_ids, w1_EDN, w2_EFD, activation, needs_grad)
