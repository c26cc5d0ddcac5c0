"""Triton kernels of the fused router (private; the launcher is :mod:`tritonmoe.kernels.routing`).

Tile layout. One program owns ``BLOCK_T`` tokens and holds their logits as a 3-D register tile
``[BLOCK_T, BLOCK_G, BLOCK_S]``: expert ``e = g * S + i`` sits at group ``g`` (of ``G``), lane
``i`` (of ``S = E // G``). Without group-limited routing ``G = 1`` and ``S = E``. Padding lanes
(``g >= G`` or ``i >= S``, since blocks are powers of two) load ``-inf`` and are masked out of
every selection and every store, so any E works, not only powers of two.

Selection order as one integer. Each lane gets an int64 key that sorts exactly like the contract
(allowed experts first, then descending selection score, then ascending expert id)::

    key = allowed << 48 | ordered_bits(sel) << 16 | (65535 - e)      (sel = score + bias; NaN -> -inf)

``ordered_bits`` maps the fp32 bit pattern to an int32 with the same order as the float (so
``-inf`` is an ordinary, smallest value), shifted into [0, 2^32). Then top-k is ``k`` rounds of
"max of the keys, decode the expert, retire its lane" -- no floating-point comparisons, no ties.
E is limited to 65536 by the id field (the launcher limits the tile far below that).

Example (E=4, k=2, softmax, no bias): logits [1, 3, 3, 0] -> scores [.06, .47, .47, .02]; keys
order lanes 1 > 2 > 0 > 3 (lanes 1 and 2 tie on score; the lower id wins), so ids = [1, 2].

Determinism: per-expert counts use integer atomics (order-independent); float partial sums are
written per block and reduced in a fixed order by the launcher; nothing uses float atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Floor of the renormalization denominator; equals ``tritonmoe.reference.RENORM_EPS``.
RENORM_EPS: tl.constexpr = tl.constexpr(1e-20)
#: Key of a padding lane or of a lane already taken by an earlier slot: below every real key.
_RETIRED: tl.constexpr = tl.constexpr(-(1 << 62))


@triton.jit
def _max_ts(x):
    """Max over the group and lane axes of a [BT, BG, BS] tile -> [BT]."""
    return tl.max(tl.max(x, axis=2), axis=1)


@triton.jit
def _sum_ts(x):
    """Sum over the group and lane axes of a [BT, BG, BS] tile -> [BT]."""
    return tl.sum(tl.sum(x, axis=2), axis=1)


@triton.jit
def _load_tile(logits_ptr, rows, row_ok, stride_lt, stride_le, G: tl.constexpr, S: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """fp32 logits of ``rows`` as a [BT, BG, BS] tile (-inf in padding), the expert id of each
    lane [1, BG, BS] and the lane mask [1, BG, BS]."""
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, BLOCK_S)
    e_1GS = g[None, :, None] * S + i[None, None, :]
    lane_ok_1GS = (g[None, :, None] < G) & (i[None, None, :] < S)
    ptrs = logits_ptr + rows[:, None, None] * stride_lt + e_1GS.to(tl.int64) * stride_le
    x_TGS = tl.load(ptrs, mask=row_ok[:, None, None] & lane_ok_1GS, other=float("-inf")).to(tl.float32)
    return x_TGS, e_1GS, lane_ok_1GS


@triton.jit
def _row_softmax_stats(x_TGS):
    """Row max and sum of exp(x - max) of a [BT, BG, BS] tile -> ([BT], [BT], exp tile)."""
    m_T = _max_ts(x_TGS)
    ex_TGS = tl.exp(x_TGS - m_T[:, None, None])
    den_T = _sum_ts(ex_TGS)
    return m_T, den_T, ex_TGS


@triton.jit
def _score_at(lg, m, den, SOFTMAX: tl.constexpr):
    """Score of logits ``lg`` (any shape) given the row's softmax stats broadcast to it. The same
    expressions as the tile's, so a gathered score equals the tile's score bit for bit."""
    if SOFTMAX:
        s = tl.exp(lg - m) / den
    else:
        s = 1.0 / (1.0 + tl.exp(-lg))
    return s


@triton.jit
def _route_fwd_kernel(
    logits_ptr,  # [T, E] fp32/fp16/bf16, strides (stride_lt, stride_le)
    bias_ptr,  # fp32 [E] (read iff HAS_BIAS)
    ids_ptr,  # int32 [T, K] out: selected ids (before capacity dropping)
    w_ptr,  # fp32 [T, K] out: weights (before capacity dropping)
    counts_ptr,  # int32 [E] in/out, zeroed: selected slots per expert (iff not HAS_CAPACITY)
    slot_hist_ptr,  # int32 [NB, K, E] out: per-block, per-slot histograms (iff HAS_CAPACITY)
    slot_tot_ptr,  # int32 [K, E] in/out, zeroed: per-slot histograms over all blocks (iff HAS_CAPACITY)
    score_part_ptr,  # fp32 [NB, E] out: per-block sums of the scores (iff WITH_AUX)
    lse_ptr,  # fp32 [T] out: per-token logsumexp of the logits (iff WITH_AUX)
    T,
    stride_lt,
    stride_le,
    G: tl.constexpr,  # groups (1 = no group-limited routing)
    S: tl.constexpr,  # experts per group; E = G * S
    TOPK_GROUPS: tl.constexpr,
    K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_CAPACITY: tl.constexpr,
    WITH_AUX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Scores, selection, top-k, weights and per-expert histograms of a block of tokens.

    Grid: ``(cdiv(T, BLOCK_T),)``. Program ``b`` reads rows [b*BLOCK_T, (b+1)*BLOCK_T) of the
    logits once, and writes their ids and weights, adds its per-expert selection histogram to
    ``counts`` (or, with capacity, writes one histogram per slot j for the launcher's scan), and
    with WITH_AUX writes its per-expert score sums and the rows' logsumexp.
    """
    E: tl.constexpr = G * S
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < T
    x_TGS, e_1GS, lane_ok_1GS = _load_tile(logits_ptr, t, row_ok, stride_lt, stride_le, G, S, BLOCK_G, BLOCK_S)

    # -- scores (fp32) --------------------------------------------------------------------------
    if SOFTMAX or WITH_AUX:
        m_T, den_T, ex_TGS = _row_softmax_stats(x_TGS)
    else:  # sigmoid without aux: no softmax statistics needed (_score_at ignores them)
        m_T = tl.zeros([BLOCK_T], dtype=tl.float32)
        den_T = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
    if SOFTMAX:
        s_TGS = ex_TGS / den_T[:, None, None]
    else:
        s_TGS = 1.0 / (1.0 + tl.exp(-x_TGS))

    if WITH_AUX:
        # logsumexp as torch.logsumexp: an infinite max is returned as is (all -inf -> -inf).
        lse_T = tl.where((m_T == float("inf")) | (m_T == float("-inf")), m_T, m_T + tl.log(den_T))
        tl.store(lse_ptr + t, lse_T, mask=row_ok)
        part_GS = tl.sum(tl.where(row_ok[:, None, None], s_TGS, 0.0), axis=0)
        g2 = tl.arange(0, BLOCK_G)[:, None]
        i2 = tl.arange(0, BLOCK_S)[None, :]
        tl.store(score_part_ptr + pid * E + g2 * S + i2, part_GS, mask=(g2 < G) & (i2 < S))

    # -- selection score: bias for selection only, NaN ranks as -inf -----------------------------
    sel_TGS = s_TGS
    if HAS_BIAS:
        b_1GS = tl.load(bias_ptr + e_1GS, mask=lane_ok_1GS, other=0.0)
        sel_TGS = sel_TGS + b_1GS
    sel_TGS = tl.where(sel_TGS != sel_TGS, float("-inf"), sel_TGS)
    sel_TGS = tl.where(lane_ok_1GS, sel_TGS, float("-inf"))

    # -- group-limited routing: keep the TOPK_GROUPS groups with the largest top-2 sums ----------
    if G > 1:
        v1_TG = tl.max(sel_TGS, axis=2)
        if S == 1:
            gs_TG = v1_TG
        else:
            is_top_TGS = sel_TGS == v1_TG[:, :, None]
            n_top_TG = tl.sum((is_top_TGS & lane_ok_1GS).to(tl.int32), axis=2)
            rest_TG = tl.max(tl.where(is_top_TGS, float("-inf"), sel_TGS), axis=2)
            gs_TG = v1_TG + tl.where(n_top_TG >= 2, v1_TG, rest_TG)
        g = tl.arange(0, BLOCK_G)
        # rank of group g = groups that beat it (higher score, or equal score and lower index)
        beats_TGG = (gs_TG[:, None, :] > gs_TG[:, :, None]) | (
            (gs_TG[:, None, :] == gs_TG[:, :, None]) & (g[None, None, :] < g[None, :, None])
        )
        beats_TGG = beats_TGG & (g[None, None, :] < G)
        rank_TG = tl.sum(beats_TGG.to(tl.int32), axis=2)
        allowed_TG = (rank_TG < TOPK_GROUPS) & (g[None, :] < G)
        allowed_TGS = allowed_TG[:, :, None].to(tl.int64)
    else:
        allowed_TGS = tl.full([1, 1, 1], 1, tl.int64)

    # -- order keys (see the module docstring) ---------------------------------------------------
    bits_TGS = sel_TGS.to(tl.int32, bitcast=True)
    ordered_TGS = tl.where(bits_TGS < 0, bits_TGS ^ 0x7FFFFFFF, bits_TGS).to(tl.int64) + 2147483647 + 1
    key_TGS = (allowed_TGS << 48) | (ordered_TGS << 16) | (65535 - e_1GS).to(tl.int64)
    key_TGS = tl.where(lane_ok_1GS, key_TGS, _RETIRED)

    # -- top-k: K rounds of argmax over the keys --------------------------------------------------
    kcol = tl.arange(0, BLOCK_K)
    ids_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in range(K):
        best_T = _max_ts(key_TGS)
        e_T = (65535 - (best_T & 65535)).to(tl.int32)
        ids_TK = tl.where(kcol[None, :] == j, e_T[:, None], ids_TK)
        hit_TGS = e_1GS == e_T[:, None, None]
        key_TGS = tl.where(hit_TGS, _RETIRED, key_TGS)
        if HAS_CAPACITY:
            hist_GS = tl.sum((hit_TGS & row_ok[:, None, None]).to(tl.int32), axis=0)
            g2 = tl.arange(0, BLOCK_G)[:, None]
            i2 = tl.arange(0, BLOCK_S)[None, :]
            e2 = g2 * S + i2
            ok2 = (g2 < G) & (i2 < S)
            tl.store(slot_hist_ptr + (pid * K + j) * E + e2, hist_GS, mask=ok2)
            tl.atomic_add(slot_tot_ptr + j * E + e2, hist_GS, mask=ok2 & (hist_GS > 0), sem="relaxed")

    if not HAS_CAPACITY:
        taken_TGS = (key_TGS == _RETIRED) & lane_ok_1GS & row_ok[:, None, None]
        hist_GS = tl.sum(taken_TGS.to(tl.int32), axis=0)
        g2 = tl.arange(0, BLOCK_G)[:, None]
        i2 = tl.arange(0, BLOCK_S)[None, :]
        ok2 = (g2 < G) & (i2 < S)
        tl.atomic_add(counts_ptr + g2 * S + i2, hist_GS, mask=ok2 & (hist_GS > 0), sem="relaxed")

    # -- weights: unbiased scores at the ids, gathered from the (cached) logits rows ---------------
    k_ok_TK = row_ok[:, None] & (kcol[None, :] < K)
    lg_TK = tl.load(
        logits_ptr + t[:, None] * stride_lt + ids_TK.to(tl.int64) * stride_le, mask=k_ok_TK, other=0.0
    ).to(tl.float32)
    p_TK = _score_at(lg_TK, m_T[:, None], den_T[:, None], SOFTMAX)
    if RENORMALIZE:
        sum_T = tl.sum(tl.where(kcol[None, :] < K, p_TK, 0.0), axis=1)
        # where(sum < eps) rather than maximum(): a NaN sum must stay NaN, as clamp_min keeps it
        den_p_T = tl.where(sum_T < RENORM_EPS, RENORM_EPS, sum_T)
        p_TK = p_TK / den_p_T[:, None]
    out_TK = t[:, None] * K + kcol[None, :]
    tl.store(ids_ptr + out_TK, ids_TK, mask=k_ok_TK)
    tl.store(w_ptr + out_TK, p_TK, mask=k_ok_TK)


