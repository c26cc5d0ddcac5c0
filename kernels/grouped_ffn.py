"""The grouped expert FFN on Triton: ``grouped_ffn`` and the fused ``moe_ffn`` (and their
training forms), composed from the grouped GEMMs of :mod:`tritonmoe.kernels.grouped_gemm`.

Launchers with the signatures of :mod:`tritonmoe.reference` (registered in
:data:`tritonmoe.backends.OPS`). See :mod:`tritonmoe.kernels.grouped_gemm` for the shape letters,
the row spaces and tile maps, precision and determinism.

* ``grouped_ffn(x [R, D], offsets, w1, w2, act, b1, b2)``: GEMM1 with the bias and activation in
  its epilogue writes the activation A [R, F] (and the pre-activation H [R, N1] when backward will
  need it, see :func:`tritonmoe.kernels._gemm_config.ffn_preact_mode`), GEMM2 writes y [R, D].
  Backward: ``dH = act'(H) * (dy @ w2^T)`` in one kernel, ``dx = dH @ w1^T``, ``dw1 = x^T dH``,
  ``dw2 = A^T dy`` per expert, bias gradients = per-expert column sums of dH and dy.
* ``moe_ffn(x [T, D], routing, w1, w2, act, b1, b2)``: the row map comes from one stable sort of
  the expert ids and the offsets from the router's ``counts``; GEMM1 reads token rows of x
  through it (no x_perm), GEMM2 writes each row's output in slot order, and a fixed-order combine
  sums the k rows of each token times their gate weights in fp32. Decode (T <= 64): one program
  builds all metadata, four launches for the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


from tritonmoe.core.autograd import first_order
from ._host import device_ctx
from tritonmoe.core.types import Routing
from . import _gemm_config as C

from .grouped_gemm import (
    RowSpace,
    route_rows,
    _kind,
    _mm,
    _dact,
    _wgrad,
    _colsum,
    _combine,
    _dgate,
    _needs_grad,
    _check_dtype,
    _act,
    _tf32,
)

__all__ = ["grouped_ffn", "moe_ffn", "grouped_ffn_train", "grouped_ffn_train_backward", "moe_ffn_train", "moe_ffn_train_backward", "MoEPlan", "moe_plan"]


def _ffn_first(x, space, w1, b1, act, save_h, cfg=None, **gather):
    """GEMM1 with the bias and activation epilogue -> (A [rows, F], H [rows, N1] or None)."""
    E, D, N1 = w1.shape
    F = N1 // 2 if act.glu else N1
    rows = space.rows
    a = torch.empty(rows, F, device=x.device, dtype=x.dtype)
    h = torch.empty(rows, N1, device=x.device, dtype=x.dtype) if save_h else None
    _mm(x, space, w1, a, act=act, h=h, bias=b1, cfg=cfg, **gather)
    return a, h


# The FFN forward and backward as functions, shared by the autograd functions below (eager) and
# by the training custom ops (``tritonmoe::grouped_ffn_train`` / ``moe_ffn_train``, whose
# registered backward gets the saved activations as op outputs): one backward, two callers.


def ffn_forward(x_RD, offsets, w1_EDN, w2_EFD, b1_EN, b2_ED, act, save_h):
    """grouped_ffn's forward -> (y [R, D], A [R, F], H [R, N1] or None, RowSpace)."""
    R = x_RD.shape[0]
    space = RowSpace(offsets, R, w1_EDN.shape[0])
    a_RF, h_RN = _ffn_first(x_RD, space, w1_EDN, b1_EN, act, save_h)
    y_RD = torch.empty(R, w2_EFD.shape[2], device=x_RD.device, dtype=x_RD.dtype)
    _mm(a_RF, space, w2_EFD, y_RD, bias=b2_ED)
    return y_RD, a_RF, h_RN, space


