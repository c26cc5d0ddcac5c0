"""Parm benchmark: the three schedules of an MP + EP + ESP MoE layer, measured, and the schedule
``parm_schedule="auto"`` picks.

``run_parm(...)`` spawns P local ranks on gloo (CPU), and for every layout (N_MP, N_ESP) of the
grid fits the collectives once over the message sizes of every shape (:func:`tritonmoe.policy.parm_schedule.
measure_collectives`, collective), then for every layer shape runs the first forward + backward of
an ``auto`` layer (which fits the rest of its model as any auto layer does:
:meth:`tritonmoe.experts.model_parallel.ParmExperts.fit_cost_model`), then times the forward + backward of
the baseline, S1 and S2 (round-robin inside each rep; a rep's time is the maximum over ranks;
the median over reps is reported) and records the schedule ``auto`` picks and the one Parm's
Algorithm 1 (communication only, forward only) picks. One dict per (layout, shape).

Figures: ``pick_vs_fastest`` = time(auto's pick) / time(fastest of the three) (1.0 when auto
picked the fastest); ``hit`` = pick_vs_fastest <= 1.10. ``python -m bench parm`` prints them
and the hit rate; ``python -m bench.parm`` runs it standalone.

On gloo over loopback the absolute times say nothing about GPUs; the question answered here is
whether the fitted model ranks the schedules as this machine does.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import tempfile
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_parm", "default_grid"]


def default_grid(world_size: int = 4) -> tuple[list[tuple[int, int]], list[dict]]:
    """(layouts (n_mp, n_esp), shapes): 4 layouts x 6 shapes = 24 configurations at P = 4."""
    P = world_size
    layouts = [(n_mp, n_esp) for n_mp in (2, 4) for n_esp in (1, 2) if P % n_mp == 0 and P % n_esp == 0]
    shapes = [
        dict(tokens=T, d_model=d, d_ffn=2 * d, num_experts=8, top_k=k, capacity_factor=cf)
        for (T, d), k, cf in itertools.product([(64, 64), (512, 64), (256, 256)], (1, 2), (None,))
    ]
    return layouts, shapes


def _rank_body(rank: int, P: int, port: int, layouts, shapes, reps: int, warmup: int, dtype_name: str,
               timeout_s: float, outdir: str) -> None:
    from tritonmoe.comm.rendezvous import init_local

    torch.set_num_threads(1)
    result = None
    try:
        init_local(rank, P, port, timeout_s)
        result = ("ok", _measure(rank, P, layouts, shapes, reps, warmup, getattr(torch, dtype_name)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if result[0] == "ok":
        try:
            dist.barrier()
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            os._exit(1)
        os._exit(0)
    os._exit(1)


def _measure(rank: int, P: int, layouts, shapes, reps: int, warmup: int, dtype) -> list[dict]:
    import tritonmoe as tm
    from tritonmoe.parm_layout import ParmLayout
    from tritonmoe.policy.parm_schedule import (
        COLLECTIVE_WIDTH,
        algorithm1,
        choose_schedule,
        collective_rows,
        measure_collectives,
        step_times,
    )

    def configs(shape):
        return {s: tm.MoEConfig(shape["d_model"], shape["d_ffn"], shape["num_experts"], shape["top_k"],
                                capacity_factor=shape["capacity_factor"], parm_schedule=s)
                for s in ("baseline", "s1", "s2")}

    out = []
    cache: dict = {}
    for n_mp, n_esp in layouts:
        lay = ParmLayout.make(n_mp, P // n_esp, n_esp)
        groups = lay.process_groups(cache=cache)
        # one collective fit per layout (Parm fits once per group), over the message sizes of
        # every shape; the layers' fits below find it in measure_collectives' cache
        rows = sorted({r for shape in shapes
                       for r in collective_rows(configs(shape)["s1"], lay, shape["tokens"], COLLECTIVE_WIDTH)})
        t0 = time.perf_counter()
        measure_collectives(groups, dtype=dtype, rows=rows)
        collective_fit_s = time.perf_counter() - t0
        for shape in shapes:
            cfg = configs(shape)
            torch.manual_seed(0)
            layers = {s: tm.MoELayer(c, parm_groups=groups, dtype=dtype) for s, c in cfg.items()}
            for s in ("s1", "s2"):
                layers[s].load_state_dict(layers["baseline"].state_dict())
            g = lay.mp_group[groups.rank]
            gen = torch.Generator().manual_seed(1000 + g)
            x = torch.randn(shape["tokens"], shape["d_model"], generator=gen, dtype=dtype)
            # auto's model: the one an auto layer fits at its first forward (ParmExperts.choose)
            auto_layer = tm.MoELayer(dataclasses.replace(cfg["s1"], parm_schedule="auto"), parm_groups=groups,
                                     dtype=dtype)
            auto_layer.load_state_dict(layers["baseline"].state_dict())
            dist.barrier()
            t0 = time.perf_counter()
            auto_layer(x.clone().requires_grad_()).sum().backward()
            fit_s = time.perf_counter() - t0
            model = auto_layer.expert_path.cost_model
            times = {s: [] for s in layers}
            for rep in range(warmup + reps):
                for s, layer in layers.items():
                    xi = x.clone().requires_grad_()
                    dist.barrier()
                    t0 = time.perf_counter()
                    layer(xi).sum().backward()
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if rep >= warmup:
                        times[s].append(float(dt))
            kw = dict(tokens=shape["tokens"], d_model=shape["d_model"], num_experts=shape["num_experts"],
                      top_k=shape["top_k"], capacity_factor=shape["capacity_factor"], n_esp=n_esp, n_mp=n_mp)
            med = {s: statistics.median(t) for s, t in times.items()}
            fastest = min(med, key=med.get)
            auto = choose_schedule(model, cfg["s1"], lay, shape["tokens"], dtype=dtype)
            paper = algorithm1(model, **kw)
            pred = step_times(model, cfg["s1"], lay, shape["tokens"], itemsize=torch.empty((), dtype=dtype).element_size())
            out.append(dict(
                name=f"parm/P{P}/mp{n_mp}-ep{P // n_esp}-esp{n_esp}/T{shape['tokens']}-d{shape['d_model']}-k{shape['top_k']}",
                world_size=P, n_mp=n_mp, n_ep=P // n_esp, n_esp=n_esp, **shape, dtype=str(dtype).replace("torch.", ""),
                times_s={s: t for s, t in times.items()}, median_s=med, fastest=fastest, auto=auto,
                algorithm1=paper, predicted_s=pred,
                pick_vs_fastest=med[auto] / med[fastest], algorithm1_vs_fastest=med[paper] / med[fastest],
                s1_speedup=med["baseline"] / med["s1"], s2_speedup=med["baseline"] / med["s2"],
                collective_fit_s=collective_fit_s, layer_fit_s=fit_s, auto_layer_pick=auto_layer.expert_path.schedule_used,
                cost_model=dict(collectives={k: vars(v) for k, v in model.collectives.items()},
                                flops_per_s=model.flops_per_s, copy_bytes_per_s=model.copy_bytes_per_s,
                                local=vars(model.local) if model.local is not None else None,
                                startup=dict(model.startup), source=model.source),
            ))
    return out


def run_parm(
    *,
    world_size: int = 4,
    layouts: Optional[list] = None,
    shapes: Optional[list] = None,
    reps: int = 7,
    warmup: int = 2,
    dtype: str = "float32",
    timeout_s: float = 120.0,
) -> list[dict]:
    """Measure the grid on ``world_size`` spawned gloo ranks (see the module docstring); one
    dict per configuration (the times already max-reduced over ranks)."""
    d_layouts, d_shapes = default_grid(world_size)
    layouts = [tuple(l) for l in (layouts or d_layouts)]
    shapes = shapes or d_shapes
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        from tritonmoe.comm.rendezvous import local_store

        store = local_store(world_size, timeout_s)  # served until the ranks have ended (no free-port race)
        port = store.port
        procs = [ctx.Process(target=_rank_body, args=(r, world_size, port, layouts, shapes, reps, warmup, dtype,
                                                     timeout_s, outdir), daemon=True) for r in range(world_size)]
        deadline = time.monotonic() + timeout_s * 20
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        path = os.path.join(outdir, "rank0.json")
        if not os.path.exists(path):
            raise RuntimeError("bench.parm: rank 0 wrote no result (killed or crashed)")
        with open(path) as f:
            status, value = json.load(f)
    if status != "ok":
        raise RuntimeError(f"bench.parm: rank 0 failed:\n{value}")
    return value


def summary(results: list[dict]) -> dict:
    """Hit rates of auto and of Algorithm 1 (pick within 10% of the fastest), and the mean
    speedups of S1 and S2 over the baseline."""
    n = len(results)
    return dict(
        configurations=n,
        auto_hit_rate=sum(r["pick_vs_fastest"] <= 1.10 for r in results) / max(n, 1),
        algorithm1_hit_rate=sum(r["algorithm1_vs_fastest"] <= 1.10 for r in results) / max(n, 1),
        auto_fastest_rate=sum(r["auto"] == r["fastest"] for r in results) / max(n, 1),
        mean_s1_speedup=statistics.fmean(r["s1_speedup"] for r in results) if n else None,
        mean_s2_speedup=statistics.fmean(r["s2_speedup"] for r in results) if n else None,
    )


def parm_rows(results: list[dict]) -> list[dict]:
    """Harness rows (bench/schema.py): one per (configuration, schedule), forward + backward
    times over reps; ``extra`` says which schedule was fastest, which ``auto`` and Algorithm 1
    picked, the pick's time over the fastest and the predicted step time."""
    from .harness import Work, fill_timing, new_row

    rows = []
    for r in results:
        params = {k: r[k] for k in ("world_size", "n_mp", "n_ep", "n_esp", "tokens", "d_model", "d_ffn",
                                    "num_experts", "top_k", "capacity_factor", "dtype")}
        case = r["name"].split("/", 1)[1]
        for sched in ("baseline", "s1", "s2"):
            row = new_row(suite="parm", case=case, mode="fwd+bwd", impl=sched, params=params)
            fill_timing(row, r["times_s"][sched], Work(), None)
            row["extra"] = {
                "fastest": r["fastest"], "auto": r["auto"], "algorithm1": r["algorithm1"],
                "auto_vs_fastest": r["pick_vs_fastest"], "algorithm1_vs_fastest": r["algorithm1_vs_fastest"],
                "speedup_vs_baseline": r["median_s"]["baseline"] / r["median_s"][sched],
                "predicted_s": r["predicted_s"][sched],
            }
            rows.append(row)
    return rows


