"""MPMoE's memory model and the joint choice of (pipeline degree, memory strategy).

Paper 004 §II-B / §III-C / §IV (``PAPERS.md`` §4.2, 4.3, 4.5, 4.6).

**The paper's model** (:func:`paper_memory`, Eqs. 1-6), per device with one expert and the gate,
in elements: model states ``M_ms = 4(E*M + 2*H*M)`` (parameter, gradient, Adam's two moments),
activations ``M_act = 4*B*M + B*H`` (T_I, T_DI, T_DO, T_O and T_M), the pipelined peak buffers
``M_buf = M_act``, the saving of memory reuse ``dM_act = dM_buf = B*(2M(n-2)/n + H(n-1)/n)`` and
the saving ratio ``phi = (dM_act + dM_buf) / (M_ms + M_act + M_buf)`` (0 at n = 1: nothing is
double-buffered then).

**The model of this library's layer** (:func:`expert_block_bytes`): what the managed expert
block (:mod:`tritonmoe.comm.programs.memory_reuse`) keeps for backward, in bytes, for the rows R_i each micro-op
receives. Adapting the paper to the real tensors:

* DI is micro-op i's received rows [R_i, d] (R counts a token once per chosen expert on this
  rank: the paper's B*M becomes sum_i R_i * d);
* MI is the first GEMM's output [R_i, n1] with n1 = 2 * d_ffn for SwiGLU (gate and up: the
  paper's H doubles) and d_ffn otherwise; the activation's output is not kept (recomputed from
  MI, the paper's "in place");
* "keep": sum_i R_i * (d + n1) elements;
* every reuse strategy: min(n, 2) DI buffers and one MI buffer of the largest micro-op (the
  paper's T_DI double buffer and T_M single buffer), in elements::

      DI: min(n, 2) * d * max_i R_i      (2 * d * max_i R_i for n >= 2)
      MI: n1 * max_i R_i                 (n1 = 2 * d_ffn for SwiGLU)
      device = (min(n, 2) * d + n1) * max_i R_i

  or, with ``mi_buffers=2`` (``MoEConfig.memory_mi_buffers``), min(n, 2) MI buffers too:
  ``device = min(n, 2) * (d + n1) * max_i R_i``;
* held between forward and backward (``held``): "keep" all of ``device``; a reuse strategy only
  the buffers with a single occupant (slot s of k buffers with s + k >= n): a buffer shared by
  several micro-ops ends the forward holding one whose backward restores it anyway, so the block
  frees it after the forward and allocates it again when its backward starts (at n >= 4 with one
  MI buffer: nothing; the expert outputs, the paper's T_DO, are not held either);

  (the paper's T_DO / T_O buffers are not this block's: the combine's outputs are kept by the
  unpermute for the routing weights' gradient);
* host bytes: the DI / MI of the micro-ops a strategy copies out
  (:func:`tritonmoe.comm.programs.memory_reuse.restore_schedule`).

**The time of a candidate** is the simulator's (:func:`tritonmoe.sim.simulate`) with the
restores issued as the runtime issues them (:func:`issue_memory_ops`): forward offload copies on
the copy lane after each micro-op's expert compute (the compute that overwrites a buffer waits
for its occupant's copy), backward DI restores (host copy or re-dispatch all-to-all) with
micro-op i's first exchange (one micro-op ahead), MI restores (host copy) after micro-op i-1's
backward compute (the single buffer's previous reader; micro-op 0's with its first exchange), or
after micro-op i-2's with two MI buffers, FC1 recomputes inside micro-op i's compute.

**The joint choice** :func:`choose_memory` evaluates every (degree, strategy) candidate, rejects
those whose predicted bytes exceed the budget (reporting each one's predicted bytes and step time)
and returns the fastest that fits; the profile-based variant :func:`search_joint` runs MPMoE's
Algorithm 1 once per strategy and compares (004 §IV-A).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional, Sequence, Union

import math
import numbers

import torch

from tritonmoe.comm.programs.memory_reuse import (
    MI_SLOTS,
    RESTORE,
    STRATEGIES,
    check_mi_buffers,
    memory_layout,
)
from tritonmoe.sim.simulate import routing_counts
from tritonmoe.sim.schedules import DEFAULT_DEGREES
from tritonmoe.sim.simulate import _tokens, parse_dtype, resolve_cost, simulate
from tritonmoe.sim.search import GranularitySearch

__all__ = [
    "paper_memory",
    "expert_block_bytes",
    "MemoryCandidate",
    "MemoryPlan",
    "MemoryBudgetError",
    "choose_memory",
    "search_joint",
    "joint_search_steps",
]


class MemoryBudgetError(ValueError):
    """No candidate fits the memory budget (a ValueError naming the budget, the smallest need and
    the fix)."""


# ---------------------------------------------------------------------------------------------
# The paper's model (Eqs. 1-6)
# ---------------------------------------------------------------------------------------------


def paper_memory(M: int, H: int, E: int, B: int, n: int) -> dict:
    """MPMoE's Eqs. 1-6 in elements for model width M, hidden width H, E experts (the gate's
    E*M), B tokens per device and n micro-batches: ``M_ms``, ``M_act``, ``M_buf`` (pipelined, no
    reuse), ``dM_act`` (= ``dM_buf``), the footprint without and with reuse, and ``phi``."""
    for name, v in (("M", M), ("H", H), ("E", E), ("B", B), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "B" else 1):
            raise ValueError(f"{name} must be a {'non-negative' if name == 'B' else 'positive'} int, got {v!r}")
    M_ms = 4 * (E * M + 2 * H * M)
    M_act = 4 * B * M + B * H
    M_buf = M_act
    dM = 0.0 if n < 2 else B * (2 * M * (n - 2) / n + H * (n - 1) / n)
    total = M_ms + M_act + M_buf
    return {"M_ms": M_ms, "M_act": M_act, "M_buf": M_buf, "dM_act": dM, "dM_buf": dM, "footprint": total,
            "footprint_reuse": total - 2 * dM, "phi": 2 * dM / total}


# ---------------------------------------------------------------------------------------------
# The managed expert block's bytes
# ---------------------------------------------------------------------------------------------


def expert_block_bytes(rows: Sequence[int], d_model: int, n1: int, strategy: str, element_size: int,
                       mi_buffers: int = MI_SLOTS) -> dict:
    """Bytes the managed expert block keeps for backward on one rank whose micro-ops receive
    ``rows[i]`` rows: ``device`` (saved DI and MI: separate tensors or the shared buffers, the
    block's working set during its forward and its backward), ``held`` (the part of ``device``
    still allocated between forward and backward: the buffers whose contents the backward reads
    without restoring them) and ``host`` (the copies a strategy offloads; on a CPU device they are
    in the same memory, so the bytes held there are ``held + host``), with ``mi_buffers`` shared
    MI buffers. See the module docstring for the adaptation."""
    n = len(rows)
    if n < 1:
        raise ValueError("rows must list at least one micro-op")
    if strategy not in RESTORE:
        raise ValueError(f"memory_strategy={strategy!r}: use one of {', '.join(STRATEGIES)}")
    lay = memory_layout(strategy, n, mi_buffers)
    es = int(element_size)
    if not lay.reuse:
        device = held = sum(rows) * (d_model + n1) * es
    else:
        top = max(rows)
        device = (lay.di_slots * d_model + lay.mi_slots * n1) * top * es
        # a buffer shared by several micro-ops (slot s + slots < n) is freed after the forward:
        # its last occupant is restored in backward anyway (memory_reuse._Memory.release)
        live = lambda slots: sum(1 for s in range(slots) if s + slots >= n)  # noqa: E731
        held = (live(lay.di_slots) * d_model + live(lay.mi_slots) * n1) * top * es
    host = (sum(rows[i] for i in lay.di_offloaded) * d_model + sum(rows[i] for i in lay.mi_offloaded) * n1) * es
    return {"device": int(device), "held": int(held), "host": int(host), "layout": lay}


# ---------------------------------------------------------------------------------------------
# The restores in the simulator
# ---------------------------------------------------------------------------------------------


@dataclass
class MemoryCandidate:
    """One (degree, strategy, MI buffers): predicted device bytes of the expert block's saved
    activations (the most loaded rank), host bytes, step time (seconds), and why it was rejected
    (None when it fits)."""

    pipeline_degree: int
    strategy: str
    device_bytes: int
    host_bytes: int
    step_time: float
    rejected: Optional[str] = None
    mi_buffers: int = MI_SLOTS


@dataclass
class MemoryPlan:
    """The joint choice: ``pipeline_degree``, ``strategy``, its predicted ``device_bytes`` and
    ``step_time``; ``candidates`` (every evaluated one, rejected ones with their reason);
    ``budget_bytes``; ``mi_buffers`` (the chosen MI buffer count)."""

    pipeline_degree: int
    strategy: str
    device_bytes: int
    step_time: float
    candidates: list[MemoryCandidate] = field(default_factory=list)
    budget_bytes: Optional[int] = None
    mi_buffers: int = MI_SLOTS

    @property
    def rejected(self) -> list[MemoryCandidate]:
        return [c for c in self.candidates if c.rejected is not None]

    def table(self) -> str:
        """Every candidate: degree, strategy, MI buffers, predicted device / host MiB, step ms,
        verdict."""
        lines = [f"{'n':>2} {'strategy':>17} {'MI bufs':>7} {'device MiB':>11} {'host MiB':>9} {'step ms':>9}  verdict"]
        for c in self.candidates:
            chosen = (c.pipeline_degree, c.strategy, c.mi_buffers) == (self.pipeline_degree, self.strategy,
                                                                        self.mi_buffers)
            verdict = "chosen" if chosen else (c.rejected or "slower")
            mi = "-" if c.strategy == "keep" else str(c.mi_buffers)
            lines.append(f"{c.pipeline_degree:>2} {c.strategy:>17} {mi:>7} {c.device_bytes / 2**20:>11.3f} "
                         f"{c.host_bytes / 2**20:>9.3f} {c.step_time * 1e3:>9.3f}  {verdict}")
        return "\n".join(lines)


def _rows_per_rank(config: Any, toks: Sequence[int], n: int, routing: Any) -> list[list[int]]:
    """Rows each rank receives per micro-op under ``routing`` (the simulator's counts)."""

    counts = routing_counts(config, toks, n, routing)  # [P(source), n, E]
    P = len(toks)
    L = config.num_experts // P
    per = counts.view(P, n, P, L).sum(dim=(0, 3))  # [n, P(dest)]
    return [[int(per[i, r]) for i in range(n)] for r in range(P)]


def _checked_choices(config: Any, tokens_per_rank, *, budget_bytes, degrees, strategies, world_size, time_fn,
                     mi_buffers) -> tuple[tuple, tuple]:
    """:func:`choose_memory`'s arguments checked (a typed error naming the value and the fix,
    before anything is simulated): the candidate strategies (default all five) and MI buffer
    counts (default the config's), de-duplicated."""
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                     or budget_bytes <= 0):
        raise ValueError(f"budget_bytes must be a positive int or None, got {budget_bytes!r}")
    if strategies is None:
        strategies = STRATEGIES
    elif isinstance(strategies, str):
        raise TypeError(f"strategies={strategies!r} is a string; pass a sequence of strategies, e.g. [{strategies!r}]")
    strategies = tuple(strategies)
    if not strategies:
        raise ValueError(f"strategies is empty; pass at least one of {', '.join(STRATEGIES)} (or None: all five)")
    if degrees is not None:
        if isinstance(degrees, (str, bytes)) or not isinstance(degrees, Sequence):
            raise TypeError(f"degrees must be a sequence of ints, got {type(degrees).__name__}")
        if not degrees:
            raise ValueError("degrees is empty; pass at least one pipeline degree >= 1 (or None: the defaults)")
        for n in degrees:
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"degrees holds {n!r} ({type(n).__name__}); pipeline degrees are ints >= 1")
            if n < 1:
                raise ValueError(f"degrees holds {n}; pipeline degrees are ints >= 1")
    if time_fn is not None and not callable(time_fn):
        raise TypeError(f"time_fn must be callable (n, strategy) -> seconds, got {type(time_fn).__name__}")
    if time_fn is not None and isinstance(tokens_per_rank, int) and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size={world_size!r}: with time_fn and an int tokens_per_rank, pass world_size "
                         "(an int >= 1), or tokens_per_rank as a per-rank sequence")
    for s in strategies:
        if s not in RESTORE:
            raise ValueError(f"unknown memory strategy {s!r}; use one of {', '.join(STRATEGIES)}")
    if mi_buffers is None:
        mis: tuple = (getattr(config, "memory_mi_buffers", MI_SLOTS),)
    elif isinstance(mi_buffers, (str, bytes)) or not isinstance(mi_buffers, (numbers.Integral, Sequence)):
        raise TypeError(f"mi_buffers must be an int or a sequence of ints (1, 2), got {mi_buffers!r}")
    else:
        mis = (mi_buffers,) if isinstance(mi_buffers, numbers.Integral) else tuple(mi_buffers)
    if not mis:
        raise ValueError("mi_buffers is empty; pass 1, 2 or (1, 2) (or None: the config's)")
    mis = tuple(dict.fromkeys(check_mi_buffers(m) for m in mis))
    if time_fn is not None and len(mis) > 1:
        raise ValueError(f"time_fn(n, strategy) cannot tell MI buffer counts apart; with mi_buffers={mis} profile "
                         "each count in its own choose_memory call")
    return strategies, mis


