"""Triton kernels for token permutation (private; the launchers are in :mod:`.permute`).

Names follow :mod:`tritonmoe.core.types`: T tokens, K slots per token (top_k), E experts, D = d_model,
R rows of the permuted buffer. A *slot* is one (token t, slot j) pair, flattened token-major as
``s = t * K + j``, so ascending s is exactly the contract's order inside an expert (token, then
slot). ``S = T * K`` slots in all.

Metadata (ids -> counts, padded offsets, slot rows) comes in two forms that give identical
results:

* :func:`_metadata_fused_kernel`: one program does everything (small S * E; one launch).
* :func:`_block_hist_kernel` -> :func:`_block_scan_kernel` -> :func:`_block_rank_kernel`: slots are
  cut into blocks of BLOCK_S; per-block per-expert histograms, a fixed-order scan over the blocks
  (one program per chunk of experts), then every block ranks its slots, each program deriving its
  experts' padded offsets from the counts. Deterministic (no atomics), stable, no host sync.

Data movement:

* :func:`_scatter_rows_kernel`: every row of an output buffer is written once: out[slot_rows[t,j]]
  = (w[t,j] *) src[t], padding rows and rows past R as zeros (permute forward; unpermute backward,
  which also takes the row dot products d(topk_weights)).
* :func:`_gather_rows_kernel`: out[t] = sum_j (w[t,j] *) src[slot_rows[t,j]] in fp32 (fp64 for
  fp64), no atomics (unpermute forward; permute backward).

Index math: program ids, rows and loaded indices are cast to int64 before they are multiplied by
a stride (:func:`row_offset`), because row * D passes 2^31 for large buffers.

Ids are compared against expert numbers, never used as addresses before they are checked to lie
in [0, E): an id outside [-1, E) (possible only with validation switched off) is treated like -1
and never causes an out-of-bounds access. Likewise a slot row outside the buffer is skipped and
offsets/counts are clamped to it, so metadata that fails validation never moves a row out of bounds.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_offset(row, stride):
    """Element offset ``row * stride`` in int64 (row may be an int32 program id or index)."""
    return tl.cast(row, tl.int64) * stride


@triton.jit
def _load_ids(ids_ptr, s, S, E):
    """Ids of slots ``s`` as int32, with -1 for slots past S and for ids outside [0, E)."""
    m = s < S
    ids = tl.load(ids_ptr + s, mask=m, other=0).to(tl.int64)  # widen first: 2**40 must not wrap
    ok = m & (ids >= 0) & (ids < E)
    return tl.where(ok, ids, -1).to(tl.int32)


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


@triton.jit
def _metadata_fused_kernel(
    ids_ptr,  # [S] integer ids, token-major
    counts_ptr,  # out int32 [E]
    offsets_ptr,  # out int64 [E+1]
    rows_ptr,  # out int64 [S]
    S,
    E,
    pad_to,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """All routing metadata in one program.

    Grid: (1,). The program walks experts in chunks of BLOCK_E; for each chunk it counts the
    chunk's slots over all S (pass 1), turns the counts into padded offsets continuing the running
    total of the earlier chunks, then walks the slots again in order (pass 2), giving each slot of
    an expert in the chunk the row ``offsets[e] + (slots of e before it)``. Slots whose id is not
    in [0, E) get row -1.

    Example: ids (flattened) = [1, 0, 1, 2, -1, 1], E = 3, pad_to = 2 gives counts [1, 3, 1],
    offsets [0, 2, 6, 8] and rows [2, 0, 3, 6, -1, 4].
    """
    s_base = tl.arange(0, BLOCK_S)
    e_base = tl.arange(0, BLOCK_E)
    total = tl.zeros([1], dtype=tl.int64)  # padded rows of the experts already done
    for e0 in range(0, E, BLOCK_E):
        e = e0 + e_base
        # pass 1: counts of this chunk's experts
        cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
        for s0 in range(0, S, BLOCK_S):
            ids = _load_ids(ids_ptr, s0 + s_base, S, E)
            hit = (ids[:, None] == e[None, :]).to(tl.int32)  # [BLOCK_S, BLOCK_E]
            cnt += tl.sum(hit, axis=0)
        padded = (cnt.to(tl.int64) + pad_to - 1) // pad_to * pad_to
        start = total + tl.cumsum(padded, axis=0) - padded  # [BLOCK_E] padded segment starts
        tl.store(counts_ptr + e, cnt, mask=e < E)
        tl.store(offsets_ptr + e, start, mask=e < E)
        total += tl.sum(padded, axis=0)
        # pass 2: rows, in slot order
        run = tl.zeros([BLOCK_E], dtype=tl.int32)  # slots of each expert seen so far
        for s0 in range(0, S, BLOCK_S):
            s = s0 + s_base
            ids = _load_ids(ids_ptr, s, S, E)
            hit = ids[:, None] == e[None, :]  # [BLOCK_S, BLOCK_E]
            hit32 = hit.to(tl.int32)
            before = tl.cumsum(hit32, axis=0) - hit32 + run[None, :]  # exclusive rank inside the expert
            # each slot hits at most one expert: the sum selects start[e] + rank under its expert
            row = tl.sum(tl.where(hit, start[None, :] + before, 0), axis=1)  # [BLOCK_S] int64
            mine = (ids >= e0) & (ids < e0 + BLOCK_E)
            tl.store(rows_ptr + s, row, mask=mine)
            run += tl.sum(hit32, axis=0)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + s_base
        ids = _load_ids(ids_ptr, s, S, E)
        tl.store(rows_ptr + s, tl.full([BLOCK_S], -1, tl.int64), mask=(s < S) & (ids < 0))
    tl.store(offsets_ptr + E + tl.arange(0, 1), total)


@triton.jit
def _block_hist_kernel(
    ids_ptr,  # [S] integer ids
    hist_ptr,  # out int32 [NB, E]
    S,
    E,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Per-block per-expert slot counts.

    Grid: (NB = cdiv(S, BLOCK_S), cdiv(E, BLOCK_E)). Program (b, c) counts, for each expert of
    chunk c, the slots of block b (slots [b*BLOCK_S, (b+1)*BLOCK_S)) routed to it.
    """
    b = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ids = _load_ids(ids_ptr, b * BLOCK_S + tl.arange(0, BLOCK_S), S, E)
    hit = (ids[:, None] == e[None, :]).to(tl.int32)  # [BLOCK_S, BLOCK_E]
    tl.store(hist_ptr + b * E + e, tl.sum(hit, axis=0), mask=e < E)


