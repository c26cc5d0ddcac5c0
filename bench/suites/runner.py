"""Running a planned case: build its inputs once, measure its entries, fill their rows.

Two methods:

* the classic one (``ctx.rounds is None``, ``python -m bench``): each entry in turn through
  :class:`bench.harness.Timer` (warm-up, reps with an L2 flush, CUDA events);
* interleaved rounds (``ctx.rounds`` a :class:`bench.timing.DeviceTimer`, ``python -m bench
  check``): per mode, every entry is prepared (warm-up, graph capture) and the prepared entries
  plus the roof pseudo-implementations of ``ctx.roof_preps`` are timed in rotated rounds
  (:mod:`bench.rounds`); rows carry device and eager time, per-round ratios, per-rep clocks
  and per-clock efficiency.
"""

from __future__ import annotations

from typing import Any

import torch

import tritonmoe as tm

from .. import rounds as RD
from ..harness import (
    BASELINE_IMPLS,
    Unavailable,
    Work,
    attach_speedups,
    fill_timing,
    first_line,
    free_memory,
    is_oom,
    new_row,
)
from ..peers import PEER_IMPLS
from ..timing import Prepared
from .common import Case, Context, Entry

#: Implementations a row's ``speedup`` is reported against (the baselines and the peers).
SPEEDUP_IMPLS = tuple(dict.fromkeys((*BASELINE_IMPLS, *PEER_IMPLS)))


def run_case(ctx: Context, case: Case, progress=None) -> list[dict]:
    """Build the case's inputs once, measure its entries (in rounds when ``ctx.rounds`` is set),
    attach speedups per mode."""
    rows: list[dict] = []
    state = None
    build_error: str | None = None
    try:
        with tm.validation(False):
            state = case.build()
    except Exception as exc:  # e.g. out of memory for the inputs: every entry records it
        build_error = ("out of memory building the inputs: " if is_oom(exc) else "building the inputs: ") + first_line(exc)
    rows = [new_row(suite=case.suite, case=case.label, mode=e.mode, impl=e.impl, params=case.params)
            for e in case.entries]
    if build_error is not None:
        for row in rows:
            row["status"], row["note"] = "error", build_error
    elif ctx.rounds is not None:
        for mode in dict.fromkeys(e.mode for e in case.entries):
            group = [(e, row) for e, row in zip(case.entries, rows) if e.mode == mode]
            if progress is not None:
                progress.step(f"{case.suite} {case.label} {mode} ({len(group)} in rounds)")
            measure_in_rounds(ctx, group, state)
    else:
        for e, row in zip(case.entries, rows):
            if progress is not None:
                progress.step(f"{case.suite} {case.label} {e.mode} {e.impl}")
            _run_entry(ctx, e, state, row)
    del state
    free_memory()
    if ctx.rounds is None:
        for mode in {r["mode"] for r in rows}:
            attach_speedups([r for r in rows if r["mode"] == mode])
    return rows


def _run_entry(ctx: Context, e: Entry, state, row: dict) -> None:
    """Measure one entry into its row. Tensors of a finished entry go by reference counting
    (a full garbage collection takes tens of ms, so it runs once per case, and after a failure,
    whose traceback may hold the failed call's tensors)."""
    try:
        with tm.validation(False):
            fn, work = e.make(state)
            m = ctx.timer.measure(fn)
        del fn
    except (Unavailable, NotImplementedError) as exc:
        row["status"], row["note"] = "unavailable", _one_line(exc)
        return
    except Exception as exc:  # any failure is recorded on its row; the run goes on
        row["status"] = "error"
        row["note"] = ("out of memory: " if is_oom(exc) else "") + first_line(exc)
    if row["status"] == "error":
        free_memory()  # outside the except block, whose traceback holds the failed call's frames
        return
    fill_timing(row, m.times_s, work, ctx.roofs)
    mem = row["memory"]
    mem["peak_bytes"], mem["peak_extra_bytes"] = m.peak_bytes, m.peak_extra_bytes
    if m.peak_bytes is not None and mem["analytic_min_bytes"]:
        mem["ratio"] = m.peak_bytes / mem["analytic_min_bytes"]
    row["telemetry"] = m.telemetry


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Interleaved rounds
# ---------------------------------------------------------------------------------------------


def _prepare_entry(ctx: Context, e: Entry, state, row: dict) -> tuple[Prepared, Work] | None:
    """make + prepare one entry; a failure is written on its row (None returned)."""
    try:
        with tm.validation(False):
            fn, work = e.make(state)
            prep = ctx.rounds.prepare(e.impl, fn)
        return prep, work
    except (Unavailable, NotImplementedError) as exc:
        row["status"], row["note"] = "unavailable", _one_line(exc)
    except Exception as exc:  # any failure is recorded on its row; the run goes on
        row["status"] = "error"
        row["note"] = ("out of memory: " if is_oom(exc) else "") + first_line(exc)
    return None


