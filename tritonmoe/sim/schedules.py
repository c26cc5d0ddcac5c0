"""What the planner can choose: schedules and candidate dimensions (two small registries).

A **schedule** (:class:`ScheduleSpec`) issues one rank's MoE layer step (forward and backward)
into a :class:`~tritonmoe.plan.SimExecutor`, given a :class:`RankStep` (the rank, its
:class:`~tritonmoe.comm.DispatchPlan`, its token count, the :class:`~tritonmoe.sim.work.WorkModel`
and the candidate being evaluated). The expert block must be issued by the *same* schedule
functions the layer runs (``comm.pipeline.forward_pass`` / ``backward_pass`` for the pipelined
expert-parallel path), so what is simulated is what runs; the local prologue and epilogue
(router GEMM, routing, permute, unpermute and their backward) are compute ops with the work of
the real kernels.

A **dimension** (:class:`Dimension`) is one axis of the candidate space: a name, the values
to try for a planning context, and the schedules that read it. :func:`tritonmoe.plan.choose`
evaluates the cartesian product of the dimensions that apply (each candidate is a dict
``{dimension name: value}``, always with ``"schedule"``).

How a scheduler issue plugs in (memory strategies, Parm's schedules, Lina's priority,
hierarchical all-to-all):

1. Write the schedule as executor calls in ``comm/`` (it then runs on the real executor too).
2. ``register_schedule(ScheduleSpec("name", build, applies=..., dimensions=("pipeline_degree",
   ...)))`` where
   ``build(ex, step)`` issues the step, calling the new schedule functions for the expert block
   and reading its parameters from ``step.candidate`` (e.g. ``step.candidate["memory_strategy"]``).
3. ``register_dimension(Dimension("memory_strategy", values, schedules=("name",), applies=...))``
   for each new parameter; ``values(ctx)`` may depend on the context, and ``applies(ctx)`` leaves
   the dimension out where it does not apply (e.g. no model-parallel group). The planner, ``simulate(..., candidate={...})`` and the CLI
   pick it up; the runtime ``"auto"`` mode chooses whatever dimensions the layer can apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from tritonmoe.comm.executor import VirtualTensor, Work
from tritonmoe.comm.programs.pipeline import backward_pass, forward_pass
from tritonmoe.comm.splits import DispatchPlan

from tritonmoe.sim.executor import SimExecutor, VirtualGroup
from tritonmoe.sim.work import WorkModel
from tritonmoe.sim.memory_ops import issue_memory_ops
from tritonmoe.comm.programs.memory_reuse import STRATEGIES

__all__ = [
    "RankStep",
    "PlanContext",
    "ScheduleSpec",
    "Dimension",
    "SCHEDULES",
    "DIMENSIONS",
    "register_schedule",
    "register_dimension",
    "build_ep_pipeline",
    "dimensions_of",
    "build_sequential",
    "DEFAULT_DEGREES",
]

#: Pipeline degrees the planner tries by default (MPMoE limits granularity to [2, 8]; 1 is the
#: unpipelined baseline).
DEFAULT_DEGREES = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclass
class PlanContext:
    """What a dimension's candidate values may depend on."""

    config: Any
    tokens_per_rank: tuple[int, ...]
    world_size: int
    cost: Any
    dtype: torch.dtype
    overrides: Mapping[str, Sequence[Any]] = field(default_factory=dict)


