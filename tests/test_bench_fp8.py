"""The bench ``fp8`` suite (bench/fp8.py): skipped cleanly in CPU mode; its GPU path (cases,
entries, work, accuracy records) exercised on CPU in Triton's interpreter with a tiny shape and
the device check faked."""

from __future__ import annotations

import pytest
import torch

from bench import __main__ as cli
from bench import fp8 as BF
from bench import roofs, suites
from bench.harness import Timer
from bench.presets import PRESETS, with_overrides


def test_fp8_suite_is_registered_and_skips_on_cpu(capsys, monkeypatch):
    assert "fp8" in suites.SUITES and not suites.SUITES["fp8"].default
    if torch.cuda.is_available():
        pytest.skip("CPU-mode behaviour")
    monkeypatch.setattr(roofs, "CPU_MATMUL_N", 64)
    monkeypatch.setattr(roofs, "CPU_COPY_BYTES", 2**16)
    assert cli.main(["fp8", "--reps", "3", "--warmup", "0", "--no-progress", "--no-telemetry"]) == 0
    assert "fp8: skipped in CPU mode" in capsys.readouterr().out


def test_accuracy_figures():
    want = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    got = torch.tensor([[1.1, 0.0], [0.0, 2.0], [0.0, 5.0]])  # the zero reference row is left out of the rows
    a = BF.accuracy(got, want)
    assert a["row_max"] == pytest.approx(0.1) and a["row_p50"] == pytest.approx(0.05)
    assert a["rel_fro"] == pytest.approx(float(torch.tensor(0.01 + 25.0).sqrt() / torch.tensor(5.0).sqrt()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the GPU path on CPU (interpreter)")
def test_fp8_suite_gpu_path_in_the_interpreter(monkeypatch):
    """With the device check faked: moe_ffn and grouped_ffn cases, bf16 / fp8_block128 /
    fp8_rowwise entries run (scaled_grouped_mm: unavailable on CPU), each FP8 row carries its
    accuracy against the bf16 path (small: two e4m3 roundings) and its speed ratio."""
    monkeypatch.setattr(suites.Context, "is_cuda", property(lambda self: True))
    preset = with_overrides(PRESETS["small"], dict(num_experts=3, d_model=160, d_ffn=128, top_k=2))
    ctx = suites.Context(device=torch.device("cpu"), dtype=torch.float32, presets=[preset], presets_chosen=True,
                         tokens=(6,), roofs={"matmul_float32": {"tflops": 1e-3}})
    ctx.timer = Timer(ctx.device, reps=1, warmup=0)
    rows = suites.run_suite(ctx, "fp8")
    by = {(r["params"]["op"], r["impl"]): r for r in rows}
    assert sorted({r["params"]["op"] for r in rows}) == sorted(BF.OPS)
    for op in BF.OPS:
        assert by[(op, "bf16")]["status"] == "ok", by[(op, "bf16")]["note"]
        for impl in BF.FP8_IMPLS:
            r = by[(op, impl)]
            assert r["status"] == "ok", r["note"]
            acc = r["extra"]["accuracy"]
            assert 0 < acc["rel_fro"] < 0.1 and acc["row_p50"] <= acc["row_p90"] <= acc["row_max"]
            assert r["extra"]["speedup_vs_bf16"] > 0
            assert r["flops"] == by[(op, "bf16")]["flops"] == 2 * 12 * 160 * 256 + 2 * 12 * 128 * 160
    assert by[("grouped_ffn", "scaled_grouped_mm")]["status"] == "unavailable"
