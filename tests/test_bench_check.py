"""``python -m bench check`` (make gpu-check) and ``python -m bench profile`` (make gpu-profile).

The GPU path is exercised with a fake device report: a runner that plays an H100 (environment,
tests, roofs) and answers each planned entry with the time a given efficiency against the roofs
would take for the entry's real work (bench.work), so the plan of GPU shapes, the speedups, the
roofline fractions, the target table, the time budget and the result files all run through the
real code. The CPU path runs for real at its stand-in shapes (two sections, to keep it short).
"""

from __future__ import annotations

import json

import pytest
import torch

from bench import check, harness, report, schema, suites
from bench import targets as TG
from bench import work as W
from bench.harness import Work
from bench.presets import PRESETS

H100_ROOFS = {
    "matmul_bfloat16": {"kind": "matmul", "what": "fake", "n": 8192, "dtype": "bfloat16",
                        "time_s": harness.summarize([1.4e-3] * 3), "tflops": 790.0, "gbps": None},
    "copy": {"kind": "copy", "what": "fake", "nbytes": 2**30, "dtype": "uint8",
             "time_s": harness.summarize([7.2e-4] * 3), "tflops": None, "gbps": 3000.0},
}


def _work(case, mode: str, impl: str) -> Work:
    """The real work of a planned entry, from its params (bench.work), as a run would count it."""
    p = case.params
    bwd = mode == "fwd+bwd"
    s = 2  # bf16
    if case.suite == "route":
        return W.route(p["T"], p["E"], p["k"], s, backward=bwd)
    pr = PRESETS[p["preset"]]
    T, k, E, d, f, n1 = p["T"], pr.top_k, pr.num_experts, pr.d_model, pr.d_ffn, pr.n1
    R = T * k
    Ea = min(E, R)
    if case.suite == "permute":
        if mode == suites.MOVE:
            return W.permute_rows(T, k, d, R, s)
        if mode == suites.METADATA:
            return W.permute_metadata(T, k, E)
        if p["op"] == "permute":
            return W.permute(T, k, d, R, E, s, backward=bwd)
        return W.unpermute(T, k, d, R, s, backward=bwd)
    if case.suite == "ffn":
        if p["op"] == "grouped_ffn":
            return W.grouped_ffn(R, d, f, n1, Ea, s, backward=bwd)
        return W.moe_ffn(T, k, R, d, f, n1, Ea, s, backward=bwd)
    return W.layer(T, E, k, R, d, f, n1, Ea, s, backward=bwd)


