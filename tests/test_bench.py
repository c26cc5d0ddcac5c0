"""Tests of the benchmark harness (bench/): CLI, schema, compare, roofs, telemetry, ep adapter.

The smoke tests run the harness in-process on CPU at the small preset with few reps and tiny
token counts; GPU-only behavior (CUDA events, L2 flush, peak memory, NVML) is exercised with
fakes here and for real under the ``gpu`` marker.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import threading
import time
import types

import pytest
import torch

from bench import __main__ as cli
from bench import harness, report, roofs, schema, suites, work
from bench.harness import Timer, Unavailable, Work
from bench.presets import PRESETS, parse_routing, with_overrides
from bench.telemetry import Telemetry

QUICK = ["--reps", "3", "--warmup", "1", "--no-progress"]


@pytest.fixture(scope="module")
def smoke_doc(tmp_path_factory):
    """One small CPU run of every local suite, shared by the tests that read its JSON."""
    out = tmp_path_factory.mktemp("bench")
    path = out / "smoke.json"
    rc = cli.main(
        ["route", "permute", "ffn", "layer", "--preset", "small", "--tokens", "32,64", *QUICK,
         "--json", str(path), "--markdown", str(out / "smoke.md")]
    )
    assert rc == 0
    return path


# ---------------------------------------------------------------------------------------------
# Smoke run and schema
# ---------------------------------------------------------------------------------------------


def test_smoke_run_validates_against_schema(smoke_doc):
    doc = json.loads(smoke_doc.read_text())
    schema.validate(doc)
    assert doc["complete"] is True
    assert doc["env"]["mode"] == "cpu" and doc["env"]["torch"] == torch.__version__
    assert doc["config"]["reps"] == 3 and doc["config"]["presets"] == ["small"]
    assert set(doc["roofs"]) == {"matmul_float32", "copy"}
    rows = doc["results"]
    assert {r["suite"] for r in rows} == {"route", "permute", "ffn", "layer"}
    assert all(r["status"] == "ok" for r in rows), [r["note"] for r in rows if r["status"] != "ok"]
    for r in rows:
        t = r["time_s"]
        assert t["reps"] == 3 == len(r["times_s"])
        assert 0 < t["min"] <= t["p20"] <= t["median"] <= t["p80"] <= t["max"]
        assert r["tflops"] is not None or r["gbps"] is not None
        assert r["memory"]["peak_bytes"] is None  # CPU: not measured
        assert r["telemetry"] is None
        assert r["roof_frac"] is not None and r["roof_bound"] in ("compute", "memory")
    ffn = [r for r in rows if r["suite"] == "ffn" and r["mode"] == "fwd+bwd" and r["params"]["T"] == 64]
    assert {r["impl"] for r in ffn} == {"torch", "loop", "grouped_mm"}
    torch_row = next(r for r in ffn if r["impl"] == "torch")
    assert set(torch_row["speedup"]) == {"loop", "grouped_mm"}
    loop_row = next(r for r in ffn if r["impl"] == "loop")
    assert loop_row["speedup"]["torch"] == pytest.approx(
        torch_row["time_s"]["median"] / loop_row["time_s"]["median"]
    )
    layer = [r for r in rows if r["suite"] == "layer"]
    assert all(r["memory"]["analytic_min_bytes"] > 0 for r in layer)
    md = (smoke_doc.parent / "smoke.md").read_text()
    assert "## ffn" in md and "| case | mode | impl | median |" in md


def test_schema_rejects_broken_documents(smoke_doc):
    good = json.loads(smoke_doc.read_text())
    bad_cases = [
        ("results", lambda d: d.pop("results")),
        ("status", lambda d: d["results"][0].__setitem__("status", "fine")),
        ("median", lambda d: d["results"][0]["time_s"].pop("median")),
        ("reps", lambda d: d["results"][0]["time_s"].__setitem__("reps", 0)),
        ("mode", lambda d: d["env"].__setitem__("mode", "tpu")),
        ("bogus", lambda d: d["results"][0].__setitem__("bogus", 1)),
        ("tflops", lambda d: d["results"][0].__setitem__("tflops", "fast")),
    ]
    for expect, mutate in bad_cases:
        d = copy.deepcopy(good)
        mutate(d)
        with pytest.raises(schema.SchemaError, match=expect):
            schema.validate(d)


def test_schema_accepts_a_row_of_every_suite(smoke_doc):
    """The `gemm` suite ran on the first GPU lease that reached it and its result file was refused
    by the schema (suite not in the enum): every suite's rows must validate."""
    from bench.suites import SUITES

    good = json.loads(smoke_doc.read_text())
    for name in SUITES:
        d = copy.deepcopy(good)
        d["results"] = [dict(d["results"][0], suite=name)]
        schema.validate(d)


