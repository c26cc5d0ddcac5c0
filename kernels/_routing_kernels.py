"""Triton kernels of the fused router (private; the launcher is :mod:`tritonmoe.kernels.routing`).

Tile layout. One program owns ``BLOCK_T`` tokens and holds their logits as a register tile
``[BLOCK_T, BLOCK_E]`` with ``BLOCK_E = BLOCK_G * BLOCK_S`` lanes: lane ``l`` is expert
``e = (l // BLOCK_S) * S + l % BLOCK_S``, i.e. group ``g = l // BLOCK_S`` (of ``G``), member
``i = l % BLOCK_S`` (of ``S = E // G``). Without group-limited routing ``G = 1`` and the lane is
the expert. Padding lanes (``g >= G`` or ``i >= S``; blocks are powers of two) load ``-inf`` and
are masked out of every selection and every store, so any E works, not only powers of two. Group
scores reshape the tile to ``[BLOCK_T, BLOCK_G, BLOCK_S]``.

Selection value. What the keys (and group scores) compare is the canonical fp32 value of
:func:`tritonmoe.reference.selection_values`, computed here with the same correctly rounded
operations in the same order, so the ids equal the reference's bit for bit on every backend:
the logit when no bias is added (softmax and sigmoid are monotone in it); with a bias, the
canonical score (:func:`_canonical_exp`, a fixed pairwise tree for the softmax denominator
(:func:`_tree_sum`), ``div_rn``) plus the bias; group scores on those values (or on canonical
scores for "top2sum" without a bias). The launcher compiles the forward kernel with
``enable_fp_fusion=False``: an FMA contracted from ``a*b + c`` rounds once where the recipe
rounds twice. ``tl.exp`` (``ex2.approx`` on the GPU) and ``/`` (``div.full``) appear only in
the weights, which are compared with a tolerance.

Selection order as one integer. Each lane gets an int64 key that sorts exactly like the contract
(allowed experts first, then descending selection value, then ascending expert id)::

    key = allowed << 48 | ordered_bits(sel) << 16 | (65535 - e)      (NaN -> -inf, -0 -> +0)

``ordered_bits`` maps the fp32 bit pattern to an integer in [0, 2^32) with the order of the float
(so ``-inf`` is an ordinary, smallest value). Top-k is then ``k`` rounds of "max of the keys,
decode the expert, retire its lane": no floating-point comparisons, no tie cases. The id field
limits E to 65536 (the launcher limits the tile far below that).

Example (E=4, k=2, softmax, no bias): logits [1, 3, 3, 0] are the selection values; the keys
order lanes 1 > 2 > 0 > 3 (lanes 1 and 2 tie; the lower id wins): ids = [1, 2].

Determinism: per-expert counts use integer atomics (order-independent); float partial sums are
written per block and reduced in a fixed order by the launcher; nothing uses float atomics.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

#: Floor of the renormalization denominator; equals ``tritonmoe.reference.RENORM_EPS``.
RENORM_EPS: tl.constexpr = tl.constexpr(1e-20)
#: Key of a padding lane or of a lane already taken by an earlier slot: below every real key.
RETIRED: tl.constexpr = tl.constexpr(-(1 << 62))

# Constants of the canonical exp: the fp32 values of tritonmoe.reference (each exact in fp32).
LOG2E: tl.constexpr = tl.constexpr(float.fromhex("0x1.715476p+0"))
LN2_HI: tl.constexpr = tl.constexpr(0.693359375)
LN2_LO: tl.constexpr = tl.constexpr(float.fromhex("-0x1.bd0106p-13"))
EXP_C7: tl.constexpr = tl.constexpr(float.fromhex("0x1.a01a02p-13"))
EXP_C6: tl.constexpr = tl.constexpr(float.fromhex("0x1.6c16c2p-10"))
EXP_C5: tl.constexpr = tl.constexpr(float.fromhex("0x1.111112p-7"))
EXP_C4: tl.constexpr = tl.constexpr(float.fromhex("0x1.555556p-5"))
EXP_C3: tl.constexpr = tl.constexpr(float.fromhex("0x1.555556p-3"))
EXP_C2: tl.constexpr = tl.constexpr(0.5)
EXP_MIN: tl.constexpr = tl.constexpr(-86.0)
EXP_MAX: tl.constexpr = tl.constexpr(88.0)
#: 2 / (2i + 1) rounded to fp32 (i = 8 .. 0): the atanh series of the canonical log1p, as
#: tritonmoe.reference._LOG1P_POLY.
_L = [struct.unpack("f", struct.pack("f", 2.0 / (2 * i + 1)))[0] for i in range(8, -1, -1)]
L8: tl.constexpr = tl.constexpr(_L[0])
L7: tl.constexpr = tl.constexpr(_L[1])
L6: tl.constexpr = tl.constexpr(_L[2])
L5: tl.constexpr = tl.constexpr(_L[3])
L4: tl.constexpr = tl.constexpr(_L[4])
L3: tl.constexpr = tl.constexpr(_L[5])
L2: tl.constexpr = tl.constexpr(_L[6])
L1: tl.constexpr = tl.constexpr(_L[7])
L0: tl.constexpr = tl.constexpr(_L[8])
#: Added to the per-token score sum that normalises sigmoid / sqrtsoftplus scores for the balance
#: loss (tritonmoe.reference.AUX_EPS).
AUX_EPS: tl.constexpr = tl.constexpr(1e-20)
#: Bits of the forward kernel's check flag (CHECK): what tritonmoe.core.validation.route_values
#: refuses (NaN logits; under softmax a +inf logit or a token whose logits are all -inf; a
#: non-finite expert bias).
CHECK_NAN: tl.constexpr = tl.constexpr(1)
CHECK_POSINF: tl.constexpr = tl.constexpr(2)
CHECK_ALL_NEGINF: tl.constexpr = tl.constexpr(4)
CHECK_BIAS: tl.constexpr = tl.constexpr(8)


@triton.jit
def _canonical_exp(y):
    """:func:`tritonmoe.reference.canonical_exp` with the same operations in the same order
    (bit-identical as long as nothing contracts them into FMAs): 0 below EXP_MIN, +inf above
    EXP_MAX, NaN for NaN, else 2^n * p(r), n = floor(y*log2e + 1/2), r = (y - n*LN2_HI) - n*LN2_LO,
    p the degree-7 Taylor polynomial in Horner form."""
    nan = y != y
    under = y < EXP_MIN
    over = y > EXP_MAX
    yc = tl.where(nan | under | over, 0.0, y)
    n = tl.floor(yc * LOG2E + 0.5)
    r = (yc - n * LN2_HI) - n * LN2_LO
    p = EXP_C7 * r + EXP_C6
    p = p * r + EXP_C5
    p = p * r + EXP_C4
    p = p * r + EXP_C3
    p = p * r + EXP_C2
    p = p * r + 1.0
    p = p * r + 1.0
    two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # 2^n exactly, n in [-124, 127]
    out = p * two_n
    out = tl.where(under, 0.0, out)
    out = tl.where(over, float("inf"), out)
    return tl.where(nan, y, out)


@triton.jit
def _canonical_sigmoid(x):
    """1 / (1 + canonical_exp(-x)), the division correctly rounded (``div_rn``)."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _canonical_exp(-x))


