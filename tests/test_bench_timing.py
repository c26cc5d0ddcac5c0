"""The device timer, interleaved rounds and the stability sentinel (bench.timing, bench.rounds,
bench.stability), checked with a fake device and a fake clock.

The fake GPU runs each fake op in ``cycles / SM clock`` seconds of device time; its SM clock
follows a schedule over device time (a power-capped card slowing down under load), and the fake
NVML reads it. So a comparison timed in interleaved rounds must give the exact cost ratio of two
ops whatever the clock did, where timing them one after the other does not.
"""

from __future__ import annotations

import random

import pytest
import torch

from bench import rounds as RD
from bench import schema, stability, timing
from bench.harness import Work, new_row
from bench.presets import PRESETS
from bench.suites import Context, Entry, measure_in_rounds


class FakeGPU:
    """Device time advances by the ops run on it; the SM clock is ``clock_of(device time)``."""

    def __init__(self, clock_of=lambda t: 1980.0, flush_s: float = 20e-6) -> None:
        self.t = 0.0  # device seconds
        self.clock_of = clock_of
        self.flush_s = flush_s
        self.log: list[str] = []
        self.throttle = 0

    @property
    def mhz(self) -> float:
        return self.clock_of(self.t)

    def run(self, cycles: float) -> None:
        self.t += cycles / (self.mhz * 1e6)


class FakeOp:
    """A callable costing ``cycles`` on the fake GPU; ``syncs``: it reads a value back to the host
    (so a graph capture of it fails)."""

    def __init__(self, gpu: FakeGPU, name: str, cycles: float, syncs: bool = False) -> None:
        self.gpu, self.name, self.cycles, self.syncs = gpu, name, cycles, syncs
        self.calls = 0

    def __call__(self):
        self.calls += 1
        self.gpu.log.append(self.name)
        self.gpu.run(self.cycles)


class FakeBackend:
    is_cuda = True

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.captures = 0

    def now(self) -> float:
        return self.gpu.t

    def elapsed(self, thunk) -> float:
        t0 = self.gpu.t
        thunk()
        return self.gpu.t - t0

    def capture(self, thunk, n):
        """A fake graph of n calls; refused, as CUDA does, when the op syncs with the host (the
        op itself, or the one the cold-L2 wrapper closes over)."""
        ops = [thunk] + [c.cell_contents for c in (getattr(thunk, "__closure__", None) or ())]
        if any(isinstance(op, FakeOp) and op.syncs for op in ops):
            raise timing.CaptureError("RuntimeError: operation not permitted when stream is capturing")
        self.captures += 1
        return lambda: [thunk() for _ in range(n)]

    def flush(self) -> None:
        self.gpu.log.append("flush")
        self.gpu.t += self.gpu.flush_s

    def sync(self) -> None:
        pass


class FakeNvml:
    NVML_CLOCK_SM = 1

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.reads = 0

    def nvmlDeviceGetClockInfo(self, handle, which):
        assert which == self.NVML_CLOCK_SM
        self.reads += 1
        return int(round(self.gpu.mhz))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self.gpu.throttle


def _timer(gpu: FakeGPU, **kw) -> timing.DeviceTimer:
    kw.setdefault("warmup_s", 1e-3)
    return timing.DeviceTimer(FakeBackend(gpu), timing.NvmlClock(FakeNvml(gpu), "h"), **kw)