@dataclass
class RankStep:
    """One rank's step, as a schedule builder sees it.

    Attributes:
        config: the layer's MoEConfig; ``rank``, ``world``: this rank and the EP group.
        tokens: this rank's token count; ``bounds``: its micro-batches' token ranges.
        plan: the :class:`~tritonmoe.comm.DispatchPlan` this rank would get from the counts
            exchange; ``dtype``: the activations' dtype; ``work``: the ops' :class:`WorkModel`.
        defer_wgrad: the expert GEMMs defer their weight gradients to the W step.
        candidate: the candidate evaluated (``{dimension: value}``).
    """

    config: Any
    rank: int
    world: VirtualGroup
    tokens: int
    bounds: list[tuple[int, int]]
    plan: DispatchPlan
    dtype: torch.dtype
    work: WorkModel
    defer_wgrad: bool
    candidate: Mapping[str, Any]

    @property
    def n(self) -> int:
        return self.plan.num_micro_ops

    def expert_stats(self) -> tuple[list[int], list[int], list[int]]:
        """Per micro-op: rows received, active local experts, non-empty (source, expert)
        segments of the received buffer."""
        rc = self.plan.recv_counts  # [N, P, L]
        rows = rc.sum(dim=(1, 2)).tolist()
        active = (rc.sum(dim=1) > 0).sum(dim=1).tolist()
        segs = (rc > 0).sum(dim=(1, 2)).tolist()
        return rows, active, segs


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule: ``build(ex, step)`` issues one rank's step; ``applies(ctx)``
    says whether it can run the context's layout; ``dimensions``: registered dimensions it
    reads (besides those that name it in :attr:`Dimension.schedules`)."""

    name: str
    build: Callable[[SimExecutor, RankStep], None]
    applies: Callable[[PlanContext], bool] = lambda ctx: True
    doc: str = ""
    dimensions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Dimension:
    """A candidate dimension: ``values(ctx)`` to try (``ctx.overrides[name]`` replaces them),
    read by the schedules named in ``schedules`` (empty: all) and by those that list it in
    :attr:`ScheduleSpec.dimensions`."""

    name: str
    values: Callable[[PlanContext], Sequence[Any]]
    schedules: tuple[str, ...] = ()
    doc: str = ""
    #: whether the dimension is part of the candidates for ``ctx`` (a dimension that does not
    #: apply is left out of every candidate unless ``ctx.overrides`` names it)
    applies: Callable[[PlanContext], bool] = lambda ctx: True


SCHEDULES: dict[str, ScheduleSpec] = {}
DIMENSIONS: dict[str, Dimension] = {}


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Add (or replace) a schedule the planner can choose."""
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"register_schedule takes a ScheduleSpec, got {type(spec).__name__}")
    SCHEDULES[spec.name] = spec
    return spec


def dimensions_of(schedule: str) -> list[Dimension]:
    """The registered dimensions a schedule reads, in registration order."""
    spec = SCHEDULES[schedule]
    return [d for d in DIMENSIONS.values() if not d.schedules or schedule in d.schedules or d.name in spec.dimensions]


def register_dimension(dim: Dimension) -> Dimension:
    """Add (or replace) a candidate dimension."""
    if not isinstance(dim, Dimension):
        raise TypeError(f"register_dimension takes a Dimension, got {type(dim).__name__}")
    if dim.name == "schedule":
        raise ValueError("'schedule' is the built-in dimension of registered schedules")
    DIMENSIONS[dim.name] = dim
    return dim


# ---------------------------------------------------------------------------------------------
# The expert-parallel layer step with the micro-op pipeline (what ExpertParallelExperts runs)
# ---------------------------------------------------------------------------------------------


def prologue(ex: SimExecutor, st: RankStep) -> list:
    """Router GEMM, routing, one permute per micro-batch, the counts exchange and its host sync
    (the split sizes are host values). Returns the micro-ops' send buffers (handles)."""
    W, T, d, dt = st.work, st.tokens, st.config.d_model, st.dtype
    ex.compute(None, work=W.router(T, backward=False), kind="router", out=VirtualTensor((T, st.config.num_experts), dt))
    ex.compute(None, work=W.route(T, backward=False), kind="route")
    sends = []
    for i, (a, b) in enumerate(st.bounds):
        R = st.plan.send_rows(i)
        sends.append(ex.compute(None, work=W.permute(b - a, R, backward=False), kind="permute", micro_op=i,
                                out=VirtualTensor((R, d), dt)))
    P, L, n = st.world.size, st.plan.num_local_experts, st.n
    counts = ex.all_to_all(VirtualTensor((P, n * L), torch.int64), [1] * P, [1] * P, kind="counts", after=sends)
    ex.host_sync(counts)
    return sends


