"""tritonmoe.reference against the naive per-token loops of tests/naive.py, plus the routing and
permutation invariants as properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe import reference as ref

import naive
from strategies import permute_cases, route_cases


# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------


@settings(max_examples=250)
@given(route_cases(), st.sampled_from(["top2sum", "max"]), st.sampled_from([1.0, 2.5]))
def test_route_matches_naive(case, group_score, routed_scaling_factor):
    kw = dict(case.kwargs(), group_score=group_score, routed_scaling_factor=routed_scaling_factor)
    r = ref.route(case.logits, case.top_k, **kw)
    ids, weights, counts, selected = naive.route(case.logits, case.top_k, **kw)
    T, k = case.logits.shape[0], case.top_k
    assert r.topk_ids.dtype == torch.int32 and r.topk_ids.shape == (T, k)
    assert r.topk_weights.dtype == torch.float32 and r.counts.dtype == torch.int32
    assert r.topk_ids.tolist() == ids
    assert r.counts.tolist() == counts
    assert r.selected_counts.tolist() == selected
    torch.testing.assert_close(r.topk_weights, torch.tensor(weights, dtype=torch.float64).float().view(T, k),
                               rtol=1e-6, atol=1e-7)


@settings(max_examples=150)
@given(route_cases())
def test_route_invariants(case):
    r = ref.route(case.logits, case.top_k, **case.kwargs())
    ids = r.topk_ids.long()
    T, E = case.logits.shape
    kept = ids >= 0
    # counts are the histogram of kept ids and sum to the kept slots
    assert int(r.counts.sum()) == int(kept.sum())
    assert torch.equal(r.counts.long(), torch.bincount(ids[kept], minlength=E))
    # each token's kept experts are distinct
    for t in range(T):
        row = ids[t][ids[t] >= 0].tolist()
        assert len(row) == len(set(row))
    # dropped slots have weight exactly 0; capacity is respected
    assert torch.all(r.topk_weights[~kept] == 0)
    if case.capacity is not None:
        assert all(c <= case.capacity for c in r.counts.tolist())
    else:
        assert bool(kept.all())
    # with renormalization and no dropping, each token's weights sum to 1
    if case.renormalize and case.capacity is None and T:
        s = r.topk_weights.sum(-1)
        assert torch.allclose(s[s > 0], torch.ones_like(s[s > 0]), atol=1e-5)


def test_route_docstring_semantics():
    """Hand-worked example: ties go to the lower expert id, the bias changes selection only."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    r = ref.route(logits, 2, renormalize=False)
    assert r.topk_ids.tolist() == [[1, 2]]
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    r = ref.route(logits, 2, renormalize=False, expert_bias=bias)
    s = torch.softmax(logits, -1)[0]
    assert r.topk_ids.tolist() == [[3, 1]]
    torch.testing.assert_close(r.topk_weights[0], torch.stack([s[3], s[1]]))


def test_group_limited_excludes_dropped_groups_even_with_nan():
    # groups {0,1,2} and {3,4,5}; group 1 wins (its top-2). Expert 5's NaN score ranks as -inf,
    # yet with k=3 it must still be chosen over every expert of the dropped group 0.
    logits = torch.tensor([[0.0, 0.1, 0.2, 5.0, 4.0, float("nan")]])
    r = ref.route(logits, 3, n_groups=2, topk_groups=1, score_func="sigmoid", renormalize=False)
    assert r.topk_ids.tolist() == [[3, 4, 5]]
    assert math.isnan(float(r.topk_weights[0, 2]))
    ids, _, _, _ = naive.route(logits, 3, n_groups=2, topk_groups=1, score_func="sigmoid", renormalize=False)
    assert ids == [[3, 4, 5]]


