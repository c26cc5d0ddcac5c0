"""Lina's priority communication against FIFO: backward all-to-all time and step time.

``run_lina(...)`` trains a small expert-parallel model on P spawned gloo ranks (CPU, EP = P, so
the dense gradients' allreduce group and the expert-parallel group are the same ranks), wrapped
by :func:`tritonmoe.parallel.data_parallel`, and measures in one run, round-robin per rep:

* ``standalone``: the step under ``ddp.no_sync()``: no gradient reduction, every all-to-all
  alone on the network;
* ``fifo``: today's behaviour: DDP buckets (``bucket_mb``) reduced whole as they become ready,
  concurrently with the all-to-alls;
* ``lina/<s>MB``: Lina: gradients in micro-ops of at most s MB, started only while no all-to-all
  is running, waiting or imminent.

The model (``blocks`` times): ``h += table[idx]`` (a ``[table_rows, d_model]`` dense parameter:
a large gradient that is cheap to compute, as embedding-like parameters are), a dense
``Linear(d, d)``, then an expert-parallel ``MoELayer``. In backward each block's dense gradients
become ready just before the previous block's MoE all-to-alls, so a gradient allreduce of
realistic size is in flight when they start.

Figures (per variant):

* ``step_s``: wall time of forward + backward (including the end-of-backward wait for the
  reductions), per rep the max over ranks;
* ``a2a_s``: completion time of every backward all-to-all (issue to completion, from the layers'
  :class:`~tritonmoe.comm.Timeline`);
* ``a2a_slowdown``: per backward all-to-all (layer, kind, micro-op, rank), its time over the
  median time of the same all-to-all in ``standalone`` (the paper's "t(A2A with concurrent
  allreduce) / t(A2A alone)", 001 section 2.2); median and p90 over ops, ranks and reps;
* ``a2a_overlap_frac``: the fraction of backward all-to-all time during which a gradient
  reduction was running (from the gradient lane's timeline);
* ``grad_micro_ops``: gradient reductions per step.

``python -m bench.lina`` runs it standalone; ``python -m bench lina`` through the harness.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["run_lina", "DEFAULTS"]

#: Shapes (tokens per rank) and reps of the CPU run.
DEFAULTS = dict(
    a2a_mb=8.0, grad_mb=64.0, grad_tensors=4, delay_ms=2.0, a2a_reps=40,
    steps=True, tokens=1024, d_model=1024, d_ffn=64, num_experts=8, top_k=2, blocks=3, table_rows=4096,
    bucket_mb=25.0, chunk_mb=(1.0, 4.0), reps=10, warmup=2,
)


class _Net(nn.Module):
    def __init__(self, spec: dict, mesh) -> None:
        import tritonmoe as tm

        super().__init__()
        d = spec["d_model"]
        cfg = tm.MoEConfig(d, spec["d_ffn"], spec["num_experts"], spec["top_k"])
        self.tables = nn.ParameterList([nn.Parameter(torch.randn(spec["table_rows"], d) * 0.02) for _ in range(spec["blocks"])])
        self.dense = nn.ModuleList([nn.Linear(d, d) for _ in range(spec["blocks"])])
        self.moe = nn.ModuleList([tm.MoELayer(cfg, mesh=mesh) for _ in range(spec["blocks"])])

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = x
        for table, dense, moe in zip(self.tables, self.dense, self.moe):
            h = h + table[idx]
            h = h + torch.tanh(dense(h))
            h = h + moe(h)
        return h


def _measure_priority(rank: int, P: int, spec: dict) -> dict:
    """The all-to-all alone and with a gradient reduction in flight, per scheduler (see the
    module docstring): per variant, per rep, the all-to-all's completion time and how much of it
    overlapped a gradient micro-op."""
    from tritonmoe.comm import CommScheduler, RealExecutor, Timeline
    from tritonmoe.comm.errors import new_group

    ep_group = new_group(range(P))  # the default group's timeout
    red_group = new_group(range(P))  # the gradient lane's own group, as data_parallel makes
    scheds = {"fifo": CommScheduler.fifo()}
    for mb in spec["chunk_mb"]:
        scheds[f"lina/{mb:g}MB"] = CommScheduler.lina(int(mb * 2**20))
    for sc in scheds.values():
        sc.timeline = Timeline()
    rows = int(spec["a2a_mb"] * 2**20) // (4 * spec["d_model"] * P) * P
    x = torch.randn(rows, spec["d_model"], generator=torch.Generator().manual_seed(rank))
    splits = [rows // P] * P
    n_grad = int(spec["grad_mb"] * 2**20) // 4
    grad = torch.ones(n_grad)
    views = list(grad.chunk(spec["grad_tensors"]))
    out: dict = {v: [] for v in ["standalone", *scheds]}
    for it in range(spec["warmup"] + spec["a2a_reps"]):
        for v in out:
            sched = scheds.get(v)
            grad.fill_(1.0)
            if sched is not None:
                sched.timeline.clear()
            dist.barrier()
            fut = sched.reduce(grad, views, red_group) if sched is not None else None
            time.sleep(spec["delay_ms"] / 1e3)  # the reduction is on the network when the all-to-all comes
            tl = Timeline()
            ex = RealExecutor(torch.device("cpu"), phase="bwd", timeline=tl, scheduler=sched)
            ex.wait(ex.all_to_all(x, splits, splits, group=ep_group, kind="combine"))
            if fut is not None:
                fut.wait()
            if it < spec["warmup"]:
                continue
            (a2a,) = tl.spans()
            grads = sched.timeline.spans() if sched is not None else []
            busy = sum(max(0.0, min(a2a.end, g.end) - max(a2a.start, g.start)) for g in grads)
            out[v].append({"a2a_s": a2a.duration, "overlap_s": busy})
    for sc in scheds.values():
        sc.close()
    return {"reps": out, "a2a_bytes": rows * spec["d_model"] * 4}


def _aggregate_priority(per_rank: list[dict], spec: dict, P: int) -> list[dict]:
    order = list(per_rank[0]["reps"])
    nrep = min(len(r["reps"][v]) for r in per_rank for v in order)
    alone = [statistics.median(r["reps"]["standalone"][i]["a2a_s"] for i in range(nrep)) for r in per_rank]
    results = []
    for v in order:
        times = [max(r["reps"][v][i]["a2a_s"] for r in per_rank) for i in range(nrep)]
        ratios = sorted(r["reps"][v][i]["a2a_s"] / alone[k] for k, r in enumerate(per_rank) for i in range(nrep))
        tot = sum(r["reps"][v][i]["a2a_s"] for r in per_rank for i in range(nrep))
        ovl = sum(r["reps"][v][i]["overlap_s"] for r in per_rank for i in range(nrep))
        results.append({
            "name": f"lina/P{P}/a2a/{v}", "bench": "a2a", "variant": v, "world_size": P, "a2a_s": times,
            "a2a_bytes": per_rank[0]["a2a_bytes"], "grad_bytes": int(spec["grad_mb"] * 2**20),
            "a2a_slowdown_median": statistics.median(ratios) if ratios else None,
            "a2a_slowdown_p90": ratios[int(0.9 * (len(ratios) - 1))] if ratios else None,
            "a2a_overlap_frac": ovl / tot if tot > 0 else None,
            "chunk_bytes": next((int(mb * 2**20) for mb in spec["chunk_mb"] if v == f"lina/{mb:g}MB"), None),
        })
    return results


def _variants(spec: dict) -> list[tuple[str, str, Optional[int]]]:
    return [("fifo", "fifo", None)] + [(f"lina/{mb:g}MB", "lina", int(mb * 2**20)) for mb in spec["chunk_mb"]]


def _measure_rank(rank: int, P: int, spec: dict, device: torch.device, progress) -> dict:
    """This rank's measurements: the all-to-all micro-benchmark, then the training steps."""
    pri = _measure_priority(rank, P, spec)
    progress()
    steps = _measure_steps(rank, P, spec, progress) if spec["steps"] else None
    return {"priority": pri, "steps": steps}