def backward_prologue(ex: SimExecutor, st: RankStep) -> list:
    """The layer output's backward down to the expert block: unpermute backward per micro-batch
    (autograd runs the last-created first). Returns the gradients of the send buffers."""
    W, d, dt = st.work, st.config.d_model, st.dtype
    grads: list = [None] * st.n
    for i in reversed(range(st.n)):
        a, b = st.bounds[i]
        R = st.plan.send_rows(i)
        grads[i] = ex.compute(None, work=W.unpermute(b - a, R, backward=True), kind="unpermute", micro_op=i,
                              out=VirtualTensor((R, d), dt))
    return grads


def backward_epilogue(ex: SimExecutor, st: RankStep) -> None:
    """Permute backward per micro-batch, the input gradient's accumulation, routing and router
    backward."""
    W, T, d = st.work, st.tokens, st.config.d_model
    for i in reversed(range(st.n)):
        a, b = st.bounds[i]
        ex.compute(None, work=W.permute(b - a, st.plan.send_rows(i), backward=True), kind="permute", micro_op=i)
    ex.compute(None, work=W.accumulate(T * d * st.work.s), kind="grad_x")
    ex.compute(None, work=W.route(T, backward=True), kind="route")
    ex.compute(None, work=W.router(T, backward=True), kind="router")


def build_ep_pipeline(ex: SimExecutor, st: RankStep) -> None:
    """``ExpertParallelExperts`` with ``pipeline_degree = len(st.bounds)``: prologue, the
    pipelined expert block through ``comm.pipeline.forward_pass`` / ``backward_pass`` (the
    functions the layer's autograd block calls), unpermute, and the backward."""
    W, d, dt, plan = st.work, st.config.d_model, st.dtype, st.plan
    rows, active, segs = st.expert_stats()
    L = plan.num_local_experts
    sends = prologue(ex, st)
    like = lambda i: VirtualTensor((rows[i], d), dt)  # noqa: E731
    strategy = st.candidate.get("memory_strategy")
    mem = None
    if strategy is not None:  # MPMoE's memory reuse and restores (tritonmoe.comm.programs.memory_reuse)

        mem = issue_memory_ops(ex, st, strategy, rows)
    fwd_work = (lambda i: W.expert_fwd(rows[i], active[i], segs[i])) if mem is None else \
        (lambda i: W.expert_fwd(rows[i], active[i], segs[i]) + mem["extra_fwd_work"](i))
    forward_pass(ex, sends, plan, None, work=fwd_work, out_like=like,
                 pre_compute=mem["fwd_pre"] if mem is not None else None,
                 post_compute=mem["fwd_post"] if mem is not None else None)
    for i, (a, b) in enumerate(st.bounds):
        ex.compute(None, work=W.unpermute(b - a, plan.send_rows(i), backward=False), kind="unpermute", micro_op=i)
    if st.n > 1:
        ex.compute(None, work=W.cat(st.tokens), kind="cat")
    ex.phase = "bwd"
    grads = backward_prologue(ex, st)
    total_rows = sum(rows)
    any_active = int((plan.recv_counts.sum(dim=(0, 1)) > 0).sum())
    wstep = W.wgrad_step(total_rows, any_active) if st.defer_wgrad else Work(0.0, 0.0, "elementwise", 1)
    def bwd_work(i: int) -> Work:
        w = W.expert_bwd(rows[i], active[i], segs[i], defer_wgrad=st.defer_wgrad, accumulate=i > 0, local_experts=L)
        return w if mem is None else w + mem["extra_bwd_work"](i)

    backward_pass(
        ex, grads, plan, None, work=bwd_work, out_like=like, weight_step_work=wstep,
        prefetch=mem["bwd_prefetch"] if mem is not None else None,
        pre_compute=mem["bwd_pre"] if mem is not None else None,
        post_compute=mem["bwd_post"] if mem is not None else None,
    )
    backward_epilogue(ex, st)


