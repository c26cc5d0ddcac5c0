"""Router and balance-loss options of issue 31 (Megatron-Core parity): the normalised sigmoid
balance loss, sqrtsoftplus, group_score="sum_topn", capacity drop policies, the sequence-level,
padded and global balance losses, the attached aux loss. Every check is against an independent
computation written here (fp64 formulas, per-token loops); tests/test_megatron_parity.py compares
with Megatron-Core itself when it is installed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
import tritonmoe.reference as ref
from tritonmoe.kernels import routing as kr

from _dist import run_group, values_or_fail
import _aux_loss_cases


def _logits(T, E, seed=0, dtype=torch.float64, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g, dtype=torch.float64) * scale).to(dtype)


def _naive_balance(logits, ids, score_func, E, k):
    """E * sum_e f_e * P_e from first principles (fp64, loops over tokens)."""
    T = logits.shape[0]
    x = logits.double()
    if score_func == "softmax":
        q = torch.softmax(x, -1)
    else:
        s = torch.sigmoid(x) if score_func == "sigmoid" else F.softplus(x).sqrt()
        q = s / (s.sum(-1, keepdim=True) + 1e-20)
    f = torch.zeros(E, dtype=torch.float64)
    for t in range(T):
        for e in ids[t].tolist():
            if e >= 0:
                f[e] += 1.0 / (T * k)
    return E * (f * q.mean(0)).sum()


# -- 1. the sigmoid balance loss is normalised over the experts --------------------------------------


@pytest.mark.parametrize("score_func", ["sigmoid", "sqrtsoftplus", "softmax"])
def test_balance_loss_normalised_scores(score_func):
    x = _logits(64, 16, seed=1)
    r = ref.route(x, 4, score_func=score_func)
    want = _naive_balance(x, r.topk_ids, score_func, 16, 4)
    got = tm.load_balancing_loss(x, r)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    # with_aux: the same loss from the router's score sums (fp32 logits: the fused path's inputs)
    xf = x.float()
    ra = tm.route(xf, 4, score_func=score_func, with_aux=True)
    torch.testing.assert_close(tm.load_balancing_loss(xf, ra), _naive_balance(xf, ra.topk_ids, score_func, 16, 4).float(),
                               rtol=2e-6, atol=0)


def test_sigmoid_loss_is_near_one_not_eight():
    """The issue's numbers: E=16, k=4, random logits: the normalised loss is about 1 (perfect
    balance gives exactly 1); the old raw-sigmoid mean gave about 8."""
    x = _logits(4096, 16, seed=2, scale=1.0)
    r = ref.route(x, 4, score_func="sigmoid")
    loss = float(tm.load_balancing_loss(x, r))
    raw = 16 * float((r.selected_counts.double() / (4096 * 4) * torch.sigmoid(x).mean(0)).sum())
    assert 0.99 < loss < 1.1 and 7.5 < raw < 8.5


def _balanced_routing(T, E, k, dtype=torch.float64):
    """A routing whose every expert is selected T*k/E times (T*k divisible by E)."""
    ids = (torch.arange(T * k).view(T, k) % E).to(torch.int32)
    counts = torch.full((E,), T * k // E, dtype=torch.int32)
    return tm.Routing(ids, torch.ones(T, k, dtype=dtype), counts, counts.clone(), score_func="sigmoid")


@settings(max_examples=60)
@given(st.integers(1, 6), st.sampled_from([(4, 2), (8, 2), (8, 4), (6, 3)]), st.integers(0, 10_000),
       st.sampled_from(["sigmoid", "sqrtsoftplus"]))
def test_normalised_loss_has_no_uniform_shift_direction_when_balanced(T4, ek, seed, score_func):
    """What the normalisation guarantees: each token's balance scores sum to 1, so the
    derivative along a uniform shift of one token's logits is E/T * sum_e f_e dq_e/dc, which is
    0 whenever f is uniform, and the balanced loss is exactly 1 whatever the logits. The raw mean
    sigmoid has a strictly negative derivative there: pushing every logit down lowers it without
    balancing anything (the bug of issue 31)."""
    E, k = ek
    T = T4 * E  # T*k divisible by E
    x = _logits(T, E, seed=seed).requires_grad_()
    r = _balanced_routing(T, E, k)
    r.score_func = score_func
    loss = ref.load_balancing_loss(x, r, padding_mask=torch.ones(T, dtype=torch.bool))  # f from the ids
    torch.testing.assert_close(loss.detach(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-12, atol=0)
    (g,) = torch.autograd.grad(loss, x)
    assert g.sum(-1).abs().max() < 1e-14  # derivative along each token's uniform shift
    s = torch.sigmoid(x) if score_func == "sigmoid" else F.softplus(x).sqrt()
    raw = E * (r.selected_counts.double() / (T * k) * s.mean(0)).sum()
    (graw,) = torch.autograd.grad(raw, x)
    assert (graw.sum(-1) > 0).all()  # d raw / d shift > 0: a downward shift lowers the raw loss


@settings(max_examples=40)
@given(st.integers(1, 20), st.integers(2, 8), st.integers(0, 10_000))
def test_normalised_sigmoid_loss_is_shift_invariant_in_the_exp_regime(T, E, seed):
    """Far below zero sigmoid(x) = exp(x) (1 + O(exp(x))), so the normalised scores become the
    softmax and the loss becomes invariant to a uniform shift of a token's logits (the softmax
    property) up to O(exp(x)) (and AUX_EPS = 1e-20 against a sum of about e^-23 here); near zero it is
    not, the normalisation is of sigmoids."""
    x = _logits(T, E, seed=seed, scale=1.0).clamp(-3, 3)
    k = min(2, E)
    r = ref.route(x, k, score_func="sigmoid")
    a = ref.load_balancing_loss(x - 20.0, r)
    b = ref.load_balancing_loss(x - 23.0, r)
    soft = ref.load_balancing_loss(x, tm.Routing(r.topk_ids, r.topk_weights, r.counts, r.selected_counts))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    torch.testing.assert_close(a, soft, rtol=1e-6, atol=0)


def test_normalised_sigmoid_loss_depends_on_a_shift_near_zero():
    """... but not where sigmoid is not exp: an unbalanced routing's loss moves with a shift."""
    x = _logits(16, 8, seed=21, scale=1.0)
    r = ref.route(x, 2, score_func="sigmoid")
    a, b = ref.load_balancing_loss(x, r), ref.load_balancing_loss(x + 1.0, r)
    assert abs(float(a - b)) > 1e-4


