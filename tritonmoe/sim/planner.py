"""The planner: evaluate candidate schedules in the simulator and pick the fastest.

:func:`choose` enumerates the candidates of the registered schedules and dimensions
(:mod:`tritonmoe.sim.schedules`: today the pipeline degree of the expert-parallel pipeline;
the scheduler issues add memory strategies, Parm's schedules, Lina's chunk size and flat or
hierarchical all-to-all), simulates each (:func:`tritonmoe.sim.simulate`) and returns a
:class:`Plan` with the predicted step time of every candidate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from tritonmoe.sim.schedules import DIMENSIONS, SCHEDULES, PlanContext, dimensions_of
from tritonmoe.sim.simulate import _tokens, parse_dtype, resolve_cost, simulate
from tritonmoe.sim.memory_model import MemoryBudgetError, _rows_per_rank, expert_block_bytes
from tritonmoe.comm.programs.memory_reuse import STRATEGIES

__all__ = ["Candidate", "Plan", "choose", "candidates"]


@dataclass
class Candidate:
    """One evaluated candidate: its values, predicted step time (seconds) and, when asked for,
    the step-time breakdown of the slowest rank (:meth:`tritonmoe.comm.Timeline.breakdown`)."""

    values: dict
    step_time: float
    breakdown: Optional[dict] = None
    #: with a memory strategy: the expert block's predicted saved bytes on the most loaded rank
    #: (:func:`tritonmoe.sim.memory_model.expert_block_bytes`) and, over the budget, why it was rejected
    device_bytes: Optional[int] = None
    rejected: Optional[str] = None


@dataclass
class Plan:
    """The planner's answer.

    Attributes:
        choice: the chosen candidate's values (``{"schedule": ..., "pipeline_degree": ...}``).
        step_time: its predicted layer forward+backward time (seconds).
        candidates: every evaluated :class:`Candidate`, in evaluation order.
        tokens_per_rank, world_size, routing: what was planned for; ``cost_source``: the cost
            model's source (a file, a cluster).
    """

    choice: dict
    step_time: float
    candidates: list[Candidate] = field(default_factory=list)
    tokens_per_rank: tuple[int, ...] = ()
    world_size: int = 0
    routing: Any = "uniform"
    cost_source: str = ""
    budget_bytes: Optional[int] = None

    @property
    def pipeline_degree(self) -> int:
        return int(self.choice.get("pipeline_degree", 1))

    @property
    def memory_strategy(self) -> Optional[str]:
        """The chosen memory strategy (None: the dimension was not planned)."""
        return self.choice.get("memory_strategy")

    @property
    def rejected(self) -> list[Candidate]:
        """Candidates over the memory budget (each with its predicted bytes and step time)."""
        return [c for c in self.candidates if c.rejected is not None]

    def table(self) -> str:
        """The candidates as an aligned text table, the choice marked (with a memory strategy:
        the predicted saved bytes, and why a candidate was rejected)."""
        names = list(dict.fromkeys(k for c in self.candidates for k in c.values))
        mem = any(c.device_bytes is not None for c in self.candidates)
        head = [*names, *(["saved MiB"] if mem else []), "step ms", "vs best"]
        rows = []
        for c in self.candidates:
            mark = " <- chosen" if c.values == self.choice else (f"  rejected: {c.rejected}" if c.rejected else "")
            mib = [("-" if c.device_bytes is None else f"{c.device_bytes / 2**20:.2f}")] if mem else []
            rows.append([str(c.values.get(k, "")) for k in names] + mib
                        + [f"{c.step_time * 1e3:.3f}", f"{c.step_time / self.step_time:.3f}x{mark}"])
        widths = [max(len(h), *(len(r[i].split(' <-')[0].split('  rejected')[0]) for r in rows))
                  for i, h in enumerate(head)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(v.rjust(w) if i < len(widths) - 1 else v for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
        return "\n".join(lines)


def candidates(ctx: PlanContext) -> list[dict]:
    """Every candidate of the registered schedules that apply to ``ctx`` (``ctx.overrides``
    replaces a dimension's values, and ``overrides["schedule"]`` the schedules)."""
    scheds = list(ctx.overrides.get("schedule", [n for n, s in SCHEDULES.items() if s.applies(ctx)]))
    for s in scheds:
        if s not in SCHEDULES:
            raise ValueError(f"unknown schedule {s!r}; registered: {', '.join(SCHEDULES)}")
    unknown = [k for k in ctx.overrides if k != "schedule" and k not in DIMENSIONS]
    if unknown:
        raise ValueError(f"unknown candidate dimension(s) {unknown}; registered: {', '.join(DIMENSIONS)}")
    out = []
    for s in scheds:
        dims = [d for d in dimensions_of(s) if d.name in ctx.overrides or d.applies(ctx)]
        axes = []
        for d in dims:
            vals = list(ctx.overrides[d.name]) if d.name in ctx.overrides else list(d.values(ctx))
            if not vals:
                raise ValueError(f"dimension {d.name!r} has no candidate values for this context")
            axes.append((d.name, vals))
        for combo in itertools.product(*(v for _, v in axes)):
            out.append({"schedule": s, **{name: val for (name, _), val in zip(axes, combo)}})
    if not out:
        raise ValueError(
            "no registered schedule applies to this layer and world size (e.g. num_experts not divisible by the "
            "world size)"
        )
    return out


def choose(
    config: Any,
    tokens_per_rank: Union[int, Sequence[int]],
    cluster_or_cost: Any,
    *,
    world_size: Optional[int] = None,
    routing: Any = "uniform",
    candidates_override: Optional[Mapping[str, Sequence[Any]]] = None,
    dtype: Optional[Union[str, torch.dtype]] = None,
    mode: str = "auto",
    breakdown: bool = True,
    memory_budget_bytes: Optional[int] = None,
    **overrides: Sequence[Any],
) -> Plan:
    """Simulate every candidate and return the fastest as a :class:`Plan`.

    Args:
        config, tokens_per_rank, cluster_or_cost, world_size, routing, dtype, mode: as
            :func:`tritonmoe.sim.simulate`.
        candidates_override / ``**overrides``: values to try per dimension, replacing the
            registered defaults, e.g. ``choose(..., pipeline_degree=(1, 2, 4, 8))`` or
            ``memory_strategy=("keep", "recompute")``.
        breakdown: record every candidate's step-time breakdown (default; False skips it, e.g. at
            run time where only the choice is read).
        memory_budget_bytes: device bytes the expert block may keep for backward on the most
            loaded rank (default ``config.memory_budget_bytes``); candidates over it are
            rejected (reported with their bytes and step time). A budget makes the memory
            strategy a dimension (all five) when neither the config nor an override names it.

    Raises:
        MemoryBudgetError: (a ValueError) no candidate fits the budget.

    Ties go to the candidate evaluated first (the smaller degree)."""

    budget = memory_budget_bytes if memory_budget_bytes is not None else getattr(config, "memory_budget_bytes", None)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"memory_budget_bytes must be a positive int or None, got {budget!r}")
    cost = resolve_cost(cluster_or_cost, dtype)
    dt = parse_dtype(dtype or cost.dtype)
    toks = _tokens(tokens_per_rank, world_size, cost)
    ov = dict(candidates_override or {})
    ov.update(overrides)
    if budget is not None and "memory_strategy" not in ov and getattr(config, "memory_strategy", None) is None:

        ov["memory_strategy"] = STRATEGIES
    ctx = PlanContext(config, toks, len(toks), cost, dt, ov)
    es = torch.empty((), dtype=dt).element_size()
    results = []
    for cand in candidates(ctx):
        tl = simulate(config, toks, cost, routing=routing, candidate=cand, dtype=dt, mode=mode)
        c = Candidate(cand, tl.step_time(), tl.breakdown() if breakdown else None)
        s = cand.get("memory_strategy")
        if s is not None:
            n = int(cand.get("pipeline_degree", 1))
            mi = cand.get("memory_mi_buffers", getattr(config, "memory_mi_buffers", 1))
            c.device_bytes = max(expert_block_bytes(r, config.d_model, config.n1, s, es, mi)["device"]
                                 for r in _rows_per_rank(config, toks, n, routing))
            if budget is not None and c.device_bytes > budget:
                c.rejected = f"needs {c.device_bytes} B > budget {budget} B"
        elif budget is not None:
            c.rejected = "no memory strategy (its bytes are not modelled)"
        results.append(c)
    fits = [c for c in results if c.rejected is None]
    if not fits:
        sized = [c for c in results if c.device_bytes is not None] or results
        small = min(sized, key=lambda c: (c.device_bytes or 0, c.step_time))
        raise MemoryBudgetError(
            f"memory_budget_bytes={budget} is below the smallest candidate's need: {small.device_bytes} bytes "
            f"({small.values}) for {max(toks)} tokens per rank; raise the budget to at least {small.device_bytes}, "
            "or allow larger pipeline degrees"
        )
    best = min(fits, key=lambda c: c.step_time)
    return Plan(best.values, best.step_time, results, toks, len(toks), routing, cost.path or cost.source,
                budget_bytes=budget)
