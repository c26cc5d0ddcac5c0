"""tritonmoe.plan cost models: least-squares fits, files and their errors, cluster-derived costs."""

from __future__ import annotations

import json

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe.comm.executor import Work
from tritonmoe.plan import (
    Cluster,
    CommSample,
    ComputeSample,
    CostModel,
    CostModelError,
    HostSample,
    InterferenceSample,
    fit_linear,
)
from tritonmoe.sim.simulate import simulate
from tritonmoe.sim import fits
from tritonmoe.sim.cost_model import VERSION

SIZES = [1024 * 4**i for i in range(9)]  # 1 KiB .. 64 MiB, as the profiler measures


@settings(max_examples=25)
@given(
    alpha=st.floats(1e-6, 1e-3),
    inv_bw=st.floats(1e-11, 1e-8),
    noise=st.lists(st.floats(-0.02, 0.02), min_size=9, max_size=9),
)
def test_fit_recovers_alpha_beta(alpha, inv_bw, noise):
    """Least squares on 9 sizes with <= 2% multiplicative noise recovers alpha and beta."""
    ts = [(alpha + inv_bw * x) * (1 + e) for x, e in zip(SIZES, noise)]
    fit = fit_linear(SIZES, ts)
    assert len(fit.pieces) == 1  # a line fits: no piecewise model
    assert fit.beta == pytest.approx(inv_bw, rel=0.05)
    # alpha is identifiable when it is a visible part of the small messages' time
    if alpha > 0.2 * inv_bw * SIZES[1]:
        assert fit.alpha == pytest.approx(alpha, rel=0.1)
    assert fit.r2 > 0.99
    assert fit.heldout_rel_err < 0.05
    assert fit.n_points == 9 and fit.x_range == (SIZES[0], SIZES[-1])


def test_fit_exact_and_piecewise():
    ts = [2e-5 + 1e-9 * x for x in SIZES]
    fit = fit_linear(SIZES, ts)
    assert fit.alpha == pytest.approx(2e-5, rel=1e-9) and fit.beta == pytest.approx(1e-9, rel=1e-9)
    assert fit(5e6) == pytest.approx(2e-5 + 5e-3)
    # two regimes (a protocol switch at 256 KiB): one line misses by far more than 15%, so the
    # fit is piecewise and predicts both regimes
    two = [(1e-4 + 1e-10 * x) if x <= 256 * 1024 else (5e-3 + 1e-9 * x) for x in SIZES]
    pw = fit_linear(SIZES, two)
    line = fit_linear(SIZES, two, piecewise=False)
    assert len(pw.pieces) >= 2 and pw.continuous
    assert pw.heldout_rel_err < line.heldout_rel_err
    # the pieces join, so the 50x startup step between 256 KiB and 1 MiB becomes a steep piece
    # between them: each measured size within 10%
    for x, t in zip(SIZES, two):
        assert pw(x) == pytest.approx(t, rel=0.10)


# A point-to-point transfer profiled in place on the 2-core CPU machine (gloo, 2 ranks,
# tritonmoe/sim/data/cpu_gloo.json): the small sizes are ~1 ms of noisy latency. Fitted as
# independent pieces it predicted 1.66 ms at 40 KiB and 0.55 ms at 41 KiB.
SEND_RECV_2 = [(1024, 1.158e-3), (4096, 0.874e-3), (16384, 1.291e-3), (65536, 0.58e-3), (262144, 0.664e-3),
               (1048576, 1.162e-3), (4194304, 2.345e-3), (16777216, 11.238e-3), (67108864, 34.677e-3)]


def _grid(lo=512.0, hi=1.5e8, n=400):
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def _assert_monotone_and_continuous(fit):
    ys = [fit(x) for x in _grid()]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(ys, ys[1:])), "a larger message predicted faster"
    for (upper, a1, b1), (_u, a2, b2) in zip(fit.pieces, fit.pieces[1:]):
        left, right = a1 + b1 * upper, a2 + b2 * upper  # both pieces' lines at their knot
        assert right == pytest.approx(left, rel=1e-9, abs=1e-15), f"a jump at the knot {upper}"
    lo = fit.x_range[0]
    for x in (lo / 2, lo, 3e6):
        startup, rest = fit.split(x)
        # the startup is the time of the smallest measured size (all of t below it), never a
        # steep first piece extrapolated to 0: that latency is not data to share
        assert startup == pytest.approx(min(fit(x), fit(lo))) and rest >= 0
        assert startup + rest == pytest.approx(fit(x))