@triton.jit
def _capacity_scan_kernel(
    slot_hist_ptr,  # int32 [NB, K, E] in: per-block per-slot histograms; out: exclusive offsets
    slot_tot_ptr,  # int32 [K, E] per-slot totals over all blocks
    counts_ptr,  # int32 [E] out: kept slots per expert
    selected_ptr,  # int32 [E] out: selected slots per expert
    NB,
    capacity,
    E,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Exclusive prefix sums of the per-block histograms in priority order (slot j, then block).

    Grid: ``(K, cdiv(E, BLOCK_E))``. Program (j, c) owns slot j of experts [c*BLOCK_E, ...): it
    starts from the slots of those experts taken by slots j' < j (from ``slot_tot``), then scans
    the blocks in order, BLOCK_B at a time, overwriting each histogram entry with the number of
    earlier slots (in priority order) on that expert. Programs with j = 0 also write the counts:
    selected = sum over j of slot_tot, kept = min(selected, capacity).

    Example (2 blocks, K=2, one expert): histograms [[2, 1], [3, 0]] (block, slot) become
    offsets [[0, 5], [2, 6]]: slot 0 of block 0 starts at 0, of block 1 at 2; slot 1 starts after
    all 5 slot-0 picks.
    """
    j = tl.program_id(0)
    c = tl.program_id(1)
    e = c * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    base_E = tl.zeros([BLOCK_E], dtype=tl.int32)
    total_E = tl.zeros([BLOCK_E], dtype=tl.int32)
    for jj in range(K):
        tot = tl.load(slot_tot_ptr + jj * E + e, mask=e_ok, other=0)
        total_E += tot
        base_E += tl.where(jj < j, tot, 0)
    if j == 0:
        tl.store(selected_ptr + e, total_E, mask=e_ok)
        tl.store(counts_ptr + e, tl.minimum(total_E, capacity), mask=e_ok)

    running_E = base_E
    bb = tl.arange(0, BLOCK_B)
    for b0 in range(0, NB, BLOCK_B):
        b = (b0 + bb).to(tl.int64)
        ok = (b[:, None] < NB) & e_ok[None, :]
        ptrs = slot_hist_ptr + (b[:, None] * K + j) * E + e[None, :]
        h_BE = tl.load(ptrs, mask=ok, other=0)
        incl_BE = tl.cumsum(h_BE, axis=0)
        tl.store(ptrs, incl_BE - h_BE + running_E[None, :], mask=ok)
        running_E += tl.sum(h_BE, axis=0)


@triton.jit
def _capacity_keep_kernel(
    sel_ids_ptr,  # int32 [T, K] selected ids (before dropping)
    offsets_ptr,  # int32 [NB, K, E] exclusive offsets from the scan
    ids_ptr,  # int32 [T, K] out: ids with dropped slots set to -1
    w_ptr,  # fp32 [T, K] in/out: weights, dropped slots set to 0
    T,
    capacity,
    E,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Drop the slots past an expert's capacity.

    Grid: ``(cdiv(T, BLOCK_T),)`` with the forward kernel's BLOCK_T (the offsets are per block).
    For each slot j, a token's position on its expert is the block's offset for (j, expert) plus
    the number of earlier tokens of the block with the same expert at slot j; the slot is kept
    when that position is below ``capacity``.
    """
    pid = tl.program_id(0).to(tl.int64)
    tt = tl.arange(0, BLOCK_T)
    t = pid * BLOCK_T + tt
    row_ok = t < T
    earlier_TT = (tt[None, :] < tt[:, None]) & row_ok[None, :]
    for j in range(K):
        e_T = tl.load(sel_ids_ptr + t * K + j, mask=row_ok, other=-1)
        off_T = tl.load(offsets_ptr + (pid * K + j) * E + e_T, mask=row_ok, other=0)
        same_TT = (e_T[None, :] == e_T[:, None]) & earlier_TT
        pos_T = off_T + tl.sum(same_TT.to(tl.int32), axis=1)
        keep_T = pos_T < capacity
        tl.store(ids_ptr + t * K + j, tl.where(keep_T, e_T, -1), mask=row_ok)
        w_T = tl.load(w_ptr + t * K + j, mask=row_ok, other=0.0)
        tl.store(w_ptr + t * K + j, tl.where(keep_T, w_T, 0.0), mask=row_ok)


@triton.jit
def _route_bwd_kernel(
    logits_ptr,  # [T, E], strides (stride_lt, stride_le)
    sel_ids_ptr,  # int32 [T, K] selected ids (before dropping)
    ids_ptr,  # int32 [T, K] final ids (-1 = dropped; read iff HAS_CAPACITY)
    dw_ptr,  # fp32 [T, K] grad of topk_weights, strides (stride_dwt, stride_dwk) (iff HAS_DW)
    dss_ptr,  # fp32 [E] grad of score_sum, stride stride_dss (iff HAS_DSS)
    dlse_ptr,  # fp32 [T] grad of logsumexp, stride stride_dlse (iff HAS_DLSE)
    dlogits_ptr,  # [T, E] contiguous out, logits' dtype
    T,
    stride_lt,
    stride_le,
    stride_dwt,
    stride_dwk,
    stride_dss,
    stride_dlse,
    G: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_CAPACITY: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DSS: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """d(logits) from d(topk_weights), d(score_sum) and d(logsumexp) in one pass.

    Grid: ``(cdiv(T, BLOCK_T),)``. Program ``b`` re-reads its rows of logits, recomputes the
    scores, and chains, per token (p = scores at the selected ids, D = max(sum p, eps)):

        dp_j  = (g_j - [sum p >= eps] * sum_i g_i p_i / D) / D   (renormalize; else dp_j = g_j),
                g_j = d(topk_weights)[t, j], zero for a dropped slot
        ds_e  = dp_j at e = id_j  +  d(score_sum)[e]
        dl_e  = s_e * (ds_e - sum_e' ds_e' s_e')   (softmax)  or  ds_e * s_e * (1 - s_e)  (sigmoid)
              + d(logsumexp)[t] * softmax(logits_t)_e
    """
    E: tl.constexpr = G * S
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < T
    x_TGS, e_1GS, lane_ok_1GS = _load_tile(logits_ptr, t, row_ok, stride_lt, stride_le, G, S, BLOCK_G, BLOCK_S)
    if SOFTMAX or HAS_DLSE:
        m_T, den_T, ex_TGS = _row_softmax_stats(x_TGS)
    else:  # sigmoid without d(logsumexp): no softmax statistics needed (_score_at ignores them)
        m_T = tl.zeros([BLOCK_T], dtype=tl.float32)
        den_T = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
    if SOFTMAX:
        s_TGS = ex_TGS / den_T[:, None, None]
    else:
        s_TGS = 1.0 / (1.0 + tl.exp(-x_TGS))

    ds_TGS = tl.zeros([BLOCK_T, BLOCK_G, BLOCK_S], dtype=tl.float32)
    if HAS_DW:
        kcol = tl.arange(0, BLOCK_K)
        k_ok_TK = row_ok[:, None] & (kcol[None, :] < K)
        ids_TK = tl.load(sel_ids_ptr + t[:, None] * K + kcol[None, :], mask=k_ok_TK, other=0)
        g_TK = tl.load(dw_ptr + t[:, None] * stride_dwt + kcol[None, :] * stride_dwk, mask=k_ok_TK, other=0.0)
        if HAS_CAPACITY:
            final_TK = tl.load(ids_ptr + t[:, None] * K + kcol[None, :], mask=k_ok_TK, other=-1)
            g_TK = tl.where(final_TK >= 0, g_TK, 0.0)
        if RENORMALIZE:
            lg_TK = tl.load(
                logits_ptr + t[:, None] * stride_lt + ids_TK.to(tl.int64) * stride_le, mask=k_ok_TK, other=0.0
            ).to(tl.float32)
            p_TK = tl.where(kcol[None, :] < K, _score_at(lg_TK, m_T[:, None], den_T[:, None], SOFTMAX), 0.0)
            sum_T = tl.sum(p_TK, axis=1)
            den_p_T = tl.where(sum_T < RENORM_EPS, RENORM_EPS, sum_T)
            dot_T = tl.sum(g_TK * (p_TK / den_p_T[:, None]), axis=1)
            dot_T = tl.where(sum_T >= RENORM_EPS, dot_T, 0.0)  # clamp_min passes no gradient below eps
            dp_TK = (g_TK - dot_T[:, None]) / den_p_T[:, None]
        else:
            dp_TK = g_TK
        # scatter dp to the selected lanes (ids of a token are distinct)
        for j in range(K):
            e_T = tl.sum(tl.where(kcol[None, :] == j, ids_TK, 0), axis=1)
            dp_T = tl.sum(tl.where(kcol[None, :] == j, dp_TK, 0.0), axis=1)
            ds_TGS += tl.where(e_1GS == e_T[:, None, None], dp_T[:, None, None], 0.0)
    if HAS_DSS:
        ds_TGS += tl.load(dss_ptr + e_1GS * stride_dss, mask=lane_ok_1GS, other=0.0)

    if SOFTMAX:
        dot_T = _sum_ts(tl.where(lane_ok_1GS, ds_TGS * s_TGS, 0.0))
        dl_TGS = s_TGS * (ds_TGS - dot_T[:, None, None])
    else:
        dl_TGS = ds_TGS * (s_TGS * (1.0 - s_TGS))
    if HAS_DLSE:
        dlse_T = tl.load(dlse_ptr + t * stride_dlse, mask=row_ok, other=0.0)
        dl_TGS += dlse_T[:, None, None] * (ex_TGS / den_T[:, None, None])

    out = dlogits_ptr + t[:, None, None] * E + e_1GS
    tl.store(out, dl_TGS.to(dlogits_ptr.dtype.element_ty), mask=row_ok[:, None, None] & lane_ok_1GS)