@pytest.mark.parametrize("score_func", ["sigmoid", "sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("opts", [{}, {"sequence_length": 3}, {"padding_mask": True}, {"sequence_length": 3, "padding_mask": True}])
def test_balance_loss_gradcheck(score_func, opts):
    T, E, k = 9, 5, 2
    x = _logits(T, E, seed=3).requires_grad_()
    r = ref.route(x.detach(), k, score_func=score_func)
    kw = dict(opts)
    if kw.get("padding_mask"):
        kw["padding_mask"] = torch.tensor([True, False, True, True, True, False, False, False, False])
    assert torch.autograd.gradcheck(lambda z: tm.load_balancing_loss(z, r, **kw), (x,))
    m = kw.get("padding_mask")
    assert torch.autograd.gradcheck(lambda z: tm.z_loss(z, padding_mask=m), (x,))


# -- 2./4. sequence-level loss and padding masks ---------------------------------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_seq_loss_is_mean_of_per_sequence_losses(score_func):
    B, S, E, k = 4, 6, 8, 2
    x = _logits(B * S, E, seed=4)
    r = ref.route(x, k, score_func=score_func)
    want = torch.stack([_naive_balance(x[b * S:(b + 1) * S], r.topk_ids[b * S:(b + 1) * S], score_func, E, k)
                        for b in range(B)]).mean()
    torch.testing.assert_close(tm.load_balancing_loss(x, r, sequence_length=S), want, rtol=1e-13, atol=0)
    # one sequence: the batch loss
    torch.testing.assert_close(tm.load_balancing_loss(x, r, sequence_length=B * S), tm.load_balancing_loss(x, r),
                               rtol=1e-13, atol=0)


@settings(max_examples=60)
@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from([(4, 1), (6, 2), (8, 3)]), st.integers(0, 10_000),
       st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]), st.booleans())
