"""The public functional ops: validate at the boundary, then dispatch to a backend.

Each op takes ``backend="auto"|"triton"|"torch"`` (None = the process default, see
:mod:`tritonmoe.core.settings`). Shapes use the letters of :mod:`tritonmoe.core.types`.
"""

from __future__ import annotations

import torch

from tritonmoe.core import validation as V
from . import reference
from tritonmoe.core.settings import validation_enabled
from .reference import nan_weights_if_nonfinite
from tritonmoe.backends import implementation
from tritonmoe.core.types import PermuteInfo, Routing
from tritonmoe import custom_ops as ops
from tritonmoe.core.settings import resolve_backend

__all__ = [
    "route",
    "load_balancing_loss",
    "z_loss",
    "permute",
    "max_permuted_rows",
    "unpermute",
    "grouped_gemm",
    "grouped_ffn",
    "moe_ffn",
]


def _check_values(t: torch.Tensor) -> bool:
    """Whether to run the value checks (a host sync) on a call with input ``t``: validation on,
    and real data (meta tensors have none: they get shape checks only), and not while
    ``torch.compile`` traces the call (a graph cannot branch on tensor values: compiled, the
    ops run as with ``set_validation(False)``; the shape and type checks still run, at trace
    time)."""
    return not torch.compiler.is_compiling() and not t.is_meta and validation_enabled()


def _traced():
    """:mod:`tritonmoe.custom_ops` while ``torch.compile`` traces the call, else None: compiled, each op
    is its ``torch.ops.tritonmoe`` custom op (one opaque node, no graph break), in the backend
    the eager call would use."""
    if not torch.compiler.is_compiling():
        return None

    return ops


def route(
    logits: torch.Tensor,
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
    backend: str | None = None,
    drop_policy: str = "slot",
) -> Routing:
    """Choose top_k experts per token.

    Args:
        logits: [T, E] router logits (fp16/bf16/fp32/fp64).
        top_k: experts per token, in [1, E].
        score_func: "softmax", "sigmoid" or "sqrtsoftplus" (sqrt(softplus(x)); DeepSeek-V4,
            Megatron-Core), computed in fp32. sigmoid and sqrtsoftplus weights are the raw
            scores at the chosen experts (renormalized over the k with ``renormalize``).
        renormalize: divide the k weights by their sum (floored at 1e-20).
        expert_bias: fp32 [E] added to the scores for selection only (auxiliary-loss-free
            balancing); the weights stay unbiased. It must be finite: with validation on a
            non-finite entry raises ``ValueError``; with validation off every weight becomes NaN
            (no host sync; see :mod:`tritonmoe.bias`).
        n_groups, topk_groups: group-limited routing: E splits into n_groups groups scored by
            ``group_score``, and only experts of the topk_groups best groups (ties: lower group)
            can be selected.
        capacity: kept slots per expert, or None (dropless). A slot whose expert is full gets
            id -1 and weight 0; which slots an expert keeps is ``drop_policy``'s.
        drop_policy: the order in which an expert keeps its slots up to ``capacity``: "slot"
            (slot j first, then token t: every first choice before any second choice; GShard),
            "position" (the earliest tokens; Megatron's "position") or "probs" (the highest
            final weights, ties to the earlier token; Megatron's default). "probs" ranks the
            canonical weight (:func:`tritonmoe.reference.drop_priority`), so every backend keeps
            the same slots.
        with_aux: also return the per-expert score sums and per-token logsumexp that
            :func:`load_balancing_loss` and :func:`z_loss` use, from the same pass.
        group_score: "top2sum" (the sum of a group's two largest selection values, a repeated
            maximum counted twice; DeepSeek-V3), "max" (its largest; DeepSeek-V2's
            group_limited_greedy) or "sum_topn" (the sum of its top_k // topk_groups largest
            values, Megatron-Core's rule: the logits under softmax without a bias, the scores
            under sigmoid / sqrtsoftplus, the biased scores with a bias; see
            :func:`tritonmoe.reference.selection_values`).
        routed_scaling_factor: multiplies the final weights, after renormalization (or the raw
            scores with ``renormalize=False``), as DeepSeek-V3 and GLM-4-MoE do; finite, > 0.
            (DeepSeek-V2's original code scales only when it does not renormalize: convert it
            with 1.0 when ``norm_topk_prob`` is set.)

    Selection is exact across backends: every backend compares the same canonical fp32 value
    (the logit without ``expert_bias``, else a fixed-recipe score plus the bias; see
    :func:`tritonmoe.reference.selection_values`), so the ids never depend on how a backend
    rounds exp or division. The weights are each backend's fp32 scores (they may differ in the
    last bits).

    Returns: :class:`Routing` (ids int32 [T, k] in descending selection value, ties to the lower
    expert id; weights fp32 [T, k], differentiable w.r.t. the logits; counts int32 [E]).
    """
    V.route_args(logits, top_k, score_func, renormalize, expert_bias, n_groups, topk_groups, capacity, with_aux,
                 group_score, routed_scaling_factor, drop_policy)
    # Integer scalars of other types (numpy.int64, ...) become Python ints before any launch.
    top_k, n_groups, topk_groups, capacity = (None if v is None else int(v) for v in (top_k, n_groups, topk_groups, capacity))
    routed_scaling_factor = float(routed_scaling_factor)
    validate = _check_values(logits)
    ops = _traced()
    impl = implementation("route", backend, logits.device, logits.dtype) if ops is None else ops.route
    # the Triton router runs the value checks inside its kernel (one flag read back, instead of
    # a pass over the logits per check before the launch); other implementations check here
    fused_checks = validate and getattr(impl, "fused_checks", False)
    if validate and not fused_checks:
        V.route_values(logits, score_func, expert_bias)
    routing = impl(
        logits,
        top_k,
        score_func=score_func,
        renormalize=renormalize,
        expert_bias=expert_bias,
        n_groups=n_groups,
        topk_groups=topk_groups,
        capacity=capacity,
        with_aux=with_aux,
        group_score=group_score,
        routed_scaling_factor=routed_scaling_factor,
        **({} if ops is None else {"backend": backend}),
        **({} if drop_policy == "slot" or capacity is None else {"drop_policy": drop_policy}),
        **({"check": True} if fused_checks else {}),
    )
    if not validate and expert_bias is not None and not getattr(impl, "fused_bias_guard", False):
        # Unchecked, a non-finite bias makes every weight NaN, on the device (no sync): the loss
        # goes NaN on the step the bias broke instead of training on silently wrong routing.
        routing.topk_weights = nan_weights_if_nonfinite(routing.topk_weights, expert_bias)
    return routing