@triton.jit
def _canonical_sqrtsoftplus(x):
    """:func:`tritonmoe.reference._canonical_sqrtsoftplus`, the same operations in the same
    order: u = canonical_exp(-|x|), z = u / (2 + u), softplus = [x > 0] x + z p(z^2), sqrt_rn."""
    u = _canonical_exp(-tl.abs(x))
    z = tl.math.div_rn(u, 2.0 + u)
    w = z * z
    p = L8 * w + L7
    p = p * w + L6
    p = p * w + L5
    p = p * w + L4
    p = p * w + L3
    p = p * w + L2
    p = p * w + L1
    p = p * w + L0
    sp = tl.where(x > 0, x, 0.0) + z * p
    return tl.sqrt_rn(sp)


@triton.jit
def _sqrtsoftplus(x):
    """sqrt(softplus(x)) for the weights: max(x, 0) + log1p(exp(-|x|)), log1p(u) as
    log(1 + u) * u / ((1 + u) - 1) (exact to rounding for small u, where log(1 + u) is not)."""
    u = tl.exp(-tl.abs(x))
    y = 1.0 + u
    l1p = tl.where(y == 1.0, u, tl.log(y) * (u / tl.where(y == 1.0, 1.0, y - 1.0)))
    return tl.sqrt(tl.where(x > 0, x, 0.0) + l1p)


@triton.jit
def _row_max_no_nan(x_TE):
    """[BT] max of each row over its non-NaN entries (-inf if none), as the reference's."""
    return tl.max(tl.where(x_TE != x_TE, float("-inf"), x_TE), axis=1)


