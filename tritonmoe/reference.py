"""Plain-PyTorch implementations of every tritonmoe op.

These are the ground truth for the kernels' tests, the default on CPU and a baseline in the
benchmark harness. They are written to be read: vectorized over tokens, a Python loop only over
experts where a GEMM per expert is the clearest statement. They take already-validated
arguments; the public, validating entry points are in :mod:`tritonmoe.functional`.

Precision: scores, weights and every accumulation are fp32 (fp64 when the inputs are fp64);
outputs have the input dtype unless stated.

Row invariance (fp64): the fp64 grouped GEMMs and activations are computed so that every row of
their outputs and input gradients depends only on its own input row and the weights, so any
partition of the rows (the micro-batches of a pipelined expert-parallel layer) gives
bitwise-identical rows; their weight gradients are one ``x_e^T @ dy_e`` per expert, which a
pipeline can defer to one step over all rows (:mod:`tritonmoe.core.exact`). This is what makes the
pipelined layer bitwise equal to the unpipelined one in fp64. It costs speed (M = 1 batched
products, scalar transcendentals), which only tests pay: fp32, bf16 and fp16 run plain
per-expert matmuls and vectorized activations.

Non-finite logits (identical on every backend; the rules are in this module, below):

* A NaN selection value ranks as -inf: it is chosen only after every finite value, lower expert
  id first, and its weight is NaN (so the output is NaN, loudly, rather than silently wrong).
  Without a bias the selection value is the logit, so under softmax a NaN logit ranks last while
  the other experts keep their order (all weights of that token are NaN: softmax spreads it).
* ``-inf`` logits are a valid mask: softmax gives score 0, sigmoid gives 0.
* With ``renormalize``, the weights are divided by ``max(sum, 1e-20)``, so a token whose selected
  scores are all 0 gets zero weights instead of 0/0.
* The public entry point rejects NaN logits, +inf logits under softmax and rows that are all
  -inf under softmax (NaN scores) while validation is on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tritonmoe.core.autograd import first_order

from tritonmoe.core.exact import (
    WeightGradSlot,
    elementwise_scalar,
    grouped_wgrad,
    row_invariant_grouped_gemm,
    rowwise_mm,
)
from tritonmoe.core import validation as V
from tritonmoe.core.types import PermuteInfo, Routing, max_permuted_rows

__all__ = [
    "expert_bias_finite",
    "nan_weights_if_nonfinite",
    "scores",
    "canonical_exp",
    "canonical_scores",
    "selection_values",
    "route",
    "load_balancing_loss",
    "z_loss",
    "aux_scores",
    "balance_score_sums",
    "switch_loss",
    "AUX_EPS",
    "permute",
    "permute_metadata",
    "permute_rows",
    "max_permuted_rows",
    "unpermute",
    "grouped_gemm",
    "grouped_ffn",
    "moe_ffn",
    "apply_activation",
    "RENORM_EPS",
    "GROUP_SCORES",
    "copy_segments",
]

#: Floor of the renormalization denominator (a token whose selected scores are all zero).
RENORM_EPS = 1e-20

#: How group-limited routing scores a group: the sum of its two largest selection values
#: (DeepSeek-V3), its largest (DeepSeek-V2's group_limited_greedy), or the sum of its
#: top_k // topk_groups largest (Megatron-Core's rule; see :func:`selection_values`).
GROUP_SCORES = ("top2sum", "max", "sum_topn")

#: Added to the per-token sum when the balance loss normalises sigmoid / sqrtsoftplus scores over
#: the experts (Megatron-Core's constant; :func:`aux_scores`).
AUX_EPS = 1e-20


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scores(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """fp32 (fp64 for fp64 logits) router scores."""
    lf = logits_TE.to(_acc_dtype(logits_TE.dtype))
    if score_func == "softmax":
        return torch.softmax(lf, dim=-1)
    if score_func == "sqrtsoftplus":
        return F.softplus(lf).sqrt()
    return torch.sigmoid(lf)


def aux_scores(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """The per-token expert distribution the load-balancing loss averages (its P_e), fp32 (fp64
    for fp64 logits): softmax probabilities, or for "sigmoid" and "sqrtsoftplus" the scores
    normalised over all E experts, ``s / (sum_e s + AUX_EPS)`` (Megatron-Core, DeepSeek-V3). Each
    row sums to 1 (up to AUX_EPS), so the loss cannot be lowered by moving every logit of a token
    together, which the raw sigmoid could."""
    s_TE = scores(logits_TE, score_func)
    if score_func == "softmax":
        return s_TE
    return s_TE / (s_TE.sum(dim=-1, keepdim=True) + AUX_EPS)


def _routed(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Which ids route a slot: those in [0, E). -1 means "not routed"; any other id (possible only
    with validation off) is treated alike on every backend, never used as an index."""
    return (ids >= 0) & (ids < num_experts)