def _measure_steps(rank: int, P: int, spec: dict, progress) -> dict:
    """Per-rep training-step measurements of every variant (collective: all ranks)."""
    from tritonmoe.comm import Timeline
    from tritonmoe.parallel import MoEMesh, data_parallel

    mesh = MoEMesh.build(dp=1, ep=P)
    models = {}
    for name, comm, chunk in _variants(spec):
        torch.manual_seed(0)
        net = _Net(spec, mesh)
        ddp = data_parallel(net, mesh, comm=comm, chunk_bytes=chunk, bucket_cap_mb=spec["bucket_mb"])
        for layer in net.moe:
            layer.timeline = Timeline()
        ddp._tritonmoe_data_parallel.scheduler.timeline = Timeline()
        models[name] = (net, ddp)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(spec["tokens"], spec["d_model"], generator=g)
    idx = torch.randint(0, spec["table_rows"], (spec["tokens"],), generator=g)
    order = ["standalone"] + [n for n, _, _ in _variants(spec)]
    out: dict = {v: [] for v in order}
    grad_bytes = sum(p.numel() * p.element_size() for n, p in models["fifo"][0].named_parameters() if not n.endswith(("w1", "w2")))
    for it in range(spec["warmup"] + spec["reps"]):
        for v in order:
            net, ddp = models["fifo" if v == "standalone" else v]
            lane = ddp._tritonmoe_data_parallel.scheduler.timeline
            for layer in net.moe:
                layer.timeline.clear()
            lane.clear()
            net.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            with ddp.no_sync() if v == "standalone" else nullcontext():
                ddp(x, idx).pow(2).mean().backward()
            step = time.perf_counter() - t0
            if it < spec["warmup"]:
                continue
            a2a, spans = {}, []
            for li, layer in enumerate(net.moe):
                for s in layer.timeline.spans():
                    if s.phase == "bwd" and s.kind in ("dispatch", "combine"):
                        a2a[f"{li}/{s.kind}/{s.micro_op}"] = s.duration
                        spans.append((s.start, s.end))
            grad = [(s.start, s.end) for s in lane.spans()]
            busy = sum(max(0.0, min(e, ge) - max(s, gs)) for s, e in spans for gs, ge in grad)
            out[v].append({
                "step_s": step, "a2a": a2a, "a2a_total_s": sum(a2a.values()), "overlap_s": busy,
                "grad_micro_ops": len(grad),
            })
            progress()
    for net, ddp in models.values():
        ddp._tritonmoe_data_parallel.scheduler.close()
    return {"reps": out, "grad_bytes": grad_bytes}