def test_padding_mask_equals_removing_the_padded_tokens(B, S, ek, seed, score_func, seq):
    E, k = ek
    T = B * S
    x = _logits(T, E, seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(T, generator=g) > 0.4
    r = ref.route(x, k, score_func=score_func, with_aux=True)
    if seq:
        got = tm.load_balancing_loss(x, r, padding_mask=mask, sequence_length=S)
        per = []
        for b in range(B):
            sl = slice(b * S, (b + 1) * S)
            keep = mask[sl]
            xb, ids = x[sl][keep], r.topk_ids[sl][keep]
            per.append(_naive_balance(xb, ids, score_func, E, k) if xb.shape[0] else torch.zeros((), dtype=torch.float64))
        want = torch.stack(per).mean()
    else:
        got = tm.load_balancing_loss(x, r, padding_mask=mask)
        sub = ref.route(x[mask], k, score_func=score_func)
        want = tm.load_balancing_loss(x[mask], sub) if int(mask.sum()) else torch.zeros((), dtype=torch.float64)
        assert torch.equal(sub.topk_ids, r.topk_ids[mask])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    zsub = tm.z_loss(x[mask]) if int(mask.sum()) else torch.zeros((), dtype=torch.float64)
    torch.testing.assert_close(tm.z_loss(x, r, padding_mask=mask), zsub, rtol=1e-12, atol=0)


def test_all_padding_gives_zero_and_a_gradient():
    x = _logits(6, 4, seed=5).requires_grad_()
    r = ref.route(x.detach(), 2)
    none = torch.zeros(6, dtype=torch.bool)
    loss = tm.load_balancing_loss(x, r, padding_mask=none) + tm.z_loss(x, padding_mask=none)
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert x.grad.abs().max() == 0


# -- 5. drop policies -----------------------------------------------------------------------------------


def _drop_case(draw_seed, T, E, k, score_func="softmax"):
    x = _logits(T, E, seed=draw_seed, dtype=torch.float32)
    x[T // 2] = x[0]  # a repeated token: equal priorities on every expert it picks
    return x


@settings(max_examples=60)
@given(st.integers(0, 10_000), st.integers(1, 24), st.sampled_from([(4, 1), (4, 2), (8, 3), (6, 6)]),
       st.integers(0, 8), st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]), st.booleans())
def test_drop_policies(seed, T, ek, cap, score_func, renormalize):
    E, k = ek
    x = _drop_case(seed, T, E, k)
    kw = dict(score_func=score_func, renormalize=renormalize, routed_scaling_factor=1.5)
    free = tm.route(x, k, **kw)
    sel = free.topk_ids.long()
    prio = ref.drop_priority(x, sel, score_func, renormalize, 1.5, free.topk_weights)
    for policy in ("slot", "position", "probs"):
        r = tm.route(x, k, capacity=cap, drop_policy=policy, **kw)
        assert torch.equal(r.selected_counts, free.counts)
        kept = r.topk_ids.long() >= 0
        assert torch.equal(r.topk_ids.long()[kept], sel[kept])  # dropping never moves a slot
        assert torch.equal(r.topk_weights[~kept], torch.zeros(int((~kept).sum())))
        assert torch.equal(r.topk_weights[kept], free.topk_weights[kept])
        for e in range(E):
            slots = [(t, j) for t in range(T) for j in range(k) if sel[t, j] == e]
            n_keep = min(cap, len(slots))
            if policy == "slot":
                order = sorted(slots, key=lambda s: (s[1], s[0]))
            elif policy == "position":
                order = sorted(slots, key=lambda s: s[0])  # the earliest tokens
            else:  # the highest priorities, ties to the earlier token
                order = sorted(slots, key=lambda s: (-float(prio[s]), s[0]))
            want = set(order[:n_keep])
            got = {s for s in slots if kept[s]}
            assert got == want, (policy, e)
            assert int(r.counts[e]) == n_keep


def test_drop_priority_is_the_weight():
    """The probs policy ranks the canonical weight: within a few ulp of the weight itself."""
    x = _logits(50, 8, seed=6, dtype=torch.float32)
    for sf in ("softmax", "sigmoid", "sqrtsoftplus"):
        for ren in (True, False):
            r = tm.route(x, 3, score_func=sf, renormalize=ren, routed_scaling_factor=2.0)
            p = ref.drop_priority(x, r.topk_ids.long(), sf, ren, 2.0, r.topk_weights)
            torch.testing.assert_close(p, r.topk_weights, rtol=3e-6, atol=1e-30)


# -- 6. group scores: sum_topn ---------------------------------------------------------------------------


