"""Triton kernels of the grouped expert FFN (launchers in :mod:`tritonmoe.kernels.grouped_gemm`).

Row space. Every GEMM here runs over a *row space* of ``R`` rows split into ragged segments by
device-side ``offsets`` [E+1]: segment e is rows [offsets[e], offsets[e+1]) and uses expert e's
weights (and bias). Rows outside [offsets[0], offsets[E]) are *zero rows*: their outputs are
written as zeros. The unfused path's padding tail is [offsets[E], R) (offsets[0] = 0); the fused
path's row r stands for the (token, slot) pair ``s = row_map[r] = t * TOPK + j`` and its row order
(a stable sort of the expert ids, unrouted id -1 first) puts the unrouted slots at the head
[0, offsets[0]). A rows are gathered from token ``s // TOPK`` and outputs may be scattered to row
``s``; ``TOPK`` is a ``tl.constexpr``, so that division is a multiply-shift, never a division
instruction.

Tile map. :func:`_tile_map_kernel` (or :func:`_decode_meta_kernel` in the decode path) turns the
offsets into a list of M tiles once per call and BM: entry i = (expert or -1 for a zero tile, first
row, segment end), plus their number ``count`` on the device. A segment of ``n`` rows takes
cdiv(n, BM) tiles; the E + 2 segments (zero head, E experts, zero tail) take at most

    MT = floor(R / BM) + min(E + 2, R)

tiles, because sum_j cdiv(n_j, BM) <= sum_j floor(n_j / BM) + #{j : n_j > 0} and
sum_j floor(n_j / BM) <= floor(R / BM). MT is known from shapes; ``count`` (<= MT) only on the
device. Worked example: BM=4, R=10, offsets=[0, 5, 5, 9] (E=3): segments (head, e0, e1, e2,
tail) have 0, 5, 0, 4, 1 rows -> tiles [(0, 0, 5), (0, 4, 5), (2, 5, 9), (-1, 9, 10)], count 4,
MT = 2 + 5 = 7.

Persistent schedule. A GEMM launch has ``P = min(MT * tiles_n * SPLIT_K, resident programs)``
programs (the launcher's bound, no host synchronization); program p takes the work items p,
p + P, p + 2P, ... < count * tiles_n * SPLIT_K in grouped order (GROUP_M M tiles sweep the N tiles
together, so concurrent programs share weight panels in L2). No program is launched only to find
it has nothing to do, except when the whole problem takes fewer items than the bound (then all of
them run in one wave next to the idle ones).

Shape letters inside kernels: BM/BN/BK are tile sizes; ``K`` is the GEMM depth (not top_k, which
is ``TOPK``).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Activation codes: host ints for the launchers, constexpr twins for the kernels (jit code may
# only read globals that are tl.constexpr). The GLU activations (SwiGLU, GPT-OSS's clamped
# SwiGLU) read two column halves of the first GEMM: gate, then up.
ACT_NONE = 0
ACT_SWIGLU = 1
ACT_GELU = 2
ACT_RELU = 3
ACT_SWIGLU_OAI = 4
GLU_ACTS = (ACT_SWIGLU, ACT_SWIGLU_OAI)
_SWIGLU = tl.constexpr(ACT_SWIGLU)
_GELU = tl.constexpr(ACT_GELU)
_RELU = tl.constexpr(ACT_RELU)
_SWIGLU_OAI = tl.constexpr(ACT_SWIGLU_OAI)

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)

#: Columns of one tile-map entry: (expert or -1, first row, segment end).
TILE_FIELDS = 3
_TF = tl.constexpr(TILE_FIELDS)


@triton.jit
def _swizzle(t, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering of work item ``t``: GROUP_M consecutive M tiles sweep the N tiles
    together, so programs that run at the same time share weight panels (same expert) and row
    tiles in L2. Runs once per tile, outside the K loop (its divisions are by runtime values)."""
    width = GROUP_M * num_pid_n
    group = t // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (t % width) % size_m
    pid_n = (t % width) // size_m
    return pid_m, pid_n


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * _SQRT1_2))


@triton.jit
def _clamp_oai(gate, up, limit):
    """GPT-OSS clamps: gate = min(gate, limit), up = clamp(up, -limit, limit); NaN stays NaN (as
    torch.clamp)."""
    g = tl.where(gate > limit, limit, gate)
    u = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    return g, u


@triton.jit
def _glu(gate, up, ACT: tl.constexpr, limit, alpha):
    """SwiGLU ``silu(gate) * up`` or GPT-OSS's ``(up_c + 1) * gate_c * sigmoid(alpha * gate_c)``
    on fp32 pre-activations (``_c``: clamped)."""
    if ACT == _SWIGLU:
        out = gate * _sigmoid(gate) * up
    else:
        g, u = _clamp_oai(gate, up, limit)
        out = (u + 1.0) * (g * _sigmoid(alpha * g))
    return out


