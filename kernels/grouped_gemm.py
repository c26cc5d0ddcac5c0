"""Grouped GEMM on Triton: ``grouped_gemm``, and the row spaces, tile maps and GEMM launches that
the FFN compositions (:mod:`tritonmoe.kernels.grouped_ffn`: ``grouped_ffn``, the fused ``moe_ffn``)
are built from.

Launchers with the signatures of :mod:`tritonmoe.reference` (registered in
:data:`tritonmoe.backends.OPS`); the kernels are in ``_grouped_gemm_kernels.py`` and the
launch parameters in ``_gemm_config.py``.

Shape letters: T tokens, k slots per token, E experts, D d_model, F d_ffn, N1 the first GEMM's
columns (2F for the GLU activations: gate then up), R rows of a permuted buffer. In the fused
path the row space has T*k rows, one per (token, slot), grouped by expert (``row_map`` gives the
slot of each row); its unrouted slots come first, [0, offsets[0]).

Paths:

* ``grouped_gemm(x [R, K], offsets, w [E, K, N], bias [E, N])``: one grouped GEMM; backward = a
  grouped GEMM with ``w^T`` (a strided view, no copy) for dx, per-expert ``x_e^T dy_e`` for dw
  and per-expert column sums of dy for the bias.
* ``grouped_ffn(x [R, D], offsets, w1, w2, act, b1, b2)``: GEMM1 with the bias and activation in
  its epilogue writes the activation A [R, F] (and the pre-activation H [R, N1] when backward will
  need it, see :func:`tritonmoe.kernels._gemm_config.ffn_preact_mode`), GEMM2 writes y [R, D].
  Backward: ``dH = act'(H) * (dy @ w2^T)`` in one kernel (activation backward in the epilogue),
  ``dx = dH @ w1^T``, ``dw1 = x^T dH``, ``dw2 = A^T dy`` per expert, bias gradients = per-expert
  column sums of dH and dy.
* ``moe_ffn(x [T, D], routing, w1, w2, act, b1, b2)``: the row map comes from one stable sort of
  the expert ids and the offsets from the router's ``counts`` (no recount); GEMM1 reads token rows
  of x through it (no x_perm), GEMM2 writes each row's output (bias included) in slot order into
  a [T*k, D] buffer (k = 1: straight into the output, times its gate weight), and a fixed-order
  combine sums the k rows of each token times their gate weights in fp32 (no y_perm in expert
  order, no atomics). Backward gathers the output gradient by token inside the kernels, reduces
  the gate-weight gradient in the ``dH`` kernel's epilogue (partial sums per column tile, summed
  in a fixed order with <dout, b2>), scatters dx rows to slot order and combines them like the
  forward.
* Decode (``moe_ffn`` with T <= 64, :func:`tritonmoe.kernels._gemm_config.decode_path`): one
  program builds all metadata (sort, offsets, tile map), GEMM1 and GEMM2 use tiles that hold an
  expert's rows in one M tile and split GEMM2's K when too few (expert, N tile) items would
  stream the weights, and the combine sums the K splits: four launches for the forward.

Tile maps and grids: each call builds the list of M tiles of its row space once per tile height
on the device and the GEMMs' persistent programs walk it (see ``_grouped_gemm_kernels``); grids
are sized from shapes. Nothing here reads device values on the host. Every output element is
written by exactly one program and every reduction runs in a fixed order, so results are
deterministic run to run.

Precision: fp32 accumulation everywhere; fp16/bf16 operands use the tensor cores; fp32 operands
use IEEE fp32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set, then TF32 (read at each
call, like torch's own matmuls). fp64 inputs have no tensor-core path: the launchers refuse them
and :mod:`tritonmoe.backends` sends them to :mod:`tritonmoe.reference`. Biases are added to the
fp32 accumulator; bias gradients are fp32 sums rounded once to the bias dtype.

Backward and the pre-activation: saved by default (one extra [rows, N1] write in forward),
recomputed by rerunning GEMM1 with ``TRITONMOE_FFN_PREACT=recompute`` or
``_gemm_config.preact_mode("recompute")``; both give the same bits (see
:func:`tritonmoe.kernels._gemm_config.ffn_preact_mode` for the reasoning). The activation A is
written by the forward anyway (GEMM2 reads it) and is kept for dw2 in "save" mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tritonmoe.core.autograd import first_order
from tritonmoe.core.settings import validation_enabled

from ._host import cdiv, device_ctx, next_power_of_2
from . import _gemm_config as C
from . import _gluon_grouped_gemm as WS
from . import _grouped_gemm_persistent as P
from ._grouped_gemm_kernels import (
    ACT_GELU,
    ACT_NONE,
    ACT_RELU,
    ACT_SWIGLU,
    ACT_SWIGLU_OAI,
    GLU_ACTS,
    TILE_FIELDS,
    _combine_kernel,
    _decode_meta_kernel,
    _dgate_kernel,
    _grouped_mm_dact_kernel,
    _grouped_mm_kernel,
    _grouped_wgrad_kernel,
    _segment_colsum_kernel,
    _tile_map_kernel,
)

__all__ = ["grouped_gemm", "route_rows", "RowSpace", "TileMap"]

_ACT = {"swiglu": ACT_SWIGLU, "gelu": ACT_GELU, "relu": ACT_RELU, "swiglu_oai": ACT_SWIGLU_OAI}


def _tf32(dtype: torch.dtype) -> bool:
    """fp32 GEMMs use TF32 only where the caller allowed it for torch's own matmuls."""
    return dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)