def measure_in_rounds(ctx: Context, group: list[tuple[Entry, dict]], state) -> None:
    """Prepare every entry of one comparison (one case, one mode), time them with the run's roof
    pseudo-implementations in interleaved rounds, and fill their rows."""
    made: list[tuple[dict, Prepared, Work]] = []
    for e, row in group:
        got = _prepare_entry(ctx, e, state, row)
        if got is None:
            free_memory()
        else:
            made.append((row, *got))
    if not made:
        return
    roofs = dict(ctx.roof_preps)
    contenders = [p for _, p, _ in made] + [p for p, _ in roofs.values()]
    try:
        with tm.validation(False):
            n = RD.run_rounds(ctx.rounds, contenders)
    except Exception as exc:  # a failure mid-rounds: every row of the comparison records it
        note = ("out of memory in the rounds: " if is_oom(exc) else "in the rounds: ") + first_line(exc)
        for row, _, _ in made:
            row["status"], row["note"] = "error", note
        return
    by_impl = {row["impl"]: p for row, p, _ in made}
    for row, p, work in made:
        fill_round_row(ctx, row, p, work, n, roofs, by_impl)
        peak_memory(ctx, p, row)


def fill_round_row(ctx: Context, row: dict, p: Prepared, work: Work, rounds: int,
                   roofs: dict[str, tuple[Prepared, float]], by_impl: dict[str, Prepared]) -> None:
    """A row from its prepared entry's reps: device-time statistics (``time_s``), the ``timing``
    record (mode, rounds, eager time, noisy flag), per-round roof fractions, per-rep clocks and
    per-clock efficiency, and the per-round ratios to every other implementation of the rounds
    (``peers``; ``speedup`` keeps the baselines' and peers' medians)."""
    fill_timing(row, [rep.device_s for rep in p.reps], work, ctx.roofs)
    row["timing"] = RD.timing_record(p, rounds)
    fracs, bound = RD.roof_fractions(p, work, roofs)
    if fracs:
        q = RD.qstats(fracs)
        row["roof_frac"], row["roof_bound"], row["roof_frac_q"] = q["median"], bound, q
    row["roof_fracs"] = {k: RD.qstats(v) for k, v in RD.fractions_by_roof(p, work, roofs).items() if v}
    row["clocks"] = RD.clock_record(p)
    # per-clock efficiency of the tensor cores: for compute-bound rows only (a memory-bound row's
    # FLOPs over the tensor-core peak would say nothing about it)
    compute = row["roof_bound"] in ("compute", None)
    eff = RD.clock_efficiencies(p, work.flops, ctx.sms, ctx.flop_per_clock) if compute else []
    row["per_clock_eff"] = RD.qstats(eff)
    peers = {}
    for impl, other in by_impl.items():
        if other is not p:
            q = RD.qstats(RD.per_round_ratios(other, p))
            if q is not None:
                peers[impl] = q
    row["peers"] = peers
    row["speedup"] = {b: q["median"] for b, q in peers.items() if b in SPEEDUP_IMPLS}
    # the ratio every speed claim quotes: to the fastest peer of the same rounds
    measured = {b: q for b, q in peers.items() if b in PEER_IMPLS}
    if measured and row["impl"] not in PEER_IMPLS:
        best = min(measured, key=lambda b: measured[b]["median"])
        row["best_peer"] = {"impl": best, **measured[best]}


def peak_memory(ctx: Context, p: Prepared, row: dict) -> None:
    """Peak allocated bytes of one eager call (CUDA only; graph pools of the comparison count in
    ``peak_bytes``, ``peak_extra_bytes`` is the call's own)."""
    if not ctx.is_cuda:
        return
    try:
        torch.cuda.synchronize(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        with tm.validation(False):
            p.fn()
        torch.cuda.synchronize(ctx.device)
        peak = torch.cuda.max_memory_allocated(ctx.device)
    except Exception as exc:  # e.g. out of memory with the graphs' pools held: left unmeasured
        row["extra"]["peak_memory_note"] = first_line(exc)
        return
    mem = row["memory"]
    mem["peak_bytes"], mem["peak_extra_bytes"] = int(peak), int(peak - before)
    if mem["analytic_min_bytes"]:
        mem["ratio"] = peak / mem["analytic_min_bytes"]


def prepare_roofs(ctx: Context, timer: Any, *, matmul_n: int, copy_bytes: int,
                  dtype: torch.dtype) -> dict[str, tuple[Prepared, float]]:
    """The roof pseudo-implementations of the rounds, prepared once per run: a dense
    ``matmul_n``^3 matmul in ``dtype`` (2 n^3 FLOPs) and a ``copy_bytes`` device copy (read +
    written: 2 x bytes). A roof that cannot be prepared is left out with one log line."""
    out: dict[str, tuple[Prepared, float]] = {}
    dev = ctx.device
    try:
        a = torch.randn(matmul_n, matmul_n, device=dev, dtype=dtype)
        b = torch.randn(matmul_n, matmul_n, device=dev, dtype=dtype)
        c = torch.empty(matmul_n, matmul_n, device=dev, dtype=dtype)
        out[RD.ROOF_MATMUL] = (timer.prepare(RD.ROOF_MATMUL, lambda: torch.matmul(a, b, out=c), cold_l2=False,
                                                 eager=False),
                               2.0 * matmul_n**3)
    except Exception as exc:  # out of memory, say: the rows fall back to the start-of-run roofs
        ctx.log(f"{RD.ROOF_MATMUL}: not in the rounds ({first_line(exc)})")
    try:
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev).random_(0, 255)
        dst = torch.empty_like(src)
        out[RD.ROOF_COPY] = (timer.prepare(RD.ROOF_COPY, lambda: dst.copy_(src), cold_l2=False, eager=False), 2.0 * copy_bytes)
    except Exception as exc:  # as above
        ctx.log(f"{RD.ROOF_COPY}: not in the rounds ({first_line(exc)})")
    return out


__all__ = ["SPEEDUP_IMPLS", "fill_round_row", "measure_in_rounds", "prepare_roofs", "run_case"]
