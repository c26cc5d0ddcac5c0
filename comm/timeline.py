"""Timeline: when each micro-op of an expert-parallel block started and ended.

A :class:`Timeline` is an optional recorder handed to an executor (``MoELayer.timeline``). Each
operation of a schedule appends one :class:`Span`: its kind (``"dispatch"``, ``"combine"``,
``"expert"``, ``"partition"``, ``"wgrad"`` (the backward's deferred weight-gradient step,
recorded once under the last micro-op), and whatever later schedules add: ``"allreduce"``,
``"offload"``, ...), the micro-op index, the phase (``"fwd"`` or ``"bwd"``), the lane it ran on
(see :mod:`tritonmoe.comm.executor`), the rank (the simulator records every rank of a virtual
cluster in one timeline; a measured timeline holds one rank) and its start and end in seconds.

Clocks:

* CPU: ``time.perf_counter``. A gloo all-to-all issued with ``async_op=True`` starts when it is
  issued and ends when its future completes (a callback on gloo's worker thread), so a collective
  queued behind another one counts its queueing as communication time.
* CUDA: events recorded on the stream the step runs on; times are relative to the first event of
  the timeline and are read (with a synchronization) only when :meth:`Timeline.spans` is called.

:meth:`Timeline.pipeline_efficiency` is the fraction of communication time during which expert
compute is running: ``|union(comm spans) & union(expert spans)| / |union(comm spans)|``. It is 0
when nothing overlaps (``pipeline_degree=1``) and approaches 1 when every all-to-all is hidden
behind an expert FFN.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

__all__ = ["Span", "Timeline", "COMM_KINDS", "COMPUTE_KINDS"]

#: Span kinds that are communication, and those that are expert compute.
COMM_KINDS = ("dispatch", "combine")
COMPUTE_KINDS = ("expert", "wgrad")


def _is_comm(span: "Span") -> bool:
    """Communication: a span on a communication lane, or (spans without a lane) of a comm kind."""
    return span.lane.startswith("comm") if span.lane else span.kind in COMM_KINDS


def _is_compute(span: "Span") -> bool:
    return span.lane == "compute" if span.lane else span.kind in COMPUTE_KINDS

#: How long :meth:`Timeline.spans` waits for a communication future's completion callback.
_CALLBACK_WAIT_S = 5.0


@dataclass
class Span:
    """One micro-op step: ``kind`` of micro-op ``micro_op`` in ``phase``, from ``start`` to ``end``
    seconds (on the timeline's clock; see the module docstring)."""

    kind: str
    micro_op: int
    phase: str
    start: float
    end: float
    lane: str = ""
    rank: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class _Open:
    """A span being recorded: wall-clock floats, or CUDA events, or an end set by a callback."""

    kind: str
    micro_op: int
    phase: str
    start: object = None
    end: object = None
    done: threading.Event = field(default_factory=threading.Event)
    awaits_callback: bool = False  # closed by a communication future's callback
    lane: str = ""
    rank: int = 0


class Timeline:
    """Records micro-op spans; see the module docstring.

    Usage::

        layer.timeline = Timeline()
        layer(x).sum().backward()
        print(layer.timeline.pipeline_efficiency(), layer.timeline.spans())
        layer.timeline.clear()
    """

    def __init__(self) -> None:
        self._open: list[_Open] = []
        self._lock = threading.Lock()
        self._cuda_base: Optional[torch.cuda.Event] = None

    # -- recording (used by the dispatcher) ---------------------------------------------------

    def start(self, kind: str, micro_op: int, phase: str, stream=None, lane: str = "") -> _Open:
        """Open a span now (on ``stream``'s clock for a CUDA stream, else the wall clock)."""
        rec = _Open(kind, micro_op, phase, lane=lane)
        if stream is not None:
            if self._cuda_base is None:
                self._cuda_base = torch.cuda.Event(enable_timing=True)
                self._cuda_base.record(stream)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            rec.start = ev
        else:
            rec.start = time.perf_counter()
        with self._lock:
            self._open.append(rec)
        return rec

    def stop(self, rec: _Open, stream=None) -> None:
        """Close a span now (same clock as :meth:`start`)."""
        if stream is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            rec.end = ev
        else:
            rec.end = time.perf_counter()
        rec.done.set()

    def stop_when_done(self, rec: _Open, future) -> None:
        """Close a span when ``future`` (a ``torch.futures.Future`` of an async collective)
        completes; the callback runs on the communication thread."""

        def _done(_fut) -> None:
            rec.end = time.perf_counter()
            rec.done.set()

        rec.awaits_callback = True
        future.add_done_callback(_done)

    def add(self, span: Span) -> None:
        """Append a finished span (the simulator's virtual clock)."""
        rec = _Open(span.kind, span.micro_op, span.phase, span.start, span.end, lane=span.lane, rank=span.rank)
        rec.done.set()
        with self._lock:
            self._open.append(rec)

    # -- reading ------------------------------------------------------------------------------

    def clear(self) -> None:
        with self._lock:
            self._open = []
            self._cuda_base = None

    def mark(self) -> int:
        """A position in the record: ``spans(since=mark)`` returns only what was recorded after
        it (to time one step without clearing a user's timeline)."""
        with self._lock:
            return len(self._open)

    def spans(self, phase: Optional[str] = None, since: int = 0) -> list[Span]:
        """Closed spans (of ``phase`` if given; recorded after ``since``, a :meth:`mark`), in
        start order. Synchronizes CUDA events."""
        with self._lock:
            recs = list(self._open[since:])
        out = []
        for rec in recs:
            if phase is not None and rec.phase != phase:
                continue
            if not rec.done.wait(_CALLBACK_WAIT_S if rec.awaits_callback else 0.0):
                continue  # never closed (the step raised); not a span
            if isinstance(rec.start, torch.cuda.Event):
                self._cuda_base.synchronize()
                rec.start.synchronize()
                rec.end.synchronize()
                start = self._cuda_base.elapsed_time(rec.start) * 1e-3
                end = self._cuda_base.elapsed_time(rec.end) * 1e-3
            else:
                start, end = rec.start, rec.end
            out.append(Span(rec.kind, rec.micro_op, rec.phase, start, end, rec.lane, rec.rank))
        out.sort(key=lambda s: (s.start, s.end))
        return out

    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.spans()})

    def step_time(self, phase: Optional[str] = None) -> float:
        """Seconds from the first span's start to the last span's end (over every rank)."""
        spans = self.spans(phase)
        if not spans:
            return 0.0
        return max(s.end for s in spans) - min(s.start for s in spans)

    def breakdown(self, phase: Optional[str] = None, rank: Optional[int] = None) -> dict[str, float]:
        """Where a step's time goes, on one rank (the slowest, by default): ``step`` (first start
        to last end), ``compute`` (union of compute-lane spans), ``comm`` (union of
        communication-lane spans), ``overlap`` (communication during compute), ``exposed_comm``
        (communication while nothing computes), ``idle`` (neither) and ``pipeline_efficiency``."""
        spans = self.spans(phase)
        if rank is None and spans:
            per = {}
            for s in spans:
                lo, hi = per.get(s.rank, (s.start, s.end))
                per[s.rank] = (min(lo, s.start), max(hi, s.end))
            rank = max(per, key=lambda r: per[r][1] - per[r][0])
        mine = [s for s in spans if s.rank == rank] if rank is not None else []
        if not mine:
            return dict(step=0.0, compute=0.0, comm=0.0, overlap=0.0, exposed_comm=0.0, idle=0.0, pipeline_efficiency=0.0)
        comm = _union((s.start, s.end) for s in mine if _is_comm(s))
        comp = _union((s.start, s.end) for s in mine if _is_compute(s))
        busy = _union([(a, b) for a, b in comm] + [(a, b) for a, b in comp])
        step = max(s.end for s in mine) - min(s.start for s in mine)
        c_comm = sum(b - a for a, b in comm)
        c_comp = sum(b - a for a, b in comp)
        overlap = _intersection_length(comm, comp)
        return dict(
            step=step,
            compute=c_comp,
            comm=c_comm,
            overlap=overlap,
            exposed_comm=c_comm - overlap,
            idle=step - sum(b - a for a, b in busy),
            pipeline_efficiency=overlap / c_comm if c_comm > 0 else 0.0,
        )

    def total(self, kind: str, phase: Optional[str] = None) -> float:
        """Summed duration of the spans of ``kind`` (seconds)."""
        return sum(s.duration for s in self.spans(phase) if s.kind == kind)

    def pipeline_efficiency(self, phase: Optional[str] = None) -> Optional[float]:
        """Fraction of communication time during which expert compute runs (None without
        communication spans)."""
        spans = self.spans(phase)
        comm = _union((s.start, s.end) for s in spans if s.kind in COMM_KINDS)
        comp = _union((s.start, s.end) for s in spans if s.kind in COMPUTE_KINDS)
        # (kinds, not lanes: the paper's metric counts the expert FFN during the dispatch and
        # combine all-to-alls; other communication, e.g. gradient allreduce, is not in it)
        comm_time = sum(b - a for a, b in comm)
        if comm_time <= 0.0:
            return None
        return _intersection_length(comm, comp) / comm_time


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint intervals covering the given ones."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _intersection_length(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo = max(xs[i][0], ys[j][0])
        hi = min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


#: Public names of the interval helpers (the benchmarks measure copy overlap with them).
union = _union
intersection_length = _intersection_length
