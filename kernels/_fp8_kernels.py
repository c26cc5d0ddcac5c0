"""Triton kernels of the FP8 (e4m3) expert path (launchers in :mod:`tritonmoe.kernels.fp8_gemm`).

Formats and conventions are those of :mod:`tritonmoe.fp8_reference`: fp32 scales are
dequantization multipliers, ``s = amax / 448`` (1 for an all-zero group), ``q = e4m3(clamp(x / s,
-448, 448))`` with IEEE division (``tl.math.div_rn``; Triton's ``/`` is approximate on GPUs) and
round-to-nearest-even with subnormals. The rounding is done in fp32 by :func:`_round_e4m3`
before the cast, so the cast only converts an exactly representable value: Triton's
interpreter rounds ties away from zero and flushes e4m3 subnormals, the GPU's ``cvt.rn.satfinite``
rounds to nearest even, and both then give torch's bits.

Kernels:

* :func:`_quant_rows_kernel`: x [T, D] -> e4m3 rows and scales (1x128 groups or one per row),
  written to row ``t`` or, with ``SCATTER``, to each slot row ``slot_rows[t, j]`` of a permuted
  buffer (the permute with the quantization fused in: each token row is read and quantized once,
  then stored k times), padding rows and rows past ``offsets[E]`` as zeros with scale 1.
* :func:`_fp8_grouped_mm_kernel`: the block-scaled grouped GEMM over a row space (tile map of
  :mod:`._grouped_gemm_kernels`), e4m3 operands, fp32 accumulation. Block format: every K step
  (``BK`` divides 128) runs ``tl.dot`` into a fresh fp32 tile and adds it to the accumulator times
  the A rows' and B columns' scales of that 128-deep K block (the DeepGEMM recipe: scales applied
  per K block inside the main loop, on the fp32 partial); rowwise format: a plain chained K loop
  and the two scale vectors applied once in the epilogue. SwiGLU runs two accumulators (gate,
  up). Epilogue: fp32/bf16/fp16 output (gathered / scattered rows and the gate weight as in the
  16-bit kernels), or ``QUANT_OUT``: the tile quantized 1x128 in registers (BN = 128, one scale
  group per row per tile), e4m3 rows and scales stored, so GEMM2's input never exists in 16 bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._grouped_gemm_kernels import _TF, _sigmoid, _swizzle

_E4M3_MAX = tl.constexpr(448.0)
_SUBNORMAL = tl.constexpr(0.015625)  # 2**-6: smallest normal e4m3 magnitude
_TWO23 = tl.constexpr(8388608.0)


@triton.jit
def _round_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, subnormals kept;
    the result is exact in e4m3. Normal range: round the fp32 mantissa to 3 bits on the integer
    bits (a carry moves into the exponent, as it should); below 2**-6 the quantum is 2**-9:
    ``(|v| * 512 + 2**23) - 2**23`` rounds to an integer in fp32 (RNE), all steps exact otherwise."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    r_norm = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    r_sub = ((a * 512.0 + _TWO23) - _TWO23) * 0.001953125
    r = tl.where(a < _SUBNORMAL, r_sub, r_norm)
    return tl.where(v < 0, -r, r)


@triton.jit
def _scale_of(amax):
    """Dequantization scale of a group with absolute maximum ``amax`` (fp32)."""
    return tl.where(amax > 0, tl.math.div_rn(amax, amax * 0.0 + 448.0), 1.0)


@triton.jit
def _quantize(v, s):
    """e4m3 values of fp32 ``v`` with scale ``s`` (broadcast), as fp32 (exact in e4m3)."""
    x = tl.math.div_rn(v, s)
    x = tl.minimum(tl.maximum(x, -_E4M3_MAX), _E4M3_MAX)
    return _round_e4m3(x)


@triton.jit
def _store_rows(q_ptr, s_ptr, rows_ptr, t, q, s, cols, col_ok, g, stride_qm, stride_sm, stride_sg, num_rows,
                TOPK: tl.constexpr, SCATTER: tl.constexpr):
    """Store one quantized chunk (q [BLOCK_D] fp32-exact e4m3, scale s) of token t to its row(s)."""
    qq = q.to(q_ptr.dtype.element_ty)
    if SCATTER:
        for j in range(0, TOPK):
            row = tl.load(rows_ptr + t * TOPK + j)
            if (row >= 0) & (row < num_rows):  # -1 (not routed) or outside the buffer: skipped
                tl.store(q_ptr + row * stride_qm + cols, qq, mask=col_ok)
                if g >= 0:
                    tl.store(s_ptr + row * stride_sm + g * stride_sg, s)
    else:
        tl.store(q_ptr + t * stride_qm + cols, qq, mask=col_ok)
        if g >= 0:
            tl.store(s_ptr + t * stride_sm + g * stride_sg, s)


@triton.jit
def _zero_rows(q_ptr, s_ptr, stride_qm, stride_sm, stride_sg, r_lo, r_hi, D, NG, BLOCK_D: tl.constexpr):
    """Rows [r_lo, r_hi) of the quantized buffer: zeros, scale 1 (what quantizing zeros gives)."""
    zero = tl.zeros([BLOCK_D], dtype=q_ptr.dtype.element_ty)
    offs = tl.arange(0, BLOCK_D)
    for r in range(r_lo, r_hi):
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs
            tl.store(q_ptr + r * stride_qm + cols, zero, mask=cols < D)
        for g0 in range(0, NG, BLOCK_D):
            gg = g0 + offs
            tl.store(s_ptr + r * stride_sm + gg * stride_sg, tl.full([BLOCK_D], 1.0, tl.float32), mask=gg < NG)


@triton.jit(do_not_specialize=["T", "num_rows"])
def _quant_rows_kernel(
    x_ptr, stride_xt, stride_xd,
    rows_ptr, offsets_ptr, counts_ptr,
    q_ptr, stride_qm,
    s_ptr, stride_sm, stride_sg,
    T, D, E, NG, num_rows, TAIL_ROWS,
    TOPK: tl.constexpr, SCATTER: tl.constexpr, ROWWISE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Quantize token rows of x [T, D] (1x128 groups with BLOCK_D = 128, or one scale per row
    with ``ROWWISE``: a max pass over the row, then the quantizing pass).

    Grid (T + E + NTAIL,) with ``SCATTER`` (a permute; see the module docstring), else (T,):
    program t < T quantizes token t and stores it to row t or to its slot rows (rows outside
    [0, num_rows) skipped); program T + e zeros expert e's padding rows [offsets[e] + counts[e],
    offsets[e+1]); program T + E + i zeros rows [i*TAIL_ROWS, (i+1)*TAIL_ROWS) at or past
    offsets[E]. Example: D = 200, 1x128: scales [T, 2], the second group covers columns 128..199.
    """
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    if pid < T:
        t = pid
        src = x_ptr + t * stride_xt
        if ROWWISE:
            amax = tl.zeros([BLOCK_D], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + offs
                v = tl.load(src + cols * stride_xd, mask=cols < D, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(v))
            s = _scale_of(tl.max(amax, 0))
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + offs
                v = tl.load(src + cols * stride_xd, mask=cols < D, other=0.0).to(tl.float32)
                _store_rows(q_ptr, s_ptr, rows_ptr, t, _quantize(v, s), s, cols, cols < D, -1,
                            stride_qm, stride_sm, stride_sg, num_rows, TOPK, SCATTER)
            _store_rows(q_ptr, s_ptr, rows_ptr, t, tl.zeros([BLOCK_D], dtype=tl.float32), s, offs, offs < 0, 0,
                        stride_qm, stride_sm, stride_sg, num_rows, TOPK, SCATTER)
        else:
            for g in range(0, NG):
                cols = g * BLOCK_D + offs
                v = tl.load(src + cols * stride_xd, mask=cols < D, other=0.0).to(tl.float32)
                s = _scale_of(tl.max(tl.abs(v), 0))
                _store_rows(q_ptr, s_ptr, rows_ptr, t, _quantize(v, s), s, cols, cols < D, g,
                            stride_qm, stride_sm, stride_sg, num_rows, TOPK, SCATTER)
    elif pid < T + E:
        e = pid - T
        lo = tl.load(offsets_ptr + e) + tl.load(counts_ptr + e).to(tl.int64)
        hi = tl.load(offsets_ptr + e + 1)
        lo = tl.minimum(tl.maximum(lo, 0), num_rows)  # clamped: metadata off validation stays inside
        hi = tl.minimum(hi, num_rows)
        _zero_rows(q_ptr, s_ptr, stride_qm, stride_sm, stride_sg, lo, hi, D, NG, BLOCK_D)
    else:
        i = pid - T - E
        R = tl.load(offsets_ptr + E)
        lo = tl.maximum(i * TAIL_ROWS, R)
        hi = tl.minimum((i + 1) * TAIL_ROWS, num_rows)
        _zero_rows(q_ptr, s_ptr, stride_qm, stride_sm, stride_sg, lo, hi, D, NG, BLOCK_D)


@triton.jit(do_not_specialize=["ROWS_HINT"])
def _fp8_grouped_mm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, cs_ptr, tiles_ptr, count_ptr, row_map_ptr, w_ptr,
    N, K, ROWS_HINT,
    stride_am, stride_ak, stride_asm, stride_asg,
    stride_be, stride_bk, stride_bn,
    stride_bse, stride_bsn, stride_bsk,
    stride_cm, stride_cn, stride_csm, stride_csg,
    h_ptr, dh_ptr, stride_hm, stride_hn,
    SWIGLU: tl.constexpr, ROWWISE: tl.constexpr, QUANT_OUT: tl.constexpr,
    GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, SCALE: tl.constexpr, TOPK: tl.constexpr,
    EVEN_K: tl.constexpr, H_OUT: tl.constexpr, DSWIGLU: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """FP8 grouped GEMM ``C[r] = act(deq(A[r]) @ deq(B[seg(r)]))`` over ragged row segments.

    A: e4m3 [rows, K] (token rows ``row_map[r] // TOPK`` with ``GATHER_A``), scales ``as``
    [rows, cdiv(K,128)] (block) or [rows, 1] (rowwise), read at the same row. B: e4m3 ``[E, K, N']``
    by strides (a view of the checkpoint's ``[E, N', K]``, so K is contiguous, as FP8 wgmma wants),
    scales ``bs`` ``[E, cdiv(N',128), cdiv(K,128)]`` (block) or ``[E, N']`` (rowwise, as
    ``stride_bsk = 0``). With ``SWIGLU`` N' = 2N: gate columns n, up columns N + n, whose scale
    blocks start at ``cdiv(N, 128)`` (block) or at channel N (rowwise).

    Work items and tile map as :func:`._grouped_gemm_kernels._grouped_mm_kernel`. Block format:
    ``BK`` divides 128, and each K step adds ``dot(a, b) * sa[:, None] * sb[None, :]`` (the scales
    of its 128-deep K block) to the fp32 accumulator. Rowwise: ``acc = sum dot(a, b)`` then
    ``acc * sa * sb`` once.

    Epilogue: SwiGLU in fp32 (``silu(gate) * up``); then either C (its dtype; ``SCATTER_C``
    stores row ``row_map[r]``, ``SCALE`` multiplies the rounded row by ``w[row_map[r]]``) or,
    with ``QUANT_OUT`` (block format, BN = 128), e4m3 C and its 1x128 scales ``cs[r, pid_n]``.
    Training (block format, BN = 128; ``h`` / ``dh`` fp32 [rows, 2N], gate columns then up):
    ``H_OUT`` (with SWIGLU and QUANT_OUT: the forward's GEMM1) also stores the pre-activation
    (gate, up) to ``h`` for backward; ``DSWIGLU`` (the backward's dA = dY W2^T, N = f) turns the
    tile into dH = swiglu'(H) dA in the epilogue (H's gate and up tiles loaded from ``h``), stores
    it in fp32 to ``dh`` (the weight gradient's operand) and quantized 1x128 to C (e4m3 [rows, 2N])
    with scales ``cs[r, pid_n]`` (gate) and ``cs[r, cdiv(N,128) + pid_n]`` (up): dX's GEMM reads
    them, so neither dA nor an unquantized dH pass exists.
    Zero tiles store zeros (scale 1). Example: K = 200, BK = 32: K steps 0..3 use scale block 0,
    steps 4..6 block 1 (columns past 200 masked to zero).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_pid_n = tl.cdiv(N, BN)
    num_pid_m = tl.load(count_ptr)
    k_tiles = tl.cdiv(K, BK)
    offs_k = tl.arange(0, BK)
    up_cols = tl.program_id(0).to(tl.int64) * 0 + N  # N as int64
    if ROWWISE:
        up_sb = up_cols  # the up half's scales start at channel N
    else:
        up_sb = (up_cols + 127) // 128  # ... at scale block cdiv(N, 128)
    for item in range(pid, num_pid_m * num_pid_n, nprog):
        pid_m, pid_n = _swizzle(item, num_pid_m, num_pid_n, GROUP_M)
        seg = tl.load(tiles_ptr + pid_m * _TF).to(tl.int64)
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
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + cols[None, :] * stride_cn
        if seg < 0:  # zero rows: padding / unrouted slots
            tl.store(c_ptrs, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=out_mask)
            if QUANT_OUT:
                tl.store(cs_ptr + c_rows * stride_csm + pid_n * stride_csg, tl.full((BM,), 1.0, tl.float32),
                         mask=row_ok)
            if H_OUT or DSWIGLU:
                hz_ptr = h_ptr if H_OUT else dh_ptr
                hz = hz_ptr + c_rows[:, None] * stride_hm + cols[None, :] * stride_hn
                tl.store(hz, tl.zeros((BM, BN), dtype=tl.float32), mask=out_mask)
                tl.store(hz + up_cols * stride_hn, tl.zeros((BM, BN), dtype=tl.float32), mask=out_mask)
            if DSWIGLU:
                tl.store(c_ptrs + up_cols * stride_cn, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=out_mask)
                tl.store(cs_ptr + c_rows * stride_csm + (up_sb + pid_n) * stride_csg, tl.full((BM,), 1.0, tl.float32),
                         mask=row_ok)
        else:
            if GATHER_A:
                a_rows = slot // TOPK
            else:
                a_rows = rows
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + seg * stride_be + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
            as_ptrs = as_ptr + a_rows * stride_asm
            if ROWWISE:
                bs_ptrs = bs_ptr + seg * stride_bse + cols * stride_bsn
            else:
                bs_ptrs = bs_ptr + seg * stride_bse + (cols // 128) * stride_bsn
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc_up = tl.zeros((BM, BN), dtype=tl.float32)
            for kk in range(0, k_tiles):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)  # [BM, BK]
                    b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)  # [BK, BN]
                else:
                    k_left = K - kk * BK
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                    b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
                if SWIGLU:
                    if EVEN_K:
                        b_up = tl.load(b_ptrs + up_cols * stride_bn, mask=col_ok[None, :], other=0.0)
                    else:
                        b_up = tl.load(b_ptrs + up_cols * stride_bn, mask=(offs_k[:, None] < k_left) & col_ok[None, :],
                                       other=0.0)
                if ROWWISE:
                    # sm90's FP8 MMAs accumulate with ~14 mantissa bits (Triton's default there:
                    # never promote); promote into the fp32 accumulator every K step (<= 128
                    # products), as the block path's fresh partial per step does
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
                    if SWIGLU:
                        acc_up = tl.dot(a, b_up, acc_up, max_num_imprecise_acc=BK)
                else:
                    kb = (kk * BK) // 128  # scale block of this K step (BK divides 128: a shift)
                    sa = tl.load(as_ptrs + kb * stride_asg, mask=row_ok, other=0.0)
                    sb = tl.load(bs_ptrs + kb * stride_bsk, mask=col_ok, other=0.0)
                    acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
                    if SWIGLU:
                        sb_up = tl.load(bs_ptrs + up_sb * stride_bsn + kb * stride_bsk, mask=col_ok, other=0.0)
                        acc_up += tl.dot(a, b_up) * (sa[:, None] * sb_up[None, :])
                a_ptrs += BK * stride_ak
                b_ptrs += BK * stride_bk
            if ROWWISE:
                sa = tl.load(as_ptrs, mask=row_ok, other=0.0)
                sb = tl.load(bs_ptrs, mask=col_ok, other=0.0)
                acc = acc * sa[:, None] * sb[None, :]
                if SWIGLU:
                    sb_up = tl.load(bs_ptrs + up_sb * stride_bsn, mask=col_ok, other=0.0)
                    acc_up = acc_up * sa[:, None] * sb_up[None, :]
            if SWIGLU:
                if H_OUT:  # training: the fp32 pre-activation, kept for backward
                    h_ptrs = h_ptr + c_rows[:, None] * stride_hm + cols[None, :] * stride_hn
                    tl.store(h_ptrs, acc, mask=out_mask)
                    tl.store(h_ptrs + up_cols * stride_hn, acc_up, mask=out_mask)
                out = acc * _sigmoid(acc) * acc_up  # SwiGLU, as the 16-bit kernels compute it
            else:
                out = acc
            if DSWIGLU:  # out is dA: dH = swiglu'(H) dA, stored fp32 and quantized 1x128
                h_ptrs = h_ptr + c_rows[:, None] * stride_hm + cols[None, :] * stride_hn
                hg = tl.load(h_ptrs, mask=out_mask, other=0.0)
                hu = tl.load(h_ptrs + up_cols * stride_hn, mask=out_mask, other=0.0)
                sg = _sigmoid(hg)
                dg = out * hu * (sg * (1.0 + hg * (1.0 - sg)))
                du = out * (hg * sg)
                dh_ptrs = dh_ptr + c_rows[:, None] * stride_hm + cols[None, :] * stride_hn
                tl.store(dh_ptrs, dg, mask=out_mask)
                tl.store(dh_ptrs + up_cols * stride_hn, du, mask=out_mask)
                s_g = _scale_of(tl.max(tl.where(out_mask, tl.abs(dg), 0.0), 1))
                s_u = _scale_of(tl.max(tl.where(out_mask, tl.abs(du), 0.0), 1))
                tl.store(c_ptrs, _quantize(dg, s_g[:, None]).to(c_ptr.dtype.element_ty), mask=out_mask)
                tl.store(c_ptrs + up_cols * stride_cn, _quantize(du, s_u[:, None]).to(c_ptr.dtype.element_ty),
                         mask=out_mask)
                tl.store(cs_ptr + c_rows * stride_csm + pid_n * stride_csg, s_g, mask=row_ok)
                tl.store(cs_ptr + c_rows * stride_csm + (up_sb + pid_n) * stride_csg, s_u, mask=row_ok)
            elif QUANT_OUT:
                amax = tl.max(tl.where(out_mask, tl.abs(out), 0.0), 1)  # [BM]: one 1x128 group per row
                s = _scale_of(amax)
                q = _quantize(out, s[:, None])
                tl.store(c_ptrs, q.to(c_ptr.dtype.element_ty), mask=out_mask)
                tl.store(cs_ptr + c_rows * stride_csm + pid_n * stride_csg, s, mask=row_ok)
            else:
                if SCALE:
                    w = tl.load(w_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
                    out = out.to(c_ptr.dtype.element_ty).to(tl.float32) * w[:, None]
                tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["R"])
def _fp8_wgrad_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, offs_ptr,
    R, M, N,
    stride_am, stride_ar, stride_asm, stride_asg,
    stride_bn, stride_br, stride_bsn, stride_bsg,
    stride_ce, stride_cm, stride_cn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """FP8 weight gradient ``C[e] = sum over rows r of segment e of deq(A)[:, r] deq(B)[:, r]^T``
    (``[M, N]`` per expert), fp32 accumulation.

    A is X^T as e4m3 ``[M, R']`` and B is dY^T as e4m3 ``[N, R']`` (R' = R rounded up to BK,
    the padding columns zero), both quantized 1x128 along the rows R (scales ``[M, cdiv(R,128)]`` / ``[N, cdiv(R,128)]``: the 128x1 activation blocks of
    DeepSeek-V3's wgrad, taken over the global row blocks of the buffer), so the reduction runs
    along their contiguous dimension (K-major operands, as FP8 wgmma needs). Grid
    ``(cdiv(M, BM) * cdiv(N, BN), E)``: one program owns one output tile of expert e and steps
    over the expert's rows from the BK-aligned row at or below its first (BK divides 128, so a
    step lies inside one scale block), rows outside the segment masked to zero; each step's fp32
    partial is scaled by its block's scales and added (fixed order, no atomics). An empty
    expert stores zeros. Example: offsets [0, 200, 300], BK = 128: expert 1 steps rows 128..255
    (only 200..255 count) and 256..299.
    """
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    pid_m, pid_n = _swizzle(pid, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    seg_start = tl.minimum(tl.maximum(tl.load(offs_ptr + e).to(tl.int64), 0), R)
    seg_end = tl.minimum(tl.maximum(tl.load(offs_ptr + e + 1).to(tl.int64), seg_start), R)
    cols_m = pid_m * BM + tl.arange(0, BM).to(tl.int64)
    cols_n = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    m_ok = cols_m < M
    n_ok = cols_n < N
    offs_r = tl.arange(0, BK).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    r_first = (seg_start // BK) * BK
    for i in range(0, tl.cdiv(seg_end - r_first, BK).to(tl.int32)):  # an int32 trip count: pipelined
        r0 = r_first + i * BK
        rows = r0 + offs_r
        r_ok = (rows >= seg_start) & (rows < seg_end)
        # Both operands hold the buffer's rows along their contiguous dimension, padded to a
        # multiple of BK: the loads need no mask along it (a per-element mask there would keep
        # cp.async, which moves >= 4 bytes, from pipelining them); the rows of other experts are
        # zeroed in A's registers (wgmma reads A from registers, B from shared memory).
        a = tl.load(a_ptr + cols_m[:, None] * stride_am + rows[None, :] * stride_ar, mask=m_ok[:, None],
                    other=0.0)  # [BM, BK]
        a = tl.where(r_ok[None, :], a, tl.zeros_like(a))
        b = tl.load(b_ptr + rows[:, None] * stride_br + cols_n[None, :] * stride_bn, mask=n_ok[None, :],
                    other=0.0)  # [BK, BN]
        g = r0 // 128  # the step's scale block (a shift)
        sa = tl.load(as_ptr + cols_m * stride_asm + g * stride_asg, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptr + cols_n * stride_bsn + g * stride_bsg, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    c_ptrs = c_ptr + e * stride_ce + cols_m[:, None] * stride_cm + cols_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