def run_parm_suite(ctx, progress=None) -> list[dict]:
    """The harness's ``parm`` suite: :func:`run_parm` on 4 gloo ranks, the default grid, at most
    5 reps (the default CPU run stays short); logs the hit rates."""
    from .harness import first_line, new_row

    reps = max(3, min(ctx.timer.reps, 5))
    ctx.log(f"parm: 4 ranks over gloo, {len(default_grid(4)[0]) * len(default_grid(4)[1])} configurations, "
            f"{reps} reps; auto = the step model fitted on the groups (tritonmoe.policy.parm_schedule)")
    if progress is not None:
        progress.step("parm")
    try:
        results = run_parm(world_size=4, reps=reps, warmup=1)
    except Exception as exc:  # a failed spawn or a timeout: one error row
        row = new_row(suite="parm", case="P4", mode="fwd+bwd", impl="parm", params={})
        row["status"], row["note"] = "error", first_line(exc)
        return [row]
    s = summary(results)
    ctx.log(f"parm: auto's pick within 10% of the fastest in {s['auto_hit_rate']:.0%} of {s['configurations']} "
            f"configurations (the fastest in {s['auto_fastest_rate']:.0%}); Parm's Algorithm 1 alone "
            f"{s['algorithm1_hit_rate']:.0%}; mean speedup over the baseline: s1 {s['mean_s1_speedup']:.2f}x, "
            f"s2 {s['mean_s2_speedup']:.2f}x")
    return parm_rows(results)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.parm", description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run_parm(world_size=args.world_size, reps=args.reps, warmup=args.warmup)
    for r in res:
        m = r["median_s"]
        print(f"{r['name']:42} base {m['baseline'] * 1e3:7.2f} ms  s1 {m['s1'] * 1e3:7.2f}  s2 {m['s2'] * 1e3:7.2f}  "
              f"fastest {r['fastest']:8} auto {r['auto']} ({r['pick_vs_fastest']:.2f}x)  alg1 {r['algorithm1']} "
              f"({r['algorithm1_vs_fastest']:.2f}x)")
    s = summary(res)
    print(json.dumps(s, indent=1))
    print(f"wall {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=res, summary=s), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