def _prec(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "tf32" if _tf32(dtype) else "ieee"
    return "tf32"  # the setting only chooses TF32 vs IEEE for fp32 operands; 16-bit ones ignore it


def _segp(E: int) -> int:
    """Lanes of the segment vector of the tile-map kernels: the E + 2 segments (zero head, E
    experts, zero tail), rounded up to a power of two."""
    return next_power_of_2(E + 2)


def tile_bound(rows: int, num_experts: int, BM: int) -> int:
    """MT: at most this many BM-row tiles cover the E + 2 segments of ``rows`` rows (module
    docstring of ``_grouped_gemm_kernels``)."""
    return rows // BM + min(num_experts + 2, rows)


@dataclass
class TileMap:
    """The M tiles of one row space for tile height ``BM`` (built on the device, see
    ``_grouped_gemm_kernels``): ``tiles`` int32 [bound, 3] (expert or -1 for zero rows, first row,
    segment end), ``count`` int32 [1] (valid entries), ``bound`` = MT (host, from shapes)."""

    BM: int
    bound: int
    tiles: torch.Tensor
    count: torch.Tensor


def _new_tile_map(BM: int, bound: int, device: torch.device) -> TileMap:
    buf = torch.empty(bound * TILE_FIELDS + 1, device=device, dtype=torch.int32)
    return TileMap(BM, bound, buf[1:].view(bound, TILE_FIELDS), buf[:1])


@dataclass
class RowSpace:
    """The rows of one grouped-GEMM call: ``rows`` rows in E segments given by the device
    ``offsets`` [E+1] (int32 or int64), with ``row_map`` (slot of each row) and ``topk`` for the
    fused path, and the tile maps built so far (one per tile height, shared by the forward and
    backward kernels of the call)."""

    offsets: torch.Tensor
    rows: int
    num_experts: int
    row_map: torch.Tensor | None = None
    topk: int = 1
    maps: dict = field(default_factory=dict)

    def tile_map(self, BM: int) -> TileMap:
        """The tile map for height BM (one small launch the first time, no host sync)."""
        tm = self.maps.get(BM)
        if tm is None:
            tm = _build_tile_map(self.offsets, self.rows, self.num_experts, BM)
            self.maps[BM] = tm
        return tm


def _build_tile_map(src: torch.Tensor, rows: int, E: int, BM: int, *, from_counts: bool = False,
                    offsets_out: torch.Tensor | None = None) -> TileMap:
    """Launch :func:`_tile_map_kernel` over ``src`` (offsets [E+1], or counts [E] with
    ``from_counts``, writing the offsets to ``offsets_out``)."""
    dev = src.device
    tm = _new_tile_map(BM, tile_bound(rows, E, BM), dev)
    if tm.bound == 0:
        if offsets_out is not None:
            offsets_out.zero_()
        tm.count.zero_()
        return tm
    BT, warps = C.tile_map_config(dev)
    _tile_map_kernel[(cdiv(tm.bound, BT),)](
        src, offsets_out if offsets_out is not None else src, tm.tiles, tm.count, rows, E, tm.bound,
        FROM_COUNTS=from_counts, WRITE_OFFS=offsets_out is not None, BM=BM, SEGP=_segp(E), BT=BT,
        num_warps=warps,
    )
    return tm


def route_rows(topk_ids_TK: torch.Tensor, counts_E: torch.Tensor, num_experts: int, BM: int,
               *, decode: bool = False) -> RowSpace:
    """Row space of the fused path over the T*k slots, with its tile map for height BM, without
    a host sync.

    ``row_map`` int64 [T*k] lists the slots ``t*k + j`` in the order of a stable sort of their
    expert ids: unrouted slots (id -1) first, then each expert's slots in token order (the
    order of :func:`tritonmoe.reference.permute` inside each expert). ``offsets`` int64 [E+1]
    come from the router's ``counts_E`` (kept slots per expert, which must match the ids): expert
    e's rows are [offsets[e], offsets[e+1]) and offsets[0] = T*k - sum(counts). ``decode``: one
    program does all of it (:func:`_decode_meta_kernel`, T*k <= 4096); otherwise a torch stable
    argsort plus :func:`_tile_map_kernel`.
    Example: ids [[1, 0], [1, 2], [-1, 1]], counts [1, 3, 1] -> offsets [1, 2, 5, 6], row_map
    [4, 1, 0, 2, 5, 3].
    """
    E = num_experts
    T, k = topk_ids_TK.shape
    S = T * k
    dev = topk_ids_TK.device
    offsets = torch.empty(E + 1, device=dev, dtype=torch.int64)
    ids_S = topk_ids_TK.reshape(-1)
    if not decode and not validation_enabled():
        # Ids outside [-1, E) are "not routed" (the validation-off contract; with validation on
        # the public API has refused them): map them to -1 so that the stable sort puts them in
        # the unrouted head that offsets[0] = T*k - sum(counts) assumes (five elementwise
        # launches, paid only with validation off). The decode kernel does this in registers.
        ids_S = torch.where((ids_S >= 0) & (ids_S < E), ids_S, torch.full_like(ids_S, -1))
    if decode and S > 0:
        row_map = torch.empty(S, device=dev, dtype=torch.int64)
        tm = _new_tile_map(BM, tile_bound(S, E, BM), dev)
        BT, warps = C.tile_map_config(dev)
        _decode_meta_kernel[(1,)](
            ids_S.contiguous(), counts_E, row_map, offsets, tm.tiles, tm.count, S, E, tm.bound,
            LOG_SP=max(1, (S - 1).bit_length()), BM=BM, SEGP=_segp(E), BT=BT, num_warps=warps,
        )
    else:
        row_map = torch.argsort(ids_S, stable=True)
        tm = _build_tile_map(counts_E, S, E, BM, from_counts=True, offsets_out=offsets)
    return RowSpace(offsets, S, E, row_map=row_map, topk=k, maps={BM: tm})


# ---------------------------------------------------------------------------------------------
# Launch helpers (inputs validated by the public API; they write every output element once)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Act:
    """An activation and its GPT-OSS parameters (ignored by the others)."""

    code: int = ACT_NONE
    limit: float = 7.0
    alpha: float = 1.702

    @property
    def glu(self) -> bool:
        return self.code in GLU_ACTS


_NO_ACT = _Act()


def _kind(act: _Act) -> str:
    return "swiglu" if act.glu else ("mm" if act.code == ACT_NONE else "mm_act")


def _grid(tm: TileMap, n_cols: int, cfg: C.TileConfig, dev: torch.device, elem: int, dual: bool) -> tuple[int]:
    items = tm.bound * cdiv(n_cols, cfg.BN) * cfg.SPLIT_K
    return (max(1, min(items, C.max_programs(dev, cfg, elem, dual))),)


def _mm(
    a: torch.Tensor,
    space: RowSpace,
    b_EKN: torch.Tensor,
    out: torch.Tensor,
    *,
    act: _Act = _NO_ACT,
    h: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    gather_a: bool = False,
    scatter: bool = False,
    scale: torch.Tensor | None = None,
    cfg: C.TileConfig | None = None,
) -> None:
    """``out[row] = act(a[row'] @ b[seg(row)] + bias[seg(row)])`` over the row space (see
    :func:`_grouped_mm_kernel`). For GLUs, ``b`` holds gate then up columns and ``out`` gets half
    of them. ``cfg`` (the decode path's) overrides the policy; with ``cfg.SPLIT_K > 1`` ``out`` is
    the fp32 partial buffer [SPLIT_K, rows, N]."""
    E, K, NB = b_EKN.shape
    dual = act.glu
    N = NB // 2 if dual else NB
    rows = space.rows
    if rows == 0 or N == 0:
        return
    dev = a.device
    if cfg is None:
        cfg = C.select(_kind(act), rows=rows, n=N, k=K, num_experts=E, dtype=a.dtype, tf32=_tf32(a.dtype), device=dev)
    tm = space.tile_map(cfg.BM)
    if cfg.variant == "warpspec":  # the warp-specialized Gluon kernel (kernels/_gluon_grouped_gemm.py)
        if (act.code == ACT_NONE and h is None and bias is None and not gather_a and not scatter and scale is None
                and cfg.SPLIT_K == 1 and out.dim() == 2 and cfg.BM in (64, 128) and cfg.BN <= 256
                and WS.usable(a, b_EKN, out, K=K, BK=cfg.BK) is None):
            WS.mm(a, b_EKN, out, tm.tiles, tm.count, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
                  num_programs=P.num_programs(dev, tm.bound * cdiv(N, cfg.BN)))
            return
        cfg = replace(cfg, variant="persistent")  # what it cannot serve, the persistent kernel does
    if cfg.variant in C.PERSISTENT_VARIANTS:  # the one variant switch (kernels/_grouped_gemm_persistent.py)
        if bias is None and act.code != ACT_SWIGLU_OAI and cfg.SPLIT_K == 1 and out.dim() == 2:
            P.mm(a, space.offsets, tm.tiles, tm.count, b_EKN, out, cfg, rows=rows, act=act.code, h=h,
                 row_map=space.row_map, topk=space.topk, gather_a=gather_a, scatter=scatter, scale=scale,
                 prec=_prec(a.dtype))
            return
        # The persistent kernel has no bias, clamped-SwiGLU or split-K epilogue: the tile kernel
        # runs those launches (same tiles).
        cfg = replace(cfg, variant="tile")
    split = cfg.SPLIT_K
    if out.dim() == 3:
        stride_cs, stride_cm, stride_cn = out.stride()
    else:
        stride_cs, (stride_cm, stride_cn) = 0, out.stride()
    # Arguments a flag switches off are never dereferenced: any tensor stands in for them.
    hh = h if h is not None else a
    bb = bias if bias is not None else b_EKN[0]
    rm = space.row_map if space.row_map is not None else space.offsets
    C.launch(
        _grouped_mm_kernel, _grid(tm, N, cfg, dev, a.element_size(), dual), cfg, ("N", "K", "ROWS_HINT"), dev,
        a.element_size(), dual,
        a, b_EKN, out, hh, bb, tm.tiles, tm.count, rm, scale if scale is not None else a,
        N, K, C.rows_hint(rows, E), float(act.limit), float(act.alpha),
        a.stride(0), a.stride(1),
        b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
        stride_cs, stride_cm, stride_cn,
        hh.stride(0), hh.stride(1),
        bb.stride(0), bb.stride(-1),
        ACT=act.code if split == 1 else ACT_NONE, STORE_H=h is not None, GATHER_A=gather_a, SCATTER_C=scatter,
        SCALE=scale is not None, HAS_BIAS=bias is not None, TOPK=space.topk, SPLIT_K=split,
        PREC=_prec(a.dtype), EVEN_K=K % cfg.BK == 0,
    )


def _dact(
    g: torch.Tensor,
    space: RowSpace,
    w2t_EDF: torch.Tensor,
    h: torch.Tensor,
    act: _Act,
    *,
    gather: bool = False,
    scale: torch.Tensor | None = None,
    dgate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dH [rows, N1] = act'(H) * round(g @ w2^T) (see :func:`_grouped_mm_dact_kernel`), and with
    ``dgate`` the fp32 partial sums [rows (by slot), column tiles] of the gate-weight gradient."""
    E, D, F = w2t_EDF.shape
    N1 = h.shape[1]
    rows = space.rows
    dev = g.device
    dh = torch.empty(rows, N1, device=dev, dtype=g.dtype)
    kind = "dact_swiglu" if act.glu else "dact"
    cfg = C.select(kind, rows=rows, n=F, k=D, num_experts=E, dtype=g.dtype, tf32=_tf32(g.dtype), device=dev)
    cols_per_item = cfg.BN * (2 if act.glu else 1)  # the GLU backward runs two BN-column accumulators
    n_tiles = cdiv(F, cols_per_item)
    part = torch.empty(rows, n_tiles, device=dev, dtype=torch.float32) if dgate else None
    if rows == 0 or F == 0:
        if dgate:
            part = torch.zeros(rows, 1, device=dev, dtype=torch.float32)
        return dh, part
    tm = space.tile_map(cfg.BM)
    rm = space.row_map if space.row_map is not None else space.offsets
    C.launch(
        _grouped_mm_dact_kernel, _grid(tm, F, replace(cfg, BN=cols_per_item), dev, g.element_size(), False), cfg,
        ("N", "K", "ROWS_HINT"), dev, g.element_size(), act.glu,
        g, w2t_EDF, h, dh, tm.tiles, tm.count, rm,
        scale if scale is not None else g, part if part is not None else dh,
        F, D, C.rows_hint(rows, E), float(act.limit), float(act.alpha),
        g.stride(0), g.stride(1),
        w2t_EDF.stride(0), w2t_EDF.stride(1), w2t_EDF.stride(2),
        h.stride(0), h.stride(1),
        dh.stride(0), dh.stride(1),
        n_tiles,
        ACT=act.code, GATHER_A=gather, SCALE=scale is not None, DGATE=dgate, TOPK=space.topk,
        PREC=_prec(g.dtype), EVEN_K=D % cfg.BK == 0,
    )
    return dh, part


def _wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    space: RowSpace,
    out_dtype: torch.dtype,
    *,
    gather_a: bool = False,
    gather_b: bool = False,
    scale_a: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert ``a_e^T @ b_e`` -> [E, M, N] (see :func:`_grouped_wgrad_kernel`)."""
    M, N = a.shape[1], b.shape[1]
    E = space.num_experts
    dev = a.device
    out = torch.empty(E, M, N, device=dev, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    rows = space.rows
    cfg = C.select("wgrad", rows=rows, n=N, k=M, num_experts=E, dtype=a.dtype, tf32=_tf32(a.dtype), device=dev)
    grid = (cdiv(M, cfg.BM) * cdiv(N, cfg.BN), E)
    rm = space.row_map if space.row_map is not None else space.offsets
    C.launch(
        _grouped_wgrad_kernel, grid, cfg, ("M", "N", "ROWS_HINT"), dev, a.element_size(), False,
        a, b, out, space.offsets, rm, scale_a if scale_a is not None else a,
        rows, M, N, C.rows_hint(rows, E),
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        GATHER_A=gather_a, GATHER_B=gather_b, SCALE_A=scale_a is not None, TOPK=space.topk, PREC=_prec(a.dtype),
    )
    return out


def _colsum(b: torch.Tensor, space: RowSpace, out_dtype: torch.dtype, *, gather: bool = False,
            scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert column sums of ``b``'s rows -> [E, N] (see :func:`_segment_colsum_kernel`)."""
    N = b.shape[1]
    E = space.num_experts
    out = torch.empty(E, N, device=b.device, dtype=out_dtype)
    if N == 0:
        return out
    BR, BN, warps = C.colsum_config(b.device)
    rm = space.row_map if space.row_map is not None else space.offsets
    _segment_colsum_kernel[(cdiv(N, BN), E)](
        b, out, space.offsets, rm, scale if scale is not None else b,
        space.rows, N, b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        GATHER_B=gather, SCALE_B=scale is not None, TOPK=space.topk, BR=BR, BN=BN, num_warps=warps,
    )
    return out


def _combine(buf: torch.Tensor, w_TK: torch.Tensor | None, ids_TK: torch.Tensor | None, E: int, T: int, topk: int,
             out: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j ([routed] w[t, j] *) y[t*k + j] in fp32, j ascending, where y is ``buf``
    [T*k, D] or, for a 3-D ``buf`` [S, T*k, D] of fp32 split-K partials, their fixed-order sum
    (see :func:`_combine_kernel`)."""
    D = out.shape[1]
    if T == 0 or D == 0:
        return out
    if buf.dim() == 3:
        split, (stride_bs, stride_bm, stride_bd) = buf.shape[0], buf.stride()
    else:
        split, stride_bs, (stride_bm, stride_bd) = 1, 0, buf.stride()
    BT, BD, warps = C.combine_config(out.device)
    grid = (cdiv(T, BT), cdiv(D, BD))
    has_w = w_TK is not None
    w = w_TK if has_w else out
    ids = ids_TK if has_w else out
    _combine_kernel[grid](
        buf, w, ids, out, T, D, E,
        stride_bs, stride_bm, stride_bd,
        w.stride(0) if has_w else 0, w.stride(1) if has_w else 0,
        ids.stride(0) if has_w else 0, ids.stride(1) if has_w else 0,
        out.stride(0), out.stride(1),
        TOPK=topk, SPLIT=split, HAS_W=has_w, BT=BT, BD=BD, num_warps=warps,
    )
    return out


def _dgate(part: torch.Tensor, dout_TD: torch.Tensor, ids_TK: torch.Tensor, b2_ED: torch.Tensor | None,
           E: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Gate-weight gradient [T, k]: the fixed-order sum of the dH kernel's column-tile partials,
    plus <dout[t], b2[id]> for routed slots when there is a second-layer bias (see
    :func:`_dgate_kernel`)."""
    T, k = ids_TK.shape
    S = T * k
    out = torch.empty(T, k, device=part.device, dtype=out_dtype)
    if S == 0:
        return out
    BS, BD, warps = C.colsum_config(part.device)
    has_b2 = b2_ED is not None
    b2 = b2_ED if has_b2 else part
    D = dout_TD.shape[1]
    _dgate_kernel[(cdiv(S, BS),)](
        part, dout_TD, ids_TK, b2, out, S, D, E, part.shape[1],
        part.stride(0), part.stride(1), dout_TD.stride(0), dout_TD.stride(1), ids_TK.stride(0), ids_TK.stride(1),
        b2.stride(0), b2.stride(1), out.stride(0), out.stride(1),
        TOPK=k, HAS_B2=has_b2, BS=BS, BD=min(BD, next_power_of_2(max(D, 1))), num_warps=warps,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Autograd functions
# ---------------------------------------------------------------------------------------------


def _needs_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


class _GroupedGemmFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RK, offsets, w_EKN, bias_EN):
        R = x_RK.shape[0]
        space = RowSpace(offsets, R, w_EKN.shape[0])
        y = torch.empty(R, w_EKN.shape[2], device=x_RK.device, dtype=x_RK.dtype)
        _mm(x_RK, space, w_EKN, y, bias=bias_EN)
        ctx.space = space
        ctx.save_for_backward(x_RK, w_EKN)
        ctx.bias_dtype = bias_EN.dtype if bias_EN is not None else None
        return y

    @staticmethod
    @first_order("grouped_gemm (Triton)")
    def backward(ctx, dy_RN):
        x_RK, w_EKN = ctx.saved_tensors
        space = ctx.space
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x_RK, memory_format=torch.contiguous_format)
            _mm(dy_RN, space, w_EKN.transpose(1, 2), dx)
        if ctx.needs_input_grad[2]:
            dw = _wgrad(x_RK, dy_RN, space, w_EKN.dtype)
        if ctx.needs_input_grad[3]:
            db = _colsum(dy_RN, space, ctx.bias_dtype)
        return dx, None, dw, db


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"the Triton grouped GEMMs run on tensor cores in fp16/bf16/fp32 (tf32), got {x.dtype}; "
            "tritonmoe.backends sends fp64 to tritonmoe.reference"
        )


def _act(activation: str, swiglu_limit: float, swiglu_alpha: float) -> _Act:
    return _Act(_ACT[activation], float(swiglu_limit), float(swiglu_alpha))


def grouped_gemm(
    x_RK: torch.Tensor, expert_offsets: torch.Tensor, w_EKN: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows in [offsets[e], offsets[e+1]) times w[e], plus bias[e]; rows outside the segments are
    zero."""
    _check_dtype(x_RK)
    with device_ctx(x_RK.device):
        return _GroupedGemmFn.apply(x_RK, expert_offsets.contiguous(), w_EKN, bias)
