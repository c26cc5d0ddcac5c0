"""Executors: what a schedule's operations run on.

A *schedule* (the micro-op pipeline of :mod:`tritonmoe.comm.programs.pipeline`, and every scheduler built
on it: memory strategies, Parm's schedules, Lina's priority communication) is plain Python that
issues operations through an :class:`Executor`, in program order:

* ``compute(fn, *args, work=...)``: local work (expert FFN, re-layout copies, weight gradients);
* collectives: ``all_to_all``, ``all_gather``, ``all_reduce``, ``reduce_scatter``, ``send_recv``;
* ``copy(x, to="host"|"device")``: host/device transfers (offloading);
* ``wait(handle)``: the value of an earlier operation, ready for the next local work.

Each operation names a **lane** (where it runs) and returns a :class:`Handle`; passing a handle
as an argument of a later operation is a dependency (the later one starts after the earlier
one's result exists), and ``after=(h, ...)`` adds dependencies that carry no data (a buffer that
may be reused only after another operation is done with it). Operations on one lane run in
issue order; operations on different lanes may overlap. Lanes:

* :data:`COMPUTE`: the compute stream (CUDA) / the calling thread (CPU);
* :data:`COMM`, :data:`COMM2`, ...: communication lanes (a dedicated CUDA stream each; gloo
  async work on CPU). Two lanes on two process groups really run concurrently;
* :data:`COPY`: host/device copies (a CUDA stream; a worker thread on CPU).

Two executors run the same schedule code:

* :class:`RealExecutor` runs it on ``torch.distributed``: CUDA streams ordered by events (the host
  never blocks), or gloo async work handles on CPU (the host blocks only where a result is used).
* :class:`tritonmoe.plan.SimExecutor` records it, for every rank of a virtual cluster in one
  process, and a discrete-event engine gives each operation a start and end on virtual clocks
  from a cost model. It needs no process group and no real tensors: arguments are
  :class:`VirtualTensor` (shape, dtype) and ``compute``'s ``fn`` is never called, so every
  ``compute`` states its ``work`` (FLOPs, bytes) and the shape of its result (``out``).

Both write the same :class:`~tritonmoe.comm.Timeline` (spans per rank, lane, kind, micro-op and
phase) and both keep :attr:`Executor.trace`, the (lane, kind, micro-op, phase) of every
operation in issue order, so a simulated and a measured run can be compared op by op.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .compat import all_gather_single, reduce_scatter_single
from .errors import LaneStartError, ScheduleError, backend_errors, lane_start
from .timeline import Timeline

__all__ = [
    "COMPUTE",
    "COMM",
    "COMM2",
    "COPY",
    "Work",
    "VirtualTensor",
    "Handle",
    "TraceEntry",
    "Executor",
    "RealExecutor",
    "ScheduleError",
    "LaneStartError",
]

#: Lane names.
COMPUTE = "compute"
COMM = "comm"
COMM2 = "comm2"
COPY = "copy"
#: Every lane a schedule may name. Communication lanes are those starting with "comm".
LANES = (COMPUTE, COMM, COMM2, COPY)


@dataclass(frozen=True)
class Work:
    """What a ``compute`` costs, for the simulator's roofline: ``flops`` floating-point
    operations and ``bytes`` of memory traffic, of ``kind`` (a key of the cost model's compute
    rates: "gemm" for tensor-core GEMMs, "elementwise", "copy"), in ``launches`` kernel launches.
    The real executor ignores it.

    A sum of works (``a + b``) is a composite: its totals are the sums and ``parts`` keeps the
    summands (flattened), so a cost model prices each kernel by its own kind and adds the
    times (a GEMM followed by a copy is not one roofline). ``leaves()`` is ``parts``, or the work
    itself when it is a single kernel group."""

    flops: float = 0.0
    bytes: float = 0.0
    kind: str = "gemm"
    launches: int = 1
    parts: tuple["Work", ...] = ()

    def __post_init__(self) -> None:
        for name in ("flops", "bytes"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"Work.{name}={v!r}; it must be a finite number >= 0")
        if not (isinstance(self.launches, int) and self.launches >= 0):
            raise ValueError(f"Work.launches={self.launches!r}; it must be an int >= 0")

    def leaves(self) -> tuple["Work", ...]:
        return self.parts if self.parts else (self,)

    def __add__(self, other: "Work") -> "Work":
        kind = self.kind if self.flops >= other.flops else other.kind
        return Work(
            self.flops + other.flops, self.bytes + other.bytes, kind, self.launches + other.launches,
            parts=self.leaves() + other.leaves(),
        )


@dataclass(frozen=True)
class VirtualTensor:
    """A tensor the simulator reasons about without storage: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)

    def numel(self) -> int:
        return math.prod(self.shape)

    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * _itemsize(self.dtype)

    def dim(self) -> int:
        return len(self.shape)

    def with_rows(self, rows: int) -> "VirtualTensor":
        return VirtualTensor((rows,) + self.shape[1:], self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


TensorLike = Union[torch.Tensor, VirtualTensor]


@dataclass(frozen=True)
class TraceEntry:
    """One issued operation: ``op`` ("compute", "all_to_all", ...) on ``lane``, of ``kind``
    (the timeline kind: "dispatch", "expert", ...), ``micro_op`` and ``phase``."""

    lane: str
    op: str
    kind: str
    micro_op: int
    phase: str


class Handle:
    """The result of an issued operation. ``value`` is the (possibly not yet ready) tensor on the
    real executor, a :class:`VirtualTensor` on the simulated one; use it only as an argument of
    another operation or through :meth:`Executor.wait`."""

    __slots__ = ("executor", "index", "lane", "entry", "value", "_ready")

    def __init__(self, executor: "Executor", index: int, lane: str, entry: TraceEntry, value: Any) -> None:
        self.executor = executor
        self.index = index
        self.lane = lane
        self.entry = entry
        self.value = value
        self._ready = None  # executor-specific: a CUDA event, gloo work, future, or None (ready)

    def __repr__(self) -> str:
        e = self.entry
        return f"Handle(#{self.index} {e.op} {e.kind}[{e.micro_op}] {e.phase} on {self.lane})"


class Executor:
    """The interface every schedule issues its operations through (see the module docstring).

    Attributes:
        phase: "fwd" or "bwd": the phase recorded for the operations issued now.
        timeline: a :class:`~tritonmoe.comm.Timeline` to record spans into, or None.
        trace: every issued operation in issue order (:class:`TraceEntry`).
    """

    def __init__(self, *, phase: str = "fwd", timeline: Optional[Timeline] = None) -> None:
        self.phase = phase
        self.timeline = timeline
        self.trace: list[TraceEntry] = []

    # -- what subclasses implement -------------------------------------------------------------

    def compute(
        self,
        fn: Callable[..., Any],
        *args: Any,
        work: Work,
        kind: str,
        micro_op: int = 0,
        out: Any = None,
        lane: str = COMPUTE,
        after: Sequence[Handle] = (),
    ) -> Handle:
        """Local work ``fn(*args)`` (handles in ``args`` are replaced by their values).
        ``out`` is the shape of the result for the simulator: a :class:`VirtualTensor`, a tuple of
        them, or a callable of the argument values returning one."""
        raise NotImplementedError

    def all_to_all(
        self,
        x: Any,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        *,
        group: Any = None,
        kind: str,
        micro_op: int = 0,
        lane: str = COMM,
        priority: int = 0,
        after: Sequence[Handle] = (),
    ) -> Handle:
        """Rows of ``x``: ``send_splits[j]`` to group rank j; the result is ``sum(recv_splits)``
        rows in source order. Splits must agree across the group (derived from one counts
        exchange). ``priority`` orders queued operations on lanes with a priority scheduler
        (higher first); plain lanes are FIFO."""
        raise NotImplementedError

    def all_gather(
        self, x: Any, *, group: Any = None, kind: str, micro_op: int = 0, lane: str = COMM,
        priority: int = 0, after: Sequence[Handle] = (),
    ) -> Handle:
        """Every group rank's ``x`` (equal shapes) concatenated along dim 0, in group-rank order."""
        raise NotImplementedError

    def all_reduce(
        self, x: Any, *, group: Any = None, kind: str, micro_op: int = 0, lane: str = COMM,
        priority: int = 0, after: Sequence[Handle] = (),
    ) -> Handle:
        """The sum of every group rank's ``x`` (a new tensor; ``x`` is not modified)."""
        raise NotImplementedError

    def reduce_scatter(
        self, x: Any, *, group: Any = None, kind: str, micro_op: int = 0, lane: str = COMM,
        priority: int = 0, after: Sequence[Handle] = (),
    ) -> Handle:
        """Group rank r's part (rows [r*R/P, (r+1)*R/P)) of the sum of every rank's ``x``."""
        raise NotImplementedError

    def send_recv(
        self,
        sends: Sequence[tuple[Any, int]],
        recvs: Sequence[tuple[Any, int]],
        *,
        group: Any = None,
        kind: str,
        micro_op: int = 0,
        lane: str = COMM,
        priority: int = 0,
        after: Sequence[Handle] = (),
    ) -> Handle:
        """Point-to-point: send each ``(tensor, peer)``, receive into a new tensor shaped like each
        ``(like, peer)`` (peers are group ranks). The result is the list of received tensors."""
        raise NotImplementedError

    def copy(
        self, x: Any, *, to: str, kind: str, micro_op: int = 0, lane: str = COPY,
        out: Any = None, after: Sequence[Handle] = (),
    ) -> Handle:
        """``x`` copied to the host (``to="host"``: pinned memory where available) or back to the
        device of the computation (``to="device"``); ``out`` optionally receives it."""
        raise NotImplementedError

    def wait(self, h: Handle) -> Any:
        """``h``'s value, ready for the next operation on the compute lane."""
        raise NotImplementedError

    # -- shared helpers ------------------------------------------------------------------------

    def _entry(self, lane: str, op: str, kind: str, micro_op: int) -> TraceEntry:
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r}; use one of {', '.join(LANES)}")
        e = TraceEntry(lane, op, kind, int(micro_op), self.phase)
        self.trace.append(e)
        return e

    def lane_order(self) -> dict[str, list[tuple[str, str, int, str]]]:
        """Per lane, the (op, kind, micro-op, phase) of its operations in issue order."""
        out: dict[str, list[tuple[str, str, int, str]]] = {}
        for e in self.trace:
            out.setdefault(e.lane, []).append((e.op, e.kind, e.micro_op, e.phase))
        return out