def ffn_backward(dy_RD, x_RD, space, w1_EDN, w2_EFD, b1_EN, a_RF, h_RN, act, needs, bias_dtypes):
    """grouped_ffn's backward -> (dx, dw1, dw2, db1, db2), None where ``needs`` (x, w1, w2, b1,
    b2) is False. ``h_RN`` None: recompute A and H with GEMM1 (the "recompute" mode)."""
    if h_RN is None:
        a_RF, h_RN = _ffn_first(x_RD, space, w1_EDN, b1_EN, act, True)
    R = x_RD.shape[0]
    need_x, need_w1, need_w2, need_b1, need_b2 = needs
    dx = dw1 = dw2 = db1 = db2 = None
    if need_x or need_w1 or need_b1:
        dh_RN, _ = _dact(dy_RD, space, w2_EFD.transpose(1, 2), h_RN, act)
        if need_x:
            dx = torch.empty(R, x_RD.shape[1], device=x_RD.device, dtype=x_RD.dtype)
            _mm(dh_RN, space, w1_EDN.transpose(1, 2), dx)
        if need_w1:
            dw1 = _wgrad(x_RD, dh_RN, space, w1_EDN.dtype)
        if need_b1:
            db1 = _colsum(dh_RN, space, bias_dtypes[0])
    if need_w2:
        dw2 = _wgrad(a_RF, dy_RD, space, w2_EFD.dtype)
    if need_b2:
        db2 = _colsum(dy_RD, space, bias_dtypes[1])
    return dx, dw1, dw2, db1, db2


def _bias_dtypes(b1, b2):
    return (None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)


class _GroupedFFNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, offsets, w1_EDN, w2_EFD, b1_EN, b2_ED, act, needs_grad):
        save = needs_grad and C.ffn_preact_mode() == "save"
        y_RD, a_RF, h_RN, space = ffn_forward(x_RD, offsets, w1_EDN, w2_EFD, b1_EN, b2_ED, act, save)
        ctx.act, ctx.space = act, space
        ctx.bias_dtypes = _bias_dtypes(b1_EN, b2_ED)
        if needs_grad:
            extra = (a_RF, h_RN) if save else ()
            ctx.save_for_backward(x_RD, w1_EDN, w2_EFD, b1_EN, *extra)
        return y_RD

    @staticmethod
    @first_order("grouped_ffn (Triton)")
    def backward(ctx, dy_RD):
        saved = ctx.saved_tensors
        x_RD, w1_EDN, w2_EFD, b1_EN = saved[:4]
        a_RF, h_RN = saved[4:] if len(saved) == 6 else (None, None)
        needs = tuple(ctx.needs_input_grad[i] for i in (0, 2, 3, 4, 5))
        dx, dw1, dw2, db1, db2 = ffn_backward(dy_RD, x_RD, ctx.space, w1_EDN, w2_EFD, b1_EN, a_RF, h_RN, ctx.act,
                                              needs, ctx.bias_dtypes)
        return dx, None, dw1, dw2, db1, db2, None, None


@dataclass
class MoEPlan:
    """The launch plan of one fused ``moe_ffn`` call: its row space (from one stable sort of the
    ids), the two GEMMs' tile configs and whether it takes the decode path. A pure function of
    the routing and the shapes, so the training op's backward rebuilds the forward's plan."""

    space: RowSpace
    cfg1: C.TileConfig
    cfg2: C.TileConfig | None
    decode: bool


def moe_plan(x_TD, topk_ids_TK, counts_E, w1_EDN, w2_EFD, act) -> MoEPlan:
    T, D = x_TD.shape
    k = topk_ids_TK.shape[1]
    E = w1_EDN.shape[0]
    F = w2_EFD.shape[1]
    dev, dt = x_TD.device, x_TD.dtype
    decode = C.decode_path(T, k)
    if decode:
        sel = dict(tokens=T, top_k=k, num_experts=E, dtype=dt, tf32=_tf32(dt), device=dev)
        cfg1 = C.select_decode(_kind(act), n=F, k=D, **sel)
        cfg2 = C.select_decode("mm", n=D, k=F, **sel)
    else:
        cfg1 = C.select(_kind(act), rows=T * k, n=F, k=D, num_experts=E, dtype=dt, tf32=_tf32(dt), device=dev)
        cfg2 = None
    space = route_rows(topk_ids_TK, counts_E, E, cfg1.BM, decode=decode)
    return MoEPlan(space, cfg1, cfg2, decode)


