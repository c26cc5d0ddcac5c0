"""Hypothesis strategies shared by the tests: routing problems and permutation problems."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from hypothesis import strategies as st

EXPERT_COUNTS = [1, 2, 3, 4, 5, 7, 8, 12, 13]  # includes E=1 and primes


@dataclass
class RouteCase:
    logits: torch.Tensor
    top_k: int
    score_func: str
    renormalize: bool
    expert_bias: Optional[torch.Tensor]
    n_groups: Optional[int]
    topk_groups: Optional[int]
    capacity: Optional[int]

    def kwargs(self):
        return dict(
            score_func=self.score_func,
            renormalize=self.renormalize,
            expert_bias=self.expert_bias,
            n_groups=self.n_groups,
            topk_groups=self.topk_groups,
            capacity=self.capacity,
        )


@st.composite
def route_cases(draw, max_tokens: int = 12, experts=EXPERT_COUNTS, dtype=torch.float32):
    """A routing problem. Logits are random floats, or small integers (forcing exact ties), or
    integers with some -inf (masked experts)."""
    T = draw(st.integers(0, max_tokens))
    E = draw(st.sampled_from(experts))
    k = draw(st.integers(1, E))
    score_func = draw(st.sampled_from(["softmax", "sigmoid"]))
    renormalize = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    mode = draw(st.sampled_from(["float", "ties", "masked"]))
    g = torch.Generator().manual_seed(seed)
    if mode == "float":
        logits = torch.randn(T, E, generator=g) * 2
    else:
        logits = torch.randint(-3, 4, (T, E), generator=g).float()
        if mode == "masked" and E > 1:
            mask = torch.rand(T, E, generator=g) < 0.3
            mask[:, 0] = False  # keep a finite logit per token (softmax of all -inf is NaN)
            logits[mask] = float("-inf")
    logits = logits.to(dtype)
    bias = None
    if draw(st.booleans()):
        # dyadic values: exact in fp32 and fp64, so ties stay ties
        bias = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.5, -0.25, 0.125]), min_size=E, max_size=E)))
    n_groups = topk_groups = None
    divisors = [d for d in range(2, E + 1) if E % d == 0]
    if divisors and draw(st.booleans()):
        n_groups = draw(st.sampled_from(divisors))
        need = -(-k // (E // n_groups))  # groups needed to hold k experts
        topk_groups = draw(st.integers(need, n_groups))
    capacity = None
    if draw(st.booleans()):
        capacity = draw(st.integers(0, max(1, T * k // max(E, 1) + 2)))
    return RouteCase(logits, k, score_func, renormalize, bias, n_groups, topk_groups, capacity)


@dataclass
class PermuteCase:
    x: torch.Tensor
    ids: torch.Tensor
    num_experts: int
    pad_to: int
    weights: torch.Tensor


@st.composite
def permute_cases(draw, max_tokens: int = 16, max_d: int = 9, dtype=torch.float32):
    """A permutation problem: ids in [-1, E) with duplicates-free rows (as routing makes them),
    sometimes all on one expert, sometimes with unrouted slots."""
    T = draw(st.integers(0, max_tokens))
    E = draw(st.sampled_from(EXPERT_COUNTS))
    k = draw(st.integers(1, E))
    d = draw(st.integers(1, max_d))
    pad_to = draw(st.sampled_from([1, 1, 2, 4, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    mode = draw(st.sampled_from(["random", "skewed", "dropped"]))
    g = torch.Generator().manual_seed(seed)
    if mode == "skewed" and k == 1:
        ids = torch.zeros(T, 1, dtype=torch.int64)  # all tokens on expert 0
    else:
        # k distinct experts per token, drawn with a skew toward low ids in "skewed" mode
        w = torch.arange(E, 0, -1).float() ** (3 if mode == "skewed" else 0)
        ids = torch.stack([torch.multinomial(w, k, generator=g) for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.int64)
    if mode == "dropped" and T:
        drop = torch.rand(T, k, generator=g) < 0.3
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    x = torch.randn(T, d, generator=g).to(dtype)
    weights = torch.rand(T, k, generator=g)
    return PermuteCase(x, ids, E, pad_to, weights)