class FakeH100(check.Runner):
    """A device report: every entry runs at ``efficiency[impl]`` of the roofline (with a floor
    of 3 us per call), except the overrides ``{(suite, op or None, mode, impl): fraction}``;
    ``fail`` names entries that raise."""

    def __init__(self, efficiency: dict, overrides: dict | None = None, fail: tuple = (), tests: str = "passed",
                 case_seconds: dict | None = None):
        super().__init__(torch.device("cuda", 0))
        self.efficiency, self.overrides, self.fail, self.tests = efficiency, overrides or {}, fail, tests
        self.case_seconds = case_seconds or {}  # suite -> simulated wall seconds per case
        self.now = 0.0
        self.planned: list[tuple] = []
        self.test_timeout = None
        self.sentinel_medians = [1.0e-3, 1.01e-3, 1.02e-3]  # start, middle, end: 2% drift

    def clock(self):
        return self.now

    def environment(self, argv):
        env = harness.environment(["check", *argv], torch.device("cpu"))
        env.update(mode="gpu", device="cuda:0", gpu_name="NVIDIA H100 80GB HBM3", gpu_count=1,
                   gpu_capability="9.0", driver="580.159.04", cuda="13.0", git_commit="f" * 40, git_dirty=False)
        return env

    def run_tests(self, timeout_s, log, out_prefix=None):
        self.test_timeout, self.test_prefix = timeout_s, out_prefix
        failing = [] if self.tests == "passed" else [
            dict(id="tests/test_x.py::test_bad[1]", status="failed", shard="2", message="AssertionError: boom"),
            dict(id="tests/test_x.py::test_crash", status="crashed", shard="0",
                 message="its shard's process died (exit status -11) while it ran"),
        ]
        counts = {"passed": 12, "failed": 1, "crashed": 1} if failing else {"passed": 12}
        return check.tests_record(dict(status=self.tests, summary=", ".join(f"{n} {k}" for k, n in counts.items()),
                                       wall_s=95.0, counts=counts, shards=[{}] * 8, failing=failing,
                                       files=[f"{out_prefix}.json", f"{out_prefix}.md"]))

    def telemetry(self, log):
        return check.Telemetry.disabled("fake device")

    def timer(self, reps, warmup, telemetry):
        return None

    def roofs(self, ctx):
        return H100_ROOFS

    def device_timer(self, ctx, telemetry, **kw):
        return None  # the fake answers whole cases (run_case below)

    def round_roofs(self, ctx, timer):
        return {}

    def device_info(self, ctx):
        return 132, 4096.0

    def sentinel(self, ctx, telemetry):
        medians = iter(self.sentinel_medians)
        return lambda: {"median_s": next(medians), "p20_s": 0.0, "p80_s": 0.0, "mhz": 1755.0, "rounds": 30}

    def run_case(self, ctx, case):
        self.now += self.case_seconds.get(case.suite, 0.0)
        rows = []
        for e in case.entries:
            key = (case.suite, case.params.get("op"), e.mode, e.impl)
            self.planned.append((case.suite, case.label, e.mode, e.impl))
            row = harness.new_row(suite=case.suite, case=case.label, mode=e.mode, impl=e.impl, params=case.params)
            if key in self.fail:
                row["status"], row["note"] = "error", "RuntimeError: fake failure"
                rows.append(row)
                continue
            work = _work(case, e.mode, e.impl)
            eff = self.overrides.get(key, self.efficiency[e.impl])
            t_floor = max((work.flops or 0) / (790e12), (work.bytes or 0) / 3000e9)
            t = max(3e-6, t_floor / eff)
            harness.fill_timing(row, [t] * 5, work, ctx.roofs)
            # an eager call: the device time plus a fixed 4 us of host (launcher) time; the
            # per-clock efficiency the fraction of the tensor-core peak the device time reaches
            row["timing"] = dict(mode="graph", note=None, calls_per_replay=1, cold_l2=False, rounds=5,
                                 device_s=row["time_s"], eager_s=harness.summarize([t + 4e-6] * 5), spread=0.0,
                                 noisy=False)
            if work.flops:
                e = (work.flops / t) / 790e12
                row["per_clock_eff"] = dict(median=e, p20=e, p80=e, min=e, max=e)
            rows.append(row)
        for mode in {r["mode"] for r in rows}:
            harness.attach_speedups([r for r in rows if r["mode"] == mode])
        return rows


EFFICIENCY = {"triton": 0.9, "triton-fused": 0.9, "triton-split": 0.9, "torch": 0.1, "grouped_mm": 0.6, "loop": 0.3,
              "liger": 0.5, "softmax_topk": 0.2}


def _by_name(results):
    return {r["name"]: r for r in results}


