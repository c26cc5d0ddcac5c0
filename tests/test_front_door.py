"""The newcomer's surface: "did you mean" for misspelled config keywords, the one-meaning names
of the two kinds of device slots (with their deprecated alias), the bench's column legend, the
committed speedup chart's script, and packaging that pins what was tested."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

import tritonmoe as tm
from tritonmoe.core.suggest import did_you_mean, suggest_unknown_kwargs

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kwargs, wrong, right", [
    (dict(d_modle=64), "d_modle", "d_model"),
    (dict(capacity_factr=1.25), "capacity_factr", "capacity_factor"),
    (dict(topk=2), "topk", "top_k"),
    (dict(pipline_degree=2), "pipline_degree", "pipeline_degree"),
    (dict(memory_stratgy="keep"), "memory_stratgy", "memory_strategy"),
])
def test_moe_config_typo_names_the_closest_keyword(kwargs, wrong, right):
    base = dict(d_model=64, d_ffn=32, num_experts=4, top_k=2)
    base.update(kwargs)
    base.pop(right, None)
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{wrong}'; did you mean '{right}'"):
        tm.MoEConfig(**base)


def test_typo_error_lists_the_valid_keywords_and_replace_is_checked_too():
    cfg = tm.MoEConfig(d_model=8, d_ffn=4, num_experts=4, top_k=2)
    with pytest.raises(TypeError) as e:
        dataclasses.replace(cfg, num_expert=8)
    assert "did you mean 'num_experts'" in str(e.value) and "it takes:" in str(e.value) and "top_k" in str(e.value)
    # A valid keyword is untouched, positional arguments too.
    assert dataclasses.replace(cfg, num_experts=8).num_experts == 8
    assert tm.MoEConfig(8, 4, 4, 2) == cfg


def test_other_public_config_objects_suggest():
    from tritonmoe.inference import Placement
    from tritonmoe.plan import Cluster

    cfg = tm.MoEConfig(d_model=8, d_ffn=4, num_experts=4, top_k=2)
    with pytest.raises(TypeError, match="did you mean 'dtype'"):
        tm.MoELayer(cfg, dtpye=torch.float64)
    with pytest.raises(TypeError, match="did you mean 'n_ep'"):
        tm.ParmLayout(n_mp=1, n_epp=2, n_esp=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nodez'; did you mean 'nodes'"):
        Cluster(nodez=2)
    with pytest.raises(TypeError, match="did you mean 'num_experts'"):
        Placement(num_expert=4, hosted=[[0, 1, 2, 3]])


def test_did_you_mean_without_a_close_name_says_nothing_misleading():
    assert did_you_mean("zzzz", ["d_model", "top_k"]) == ""
    assert did_you_mean("expert", ["expert_bias", "top_k"]) == "; did you mean 'expert_bias'?"

    @suggest_unknown_kwargs
    class Free:
        def __init__(self, **kw):
            self.kw = kw

    assert Free(anything=1).kw == {"anything": 1}   # **kwargs classes are left alone


def _layers(n, E=4, d=8):
    torch.manual_seed(0)
    cfg = tm.MoEConfig(d_model=d, d_ffn=6, num_experts=E, top_k=2)
    return [tm.MoELayer(cfg, dtype=torch.float64) for _ in range(n)]


def test_offloaded_experts_layer_slots_and_deprecated_slots():
    from tritonmoe.inference import OffloadedExperts, restore_experts

    layers = _layers(3)
    x = torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        want = layers[2](layers[1](layers[0](x)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # the new name warns nothing
        stack = OffloadedExperts(layers, layer_slots=2)
    with torch.no_grad():
        got = layers[2](layers[1](layers[0](x)))
    stack.close()
    assert torch.equal(got, want) and len(stack.slots) == 2
    for layer in layers:
        restore_experts(layer)
    with pytest.warns(DeprecationWarning, match=r"OffloadedExperts\(slots=...\) is deprecated: use layer_slots="):
        old = OffloadedExperts(layers, slots=1)
    assert len(old.slots) == 1
    old.close()
    for layer in layers:
        restore_experts(layer)
    with pytest.raises(TypeError, match="both layer_slots= and its deprecated name slots="):
        OffloadedExperts(layers, layer_slots=1, slots=1)
    with pytest.raises(TypeError, match="needs layer_slots="):
        OffloadedExperts(layers)
    with pytest.raises(ValueError, match="layer_slots=3 for 3 layers"):
        OffloadedExperts(layers, layer_slots=3)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_replicated_layer_expert_slots_and_deprecated_slots(one_rank_group):
    from tritonmoe.inference import ReplicatedMoELayer

    (layer,) = _layers(1)
    rep = ReplicatedMoELayer(layer, expert_slots=4)
    assert rep.expert_slots == 4
    with pytest.warns(DeprecationWarning, match="use expert_slots"):
        assert rep.slots == 4
    with pytest.warns(DeprecationWarning, match=r"ReplicatedMoELayer\(slots=...\) is deprecated: use expert_slots="):
        old = ReplicatedMoELayer(layer, slots=4)
    assert old.expert_slots == 4
    with pytest.raises(ValueError, match="expert_slots=0 must be >= 1"):
        ReplicatedMoELayer(layer, expert_slots=0)


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bench_legend_covers_every_column():
    from bench import report

    run = _bench("--legend")
    assert run.returncode == 0, run.stderr
    for header in ("median", "p20-p80", "roof", "x gmm", "x loop", "x torch", "/min", "peak"):
        assert re.search(rf"^\s*{re.escape(header)}\s{{2}}\S", run.stdout, re.M), (header, run.stdout)
    # Every column the tables can show has a legend line.
    row = {"suite": "ffn", "case": "c", "mode": "fwd", "impl": "triton", "status": "ok", "note": "n",
           "time_s": {"median": 1.0, "p20": 1.0, "p80": 1.0}, "tflops": 1.0, "gbps": 1.0, "roof_frac": 0.5,
           "roof_bound": "compute", "speedup": {"torch": 1.0, "loop": 2.0, "grouped_mm": 1.0},
           "memory": {"peak_bytes": 1, "ratio": 1.0},
           "telemetry": {"gpu_util_pct": {"mean": 1.0}, "power_w": {"mean": 1.0}, "sm_clock_mhz": {"mean": 1.0}},
           "extra": {"x": 1}}
    assert {c.header for c in report.columns([row])} <= set(report.LEGEND)


def test_speedup_chart_script_reads_the_committed_results(tmp_path):
    pytest.importorskip("matplotlib")
    results = sorted((ROOT / "bench" / "results").glob("nvidia-*-[0-9][0-9]-[0-9][0-9]-2.json"))
    assert results, "no committed GPU results"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_speedup.py"), str(results[-1]),
                          "--speedup", str(tmp_path / "s.png"), "--roofline", str(tmp_path / "r.png")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for name in ("s.png", "r.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "img" / "speedup-h100.png").exists() and (ROOT / "docs" / "img" / "roofline-h100.png").exists()


def test_tested_versions_are_pinned_and_inside_the_declared_ranges():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+

    from packaging.requirements import Requirement

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {Requirement(d).name: Requirement(d) for d in meta["dependencies"]}
    pins = {}
    for line in (ROOT / "constraints-tested.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints-tested.txt: {line!r} is not an exact pin"
            pins[name.strip()] = version.strip()
    for name in ("torch", "triton"):
        assert deps[name].specifier.contains(pins[name]), (name, pins[name], deps[name])
        # Upper bounds: pip never picks an untested next release.
        assert any(s.operator == "<" for s in deps[name].specifier), deps[name]
    extras = meta["optional-dependencies"]
    dev = {Requirement(r).name for r in extras["dev"]}
    assert dev >= {Requirement(r).name for x in ("test", "bench", "plot", "hf") for r in extras[x]}
    assert set(pins) - {"torch", "triton"} <= dev
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert ".[dev]" in setup and "constraints-tested.txt" in setup and "matplotlib" in setup


# The README's headline rows: (label in the first cell, suite, case, mode, impl, peer).
HEADLINE = [
    ("`MoELayer` training step, Qwen3-30B-A3B-like T=32k", "layer", "qwen3-30b-a3b-like T=32768 uniform", "fwd+bwd", "triton", "loop"),
    ("`MoELayer` training step, Mixtral-8x7B-like T=16k", "layer", "mixtral-8x7b-like T=16384 uniform", "fwd+bwd", "triton", "loop"),
    ("`moe_ffn` fwd+bwd, Qwen3-30B-A3B-like T=32k", "ffn", "moe_ffn qwen3-30b-a3b-like T=32768 uniform", "fwd+bwd", "triton", "grouped_mm"),
    ("`moe_ffn` fwd (fused), Qwen3-30B-A3B-like T=32k", "ffn", "moe_ffn qwen3-30b-a3b-like T=32768 uniform", "fwd", "triton-fused", "grouped_mm"),
    ("`moe_ffn` fwd+bwd, Mixtral-like T=16k", "ffn", "moe_ffn mixtral-8x7b-like T=16384 uniform", "fwd+bwd", "triton", "grouped_mm"),
    ("`grouped_ffn` fwd, Mixtral-like T=16k", "ffn", "grouped_ffn mixtral-8x7b-like T=16384 uniform", "fwd", "triton", "grouped_mm"),
    ("decode `moe_ffn` (fused), Mixtral-like T=64", "ffn", "moe_ffn mixtral-8x7b-like T=64 uniform", "fwd", "triton-fused", "grouped_mm"),
    ("router fwd+bwd, DeepSeek-V3-like E=128 T=16k", "route", "E=128 k=8 sigmoid+bias groups=8/4 T=16384 uniform", "fwd+bwd", "triton", "torch"),
]


def test_readme_headline_numbers_are_the_committed_results():
    """Every ratio and time of the README's speed table is read from the results file it cites."""
    import json

    from bench.report import fmt_time

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Is it faster?")[1].split("\n## ")[0]
    (cited,) = {m for m in re.findall(r"\(bench/results/([\w.-]+)\.md\)", section) if not m.endswith("-notes")}
    doc = json.loads((ROOT / "bench" / "results" / f"{cited}.json").read_text())
    assert doc["env"]["git_commit"][:7] in readme and doc["env"]["date_utc"][:10] in readme
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in readme.splitlines() if line.startswith("| ")}
    for label, suite, case, mode, impl, peer in HEADLINE:
        (r,) = [r for r in doc["results"] if (r["suite"], r["case"], r["mode"], r["impl"]) == (suite, case, mode, impl)]
        median, _, ratio = rows[label]
        assert ratio.strip("*").split("x")[0] in (f"{r['speedup'][peer]:.2f}", f"{r['speedup'][peer]:.1f}"), (label, ratio, r["speedup"])
        assert median == fmt_time(r["time_s"]["median"]), (label, median, fmt_time(r["time_s"]["median"]))


def test_plot_draws_bars_where_every_line_would_be_one_dot(tmp_path, monkeypatch):
    """gpu-check measures each shape at one token count: its panels are bars, not single dots."""
    pytest.importorskip("matplotlib")
    import json

    from bench import report

    doc = json.loads((ROOT / "bench" / "results" / "nvidia-h100-80gb-hbm3-2026-11-26-2.json").read_text())
    drawn = []
    real = report._bar_panel
    monkeypatch.setattr(report, "_bar_panel", lambda ax, suite, mode, *a: (drawn.append((suite, mode)), real(ax, suite, mode, *a)))
    assert report.plot(doc, tmp_path / "p.png") is None
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    # layer and permute have one T per case there; route has two (lines); ffn fwd has decode T's (lines).
    assert ("layer", "fwd+bwd") in drawn and ("permute", "move") in drawn
    assert ("route", "fwd") not in drawn and ("ffn", "fwd") not in drawn
