"""Memory strategies of the pipelined expert-parallel layer (MPMoE, paper 004), user-facing.

``MoEConfig(memory_strategy=..., memory_budget_bytes=..., memory_mi_buffers=...)`` with ``ep_group``:

* ``None`` (default): the unmanaged pipeline (its expert FFN keeps whatever its ops save).
* ``"keep"``: every micro-op keeps its own dispatched input (DI) and first-GEMM output (MI):
  nothing reused, nothing restored (the paper's PMoE baseline).
* ``"offload"`` (S1), ``"recomm"`` (S2), ``"recompute"`` (S3), ``"recomm_recompute"`` (S4):
  DI lives in two shared device buffers and MI in one (micro-op i overwrites i-2's / i-1's), or
  in two with ``memory_mi_buffers=2`` (i overwrites i-2's: its host copy runs beside the next
  micro-op's compute); what backward lacks is restored from pinned host copies, by re-running
  the dispatch all-to-all, or by recomputing the first GEMM (:mod:`tritonmoe.comm.programs.memory_reuse`).
* ``"auto"``: the planner's choice of the strategy (and of the degree with
  ``pipeline_degree="auto"``) under ``memory_budget_bytes`` (:mod:`tritonmoe.sim.memory_model`), for
  the config's ``memory_mi_buffers`` (``choose_memory(..., mi_buffers=(1, 2))`` compares both
  counts offline).

The trade-off: every reuse strategy keeps ``(2*d + n1) * max_i R_i`` elements on the device
(``2*(d + n1) * max_i R_i`` with two MI buffers) instead of ``(d + n1) * sum_i R_i``; offloading
costs host memory and copy bandwidth (hidden behind compute when the copy is shorter),
re-communicating costs one all-to-all per micro-op in backward, recomputing one first GEMM per
micro-op.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from tritonmoe.comm.programs.memory_reuse import RESTORE, STRATEGIES
from tritonmoe.comm.timeline import Timeline
from tritonmoe.sim.memory_model import MemoryPlan, choose_memory, joint_search_steps
from tritonmoe.sim.schedules import DEFAULT_DEGREES

from .degree import DegreePolicy, Pending, SearchDegree, fingerprint_int, runtime_cost_model, token_bucket

__all__ = ["AutoMemory", "SearchMemory", "STRATEGIES", "MEMORY_STRATEGIES", "uses_offload", "pinned_memory_available", "check_memory_strategy",
           "check_offload"]

#: Values of ``MoEConfig.memory_strategy`` besides None.
MEMORY_STRATEGIES = STRATEGIES + ("auto",)


def check_memory_strategy(value: Any) -> Optional[str]:
    """``value`` if it names a strategy (or is None); else a TypeError / ValueError naming it."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"memory_strategy must be a str or None, got {type(value).__name__} {value!r}")
    if value not in MEMORY_STRATEGIES:
        raise ValueError(f"memory_strategy={value!r} is not a memory strategy; use one of "
                         f"{', '.join(map(repr, MEMORY_STRATEGIES))} (or None for the unmanaged pipeline)")
    return value


def uses_offload(strategy: Optional[str]) -> bool:
    """Whether ``strategy`` copies activations to host memory."""
    return strategy in RESTORE and "offload" in RESTORE[strategy]


