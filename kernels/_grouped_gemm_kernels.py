"""Triton kernels of the grouped expert FFN (launchers in :mod:`tritonmoe.kernels.grouped_gemm`).

Row space. Every GEMM here runs over a *row space* of ``R`` rows split into ragged segments by
device-side ``offsets`` [E+1]: segment e is rows [offsets[e], offsets[e+1]) and uses expert e's
weights; the rows [offsets[E], R) form a *tail* segment (padding of the unfused path, unrouted
slots of the fused path) whose outputs are written as zeros. In the unfused path a row is a row of
the permuted buffer; in the fused path row r stands for the (token, slot) pair
``s = row_map[r] = t * TOPK + j``, so A rows are gathered from token ``s // TOPK`` and outputs may be
scattered to row ``s``.

Tile map without host synchronization. The grid is sized from shapes only: ``num_pid_m =
cdiv(R, BM) + E`` M tiles bound sum over the E+1 segments of cdiv(len, BM), because each segment
wastes less than one tile. Each program loads the offsets (a vector of E+1), computes every
segment's tile count and their inclusive prefix sum, and finds its segment as the number of
prefix sums <= its M-tile index; programs past the last tile return at once, so empty experts cost
nothing. Worked example: BM=4, R=10, offsets=[0, 5, 5, 9] (E=3): segment tiles [2, 0, 1, 1 (tail)]
prefix [2, 2, 3, 4]; M tile 0 -> segment 0 rows 0..3, tile 1 -> segment 0 row 4, tile 2 ->
segment 2 rows 5..8, tile 3 -> tail row 9 (zeros), tiles 4..6 (of cdiv(10,4)+3 = 6) return.

Shape letters inside kernels: BM/BN/BK are tile sizes; ``K`` is the GEMM depth (not top_k, which
is ``TOPK``).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Activation codes: host ints for the launchers, constexpr twins for the kernels (jit code may
# only read globals that are tl.constexpr).
ACT_NONE = 0
ACT_SWIGLU = 1
ACT_GELU = 2
ACT_RELU = 3
_SWIGLU = tl.constexpr(ACT_SWIGLU)
_GELU = tl.constexpr(ACT_GELU)
_RELU = tl.constexpr(ACT_RELU)

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M consecutive M tiles sweep the N tiles together, so programs that
    run at the same time share weight panels (same expert) and row tiles in L2."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _locate_tile(pid_m, offs_ptr, E, R, BM: tl.constexpr, SEG: tl.constexpr):
    """-> (segment, first row, segment end) of M tile ``pid_m``; segment > E means no tile."""
    idx = tl.arange(0, SEG)
    start = tl.load(offs_ptr + idx, mask=idx <= E, other=0).to(tl.int64)
    start = tl.where(idx <= E, start, R)
    end = tl.load(offs_ptr + idx + 1, mask=idx < E, other=0).to(tl.int64)
    end = tl.where(idx < E, end, R)  # the tail segment E ends at R; segments past it are empty
    # Valid offsets are monotone in [0, R]; clamping costs nothing and keeps even invalid ones
    # (validation switched off) from sending a program outside the row space.
    start = tl.minimum(tl.maximum(start, 0), R)
    end = tl.minimum(tl.maximum(end, start), R)
    tiles = (end - start + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)  # inclusive prefix sum of tiles per segment
    seg = tl.sum((cum <= pid_m).to(tl.int64), 0)  # int64: seg * stride_be can pass 2**31
    here = idx == seg
    tile0 = tl.sum(tl.where(here, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(here, start, 0), 0) + (pid_m - tile0) * BM
    row_end = tl.sum(tl.where(here, end, 0), 0)
    return seg, row0, row_end


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * _SQRT1_2))


# Row counts and grid sizes change with every batch; specializing on them (divisibility by 16,
# equality to 1) would only recompile. N, K and the strides stay specialized: their divisibility
# is what lets the masked tile loads vectorize into cp.async copies.
_ROW_ARGS = ["R", "E", "num_pid_m", "ROWS_HINT"]


@triton.jit(do_not_specialize=_ROW_ARGS)
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, h_ptr, offs_ptr, row_map_ptr, scale_ptr,
    R, N, K, E, TOPK, num_pid_m, ROWS_HINT,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn,
    stride_hm, stride_hn,
    ACT: tl.constexpr, STORE_H: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
    SCALE: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr, SEG: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Grouped GEMM ``C[r] = act(A[r] @ B[seg(r)])`` over ragged row segments, fp32 accumulation.

    Grid: ``(num_pid_m * cdiv(N, BN),)`` with ``num_pid_m = cdiv(R, BM) + E`` (see the module
    docstring). One program computes one ``BM x BN`` output tile of one segment: it locates its
    segment from ``offsets``, loops over K in ``BK`` steps (``tl.dot`` into an fp32 accumulator;
    with ``ACT == SWIGLU`` a second accumulator over B's columns ``N + n``, the up half, so
    ``silu(gate) * up`` happens in registers), then applies the epilogue:

    * ``ACT``: none / SwiGLU / GELU (exact erf) / ReLU on the fp32 accumulator, rounded once to
      C's dtype; ``STORE_H`` also stores the pre-activation (both halves for SwiGLU) to ``h``.
    * ``GATHER_A``: A row = ``row_map[r] // TOPK`` (token rows read through routing metadata).
    * ``SCATTER_C``: C row = ``row_map[r]`` (slot order) instead of ``r``.
    * ``SCALE``: C = round(acc) * scale[row_map[r]] in fp32 (gate weight), then stored.

    Tail-segment programs (rows past offsets[E]) store zeros to C (and h). B is ``[E, K, *]`` by
    strides, so transposed or sliced weight views need no copy. Example: R=3, E=2,
    offsets=[0, 2, 2]: rows 0..1 use B[0], expert 1 is empty (no tile), row 2 is tail (zeros).
    """
    pid = tl.program_id(0).to(tl.int64)
    n_up = pid * 0 + N  # N as int64 (column offset of the up / second half; N may be a constexpr)
    num_pid_n = tl.cdiv(N, BN)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    seg, row0, row_end = _locate_tile(pid_m, offs_ptr, E, R, BM, SEG)
    if seg > E:
        return
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
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + cols[None, :] * stride_cn
    h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn

    if seg == E:  # tail: padding rows / unrouted slots are zero
        tl.store(c_ptrs, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=out_mask)
        if STORE_H:
            tl.store(h_ptrs, tl.zeros((BM, BN), dtype=h_ptr.dtype.element_ty), mask=out_mask)
            if ACT == _SWIGLU:
                tl.store(h_ptrs + n_up * stride_hn, tl.zeros((BM, BN), dtype=h_ptr.dtype.element_ty), mask=out_mask)
        return

    if GATHER_A:
        a_rows = slot // TOPK
    else:
        a_rows = rows
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + seg * stride_be + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)  # [BM, BK]
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)  # [BK, BN]
        else:
            k_left = K - kk * BK
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)  # [BM, BK] @ [BK, BN]
        if ACT == _SWIGLU:
            if EVEN_K:
                b_up = tl.load(b_ptrs + n_up * stride_bn, mask=col_ok[None, :], other=0.0)
            else:
                b_up = tl.load(b_ptrs + n_up * stride_bn, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PREC)  # [BM, BK] @ [BK, BN]
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk

    if STORE_H:
        tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=out_mask)
        if ACT == _SWIGLU:
            tl.store(h_ptrs + n_up * stride_hn, acc_up.to(h_ptr.dtype.element_ty), mask=out_mask)
    if ACT == _SWIGLU:
        out = acc * _sigmoid(acc) * acc_up
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