def moe_forward(x_TD, topk_weights_TK, topk_ids_TK, plan: MoEPlan, w1_EDN, w2_EFD, b1_EN, b2_ED, act, save_h):
    """The fused moe_ffn forward -> (out [T, D], A [T*k, F], H [T*k, N1] or None)."""
    T, D = x_TD.shape
    k = topk_ids_TK.shape[1]
    E = w1_EDN.shape[0]
    dev, dt = x_TD.device, x_TD.dtype
    rows = T * k
    space, cfg1, cfg2 = plan.space, plan.cfg1, plan.cfg2
    # Gate weights per slot, read by the kernels at routed rows only (flat [T*k]).
    w_S = topk_weights_TK.reshape(-1)
    a_RF, h_RN = _ffn_first(x_TD, space, w1_EDN, b1_EN, act, save_h, cfg=cfg1, gather_a=True)
    out_TD = torch.empty(T, D, device=dev, dtype=dt)
    split = cfg2.SPLIT_K if cfg2 is not None else 1
    if k == 1 and split == 1:
        # One slot per token: the epilogue writes w * (y + b2) straight into the token's row.
        _mm(a_RF, space, w2_EFD, out_TD, bias=b2_ED, scatter=True, scale=w_S, cfg=cfg2)
    else:
        # y rows (or split-K partials) in slot order (t*k + j), then the fixed-order combine.
        if split > 1:
            y_SD = torch.empty(split, rows, D, device=dev, dtype=torch.float32)
        else:
            y_SD = torch.empty(rows, D, device=dev, dtype=dt)
        _mm(a_RF, space, w2_EFD, y_SD, bias=b2_ED, scatter=True, cfg=cfg2)
        _combine(y_SD, topk_weights_TK, topk_ids_TK, E, T, k, out_TD)
    return out_TD, a_RF, h_RN


def moe_backward(dout_TD, x_TD, topk_weights_TK, topk_ids_TK, space, w1_EDN, w2_EFD, b1_EN, b2_ED, a_RF, h_RN, act,
                 needs, bias_dtypes):
    """The fused moe_ffn backward -> (dx, dgate, dw1, dw2, db1, db2), None where ``needs`` (x,
    gate weights, w1, w2, b1, b2) is False. ``h_RN`` None: recompute A and H with GEMM1."""
    T, D = x_TD.shape
    k = topk_ids_TK.shape[1]
    E = w1_EDN.shape[0]
    rows = T * k
    w_S = topk_weights_TK.reshape(-1)
    if h_RN is None:
        a_RF, h_RN = _ffn_first(x_TD, space, w1_EDN, b1_EN, act, True, gather_a=True)
    need_x, need_w, need_w1, need_w2, need_b1, need_b2 = needs
    dx = dgate = dw1 = dw2 = db1 = db2 = None
    if need_x or need_w or need_w1 or need_b1:
        dh_RN, part = _dact(dout_TD, space, w2_EFD.transpose(1, 2), h_RN, act, gather=True, scale=w_S,
                            dgate=need_w)
        if need_w:
            dgate = _dgate(part, dout_TD, topk_ids_TK, b2_ED, E, topk_weights_TK.dtype)
        if need_x:
            dx = torch.empty(T, D, device=x_TD.device, dtype=x_TD.dtype)
            if k == 1:
                _mm(dh_RN, space, w1_EDN.transpose(1, 2), dx, scatter=True)
            else:
                dx_SD = torch.empty(rows, D, device=x_TD.device, dtype=x_TD.dtype)
                _mm(dh_RN, space, w1_EDN.transpose(1, 2), dx_SD, scatter=True)
                _combine(dx_SD, None, None, E, T, k, dx)
        if need_w1:
            dw1 = _wgrad(x_TD, dh_RN, space, w1_EDN.dtype, gather_a=True)
        if need_b1:
            db1 = _colsum(dh_RN, space, bias_dtypes[0])
    if need_w2:
        dw2 = _wgrad(a_RF, dout_TD, space, w2_EFD.dtype, gather_b=True, scale_a=w_S)
    if need_b2:
        db2 = _colsum(dout_TD, space, bias_dtypes[1], gather=True, scale=w_S)
    return dx, dgate, dw1, dw2, db1, db2


