"""MPMoE's Algorithm 1 (PAPERS.md §4.5 Verify 1) against synthetic convex cost oracles."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonmoe.sim.search import GranularitySearch


def _oracle(thresholds):
    """t(B, n): convex in n (a parabola around n*(B)), with n*(B) monotone in B: n*(B) = 2 plus
    the number of thresholds below B."""

    def best(B):
        return min(8, 2 + sum(1 for t in thresholds if B > t))

    def t(B, n):
        return 1.0 + B * 1e-4 + (n - best(B)) ** 2 * (0.05 + B * 1e-6)

    return t, best


@settings(max_examples=50)
@given(
    thresholds=st.lists(st.integers(1, 40000), min_size=0, max_size=6).map(sorted),
    Bs=st.lists(st.integers(2, 50000), min_size=1, max_size=40),
)
def test_algorithm1_finds_the_argmin_and_keeps_ranges_sorted(thresholds, Bs):
    t, best = _oracle(thresholds)
    calls = []

    def profile(B, n):
        calls.append((B, n))
        return t(B, n)

    s = GranularitySearch(2, 8)
    for B in sorted(Bs):  # training batches grow: the range bookkeeping of H1 holds
        assert s.best(B, profile) == best(B)
        keys = sorted(s.G)
        assert list(s.G) == keys  # G stays sorted by n
        ranges = [s.G[n] for n in keys]
        for (lo, hi) in ranges:
            assert lo <= hi
        for (lo1, hi1), (lo2, hi2) in zip(ranges, ranges[1:]):
            assert hi1 < lo2 or math.isinf(lo2)  # disjoint and increasing with n
    # cached answers are not profiled again
    before = len(calls)
    for B in Bs:
        assert s.best(B, profile) == best(B)
    assert len(calls) == before
    assert s.profiled == len(calls)


def test_algorithm1_profiles_far_fewer_than_exhaustive():
    """Over a random sequence of batch sizes (not sorted) the search stays exact on a convex
    oracle whose best degree grows with B, and profiles a fraction of the exhaustive 7 per B."""
    import random

    t, best = _oracle([8000, 22000, 26000, 30000])  # MPMoE Fig. 14-like switch points
    rng = random.Random(0)
    Bs = [rng.randrange(512, 40000) for _ in range(300)]
    s = GranularitySearch(2, 8)
    wrong = sum(s.best(B, t) != best(B) for B in Bs)
    distinct = len(set(Bs))
    ratio = s.profiled / (7 * distinct)
    assert wrong == 0
    assert ratio < 0.5, f"profiled {s.profiled} of an exhaustive {7 * distinct}"


def test_search_generator_and_bad_times():
    s = GranularitySearch(2, 4)
    gen = s.steps(1000)
    assert next(gen) == 2
    assert gen.send(3.0) == 3
    assert gen.send(2.0) == 4
    with pytest.raises(StopIteration) as stop:
        gen.send(2.5)  # rose: stop at the turning point, best so far is 3
    assert stop.value.value == 3 and s.answer(1000) == 3
    assert s.G == {2: (0.0, 1.0), 3: (1000, 1000), 4: (math.inf, math.inf)}
    g2 = s.steps(5000)
    next(g2)
    with pytest.raises(ValueError, match="returned nan"):
        g2.send(float("nan"))
    with pytest.raises(ValueError, match="1 <= n_min < n_max"):
        GranularitySearch(4, 4)
