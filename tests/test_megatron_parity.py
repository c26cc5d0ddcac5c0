"""tritonmoe's router options and balance losses against NVIDIA Megatron-Core's MoE utilities
(``megatron.core.transformer.moe.moe_utils``, pure torch), when megatron-core is installed
(``pip install megatron-core --no-deps``); skipped otherwise. The in-repo references of the same
options are tested in tests/test_router_parity.py without it. fp64, random logits (no ties:
Megatron breaks ties with torch.topk, whose order among equal values is unspecified)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tritonmoe as tm

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")


def _logits(T, E, seed):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _their_switch(logits, k, score_func, padding_mask=None):
    """Megatron's aux loss (coefficient 1): routing map and scores of compute_routing_scores_for_aux_loss."""
    pad = None if padding_mask is None else ~padding_mask  # Megatron: True = padding
    rmap, scores = mu.compute_routing_scores_for_aux_loss(logits, k, score_func, padding_mask=pad)
    n = logits.shape[0] if padding_mask is None else int(padding_mask.sum())
    return mu.switch_load_balancing_loss_func(scores, rmap.sum(0), n, k, logits.shape[1], 1.0)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("masked", [False, True])
def test_switch_loss(score_func, masked):
    x = _logits(40, 16, 0)
    mask = torch.rand(40, generator=torch.Generator().manual_seed(1)) > 0.3 if masked else None
    r = tm.route(x, 4, score_func=score_func)
    ours = tm.load_balancing_loss(x, r, padding_mask=mask)
    theirs = _their_switch(x, 4, score_func, mask)  # Megatron's softmax is fp32 whatever the logits
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6 if score_func == "softmax" else 1e-12, atol=0)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_seq_loss(score_func):
    """Megatron's seq_aux_loss (router._apply_seq_aux_loss): tokens [S, B] sequence-major, the
    map and scores reshaped to [S, B*E]; ours reads [B, S] batch-major."""
    B, S, E, k = 3, 8, 8, 2
    x_bs = _logits(B * S, E, 2)
    r = tm.route(x_bs, k, score_func=score_func)
    ours = tm.load_balancing_loss(x_bs, r, sequence_length=S)
    x_sb = x_bs.view(B, S, E).transpose(0, 1).reshape(S * B, E)
    rmap, scores = mu.compute_routing_scores_for_aux_loss(x_sb, k, score_func)
    rmap, scores = rmap.reshape(S, -1), scores.reshape(S, -1)
    theirs = mu.switch_load_balancing_loss_func(scores, rmap.sum(0), S, k, E, 1.0) / B
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6 if score_func == "softmax" else 1e-12, atol=0)


def test_z_loss_with_padding():
    x = _logits(20, 8, 3)
    mask = torch.rand(20, generator=torch.Generator().manual_seed(4)) > 0.4
    torch.testing.assert_close(tm.z_loss(x, padding_mask=mask), mu.z_loss_func(x, 1.0, padding_mask=~mask), rtol=1e-12,
                               atol=0)


def _ids_of(routing_map, k):
    """Per token, the sorted expert ids of a [T, E] bool map."""
    return [sorted(torch.nonzero(row).flatten().tolist()) for row in routing_map]


@pytest.mark.parametrize("score_func,bias", [("softmax", False), ("sigmoid", False), ("sigmoid", True)])
@pytest.mark.parametrize("G,tg,k", [(4, 2, 4), (8, 2, 6), (8, 4, 8), (4, 1, 2)])
def test_group_scores_sum_topn(score_func, bias, G, tg, k):
    E = 16 if G == 4 else 32
    x = _logits(48, E, 5)
    b = torch.linspace(-0.3, 0.3, E, dtype=torch.float64) if bias else None
    r = tm.route(x, k, score_func=score_func, expert_bias=b, n_groups=G, topk_groups=tg, group_score="sum_topn")
    probs, rmap = mu.topk_routing_with_score_function(x, k, use_pre_softmax=False, num_groups=G, group_topk=tg,
                                                      score_function=score_func, expert_bias=b)
    assert [sorted(row) for row in r.topk_ids.tolist()] == _ids_of(rmap, k)
    # Megatron's weights come from fp32 scores (softmax, and sigmoid of logits.float())
    torch.testing.assert_close(torch.zeros_like(probs).scatter(1, r.topk_ids.long(), r.topk_weights), probs,
                               rtol=1e-6, atol=1e-300)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_drop_policy_probs(score_func):
    T, E, k, cf = 50, 8, 2, 0.7
    x = _logits(T, E, 6)
    probs, rmap = mu.topk_routing_with_score_function(x, k, score_function=score_func)
    final_probs, final_map = mu.apply_router_token_dropping(probs, rmap, k, cf, drop_policy="probs")
    cap = mu.get_capacity(T * k, E, cf)
    r = tm.route(x, k, score_func=score_func, capacity=cap, drop_policy="probs")
    ours_map = torch.zeros(T, E, dtype=torch.bool)
    kept = r.topk_ids >= 0
    ours_map[torch.nonzero(kept)[:, 0], r.topk_ids[kept].long()] = True
    assert torch.equal(ours_map, final_map)
    ours_probs = torch.zeros(T, E, dtype=torch.float64)
    ours_probs[torch.nonzero(kept)[:, 0], r.topk_ids[kept].long()] = r.topk_weights[kept]
    torch.testing.assert_close(ours_probs, final_probs, rtol=1e-6, atol=1e-300)


def test_drop_policy_position_counts():
    """Megatron's "position" picks among equal map values with torch.topk (unspecified order), so
    only what it guarantees is compared: the kept count per expert; ours keeps the earliest."""
    T, E, k, cf = 40, 8, 2, 0.6
    x = _logits(T, E, 7)
    probs, rmap = mu.topk_routing_with_score_function(x, k)
    _, final_map = mu.apply_router_token_dropping(probs, rmap, k, cf, drop_policy="position")
    cap = mu.get_capacity(T * k, E, cf)
    r = tm.route(x, k, capacity=cap, drop_policy="position")
    assert torch.equal(r.counts.long(), final_map.sum(0))


def test_attached_loss_matches_aux_loss_auto_scaler():
    x = _logits(10, 4, 8).requires_grad_()
    aux = (x.square()).mean()
    out = x * 2
    ours = tm.attach_aux_loss(out, aux)
    tm.set_aux_loss_scale(0.5)
    try:
        (g_ours,) = torch.autograd.grad(ours.sum(), x)
    finally:
        tm.set_aux_loss_scale(1.0)
    mu.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.5, dtype=torch.float64))
    try:
        theirs = mu.MoEAuxLossAutoScaler.apply(x * 2, (x.square()).mean())
        (g_theirs,) = torch.autograd.grad(theirs.sum(), x)
    finally:
        mu.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=0)


def test_capacity_rounding_differs_at_exact_products():
    """Megatron rounds ceil(T*k/E * cf) in floating point; tritonmoe's MoEConfig.capacity is exact
    (cf as the decimal it prints as): T=50, k=8, E=8, cf=1.1 is 55 exactly; Megatron's float
    product 55.000000000000007 rounds up to 56."""
    assert mu.get_capacity(50 * 8, 8, 1.1) == 56
    assert tm.MoEConfig(8, 8, 8, 8, capacity_factor=1.1).capacity(50) == 55
