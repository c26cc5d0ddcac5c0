"""Simulate one MoE layer step (forward + backward) of every rank of a virtual cluster.

:func:`simulate` builds each rank's :class:`~tritonmoe.comm.DispatchPlan` from synthetic routing
counts (:func:`routing_counts`; no process group, no tensors of full size), records the step of
the candidate's schedule (:mod:`tritonmoe.sim.schedules`; by default the expert-parallel
pipeline through the same ``comm.pipeline`` functions the layer runs) into a
:class:`~tritonmoe.plan.SimExecutor` per rank, and runs the discrete-event engine
(:mod:`tritonmoe.sim.engine`) on a cost model. The result is a :class:`SimTimeline`: the
:class:`~tritonmoe.comm.Timeline` of every rank with ``step_time()`` and ``breakdown()``.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from tritonmoe.comm.splits import plan_from_counts
from tritonmoe.comm.timeline import Span, Timeline

from tritonmoe.sim import engine as _engine
from tritonmoe.sim.cost_model import Cluster
from tritonmoe.sim.cost_model import CostModel
from tritonmoe.sim.schedules import SCHEDULES, RankStep
from tritonmoe.sim.executor import SimExecutor, VirtualGroup
from tritonmoe.sim.work import WorkModel
from tritonmoe.comm.programs.pipeline import micro_batch_bounds
from tritonmoe import reference
from tritonmoe.backends import implementation

__all__ = ["SimTimeline", "simulate", "routing_counts", "resolve_cost", "expert_probabilities", "parse_dtype"]

#: Above this many ranks, mode "auto" simulates one representative rank (engine's symmetric mode).
FULL_MODE_MAX_RANKS = 64

_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
}


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).replace("torch.", "").lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(sorted(set(_DTYPES)))}") from None


class SimTimeline(Timeline):
    """A simulated step: every rank's spans (a :class:`~tritonmoe.comm.Timeline`) plus what
    produced them: ``candidate``, ``world_size``, ``tokens_per_rank``, ``cost`` (the
    :class:`CostModel`), ``result`` (the engine's :class:`~tritonmoe.sim.engine.EngineResult`,
    with every op's issue/start/end) and ``symmetric`` (one representative rank simulated).

    Spans are made from the engine's timings when first read (planning needs only
    :meth:`step_time`)."""

    def __init__(self, result: Optional[_engine.EngineResult] = None) -> None:
        super().__init__()
        self.candidate: dict = {}
        self.world_size = 0
        self.tokens_per_rank: tuple[int, ...] = ()
        self.cost: Optional[CostModel] = None
        self.result = result
        self.symmetric = False
        self._spans: Optional[list[Span]] = None

    def _all_spans(self) -> list[Span]:
        if self._spans is None:
            out = [Span(s.kind, s.micro_op, s.phase, s.start, s.end, s.lane, s.rank) for s in super().spans()]
            if self.result is not None:
                for prog in self.result.programs:
                    for o, t in zip(prog.ops, self.result.timings[prog.rank]):
                        out.append(Span(o.kind, o.micro_op, o.phase, t.start, t.end, o.lane, prog.rank))
            out.sort(key=lambda s: (s.start, s.end))
            self._spans = out
        return self._spans

    def spans(self, phase: Optional[str] = None, since: int = 0) -> list[Span]:  # noqa: D102 - Timeline's contract
        return [s for s in self._all_spans()[since:] if phase is None or s.phase == phase]

    def add(self, span: Span) -> None:  # noqa: D102
        super().add(span)
        self._spans = None

    def clear(self) -> None:  # noqa: D102
        super().clear()
        self.result, self._spans = None, None

    def step_time(self, phase: Optional[str] = None) -> float:  # noqa: D102 - Timeline's contract
        if phase is None and self.result is not None and not super().spans():
            return self.result.step_time()
        return super().step_time(phase)


def resolve_cost(cluster_or_cost: Any, dtype: Optional[Union[str, torch.dtype]] = None) -> CostModel:
    """A :class:`CostModel` from a Cluster (derived for ``dtype``), a CostModel, or a path to a
    cost-model file."""
    if isinstance(cluster_or_cost, CostModel):
        return cluster_or_cost
    if isinstance(cluster_or_cost, Cluster):
        return cluster_or_cost.cost_model(str(parse_dtype(dtype or "bfloat16")).replace("torch.", ""))
    if isinstance(cluster_or_cost, (str, os.PathLike)):
        return CostModel.load(cluster_or_cost)
    raise TypeError(
        f"cluster_or_cost must be a tritonmoe.plan.Cluster, a CostModel or a cost-model file path, got "
        f"{type(cluster_or_cost).__name__}"
    )


def expert_probabilities(routing: Any, num_experts: int, top_k: int) -> torch.Tensor:
    """fp64 [E]: the expected number of a token's k slots that go to each expert (sums to k,
    each <= 1 since a token picks an expert at most once).

    ``routing``: "uniform", "zipf:S" (expert e drawn in proportion to 1/(e+1)^S, the hottest
    experts on the first ranks), or a length-E sequence of popularity weights."""
    E, k = num_experts, top_k
    if isinstance(routing, str):
        if routing == "uniform":
            p = torch.ones(E, dtype=torch.float64)
        elif routing.startswith("zipf:"):
            try:
                s = float(routing.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"routing {routing!r}: zipf:S needs a number S, e.g. zipf:1.2") from None
            if not (math.isfinite(s) and s >= 0):
                raise ValueError(f"routing {routing!r}: S must be finite and >= 0")
            p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
        else:
            raise ValueError(f"routing={routing!r}: use 'uniform', 'zipf:S' or a sequence of E popularity weights")
    else:
        p = torch.as_tensor(routing, dtype=torch.float64).flatten()
        if p.numel() != E or bool((p < 0).any()) or float(p.sum()) <= 0:
            raise ValueError(f"routing weights must be {E} non-negative numbers with a positive sum")
    q = p / p.sum() * k
    for _ in range(E):  # cap at 1 per token, give the excess to the others in proportion
        over = q > 1
        if not bool(over.any()):
            break
        excess = float((q[over] - 1).sum())
        q[over] = 1.0
        free = ~over & (q < 1)
        if not bool(free.any()):
            break
        q[free] += excess * q[free] / q[free].sum()
    return q


def _largest_remainder(target: torch.Tensor, total: int) -> torch.Tensor:
    """Integers summing to ``total`` close to the fp64 ``target`` (ties to the lower index)."""
    base = torch.floor(target).to(torch.int64)
    rest = int(total - int(base.sum()))
    if rest > 0:
        frac = target - base.to(torch.float64)
        order = torch.sort(-frac, stable=True).indices[:rest]
        base[order] += 1
    return base


def routing_counts(config: Any, tokens_per_rank: Sequence[int], n: int, routing: Any = "uniform") -> torch.Tensor:
    """int64 [P, n, E]: rows each rank sends to each expert in each micro-batch, for the expected
    routing of ``routing`` (deterministic: largest-remainder rounding of the expected counts),
    after capacity (computed, as the layer does, from each rank's own token count), with the
    micro-batches being ``tritonmoe.experts.micro_batch_bounds`` of each rank's tokens.

    ``routing`` may also be the counts: an integer tensor [P, n, E], or a callable ``n -> [P, n,
    E]`` (e.g. the routing of a measured run, for every degree the planner tries)."""

    E, k = config.num_experts, config.top_k
    if callable(routing) or isinstance(routing, torch.Tensor):  # the counts themselves
        c = routing(n) if callable(routing) else routing
        if not isinstance(c, torch.Tensor) or tuple(c.shape) != (len(tokens_per_rank), n, E) or c.dtype.is_floating_point:
            raise ValueError(
                f"routing counts must be an integer tensor [ranks={len(tokens_per_rank)}, micro_ops={n}, experts={E}], "
                f"got {getattr(c, 'dtype', type(c).__name__)} {tuple(getattr(c, 'shape', ()))}"
            )
        return c.to(torch.int64)
    q = expert_probabilities(routing, E, k)
    cache: dict[int, torch.Tensor] = {}
    rows = []
    for T in tokens_per_rank:
        if T not in cache:
            c_E = _largest_remainder(q * T, T * k) if T > 0 else torch.zeros(E, dtype=torch.int64)
            c_E = torch.minimum(c_E, torch.tensor(T))
            cap = config.capacity(T)
            if cap is not None:
                c_E = torch.clamp(c_E, max=cap)
            bounds = micro_batch_bounds(T, n)
            share = torch.tensor([b - a for a, b in bounds], dtype=torch.float64)
            if T > 0:
                # per expert e, split its c_e rows over the micro-batches in proportion to their
                # tokens (largest remainder per column, ties to the earlier micro-batch)
                target = share[:, None] / T * c_E[None, :].to(torch.float64)  # [n, E]
                out = torch.floor(target).to(torch.int64)
                rest = c_E - out.sum(0)  # [E]
                frac = target - out.to(torch.float64)
                order = torch.sort(-frac, dim=0, stable=True).indices
                rank = torch.empty_like(order)
                rank.scatter_(0, order, torch.arange(n).unsqueeze(1).expand(n, E).contiguous())
                out += (rank < rest[None, :]).to(torch.int64)
                out = torch.minimum(out, share.to(torch.int64)[:, None])
            else:
                out = torch.zeros(n, E, dtype=torch.int64)
            cache[T] = out
        rows.append(cache[T])
    return torch.stack(rows)


def _is_int(v: Any) -> bool:
    import numbers

    return isinstance(v, numbers.Integral) and not isinstance(v, bool) or (
        isinstance(v, torch.Tensor) and v.dim() == 0 and not v.dtype.is_floating_point
    )


def _tokens(tokens_per_rank: Any, world_size: Optional[int], cost: CostModel) -> tuple[int, ...]:
    if isinstance(tokens_per_rank, (list, tuple)) or (isinstance(tokens_per_rank, torch.Tensor) and tokens_per_rank.dim() == 1):
        toks = tuple(int(t) for t in tokens_per_rank)
        if world_size is not None and world_size != len(toks):
            raise ValueError(f"world_size={world_size} but tokens_per_rank has {len(toks)} entries")
    else:
        if not _is_int(tokens_per_rank):
            raise TypeError(f"tokens_per_rank must be an int or a sequence of ints, got {type(tokens_per_rank).__name__}")
        P = world_size
        if P is None:
            if cost.cluster is None:
                raise ValueError("world_size is required with a fitted cost model and one token count")
            P = cost.cluster.num_gpus
        toks = (int(tokens_per_rank),) * int(P)
    if not toks or any(t < 0 for t in toks):
        raise ValueError(f"tokens per rank must be >= 0 (got {toks[:8]}{'...' if len(toks) > 8 else ''})")
    return toks


def kernel_flags(config: Any, dtype: torch.dtype, cost: CostModel) -> tuple[bool, bool]:
    """(the layer's expert FFN runs the Triton kernels, its GEMMs defer weight gradients) on the
    device the cost model describes (CPU host model: CPU tensors; else CUDA)."""

    device = torch.device("cpu" if cost.host_compute else "cuda")
    try:
        ffn = implementation("grouped_ffn", config.backend, device, dtype)
    except (NotImplementedError, RuntimeError):
        ffn = reference.grouped_ffn
    kernels = ffn is not reference.grouped_ffn
    defers = bool(getattr(ffn, "defers_weight_grad", False)) and (kernels or dtype == torch.float64)
    return kernels, defers


def build_programs(
    config: Any,
    tokens: Sequence[int],
    cost: CostModel,
    candidate: Mapping[str, Any],
    *,
    routing: Any = "uniform",
    dtype: torch.dtype,
    ranks: Optional[Sequence[int]] = None,
) -> list:
    """The :class:`~tritonmoe.plan.Program` of each of ``ranks`` (default: all) for one step."""

    P = len(tokens)
    spec = SCHEDULES.get(candidate["schedule"])
    if spec is None:
        raise ValueError(f"unknown schedule {candidate['schedule']!r}; registered: {', '.join(SCHEDULES)}")
    n = int(candidate.get("pipeline_degree", 1))
    if n < 1:
        raise ValueError(f"pipeline_degree={n} must be >= 1")
    counts = routing_counts(config, tokens, n, routing)
    kernels, defers = kernel_flags(config, dtype, cost)
    s = torch.empty((), dtype=dtype).element_size()
    W = WorkModel(config.d_model, config.d_ffn, config.n1, config.num_experts, config.top_k, s, kernels)
    world = VirtualGroup(tuple(range(P)))
    progs = []
    for r in (range(P) if ranks is None else ranks):
        plan = plan_from_counts(counts, r)
        step = RankStep(config, r, world, tokens[r], micro_batch_bounds(tokens[r], n), plan, dtype, W, defers, candidate)
        ex = SimExecutor(r, world, host_compute=cost.host_compute)
        spec.build(ex, step)
        progs.append(ex.program)
    return progs


def simulate(
    config: Any,
    tokens_per_rank: Union[int, Sequence[int]],
    cluster_or_cost: Any,
    *,
    world_size: Optional[int] = None,
    routing: Any = "uniform",
    pipeline_degree: Optional[int] = None,
    candidate: Optional[Mapping[str, Any]] = None,
    dtype: Optional[Union[str, torch.dtype]] = None,
    mode: str = "auto",
) -> SimTimeline:
    """Simulate the expert-parallel layer's forward + backward of one step on every rank.

    Args:
        config: a :class:`tritonmoe.MoEConfig` (widths, experts, top-k, capacity, activation).
        tokens_per_rank: tokens entering the layer on each rank (one int for all, or P ints).
        cluster_or_cost: a :class:`~tritonmoe.plan.Cluster`, a :class:`~tritonmoe.plan.CostModel`
            or the path of a cost-model file.
        world_size: P (default: the cluster's GPUs, or ``len(tokens_per_rank)``).
        routing: "uniform", "zipf:S", E popularity weights (:func:`expert_probabilities`), or the
            counts themselves (:func:`routing_counts`).
        pipeline_degree: the degree to simulate (default: ``config.pipeline_degree`` when it is
            an int, else 1); shorthand for ``candidate={"pipeline_degree": n}``.
        candidate: values of the registered dimensions (:mod:`tritonmoe.sim.schedules`),
            e.g. ``{"schedule": "ep-pipeline", "pipeline_degree": 4}``.
        dtype: activation dtype (default: the cost model's).
        mode: "full" (every rank), "symmetric" (one representative rank: the most loaded;
            exact when ranks are symmetric, see :mod:`tritonmoe.sim.engine`) or "auto" (full
            up to :data:`FULL_MODE_MAX_RANKS` ranks).

    Returns: a :class:`SimTimeline` (``.step_time()``, ``.breakdown()``, ``.pipeline_efficiency()``).
    """
    cost = resolve_cost(cluster_or_cost, dtype)
    dt = parse_dtype(dtype or cost.dtype)
    toks = _tokens(tokens_per_rank, world_size, cost)
    P = len(toks)
    E = config.num_experts
    if E % P:
        raise ValueError(f"num_experts={E} is not divisible by world_size={P}; use a world size dividing {E}")
    cand = dict(candidate or {})
    cand.setdefault("schedule", "ep-pipeline")
    if pipeline_degree is not None:
        cand["pipeline_degree"] = pipeline_degree
    elif "pipeline_degree" not in cand:
        cand["pipeline_degree"] = config.pipeline_degree if isinstance(config.pipeline_degree, int) else 1
    if mode not in ("auto", "full", "symmetric"):
        raise ValueError(f"mode={mode!r}: use 'auto', 'full' or 'symmetric'")
    if P > 1 and cost.cluster is None:
        cost.check_group_size(P, ("all_to_all",), cost.link_class(range(P)))
    symmetric = mode == "symmetric" or (mode == "auto" and P > FULL_MODE_MAX_RANKS and cost.cpu_share() is None)
    ranks = None
    if symmetric:
        n = int(cand.get("pipeline_degree", 1))
        counts = routing_counts(config, toks, n, routing)
        L = E // P
        received = counts.sum(dim=(0, 1)).view(P, L).sum(-1) + torch.tensor(toks)  # load: rows in + tokens
        ranks = [int(torch.argmax(received))]
    progs = build_programs(config, toks, cost, cand, routing=routing, dtype=dt, ranks=ranks)
    res = _engine.run(progs, cost, symmetric=symmetric, timeline=False)
    tl = SimTimeline(res)
    tl.candidate, tl.world_size, tl.tokens_per_rank = cand, P, toks
    tl.cost, tl.result, tl.symmetric = cost, res, symmetric
    return tl