def test_gpu_path_with_a_fake_device_report(tmp_path, capsys):
    """The GPU core set planned at its real shapes, measured by the fake H100, judged against the
    target table: every target finds its row; a decode kernel at 0.5 of the copy roof is "not
    met"; the result files carry the commit and validate against the schema; the table is last."""
    runner = FakeH100(EFFICIENCY, overrides={("ffn", "moe_ffn", "fwd", "triton-fused"): 0.5})
    rc = check.run_check(["--results-dir", str(tmp_path)], runner=runner)
    assert rc == 0  # unmet targets are reported, not fatal (see --strict)
    out = capsys.readouterr().out
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"nvidia-h100-80gb-hbm3-{files[0][-15:-5]}.json", f"nvidia-h100-80gb-hbm3-{files[0][-15:-5]}.md"]
    doc = json.loads((tmp_path / files[0]).read_text())
    schema.validate(doc)
    chk = doc["check"]
    assert chk["commit"] == "f" * 40 and chk["tests"]["status"] == "passed"
    assert [s["name"] for s in chk["sections"]] == list(check.SECTION_NAMES)
    assert all(s["status"] == "ran" for s in chk["sections"])
    res = _by_name(chk["targets"])
    assert len(res) == len(TG.TARGETS)
    # the moe_ffn forward runs at 0.5 of its roof: its copy-roof targets read 0.5, and against the
    # peers it is not met wherever the peer's floor (3 us) does not decide the time
    roof = [r for name, r in res.items() if name.startswith("decode") and "copy roof" in name]
    assert len(roof) == 2 and all(r["status"] == "not met" and r["value"] == pytest.approx(0.5, rel=1e-6)
                                  for r in roof)
    big_fwd = [r for name, r in res.items() if name.startswith("moe_ffn fwd ")]
    assert len(big_fwd) == 4 and all(r["status"] == "not met" for r in big_fwd)
    assert res["moe_ffn fwd qwen3 T=32768, x Liger fused MoE"]["value"] == pytest.approx(0.5 / 0.5)
    others = [r for name, r in res.items() if "moe_ffn" not in name or "fwd+bwd" in name]
    assert all(r["status"] == "met" for r in others), [(r["name"], r["status"], r["note"]) for r in others]
    router = res["router fwd softmax E=128 k=8 T=4096, time (us)"]
    assert router["value"] == pytest.approx(3.0) and "E=128 k=8 softmax T=4096" in router["row"]
    eager = res["router fwd softmax E=128 k=8 T=4096, eager call / torch.softmax+topk's"]
    assert eager["value"] == pytest.approx(7.0 / 7.0)  # both at the 3 us floor, plus 4 us of host time
    gmm = res["grouped FFN fwd qwen3 T=32768, x torch._grouped_mm"]
    assert gmm["value"] == pytest.approx(0.9 / 0.6)
    ffn = res["grouped FFN fwd mixtral T=16384, of matmul roof"]
    assert ffn["value"] == pytest.approx(0.9, rel=1e-3)  # compute-bound: 0.9 of the matmul roof
    assert ffn["per_clock"] == pytest.approx(0.9, rel=1e-3)
    # the plan: GPU shapes and only the implementations each section keeps
    planned = set(runner.planned)
    assert ("route", "E=256 k=8 sigmoid+bias groups=8/4 T=16384 uniform", "fwd+bwd", "torch") in planned
    assert ("permute", "permute mixtral-8x7b-like T=16384 uniform", "move", "triton") in planned
    assert not any(p[0] == "ffn" and p[3] in ("torch", "loop") and "T=64" not in p[1] and "T=8 " not in p[1]
                   and "T=1 " not in p[1] for p in planned)  # no fp32 reference GEMMs at 16k-32k tokens
    assert {p[2] for p in planned if "T=64 " in p[1]} == {"fwd"}  # decode: forward only
    # the final table is the last thing printed, with the commit and the test outcome
    tail = out[out.index("== targets"):]
    assert "NVIDIA H100" in tail and "f" * 40 in tail and "tests passed" in tail
    assert "decode moe_ffn qwen3 T=64, of copy roof" in tail and "not met" in tail
    md = (tmp_path / files[1]).read_text()
    assert "## Targets" in md and "| decode moe_ffn mixtral T=64, of copy roof | 0.500 | >= 0.700 |" in md
    assert "## route" in md and "## ffn" in md