def load_balancing_loss(
    logits: torch.Tensor,
    routing: Routing,
    *,
    sequence_length: int | None = None,
    padding_mask: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Switch-style auxiliary loss E * sum_e f_e * P_e (fp32 scalar, differentiable via P_e).

    f_e: the fraction of the T*k slots that selected expert e (before capacity dropping). P_e:
    the mean over tokens of the balance scores (:func:`tritonmoe.reference.aux_scores`): softmax
    probabilities, or for "sigmoid" / "sqrtsoftplus" routing the scores normalised over all E
    experts per token (Megatron-Core, DeepSeek-V3). A perfectly balanced routing gives 1.

    Args:
        sequence_length: S. The tokens are read as [B, S] flattened batch-major (T = B * S) and
            the loss is each sequence's own loss, averaged over the B sequences (DeepSeek-V2/V3's
            sequence-wise balance loss; Megatron's ``seq_aux_loss``).
        padding_mask: bool [T], True = a real token: padded tokens are removed from f, P and the
            token counts (the same loss as without those tokens).

    With either option f counts the routed slots of ``routing.topk_ids`` (which equal the
    selected slots when capacity dropped none), and the per-segment score sums come from the
    backend's ``balance_score_sums`` (a Triton kernel and its backward on CUDA); without them the
    loss uses ``routing.score_sum`` when the routing was computed ``with_aux`` (the fused router's
    sums).
    """
    V.float_tensor("logits", logits, 2)
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a tritonmoe.Routing, got {type(routing).__name__}")
    if tuple(logits.shape) != (routing.num_tokens, routing.num_experts):
        raise ValueError(
            f"logits are {tuple(logits.shape)} but routing is for T={routing.num_tokens}, "
            f"E={routing.num_experts}; pass the logits the routing was computed from"
        )
    V.padding_mask(padding_mask, logits.shape[0], device=logits.device)
    V.sequence_length(sequence_length, logits.shape[0])
    S = None if sequence_length is None else int(sequence_length)
    sums = None
    if S is not None or padding_mask is not None:
        impl = (reference.balance_score_sums if torch.compiler.is_compiling()
                else implementation("balance_score_sums", backend, logits.device, logits.dtype))
        sums = impl(logits, routing.score_func, padding_mask, S)
    return reference.load_balancing_loss(logits, routing, padding_mask=padding_mask, sequence_length=S,
                                         score_sums=sums)


def z_loss(logits: torch.Tensor, routing: Routing | None = None, *,
           padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss mean_t logsumexp(logits_t)^2 (fp32 scalar). Reuses ``routing.logsumexp`` when
    the routing was computed ``with_aux``. ``padding_mask`` (bool [T], True = a real token): the
    mean over the real tokens."""
    V.float_tensor("logits", logits, 2)
    if routing is not None:
        if not isinstance(routing, Routing):
            raise TypeError(f"routing must be a tritonmoe.Routing or None, got {type(routing).__name__}")
        if routing.logsumexp is not None and routing.logsumexp.shape[0] != logits.shape[0]:
            raise ValueError(
                f"routing.logsumexp has {routing.logsumexp.shape[0]} tokens but logits have {logits.shape[0]}"
            )
    V.padding_mask(padding_mask, logits.shape[0], device=logits.device)
    return reference.z_loss(logits, routing, padding_mask=padding_mask)


def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    pad_to: int = 1,
    num_rows: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, PermuteInfo]:
    """Gather token rows into a buffer grouped by expert.

    Args:
        x: [T, d] tokens.
        topk_ids: [T, k] integer expert ids; -1 means "not routed" and is skipped. Other ids
            outside [-1, E) raise ``IndexError`` with validation on; with it off they are
            treated as -1 on every backend.
        num_experts: E.
        pad_to: each expert's segment is padded with zero rows up to a multiple of this.
        num_rows: None: ``x_perm`` has exactly R = ``expert_offsets[E]`` rows, which the Triton
            backend reads back from the device (one host sync). An int N >=
            :func:`max_permuted_rows` (T, k, E, pad_to): ``x_perm`` has N rows, rows past R are
            zero, and nothing synchronizes with the host. grouped_gemm / grouped_ffn treat rows at
            or past offsets[E] as zero and unpermute reads only routed rows, so the whole expert
            path runs on such a buffer (with pad_to=1 and no id -1, N equals R).

    Returns: ``x_perm`` [R, d] (or [N, d]) with rows grouped by expert, inside an expert ordered
    by token, then slot; and :class:`PermuteInfo` (``expert_offsets`` int64 [E+1], ``slot_rows``
    int64 [T, k], ``counts`` int32 [E]). ``x_perm[slot_rows[t, j]] == x[t]`` exactly.
    """
    V.permute_args(x, topk_ids, num_experts, pad_to, num_rows)
    num_experts, pad_to = int(num_experts), int(pad_to)
    if _check_values(x):
        V.ids_values(topk_ids, num_experts)
    ops = _traced()
    if ops is not None and num_rows is not None:  # without num_rows the row count is data-dependent
        return ops.permute(x, topk_ids, num_experts, num_rows=int(num_rows), pad_to=pad_to, backend=backend)
    impl = implementation("permute", backend, x.device, x.dtype)
    if num_rows is None:
        return impl(x, topk_ids, num_experts, pad_to=pad_to)
    return impl(x, topk_ids, num_experts, pad_to=pad_to, num_rows=int(num_rows))