def test_print_schema_is_json(capsys):
    assert cli.main(["--print-schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["title"] == "tritonmoe benchmark results"


def test_default_reps_and_cpu_plan(capsys):
    args = cli.build_parser().parse_args([])
    assert args.reps >= 20 and args.reps == harness.DEFAULT_REPS
    if not torch.cuda.is_available():
        assert cli.main(["--list"]) == 0
        out = capsys.readouterr().out
        assert "layer/small T=" in out and "[loop]" in out and "[triton]" not in out


# ---------------------------------------------------------------------------------------------
# compare and report
# ---------------------------------------------------------------------------------------------


def test_compare_two_saved_files(smoke_doc, tmp_path, capsys):
    a = json.loads(smoke_doc.read_text())
    b = copy.deepcopy(a)
    for r in b["results"]:
        if r["suite"] == "ffn":
            for key in ("median", "p20", "p80"):
                r["time_s"][key] /= 2  # B twice as fast on ffn
    b["results"] = [r for r in b["results"] if r["suite"] != "route"]  # route only in A
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    report.write_json(a, pa)
    report.write_json(b, pb)
    assert cli.main(["compare", str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    ffn_lines = [ln for ln in out.splitlines() if ln.startswith("ffn/")]
    assert ffn_lines and all("0.500" in ln and "2.000x" in ln and "faster" in ln for ln in ffn_lines)
    assert "entries only in A" in out and "geometric-mean speedup" in out
    _, summary = report.compare_docs(a, b)
    n_ffn = sum(r["suite"] == "ffn" for r in a["results"])
    n_common = sum(r["suite"] != "route" for r in a["results"])
    assert summary["matched"] == n_common
    assert summary["geomean_speedup"] == pytest.approx(2.0 ** (n_ffn / n_common))


def test_compare_rejects_unreadable_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1}')
    assert cli.main(["compare", str(bad), str(bad)]) == 2
    assert "missing required field" in capsys.readouterr().err


def test_report_rerenders_and_merges(smoke_doc, tmp_path, capsys):
    md = tmp_path / "r.md"
    assert cli.main(["report", str(smoke_doc), "--markdown", str(md)]) == 0
    assert "## layer" in md.read_text()
    assert "roof matmul_float32" in capsys.readouterr().out
    doc = report.load_json(smoke_doc)
    merged = report.merge_docs([doc, doc])
    schema.validate(merged)
    assert len(merged["results"]) == 2 * len(doc["results"]) and len(merged["notes"]) == 2


def test_results_dir_names_files_by_device_and_date(tmp_path, capsys):
    assert cli.main(["route", "--preset", "small", "--tokens", "16", *QUICK, "--results-dir", str(tmp_path)]) == 0
    names = sorted(p.suffix for p in tmp_path.iterdir())
    assert ".json" in names and ".md" in names
    stem = next(tmp_path.glob("*.json")).stem
    assert stem.startswith("nvidia" if torch.cuda.is_available() else "cpu-20")
    assert cli.slug("NVIDIA H200 NVL") == "nvidia-h200-nvl"


def test_plot_without_matplotlib_is_one_note(smoke_doc, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    doc = json.loads(smoke_doc.read_text())
    note = report.plot(doc, tmp_path / "p.png")
    assert note.startswith("plot: matplotlib is not installed") and "\n" not in note
    assert not (tmp_path / "p.png").exists()


def test_plot_with_matplotlib(smoke_doc, tmp_path):
    pytest.importorskip("matplotlib")
    doc = json.loads(smoke_doc.read_text())
    assert report.plot(doc, tmp_path / "p.png") is None
    assert (tmp_path / "p.png").stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# Bad flags: argparse errors (exit status 2), never tracebacks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["nosuchsuite"],
        ["--preset", "gpt5"],
        ["--tokens", "12,abc"],
        ["--tokens", "0"],
        ["--routing", "zipf:-1"],
        ["--routing", "normal"],
        ["--dtype", "int8"],
        ["--backend", "cuda"],
        ["--baselines", "magic"],
        ["--reps", "2"],
        ["--warmup", "-1"],
        ["-E", "4", "-k", "8"],
        ["--num-experts", "6", "--n-groups", "4", "--topk-groups", "2"],
        ["--ep-timeout", "0"],
        ["--activation", "tanh"],
        ["compare", "only-one.json"],
        ["report"],
    ],
)
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_device_without_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--device", "cuda", "route"])
    assert exc.value.code == 2


def test_custom_shape_overrides_preset():
    p = with_overrides(PRESETS["small"], {"d_model": 512, "top_k": 4, "num_experts": None})
    assert p.d_model == 512 and p.top_k == 4 and p.num_experts == 8
    assert p.name == "small[d_model=512,top_k=4]"
    assert with_overrides(PRESETS["small"], {"d_model": 256}) is PRESETS["small"]


# ---------------------------------------------------------------------------------------------
# Harness pieces
# ---------------------------------------------------------------------------------------------


def test_summarize_and_quantiles():
    s = harness.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 5.0 and s["reps"] == 5
    assert s["p20"] == pytest.approx(1.8) and s["p80"] == pytest.approx(4.2)  # numpy's linear method


def test_roofline_fraction_and_bound():
    r = {"matmul_bfloat16": {"tflops": 100.0}, "copy": {"gbps": 1000.0}}
    frac, bound = harness.roofline(Work(flops=1e12, bytes=1e9), 0.02, r, "bfloat16")
    assert bound == "compute" and frac == pytest.approx(0.5)  # 10 ms at the roof, 20 ms measured
    frac, bound = harness.roofline(Work(flops=1e9, bytes=1e10), 0.02, r, "float16")
    assert bound == "memory" and frac == pytest.approx(0.5)
    assert harness.roofline(Work(flops=1.0), 1.0, {}, "bfloat16") == (None, None)


def test_cpu_timer_and_roofs_degrade_cleanly(monkeypatch):
    timer = Timer(torch.device("cpu"), reps=3, warmup=1)
    assert not timer.flushes  # no L2 flush buffer on CPU
    m = timer.measure(lambda: torch.ones(8).sum())
    assert len(m.times_s) == 3 and m.peak_bytes is None and m.telemetry is None
    lines = []
    monkeypatch.setattr(roofs, "CPU_MATMUL_N", 64)
    monkeypatch.setattr(roofs, "CPU_COPY_BYTES", 2**16)
    got = roofs.measure_roofs(timer, torch.float32, log=lines.append)
    assert set(got) == {"matmul_float32", "copy"} and lines == []
    assert got["matmul_float32"]["tflops"] > 0 and got["copy"]["gbps"] > 0

    def broken(*a, **k):
        raise RuntimeError("CUDA error: out of memory\nmore text")

    monkeypatch.setattr(roofs, "measure_copy", broken)
    got = roofs.measure_roofs(timer, torch.float32, log=lines.append)
    assert set(got) == {"matmul_float32"}
    assert lines == ["roof copy: not measured (RuntimeError: CUDA error: out of memory)"]


def _ctx(**kw):
    kw.setdefault("presets", [PRESETS["small"]])
    ctx = suites.Context(device=torch.device("cpu"), dtype=torch.float32, **kw)
    ctx.timer = Timer(ctx.device, reps=3, warmup=0)
    return ctx


def test_entry_failures_are_recorded_not_raised():
    def unavailable(st):
        raise NotImplementedError("tritonmoe has no Triton kernel for 'route' yet; use backend='torch'")

    def missing(st):
        raise Unavailable("torch._grouped_mm is missing")

    def broken(st):
        return (lambda: 1 / 0), Work(flops=1.0)

    def ok(st):
        return (lambda: st + 1), Work(flops=10.0)

    case = suites.Case("ffn", "c", {"T": 1}, build=lambda: 1, entries=[
        suites.Entry("fwd", "triton", unavailable), suites.Entry("fwd", "grouped_mm", missing),
        suites.Entry("fwd", "loop", broken), suites.Entry("fwd", "torch", ok),
    ])
    rows = suites.run_case(_ctx(), case)
    assert [r["status"] for r in rows] == ["unavailable", "unavailable", "error", "ok"]
    assert rows[0]["note"].startswith("tritonmoe has no Triton kernel")
    assert rows[2]["note"] == "ZeroDivisionError: division by zero"
    assert rows[3]["speedup"] == {} and rows[3]["tflops"] > 0

    def no_inputs():
        raise RuntimeError("CUDA out of memory. Tried to allocate 20 GiB")

    rows = suites.run_case(_ctx(), dataclasses.replace(case, build=no_inputs))
    assert all(r["status"] == "error" and "out of memory" in r["note"] for r in rows)


def test_triton_backend_on_cpu_without_interpreter_is_unavailable(monkeypatch):
    from tritonmoe.core import settings as _settings

    monkeypatch.setattr(_settings, "TRITON_INTERPRET", False)
    ctx = _ctx(backends=("triton",), tokens=(16,), presets_chosen=True)
    rows = suites.run_suite(ctx, "route")
    assert rows and all(r["status"] == "unavailable" and "TRITON_INTERPRET" in r["note"] for r in rows)


def test_permute_metadata_entry(monkeypatch):
    """The permute suite's metadata entries: Triton's permute_metadata (in the interpreter on CPU)
    beside the reference's, or one unavailable line without the interpreter."""
    from tritonmoe.core import settings as _settings

    ctx = _ctx(backends=("triton", "torch"), tokens=(16,), presets_chosen=True)
    case = next(c for c in suites.plan(ctx, "permute") if c.params["op"] == "permute")
    case = dataclasses.replace(case, entries=[e for e in case.entries if e.mode == suites.METADATA])
    assert [e.impl for e in case.entries] == ["triton", "torch"]
    if not torch.cuda.is_available():
        monkeypatch.setattr(_settings, "TRITON_INTERPRET", False)
        rows = suites.run_case(ctx, case)
        assert rows[0]["status"] == "unavailable" and "TRITON_INTERPRET" in rows[0]["note"]
        assert "\n" not in rows[0]["note"] and rows[1]["status"] == "ok"
        monkeypatch.setattr(_settings, "TRITON_INTERPRET", True)  # conftest switched it on for real
    rows = suites.run_case(ctx, case)
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["note"] for r in rows]
    T, k, E = 16, PRESETS["small"].top_k, PRESETS["small"].num_experts
    assert all(r["bytes"] == work.permute_metadata(T, k, E).bytes and r["gbps"] > 0 for r in rows)
    assert set(rows[0]["speedup"]) == {"torch"}


def test_metadata_fraction_of_the_layer(smoke_doc, capsys):
    doc = json.loads(smoke_doc.read_text())
    rows = doc["results"]
    meta = [r for r in rows if r["mode"] == suites.METADATA]
    assert [(r["suite"], r["impl"], r["params"]["T"]) for r in meta] == [("permute", "torch", 32), ("permute", "torch", 64)]
    for r in meta:
        layer = next(x for x in rows if x["suite"] == "layer" and x["mode"] == "fwd" and x["impl"] == "torch"
                     and x["params"]["T"] == r["params"]["T"])
        assert r["extra"][suites.LAYER_FRACTION] == pytest.approx(r["time_s"]["median"] / layer["time_s"]["median"])
    # report re-attaches it across files (permute and layer measured by separate commands)
    for r in meta:
        r["extra"].clear()
    assert suites.attach_layer_fractions(rows) == meta
    assert suites.attach_layer_fractions([r for r in rows if r["suite"] != "layer"]) == []
    assert cli.main(["report", str(smoke_doc)]) == 0
    assert f"{suites.LAYER_FRACTION}=" in capsys.readouterr().out


def test_missing_kernel_is_unavailable(monkeypatch):
    """backend='triton' for an op without a kernel raises NotImplementedError in tritonmoe: one
    unavailable row per entry, the run goes on."""
    from tritonmoe.core import settings as _settings
    from tritonmoe import backends as dispatch

    monkeypatch.setattr(_settings, "TRITON_INTERPRET", True)
    monkeypatch.setattr(dispatch, "kernel", lambda op: None)
    ctx = _ctx(backends=("triton", "torch"), tokens=(16,), presets_chosen=True, baselines=())
    rows = suites.run_suite(ctx, "layer")
    by_impl = {(r["impl"], r["mode"]): r for r in rows}
    assert by_impl[("triton", "fwd")]["status"] == "unavailable"
    assert "no Triton kernel" in by_impl[("triton", "fwd")]["note"]
    assert by_impl[("torch", "fwd+bwd")]["status"] == "ok"


def test_zipf_routing_is_skewed():
    spec = parse_routing("zipf:1.2")
    p = spec.popularity(8)
    assert torch.all(p[:-1] > p[1:]) and float(p.sum()) == pytest.approx(1.0)
    logits = spec.logits(4096, 8, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    top1 = torch.bincount(logits.argmax(-1), minlength=8).double() / 4096
    assert float(top1[0]) == pytest.approx(float(p[0]), abs=0.03)
    u = parse_routing("uniform").logits(4096, 8, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    assert float((torch.bincount(u.argmax(-1), minlength=8) / 4096).max()) < 0.16


def test_work_formulas():
    fwd = work.grouped_ffn(R=100, d=8, f=16, n1=32, Ea=4, s=2, backward=False)
    both = work.grouped_ffn(R=100, d=8, f=16, n1=32, Ea=4, s=2, backward=True)
    assert fwd.flops == 2 * 100 * 8 * 32 + 2 * 100 * 16 * 8 and both.flops == 3 * fwd.flops
    assert both.bytes > fwd.bytes
    lay = work.layer(T=10, E=4, k=2, R=20, d=8, f=16, n1=32, Ea=4, s=2, backward=True)
    W_ = (8 * 4 + 4 * 8 * 32 + 4 * 16 * 8) * 2
    assert lay.min_memory_bytes == 2 * W_ + 4 * 10 * 8 * 2 + 10 * 4 * 2 + 10 * 2 * 8 + 20 * 32 * 2
    assert work.route(T=4, E=8, k=2, s=4, backward=False).bytes == 4 * 8 * 4 + 4 * 2 * 8 + 8 * 4


# ---------------------------------------------------------------------------------------------
# Telemetry
# ---------------------------------------------------------------------------------------------


def test_telemetry_off_without_gpu_says_one_line():
    lines = []
    t = Telemetry.create(torch.device("cpu"), log=lines.append)
    assert not t.enabled and lines == ["telemetry: off (no CUDA device)"]
    t.start()
    assert t.stop() is None


class _NVMLError(Exception):
    pass


def test_telemetry_off_when_nvml_fails():
    broken = types.SimpleNamespace(nvmlInit=lambda: (_ for _ in ()).throw(_NVMLError("Driver Not Loaded")))
    lines = []
    t = Telemetry.create(torch.device("cuda", 0), log=lines.append, nvml=broken)
    assert not t.enabled
    assert len(lines) == 1 and lines[0].startswith("telemetry: off (NVML unavailable: _NVMLError: Driver Not Loaded")


def test_telemetry_sampler_with_fake_nvml():
    calls = {"n": 0}

    def util(h):
        calls["n"] += 1
        return types.SimpleNamespace(gpu=50 + calls["n"] % 2 * 10)

    def power(h):
        raise _NVMLError("Not Supported")

    nvml = types.SimpleNamespace(
        NVML_CLOCK_SM=1,
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2**30),
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetClockInfo=lambda h, kind: 1980,
        nvmlShutdown=lambda: None,
    )
    t = Telemetry(nvml, handle=object(), interval_s=0.002)
    assert t.enabled
    t.start()
    time.sleep(0.05)
    s = t.stop()
    assert s["samples"] >= 3
    assert 50 <= s["gpu_util_pct"]["mean"] <= 60 and s["gpu_util_pct"]["max"] == 60
    assert s["mem_used_bytes"] == {"mean": 2**30, "max": 2**30}
    assert s["sm_clock_mhz"]["mean"] == 1980
    assert s["power_w"] is None  # not supported: dropped, not an error
    assert not any(th.name == "bench-telemetry" for th in threading.enumerate())
    t.close()
    assert not t.enabled


# ---------------------------------------------------------------------------------------------
# ep suite adapter (bench/ep.py comes from the expert-parallel issue)
# ---------------------------------------------------------------------------------------------


def _fake_ep_module(calls):
    def run_ep(*, world_sizes=(2, 4), degrees=(1, 2, 4, 8), tokens, d_model, d_ffn, num_experts, top_k,
               dtype=torch.float32, reps=20, warmup=3, timeout_s=60.0):
        calls.append(dict(world_sizes=world_sizes, degrees=degrees, tokens=tokens, reps=reps, timeout_s=timeout_s))
        out = []
        for ws in world_sizes:
            for n in degrees:
                base = 0.010 / n ** 0.5
                out.append({
                    "name": "small", "world_size": ws, "pipeline_degree": n, "tokens_per_rank": tokens,
                    "d_model": d_model, "d_ffn": d_ffn, "num_experts": num_experts, "top_k": top_k,
                    "dtype": dtype, "layer_fwd_bwd_s": [base * (1 + 0.01 * i) for i in range(reps)],
                    "dispatch_s": [0.001] * reps, "combine_s": [0.002] * reps, "dispatch_bytes": 1_000_000,
                    "algbw_GBps": 1.0, "busbw_GBps": 1.0 * (ws - 1) / ws,
                    "pipeline_efficiency": None if n == 1 else 0.5, "partition_overhead_frac": 0.01,
                })
        return out

    return types.SimpleNamespace(run_ep=run_ep)


def test_ep_suite_adapts_run_ep_rows(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setitem(sys.modules, "bench.ep", _fake_ep_module(calls))
    path = tmp_path / "ep.json"
    rc = cli.main(["ep", "--preset", "small", "--tokens", "64", "--ep-world-sizes", "2,4", "--ep-degrees", "1,2",
                   *QUICK, "--json", str(path)])
    assert rc == 0
    assert calls == [dict(world_sizes=(2, 4), degrees=(1, 2), tokens=64, reps=3, timeout_s=60.0)]
    doc = report.load_json(path)
    rows = doc["results"]
    assert len(rows) == 2 * 2 * 3 and all(r["status"] == "ok" for r in rows)
    layer = {(r["params"]["world_size"], r["params"]["pipeline_degree"]): r for r in rows if r["impl"] == "ep-layer"}
    assert layer[(4, 2)]["extra"]["pipeline_efficiency"] == 0.5
    assert "pipeline_efficiency" not in layer[(4, 1)]["extra"]  # None: left out
    assert layer[(4, 2)]["extra"]["speedup_vs_degree1"] == pytest.approx(2 ** 0.5, rel=1e-6)
    assert layer[(2, 1)]["time_s"]["median"] == pytest.approx(0.0101)
    dispatch = next(r for r in rows if r["mode"] == "dispatch" and r["params"]["world_size"] == 4)
    assert dispatch["gbps"] == pytest.approx(1.0) and dispatch["extra"]["busbw_GBps"] == pytest.approx(0.75)
    assert dispatch["params"]["dtype"] == "float32"
    out = capsys.readouterr().out
    assert "all-to-all" in out and "speedup_vs_degree1=" in out


def test_ep_suite_missing_module_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bench.ep", None)  # import raises ImportError
    rows = suites.run_ep_suite(_ctx(log=print))
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("ep: unavailable")
    assert len(rows) == 1 and rows[0]["status"] == "unavailable"


def test_ep_runs_on_cpu_use_the_small_preset_in_fp32():
    runs, dtype, where = suites.ep_cases(_ctx(presets=[PRESETS["mixtral-8x7b-like"]]))
    assert [(p.name, T) for p, T in runs] == [("small", 512)] and dtype == torch.float32
    assert where == "gloo on CPU processes"
    runs, _, _ = suites.ep_cases(_ctx(presets=[PRESETS["medium"]], presets_chosen=True, tokens=(64, 128)))
    assert [(p.name, T) for p, T in runs] == [("medium", 64), ("medium", 128)]


def test_ep_rows_without_times_are_errors():
    rows = suites.ep_rows([{"name": "x", "world_size": 2, "pipeline_degree": 1, "layer_fwd_bwd_s": [],
                            "dispatch_s": [0.1], "combine_s": [0.1], "dispatch_bytes": 10}])
    assert [r["status"] for r in rows] == ["error", "ok", "ok"]


# ---------------------------------------------------------------------------------------------
# GPU: the real timing path (CUDA events, L2 flush, peak memory, NVML)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_smoke(tmp_path):
    path = tmp_path / "gpu.json"
    rc = cli.main(["ffn", "layer", "--preset", "small", "--tokens", "256", "--backend", "torch", *QUICK,
                   "--json", str(path)])
    assert rc == 0
    doc = report.load_json(path)
    assert doc["env"]["mode"] == "gpu" and doc["env"]["gpu_name"]
    assert "matmul_bfloat16" in doc["roofs"] and doc["roofs"]["copy"]["gbps"] > 0
    assert doc["config"]["l2_flush"] is True
    for r in doc["results"]:
        if r["status"] == "ok":
            assert r["memory"]["peak_bytes"] > 0
    layer = [r for r in doc["results"] if r["suite"] == "layer" and r["status"] == "ok"]
    assert layer and all(r["memory"]["ratio"] > 0 for r in layer)


def test_unpermute_split_variant_is_the_same_op(monkeypatch):
    """The GPU-only "triton-split" unpermute entry (one d-chunk per program) computes what the
    default launch does; it exists only when the row spans several chunks."""
    import types

    import tritonmoe as tm
    from bench import suites as S
    from tritonmoe import reference
    from tritonmoe.kernels import permute as kp

    monkeypatch.setattr(kp, "_sms", lambda device: 1)  # a "CUDA" device with enough tokens to loop; CPU tensors
    ctx = types.SimpleNamespace(backends=("torch", "triton"), device=torch.device("cuda"), itemsize=2)
    T, k, d, E = 16, 8, 2048, 8
    g = torch.Generator().manual_seed(0)
    r = reference.route(torch.randn(T, E, generator=g), k)
    _, info = reference.permute(torch.empty(T, 0), r.topk_ids, E)
    st = dict(y=torch.randn(T * k, d, generator=g), info=info, w=r.topk_weights)
    impls = S.gather_split_impls(ctx, T, k, d, lambda st: tm.unpermute(st["y"], st["info"], st["w"], backend="triton"))
    assert [name for name, _, _ in impls] == ["triton-split"]
    got = impls[0][1](st)
    want = tm.unpermute(st["y"], st["info"], st["w"], backend="triton")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got, reference.unpermute(st["y"], info, st["w"]), rtol=1e-5, atol=1e-5)
    assert S.gather_split_impls(ctx, T, 2, 256, lambda st: None) == []  # one chunk: nothing to compare
    assert S.gather_split_impls(types.SimpleNamespace(backends=("triton",), device=torch.device("cpu"), itemsize=2),
                                T, k, d, lambda st: None) == []


def test_single_device_memory_check_runs_and_accounts(tmp_path):
    """``python -m bench.memory_strategies --single`` (make gpu-memory) on its CPU stand-in: every (degree,
    strategy) measured, the bytes saved for backward (counted by hooks) and copied to the host
    equal to the memory model's, and every reuse strategy below keep."""
    import subprocess

    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "bench.memory_strategies", "--single", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert "keep, one step:" in proc.stdout and "aten ops" in proc.stdout
    strategies = ("keep", "offload", "recomm", "recompute", "recomm_recompute")
    want = {("gpt-xl", n, s, 1) for n in (2, 4) for s in strategies}
    want |= {("gpt-xl", 4, s, 2) for s in strategies[1:]}  # two MI buffers from n = 3 on
    want |= {("overlap", 4, "keep", 1), ("overlap", 4, "offload", 1), ("overlap", 4, "offload", 2)}
    assert {(r["shape"], r["n"], r["strategy"], r["mi_buffers"]) for r in rows} == want
    for r in rows:
        assert r["saved_bytes"] == r["model_bytes"] > 0, r
        assert r["held_bytes"] is None and r["peak_bytes"] is None  # no device allocator on CPU
        assert r["sim"] is None  # the H100 prediction is attached on CUDA only
        d = r["diagnosis"]  # one profiled step of "keep" per degree: where a deeper pipeline's time goes
        if r["strategy"] == "keep":
            assert d["host_syncs"] is None and d["device_s"] is None  # CPU: nothing to wait for, no kernels
            assert d["launches"] == 0 and d["aten_ops"] > 0 and d["profiled_host_s"] > 0, d
        else:
            assert d is None
        keep = next(k for k in rows if (k["shape"], k["n"], k["strategy"]) == (r["shape"], r["n"], "keep"))
        if r["strategy"] != "keep":
            assert r["saved_bytes"] < keep["saved_bytes"]
            # the same kernels on the same rows as "keep": restores put back exactly what was saved
            # (the recomputing strategies' FC1 runs the same GEMM on the same DI)
            assert r["max_abs_diff_vs_keep"] == 0.0, r
        else:
            assert r["max_abs_diff_vs_keep"] is None
        if r["mi_buffers"] == 2:  # one more MI buffer kept than with one
            one = next(k for k in rows if (k["shape"], k["n"], k["strategy"], k["mi_buffers"])
                       == (r["shape"], r["n"], r["strategy"], 1))
            assert r["saved_bytes"] > one["saved_bytes"] and r["host_bytes"] == one["host_bytes"], (r, one)
        assert r["host_bytes"] == r["model_host_bytes"], r  # what went to the host: the layout's offloads


def test_single_device_check_predictions():
    """The simulator's predictions the single-device check prints on CUDA (dgx-h100 preset): at
    the GPT-XL-like shape the offload copies outlast the compute (so the issue's "80% hidden"
    condition, a copy shorter than the compute, does not hold there), at the overlap shape they
    do not; a second MI buffer puts more of the copies beside compute at both."""
    from bench import memory_strategies as bm

    xl = bm.predict_single(bm.SINGLE_GPU, 4, "offload", 1)
    wide = [bm.predict_single(bm.SINGLE_GPU_OVERLAP, 8, "offload", mi) for mi in (1, 2)]
    assert xl["copy_s"] > xl["compute_s"] > 0
    assert all(0 < w["copy_s"] < w["compute_s"] for w in wide)
    assert wide[1]["hidden_frac"] > wide[0]["hidden_frac"] and wide[1]["step_s"] < wide[0]["step_s"]
    assert bm.predict_single(bm.SINGLE_GPU, 4, "keep", 1)["hidden_frac"] is None  # no copies


def test_step_diagnosis_counts_what_it_reports():
    """bench.memory_strategies.diagnose_step on CPU: a step of 3 matmuls, an add and a sum is 5 top-level
    aten operator calls (the ops they call inside not counted), no kernel launches and no
    host-sync count (CPU has none); a warning about a synchronizing operation is attributed to
    the project line that issued it."""
    import warnings

    from bench.memory_strategies import diagnose_step

    a = torch.randn(8, 8)

    def step():
        (a @ a @ a @ a + 1).sum()

    d = diagnose_step(step, cuda=False)
    assert d["aten_ops"] == 5 and d["launches"] == 0 and d["host_syncs"] is None and d["sync_sites"] == []
    assert d["profiled_host_s"] > 0 and d["device_s"] is None and d["copy_s"] is None

    def syncing():
        warnings.warn("called a synchronizing CUDA operation")  # as the sync debug mode warns

    d = diagnose_step(syncing, cuda=False)
    assert [s for s, _ in d["sync_sites"]] and d["sync_sites"][0][0].startswith("test_bench.py:"), d  # not the warnings module


def test_step_diagnosis_labels_by_module_not_by_folder_name(tmp_path):
    """A checkout cloned into a folder named ``tritonmoe`` (``git clone``'s default) or ``bench``:
    a file under it that is no project module is not a project site (issue 35 item 7)."""
    import importlib.util
    import warnings

    from bench.memory_strategies import diagnose_step

    for folder in ("tritonmoe", "bench", "comm"):
        src = tmp_path / folder / "tests" / f"probe_{folder}.py"
        src.parent.mkdir(parents=True)
        src.write_text("import warnings\n\ndef syncing():\n    warnings.warn('called a synchronizing CUDA operation')\n")
        spec = importlib.util.spec_from_file_location(f"probe_{folder}", src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        with warnings.catch_warnings():
            d = diagnose_step(mod.syncing, cuda=False)
        assert d["sync_sites"][0][0] == f"probe_{folder}.py:4", d
    # and a project module is labelled by its place in the package
    from bench.memory_strategies import _project_label

    assert _project_label("tritonmoe.kernels.permute") == "kernels/permute.py"
    assert _project_label("tritonmoe.experts.local") == "tritonmoe/experts/local.py"
    assert _project_label("bench.memory_strategies") is None and _project_label("torch.nn") is None
