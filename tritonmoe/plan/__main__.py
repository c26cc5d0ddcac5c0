"""``python -m tritonmoe.plan``: profile a machine, simulate a layer, plan its schedule.

  profile    measure collectives, compute rates and interference here; write a cost model
  simulate   one layer step on a virtual cluster: step-time breakdown, pipelining efficiency
  plan       evaluate the candidate schedules and print the choice
  size       size a model on N GPUs: EP x DP, capacity factor, degree, memory strategy, memory
             per GPU and step time, explained (also `plan --model NAME`)
  calibrate  the papers' testbed results next to the simulator's (PAPERS.md §6)
  clusters   the built-in cluster descriptions

Each command has ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional
from tritonmoe.comm.programs.memory_reuse import STRATEGIES
from tritonmoe.config import MoEConfig
from tritonmoe.sim.cost_model import Cluster
from tritonmoe.sim.cost_model import CostModel
from tritonmoe.plan.profile import ProfileSpec, profile, profile_spawned
from tritonmoe.sim.simulate import parse_dtype
from tritonmoe.sim.simulate import simulate
from tritonmoe.sim.planner import choose
from tritonmoe.comm.programs.memory_reuse import check_mi_buffers
from tritonmoe.plan.calibrate import format_table, run_calibration
from tritonmoe.sim.cost_model import PRESETS
from tritonmoe.plan.fusion import choose_bucket_bytes
from tritonmoe.parallel.elastic import plan_tasks
from tritonmoe.plan.memory_budget import OPTIMIZERS, TrainingSetup
from tritonmoe.plan.sizing import DEFAULT_CAPACITY_FACTORS, DEFAULT_DEGREES, DEFAULT_MEMORY_STRATEGIES, size

__all__ = ["main"]


def _ints(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: expected non-negative integers")
    return vals


def _shape(text: str) -> tuple[int, int, int, int]:
    v = _ints(text)
    if len(v) != 4 or min(v) < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected d_model,d_ffn,num_experts,top_k (positive)")
    return tuple(v)


def _layer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layer")
    g.add_argument("--d-model", type=int, default=4096, help="model width (default 4096)")
    g.add_argument("--d-ffn", type=int, default=1536, help="expert hidden width (default 1536)")
    g.add_argument("-E", "--num-experts", type=int, default=64, help="experts (default 64)")
    g.add_argument("-k", "--top-k", type=int, default=8, help="experts per token (default 8)")
    g.add_argument("--activation", choices=("swiglu", "gelu", "relu"), default="swiglu")
    g.add_argument("--capacity-factor", type=float, default=None, help="capacity factor (default: dropless)")
    g.add_argument("--tokens", type=_ints, required=True, metavar="T[,T2,...]",
                   help="tokens per rank: one count for every rank, or one per rank")
    g.add_argument("--routing", default="uniform", help="uniform or zipf:S (default uniform)")
    g.add_argument("--dtype", default=None, help="activation dtype (default: the cost model's; bfloat16 for clusters)")
    g = p.add_argument_group("machine (one of)")
    m = g.add_mutually_exclusive_group(required=True)
    m.add_argument("--cluster", help="a built-in cluster (see `python -m tritonmoe.plan clusters`)")
    m.add_argument("--cost-model", metavar="FILE", help="a cost-model file from `profile`")
    g.add_argument("--nodes", type=int, default=None, help="nodes of --cluster (default: the preset's)")
    g.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: the cluster's GPUs, or the number of --tokens entries)")
    g.add_argument("--mode", choices=("auto", "full", "symmetric"), default="auto",
                   help="simulate every rank, or one representative (auto: full up to 64 ranks)")


def _strategies(text: str) -> tuple:

    if text.strip() == "all":
        return tuple(STRATEGIES)
    out = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in out if t not in STRATEGIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"{text!r}: use 'all' or a comma-separated list of {', '.join(STRATEGIES)}")
    return out


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def _positive_bytes(text: str) -> int:
    import re

    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 2147483648, 512MiB, 2GiB)")
    v = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 bytes")
    return v


def _setup(args):

    cfg = MoEConfig(args.d_model, args.d_ffn, args.num_experts, args.top_k, activation=args.activation,
                       capacity_factor=args.capacity_factor)
    machine = Cluster.preset(args.cluster, nodes=args.nodes) if args.cluster else CostModel.load(args.cost_model)
    toks = args.tokens[0] if len(args.tokens) == 1 else args.tokens
    return cfg, machine, toks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tritonmoe.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    pr = sub.add_parser("profile", help="measure this machine and write a cost model",
                        description="Measure every collective the schedules use (1 KiB..64 MiB per rank, each right after a compute phase as in a "
                        "step), the layer's "
                        "compute with all ranks computing at once, interference and copies; fit alpha/beta per (kind, "
                        "group size) by least squares; print R^2 and held-out errors; write the JSON cost model. "
                        "Launch under torchrun (gloo or NCCL), or use --nproc N to spawn N local gloo ranks.")
    pr.add_argument("--out", default="cost_model.json", help="output file (default cost_model.json)")
    pr.add_argument("--nproc", type=int, default=None, help="spawn N local ranks on gloo (CPU) instead of torchrun")
    pr.add_argument("--sizes", type=_ints, default=None, help="bytes per rank (default 1 KiB..64 MiB, x4 steps)")
    pr.add_argument("--reps", type=int, default=5, help="repetitions per point (default 5)")
    pr.add_argument("--shape", type=_shape, action="append", default=None, metavar="D,F,E,K",
                    help="layer shape whose ops are timed (repeatable; default 256,512,8,2 and 512,1024,8,2)")
    pr.add_argument("--tokens", type=_ints, default=None, help="token counts per rank for the compute timings")
    pr.add_argument("--dtype", default="float32", help="activation dtype of the compute timings (default float32)")
    pr.add_argument("--quick", action="store_true", help="fewer sizes and shapes (a smoke test, ~1 minute)")
    pr.add_argument("--isolated-collectives", action="store_true",
                    help="time each collective after a barrier alone (default: in place, right after a compute "
                    "phase on every member, as a step issues it)")

    for name, helptext in (("simulate", "simulate one layer step"), ("plan", "choose the schedule")):
        sp = sub.add_parser(name, help=helptext, description={
            "simulate": "Simulate the expert-parallel MoE layer's forward+backward on every rank of a virtual "
                        "cluster and print the step-time breakdown (compute, exposed communication, overlap) and the "
                        "pipelining efficiency.",
            "plan": "Evaluate every candidate (pipeline degree, and the dimensions other schedulers register) in the "
                    "simulator and print each candidate's predicted step time and the choice.",
        }[name])
        _layer_args(sp)
        if name == "simulate":
            sp.add_argument("--degree", type=int, default=1, help="pipeline degree (default 1)")
            sp.add_argument("--spans", action="store_true", help="also print the spans of the slowest rank")
        else:
            sp.add_argument("--degrees", type=_ints, default=None, help="pipeline degrees to try (default 1..8)")
            sp.add_argument("--memory-strategies", type=_strategies, default=None, metavar="S[,S2,...]|all",
                            help="MPMoE memory strategies to try (keep, offload, recomm, recompute, recomm_recompute; "
                                 "all: the five; default: none, or all with --memory-budget)")
            sp.add_argument("--memory-mi-buffers", type=_ints, default=None, metavar="1|2|1,2",
                            help="shared MI buffers of the reuse strategies to try (default: the config's, 1)")
            sp.add_argument("--memory-budget", type=_positive_bytes, default=None, metavar="BYTES",
                            help="device bytes the expert block may keep for backward per rank (e.g. 2147483648 or "
                                 "2GiB); candidates over it are rejected")
        sp.add_argument("--json", metavar="FILE", help="also write the result as JSON")

    _size_parser(sub)
    cal = sub.add_parser("calibrate", help="the papers' results next to the simulator's",
                         description="For each entry of PAPERS.md §6 the simulator can express, the simulated "
                         "ratio next to the paper's; the entries it cannot express yet, and why.")
    cal.add_argument("--json", metavar="FILE", help="also write the table as JSON")
    cal.add_argument("--only", default=None, help="comma-separated entry ids (e.g. CAL-13,CAL-14)")
    sub.add_parser("clusters", help="list the built-in cluster descriptions")
    bk = sub.add_parser("buckets", help="SE-MoE's gradient bucket size from the alpha-beta model",
                        description="Play the backward pass on greedy buckets of every candidate size (a bucket starts "
                        "when its last gradient is ready and the previous one ended; it lasts the fitted all-reduce "
                        "time) and print the size whose last reduction ends first, and why.")
    src = bk.add_mutually_exclusive_group(required=True)
    src.add_argument("--cluster", help="a built-in cluster (python -m tritonmoe.plan clusters)")
    src.add_argument("--cost-model", help="a cost model JSON from `profile`")
    bk.add_argument("--nodes", type=int, default=None, help="nodes of the cluster (default: the preset's)")
    bk.add_argument("--dtype", default="bfloat16", help="dtype of the cluster's cost model (default bfloat16)")
    bk.add_argument("--group", type=int, required=True, help="ranks of the reduction group")
    bk.add_argument("--sizes", type=_ints, required=True, help="gradient bytes, in the order they become ready")
    bk.add_argument("--backward-ms", type=float, default=0.0, help="backward duration the gradients spread over")
    tk = sub.add_parser("tasks", help="SE-MoE's GPUs per task (greedy min-max, light tasks merged)",
                        description="GPUs per task minimising the busiest GPU's load, with light tasks merged onto "
                        "shared GPUs when memory allows; prints the allocation and why.")
    tk.add_argument("--loads", type=_ints, required=True, help="each task's load per step (e.g. samples)")
    tk.add_argument("--gpus", type=int, required=True, help="GPUs to share")
    tk.add_argument("--task-bytes", type=_ints, default=None, help="each task's memory (bytes)")
    tk.add_argument("--gpu-bytes", type=_positive_bytes, default=None, help="memory of one GPU")
    tk.add_argument("--no-merge", action="store_true", help="one task per unit (allocate_tasks only)")
    return p


def _ints_or_none(text: str) -> tuple:
    """A comma-separated list of ints; '' or 'none' for an empty one."""
    return () if text.strip().lower() in ("", "none") else tuple(_ints(text))


def _capacity_factors(text: str) -> tuple:
    out = []
    for t in (t.strip() for t in text.split(",") if t.strip()):
        if t in ("dropless", "none", "None"):
            out.append(None)
            continue
        try:
            v = float(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{t!r}: use 'dropless' or a positive number") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{t!r}: a capacity factor must be > 0")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: expected e.g. dropless,1.0,1.25")
    return tuple(out)


def _size_strategies(text: str) -> tuple:
    if text.strip() == "all":
        return DEFAULT_MEMORY_STRATEGIES
    parts = [t.strip() for t in text.split(",") if t.strip()]
    rest = [t for t in parts if t != "default"]
    named = _strategies(",".join(rest)) if rest else ()
    return tuple(None if t == "default" else t for t in parts if t == "default" or t in named)


def _size_parser(sub) -> None:
    sz = sub.add_parser("size", help="size a model on N GPUs (also: plan --model NAME)",
                        description="Search the EP x DP split, capacity factor, pipeline degree, memory strategy and "
                        "all-to-all (hierarchical where EP spans nodes), Parm's EP x MP layouts (where E < GPUs) and Lina's "
                        "priority (for the top candidates) for a model on N GPUs: every candidate's step "
                        "time from the simulator running the layer's schedule programs on the cluster model, its "
                        "memory per GPU against the device's, the ranking, and why (tritonmoe.plan.sizing).")
    sz.add_argument("--model", required=True, help="a preset (e.g. qwen3-30b-a3b, mixtral-8x7b) or a config.json path")
    sz.add_argument("--gpus", type=int, required=True, help="GPUs to train on")
    sz.add_argument("--cluster", default="dgx-h100", help="a built-in cluster (default dgx-h100)")
    t = sz.add_mutually_exclusive_group(required=True)
    t.add_argument("--tokens-per-gpu", type=int, help="tokens of one GPU per step")
    t.add_argument("--tokens-per-step", type=int, help="global tokens per step (divided over the GPUs)")
    sz.add_argument("--seq-len", type=int, default=4096, help="sequence length (default 4096)")
    sz.add_argument("--memory-budget", type=_positive_bytes, default=None, metavar="BYTES",
                    help="device bytes per GPU (e.g. 70GiB; default: the GPU's memory)")
    sz.add_argument("--optimizer", choices=[o for o in OPTIMIZERS if o != "none"], default="adam")
    sz.add_argument("--no-master-weights", action="store_true", help="no fp32 master weights (bf16 optimizer state)")
    sz.add_argument("--zero1", action="store_true", help="shard optimizer state over data parallelism (ZeRO-1)")
    sz.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the dense part")
    sz.add_argument("--ep-sizes", type=_ints, default=None, help="EP sizes to try (default: those dividing GPUs and E)")
    sz.add_argument("--capacity-factors", type=_capacity_factors, default=DEFAULT_CAPACITY_FACTORS,
                    metavar="dropless,1.0,...", help="capacity factors to try (default dropless,1.0,1.25)")
    sz.add_argument("--degrees", type=_ints, default=DEFAULT_DEGREES, help="pipeline degrees (default 1,2,4)")
    sz.add_argument("--memory-strategies", type=_size_strategies, default=DEFAULT_MEMORY_STRATEGIES,
                    metavar="S[,S2,...]|all", help="memory strategies to try: default (the layer's unmanaged path), "
                    "keep, offload, recomm, recompute, recomm_recompute (default: all six)")
    sz.add_argument("--routing", default="uniform", help="uniform or zipf:S (default uniform)")
    sz.add_argument("--mp-sizes", type=_ints_or_none, default=None,
                    help="Parm's MP sizes to try (EP x MP x DP, experts sharded over MP; default: MP > 1 within a "
                    "node where E < GPUs; '' for none)")
    sz.add_argument("--attn-implementation", default="sdpa", choices=("sdpa", "eager"),
                    help="the attention the activation memory assumes (transformers' sdpa by default)")
    sz.add_argument("--no-lina", action="store_true",
                    help="do not simulate Lina's priority of the all-to-all over the gradient all-reduce for the top "
                    "candidates")
    sz.add_argument("--top", type=int, default=12, help="candidates shown in the table (default 12)")
    sz.add_argument("--json", nargs="?", const="-", metavar="FILE", help="write the report as JSON (to stdout without FILE)")


def _size(args) -> int:

    setup = TrainingSetup(optimizer=args.optimizer, master_weights=not args.no_master_weights,
                          shard_optimizer=args.zero1, activation_checkpointing=args.checkpointing)
    report = size(args.model, gpus=args.gpus, cluster=args.cluster, tokens_per_gpu=args.tokens_per_gpu,
                  tokens_per_step=args.tokens_per_step, seq_len=args.seq_len, memory_budget_bytes=args.memory_budget,
                  setup=setup, ep_sizes=args.ep_sizes, capacity_factors=args.capacity_factors,
                  pipeline_degrees=args.degrees, memory_strategies=args.memory_strategies, routing=args.routing,
                  mp_sizes=args.mp_sizes, lina=not args.no_lina,
                  attn_implementation=args.attn_implementation)
    if args.json == "-":
        json.dump(report.to_dict(), sys.stdout, indent=1)
        print()
        return 0
    print(f"{report.model.name} on {report.gpus} GPUs ({report.cluster}), {report.tokens_per_gpu} tokens per GPU, "
          f"sequence {report.seq_len}: {len(report.candidates)} candidates")
    print(report.table(args.top))
    print()
    for line in report.explain():
        print(f"* {line}")
    print()
    print(f"memory per GPU of the {'recommended' if report.is_tie else 'winning'} candidate:")
    print(report.recommended.memory.table(report.capacity_bytes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 0


def _buckets(args) -> int:

    cm = Cluster.preset(args.cluster, nodes=args.nodes).cost_model(args.dtype) if args.cluster else CostModel.load(args.cost_model)
    print(choose_bucket_bytes(args.sizes, cm, args.group, backward_s=args.backward_ms / 1e3).describe())
    return 0


def _tasks(args) -> int:

    plan = plan_tasks(args.loads, args.gpus, merge=not args.no_merge, task_bytes=args.task_bytes, gpu_bytes=args.gpu_bytes)
    for u, g in zip(plan.units, plan.gpus):
        print(f"tasks {u}: {g} GPU(s), load {sum(args.loads[t] for t in u) / g:.4g} per GPU")
    print(f"bottleneck {plan.bottleneck:.4g} per GPU")
    for r in plan.reasons:
        print(f"  {r}")
    return 0


def _profile(args) -> int:

    spec = ProfileSpec(dtype=parse_dtype(args.dtype), reps=args.reps,
                       collectives_in_place=not args.isolated_collectives)
    if args.sizes:
        spec.sizes = tuple(args.sizes)
    if args.shape:
        spec.shapes = tuple(args.shape)
    if args.tokens:
        spec.tokens = tuple(args.tokens)
    if args.quick:
        spec.sizes = tuple(spec.sizes[::2]) if not args.sizes else spec.sizes
        spec.shapes = tuple(spec.shapes[:1])
        spec.tokens = tuple(spec.tokens[:3])
        spec.reps = min(spec.reps, 3)
    if args.nproc:
        model = profile_spawned(args.nproc, spec, out=args.out)
    else:
        import datetime

        import torch
        import torch.distributed as dist

        if "RANK" not in os.environ:
            print("profile: launch under torchrun, or pass --nproc N to spawn N local ranks", file=sys.stderr)
            return 2
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
        model = profile(spec, out=args.out)
        dist.destroy_process_group()
        if model is None:
            return 0
    for line in model.describe():
        print(line)
    print(f"written: {args.out}")
    return 0


def _simulate(args) -> int:

    cfg, machine, toks = _setup(args)
    tl = simulate(cfg, toks, machine, world_size=args.world_size, routing=args.routing, pipeline_degree=args.degree,
                  dtype=args.dtype, mode=args.mode)
    b = tl.breakdown()
    P = tl.world_size
    print(f"{tl.cost.source}: P={P}{' (one representative rank simulated)' if tl.symmetric else ''}, "
          f"tokens/rank {tl.tokens_per_rank[0] if len(set(tl.tokens_per_rank)) == 1 else list(tl.tokens_per_rank)}, "
          f"d={cfg.d_model} f={cfg.d_ffn} E={cfg.num_experts} k={cfg.top_k}, degree {args.degree}, {tl.cost.dtype}")
    print(f"step (forward+backward, slowest rank) {b['step'] * 1e3:.3f} ms")
    for key in ("compute", "comm", "overlap", "exposed_comm", "idle"):
        print(f"  {key:13} {b[key] * 1e3:10.3f} ms  ({100 * b[key] / b['step'] if b['step'] else 0:5.1f}%)")
    eff = tl.pipeline_efficiency()
    print(f"  pipelining efficiency (comm time with expert compute running) {eff if eff is None else round(eff, 3)}")
    for phase in ("fwd", "bwd"):
        print(f"  {phase}: {tl.step_time(phase) * 1e3:.3f} ms")
    if args.spans:
        rank = max(tl.ranks(), key=lambda r: tl.result.rank_end(r))
        for s in tl.spans():
            if s.rank == rank:
                print(f"    {s.phase} {s.lane:8} {s.kind:10}[{s.micro_op}] {s.start * 1e3:9.3f} .. {s.end * 1e3:9.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"breakdown": b, "pipeline_efficiency": eff, "candidate": tl.candidate, "world_size": P,
                       "tokens_per_rank": list(tl.tokens_per_rank), "cost": tl.cost.source}, f, indent=1)
    return 0


def _plan(args) -> int:

    cfg, machine, toks = _setup(args)
    over = {"pipeline_degree": args.degrees} if args.degrees else {}
    if args.memory_strategies:
        over["memory_strategy"] = args.memory_strategies
    if args.memory_mi_buffers:

        try:
            over["memory_mi_buffers"] = [check_mi_buffers(m) for m in args.memory_mi_buffers]
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"--memory-mi-buffers: {exc}")
        if not args.memory_strategies and args.memory_budget is None:
            raise SystemExit("--memory-mi-buffers needs --memory-strategies (or --memory-budget): MI buffers belong "
                             "to a memory reuse strategy")
    plan = choose(cfg, toks, machine, world_size=args.world_size, routing=args.routing, dtype=args.dtype,
                  mode=args.mode, candidates_override=over, memory_budget_bytes=args.memory_budget)
    print(f"{plan.cost_source}: P={plan.world_size}, d={cfg.d_model} f={cfg.d_ffn} E={cfg.num_experts} k={cfg.top_k}")
    print(plan.table())
    print(f"choice: {plan.choice} ({plan.step_time * 1e3:.3f} ms predicted)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"choice": plan.choice, "step_time_s": plan.step_time,
                       "budget_bytes": plan.budget_bytes,
                       "candidates": [{"values": c.values, "step_time_s": c.step_time, "device_bytes": c.device_bytes,
                                       "rejected": c.rejected, "breakdown": c.breakdown}
                                      for c in plan.candidates]}, f,
                      indent=1)
    return 0


def _calibrate(args) -> int:

    only = [s.strip() for s in args.only.split(",")] if args.only else None
    rows = run_calibration(only)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _clusters(_args) -> int:

    for name in PRESETS:
        c = Cluster.preset(name)
        print(f"{name:12} {c.describe()}")
        print(f"{'':12} {c.notes}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"] and any(a == "--model" or a.startswith("--model=") for a in argv):
        argv[0] = "size"  # `plan --model NAME` sizes a model; `plan` without it plans one layer's schedule
    args = build_parser().parse_args(argv)
    try:
        return {"profile": _profile, "simulate": _simulate, "plan": _plan, "calibrate": _calibrate,
                "clusters": _clusters, "buckets": _buckets, "tasks": _tasks, "size": _size}[args.cmd](args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"python -m tritonmoe.plan {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