# ---------------------------------------------------------------------------------------------
# Tile maps (once per call and BM)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _segments(src_ptr, R, E, FROM_COUNTS: tl.constexpr, SEGP: tl.constexpr):
    """The E + 2 row segments j (0: zero head, 1..E: expert j-1, E+1: zero tail) as clamped
    [start, end) vectors of SEGP >= E + 2 lanes (lanes past E+1 are empty at R).

    FROM_COUNTS: ``src`` is the per-expert row counts [E] and the experts' rows end at R (the
    fused path: R - sum(counts) unrouted rows first). Otherwise ``src`` is the offsets [E+1].
    Counts and offsets are clamped to the row space, so even invalid ones (value checks off)
    never send a program outside [0, R)."""
    j = tl.arange(0, SEGP)
    is_expert = (j >= 1) & (j <= E)
    if FROM_COUNTS:
        c = tl.load(src_ptr + j - 1, mask=is_expert, other=0).to(tl.int64)
        c = tl.maximum(c, 0)
        head = tl.maximum(R - tl.sum(c, 0), 0)
        incl = tl.cumsum(c, 0)  # rows of experts 0..j-1 (lane j)
        start = tl.where(j == 0, 0, head + incl - c)
        end = tl.where(j == 0, head, head + incl)
        end = tl.where(j == E + 1, R, end)
    else:
        lo = tl.load(src_ptr + j - 1, mask=(j >= 1) & (j <= E + 1), other=0).to(tl.int64)
        hi = tl.load(src_ptr + j, mask=j <= E, other=0).to(tl.int64)
        start = tl.where(j == 0, 0, lo)
        end = tl.where(j <= E, hi, R)
    start = tl.where(j <= E + 1, tl.minimum(tl.maximum(start, 0), R), R)
    end = tl.where(j <= E + 1, tl.minimum(tl.maximum(end, start), R), R)
    return j, start, end


@triton.jit
def _write_tiles(src_ptr, offs_ptr, tiles_ptr, count_ptr, R, E, MT, first_block, num_blocks, block_step,
                 FROM_COUNTS: tl.constexpr, WRITE_OFFS: tl.constexpr, BM: tl.constexpr, SEGP: tl.constexpr,
                 BT: tl.constexpr):
    """Tile-map entries for tiles [b*BT, (b+1)*BT) of blocks b = first_block, first_block +
    block_step, ... < num_blocks (see the module docstring); the block holding tile 0 also
    stores the count (and the offsets [E+1] when WRITE_OFFS)."""
    j, start, end = _segments(src_ptr, R, E, FROM_COUNTS, SEGP)
    tiles = (end - start + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)  # inclusive prefix sum of tiles per segment
    if first_block == 0:
        tl.store(count_ptr, tl.minimum(tl.sum(tiles, 0), MT).to(tl.int32))
        if WRITE_OFFS:
            # offsets[e] = start of expert e (segment e+1) for e < E, offsets[E] = its end
            tl.store(offs_ptr + j - 1, start, mask=(j >= 1) & (j <= E))
            tl.store(offs_ptr + E + j * 0, tl.sum(tl.where(j == E + 1, start, 0), 0), mask=j == 0)
    for b in range(first_block, num_blocks, block_step):
        i = b * BT + tl.arange(0, BT).to(tl.int64)  # tile indices
        seg = tl.sum((cum[None, :] <= i[:, None]).to(tl.int32), 1)  # [BT] segment of each tile
        here = j[None, :] == seg[:, None]  # [BT, SEGP]
        s0 = tl.sum(tl.where(here, start[None, :], 0), 1)
        s1 = tl.sum(tl.where(here, end[None, :], 0), 1)
        t0 = tl.sum(tl.where(here, (cum - tiles)[None, :], 0), 1)
        expert = tl.where((seg >= 1) & (seg <= E), seg - 1, -1)
        ok = (i < MT) & (seg <= E + 1)
        base = tiles_ptr + i * _TF
        tl.store(base, expert.to(tl.int32), mask=ok)
        tl.store(base + 1, (s0 + (i - t0) * BM).to(tl.int32), mask=ok)
        tl.store(base + 2, s1.to(tl.int32), mask=ok)


@triton.jit(do_not_specialize=["R", "MT"])
def _tile_map_kernel(
    src_ptr, offs_ptr, tiles_ptr, count_ptr, R, E, MT,
    FROM_COUNTS: tl.constexpr, WRITE_OFFS: tl.constexpr, BM: tl.constexpr, SEGP: tl.constexpr, BT: tl.constexpr,
):
    """Tile map of BM-row tiles over the segments of ``offsets`` (or of ``counts``, see
    :func:`_segments`); the grid ``(cdiv(MT, BT),)`` has one program per block of BT tiles, each
    recomputing the E + 2 segment bounds (one vector) and locating its tiles' segments by a
    ``[BT, SEGP]`` comparison with the tiles' prefix sum.

    Example (BM=4, R=10, offsets=[0, 5, 5, 9]): tiles [(0, 0, 5), (0, 4, 5), (2, 5, 9),
    (-1, 9, 10)], count 4."""
    pid = tl.program_id(0)
    _write_tiles(src_ptr, offs_ptr, tiles_ptr, count_ptr, R, E, MT, pid, pid + 1, 1,
                 FROM_COUNTS, WRITE_OFFS, BM, SEGP, BT)


