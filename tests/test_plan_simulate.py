"""tritonmoe.plan: synthetic routing, the work model, the planner and its registries, the CLI,
the calibration registry, 1,024 ranks from a laptop."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe.plan import DIMENSIONS, SCHEDULES, Cluster, Dimension, ScheduleSpec, routing_counts
from tritonmoe.sim.simulate import simulate
from tritonmoe.sim.planner import choose
from tritonmoe.sim.schedules import build_ep_pipeline
from tritonmoe.sim.work import WorkModel

import bench.work as BW


@settings(max_examples=40)
@given(
    tokens=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    n=st.integers(1, 8),
    k=st.integers(1, 4),
    routing=st.sampled_from(["uniform", "zipf:0.8", "zipf:2"]),
    cf=st.sampled_from([None, 1.0, 1.5]),
)
def test_routing_counts_properties(tokens, n, k, routing, cf):
    from tritonmoe.experts import micro_batch_bounds

    E = 8
    cfg = tm.MoEConfig(16, 16, E, k, capacity_factor=cf)
    c = routing_counts(cfg, tokens, n, routing)
    assert c.shape == (len(tokens), n, E) and c.dtype == torch.int64 and bool((c >= 0).all())
    for r, T in enumerate(tokens):
        per_e = c[r].sum(0)
        if cf is None:
            assert int(per_e.sum()) == T * k  # dropless: every slot routed
        else:
            assert bool((per_e <= cfg.capacity(T)).all())
        assert bool((per_e <= T).all())  # a token picks an expert at most once
        for i, (a, b) in enumerate(micro_batch_bounds(T, n)):
            assert bool((c[r, i] <= b - a).all())
    assert torch.equal(c, routing_counts(cfg, tokens, n, routing))  # deterministic
    if routing == "zipf:2" and cf is None and max(tokens) >= 100:
        r = max(range(len(tokens)), key=lambda i: tokens[i])
        assert int(c[r].sum(0)[0]) >= int(c[r].sum(0)[-1])


def test_work_model_matches_bench_work():
    """The simulator's work of each op equals the harness's analytic work (bench/work.py)."""
    d, f, E, k, s = 256, 512, 8, 2, 2
    n1 = 2 * f
    W = WorkModel(d, f, n1, E, k, s)
    T, R, Ea = 1000, 2000, 6
    fwd = BW.grouped_ffn(R, d, f, n1, Ea, s, backward=False)
    both = BW.grouped_ffn(R, d, f, n1, Ea, s, backward=True)
    assert W.ffn_fwd(R, Ea).flops == fwd.flops and W.ffn_fwd(R, Ea).bytes == fwd.bytes
    bwd = W.ffn_dx(R, Ea) + W.ffn_dw(R, Ea)
    assert W.ffn_fwd(R, Ea).flops + bwd.flops == both.flops
    assert W.ffn_fwd(R, Ea).bytes + bwd.bytes == both.bytes
    for name, mine, theirs in [
        ("route", lambda b: W.route(T, backward=b), lambda b: BW.route(T, E, k, s, backward=b)),
        ("permute", lambda b: W.permute(T, R, backward=b), lambda b: BW.permute(T, k, d, R, E, s, backward=b)),
        ("unpermute", lambda b: W.unpermute(T, R, backward=b), lambda b: BW.unpermute(T, k, d, R, s, backward=b)),
    ]:
        assert mine(False).bytes == theirs(False).bytes, name
        assert mine(False).bytes + mine(True).bytes == theirs(True).bytes, name


def test_choose_reports_every_candidate_and_picks_the_fastest():
    cfg = tm.MoEConfig(4096, 1536, 64, 8)
    c = Cluster.preset("dgx-h100", nodes=2)
    plan = choose(cfg, 8192, c, pipeline_degree=(1, 2, 4, 8), breakdown=True)
    times = {cand.values["pipeline_degree"]: cand.step_time for cand in plan.candidates}
    assert sorted(times) == [1, 2, 4, 8]
    assert plan.step_time == min(times.values()) and times[plan.pipeline_degree] == plan.step_time
    assert plan.choice["schedule"] == "ep-pipeline"
    assert all(cand.breakdown is not None for cand in plan.candidates)
    assert "<- chosen" in plan.table()
    # communication-bound (2 nodes, 64 experts): pipelining pays
    assert plan.pipeline_degree > 1 and times[plan.pipeline_degree] < times[1]
    # every candidate's predicted time equals a direct simulation of it
    assert times[4] == simulate(cfg, 8192, c, pipeline_degree=4).step_time()
    with pytest.raises(ValueError, match="unknown candidate dimension"):
        choose(cfg, 8192, c, lina_chunk=(1, 2))


def test_registries_take_new_schedules_and_dimensions(monkeypatch):
    """A scheduler issue plugs in a schedule and a dimension; the planner evaluates them."""
    seen = []

    def build(ex, step):
        seen.append(dict(step.candidate))
        build_ep_pipeline(ex, step)

    monkeypatch.setitem(SCHEDULES, "test-variant", ScheduleSpec("test-variant", build, lambda ctx: True, "a test",
                                                                     dimensions=("pipeline_degree",)))
    monkeypatch.setitem(DIMENSIONS, "test_knob", Dimension("test_knob", lambda ctx: ("a", "b"), ("test-variant",)))
    cfg = tm.MoEConfig(256, 256, 8, 2)
    c = Cluster.preset("dgx-h100")
    plan = choose(cfg, 512, c, pipeline_degree=(1, 2))
    variants = [cand.values for cand in plan.candidates if cand.values["schedule"] == "test-variant"]
    assert sorted((v["pipeline_degree"], v["test_knob"]) for v in variants) == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert {(v["pipeline_degree"], v["test_knob"]) for v in seen} == {(1, "a"), (1, "b"), (2, "a"), (2, "b")}
    # the built-in schedule does not see the new knob
    assert all("test_knob" not in cand.values for cand in plan.candidates if cand.values["schedule"] == "ep-pipeline")


def test_1024_gpus_from_a_laptop():
    cfg = tm.MoEConfig(7168, 2048, 1024, 8)
    c = Cluster.preset("dgx-h100", nodes=128)
    t0 = time.perf_counter()
    plan = choose(cfg, 4096, c, pipeline_degree=(1, 2, 4))
    wall = time.perf_counter() - t0
    assert plan.world_size == 1024 and plan.step_time > 0
    tl = simulate(cfg, 4096, c, pipeline_degree=plan.pipeline_degree)
    assert tl.symmetric and tl.ranks() == [tl.ranks()[0]]  # one representative rank
    assert wall < 60


def test_simulate_bad_input():
    cfg = tm.MoEConfig(64, 64, 6, 2)
    c = Cluster.preset("dgx-h100")
    with pytest.raises(ValueError, match="not divisible by world_size=4"):
        simulate(cfg, 16, c, world_size=4)
    with pytest.raises(ValueError, match="world_size=3 but tokens_per_rank has 2"):
        simulate(cfg, [4, 4], c, world_size=3)
    with pytest.raises(TypeError, match="cluster_or_cost"):
        simulate(cfg, 16, 3.0, world_size=2)
    with pytest.raises(ValueError, match="zipf:S needs a number"):
        simulate(cfg, 16, c, world_size=2, routing="zipf:x")
    with pytest.raises(ValueError, match="mode="):
        simulate(cfg, 16, c, world_size=2, mode="fast")


def test_cli(capsys, tmp_path):
    from tritonmoe.plan.__main__ import main

    for cmd in ("profile", "simulate", "plan", "calibrate"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
    capsys.readouterr()
    out_json = tmp_path / "sim.json"
    assert main(["simulate", "--cluster", "dgx-h100", "--tokens", "4096", "--degree", "2", "-E", "16",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "exposed_comm" in out and "pipelining efficiency" in out and out_json.exists()
    assert main(["plan", "--cluster", "mpmoe-valor", "--tokens", "2048", "--d-model", "1024", "--d-ffn", "4096",
                 "-E", "16", "-k", "2", "--degrees", "1,2,4", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "choice:" in out and "<- chosen" in out
    assert main(["simulate", "--cost-model", str(tmp_path / "missing.json"), "--tokens", "8"]) == 2
    assert "missing.json does not exist" in capsys.readouterr().err
    assert main(["clusters"]) == 0
    assert "parm-b" in capsys.readouterr().out


def test_calibration_registry():
    from tritonmoe.plan.calibrate import CALIBRATIONS, CalEntry, format_table, register_calibration, run_calibration

    ids = set(CALIBRATIONS)
    assert {f"CAL-{i:02d}" for i in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16, 17, 18, 19, 20)} <= ids
    for e in CALIBRATIONS.values():
        assert (e.run is None) != (e.blocked is None)
    rows = run_calibration(["CAL-14b", "CAL-01"])
    by = {r["id"]: r for r in rows}
    assert by["CAL-14b"]["status"] == "simulated" and isinstance(by["CAL-14b"]["simulated"], float)
    assert by["CAL-01"]["status"] == "simulated"  # Parm's schedules landed (tritonmoe.plan.parm_calibration)
    assert "| CAL-14b |" in format_table(rows)
    with pytest.raises(ValueError, match="exactly one of run and blocked"):
        register_calibration(CalEntry("X", "p", "m", "", 1.0))
