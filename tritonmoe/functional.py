"""The public functional ops: validate at the boundary, then dispatch to a backend.

Each op takes ``backend="auto"|"triton"|"torch"`` (None = the process default, see
:mod:`tritonmoe._settings`). Shapes use the letters of :mod:`tritonmoe.types`.
"""

from __future__ import annotations

import torch

from . import _validation as V
from . import reference
from ._settings import validation_enabled
from .bias import nan_weights_if_nonfinite
from .dispatch import implementation
from .types import PermuteInfo, Routing

__all__ = [
    "route",
    "load_balancing_loss",
    "z_loss",
    "permute",
    "unpermute",
    "grouped_gemm",
    "grouped_ffn",
    "moe_ffn",
]


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
    backend: str | None = None,
) -> Routing:
    """Choose top_k experts per token.

    Args:
        logits: [T, E] router logits (fp16/bf16/fp32/fp64).
        top_k: experts per token, in [1, E].
        score_func: "softmax" or "sigmoid", computed in fp32.
        renormalize: divide the k weights by their sum (floored at 1e-20).
        expert_bias: fp32 [E] added to the scores for selection only (auxiliary-loss-free
            balancing); the weights stay unbiased. It must be finite: with validation on a
            non-finite entry raises ``ValueError``; with validation off every weight becomes NaN
            (no host sync; see :mod:`tritonmoe.bias`).
        n_groups, topk_groups: group-limited routing: E splits into n_groups groups, a group's
            score is the sum of its top-2 selection scores (its max if it has one expert), and
            only experts of the topk_groups best groups (ties: lower group) can be selected.
        capacity: kept slots per expert, or None (dropless). Slots are considered slot j first,
            then token t; a slot whose expert is full gets id -1 and weight 0.
        with_aux: also return the per-expert score sums and per-token logsumexp that
            :func:`load_balancing_loss` and :func:`z_loss` use, from the same pass.

    Returns: :class:`Routing` (ids int32 [T, k] in descending score, ties to the lower expert id;
    weights fp32 [T, k], differentiable w.r.t. the logits; counts int32 [E]).
    """
    V.route_args(logits, top_k, score_func, renormalize, expert_bias, n_groups, topk_groups, capacity, with_aux)
    # Integer scalars of other types (numpy.int64, ...) become Python ints before any launch.
    top_k, n_groups, topk_groups, capacity = (None if v is None else int(v) for v in (top_k, n_groups, topk_groups, capacity))
    validate = validation_enabled()
    if validate:
        V.route_values(logits, score_func, expert_bias)
    impl = implementation("route", backend, logits.device, logits.dtype)
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
    )
    if not validate and expert_bias is not None:
        # Unchecked, a non-finite bias makes every weight NaN, on the device (no sync): the loss
        # goes NaN on the step the bias broke instead of training on silently wrong routing.
        routing.topk_weights = nan_weights_if_nonfinite(routing.topk_weights, expert_bias)
    return routing


