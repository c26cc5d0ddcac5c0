"""Sizing a MoE model on N GPUs: which EP x DP split, capacity factor, pipeline degree, memory
strategy and all-to-all, how much memory per GPU, whether it fits, and how fast a step is.

:func:`size` enumerates a bounded candidate space and prices each candidate twice:

* **step time** from :func:`tritonmoe.sim.simulate`: the real schedule program of one MoE layer
  (``comm.programs.pipeline``'s forward and backward, with MPMoE's memory strategies) recorded for
  one representative rank of the EP group and run by the discrete-event engine on the cluster's
  cost model, times the number of MoE layers; plus the dense part (attention projections and
  scores, dense MLPs, shared experts, LM head) from the cost model's GEMM rate, and the gradient
  all-reduces (dense gradients over the world, expert gradients over each expert's DP group)
  from its collective model, assumed overlapped with the backward (DDP buckets) and exposed only
  beyond it. Where the EP group spans nodes, the hierarchical all-to-all
  (``comm.programs.hierarchical``) is a candidate: one flat and one hierarchical exchange of the
  layer's dispatch traffic are simulated, and the difference replaces the exposed share of the
  layer's four exchanges (an estimate: the pipeline itself is simulated with the flat exchange).
* **memory per GPU** from :func:`tritonmoe.plan.memory_budget.memory_per_gpu` against the
  device's memory (or ``memory_budget_bytes``). A candidate that does not fit stays in the report
  with its shortfall and :meth:`~tritonmoe.plan.memory_budget.MemoryEstimate.what_would_fit`.

:class:`SizingReport` ranks the candidates (those that fit by step time, then the rest by
shortfall) and explains itself (:meth:`SizingReport.explain`): where the winner's time goes and
how much of its communication is exposed, what the runner-up costs, and, when the top
candidates are within the simulator's own median error (:data:`TIE_TOLERANCE`), that they are a
tie and which is the simpler (:data:`SIMPLER`). Every figure names its provenance: "assumed
from a preset" (a cluster preset: spec-sheet rates times assumed efficiencies), "fitted" (a
cost model fitted to a profile), "measured on this machine" (the simulator's error), or the
memory rows' "exact" / "formula" / "assumed".

Two schedulers are searched where they apply:

* **Parm's EP x MP (x DP) layouts** where E < GPUs (or as ``mp_sizes`` asks): each expert sharded
  over an MP group (``ParmLayout.make(n_mp=MP, n_ep=EP, n_esp=MP)``), one MoE layer priced by
  Parm's own model (:func:`tritonmoe.sim.parm_model.simulate_parm`, S1, S2 and the baseline;
  the fastest kept, as :func:`~tritonmoe.sim.parm_model.choose_parm` picks: the offline
  counterpart of ``parm_schedule="auto"``), the dense part assumed tensor-parallel
  over MP (Megatron), memory from ``memory_per_gpu(..., mp_size=MP, parm_schedule=S)``.
* **Lina's priority** of the all-to-all over the gradient all-reduce, for the top candidates
  only (within the tie tolerance plus one, at most :data:`LINA_TOP`): FIFO and priority each
  simulated by :func:`tritonmoe.plan.lina.simulate_lina_step` (symmetric: rank 0 mirrored), the
  candidate's step scaled by their ratio, the "lina" variant ranked with the rest.

Not in the search (yet): expert replication in training (tritonmoe's expert-parallel layer
holds each expert once per EP group; when E does not divide the world, EP x DP with an EP size
dividing E is offered instead), Parm with pipelining or memory strategies.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from tritonmoe.comm.executor import Work
from tritonmoe.comm.programs.memory_reuse import STRATEGIES
from tritonmoe.config import MoEConfig
from tritonmoe.core.suggest import did_you_mean
from tritonmoe.sim.cost_model import PRESETS, Cluster, CostModel
from tritonmoe.parm_layout import ParmLayout
from tritonmoe.sim.parm_model import simulate_all_to_all, simulate_parm
from tritonmoe.sim.simulate import SimTimeline, routing_counts, simulate

from .lina import LinaModel, packing_candidates, simulate_lina_step
from .memory_budget import GiB, MemoryEstimate, TrainingSetup, device_memory_bytes, memory_per_gpu
from .models import ModelSpec, get_model

__all__ = ["size", "SizingReport", "SizingCandidate", "SizingError", "TIE_TOLERANCE", "SIMPLER",
           "DEFAULT_CAPACITY_FACTORS", "DEFAULT_DEGREES",
           "DEFAULT_MEMORY_STRATEGIES", "LINA_TOP", "PARM_SCHEDULES"]

#: The simulator's median |relative error| against measured steps: 9.6-14.3% over six
#: ``python -m bench plan`` runs on this project's CPU testbed (docs/planner.md, "Fidelity").
#: Candidates within this fraction of the winner are a tie. Its error on a GPU cluster preset
#: has not been measured.
TIE_TOLERANCE = 0.143
TIE_SOURCE = "measured on this machine: the simulator's median error, 9.6-14.3% in six bench-plan runs (docs/planner.md)"
#: What "simpler" means between tied candidates, most important first.
SIMPLER = ("no model parallelism (MP=1)", "smaller EP", "pipeline degree 1",
           "the layer's default memory path (None), then 'keep'", "no expert replication", "dropless",
           "flat all-to-all", "the FIFO (DDP) gradient all-reduce")
#: Lina's priority is simulated (:func:`tritonmoe.plan.lina.simulate_lina_step`) for the top
#: candidates only: those within the tie tolerance of the winner plus the next one, at most this many.
LINA_TOP = 6
#: Lina's micro-op size (001 section 7.1's default, 30 MB).
LINA_CHUNK_BYTES = 30 * 2**20
DEFAULT_CAPACITY_FACTORS = (None, 1.0, 1.25)
DEFAULT_DEGREES = (1, 2, 4)
#: None: the layer's default, unmanaged expert block (no MPMoE memory strategy); then the five.
DEFAULT_MEMORY_STRATEGIES = (None, *STRATEGIES)
_EXCHANGES_PER_LAYER = 4  # dispatch and combine, forward and backward
PARM_SCHEDULES = ("s1", "s2", "baseline")  # the order parm_model.choose_parm breaks ties in


class SizingError(ValueError):
    """No candidate fits (or none can run): names the closest candidate, its shortfall and the fix."""


@dataclass
class SizingCandidate:
    """One evaluated layout: its values, predicted step time (seconds), breakdown and memory.

    ``breakdown`` (seconds per step unless named): ``step``, ``moe_layers`` (all MoE layers),
    ``moe_layer`` (one layer's simulated breakdown), ``dense``, ``compute``, ``comm``,
    ``exposed_comm``, ``exposed_share`` (exposed / comm), ``grad_sync`` and
    ``grad_sync_exposed``, ``pipeline_efficiency``, ``memory_bytes``."""

    ep_size: int
    dp_size: int
    capacity_factor: Optional[float]
    pipeline_degree: int
    memory_strategy: Optional[str]
    all_to_all: str
    step_time: float
    breakdown: dict
    memory: MemoryEstimate
    capacity_bytes: int
    expert_replicas: int = 1
    mp_size: int = 1
    parm_schedule: Optional[str] = None
    gradient_sync: str = "fifo"

    @property
    def fits(self) -> bool:
        return self.memory.fits(self.capacity_bytes)

    @property
    def shortfall(self) -> int:
        return self.memory.shortfall(self.capacity_bytes)

    def what_would_fit(self) -> list:
        return self.memory.what_would_fit(self.capacity_bytes)

    @property
    def values(self) -> dict:
        return {"ep_size": self.ep_size, "dp_size": self.dp_size, "capacity_factor": self.capacity_factor,
                "pipeline_degree": self.pipeline_degree, "memory_strategy": self.memory_strategy,
                "all_to_all": self.all_to_all, "expert_replicas": self.expert_replicas, "mp_size": self.mp_size,
                "parm_schedule": self.parm_schedule, "gradient_sync": self.gradient_sync}

    def label(self) -> str:
        cf = "dropless" if self.capacity_factor is None else f"capacity factor {self.capacity_factor:g}"
        mem = "the layer's default memory path" if self.memory_strategy is None else \
            f"memory strategy {self.memory_strategy!r}"
        lina = ", Lina's priority gradient all-reduce" if self.gradient_sync == "lina" else ""
        if self.mp_size > 1:
            return (f"EP={self.ep_size} x MP={self.mp_size} x DP={self.dp_size}, {cf}, Parm schedule "
                    f"{self.parm_schedule!r} (experts sharded over MP){lina}")
        return (f"EP={self.ep_size} x DP={self.dp_size}, {cf}, pipeline degree {self.pipeline_degree}, "
                f"{mem}, {self.all_to_all} all-to-all{lina}")

    def program_key(self) -> tuple:
        """What the simulated program depends on, all but the capacity factor."""
        return (self.ep_size, self.mp_size, self.pipeline_degree, self.memory_strategy, self.all_to_all,
                self.parm_schedule, self.gradient_sync)

    def schedule_label(self) -> str:
        """The table's "sched" cell: Parm's schedule where MP > 1, "lina" for Lina's priority."""
        out = [f"parm:{self.parm_schedule}"] if self.mp_size > 1 else []
        return "+".join(out + (["lina"] if self.gradient_sync == "lina" else [])) or "-"

    def simplicity(self) -> tuple:
        """Sort key of :data:`SIMPLER` (smaller is simpler)."""
        mem = DEFAULT_MEMORY_STRATEGIES.index(self.memory_strategy)
        return (self.mp_size != 1, self.ep_size, self.pipeline_degree != 1, min(mem, 2), self.expert_replicas != 1,
                self.capacity_factor is not None, self.all_to_all != "flat", self.gradient_sync != "fifo",
                self.pipeline_degree, mem, self.capacity_factor or 0.0, self.mp_size)

    def to_dict(self) -> dict:
        return {**self.values, "step_time_s": self.step_time, "fits": self.fits, "shortfall_bytes": self.shortfall,
                "memory_bytes": self.memory.total_bytes,
                "breakdown": {k: v for k, v in self.breakdown.items() if k != "moe_layer"},
                "moe_layer": self.breakdown.get("moe_layer")}


def _fixes(est_fixes: list, k: int = 3) -> list:
    """The first ``k`` of what_would_fit's sentences, those that make it fit first."""
    good = [f for f in est_fixes if f.rstrip(")").endswith("fits")]
    return (good + [f for f in est_fixes if f not in good])[:k]


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


@dataclass
class SizingReport:
    """The ranked candidates of :func:`size` and why the winner won (:meth:`explain`).

    Attributes:
        model, gpus, cluster (a description), tokens_per_gpu, seq_len, capacity_bytes.
        candidates: every candidate, those that fit by step time first, then the rest by shortfall.
        step_provenance: where the step times come from; ``tie_tolerance``: see :data:`TIE_TOLERANCE`.
        notes: what the search left out and why (e.g. EP sizes that do not divide E).
    """

    model: ModelSpec
    gpus: int
    cluster: str
    tokens_per_gpu: int
    seq_len: int
    capacity_bytes: int
    candidates: list
    step_provenance: str
    tie_tolerance: float = TIE_TOLERANCE
    notes: list = field(default_factory=list)
    efficiency: dict = field(default_factory=dict)
    lina: dict = field(default_factory=dict)

    @property
    def fitting(self) -> list:
        return [c for c in self.candidates if c.fits]

    @property
    def winner(self) -> SizingCandidate:
        return self.fitting[0]

    @property
    def runner_up(self) -> Optional[SizingCandidate]:
        """The fastest fitting candidate that differs from the winner in more than the capacity
        factor (a capacity that drops nothing runs the same program; None if there is none)."""
        w = self.winner
        same = lambda c: c.program_key() + (c.step_time,) == w.program_key() + (w.step_time,)  # noqa: E731
        return next((c for c in self.fitting[1:] if not same(c)), None)

    @property
    def tied(self) -> list:
        """Fitting candidates within :attr:`tie_tolerance` of the winner's step time."""
        w = self.winner.step_time
        return [c for c in self.fitting if c.step_time <= w * (1 + self.tie_tolerance)]

    @property
    def is_tie(self) -> bool:
        return len(self.tied) > 1

    @property
    def recommended(self) -> SizingCandidate:
        """The winner, or on a tie the simplest tied candidate (:data:`SIMPLER`)."""
        return min(self.tied, key=lambda c: c.simplicity()) if self.is_tie else self.winner

    def explain(self) -> list:
        """Sentences: the winner and where its time goes, the runner-up's cost, the tie (if any),
        and what does not fit. Every figure names its provenance."""
        w, b, prov = self.winner, self.winner.breakdown, self.step_provenance
        out = [f"Winner: {w.label()}: {_ms(w.step_time)} per step of {self.tokens_per_gpu} tokens per GPU "
               f"[{prov}], {w.memory.total_bytes / GiB:.1f} GiB per GPU of {self.capacity_bytes / GiB:.1f} GiB "
               f"[weights, gradients, optimizer state exact; activations by formula]."]
        moe = b["moe_layer"]
        eff = b["pipeline_efficiency"]
        out.append(
            f"Where the step's time goes: {self.model.moe_layers} MoE layers x {_ms(moe['step'])} = "
            f"{_ms(b['moe_layers'])} (simulated: compute {_ms(moe['compute'])}, communication {_ms(moe['comm'])} "
            f"per layer), the dense part (attention, dense MLPs, shared experts, LM head) {_ms(b['dense'])}, the "
            f"exposed gradient all-reduce {_ms(b['grad_sync_exposed'])} of {_ms(b['grad_sync'])} [{prov}].")
        out.append(
            f"Of {_ms(b['comm'])} of communication per step, {_ms(b['exposed_comm'])} "
            f"({100 * b['exposed_share']:.0f}%) is exposed (nothing computes during it); "
            + (f"pipelining efficiency {eff:.2f} (communication time with expert compute running) [{prov}]."
               if eff is not None else f"no expert-parallel communication at EP=1 [{prov}]."))
        r = self.runner_up
        if r is not None:
            extra = 100 * (r.step_time / w.step_time - 1)
            out.append(f"Runner-up: {r.label()}: {_ms(r.step_time)}, +{extra:.1f}% [{prov}], "
                       f"{r.memory.total_bytes / GiB:.1f} GiB per GPU.")
        if self.is_tie:
            rec = self.recommended
            out.append(
                f"TIE: {self._layouts(self.tied)} are within {100 * self.tie_tolerance:.1f}% of the winner, inside "
                f"the simulator's own median error [{TIE_SOURCE}]; the prediction cannot tell them apart. "
                + (f"Recommended: the simpler one, {rec.label()} ({_ms(rec.step_time)}, "
                   f"+{100 * (rec.step_time / w.step_time - 1):.1f}%)" if rec is not w else
                   "Recommended: the winner, which is also the simplest of them")
                + f"; simpler means, in this order: {', '.join(SIMPLER)}.")
        elif r is not None:
            out.append(f"The winner leads by more than the simulator's median error "
                       f"({100 * self.tie_tolerance:.1f}%) [{TIE_SOURCE}].")
        out.extend(self._parm_sentences())
        out.extend(self._lina_sentences())
        out.extend(self._misfit_sentences())
        out.extend(self.notes)
        if self.step_provenance.startswith("assumed"):
            out.append(f"Provenance: step times are {self.step_provenance} (spec-sheet peak rates x efficiencies "
                       f"assumed once for every cluster, {self.efficiency}); the dense part is a roofline of its "
                       "FLOPs at that GEMM rate; the gradient all-reduce is assumed overlapped with the backward"
                       + (" (Lina's variants: simulated with contention and priority)." if self.lina.get("variants")
                          else "."))
        return out

    @staticmethod
    def _layouts(cands: list) -> str:
        """"N candidates", or "N layouts (M candidates ...)" where capacity factors change nothing."""
        n = len({c.program_key() + (c.step_time,) for c in cands})
        return (f"{len(cands)} candidates" if n == len(cands) else
                f"{n} layouts ({len(cands)} candidates, counting capacity factors that change nothing)")

    def _parm_sentences(self) -> list:
        """Which Parm schedule won for the best EP x MP candidate, why, and where it ranks."""
        parm = [c for c in self.candidates if c.mp_size > 1]
        if not parm:
            return []
        best = min(parm, key=lambda c: (not c.fits, c.step_time if c.fits else c.shortfall))
        p, prov, w = best.breakdown["parm"], self.step_provenance, self.winner
        times = ", ".join(f"{s} {_ms(p['layer_step_s'][s])}" for s in p["order"])
        where = ("it is the winner" if best is w else
                 f"{100 * (best.step_time / w.step_time - 1):+.1f}% against the winner" if best.fits else
                 f"it does not fit ({best.shortfall / GiB:.1f} GiB short)")
        return [f"Parm (applies: {p['applies']}): the best model-parallel candidate is {best.label()}, "
                f"{_ms(best.step_time)} per step, {where} [{prov}]. Parm's schedule {p['schedule']!r} won per MoE "
                f"layer ({times}, simulated by sim.parm_model: choose_parm's pick, the offline counterpart of parm_schedule='auto'): {p['why']}; the "
                f"dense part's tensor-parallel all-reduces add {_ms(best.breakdown['tensor_parallel_comm'])} [{prov}]."]

    def _lina_sentences(self) -> list:
        """Whether Lina's priority changes the winner, and by how much (simulated)."""
        info = self.lina
        if not info.get("variants"):
            return []
        before, w = info["before"], self.winner
        best = min(info["variants"], key=lambda c: c.step_time)
        r = best.breakdown["lina"]
        head = (f"Lina's priority of the all-to-all over the gradient all-reduce (micro-ops of "
                f"{r['chunk_bytes'] // 2**20} MB) was simulated for the top {len(info['evaluated'])} candidates "
                f"({info['simulations']} runs of plan.lina.simulate_lina_step: FIFO DDP buckets sharing the network "
                f"vs priority, the ratio applied to each candidate's step) [simulated; {self.step_provenance}]: ")
        if w.gradient_sync == "lina":
            gain = 100 * (1 - w.step_time / before.step_time)
            verdict = ("it changes the winner to " if w.program_key()[:-1] != before.program_key()[:-1] else
                       "it keeps the winner's layout and speeds it up: ")
            return [head + verdict + f"{w.label()}, {_ms(w.step_time)} against {_ms(before.step_time)} without it "
                    f"({gain:.1f}% faster; Lina's FIFO step {_ms(r['fifo_step_s'])} -> {_ms(r['lina_step_s'])})."]
        return [head + f"it does not change the winner: its best variant, {best.label()}, takes "
                f"{_ms(best.step_time)} ({100 * (best.step_time / w.step_time - 1):+.1f}% against the winner; "
                f"Lina's simulator: FIFO {_ms(r['fifo_step_s'])}, priority {_ms(r['lina_step_s'])})."]

    def _misfit_sentences(self) -> list:
        bad = [c for c in self.candidates if not c.fits]
        if not bad:
            return []
        out = []
        w = self.winner if self.fitting else None
        faster = [c for c in bad if w is not None and c.step_time < w.step_time]
        if faster:  # the faster candidate nearest to fitting
            fast = min(faster, key=lambda c: (c.shortfall, c.step_time))
            fixes = _fixes(fast.what_would_fit(), 1)
            out.append(f"Faster but over the memory: {fast.label()} would take {_ms(fast.step_time)} "
                       f"({100 * (fast.step_time / w.step_time - 1):+.1f}%) and is {fast.shortfall / GiB:.1f} GiB short"
                       + (f" (what would fit: {fixes[0]})." if fixes else "."))
        c = min(bad, key=lambda c: c.shortfall)
        fixes = _fixes(c.what_would_fit(), 1)
        if faster and fast.shortfall <= c.shortfall:  # the faster one is also the closest: said above
            return out + [f"{len(bad)} of {len(self.candidates)} candidates do not fit in "
                          f"{self.capacity_bytes / GiB:.1f} GiB."]
        return out + [f"{len(bad)} of {len(self.candidates)} candidates do not fit in {self.capacity_bytes / GiB:.1f} GiB; "
                f"the closest, {c.label()}, is {c.shortfall / GiB:.1f} GiB short"
                + (f" (what would fit: {fixes[0]})." if fixes else ".")]

    def table(self, limit: int = 12) -> str:
        """The ranked candidates as an aligned text table (the first ``limit`` that fit, then
        the closest that do not). Candidates that differ only in a capacity factor that changes
        neither their step time nor their memory share a row (capacity "dropless|1|1.25")."""
        head = ["EP", "MP", "DP", "capacity", "degree", "memory", "a2a", "sched", "step ms", "vs best", "exposed",
                "GiB/GPU", ""]
        groups: dict = {}
        for c in self.candidates:
            key = c.program_key() + (c.step_time, c.memory.total_bytes)
            groups.setdefault(key, []).append(c)
        firsts = [g[0] for g in groups.values()]
        shown = [c for c in firsts if c.fits][:limit] + [c for c in firsts if not c.fits][:max(0, limit // 3)]
        best = self.winner.step_time if self.fitting else None
        rows = []
        for c in shown:
            b = c.breakdown
            same = groups[c.program_key() + (c.step_time, c.memory.total_bytes)]
            cap = "|".join("dropless" if g.capacity_factor is None else f"{g.capacity_factor:g}" for g in same)
            mark = ("<- winner" if c is self.winner else "") if c.fits else f"short {c.shortfall / GiB:.1f} GiB"
            if self.fitting and self.is_tie and self.recommended in same and c is not self.winner:
                mark = "<- recommended (tie)"
            rows.append([str(c.ep_size), str(c.mp_size), str(c.dp_size), cap, str(c.pipeline_degree),
                         c.memory_strategy or "default", c.all_to_all, c.schedule_label(),
                         f"{c.step_time * 1e3:.1f}", f"{c.step_time / best:.3f}x" if best else "-",
                         f"{100 * b['exposed_share']:.0f}%", f"{c.memory.total_bytes / GiB:.1f}", mark])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        fmt = lambda r: "  ".join(v.rjust(w) if i < len(r) - 1 else v for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
        return "\n".join([fmt(head).rstrip()] + [fmt(r).rstrip() for r in rows])

    def to_dict(self) -> dict:
        return {"model": self.model.name, "gpus": self.gpus, "cluster": self.cluster,
                "tokens_per_gpu": self.tokens_per_gpu, "seq_len": self.seq_len, "capacity_bytes": self.capacity_bytes,
                "step_provenance": self.step_provenance, "tie_tolerance": self.tie_tolerance,
                "winner": self.winner.values, "recommended": self.recommended.values, "tie": self.is_tie,
                "explain": self.explain(), "candidates": [c.to_dict() for c in self.candidates]}


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _pos_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < 1:
        raise ValueError(f"{name}={v} must be >= 1")
    return int(v)


def _machine(cluster: Any, gpus: int) -> tuple:
    """(cost model, cluster description, step-time provenance, device bytes) for ``gpus`` GPUs."""
    if isinstance(cluster, str):
        if cluster not in PRESETS:
            raise ValueError(f"unknown cluster {cluster!r}{did_you_mean(cluster, list(PRESETS))}; use one of "
                             f"{', '.join(PRESETS)}")
        cluster = Cluster.preset(cluster)
    if isinstance(cluster, CostModel):
        if cluster.cluster is None:
            raise TypeError("size() needs a Cluster (or a preset name) or a CostModel derived from one: the sizing "
                            "search simulates every EP group size, which a profiled cost model has fitted only for "
                            "the group sizes it measured")
        cost, cl = cluster, cluster.cluster
        prov = (f"assumed from a preset: {cl.name}" if str(cost.source).startswith("cluster:")
                else f"fitted: cost model {cost.source}")
    elif isinstance(cluster, Cluster):
        cl, cost = cluster, None
        prov = f"assumed from a preset: {cluster.name}"
    else:
        raise TypeError(f"cluster must be a preset name, a Cluster or a CostModel, got {type(cluster).__name__}")
    gpn = cl.gpus_per_node
    if gpus > gpn and gpus % gpn:
        raise ValueError(f"gpus={gpus} is not a multiple of {cl.name}'s {gpn} GPUs per node; use a multiple of {gpn} "
                         f"(e.g. {gpus // gpn * gpn or gpn} or {(gpus // gpn + 1) * gpn}), or at most {gpn} on one node")
    if cost is not None and cl.num_gpus < gpus:
        raise ValueError(f"the cost model describes {cl.num_gpus} GPUs ({cl.describe()}), fewer than gpus={gpus}; "
                         f"pass the cluster (or its preset name) and size() takes the nodes it needs")
    cl = cl.with_nodes(max(1, gpus // gpn))
    if cost is None:
        cost = cl.cost_model("bfloat16")
    return cost, cl, prov, device_memory_bytes(cl)


def _tokens(gpus: int, tokens_per_step: Optional[int], tokens_per_gpu: Optional[int]) -> int:
    if (tokens_per_step is None) == (tokens_per_gpu is None):
        raise ValueError("give exactly one of tokens_per_step (global, per optimizer step) or tokens_per_gpu")
    if tokens_per_gpu is not None:
        return _pos_int("tokens_per_gpu", tokens_per_gpu)
    t = _pos_int("tokens_per_step", tokens_per_step)
    if t % gpus:
        raise ValueError(f"tokens_per_step={t} is not divisible by gpus={gpus}; use a multiple of {gpus} "
                         f"(e.g. {t // gpus * gpus or gpus}), or give tokens_per_gpu")
    return t // gpus


def _ep_sizes(m: ModelSpec, gpus: int, notes: list) -> list:
    divs = [d for d in range(1, gpus + 1) if gpus % d == 0]
    ok = [d for d in divs if m.num_experts % d == 0]
    left = [d for d in divs if d not in ok]
    if left:
        notes.append(f"EP sizes {left} do not divide the {m.num_experts} experts: tritonmoe's expert-parallel layer "
                     f"holds each expert once per EP group, so training uses EP in {ok} with DP = {gpus} / EP "
                     f"(e.g. EP={max(ok)} x DP={gpus // max(ok)}); expert replication serves inference only "
                     "(tritonmoe.inference.ReplicatedMoELayer; memory_per_gpu(..., optimizer='none')).")
    return ok


# ---------------------------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------------------------


class _Sim:
    """Cached simulations of one MoE layer and of the all-to-all exchanges."""

    def __init__(self, m: ModelSpec, T: int, cost: CostModel, routing: Any, seq_len: int = 4096) -> None:
        self.m, self.T, self.cost, self.routing, self.seq_len = m, T, cost, routing, seq_len
        self.layers: dict = {}
        self.a2a: dict = {}

    def config(self, cf: Optional[float]) -> MoEConfig:
        m = self.m
        act = m.activation if m.activation in ("swiglu", "gelu", "relu") else ("swiglu" if m.gated else "gelu")
        return MoEConfig(m.d_model, m.d_ffn, m.num_experts, m.top_k, activation=act, capacity_factor=cf)

    def effective_capacity(self, ep: int, cf: Optional[float]) -> Optional[int]:
        """The capacity that binds for this routing (None when it drops nothing: same program)."""
        cfg = self.config(cf)
        cap = cfg.capacity(self.T)
        if cap is None:
            return None
        most = int(routing_counts(self.config(None), (self.T,), 1, self.routing).max())
        return None if cap >= most else cap

    def layer(self, ep: int, cf: Optional[float], n: int, strategy: Optional[str]) -> tuple:
        key = (ep, self.effective_capacity(ep, cf), n, strategy)
        if key not in self.layers:
            cfg = self.config(cf)
            cand = {"schedule": "ep-pipeline", "pipeline_degree": n}
            if strategy is not None:  # None: the layer's default expert block, no memory ops
                cand["memory_strategy"] = strategy
            tl = simulate(cfg, self.T, self.cost, world_size=ep, routing=self.routing, mode="symmetric",
                          candidate=cand)
            b = tl.breakdown()
            self.layers[key] = (tl.step_time(), b, tl.pipeline_efficiency())
        return self.layers[key]

    def parm_layer(self, ep: int, mp: int, cf: Optional[float]) -> tuple:
        """Parm's three schedules of one MoE layer on the layout EP x MP (experts sharded over the
        MP group, n_esp = n_mp = mp, ESP-inner: :func:`tritonmoe.sim.parm_model.simulate_parm`, the
        layer's own schedule code, uniform routing), each MP group's batch of ``T * mp`` tokens.
        Returns (the fastest schedule, its step, breakdown, pipelining efficiency, every
        schedule's step): :func:`~tritonmoe.sim.parm_model.choose_parm`'s pick."""
        key = ("parm", ep, mp, cf)
        if key not in self.layers:
            layout = ParmLayout.make(n_mp=mp, n_ep=ep, n_esp=mp, placement="esp_inner")
            res = {sch: simulate_parm(self.config(cf), layout, sch, self.cost, tokens=self.T * mp, dtype="bfloat16")
                   for sch in PARM_SCHEDULES}
            times = {sch: r.step_time() for sch, r in res.items()}
            best = min(PARM_SCHEDULES, key=times.get)
            tl = SimTimeline(res[best])
            self.layers[key] = (best, times[best], tl.breakdown(), tl.pipeline_efficiency(), times)
        return self.layers[key]

    def exchange(self, ep: int, hierarchical: bool) -> float:
        """One dispatch all-to-all of the layer's uniform traffic over the EP group (ranks 0..ep-1)."""
        key = (ep, hierarchical)
        if key not in self.a2a:
            rows = self.T * self.m.top_k // ep
            send = [[0 if d == r else rows for d in range(ep)] for r in range(ep)]
            gpn = self.cost.cluster.gpus_per_node
            self.a2a[key] = simulate_all_to_all(send, self.cost, row_bytes=self.m.d_model * 2, local_size=gpn,
                                                hierarchical=hierarchical, dtype="bfloat16").step_time()
        return self.a2a[key]


def dense_work(m: ModelSpec, T: int, seq_len: int) -> Work:
    """The forward + backward GEMM work of everything outside the routed experts and routers for
    ``T`` tokens: attention projections and (causal) scores, dense MLPs, shared experts, LM head
    (backward = twice the forward's FLOPs; the weights read three times in bf16)."""
    attn = m.attention_params_per_layer()
    mlp = (3 if m.gated else 2) * m.d_model * m.dense_d_ffn if m.dense_layers else 0
    shared = m.shared_params_per_layer()
    head_dim = (m.qk_nope_head_dim + m.qk_rope_head_dim) if m.mla else m.head_dim
    params = m.num_layers * attn + m.dense_layers * mlp + m.moe_layers * shared + m.vocab_size * m.d_model
    scores = m.num_layers * 2 * seq_len * m.n_heads * head_dim  # QK^T and PV, causal half of 2 x 2 x S
    flops = 3 * T * (2 * params + scores)
    return Work(flops=float(flops), bytes=float(3 * 2 * params + 3 * 2 * T * m.d_model * m.num_layers * 8),
                kind="gemm", launches=3 * 8 * m.num_layers)


def _grad_sync(m: ModelSpec, cost: CostModel, gpus: int, ep: int, setup: TrainingSetup, mp: int = 1) -> float:
    """Seconds of the gradient all-reduces (dense over the world, experts over their DP group;
    with MP > 1 the dense part's tensor-parallel slice over the world / MP and each expert
    shard over DP = world / (EP x MP))."""
    if not setup.training or gpus == 1:
        return 0.0
    es = (setup.grad_dtype or setup.param_dtype).itemsize
    parts = m.params_by_part()
    dense = m.total_params() - parts["routed_experts"]
    if mp > 1:
        rep = parts["norms"] + parts["router"]
        dense = rep + math.ceil((dense - rep) / mp)
    experts = m.moe_layers * (m.num_experts // ep) * (m.expert_params_per_layer() // m.num_experts) // mp
    link = "intra" if gpus <= cost.cluster.gpus_per_node else "inter"
    t = cost.predict("all_reduce", dense * es, gpus // mp, link) if gpus // mp > 1 else 0.0
    dp = gpus // (ep * mp)
    if dp > 1:
        t += cost.predict("all_reduce", experts * es, dp, link)
    return t


_PARM_WHY = {
    "s1": "S1 pauses MP before the gate: each MP rank routes its 1/MP of the batch, so the expert work and the "
          "all-to-all volume drop by MP, for one MP all-gather of the output",
    "s2": "S2 pauses MP after the gate: the gate runs on the whole batch, each MP rank sends 1/MP of every "
          "expert's rows, and the returning all-to-all overlaps the MP all-gather (SAA)",
    "baseline": "the baseline (DeepSpeed-MoE's order) has no MP all-gather, but every MP rank processes its copy of "
                "the batch",
}


def _parm_candidate(sim: _Sim, m, cost, gpus, ep, mp, cf, setup, mem_kw, capacity) -> SizingCandidate:
    """An EP x MP (x DP) candidate priced with Parm's own model (:meth:`_Sim.parm_layer`); the
    dense part tensor-parallel over MP (its GEMMs / MP, plus Megatron's activation all-reduce
    over MP after each attention block and dense MLP, forward and backward, exposed)."""
    sched, step1, lb, eff, times = sim.parm_layer(ep, mp, cf)
    lb = dict(lb)
    L, T = m.moe_layers, sim.T
    w = dense_work(m, T * mp, mem_kw["seq_len"])
    dense = cost.compute_time(Work(flops=w.flops / mp, bytes=w.bytes / mp, kind=w.kind, launches=w.launches))
    tp = 2 * (m.num_layers + m.dense_layers) * cost.predict("all_reduce", T * mp * m.d_model * 2, mp, "intra")
    sync = _grad_sync(m, cost, gpus, ep, setup, mp)
    backward = (2 / 3) * (dense + L * lb["compute"])
    sync_exposed = max(0.0, sync - backward)
    step = L * step1 + dense + tp + sync_exposed
    comm = L * lb["comm"] + tp + sync
    exposed = L * lb["exposed_comm"] + tp + sync_exposed
    order = sorted(times, key=times.get)
    b = {"step": step, "moe_layers": L * step1, "moe_layer": lb, "dense": dense + tp, "tensor_parallel_comm": tp,
         "compute": L * lb["compute"] + dense, "comm": comm, "exposed_comm": exposed,
         "exposed_share": exposed / comm if comm else 0.0, "grad_sync": sync, "grad_sync_exposed": sync_exposed,
         "pipeline_efficiency": eff,
         "parm": {"schedule": sched, "layer_step_s": dict(times), "why": _PARM_WHY[sched],
                  "applies": (f"E={m.num_experts} experts on {gpus} GPUs: each expert sharded over an MP group of "
                              f"{mp} (EP={ep} x MP={mp} x DP={gpus // (ep * mp)})"),
                  "order": order}}
    est = memory_per_gpu(m, world_size=gpus, ep_size=ep, setup=setup, memory_strategy=None, pipeline_degree=1,
                         capacity_factor=cf, mp_size=mp, parm_schedule=sched, **mem_kw)
    b["memory_bytes"] = est.total_bytes
    return SizingCandidate(ep, gpus // (ep * mp), cf, 1, None, "flat", step, b, est, capacity, mp_size=mp,
                           parm_schedule=sched)


def _mp_layouts(m: ModelSpec, gpus: int, gpn: int, eps: list, mp_sizes: Optional[Sequence[int]], notes: list) -> list:
    """(EP, MP) pairs of Parm's layouts to search: by default, where E < GPUs (Parm's setting),
    every MP > 1 dividing GPUs / EP that fits in a node and divides d_ffn."""
    if mp_sizes is None:
        if m.num_experts >= gpus:
            return []
        mp_sizes = [d for d in range(2, gpn + 1) if gpus % d == 0]
    else:
        mp_sizes = [_pos_int("mp_size", v) for v in mp_sizes]
    out = [(ep, mp) for ep in eps for mp in mp_sizes
           if mp > 1 and gpus % (ep * mp) == 0 and mp <= gpn and m.d_ffn % mp == 0]
    if out:
        notes.append(f"Parm's layouts (EP x MP x DP, experts sharded over MP, the dense part tensor-parallel over MP) "
                     f"are searched because E={m.num_experts} < {gpus} GPUs" if m.num_experts < gpus else
                     "Parm's layouts (EP x MP x DP) are searched as asked (mp_sizes)")
        notes.append("Parm's candidates are priced on uniform routing (sim.parm_model), with the layer's default expert "
                     "block, pipeline degree 1 and Parm's own EP&ESP all-to-all.")
    return out


def _lina_model(sim: _Sim, m: ModelSpec, cost: CostModel, cf, setup: TrainingSetup) -> LinaModel:
    """The candidate as Lina's step simulator models it: its MoE layers, the dense part's
    forward spread over them (its backward twice that) and its gradients per layer."""
    L = m.moe_layers
    dense_fwd = cost.compute_time(dense_work(m, sim.T, sim.seq_len)) / 3
    es = (setup.grad_dtype or setup.param_dtype).itemsize
    dense_p = m.total_params() - m.params_by_part()["routed_experts"]
    return LinaModel(sim.config(cf), L, sim.T, dense_fwd / L, dense_p * es // L, torch.bfloat16)


def _lina_pass(cands: list, sim: _Sim, m: ModelSpec, cost: CostModel, gpus: int, setup: TrainingSetup,
               tol: float) -> tuple:
    """Lina's priority for the top candidates only: those within ``tol`` of the fastest fitting one
    plus the next (at most :data:`LINA_TOP`, MP = 1: Lina's simulator is DP x EP). Each is
    simulated twice by :func:`~tritonmoe.plan.lina.simulate_lina_step` (symmetric: rank 0 mirrored),
    FIFO DDP buckets sharing the network with the all-to-alls and Lina's priority micro-ops of
    :data:`LINA_CHUNK_BYTES`; the variant's step is the candidate's times their ratio. Returns
    (the variants, a summary dict)."""
    fitting = [c for c in cands if c.fits]
    if not fitting or gpus == 1:
        return [], {}
    best = fitting[0].step_time
    seen, top = set(), []
    for c in fitting:  # distinct programs (a capacity that drops nothing runs the same one)
        key = c.program_key() + (c.step_time,)
        if key not in seen:
            seen.add(key)
            top.append(c)
            if c.step_time > best * (1 + tol) or len(top) >= LINA_TOP:
                break  # the first one past the tolerance is the "plus one"
    top = [c for c in top if c.mp_size == 1 and gpus // c.ep_size in packing_candidates(gpus, m.num_experts)]
    cache, out = {}, []
    for c in top:
        key = (c.ep_size, sim.effective_capacity(c.ep_size, c.capacity_factor), c.pipeline_degree)
        if key not in cache:
            model = _lina_model(sim, m, cost, c.capacity_factor, setup)
            kw = dict(world_size=gpus, packing=gpus // c.ep_size, pipeline_degree=c.pipeline_degree, symmetric=True)
            fifo = simulate_lina_step(model, cost, comm="fifo", **kw).step_s
            lina = simulate_lina_step(model, cost, comm="lina", chunk_bytes=LINA_CHUNK_BYTES, **kw).step_s
            cache[key] = (fifo, lina)
        fifo, lina = cache[key]
        ratio = lina / fifo
        b = dict(c.breakdown, step=c.step_time * ratio,
                 lina={"fifo_step_s": fifo, "lina_step_s": lina, "ratio": ratio, "chunk_bytes": LINA_CHUNK_BYTES})
        out.append(dataclasses.replace(c, step_time=c.step_time * ratio, breakdown=b, gradient_sync="lina"))
    return out, {"evaluated": [c.label() for c in top], "simulations": 2 * len(cache)}


def _candidate(sim: _Sim, m, cost, gpus, ep, cf, n, strategy, a2a, setup, mem_kw, capacity) -> SizingCandidate:
    step1, lb, eff = sim.layer(ep, cf, n, strategy)
    lb = dict(lb)
    if a2a == "hierarchical":
        saving = _EXCHANGES_PER_LAYER * (sim.exchange(ep, False) - sim.exchange(ep, True))
        exposed = lb["exposed_comm"] / lb["comm"] if lb["comm"] else 0.0
        cut = saving * exposed
        step1 -= cut
        lb.update(step=lb["step"] - cut, comm=lb["comm"] - saving, exposed_comm=lb["exposed_comm"] - cut)
    L = m.moe_layers
    dense = cost.compute_time(dense_work(m, sim.T, mem_kw["seq_len"]))
    sync = _grad_sync(m, cost, gpus, ep, setup)
    backward = (2 / 3) * (dense + L * lb["compute"])
    sync_exposed = max(0.0, sync - backward)
    step = L * step1 + dense + sync_exposed
    comm = L * lb["comm"] + sync
    exposed = L * lb["exposed_comm"] + sync_exposed
    b = {"step": step, "moe_layers": L * step1, "moe_layer": lb, "dense": dense, "compute": L * lb["compute"] + dense,
         "comm": comm, "exposed_comm": exposed, "exposed_share": exposed / comm if comm else 0.0,
         "grad_sync": sync, "grad_sync_exposed": sync_exposed, "pipeline_efficiency": eff}
    est = memory_per_gpu(m, world_size=gpus, ep_size=ep, setup=setup, memory_strategy=strategy, pipeline_degree=n,
                         capacity_factor=cf, **mem_kw)
    b["memory_bytes"] = est.total_bytes
    return SizingCandidate(ep, gpus // ep, cf, n, strategy, a2a, step, b, est, capacity)


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------


def size(
    model: Any,
    *,
    gpus: int,
    cluster: Union[str, Cluster, CostModel] = "dgx-h100",
    tokens_per_step: Optional[int] = None,
    tokens_per_gpu: Optional[int] = None,
    seq_len: int = 4096,
    memory_budget_bytes: Optional[int] = None,
    setup: TrainingSetup = TrainingSetup(),
    ep_sizes: Optional[Sequence[int]] = None,
    capacity_factors: Sequence[Optional[float]] = DEFAULT_CAPACITY_FACTORS,
    pipeline_degrees: Sequence[int] = DEFAULT_DEGREES,
    memory_strategies: Sequence[Optional[str]] = DEFAULT_MEMORY_STRATEGIES,
    all_to_all: Optional[Sequence[str]] = None,
    routing: Any = "uniform",
    mp_sizes: Optional[Sequence[int]] = None,
    lina: bool = True,
    attn_implementation: str = "sdpa",
) -> SizingReport:
    """Size ``model`` (a preset name, a :class:`~tritonmoe.plan.models.ModelSpec`, a transformers
    config, its dict or path) for training on ``gpus`` GPUs of ``cluster`` (see the module
    docstring for how each candidate is priced).

    Args:
        tokens_per_step / tokens_per_gpu: the global tokens of one step (divided evenly over the
            GPUs) or the tokens of one GPU; exactly one.
        seq_len: the sequence length (attention scores and activations).
        memory_budget_bytes: the device bytes a GPU may use (default: the device's memory).
        setup: the :class:`~tritonmoe.plan.memory_budget.TrainingSetup` (optimizer, master
            weights, ZeRO-1, checkpointing); ``optimizer='none'`` is refused (sizing trains).
        ep_sizes, capacity_factors, pipeline_degrees, memory_strategies, all_to_all: the values
            to search (defaults: EP sizes dividing both ``gpus`` and E; dropless, 1.0, 1.25;
            1, 2, 4; the layer's default expert block (None) and the five memory strategies; flat,
            and hierarchical where EP spans nodes).
        routing: the simulated routing ("uniform", "zipf:S" or E weights).
        mp_sizes: Parm's MP sizes to search (EP x MP x DP layouts, experts sharded over MP;
            default: every MP > 1 dividing the GPUs within a node when E < GPUs, none otherwise;
            ``()`` for none).
        lina: simulate Lina's priority of the all-to-all over the gradient all-reduce for the
            top candidates (those within the tie tolerance plus one) and rank the variants.
        attn_implementation: the attention the activation memory assumes ("sdpa", transformers'
            default, or "eager"; :func:`~tritonmoe.plan.memory_budget.memory_per_gpu`).

    Raises:
        ValueError / TypeError naming the value and the fix; :class:`SizingError` (a ValueError)
        when no candidate fits, naming the closest one's shortfall and what would make it fit.
    """
    gpus = _pos_int("gpus", gpus)
    m = get_model(model)
    if not isinstance(setup, TrainingSetup):
        raise TypeError(f"setup must be a TrainingSetup, got {type(setup).__name__}")
    if not setup.training:
        raise ValueError("size() sizes training (setup.optimizer='none' is serving); for serving memory use "
                         "memory_per_gpu(..., setup=TrainingSetup(optimizer='none'))")
    cost, cl, prov, device = _machine(cluster, gpus)
    T = _tokens(gpus, tokens_per_step, tokens_per_gpu)
    _pos_int("seq_len", seq_len)
    if memory_budget_bytes is not None and (isinstance(memory_budget_bytes, bool)
                                            or not isinstance(memory_budget_bytes, numbers.Integral)
                                            or memory_budget_bytes <= 0):
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r} must be a positive int (bytes) or None")
    capacity = int(memory_budget_bytes) if memory_budget_bytes is not None else device
    notes: list = []
    eps = _ep_sizes(m, gpus, notes) if ep_sizes is None else [_pos_int("ep_size", e) for e in ep_sizes]
    for e in eps:
        if gpus % e or m.num_experts % e:
            ok = [d for d in range(1, gpus + 1) if gpus % d == 0 and m.num_experts % d == 0]
            raise ValueError(f"ep_size={e} must divide gpus={gpus} and num_experts={m.num_experts}; use one of {ok}")
    bad = [s for s in memory_strategies if s not in DEFAULT_MEMORY_STRATEGIES]
    if bad:
        raise ValueError(f"memory strategies {bad}: use None (the layer's default) or {', '.join(STRATEGIES)}")
    for n in pipeline_degrees:
        _pos_int("pipeline_degree", n)
    degrees = [n for n in pipeline_degrees if n <= T]
    sim = _Sim(m, T, cost, routing, seq_len)
    mem_kw = dict(tokens_per_gpu=T, seq_len=seq_len, attn_implementation=attn_implementation)
    layouts = _mp_layouts(m, gpus, cl.gpus_per_node, eps, mp_sizes, notes)
    out = [_parm_candidate(sim, m, cost, gpus, ep, mp, cf, setup, mem_kw, capacity)
           for ep, mp in layouts for cf in capacity_factors]
    for ep in eps:
        spans = ep > cl.gpus_per_node
        exch = [a for a in (all_to_all or ("flat", "hierarchical")) if a == "flat" or spans]
        for a in exch:
            if a not in ("flat", "hierarchical"):
                raise ValueError(f"all_to_all={a!r}: use 'flat' or 'hierarchical'")
        for cf in capacity_factors:
            for n in degrees:
                for s in memory_strategies:
                    for a in exch:
                        out.append(_candidate(sim, m, cost, gpus, ep, cf, n, s, a, setup, mem_kw, capacity))
    if not out:
        raise SizingError(f"no candidate to evaluate for {m.name} on {gpus} GPUs (EP sizes {eps}, degrees {degrees})")
    rank = lambda c: (not c.fits, c.step_time if c.fits else c.shortfall, c.simplicity())  # noqa: E731
    out.sort(key=rank)
    lina_info: dict = {}
    if lina:
        before = next((c for c in out if c.fits), None)
        variants, lina_info = _lina_pass(out, sim, m, cost, gpus, setup, TIE_TOLERANCE)
        out = sorted(out + variants, key=rank)
        if variants:
            lina_info.update(before=before, variants=variants)
    if all(sim.effective_capacity(e, cf) is None for e in eps for cf in capacity_factors):
        notes.append(f"Under {routing!r} routing no capacity factor tried ({', '.join('dropless' if c is None else f'{c:g}' for c in capacity_factors)}) "
                     "drops a token: they run the same program and differ only in the memory reserved for rows.")
    report = SizingReport(m, gpus, cl.describe(), T, seq_len, capacity, out, prov, notes=notes,
                          efficiency=dict(cl.efficiency), lina=lina_info)
    if not report.fitting:
        c = min(out, key=lambda c: c.shortfall)
        fixes = _fixes(c.what_would_fit())
        raise SizingError(
            f"nothing fits: {m.name} on {gpus} GPUs needs at least {c.memory.total_bytes / GiB:.1f} GiB per GPU "
            f"({c.label()}), {c.shortfall / GiB:.1f} GiB over the {capacity / GiB:.1f} GiB budget. Fix: "
            + ("; or ".join(fixes[:3]) if fixes else "more GPUs, fewer tokens per GPU, or a larger budget"))
    return report