def test_group_score_rules_and_routed_scaling():
    """Groups {0,1,2} and {3,4,5}: group 0 holds the single best expert, group 1 the larger sum
    of two. DeepSeek-V3's top-2 sum keeps group 1, DeepSeek-V2's max keeps group 0 (then its
    tied -2 logits go to the lower id). The routed scaling factor multiplies the final weights:
    after renormalization, or the raw scores without it; dropped slots stay 0."""
    logits = torch.tensor([[3.0, -2.0, -2.0, 2.5, 2.4, -2.0]])
    assert ref.route(logits, 2, n_groups=2, topk_groups=1).topk_ids.tolist() == [[3, 4]]
    assert ref.route(logits, 2, n_groups=2, topk_groups=1, group_score="max").topk_ids.tolist() == [[0, 1]]
    s = torch.softmax(logits, -1)[0]
    r = ref.route(logits, 2, routed_scaling_factor=2.5)
    torch.testing.assert_close(r.topk_weights[0], 2.5 * s[[0, 3]] / s[[0, 3]].sum())
    r = ref.route(logits, 2, renormalize=False, routed_scaling_factor=2.5)
    torch.testing.assert_close(r.topk_weights[0], 2.5 * s[[0, 3]])
    r = ref.route(logits.repeat(3, 1), 2, capacity=1, routed_scaling_factor=2.5)
    assert r.topk_weights[1:].abs().sum() == 0 and r.topk_weights[0].sum() > 2.4


def test_canonical_exp_accuracy_and_limits():
    """canonical_exp is exp within 2 ulp over [-86, 88], monotone on a dense grid, 0 below,
    +inf above, NaN for NaN."""
    y = torch.linspace(-86.0, 88.0, 200_001)
    c = ref.canonical_exp(y)
    rel = ((c.double() - y.double().exp()) / y.double().exp()).abs()
    assert float(rel.max()) < 2 * 2.0**-24
    assert bool((c[1:] >= c[:-1]).all())
    edge = ref.canonical_exp(torch.tensor([-86.001, float("-inf"), 88.001, float("inf"), float("nan"), 0.0]))
    assert edge[:4].tolist() == [0.0, 0.0, float("inf"), float("inf")]
    assert math.isnan(float(edge[4])) and float(edge[5]) == 1.0


def test_capacity_priority_is_slot_then_token():
    # 3 tokens all prefer expert 0 first and expert 1 second; capacity 2.
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 3)
    r = ref.route(logits, 2, capacity=2, renormalize=False)
    # slot 0 of tokens 0,1 fill expert 0; token 2's slot 0 is dropped; slot 1 of tokens 0,1 fill
    # expert 1; token 2's slot 1 is dropped too.
    assert r.topk_ids.tolist() == [[0, 1], [0, 1], [-1, -1]]
    assert r.counts.tolist() == [2, 2, 0]
    assert r.selected_counts.tolist() == [3, 3, 0]
    assert r.topk_weights[2].tolist() == [0.0, 0.0]


def test_capacity_zero_drops_everything():
    r = ref.route(torch.randn(5, 4), 2, capacity=0)
    assert bool((r.topk_ids == -1).all()) and float(r.topk_weights.abs().sum()) == 0.0
    assert r.counts.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_edge_shapes(score_func):
    for T, E, k in [(0, 4, 2), (1, 4, 2), (6, 4, 4), (5, 1, 1), (9, 7, 3)]:
        r = ref.route(torch.randn(T, E), k, score_func=score_func, with_aux=True)
        assert r.topk_ids.shape == (T, k) and r.counts.shape == (E,)
        assert r.score_sum.shape == (E,) and r.logsumexp.shape == (T,)
        if k == E and T:
            assert sorted(r.topk_ids[0].tolist()) == list(range(E))


def test_nan_logits_rank_as_minus_inf_and_poison_weight():
    logits = torch.tensor([[float("nan"), 0.5, 0.1, -1.0]])
    r = ref.route(logits, 2, score_func="sigmoid", renormalize=False)
    assert r.topk_ids.tolist() == [[1, 2]]
    r = ref.route(logits, 4, score_func="sigmoid", renormalize=False)
    assert r.topk_ids.tolist() == [[1, 2, 3, 0]]
    assert math.isnan(float(r.topk_weights[0, 3]))