def choose_memory(
    config: Any,
    tokens_per_rank: Union[int, Sequence[int]],
    cluster_or_cost: Any,
    *,
    budget_bytes: Optional[int] = None,
    degrees: Optional[Sequence[int]] = None,
    strategies: Optional[Sequence[str]] = None,
    world_size: Optional[int] = None,
    routing: Any = "uniform",
    dtype: Optional[Union[str, torch.dtype]] = None,
    mode: str = "auto",
    time_fn: Optional[Callable[[int, str], float]] = None,
    mi_buffers: Optional[Union[int, Sequence[int]]] = None,
) -> MemoryPlan:
    """The fastest (pipeline degree, memory strategy) whose expert block fits ``budget_bytes``.

    Args:
        config: the layer's MoEConfig; ``tokens_per_rank``, ``cluster_or_cost``, ``world_size``,
            ``routing``, ``dtype``, ``mode``: as :func:`tritonmoe.sim.simulate`.
        budget_bytes: device bytes the expert block may keep for backward on the most loaded
            rank (None: no limit, so the fastest candidate wins).
        degrees: candidate degrees (default 1..8, at most the tokens per rank);
            ``strategies``: candidate strategies (default all five).
        time_fn: ``time_fn(n, strategy) -> seconds`` replacing the simulator (a profile).
        mi_buffers: the shared MI buffer count of the reuse strategies (default
            ``config.memory_mi_buffers``), or several (e.g. ``(1, 2)``) to compare them too: each
            reuse strategy is then a candidate per count ("keep" shares no buffer: once).

    Raises:
        MemoryBudgetError: when no candidate fits (naming the smallest need and its candidate).
    Ties go to the candidate evaluated first (smaller degree, then the order of
    :data:`~tritonmoe.comm.programs.memory_reuse.STRATEGIES`)."""

    strategies, mis = _checked_choices(config, tokens_per_rank, budget_bytes=budget_bytes, degrees=degrees,
                                       strategies=strategies, world_size=world_size, time_fn=time_fn,
                                       mi_buffers=mi_buffers)
    cost = None
    if time_fn is None:
        cost = resolve_cost(cluster_or_cost, dtype)
        dt = parse_dtype(dtype or cost.dtype)
        toks = _tokens(tokens_per_rank, world_size, cost)
    else:
        dt = parse_dtype(dtype or "float32")
        toks = tuple([int(tokens_per_rank)] * int(world_size)) if isinstance(tokens_per_rank, int) \
            else tuple(int(t) for t in tokens_per_rank)
    top = max(1, min(toks))
    degs = tuple(degrees) if degrees is not None else tuple(n for n in DEFAULT_DEGREES if n == 1 or n <= top)
    es = torch.empty((), dtype=dt).element_size()
    n1 = config.n1
    cands: list[MemoryCandidate] = []
    for n in degs:
        per_rank = _rows_per_rank(config, toks, n, routing)
        for s in strategies:
            for mi in ((MI_SLOTS,) if s == "keep" else mis):  # "keep" shares no buffer
                sizes = [expert_block_bytes(r, config.d_model, n1, s, es, mi) for r in per_rank]
                dev = max(x["device"] for x in sizes)
                host = max(x["host"] for x in sizes)
                if time_fn is not None:
                    t = float(time_fn(n, s))
                    if not math.isfinite(t) or t < 0:
                        raise ValueError(f"time_fn({n}, {s!r}) returned {t}; it must return finite seconds >= 0")
                else:
                    t = simulate(config, toks, cost, candidate={"schedule": "ep-pipeline", "pipeline_degree": n,
                                                                "memory_strategy": s, "memory_mi_buffers": mi},
                                 dtype=dt, mode=mode, routing=routing).step_time()
                why = None
                if budget_bytes is not None and dev > budget_bytes:
                    why = f"needs {dev} B > budget {budget_bytes} B"
                cands.append(MemoryCandidate(n, s, dev, host, t, why, mi))
    fits = [c for c in cands if c.rejected is None]
    if not fits:
        small = min(cands, key=lambda c: (c.device_bytes, c.step_time))
        raise MemoryBudgetError(
            f"memory_budget_bytes={budget_bytes} is below the smallest candidate's need: {small.device_bytes} bytes "
            f"(pipeline_degree={small.pipeline_degree}, memory_strategy={small.strategy!r}, "
            f"memory_mi_buffers={small.mi_buffers}) for {max(toks)} tokens per "
            f"rank; raise the budget to at least {small.device_bytes}, or allow larger pipeline degrees"
        )
    best = min(fits, key=lambda c: c.step_time)
    return MemoryPlan(best.pipeline_degree, best.strategy, best.device_bytes, best.step_time, cands, budget_bytes,
                      best.mi_buffers)