def _aggregate_steps(per_rank: list[dict], spec: dict, P: int) -> list[dict]:
    order = ["standalone"] + [n for n, _, _ in _variants(spec)]
    nrep = min(len(r["reps"][v]) for r in per_rank for v in order)
    alone = {}
    for r, res in enumerate(per_rank):
        keys = res["reps"]["standalone"][0]["a2a"].keys() if nrep else ()
        for k in keys:
            alone[(r, k)] = statistics.median(res["reps"]["standalone"][i]["a2a"][k] for i in range(nrep))
    results = []
    for v in order:
        steps = [max(res["reps"][v][i]["step_s"] for res in per_rank) for i in range(nrep)]
        ratios, a2a_s, total, overlap, micro = [], [], 0.0, 0.0, []
        for r, res in enumerate(per_rank):
            for i in range(nrep):
                rep = res["reps"][v][i]
                for k, t in rep["a2a"].items():
                    a2a_s.append(t)
                    if alone.get((r, k)):
                        ratios.append(t / alone[(r, k)])
                total += rep["a2a_total_s"]
                overlap += rep["overlap_s"]
                micro.append(rep["grad_micro_ops"])
        ratios.sort()
        chunk = next((c for n, _, c in _variants(spec) if n == v), None)
        results.append({
            "name": f"lina/P{P}/step/{v}",
            "bench": "step",
            "variant": v,
            "world_size": P,
            "chunk_bytes": chunk,
            "step_s": steps,
            "a2a_s": a2a_s,
            "a2a_slowdown_median": statistics.median(ratios) if ratios else None,
            "a2a_slowdown_p90": ratios[int(0.9 * (len(ratios) - 1))] if ratios else None,
            "a2a_slowdown_max": ratios[-1] if ratios else None,
            "a2a_overlap_frac": overlap / total if total > 0 else None,
            "grad_micro_ops": statistics.median(micro) if micro else None,
            "grad_bytes": per_rank[0]["grad_bytes"],
            **{k: spec[k] for k in ("tokens", "d_model", "d_ffn", "num_experts", "top_k", "blocks", "table_rows", "bucket_mb")},
        })
    base = statistics.median(results[1]["step_s"]) if nrep else None  # fifo
    for r in results:
        r["step_speedup_vs_fifo"] = base / statistics.median(r["step_s"]) if base and r["step_s"] else None
    return results


