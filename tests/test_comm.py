"""tritonmoe.comm on a spawned 3-rank gloo group (CPU): autograd all-to-all with uneven splits,
split agreement (the same SplitMismatchError on every rank, never an abort or a hang), the
counts exchange, the dispatch / identity / combine round trip and pipelining invariance. The
per-rank bodies are in tests/_comm_cases.py. Plus the timeline's interval arithmetic."""

from __future__ import annotations

import pytest

from tritonmoe.comm import Span, Timeline
from tritonmoe.comm.timeline import _Open, _intersection_length, _union

from _dist import run_group, values_or_fail
import _comm_cases

WORLD = 3


@pytest.fixture(scope="module")
def comm_results():
    results, _ = run_group(WORLD, _comm_cases.comm_table, deadline_s=180, pg_timeout_s=60)
    return values_or_fail(results)


@pytest.mark.dist
def test_comm_table_has_no_failures(comm_results):
    failures = [f"rank {r}: {f}" for r, v in enumerate(comm_results) for f in v["failures"]]
    assert not failures, "\n".join(failures)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["expects_more", "expects_fewer", "sends_more", "wrong_length"])
def test_split_mismatch_same_error_on_every_rank(comm_results, name):
    per_rank = [next(s for s in v["mismatch"] if s["name"] == name) for v in comm_results]
    assert all(s["raised"] == "SplitMismatchError" and s["is_value_error"] for s in per_rank), per_rank
    assert len({s["message"] for s in per_rank}) == 1, "ranks raised different messages"
    assert all(s["elapsed"] < 5.0 for s in per_rank)
    msg, offending = per_rank[0]["message"], per_rank[0]["offending"]
    S = _comm_cases.send_table(WORLD)
    if name == "expects_more":
        assert f"rank 1 sends {S[1][0]} rows to rank 0, which expects {S[1][0] + 1}" in msg
        assert offending == [0, 1]
    elif name == "expects_fewer":
        assert f"rank 1 sends {S[1][0]} rows to rank 0, which expects {S[1][0] - 1}" in msg
        assert offending == [0, 1]
    elif name == "sends_more":
        assert f"rank 1 sends {S[1][0] + 1} rows to rank 0, which expects {S[1][0]}" in msg
        assert offending == [0, 1]
    else:
        assert f"rank 2 passed {WORLD - 1} output_split_sizes for a group of {WORLD} ranks" in msg
        assert offending == [2]


@pytest.mark.dist
def test_plans_agree_across_ranks(comm_results):
    """Rank s's send_splits[i][d] is rank d's recv_splits[i][s], for every micro-op."""
    plans = [v["plan"] for v in comm_results]
    for i in range(len(plans[0]["send"])):
        for s in range(WORLD):
            for d in range(WORLD):
                assert plans[s]["send"][i][d] == plans[d]["recv"][i][s]


@pytest.mark.dist
def test_pipeline_efficiency_is_reported(comm_results):
    for v in comm_results:
        for n, eff in v["efficiency"].items():
            assert eff is not None and 0.0 <= eff <= 1.0, (n, eff)


def test_interval_union_and_intersection():
    assert _union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert _intersection_length([(0, 2), (3, 5)], [(1, 4)]) == pytest.approx(2.0)
    assert _intersection_length([], [(0, 1)]) == 0.0


def _timeline_of(spans):
    tl = Timeline()
    for kind, i, a, b in spans:
        rec = _Open(kind, i, "fwd", a, b)
        rec.done.set()
        tl._open.append(rec)
    return tl


def test_pipeline_efficiency_definition():
    # Sequential micro-op (n = 1): nothing overlaps.
    seq = _timeline_of([("dispatch", 0, 0, 1), ("expert", 0, 1, 3), ("combine", 0, 3, 4)])
    assert seq.pipeline_efficiency() == 0.0
    # Two micro-ops: dispatch_1 [1, 2] hides under expert_0 [1, 3]; combine_0 [3, 4] under expert_1
    # [3, 5]; dispatch_0 [0, 1] and combine_1 [5, 6] are exposed: 2 of 4 comm seconds overlap.
    pipe = _timeline_of(
        [
            ("dispatch", 0, 0, 1),
            ("dispatch", 1, 1, 2),
            ("expert", 0, 1, 3),
            ("combine", 0, 3, 4),
            ("expert", 1, 3, 5),
            ("combine", 1, 5, 6),
        ]
    )
    assert pipe.pipeline_efficiency() == pytest.approx(0.5)
    assert pipe.total("dispatch") == pytest.approx(2.0)
    assert [s.kind for s in pipe.spans()][:2] == ["dispatch", "dispatch"]
    assert isinstance(pipe.spans()[0], Span)
    assert Timeline().pipeline_efficiency() is None  # no communication recorded


def test_plan_expert_offsets_are_each_micro_ops_segment_starts():
    """DispatchPlan.expert_offsets(i): the local experts' segment starts of micro-op i's
    expert-major buffer (received rows of expert l from every source), computed once for all
    micro-ops; a micro-op or expert with no rows included."""
    import torch

    from tritonmoe.comm.splits import DispatchPlan

    recv = torch.tensor([[[2, 0, 1], [3, 0, 0]], [[0, 0, 0], [0, 0, 0]], [[1, 4, 0], [0, 2, 5]]])  # [N=3, P=2, L=3]
    plan = DispatchPlan(rank=0, world_size=2, num_experts=6, send_counts=torch.zeros(3, 6, dtype=torch.int64),
                        recv_counts=recv, send_splits=[[0, 0]] * 3, recv_splits=[[3, 3], [0, 0], [5, 7]])
    want = [[0, 5, 5, 6], [0, 0, 0, 0], [0, 1, 7, 12]]
    for i in range(3):
        got = plan.expert_offsets(i)
        assert got.dtype == torch.int64 and got.tolist() == want[i]
    a, b = plan.expert_offsets(2), plan.expert_offsets(2)  # computed once: views of one table after
    assert a.data_ptr() == b.data_ptr() and a._base is not None and a._base is b._base