def test_nnls_solver_is_exact_and_rejects_singular_systems():
    """The knots' least squares: support enumeration over the exact solves (a singular system,
    e.g. more columns than samples, must not hand back a made-up solution)."""
    assert fits._solve([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [1, 2, 3.1]) is None
    assert fits._solve([[2, 1], [1, 3]], [3, 5]) == pytest.approx([0.8, 1.4])
    xs, ts = [4096.0, 1048576.0], [1e-3, 2e-3]
    bounds = [0.0, 10240.0, 16384.0, math.inf]
    cols = [[1.0] * 2] + [[min(max(x - lo, 0.0), hi - lo) for x in xs] for lo, hi in zip(bounds, bounds[1:])]
    c = fits._nnls(cols, ts)
    assert all(v >= 0 for v in c)
    for k, t in enumerate(ts):  # an exact fit exists, so the solver finds one
        assert sum(v * col[k] for v, col in zip(c, cols)) == pytest.approx(t, rel=1e-9)


def test_piecewise_fit_never_falls_with_size():
    fit = fit_linear(*zip(*SEND_RECV_2))
    _assert_monotone_and_continuous(fit)
    assert fit(40 * 1024) <= fit(41 * 1024)
    assert fit(64 * 2**20) == pytest.approx(34.677e-3, rel=0.15)


@settings(max_examples=40)
@given(st.lists(st.floats(1e-5, 1e-1), min_size=9, max_size=9), st.booleans())
def test_fits_are_monotone_and_continuous(ts, sort):
    """Whatever the samples (noise, steps, falling times), the fitted time never falls with the
    size and never jumps at a breakpoint."""
    ts = sorted(ts) if sort else ts
    _assert_monotone_and_continuous(fit_linear(SIZES, ts))


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError, match="equally many"):
        fit_linear([1, 2], [1.0])
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_linear([1, 2, 3], [1.0, 0.0, 2.0])


def _synthetic_measurements(group_sizes=(2, 4)):
    out = []
    for P in group_sizes:
        for kind in ("all_to_all", "all_gather", "all_reduce"):
            for x in SIZES:
                out.append(CommSample(kind, P, "intra", x, 1e-4 * P + x / (1e9 / P)))
    for x in SIZES:
        out.append(CommSample("copy_d2h", 1, "intra", x, 5e-6 + x / 2e10))
    for R in (64, 256, 1024, 4096):
        w = Work(2.0 * R * 256 * 512, 0.0, "gemm", 10)
        out.append(ComputeSample("gemm", w.flops, w.bytes, w.launches, 10 * 2e-5 + w.flops / 5e10))
        out.append(ComputeSample("copy", 0.0, R * 1024.0, 3, 3 * 1e-5 + R * 1024 / 4e9))
    out += [InterferenceSample("comm", "comp", 1.0, 1.25), InterferenceSample("comm", "comp", 1.0, 1.15)]
    out += [HostSample(3e-5), HostSample(5e-5), HostSample(4e-5)]
    return out


def test_cost_model_fit_predict_and_roundtrip(tmp_path):
    m = CostModel.fit(_synthetic_measurements(), host_compute=True, dtype="float32", lane_slots={"comm": 2},
                      host_cores=1.5, threads_per_rank=1)
    assert m.cpu_share() == pytest.approx(1 / 1.5)
    assert m.group_sizes() == [2, 4]
    assert m.predict("all_to_all", 2**20, 4) == pytest.approx(4e-4 + 2**20 * 4 / 1e9, rel=1e-6)
    assert m.predict("copy_d2h", 2**20, 1) == pytest.approx(5e-6 + 2**20 / 2e10, rel=1e-6)
    g = m.compute["gemm"]
    assert g.launch_s == pytest.approx(2e-5, rel=1e-6) and g.flops_per_s == pytest.approx(5e10, rel=1e-6)
    assert not g.curve  # exact data: no efficiency curve
    assert m.compute_time(Work(1e9, 0.0, "gemm", 4)) == pytest.approx(4 * 2e-5 + 1e9 / 5e10, rel=1e-6)
    # a composite work is priced part by part, each by its own kind
    both = Work(1e9, 0.0, "gemm", 4) + Work(0.0, 4e6, "copy", 2)
    assert m.compute_time(both) == pytest.approx(4 * 2e-5 + 1e9 / 5e10 + 2e-5 + 4e6 / 4e9, rel=1e-6)
    assert m.interference[("comm", "comp")] == pytest.approx(1 / 1.2, rel=0.05)  # the median of 0.8 and 0.87
    assert m.host_op_s == pytest.approx(4e-5)
    path = tmp_path / "cm.json"
    m.save(path)
    back = CostModel.load(path)
    assert back.to_json() == m.to_json() and back.path == str(path)
    assert back.fingerprint() == m.fingerprint()
    assert back.predict("all_reduce", 12345, 2) == m.predict("all_reduce", 12345, 2)
    # a model for another machine fingerprints differently
    other = CostModel.fit(_synthetic_measurements((2,)), host_compute=True)
    assert other.fingerprint() != m.fingerprint()