def run_lina(*, world_size: int = 2, timeout_s: float = 120.0, **overrides) -> list[dict]:
    """Measure every variant on ``world_size`` spawned gloo ranks; one dict per variant (see the
    module docstring). ``overrides`` replace :data:`DEFAULTS` entries."""
    from .ep import run_spawned

    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}; use {sorted(DEFAULTS)}")
    spec = {**DEFAULTS, **overrides}
    spec["chunk_mb"] = [float(c) for c in spec["chunk_mb"]]
    if spec["num_experts"] % world_size:
        raise ValueError(f"num_experts={spec['num_experts']} is not divisible by world_size={world_size}")
    per_rank = run_spawned(world_size, spec, timeout_s, measure=_measure_rank, what="bench.lina")
    out = _aggregate_priority([r["priority"] for r in per_rank], spec, world_size)
    if spec["steps"]:
        out += _aggregate_steps([r["steps"] for r in per_rank], spec, world_size)
    return out


def print_table(results: list[dict]) -> None:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    pri = [r for r in results if r["bench"] == "a2a"]
    if pri:
        r0 = pri[0]
        print(f"all-to-all of {r0['a2a_bytes'] / 2**20:.1f} MB/rank with a {r0['grad_bytes'] / 2**20:.0f} MB gradient "
              "reduction in flight (completion time, max over ranks; x alone = per rank vs its standalone median)")
        print(f"{'variant':12} {'a2a ms':>8} {'x alone (med / p90)':>20} {'overlap':>8}")
        for r in pri:
            print(f"{r['variant']:12} {1e3 * statistics.median(r['a2a_s']):8.2f} "
                  f"{f(r['a2a_slowdown_median'], '.2f'):>11} / {f(r['a2a_slowdown_p90'], '.2f'):<6} {f(r['a2a_overlap_frac'], '8.2f')}")
    st = [r for r in results if r["bench"] == "step"]
    if st:
        print(f"training step ({st[0]['blocks']} blocks, {st[0]['grad_bytes'] / 2**20:.0f} MB of dense gradients per step; "
              "backward all-to-alls vs the same ones in 'standalone' = no gradient reduction)")
        print(f"{'variant':12} {'step ms':>8} {'vs fifo':>7} {'a2a ms':>7} {'a2a x alone (med / p90)':>24} "
              f"{'overlap':>7} {'micro-ops':>9}")
        for r in st:
            print(f"{r['variant']:12} {1e3 * statistics.median(r['step_s']):8.1f} {f(r['step_speedup_vs_fifo'], '7.2f')} "
                  f"{1e3 * statistics.median(r['a2a_s']):7.2f} "
                  f"{f(r['a2a_slowdown_median'], '.2f'):>15} / {f(r['a2a_slowdown_p90'], '.2f'):<6} "
                  f"{f(r['a2a_overlap_frac'], '7.2f')} {f(r['grad_micro_ops'], '9.0f')}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lina", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    for k, v in DEFAULTS.items():
        if k == "chunk_mb":
            p.add_argument("--chunk-mb", type=float, nargs="+", default=None, help=f"Lina partition sizes (default {v})")
        elif k == "steps":
            p.add_argument("--no-steps", dest="steps", action="store_const", const=False, default=None,
                           help="skip the training-step part")
        else:
            p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None, help=f"default {v}")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    kw = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k) is not None}
    t0 = time.perf_counter()
    results = run_lina(world_size=args.world_size, timeout_s=args.timeout, **kw)
    print(f"bench.lina P={args.world_size} {dict(DEFAULTS, **kw)} torch={torch.__version__}")
    print_table(results)
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
