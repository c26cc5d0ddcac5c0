"""Interleaved rounds: every implementation of a comparison timed once per round, in a rotated order.

A comparison (one case, one mode) builds its inputs once; each implementation is prepared by
:class:`bench.timing.DeviceTimer` (warm-up, ``N`` calls per replay, capture); then round ``r``
times every contender once, in the order rotated by ``r`` (so none always runs first, after the
same neighbour, or at the same point of a clock ramp). The roof GEMM and the copy roof join the
rotation as pseudo-implementations (:data:`ROOF_MATMUL`, :data:`ROOF_COPY`), so every round has
its own roofs, measured at that round's clock.

Statistics are of per-round values: a speedup is the median over rounds of
``t_other[r] / t_self[r]``, a roof fraction the median of ``floor[r] / t_self[r]`` where
``floor[r]`` is the work's time at round ``r``'s roofs; both with p20-p80. A row is *noisy* when
its device times' p80 / p20 exceeds :data:`NOISY_SPREAD`.

Counts: at least ``min_rounds`` rounds, and more until every implementation has spent
``min_device_s`` of device time in its reps (0.5 s for millisecond entries), at most
``max_rounds`` and, once ``min_rounds`` are done, at most ``max_case_s`` of wall time.
"""

from __future__ import annotations

from collections.abc import Sequence

from .harness import Work, quantile, summarize
from .timing import DeviceTimer, Prepared, per_clock_efficiency, throttle_names

ROOF_MATMUL = "roof:matmul"
ROOF_COPY = "roof:copy"
#: A row whose device times have p80 / p20 above this is flagged noisy.
NOISY_SPREAD = 1.10


def rotation(items: Sequence, r: int) -> list:
    """``items`` rotated left by ``r`` (round r starts with item r mod n)."""
    if not items:
        return []
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def run_rounds(timer: DeviceTimer, preps: Sequence[Prepared]) -> int:
    """Time every prepared contender once per round, rotated, until the counts are met (see the
    module docstring). Each contender's ``reps`` holds exactly one rep per round. Returns the
    number of rounds."""
    preps = list(preps)
    for p in preps:
        p.reps = []
    if not preps:
        return 0
    be = timer.backend
    t0 = be.now()
    spent = {id(p): 0.0 for p in preps}
    r = 0
    while True:
        for p in rotation(preps, r):
            rep = timer.rep(p)
            spent[id(p)] += rep.device_s * p.calls
        r += 1
        if r >= timer.max_rounds:
            break
        if r >= timer.min_rounds:
            if all(s >= timer.min_device_s for s in spent.values()):
                break
            if be.now() - t0 >= timer.max_case_s:
                break
    return r