def test_gpu_path_budget_failures_and_strict(tmp_path, capsys):
    """A budget too small for the ffn section skips it (its targets read "not measured" and say
    why) while the others run; a failed entry and failed tests make the exit status 1; --strict
    fails on unmet targets."""
    runner = FakeH100(EFFICIENCY, fail=(("route", None, "fwd", "triton"),), tests="failed")
    rc = check.run_check(["--results-dir", str(tmp_path), "--budget-s", "60"], runner=runner)
    assert rc == 1
    assert runner.test_timeout == 30.0  # the tests get what the budget leaves, at least 30 s
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    schema.validate(doc)
    # the tests' summary beside the results, and each test that did not pass in the final table
    assert runner.test_prefix == str(tmp_path / f"nvidia-h100-80gb-hbm3-{doc['env']['date_utc'][:10]}-gpu-tests")
    tests = doc["check"]["tests"]
    assert tests["counts"] == {"passed": 12, "failed": 1, "crashed": 1} and tests["shards"] == 8
    tail = capsys.readouterr().out.split("== targets", 1)[1]
    assert "tests (pytest -m gpu, 8 shards): failed: 12 passed, 1 failed, 1 crashed" in tail
    assert "failed    [shard 2] tests/test_x.py::test_bad[1]: AssertionError: boom" in tail
    assert "crashed   [shard 0] tests/test_x.py::test_crash" in tail
    md = next(tmp_path.glob("*.md")).read_text()
    assert "  - crashed [shard 0] `tests/test_x.py::test_crash`" in md
    status = {s["name"]: s["status"] for s in doc["check"]["sections"]}
    assert status == {"route": "ran", "permute": "ran", "ffn": "skipped", "decode": "ran", "layer": "ran"}
    res = _by_name(doc["check"]["targets"])
    ffn = res["grouped FFN fwd mixtral T=16384, of matmul roof"]
    assert ffn["status"] == "not measured" and "time budget" in ffn["note"]
    router = res["router fwd softmax E=128 k=8 T=4096, time (us)"]
    assert router["status"] == "not measured" and "fake failure" in router["note"]
    skipped_rows = [r for r in doc["results"] if r["suite"] == "ffn" and r["params"]["T"] > 64]
    assert skipped_rows and all(r["status"] == "unavailable" for r in skipped_rows)
    capsys.readouterr()
    strict = FakeH100(EFFICIENCY, overrides={("route", None, "fwd", "triton"): 0.01})
    assert check.run_check(["--results-dir", str(tmp_path), "--skip-tests"], runner=strict) == 0
    assert check.run_check(["--results-dir", str(tmp_path), "--skip-tests", "--strict"], runner=strict) == 1
    assert "router fwd softmax E=128 k=8 T=4096, time (us)" in capsys.readouterr().out


def test_a_section_overrunning_its_estimate_leaves_time_for_the_table(tmp_path, capsys):
    """ffn cases that take 300 s each (estimate: 70 s for the whole section): the second case
    still starts (300 s of 530 used), the ones after it are skipped inside the section, the later
    sections are skipped whole, and the run ends with its files and table."""
    runner = FakeH100(EFFICIENCY, case_seconds={"ffn": 300.0})
    assert check.run_check(["--results-dir", str(tmp_path), "--skip-tests"], runner=runner) == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    status = {s["name"]: s["status"] for s in doc["check"]["sections"]}
    assert status == {"route": "ran", "permute": "ran", "ffn": "ran", "decode": "skipped", "layer": "skipped"}
    ffn_cases = {}
    for r in doc["results"]:
        if r["suite"] == "ffn" and r["params"]["T"] >= 16384:
            ffn_cases.setdefault(r["case"], set()).add(r["status"])
    assert list(ffn_cases.values()) == [{"ok"}, {"ok"}, {"unavailable"}, {"unavailable"}]
    res = _by_name(doc["check"]["targets"])
    assert res["grouped FFN fwd mixtral T=16384, of matmul roof"]["status"] == "met"
    qwen = res["grouped FFN fwd qwen3 T=32768, of matmul roof"]
    assert qwen["status"] == "not measured" and "inside section ffn" in qwen["note"]
    assert "== targets" in capsys.readouterr().out