def _scatter_count(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E] histogram of the routed ids (:func:`_routed`). No host sync (unlike bincount)."""
    ids = ids.reshape(-1).long()
    flat = torch.where(_routed(ids, num_experts), ids + 1, torch.zeros_like(ids))
    out = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    out.scatter_add_(0, flat, torch.ones_like(flat))
    return out[1:].to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Canonical selection values (identical on every backend: selection is exact)
# ---------------------------------------------------------------------------------------------
#
# Which experts a token gets must not depend on how a backend rounds exp or division: two
# softmax scores one ulp apart can swap order between torch's expf, a GPU's approximate ex2 and
# numpy's exp. So selection never compares the scores the weights are made of. It compares:
#
# * no expert_bias: the logits themselves (fp32; fp16/bf16 convert exactly). Softmax and sigmoid
#   are monotone in the logit, so this is the order of the true scores; logits that are equal
#   tie (lower id wins) and logits that differ never tie, however the scores round.
# * with expert_bias: ``canonical_scores(logits) + bias`` in fp32, where canonical_scores uses
#   only IEEE-754 correctly rounded operations (+, -, *, /, floor, comparisons, exact bit
#   manipulation) in one fixed order with no fused multiply-add: every backend that follows the
#   recipe gets the same bits. Its exp is :func:`canonical_exp` (a Cody-Waite reduction and a
#   degree-7 Taylor polynomial, within ~2 ulp of exp; below -86 it is 0 and above 88 +inf, so no
#   subnormal result can meet a flush-to-zero unit); the softmax denominator is a pairwise sum
#   in a fixed tree (:func:`_canonical_tree_sum`); the division is correctly rounded.
# * group scores: "max" of the selection values of a group; "top2sum" of its two largest
#   selection values with a bias, and without one of its two largest *canonical* scores (for
#   softmax the unnormalized canonical exp(x - m): the row's common denominator does not change
#   the order of the groups, and leaving it out saves the tree sum).
#
# The Triton router computes the same recipe (kernels/_routing_kernels.py) and is compiled with
# FMA contraction off for that reason. Limits: the recipe holds for fp16/bf16/fp32 logits (fp64
# logits are routed by this reference only, in fp64); a backend that contracts a*b+c into an
# FMA (torch.compile's generated code may) or flushes subnormal inputs can differ by an ulp in
# the selection value and so pick a different expert at a near-tie.

#: fp32 constants of :func:`canonical_exp` (each exactly representable in fp32).
_LOG2E = float.fromhex("0x1.715476p+0")  # log2(e) rounded to fp32
_LN2_HI = 0.693359375  # 355/512: n * _LN2_HI is exact for the |n| <= 128 used here
_LN2_LO = float.fromhex("-0x1.bd0106p-13")  # ln(2) - _LN2_HI rounded to fp32
#: Taylor coefficients 1/7!, 1/6!, ..., 1/2! rounded to fp32 (Horner order).
_EXP_POLY = tuple(float.fromhex(h) for h in ("0x1.a01a02p-13", "0x1.6c16c2p-10", "0x1.111112p-7",
                                             "0x1.555556p-5", "0x1.555556p-3", "0x1p-1"))
#: Below this canonical_exp is 0, above the next +inf: results stay normal fp32 numbers.
EXP_MIN = -86.0
EXP_MAX = 88.0


def canonical_exp(y: torch.Tensor) -> torch.Tensor:
    """exp of fp32 ``y`` by a fixed recipe of correctly rounded fp32 operations (the one the
    Triton router computes bit for bit): 0 below -86 (and for -inf), +inf above 88, NaN for
    NaN; else 2^n * p(r) with n = floor(y*log2e + 1/2), r = (y - n*LN2_HI) - n*LN2_LO and p the
    degree-7 Taylor polynomial in Horner form. Within ~2 ulp of exp (it is a selection value, not
    a weight)."""
    nan = torch.isnan(y)
    under = y < EXP_MIN
    over = y > EXP_MAX
    yc = torch.where(nan | under | over, torch.zeros_like(y), y)
    n = torch.floor(yc * _LOG2E + 0.5)
    r = (yc - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = p * r + c
    p = p * r + 1.0
    p = p * r + 1.0
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n, exact (n in [-124, 127])
    out = p * two_n
    out = torch.where(under, torch.zeros_like(out), out)
    out = torch.where(over, torch.full_like(out, float("inf")), out)
    return torch.where(nan, y, out)


def _canonical_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + canonical_exp(-x)), the division correctly rounded."""
    d = 1.0 + canonical_exp(-x)
    return torch.ones_like(d) / d


#: 2 / (2i + 1) rounded to fp32, i = 8, 7, ..., 0 (Horner order): log1p(u) = 2 atanh(u / (2 + u)).
_LOG1P_POLY = tuple(float(torch.tensor(2.0 / (2 * i + 1), dtype=torch.float32)) for i in range(8, -1, -1))