def test_composite_ops_fit_the_host_unit():
    """A composite sample (the pipeline's expert op) prices its parts with the fitted kinds and
    attributes the rest to its host units."""
    base = _synthetic_measurements()
    parts = (("copy", 0.0, 4096.0, 3), ("gemm", 1e8, 0.0, 10), ("host", 0.0, 0.0, 2))
    known = 3 * 1e-5 + 4096 / 4e9 + 10 * 2e-5 + 1e8 / 5e10
    comp = [ComputeSample("composite", 1e8, 4096.0, 15, known + 2 * 7e-4, parts)]
    m = CostModel.fit(base + comp, host_compute=True)
    assert m.compute["host"].launch_s == pytest.approx(7e-4, rel=1e-6)
    w = Work(1e8, 0.0, "gemm", 10) + Work(0.0, 0.0, "host", 2)
    assert m.compute_time(w) == pytest.approx(10 * 2e-5 + 1e8 / 5e10 + 1.4e-3, rel=1e-6)
    back = CostModel.from_json(json.loads(json.dumps(m.to_json())))
    assert back.samples[-1].parts == parts and back.refit().compute["host"].launch_s == pytest.approx(7e-4)
    # models without a measured host cost (clusters, older files) price host units at 0
    assert CostModel(compute={"gemm": m.compute["gemm"]}).compute_time(w) == pytest.approx(m.compute_time(Work(1e8, 0.0, "gemm", 10)))


def test_retained_speed():
    m = CostModel(interference={("comm", "comp"): 0.8, ("comm", "mem"): 0.6, ("comm", "comm"): 0.5,
                                ("comp", "all"): 0.7})
    assert m.retained("comm", []) == 1.0
    assert m.retained("comm", ["comp"]) == 0.8
    assert m.retained("comm", ["comp", "mem"]) == 0.6  # no ("comm", "all"): the worst present
    assert m.retained("comm", ["comm", "comp"]) == pytest.approx(0.4)  # same class beyond fair share
    assert m.retained("comp", ["comm", "mem"]) == 0.7
    assert m.retained("comp", ["comm"]) == 1.0  # not given: no slowdown


def test_cost_model_file_errors(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=r"nope\.json.*python -m tritonmoe\.plan profile"):
        CostModel.load(missing)
    m = CostModel.fit(_synthetic_measurements(), host_compute=True)
    d = m.to_json()
    d["version"] = VERSION + 1
    bad = tmp_path / "future.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match=rf"future\.json has version {VERSION + 1}.*reads version {VERSION}.*profile"):
        CostModel.load(bad)
    notmodel = tmp_path / "other.json"
    notmodel.write_text(json.dumps({"hello": 1}))
    with pytest.raises(CostModelError, match=r"other\.json is not a tritonmoe cost model"):
        CostModel.load(notmodel)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(CostModelError, match=r"garbage\.json is not JSON"):
        CostModel.load(garbage)
    damaged = tmp_path / "damaged.json"
    d = m.to_json()
    del d["collectives"][0]["pieces"]
    damaged.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match=r"damaged\.json is damaged"):
        CostModel.load(damaged)
    # a group size the model was not fitted for: named with the file and the fix, before simulating
    good = tmp_path / "fitted.json"
    m.save(good)
    loaded = CostModel.load(good)
    with pytest.raises(CostModelError, match=r"fitted\.json: all_to_all was fitted for group sizes \[2, 4\], not 8.*--nproc 8"):
        loaded.predict("all_to_all", 1024, 8)
    cfg = tm.MoEConfig(16, 32, 8, 2)
    with pytest.raises(CostModelError, match=r"fitted\.json.*not 8"):
        simulate(cfg, 64, str(good), world_size=8)
    with pytest.raises(CostModelError, match="reduce_scatter was not measured"):
        loaded.predict("reduce_scatter", 1024, 2)
    with pytest.raises(CostModelError, match="fitted for link class intra only"):
        loaded.predict("all_to_all", 1024, 2, link_class="inter")
    with pytest.raises(CostModelError, match="no compute rate for Work kind 'elementwise'"):
        loaded.compute_time(Work(0.0, 10.0, "elementwise"))


