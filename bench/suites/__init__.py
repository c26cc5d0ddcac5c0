"""The benchmark suites: what is measured, at which shapes, against what.

One module per suite (:mod:`.route`, :mod:`.permute`, :mod:`.ffn`, :mod:`.layer`, :mod:`.gemm`,
:mod:`.ep` with ``plan``, :mod:`.processes` for lina, memory and inference), their shared
helpers in :mod:`.common`, the case runner in :mod:`.runner`, and the registry here.

Every suite measures tritonmoe through its public API (``tritonmoe.route``, ``permute``,
``unpermute``, ``grouped_ffn``, ``moe_ffn`` when present, ``MoELayer``) once per backend asked
for (``triton``: the kernels, ``torch``: the reference path, ``auto``), beside the baselines of
:mod:`bench.baselines` on the same inputs in the same process.

A suite plans a list of :class:`Case` (one problem: shape, token count, routing) whose inputs
are built only when the case runs; each case holds :class:`Entry` items (one mode and one
implementation). ``fwd`` is an inference forward (under ``torch.no_grad()``); ``fwd+bwd`` is a
forward and ``torch.autograd.grad`` of the outputs, with a fixed random output gradient, with
respect to every differentiable input (no gradient accumulation into ``.grad``). Value checks
of the public API are switched off while timing (``tritonmoe.validation(False)``), as a
training loop would. The permute suite's ``metadata`` mode times the routing metadata alone
(ids -> counts, offsets, slot rows; no row moved): ``tritonmoe.kernels.permute.permute_metadata``
for backend ``triton`` against ``tritonmoe.reference.permute_metadata`` for ``torch``. After a
run with the layer suite, :func:`attach_layer_fractions` gives each metadata row the fraction of
the MoELayer forward (same backend, shape, token count and routing) it takes. Its ``move`` mode
times the row movement alone, the metadata precomputed and the row count known:
``tritonmoe.kernels.permute.permute_rows`` (one scatter kernel) against
``tritonmoe.reference.permute_rows``; ``fwd`` of the permute op includes the metadata kernels
and the host sync that reads R, and unpermute's ``fwd`` is movement alone (one gather).

An implementation that cannot run here (``backend="triton"`` for an op without a kernel yet,
``torch._grouped_mm`` missing or not supporting the dtype) is recorded as "unavailable" with
the reason; a failure of any other kind is recorded as "error"; neither stops the run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from .common import (
    METADATA,
    MODES,
    MOVE,
    Case,
    Context,
    Entry,
    Impl,
    active_experts,
    backend_impls,
    case_params,
    ffn_weights,
    grad_fn,
    grouped_mm_check,
    leaf,
    make_entries,
    make_routing,
    no_grad_fn,
    parse_routing,
    require_backend,
)
from .ep import describe_ep, ep_cases, ep_rows, load_ep, run_ep_suite, run_plan_rows
from .ffn import grouped_ffn_case, moe_ffn_case, plan_ffn
from .gemm import plan_gemm
from .layer import layer_case, plan_layer, skew_router
from .permute import (
    LAYER_FRACTION,
    attach_layer_fractions,
    gather_split_impls,
    metadata_entries,
    metadata_impl,
    move_entries,
    permute_case,
    plan_permute,
    rows_impl,
    unpermute_case,
)
from .processes import (
    describe_inference,
    describe_lina,
    describe_memory,
    run_inference_suite,
    run_lina_suite,
    run_memory_suite,
)
from .route import (
    ROUTE_GRID_EXPERTS,
    ROUTE_GRID_TOKENS,
    ROUTE_GRID_TOPK,
    RouteShape,
    plan_route,
    route_case,
    route_shapes,
)
from .runner import fill_round_row, measure_in_rounds, prepare_roofs, run_case


def _run_parm_suite(ctx: Context, progress=None) -> list[dict]:
    return importlib.import_module("bench.parm").run_parm_suite(ctx, progress)


def _run_fp8_suite(ctx: Context, progress=None) -> list[dict]:
    return importlib.import_module("bench.fp8").run_fp8_suite(ctx, progress)


@dataclass(frozen=True)
class Suite:
    """A suite either plans cases (run entry by entry by :func:`run_case`) or runs itself
    (``run(ctx, progress) -> rows``, for suites whose ranks are separate processes; ``describe``
    lists its runs). ``default``: part of the run when no suite is named."""

    name: str
    about: str
    plan: Callable[[Context], list[Case]] | None = None
    run: Callable[..., list[dict]] | None = None
    describe: Callable[[Context], list[str]] | None = None
    default: bool = True  # part of `python -m bench` without suite names


SUITES: dict[str, Suite] = {
    s.name: s
    for s in [
        Suite("route", "router: scores, (grouped) top-k, weights, counts; forward and forward+backward", plan=plan_route),
        Suite("permute", "token permutation and weighted unpermutation; forward and forward+backward; the "
              "row movement alone (mode move) and the routing metadata alone (mode metadata)", plan=plan_permute),
        Suite("ffn", "grouped expert FFN over a permuted buffer (grouped_ffn); with a non-reference backend also "
              "the routed FFN x -> out (fused moe_ffn vs permute + grouped_ffn + unpermute)", plan=plan_ffn),
        Suite("layer", "MoELayer forward (inference) and forward+backward", plan=plan_layer),
        Suite("gemm", "grouped-GEMM kernel variants (tile, persistent TMA) vs torch._grouped_mm, forward; GPU only",
              plan=plan_gemm),
        Suite("fp8", "FP8 experts (e4m3 block-128 / rowwise) vs our bf16 kernels and torch._scaled_grouped_mm: "
              "moe_ffn and grouped_ffn forward, speed and accuracy; GPU only, not default", run=_run_fp8_suite,
              default=False),
        Suite("ep", "expert parallelism over torch.distributed (gloo on CPU): dispatch/combine all-to-all "
              "and the layer per world size and pipeline degree", run=run_ep_suite, describe=describe_ep),
        Suite("parm", "Parm's schedules of an MP+EP+ESP layer over gloo, and the pick of parm_schedule='auto'", run=_run_parm_suite, default=False),
        Suite("plan", "simulator fidelity: a cost model fitted here vs the measured expert-parallel layer (gloo, "
              "2 and 4 ranks, degrees 1-8), and the planner's choice (bench/plan_fidelity.py; ~10 min, not default)",
              run=run_plan_rows, default=False),
        Suite("memory", "MPMoE's memory strategies on the expert-parallel layer over gloo (2 ranks): fwd+bwd time "
              "and saved bytes (saved_tensors_hooks) per strategy vs 'keep'; not default", run=run_memory_suite,
              describe=describe_memory, default=False),
        Suite("lina", "Lina's priority communication vs FIFO over gloo (2 ranks): an all-to-all beside a gradient "
              "reduction, and training steps (all-to-all slowdown, step time); not default", run=run_lina_suite,
              describe=describe_lina, default=False),
        Suite("inference", "Lina's replicate-and-pack placement vs EPLB and the contiguous layout (balance, latency on "
              "gloo and in the simulator), popularity estimation, ring-memory offloading (host, disk); not default",
              run=run_inference_suite, describe=describe_inference, default=False),
    ]
}

SUITE_ORDER = tuple(SUITES)


def plan(ctx: Context, suite: str) -> list[Case]:
    s = SUITES[suite]
    return s.plan(ctx) if s.plan is not None else []


def run_suite(
    ctx: Context,
    suite: str,
    cases: list[Case] | None = None,
    progress=None,
    *,
    sink: list[dict] | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> list[dict]:
    """Run a suite's cases (planned now unless given). Rows are appended to ``sink`` case by case
    and ``checkpoint()`` is called after each case, so an interrupted run keeps what it measured;
    the suite's rows are also returned."""
    rows: list[dict] = [] if sink is None else sink
    first = len(rows)
    s = SUITES[suite]
    if s.run is not None:
        rows.extend(s.run(ctx, progress))
    else:
        for case in cases if cases is not None else plan(ctx, suite):
            rows.extend(run_case(ctx, case, progress))
            if checkpoint is not None:
                checkpoint()
    return rows[first:]


