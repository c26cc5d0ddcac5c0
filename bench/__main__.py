"""tritonmoe's microbenchmark harness.

  python -m bench [SUITE ...] [options]     run suites (default: the default set for this machine)
  python -m bench compare A.json B.json     per-entry ratios of two result files
  python -m bench agree A.json B.json       do two check runs agree within 5% on every median ratio?
  python -m bench faults [--world-sizes 2,4]   expert-parallel fault table (bench/faults.py)
  python -m bench report A.json [--markdown M] [--plot P]   re-render a result file
  python -m bench check [--sections S,...]  gpu-check: gpu tests, the core set, the target table
  python -m bench profile [--sections S,...]  the core set's kernels under the PyTorch profiler
  python -m bench gpu-tests [--shards N]    the gpu-marked tests as concurrent pytest shards
  python -m bench host                      host CPU time of the launchers' Python (kernels stubbed)
  python -m bench tune [--budget-s S] [--resume]   tuned kernel configs -> kernels/configs/<device>.json

Each suite (listed below) measures tritonmoe through its public API
(backend "triton": the kernels; "torch": the reference path) beside baselines run in the same
process (a per-expert torch.matmul loop, torch._grouped_mm where this torch has it), and reports
time (median, p20-p80 of >= 20 reps after warm-up, L2 flushed between reps on GPU), TFLOP/s or
GB/s, the fraction of the roofs measured at the start of the run (dense bf16 8192^3 matmul,
1 GiB device copy), speedups over each baseline, peak memory and NVML telemetry.

With no arguments it runs the default set for the machine: on a GPU every suite at the four model
presets with backends triton and torch; on CPU ("CPU MODE") the reference path and the torch
baselines at the small preset plus the ep suite over gloo, in under two minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch

from . import report, schema
from .harness import DEFAULT_REPS, MIN_REPS, Timer, environment, first_line
from .presets import (
    DEFAULT_PRESETS_CPU,
    DEFAULT_PRESETS_GPU,
    PRESETS,
    SHAPE_FIELDS,
    parse_routing,
    with_overrides,
)
from .roofs import describe, dtype_name, measure_roofs
from .suites import (
    LAYER_FRACTION,
    SUITE_ORDER,
    SUITES,
    Context,
    attach_layer_fractions,
    count_entries,
    plan,
    run_suite,
)
from .telemetry import Telemetry

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32,
}
BACKENDS = ("triton", "torch", "auto")
#: Baselines and peers a run may name; the default leaves out the peer liger (it needs its wheel,
#: and runs only on a GPU or under Triton's interpreter) and softmax_topk (torch.softmax +
#: torch.topk beside plain softmax routers: the floor the router's eager call is judged against).
BASELINES = ("loop", "grouped_mm", "liger", "softmax_topk")
DEFAULT_BASELINES = ("loop", "grouped_mm")


# ---------------------------------------------------------------------------------------------
# Argument types (each raises ArgumentTypeError, which argparse turns into exit status 2)
# ---------------------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def suite_name(text: str) -> str:
    if text not in (*SUITE_ORDER, "all"):
        raise argparse.ArgumentTypeError(f"unknown suite {text!r}; choose from {', '.join((*SUITE_ORDER, 'all'))}")
    return text


def preset_list(text: str) -> list[str]:
    out = []
    for name in _csv(text):
        if name == "all":
            out.extend(DEFAULT_PRESETS_GPU)
        elif name in PRESETS:
            out.append(name)
        else:
            raise argparse.ArgumentTypeError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)} or all")
    return out


def token_list(text: str) -> tuple[int, ...]:
    out = []
    for t in _csv(text):
        try:
            v = int(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"tokens {t!r} is not an integer") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"tokens {v} must be >= 1")
        out.append(v)
    return tuple(out)


def routing_list(text: str):
    try:
        return [parse_routing(t) for t in _csv(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dtype_arg(text: str) -> torch.dtype:
    try:
        return DTYPES[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"dtype {text!r}; choose from bfloat16, float16, float32") from None


def choice_list(choices: tuple[str, ...], allow_none: bool = False):
    def parse(text: str) -> tuple[str, ...]:
        items = _csv(text)
        if allow_none and items == ["none"]:
            return ()
        for it in items:
            if it not in choices:
                extra = " or none" if allow_none else ""
                raise argparse.ArgumentTypeError(f"{it!r} is not one of {', '.join(choices)}{extra}")
        return tuple(dict.fromkeys(items))

    return parse


def int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
        return v

    return parse


def int_list_at_least(lo: int):
    one = int_at_least(lo)
    return lambda text: tuple(one(t) for t in _csv(text))


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    presets_help = "; ".join(f"{p.name} (E={p.num_experts} d={p.d_model} f={p.d_ffn} k={p.top_k}"
                             f"{', ' + p.score_func if p.score_func != 'softmax' else ''}"
                             f"{', groups ' + str(p.n_groups) + '/' + str(p.topk_groups) if p.n_groups else ''}"
                             f"{', ' + p.activation if p.activation != 'swiglu' else ''})" for p in PRESETS.values())
    suites_text = "\n".join(f"  {s.name:8} {s.about}" for s in SUITES.values())
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=f"{__doc__}\nSuites:\n{suites_text}\n  all      every suite (without suite names: all but parm, plan, lina and inference)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=report.__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("suites", nargs="*", type=suite_name, metavar="SUITE",
                   help=f"suites to run: {', '.join(SUITE_ORDER)} or all (default: every suite but parm, plan, lina and inference; see Suites above)")
    g = p.add_argument_group("shapes")
    g.add_argument("--preset", type=preset_list, action="extend", metavar="NAMES",
                   help=f"comma-separated presets ('all' = the four model presets): {presets_help}. "
                   "Default: the four model presets on GPU, small on CPU")
    g.add_argument("--tokens", type=token_list, metavar="T1,T2,...",
                   help="token counts to sweep, replacing each preset's list (GPU: 64,4096,16384 and 32768 for "
                   "qwen3; CPU: 128,512; route grid on GPU: 4096,16384,65536)")
    g.add_argument("--routing", type=routing_list, metavar="DIST,...",
                   help="expert popularity of the routing: uniform, or zipf:S (expert e drawn in proportion to "
                   "1/(e+1)^S); comma-separated to run several. Default uniform (plus zipf:1.2 for ffn on GPU)")
    g.add_argument("-E", "--num-experts", type=int_at_least(1), help="custom shape: number of experts")
    g.add_argument("--d-model", type=int_at_least(1), help="custom shape: model width d")
    g.add_argument("--d-ffn", type=int_at_least(1), help="custom shape: expert hidden width f")
    g.add_argument("-k", "--top-k", type=int_at_least(1), help="custom shape: experts per token")
    g.add_argument("--activation", choices=("swiglu", "gelu", "relu"), help="custom shape: expert activation")
    g.add_argument("--score-func", choices=("softmax", "sigmoid"), help="custom shape: router score function")
    g.add_argument("--n-groups", type=int_at_least(1), help="custom shape: expert groups of group-limited routing")
    g.add_argument("--topk-groups", type=int_at_least(1), help="custom shape: groups kept per token")
    g.add_argument("--expert-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="custom shape: selection bias (auxiliary-loss-free balancing)")
    g = p.add_argument_group("what to measure")
    g.add_argument("--dtype", type=dtype_arg, metavar="DTYPE",
                   help="bfloat16 | float16 | float32 (default: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--backend", type=choice_list(BACKENDS), metavar="B,...",
                   help="tritonmoe backends to measure: triton (the kernels), torch (the reference path, also a "
                   "baseline), auto. Default triton,torch on GPU and torch on CPU")
    g.add_argument("--baselines", type=choice_list(BASELINES, allow_none=True), metavar="B,...",
                   help="extra baselines: loop (per-expert torch.matmul), grouped_mm (torch._grouped_mm), liger "
                   "(Liger-Kernel's fused MoE, routed-FFN cases), softmax_topk (torch.softmax + torch.topk, plain "
                   "softmax router cases) or none. Default: loop,grouped_mm")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where to run (default: cuda when available)")
    g.add_argument("--reps", type=int_at_least(MIN_REPS), default=DEFAULT_REPS,
                   help=f"timed repetitions per entry (default {DEFAULT_REPS}; fewer only for quick checks)")
    g.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed calls before timing (default 3)")
    g.add_argument("--no-flush", action="store_true", help="do not flush the GPU L2 between reps")
    g.add_argument("--rounds", type=int_at_least(3), metavar="N",
                   help="measure with the check's method (bench.rounds): each comparison's implementations and the "
                   "roofs in at least N interleaved rounds of CUDA-graph replays (0.5 s of device time each), "
                   "instead of --reps in turn")
    g.add_argument("--no-telemetry", action="store_true", help="do not sample NVML telemetry")
    g.add_argument("--seed", type=int, default=0, help="seed of inputs and routing (default 0)")
    g.add_argument("--threads", type=int_at_least(1), metavar="N",
                   help="torch intra-op CPU threads (default: 1 in CPU mode, so CPU numbers are comparable across "
                   "machines and robust to a shared machine; torch's own choice in GPU mode)")
    g.add_argument("--ep-world-sizes", type=int_list_at_least(1), default=(2, 4), metavar="P,...",
                   help="ep suite: ranks per run (default 2,4)")
    g.add_argument("--ep-degrees", type=int_list_at_least(1), default=(1, 2, 4, 8), metavar="N,...",
                   help="ep suite: pipeline degrees (default 1,2,4,8)")
    g.add_argument("--ep-timeout", type=positive_float, default=60.0, metavar="S",
                   help="ep suite: timeout of process-group setup and every wait (default 60 s)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write the results (schema: bench/schema.py) to PATH, "
                   "rewritten after each suite so an interrupted run keeps what it measured")
    g.add_argument("--markdown", metavar="PATH", help="write the results as markdown tables (as in bench/results)")
    g.add_argument("--plot", metavar="PATH", help="write a PNG of throughput vs tokens per suite (needs matplotlib)")
    g.add_argument("--results-dir", metavar="DIR",
                   help="write <gpu>-<date>.json, .md and .png (plot if matplotlib is installed) into DIR, e.g. "
                   "bench/results; --json/--markdown/--plot given explicitly take precedence")
    g.add_argument("--list", action="store_true", help="list the entries the run would measure and exit")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress line on stderr (default: when stdout is a terminal)")
    g.add_argument("--print-schema", action="store_true", help="print the JSON schema of result files and exit")
    g.add_argument("--legend", action="store_true", help="print what every table column means and exit "
                   "(a run prints the legend of its own columns after its tables)")
    return p


def build_compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench compare",
        description="Compare two result files entry by entry (same name and impl): B/A is B's median time "
        "over A's, speedup its inverse; entries moving by more than the threshold are flagged.",
    )
    p.add_argument("a", metavar="A.json", help="baseline results")
    p.add_argument("b", metavar="B.json", help="new results")
    p.add_argument("--threshold", type=positive_float, default=0.05,
                   help="relative change flagged as faster/slower (default 0.05)")
    return p


def build_report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench report",
        description="Print the tables of one or more result files (several are merged, e.g. suites run by "
        "separate commands); optionally write markdown or a plot.",
    )
    p.add_argument("paths", nargs="+", metavar="RESULTS.json")
    p.add_argument("--markdown", metavar="PATH", help="write markdown tables to PATH")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot to PATH (needs matplotlib)")
    return p


# ---------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------


class Progress:
    """``[i/n] label`` rewritten in place on stderr, only when enabled (a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.i = total, enabled, 0
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.i += 1
        if self.enabled:
            msg = f"[{self.i}/{self.total} {time.perf_counter() - self.t0:.0f}s] {label}"
            sys.stderr.write("\r\033[K" + msg[:150])
            sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def resolve_presets(args, parser, device):
    names = args.preset or list(DEFAULT_PRESETS_GPU if device.type == "cuda" else DEFAULT_PRESETS_CPU)
    overrides = {f: getattr(args, f) for f in SHAPE_FIELDS}
    presets = []
    import tritonmoe as tm

    for name in dict.fromkeys(names):
        pr = with_overrides(PRESETS[name], overrides)
        try:  # the layer's own validation says what is wrong with a custom shape
            tm.MoEConfig(pr.d_model, pr.d_ffn, pr.num_experts, pr.top_k, activation=pr.activation,
                         score_func=pr.score_func, n_groups=pr.n_groups, topk_groups=pr.topk_groups,
                         expert_bias=pr.expert_bias)
        except (TypeError, ValueError) as exc:
            parser.error(f"shape {pr.name}: {exc}")
        presets.append(pr)
    chosen = bool(args.preset) or any(v is not None for v in overrides.values())
    return presets, chosen


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (for result file names)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def new_doc(env: dict, config: dict, roofs: dict, notes: list[str]) -> dict:
    return {
        "schema_version": schema.SCHEMA_VERSION,
        "complete": False,
        "env": env,
        "config": config,
        "roofs": roofs,
        "results": [],
        "notes": notes,
        "wall_time_s": 0.0,
    }


def run(args, parser, argv: list[str]) -> int:
    """``python -m bench [SUITE ...]``: resolve the device, shapes and suites; list them
    (``--list``) or measure them suite by suite into one result document (rewritten after every
    case when ``--json`` names a file) and print the tables. Exit status 1 when an entry failed or
    the run was interrupted."""
    t0 = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    threads = args.threads or (None if use_cuda else 1)
    if threads:
        torch.set_num_threads(threads)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    notes: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        notes.append(line)

    ctx, suites = _run_context(args, parser, device, log)
    plans = {s: plan(ctx, s) for s in suites}
    if args.list:
        _print_list(ctx, suites, plans)
        return 0
    env = environment(argv, device)
    _resolve_outputs(args, env)
    _log_run(args, argv, ctx, suites, env, log)
    telemetry = Telemetry.disabled("--no-telemetry") if args.no_telemetry else Telemetry.create(device, log=log)
    timer = Timer(device, reps=args.reps, warmup=args.warmup, flush=not args.no_flush, telemetry=telemetry)
    ctx.timer = timer
    if any(SUITES[s].plan is not None for s in suites):
        ctx.roofs = measure_roofs(timer, ctx.dtype, log=log)
        for line in describe(ctx.roofs):
            log(line)
    if args.rounds:
        _use_rounds(args, ctx, telemetry, log)
    if not use_cuda:
        log("peak memory: not measured on CPU (reported as None)")
    doc = new_doc(env, _run_config(args, ctx, suites, timer, telemetry), ctx.roofs, notes)
    _run_suites(args, ctx, suites, plans, doc, t0, log)
    telemetry.close()
    print_layer_fractions(doc["results"])
    report.print_legend([r for r in doc["results"] if r["status"] == "ok"])
    return _write_outputs(args, doc, t0, log)


def _use_rounds(args, ctx: Context, telemetry: Telemetry, log) -> None:
    """--rounds N: the interleaved-rounds timer (bench.timing) and the roof pseudo-implementations
    for every comparison of the run."""
    from .roofs import GPU_COPY_BYTES, GPU_MATMUL_N
    from .suites import prepare_roofs
    from .timing import DeviceTimer, NvmlClock, backend_for, flop_per_clock_sm

    ctx.rounds = DeviceTimer(backend_for(ctx.device), NvmlClock.from_telemetry(telemetry), min_rounds=args.rounds,
                             min_device_s=0.5 if ctx.is_cuda else 0.0, max_rounds=max(args.rounds, 1000),
                             warmup_s=0.2 if ctx.is_cuda else 0.0)
    if ctx.is_cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        ctx.sms = int(props.multi_processor_count)
        ctx.flop_per_clock = flop_per_clock_sm(f"{props.major}.{props.minor}", dtype_name(ctx.dtype))
        nbytes = min(GPU_COPY_BYTES, max(torch.cuda.mem_get_info(ctx.device)[0] // 8, 2**20))
        ctx.roof_preps = prepare_roofs(ctx, ctx.rounds, matmul_n=GPU_MATMUL_N, copy_bytes=nbytes, dtype=torch.bfloat16)
    else:
        ctx.roof_preps = prepare_roofs(ctx, ctx.rounds, matmul_n=256, copy_bytes=4 * 2**20, dtype=torch.float32)
    log(f"method: interleaved rounds (>= {args.rounds}) with the roofs as pseudo-implementations")


def _run_context(args, parser, device: torch.device, log) -> tuple[Context, list[str]]:
    """The run's context (shapes, backends, baselines, options) and its suites, in order."""
    use_cuda = device.type == "cuda"
    dtype = args.dtype or (torch.bfloat16 if use_cuda else torch.float32)
    presets, chosen = resolve_presets(args, parser, device)
    suites = ([s for s in SUITE_ORDER if SUITES[s].default] if not args.suites else
              list(SUITE_ORDER) if "all" in args.suites else list(dict.fromkeys(args.suites)))
    backends = args.backend or (("triton", "torch") if use_cuda else ("torch",))
    baselines = DEFAULT_BASELINES if args.baselines is None else args.baselines
    ctx = Context(
        device=device, dtype=dtype, presets=presets, presets_chosen=chosen, tokens=args.tokens,
        routings=args.routing, backends=tuple(backends), baselines=tuple(baselines), seed=args.seed, log=log,
        ep_world_sizes=args.ep_world_sizes, ep_degrees=args.ep_degrees, ep_timeout_s=args.ep_timeout,
    )
    return ctx, suites


def _print_list(ctx: Context, suites: list[str], plans: dict) -> None:
    for s in suites:
        for line in SUITES[s].describe(ctx) if SUITES[s].describe is not None else ():
            print(f"{s}/{line}")
        for c in plans[s]:
            for e in c.entries:
                print(f"{s}/{c.label}/{e.mode} [{e.impl}]")
    print(f"{sum(count_entries(c) for c in plans.values())} entries")


def _resolve_outputs(args, env: dict) -> None:
    """--results-dir: <dir>/<gpu>-<date>.{json,md,png} where not named explicitly."""
    if args.results_dir:
        stem = Path(args.results_dir) / f"{slug(env['gpu_name'] or 'cpu')}-{env['date_utc'][:10]}"
        args.json = args.json or f"{stem}.json"
        args.markdown = args.markdown or f"{stem}.md"
        args.plot = args.plot or f"{stem}.png"


def _log_run(args, argv: list[str], ctx: Context, suites: list[str], env: dict, log) -> None:
    """The run's opening lines: the mode, the machine, what is measured."""
    if ctx.is_cuda:
        log(f"GPU MODE: {env['gpu_name']} (driver {env['driver']}, CUDA {env['cuda']}), torch {env['torch']}, "
            f"triton {env['triton']}")
    else:
        log("CPU MODE: no CUDA device in use; CPU wall-clock times say nothing about GPU kernel speed.")
        if not argv:
            log("default CPU set: tritonmoe's reference path (backend 'torch') and the plain-PyTorch baselines at "
                "the small preset, and the ep suite over gloo")
        log(f"torch {env['torch']}, triton {env['triton']}, {env['cpu_count']} CPUs, {env['torch_threads']} torch threads")
    log(f"suites {','.join(suites)}; presets {','.join(p.name for p in ctx.presets)}; dtype {dtype_name(ctx.dtype)}; "
        f"backends {','.join(ctx.backends)}; baselines {','.join(ctx.baselines) or 'none'}; reps {args.reps}, "
        f"warm-up {args.warmup}")
    if args.reps < DEFAULT_REPS:
        log(f"reps={args.reps} < {DEFAULT_REPS}: a quick run, the quantiles are rough")


def _run_config(args, ctx: Context, suites: list[str], timer: Timer, telemetry: Telemetry) -> dict:
    return {
        "suites": suites,
        "presets": [p.name for p in ctx.presets],
        "tokens": list(args.tokens) if args.tokens else None,
        "routings": [r.label for r in args.routing] if args.routing else None,
        "dtype": dtype_name(ctx.dtype),
        "backends": list(ctx.backends),
        "baselines": list(ctx.baselines),
        "reps": args.reps,
        "warmup": args.warmup,
        "l2_flush": timer.flushes,
        "seed": args.seed,
        "device": str(ctx.device),
        "telemetry": telemetry.enabled,
        "rounds": args.rounds,
    }


def _run_suites(args, ctx: Context, suites: list[str], plans: dict, doc: dict, t0: float, log) -> None:
    """Each suite in turn, its rows appended to ``doc`` (checkpointed after every case); the
    document is complete unless interrupted."""
    total = sum(count_entries(c) for c in plans.values())
    total += sum(len(SUITES[s].describe(ctx)) for s in suites if SUITES[s].describe is not None)
    progress_on = args.progress if args.progress is not None else (sys.stdout.isatty() and sys.stderr.isatty())
    progress = Progress(total, progress_on)

    def checkpoint() -> None:  # after every case: an interrupted or killed run keeps what it measured
        doc["wall_time_s"] = time.perf_counter() - t0
        if args.json:
            report.write_json(doc, args.json)

    for s in suites:
        ts = time.perf_counter()
        first = len(doc["results"])
        try:
            run_suite(ctx, s, plans[s], progress, sink=doc["results"], checkpoint=checkpoint)
        except KeyboardInterrupt:
            progress.clear()
            log(f"interrupted during suite {s}")
            break
        progress.clear()
        rows = doc["results"][first:]
        if not (SUITES[s].run and len(rows) == 1 and rows[0]["status"] == "unavailable"):  # else said in one line
            report.print_suite(rows, f"{s}: {SUITES[s].about}  [{time.perf_counter() - ts:.1f} s]")
        checkpoint()
    else:
        doc["complete"] = True


def _write_outputs(args, doc: dict, t0: float, log) -> int:
    """The closing count, the files asked for; the exit status."""
    doc["wall_time_s"] = time.perf_counter() - t0
    rows = doc["results"]
    n_ok = sum(r["status"] == "ok" for r in rows)
    n_un = sum(r["status"] == "unavailable" for r in rows)
    n_err = sum(r["status"] == "error" for r in rows)
    print()
    log(f"{len(rows)} entries: {n_ok} measured, {n_un} unavailable, {n_err} failed; "
        f"wall time {doc['wall_time_s']:.1f} s")
    if args.json:
        report.write_json(doc, args.json)
        print(f"results: {args.json}")
    if args.markdown:
        report.write_text_atomic(args.markdown, report.render_markdown(doc))
        print(f"markdown: {args.markdown}")
    if args.plot:
        msg = report.plot(doc, args.plot)
        print(msg or f"plot: {args.plot}")
    return 1 if n_err or not doc["complete"] else 0


def print_layer_fractions(rows: list[dict]) -> None:
    """Attach to the permute suite's metadata rows their fraction of the layer forward (when the
    layer suite measured the same shape) and print those rows again, now with the fraction."""
    meta = attach_layer_fractions(rows)
    if meta:
        report.print_suite(meta, f"permute metadata as a fraction of the MoELayer forward ({LAYER_FRACTION} = "
                           "metadata median / layer fwd median, same backend, shape, T and routing)")


def compare_main(argv: list[str]) -> int:
    args = build_compare_parser().parse_args(argv)
    docs = []
    for path in (args.a, args.b):
        try:
            docs.append(report.load_json(path))
        except (OSError, ValueError) as exc:  # unreadable, not JSON, or not matching the schema
            print(f"compare: {path}: {first_line(exc)}", file=sys.stderr)
            return 2
    text, _ = report.compare_docs(docs[0], docs[1], threshold=args.threshold)
    print(text)
    return 0


def report_main(argv: list[str]) -> int:
    args = build_report_parser().parse_args(argv)
    docs = []
    for path in args.paths:
        try:
            docs.append(report.load_json(path))
        except (OSError, ValueError) as exc:  # unreadable, not JSON, or not matching the schema
            print(f"report: {path}: {first_line(exc)}", file=sys.stderr)
            return 2
    doc = report.merge_docs(docs)
    attach_layer_fractions(doc["results"])  # also across files: permute and layer run separately
    for line in report.header_lines(doc):
        print(line)
    suites = list(dict.fromkeys(r["suite"] for r in doc["results"]))
    for s in suites:
        report.print_suite([r for r in doc["results"] if r["suite"] == s], s)
    if args.markdown:
        report.write_text_atomic(args.markdown, report.render_markdown(doc))
        print(f"markdown: {args.markdown}")
    if args.plot:
        msg = report.plot(doc, args.plot)
        print(msg or f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except BrokenPipeError:  # `python -m bench compare A B | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str]) -> int:
    if argv[:1] == ["faults"]:
        from . import faults

        return faults.main(argv[1:])
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    if argv[:1] == ["agree"]:
        from . import agreement

        return agreement.main(argv[1:])
    if argv[:1] == ["report"]:
        return report_main(argv[1:])
    if argv[:1] == ["check"]:
        from . import check

        return check.run_check(argv[1:])
    if argv[:1] == ["profile"]:
        from . import check

        return check.run_profile(argv[1:])
    if argv[:1] == ["host"]:
        from . import host

        return host.main(argv[1:])
    if argv[:1] == ["gpu-tests"]:
        from . import gpu_tests

        return gpu_tests.main(argv[1:])
    if argv[:1] == ["tune"]:
        from . import tune

        return tune.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.print_schema:
        import json

        print(json.dumps(schema.SCHEMA, indent=1))
        return 0
    if args.legend:
        print("Columns of the tables of python -m bench (a column with nothing to show is left out):")
        print("\n".join(report.legend_lines()))
        return 0
    return run(args, parser, argv)


if __name__ == "__main__":
    raise SystemExit(main())
