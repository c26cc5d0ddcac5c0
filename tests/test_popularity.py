"""Expert-popularity estimation from sample paths (tritonmoe.inference.PopularityEstimator,
Lina 001 §5.2): tables from a known Markov kernel, order independence, backing off for unseen
paths, the top-k estimate, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tritonmoe.inference import PopularityEstimator, l1_error, top_k_match


def _markov(T: int, L: int, E: int, seed: int, stay: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """Token paths from a first-order kernel: keep the previous expert's successor (e+1 mod E)
    with probability ``stay``, else uniform. Returns (choices [T, L], kernel [E, E])."""
    g = torch.Generator().manual_seed(seed)
    K = torch.full((E, E), (1 - stay) / E, dtype=torch.float64)
    K[torch.arange(E), (torch.arange(E) + 1) % E] += stay
    c = torch.empty(T, L, dtype=torch.int64)
    c[:, 0] = torch.randint(0, E, (T,), generator=g)
    for l in range(1, L):
        c[:, l] = torch.multinomial(K[c[:, l - 1]], 1, generator=g).squeeze(1)
    return c, K


def test_first_order_tables_are_the_counts_and_converge_to_the_kernel():
    c, K = _markov(20000, 4, 6, 0)
    est = PopularityEstimator(4, 6, path_length=1, k_est=None)
    est.record(c)
    for l in range(1, 4):
        for prev in range(6):
            rows = c[c[:, l - 1] == prev, l]
            want = torch.bincount(rows, minlength=6)
            assert torch.equal(est.tables[l][(prev,)], want)  # m = 1: exactly the first-order counts
            tv = 0.5 * float((est.distribution(l, [prev]) - K[prev]).abs().sum())
            assert tv < 4.0 / rows.numel() ** 0.5
    assert torch.equal(est.marginal[2], torch.bincount(c[:, 2], minlength=6))


def test_tables_do_not_depend_on_token_or_batch_order():
    c, _ = _markov(500, 5, 4, 1)
    a, b = PopularityEstimator(5, 4), PopularityEstimator(5, 4)
    a.record(c)
    perm = torch.randperm(500, generator=torch.Generator().manual_seed(3))
    b.record(c[perm][:200])
    b.record(c[perm][200:])  # online, in two batches
    for l in range(5):
        assert a.tables[l].keys() == b.tables[l].keys()
        assert all(torch.equal(a.tables[l][k], b.tables[l][k]) for k in a.tables[l])
    assert len(a.tables[4]) <= min(4**1 + 4**2 + 4**3, 3 * 500)  # one entry per observed suffix


def test_estimate_uses_paths_backs_off_and_sums_to_the_tokens():
    c, K = _markov(4000, 4, 5, 2, stay=0.9)
    est = PopularityEstimator(4, 5, path_length=3, k_est=2)
    est.record(c)
    hist = torch.tensor([[0, 1, 2], [0, 1, 2], [4, 4, 4]])
    load = est.estimate(3, hist)
    assert load.sum().item() == pytest.approx(3.0)
    assert int(torch.argmax(load)) == 3  # 2 -> 3 is the kernel's likely successor
    assert (load > 0).sum() <= 2 * 2  # top-2 per path: the two paths give at most 4 experts
    # an unseen full path backs off to its longest seen suffix
    unseen = [(a, b, d) for a in range(5) for b in range(5) for d in range(5) if (a, b, d) not in est.tables[3]]
    assert unseen
    for path in unseen[:5]:
        m = 2 if path[1:] in est.tables[3] else 1
        assert torch.equal(est.distribution(3, path), est.distribution(3, path[-m:]))
    assert torch.equal(PopularityEstimator(4, 5).distribution(2, [1, 2]), torch.full((5,), 0.2, dtype=torch.float64))
    # no history: the top-k of the marginal; an empty batch: zeros
    assert est.estimate(3, torch.empty(7, 0, dtype=torch.int64)).sum().item() == pytest.approx(7.0)
    assert est.estimate(3, torch.empty(0, 3, dtype=torch.int64)).sum().item() == 0
    # the conditional estimate beats the marginal on a correlated trace
    test, _ = _markov(64, 4, 5, 9, stay=0.9)
    actual = torch.bincount(test[:, 3], minlength=5)
    full = PopularityEstimator(4, 5, k_est=None)
    full.record(c)
    assert l1_error(full.estimate(3, test[:, :3]), actual) < l1_error(full.unconditional(3), actual)


@given(st.lists(st.floats(0, 10), min_size=3, max_size=8), st.integers(1, 3))
def test_top_k_match_is_the_brute_force_criterion(vals, k):
    v = torch.tensor(vals, dtype=torch.float64)
    w = v.flip(0)
    def top(x):  # brute force: the k largest, ties to the lower id
        return set(sorted(range(len(vals)), key=lambda i: (-float(x[i]), i))[:k])
    assert top_k_match(v, w, k) == (top(v) == top(w))


def test_bad_input():
    est = PopularityEstimator(3, 4)
    with pytest.raises(ValueError, match="expert id 4 outside"):
        est.record(torch.tensor([[0, 1, 4]]))
    with pytest.raises(ValueError, match="expert id -1"):
        est.record(torch.tensor([[0, -1, 2]]))
    with pytest.raises(ValueError, match="has 2 layers"):
        est.record(torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="int tensor"):
        est.record(torch.zeros(2, 3))
    with pytest.raises(IndexError, match="layer=3"):
        est.estimate(3, torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="only 1 layers before"):
        est.estimate(1, torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="num_experts=0"):
        PopularityEstimator(3, 0)
    with pytest.raises(TypeError, match="k_est"):
        PopularityEstimator(3, 4, k_est=1.5)


@pytest.mark.parametrize("k_est", [1, 2, None])
def test_no_data_estimate_is_uniform(k_est):
    """Before anything is recorded for a layer, the estimate spreads the T tokens evenly over the
    E experts (it put them all on experts 0 and 1: the top-2 of a uniform tie), unconditional or
    with a history; a layer with data still gets its truncated estimate."""
    E, T = 8, 10
    est = PopularityEstimator(3, E, k_est=k_est)
    uniform = torch.full((E,), T / E, dtype=torch.float64)
    assert torch.equal(est.estimate(0, torch.empty(T, 0, dtype=torch.int64)), uniform)
    assert torch.equal(est.estimate(2, torch.zeros(T, 2, dtype=torch.int64)), uniform)
    assert torch.equal(est.estimate(1, torch.randint(0, E, (T, 1))), uniform)
    # with data the top-k_est truncation applies (a skewed layer: experts 3 and 5 only)
    c = torch.zeros(4, 3, dtype=torch.int64)
    c[:, 1] = torch.tensor([3, 3, 3, 5])
    est.record(c)
    got = est.estimate(1, torch.empty(T, 0, dtype=torch.int64))
    assert float(got.sum()) == pytest.approx(T)
    assert set(got.nonzero().flatten().tolist()) == ({3} if k_est == 1 else {3, 5})
    assert torch.equal(est.estimate(2, torch.zeros(T, 2, dtype=torch.int64)), torch.eye(E, dtype=torch.float64)[0] * T)