def _naive_group_route(x, k, G, tg, score_func, bias=None):
    """Megatron's rule, per token: groups scored by the sum of their top k//tg values (logits under
    softmax without a bias, scores otherwise, biased with a bias); best tg groups (ties: lower
    group), then the top k experts of those (ties: lower id). fp64."""
    T, E = x.shape
    S, n = E // G, k // tg
    xd = x.double()
    if score_func == "softmax":
        s = torch.softmax(xd, -1)
    elif score_func == "sigmoid":
        s = torch.sigmoid(xd)
    else:
        s = F.softplus(xd).sqrt()
    sel = xd if bias is None else s + bias.double()
    gv = sel if (bias is not None or score_func == "softmax") else s
    out = []
    for t in range(T):
        gs = [sum(sorted(gv[t, g * S:(g + 1) * S].tolist(), reverse=True)[:n]) for g in range(G)]
        groups = sorted(range(G), key=lambda g: (-gs[g], g))[:tg]
        allowed = [e for e in range(E) if e // S in groups]
        out.append(sorted(allowed, key=lambda e: (-float(sel[t, e]), e))[:k])
    return out


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("G,tg,k", [(4, 2, 4), (4, 1, 3), (8, 3, 6), (8, 4, 6), (2, 2, 2)])
def test_sum_topn_matches_megatrons_rule(score_func, bias, G, tg, k):
    E = 16
    x = _logits(40, E, seed=7)
    b = torch.linspace(-0.2, 0.2, E, dtype=torch.float64) if bias else None
    r = ref.route(x, k, score_func=score_func, expert_bias=b, n_groups=G, topk_groups=tg, group_score="sum_topn")
    assert r.topk_ids.tolist() == _naive_group_route(x, k, G, tg, score_func, b)


def test_sum_topn_with_two_equals_top2sum_values():
    """n = 2 with a bias: the same group order as top2sum (both sum the two largest biased scores)."""
    x = _logits(60, 16, seed=8, dtype=torch.float32)
    b = torch.linspace(-0.1, 0.1, 16)
    a = ref.route(x, 4, score_func="sigmoid", expert_bias=b, n_groups=4, topk_groups=2, group_score="sum_topn")
    c = ref.route(x, 4, score_func="sigmoid", expert_bias=b, n_groups=4, topk_groups=2, group_score="top2sum")
    assert torch.equal(a.topk_ids, c.topk_ids)


# -- 7. sqrtsoftplus -------------------------------------------------------------------------------------


def test_sqrtsoftplus_scores_and_canonical_values():
    x = torch.cat([_logits(30, 8, seed=9, dtype=torch.float32, scale=6.0),
                   torch.tensor([[-90.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 50.0, 90.0]])])
    r = tm.route(x, 3, score_func="sqrtsoftplus", renormalize=False)
    want = F.softplus(x.double()).sqrt().gather(1, r.topk_ids.long())
    torch.testing.assert_close(r.topk_weights.double(), want, rtol=1e-6, atol=0)
    c = ref.canonical_scores(x, "sqrtsoftplus").double()
    exact = F.softplus(x.double()).sqrt()
    big = exact > 1e-18  # below, canonical_exp flushes to 0 (a selection value, not a weight)
    assert ((c - exact).abs()[big] / exact[big]).max() < 4 * 2.0**-23
    assert (ref.canonical_scores(x, "sqrtsoftplus") >= 0).all()


# -- kernels against the reference -------------------------------------------------------------------------

#: several token blocks (the scans cross blocks and their own row tiles) on a small input
SMALL = kr.RouteConfig(block_t=2, num_warps=4, bwd_block_t=4, bwd_num_warps=4, scan_block_r=4, scan_block_e=8,
                       scan_split_slots=False)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("group", [None, "top2sum", "sum_topn", "max"])
@pytest.mark.parametrize("policy", ["slot", "position", "probs", None])
def test_kernel_matches_reference(score_func, group, policy):
    T, E, K = 21, 16, 4
    for bias, ren in ((False, True), (True, False)):
        x = _logits(T, E, seed=10 + bias + 2 * ren, dtype=torch.float32)
        x[5] = x[6]  # ties across tokens (equal priorities)
        x[7, 1] = x[7, 2]  # a tie inside a token
        b = torch.linspace(-0.1, 0.1, E) if bias else None
        kw = dict(score_func=score_func, expert_bias=b, renormalize=ren, routed_scaling_factor=1.5, with_aux=True)
        if group:
            kw.update(n_groups=4, topk_groups=2, group_score=group)
        if policy:
            kw.update(capacity=5, drop_policy=policy)
        xr, xk = x.clone().requires_grad_(), x.clone().requires_grad_()
        want = ref.route(xr, K, **kw)
        with kr.config_override(SMALL):
            got = kr.route(xk, K, **kw)
        assert torch.equal(got.topk_ids, want.topk_ids)
        assert torch.equal(got.counts, want.counts) and torch.equal(got.selected_counts, want.selected_counts)
        torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(got.score_sum, want.score_sum, rtol=2e-6, atol=1e-6)
        torch.testing.assert_close(got.logsumexp, want.logsumexp, rtol=2e-6, atol=1e-6)
        dw = torch.randn(T, K, generator=torch.Generator().manual_seed(1))
        for r, xx in ((want, xr), (got, xk)):
            ((r.topk_weights * dw).sum() + tm.load_balancing_loss(xx, r) + tm.z_loss(xx, r)).backward()
        torch.testing.assert_close(xk.grad, xr.grad, rtol=1e-4, atol=2e-6)


def test_kernel_score_sum_gradient_through_normalisation():
    """d(score_sum) alone, sigmoid/sqrtsoftplus: the kernel's backward of the normalised sums."""
    x = _logits(13, 6, seed=11, dtype=torch.float32)
    v = torch.randn(6, generator=torch.Generator().manual_seed(2))
    for sf in ("sigmoid", "sqrtsoftplus"):
        xr, xk = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ref.route(xr, 2, score_func=sf, with_aux=True).score_sum * v).sum().backward()
        (kr.route(xk, 2, score_func=sf, with_aux=True).score_sum * v).sum().backward()
        torch.testing.assert_close(xk.grad, xr.grad, rtol=1e-5, atol=1e-7)