@triton.jit(do_not_specialize=["S", "MT"])
def _decode_meta_kernel(
    ids_ptr, counts_ptr, row_map_ptr, offs_ptr, tiles_ptr, count_ptr, S, E, MT,
    LOG_SP: tl.constexpr, BM: tl.constexpr, SEGP: tl.constexpr, BT: tl.constexpr,
):
    """All metadata of the fused path in one program (decode: S = T * k <= 2**LOG_SP slots).

    Sorts the keys ``(id' << LOG_SP) | s`` of the slots s (id' = id + 1 in [1, E] for ids in
    [0, E), 0 for every other id: unrouted, like -1, as the validation-off contract says) in
    registers: the sorted order is the stable sort of the ids, so
    ``row_map[r] = key_r & (2**LOG_SP - 1)`` lists unrouted slots first, then each expert's slots
    in token order. Offsets come from the router's ``counts`` (not recounted), and the tile map
    from the offsets, as :func:`_tile_map_kernel` (FROM_COUNTS) would build it.
    Example: ids [[1, 0], [1, 2], [-1, 1]] (S=6, E=3), counts [1, 3, 1] -> row_map
    [4, 1, 0, 2, 5, 3], offsets [1, 2, 5, 6]."""
    SP: tl.constexpr = 1 << LOG_SP
    s = tl.arange(0, SP)
    ok = s < S
    ids = tl.load(ids_ptr + s, mask=ok, other=0)
    idp = tl.where((ids >= 0) & (ids < E), ids + 1, 0)
    key = tl.where(ok, (idp << LOG_SP) | s, 2147483647)
    key = tl.sort(key, 0)
    tl.store(row_map_ptr + s, (key & (SP - 1)).to(tl.int64), mask=ok)
    _write_tiles(counts_ptr, offs_ptr, tiles_ptr, count_ptr, S, E, MT, 0, tl.cdiv(MT, BT), 1,
                 True, True, BM, SEGP, BT)


# ---------------------------------------------------------------------------------------------
# GEMMs
# ---------------------------------------------------------------------------------------------

# Row counts change with every batch; specializing on them (divisibility by 16, equality to 1)
# would only recompile. N, K and the strides stay specialized: their divisibility is what lets
# the masked tile loads vectorize into cp.async copies.
_ROW_ARGS = ["ROWS_HINT"]