# ---------------------------------------------------------------------------------------------
# Clusters
# ---------------------------------------------------------------------------------------------


def test_cluster_collectives_from_first_principles():
    c = Cluster.preset("dgx-h100", nodes=2)
    eff = c.efficiency["link"]
    x = 64 * 2**20
    # all-to-all on one node: (P-1)/P of the buffer over each GPU's NVLink, plus latency
    line = c.collective_line("all_to_all", 8, "intra")
    assert line(x) == pytest.approx(c.intra.latency + 7 * c.per_peer_s + x * 7 / 8 / (c.intra.bw * eff))
    # across 2 nodes: half of the buffer leaves the node through each GPU's own NIC (8 per node)
    inter = c.collective_line("all_to_all", 16, "inter")
    assert inter(x) == pytest.approx(c.inter.latency + 15 * c.per_peer_s + x * 8 / 16 / (c.inter.bw * eff))
    # ring all-gather on one node: P-1 steps of the shard; all-reduce = RS + AG
    ag = c.collective_line("all_gather", 8, "intra")
    assert ag(x) == pytest.approx(7 * c.intra.latency + 7 * x / (c.intra.bw * eff))
    ar = c.collective_line("all_reduce", 8, "intra")
    rs = c.collective_line("reduce_scatter", 8, "intra")
    assert ar(x) == pytest.approx(rs(x) + ag(x / 8))
    # NIC sharing: Parm's testbed B has one 100 Gb NIC for 4 GPUs, so 4 GPUs' inter-node bytes
    # queue on it
    b = Cluster.preset("parm-b", nodes=2)
    lat, dem = b.collective_cost("all_to_all", list(range(8)), [[x / 8] * 8] * 8, [[x / 8] * 8] * 8)
    nic = dem[("nic", 0, 0)]
    assert nic == pytest.approx(4 * (x * 4 / 8) / (b.inter.bw * eff))
    # ... and PCIe carries a GPU's intra- and inter-node traffic alike
    assert dem[("gpu", 0)] == pytest.approx(x * 7 / 8 / (b.intra.bw * eff))
    # the symmetric shortcut (one listed member) charges the NIC for every GPU that shares it
    lat1, dem1 = b.collective_cost("all_to_all", list(range(8)), [[x / 8] * 8], [[x / 8] * 8], members=[0])
    assert dem1[("nic", 0, 0)] == pytest.approx(nic) and lat1 == lat


def test_cluster_presets_and_model_roundtrip(tmp_path):
    for name in ("lina", "parm-a", "parm-b", "mpmoe-adira", "mpmoe-valor", "se-moe", "dgx-h100", "dgx-h200"):
        c = Cluster.preset(name)
        assert c.notes and c.num_gpus >= 8
        m = c.cost_model("float16")
        assert m.predict("all_to_all", 2**20, 2) > 0
    big = Cluster.preset("dgx-h100", nodes=128)
    assert big.num_gpus == 1024
    m = big.cost_model(torch.bfloat16)
    assert m.predict("all_to_all", 2**20, 1024, "inter") > m.predict("all_to_all", 2**20, 8, "intra")
    m.save(tmp_path / "h100.json")
    back = CostModel.load(tmp_path / "h100.json")
    assert back.cluster == big and back.predict("all_gather", 4096, 16, "inter") == m.predict("all_gather", 4096, 16, "inter")
    with pytest.raises(ValueError, match="unknown cluster preset"):
        Cluster.preset("dgx-z9")
    with pytest.raises(ValueError, match="no float64 rate"):
        Cluster.preset("mpmoe-valor").cost_model("float64")
    with pytest.raises(ValueError, match="does not fit on a node"):
        Cluster.preset("dgx-h100").collective_line("all_to_all", 16, "intra")
    with pytest.raises(ValueError, match="needs an inter-node link"):
        Cluster("x", 2, 8, big.gpu, big.intra, None, 0, big.host_link)