# -- bad input -------------------------------------------------------------------------------------------


def test_bad_input_raises_typed_errors_naming_the_fix():
    x = _logits(6, 4, seed=12, dtype=torch.float32)
    r = tm.route(x, 2)
    with pytest.raises(ValueError, match=r"padding_mask has shape \(5,\).*6 tokens"):
        tm.load_balancing_loss(x, r, padding_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        tm.load_balancing_loss(x, r, padding_mask=torch.ones(6))
    with pytest.raises(ValueError, match="padding_mask"):
        tm.z_loss(x, padding_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="sequence_length=4 does not divide the 6 tokens"):
        tm.load_balancing_loss(x, r, sequence_length=4)
    with pytest.raises(ValueError, match="sequence_length=0"):
        tm.load_balancing_loss(x, r, sequence_length=0)
    with pytest.raises(TypeError, match="sequence_length"):
        tm.load_balancing_loss(x, r, sequence_length=2.0)
    with pytest.raises(ValueError, match="drop_policy='first'.*'slot', 'position', 'probs'"):
        tm.route(x, 2, capacity=2, drop_policy="first")
    with pytest.raises(ValueError, match="score_func='softplus'"):
        tm.route(x, 2, score_func="softplus")
    with pytest.raises(ValueError, match="top_k >= topk_groups"):
        tm.route(x, 1, n_groups=2, topk_groups=2, group_score="sum_topn")
    with pytest.raises(ValueError, match="aux_loss_type='seqaux'"):
        tm.MoEConfig(8, 8, 4, 2, aux_loss_type="seqaux")
    with pytest.raises(ValueError, match="one coefficient per type"):
        tm.MoEConfig(8, 8, 4, 2, aux_loss_type=("seq", "global"), aux_loss_coef=1e-3)
    with pytest.raises(ValueError, match="is one type"):
        tm.MoEConfig(8, 8, 4, 2, aux_loss_type="seq", aux_loss_coef=(1e-3,))
    with pytest.raises(ValueError, match="names a loss twice"):
        tm.MoEConfig(8, 8, 4, 2, aux_loss_type=("seq", "seq"), aux_loss_coef=(1e-3, 1e-3))
    with pytest.raises(ValueError, match="aux_loss_coef=-1.0"):
        tm.MoEConfig(8, 8, 4, 2, aux_loss_type=("seq", "global"), aux_loss_coef=(1e-3, -1.0))
    with pytest.raises(ValueError, match="drop_policy='tokens'"):
        tm.MoEConfig(8, 8, 4, 2, capacity_factor=1.0, drop_policy="tokens")
    with pytest.raises(ValueError, match="aux_loss_mode='auto'"):
        tm.MoEConfig(8, 8, 4, 2, aux_loss_mode="auto")
    with pytest.raises(ValueError, match="add 'global' to aux_loss_type"):
        tm.MoELayer(tm.MoEConfig(8, 8, 4, 2, aux_loss_coef=0.1), aux_loss_group=object())
    layer = tm.MoELayer(tm.MoEConfig(8, 8, 4, 2, aux_loss_type="seq", aux_loss_coef=0.1))
    with pytest.raises(ValueError, match=r"\[B, S, d_model\]"):
        layer(torch.randn(6, 8))
    with pytest.raises(ValueError, match=r"padding_mask has shape \(2, 4\)"):
        layer(torch.randn(2, 3, 8), padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        layer(torch.randn(2, 3, 8), padding_mask=torch.ones(2, 3))


# -- the layer: several losses, masks, attach mode ---------------------------------------------------------


def _layer(**kw):
    torch.manual_seed(0)
    return tm.MoELayer(tm.MoEConfig(6, 8, 8, 2, backend="torch", **kw), dtype=torch.float64)


def test_layer_sums_the_configured_losses():
    x = torch.randn(3, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(4)) > 0.3
    layer = _layer(score_func="sigmoid", aux_loss_type=("switch", "seq"), aux_loss_coef=(0.5, 0.25), z_loss_coef=0.125,
                   capacity_factor=1.0, drop_policy="position")
    layer(x, padding_mask=mask)
    logits, r = layer.last_router_logits, layer.last_routing
    m = mask.reshape(-1)
    want = (0.5 * tm.load_balancing_loss(logits, r, padding_mask=m)
            + 0.25 * tm.load_balancing_loss(logits, r, padding_mask=m, sequence_length=5)
            + 0.125 * tm.z_loss(logits, r, padding_mask=m))
    torch.testing.assert_close(layer.aux_loss, want, rtol=1e-14, atol=0)
    # the expert load counts only real tokens' kept slots
    ids = r.topk_ids.long()[m]
    assert torch.equal(layer.expert_load(), torch.bincount(ids[ids >= 0], minlength=8))
    # the capacity policy reached the router
    free = tm.route(logits, 2, score_func="sigmoid")
    cap = layer.config.capacity(15)
    assert torch.equal(r.topk_ids, tm.route(logits, 2, score_func="sigmoid", capacity=cap, drop_policy="position").topk_ids)
    assert torch.equal(r.selected_counts, free.counts)


def test_layer_padding_mask_equals_removing_padded_tokens():
    x = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([True, True, False, True, False, True, True, True, False, True])
    a, b = _layer(aux_loss_coef=0.5, z_loss_coef=0.1), _layer(aux_loss_coef=0.5, z_loss_coef=0.1)
    ya = a(x, padding_mask=mask)
    yb = b(x[mask])
    torch.testing.assert_close(ya[mask], yb, rtol=0, atol=0)  # padded tokens still pass, independently
    torch.testing.assert_close(a.aux_loss, b.aux_loss, rtol=1e-14, atol=0)
    assert torch.equal(a.expert_load(), b.expert_load())
    a.aux_loss.backward()
    b.aux_loss.backward()
    torch.testing.assert_close(a.router.weight.grad, b.router.weight.grad, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_attached_aux_loss_gradient_equals_adding_it(scale):
    x = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    plain, attached = _layer(aux_loss_coef=0.3, z_loss_coef=0.01), _layer(aux_loss_coef=0.3, z_loss_coef=0.01,
                                                                         aux_loss_mode="attach")
    w = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    y = plain(x)
    ((y * w).sum() + scale * plain.aux_loss).backward()
    tm.set_aux_loss_scale(scale)
    try:
        ya = attached(x)
        assert not attached.aux_loss.requires_grad
        torch.testing.assert_close(attached.aux_loss, plain.aux_loss.detach(), rtol=0, atol=0)
        torch.testing.assert_close(ya, y, rtol=0, atol=0)
        (ya * w).sum().backward()  # the user never touches the aux loss
    finally:
        tm.set_aux_loss_scale(1.0)
    for (n, p), (_, q) in zip(plain.named_parameters(), attached.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-13, atol=1e-16, msg=n)


def test_aux_loss_scale_validation():
    with pytest.raises(TypeError):
        tm.set_aux_loss_scale("1")
    with pytest.raises(ValueError, match="not finite"):
        tm.set_aux_loss_scale(float("inf"))
    tm.set_aux_loss_scale(torch.tensor(0.5, dtype=torch.float64))
    tm.set_aux_loss_scale(1.0)


def test_global_loss_single_process_accumulates_and_resets():
    """One process, no group: micro-batch m's loss uses the frequencies of micro-batches 1..m."""
    layer = _layer(aux_loss_type="global", aux_loss_coef=1.0)
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(t, 6, dtype=torch.float64, generator=g) for t in (5, 7, 3)]
    logits_all = []
    for i, x in enumerate(xs):
        layer(x)
        logits_all.append(layer.last_router_logits.detach())
        cat = torch.cat(logits_all)
        f = ref.route(cat, 2).counts.double() / (2 * cat.shape[0])
        s = torch.softmax(logits_all[-1], -1).sum(0)
        torch.testing.assert_close(layer.aux_loss.detach(), 8 * (f * s).sum() / x.shape[0], rtol=1e-14, atol=0)
    assert layer.global_balance_state.micro_batches == 3
    layer.reset_aux_loss_state()
    layer(xs[0])
    r = layer.last_routing
    torch.testing.assert_close(layer.aux_loss, tm.load_balancing_loss(layer.last_router_logits, r), rtol=1e-14, atol=0)


@pytest.mark.dist
@pytest.mark.parametrize("score_func,use_mask", [("softmax", False), ("sigmoid", True)])
def test_global_loss_two_ranks_four_micro_batches(score_func, use_mask):
    """gloo, 2 ranks (the data-parallel group), 4 ragged micro-batches (one empty): each
    forward's loss and router gradient equal the single-process computation over the
    concatenated batch; summed over the ranks, micro-batch m's loss is the Switch loss of its
    global batch with the frequencies of every token routed since the reset (after a reset: the
    Switch loss of the concatenated micro-batch)."""
    results, _ = run_group(2, _aux_loss_cases.global_losses, score_func, use_mask, deadline_s=180, pg_timeout_s=60)
    per_rank = values_or_fail(results)
    torch.manual_seed(0)
    cfg = tm.MoEConfig(6, 8, 8, 2, score_func=score_func, backend="torch")
    single = tm.MoELayer(cfg, dtype=torch.float64)
    xs, masks = _aux_loss_cases.inputs()
    W = single.router.weight
    order = list(range(4)) + [0]
    E, k = 8, 2
    for i, m in enumerate(order):
        hist = order[:i + 1] if i < 4 else [0]
        # the frequencies: every rank's micro-batches since the reset, concatenated
        xcat = torch.cat([xs[r][mm] for mm in hist for r in range(2)])
        mcat = torch.cat([masks[r][mm] for mm in hist for r in range(2)])
        rcat = ref.route(xcat @ W.detach().t(), k, score_func=score_func)
        ids = rcat.topk_ids.long()
        if use_mask:
            ids = ids[mcat]
        n_all = ids.shape[0]
        f = torch.bincount(ids.reshape(-1), minlength=E).double() / (k * max(n_all, 1))
        n_m = sum(int(masks[r][m].sum()) if use_mask else xs[r][m].shape[0] for r in range(2))
        total = 0.0
        for r in range(2):
            Wr = W.detach().clone().requires_grad_()
            logits = xs[r][m] @ Wr.t()
            q = ref.aux_scores(logits, score_func)
            if use_mask:
                q = q[masks[r][m]]
            want = E * (f * q.sum(0)).sum() / max(n_m, 1)
            want.backward()
            got_loss, got_grad = per_rank[r][i]
            assert math.isclose(got_loss, float(want.detach()), rel_tol=1e-12, abs_tol=1e-15), (r, i)
            torch.testing.assert_close(got_grad, Wr.grad, rtol=1e-11, atol=1e-15)
            total += got_loss
        if i in (0, 4):  # the first micro-batch after a reset: the Switch loss of the concatenated batch
            xm = torch.cat([xs[r][m] for r in range(2)])
            mm_ = torch.cat([masks[r][m] for r in range(2)])
            lg = xm @ W.detach().t()
            rr = ref.route(lg, k, score_func=score_func)
            want_cat = tm.load_balancing_loss(lg, rr, padding_mask=mm_ if use_mask else None)
            assert math.isclose(total, float(want_cat), rel_tol=1e-12)


# -- HF: the attention mask reaches the layer --------------------------------------------------------------


def test_hf_attention_mask_reaches_the_layer():
    transformers = pytest.importorskip("transformers")
    from transformers import MixtralConfig, MixtralForCausalLM
    import tritonmoe.hf as hf

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16)
    model = MixtralForCausalLM(cfg).double()
    hf.apply(model, backend="torch", aux_loss_coef=1.0)
    block = next(m for m in model.modules() if isinstance(m, hf.HFMoEBlock))
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    att = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    model(ids, attention_mask=att)
    logits, r = block.moe.last_router_logits, block.moe.last_routing
    m = att.reshape(-1).bool()
    torch.testing.assert_close(block.moe.aux_loss, tm.load_balancing_loss(logits, r, padding_mask=m), rtol=1e-14, atol=0)
    model(ids)  # no mask: every token counts
    torch.testing.assert_close(block.moe.aux_loss, tm.load_balancing_loss(block.moe.last_router_logits,
                                                                          block.moe.last_routing), rtol=1e-14, atol=0)
    hf.restore(model)
    assert hf._MASK_HOOKS not in model.__dict__


# -- torch.compile: the new options go through the route custom op ------------------------------------------


def test_route_op_opcheck_with_new_options():
    logits = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9), requires_grad=True)
    bias = torch.linspace(-0.1, 0.1, 8)
    for args in (
        (logits, None, 2, "sqrtsoftplus", True, 4, 2, 3, True, "sum_topn", 1.0, "torch", "probs"),
        (logits, bias, 3, "sigmoid", False, None, None, 2, True, "top2sum", 2.0, "torch", "position"),
    ):
        torch.library.opcheck(torch.ops.tritonmoe.route.default, args)