@triton.jit(do_not_specialize=_ROW_ARGS)
def _grouped_mm_dact_kernel(
    a_ptr, b_ptr, h_ptr, dh_ptr, offs_ptr, row_map_ptr, scale_ptr, part_ptr,
    R, N, K, E, TOPK, num_pid_m, ROWS_HINT,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_hm, stride_hn,
    stride_dm, stride_dn,
    stride_pm,
    ACT: tl.constexpr, GATHER_A: tl.constexpr, SCALE: tl.constexpr, DGATE: tl.constexpr,
    PREC: tl.constexpr, EVEN_K: tl.constexpr, SEG: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Backward of the second FFN GEMM and the activation: ``dH = act'(H) * round(dY @ w2[e]^T)``.

    Grid and tile map as :func:`_grouped_mm_kernel` (N = d_ffn columns of the activation). A is
    dY ``[R, D]`` (or, with ``GATHER_A``, the output gradient ``[T, D]`` read at token
    ``row_map[r] // TOPK``); B is ``w2^T`` as a strided view ``[E, D, F]``. One program computes
    G = A @ B for a ``BM x BN`` tile, then in the epilogue:

    * ``SCALE``: dA = round(G) * gate_weight[row_map[r]] (the fused path's dY rows are the
      output gradient times the gate weight); dA is rounded to the input dtype like the
      unfused backward's.
    * reads the saved pre-activation H (both halves for SwiGLU) and stores dH (gate and up
      columns ``n`` and ``F + n`` for SwiGLU: d_gate = dA * up * silu'(gate), d_up = dA * silu(gate);
      GELU: dA * (Phi(h) + h * phi(h)); ReLU: dA * (h > 0)).
    * ``DGATE``: the gate-weight gradient's partial sum over this tile's columns,
      ``sum_n round(act(H))[r, n] * G[r, n]`` (= <dout[t], y[r]> restricted to the tile), stored
      to ``part[row_map[r], pid_n]``; the launcher sums the partials in a fixed order.

    Tail programs store zero dH (and zero partials).
    """
    pid = tl.program_id(0).to(tl.int64)
    n_up = pid * 0 + N  # N as int64 (column offset of the up / second half; N may be a constexpr)
    num_pid_n = tl.cdiv(N, BN)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    seg, row0, row_end = _locate_tile(pid_m, offs_ptr, E, R, BM, SEG)
    if seg > E:
        return
    rows = row0 + tl.arange(0, BM).to(tl.int64)
    row_ok = rows < row_end
    cols = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    col_ok = cols < N
    out_mask = row_ok[:, None] & col_ok[None, :]
    if GATHER_A or SCALE or DGATE:
        slot = tl.load(row_map_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    dh_ptrs = dh_ptr + rows[:, None] * stride_dm + cols[None, :] * stride_dn
    h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn

    if seg == E:
        zero = tl.zeros((BM, BN), dtype=dh_ptr.dtype.element_ty)
        tl.store(dh_ptrs, zero, mask=out_mask)
        if ACT == _SWIGLU:
            tl.store(dh_ptrs + n_up * stride_dn, zero, mask=out_mask)
        if DGATE:
            tl.store(part_ptr + slot * stride_pm + pid_n, tl.zeros((BM,), dtype=tl.float32), mask=row_ok)
        return

    if GATHER_A:
        a_rows = slot // TOPK
    else:
        a_rows = rows
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + seg * stride_be + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_left = K - kk * BK
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)  # [BM, BK] @ [BK, BN]
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk

    dt = a_ptr.dtype.element_ty
    d_a = acc.to(dt).to(tl.float32)
    if SCALE:
        w = tl.load(scale_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
        d_a = (d_a * w[:, None]).to(dt).to(tl.float32)
    h = tl.load(h_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    if ACT == _SWIGLU:
        up = tl.load(h_ptrs + n_up * stride_hn, mask=out_mask, other=0.0).to(tl.float32)
        sg = _sigmoid(h)
        silu = h * sg
        d_gate = d_a * up * (sg * (1.0 + h * (1.0 - sg)))
        d_up = d_a * silu
        tl.store(dh_ptrs, d_gate.to(dh_ptr.dtype.element_ty), mask=out_mask)
        tl.store(dh_ptrs + n_up * stride_dn, d_up.to(dh_ptr.dtype.element_ty), mask=out_mask)
        act = silu * up
    elif ACT == _GELU:
        cdf = 0.5 * (1.0 + tl.math.erf(h * _SQRT1_2))
        pdf = tl.exp(-0.5 * h * h) * _INV_SQRT_2PI
        tl.store(dh_ptrs, (d_a * (cdf + h * pdf)).to(dh_ptr.dtype.element_ty), mask=out_mask)
        act = h * cdf
    else:
        tl.store(dh_ptrs, tl.where(h > 0.0, d_a, 0.0).to(dh_ptr.dtype.element_ty), mask=out_mask)
        act = tl.maximum(h, 0.0)
    if DGATE:
        act = act.to(dt).to(tl.float32)
        part = tl.sum(tl.where(out_mask, act * acc, 0.0), 1)  # [BM]
        tl.store(part_ptr + slot * stride_pm + pid_n, part, mask=row_ok)


@triton.jit(do_not_specialize=["R", "ROWS_HINT"])
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, row_map_ptr, scale_ptr,
    R, M, N, TOPK, ROWS_HINT,
    stride_ar, stride_ac,
    stride_br, stride_bc,
    stride_ce, stride_cm, stride_cn,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, SCALE_B: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Per-expert transpose GEMM ``C[e] = A_e^T @ B_e`` (weight gradients), fp32 accumulation.

    Grid: ``(cdiv(M, BM) * cdiv(N, BN), E)``. One program owns one ``BM x BN`` tile of expert
    e's ``[M, N]`` output and loops over the rows [offsets[e], offsets[e+1]) (of the R-row space) in
    ``BK`` steps: ``acc += A[rows, m]^T @ B[rows, n]`` (``[BM, BK] @ [BK, BN]``), then stores it
    once, so the reduction order is fixed (deterministic, no atomics). An empty expert stores
    zeros. ``GATHER_A`` / ``GATHER_B`` read row ``row_map[r] // TOPK`` of A / B (token rows of the
    fused path); ``SCALE_B`` multiplies B's rows by ``scale[row_map[r]]`` in fp32 and rounds to the
    input dtype (the fused path's dY = gate weight * output gradient).
    Example: offsets=[0, 3, 3], E=2: expert 0 sums rows 0..2, expert 1 stores zeros.
    """
    pid = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    seg_start = tl.minimum(tl.maximum(tl.load(offs_ptr + e).to(tl.int64), 0), R)  # clamped like _locate_tile
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
        if GATHER_A or GATHER_B or SCALE_B:
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
        if SCALE_B:
            s = tl.load(scale_ptr + slot, mask=r_ok, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * s[:, None]).to(dt)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PREC)  # [BM, BK] @ [BK, BN]
    c_ptrs = c_ptr + e * stride_ce + cols_m[:, None] * stride_cm + cols_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _combine_kernel(
    buf_ptr, w_ptr, out_ptr,
    T, D,
    stride_bm, stride_bd,
    stride_ot, stride_od,
    TOPK: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """``out[t] = sum_j w[t, j] * buf[t * TOPK + j]`` (or the plain sum without ``HAS_W``), in fp32
    with j ascending, rounded once to out's dtype: the fixed-order combine of the k expert
    outputs of a token (no atomics).

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
        v = tl.load(buf_ptr + slot[:, None] * stride_bm + cols[None, :] * stride_bd, mask=mask, other=0.0)
        v = v.to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + slot, mask=t_ok, other=0.0).to(tl.float32)
            v = v * w[:, None]
        acc += v
    tl.store(out_ptr + toks[:, None] * stride_ot + cols[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty), mask=mask)