def max_permuted_rows(num_tokens: int, top_k: int, num_experts: int, pad_to: int = 1) -> int:
    """The row count of a permuted buffer that holds any routing of ``num_tokens`` tokens:
    T * k + E * (pad_to - 1). Pass it as ``permute(..., num_rows=...)`` to permute without a host
    sync; it equals R when pad_to == 1 and no slot is dropped."""
    for name, v, lo in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1), ("num_experts", num_experts, 1),
                        ("pad_to", pad_to, 1)):
        V.positive_int(name, v, lo)
    return reference.max_permuted_rows(int(num_tokens), int(top_k), int(num_experts), int(pad_to))


def unpermute(
    y_perm: torch.Tensor,
    info: PermuteInfo,
    topk_weights: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Weighted combine: out[t] = sum over routed j of topk_weights[t, j] * y_perm[slot_rows[t, j]],
    accumulated per token in fp32 (no atomics); [T, d] in y_perm's dtype. ``y_perm`` may have
    more rows than R (a buffer from ``permute(..., num_rows=N)``); rows past R are not read.

    ``info`` may come from :func:`permute` or be built or sliced by the caller; its dtypes and
    shapes are always checked, and with validation on its values too (offsets start at 0, never
    decrease and end at R, at or below y_perm's rows; each segment is its count rounded up to
    ``pad_to``; slot rows in [-1, R), each routed slot on its own unpadded row of an expert's
    segment, ``counts[e]`` slots per expert), before any launch. With validation off, a slot row
    outside [0, R) contributes nothing to the output, on every backend (see "Semantics decided
    here" in docs/functional.md)."""
    V.float_tensor("y_perm", y_perm, 2)
    V.permute_info_args(info)
    V.float_tensor("topk_weights", topk_weights, 2)
    if tuple(topk_weights.shape) != tuple(info.slot_rows.shape):
        raise ValueError(
            f"topk_weights has shape {tuple(topk_weights.shape)} but the permutation is for "
            f"[T, k] = {tuple(info.slot_rows.shape)}"
        )
    V.same_device(y_perm=y_perm, topk_weights=topk_weights, slot_rows=info.slot_rows)
    if _check_values(y_perm):
        V.permute_info_values(info, y_perm.shape[0], allow_tail=True)
    ops = _traced()
    if ops is not None:
        return ops.unpermute(y_perm, info, topk_weights, backend=backend)
    impl = implementation("unpermute", backend, y_perm.device, y_perm.dtype)
    return impl(y_perm, info, topk_weights)


def grouped_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Ragged per-expert matmul: rows [offsets[e], offsets[e+1]) of x [R, K] times w[e] ([E, K, N]),
    plus bias[e] ([E, N], x's dtype) when given; fp32 accumulation (the bias added to it), output
    [R, N] in x's dtype. The bias gradient is the per-expert column sum of the output gradient.
    offsets[E] may be below R (a buffer from ``permute(..., num_rows=N)``): rows past it come out
    zero. With validation off, offsets outside [0, R] are clamped into it (decreasing offsets
    give unspecified values, never an out-of-bounds access)."""
    V.gemm_args(x, expert_offsets, w)
    V.bias("bias", bias, w.shape[0], w.shape[2], x, "output columns")
    if _check_values(x):
        V.offsets_values("expert_offsets", expert_offsets, x.shape[0], allow_tail=True)
    if _traced() is not None:

        return torch.ops.tritonmoe.grouped_gemm(x, expert_offsets, w, bias, resolve_backend(backend))
    impl = implementation("grouped_gemm", backend, x.device, x.dtype)
    return impl(x, expert_offsets, w, bias)


def _swiglu_kw(activation: str, swiglu_limit, swiglu_alpha) -> dict:
    V.swiglu_options(activation, swiglu_limit, swiglu_alpha)
    return dict(swiglu_limit=float(swiglu_limit), swiglu_alpha=float(swiglu_alpha))


def grouped_ffn(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "swiglu",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
    backend: str | None = None,
) -> torch.Tensor:
    """Expert FFN over a permuted buffer: grouped_gemm(act(grouped_gemm(x, w1) + b1), w2) + b2.

    w1 is [E, d, 2f] for the GLUs (columns [:f] gate, [f:] up) and [E, d, f] for "gelu" (exact erf)
    and "relu"; w2 is [E, f, d]. Activations: "swiglu" = silu(gate) * up; "swiglu_oai" (GPT-OSS)
    = (u + 1) * g * sigmoid(swiglu_alpha * g) with g = min(gate, swiglu_limit) and
    u = clamp(up, -swiglu_limit, swiglu_limit) (gradients pass at the limits, as torch.clamp's).
    Optional biases b1 [E, n1] and b2 [E, d] (x's dtype) are added to the fp32 accumulators.
    Offsets as in :func:`grouped_gemm` (clamped into [0, R] with validation off).
    """
    V.ffn_args(x, expert_offsets, w1, w2, activation)
    V.ffn_biases(x, w1, w2, b1, b2)
    kw = _swiglu_kw(activation, swiglu_limit, swiglu_alpha)
    if _check_values(x):
        V.offsets_values("expert_offsets", expert_offsets, x.shape[0], allow_tail=True)
    ops = _traced()
    if ops is not None:
        return ops.grouped_ffn(x, expert_offsets, w1, w2, activation, b1, b2, backend=backend, **kw)
    impl = implementation("grouped_ffn", backend, x.device, x.dtype)
    return impl(x, expert_offsets, w1, w2, activation, b1, b2, **kw)


def moe_ffn(
    x: torch.Tensor,
    routing: Routing,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "swiglu",
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
    backend: str | None = None,
) -> torch.Tensor:
    """The expert path of a MoE layer in one op: permute -> grouped_ffn -> unpermute.

    ``out[t] = sum over routed j of topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])`` with the
    per-expert FFN of :func:`grouped_ffn` (fp32 accumulation; biases inside each expert's output,
    so the gate weight multiplies b2 too; the activation's output and each expert output rounded
    once to x's dtype; the k-way weighted sum in fp32). The Triton backend fuses the token gather
    into the first GEMM and the weighted combine after the second, so no expert-ordered copy of x
    or of the expert outputs is made, builds its segments from ``routing.counts`` (which must
    match ``routing.topk_ids``; checked with validation on), and takes a decode path for T <= 64;
    gradients flow to x, w1, w2, b1, b2 and ``routing.topk_weights``.

    Args:
        x: [T, d] tokens.
        routing: the :class:`Routing` of these tokens over E experts (ids -1 are skipped; other
            ids outside [-1, E) raise ``IndexError``, or with validation off are skipped too).
        w1: [E, d, 2f] for the GLUs (gate then up), [E, d, f] for gelu / relu.
        w2: [E, f, d].
        activation: "swiglu", "swiglu_oai" (GPT-OSS, see :func:`grouped_ffn`), "gelu" (exact erf)
            or "relu".
        b1, b2: optional biases [E, n1] and [E, d].
        swiglu_limit, swiglu_alpha: the "swiglu_oai" clamp bound and sigmoid scale.
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a tritonmoe.Routing, got {type(routing).__name__}")
    V.float_tensor("x", x, 2)
    V.int_tensor("routing.topk_ids", routing.topk_ids, 2)
    V.float_tensor("routing.topk_weights", routing.topk_weights, 2)
    V.int_tensor("routing.counts", routing.counts, 1)
    T = x.shape[0]
    if routing.topk_ids.shape[0] != T:
        raise ValueError(
            f"routing is for {routing.topk_ids.shape[0]} tokens but x has {T}; route these tokens first"
        )
    if tuple(routing.topk_weights.shape) != tuple(routing.topk_ids.shape):
        raise ValueError(
            f"routing.topk_weights has shape {tuple(routing.topk_weights.shape)} but routing.topk_ids has "
            f"{tuple(routing.topk_ids.shape)}; they must match ([T, k])"
        )
    E = routing.num_experts
    V.expert_weights_args(x, w1, w2, activation, E, "the routing's num_experts")
    V.ffn_biases(x, w1, w2, b1, b2)
    kw = _swiglu_kw(activation, swiglu_limit, swiglu_alpha)
    V.same_device(x=x, topk_ids=routing.topk_ids, topk_weights=routing.topk_weights, counts=routing.counts)
    if _check_values(x):
        V.ids_values(routing.topk_ids, E)
        V.counts_values(routing)
    ops = _traced()
    if ops is not None:
        return ops.moe_ffn(x, routing, w1, w2, activation, b1, b2, backend=backend, **kw)
    impl = implementation("moe_ffn", backend, x.device, x.dtype)
    return impl(x, routing, w1, w2, activation, b1, b2, **kw)