def test_compiled_layer_with_new_options_matches_eager():
    layer = _layer(score_func="sqrtsoftplus", n_groups=4, topk_groups=2, group_score="sum_topn", capacity_factor=1.0,
                   drop_policy="probs", aux_loss_type=("switch", "seq"), aux_loss_coef=(0.1, 0.2), z_loss_coef=0.01)
    x = torch.randn(2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    mask = torch.rand(2, 5, generator=torch.Generator().manual_seed(11)) > 0.3
    y = layer(x, padding_mask=mask)
    aux, ids = layer.aux_loss.detach(), layer.last_routing.topk_ids
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    yc = compiled(x, padding_mask=mask)
    torch.testing.assert_close(yc, y, rtol=1e-13, atol=1e-15)
    assert torch.equal(layer.last_routing.topk_ids, ids)
    torch.testing.assert_close(layer.aux_loss.detach(), aux, rtol=1e-13, atol=0)


def test_config_forms_and_parm_refusal():
    c = tm.MoEConfig(8, 8, 4, 2, aux_loss_type=("switch",), aux_loss_coef=(0.1,))
    assert c.aux_loss_type == "switch" and c.aux_loss_coef == 0.1 and c.aux_losses == {"switch": 0.1}
    c = tm.MoEConfig(8, 8, 4, 2, aux_loss_type=["seq", "global"], aux_loss_coef=[0, 2])
    assert c.aux_loss_type == ("seq", "global") and c.aux_loss_coef == (0.0, 2.0) and c.aux_losses == {"global": 2.0}
    # refused before any group is touched (the groups here are not even process groups)
    with pytest.raises(ValueError, match="Parm layouts"):
        tm.MoELayer(tm.MoEConfig(8, 8, 4, 2, aux_loss_type="seq", aux_loss_coef=0.1), mp_group=object())
    with pytest.raises(ValueError, match="Parm layouts"):
        tm.MoELayer(tm.MoEConfig(8, 8, 4, 2, capacity_factor=1.0, drop_policy="probs"), esp_group=object())


# -- the balance-score kernel (the fused sums of the seq / padded losses) -----------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("T,E,S,masked", [(24, 8, 6, True), (24, 8, None, True), (37, 6, None, False),
                                          (30, 5, 3, False), (0, 4, None, True), (8, 3, 8, True)])
