"""Expert-parallel MoELayer on spawned gloo groups (CPU): equality with the single-process layer
holding all experts, forward and every gradient, across EP sizes, pipeline degrees, top_k,
dtypes, capacity and degenerate batches; a peer dying mid-forward. The per-rank bodies are in
tests/_ep_cases.py (see its docstring for the reference design)."""

from __future__ import annotations

import pytest

import tritonmoe as tm
from tritonmoe.layer import _micro_batch_bounds

from _dist import run_group, values_or_fail
import _ep_cases

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_layer_matches_single_process(world_size):
    results, _ = run_group(world_size, _ep_cases.layer_table, deadline_s=240, pg_timeout_s=60)
    values = values_or_fail(results)
    failures = [f"rank {r}: {f}" for r, v in enumerate(values) for f in v["failures"]]
    assert not failures, "\n".join(failures[:20])
    assert all(v["num_cases"] == 24 for v in values)
    # E not divisible by P is rejected at construction on every rank, naming both numbers.
    for v in values:
        assert len(v["errors"]) == 1 and f"num_experts={2 * world_size + 1}" in v["errors"][0]


def test_peer_exit_mid_forward_raises_on_survivors():
    """Rank 2 of 3 exits between the counts exchange and its first dispatch: the survivors'
    forward ends in an exception within the group timeout + 5 s, never a hang."""
    pg_timeout = 10.0
    results, wall = run_group(3, _ep_cases.peer_exit, 2, deadline_s=pg_timeout + 40, pg_timeout_s=pg_timeout)
    assert results[2].status == "missing"  # the victim wrote nothing
    for r in results[:2]:
        assert r.status == "ok", r.value
        assert r.value["raised"] is not None, f"rank {r.rank} finished a forward with a dead peer"
        assert r.value["elapsed"] < pg_timeout + 5.0, r.value


def test_pipeline_degree_needs_ep_group():
    with pytest.raises(ValueError, match="pipeline_degree=2.*ep_group"):
        tm.MoELayer(tm.MoEConfig(8, 12, 4, 1, pipeline_degree=2))


@pytest.mark.parametrize(
    "T, n, want",
    [
        (10, 1, [(0, 10)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),  # the first T % n one longer
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),  # fewer tokens than micro-batches
        (0, 3, [(0, 0), (0, 0), (0, 0)]),  # a rank with no tokens
    ],
)
def test_micro_batch_bounds(T, n, want):
    assert _micro_batch_bounds(T, n) == want
