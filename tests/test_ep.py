"""Expert-parallel MoELayer on spawned gloo groups (CPU): equality with the single-process layer
holding all experts, forward and every gradient, across EP sizes, pipeline degrees, top_k,
dtypes, capacity and degenerate batches; a peer dying mid-forward. The per-rank bodies are in
tests/_ep_cases.py (see its docstring for the reference design)."""

from __future__ import annotations

import pytest
import torch

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
    # FP8 experts (expert_dtype="fp8_e4m3") on this group: equal to the single-process FP8 layer,
    # dispatch bytes e4m3 + scales (tests/_fp8_ep_cases.py)
    fp8 = [f"rank {r}: {f}" for r, v in enumerate(values) for f in v["fp8_failures"]]
    assert not fp8, "\n".join(fp8)
    assert all(v["num_cases"] == 24 for v in values)
    # E not divisible by P, and ranks that disagree on the pipeline degree, are rejected at
    # construction with the same message on every rank.
    for v in values:
        assert len(v["errors"]) == 2, v["errors"]
        assert f"num_experts={2 * world_size + 1}" in v["errors"][0]
        assert "pipeline_degree: rank 0=2, rank 1=3" in v["errors"][1]
    assert len({v["errors"][1] for v in values}) == 1
    # a gradient penalty through the expert-parallel schedules: a typed error on every rank (issue 35)
    for v in values:
        for key, (kind, msg) in v["double_backward"].items():
            assert kind == "NotTwiceDifferentiableError", (key, kind, msg)
            assert "schedule is not twice differentiable" in msg and "backend='torch'" in msg, (key, msg)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_that_disagree_on_any_config_field_are_refused(world_size):
    """Every field that changes what a rank computes (not only the sizes of the collectives) is
    compared at construction: each disagreement is the same ValueError on every rank, naming
    the field and each rank's value as written; backend and ffn_path may differ."""
    results, _ = run_group(world_size, _ep_cases.config_disagreements, deadline_s=240, pg_timeout_s=60)
    values = values_or_fail(results)
    for name, per_rank in _ep_cases.DISAGREEING_FIELDS.items():
        msgs = {v[name] for v in values}
        assert len(msgs) == 1, (name, msgs)  # the same error on every rank
        msg = msgs.pop()
        want = ", ".join(f"rank {r}={per_rank[r % 2]!r}" for r in range(world_size))
        assert f"{name}: {want}" in msg, (name, msg)
        assert "disagree" in msg
    assert all(v["rank_local_ok"] for v in values)


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


def test_pipeline_degree_without_ep_group_is_the_local_reference():
    """One config, any world size (tests/test_one_config.py has the equality and the log line)."""
    from tritonmoe.experts import LocalExperts

    assert isinstance(tm.MoELayer(tm.MoEConfig(8, 12, 4, 1, pipeline_degree=2)).expert_path, LocalExperts)


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


def test_bench_run_ep_contract():
    """bench.ep.run_ep (driven by the harness) returns one dict per (world size, degree) with the
    agreed keys; a tiny shape, 2 ranks."""
    from bench.ep import run_ep

    results = run_ep(
        world_sizes=(2,), degrees=(1, 2), tokens=16, d_model=8, d_ffn=8, num_experts=4, top_k=2, reps=2, warmup=1
    )
    assert [r["name"] for r in results] == ["ep/P2/n1", "ep/P2/n2"]
    keys = {
        "name", "world_size", "pipeline_degree", "tokens_per_rank", "d_model", "d_ffn", "num_experts", "top_k",
        "dtype", "layer_fwd_bwd_s", "dispatch_s", "combine_s", "dispatch_bytes", "algbw_GBps", "busbw_GBps",
        "pipeline_efficiency", "partition_overhead_frac",
    }
    for r in results:
        assert keys <= set(r)
        assert len(r["layer_fwd_bwd_s"]) == 2 and all(t > 0 for t in r["layer_fwd_bwd_s"])
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] / 2)
        assert r["dispatch_bytes"] > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_static_mode_matches_single_process_without_host_sync(world_size):
    """MoEConfig(ep_capacity=C): equal to the single-process layer with the same config on each
    rank's batch (fp64, every gradient), and its expert path dispatches no host-synchronizing op
    in the forward or the backward with validation off (counted by a TorchDispatchMode; with
    validation on exactly one, the read of the refused-input status words), nor does the dynamic path's
    (pipelined, with capacity drops: its permutes size their buffers from the slot count; its one
    sync, the counts exchange's tolist, is not a dispatched op); a permute that reads R back is
    the control that shows the counter sees syncs."""
    results, _ = run_group(world_size, _ep_cases.static_table, deadline_s=120, pg_timeout_s=60)
    for rank, v in enumerate(values_or_fail(results)):
        assert not v["failures"], "\n".join(v["failures"][:10])
        for case, found in v["syncs"].items():
            if case == "control":
                assert "_local_scalar_dense" in found, (rank, found)
            elif case.endswith("validation on"):  # the status words' read (docs/rank-input.md)
                assert found == ["_local_scalar_dense"], (rank, case, found)
            else:
                assert found == [], (rank, case, found)
        assert "dynamic" in v["syncs"] and "control" in v["syncs"]


def test_static_mode_options():
    with pytest.raises(ValueError, match="drop capacity_factor"):
        tm.MoEConfig(8, 12, 4, 2, ep_capacity=4, capacity_factor=1.0)
    with pytest.raises(ValueError, match="use pipeline_degree=1"):
        tm.MoEConfig(8, 12, 4, 2, ep_capacity=4, pipeline_degree=2)
    with pytest.raises(ValueError, match="ep_capacity"):
        tm.MoEConfig(8, 12, 4, 2, ep_capacity=0)
    assert tm.MoEConfig(8, 12, 4, 2, ep_capacity=3).capacity(100) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_static_mode_captures_in_a_cuda_graph():
    """One rank (NCCL world of 1): the static expert path's forward + backward is captured in a
    CUDA graph and replayed on new inputs, with the eager result (tests/_cuda_graph_case.py, in
    its own process: a failed capture must not break the tests after it)."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, os.path.join(here, "_cuda_graph_case.py")], capture_output=True,
                          text=True, timeout=180, cwd=here)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
