"""``make gpu-check`` / ``make gpu-profile``: the one-call GPU verification of tritonmoe.

``python -m bench check`` runs, in one process and in this order:

1. the ``gpu``-marked tests (:mod:`bench.gpu_tests`: ``pytest -m gpu`` split into up to 8
   concurrent pytest processes balanced by an estimate, one deadline for all; the merged summary
   goes to ``<gpu>-<date>-gpu-tests.{json,md}`` and its outcome into the final table);
2. the roofs (dense bf16 8192^3 matmul, 1 GiB device copy), a sentinel measurement
   (:mod:`bench.stability`: the grouped FFN forward at Mixtral-like T = 4096, again after the
   middle section and at the end; a drift over 5% marks the run unstable), and the harness's
   core set, section by section (:data:`SECTIONS`): the router, permute / unpermute row movement,
   the grouped FFN and ``moe_ffn`` forward and forward+backward beside ``torch._grouped_mm`` and
   Liger-Kernel's fused MoE, decode ``moe_ffn`` and the layer;
3. the targets (:mod:`bench.targets`, one table) judged on those rows;

writes ``<results-dir>/<gpu>-<date>.{json,md}`` (``<gpu>-<date>-2``, ``-3``, ... when that day already
has one; the harness's result schema plus a ``check`` object: tests, sections, targets,
stability, the commit measured) and prints the target table last.

The method (docs/benchmarking.md): each comparison (one case, one mode) builds its inputs once,
prepares every implementation (compile, >= 200 ms warm-up, ``N`` calls captured into a CUDA graph
so one replay lasts >= 1 ms; eager event timing where capture fails, and the row says so), and
times them in interleaved rounds with the roof GEMM and copy as pseudo-implementations
(:mod:`bench.rounds`): >= 100 rounds for the microsecond sections (route, permute, decode, with
the L2 flushed before each call and the flush subtracted), >= 30 rounds and 0.5 s of device time
per implementation for the millisecond ones (ffn, layer). Ratios and roof fractions are medians of
per-round ratios; rows carry the timing mode, rounds, min / median / p20 / p80, eager time, per-rep
SM clocks and throttle reasons (NVML, read-only), per-clock efficiency and the noisy flag.

Time budget on one H100 or H200 (a device call may run 10 minutes; the device script gives the
check about 4.5 of part one's 8). Estimates per section, after the untimed warm-up
(``--compile-only``) has compiled every kernel; they are estimates from the counts above until a
run's ``check.sections`` record measures them:

==========  =======  ==========================================================================
section     est. s   what dominates
==========  =======  ==========================================================================
startup         15   imports, CUDA context, roofs, the sentinel (3 x ~1 s)
tests          330   (cap; the device script runs them in part two instead: --skip-tests)
route           35   16 comparisons x (2 impls + 2 roofs) x 100 rounds of ~1 ms replays + flushes
permute         30   12 comparisons x 2-3 impls x 100 rounds; permute's fwd is eager (host sync)
ffn             70   8 comparisons x 2-4 impls, 30-50 rounds of 4-30 ms (0.5 s per impl)
decode          40   6 comparisons x 5 impls x 100 rounds of ~1 ms replays + flushes
layer           40   4 comparisons x 2 impls x 30 rounds of 10-300 ms
==========  =======  ==========================================================================

``--budget-s`` (default 530) bounds the whole command: a section whose estimate no longer fits
in what is left is skipped and says so (its targets read "not measured"), and inside a section
that overruns its estimate the cases that would start in the last 15 s are skipped, so the run
ends with its table and files (one case can still overrun by its own length). ``make gpu-tests``
runs the tests alone (one device call). The ``check.sections`` record of a result file has each
section's measured wall time to correct the estimates with.

Without a CUDA device it runs the same sections at CPU stand-in shapes on the reference path and
the torch baselines, in 3 wall-clock rounds (end to end in well under a minute), says that the GPU targets are skipped,
and writes result files only where ``--json`` / ``--markdown`` name them (``bench/results``
holds GPU results).

``python -m bench profile`` plans the same sections and runs each entry a few times under the
PyTorch profiler, printing the kernels it launched with their time per call.

The exit status is 0 when the tests passed (or were skipped) and every entry ran; unmet targets
are reported, not fatal, unless ``--strict``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import report, schema
from . import suites as S
from . import targets as TG
from .harness import Timer, environment, first_line, free_memory, new_row, quantile
from .presets import PRESETS, parse_routing
from .rounds import NOISY_SPREAD, run_rounds
from .roofs import GPU_COPY_BYTES, GPU_MATMUL_N, describe, dtype_name, measure_roofs
from .stability import Sentinel
from .telemetry import Telemetry
from .timing import CpuBackend, CudaBackend, DeviceTimer, NullClock, NvmlClock, flop_per_clock_sm

#: Seconds the whole ``check`` command may take by default (9 minutes minus a margin).
DEFAULT_BUDGET_S = 530.0
#: Seconds the gpu-marked tests may take by default.
DEFAULT_TESTS_TIMEOUT_S = 330.0
#: Seconds of the budget kept for the last case of a section and the report: inside a section,
#: cases that would start later than budget - CASE_RESERVE_S are skipped.
CASE_RESERVE_S = 15.0

UNIFORM = parse_routing("uniform")

#: The sentinel entry re-measured at the start, middle and end of the run (bench.stability).
SENTINEL_NAME = "ffn/grouped_ffn mixtral-8x7b-like T=4096 uniform/fwd [triton] (CPU: small T=64 [torch])"


@dataclass(frozen=True)
class Section:
    """A part of the core set: its cases, how many reps, what it is estimated to cost on a GPU.

    plan(ctx, gpu) -> cases (GPU shapes, or CPU stand-ins); modes / impls: the entries kept
    (None: all); est_gpu_s: estimated wall time on one H100/H200 with a cold Triton cache.
    """

    name: str
    about: str
    est_gpu_s: float
    reps: int
    warmup: int
    plan: Callable[[S.Context, bool], list[S.Case]]
    modes: tuple[str, ...] | None = None
    impls: tuple[str, ...] | None = None
    #: Interleaved rounds on a GPU (bench.timing / bench.rounds): the L2 flushed before every
    #: call and the flush subtracted (microsecond ops whose inputs fit in the L2), at least
    #: ``min_rounds`` rounds and ``min_device_s`` of device time per implementation.
    cold_l2: bool = False
    min_rounds: int = 30
    min_device_s: float = 0.5
    #: Reps that also time one eager call (10 for millisecond entries, whose eager call costs
    #: as much as their replay).
    eager_reps: int = 30

    def cases(self, ctx: S.Context, gpu: bool) -> list[S.Case]:
        out = []
        for case in self.plan(ctx, gpu):
            kept = [e for e in case.entries
                    if (self.modes is None or e.mode in self.modes) and (self.impls is None or e.impl in self.impls)]
            if kept:
                out.append(dataclasses.replace(case, entries=kept))
        return out


def _with(ctx: S.Context, **kw) -> S.Context:
    """A copy of the context with other backends / baselines (cases read them when planned)."""
    return dataclasses.replace(ctx, **kw)


def _backends(gpu: bool, *names: str) -> tuple[str, ...]:
    """The tritonmoe backends of a section: on CPU only the reference (the kernels would run in
    Triton's interpreter, which measures nothing)."""
    return tuple(names) if gpu else ("torch",)


def plan_route(ctx: S.Context, gpu: bool) -> list[S.Case]:
    """Router at T = 4096, 16384 with E = 128, 256, k = 8: softmax, and DeepSeek-V3-like (sigmoid,
    selection bias, 8 groups keep 4); the Triton kernels against the reference, and the softmax
    routers against torch.softmax + torch.topk (the floor of an eager router call)."""
    c = _with(ctx, backends=_backends(gpu, "triton", "torch"), baselines=("softmax_topk",))
    tokens = (4096, 16384) if gpu else (256,)
    shapes = [S.RouteShape(E, 8) for E in (128, 256)] + [S.RouteShape(E, 8, "sigmoid", True, 8, 4) for E in (128, 256)]
    return [S.route_case(c, shape, T, UNIFORM) for shape in shapes for T in tokens]


def plan_permute(ctx: S.Context, gpu: bool) -> list[S.Case]:
    """permute and unpermute at Mixtral-like and Qwen3-30B-A3B-like T = 16384 (x_perm 256 and
    512 MiB in bf16): the op, the row movement alone, and the metadata alone."""
    c = _with(ctx, backends=_backends(gpu, "triton", "torch"))
    runs = [(PRESETS["mixtral-8x7b-like"], 16384), (PRESETS["qwen3-30b-a3b-like"], 16384)] if gpu else \
        [(PRESETS["small"], 512)]
    out = []
    for p, T in runs:
        out += [S.permute_case(c, p, T, UNIFORM), S.unpermute_case(c, p, T, UNIFORM)]
    return out


def plan_ffn(ctx: S.Context, gpu: bool) -> list[S.Case]:
    """grouped_ffn and moe_ffn at Mixtral-like T = 16384 and Qwen3-30B-A3B-like T = 32768, against
    torch._grouped_mm (the reference path's fp32 GEMMs would take minutes here and are left out)."""
    if gpu:
        c = _with(ctx, backends=("triton",), baselines=("grouped_mm", "liger"))
        runs = [(PRESETS["mixtral-8x7b-like"], 16384), (PRESETS["qwen3-30b-a3b-like"], 32768)]
        return [case for p, T in runs for case in (S.grouped_ffn_case(c, p, T, UNIFORM), S.moe_ffn_case(c, p, T, UNIFORM))]
    c = _with(ctx, backends=("torch",), baselines=("grouped_mm", "loop"))
    return [S.grouped_ffn_case(c, PRESETS["small"], 128, UNIFORM)]


def plan_decode(ctx: S.Context, gpu: bool) -> list[S.Case]:
    """Decode: moe_ffn forward at T = 1, 8, 64 (Mixtral-like and Qwen3-30B-A3B-like), against
    torch._grouped_mm and the per-expert loop; bound by reading the active experts' weights."""
    presets = [PRESETS["mixtral-8x7b-like"], PRESETS["qwen3-30b-a3b-like"]] if gpu else [PRESETS["small"]]
    # on CPU the routed-FFN cases need a non-reference backend; "auto" is the reference there
    c = _with(ctx, backends=("triton",) if gpu else ("auto",),
              baselines=("grouped_mm", "loop", "liger") if gpu else ("grouped_mm", "loop"))
    return [S.moe_ffn_case(c, p, T, UNIFORM) for p in presets for T in (1, 8, 64)]


def plan_layer(ctx: S.Context, gpu: bool) -> list[S.Case]:
    """MoELayer forward and forward+backward at Mixtral-like T = 16384 and Qwen3-30B-A3B-like
    T = 32768 (Triton backend) against the per-expert loop layer."""
    c = _with(ctx, backends=_backends(gpu, "triton"), baselines=("loop",))
    runs = [(PRESETS["mixtral-8x7b-like"], 16384), (PRESETS["qwen3-30b-a3b-like"], 32768)] if gpu else \
        [(PRESETS["small"], 128)]
    return [S.layer_case(c, p, T, UNIFORM) for p, T in runs]


#: The core set, in run order.
SECTIONS: tuple[Section, ...] = (
    Section("route", "router forward and forward+backward", 35, reps=100, warmup=10, plan=plan_route,
            modes=("fwd", "fwd+bwd"), cold_l2=True, min_rounds=100, min_device_s=0.0),
    Section("permute", "permute / unpermute: the op, the row movement alone, the metadata", 30, reps=30, warmup=5,
            plan=plan_permute, cold_l2=True, min_rounds=100, min_device_s=0.0),
    Section("ffn", "grouped FFN and moe_ffn forward and forward+backward, beside torch._grouped_mm and Liger", 70,
            reps=10, warmup=2, plan=plan_ffn, eager_reps=10),
    Section("decode", "moe_ffn decode forward at T = 1, 8, 64", 40, reps=30, warmup=5, plan=plan_decode,
            modes=("fwd",), cold_l2=True, min_rounds=100, min_device_s=0.0),
    Section("layer", "MoELayer forward and forward+backward", 40, reps=10, warmup=2, plan=plan_layer, eager_reps=10),
)
SECTION_NAMES = tuple(s.name for s in SECTIONS)


# ---------------------------------------------------------------------------------------------
# What touches the device (replaced by a fake report in the tests)
# ---------------------------------------------------------------------------------------------


class Runner:
    """Measures on the real device: the environment record, the gpu-marked tests, the roofs and
    the cases (through :func:`bench.suites.run_case`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def environment(self, argv: list[str]) -> dict:
        return environment(["check", *argv], self.device)

    def run_tests(self, timeout_s: float, log: Callable[[str], None], out_prefix: str | None = None) -> dict:
        """The gpu-marked tests as concurrent pytest shards (:mod:`bench.gpu_tests`), all done
        within ``timeout_s``; the merged summary goes to ``<out_prefix>.{json,md}`` (shard logs in
        :func:`bench.gpu_tests.shard_logs_dir`: an ignored folder for bench/results). Returns :func:`tests_record` of it."""
        from . import gpu_tests as GT

        opt = GT.Options(python=sys.executable, deadline_s=timeout_s)
        measured = GT.load_measured(GT.newest_summary(Path(out_prefix).parent)) if out_prefix else {}
        log(f"tests: pytest -m gpu in up to {opt.shards} concurrent shards (deadline {timeout_s:.0f} s)")
        try:
            summary = GT.run(opt, out_prefix=out_prefix, log=log, measured=measured)
        except OSError as exc:
            return dict(status="not run", summary=first_line(exc), wall_s=0.0)
        return tests_record(summary)

    def clock(self) -> float:
        """Seconds on the clock the time budget is kept with."""
        return time.perf_counter()

    def telemetry(self, log: Callable[[str], None]) -> Telemetry:
        return Telemetry.create(self.device, log=log)

    def timer(self, reps: int, warmup: int, telemetry: Telemetry) -> Timer:
        return Timer(self.device, reps=reps, warmup=warmup, telemetry=telemetry)

    def roofs(self, ctx: S.Context) -> dict:
        return measure_roofs(Timer(self.device, reps=20, warmup=3), ctx.dtype, log=ctx.log)

    def run_case(self, ctx: S.Context, case: S.Case) -> list[dict]:
        return S.run_case(ctx, case)

    def device_timer(self, ctx: S.Context, telemetry: Telemetry, *, cold_l2: bool = False, min_rounds: int = 30,
                     min_device_s: float = 0.5, eager_reps: int = 30) -> DeviceTimer:
        """The interleaved-rounds timer: CUDA graphs, events and NVML clocks on a GPU; on CPU
        wall-clock rounds without warm-up (the stand-in shapes check the pipeline, not speed)."""
        if self.device.type == "cuda":
            return DeviceTimer(CudaBackend(self.device), NvmlClock.from_telemetry(telemetry), cold_l2=cold_l2,
                               min_rounds=min_rounds, min_device_s=min_device_s, max_rounds=max(min_rounds, 1000),
                               eager_reps=eager_reps)
        return DeviceTimer(CpuBackend(), NullClock(), warmup_s=0.0, min_rounds=min_rounds, min_device_s=0.0,
                           max_rounds=min_rounds)

    def round_roofs(self, ctx: S.Context, timer: DeviceTimer) -> dict:
        """The roof pseudo-implementations joining every comparison (8192^3 bf16 matmul and a
        1 GiB copy on a GPU; a 256^3 fp32 matmul and a 4 MiB copy on CPU)."""
        if self.device.type == "cuda":
            nbytes = min(GPU_COPY_BYTES, max(torch.cuda.mem_get_info(self.device)[0] // 8, 2**20))
            return S.prepare_roofs(ctx, timer, matmul_n=GPU_MATMUL_N, copy_bytes=nbytes, dtype=torch.bfloat16)
        return S.prepare_roofs(ctx, timer, matmul_n=256, copy_bytes=4 * 2**20, dtype=torch.float32)

    def device_info(self, ctx: S.Context) -> tuple[int | None, float | None]:
        """(SMs, peak dense FLOP per clock per SM in the run's dtype) for per-clock efficiency;
        (None, None) on CPU or an unknown architecture."""
        if self.device.type != "cuda":
            return None, None
        props = torch.cuda.get_device_properties(self.device)
        return int(props.multi_processor_count), flop_per_clock_sm(f"{props.major}.{props.minor}",
                                                                     dtype_name(ctx.dtype))

    def sentinel(self, ctx: S.Context, telemetry: Telemetry) -> Callable[[], dict] | None:
        """The sentinel's measurement (bench.stability): the grouped FFN forward, built afresh from
        the same seed each time, 30 rounds of the device timer."""
        gpu = self.device.type == "cuda"
        preset, T = (PRESETS["mixtral-8x7b-like"], 4096) if gpu else (PRESETS["small"], 64)
        c = _with(ctx, backends=("triton",) if gpu else ("torch",), baselines=())

        def measure() -> dict:
            case = S.grouped_ffn_case(c, preset, T, UNIFORM)
            entry = next(e for e in case.entries if e.mode == "fwd")
            timer = self.device_timer(ctx, telemetry, min_rounds=30 if gpu else 3, min_device_s=0.0)
            import tritonmoe as tm

            with tm.validation(False):
                state = case.build()
                fn, _ = entry.make(state)
                prep = timer.prepare("sentinel", fn)
                run_rounds(timer, [prep])
            times = sorted(r.device_s for r in prep.reps)
            mhz = [r.mhz for r in prep.reps if r.mhz]
            del state, fn, prep
            free_memory()
            return {"median_s": quantile(times, 0.5), "p20_s": quantile(times, 0.2), "p80_s": quantile(times, 0.8),
                    "mhz": quantile(sorted(mhz), 0.5) if mhz else None, "rounds": len(times)}

        return measure


def tests_record(summary: dict, max_failing: int = 60) -> dict:
    """What ``check.tests`` keeps of a :mod:`bench.gpu_tests` summary: status, one-line summary,
    wall time, counts per status, the shards, each test that did not pass (id, status, shard,
    message) and the files written."""
    return dict(status=summary["status"], summary=summary["summary"], wall_s=float(summary["wall_s"]),
                counts={k: n for k, n in summary.get("counts", {}).items() if n},
                shards=len(summary.get("shards", [])),
                failing=[{k: t[k] for k in ("id", "status", "shard", "message")}
                         for t in summary.get("failing", [])[:max_failing]],
                files=list(summary.get("files", [])))


def tests_lines(tests: dict, max_tests: int = 20) -> list[str]:
    """The tests' part of the final table: the outcome, then each test that did not pass."""
    where = f"; {tests['files'][1]}" if len(tests.get("files") or []) > 1 else ""
    shards = f", {tests['shards']} shards" if tests.get("shards") else ""
    out = [f"tests (pytest -m gpu{shards}): {tests['status']}: {tests['summary']}{where}"]
    failing = tests.get("failing") or []
    for t in failing[:max_tests]:
        msg = f": {t['message'][:120]}" if t.get("message") else ""
        out.append(f"  {t['status']:<9} [shard {t['shard']}] {t['id']}{msg}")
    if len(failing) > max_tests:
        out.append(f"  ... and {len(failing) - max_tests} more")
    return out


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------


def build_parser(prog: str = "python -m bench check") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Targets:\n" + "\n".join(f"  {t.name} {t.op} {t.goal:g}" for t in TG.TARGETS))
    p.add_argument("--sections", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   default=list(SECTION_NAMES), metavar="S,...",
                   help=f"sections to run (default all: {','.join(SECTION_NAMES)})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--results-dir", default="bench/results", metavar="DIR",
                   help="GPU mode: write <gpu>-<date>.json and .md here (-2, -3, ... after the date when that day "
                        "already has one; default bench/results)")
    p.add_argument("--json", metavar="PATH", help="write the results here (also in CPU mode)")
    p.add_argument("--markdown", metavar="PATH", help="write the markdown report here (also in CPU mode)")
    p.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked tests")
    p.add_argument("--tests-timeout-s", type=float, default=DEFAULT_TESTS_TIMEOUT_S)
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"wall-time budget of the whole command (default {DEFAULT_BUDGET_S:.0f} s): sections that "
                   "no longer fit are skipped")
    p.add_argument("--reps-scale", type=float, default=1.0, help="multiply every section's reps and, on a GPU, its minimum rounds (min 3)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is not met")
    p.add_argument("--list", action="store_true", help="print the planned entries and targets, then exit")
    p.add_argument("--compile-only", action="store_true",
                   help="the untimed warm-up: build every case and call every entry once (Triton compiles and "
                   "autotunes), time nothing, write nothing")
    return p


def _resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sections(names: list[str]) -> list[Section]:
    unknown = [n for n in names if n not in SECTION_NAMES]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {', '.join(SECTION_NAMES)}")
    return [s for s in SECTIONS if s.name in names]


def _context(device: torch.device, log: Callable[[str], None]) -> S.Context:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    return S.Context(device=device, dtype=dtype, presets=[], presets_chosen=True, backends=("torch",),
                     baselines=("loop", "grouped_mm"), log=log)


def _skipped_rows(case: S.Case, note: str) -> list[dict]:
    rows = []
    for e in case.entries:
        row = new_row(suite=case.suite, case=case.label, mode=e.mode, impl=e.impl, params=case.params)
        row["status"], row["note"] = "unavailable", note
        rows.append(row)
    return rows


@contextlib.contextmanager
def _cpu_threads(gpu: bool):
    """One torch thread in CPU mode (as ``python -m bench`` does: comparable across machines and
    robust to a shared one, where each parallel op can wait a scheduler quantum for its second
    thread); the previous count is restored afterwards."""
    before = torch.get_num_threads()
    if not gpu:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_check(argv: list[str], runner: Runner | None = None) -> int:
    """``python -m bench check``: parse ``argv``, then run on ``runner`` (the real device unless
    a test passes a fake one); the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    device = _resolve_device(args.device) if runner is None else runner.device
    with _cpu_threads(device.type == "cuda"):
        return _run_check(args, argv, device, runner or Runner(device))


@dataclass
class _Run:
    """The state of one check run shared by its steps: the arguments, the device runner, the
    context, the result document and where it is written, the log."""

    args: argparse.Namespace
    runner: Runner
    ctx: S.Context
    gpu: bool
    t0: float
    notes: list[str]
    doc: dict = dataclasses.field(default_factory=dict)
    paths: dict = dataclasses.field(default_factory=dict)

    def log(self, line: str) -> None:
        print(line, flush=True)
        self.notes.append(line)

    def elapsed(self) -> float:
        return self.runner.clock() - self.t0

    def checkpoint(self) -> None:
        """Rewrite the results file (after every case: an interrupted run keeps what it measured)."""
        self.doc["wall_time_s"] = self.elapsed()
        if self.paths.get("json"):
            report.write_json(self.doc, self.paths["json"])


def _run_check(args, argv: list[str], device: torch.device, runner: Runner) -> int:
    """The check's steps in order: list (``--list``) or compile only (``--compile-only``); else the
    environment, the tests, the roofs, the sentinel, the sections, the targets and the files."""
    gpu = device.type == "cuda"
    sections = _sections(args.sections)
    run = _Run(args, runner, None, gpu, runner.clock(), [])  # type: ignore[arg-type]
    run.ctx = _context(device, run.log)
    if args.list:
        _print_plan(run.ctx, sections, gpu)
        return 0
    if args.compile_only:
        return _compile_only(run, sections)
    env = runner.environment(argv)
    _log_mode(run, env)
    run.paths = _output_paths(args, env, gpu, run.log)
    tests = _run_tests(run)
    telemetry = runner.telemetry(run.log)
    run.ctx.roofs = runner.roofs(run.ctx)
    for line in describe(run.ctx.roofs):
        run.log(line)
    run.ctx.sms, run.ctx.flop_per_clock = runner.device_info(run.ctx)
    run.doc = {"schema_version": schema.SCHEMA_VERSION, "complete": False, "env": env,
               "config": _config(run, sections, telemetry), "roofs": run.ctx.roofs, "results": [],
               "notes": run.notes, "wall_time_s": 0.0}
    sentinel = Sentinel(SENTINEL_NAME, runner.sentinel(run.ctx, telemetry))
    _mark(run, sentinel, "start")
    run.ctx.roof_preps = runner.round_roofs(run.ctx, runner.device_timer(run.ctx, telemetry))
    section_log = []
    for i, sec in enumerate(sections):
        section_log.append(_run_section(run, sec, telemetry))
        if i == (len(sections) - 1) // 2:
            _mark(run, sentinel, "middle")
    run.ctx.roof_preps = {}
    free_memory()
    _mark(run, sentinel, "end")
    telemetry.close()
    free_memory()
    report.print_legend([r for r in run.doc["results"] if r["status"] == "ok"])
    return _finish(run, env, tests, section_log, sentinel)


def _print_plan(ctx: S.Context, sections: list[Section], gpu: bool) -> None:
    """``--list``: every section's entries and the targets."""
    for sec in sections:
        cases = sec.cases(ctx, gpu)
        print(f"[{sec.name}] {sec.about}: {sum(len(c.entries) for c in cases)} entries, rounds >= {sec.min_rounds}"
              f"{' (cold L2)' if sec.cold_l2 else ''}, est. {sec.est_gpu_s:.0f} s on a GPU")
        for c in cases:
            for e in c.entries:
                print(f"  {c.suite}/{c.label}/{e.mode} [{e.impl}]")
    for t in TG.TARGETS:
        print(f"target: {t.name} {t.op} {t.goal:g}")


def _compile_only(run: _Run, sections: list[Section]) -> int:
    """``--compile-only``: the untimed warm-up of the device script. Builds every case and calls
    every entry once (Triton compiles and autotunes, caches fill); nothing is timed or written.
    Exit status 0 (a failing entry is printed: the check proper records it)."""
    for sec in sections:
        t = run.runner.clock()
        n = 0
        for case in sec.cases(run.ctx, run.gpu):
            n += compile_case(run.ctx, case, run.log)
        run.log(f"compile-only: {sec.name}: {n} entries called once in {run.runner.clock() - t:.1f} s")
    return 0


def compile_case(ctx: S.Context, case: S.Case, log: Callable[[str], None]) -> int:
    """Build a case and call each entry once; the number of entries that ran."""
    import tritonmoe as tm

    ran = 0
    try:
        with tm.validation(False):
            state = case.build()
    except Exception as exc:  # the check proper records it on the rows
        log(f"  {case.label}: inputs not built ({first_line(exc)})")
        return 0
    for e in case.entries:
        try:
            with tm.validation(False):
                fn, _ = e.make(state)
                fn()
            ran += 1
        except Exception as exc:  # unavailable baselines and failures: one line, go on
            log(f"  {case.suite}/{case.label}/{e.mode} [{e.impl}]: {first_line(exc)}")
    del state
    free_memory()
    return ran


def _log_mode(run: _Run, env: dict) -> None:
    if run.gpu:
        run.log(f"GPU MODE: {env['gpu_name']} (driver {env['driver']}, CUDA {env['cuda']}), torch {env['torch']}, "
                f"triton {env['triton']}; commit {env['git_commit'] or 'unknown (set TRITONMOE_BENCH_COMMIT)'}"
                + (" (dirty)" if env.get("git_dirty") else ""))
    else:
        run.log("CPU MODE: no CUDA device. The gpu-marked tests are skipped and the GPU targets are not evaluated; "
                "the sections run at small CPU stand-in shapes on the reference path and the torch baselines, "
                "to check the pipeline end to end (times say nothing about GPU kernels).")


def _run_tests(run: _Run) -> dict:
    """The gpu-marked tests (GPU, unless --skip-tests), capped by what the budget leaves."""
    args = run.args
    if not run.gpu or args.skip_tests:
        return dict(status="skipped", summary="no CUDA device" if not run.gpu else "--skip-tests", wall_s=0.0)
    prefix = str(Path(run.paths["json"]).with_suffix("")) + "-gpu-tests" if run.paths["json"] else None
    tests = run.runner.run_tests(min(args.tests_timeout_s, max(30.0, args.budget_s - 120.0)), run.log, prefix)
    run.log(f"tests: {tests['status']} ({tests['summary']}) in {tests['wall_s']:.0f} s")
    return tests


def _config(run: _Run, sections: list[Section], telemetry: Telemetry) -> dict:
    ctx, gpu, args = run.ctx, run.gpu, run.args
    cases = [c for s in sections for c in s.cases(ctx, gpu)]
    return {
        "suites": sorted({c.suite for c in cases}),
        "presets": sorted({c.params.get("preset") or "" for c in cases} - {""}),
        "tokens": None,
        "routings": ["uniform"],
        "dtype": dtype_name(ctx.dtype),
        "backends": ["triton", "torch"] if gpu else ["torch"],
        "baselines": ["grouped_mm", "loop", "liger"] if gpu else ["grouped_mm", "loop"],
        "reps": max(s.reps for s in sections) if sections else 0,
        "warmup": max(s.warmup for s in sections) if sections else 0,
        "l2_flush": gpu,
        "seed": ctx.seed,
        "device": str(ctx.device),
        "telemetry": telemetry.enabled,
        "sections": [s.name for s in sections],
        "reps_per_section": {s.name: max(3, round(s.reps * args.reps_scale)) for s in sections},
        "method": "interleaved rounds" if gpu else "interleaved rounds (CPU wall clock)",
        "rounds_per_section": {s.name: _min_rounds(s, args, gpu) for s in sections},
        "cold_l2_sections": [s.name for s in sections if s.cold_l2],
    }


def _min_rounds(sec: Section, args, gpu: bool) -> int:
    return max(3, round(sec.min_rounds * args.reps_scale)) if gpu else 3


def _mark(run: _Run, sentinel: Sentinel, at: str) -> None:
    point = sentinel.mark(at)
    if point is not None:
        run.log(f"sentinel {at}: " + (f"{point['median_s'] * 1e6:.1f} us" if "median_s" in point else point["error"]))


def _run_section(run: _Run, sec: Section, telemetry: Telemetry) -> dict:
    """One section: skipped when its estimate no longer fits the budget; else its cases in
    interleaved rounds, each case skipped once the budget's reserve is reached. Its record."""
    args, ctx, gpu = run.args, run.ctx, run.gpu
    left = args.budget_s - run.elapsed()
    cases = sec.cases(ctx, gpu)
    rec = dict(name=sec.name, estimate_s=sec.est_gpu_s, wall_s=0.0, entries=sum(len(c.entries) for c in cases))
    if gpu and left < sec.est_gpu_s:
        note = (f"skipped: time budget ({left:.0f} s left of --budget-s {args.budget_s:.0f}, section estimated "
                f"at {sec.est_gpu_s:.0f} s)")
        run.log(f"{sec.name}: {note}")
        for c in cases:
            run.doc["results"].extend(_skipped_rows(c, note))
        return dict(rec, status="skipped")
    reps = max(3, round(sec.reps * args.reps_scale))
    ctx.timer = run.runner.timer(reps if gpu else 3, sec.warmup if gpu else 1, telemetry)
    ctx.rounds = run.runner.device_timer(ctx, telemetry, cold_l2=sec.cold_l2, min_rounds=_min_rounds(sec, args, gpu),
                                         min_device_s=sec.min_device_s if gpu else 0.0, eager_reps=sec.eager_reps)
    ts = run.runner.clock()
    first = len(run.doc["results"])
    for case in cases:
        if gpu and run.elapsed() > args.budget_s - CASE_RESERVE_S:
            # a section that overruns its estimate must not take the final table with it
            note = f"skipped: time budget (--budget-s {args.budget_s:.0f} reached inside section {sec.name})"
            run.doc["results"].extend(_skipped_rows(case, note))
            continue
        run.doc["results"].extend(run.runner.run_case(ctx, case))
        run.checkpoint()
    ctx.rounds = None
    rows = run.doc["results"][first:]
    rec.update(wall_s=run.runner.clock() - ts, status="ran")
    report.print_suite(rows, f"{sec.name}: {sec.about}  [{rec['wall_s']:.1f} s, est. {sec.est_gpu_s:.0f} s on a GPU]")
    noisy = [r["name"] + f" [{r['impl']}]" for r in rows if (r.get("timing") or {}).get("noisy")]
    if noisy:
        run.log(f"{sec.name}: noisy (p80/p20 > {NOISY_SPREAD:.2f}): {', '.join(noisy)}")
    return rec


def _finish(run: _Run, env: dict, tests: dict, section_log: list[dict], sentinel: Sentinel) -> int:
    """Judge the targets, write the files, print the final table; the exit status."""
    doc, gpu = run.doc, run.gpu
    results = TG.evaluate(doc["results"], run.ctx.roofs,
                          skipped_reason=None if gpu else "CPU mode: GPU targets need an H100/H200")
    n_err = sum(r["status"] == "error" for r in doc["results"])
    doc["check"] = {"commit": env.get("git_commit"), "dirty": env.get("git_dirty"), "tests": tests,
                    "sections": section_log, "targets": results, "summary": TG.summary(results)}
    stability = sentinel.record()
    if stability is not None:
        doc["check"]["stability"] = stability
    doc["complete"] = True
    doc["wall_time_s"] = run.elapsed()
    if run.paths["json"]:
        report.write_json(doc, run.paths["json"])
        print(f"results: {run.paths['json']}")
    if run.paths["markdown"]:
        report.write_text_atomic(run.paths["markdown"], render_markdown(doc))
        print(f"markdown: {run.paths['markdown']}")
    counts = TG.summary(results)
    print()
    print(f"== targets ({env.get('gpu_name') or 'CPU'}, commit {env.get('git_commit') or 'unknown'}"
          f"{' dirty' if env.get('git_dirty') else ''}; tests {tests['status']}; {n_err} entries failed; "
          f"wall {doc['wall_time_s']:.0f} s)")
    print(TG.render_text(results))
    print(", ".join(f"{n} {k}" for k, n in counts.items()))
    for line in tests_lines(tests):
        print(line)
    print(sentinel.line())
    if not gpu:
        print("CPU MODE: GPU targets skipped (run `make gpu-check` on an H100/H200).")
    failed = tests["status"] in ("failed", "timed out") or n_err > 0
    if run.args.strict and counts.get("not met", 0) + counts.get("not measured", 0):
        failed = True
    return 1 if failed else 0


def _output_paths(args, env: dict, gpu: bool, log: Callable[[str], None]) -> dict:
    if gpu:
        from bench.gpu_tests import free_stem

        stem = free_stem(Path(args.results_dir) / f"{_slug(env.get('gpu_name') or 'gpu')}-{env['date_utc'][:10]}")
        return {"json": args.json or f"{stem}.json", "markdown": args.markdown or f"{stem}.md"}
    if not (args.json or args.markdown):
        log(f"CPU mode: nothing written to {args.results_dir} (it holds GPU results); --json / --markdown keep a copy")
    return {"json": args.json, "markdown": args.markdown}


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def render_markdown(doc: dict) -> str:
    """The check's report: what was measured where, the target table, the tests and sections,
    then the harness's tables."""
    chk = doc["check"]
    env = doc["env"]
    out = [f"# tritonmoe gpu-check: {env.get('gpu_name') or 'CPU'}, {env['date_utc'][:10]}", ""]
    out += [f"- {line}" for line in report.header_lines(doc)]
    out += [f"- tests (pytest -m gpu): {chk['tests']['status']} ({chk['tests']['summary']}, "
            f"{chk['tests']['wall_s']:.0f} s)"]
    out += [f"  - {t['status']} [shard {t['shard']}] `{t['id']}`" + (f": {t['message'][:160]}" if t.get("message") else "")
            for t in chk["tests"].get("failing") or []]
    out += [f"- wall time {doc['wall_time_s']:.0f} s; sections: "
            + ", ".join(f"{s['name']} {s['status']} {s['wall_s']:.0f} s (est. {s['estimate_s']:.0f})"
                        for s in chk["sections"]), ""]
    out += ["## Targets", "", TG.render_markdown(chk["targets"]), ""]
    body = report.render_markdown(doc).split("\n", 1)[1]  # the harness's tables, without its title
    return "\n".join(out) + body


# ---------------------------------------------------------------------------------------------
# Profile
# ---------------------------------------------------------------------------------------------


def build_profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench profile",
                                description="The gpu-check shapes under the PyTorch profiler: the kernels each entry "
                                "launches and their time per call.")
    p.add_argument("--sections", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   default=list(SECTION_NAMES), metavar="S,...")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--reps", type=int, default=5, help="profiled calls per entry (after 2 warm-up calls)")
    p.add_argument("--top", type=int, default=8, help="kernels listed per entry")
    p.add_argument("--impls", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                   metavar="I,...", help="only these implementations (default: all, baselines included)")
    return p