def load_balancing_loss(logits: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Switch-style auxiliary loss E * sum_e f_e * P_e (fp32 scalar, differentiable via P_e)."""
    V.float_tensor("logits", logits, 2)
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a tritonmoe.Routing, got {type(routing).__name__}")
    if tuple(logits.shape) != (routing.num_tokens, routing.num_experts):
        raise ValueError(
            f"logits are {tuple(logits.shape)} but routing is for T={routing.num_tokens}, "
            f"E={routing.num_experts}; pass the logits the routing was computed from"
        )
    return reference.load_balancing_loss(logits, routing)


def z_loss(logits: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
    """Router z-loss mean_t logsumexp(logits_t)^2 (fp32 scalar). Reuses ``routing.logsumexp`` when
    the routing was computed ``with_aux``."""
    V.float_tensor("logits", logits, 2)
    if routing is not None:
        if not isinstance(routing, Routing):
            raise TypeError(f"routing must be a tritonmoe.Routing or None, got {type(routing).__name__}")
        if routing.logsumexp is not None and routing.logsumexp.shape[0] != logits.shape[0]:
            raise ValueError(
                f"routing.logsumexp has {routing.logsumexp.shape[0]} tokens but logits have {logits.shape[0]}"
            )
    return reference.z_loss(logits, routing)


def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    pad_to: int = 1,
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

    Returns: ``x_perm`` [R, d] with rows grouped by expert, inside an expert ordered by token,
    then slot; and :class:`PermuteInfo` (``expert_offsets`` int64 [E+1], ``slot_rows`` int64
    [T, k], ``counts`` int32 [E]). ``x_perm[slot_rows[t, j]] == x[t]`` exactly.
    """
    V.permute_args(x, topk_ids, num_experts, pad_to)
    num_experts, pad_to = int(num_experts), int(pad_to)
    if validation_enabled():
        V.ids_values(topk_ids, num_experts)
    impl = implementation("permute", backend, x.device, x.dtype)
    return impl(x, topk_ids, num_experts, pad_to=pad_to)


def unpermute(
    y_perm: torch.Tensor,
    info: PermuteInfo,
    topk_weights: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Weighted combine: out[t] = sum over routed j of topk_weights[t, j] * y_perm[slot_rows[t, j]],
    accumulated per token in fp32 (no atomics); [T, d] in y_perm's dtype.

    ``info`` may come from :func:`permute` or be built or sliced by the caller; its dtypes and
    shapes are always checked, and with validation on its values too (offsets start at 0, never
    decrease and end at R; each segment is its count rounded up to ``pad_to``; slot rows in
    [-1, R), each routed slot on its own unpadded row of an expert's segment, ``counts[e]`` slots
    per expert), before any launch. With validation off, a slot row outside [0, R) contributes
    nothing to the output, on every backend (see "Semantics decided here" in the README)."""
    V.float_tensor("y_perm", y_perm, 2)
    V.permute_info_args(info)
    V.float_tensor("topk_weights", topk_weights, 2)
    if tuple(topk_weights.shape) != tuple(info.slot_rows.shape):
        raise ValueError(
            f"topk_weights has shape {tuple(topk_weights.shape)} but the permutation is for "
            f"[T, k] = {tuple(info.slot_rows.shape)}"
        )
    V.same_device(y_perm=y_perm, topk_weights=topk_weights, slot_rows=info.slot_rows)
    if validation_enabled():
        V.permute_info_values(info, y_perm.shape[0])
    impl = implementation("unpermute", backend, y_perm.device, y_perm.dtype)
    return impl(y_perm, info, topk_weights)


def grouped_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    w: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Ragged per-expert matmul: rows [offsets[e], offsets[e+1]) of x [R, K] times w[e] ([E, K, N]);
    fp32 accumulation, output [R, N] in x's dtype. With validation off, offsets outside [0, R] are
    clamped into it (decreasing offsets give unspecified values, never an out-of-bounds access)."""
    V.gemm_args(x, expert_offsets, w)
    if validation_enabled():
        V.offsets_values("expert_offsets", expert_offsets, x.shape[0])
    impl = implementation("grouped_gemm", backend, x.device, x.dtype)
    return impl(x, expert_offsets, w)


def grouped_ffn(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "swiglu",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Expert FFN over a permuted buffer: grouped_gemm(act(grouped_gemm(x, w1)), w2).

    w1 is [E, d, 2f] for swiglu (columns [:f] gate, [f:] up; act = silu(gate) * up) and [E, d, f]
    for "gelu" (exact erf) and "relu"; w2 is [E, f, d]. Offsets as in :func:`grouped_gemm`
    (clamped into [0, R] with validation off).
    """
    V.ffn_args(x, expert_offsets, w1, w2, activation)
    if validation_enabled():
        V.offsets_values("expert_offsets", expert_offsets, x.shape[0])
    impl = implementation("grouped_ffn", backend, x.device, x.dtype)
    return impl(x, expert_offsets, w1, w2, activation)


def moe_ffn(
    x: torch.Tensor,
    routing: Routing,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "swiglu",
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """The expert path of a MoE layer in one op: permute -> grouped_ffn -> unpermute.

    ``out[t] = sum over routed j of topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])`` with the
    per-expert FFN of :func:`grouped_ffn` (fp32 accumulation; the activation's output and each
    expert output rounded once to x's dtype; the k-way weighted sum in fp32). The Triton backend
    fuses the token gather into the first GEMM and the weighted combine after the second, so no
    expert-ordered copy of x or of the expert outputs is made; gradients flow to x, w1, w2 and
    ``routing.topk_weights``.

    Args:
        x: [T, d] tokens.
        routing: the :class:`Routing` of these tokens over E experts (ids -1 are skipped; other
            ids outside [-1, E) raise ``IndexError``, or with validation off are skipped too).
        w1: [E, d, 2f] for swiglu (gate then up), [E, d, f] for gelu / relu.
        w2: [E, f, d].
        activation: "swiglu", "gelu" (exact erf) or "relu".
    """
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a tritonmoe.Routing, got {type(routing).__name__}")
    V.float_tensor("x", x, 2)
    V.int_tensor("routing.topk_ids", routing.topk_ids, 2)
    V.float_tensor("routing.topk_weights", routing.topk_weights, 2)
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
    V.same_device(x=x, topk_ids=routing.topk_ids, topk_weights=routing.topk_weights)
    if validation_enabled():
        V.ids_values(routing.topk_ids, E)
    impl = implementation("moe_ffn", backend, x.device, x.dtype)
    return impl(x, routing, w1, w2, activation)