@triton.jit
def _tree_sum(v_TE, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """[BT] sum of each row of ``v_TE`` by adjacent pairs (v[0::2] + v[1::2], repeated), the
    fixed order of the reference's canonical softmax denominator (BLOCK_E a power of two, lanes
    in the group-major layout of the module docstring, padding lanes 0)."""
    v = v_TE
    for lvl in tl.static_range(14):  # BLOCK_E <= 2^13 (MAX_TILE_LANES)
        if (BLOCK_E >> lvl) > 1:
            a, b = tl.split(tl.reshape(v, [BLOCK_T, BLOCK_E >> (lvl + 1), 2]))
            v = a + b
    return tl.reshape(v, [BLOCK_T])


@triton.jit
def _canonical_softmax(x_TE, lane_ok_E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """:func:`tritonmoe.reference.canonical_scores` under softmax: canonical_exp(x - m) divided
    (div_rn) by its pairwise tree sum, m the row max over non-NaN logits."""
    m_T = _row_max_no_nan(x_TE)
    e_TE = tl.where(lane_ok_E[None, :], _canonical_exp(x_TE - m_T[:, None]), 0.0)
    den_T = _tree_sum(e_TE, BLOCK_T, BLOCK_E)
    return tl.math.div_rn(e_TE, tl.broadcast_to(den_T[:, None], [BLOCK_T, BLOCK_E]))


@triton.jit
def _lanes(G: tl.constexpr, S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Expert id [BE] and validity [BE] of each lane of a [BT, BE] tile (BE = BLOCK_G*BLOCK_S)."""
    lane = tl.arange(0, BLOCK_G * BLOCK_S)
    g = lane // BLOCK_S
    i = lane % BLOCK_S
    return g * S + i, (g < G) & (i < S)


@triton.jit
def _load_scores(logits_ptr, t, row_ok, stride_lt, stride_le, e_E, lane_ok_E,
                 SOFTMAX: tl.constexpr, NEED_STATS: tl.constexpr, BLOCK_T: tl.constexpr, SQRTSP: tl.constexpr = False):
    """Logits of rows ``t`` as an fp32 [BT, BE] tile (-inf in padding lanes, 0 in rows past T,
    so they do no NaN work), their fp32 scores, and the row max / sum of exp(x - max) when
    SOFTMAX or NEED_STATS (else 0 and 1)."""
    ptrs = logits_ptr + t[:, None] * stride_lt + e_E[None, :].to(tl.int64) * stride_le
    x_TE = tl.load(ptrs, mask=row_ok[:, None] & lane_ok_E[None, :], other=float("-inf")).to(tl.float32)
    x_TE = tl.where(row_ok[:, None], x_TE, 0.0)
    if SOFTMAX or NEED_STATS:
        m_T = tl.max(x_TE, axis=1)
        ex_TE = tl.exp(x_TE - m_T[:, None])
        den_T = tl.sum(ex_TE, axis=1)
    else:
        m_T = tl.zeros([BLOCK_T], dtype=tl.float32)
        den_T = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
        ex_TE = x_TE
    if SOFTMAX:
        s_TE = ex_TE / den_T[:, None]
    elif SQRTSP:
        s_TE = _sqrtsoftplus(x_TE)
    else:
        s_TE = 1.0 / (1.0 + tl.exp(-x_TE))
    return x_TE, s_TE, m_T, den_T


@triton.jit
def _score_at(lg, m, den, SOFTMAX: tl.constexpr, SQRTSP: tl.constexpr = False):
    """Score of logits ``lg`` given the row's softmax statistics broadcast to it: the expressions
    of :func:`_load_scores`, so a gathered score equals the tile's score bit for bit."""
    if SOFTMAX:
        s = tl.exp(lg - m) / den
    elif SQRTSP:
        s = _sqrtsoftplus(lg)
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
    slot_hist_ptr,  # int32 [K, NB, E] out: per-slot, per-block histograms (iff HAS_CAPACITY)
    slot_tot_ptr,  # int32 [K, E] in/out, zeroed: per-slot totals (iff HAS_CAPACITY and SLOT_TOTALS)
    score_part_ptr,  # fp32 [NB, E] out: per-block sums of the scores (iff WITH_AUX)
    lse_ptr,  # fp32 [T] out: per-token logsumexp of the logits (iff WITH_AUX)
    T,
    NB,
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
    SLOT_TOTALS: tl.constexpr,
    WITH_AUX: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    scale=1.0,  # fp32 routed_scaling_factor: multiplies the final weights
    GROUP_MAX: tl.constexpr = False,  # group score: max (True) or top-2 sum (False)
    SQRTSP: tl.constexpr = False,  # score function sqrtsoftplus (SOFTMAX False): sqrt(softplus(x))
    GROUP_TOPN: tl.constexpr = 0,  # > 0: group score "sum_topn", the sum of the group's GROUP_TOPN largest values
    prio_ptr=None,  # fp32 [T, K] out: the "probs" drop priority (iff WITH_PRIO)
    WITH_PRIO: tl.constexpr = False,
    BLOCK_HIST: tl.constexpr = False,  # also write the block's selection histogram to slot_hist [NB, E] ("position")
    flag_ptr=None,  # int32 [1] in/out, zeroed: OR of the CHECK_* bits any program found (iff CHECK)
    CHECK: tl.constexpr = False,  # the value checks of tritonmoe.core.validation.route_values, fused
    POISON: tl.constexpr = False,  # HAS_BIAS: every weight NaN when any bias entry is not finite
):
    """Scores, selection, top-k, weights and per-expert histograms of a block of tokens.

    Grid: ``(NB,) = (cdiv(T, BLOCK_T),)``. Program ``b`` reads rows [b*BLOCK_T, (b+1)*BLOCK_T)
    of the logits once and writes their ids and weights; it adds its per-expert selection
    histogram to ``counts`` (with capacity instead: one histogram per slot j, for the scan);
    with WITH_AUX it writes its per-expert score sums and the rows' logsumexp.
    """
    E: tl.constexpr = G * S
    BLOCK_E: tl.constexpr = BLOCK_G * BLOCK_S
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < T
    e_E, lane_ok_E = _lanes(G, S, BLOCK_G, BLOCK_S)
    x_TE, s_TE, m_T, den_T = _load_scores(
        logits_ptr, t, row_ok, stride_lt, stride_le, e_E, lane_ok_E, SOFTMAX, WITH_AUX, BLOCK_T, SQRTSP
    )

    if WITH_AUX:
        # logsumexp as torch.logsumexp computes it: an infinite max is the result (all -inf -> -inf)
        lse_T = tl.where((m_T == float("inf")) | (m_T == float("-inf")), m_T, m_T + tl.log(den_T))
        tl.store(lse_ptr + t, lse_T, mask=row_ok)
        if SOFTMAX:
            q_TE = s_TE
        else:  # the balance loss's scores: normalised over the experts (tritonmoe.reference.aux_scores)
            z_T = tl.sum(tl.where(lane_ok_E[None, :], s_TE, 0.0), axis=1)
            q_TE = s_TE / (z_T + AUX_EPS)[:, None]
        part_E = tl.sum(tl.where(row_ok[:, None], q_TE, 0.0), axis=0)
        tl.store(score_part_ptr + pid * E + e_E, part_E, mask=lane_ok_E)

    if HAS_BIAS:
        b_E = tl.load(bias_ptr + e_E, mask=lane_ok_E, other=0.0)
        # non-finite bias entries (every program reads the whole bias: E loads, no extra pass)
        n_bad_bias = tl.sum((((b_E != b_E) | (tl.abs(b_E) == float("inf"))) & lane_ok_E).to(tl.int32), axis=0)
    if CHECK:
        valid_TE = row_ok[:, None] & lane_ok_E[None, :]
        bits = tl.where(tl.sum(tl.sum(((x_TE != x_TE) & valid_TE).to(tl.int32), axis=1), axis=0) > 0, CHECK_NAN, 0)
        if SOFTMAX:
            n_pinf = tl.sum(tl.sum(((x_TE == float("inf")) & valid_TE).to(tl.int32), axis=1), axis=0)
            bits = bits | tl.where(n_pinf > 0, CHECK_POSINF, 0)
            # a real row whose every real lane is -inf
            live_T = tl.sum(((x_TE != float("-inf")) & valid_TE).to(tl.int32), axis=1)
            n_dead = tl.sum(((live_T == 0) & row_ok).to(tl.int32), axis=0)
            bits = bits | tl.where(n_dead > 0, CHECK_ALL_NEGINF, 0)
        if HAS_BIAS:
            bits = bits | tl.where(n_bad_bias > 0, CHECK_BIAS, 0)
        tl.atomic_or(flag_ptr, bits, mask=bits != 0, sem="relaxed")

    # -- selection value (canonical, see the module docstring); NaN ranks as -inf, -0 is +0 -------
    if HAS_BIAS or WITH_PRIO:
        if SOFTMAX:
            c_TE = _canonical_softmax(x_TE, lane_ok_E, BLOCK_T, BLOCK_E)
        elif SQRTSP:
            c_TE = _canonical_sqrtsoftplus(x_TE)
        else:
            c_TE = _canonical_sigmoid(x_TE)
    if HAS_BIAS:
        sel_TE = c_TE + b_E[None, :]
    else:
        sel_TE = x_TE
    sel_TE = tl.where((sel_TE != sel_TE) | (lane_ok_E[None, :] == 0), float("-inf"), sel_TE)
    sel_TE = tl.where(sel_TE == 0.0, 0.0, sel_TE)

    # -- group-limited routing: keep the TOPK_GROUPS groups with the best group scores -------------
    if G > 1:
        # what a group score is made of: the selection values, or (top-2 sum without a bias) the
        # canonical scores; for softmax without the row's common denominator
        if GROUP_MAX or (S == 1 and GROUP_TOPN == 0) or HAS_BIAS or (GROUP_TOPN > 0 and SOFTMAX):
            gv_TE = sel_TE
        else:
            if SOFTMAX:
                gv_TE = _canonical_exp(x_TE - _row_max_no_nan(x_TE)[:, None])
            elif SQRTSP:
                gv_TE = _canonical_sqrtsoftplus(x_TE)
            else:
                gv_TE = _canonical_sigmoid(x_TE)
            gv_TE = tl.where((gv_TE != gv_TE) | (lane_ok_E[None, :] == 0), float("-inf"), gv_TE)
        gv_TGS = tl.reshape(gv_TE, [BLOCK_T, BLOCK_G, BLOCK_S])
        g = tl.arange(0, BLOCK_G)
        member_ok_1GS = (g[None, :, None] < G) & (tl.arange(0, BLOCK_S)[None, None, :] < S)
        v1_TG = tl.max(gv_TGS, axis=2)
        if GROUP_TOPN > 0:
            # the GROUP_TOPN largest, added largest first; each round retires one lane (the lowest
            # index holding the maximum), so a repeated value counts as often as it occurs
            sidx_S = tl.arange(0, BLOCK_S)
            live_TGS = gv_TGS
            gs_TG = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.float32)
            for r in tl.static_range(GROUP_TOPN):
                vr_TG = tl.max(live_TGS, axis=2)
                first_TG = tl.min(tl.where(live_TGS == vr_TG[:, :, None], sidx_S[None, None, :], BLOCK_S), axis=2)
                live_TGS = tl.where(sidx_S[None, None, :] == first_TG[:, :, None], float("-inf"), live_TGS)
                if r == 0:
                    gs_TG = vr_TG
                else:
                    gs_TG = gs_TG + vr_TG
        elif GROUP_MAX or S == 1:
            gs_TG = v1_TG
        else:
            # top-2 sum: the max twice if it occurs twice, else the max plus the next value
            is_top_TGS = gv_TGS == v1_TG[:, :, None]
            n_top_TG = tl.sum((is_top_TGS & member_ok_1GS).to(tl.int32), axis=2)
            rest_TG = tl.max(tl.where(is_top_TGS, float("-inf"), gv_TGS), axis=2)
            gs_TG = v1_TG + tl.where(n_top_TG >= 2, v1_TG, rest_TG)
        gs_TG = tl.where(gs_TG != gs_TG, float("-inf"), gs_TG)  # NaN (inf - inf) ranks last
        # rank of group g = the groups that beat it (larger score, or equal score and lower index)
        beats_TGG = (gs_TG[:, None, :] > gs_TG[:, :, None]) | (
            (gs_TG[:, None, :] == gs_TG[:, :, None]) & (g[None, None, :] < g[None, :, None])
        )
        rank_TG = tl.sum((beats_TGG & (g[None, None, :] < G)).to(tl.int32), axis=2)
        allowed_TG = (rank_TG < TOPK_GROUPS).to(tl.int64)
        allowed_TE = tl.reshape(tl.broadcast_to(allowed_TG[:, :, None], [BLOCK_T, BLOCK_G, BLOCK_S]),
                                [BLOCK_T, BLOCK_E])
    else:
        allowed_TE = tl.full([1, BLOCK_E], 1, tl.int64)

    # -- order keys (see the module docstring) ----------------------------------------------------
    bits_TE = sel_TE.to(tl.int32, bitcast=True)
    ordered_TE = tl.where(bits_TE < 0, bits_TE ^ 0x7FFFFFFF, bits_TE).to(tl.int64) + 2147483647 + 1
    key_TE = (allowed_TE << 48) | (ordered_TE << 16) | (65535 - e_E[None, :]).to(tl.int64)
    key_TE = tl.where(lane_ok_E[None, :], key_TE, RETIRED)

    # -- top-k: K rounds of argmax over the keys ---------------------------------------------------
    kcol = tl.arange(0, BLOCK_K)
    ids_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    if WITH_PRIO:
        c_TK = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        csum_T = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in range(K):
        best_T = tl.max(key_TE, axis=1)
        e_T = (65535 - (best_T & 65535)).to(tl.int32)
        ids_TK = tl.where(kcol[None, :] == j, e_T[:, None], ids_TK)
        hit_TE = e_E[None, :] == e_T[:, None]
        key_TE = tl.where(hit_TE, RETIRED, key_TE)
        if WITH_PRIO:
            # the canonical score at the id (a max over one lane: exact), summed in slot order
            cj_T = tl.max(tl.where(hit_TE, c_TE, float("-inf")), axis=1)
            c_TK = tl.where(kcol[None, :] == j, cj_T[:, None], c_TK)
            if j == 0:
                csum_T = cj_T
            else:
                csum_T = csum_T + cj_T
        if HAS_CAPACITY:
            hist_E = tl.sum((hit_TE & row_ok[:, None]).to(tl.int32), axis=0)
            tl.store(slot_hist_ptr + (j * NB + pid) * E + e_E, hist_E, mask=lane_ok_E)
            if SLOT_TOTALS:
                tl.atomic_add(slot_tot_ptr + j * E + e_E, hist_E, mask=lane_ok_E & (hist_E > 0), sem="relaxed")

    if not HAS_CAPACITY:
        taken_TE = (key_TE == RETIRED) & lane_ok_E[None, :] & row_ok[:, None]
        hist_E = tl.sum(taken_TE.to(tl.int32), axis=0)
        if BLOCK_HIST:
            tl.store(slot_hist_ptr + pid * E + e_E, hist_E, mask=lane_ok_E)
        else:
            tl.atomic_add(counts_ptr + e_E, hist_E, mask=lane_ok_E & (hist_E > 0), sem="relaxed")

    # -- weights: unbiased scores at the ids, gathered from the (cached) logits rows ---------------
    k_ok_TK = row_ok[:, None] & (kcol[None, :] < K)
    lg_TK = tl.load(
        logits_ptr + t[:, None] * stride_lt + ids_TK.to(tl.int64) * stride_le, mask=k_ok_TK, other=0.0
    ).to(tl.float32)
    p_TK = _score_at(lg_TK, m_T[:, None], den_T[:, None], SOFTMAX, SQRTSP)
    if RENORMALIZE:
        sum_T = tl.sum(tl.where(kcol[None, :] < K, p_TK, 0.0), axis=1)
        # where(sum < eps) rather than maximum(): a NaN sum stays NaN, as under clamp_min
        p_TK = p_TK / tl.where(sum_T < RENORM_EPS, RENORM_EPS, sum_T)[:, None]
    p_TK = p_TK * scale
    if POISON:  # tritonmoe.reference.nan_weights_if_nonfinite, fused: w + 0, or w + NaN
        p_TK = p_TK + tl.where(n_bad_bias > 0, float("nan"), 0.0)
    out_TK = t[:, None] * K + kcol[None, :]
    tl.store(ids_ptr + out_TK, ids_TK, mask=k_ok_TK)
    tl.store(w_ptr + out_TK, p_TK, mask=k_ok_TK)
    if WITH_PRIO:  # tritonmoe.reference.drop_priority: canonical weight, NaN as -inf, -0 as +0
        if RENORMALIZE:
            c_TK = tl.math.div_rn(c_TK, tl.broadcast_to(tl.where(csum_T < RENORM_EPS, RENORM_EPS, csum_T)[:, None],
                                                        [BLOCK_T, BLOCK_K]))
        c_TK = c_TK * scale
        c_TK = tl.where(c_TK != c_TK, float("-inf"), c_TK)
        c_TK = tl.where(c_TK == 0.0, 0.0, c_TK)
        tl.store(prio_ptr + out_TK, c_TK, mask=k_ok_TK)


@triton.jit
def _capacity_scan_kernel(
    slot_hist_ptr,  # int32 [K, NB, E] in: per-slot per-block histograms; out: exclusive offsets
    slot_tot_ptr,  # int32 [K, E] per-slot totals over all blocks (read iff SLOTS_PER_PROG < K)
    counts_ptr,  # int32 [E] out: kept slots per expert
    selected_ptr,  # int32 [E] out: selected slots per expert
    NB,
    capacity,
    E,
    K: tl.constexpr,
    SLOTS_PER_PROG: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Exclusive prefix sums of the histograms in priority order (slot j, then block).

    The histograms are laid out [K, NB, E], so for one expert the priority order is the row
    order: the scan runs down the K*NB rows. Grid: ``(cdiv(K, SLOTS_PER_PROG), cdiv(E, BLOCK_E))``.
    Program (p, c) scans the rows of slots [p*SLOTS_PER_PROG, (p+1)*SLOTS_PER_PROG) for experts
    [c*BLOCK_E, (c+1)*BLOCK_E), BLOCK_R rows at a time, starting from the slots of earlier slot
    groups (summed from ``slot_tot``; with SLOTS_PER_PROG = K one program per expert block scans
    everything and needs no totals). Each entry is overwritten with the number of earlier slots
    (in priority order) on its expert. Programs p = 0 also write the counts: selected, and
    kept = min(selected, capacity).

    Example (one expert, NB=2, K=2): histograms (slot 0: [2, 3], slot 1: [1, 0]) become offsets
    (slot 0: [0, 2], slot 1: [5, 6]).
    """
    p = tl.program_id(0)
    c = tl.program_id(1)
    e = c * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    j_lo = p * SLOTS_PER_PROG
    running_E = tl.zeros([BLOCK_E], dtype=tl.int32)
    if SLOTS_PER_PROG < K:
        jj = tl.arange(0, BLOCK_J)
        total_E = tl.zeros([BLOCK_E], dtype=tl.int32)
        for j0 in range(0, K, BLOCK_J):
            j_J = j0 + jj
            tot_JE = tl.load(slot_tot_ptr + j_J[:, None] * E + e[None, :], mask=(j_J[:, None] < K) & e_ok[None, :],
                             other=0)
            total_E += tl.sum(tot_JE, axis=0)
            running_E += tl.sum(tl.where(j_J[:, None] < j_lo, tot_JE, 0), axis=0)
        if p == 0:
            tl.store(selected_ptr + e, total_E, mask=e_ok)
            tl.store(counts_ptr + e, tl.minimum(total_E, capacity), mask=e_ok)

    row_end = tl.minimum(j_lo + SLOTS_PER_PROG, K).to(tl.int64) * NB
    rr = tl.arange(0, BLOCK_R)
    for r0 in range(j_lo.to(tl.int64) * NB, row_end, BLOCK_R):
        r = r0 + rr
        ok = (r[:, None] < row_end) & e_ok[None, :]
        ptrs = slot_hist_ptr + r[:, None] * E + e[None, :]
        h_RE = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(h_RE, axis=0) - h_RE + running_E[None, :], mask=ok)
        running_E += tl.sum(h_RE, axis=0)

    if SLOTS_PER_PROG >= K:
        tl.store(selected_ptr + e, running_E, mask=e_ok)
        tl.store(counts_ptr + e, tl.minimum(running_E, capacity), mask=e_ok)


@triton.jit
def _capacity_keep_kernel(
    sel_ids_ptr,  # int32 [T, K] selected ids (before dropping)
    offsets_ptr,  # int32 [K, NB, E] exclusive offsets from the scan
    ids_ptr,  # int32 [T, K] out: ids with dropped slots set to -1
    w_ptr,  # fp32 [T, K] in/out: weights, dropped slots set to 0
    T,
    NB,
    capacity,
    E,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_KC: tl.constexpr,
):
    """Drop the slots past an expert's capacity.

    Grid: ``(NB,)`` with the forward kernel's BLOCK_T (the offsets are per token block). The
    position of slot (t, j) on its expert e is offset[j, block, e] plus the number of earlier
    tokens of the block whose slot j is also on e; the slot is kept when the position is below
    ``capacity``. Slots are handled BLOCK_KC at a time with a [BT, BT, BKC] comparison.
    """
    pid = tl.program_id(0).to(tl.int64)
    tt = tl.arange(0, BLOCK_T)
    t = pid * BLOCK_T + tt
    row_ok = t < T
    earlier_TT = (tt[None, :] < tt[:, None]) & row_ok[None, :]  # [t, t']: t' is before t
    kc = tl.arange(0, BLOCK_KC)
    for j0 in range(0, K, BLOCK_KC):
        j_C = j0 + kc
        ok_TC = row_ok[:, None] & (j_C[None, :] < K)
        slot_TC = t[:, None] * K + j_C[None, :]
        e_TC = tl.load(sel_ids_ptr + slot_TC, mask=ok_TC, other=-1)
        off_TC = tl.load(offsets_ptr + (j_C[None, :] * NB + pid) * E + e_TC, mask=ok_TC, other=0)
        same_TTC = (e_TC[None, :, :] == e_TC[:, None, :]) & earlier_TT[:, :, None]
        keep_TC = off_TC + tl.sum(same_TTC.to(tl.int32), axis=1) < capacity
        tl.store(ids_ptr + slot_TC, tl.where(keep_TC, e_TC, -1), mask=ok_TC)
        w_TC = tl.load(w_ptr + slot_TC, mask=ok_TC, other=0.0)
        tl.store(w_ptr + slot_TC, tl.where(keep_TC, w_TC, 0.0), mask=ok_TC)


@triton.jit
def _position_keep_kernel(
    sel_ids_ptr,  # int32 [T, K] selected ids (before dropping)
    offsets_ptr,  # int32 [NB, E] exclusive offsets of each block's selections (the scan, K = 1)
    ids_ptr,  # int32 [T, K] out: ids with dropped slots set to -1
    w_ptr,  # fp32 [T, K] in/out: weights, dropped slots set to 0
    T,
    capacity,
    E,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Drop by "position": each expert keeps the slots of its ``capacity`` earliest tokens.

    Grid: ``(NB,)`` with the forward kernel's BLOCK_T (the offsets are per token block). A
    token's position on expert e is the block's offset for e plus the number of earlier tokens of
    the block that chose e: an exclusive cumulative sum down the block's [BLOCK_T, BLOCK_E]
    occupancy tile (a token holds an expert at most once)."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < T
    e_E = tl.arange(0, BLOCK_E)
    occ_TE = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for j in range(K):
        e_T = tl.load(sel_ids_ptr + t * K + j, mask=row_ok, other=-1)
        occ_TE += (e_E[None, :] == e_T[:, None]).to(tl.int32)
    off_E = tl.load(offsets_ptr + pid * E + e_E, mask=e_E < E, other=0)
    pos_TE = tl.cumsum(occ_TE, axis=0) - occ_TE + off_E[None, :]
    for j in range(K):
        e_T = tl.load(sel_ids_ptr + t * K + j, mask=row_ok, other=-1)
        pos_T = tl.sum(tl.where(e_E[None, :] == e_T[:, None], pos_TE, 0), axis=1)
        keep_T = pos_T < capacity
        tl.store(ids_ptr + t * K + j, tl.where(keep_T, e_T, -1), mask=row_ok)
        w_T = tl.load(w_ptr + t * K + j, mask=row_ok, other=0.0)
        tl.store(w_ptr + t * K + j, tl.where(keep_T, w_T, 0.0), mask=row_ok)


@triton.jit
def _route_bwd_kernel(
    logits_ptr,  # [T, E], strides (stride_lt, stride_le)
    sel_ids_ptr,  # int32 [T, K] selected ids (before dropping)
    ids_ptr,  # int32 [T, K] final ids, -1 = dropped (read iff HAS_CAPACITY)
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
    scale=1.0,  # fp32 routed_scaling_factor of the forward
    SQRTSP: tl.constexpr = False,  # score function sqrtsoftplus (SOFTMAX False)
):
    """d(logits) from d(topk_weights), d(score_sum) and d(logsumexp) in one pass.

    Grid: ``(cdiv(T, BLOCK_T),)``. Program ``b`` re-reads its rows of logits, recomputes the
    scores and chains, per token (p_j = score at id_j, the ids before dropping; P = sum_j p_j;
    D = max(P, eps); g_j = scale * d(topk_weights)[t, j], zero for a dropped slot)::

        dp_j = (g_j - [P >= eps] * sum_i g_i p_i / D) / D     (renormalize; else dp_j = g_j)
        ds_e = dp_j where e = id_j, plus d(score_sum)[e] (softmax), or through the balance
               loss's normalisation q = s / (Z + eps), Z = sum_e s_e (sigmoid, sqrtsoftplus):
               (d(score_sum)[e] - sum_e' d(score_sum)[e'] q_e') / (Z + eps)
        dl_e = s_e * (ds_e - sum_e' ds_e' s_e')   (softmax),   ds_e * s_e * (1 - s_e)   (sigmoid),
               ds_e * sigmoid(x_e) / (2 s_e)   (sqrtsoftplus; 0 where s_e = 0)
               + d(logsumexp)[t] * softmax(logits_t)_e
    """
    E: tl.constexpr = G * S
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < T
    e_E, lane_ok_E = _lanes(G, S, BLOCK_G, BLOCK_S)
    x_TE, s_TE, m_T, den_T = _load_scores(
        logits_ptr, t, row_ok, stride_lt, stride_le, e_E, lane_ok_E, SOFTMAX, HAS_DLSE, BLOCK_T, SQRTSP
    )

    ds_TE = tl.zeros([BLOCK_T, BLOCK_G * BLOCK_S], dtype=tl.float32)
    if HAS_DW:
        kcol = tl.arange(0, BLOCK_K)
        k_ok_TK = row_ok[:, None] & (kcol[None, :] < K)
        if RENORMALIZE:
            ids_TK = tl.load(sel_ids_ptr + t[:, None] * K + kcol[None, :], mask=k_ok_TK, other=0)
            g_TK = scale * tl.load(dw_ptr + t[:, None] * stride_dwt + kcol[None, :] * stride_dwk, mask=k_ok_TK,
                                   other=0.0)
            if HAS_CAPACITY:
                final_TK = tl.load(ids_ptr + t[:, None] * K + kcol[None, :], mask=k_ok_TK, other=-1)
                g_TK = tl.where(final_TK >= 0, g_TK, 0.0)
            lg_TK = tl.load(
                logits_ptr + t[:, None] * stride_lt + ids_TK.to(tl.int64) * stride_le, mask=k_ok_TK, other=0.0
            ).to(tl.float32)
            p_TK = tl.where(k_ok_TK, _score_at(lg_TK, m_T[:, None], den_T[:, None], SOFTMAX, SQRTSP), 0.0)
            sum_T = tl.sum(p_TK, axis=1)
            den_p_T = tl.where(sum_T < RENORM_EPS, RENORM_EPS, sum_T)
            dot_T = tl.sum(g_TK * (p_TK / den_p_T[:, None]), axis=1)
            dot_T = tl.where(sum_T >= RENORM_EPS, dot_T, 0.0)  # clamp_min passes no gradient below eps
        # scatter dp_j to lane id_j (a token's ids are distinct); per-slot loads, not reductions
        for j in range(K):
            e_T = tl.load(sel_ids_ptr + t * K + j, mask=row_ok, other=-1)
            g_T = scale * tl.load(dw_ptr + t * stride_dwt + j * stride_dwk, mask=row_ok, other=0.0)
            if HAS_CAPACITY:
                g_T = tl.where(tl.load(ids_ptr + t * K + j, mask=row_ok, other=-1) >= 0, g_T, 0.0)
            if RENORMALIZE:
                dp_T = (g_T - dot_T) / den_p_T
            else:
                dp_T = g_T
            ds_TE += tl.where(e_E[None, :] == e_T[:, None], dp_T[:, None], 0.0)
    if HAS_DSS:
        dss_E = tl.load(dss_ptr + e_E * stride_dss, mask=lane_ok_E, other=0.0)
        if SOFTMAX:
            ds_TE += dss_E[None, :]
        else:
            zp_T = tl.sum(tl.where(lane_ok_E[None, :], s_TE, 0.0), axis=1) + AUX_EPS
            dq_T = tl.sum(tl.where(lane_ok_E[None, :], dss_E[None, :] * (s_TE / zp_T[:, None]), 0.0), axis=1)
            ds_TE += (dss_E[None, :] - dq_T[:, None]) / zp_T[:, None]

    if SOFTMAX:
        dot_s_T = tl.sum(tl.where(lane_ok_E[None, :], ds_TE * s_TE, 0.0), axis=1)
        dl_TE = s_TE * (ds_TE - dot_s_T[:, None])
    elif SQRTSP:
        sig_TE = 1.0 / (1.0 + tl.exp(-x_TE))
        dl_TE = tl.where(s_TE > 0, ds_TE * sig_TE / tl.where(s_TE > 0, 2.0 * s_TE, 1.0), 0.0)
    else:
        dl_TE = ds_TE * (s_TE * (1.0 - s_TE))
    if HAS_DLSE:
        dlse_T = tl.load(dlse_ptr + t * stride_dlse, mask=row_ok, other=0.0)
        if SOFTMAX:
            dl_TE += dlse_T[:, None] * s_TE
        else:
            dl_TE += dlse_T[:, None] * (tl.exp(x_TE - m_T[:, None]) / den_T[:, None])

    out = dlogits_ptr + t[:, None] * E + e_E[None, :]
    tl.store(out, dl_TE.to(dlogits_ptr.dtype.element_ty), mask=row_ok[:, None] & lane_ok_E[None, :])


@triton.jit
def _balance_sums_fwd_kernel(
    logits_ptr,  # [T, E], strides (stride_lt, stride_le)
    mask_ptr,  # bool [T] as int8 (read iff HAS_MASK): 1 = a real token
    part_ptr,  # fp32 [B, NC, E] out: per-chunk sums of the balance scores
    T,
    S,  # tokens per segment (a sequence; T for the whole batch)
    NC,  # chunks per segment, cdiv(S, BLOCK_T)
    stride_lt,
    stride_le,
    E: tl.constexpr,
    SOFTMAX: tl.constexpr,
    SQRTSP: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Sums over the real tokens of a segment chunk of the balance loss's scores
    (tritonmoe.reference.aux_scores: softmax, or sigmoid / sqrtsoftplus normalised over the
    experts). Grid: ``(B, NC)``; program (b, c) reads the rows b*S + [c*BLOCK_T, (c+1)*BLOCK_T)
    of segment b and writes their sums; the launcher adds the NC chunks in a fixed order."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    i = c * BLOCK_T + tl.arange(0, BLOCK_T)
    t = b * S + i
    row_ok = (i < S) & (t < T)
    e_E = tl.arange(0, BLOCK_E)
    lane_ok_E = e_E < E
    x_TE, s_TE, m_T, den_T = _load_scores(logits_ptr, t, row_ok, stride_lt, stride_le, e_E, lane_ok_E, SOFTMAX,
                                          False, BLOCK_T, SQRTSP)
    if SOFTMAX:
        q_TE = s_TE
    else:
        z_T = tl.sum(tl.where(lane_ok_E[None, :], s_TE, 0.0), axis=1)
        q_TE = s_TE / (z_T + AUX_EPS)[:, None]
    keep_T = row_ok
    if HAS_MASK:
        keep_T = keep_T & (tl.load(mask_ptr + t, mask=row_ok, other=0) != 0)
    part_E = tl.sum(tl.where(keep_T[:, None], q_TE, 0.0), axis=0)
    tl.store(part_ptr + (b * NC + c) * E + e_E, part_E, mask=lane_ok_E)


@triton.jit
def _balance_sums_bwd_kernel(
    logits_ptr,  # [T, E], strides (stride_lt, stride_le)
    mask_ptr,  # bool [T] as int8 (read iff HAS_MASK)
    g_ptr,  # fp32 [B, E] contiguous: gradient of the segment sums
    dlogits_ptr,  # [T, E] contiguous out, logits' dtype
    T,
    S,
    stride_lt,
    stride_le,
    E: tl.constexpr,
    SOFTMAX: tl.constexpr,
    SQRTSP: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """d(logits) of :func:`_balance_sums_fwd_kernel`: token t gets g = grad[t // S] (0 if
    padded); softmax: q * (g - sum g q); normalised scores q = s / (Z + eps):
    ds = (g - sum g q) / (Z + eps), then ds * s (1 - s) (sigmoid) or ds * sigmoid(x) / (2 s)
    (sqrtsoftplus). Grid: ``(cdiv(T, BLOCK_T),)``."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = t < T
    e_E = tl.arange(0, BLOCK_E)
    lane_ok_E = e_E < E
    x_TE, s_TE, m_T, den_T = _load_scores(logits_ptr, t, row_ok, stride_lt, stride_le, e_E, lane_ok_E, SOFTMAX,
                                          False, BLOCK_T, SQRTSP)
    keep_T = row_ok
    if HAS_MASK:
        keep_T = keep_T & (tl.load(mask_ptr + t, mask=row_ok, other=0) != 0)
    seg_T = t // S
    g_TE = tl.load(g_ptr + seg_T[:, None] * E + e_E[None, :], mask=keep_T[:, None] & lane_ok_E[None, :], other=0.0)
    if SOFTMAX:
        dot_T = tl.sum(tl.where(lane_ok_E[None, :], g_TE * s_TE, 0.0), axis=1)
        dl_TE = s_TE * (g_TE - dot_T[:, None])
    else:
        zp_T = tl.sum(tl.where(lane_ok_E[None, :], s_TE, 0.0), axis=1) + AUX_EPS
        dot_T = tl.sum(tl.where(lane_ok_E[None, :], g_TE * (s_TE / zp_T[:, None]), 0.0), axis=1)
        ds_TE = (g_TE - dot_T[:, None]) / zp_T[:, None]
        if SQRTSP:
            sig_TE = 1.0 / (1.0 + tl.exp(-x_TE))
            dl_TE = tl.where(s_TE > 0, ds_TE * sig_TE / tl.where(s_TE > 0, 2.0 * s_TE, 1.0), 0.0)
        else:
            dl_TE = ds_TE * (s_TE * (1.0 - s_TE))
    out = dlogits_ptr + t[:, None] * E + e_E[None, :]
    tl.store(out, dl_TE.to(dlogits_ptr.dtype.element_ty), mask=row_ok[:, None] & lane_ok_E[None, :])