def kernel_table(prof, reps: int, top: int, on_gpu: bool) -> list[tuple[str, int, float]]:
    """(kernel name, launches per call, microseconds per call) of the profiled calls, by time.
    On CPU: the aten ops' self CPU time instead of kernels."""
    rows = []
    for ev in prof.key_averages():
        if on_gpu:
            t = getattr(ev, "self_device_time_total", None)
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0.0)
        else:
            t = ev.self_cpu_time_total
        if t and t > 0:
            rows.append((ev.key, ev.count / reps, t / reps))
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def profile_case(ctx: S.Context, case: S.Case, reps: int, top: int, impls) -> None:
    from torch.profiler import ProfilerActivity, profile

    import tritonmoe as tm

    on_gpu = ctx.device.type == "cuda"
    try:
        with tm.validation(False):
            state = case.build()
    except Exception as exc:  # e.g. out of memory for the inputs
        print(f"{case.label}: inputs not built ({first_line(exc)})")
        return
    for e in case.entries:
        if impls and e.impl not in impls:
            continue
        head = f"{case.suite}/{case.label}/{e.mode} [{e.impl}]"
        try:
            with tm.validation(False):
                fn, _ = e.make(state)
                for _ in range(2):
                    fn()
                if on_gpu:
                    torch.cuda.synchronize()
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
                with profile(activities=acts) as prof:
                    for _ in range(reps):
                        fn()
                    if on_gpu:
                        torch.cuda.synchronize()
        except Exception as exc:  # unavailable baselines, failures: one line, go on
            print(f"\n{head}: not profiled ({first_line(exc)})")
            continue
        table = kernel_table(prof, reps, top, on_gpu)
        total = sum(t for _, _, t in kernel_table(prof, reps, 10**6, on_gpu))
        unit = "kernels" if on_gpu else "CPU ops (self time)"
        print(f"\n{head}: {total:.1f} us per call in {unit}")
        for name, n, t in table:
            print(f"  {t:10.1f} us  {100 * t / total if total else 0:5.1f}%  x{n:<5.3g} {name[:110]}")
    del state
    free_memory()


def run_profile(argv: list[str]) -> int:
    args = build_profile_parser().parse_args(argv)
    device = _resolve_device(args.device)
    gpu = device.type == "cuda"
    ctx = _context(device, print)
    if not gpu:
        print("CPU MODE: no CUDA device; profiling the CPU stand-in shapes (aten ops, not GPU kernels).")
    with _cpu_threads(gpu):
        for sec in _sections(args.sections):
            print(f"\n==== {sec.name}: {sec.about}")
            for case in sec.cases(ctx, gpu):
                profile_case(ctx, case, max(1, args.reps), args.top, args.impls)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_check(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