def test_balance_score_sums_kernel_matches_reference(score_func, T, E, S, masked):
    x = _logits(T, E, seed=T + E, dtype=torch.float32)
    mask = (torch.rand(T, generator=torch.Generator().manual_seed(3)) > 0.3) if masked else None
    xr, xk = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = ref.balance_score_sums(xr, score_func, mask, S)
    got = kr.balance_score_sums(xk, score_func, mask, S)
    assert got.shape == want.shape == ((T // S) if S else 1, E)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(4))
    (want * g).sum().backward()
    (got * g).sum().backward()
    torch.testing.assert_close(xk.grad, xr.grad, rtol=1e-5, atol=1e-7)


def test_load_balancing_loss_on_the_triton_backend():
    x = _logits(24, 8, seed=30, dtype=torch.float32)
    mask = torch.rand(24, generator=torch.Generator().manual_seed(5)) > 0.3
    r = tm.route(x, 2, score_func="sigmoid")
    for kw in ({"padding_mask": mask}, {"sequence_length": 6}, {"padding_mask": mask, "sequence_length": 4}):
        xr, xk = x.clone().requires_grad_(), x.clone().requires_grad_()
        a = tm.load_balancing_loss(xr, r, backend="torch", **kw)
        b = tm.load_balancing_loss(xk, r, backend="triton", **kw)
        torch.testing.assert_close(b, a, rtol=2e-6, atol=0)
        a.backward()
        b.backward()
        torch.testing.assert_close(xk.grad, xr.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_kernel_drop_edges(policy):
    """capacity 0 (everything dropped), 1, and above every count (nothing dropped); T = 0."""
    x = _logits(9, 4, seed=40, dtype=torch.float32)
    for cap in (0, 1, 100):
        want = ref.route(x, 2, capacity=cap, drop_policy=policy)
        with kr.config_override(SMALL):
            got = kr.route(x, 2, capacity=cap, drop_policy=policy)
        assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.counts, want.counts)
        assert torch.equal(got.selected_counts, want.selected_counts)
    empty = kr.route(torch.zeros(0, 4), 2, capacity=1, drop_policy=policy)
    assert empty.topk_ids.shape == (0, 2) and empty.counts.tolist() == [0] * 4