@triton.jit
def _block_scan_kernel(
    hist_ptr,  # in int32 [NB, E] block counts; out: exclusive prefix over blocks, per expert
    counts_ptr,  # out int32 [E]
    NB,
    E,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Fixed-order scan of the block histograms over the blocks.

    Grid: (cdiv(E, BLOCK_E),). Program c walks the blocks in order, BLOCK_B at a time, replacing
    hist[b, e] (e in chunk c) by the number of slots of e in blocks before b; the totals are the
    counts. Example: hist = [[2, 1], [0, 3]] -> hist [[0, 0], [2, 1]], counts [2, 4].
    """
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    b_base = tl.arange(0, BLOCK_B)
    run = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        b = (b0 + b_base).to(tl.int64)
        ptrs = hist_ptr + b[:, None] * E + e[None, :]
        m = (b[:, None] < NB) & (e[None, :] < E)
        h = tl.load(ptrs, mask=m, other=0)  # [BLOCK_B, BLOCK_E]
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + run[None, :], mask=m)
        run += tl.sum(h, axis=0)
    tl.store(counts_ptr + e, run, mask=e < E)


@triton.jit
def _block_rank_kernel(
    ids_ptr,  # [S] integer ids
    prefix_ptr,  # int32 [NB, E]: slots of e in earlier blocks (from _block_scan_kernel)
    counts_ptr,  # int32 [E] (from _block_scan_kernel)
    offsets_ptr,  # out int64 [E+1]
    rows_ptr,  # out int64 [S]
    S,
    E,
    pad_to,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SCAN_E: tl.constexpr,
):
    """Padded offsets, and the row of every slot: offsets[e] + prefix[b, e] + its rank among e's
    slots inside block b.

    Grid: (NB, cdiv(E, BLOCK_E)). Program (b, c) first derives the padded segment starts of chunk
    c's experts from the counts (padded counts of all earlier experts, summed SCAN_E at a time in
    a fixed order, then an exclusive scan inside the chunk; programs (0, c) store them, and (0,
    last) stores offsets[E] = R). It then ranks the slots of block b whose expert lies in chunk c
    (an exclusive cumsum of the one-hot [BLOCK_S, BLOCK_E] tile) and writes their rows; programs
    (b, 0) also write -1 for the block's unrouted slots. Each slot is written by one program.
    """
    pid_b = tl.program_id(0)
    pid_c = tl.program_id(1)
    e0 = pid_c * BLOCK_E
    e = e0 + tl.arange(0, BLOCK_E)
    # padded segment starts of this chunk's experts
    done = tl.zeros([1], dtype=tl.int64)  # padded rows of experts [0, e0)
    for e1 in range(0, e0, SCAN_E):
        ee = e1 + tl.arange(0, SCAN_E)
        c = tl.load(counts_ptr + ee, mask=ee < e0, other=0).to(tl.int64)
        done += tl.sum((c + pad_to - 1) // pad_to * pad_to, axis=0)
    cnt = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int64)
    padded = (cnt + pad_to - 1) // pad_to * pad_to
    start = done + tl.cumsum(padded, axis=0) - padded  # [BLOCK_E]
    tl.store(offsets_ptr + e, start, mask=e < tl.where(pid_b == 0, E, 0))
    last = (pid_b == 0) & (pid_c == tl.num_programs(1) - 1)
    one = tl.arange(0, 1)
    tl.store(offsets_ptr + E + one, done + tl.sum(padded, axis=0), mask=one < tl.where(last, 1, 0))
    # rows of this block's slots of this chunk
    s = pid_b.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    ids = _load_ids(ids_ptr, s, S, E)
    hit = ids[:, None] == e[None, :]  # [BLOCK_S, BLOCK_E]
    hit32 = hit.to(tl.int32)
    before = tl.cumsum(hit32, axis=0) - hit32  # exclusive rank inside the block
    prefix = tl.load(prefix_ptr + pid_b.to(tl.int64) * E + e, mask=e < E, other=0)
    base = start + prefix.to(tl.int64)  # [BLOCK_E]
    row = tl.sum(tl.where(hit, base[None, :] + before, 0), axis=1)  # [BLOCK_S] int64, one hit per slot
    mine = (ids >= e0) & (ids < e0 + BLOCK_E)
    tl.store(rows_ptr + s, row, mask=mine)
    unrouted = (s < tl.where(pid_c == 0, S, 0)) & (ids < 0)  # only programs (b, 0)
    tl.store(rows_ptr + s, tl.full([BLOCK_S], -1, tl.int64), mask=unrouted)


# --------------------------------------------------------------------------------------------
# Data movement
# --------------------------------------------------------------------------------------------


@triton.jit
def _zero_rows(out_ptr, stride_o, r_lo, r_hi, pid_d, D, NSPLIT, BLOCK_D: tl.constexpr):
    """Write zeros to columns (this program's d chunks) of rows [r_lo, r_hi) of out."""
    zero = tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty)
    for d0 in range(pid_d * BLOCK_D, D, NSPLIT * BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        for r in range(r_lo, r_hi):
            tl.store(out_ptr + row_offset(r, stride_o) + cols, zero, mask=cols < D)


@triton.jit
def _scatter_rows_kernel(
    src_ptr,  # [T, D] rows to scatter (x, or d(out) in unpermute's backward)
    stride_st,
    stride_sd,
    rows_ptr,  # int64 [T, K] slot rows (-1: not routed), contiguous
    w_ptr,  # [T, K] weights, contiguous (HAS_W)
    offsets_ptr,  # int64 [E+1]
    counts_ptr,  # int32 [E]
    out_ptr,  # out [num_rows, D], contiguous rows (WRITE_OUT)
    stride_o,
    dot_ptr,  # [num_rows, D] rows dotted with src (HAS_DOT: y_perm in unpermute's backward; out, when
    # also written, has the same rows)
    stride_yr,
    stride_yd,
    dw_ptr,  # out [NSPLIT, T, K] partial row dot products (HAS_DOT), acc dtype
    T,
    K,
    E,
    D,
    num_rows,
    NSPLIT,
    TAIL_ROWS,
    HAS_W: tl.constexpr,
    HAS_DOT: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Write every row of ``out`` once: slot rows get (w *) src[t], all other rows zeros.

    Grid: (T + E + NTAIL, NSPLIT). Axis 1 splits D: program column p handles the d chunks
    p*BLOCK_D, (p + NSPLIT)*BLOCK_D, ... Along axis 0:

    * program t < T (a token) loads its row src[t] once per d chunk and stores it to its K slot
      rows (slot rows outside [0, num_rows) are skipped) (scaled by w[t, j] in the acc dtype when HAS_W; copied bit-exactly otherwise). With
      HAS_DOT it also accumulates dw[t, j] = sum_d src[t, d] * dot[row, d] for its chunks and
      writes them to dw[p, t, :] (summed over p on the host side, in a fixed order).
    * program T + e zeros expert e's padding rows [offsets[e] + counts[e], offsets[e+1]).
    * program T + E + i zeros rows [i*TAIL_ROWS, (i+1)*TAIL_ROWS) that lie at or past
      offsets[E] (rows no slot owns when out has more rows than R; NTAIL = 0 when it has R).
    """
    pid = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    out_dtype = out_ptr.dtype.element_ty
    if pid < T:
        t = pid
        kk = tl.arange(0, BLOCK_K)
        dw = tl.zeros([BLOCK_K], dtype=ACC)
        for d0 in range(pid_d * BLOCK_D, D, NSPLIT * BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            cm = cols < D
            v = tl.load(src_ptr + row_offset(t, stride_st) + cols.to(tl.int64) * stride_sd, mask=cm, other=0)
            if HAS_W or HAS_DOT:
                va = v.to(ACC)
            for j in range(0, K):
                row = tl.load(rows_ptr + t * K + j)
                # a row outside [0, num_rows) (-1, or any row with validation off) is not routed
                routed = (row >= 0) & (row < num_rows)
                row_safe = tl.where(routed, row, 0)
                # columns to touch: none for an unrouted slot (a vector compare, not vector & scalar)
                m = cols < tl.where(routed, D, 0)
                if WRITE_OUT:
                    if HAS_W:
                        wj = tl.load(w_ptr + t * K + j).to(ACC)
                        val = (va * wj).to(out_dtype)
                    else:
                        val = v.to(out_dtype)
                    tl.store(out_ptr + row_offset(row_safe, stride_o) + cols, val, mask=m)
                if HAS_DOT:
                    y = tl.load(
                        dot_ptr + row_offset(row_safe, stride_yr) + cols.to(tl.int64) * stride_yd,
                        mask=m,
                        other=0,
                    ).to(ACC)
                    dw += tl.where(kk == j, tl.sum(va * y, axis=0), 0)
        if HAS_DOT:
            tl.store(dw_ptr + (pid_d * T + t) * K + kk, dw, mask=kk < K)
    elif pid < T + E:
        if WRITE_OUT:
            e = pid - T
            lo = tl.load(offsets_ptr + e) + tl.load(counts_ptr + e).to(tl.int64)
            hi = tl.load(offsets_ptr + e + 1)
            # clamped to the buffer: even metadata that fails validation (checks off) stays inside
            lo = tl.minimum(tl.maximum(lo, 0), num_rows)
            hi = tl.minimum(hi, num_rows)
            _zero_rows(out_ptr, stride_o, lo, hi, pid_d, D, NSPLIT, BLOCK_D)
    else:
        if WRITE_OUT:
            i = pid - T - E
            R = tl.load(offsets_ptr + E)
            lo = tl.maximum(i * TAIL_ROWS, R)
            hi = tl.minimum((i + 1) * TAIL_ROWS, num_rows)
            _zero_rows(out_ptr, stride_o, lo, hi, pid_d, D, NSPLIT, BLOCK_D)


@triton.jit
def _gather_rows_kernel(
    src_ptr,  # [num_src_rows, D] permuted rows (y_perm, or d(x_perm) in permute's backward)
    stride_sr,
    stride_sd,
    rows_ptr,  # int64 [T, K] slot rows (-1: not routed), contiguous
    w_ptr,  # [T, K] weights, contiguous (HAS_W)
    out_ptr,  # out [T, D], contiguous
    T,
    K,
    D,
    num_src_rows,
    NSPLIT,
    HAS_W: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t] = sum over routed j of (w[t, j] *) src[slot_rows[t, j]], accumulated in ACC.

    Grid: (T, NSPLIT). Program (t, p) loads token t's K rows and weights once, then for each of
    its d chunks (p*BLOCK_D, (p + NSPLIT)*BLOCK_D, ...) gathers the [BLOCK_K, BLOCK_D] tile of
    those rows, weights it, sums over the slots in a fixed order and stores the chunk in out's
    dtype. Unrouted slots (row -1) contribute nothing. No atomics: one program owns each output
    element.
    """
    t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    rows = tl.load(rows_ptr + t * K + kk, mask=kk < K, other=-1)
    routed = (rows >= 0) & (rows < num_src_rows)
    rows_safe = tl.where(routed, rows, 0)
    if HAS_W:
        w = tl.load(w_ptr + t * K + kk, mask=routed, other=0).to(ACC)
    for d0 in range(pid_d * BLOCK_D, D, NSPLIT * BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cm = cols < D
        ptrs = src_ptr + row_offset(rows_safe, stride_sr)[:, None] + (cols.to(tl.int64) * stride_sd)[None, :]
        tile = tl.load(ptrs, mask=routed[:, None] & cm[None, :], other=0).to(ACC)  # [BLOCK_K, BLOCK_D]
        if HAS_W:
            tile = tile * w[:, None]
        acc = tl.sum(tile, axis=0)  # [BLOCK_D]
        tl.store(out_ptr + row_offset(t, D) + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)
