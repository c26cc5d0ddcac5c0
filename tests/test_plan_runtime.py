"""pipeline_degree="auto" / "search": configuration errors, buckets, and cross-rank agreement on
gloo with different token counts per rank."""

from __future__ import annotations

import pytest

import tritonmoe as tm
from tritonmoe.plan import CostModel, LinearFit
from tritonmoe.sim.cost_model import ComputeRate
from tritonmoe.policy.degree import token_bucket

from _dist import run_group, values_or_fail
import _plan_runtime_cases


def test_auto_without_a_process_group_is_the_local_reference():
    """Without ep_group, "auto"/"search" run as degree 1 (one config, any world size)."""
    from tritonmoe.experts import LocalExperts

    for mode in ("auto", "search"):
        cfg = tm.MoEConfig(8, 8, 4, 2, pipeline_degree=mode)
        assert isinstance(tm.MoELayer(cfg).expert_path, LocalExperts)
    with pytest.raises(ValueError, match="pipeline_degree='fast' is not supported"):
        tm.MoEConfig(8, 8, 4, 2, pipeline_degree="fast")
    with pytest.raises(TypeError, match="positive int, 'auto' or 'search'"):
        tm.MoEConfig(8, 8, 4, 2, pipeline_degree=2.5)
    with pytest.raises(TypeError, match="cost_model must be a file path"):
        tm.MoEConfig(8, 8, 4, 2, pipeline_degree="auto", cost_model=3)


def test_default_cost_models():
    """Without cost_model / $TRITONMOE_COST_MODEL, CPU tensors plan with the packaged model; a
    group size it was not fitted for is an error naming the fix."""
    import torch

    from tritonmoe.sim.cost_model import CostModelError
    from tritonmoe.policy.degree import DEFAULT_CPU_MODEL, runtime_cost_model

    cfg = tm.MoEConfig(8, 8, 4, 2, pipeline_degree="auto")
    m = runtime_cost_model(cfg, 4, torch.device("cpu"))
    assert m.path == DEFAULT_CPU_MODEL and m.host_compute and 4 in m.group_sizes("all_to_all")
    with pytest.raises(CostModelError, match=r"cpu_gloo\.json.*not 3.*--nproc 3"):
        m.check_group_size(3)


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
    # the profiler end to end (toy sizes): every kind and group size fitted, compute rates,
    # interference, the CPU sharing of 3 ranks
    prof = CostModel.from_json(per_rank[0]["profile"])
    assert per_rank[1]["profile"] is None and per_rank[2]["profile"] is None
    assert prof.group_sizes("all_to_all") == [2, 3] and prof.group_sizes("all_reduce") == [2, 3]
    assert all(f.r2 is not None and f.n_points == 3 for f in prof.collectives.values())
    assert {"gemm", "copy", "elementwise"} <= set(prof.compute)
    assert ("comp", "comm") in prof.interference and ("comm", "comm") in prof.interference
    assert prof.host_compute and prof.lane_slots.get("comm", 0) >= 1 and prof.meta["world_size"] == 3
    assert prof.meta["collectives_timed"].startswith("in place")
    # in-place collective timing keeps the mean over members of each one's issue-to-completion
    # time: with the last of 3 ranks 60 ms late, two members wait ~60 ms and one ~0 (mean ~40 ms;
    # the slowest member's time would be ~60, the phase's own time is never counted)
    ip = per_rank[0]["in_place"]
    assert all(r["in_place"] == ip for r in per_rank)  # one value, agreed by every rank
    assert ip["isolated"] < 0.02 and ip["alike"] < 0.02, ip
    assert 0.03 <= ip["skewed"] <= 0.055, ip
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
