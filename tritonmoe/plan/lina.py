"""Lina's planner options: expert packing (PAPERS.md section 1.3) and the chunk size (1.1).

**Expert packing** (001 section 4.2): with P devices and E experts, packing ``p`` puts ``p``
times as many experts on each device: the expert-parallel group shrinks to ``P / p`` ranks and
every expert gets ``p`` replicas, whose gradients are reduced over the expert-data-parallel group
(through the low-priority gradient lane, PAPERS.md 1.3 Reading). In this library that is the
mesh ``MoEMesh.build(dp=p, ep=P // p)`` (times any outer data parallelism): packing is a choice of
mesh shape, which :func:`tritonmoe.parallel.data_parallel` then runs with the right gradient
semantics. ``p = P`` is pure data parallelism (no all-to-all).

:func:`expert_packing` is the paper's rule as a pure function: starting at one (relative)
packing, double ``p`` while an FFN micro-op is shorter than an all-to-all micro-op, stopping
when it no longer is, when the next ``p`` does not fit in memory, or at ``p = P``.
:func:`packing_candidates` lists the packings a layout admits (the planner's candidate
dimension).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

__all__ = ["PackingChoice", "packing_candidates", "expert_packing", "LINA_CHUNK_CANDIDATES"]

#: Lina chunk sizes (bytes) the planner tries: the paper's study spans 10-100 MB, default 30 MB
#: (001 section 7.2.2); None is priority without partitioning (the paper's variant (b)).
LINA_CHUNK_CANDIDATES = (None, 4 * 2**20, 10 * 2**20, 30 * 2**20, 50 * 2**20, 100 * 2**20)

Timing = Union[Callable[[int], float], Mapping[int, float]]


@dataclass(frozen=True)
class PackingChoice:
    """A packing: ``p`` replicas per expert; the mesh is (dp=p, ep=P/p) with
    ``experts_per_device`` = E / (P/p) experts on every device; ``reason`` says why the search
    stopped there; ``trace`` holds every (p, t_ffn, t_a2a) the search looked at."""

    p: int
    ep: int
    experts_per_device: int
    reason: str
    trace: tuple[tuple[int, float, float], ...]


def packing_candidates(world_size: int, num_experts: int) -> list[int]:
    """Packings ``p`` (powers of two) with ``p`` dividing P and E divisible by the
    expert-parallel size P/p, ascending."""
    if world_size < 1 or num_experts < 1:
        raise ValueError(f"world_size={world_size} and num_experts={num_experts} must be >= 1")
    out, p = [], 1
    while p <= world_size:
        if world_size % p == 0 and num_experts % (world_size // p) == 0:
            out.append(p)
        p *= 2
    return out


def _at(t: Timing, p: int, what: str) -> float:
    v = t(p) if callable(t) else t.get(p)
    if v is None:
        raise ValueError(f"no {what} time for packing p={p}; give it for every candidate the search reaches")
    v = float(v)
    if not v >= 0.0:
        raise ValueError(f"{what} time for p={p} is {v}; times must be >= 0")
    return v


def expert_packing(
    ffn_time: Timing,
    a2a_time: Timing,
    *,
    world_size: int,
    num_experts: int,
    fits: Optional[Callable[[int], bool]] = None,
) -> PackingChoice:
    """Lina's packing rule (001 section 4.2) as a pure function.

    Args:
        ffn_time, a2a_time: the time of one expert-FFN micro-op and of one all-to-all micro-op
            at packing ``p`` (callables of p, or dicts p -> seconds: measured, or simulated by
            :mod:`tritonmoe.plan`). At ``p = P`` there is no all-to-all (give 0).
        world_size: P, devices of the layer; num_experts: E.
        fits: whether packing ``p`` fits in device memory (default: always).

    Returns: the first ``p`` of :func:`packing_candidates` (walked in powers of two) whose FFN
    micro-op takes at least as long as its all-to-all micro-op; the largest that fits when
    memory stops the search first (the paper offloads to DRAM instead, which this does not
    model); ``P`` at most.
    """
    cands = packing_candidates(world_size, num_experts)
    fits = fits or (lambda p: True)
    trace = []
    chosen, reason = cands[0], ""
    for j, p in enumerate(cands):
        if j > 0 and not fits(p):
            reason = f"p={p} does not fit in memory"
            break
        chosen = p
        tf, ta = _at(ffn_time, p, "FFN"), _at(a2a_time, p, "all-to-all")
        trace.append((p, tf, ta))
        if tf >= ta:
            reason = f"the FFN micro-op ({tf:.3g} s) outlasts the all-to-all micro-op ({ta:.3g} s)"
            break
    else:
        reason = f"largest packing p={chosen} (all experts' replicas on every device)" if chosen == world_size else \
            f"largest packing the layout admits (p={chosen})"
    ep = world_size // chosen
    return PackingChoice(chosen, ep, num_experts // ep, reason, tuple(trace))