def build_sequential(ex: SimExecutor, st: RankStep) -> None:
    """MPMoE's "seq(n)" baseline (004 Fig. 16): the same n micro-ops, dispatch -> expert ->
    combine each waited for before the next starts (partitioned, not overlapped). A simulator
    baseline for calibration, not a schedule the layer runs."""
    W, d, dt, plan = st.work, st.config.d_model, st.dtype, st.plan
    rows, active, segs = st.expert_stats()
    sends = prologue(ex, st)

    def one_pass(bufs, kinds, work):
        for i in range(st.n):
            h = ex.all_to_all(bufs[i], plan.send_splits[i], plan.recv_splits[i], kind=kinds[0], micro_op=i)
            ex.wait(h)
            y = ex.compute(None, h, work=work(i), kind="expert", micro_op=i, out=VirtualTensor((rows[i], d), dt))
            ex.wait(ex.all_to_all(y, plan.recv_splits[i], plan.send_splits[i], kind=kinds[1], micro_op=i))

    one_pass(sends, ("dispatch", "combine"), lambda i: W.expert_fwd(rows[i], active[i], segs[i]))
    for i, (a, b) in enumerate(st.bounds):
        ex.compute(None, work=W.unpermute(b - a, plan.send_rows(i), backward=False), kind="unpermute", micro_op=i)
    if st.n > 1:
        ex.compute(None, work=W.cat(st.tokens), kind="cat")
    ex.phase = "bwd"
    grads = backward_prologue(ex, st)
    L = plan.num_local_experts
    one_pass(grads, ("combine", "dispatch"),
             lambda i: W.expert_bwd(rows[i], active[i], segs[i], defer_wgrad=False, accumulate=i > 0, local_experts=L))
    backward_epilogue(ex, st)


def _expert_parallel(ctx: PlanContext) -> bool:
    return ctx.config.num_experts % ctx.world_size == 0


def _degrees(ctx: PlanContext) -> Sequence[int]:
    top = max(1, min(ctx.tokens_per_rank)) if ctx.tokens_per_rank else 1
    return [n for n in DEFAULT_DEGREES if n == 1 or n <= top]


register_schedule(ScheduleSpec(
    "ep-pipeline", build_ep_pipeline, _expert_parallel,
    "expert parallelism with the micro-op pipeline of comm.pipeline (Lina / MPMoE), degree = pipeline_degree",
))
register_schedule(ScheduleSpec(
    "ep-sequential", build_sequential, lambda ctx: False,
    "MPMoE's seq(n): the same micro-ops, not overlapped (a calibration baseline; never chosen by default)",
))
register_dimension(Dimension(
    "pipeline_degree", _degrees, ("ep-pipeline", "ep-sequential"),
    "micro-batches of the expert-parallel pipeline",
))


def _memory_strategies(ctx: PlanContext) -> Sequence[str]:
    """The layer's memory strategy, or all five when it is "auto"."""

    s = getattr(ctx.config, "memory_strategy", None)
    return tuple(STRATEGIES) if s == "auto" else (s,)


def _mi_buffers(ctx: PlanContext) -> Sequence[int]:
    """The config's shared MI buffer count (``memory_mi_buffers``)."""
    return (getattr(ctx.config, "memory_mi_buffers", 1),)


register_dimension(Dimension(
    "memory_mi_buffers", _mi_buffers, ("ep-pipeline",),
    "shared MI buffers of a memory reuse strategy (MoEConfig.memory_mi_buffers: 1, the paper's single T_M, or 2, "
    "double-buffered); only in the candidates when named, e.g. choose(..., candidates_override="
    "{'memory_mi_buffers': [1, 2]}); the simulator reads the config's count otherwise",
    applies=lambda ctx: False,
))
register_dimension(Dimension(
    "memory_strategy", _memory_strategies, ("ep-pipeline",),
    "MPMoE's memory reuse and restore strategy of the pipelined expert block (tritonmoe.comm.programs.memory_reuse); candidates "
    "over a memory budget (MoEConfig.memory_budget_bytes or choose(memory_budget_bytes=)) are rejected",
    applies=lambda ctx: getattr(ctx.config, "memory_strategy", None) is not None,
))