def test_all_zero_selected_scores_renormalize_to_zero():
    logits = torch.tensor([[float("-inf"), float("-inf"), 1.0]])
    r = ref.route(logits, 2, score_func="sigmoid")
    assert r.topk_ids.tolist() == [[2, 0]]
    r = ref.route(torch.full((1, 3), float("-inf")), 2, score_func="sigmoid")
    assert r.topk_weights.tolist() == [[0.0, 0.0]]


def test_aux_losses_match_formulas():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 6, generator=g)
    for with_aux in (False, True):
        r = ref.route(logits, 2, capacity=3, with_aux=with_aux)
        lb = ref.load_balancing_loss(logits, r)
        s = torch.softmax(logits, -1)
        f = torch.bincount(torch.topk(s, 2).indices.flatten(), minlength=6).float() / (11 * 2)
        torch.testing.assert_close(lb, 6 * (f * s.mean(0)).sum())
        z = ref.z_loss(logits, r)
        torch.testing.assert_close(z, torch.logsumexp(logits, -1).square().mean())
    empty = torch.zeros(0, 6)
    assert float(ref.load_balancing_loss(empty, ref.route(empty, 2))) == 0.0
    assert float(ref.z_loss(empty)) == 0.0


# ---------------------------------------------------------------------------------------------
# permute / unpermute
# ---------------------------------------------------------------------------------------------


@settings(max_examples=250)
@given(permute_cases())
def test_permute_matches_naive_and_invariants(case):
    x_perm, info = ref.permute(case.x, case.ids, case.num_experts, pad_to=case.pad_to)
    nx, noffs, nrows, ncounts = naive.permute(case.x, case.ids.tolist(), case.num_experts, case.pad_to)
    assert info.expert_offsets.dtype == torch.int64 and info.slot_rows.dtype == torch.int64
    assert info.counts.dtype == torch.int32
    assert info.expert_offsets.tolist() == noffs
    assert info.slot_rows.tolist() == nrows
    assert info.counts.tolist() == ncounts
    assert torch.equal(x_perm, nx)
    # invariants
    offs = info.expert_offsets
    padded = (info.counts.long() + case.pad_to - 1) // case.pad_to * case.pad_to
    assert torch.equal(offs[1:] - offs[:-1], padded)
    routed = case.ids >= 0
    assert int(info.counts.sum()) == int(routed.sum())
    rows = info.slot_rows[routed]
    assert rows.unique().numel() == rows.numel()  # every row has at most one owner
    T = case.x.shape[0]
    tok = torch.arange(T).unsqueeze(1).expand_as(case.ids)[routed]
    assert torch.equal(x_perm[rows], case.x[tok])
    owned = torch.zeros(x_perm.shape[0], dtype=torch.bool)
    owned[rows] = True
    assert bool((x_perm[~owned] == 0).all())  # padding rows are zero
    # each routed row lies inside its expert's segment
    e = case.ids[routed]
    assert bool(((rows >= offs[e]) & (rows < offs[e] + info.counts.long()[e])).all())


@settings(max_examples=150)
@given(permute_cases())
def test_unpermute_matches_naive(case):
    x_perm, info = ref.permute(case.x, case.ids, case.num_experts, pad_to=case.pad_to)
    y = x_perm * 2 + 1  # something row-dependent
    out = ref.unpermute(y, info, case.weights)
    expect = naive.unpermute(y, info.slot_rows.tolist(), case.weights.tolist(), y.dtype)
    torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)


def test_permute_example_from_docs():
    x = torch.arange(3.0).unsqueeze(1).repeat(1, 2)
    ids = torch.tensor([[1, 0], [1, 2], [-1, 1]])
    x_perm, info = ref.permute(x, ids, 3)
    assert info.counts.tolist() == [1, 3, 1]
    assert info.expert_offsets.tolist() == [0, 1, 4, 5]
    assert info.slot_rows.tolist() == [[1, 0], [2, 4], [-1, 3]]
    assert x_perm[:, 0].tolist() == [0.0, 0.0, 1.0, 2.0, 1.0]