def test_target_evaluation():
    """Metrics from rows and roofs, both comparison directions, missing and failed rows."""
    t_time = TG.Target("t", "route", "fwd", "triton", "time_us", "<=", 5.0, dict(T=1))
    t_roof = TG.Target("m", "permute", "move", "triton", "mem_roof", ">=", 0.8, dict(T=1))
    t_gmm = TG.Target("g", "ffn", "fwd", "triton", "x_gmm", ">=", 1.2, dict(T=1))

    def row(suite, mode, status="ok", **kw):
        r = harness.new_row(suite=suite, case="c", mode=mode, impl="triton", params=dict(T=1, dtype="bfloat16"))
        r["status"] = status
        if status == "ok":
            harness.fill_timing(r, [kw.pop("t")] * 3, Work(bytes=kw.pop("bytes", None)), H100_ROOFS)
        r.update(kw)
        return r

    rows = [row("route", "fwd", t=4e-6), row("permute", "move", t=1e-3, bytes=2.1e9),
            row("ffn", "fwd", t=1.0, speedup={"grouped_mm": 1.1})]
    res = TG.evaluate(rows, H100_ROOFS, targets=(t_time, t_roof, t_gmm))
    assert [r["status"] for r in res] == ["met", "not met", "not met"]
    assert res[0]["value"] == pytest.approx(4.0) and res[1]["value"] == pytest.approx(0.7)
    rows[1] = row("permute", "move", status="error", note="boom")
    res = TG.evaluate(rows[:2], H100_ROOFS, targets=(t_time, t_roof, t_gmm))
    assert res[1]["status"] == "not measured" and "boom" in res[1]["note"]
    assert res[2]["status"] == "not measured" and "no result row" in res[2]["note"]
    assert all(r["status"] == "skipped" for r in TG.evaluate(rows, {}, skipped_reason="cpu"))
    with pytest.raises(ValueError, match="metric"):
        TG.Target("bad", "route", "fwd", "triton", "speed", ">=", 1.0)
    assert "not met (" not in TG.render_text(res[:1])


def test_cpu_mode_runs_end_to_end(tmp_path, capsys):
    """No CUDA device: the sections run at their CPU stand-in shapes on the reference and the
    torch baselines, nothing lands in the results directory, the targets are "skipped" and the
    output says so; --json keeps a copy that validates."""
    if torch.cuda.is_available():
        pytest.skip("CPU mode is what runs without a CUDA device")
    results_dir = tmp_path / "results"
    path = tmp_path / "check.json"
    rc = check.run_check(["--sections", "route,permute", "--results-dir", str(results_dir), "--json", str(path),
                          "--markdown", str(tmp_path / "check.md")])
    out = capsys.readouterr().out
    assert rc == 0
    assert not results_dir.exists()
    assert "CPU MODE" in out and "GPU targets skipped" in out.splitlines()[-1]
    doc = report.load_json(path)
    assert doc["check"]["tests"]["status"] == "skipped"
    assert {r["status"] for r in doc["check"]["targets"]} == {"skipped"}
    assert {r["suite"] for r in doc["results"]} == {"route", "permute"}
    assert all(r["status"] == "ok" for r in doc["results"]), [r["note"] for r in doc["results"] if r["status"] != "ok"]
    # measured in interleaved (wall-clock) rounds, with the CPU roofs as pseudo-implementations
    assert all(r["timing"]["mode"] == "cpu" and r["timing"]["rounds"] == 3 for r in doc["results"])
    assert all(r["roof_frac_q"] is not None for r in doc["results"] if r["roof_frac"] is not None)
    stab = doc["check"]["stability"]
    assert [p["at"] for p in stab["points"]] == ["start", "middle", "end"] and stab["drift"] is not None


