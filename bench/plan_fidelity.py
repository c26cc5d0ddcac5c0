"""The plan suite: how well the simulator predicts the expert-parallel layer on this machine.

For each world size (2 and 4 ranks, gloo on CPU processes):

1. fit a cost model here, now (``tritonmoe.plan.profile``: every collective over 1 KiB..64 MiB,
   the layer's ops with every rank computing at once, interference), from measurements only;
2. measure the expert-parallel MoELayer's forward+backward (``bench.ep.run_ep``: degrees
   measured round-robin, the slowest rank per repetition, the median kept) at two model widths
   and two token counts for pipeline degrees 1, 2, 4, 8;
3. simulate the same configurations (``tritonmoe.sim.simulate``) with the routing counts the
   measured run had (recomputed here from the same seeds), and ask the planner
   (``tritonmoe.plan.choose``) for a degree.

Rows: one per (world size, width, tokens, degree) with the measured time, the simulated time
and the relative error; one per (world size, width, tokens) with the planner's choice and its
measured regret (measured time at the chosen degree / measured best - 1). The summary gives the
median relative error (goal <= 20%) and the fraction of choices within 10% of the measured best
(goal >= 80%), the measurement's own spread between repetitions (the noise floor a prediction
is judged against), and the machine's load average before and after (other processes share the
CPU).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from .harness import Work, fill_timing, first_line, new_row

__all__ = ["run_plan_suite", "WORLD_SIZES", "DEGREES", "WIDTHS", "TOKENS"]

WORLD_SIZES = (2, 4)
DEGREES = (1, 2, 4, 8)
#: (d_model, d_ffn): two widths; E = 8 experts, top-2, swiglu, fp32 (the CPU reference path)
WIDTHS = ((256, 128), (512, 256))
TOKENS = (256, 1024)
NUM_EXPERTS, TOP_K = 8, 2


def measured_counts(d: int, f: int, T: int, P: int):
    """``n -> int64 [P, n, E]``: the rows each rank of ``bench.ep`` sends to each expert per
    micro-batch (same router initialization and inputs as ``bench.ep._measure_rank``)."""
    import tritonmoe as tm
    from tritonmoe.experts import micro_batch_bounds

    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(d, f, NUM_EXPERTS, TOP_K), dtype=torch.float32)
    ids = []
    with torch.no_grad():
        for rank in range(P):
            g = torch.Generator(device="cpu").manual_seed(1 + rank)
            x = torch.randn(T, d, generator=g)
            ids.append(layer.route(x)[1].topk_ids.long())

    def counts(n: int) -> torch.Tensor:
        out = torch.zeros(P, n, NUM_EXPERTS, dtype=torch.int64)
        for r, ids_r in enumerate(ids):
            for i, (a, b) in enumerate(micro_batch_bounds(T, n)):
                sel = ids_r[a:b].reshape(-1)
                out[r, i] = torch.bincount(sel[sel >= 0], minlength=NUM_EXPERTS)
        return out

    return counts


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def run_plan_suite(ctx, progress=None) -> list[dict]:
    """Fit, measure, simulate, choose (see the module docstring); rows for the harness."""
    import bench.ep as ep
    import tritonmoe as tm
    from tritonmoe.sim.simulate import simulate
    from tritonmoe.sim.planner import choose
    from tritonmoe.plan.profile import ProfileSpec, profile_spawned

    reps = max(5, min(ctx.timer.reps if ctx.timer else 8, 8))
    warmup = 2
    rows: list[dict] = []
    errors: list[float] = []
    regrets: list[float] = []
    spreads: list[float] = []
    outdir = os.environ.get("TRITONMOE_PLAN_OUT") or tempfile.mkdtemp(prefix="tritonmoe-plan-")
    ctx.log(f"plan: world sizes {WORLD_SIZES}, widths {WIDTHS}, tokens {TOKENS}, degrees {DEGREES}, "
            f"E={NUM_EXPERTS} k={TOP_K} fp32, gloo; {reps} reps; cost models in {outdir}")
    micro = sorted({max(1, T // n) for T in TOKENS for n in DEGREES})
    for P in WORLD_SIZES:
        load0 = _load()
        t0 = time.perf_counter()
        path = os.path.join(outdir, f"cost_model_P{P}.json")
        try:
            model = profile_spawned(P, ProfileSpec(
                shapes=tuple((d, f, NUM_EXPERTS, TOP_K) for d, f in WIDTHS), tokens=tuple(micro),
                dtype=torch.float32, log=False, meta={"by": "python -m bench plan"}), out=path)
        except Exception as exc:  # one failed world size: an error row, the run goes on
            row = new_row(suite="plan", case=f"profile P={P}", mode="fit", impl="profile", params={"world_size": P})
            row["status"], row["note"] = "error", first_line(exc)
            rows.append(row)
            continue
        ctx.log(f"plan: P={P} cost model fitted in {time.perf_counter() - t0:.0f} s (load {load0} -> {_load()}):")
        for line in model.describe():
            ctx.log("  " + line)
        for d, f in WIDTHS:
            cfg = tm.MoEConfig(d, f, NUM_EXPERTS, TOP_K)
            for T in TOKENS:
                if progress is not None:
                    progress.step(f"plan P={P} d={d} T={T}")
                case = dict(world_size=P, d=d, f=f, E=NUM_EXPERTS, k=TOP_K, T=T, dtype="float32")
                load_before = _load()
                try:
                    res = ep.run_ep(world_sizes=(P,), degrees=DEGREES, tokens=T, d_model=d, d_ffn=f,
                                    num_experts=NUM_EXPERTS, top_k=TOP_K, dtype=torch.float32, reps=reps,
                                    warmup=warmup, timeout_s=ctx.ep_timeout_s)
                except Exception as exc:
                    row = new_row(suite="plan", case=f"P={P} d={d} T={T}", mode="fwd+bwd", impl="measured",
                                  params=case)
                    row["status"], row["note"] = "error", first_line(exc)
                    rows.append(row)
                    continue
                load_after = _load()
                counts = measured_counts(d, f, T, P)
                measured = {r["pipeline_degree"]: r for r in res}
                med = {n: statistics.median(measured[n]["layer_fwd_bwd_s"]) for n in DEGREES}
                for n in DEGREES:
                    sim = simulate(cfg, T, model, world_size=P, pipeline_degree=n, routing=counts, dtype=torch.float32)
                    t_sim = sim.step_time()
                    err = t_sim / med[n] - 1.0
                    errors.append(abs(err))
                    ts = sorted(measured[n]["layer_fwd_bwd_s"])
                    spread = (ts[int(0.8 * (len(ts) - 1))] - ts[int(0.2 * (len(ts) - 1))]) / med[n]
                    spreads.append(spread)
                    row = new_row(suite="plan", case=f"P={P} d={d} f={f} T={T} n={n}", mode="fwd+bwd",
                                  impl="simulated-vs-measured", params={**case, "pipeline_degree": n})
                    fill_timing(row, measured[n]["layer_fwd_bwd_s"], Work(), None)
                    row["extra"] = {
                        "simulated_s": t_sim,
                        "rel_err": err,
                        "measured_spread_p20_p80": spread,
                        "sim_pipeline_efficiency": sim.pipeline_efficiency(),
                        "measured_pipeline_efficiency": measured[n].get("pipeline_efficiency"),
                        "load_before": load_before,
                        "load_after": load_after,
                    }
                    rows.append(row)
                plan = choose(cfg, T, model, world_size=P, routing=counts, pipeline_degree=DEGREES, dtype=torch.float32)
                best = min(med, key=med.get)
                regret = med[plan.pipeline_degree] / med[best] - 1.0
                regrets.append(regret)
                row = new_row(suite="plan", case=f"P={P} d={d} f={f} T={T} choice", mode="choice", impl="planner",
                              params=case)
                fill_timing(row, measured[plan.pipeline_degree]["layer_fwd_bwd_s"], Work(), None)
                row["extra"] = {
                    "chosen": plan.pipeline_degree,
                    "measured_best": best,
                    "regret": regret,
                    "within_10pct": regret <= 0.10,
                    "predicted_s": {str(c.values["pipeline_degree"]): c.step_time for c in plan.candidates},
                    "measured_s": {str(n): med[n] for n in DEGREES},
                }
                rows.append(row)
                ctx.log(f"plan: P={P} d={d} f={f} T={T}: measured ms "
                        + " ".join(f"n{n}={1e3 * med[n]:.1f}" for n in DEGREES)
                        + " | simulated ms "
                        + " ".join(f"n{n}={1e3 * r['extra']['simulated_s']:.1f}" for n, r in
                                   zip(DEGREES, rows[-1 - len(DEGREES):-1]))
                        + f" | choice n={plan.pipeline_degree} (best n={best}, regret {100 * regret:+.1f}%)"
                        + f" | load {load_before} -> {load_after}")
    if errors:
        within = sum(1 for r in regrets if r <= 0.10)
        ctx.log(f"plan: median |simulated/measured - 1| = {100 * statistics.median(errors):.1f}% over {len(errors)} "
                f"configurations (goal <= 20%); mean {100 * statistics.fmean(errors):.1f}%, max {100 * max(errors):.1f}%")
        ctx.log(f"plan: planner's choice within 10% of the measured best in {within}/{len(regrets)} cases "
                f"(goal >= 80%)")
        ctx.log(f"plan: measurement noise: (p80 - p20) / median of the measured repetitions, median over configurations "
                f"{100 * statistics.median(spreads):.1f}% (max {100 * max(spreads):.1f}%); load average now {_load()}")
    return rows