def test_rotation_orders_each_round_differently():
    assert RD.rotation(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert RD.rotation(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert RD.rotation(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert RD.rotation([], 3) == []
    gpu = FakeGPU()
    timer = _timer(gpu, min_rounds=6, max_rounds=6, min_device_s=0.0, eager=False)
    ops = [FakeOp(gpu, n, 2e6) for n in "abc"]
    preps = [timer.prepare(op.name, op) for op in ops]
    gpu.log.clear()
    assert RD.run_rounds(timer, preps) == 6
    # each rep replays N calls of one op: collapse the log into the order of reps
    order = [name for i, name in enumerate(gpu.log) if i == 0 or gpu.log[i - 1] != name]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"] * 2
    assert all(len(p.reps) == 6 for p in preps)


def test_per_round_ratio_is_exact_under_a_drifting_clock_and_timed_apart_is_not():
    """The clock falls from 1980 to 1300 MHz as the card heats: interleaved, the per-round ratio
    of an op costing twice another is 2 up to the clock's change within one round (~2%), and so
    is the roof fraction; timed one after the other, the ratio is off by the clock's change over
    a whole burst. Each row's own times follow the clock, so they are flagged noisy."""
    gpu = FakeGPU(clock_of=lambda t: max(800.0, 1980.0 - 2000.0 * t))
    timer = _timer(gpu, min_rounds=30, min_device_s=0.0, max_rounds=30)
    slow, fast = FakeOp(gpu, "slow", 4e6), FakeOp(gpu, "fast", 2e6)
    roof = FakeOp(gpu, "roof", 1e6)
    ps, pf, pr = (timer.prepare(op.name, op) for op in (slow, fast, roof))
    RD.run_rounds(timer, [ps, pf, pr])
    ratios = RD.per_round_ratios(ps, pf)
    assert len(ratios) == 30 and all(r == pytest.approx(2.0, rel=0.025) for r in ratios)
    assert RD.qstats(ratios)["median"] == pytest.approx(2.0, rel=0.01)
    # a "roof" doing 1e6 units of work per 1e6 cycles; the slow op does 2e6 units: fraction 0.5
    fracs, bound = RD.roof_fractions(ps, Work(flops=2e6), {RD.ROOF_MATMUL: (pr, 1e6)})
    assert bound == "compute" and all(f == pytest.approx(0.5, rel=0.03) for f in fracs)
    clocks = RD.clock_record(ps)
    assert clocks["max"] > clocks["min"] * 1.2 and len(clocks["sm_mhz"]) == 30
    assert RD.timing_record(ps, 30)["noisy"]  # each row's own times follow the clock: noisy
    # timed apart: all of slow's reps, then all of fast's, on a falling clock
    RD.run_rounds(timer, [ps])
    RD.run_rounds(timer, [pf])
    apart = RD.qstats([a.device_s for a in ps.reps])["median"] / RD.qstats([b.device_s for b in pf.reps])["median"]
    assert abs(apart / 2.0 - 1.0) > 0.05


def test_noisy_flag_from_the_p80_p20_spread():
    gpu = FakeGPU()
    timer = _timer(gpu, min_rounds=20, max_rounds=20, min_device_s=0.0)
    steady = FakeOp(gpu, "steady", 2e6)
    p = timer.prepare("steady", steady)
    RD.run_rounds(timer, [p])
    rec = RD.timing_record(p, 20)
    assert rec["mode"] == "graph" and rec["noisy"] is False and rec["spread"] == pytest.approx(1.0)
    rng = random.Random(0)

    class Jittery(FakeOp):
        def __call__(self):
            self.gpu.run(self.cycles * rng.choice([1.0, 1.35]))

    q = timer.prepare("jittery", Jittery(gpu, "j", 2e6))
    RD.run_rounds(timer, [q])
    rec = RD.timing_record(q, 20)
    assert rec["spread"] > RD.NOISY_SPREAD and rec["noisy"] is True


def test_calls_per_replay_reach_a_millisecond_and_the_counts_are_met():
    gpu = FakeGPU(clock_of=lambda t: 1000.0)  # 1 cycle = 1 ns
    timer = _timer(gpu, min_rounds=30, min_device_s=0.5, max_rounds=10_000)
    us = timer.prepare("us", FakeOp(gpu, "us", 10e3))  # 10 us per call
    assert us.mode == "graph" and us.calls == 100
    ms = timer.prepare("ms", FakeOp(gpu, "ms", 5e6))  # 5 ms per call
    assert ms.calls == 1
    n = RD.run_rounds(timer, [us, ms])
    # 0.5 s of device time for each: the 1 ms replays of "us" need 500 rounds
    assert n in (500, 501) and sum(r.device_s * us.calls for r in us.reps) >= 0.5 - 1e-9
    assert all(r.device_s == pytest.approx(10e-6) for r in us.reps)
    # the warm-up ran for at least warmup_s after the first call
    assert us.warmup_s >= timer.warmup_s


def test_cold_l2_subtracts_the_flush():
    gpu = FakeGPU(clock_of=lambda t: 1000.0, flush_s=30e-6)
    timer = _timer(gpu, cold_l2=True, min_rounds=5, max_rounds=5, min_device_s=0.0)
    p = timer.prepare("router", FakeOp(gpu, "router", 6e3))  # 6 us
    assert p.mode == "graph-flush" and p.calls == -(-1000 // 36)
    RD.run_rounds(timer, [p])
    assert all(r.device_s == pytest.approx(6e-6) for r in p.reps)
    # eager time: one call with the flush before it, outside the events
    assert all(r.eager_s == pytest.approx(6e-6) for r in p.reps)


def test_graph_capture_failure_falls_back_to_eager_and_says_so():
    gpu = FakeGPU(clock_of=lambda t: 1000.0)
    timer = _timer(gpu, min_rounds=4, max_rounds=4, min_device_s=0.0)
    p = timer.prepare("permute", FakeOp(gpu, "permute", 50e3, syncs=True))
    assert p.mode == "eager" and "graph capture failed" in p.note and p.replay is None
    RD.run_rounds(timer, [p])
    rec = RD.timing_record(p, 4)
    assert rec["mode"] == "eager" and rec["note"].startswith("graph capture failed")
    assert rec["device_s"]["median"] == pytest.approx(50e-6)
    cold = _timer(gpu, cold_l2=True, min_rounds=2, max_rounds=2, min_device_s=0.0)
    q = cold.prepare("permute", FakeOp(gpu, "permute", 50e3, syncs=True))
    assert q.mode == "eager" and q.cold_l2
    RD.run_rounds(cold, [q])
    assert all(r.device_s == pytest.approx(50e-6) for r in q.reps)  # the flushes are outside the events
    # no CUDA at all: wall-clock rounds, labelled "cpu"
    cpu = timing.DeviceTimer(timing.CpuBackend(), warmup_s=0.0, min_rounds=2, max_rounds=2, min_device_s=0.0)
    c = cpu.prepare("x", lambda: None)
    assert c.mode == "cpu" and c.calls == 1


def test_per_clock_efficiency_and_throttle_reasons():
    assert timing.flop_per_clock_sm("9.0", "bfloat16") == 4096.0
    assert timing.flop_per_clock_sm("8.0", "bfloat16") is None
    # 989.4 TFLOP/s at 1830 MHz on 132 SMs is the datasheet's peak: efficiency 1
    assert timing.per_clock_efficiency(989.4e12, 1.0, 132, 4096.0, 1830.0) == pytest.approx(1.0, rel=1e-3)
    gpu = FakeGPU(clock_of=lambda t: 1500.0)
    gpu.throttle = 0x4 | 0x20  # sw power cap, sw thermal
    timer = _timer(gpu, min_rounds=3, max_rounds=3, min_device_s=0.0)
    p = timer.prepare("gemm", FakeOp(gpu, "gemm", 3e6))  # 2 ms at 1500 MHz
    RD.run_rounds(timer, [p])
    eff = RD.clock_efficiencies(p, 0.5 * 132 * 4096 * 3e6, 132, 4096.0)  # half the peak per clock
    assert eff and all(e == pytest.approx(0.5, rel=1e-3) for e in eff)
    clocks = RD.clock_record(p)
    assert clocks["median"] == 1500.0 and clocks["throttle"] == {"sw_power_cap": 3, "sw_thermal": 3}
    assert RD.clock_record(timing.Prepared("x", lambda: None, "cpu", 1, False)) is None


def test_sentinel_drift_marks_a_run_unstable():
    assert stability.drift([1.0]) is None
    assert stability.drift([1.0, 1.02, 0.97]) == pytest.approx(0.03)
    vals = iter([1e-3, 1.02e-3, 1.06e-3])
    s = stability.Sentinel("ffn", lambda: {"median_s": next(vals), "p20_s": 0.0, "p80_s": 0.0, "mhz": None,
                                           "rounds": 30})
    for at in ("start", "middle", "end"):
        s.mark(at)
    rec = s.record()
    assert rec["drift"] == pytest.approx(0.06) and rec["unstable"] is True
    assert "UNSTABLE" in s.line()
    vals2 = iter([1e-3, 1.01e-3])

    def measure():
        v = next(vals2, None)
        if v is None:
            raise RuntimeError("out of memory")
        return {"median_s": v, "p20_s": 0.0, "p80_s": 0.0, "mhz": 1755.0, "rounds": 30}

    s2 = stability.Sentinel("ffn", measure)
    for at in ("start", "middle", "end"):
        s2.mark(at)
    rec2 = s2.record()
    assert rec2["unstable"] is False and rec2["drift"] == pytest.approx(0.01)
    assert "error" in rec2["points"][2] and "stable" in s2.line()
    assert stability.Sentinel("none", None).record() is None


def test_a_comparison_in_rounds_fills_rows_that_match_the_schema():
    """measure_in_rounds: every entry of one mode and the roof pseudo-implementations in the same
    rounds; a row's speedup over a baseline and its roof fraction are medians of per-round ratios,
    within 1% under a clock that drifts 12% over the comparison (each row's own times are noisy);
    an entry that cannot run records why."""
    gpu = FakeGPU(clock_of=lambda t: max(1300.0, 1980.0 - 2000.0 * t))
    timer = _timer(gpu, min_rounds=30, max_rounds=30, min_device_s=0.0)
    ctx = Context(device=torch.device("cpu"), dtype=torch.bfloat16, presets=[PRESETS["small"]])
    ctx.rounds, ctx.sms, ctx.flop_per_clock = timer, 132, 4096.0
    mm = FakeOp(gpu, "roof", 1e6)
    ctx.roof_preps = {RD.ROOF_MATMUL: (timer.prepare(RD.ROOF_MATMUL, mm), 1e9)}
    work = Work(flops=1e9)

    def entry(impl, cycles):
        def make(st):
            if cycles is None:
                from bench.harness import Unavailable

                raise Unavailable("no liger here")
            return FakeOp(gpu, impl, cycles), work
        return Entry("fwd", impl, make)

    entries = [entry("triton", 1e6), entry("grouped_mm", 1.5e6), entry("liger", None)]
    rows = [new_row(suite="ffn", case="c", mode="fwd", impl=e.impl, params={"dtype": "bfloat16"}) for e in entries]
    measure_in_rounds(ctx, list(zip(entries, rows)), state={})
    tri, gmm, lig = rows
    assert lig["status"] == "unavailable" and "no liger" in lig["note"]
    assert tri["timing"]["noisy"] and gmm["timing"]["noisy"]
    assert tri["speedup"]["grouped_mm"] == pytest.approx(1.5, rel=0.01)
    assert tri["peers"]["grouped_mm"]["p20"] == pytest.approx(1.5, rel=0.01)
    assert tri["best_peer"]["impl"] == "grouped_mm" and tri["best_peer"]["median"] == tri["speedup"]["grouped_mm"]
    assert "best_peer" not in gmm
    assert gmm["peers"]["triton"]["median"] == pytest.approx(1 / 1.5, rel=0.01)
    assert tri["roof_frac"] == pytest.approx(1.0, rel=0.01) and tri["roof_bound"] == "compute"
    # the targets read the per-round fraction of the roof they name
    from bench import targets as TG

    assert TG.metric_value(tri, "mm_roof", {}) == tri["roof_fracs"]["matmul"]["median"]
    assert TG.metric_value(tri, "x_gmm", {}) == tri["speedup"]["grouped_mm"]
    # kernel-terms targets read device time, a user's-call target reads eager time
    assert TG.metric_value(tri, "time_us", {}) == tri["time_s"]["median"] * 1e6
    assert TG.metric_value(tri, "eager_us", {}) == tri["timing"]["eager_s"]["median"] * 1e6
    assert tri["timing"]["rounds"] == 30 and tri["timing"]["mode"] == "graph"
    assert len(tri["clocks"]["sm_mhz"]) == 30 and tri["per_clock_eff"]["median"] > 0
    assert tri["time_s"]["reps"] == 30 and tri["time_s"]["p20"] <= tri["time_s"]["median"] <= tri["time_s"]["p80"]
    row_schema = {"$defs": schema.SCHEMA["$defs"], "$ref": "#/$defs/result"}
    for r in rows:
        schema.validate(r, row_schema)



def test_the_harness_cli_measures_any_suite_in_rounds(tmp_path):
    """python -m bench --rounds N: the same rounds as the check, rows with their timing record."""
    import json

    from bench import __main__ as cli

    path = tmp_path / "r.json"
    assert cli.main(["route", "--rounds", "3", "--tokens", "16", "--preset", "small", "--device", "cpu",
                     "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    schema.validate(doc)
    assert doc["config"]["rounds"] == 3
    assert {r["timing"]["mode"] for r in doc["results"]} == {"cpu"}
    assert all(r["timing"]["rounds"] == 3 and r["time_s"]["reps"] == 3 for r in doc["results"])


def test_two_runs_agree_on_their_median_ratios(tmp_path, capsys):
    """python -m bench agree: ratios (not times) of two runs within 5%, and both sentinels stable."""
    import copy

    from bench import __main__ as cli
    from bench import agreement

    def row(impl, x_gmm, frac):
        r = new_row(suite="ffn", case="c", mode="fwd", impl=impl, params={})
        q = lambda v: {"median": v, "p20": v, "p80": v, "min": v, "max": v}  # noqa: E731
        r.update(peers={"grouped_mm": q(x_gmm)}, roof_fracs={"matmul": q(frac)})
        return r

    a = {"results": [row("triton", 1.5, 0.6)], "check": {"stability": {"drift": 0.01}}}
    b = copy.deepcopy(a)
    b["results"][0]["peers"]["grouped_mm"]["median"] = 1.53  # +2%: agrees
    b["results"][0]["time_s"] = None
    lines, s = agreement.compare(a, b)
    assert s == {"compared": 2, "moved": 0, "drift": {"A": 0.01, "B": 0.01}, "agree": True} and lines[-1] == "AGREE"
    b["results"][0]["roof_fracs"]["matmul"]["median"] = 0.66  # +10%
    lines, s = agreement.compare(a, b)
    assert s["moved"] == 1 and not s["agree"] and any("of matmul roof" in line and "+10.0%" in line for line in lines)
    b = copy.deepcopy(a)
    b["check"]["stability"]["drift"] = 0.07
    assert agreement.compare(a, b)[1]["agree"] is False
    fake = {"results": [], "check": {}}
    assert agreement.compare(fake, fake)[1]["agree"] is False  # nothing compared: no verdict
    # the command reads two check result files; an unreadable one is exit status 2
    assert cli.main(["agree", str(tmp_path / "missing.json"), str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
