"""The bench ``gemm`` suite (bench/gemm_variants.py): skipped cleanly in CPU mode; its GPU path
(cases, entries, work, the variant each entry runs) exercised on CPU in Triton's interpreter
with a tiny shape and the device check faked."""

from __future__ import annotations

import pytest
import torch

from bench import __main__ as cli
from bench import gemm_variants as GV
from bench import roofs, suites
from bench.harness import Timer
from bench.presets import PRESETS, with_overrides
from tritonmoe.kernels import _grouped_gemm_persistent as P


def test_gemm_suite_is_registered_and_skips_on_cpu(capsys, monkeypatch):
    assert "gemm" in suites.SUITES
    if torch.cuda.is_available():
        pytest.skip("CPU-mode behaviour")
    monkeypatch.setattr(roofs, "CPU_MATMUL_N", 64)
    monkeypatch.setattr(roofs, "CPU_COPY_BYTES", 2**16)
    assert cli.main(["gemm", "--reps", "3", "--warmup", "0", "--no-progress", "--no-telemetry"]) == 0
    out = capsys.readouterr().out
    assert "gemm: skipped in CPU mode" in out and "0 entries" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the GPU path on CPU (interpreter)")
def test_gemm_suite_gpu_path_in_the_interpreter(monkeypatch):
    """With the device check faked, the suite plans gemm1 / gemm2 / ffn x (tile, persistent,
    grouped_mm); the tile and persistent entries run the kernel variant they are named after,
    and every row's work is 2*R*K*N per GEMM."""
    monkeypatch.setattr(suites.Context, "is_cuda", property(lambda self: True))
    preset = with_overrides(PRESETS["small"], dict(num_experts=3, d_model=32, d_ffn=16))
    ctx = suites.Context(device=torch.device("cpu"), dtype=torch.float32, presets=[preset], presets_chosen=True,
                         tokens=(7,), roofs={"matmul_float32": {"tflops": 1e-3}})
    ctx.timer = Timer(ctx.device, reps=1, warmup=0)
    cases = suites.plan(ctx, "gemm")
    assert [c.params["op"] for c in cases] == list(GV.OPS)
    assert all([e.impl for e in c.entries] == ["tile", "persistent", "wide", "grouped_mm"] for c in cases)
    launched = []
    real = P.mm
    monkeypatch.setattr(P, "mm", lambda *a, **k: (launched.append(a[6].variant), real(*a, **k))[1])
    rows = [r for c in cases for r in suites.run_case(ctx, c)]
    by = {(r["params"]["op"], r["impl"]): r for r in rows}
    for op in GV.OPS:
        for impl in GV.VARIANT_IMPLS:
            r = by[(op, impl)]
            assert r["status"] == "ok", r["note"]
            assert r["roof_frac"] is not None and r["roof_bound"] == "compute"
        assert by[(op, "grouped_mm")]["status"] in ("ok", "unavailable")
    R = 7 * preset.top_k
    assert by[("gemm1", "tile")]["flops"] == 2 * R * 32 * 32  # n1 = 2 * d_ffn (SwiGLU)
    assert by[("gemm2", "tile")]["flops"] == 2 * R * 16 * 32
    assert by[("ffn", "tile")]["flops"] == 2 * R * 32 * 32 + 2 * R * 16 * 32
    # persistent and wide entries: gemm1 (1 launch) + gemm2 (1) + ffn (2) each, none from the tile
    # entries; "wide" is the persistent kernel for the plain GEMM2
    assert launched == ["persistent", "wide", "persistent", "persistent"] + ["persistent", "persistent", "wide",
                                                                            "persistent"]
