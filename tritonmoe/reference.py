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
pipeline can defer to one step over all rows (:mod:`tritonmoe.exact`). This is what makes the
pipelined layer bitwise equal to the unpipelined one in fp64. It costs speed (M = 1 batched
products, scalar transcendentals), which only tests pay: fp32, bf16 and fp16 run plain
per-expert matmuls and vectorized activations.

Non-finite logits (identical on every backend; see DESIGN.md):

* A NaN selection score ranks as -inf: it is chosen only after every finite score, lower expert
  id first, and its weight is NaN (so the output is NaN, loudly, rather than silently wrong).
* ``-inf`` logits are a valid mask: softmax gives score 0, sigmoid gives 0.
* With ``renormalize``, the weights are divided by ``max(sum, 1e-20)``, so a token whose selected
  scores are all 0 gets zero weights instead of 0/0.
* The public entry point rejects NaN logits, +inf logits under softmax and rows that are all
  -inf under softmax (NaN scores) while validation is on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .exact import WeightGradSlot, elementwise_scalar, row_invariant_grouped_gemm
from .types import PermuteInfo, Routing

__all__ = [
    "scores",
    "route",
    "load_balancing_loss",
    "z_loss",
    "permute",
    "permute_metadata",
    "unpermute",
    "ep_splits",
    "grouped_gemm",
    "grouped_ffn",
    "moe_ffn",
    "apply_activation",
    "RENORM_EPS",
    "copy_segments",
]

#: Floor of the renormalization denominator (a token whose selected scores are all zero).
RENORM_EPS = 1e-20


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scores(logits_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """fp32 (fp64 for fp64 logits) router scores."""
    lf = logits_TE.to(_acc_dtype(logits_TE.dtype))
    if score_func == "softmax":
        return torch.softmax(lf, dim=-1)
    return torch.sigmoid(lf)


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
) -> Routing:
    """Top-k routing; see :func:`tritonmoe.route` for the contract."""
    T, E = logits_TE.shape
    s_TE = scores(logits_TE, score_func)

    # Selection score: scores plus the bias, never differentiated; NaN ranks as -inf.
    sel_TE = s_TE.detach().float()
    if expert_bias is not None:
        sel_TE = sel_TE + expert_bias.float()
    sel_TE = torch.where(torch.isnan(sel_TE), torch.full_like(sel_TE, float("-inf")), sel_TE)

    order_TE = torch.sort(sel_TE, dim=-1, descending=True, stable=True).indices
    if n_groups is not None and n_groups > 1:
        G = n_groups
        sel_TGe = sel_TE.view(T, G, E // G)
        if E // G == 1:
            gscore_TG = sel_TGe[..., 0]
        else:
            gscore_TG = sel_TGe.topk(2, dim=-1).values.sum(-1)
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
    w_TK = w_TK.float() if w_TK.dtype != torch.float64 else w_TK

    selected_counts_E = _scatter_count(ids_TK, E)
    if capacity is not None:
        keep_TK = _capacity_keep(ids_TK, selected_counts_E, capacity)
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
        routing.score_sum = s_TE.sum(dim=0)
        routing.logsumexp = torch.logsumexp(logits_TE.to(s_TE.dtype), dim=-1)
    return routing


def _capacity_keep(ids_TK: torch.Tensor, counts_E: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which slots survive capacity: slots in priority order (slot j, then token t), each expert
    keeps its first ``capacity``."""
    T, K = ids_TK.shape
    flat = ids_TK.t().reshape(-1).long()  # priority order: j-major, then t
    order = torch.argsort(flat, stable=True)  # grouped by expert, priority order inside
    starts = torch.cumsum(counts_E.long(), 0) - counts_E.long()  # exclusive
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return (rank < capacity).view(K, T).t()


def load_balancing_loss(logits_TE: torch.Tensor, routing: Routing) -> torch.Tensor:
    """E * sum_e f_e * P_e (Switch Transformer).

    f_e = selected slots of e before capacity dropping / (T*k), P_e = mean over tokens of the
    scores of e. Differentiable through P_e only. Zero for T = 0.
    """
    T, E = logits_TE.shape
    k = routing.top_k
    if routing.score_sum is not None:
        score_sum_E = routing.score_sum
    else:
        score_sum_E = scores(logits_TE, routing.score_func).sum(dim=0)
    if T == 0:
        return score_sum_E.sum() * 0.0
    f_E = routing.selected_counts.to(score_sum_E.dtype) / float(T * k)
    return E * (f_E * score_sum_E).sum() / T


def z_loss(logits_TE: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE), fp32; uses ``routing.logsumexp`` when present.
    Zero for T = 0."""
    if routing is not None and routing.logsumexp is not None:
        lse_T = routing.logsumexp
    else:
        lse_T = torch.logsumexp(logits_TE.to(_acc_dtype(logits_TE.dtype)), dim=-1)
    if lse_T.numel() == 0:
        return lse_T.sum() * 0.0
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


def permute(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int, *, pad_to: int = 1
) -> tuple[torch.Tensor, PermuteInfo]:
    """Gather token rows into expert-grouped order; see :func:`tritonmoe.permute`."""
    T, K = topk_ids_TK.shape
    info = permute_metadata(topk_ids_TK, num_experts, pad_to)
    rows = info.slot_rows.reshape(-1)
    R = int(info.expert_offsets[-1])  # host sync: the output's row count depends on the routing
    # Source token of each row; padding rows read a zero row appended at index T.
    src_ext = torch.full((R + 1,), T, dtype=torch.int64, device=x_TD.device)
    src_ext[torch.where(rows >= 0, rows, torch.full_like(rows, R))] = torch.arange(T * K, device=x_TD.device) // K
    x_ext = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])], dim=0)
    x_perm = x_ext[src_ext[:R]]
    return x_perm, info


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