@pytest.mark.parametrize("pad_to", [1, 16, 128])
def test_permute_edge_cases(pad_to):
    d = 3
    cases = {
        "T=0": (torch.zeros(0, d), torch.zeros(0, 2, dtype=torch.int64), 4),
        "T=1": (torch.randn(1, d), torch.tensor([[2, 0]]), 4),
        "k=E": (torch.randn(4, d), torch.tensor([[0, 1, 2]] * 4), 3),
        "all -1": (torch.randn(3, d), torch.full((3, 2), -1), 4),
        "one expert": (torch.randn(5, d), torch.full((5, 1), 2), 4),
        "empty expert, prime E": (torch.randn(6, d), torch.tensor([[0], [2], [4], [6], [0], [2]]), 7),
    }
    for name, (x, ids, E) in cases.items():
        x_perm, info = ref.permute(x, ids, E, pad_to=pad_to)
        nx, noffs, nrows, _ = naive.permute(x, ids.tolist(), E, pad_to)
        assert info.expert_offsets.tolist() == noffs, name
        assert info.slot_rows.tolist() == nrows, name
        assert torch.equal(x_perm, nx), name


def _assert_same_info(a, b, what):
    for field in ("expert_offsets", "slot_rows", "counts"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), (what, field)
    assert (a.num_tokens, a.pad_to) == (b.num_tokens, b.pad_to), what


@settings(max_examples=60)
@given(permute_cases(max_d=1))
def test_permute_metadata_equals_permute_and_kernel(case):
    """reference.permute_metadata is exactly the metadata of reference.permute and of the Triton
    permute_metadata (the interpreter on CPU, the GPU when present)."""
    from tritonmoe.kernels import permute as kp

    E, pad_to = case.num_experts, case.pad_to
    info = ref.permute_metadata(case.ids, E, pad_to)
    _assert_same_info(info, ref.permute(case.x, case.ids, E, pad_to=pad_to)[1], "reference.permute")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _assert_same_info(info, kp.permute_metadata(case.ids.to(dev, torch.int32), E, pad_to), "kernel")


def test_permute_non_contiguous_x():
    base = torch.randn(8, 10)
    x = base[:, ::2]  # strided view
    ids = torch.tensor([[0, 1]] * 8)
    x_perm, info = ref.permute(x, ids, 2)
    assert torch.equal(x_perm, ref.permute(x.contiguous(), ids, 2)[0])


# ---------------------------------------------------------------------------------------------
# grouped GEMM / FFN
# ---------------------------------------------------------------------------------------------


@st.composite
def segments(draw, max_rows=24):
    E = draw(st.sampled_from([1, 2, 3, 5]))
    counts = draw(st.lists(st.integers(0, max_rows // E + 2), min_size=E, max_size=E))
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    return E, torch.tensor(offs), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=60)
@given(segments(), st.sampled_from(["swiglu", "gelu", "relu"]))
def test_grouped_ffn_matches_per_row(seg, activation):
    E, offs, seed = seg
    g = torch.Generator().manual_seed(seed)
    R, d, f = int(offs[-1]), 5, 4
    n1 = 2 * f if activation == "swiglu" else f
    x = torch.randn(R, d, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, d, n1, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, f, d, generator=g, dtype=torch.float64)
    out = ref.grouped_ffn(x, offs, w1, w2, activation)
    h = ref.grouped_gemm(x, offs, w1)
    for r in range(R):
        e = int(torch.searchsorted(offs[1:], r, right=True))
        torch.testing.assert_close(h[r], x[r] @ w1[e])
        torch.testing.assert_close(out[r], naive.expert_ffn(x[r], w1[e], w2[e], activation))


def test_grouped_gemm_low_precision_accumulates_in_fp32():
    x = torch.randn(6, 64).half()
    w = torch.randn(2, 64, 3).half()
    offs = torch.tensor([0, 4, 6], dtype=torch.int32)
    out = ref.grouped_gemm(x, offs, w)
    assert out.dtype == torch.float16
    expect = torch.cat([x[:4].float() @ w[0].float(), x[4:].float() @ w[1].float()]).half()
    assert torch.equal(out, expect)