class _MoEFFNFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, topk_weights_TK, topk_ids_TK, counts_E, w1_EDN, w2_EFD, b1_EN, b2_ED, act, needs_grad):
        plan = moe_plan(x_TD, topk_ids_TK, counts_E, w1_EDN, w2_EFD, act)
        save = needs_grad and C.ffn_preact_mode() == "save"
        out_TD, a_RF, h_RN = moe_forward(x_TD, topk_weights_TK, topk_ids_TK, plan, w1_EDN, w2_EFD, b1_EN, b2_ED, act,
                                         save)
        ctx.act, ctx.space = act, plan.space
        ctx.bias_dtypes = _bias_dtypes(b1_EN, b2_ED)
        if needs_grad:
            extra = (a_RF, h_RN) if save else ()
            ctx.save_for_backward(x_TD, topk_weights_TK, topk_ids_TK, w1_EDN, w2_EFD, b1_EN, b2_ED, *extra)
        return out_TD

    @staticmethod
    @first_order("moe_ffn (Triton)")
    def backward(ctx, dout_TD):
        saved = ctx.saved_tensors
        x_TD, topk_weights_TK, topk_ids_TK, w1_EDN, w2_EFD, b1_EN, b2_ED = saved[:7]
        a_RF, h_RN = saved[7:] if len(saved) == 9 else (None, None)
        needs = tuple(ctx.needs_input_grad[i] for i in (0, 1, 4, 5, 6, 7))
        dx, dgate, dw1, dw2, db1, db2 = moe_backward(dout_TD, x_TD, topk_weights_TK, topk_ids_TK, ctx.space, w1_EDN,
                                                     w2_EFD, b1_EN, b2_ED, a_RF, h_RN, ctx.act, needs,
                                                     ctx.bias_dtypes)
        return dx, dgate, None, None, dw1, dw2, db1, db2, None, None


# ---------------------------------------------------------------------------------------------
# Public launchers (the signatures of tritonmoe.reference)
# ---------------------------------------------------------------------------------------------