# ---------------------------------------------------------------------------------------------
# Damaged cost models are refused at load, naming the file and the field (issue 35 item 5)
# ---------------------------------------------------------------------------------------------


def _damage(d: dict, where: str, value) -> dict:
    import copy

    d = copy.deepcopy(d)
    if where == "alpha":
        d["collectives"][0]["pieces"][0][1] = value
    elif where == "beta":
        d["collectives"][0]["pieces"][-1][2] = value
    elif where == "flops":
        d["compute"][0]["flops_per_s"] = value
    elif where == "launch":
        d["compute"][0]["launch_s"] = value
    elif where == "interference":
        d["interference"] = [{"y": "comm", "x": "comp", "retained": value}]
    elif where == "host_op_s":
        d["host_op_s"] = value
    elif where == "threads":
        d["threads_per_rank"] = value
    elif where == "x_range":
        d["collectives"][0]["x_range"] = value
    elif where == "group_size":
        d["collectives"][0]["group_size"] = value
    return d


@pytest.mark.parametrize("where, value, field", [
    ("alpha", float("nan"), "alpha"), ("alpha", float("inf"), "alpha"), ("beta", -1e-9, "beta"),
    ("beta", float("nan"), "beta"), ("flops", 0.0, "flops_per_s"), ("flops", -5.0, "flops_per_s"),
    ("flops", float("nan"), "flops_per_s"), ("launch", float("inf"), "launch_s"), ("launch", -1.0, "launch_s"),
    ("interference", 0.0, "interference"), ("interference", 1.5, "interference"), ("host_op_s", float("nan"), "host_op_s"),
    ("threads", 0, "threads_per_rank"), ("x_range", [1e9, 1.0], "x_range"), ("x_range", [float("nan"), 1.0], "x_range"),
    ("group_size", 0, "group_size"),
])
def test_damaged_values_are_refused_at_load(tmp_path, where, value, field):
    import json

    from tritonmoe.policy.degree import DEFAULT_CPU_MODEL

    with open(DEFAULT_CPU_MODEL) as f:
        good = json.load(f)
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(_damage(good, where, value)))
    with pytest.raises(CostModelError, match=rf"{path}.*{field}.*must be") as e:
        CostModel.load(path)
    assert "Fix:" in str(e.value)
    # the same through the config the layer builds its policy from
    from tritonmoe.policy.degree import runtime_cost_model

    with pytest.raises(CostModelError, match=field):
        runtime_cost_model(tm.MoEConfig(8, 16, 4, 2, cost_model=str(path)), 1, torch.device("cpu"))


def test_the_engine_refuses_a_non_finite_time_instead_of_spinning():
    """A Work with a non-finite size is refused where it is made; a model whose rate was damaged
    after loading (its checks passed) ends the simulation with a SimulationError, never a loop or
    a schedule blamed for a hang."""
    import dataclasses

    from tritonmoe.policy.degree import DEFAULT_CPU_MODEL
    from tritonmoe.sim import engine
    from tritonmoe.sim.engine import SimulationError
    from tritonmoe.sim.executor import SimExecutor, VirtualGroup

    with pytest.raises(ValueError, match="flops=nan"):
        Work(flops=float("nan"), bytes=0.0, kind="gemm")
    with pytest.raises(ValueError, match="bytes=-1"):
        Work(flops=1.0, bytes=-1, kind="gemm")
    m = CostModel.load(DEFAULT_CPU_MODEL)
    m.compute["gemm"] = dataclasses.replace(m.compute["gemm"], launch_s=0.0)
    object.__setattr__(m.compute["gemm"], "launch_s", float("inf"))  # damaged after the checks
    ex = SimExecutor(0, VirtualGroup((0,)), host_compute=True)
    ex.compute(None, work=Work(flops=1e6, bytes=1e3, kind="gemm"), kind="ffn")
    with pytest.raises(SimulationError, match="not finite|NaN"):
        engine.run([ex.program], m)
