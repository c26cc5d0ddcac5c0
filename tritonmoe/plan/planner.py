"""The planner: evaluate candidate schedules in the simulator and pick the fastest.

:func:`choose` enumerates the candidates of the registered schedules and dimensions
(:mod:`tritonmoe.plan.schedules`: today the pipeline degree of the expert-parallel pipeline;
the scheduler issues add memory strategies, Parm's schedules, Lina's chunk size and flat or
hierarchical all-to-all), simulates each (:func:`tritonmoe.plan.simulate`) and returns a
:class:`Plan` with the predicted step time of every candidate.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .schedules import DIMENSIONS, SCHEDULES, PlanContext, dimensions_of
from .simulate import _tokens, parse_dtype, resolve_cost, simulate

__all__ = ["Candidate", "Plan", "choose", "candidates"]


@dataclass
class Candidate:
    """One evaluated candidate: its values, predicted step time (seconds) and, when asked for,
    the step-time breakdown of the slowest rank (:meth:`tritonmoe.comm.Timeline.breakdown`)."""

    values: dict
    step_time: float
    breakdown: Optional[dict] = None


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

    @property
    def pipeline_degree(self) -> int:
        return int(self.choice.get("pipeline_degree", 1))

    def table(self) -> str:
        """The candidates as an aligned text table, the choice marked."""
        names = list(dict.fromkeys(k for c in self.candidates for k in c.values))
        head = [*names, "step ms", "vs best"]
        rows = []
        for c in self.candidates:
            mark = " <- chosen" if c.values == self.choice else ""
            rows.append([str(c.values.get(k, "")) for k in names]
                        + [f"{c.step_time * 1e3:.3f}", f"{c.step_time / self.step_time:.3f}x{mark}"])
        widths = [max(len(h), *(len(r[i].split(' <-')[0]) for r in rows)) for i, h in enumerate(head)]
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
        dims = dimensions_of(s)
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
    breakdown: bool = False,
    **overrides: Sequence[Any],
) -> Plan:
    """Simulate every candidate and return the fastest as a :class:`Plan`.

    Args:
        config, tokens_per_rank, cluster_or_cost, world_size, routing, dtype, mode: as
            :func:`tritonmoe.plan.simulate`.
        candidates_override / ``**overrides``: values to try per dimension, replacing the
            registered defaults, e.g. ``choose(..., pipeline_degree=(1, 2, 4, 8))``.
        breakdown: also record every candidate's step-time breakdown.

    Ties go to the candidate evaluated first (the smaller degree)."""
    cost = resolve_cost(cluster_or_cost, dtype)
    dt = parse_dtype(dtype or cost.dtype)
    toks = _tokens(tokens_per_rank, world_size, cost)
    ov = dict(candidates_override or {})
    ov.update(overrides)
    ctx = PlanContext(config, toks, len(toks), cost, dt, ov)
    results = []
    for cand in candidates(ctx):
        tl = simulate(config, toks, cost, routing=routing, candidate=cand, dtype=dt, mode=mode)
        results.append(Candidate(cand, tl.step_time(), tl.breakdown() if breakdown else None))
    best = min(results, key=lambda c: c.step_time)
    return Plan(best.values, best.step_time, results, toks, len(toks), routing, cost.path or cost.source)
