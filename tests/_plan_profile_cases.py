"""Per-rank bodies of tests/test_plan_profile.py (spawned gloo groups, see tests/_dist.py)."""

from __future__ import annotations

import weakref

import torch

import tritonmoe.plan.profile as prof

TINY = dict(shapes=((16, 16, 4, 2),), tokens=(8, 9, 10, 11), reps=3, warmup=0, log=False)


def once_sequence() -> list:
    """The sequence of ops this rank times in ``_compute_samples`` (op index per ``_once``)."""
    seen, seq = {}, []
    real_once = prof._once

    def spy(fn, device):
        seq.append(seen.setdefault(id(fn), len(seen)))
        return real_once(fn, device)

    prof._once = spy
    try:
        prof._compute_samples(prof.ProfileSpec(**TINY), torch.device("cpu"))
    finally:
        prof._once = real_once
    return seq


def op_sets_alive() -> int:
    """The most sets of the layer's ops (one per shape and token count) alive at once while
    ``_compute_samples`` runs."""
    alive, peak = [0], [0]
    real = prof._layer_ops

    def counting(*a, **kw):
        ops = real(*a, **kw)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(ops[0][2], lambda: alive.__setitem__(0, alive[0] - 1))
        return ops

    prof._layer_ops = counting
    try:
        prof._compute_samples(prof.ProfileSpec(**TINY), torch.device("cpu"))
    finally:
        prof._layer_ops = real
    return peak[0]


def phases_passed() -> dict:
    """For each ``collectives_in_place``: whether ``_collective_samples`` timed every collective
    with a compute phase (``_time_group``'s ``phase``), and how many it timed."""
    out = {}
    real = prof._time_group
    for in_place in (True, False):
        seen = []

        def spy(fn, group, device, reps, warmup, phase=None):
            seen.append(phase is not None)
            return 1e-3

        prof._time_group = spy
        try:
            spec = prof.ProfileSpec(sizes=(1024, 4096), kinds=("all_to_all", "all_reduce"), collectives_in_place=in_place,
                                    **{k: v for k, v in TINY.items() if k not in ("reps", "warmup")})
            prof._collective_samples(spec, torch.device("cpu"), [0, 0])
        finally:
            prof._time_group = real
        out[in_place] = seen
    return out


def all_cases(rank: int, P: int) -> dict:
    return {"once_sequence": once_sequence(), "op_sets_alive": op_sets_alive(), "phases": phases_passed()}
