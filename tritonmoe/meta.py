"""Shape-only implementations of tritonmoe's ops for tensors on the ``meta`` device.

A layer built on the meta device (shape inference, deferred initialization as FSDP2 and large-model
loading use it: ``MoELayer(cfg, device="meta")`` then ``to_empty`` + ``reset_parameters``) runs
forward and backward here on every backend: :func:`tritonmoe.backends.implementation` sends meta
tensors to these functions. Each takes the arguments of its reference
(:mod:`tritonmoe.reference`) and returns outputs of the reference's shapes and dtypes, built from
its inputs by differentiable ops, so a backward gives every input and parameter a gradient of
the right shape (all values are meta: there are none).

Data-dependent sizes take their static bound: a permuted buffer has ``num_rows`` rows when given,
else :func:`~tritonmoe.reference.max_permuted_rows` (the real R is at most that; equal when no slot
is dropped and ``pad_to`` is 1).
"""

from __future__ import annotations

import torch

from tritonmoe.core.validation import GLU_ACTIVATIONS
from tritonmoe.core.types import max_permuted_rows
from tritonmoe.core.types import PermuteInfo, Routing

__all__ = ["route", "balance_score_sums", "permute", "permute_metadata", "unpermute", "grouped_gemm", "grouped_ffn", "moe_ffn",
           "copy_segments"]


def _rows_like(x_TD: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, d] depending on every row of x (differentiably), for any T including 0."""
    return x_TD.sum(0, keepdim=True).expand(rows, x_TD.shape[1])


def route(logits_TE, top_k, *, score_func="softmax", renormalize=True, expert_bias=None, n_groups=None,
          topk_groups=None, capacity=None, with_aux=False, group_score="top2sum", routed_scaling_factor=1.0,
          drop_policy="slot") -> Routing:
    T, E = logits_TE.shape
    scores = logits_TE.float()
    dev = logits_TE.device
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    return Routing(
        topk_ids=torch.empty(T, top_k, dtype=torch.int32, device=dev),
        topk_weights=scores.sum(-1, keepdim=True).expand(T, top_k) * float(routed_scaling_factor),
        counts=counts,
        selected_counts=torch.empty_like(counts),
        score_func=score_func,
        score_sum=scores.sum(0) if with_aux else None,
        logsumexp=scores.logsumexp(-1) if with_aux else None,
    )


def balance_score_sums(logits_TE, score_func, padding_mask=None, sequence_length=None):
    T, E = logits_TE.shape
    B = 1 if sequence_length is None else T // sequence_length
    acc = torch.float64 if logits_TE.dtype == torch.float64 else torch.float32
    return logits_TE.to(acc).sum(0, keepdim=True).expand(B, E)


def permute_metadata(topk_ids_TK: torch.Tensor, num_experts: int, pad_to: int = 1) -> PermuteInfo:
    T, _ = topk_ids_TK.shape
    dev = topk_ids_TK.device
    return PermuteInfo(
        expert_offsets=torch.empty(num_experts + 1, dtype=torch.int64, device=dev),
        slot_rows=torch.empty(topk_ids_TK.shape, dtype=torch.int64, device=dev),
        counts=torch.empty(num_experts, dtype=torch.int32, device=dev),
        num_tokens=T,
        pad_to=pad_to,
    )


def permute(x_TD, topk_ids_TK, num_experts, *, pad_to=1, num_rows=None):
    T, K = topk_ids_TK.shape
    rows = num_rows if num_rows is not None else max_permuted_rows(T, K, num_experts, pad_to)
    return _rows_like(x_TD, rows), permute_metadata(topk_ids_TK, num_experts, pad_to)


def unpermute(y_perm_RD, info: PermuteInfo, topk_weights_TK):
    T = info.slot_rows.shape[0]
    return _rows_like(y_perm_RD, T) * topk_weights_TK.sum(-1, keepdim=True).to(y_perm_RD.dtype)


def grouped_gemm(x_RK, expert_offsets, w_EKN, bias=None, *, wgrad=None):
    y = x_RK @ w_EKN.sum(0)
    return y if bias is None else y + bias.sum(0)


grouped_gemm.defers_weight_grad = True


def grouped_ffn(x_RD, expert_offsets, w1_EDN, w2_EFD, activation="swiglu", b1=None, b2=None, *,
                swiglu_limit=7.0, swiglu_alpha=1.702, wgrad=None):
    h = grouped_gemm(x_RD, expert_offsets, w1_EDN, b1)
    f = w2_EFD.shape[1]
    a = h[:, :f] * h[:, f:] if activation in GLU_ACTIVATIONS else h
    return grouped_gemm(a, expert_offsets, w2_EFD, b2)


grouped_ffn.defers_weight_grad = True


def moe_ffn(x_TD, routing: Routing, w1_EDN, w2_EFD, activation="swiglu", b1=None, b2=None, *,
            swiglu_limit=7.0, swiglu_alpha=1.702):
    y = grouped_ffn(x_TD, None, w1_EDN, w2_EFD, activation, b1, b2)
    return y * routing.topk_weights.sum(-1, keepdim=True).to(y.dtype)


def copy_segments(src_RD, src_starts_C, dst_starts_C, lengths_C, num_rows):
    return _rows_like(src_RD, num_rows)