def joint_search_steps(B: float, searches: dict, strategies: Sequence[str] = STRATEGIES, n_min: int = 2,
                       n_max: int = 8) -> Generator[tuple[int, str], float, tuple[int, str, dict]]:
    """MPMoE-pb (004 §IV-A) as a generator: Algorithm 1
    (:class:`~tritonmoe.sim.search.GranularitySearch`, one per strategy in ``searches``, kept
    across calls) for each strategy in turn; it yields each ``(n, strategy)`` to profile, expects
    the measured seconds sent back, and returns ``(n, strategy, {strategy: (n, seconds)})``, the
    best candidate by comparison. A strategy whose search answers from its known ranges without
    profiling has its answer profiled once, so every strategy is compared on a measurement."""

    per: dict = {}
    for s in strategies:
        g = searches.setdefault(s, GranularitySearch(n_min, n_max))
        gen = g.steps(B)
        seen: dict = {}
        try:
            n = next(gen)
            while True:
                t = yield (n, s)
                seen[n] = t
                n = gen.send(t)
        except StopIteration as stop:
            n_s = stop.value
        if n_s not in seen:
            seen[n_s] = yield (n_s, s)
        per[s] = (n_s, seen[n_s])
    s_best = min(per, key=lambda s: per[s][1])
    return per[s_best][0], s_best, per


def search_joint(
    B: float,
    profile: Callable[[float, int, str], float],
    *,
    strategies: Sequence[str] = STRATEGIES,
    n_min: int = 2,
    n_max: int = 8,
    searches: Optional[dict] = None,
) -> tuple[int, str, dict]:
    """:func:`joint_search_steps` driven by ``profile(B, n, strategy) -> seconds``; ``searches``
    (strategy -> search) carries the searches' state across calls. Returns
    ``(n, strategy, {strategy: (n, seconds)})``."""
    searches = searches if searches is not None else {}
    gen = joint_search_steps(B, searches, strategies, n_min, n_max)
    try:
        n, s = next(gen)
        while True:
            n, s = gen.send(profile(B, n, s))
    except StopIteration as stop:
        return stop.value