def pinned_memory_available() -> bool:
    """Whether page-locked host memory can be allocated here (needs a CUDA runtime)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


def check_offload(strategy: Optional[str], device: torch.device) -> None:
    """A ValueError when ``strategy`` offloads activations of a CUDA layer but pinned host memory
    cannot be allocated (the copies would be synchronous and unsafe to overlap). CPU layers copy
    into ordinary host memory on a worker thread."""
    if uses_offload(strategy) and torch.device(device).type == "cuda" and not pinned_memory_available():
        raise ValueError(
            f"memory_strategy={strategy!r} copies activations to pinned host memory, which is not available here "
            "(no CUDA runtime, or pin_memory failed); use memory_strategy='recomm_recompute' (no host copies) or "
            "'auto' (which then skips the offloading strategies)"
        )

# ---------------------------------------------------------------------------------------------
# The runtime policy: MoEConfig(memory_strategy="auto")
# ---------------------------------------------------------------------------------------------


class AutoMemory:
    """``memory_strategy="auto"``: per forward, the group agrees on its largest token count (one
    small all-reduce, as ``pipeline_degree="auto"``), and every rank runs :func:`choose_memory`
    for it (cached per token bucket) with the same cost model, so every rank picks the same
    (degree, strategy), or raises the same :class:`MemoryBudgetError` before any exchange.

    The degree is chosen too when ``config.pipeline_degree`` is "auto"; an int degree is kept."""

    def __init__(self, config: Any, group: Any, device: torch.device, dtype: torch.dtype,
                 strategies: Sequence[str] = STRATEGIES) -> None:
        self._base = DegreePolicy(group, device)
        self.config, self.dtype = config, dtype
        self.world_size = self._base.world_size
        self.cost = runtime_cost_model(config, self.world_size, device)
        if self.world_size > 1 and self.cost.cluster is None:
            self.cost.check_group_size(self.world_size, ("all_to_all",))
        self.strategies = tuple(strategies)
        self.fingerprint = fingerprint_int(self.cost.fingerprint() + ",".join(self.strategies)
                                            + str(config.memory_budget_bytes) + f"mi{config.memory_mi_buffers}")
        self.cache: dict[int, MemoryPlan] = {}

    def step(self, tokens: int, timeline: Optional[Any] = None) -> tuple[int, str, Optional[Any]]:
        """(degree, strategy, timeline to record into) for this forward (collective)."""
        t_max = int(self._base._agree([float(tokens)])[0])
        b, rep = token_bucket(t_max)
        if b not in self.cache:
            n = self.config.pipeline_degree
            degs = [k for k in DEFAULT_DEGREES if k == 1 or k <= rep] if n == "auto" else [int(n)]
            self.cache[b] = choose_memory(self.config, rep, self.cost, budget_bytes=self.config.memory_budget_bytes,
                                          degrees=degs, strategies=self.strategies, world_size=self.world_size,
                                          dtype=self.dtype, mode="symmetric" if self.world_size > 8 else "auto")
        p = self.cache[b]
        return p.pipeline_degree, p.strategy, timeline


class SearchMemory:
    """``memory_strategy="auto"`` with ``pipeline_degree="search"``: MPMoE-pb online. Per token
    bucket, :func:`joint_search_steps` asks for (degree, strategy) candidates; each runs one
    training step, whose expert-block time (forward + backward spans of the timeline, max over
    ranks through the same small all-reduce that agrees on the token count) is fed back at the
    next forward; when every strategy's search has ended, the bucket's best (degree, strategy)
    is cached. Ranks decide from the same agreed values, so they always run the same candidate.
    ``steps_profiled`` counts forwards that ran a candidate."""

    fingerprint = 0

    def __init__(self, config: Any, group: Any, device: torch.device,
                 strategies: Sequence[str] = STRATEGIES, n_min: int = 2, n_max: int = 8) -> None:
        self._base = DegreePolicy(group, device)
        self.strategies = tuple(strategies)
        self.n_min, self.n_max = n_min, n_max
        self.searches: dict = {}
        self.cache: dict[int, tuple[int, str]] = {}
        self.results: dict[int, dict] = {}
        self._gens: dict = {}
        self._next: dict = {}
        self._pending = None
        self._own = Timeline()
        self.steps_profiled = 0

    def step(self, tokens: int, timeline: Optional[Any] = None) -> tuple[int, str, Optional[Any]]:
        pend = self._pending
        measured = SearchDegree.measure(pend.timeline, pend.mark) if pend is not None else -1.0
        t_max, m_max = self._base._agree([float(tokens), measured])
        if pend is not None:
            self._pending = None
            if m_max > 0:  # every rank recorded the step (else the same candidate runs again)
                try:
                    self._next[pend.bucket] = self._gens[pend.bucket].send(m_max)
                except StopIteration as stop:
                    n, s, per = stop.value
                    self.cache[pend.bucket] = (n, s)
                    self.results[pend.bucket] = per
                    self._gens.pop(pend.bucket)
                    self._next.pop(pend.bucket, None)
        b, rep = token_bucket(int(t_max))
        if b in self.cache:
            n, s = self.cache[b]
            return n, s, timeline
        if b not in self._gens:
            gen = joint_search_steps(rep, self.searches, self.strategies, self.n_min, self.n_max)
            self._gens[b] = gen
            self._next[b] = next(gen)  # a first candidate is always profiled (see joint_search_steps)
        n, s = self._next[b]
        tl = timeline
        if tl is None:
            tl = self._own
            tl.clear()
        self._pending = Pending(b, n, tl, tl.mark())
        self.steps_profiled += 1
        return n, s, tl