def qstats(values: Sequence[float]) -> dict | None:
    """median, p20, p80, min, max of a list (None when empty)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    return {"median": quantile(xs, 0.5), "p20": quantile(xs, 0.2), "p80": quantile(xs, 0.8),
            "min": xs[0], "max": xs[-1]}


def per_round_ratios(num: Prepared, den: Prepared) -> list[float]:
    """``num.reps[r].device_s / den.reps[r].device_s`` for every round both timed."""
    return [a.device_s / b.device_s for a, b in zip(num.reps, den.reps) if b.device_s > 0]


def spread(stats: dict) -> float:
    return stats["p80"] / stats["p20"] if stats["p20"] > 0 else float("inf")


def roof_fractions(p: Prepared, work: Work, roofs: dict[str, tuple[Prepared, float]],
                   dtype_roof: str | None = None) -> tuple[list[float], str | None]:
    """Per-round roof fractions of ``p`` and the binding roof ("compute" / "memory").

    ``roofs`` maps :data:`ROOF_MATMUL` / :data:`ROOF_COPY` to (prepared, its work: FLOPs of one
    matmul, bytes of one copy), timed in the same rounds. Round r's floor is the larger of
    ``work.flops / (matmul FLOPs / t_matmul[r])`` and ``work.bytes / (copy bytes / t_copy[r])``."""
    mm, cp = roofs.get(ROOF_MATMUL), roofs.get(ROOF_COPY)
    out, bound = [], None
    for r, rep in enumerate(p.reps):
        if rep.device_s <= 0:
            continue
        t_c = t_m = 0.0
        if work.flops and mm is not None and r < len(mm[0].reps):
            t_c = work.flops * mm[0].reps[r].device_s / mm[1]
        if work.bytes and cp is not None and r < len(cp[0].reps):
            t_m = work.bytes * cp[0].reps[r].device_s / cp[1]
        if t_c == 0.0 and t_m == 0.0:
            continue
        bound = "compute" if t_c >= t_m else "memory"
        out.append(max(t_c, t_m) / rep.device_s)
    return out, bound


def fractions_by_roof(p: Prepared, work: Work, roofs: dict[str, tuple[Prepared, float]]) -> dict[str, list[float]]:
    """Per-round fraction of each roof separately: ``{"matmul": [...], "copy": [...]}`` (the
    time the work's FLOPs, or its bytes, take at round r's roof over the row's time at round r),
    for the targets stated against one roof."""
    out: dict[str, list[float]] = {}
    for key, name, amount in ((ROOF_MATMUL, "matmul", work.flops), (ROOF_COPY, "copy", work.bytes)):
        roof = roofs.get(key)
        if not amount or roof is None:
            continue
        prep, roof_amount = roof
        out[name] = [amount * prep.reps[r].device_s / roof_amount / rep.device_s
                     for r, rep in enumerate(p.reps) if r < len(prep.reps) and rep.device_s > 0]
    return out


def clock_record(p: Prepared) -> dict | None:
    """The SM clock of every rep (MHz, the mean of the readings before and after it), their
    median / min / max, and how many reps saw each throttle reason."""
    mhz = [rep.mhz for rep in p.reps]
    if not any(m is not None for m in mhz):
        return None
    vals = [m for m in mhz if m is not None]
    throttle: dict[str, int] = {}
    for rep in p.reps:
        for name in throttle_names(rep.throttle):
            throttle[name] = throttle.get(name, 0) + 1
    return {"sm_mhz": [None if m is None else round(m, 1) for m in mhz], "median": quantile(sorted(vals), 0.5),
            "min": min(vals), "max": max(vals), "throttle": throttle}


def clock_efficiencies(p: Prepared, flops: float | None, sms: int | None,
                       flop_per_clock: float | None) -> list[float]:
    """Per-rep per-clock efficiency (FLOPs / time / (SMs x FLOP per clock x that rep's clock))."""
    if not (flops and sms and flop_per_clock):
        return []
    return [per_clock_efficiency(flops, rep.device_s, sms, flop_per_clock, rep.mhz)
            for rep in p.reps if rep.mhz and rep.device_s > 0]


def timing_record(p: Prepared, rounds: int) -> dict:
    """The row's ``timing`` object: how its times were taken and how stable they were."""
    dev = summarize([rep.device_s for rep in p.reps])
    eager = [rep.eager_s for rep in p.reps if rep.eager_s is not None]
    return {
        "mode": p.mode,
        "note": p.note,
        "calls_per_replay": p.calls,
        "cold_l2": p.cold_l2,
        "rounds": rounds,
        "warmup_s": p.warmup_s,
        "estimate_s": p.estimate_s,
        "device_s": dev,
        "eager_s": summarize(eager) if eager else None,
        "spread": spread(dev),
        "noisy": spread(dev) > NOISY_SPREAD,
    }


__all__ = [
    "NOISY_SPREAD", "ROOF_COPY", "ROOF_MATMUL", "clock_efficiencies", "clock_record", "fractions_by_roof",
    "per_round_ratios", "qstats",
    "roof_fractions", "rotation", "run_rounds", "spread", "timing_record",
]
