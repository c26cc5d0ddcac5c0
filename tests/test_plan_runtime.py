"""pipeline_degree="auto" / "search": configuration errors, buckets, and cross-rank agreement on
gloo with different token counts per rank."""

from __future__ import annotations

import pytest

import tritonmoe as tm
from tritonmoe.plan import CostModel, LinearFit
from tritonmoe.plan.cost_model import ComputeRate
from tritonmoe.plan.runtime import token_bucket

from _dist import run_group, values_or_fail
import _plan_runtime_cases


def test_auto_needs_a_process_group():
    for mode in ("auto", "search"):
        cfg = tm.MoEConfig(8, 8, 4, 2, pipeline_degree=mode)
        with pytest.raises(ValueError, match=rf"pipeline_degree='{mode}'.*needs ep_group"):
            tm.MoELayer(cfg)
    with pytest.raises(ValueError, match="pipeline_degree='fast' is not supported"):
        tm.MoEConfig(8, 8, 4, 2, pipeline_degree="fast")
    with pytest.raises(TypeError, match="positive int, 'auto' or 'search'"):
        tm.MoEConfig(8, 8, 4, 2, pipeline_degree=2.5)
    with pytest.raises(TypeError, match="cost_model must be a file path"):
        tm.MoEConfig(8, 8, 4, 2, pipeline_degree="auto", cost_model=3)


def test_token_buckets():
    seen = {}
    for T in range(1, 5000):
        b, rep = token_bucket(T)
        assert T <= rep <= 2 ** 0.25 * T + 1  # the representative is the bucket's upper edge
        seen.setdefault(b, set()).add(rep)
    assert all(len(v) == 1 for v in seen.values())
    assert token_bucket(0) == token_bucket(1)


def _comm_heavy_model(P: int) -> CostModel:
    """Communication and expert compute of similar cost, cheap startup: pipelining pays."""
    coll = {(k, P, "intra"): LinearFit.line(1e-6, 2e-8) for k in ("all_to_all", "all_reduce", "all_gather")}
    comp = {k: ComputeRate(4e8, 1e10, 1e-6) for k in ("gemm", "elementwise", "copy")}
    return CostModel(collectives=coll, compute=comp, host_compute=True, dtype="float64", source="test")


@pytest.mark.dist
@pytest.mark.slow
def test_auto_and_search_agree_across_ranks(tmp_path):
    """Ranks with different token counts choose the same degree every step (one small all-reduce),
    and the layer equals pipeline_degree=1 bitwise."""
    path = tmp_path / "cm.json"
    _comm_heavy_model(3).save(path)
    results, _ = run_group(3, _plan_runtime_cases.agreement, str(path), deadline_s=240, pg_timeout_s=60)
    per_rank = values_or_fail(results)
    # the file exists on ranks 0 and 2 only: every rank raises the agreement error
    msgs = [r["missing"] for r in per_rank]
    assert all(m.startswith("ValueError") and "degree_policy" in m and "rank 1=-1" in m for m in msgs), msgs
    for mode in ("auto", "search"):
        runs = [r[mode] for r in per_rank]
        assert all(r["degrees"] == runs[0]["degrees"] for r in runs), [r["degrees"] for r in runs]
        assert all(r["equal"] for r in runs), f"{mode}: differs from pipeline_degree=1"
        assert all(r["decided"] == runs[0]["decided"] for r in runs)
        assert runs[0]["decided"], f"{mode} decided nothing"
    auto = per_rank[0]["auto"]
    assert max(auto["degrees"]) > 1  # the comm-heavy model makes pipelining pay
    # the same token counts (max over ranks) give the same degree: cached per bucket
    assert auto["degrees"][0] == auto["degrees"][1] == auto["degrees"][3]
    search = per_rank[0]["search"]
    assert all(2 <= n <= 8 for n in search["degrees"])
    assert search["profiled"] < len(search["degrees"])  # decided buckets stop profiling