@triton.jit(do_not_specialize=_ROW_ARGS)
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, h_ptr, bias_ptr, tiles_ptr, count_ptr, row_map_ptr, scale_ptr,
    N, K, ROWS_HINT, limit, alpha,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cs, stride_cm, stride_cn,
    stride_hm, stride_hn,
    stride_xe, stride_xn,
    ACT: tl.constexpr, STORE_H: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
    SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, TOPK: tl.constexpr, SPLIT_K: tl.constexpr,
    PREC: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Grouped GEMM ``C[r] = act(A[r] @ B[seg(r)] + bias[seg(r)])`` over ragged row segments,
    fp32 accumulation.

    Work items: (M tile of the tile map, N tile, K split), taken by the persistent programs in
    grouped order (module docstring). One item is a ``BM x BN`` output tile: a K loop in ``BK``
    steps (``tl.dot`` into an fp32 accumulator; with a GLU activation a second accumulator over
    B's columns ``N + n``, the up half, so the activation happens in registers), then:

    * ``HAS_BIAS``: acc += bias[e, n] (and bias[e, N + n] on the up half) in fp32 (split 0 only).
    * ``ACT``: none / SwiGLU / GELU (exact erf) / ReLU / GPT-OSS clamped SwiGLU (``limit``,
      ``alpha``) on the fp32 accumulator, rounded once to C's dtype; ``STORE_H`` also stores the
      pre-activation (both halves for GLUs) to ``h``.
    * ``GATHER_A``: A row = ``row_map[r] // TOPK`` (token rows read through routing metadata).
    * ``SCATTER_C``: C row = ``row_map[r]`` (slot order) instead of ``r``.
    * ``SCALE``: C = round(acc) * scale[row_map[r]] in fp32 (gate weight), then stored.
    * ``SPLIT_K > 1``: item (tile, split) sums K steps [split * per, (split + 1) * per) and stores
      the fp32 partial to C + split * stride_cs (no activation, scale or rounding; the combine
      sums the splits in a fixed order).

    Zero tiles (rows outside the segments) store zeros to C (and h). B is ``[E, K, *]`` by
    strides, so transposed or sliced weight views need no copy. Example: R=3, E=2,
    offsets=[0, 2, 2]: rows 0..1 use B[0], expert 1 is empty (no tile), row 2 is a zero row.
    """
    DUAL: tl.constexpr = (ACT == _SWIGLU) or (ACT == _SWIGLU_OAI)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_up = tl.program_id(0).to(tl.int64) * 0 + N  # N as int64 (offset of the up half; N may be a constexpr)
    num_pid_n = tl.cdiv(N, BN)
    num_pid_m = tl.load(count_ptr)
    k_tiles = tl.cdiv(K, BK)
    k_per = tl.cdiv(k_tiles, SPLIT_K)
    offs_k = tl.arange(0, BK)
    for item in range(pid, num_pid_m * num_pid_n * SPLIT_K, nprog):
        split = item % SPLIT_K  # SPLIT_K is a constexpr: no division instruction
        pid_m, pid_n = _swizzle(item // SPLIT_K, num_pid_m, num_pid_n, GROUP_M)
        seg = tl.load(tiles_ptr + pid_m * _TF).to(tl.int64)  # int64: seg * stride_be can pass 2**31
        row0 = tl.load(tiles_ptr + pid_m * _TF + 1).to(tl.int64)
        row_end = tl.load(tiles_ptr + pid_m * _TF + 2).to(tl.int64)
        rows = row0 + tl.arange(0, BM).to(tl.int64)
        row_ok = rows < row_end
        cols = pid_n * BN + tl.arange(0, BN).to(tl.int64)
        col_ok = cols < N
        out_mask = row_ok[:, None] & col_ok[None, :]
        if GATHER_A or SCATTER_C or SCALE:
            slot = tl.load(row_map_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        if SCATTER_C:
            c_rows = slot
        else:
            c_rows = rows
        c_ptrs = c_ptr + split * stride_cs + c_rows[:, None] * stride_cm + cols[None, :] * stride_cn
        h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn
        if seg < 0:  # zero rows: padding / unrouted slots
            tl.store(c_ptrs, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=out_mask)
            if STORE_H:
                zero_h = tl.zeros((BM, BN), dtype=h_ptr.dtype.element_ty)
                tl.store(h_ptrs, zero_h, mask=out_mask)
                if DUAL:
                    tl.store(h_ptrs + n_up * stride_hn, zero_h, mask=out_mask)
        else:
            if GATHER_A:
                a_rows = slot // TOPK
            else:
                a_rows = rows
            k_lo = split * k_per
            k_hi = tl.minimum(k_lo + k_per, k_tiles)
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_lo * BK + offs_k)[None, :] * stride_ak
            b_ptrs = b_ptr + seg * stride_be + (k_lo * BK + offs_k)[:, None] * stride_bk + cols[None, :] * stride_bn
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc_up = tl.zeros((BM, BN), dtype=tl.float32)
            for kk in range(k_lo, k_hi):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)  # [BM, BK]
                    b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)  # [BK, BN]
                else:
                    k_left = K - kk * BK
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                    b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PREC)  # [BM, BK] @ [BK, BN]
                if DUAL:
                    if EVEN_K:
                        b_up = tl.load(b_ptrs + n_up * stride_bn, mask=col_ok[None, :], other=0.0)
                    else:
                        b_up = tl.load(b_ptrs + n_up * stride_bn, mask=(offs_k[:, None] < k_left) & col_ok[None, :],
                                       other=0.0)
                    acc_up = tl.dot(a, b_up, acc_up, input_precision=PREC)  # [BM, BK] @ [BK, BN]
                a_ptrs += BK * stride_ak
                b_ptrs += BK * stride_bk

            if HAS_BIAS:
                bias_ptrs = bias_ptr + seg * stride_xe + cols * stride_xn
                bias_ok = col_ok & ((cols * 0 + split) == 0)  # the bias belongs to one K split
                acc += tl.load(bias_ptrs, mask=bias_ok, other=0.0).to(tl.float32)[None, :]
                if DUAL:
                    acc_up += tl.load(bias_ptrs + n_up * stride_xn, mask=bias_ok, other=0.0).to(tl.float32)[None, :]
            if SPLIT_K > 1:
                tl.store(c_ptrs, acc, mask=out_mask)
            else:
                if STORE_H:
                    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=out_mask)
                    if DUAL:
                        tl.store(h_ptrs + n_up * stride_hn, acc_up.to(h_ptr.dtype.element_ty), mask=out_mask)
                if DUAL:
                    out = _glu(acc, acc_up, ACT, limit, alpha)
                elif ACT == _GELU:
                    out = _gelu(acc)
                elif ACT == _RELU:
                    out = tl.maximum(acc, 0.0)
                else:
                    out = acc
                if SCALE:
                    w = tl.load(scale_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
                    out = out.to(a_ptr.dtype.element_ty).to(tl.float32) * w[:, None]
                tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dact_cols(g, w, rows, row_ok, ld_ok, cols, N, n_up, h_ptr, dh_ptr, stride_hm, stride_hn, stride_dm, stride_dn,
               ACT: tl.constexpr, SCALE: tl.constexpr, limit, alpha):
    """Epilogue of :func:`_grouped_mm_dact_kernel` for the columns ``cols`` of G = dY @ w2^T
    (``g`` [BM, len(cols)] fp32): stores dH there and returns the rows' gate-weight partials
    ``sum_n round(act(H))[r, n] * g[r, n]``."""
    dt = dh_ptr.dtype.element_ty
    mask = row_ok[:, None] & (cols < N)[None, :]
    ld_mask = ld_ok[:, None] & (cols < N)[None, :]
    h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn
    dh_ptrs = dh_ptr + rows[:, None] * stride_dm + cols[None, :] * stride_dn
    d_a = g.to(dt).to(tl.float32)
    if SCALE:
        d_a = (d_a * w[:, None]).to(dt).to(tl.float32)
    h = tl.load(h_ptrs, mask=ld_mask, other=0.0).to(tl.float32)
    if (ACT == _SWIGLU) or (ACT == _SWIGLU_OAI):
        up = tl.load(h_ptrs + n_up * stride_hn, mask=ld_mask, other=0.0).to(tl.float32)
        if ACT == _SWIGLU:
            sg = _sigmoid(h)
            silu = h * sg
            d_gate = d_a * up * (sg * (1.0 + h * (1.0 - sg)))
            d_up = d_a * silu
            act = silu * up
        else:
            gc, u = _clamp_oai(h, up, limit)
            sg = _sigmoid(alpha * gc)
            glu = gc * sg
            # torch.clamp's gradient rule: 1 inside the limits and at them, 0 outside (and for NaN)
            d_gate = tl.where(h <= limit, d_a * (u + 1.0) * (sg * (1.0 + alpha * gc * (1.0 - sg))), 0.0)
            d_up = tl.where((up >= -limit) & (up <= limit), d_a * glu, 0.0)
            act = (u + 1.0) * glu
        tl.store(dh_ptrs, d_gate.to(dt), mask=mask)
        tl.store(dh_ptrs + n_up * stride_dn, d_up.to(dt), mask=mask)
    elif ACT == _GELU:
        cdf = 0.5 * (1.0 + tl.math.erf(h * _SQRT1_2))
        pdf = tl.exp(-0.5 * h * h) * _INV_SQRT_2PI
        tl.store(dh_ptrs, (d_a * (cdf + h * pdf)).to(dt), mask=mask)
        act = h * cdf
    else:
        tl.store(dh_ptrs, tl.where(h > 0.0, d_a, 0.0).to(dt), mask=mask)
        act = tl.maximum(h, 0.0)
    act = act.to(dt).to(tl.float32)
    return tl.sum(tl.where(mask, act * g, 0.0), 1)  # [BM]


@triton.jit(do_not_specialize=_ROW_ARGS)
def _grouped_mm_dact_kernel(
    a_ptr, b_ptr, h_ptr, dh_ptr, tiles_ptr, count_ptr, row_map_ptr, scale_ptr, part_ptr,
    N, K, ROWS_HINT, limit, alpha,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_hm, stride_hn,
    stride_dm, stride_dn,
    stride_pm,
    ACT: tl.constexpr, GATHER_A: tl.constexpr, SCALE: tl.constexpr, DGATE: tl.constexpr, TOPK: tl.constexpr,
    PREC: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Backward of the second FFN GEMM and the activation: ``dH = act'(H) * round(dY @ w2[e]^T)``.

    Tile map and persistent schedule as :func:`_grouped_mm_kernel` (N = d_ffn columns of the
    activation). A is dY ``[R, D]`` (or, with ``GATHER_A``, the output gradient ``[T, D]`` read at
    token ``row_map[r] // TOPK``); B is ``w2^T`` as a strided view ``[E, D, F]``. One work item
    computes G = A @ B for a ``BM x BN`` tile, or, for the GLUs, for two adjacent ``BM x BN``
    tiles (two accumulators over the same A tile: 2 * BN columns per read of dY, with the two
    epilogues run one after the other so their live tiles never coexist), then in the epilogue
    (:func:`_dact_cols`):

    * ``SCALE``: dA = round(G) * gate_weight[row_map[r]] (the fused path's dY rows are the
      output gradient times the gate weight); dA is rounded to the input dtype like the
      unfused backward's.
    * reads the saved pre-activation H (both halves for GLUs) and stores dH (gate and up columns
      ``n`` and ``F + n`` for GLUs: SwiGLU d_gate = dA * up * silu'(gate), d_up = dA * silu(gate);
      GPT-OSS: the clamped gate g and up u give d_gate = dA * (u + 1) * d[g sigmoid(alpha g)]/dg
      where gate <= limit (else 0) and d_up = dA * g sigmoid(alpha g) where |up| <= limit (else 0),
      the boundaries passing the gradient like torch.clamp; GELU: dA * (Phi(h) + h * phi(h));
      ReLU: dA * (h > 0)).
    * ``DGATE``: the gate-weight gradient's partial sum over this tile's columns,
      ``sum_n round(act(H))[r, n] * G[r, n]`` (= <dout[t], y[r] - b2[e]> restricted to the tile),
      stored to ``part[row_map[r], pid_n]``; :func:`_dgate_kernel` sums the partials in a fixed
      order and adds <dout[t], b2[e]>.

    Zero tiles run no K step and read nothing (their loads are masked off); they store zero dH
    (and zero partials).
    """
    DUAL: tl.constexpr = (ACT == _SWIGLU) or (ACT == _SWIGLU_OAI)
    TWO: tl.constexpr = DUAL  # two BN-column accumulators per work item (2 * BN columns)
    ITEM_N: tl.constexpr = BN * (2 if TWO else 1)  # output columns per work item
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_up = tl.program_id(0).to(tl.int64) * 0 + N  # N as int64 (offset of the up half; N may be a constexpr)
    num_pid_n = tl.cdiv(N, ITEM_N)
    num_pid_m = tl.load(count_ptr)
    offs_k = tl.arange(0, BK)
    for item in range(pid, num_pid_m * num_pid_n, nprog):
        pid_m, pid_n = _swizzle(item, num_pid_m, num_pid_n, GROUP_M)
        seg = tl.load(tiles_ptr + pid_m * _TF).to(tl.int64)
        row0 = tl.load(tiles_ptr + pid_m * _TF + 1).to(tl.int64)
        row_end = tl.load(tiles_ptr + pid_m * _TF + 2).to(tl.int64)
        rows = row0 + tl.arange(0, BM).to(tl.int64)
        row_ok = rows < row_end
        cols = pid_n * ITEM_N + tl.arange(0, BN).to(tl.int64)
        col_ok = cols < N
        col2_ok = cols + BN < N
        if GATHER_A or SCALE or DGATE:
            slot = tl.load(row_map_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        # Zero tiles (seg < 0) run no K step and read nothing: every input tile is masked off,
        # and the activation gradients of zeros are zeros.
        ld_ok = rows < tl.where(seg >= 0, row_end, row0)
        if GATHER_A:
            a_rows = slot // TOPK
        else:
            a_rows = rows
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + tl.maximum(seg, 0) * stride_be + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(0, tl.where(seg >= 0, tl.cdiv(K, BK), 0)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=ld_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_left = K - kk * BK
                a = tl.load(a_ptrs, mask=ld_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)  # [BM, BK] @ [BK, BN]
            if TWO:
                if EVEN_K:
                    b2 = tl.load(b_ptrs + BN * stride_bn, mask=col2_ok[None, :], other=0.0)
                else:
                    b2 = tl.load(b_ptrs + BN * stride_bn, mask=(offs_k[:, None] < k_left) & col2_ok[None, :], other=0.0)
                acc2 = tl.dot(a, b2, acc2, input_precision=PREC)  # [BM, BK] @ [BK, BN]
            a_ptrs += BK * stride_ak
            b_ptrs += BK * stride_bk
        if SCALE:
            w = tl.load(scale_ptr + slot, mask=ld_ok, other=0.0).to(tl.float32)
        else:
            w = tl.zeros((BM,), dtype=tl.float32)
        part = _dact_cols(acc, w, rows, row_ok, ld_ok, cols, N, n_up, h_ptr, dh_ptr, stride_hm, stride_hn,
                          stride_dm, stride_dn, ACT, SCALE, limit, alpha)
        if TWO:
            part += _dact_cols(acc2, w, rows, row_ok, ld_ok, cols + BN, N, n_up, h_ptr, dh_ptr, stride_hm, stride_hn,
                               stride_dm, stride_dn, ACT, SCALE, limit, alpha)
        if DGATE:
            tl.store(part_ptr + slot * stride_pm + pid_n, part, mask=row_ok)


@triton.jit(do_not_specialize=["R", "ROWS_HINT"])
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, row_map_ptr, scale_ptr,
    R, M, N, ROWS_HINT,
    stride_ar, stride_ac,
    stride_br, stride_bc,
    stride_ce, stride_cm, stride_cn,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, SCALE_A: tl.constexpr, TOPK: tl.constexpr,
    PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Per-expert transpose GEMM ``C[e] = A_e^T @ B_e`` (weight gradients), fp32 accumulation.

    Grid: ``(cdiv(M, BM) * cdiv(N, BN), E)``. One program owns one ``BM x BN`` tile of expert
    e's ``[M, N]`` output and loops over the rows [offsets[e], offsets[e+1]) (of the R-row space) in
    ``BK`` steps: ``acc += A[rows, m]^T @ B[rows, n]`` (``[BM, BK] @ [BK, BN]``), then stores it
    once, so the reduction order is fixed (deterministic, no atomics). An empty expert stores
    zeros. ``GATHER_A`` / ``GATHER_B`` read row ``row_map[r] // TOPK`` of A / B (token rows of the
    fused path; TOPK is a constexpr, so no division instruction in the loop). ``SCALE_A``
    multiplies A's rows by ``scale[row_map[r]]`` in fp32 and rounds to the input dtype (the fused
    path's dw2 = (gate weight * act)^T @ output gradient): the scaled operand is the MMA's
    left-hand side, which wgmma takes from registers, so the right-hand side keeps streaming
    through the shared-memory pipeline and consecutive MMAs overlap (scaling B instead forces a
    register -> shared copy and a full wgmma wait every step).
    Example: offsets=[0, 3, 3], E=2: expert 0 sums rows 0..2, expert 1 stores zeros.
    """
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    seg_start = tl.minimum(tl.maximum(tl.load(offs_ptr + e).to(tl.int64), 0), R)  # clamped to the row space
    seg_end = tl.minimum(tl.maximum(tl.load(offs_ptr + e + 1).to(tl.int64), seg_start), R)
    cols_m = pid_m * BM + tl.arange(0, BM).to(tl.int64)
    cols_n = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    m_ok = cols_m < M
    n_ok = cols_n < N
    offs_r = tl.arange(0, BK).to(tl.int64)
    dt = a_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(seg_start, seg_end, BK):
        rows = r0 + offs_r
        r_ok = rows < seg_end
        if GATHER_A or GATHER_B or SCALE_A:
            slot = tl.load(row_map_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        if GATHER_A:
            a_rows = slot // TOPK
        else:
            a_rows = rows
        if GATHER_B:
            b_rows = slot // TOPK
        else:
            b_rows = rows
        a = tl.load(a_ptr + a_rows[:, None] * stride_ar + cols_m[None, :] * stride_ac,
                    mask=r_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
        b = tl.load(b_ptr + b_rows[:, None] * stride_br + cols_n[None, :] * stride_bc,
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if SCALE_A:
            s = tl.load(scale_ptr + slot, mask=r_ok, other=0.0).to(tl.float32)
            a_t = (tl.trans(a).to(tl.float32) * s[None, :]).to(dt)  # [BM, BK], in registers
            acc = tl.dot(a_t, b, acc, input_precision=PREC)  # [BM, BK] @ [BK, BN]
        else:
            acc = tl.dot(tl.trans(a), b, acc, input_precision=PREC)  # [BM, BK] @ [BK, BN]
    c_ptrs = c_ptr + e * stride_ce + cols_m[:, None] * stride_cm + cols_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["R"])
def _segment_colsum_kernel(
    b_ptr, c_ptr, offs_ptr, row_map_ptr, scale_ptr,
    R, N,
    stride_br, stride_bc, stride_ce, stride_cn,
    GATHER_B: tl.constexpr, SCALE_B: tl.constexpr, TOPK: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
):
    """Per-expert column sums ``C[e] = sum over rows r of segment e of B[r]`` (bias gradients),
    fp32, rows in ascending order in BR-row steps (deterministic, no atomics).

    Grid: ``(cdiv(N, BN), E)``. ``GATHER_B`` reads B's row ``row_map[r] // TOPK`` and ``SCALE_B``
    multiplies it by ``scale[row_map[r]]`` (the fused path's dY = gate weight * output
    gradient). An empty expert stores zeros. Example: offsets [0, 2, 2], B rows [1, 2], [3, 4]
    -> C = [[4, 6], [0, 0]].
    """
    pid_n = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    seg_start = tl.minimum(tl.maximum(tl.load(offs_ptr + e).to(tl.int64), 0), R)
    seg_end = tl.minimum(tl.maximum(tl.load(offs_ptr + e + 1).to(tl.int64), seg_start), R)
    cols = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    col_ok = cols < N
    offs_r = tl.arange(0, BR).to(tl.int64)
    acc = tl.zeros((BR, BN), dtype=tl.float32)
    for r0 in range(seg_start, seg_end, BR):
        rows = r0 + offs_r
        r_ok = rows < seg_end
        if GATHER_B or SCALE_B:
            slot = tl.load(row_map_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        if GATHER_B:
            b_rows = slot // TOPK
        else:
            b_rows = rows
        v = tl.load(b_ptr + b_rows[:, None] * stride_br + cols[None, :] * stride_bc,
                    mask=r_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if SCALE_B:
            v = v * tl.load(scale_ptr + slot, mask=r_ok, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(c_ptr + e * stride_ce + cols * stride_cn, tl.sum(acc, 0).to(c_ptr.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["T"])
def _combine_kernel(
    buf_ptr, w_ptr, ids_ptr, out_ptr,
    T, D, E,
    stride_bs, stride_bm, stride_bd,
    stride_wt, stride_wk,
    stride_it, stride_ik,
    stride_ot, stride_od,
    TOPK: tl.constexpr, SPLIT: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """``out[t] = sum_j [0 <= id[t, j] < E] * w[t, j] * y[t * TOPK + j]`` (or the plain sum of the
    rows without ``HAS_W``), in fp32 with j ascending, rounded once to out's dtype: the
    fixed-order combine of the k expert outputs of a token (no atomics). Unrouted slots add
    nothing whatever their stored weight.

    ``SPLIT > 1``: ``y = round(sum_s buf[s, row])`` over the fp32 split-K partials in ascending s
    (rounded to out's dtype like a stored expert output); otherwise y = buf[row].
    Grid: ``(cdiv(T, BT), cdiv(D, BD))``; one program sums TOPK rows for a ``BT x BD`` block.
    Example: TOPK=2, buf rows [y00, y01, y10, y11] -> out = [w00*y00 + w01*y01, w10*y10 + w11*y11].
    """
    pid_t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    toks = pid_t * BT + tl.arange(0, BT).to(tl.int64)
    cols = pid_d * BD + tl.arange(0, BD).to(tl.int64)
    t_ok = toks < T
    mask = t_ok[:, None] & (cols[None, :] < D)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in range(0, TOPK):
        slot = toks * TOPK + j
        ptrs = buf_ptr + slot[:, None] * stride_bm + cols[None, :] * stride_bd
        if SPLIT > 1:
            v = tl.zeros((BT, BD), dtype=tl.float32)
            for s in range(0, SPLIT):
                v += tl.load(ptrs + s * stride_bs, mask=mask, other=0.0)
            v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
        else:
            v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            e = tl.load(ids_ptr + toks * stride_it + j * stride_ik, mask=t_ok, other=-1)
            w = tl.load(w_ptr + toks * stride_wt + j * stride_wk, mask=t_ok, other=0.0).to(tl.float32)
            v = tl.where(((e >= 0) & (e < E))[:, None], v * w[:, None], 0.0)
        acc += v
    tl.store(out_ptr + toks[:, None] * stride_ot + cols[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["S"])
def _dgate_kernel(
    part_ptr, dout_ptr, ids_ptr, b2_ptr, out_ptr,
    S, D, E, NP,
    stride_ps, stride_pn,
    stride_dt, stride_dd,
    stride_it, stride_ik,
    stride_be, stride_bd,
    stride_ot, stride_ok,
    TOPK: tl.constexpr, HAS_B2: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
):
    """Gate-weight gradient of the fused path: ``out[t, j] = sum_p part[s, p]`` (the dH kernel's
    column-tile partials of slot s = t * TOPK + j, p ascending) ``+ <dout[t], b2[id[t, j]]>`` for
    a routed slot with ``HAS_B2`` (the bias is part of the expert output the weight multiplies),
    in fp32, d ascending. Unrouted slots get 0 (their partials are zero).

    Grid: ``(cdiv(S, BS),)``; one program does BS slots. Example: TOPK = 1, part [[1, 2]], dout
    [[3, 4]], b2 [[1, 1]], ids [[0]] -> out [[3 + 7]] = [[10]].
    """
    pid = tl.program_id(0).to(tl.int64)
    slots = pid * BS + tl.arange(0, BS).to(tl.int64)
    s_ok = slots < S
    t = slots // TOPK  # constexpr divisor: a multiply-shift
    j = slots % TOPK
    offs = tl.arange(0, BD).to(tl.int64)
    acc = tl.zeros((BS, BD), dtype=tl.float32)
    for p0 in range(0, NP, BD):
        p = p0 + offs
        acc += tl.load(part_ptr + slots[:, None] * stride_ps + p[None, :] * stride_pn,
                       mask=s_ok[:, None] & (p[None, :] < NP), other=0.0)
    if HAS_B2:
        e = tl.load(ids_ptr + t * stride_it + j * stride_ik, mask=s_ok, other=-1).to(tl.int64)
        routed = s_ok & (e >= 0) & (e < E)
        for d0 in range(0, D, BD):
            d = d0 + offs
            m = routed[:, None] & (d[None, :] < D)
            x = tl.load(dout_ptr + t[:, None] * stride_dt + d[None, :] * stride_dd, mask=m, other=0.0).to(tl.float32)
            b = tl.load(b2_ptr + e[:, None] * stride_be + d[None, :] * stride_bd, mask=m, other=0.0).to(tl.float32)
            acc += x * b
    tl.store(out_ptr + t * stride_ot + j * stride_ok, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=s_ok)