def ep_splits(expert_offsets: torch.Tensor, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a permuted buffer per destination rank when E experts are split evenly over P ranks
    (rank r owns experts [r*E/P, (r+1)*E/P)): int64 ``(rank_counts [P], rank_offsets [P+1])``,
    rank r's rows being [rank_offsets[r], rank_offsets[r+1]) (padding rows included)."""
    E = expert_offsets.shape[0] - 1
    per_rank = E // num_ranks
    rank_offsets = torch.stack([expert_offsets[r * per_rank].long() for r in range(num_ranks + 1)])
    return rank_offsets[1:] - rank_offsets[:-1], rank_offsets


def clamped_offsets(expert_offsets: torch.Tensor, num_rows: int) -> list[int]:
    """The offsets as host ints, each clamped into [0, R] and never below the one before it.

    Valid offsets pass unchanged. With validation off, an offset past R or below 0 is clamped
    into the buffer (as the Triton kernels clamp it), so no slice leaves the rows and the output
    keeps R rows; decreasing offsets are inconsistent metadata whose values are unspecified.
    Example: [-3, 2, 9] with R = 5 -> [0, 2, 5]; [0, 4, 2, 5] -> [0, 4, 4, 5].
    """
    out, lo = [], 0
    for o in expert_offsets.tolist():
        lo = min(max(o, lo), num_rows)
        out.append(lo)
    return out


def _grouped_gemm_acc(
    x_RK: torch.Tensor, expert_offsets: torch.Tensor, w_EKN: torch.Tensor, wgrad: WeightGradSlot | None = None
) -> torch.Tensor:
    """grouped_gemm in the accumulation dtype (not rounded to the input dtype).

    fp64 (used by tests as the exact reference) is row-invariant: every output row, and every
    row of the input gradient, depends only on its own input row and the weights, so any
    partition of the rows (micro-batches of a pipeline) gives bitwise-identical rows, and its
    weight gradient can be deferred to ``wgrad`` (see :mod:`tritonmoe.exact`). Other dtypes run
    one plain matmul per expert and compute their weight gradient in backward (``wgrad`` is not
    used: their forward is not row-invariant, so deferring would not make a schedule exact).
    """
    R = x_RK.shape[0]
    E, _, N = w_EKN.shape
    acc = _acc_dtype(x_RK.dtype)
    offs = clamped_offsets(expert_offsets, R)  # host sync: the reference slices the rows per expert
    if x_RK.dtype == torch.float64 and w_EKN.dtype == torch.float64:
        return row_invariant_grouped_gemm(x_RK, offs, w_EKN, wgrad)
    # Every expert contributes a (possibly empty) piece, so the output stays in the autograd
    # graph of x and w even when no row is routed (zero gradients rather than no grad_fn).
    # Rows before offsets[0] (> 0 only with validation off) are zero, like the rows past offsets[E].
    pieces = [x_RK.new_zeros(offs[0], N, dtype=acc)]
    pieces += [x_RK[offs[e] : offs[e + 1]].to(acc) @ w_EKN[e].to(acc) for e in range(E)]
    if R > offs[E]:
        pieces.append(x_RK.new_zeros(R - offs[E], N, dtype=acc))
    return torch.cat(pieces, dim=0)


def grouped_gemm(
    x_RK: torch.Tensor, expert_offsets: torch.Tensor, w_EKN: torch.Tensor, *, wgrad: WeightGradSlot | None = None
) -> torch.Tensor:
    """Rows in [offsets[e], offsets[e+1]) times w[e]; rows at or past offsets[E] are zero.
    ``wgrad``: defer the weight gradient to a schedule's store (fp64; :mod:`tritonmoe.exact`)."""
    return _grouped_gemm_acc(x_RK, expert_offsets, w_EKN, wgrad).to(x_RK.dtype)


grouped_gemm.defers_weight_grad = True


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        f = h.shape[-1] // 2
        return F.silu(h[..., :f]) * h[..., f:]
    if activation == "gelu":
        return F.gelu(h)  # exact erf form
    if activation == "relu":
        return F.relu(h)
    raise ValueError(f"activation={activation!r}; use 'swiglu', 'gelu' or 'relu'")


def apply_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The expert activation on a pre-activation h ([R, 2F] for swiglu: gate, then up).

    fp64 inputs are row-invariant (see :func:`tritonmoe.exact.elementwise_scalar`), like the fp64
    grouped GEMMs."""
    if h.dtype == torch.float64 and activation != "relu":
        return _activation(elementwise_scalar(h), activation)
    return _activation(h, activation)


def grouped_ffn(
    x_RD: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1_EDN: torch.Tensor,
    w2_EFD: torch.Tensor,
    activation: str = "swiglu",
    *,
    wgrad: WeightGradSlot | None = None,
) -> torch.Tensor:
    """grouped_gemm(act(grouped_gemm(x, w1)), w2), the activation applied to the fp32 accumulator
    and rounded to the input dtype once (as a fused epilogue does). ``wgrad``: defer both weight
    gradients to a schedule's store (fp64; :mod:`tritonmoe.exact`)."""
    h = _grouped_gemm_acc(x_RD, expert_offsets, w1_EDN, wgrad)
    a = apply_activation(h, activation).to(x_RD.dtype)
    return grouped_gemm(a, expert_offsets, w2_EFD, wgrad=wgrad)


grouped_ffn.defers_weight_grad = True


def moe_ffn(
    x_TD: torch.Tensor,
    routing: Routing,
    w1_EDN: torch.Tensor,
    w2_EFD: torch.Tensor,
    activation: str = "swiglu",
) -> torch.Tensor:
    """The whole expert path of a MoE layer: permute -> grouped_ffn -> unpermute (weighted by
    ``routing.topk_weights``); [T, d] in x's dtype."""
    x_perm, info = permute(x_TD, routing.topk_ids, routing.num_experts)
    y_perm = grouped_ffn(x_perm, info.expert_offsets, w1_EDN, w2_EFD, activation)
    return unpermute(y_perm, info, routing.topk_weights)


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
