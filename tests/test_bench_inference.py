"""``python -m bench inference`` on tiny shapes: every figure is produced, and the claims the
docs/inference.md makes from it hold on the small run (Lina and EPLB balance skewed routing better than the
contiguous layout; the conditional estimate beats the marginal on the correlated stack only)."""

from __future__ import annotations

import math

from bench.inference import run_inference, zipf_exponent


def test_inference_figures_small():
    rows = run_inference(parts=("balance", "estimation", "sim"), batches=6, tokens=256, est_profile=6, est_batches=3,
                         sim_world=4, sim_batches=2, sim_tokens=256, sim_d=256, sim_f=512)
    assert not [r for r in rows if "error" in r], rows
    bal = {(r["world_size"], r["placement"]): r["max_over_mean"]["mean"] for r in rows if r["figure"] == "balance"}
    assert bal[(16, "lina-actual")] < bal[(16, "contiguous")] and bal[(16, "eplb")] < bal[(16, "contiguous")]
    assert all(v >= 1.0 for v in bal.values())
    est = {r["stack"]: r for r in rows if r["figure"] == "estimation"}
    assert est["correlated"]["l1_conditional"] < 0.5 * est["correlated"]["l1_unconditional"]
    assert est["uncorrelated"]["l1_conditional"] > 0.5 * est["uncorrelated"]["l1_unconditional"]
    sim = {r["placement"]: r for r in rows if r["figure"] == "latency-sim"}
    assert set(sim) == {"contiguous", "lina", "eplb"} and all(r["p50_s"] > 0 for r in sim.values())
    assert math.isclose(16 ** zipf_exponent(16, 5.56), 5.56)


def test_inference_serving_memory_and_replan_small():
    """The gloo part on tiny shapes: each rank's device expert bytes are its hosted experts'
    (E/P of them under the contiguous layout), and a placement change loads whole experts,
    at most the rank's hosted ones."""
    rows = run_inference(parts=("gloo",), gloo_batches=1, gloo_tokens=32, gloo_d=32, gloo_f=64)
    assert not [r for r in rows if "error" in r], rows
    mem = {r["placement"]: r for r in rows if r["figure"] == "serving-memory"}
    per, full = mem["contiguous"]["expert_bytes"], mem["contiguous"]["all_resident_bytes"]
    assert full == 16 * per
    assert mem["contiguous"]["device_expert_bytes_per_rank"] == [4 * per] * 4
    assert all(0 < b < full for r in mem.values() for b in r["device_expert_bytes_per_rank"])
    changes = [r for r in rows if r["figure"] == "replan-load" and "bytes_per_rank" in r]
    assert len(changes) == 6
    for r in changes:
        assert all(b % per == 0 and b <= 5 * per for b in r["bytes_per_rank"])
    assert any(b > 0 for r in changes for b in r["bytes_per_rank"])