def test_profile_lists_kernels_per_entry(capsys):
    """make gpu-profile's runner: each entry's kernels (here, on CPU, aten ops) with time per call."""
    assert check.run_profile(["--sections", "route", "--device", "cpu", "--reps", "1", "--top", "3",
                              "--impls", "torch"]) == 0
    out = capsys.readouterr().out
    assert "route/E=128 k=8 softmax T=256 uniform/fwd [torch]" in out
    assert "us per call" in out and "aten::" in out


def test_list_and_unknown_section(capsys):
    assert check.run_check(["--list"]) == 0
    out = capsys.readouterr().out
    assert "[route]" in out and "[layer]" in out and out.count("target: ") == len(TG.TARGETS)
    with pytest.raises(SystemExit, match="unknown section"):
        check.run_check(["--sections", "gemm"])


def test_permute_move_entries_time_the_rows_alone():
    """The permute suite's ``move`` entries: the Triton scatter (interpreter on CPU) and the
    reference's gather move the rows of a precomputed permutation, bytes of the movement alone."""
    ctx = suites.Context(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"), dtype=torch.float32,
                         presets=[PRESETS["small"]], backends=("triton", "torch"))
    ctx.timer = harness.Timer(ctx.device, reps=3, warmup=0)
    case = suites.permute_case(ctx, PRESETS["small"], 16, suites.parse_routing("uniform"))
    moves = [e for e in case.entries if e.mode == suites.MOVE]
    assert [e.impl for e in moves] == ["triton", "torch"]
    import dataclasses

    rows = suites.run_case(ctx, dataclasses.replace(case, entries=moves))
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["note"] for r in rows]
    p = PRESETS["small"]
    assert all(r["bytes"] == W.permute_rows(16, p.top_k, p.d_model, 16 * p.top_k, 4).bytes for r in rows)
    state = case.build()
    from tritonmoe import reference
    from tritonmoe.kernels.permute import permute_rows

    R = 16 * p.top_k
    assert torch.equal(permute_rows(state["x"].detach(), state["info"], num_rows=R),
                       reference.permute_rows(state["x"].detach(), state["info"], R))


def test_the_sentinel_drift_is_recorded_and_an_unstable_run_says_so(tmp_path, capsys):
    runner = FakeH100(EFFICIENCY)
    runner.sentinel_medians = [1.0e-3, 1.0e-3, 1.08e-3]
    assert check.run_check(["--skip-tests", "--results-dir", str(tmp_path), "--sections", "route,layer"],
                           runner=runner) == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    schema.validate(doc)
    stab = doc["check"]["stability"]
    assert [p["at"] for p in stab["points"]] == ["start", "middle", "end"]
    assert stab["drift"] == pytest.approx(0.08) and stab["unstable"] is True and stab["limit"] == 0.05
    assert "drift 8.0% (limit 5%): UNSTABLE" in capsys.readouterr().out


def test_compile_only_calls_every_entry_once_and_writes_nothing(tmp_path, capsys):
    """--compile-only (the device script's untimed warm-up) builds each case and calls each entry
    once; nothing is timed or written."""
    calls = []

    def make(st, impl):
        return (lambda: calls.append(impl)), Work()

    case = suites.Case("route", "fake", {}, build=dict,
                       entries=[suites.Entry("fwd", i, lambda st, i=i: make(st, i)) for i in ("a", "b")])
    ctx = suites.Context(device=torch.device("cpu"), dtype=torch.float32, presets=[])
    assert check.compile_case(ctx, case, print) == 2 and calls == ["a", "b"]
    assert check.run_check(["--compile-only", "--device", "cpu", "--sections", "route",
                            "--results-dir", str(tmp_path / "r")]) == 0
    assert "compile-only: route:" in capsys.readouterr().out and not (tmp_path / "r").exists()