# ---------------------------------------------------------------------------------------------
# The real executor
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _lane_stream(device_index: int, lane: str) -> "torch.cuda.Stream":
    """The dedicated CUDA stream of a non-compute lane on a device (created once, reused; a
    failure is not cached and raises :class:`LaneStartError`)."""
    with lane_start(f"the CUDA stream of lane {lane!r} on cuda:{device_index}"):
        return torch.cuda.Stream(device=device_index)


@functools.lru_cache(maxsize=1)
def _copy_worker() -> ThreadPoolExecutor:
    """The CPU copy lane: one worker thread, so copies run in issue order, beside compute."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tritonmoe-copy")


def _submit_copy(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn(*args)`` on the CPU copy lane's worker thread; a worker that cannot start (no
    thread left, a pool shut down at interpreter exit) raises :class:`LaneStartError`."""
    with lane_start("the copy lane's worker thread"):
        return _copy_worker().submit(fn, *args)


def _values(args: Sequence[Any]) -> list[Any]:
    return [a.value if isinstance(a, Handle) else a for a in args]


def _check_device(device: Any) -> torch.device:
    """``device`` as a torch.device the real executor can run on, or a ValueError/TypeError
    naming it (before any stream or thread is started)."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device={device!r} is not a device string ({e}); use e.g. 'cpu' or 'cuda:0'") from None
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or a device string, got {type(device).__name__}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device} but CUDA is not available here; run the schedule on 'cpu'")
        n = torch.cuda.device_count()
        if device.index is not None and not 0 <= device.index < n:
            raise ValueError(f"device={device} but this process sees {n} CUDA device(s) (indices 0..{n - 1})")
    elif device.type != "cpu":
        raise ValueError(f"device={device}: the real executor runs on 'cpu' (gloo) or 'cuda' (NCCL) devices")
    return device


# The backend calls of the real executor's collectives: each starts one asynchronous
# torch.distributed operation on its (contiguous) input and returns ``(output, work)``.


def _start_all_to_all(t: torch.Tensor, send_splits, recv_splits, group):
    out = t.new_empty((sum(recv_splits),) + tuple(t.shape[1:]))
    work = dist.all_to_all_single(out, t, list(recv_splits), list(send_splits), group=group, async_op=True)
    return out, work


def _start_all_gather(t: torch.Tensor, group):
    P = dist.get_world_size(group)
    out = t.new_empty((P * t.shape[0],) + tuple(t.shape[1:]))
    work = all_gather_single(out, t, group=group, async_op=True)
    return out, work


def _start_all_reduce(x: torch.Tensor, group):
    """In place on a contiguous copy of ``x`` (the caller's tensor is left alone)."""
    t = x.clone(memory_format=torch.contiguous_format)
    work = dist.all_reduce(t, group=group, async_op=True)
    return t, work


def _start_reduce_scatter(t: torch.Tensor, group):
    P = dist.get_world_size(group)
    if t.shape[0] % P:
        raise ValueError(f"reduce_scatter of {t.shape[0]} rows over {P} ranks: rows must divide evenly")
    out = t.new_empty((t.shape[0] // P,) + tuple(t.shape[1:]))
    work = reduce_scatter_single(out, t, group=group, async_op=True)
    return out, work


def _start_send_recv(sends, recvs, group):
    """``sends``: (tensor, group rank) pairs to send; ``recvs``: (tensor like the one to receive,
    group rank) pairs. The output: the received tensors, in ``recvs`` order."""
    ops, outs = [], []
    for t, peer in sends:
        ops.append(dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer) if group is not None else peer, group))
    for like, peer in recvs:
        buf = torch.empty_like(like)
        outs.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, peer) if group is not None else peer, group))
    works = dist.batch_isend_irecv(ops) if ops else []
    return outs, _Works(works)


