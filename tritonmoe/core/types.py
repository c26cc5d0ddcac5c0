"""Routing metadata as small documented dataclasses.

Shape letters used across tritonmoe (names carry them as suffixes, e.g. ``topk_ids_TK``):

====  ==========================================================
T     tokens (the flattened batch)
E     experts (global count; ``E_local`` for one rank's experts)
K     top_k, the slots of a token (in kernels ``K`` may also be a GEMM depth; it is said there)
D     d_model
F     d_ffn
R     rows of a permuted buffer (``expert_offsets[E]``)
P     ranks of an expert-parallel group
====  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Routing:
    """The router's decision for a batch of T tokens over E experts with top_k = k.

    Attributes:
        topk_ids: int32 [T, k]. Chosen experts in descending selection score (ties: lower expert
            id). ``-1`` marks a slot dropped by capacity.
        topk_weights: fp32 [T, k]. Unbiased scores at ``topk_ids`` (renormalized over the k
            selected if requested); 0 for dropped slots. Differentiable w.r.t. the logits.
        counts: int32 [E]. Kept slots per expert (after capacity).
        selected_counts: int32 [E]. Selected slots per expert before capacity dropping; the
            ``f_e`` of the load-balancing loss uses these.
        score_func: "softmax", "sigmoid" or "sqrtsoftplus", the score function that produced
            the routing.
        score_sum: fp32 [E] or None. Sum over tokens of the load-balancing loss's scores
            (:func:`tritonmoe.reference.aux_scores`: the softmax probabilities, or the sigmoid /
            sqrtsoftplus scores normalised over the experts per token), differentiable; present
            when ``route(..., with_aux=True)``, so the load-balancing loss does not re-read the
            logits.
        logsumexp: fp32 [T] or None. Per-token logsumexp of the logits (fp32), differentiable;
            present when ``route(..., with_aux=True)``, for the z-loss.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    counts: torch.Tensor
    selected_counts: torch.Tensor
    score_func: str = "softmax"
    score_sum: Optional[torch.Tensor] = None
    logsumexp: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]


@dataclass
class PermuteInfo:
    """Where each (token, slot) went in a permuted buffer of R rows grouped by expert.

    Attributes:
        expert_offsets: [E+1] (int32 or int64). Start row of each expert's segment; segments are
            padded up to a multiple of ``pad_to``; ``expert_offsets[E] == R``.
        slot_rows: int64 [T, k]. Row of slot (t, j) in the permuted buffer, -1 if the slot was
            not routed (id -1).
        counts: int32 [E]. Unpadded rows per expert.
        num_tokens: T, the rows of the unpermuted tensor.
        pad_to: the padding multiple the buffer was built with.

    Example: T=3, k=2, E=3, ids = [[1, 0], [1, 2], [-1, 1]], pad_to=1 gives counts [1, 3, 1],
    expert_offsets [0, 1, 4, 5] and slot_rows [[1, 0], [2, 4], [-1, 3]]: expert 0 holds (0,1);
    expert 1 holds (0,0), (1,0), (2,1) in token order; expert 2 holds (1,1).
    """

    expert_offsets: torch.Tensor
    slot_rows: torch.Tensor
    counts: torch.Tensor
    num_tokens: int
    pad_to: int = 1

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def top_k(self) -> int:
        return self.slot_rows.shape[1]


def max_permuted_rows(num_tokens: int, top_k: int, num_experts: int, pad_to: int = 1) -> int:
    """Static upper bound of R = expert_offsets[E] for any routing of T tokens: every slot
    routed, every expert padded by pad_to - 1 rows. Equals R when pad_to == 1 and no id is -1.
    A permuted buffer of this many rows can be built without reading R on the host."""
    return num_tokens * top_k + num_experts * (pad_to - 1)