def _canonical_sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)) by a fixed recipe of correctly rounded fp32 operations (the Triton
    router's, bit for bit): softplus(x) = [x > 0] * x + log1p(u), u = canonical_exp(-|x|) in
    [0, 1], log1p(u) = z * p(z^2) with z = u / (2 + u) in [0, 1/3] and p the atanh series to
    z^17 (Horner; within a few ulp); the square root correctly rounded. NaN stays NaN."""
    u = canonical_exp(-x.abs())
    z = u / (2.0 + u)
    w = z * z
    p = torch.full_like(w, _LOG1P_POLY[0])
    for c in _LOG1P_POLY[1:]:
        p = p * w + c
    sp = torch.where(x > 0, x, torch.zeros_like(x)) + z * p
    return torch.sqrt(sp)


def _canonical_unnormalized(x_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Canonical scores up to a per-token positive factor (softmax without its denominator): the
    values top-2 group scores without a bias sum."""
    if score_func == "softmax":
        return canonical_exp(x_TE - _row_max(x_TE))
    if score_func == "sqrtsoftplus":
        return _canonical_sqrtsoftplus(x_TE)
    return _canonical_sigmoid(x_TE)


def _row_max(x_TE: torch.Tensor) -> torch.Tensor:
    """[T, 1] max of each row over its non-NaN entries (-inf if none): a NaN logit does not move
    the other experts' canonical values (backends disagree on max with NaN; this is defined)."""
    return torch.where(torch.isnan(x_TE), torch.full_like(x_TE, float("-inf")), x_TE).amax(dim=-1, keepdim=True)


def _canonical_tree_sum(v_TGS: torch.Tensor) -> torch.Tensor:
    """[T] fixed-order sum of [T, G, S]: each group's S values padded with zeros to a power of two,
    the groups padded with zero groups to a power of two, then the flat row summed by adjacent
    pairs (v[0::2] + v[1::2]) until one value is left. The Triton router's tile holds a row in
    exactly this lane order, so it sums the same pairs."""
    T, G, S = v_TGS.shape
    bs, bg = 1 << max(S - 1, 0).bit_length(), 1 << max(G - 1, 0).bit_length()
    v = F.pad(v_TGS, (0, bs - S, 0, bg - G)).reshape(T, bg * bs)
    while v.shape[-1] > 1:
        v = v[:, 0::2] + v[:, 1::2]
    return v[:, 0]


def canonical_scores(logits_TE: torch.Tensor, score_func: str, n_groups: int | None = None) -> torch.Tensor:
    """The canonical fp32 scores of fp16/bf16/fp32 logits (see the section comment): sigmoid as
    1 / (1 + canonical_exp(-x)); sqrtsoftplus by :func:`_canonical_sqrtsoftplus`; softmax as canonical_exp(x - m) / tree_sum(canonical_exp(x - m)),
    m the row max over non-NaN logits, the tree over the [n_groups, E / n_groups] layout. What
    selection with ``expert_bias`` compares (plus the bias); not the weights."""
    x_TE = logits_TE.float()
    if score_func == "sigmoid":
        return _canonical_sigmoid(x_TE)
    if score_func == "sqrtsoftplus":
        return _canonical_sqrtsoftplus(x_TE)
    T, E = x_TE.shape
    G = n_groups if n_groups is not None and n_groups > 1 else 1
    e_TE = canonical_exp(x_TE - _row_max(x_TE))
    den_T = _canonical_tree_sum(e_TE.view(T, G, E // G))
    return e_TE / den_T.unsqueeze(-1)


def _orderable(v: torch.Tensor) -> torch.Tensor:
    """NaN as -inf (ranked last) and -0 as +0 (a tie: CUDA's radix sort would order them)."""
    v = torch.where(torch.isnan(v), torch.full_like(v, float("-inf")), v)
    return torch.where(v == 0, torch.zeros_like(v), v)


def selection_values(
    logits_TE: torch.Tensor,
    score_func: str,
    expert_bias: torch.Tensor | None = None,
    n_groups: int | None = None,
    group_score: str = "top2sum",
    top_n: int = 2,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(selection value [T, E], group score [T, G] or None): what routing compares, NaN as -inf
    and -0 as +0.

    Group scores: "max" of the selection values of a group; "top2sum" of its two largest
    selection values with a bias, of its two largest canonical scores without one; "sum_topn"
    (Megatron-Core) of its ``top_n`` largest values, summed largest first one by one, where the
    values are the selection values with a bias, and without one the logits under softmax
    (Megatron's top-k before the softmax) and the canonical scores under sigmoid / sqrtsoftplus.

    fp16/bf16/fp32 logits: the canonical fp32 values of the section comment, identical on every
    backend. fp64 logits (routed by this reference only): the logits, or fp64 scores plus the
    bias, and fp64 group scores; the order of exact arithmetic.
    """
    T, E = logits_TE.shape
    fp64 = logits_TE.dtype == torch.float64
    x_TE = logits_TE.detach().to(torch.float64 if fp64 else torch.float32)
    grouped = n_groups is not None and n_groups > 1
    G = n_groups if grouped else 1
    if expert_bias is None:
        sel_TE = x_TE
    elif fp64:
        sel_TE = scores(x_TE, score_func) + expert_bias.double()
    else:
        sel_TE = canonical_scores(x_TE, score_func, G) + expert_bias.float()
    sel_TE = _orderable(sel_TE)
    if not grouped:
        return sel_TE, None
    S = E // G
    if group_score == "max" or S == 1 and group_score == "top2sum":
        return sel_TE, sel_TE.view(T, G, S).amax(dim=-1)
    if expert_bias is not None or (group_score == "sum_topn" and score_func == "softmax"):
        gval_TE = sel_TE
    elif fp64:
        gval_TE = _orderable(scores(x_TE, score_func))
    else:
        gval_TE = _orderable(_canonical_unnormalized(x_TE, score_func))
    n = 2 if group_score == "top2sum" else top_n
    # the n largest values, a repeated maximum counted again (topk keeps duplicates), added
    # largest first one at a time (the Triton router's order: the same bits)
    top_TGN = gval_TE.view(T, G, S).topk(n, dim=-1).values
    acc_TG = top_TGN[..., 0]
    for i in range(1, n):
        acc_TG = acc_TG + top_TGN[..., i]
    return sel_TE, _orderable(acc_TG)


def route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    renormalize: bool = True,
    expert_bias: torch.Tensor | None = None,
    n_groups: int | None = None,
    topk_groups: int | None = None,
    capacity: int | None = None,
    with_aux: bool = False,
    group_score: str = "top2sum",
    routed_scaling_factor: float = 1.0,
    drop_policy: str = "slot",
) -> Routing:
    """Top-k routing; see :func:`tritonmoe.route` for the contract. Selection compares the
    canonical values of :func:`selection_values`; the weights are the fp32 scores of
    :func:`scores` (softmax / sigmoid / sqrtsoftplus of the logits as torch computes them)."""
    T, E = logits_TE.shape
    s_TE = scores(logits_TE, score_func)
    top_n = top_k // topk_groups if topk_groups else 2
    sel_TE, gscore_TG = selection_values(logits_TE, score_func, expert_bias, n_groups, group_score, top_n)

    order_TE = torch.sort(sel_TE, dim=-1, descending=True, stable=True).indices
    if gscore_TG is not None:
        G = n_groups
        # Best topk_groups groups, ties to the lower group index (stable sort).
        gorder_TG = torch.sort(gscore_TG, dim=-1, descending=True, stable=True).indices
        keep_TG = torch.zeros(T, G, dtype=torch.bool, device=logits_TE.device)
        keep_TG.scatter_(1, gorder_TG[:, :topk_groups], True)
        allowed_TE = keep_TG.repeat_interleave(E // G, dim=1)
        # Allowed experts first, each part still in descending score / ascending id order: a
        # stable sort by "allowed" of the score order (an -inf score inside a kept group must
        # still beat every expert of a dropped group).
        allowed_sorted = allowed_TE.gather(1, order_TE).to(torch.int8)
        order_TE = order_TE.gather(1, torch.sort(allowed_sorted, dim=-1, descending=True, stable=True).indices)
    ids_TK = order_TE[:, :top_k]

    w_TK = s_TE.gather(1, ids_TK)
    if renormalize:
        w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True).clamp_min(RENORM_EPS)
    if routed_scaling_factor != 1.0:
        w_TK = w_TK * routed_scaling_factor
    w_TK = w_TK.float() if w_TK.dtype != torch.float64 else w_TK

    selected_counts_E = _scatter_count(ids_TK, E)
    if capacity is not None:
        prio_TK = None
        if drop_policy == "probs":
            prio_TK = drop_priority(logits_TE, ids_TK, score_func, renormalize, routed_scaling_factor, w_TK, n_groups)
        keep_TK = _capacity_keep(ids_TK, selected_counts_E, capacity, drop_policy, prio_TK)
        ids_TK = torch.where(keep_TK, ids_TK, torch.full_like(ids_TK, -1))
        w_TK = torch.where(keep_TK, w_TK, torch.zeros_like(w_TK))
        counts_E = _scatter_count(ids_TK, E)
    else:
        counts_E = selected_counts_E

    routing = Routing(
        topk_ids=ids_TK.to(torch.int32),
        topk_weights=w_TK,
        counts=counts_E,
        selected_counts=selected_counts_E,
        score_func=score_func,
    )
    if with_aux:
        routing.score_sum = (s_TE if score_func == "softmax" else s_TE / (s_TE.sum(-1, keepdim=True) + AUX_EPS)).sum(0)
        routing.logsumexp = torch.logsumexp(logits_TE.to(s_TE.dtype), dim=-1)
    return routing


def drop_priority(logits_TE: torch.Tensor, ids_TK: torch.Tensor, score_func: str, renormalize: bool,
                  scale: float, w_TK: torch.Tensor, n_groups: int | None = None) -> torch.Tensor:
    """[T, k] value the "probs" drop policy ranks a slot by: the slot's final weight computed
    canonically, so that every backend keeps the same slots (the weights themselves may differ
    in the last bit between backends). fp16/bf16/fp32: the canonical score at the id
    (:func:`canonical_scores`), renormalised by the sum of the token's k canonical scores added
    in slot order (floored at RENORM_EPS, the division correctly rounded), times the scaling
    factor; NaN as -inf. fp64 (this reference only): the fp64 weights."""
    if logits_TE.dtype == torch.float64:
        return _orderable(w_TK.detach())
    c_TK = canonical_scores(logits_TE.detach(), score_func, n_groups).gather(1, ids_TK)
    if renormalize:
        den_T = c_TK[:, 0]
        for j in range(1, c_TK.shape[1]):
            den_T = den_T + c_TK[:, j]
        c_TK = c_TK / torch.where(den_T < RENORM_EPS, torch.full_like(den_T, RENORM_EPS), den_T).unsqueeze(1)
    return _orderable(c_TK * scale)


def _rank_in_expert(flat: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Each entry's position among the entries of its expert, in the order of ``flat``."""
    order = torch.argsort(flat, stable=True)  # grouped by expert, the given order inside
    starts = torch.cumsum(counts_E.long(), 0) - counts_E.long()  # exclusive
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank


def _capacity_keep(ids_TK: torch.Tensor, counts_E: torch.Tensor, capacity: int, policy: str = "slot",
                   priority_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Which slots survive capacity; each expert keeps the first ``capacity`` of its slots in the
    policy's order: "slot" (slot j, then token t: every first choice before any second choice,
    GShard), "position" (token t: the earliest tokens), "probs" (``priority`` descending, then
    token t: the highest weights; :func:`drop_priority`)."""
    T, K = ids_TK.shape
    if policy == "slot":
        return (_rank_in_expert(ids_TK.t().reshape(-1).long(), counts_E) < capacity).view(K, T).t()
    flat = ids_TK.reshape(-1).long()  # token-major: (t, j) -> t*K + j; a token holds an expert once
    if policy == "position":
        return (_rank_in_expert(flat, counts_E) < capacity).view(T, K)
    # probs: visit the slots by descending priority (stable: ties keep token order), rank in expert
    by_prio = torch.sort(priority_TK.reshape(-1), descending=True, stable=True).indices
    rank = torch.empty_like(by_prio)
    rank[by_prio] = _rank_in_expert(flat[by_prio], counts_E)
    return (rank < capacity).view(T, K)


def switch_loss(score_sum_E: torch.Tensor, freq_E: torch.Tensor, num_tokens) -> torch.Tensor:
    """E * sum_e f_e * P_e with P_e = score_sum_e / num_tokens: the Switch balance loss from its
    parts (the frequencies are constants; the gradient flows through the score sums). Zero
    (in the graph) for num_tokens = 0."""
    E = score_sum_E.shape[-1]
    num = E * (freq_E.to(score_sum_E.dtype) * score_sum_E).sum(-1)
    if isinstance(num_tokens, torch.Tensor):
        return num / num_tokens.to(num.dtype).clamp_min(1)
    return num / num_tokens if num_tokens else num * 0.0


def selected_slot_counts(routing: Routing, padding_mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [E] slots per expert the balance loss counts: ``routing.selected_counts`` (before
    capacity dropping), or with a padding mask the real tokens' routed slots (``topk_ids``: equal
    to the selected slots when capacity dropped none; a dropped slot is not counted)."""
    if padding_mask_T is None:
        return routing.selected_counts
    ids_TK = torch.where(padding_mask_T.unsqueeze(1), routing.topk_ids, torch.full_like(routing.topk_ids, -1))
    return _scatter_count(ids_TK, routing.num_experts)


def balance_score_sums(
    logits_TE: torch.Tensor,
    score_func: str,
    padding_mask: torch.Tensor | None = None,
    sequence_length: int | None = None,
) -> torch.Tensor:
    """[B, E] sums of :func:`aux_scores` over each segment's real tokens: B = T / S segments of
    ``sequence_length`` S tokens (batch-major), or one segment of all T tokens; padded tokens
    (``padding_mask`` False) add nothing. fp32 (fp64 for fp64 logits), differentiable. The
    Triton kernel of the balance losses computes the same (:mod:`tritonmoe.kernels.routing`)."""
    T, E = logits_TE.shape
    q_TE = aux_scores(logits_TE, score_func)
    if padding_mask is not None:
        q_TE = torch.where(padding_mask.unsqueeze(1), q_TE, torch.zeros((), dtype=q_TE.dtype, device=q_TE.device))
    if sequence_length is None:
        return q_TE.sum(0, keepdim=True)
    return q_TE.view(T // sequence_length, sequence_length, E).sum(1)


def load_balancing_loss(
    logits_TE: torch.Tensor,
    routing: Routing,
    *,
    sequence_length: int | None = None,
    padding_mask: torch.Tensor | None = None,
    score_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """E * sum_e f_e * P_e (Switch Transformer; see :func:`tritonmoe.load_balancing_loss`).

    f_e = selected slots of e before capacity dropping / (T*k), P_e = mean over tokens of
    :func:`aux_scores` (softmax probabilities; sigmoid / sqrtsoftplus scores normalised over the
    E experts). Differentiable through P_e only. Zero for T = 0.

    ``sequence_length`` S: the tokens are [B, S] flattened batch-major and the loss is the mean
    over the B sequences of each sequence's own loss (DeepSeek's sequence-wise balance loss).
    ``padding_mask`` (bool [T], True = real): padded tokens leave f, P and the token counts (a
    sequence of padding only contributes 0). With either option f counts the routed slots of
    ``routing.topk_ids`` (per token; after capacity dropping, since the selection of a dropped
    slot is not kept): equal to the selected slots when nothing was dropped. ``score_sums``: the
    [B, E] :func:`balance_score_sums` of these options when already computed (a kernel's). fp32
    (fp64 for fp64 logits).
    """
    T, E = logits_TE.shape
    k = routing.top_k
    if sequence_length is None and padding_mask is None:
        if score_sums is not None:
            score_sum_E = score_sums[0]
        elif routing.score_sum is not None:
            score_sum_E = routing.score_sum
        else:
            score_sum_E = aux_scores(logits_TE, routing.score_func).sum(dim=0)
        if T == 0:
            return score_sum_E.sum() * 0.0
        f_E = routing.selected_counts.to(score_sum_E.dtype) / (T * k)  # T may be a SymInt (torch.compile)
        return E * (f_E * score_sum_E).sum() / T
    if score_sums is None:
        score_sums = balance_score_sums(logits_TE, routing.score_func, padding_mask, sequence_length)
    dtype = score_sums.dtype
    if sequence_length is None:  # padding_mask given
        n = padding_mask.sum()
        f_E = selected_slot_counts(routing, padding_mask).to(dtype) / (k * n.clamp_min(1)).to(dtype)
        return switch_loss(score_sums[0], f_E, n)
    S = sequence_length
    B = T // S
    if B == 0:
        return score_sums.sum() * 0.0
    ids_TK = routing.topk_ids.long()
    if padding_mask is not None:
        ids_TK = torch.where(padding_mask.unsqueeze(1), ids_TK, torch.full_like(ids_TK, -1))
    # per-sequence counts: a histogram over (sequence, expert) of the routed slots
    seq_TK = torch.arange(T, device=ids_TK.device).unsqueeze(1).expand_as(ids_TK) // S
    flat = torch.where(_routed(ids_TK, E), seq_TK * E + ids_TK + 1, torch.zeros_like(ids_TK)).reshape(-1)
    cnt = torch.zeros(B * E + 1, dtype=torch.int64, device=ids_TK.device)
    cnt.scatter_add_(0, flat, torch.ones_like(flat))
    cnt_BE = cnt[1:].view(B, E).to(dtype)
    n_B = padding_mask.view(B, S).sum(1) if padding_mask is not None else torch.full(
        (B,), S, dtype=torch.int64, device=score_sums.device)
    f_BE = cnt_BE / (k * n_B.clamp_min(1)).to(dtype).unsqueeze(1)
    return switch_loss(score_sums, f_BE, n_B).mean()


def z_loss(logits_TE: torch.Tensor, routing: Routing | None = None, *,
           padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE), fp32; uses ``routing.logsumexp`` when present.
    ``padding_mask``: the mean over the real tokens only. Zero for T = 0 (or no real token)."""
    if routing is not None and routing.logsumexp is not None:
        lse_T = routing.logsumexp
    else:
        lse_T = torch.logsumexp(logits_TE.to(_acc_dtype(logits_TE.dtype)), dim=-1)
    if lse_T.numel() == 0:
        return lse_T.sum() * 0.0
    if padding_mask is not None:
        sq = torch.where(padding_mask, lse_T.square(), torch.zeros((), dtype=lse_T.dtype, device=lse_T.device))
        return sq.sum() / padding_mask.sum().clamp_min(1).to(lse_T.dtype)
    return lse_T.square().mean()


def permute_metadata(topk_ids_TK: torch.Tensor, num_experts: int, pad_to: int = 1) -> PermuteInfo:
    """The :class:`PermuteInfo` of :func:`permute` without moving any row (no host sync): counts,
    expert_offsets padded to ``pad_to`` and slot_rows in the stable order (by expert, then token,
    then slot); slots with id -1 (or any id outside [0, E)) get row -1."""
    T, K = topk_ids_TK.shape
    E = num_experts
    dev = topk_ids_TK.device
    flat = topk_ids_TK.reshape(-1).long()  # token-major: (t, j) -> t*K + j
    key = torch.where(_routed(flat, E), flat, torch.full_like(flat, E))  # unrouted slots sort last
    order = torch.argsort(key, stable=True)  # by expert, then token, then slot
    key_sorted = key[order]

    counts_E = _scatter_count(topk_ids_TK, E)
    c = counts_E.long()
    padded_E = (c + pad_to - 1) // pad_to * pad_to
    offsets = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded_E, 0)
    starts_E = torch.cumsum(c, 0) - c  # unpadded exclusive starts in the sorted order

    routed = key_sorted < E
    e_sorted = key_sorted.clamp(max=E - 1)
    pos = torch.arange(flat.numel(), device=dev)
    row_sorted = torch.where(routed, offsets[e_sorted] + pos - starts_E[e_sorted], torch.full_like(pos, -1))
    slot_rows = torch.empty_like(row_sorted)
    slot_rows[order] = row_sorted
    return PermuteInfo(
        expert_offsets=offsets, slot_rows=slot_rows.view(T, K), counts=counts_E, num_tokens=T, pad_to=pad_to
    )


def permute_rows(x_TD: torch.Tensor, info: PermuteInfo, num_rows: int | None = None) -> torch.Tensor:
    """The row movement of :func:`permute` for a given ``info``: [N, d] with
    ``x_perm[slot_rows[t, j]] == x[t]`` and every other row zero. N = ``num_rows`` (at least R;
    no host sync) or R read from ``info`` (one host sync)."""
    T, K = info.slot_rows.shape
    rows = info.slot_rows.reshape(-1)
    if num_rows is None:
        num_rows = int(info.expert_offsets[-1])  # host sync: the output's row count depends on the routing
    # Source token of each row; padding rows (and rows past R) read a zero row appended at index T.
    src_ext = torch.full((num_rows + 1,), T, dtype=torch.int64, device=x_TD.device)
    src_ext[torch.where(rows >= 0, rows, torch.full_like(rows, num_rows))] = (
        torch.arange(T * K, device=x_TD.device) // K
    )
    x_ext = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])], dim=0)
    return x_ext[src_ext[:num_rows]]


def permute(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int, *, pad_to: int = 1, num_rows: int | None = None
) -> tuple[torch.Tensor, PermuteInfo]:
    """Gather token rows into expert-grouped order; see :func:`tritonmoe.permute`. ``num_rows``
    (>= :func:`max_permuted_rows`): a buffer of that many rows, rows past R zero, no host sync."""
    info = permute_metadata(topk_ids_TK, num_experts, pad_to)
    return permute_rows(x_TD, info, num_rows), info


def unpermute(y_perm_RD: torch.Tensor, info: PermuteInfo, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over routed j of w[t,j] * y_perm[slot_rows[t,j]], accumulated in fp32. A slot
    whose row lies outside [0, R) (-1, or any row with validation off) contributes nothing."""
    R, D = y_perm_RD.shape
    acc = _acc_dtype(y_perm_RD.dtype)
    rows_TK = info.slot_rows.long()
    routed_TK = (rows_TK >= 0) & (rows_TK < R)
    y_ext = torch.cat([y_perm_RD.to(acc), y_perm_RD.new_zeros(1, D, dtype=acc)], dim=0)
    g_TKD = y_ext[torch.where(routed_TK, rows_TK, torch.full_like(rows_TK, R))]
    w_TK = torch.where(routed_TK, topk_weights_TK.to(acc), torch.zeros((), dtype=acc, device=y_perm_RD.device))
    out = (g_TKD * w_TK.unsqueeze(-1)).sum(dim=1)
    return out.to(y_perm_RD.dtype)


def _grouped_bias_grad(x_R0: torch.Tensor, dy_RN: torch.Tensor, offs: list, num_experts: int) -> torch.Tensor:
    """Per-expert bias gradient: the column sums of each expert's rows of dy -> [E, N] (``x`` is
    an empty [R, 0] stand-in, so that a :class:`tritonmoe.core.exact.WeightGradStore` can defer it
    exactly like a weight gradient)."""
    db = dy_RN.new_zeros(num_experts, dy_RN.shape[1])
    for e in range(num_experts):
        a, b = offs[e], offs[e + 1]
        if b > a:
            db[e] = dy_RN[a:b].sum(0)
    return db


class SegmentBias(torch.autograd.Function):
    """y + bias[e] on the rows of segment e (an elementwise add: row-invariant); the bias gradient
    is one column sum per expert over its rows, or, with a :class:`WeightGradSlot` whose store
    holds ``bias``, deferred to that store (so a pipelined schedule's bias gradient is bitwise the
    unscheduled one, like its weight gradients). With ``add=False`` y passes unchanged and only the
    bias gradient is produced, as if the bias had been added (Parm's ESP shards that do not add
    ``b2`` get its gradient this way)."""

    @staticmethod
    def forward(y_RN, offs, bias_EN, slot, add=True):
        if add:
            out = y_RN.clone()
            for e in range(bias_EN.shape[0]):
                a, b = offs[e], offs[e + 1]
                if b > a:
                    out[a:b] += bias_EN[e]
        else:
            out = y_RN.view_as(y_RN)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):  # a separate setup_context: torch.func can transform it
        y_RN, offs, bias_EN, slot = inputs[:4]
        ctx.offs = offs
        ctx.num_experts = bias_EN.shape[0]
        ctx.defer = None
        if slot is not None and bias_EN.requires_grad:
            site = slot.claim_site(bias_EN)
            if site is not None:
                ctx.defer = (slot, site, bias_EN)

    @staticmethod
    def backward(ctx, dy_RN):
        if ctx.defer is not None and torch.is_grad_enabled():
            return _deferred_bias_first_order(ctx, dy_RN)
        return _segment_bias_backward(ctx, dy_RN)


@first_order("a pipelined schedule's deferred bias gradient (fp64 reference)")
def _deferred_bias_first_order(ctx, dy_RN):
    return _segment_bias_backward(ctx, dy_RN)


def _segment_bias_backward(ctx, dy_RN):
    """:class:`SegmentBias`'s backward in differentiable torch ops (recorded under
    ``create_graph=True``)."""
    db = None
    if ctx.needs_input_grad[2]:
        x_R0 = dy_RN.new_empty(dy_RN.shape[0], 0)
        if ctx.defer is not None:
            slot, site, bias_EN = ctx.defer
            slot.add(bias_EN, site, x_R0, dy_RN, ctx.offs, _grouped_bias_grad)
        else:
            db = _grouped_bias_grad(x_R0, dy_RN, ctx.offs, ctx.num_experts)
    return dy_RN, None, db, None, None


def clamped_offsets(expert_offsets: torch.Tensor, num_rows: int) -> list[int]:
    """The offsets as host ints, each clamped into [0, R] and never below the one before it.

    Valid offsets pass unchanged. With validation off, an offset past R or below 0 is clamped
    into the buffer (as the Triton kernels clamp it), so no slice leaves the rows and the output
    keeps R rows; decreasing offsets are inconsistent metadata whose values are unspecified.
    Example: [-3, 2, 9] with R = 5 -> [0, 2, 5]; [0, 4, 2, 5] -> [0, 4, 4, 5].
    """
    out, lo = [], 0
    for o in expert_offsets.tolist():  # host sync: the reference slices rows per expert on the host
        lo = min(max(o, lo), num_rows)
        out.append(lo)
    return out


def _grouped_gemm_acc(
    x_RK: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_EKN: torch.Tensor,
    bias_EN: torch.Tensor | None = None,
    wgrad: WeightGradSlot | None = None,
) -> torch.Tensor:
    """grouped_gemm (plus the per-expert bias) in the accumulation dtype (not rounded to the input
    dtype). Rows outside [offsets[0], offsets[E]) are zero.

    fp64 (used by tests as the exact reference) is row-invariant: every output row, and every
    row of the input gradient, depends only on its own input row and the weights, so any
    partition of the rows (micro-batches of a pipeline) gives bitwise-identical rows, and its
    weight and bias gradients can be deferred to ``wgrad`` (see :mod:`tritonmoe.core.exact`). Other
    dtypes run one plain matmul per expert and compute their gradients in backward (``wgrad`` is
    not used: their forward is not row-invariant, so deferring would not make a schedule exact).
    """
    R = x_RK.shape[0]
    E, _, N = w_EKN.shape
    acc = _acc_dtype(x_RK.dtype)
    offs = clamped_offsets(expert_offsets, R)  # host sync: the reference slices the rows per expert
    if x_RK.dtype == torch.float64 and w_EKN.dtype == torch.float64:
        lo, hi = offs[0], offs[E]
        if lo == 0:
            y = row_invariant_grouped_gemm(x_RK, offs, w_EKN, wgrad)
        else:  # zero head rows (value checks off): the segments start at offs[0]
            inner = row_invariant_grouped_gemm(x_RK[lo:hi], [o - lo for o in offs], w_EKN, wgrad)
            y = torch.cat([x_RK.new_zeros(lo, N), inner, x_RK.new_zeros(R - hi, N)], dim=0)
        return y if bias_EN is None else SegmentBias.apply(y, offs, bias_EN, wgrad)
    # Every expert contributes a (possibly empty) piece, so the output stays in the autograd
    # graph of x, w and the bias even when no row is routed (zero gradients rather than no grad_fn).
    # Rows before offsets[0] (> 0 only with validation off) are zero, like the rows past offsets[E].
    # One split and one unbind, not E slices and E selects: autograd's backward of ``x[a:b]``
    # (``w[e]``) materializes a zero gradient of x's (w's) full size per expert and sums E of
    # them (E times x's bytes, E^2 times one expert's weights); split's and unbind's backward
    # concatenate (stack) the E pieces once. Same values: each expert's gradient lands in its
    # own rows (slice).
    xs = x_RK.split([offs[0]] + [offs[e + 1] - offs[e] for e in range(E)] + [R - offs[E]])
    ws = w_EKN.unbind(0)
    bs = bias_EN.unbind(0) if bias_EN is not None else None
    pieces = [x_RK.new_zeros(offs[0], N, dtype=acc)]
    for e in range(E):
        piece = xs[e + 1].to(acc) @ ws[e].to(acc)
        if bs is not None:
            piece = piece + bs[e].to(acc)
        pieces.append(piece)
    pieces.append(x_RK.new_zeros(R - offs[E], N, dtype=acc))
    return torch.cat(pieces, dim=0)


def grouped_gemm(
    x_RK: torch.Tensor,
    expert_offsets: torch.Tensor,
    w_EKN: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    wgrad: WeightGradSlot | None = None,
) -> torch.Tensor:
    """Rows in [offsets[e], offsets[e+1]) times w[e], plus bias[e] ([E, N]) when given; rows
    outside [offsets[0], offsets[E]) are zero. ``wgrad``: defer the weight and bias gradients to
    a schedule's store (fp64; :mod:`tritonmoe.core.exact`)."""
    return _grouped_gemm_acc(x_RK, expert_offsets, w_EKN, bias, wgrad).to(x_RK.dtype)


grouped_gemm.defers_weight_grad = True


def _activation(h: torch.Tensor, activation: str, limit: float, alpha: float, scalar: bool) -> torch.Tensor:
    """The activation on h; ``scalar``: every transcendental function runs on a view without a
    unit stride (:func:`tritonmoe.core.exact.elementwise_scalar`)."""
    if scalar:
        h = elementwise_scalar(h)
    if activation == "swiglu":
        f = h.shape[-1] // 2
        return F.silu(h[..., :f]) * h[..., f:]
    if activation == "swiglu_oai":
        # GPT-OSS (transformers' GptOssExperts): gate clamped from above, up from both sides, the
        # gradient passing at the limits (torch.clamp's rule); our w1 holds gate columns first.
        f = h.shape[-1] // 2
        gate = h[..., :f].clamp(max=limit)
        up = h[..., f:].clamp(min=-limit, max=limit)
        z = gate * alpha
        if scalar:  # gate is a fresh contiguous tensor: re-stride it before the exp
            z = elementwise_scalar(z)
        return (up + 1) * (gate * torch.sigmoid(z))
    if activation == "gelu":
        return F.gelu(h)  # exact erf form
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"activation={activation!r}; use 'swiglu', 'swiglu_oai', 'gelu' or 'relu'")


def apply_activation(h: torch.Tensor, activation: str, *, swiglu_limit: float = 7.0,
                     swiglu_alpha: float = 1.702) -> torch.Tensor:
    """The expert activation on a pre-activation h ([R, 2F] for the GLUs: gate, then up).

    "swiglu": silu(gate) * up. "swiglu_oai" (GPT-OSS): g = min(gate, swiglu_limit),
    u = clamp(up, -swiglu_limit, swiglu_limit), (u + 1) * g * sigmoid(swiglu_alpha * g).
    fp64 inputs are row-invariant (see :func:`tritonmoe.core.exact.elementwise_scalar`), like the fp64
    grouped GEMMs."""
    scalar = h.dtype == torch.float64 and activation != "relu"
    return _activation(h, activation, float(swiglu_limit), float(swiglu_alpha), scalar)


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
    wgrad: WeightGradSlot | None = None,
) -> torch.Tensor:
    """grouped_gemm(act(grouped_gemm(x, w1, b1)), w2, b2), the activation applied to the fp32
    accumulator (bias included) and rounded to the input dtype once (as a fused epilogue does).
    ``wgrad``: defer the weight and bias gradients to a schedule's store (fp64;
    :mod:`tritonmoe.core.exact`)."""
    h = _grouped_gemm_acc(x_RD, expert_offsets, w1_EDN, b1, wgrad)
    a = apply_activation(h, activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha).to(x_RD.dtype)
    return grouped_gemm(a, expert_offsets, w2_EFD, b2, wgrad=wgrad)


grouped_ffn.defers_weight_grad = True


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
    """The whole expert path of a MoE layer: permute -> grouped_ffn -> unpermute (weighted by
    ``routing.topk_weights``); [T, d] in x's dtype. The second bias is part of each expert's
    output, so the gate weight multiplies it too."""
    x_perm, info = permute(x_TD, routing.topk_ids, routing.num_experts)
    y_perm = grouped_ffn(x_perm, info.expert_offsets, w1_EDN, w2_EFD, activation, b1, b2,
                         swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    return unpermute(y_perm, info, routing.topk_weights)


# ---------------------------------------------------------------------------------------------
# Training forms of grouped_ffn and moe_ffn: the forward also returns the activations its
# backward needs (A [R, F] and the pre-activation H [R, N1], both in x's dtype, as the kernels
# write them), and the backward takes them, so it never reruns the first GEMM. They back the
# custom ops ``tritonmoe::grouped_ffn_train`` / ``moe_ffn_train`` (:mod:`tritonmoe.custom_ops`), whose
# autograd registration saves those outputs. The backward is explicit (per-expert GEMMs as the
# autograd of :func:`grouped_ffn` runs them); only the elementwise activation is re-evaluated
# (autograd over it, for its derivative). Equal to the autograd of :func:`grouped_ffn` /
# :func:`moe_ffn` to rounding (the same products; the gate-weight gradient of ``moe_ffn`` is
# summed as <A, dout @ w2^T> + <dout, b2>, as the kernels do, since y is not kept).
# ---------------------------------------------------------------------------------------------


def _segment_input_grad(dy_RN: torch.Tensor, offs: list, w_EKN: torch.Tensor) -> torch.Tensor:
    """Rows of each segment times w[e]^T (dy's dtype; rows outside the segments zero)."""
    acc = dy_RN.dtype
    out = dy_RN.new_zeros(dy_RN.shape[0], w_EKN.shape[1])
    for e in range(w_EKN.shape[0]):
        a, b = offs[e], offs[e + 1]
        if b > a:
            we = w_EKN[e].to(acc).t()
            out[a:b] = rowwise_mm(dy_RN[a:b], we) if acc == torch.float64 else dy_RN[a:b] @ we
    return out


def grouped_ffn_train(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`grouped_ffn`'s output and the activations its backward needs: ``(y [R, D],
    A [R, F], H [R, N1])``, not differentiable (see :func:`grouped_ffn_train_backward`)."""
    with torch.no_grad():
        h = _grouped_gemm_acc(x_RD, expert_offsets, w1_EDN, b1)
        a = apply_activation(h, activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha).to(x_RD.dtype)
        y = grouped_gemm(a, expert_offsets, w2_EFD, b2)
    return y, a, h.to(x_RD.dtype)


def _ffn_train_grads(dy_RD, da_RF, x_RD, offs, w1, w2, b1, b2, a_RF, h_RN, activation, swiglu_limit, swiglu_alpha,
                     needs):
    """(dx, dw1, dw2, db1, db2) of the grouped FFN from dy (accumulation dtype) and optionally
    dA already computed (accumulation dtype); None where ``needs`` is False."""
    need_x, need_w1, need_w2, need_b1, need_b2 = needs
    acc = dy_RD.dtype
    E = w1.shape[0]
    dx = dw1 = dw2 = db1 = db2 = None
    if need_w2:
        dw2 = grouped_wgrad(a_RF.to(acc), dy_RD, offs, E).to(w2.dtype)
    if need_b2:
        db2 = _grouped_bias_grad(dy_RD, dy_RD, offs, E).to(b2.dtype)
    if need_x or need_w1 or need_b1:
        if da_RF is None:
            da_RF = _segment_input_grad(dy_RD, offs, w2)
        da_RF = da_RF.to(x_RD.dtype).to(acc)  # the forward rounded A to x's dtype
        with torch.enable_grad():
            h_leaf = h_RN.to(acc).detach().requires_grad_()
            act = apply_activation(h_leaf, activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
            (dh,) = torch.autograd.grad(act, h_leaf, da_RF)
        if need_x:
            dx = _segment_input_grad(dh, offs, w1).to(x_RD.dtype)
        if need_w1:
            dw1 = grouped_wgrad(x_RD.to(acc), dh, offs, E).to(w1.dtype)
        if need_b1:
            db1 = _grouped_bias_grad(dh, dh, offs, E).to(b1.dtype)
    return dx, dw1, dw2, db1, db2


def grouped_ffn_train_backward(
    dy_RD: torch.Tensor,
    x_RD: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1_EDN: torch.Tensor,
    w2_EFD: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    a_RF: torch.Tensor,
    h_RN: torch.Tensor,
    activation: str = "swiglu",
    *,
    needs: tuple[bool, ...] = (True,) * 5,
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
) -> tuple:
    """The gradients (dx, dw1, dw2, db1, db2) of :func:`grouped_ffn` from the activations of
    :func:`grouped_ffn_train`, no GEMM rerun; None where ``needs`` (x, w1, w2, b1, b2) is False."""
    offs = clamped_offsets(expert_offsets, x_RD.shape[0])  # host sync: the reference slices rows per expert
    acc = _acc_dtype(x_RD.dtype)
    needs = (needs[0], needs[1], needs[2], needs[3] and b1 is not None, needs[4] and b2 is not None)
    return _ffn_train_grads(dy_RD.to(acc), None, x_RD, offs, w1_EDN, w2_EFD, b1, b2, a_RF, h_RN, activation,
                            float(swiglu_limit), float(swiglu_alpha), needs)


def moe_ffn_train(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_ffn`'s output and the activations its backward needs: ``(out [T, D],
    A [T*k, F], H [T*k, N1])`` with the rows in the permuted order of
    :func:`permute_metadata` (rows of unrouted slots zero, at the end); not differentiable."""
    T, k = routing.topk_ids.shape
    with torch.no_grad():
        x_perm, info = permute(x_TD, routing.topk_ids, w1_EDN.shape[0], num_rows=T * k)
        y_perm, a, h = grouped_ffn_train(x_perm, info.expert_offsets, w1_EDN, w2_EFD, activation, b1, b2,
                                         swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
        out = unpermute(y_perm, info, routing.topk_weights)
    return out, a, h


def moe_ffn_train_backward(
    dout_TD: torch.Tensor,
    x_TD: torch.Tensor,
    routing: Routing,
    w1_EDN: torch.Tensor,
    w2_EFD: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    a_RF: torch.Tensor,
    h_RN: torch.Tensor,
    activation: str = "swiglu",
    *,
    needs: tuple[bool, ...] = (True,) * 6,
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
) -> tuple:
    """The gradients (dx, d topk_weights, dw1, dw2, db1, db2) of :func:`moe_ffn` from the
    activations of :func:`moe_ffn_train`, no GEMM rerun; None where ``needs`` is False."""
    T, k = routing.topk_ids.shape
    E = w1_EDN.shape[0]
    rows = T * k
    acc = _acc_dtype(x_TD.dtype)
    info = permute_metadata(routing.topk_ids, E)
    offs = clamped_offsets(info.expert_offsets, rows)  # host sync: the reference slices rows per expert
    slot_rows = info.slot_rows.reshape(-1)
    routed = slot_rows >= 0
    # Token and gate weight of every row (rows of unrouted slots: token T, weight 0).
    tok = torch.full((rows + 1,), T, dtype=torch.int64, device=x_TD.device)
    tok[torch.where(routed, slot_rows, torch.full_like(slot_rows, rows))] = torch.arange(rows, device=x_TD.device) // k
    tok = tok[:rows]
    w_S = torch.where(routed, routing.topk_weights.reshape(-1).to(acc), torch.zeros((), dtype=acc, device=x_TD.device))
    w_R = torch.zeros(rows + 1, dtype=acc, device=x_TD.device)
    w_R[torch.where(routed, slot_rows, torch.full_like(slot_rows, rows))] = w_S
    w_R = w_R[:rows]
    g_RD = torch.cat([dout_TD.to(acc), dout_TD.new_zeros(1, dout_TD.shape[1], dtype=acc)])[tok]  # dout per row
    need_x, need_w, need_w1, need_w2, need_b1, need_b2 = needs
    need_b1, need_b2 = need_b1 and b1 is not None, need_b2 and b2 is not None
    du_RF = _segment_input_grad(g_RD, offs, w2_EFD) if (need_x or need_w or need_w1 or need_b1) else None
    dgate = None
    if need_w:
        # d w[t, j] = <dout[t], y_row> with y_row = A_row @ w2[e] + b2[e] = <A_row, dout[t] @ w2[e]^T> + <dout[t], b2[e]>
        part = (a_RF.to(acc) * du_RF).sum(1)
        if b2 is not None:
            e_R = torch.repeat_interleave(torch.arange(E, device=x_TD.device), torch.tensor(
                [offs[e + 1] - offs[e] for e in range(E)], device=x_TD.device), output_size=offs[E])
            bias_R = torch.zeros(rows, dtype=acc, device=x_TD.device)
            bias_R[: offs[E]] = (g_RD[: offs[E]] * b2.to(acc)[e_R]).sum(1)
            part = part + bias_R
        part_ext = torch.cat([part, part.new_zeros(1)])
        dgate = part_ext[torch.where(routed, slot_rows, torch.full_like(slot_rows, rows))].view(T, k)
        dgate = dgate.to(routing.topk_weights.dtype)
    dy_RD = (g_RD * w_R.unsqueeze(1)).to(x_TD.dtype).to(acc)  # the forward's expert outputs were in x's dtype
    da_RF = du_RF * w_R.unsqueeze(1) if du_RF is not None else None
    x_perm = permute_rows(x_TD, info, rows)
    dx_perm, dw1, dw2, db1, db2 = _ffn_train_grads(dy_RD, da_RF, x_perm, offs, w1_EDN, w2_EFD, b1, b2, a_RF, h_RN,
                                                   activation, float(swiglu_limit), float(swiglu_alpha),
                                                   (need_x, need_w1, need_w2, need_b1, need_b2))
    dx = None
    if need_x:
        # each token's rows summed in slot order (the gradient of the gather)
        dx_ext = torch.cat([dx_perm.to(acc), dx_perm.new_zeros(1, dx_perm.shape[1], dtype=acc)])
        dx = dx_ext[torch.where(routed, slot_rows, torch.full_like(slot_rows, rows))].view(T, k, x_TD.shape[1]).sum(1)
        dx = dx.to(x_TD.dtype)
    return dx, dgate, dw1, dw2, db1, db2


def copy_segments(
    src_RD: torch.Tensor,
    src_starts_C: torch.Tensor,
    dst_starts_C: torch.Tensor,
    lengths_C: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    """Copy C row segments into a new [num_rows, D] buffer (the partition/concat op).

    out[dst_starts[c] + i] = src[src_starts[c] + i] for i < lengths[c]; rows no segment covers
    are zero. Segments are disjoint in src and in out, in any order. Packing a micro-op's
    per-destination chunks into one send buffer and unpacking a receive buffer are both this op;
    its gradient is the same op with the starts swapped.
    """
    # Source row of every output row (index R_src = a zero row for uncovered rows); gathering
    # keeps the output in src's autograd graph even when every segment is empty.
    R_src, D = src_RD.shape
    idx = torch.full((num_rows,), R_src, dtype=torch.int64)
    # Host sync: the reference builds the row map segment by segment on the host.
    for s, d, n in zip(src_starts_C.tolist(), dst_starts_C.tolist(), lengths_C.tolist()):
        if n > 0:
            idx[d : d + n] = torch.arange(s, s + n)
    src_ext = torch.cat([src_RD, src_RD.new_zeros(1, D)], dim=0)
    return src_ext[idx.to(src_RD.device)]


def expert_bias_finite(bias: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on ``bias``'s device: whether every entry is finite. No host sync (read
    it where the loop synchronizes anyway, e.g. beside the loss, or pass it to a logger)."""
    V.float_tensor("expert_bias", bias, 1)
    return torch.isfinite(bias).all()


def nan_weights_if_nonfinite(topk_weights: torch.Tensor, expert_bias: "torch.Tensor | None") -> torch.Tensor:
    """``topk_weights`` unchanged, or all NaN when any entry of ``expert_bias`` is not finite.

    No host sync: the decision stays on the device (a reduction over E, then ``w + 0`` or
    ``w + NaN``, which keeps the weights differentiable). ``expert_bias`` None returns the
    weights as they are. Used by :func:`tritonmoe.route`; a layer applies it to its routing
    weights the same way.
    """
    if expert_bias is None:
        return topk_weights
    poison = torch.where(
        torch.isfinite(expert_bias).all(),
        torch.zeros((), dtype=topk_weights.dtype, device=topk_weights.device),
        torch.full((), float("nan"), dtype=topk_weights.dtype, device=topk_weights.device),
    )
    return topk_weights + poison