class RealExecutor(Executor):
    """Runs a schedule on ``torch.distributed`` and the device of ``device``.

    * CUDA: the compute lane is the current stream; every other lane a dedicated stream. An
      operation waits (``wait_event``) for the events of the handles it depends on; the host
      never blocks. Collectives are NCCL calls issued on their lane's stream.
    * CPU: compute runs on the calling thread; collectives are gloo ``async_op=True`` work
      handles that progress on gloo's threads; copies run on a worker thread. The calling thread
      waits for a handle's work only when an operation uses its value.

    A failed collective (a dead peer, a timeout) raises :class:`ScheduleError` naming the
    operation, on every rank that waits for it.
    """

    def __init__(
        self, device: torch.device, *, phase: str = "fwd", timeline: Optional[Timeline] = None, scheduler=None
    ) -> None:
        super().__init__(phase=phase, timeline=timeline)
        device = _check_device(device)
        self.device = device
        #: a :class:`~tritonmoe.comm.CommScheduler` collectives are started through (None: directly)
        self.scheduler = scheduler
        self.cuda = device.type == "cuda"
        self._count = 0
        if self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._index = index
            with lane_start(f"the compute lane (the current stream of {device})"):
                self.compute_stream = torch.cuda.current_stream(device)

    # -- lanes ---------------------------------------------------------------------------------

    def _stream(self, lane: str):
        if lane == COMPUTE:
            return self.compute_stream
        return _lane_stream(self._index, lane)

    def _new(self, lane: str, entry: TraceEntry, value: Any) -> Handle:
        h = Handle(self, self._count, lane, entry, value)
        self._count += 1
        return h

    def _await(self, deps: Sequence[Handle], lane: str) -> None:
        """Make ``lane`` wait for ``deps``: stream waits on CUDA, host waits on CPU."""
        for d in deps:
            if d._ready is None:
                continue
            if self.cuda:
                if d.lane != lane:
                    self._stream(lane).wait_event(d._ready)
            else:
                self._host_wait(d)

    def _host_wait(self, h: Handle) -> None:
        r = h._ready
        if r is None:
            return
        try:
            if isinstance(r, Future):
                r.result()
            else:
                r.wait()
        except Exception as e:  # a peer died or timed out: say which step of which pass
            e2 = ScheduleError(
                f"{h.entry.op} '{h.entry.kind}' of micro-op {h.entry.micro_op} ({h.entry.phase}) failed: {e}"
            )
            raise e2 from e
        h._ready = None

    def _span(self, kind: str, micro_op: int, lane: str, stream=None):
        tl = self.timeline
        if tl is None:
            return None
        return tl.start(kind, micro_op, self.phase, stream=stream, lane=lane)

    # -- compute -------------------------------------------------------------------------------

    def compute(self, fn, *args, work, kind, micro_op=0, out=None, lane=COMPUTE, after=()):
        entry = self._entry(lane, "compute", kind, micro_op)
        deps = [a for a in args if isinstance(a, Handle)] + list(after)
        if self.cuda:
            self._await(deps, lane)
            stream = self._stream(lane)
            with torch.cuda.stream(stream):
                rec = self._span(kind, micro_op, lane, stream)
                value = fn(*_values(args))
                if rec is not None:
                    self.timeline.stop(rec, stream=stream)
                h = self._new(lane, entry, value)
                if lane != COMPUTE:
                    h._ready = torch.cuda.Event()
                    h._ready.record(stream)
            return h
        for d in deps:
            self._host_wait(d)
        if lane == COPY:
            vals = _values(args)
            h = self._new(lane, entry, None)
            fut = _submit_copy(fn, *vals)
            h._ready = fut
            fut.add_done_callback(lambda f, h=h: setattr(h, "value", f.result() if not f.exception() else None))
            return h
        rec = self._span(kind, micro_op, lane)
        value = fn(*_values(args))
        if rec is not None:
            self.timeline.stop(rec)
        return self._new(lane, entry, value)

    # -- communication -------------------------------------------------------------------------

    def _collective(self, lane, entry, deps, run: Callable[[], tuple[Any, Any]], kind, micro_op, priority=0,
                    group=None) -> Handle:
        """Issue ``run() -> (out, work)`` on ``lane`` after ``deps`` (through the installed
        scheduler, which may gate other traffic behind it, when there is one). A backend failure
        when the collective is issued (a peer's connection already closed) raises the same
        :class:`ScheduleError` as one when it is waited for."""
        if not lane.startswith("comm"):
            raise ValueError(f"collectives run on a communication lane ('comm', 'comm2'), not {lane!r}")
        sched = self.scheduler
        launch = run if sched is None else functools.partial(sched.launch, run, priority=priority, cuda=self.cuda)

        def issue():
            with backend_errors(f"{entry.op} '{entry.kind}' of micro-op {entry.micro_op} ({entry.phase})", group):
                return launch()
        if self.cuda:
            stream = self._stream(lane)
            self._await(deps, lane)
            ready = torch.cuda.Event()
            ready.record(self.compute_stream)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)  # inputs produced on the compute stream before this call
                rec = self._span(kind, micro_op, lane, stream)
                out, work = issue()
                if work is not None:
                    work.wait()  # NCCL: the lane's stream waits for the collective; the host does not
                if rec is not None:
                    self.timeline.stop(rec, stream=stream)
                done = torch.cuda.Event()
                done.record(stream)
            if sched is not None:
                sched.track_cuda_exchange(done)
            h = self._new(lane, entry, out)
            h._ready = done
            return h
        for d in deps:
            self._host_wait(d)
        rec = self._span(kind, micro_op, lane)
        out, work = issue()
        if rec is not None and work is not None:
            self.timeline.stop_when_done(rec, work.get_future())
        elif rec is not None:
            self.timeline.stop(rec)
        h = self._new(lane, entry, out)
        h._ready = work
        return h

    def _record_inputs(self, lane: str, *tensors: torch.Tensor) -> None:
        """CUDA caching allocator: tensors produced on the compute stream and read on ``lane``'s."""
        if self.cuda and lane != COMPUTE:
            s = self._stream(lane)
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(s)

    def _input(self, x, lane: str) -> torch.Tensor:
        """The tensor of ``x`` (a handle's value or a tensor), contiguous, recorded for ``lane``'s
        stream (:meth:`_record_inputs`)."""
        t = (x.value if isinstance(x, Handle) else x).contiguous()
        self._record_inputs(lane, t)
        return t

    def all_to_all(self, x, send_splits, recv_splits, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        entry = self._entry(lane, "all_to_all", kind, micro_op)
        deps = ([x] if isinstance(x, Handle) else []) + list(after)
        run = lambda: _start_all_to_all(self._input(x, lane), send_splits, recv_splits, group)  # noqa: E731
        return self._collective(lane, entry, deps, run, kind, micro_op, priority, group)

    def all_gather(self, x, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        entry = self._entry(lane, "all_gather", kind, micro_op)
        deps = ([x] if isinstance(x, Handle) else []) + list(after)
        run = lambda: _start_all_gather(self._input(x, lane), group)  # noqa: E731
        return self._collective(lane, entry, deps, run, kind, micro_op, priority, group)

    def all_reduce(self, x, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        entry = self._entry(lane, "all_reduce", kind, micro_op)
        deps = ([x] if isinstance(x, Handle) else []) + list(after)
        run = lambda: _start_all_reduce(x.value if isinstance(x, Handle) else x, group)  # noqa: E731
        return self._collective(lane, entry, deps, run, kind, micro_op, priority, group)

    def reduce_scatter(self, x, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        entry = self._entry(lane, "reduce_scatter", kind, micro_op)
        deps = ([x] if isinstance(x, Handle) else []) + list(after)
        run = lambda: _start_reduce_scatter(self._input(x, lane), group)  # noqa: E731
        return self._collective(lane, entry, deps, run, kind, micro_op, priority, group)

    def send_recv(self, sends, recvs, *, group=None, kind, micro_op=0, lane=COMM, priority=0, after=()):
        entry = self._entry(lane, "send_recv", kind, micro_op)
        deps = [t for t, _ in sends if isinstance(t, Handle)] + list(after)

        def run():
            ins = [(self._input(t, lane), peer) for t, peer in sends]
            outs = [(like.value if isinstance(like, Handle) else like, peer) for like, peer in recvs]
            return _start_send_recv(ins, outs, group)

        return self._collective(lane, entry, deps, run, kind, micro_op, priority, group)

    # -- copies --------------------------------------------------------------------------------

    def copy(self, x, *, to, kind, micro_op=0, lane=COPY, out=None, after=()):
        if to not in ("host", "device"):
            raise ValueError(f"copy(to={to!r}): use 'host' or 'device'")
        entry = self._entry(lane, "copy", kind, micro_op)
        deps = ([x] if isinstance(x, Handle) else []) + list(after)
        dest = torch.device("cpu") if to == "host" else self.device

        def do(t: torch.Tensor, buf):
            if buf is None:
                pin = to == "host" and self.cuda
                buf = torch.empty(t.shape, dtype=t.dtype, device=dest, pin_memory=pin)
            buf.copy_(t, non_blocking=self.cuda)
            return buf

        if self.cuda:
            self._await(deps, lane)
            stream = self._stream(lane)
            ready = torch.cuda.Event()
            ready.record(self.compute_stream)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                rec = self._span(kind, micro_op, lane, stream)
                t = x.value if isinstance(x, Handle) else x
                self._record_inputs(lane, t)
                value = do(t, out)
                if rec is not None:
                    self.timeline.stop(rec, stream=stream)
                done = torch.cuda.Event()
                done.record(stream)
            h = self._new(lane, entry, value)
            h._ready = done
            return h
        return self._cpu_copy(entry, x, out, deps, do, kind, micro_op)

    def _cpu_copy(self, entry, x, out, deps, do, kind, micro_op) -> Handle:
        for d in deps:
            self._host_wait(d)
        t = x.value if isinstance(x, Handle) else x
        h = self._new(COPY, entry, None)
        tl = self.timeline

        def job():
            rec = tl.start(kind, micro_op, self.phase, lane=COPY) if tl is not None else None
            v = do(t, out)
            if rec is not None:
                tl.stop(rec)
            h.value = v
            return v

        h._ready = _submit_copy(job)
        return h

    # -- waiting -------------------------------------------------------------------------------

    def wait(self, h: Handle) -> Any:
        if h._ready is not None:
            if self.cuda:
                self.compute_stream.wait_event(h._ready)
                v = h.value
                if isinstance(v, torch.Tensor) and v.is_cuda and h.lane != COMPUTE:
                    v.record_stream(self.compute_stream)  # allocated on another lane's stream
                elif isinstance(v, list):
                    for t in v:
                        if isinstance(t, torch.Tensor) and t.is_cuda:
                            t.record_stream(self.compute_stream)
            else:
                self._host_wait(h)
        return h.value


class _Works:
    """Several gloo/NCCL works (``batch_isend_irecv``) as one: ``wait`` waits for all."""

    def __init__(self, works) -> None:
        self.works = list(works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def get_future(self):
        futs = [w.get_future() for w in self.works]
        if not futs:
            f = torch.futures.Future()
            f.set_result(None)
            return f
        return torch.futures.collect_all(futs)