def count_entries(cases: list[Case]) -> int:
    return sum(len(c.entries) for c in cases)


__all__ = [
    "LAYER_FRACTION",
    "METADATA",
    "MODES",
    "MOVE",
    "ROUTE_GRID_EXPERTS",
    "ROUTE_GRID_TOKENS",
    "ROUTE_GRID_TOPK",
    "SUITES",
    "SUITE_ORDER",
    "Case",
    "Context",
    "Entry",
    "Impl",
    "RouteShape",
    "Suite",
    "active_experts",
    "attach_layer_fractions",
    "backend_impls",
    "case_params",
    "count_entries",
    "describe_ep",
    "describe_inference",
    "describe_lina",
    "describe_memory",
    "ep_cases",
    "ep_rows",
    "ffn_weights",
    "fill_round_row",
    "gather_split_impls",
    "grad_fn",
    "grouped_ffn_case",
    "grouped_mm_check",
    "layer_case",
    "leaf",
    "load_ep",
    "make_entries",
    "make_routing",
    "measure_in_rounds",
    "metadata_entries",
    "metadata_impl",
    "moe_ffn_case",
    "move_entries",
    "no_grad_fn",
    "parse_routing",
    "permute_case",
    "plan",
    "plan_ffn",
    "plan_gemm",
    "plan_layer",
    "plan_permute",
    "plan_route",
    "prepare_roofs",
    "require_backend",
    "route_case",
    "route_shapes",
    "rows_impl",
    "run_case",
    "run_ep_suite",
    "run_inference_suite",
    "run_lina_suite",
    "run_memory_suite",
    "run_suite",
    "skew_router",
    "unpermute_case",
]