def grouped_ffn(
    x_RD: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1_EDN: torch.Tensor,
    w2_EFD: torch.Tensor,
    activation: str = "swiglu",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:
    """grouped_gemm(act(grouped_gemm(x, w1) + b1), w2) + b2 with the bias and activation fused
    into GEMM1's epilogue (fp32 accumulator, rounded once to the input dtype)."""
    _check_dtype(x_RD)
    needs_grad = _needs_grad(x_RD, w1_EDN, w2_EFD, b1, b2)
    act = _act(activation, swiglu_limit, swiglu_alpha)
    with device_ctx(x_RD.device):
        return _GroupedFFNFn.apply(x_RD, expert_offsets.contiguous(), w1_EDN, w2_EFD, b1, b2, act, needs_grad)


def moe_ffn(
    x_TD: torch.Tensor,
    routing: Routing,
    w1_EDN: torch.Tensor,
    w2_EFD: torch.Tensor,
    activation: str = "swiglu",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:
    """permute -> grouped_ffn -> unpermute, fused: token rows are gathered inside GEMM1 and the
    gate-weighted combine follows GEMM2 without an expert-ordered y buffer. Uses
    ``routing.counts`` for the segment offsets (they must match ``routing.topk_ids``)."""
    _check_dtype(x_TD)
    w_TK = routing.topk_weights
    needs_grad = _needs_grad(x_TD, w_TK, w1_EDN, w2_EFD, b1, b2)
    act = _act(activation, swiglu_limit, swiglu_alpha)
    with device_ctx(x_TD.device):
        return _MoEFFNFn.apply(x_TD, w_TK, routing.topk_ids, routing.counts, w1_EDN, w2_EFD, b1, b2, act,
                               needs_grad)


# Training forms (see tritonmoe.reference.grouped_ffn_train): the forward returns the activations
# the backward needs (A, and H always written: these back the "save" mode of the training custom
# ops); the backward takes them and runs the same ffn_backward / moe_backward as the autograd
# functions above, so a compiled step's gradients are the eager ones bit for bit.


def grouped_ffn_train(x_RD, expert_offsets, w1_EDN, w2_EFD, activation="swiglu", b1=None, b2=None, *,
                      swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
    """(y [R, D], A [R, F], H [R, N1]); not differentiable."""
    _check_dtype(x_RD)
    act = _act(activation, swiglu_limit, swiglu_alpha)
    with device_ctx(x_RD.device), torch.no_grad():
        y, a, h, _ = ffn_forward(x_RD, expert_offsets.contiguous(), w1_EDN, w2_EFD, b1, b2, act, True)
    return y, a, h


def grouped_ffn_train_backward(dy_RD, x_RD, expert_offsets, w1_EDN, w2_EFD, b1, b2, a_RF, h_RN, activation="swiglu", *,
                               needs=(True,) * 5, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
    """(dx, dw1, dw2, db1, db2) from the saved A and H (None where ``needs`` is False)."""
    _check_dtype(x_RD)
    act = _act(activation, swiglu_limit, swiglu_alpha)
    needs = (needs[0], needs[1], needs[2], needs[3] and b1 is not None, needs[4] and b2 is not None)
    with device_ctx(x_RD.device), torch.no_grad():
        space = RowSpace(expert_offsets.contiguous(), x_RD.shape[0], w1_EDN.shape[0])
        return ffn_backward(dy_RD, x_RD, space, w1_EDN, w2_EFD, b1, a_RF, h_RN, act, needs, _bias_dtypes(b1, b2))


def moe_ffn_train(x_TD, routing: Routing, w1_EDN, w2_EFD, activation="swiglu", b1=None, b2=None, *,
                  swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
    """(out [T, D], A [T*k, F], H [T*k, N1]) in the row space of the fused kernels; not
    differentiable."""
    _check_dtype(x_TD)
    act = _act(activation, swiglu_limit, swiglu_alpha)
    with device_ctx(x_TD.device), torch.no_grad():
        plan = moe_plan(x_TD, routing.topk_ids, routing.counts, w1_EDN, w2_EFD, act)
        return moe_forward(x_TD, routing.topk_weights, routing.topk_ids, plan, w1_EDN, w2_EFD, b1, b2, act, True)


def moe_ffn_train_backward(dout_TD, x_TD, routing: Routing, w1_EDN, w2_EFD, b1, b2, a_RF, h_RN, activation="swiglu", *,
                           needs=(True,) * 6, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
    """(dx, d topk_weights, dw1, dw2, db1, db2) from the saved A and H; the row space is rebuilt
    from the routing (one sort; the forward's plan is a function of it)."""
    _check_dtype(x_TD)
    act = _act(activation, swiglu_limit, swiglu_alpha)
    needs = (*needs[:4], needs[4] and b1 is not None, needs[5] and b2 is not None)
    with device_ctx(x_TD.device), torch.no_grad():
        plan = moe_plan(x_TD, routing.topk_ids, routing.counts, w1_EDN, w2_EFD, act)
        return moe_backward(dout_TD, x_TD, routing.topk_weights, routing.topk_ids, plan.space, w1_EDN, w2_EFD, b1, b2,
                            a_RF, h_RN, act, needs, _bias_dtypes(b1, b2))
