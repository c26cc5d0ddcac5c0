"""Priority communication: Lina's all-to-all over allreduce (PAPERS.md section 1.1).

One :class:`CommScheduler` per rank owns the communication of a training step on two lanes:

* the **exchange lane**: the expert path's token exchanges (all-to-alls), issued by the
  :class:`~tritonmoe.comm.RealExecutor` through :meth:`CommScheduler.launch` the moment the
  schedule reaches them, in program order;
* the **gradient lane**: gradient reductions (:meth:`CommScheduler.reduce`, called by the DDP
  communication hook and the expert-gradient hooks of :func:`tritonmoe.parallel.data_parallel`),
  run by one worker thread **one micro-op at a time, in submission order**.

Two policies, one class:

* ``CommScheduler.fifo()`` -- today's behaviour: each gradient bucket is one reduction, started
  as soon as the previous one ended, regardless of all-to-alls, with which it shares the network
  (concurrent, uncoordinated; on GPUs NCCL also runs a communicator's collectives one at a time).
* ``CommScheduler.lina(chunk_bytes)`` -- Lina: every gradient is cut into micro-ops of at most
  ``chunk_bytes`` (chunks never span two gradients; :func:`partition`), and a micro-op starts
  only while no all-to-all is running, waiting or imminent (the expert path announces its
  backward exchanges when the backward reaches the layer output, before the combine's backward,
  Lina's look-ahead stop). A running micro-op is never pre-empted, so an all-to-all shares the
  network with at most one micro-op of at most ``chunk_bytes`` (one that was already running
  when it arrived); gradient micro-ops fill every interval in which no exchange is pending
  (work conservation).

**Why no cycle can form across ranks** (PAPERS.md 1.1, ambiguity 1). Lina's ranks decide
locally; the data-parallel and expert-parallel groups share ranks, so a rank that waited for its
running allreduce micro-op before starting an all-to-all could wait forever on a peer that,
having seen the all-to-all first, holds that micro-op back until the all-to-all ends -- and
whether a peer has started a micro-op is a matter of timing, which no local rule can know.
This scheduler makes every decision that fixes an *order* a function of program events, and
lets time only *delay* gradient micro-ops:

1. exchanges start when the program issues them (never queued behind a gradient micro-op), on
   the expert-parallel group, which carries nothing else: every rank issues them in the same
   order and none of them waits for a gradient micro-op;
2. gradient micro-ops start in submission order -- the order of the autograd hooks, identical
   on every rank -- one at a time, on reduction groups that carry nothing else, so any two that
   share a rank start in the same order on every rank;
3. the gate that delays a micro-op (an exchange running, waiting or imminent) reopens once the
   rank's exchanges complete, which by 1 needs no gradient micro-op;
4. the compute thread waits for gradient micro-ops only at the end of the backward pass, after
   issuing every exchange of the step.

So the wait-for relation follows one order common to all ranks and has no cycle, however the
ranks' timing skews. The price against a literal reading of the paper: an all-to-all that
arrives while a micro-op runs starts beside it instead of waiting for it. Under fair sharing it
finishes at the same time (A + C for an all-to-all of A seconds and a remaining micro-op of C,
A >= C), and a micro-op still waiting for a peer moves no bytes at all.

Reductions: ``"allreduce"`` is the backend's allreduce (ring on gloo and NCCL: its summation
order depends on where a buffer is cut, so FIFO and Lina agree to rounding); ``"ordered"``
reduces every element in group-rank order whatever the cut (an all-to-all of segments, a sum
in rank order, an all-gather: the same bytes as a ring), so gradients are bitwise independent of
bucketing, chunking and scheduling.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .compat import all_gather_single
from .errors import LaneStartError, ScheduleError, backend_errors, lane_start
from .timeline import Timeline
from tritonmoe.comm.executor import VirtualTensor

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "PRIORITY_EXCHANGE",
    "PRIORITY_GRADIENT",
    "REDUCTIONS",
    "CommScheduler",
    "GradSyncState",
    "partition",
    "fuse_micro_ops",
    "ordered_all_reduce_",
    "scheduled_allreduce_hook",
    "issue_gradient_sync",
]

#: Lina's partition size (001 section 7.1: 30 MB).
DEFAULT_CHUNK_BYTES = 30 * 2**20
#: Executor priorities: collectives default to 0, the layer's token exchanges; gradient
#: reduction micro-ops are below it.
PRIORITY_EXCHANGE = 0
PRIORITY_GRADIENT = -1
#: Reduction algorithms of the gradient lane.
REDUCTIONS = ("allreduce", "ordered")

_GATE_POLL_S = 1e-4  # how often a waiting worker re-checks CUDA exchange events


def partition(ranges: Sequence[tuple[int, int]], itemsize: int, chunk_bytes: Optional[int]) -> list[tuple[int, int, int]]:
    """Micro-ops of gradients laid out in one buffer.

    Args:
        ranges: per gradient, (first element, number of elements) in the buffer.
        itemsize: bytes per element.
        chunk_bytes: the most bytes of one micro-op, or None for one micro-op per gradient.

    Returns: (gradient index, first element, end element) per micro-op, gradient by gradient.
    Gradient g of n elements becomes ``ceil(n * itemsize / chunk_bytes)`` micro-ops of as equal a
    size as elements allow (``torch.chunk`` sizes: ``ceil(n / count)`` each, the last ones
    smaller), every one at most ``chunk_bytes``; a micro-op never spans two gradients, and empty
    gradients have none.
    """
    if chunk_bytes is not None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
            raise TypeError(f"chunk_bytes must be an int (bytes) or None, got {type(chunk_bytes).__name__}")
        if chunk_bytes < itemsize:
            raise ValueError(f"chunk_bytes={chunk_bytes} is smaller than one element ({itemsize} bytes); use at least {itemsize}")
    out = []
    for g, (start, n) in enumerate(ranges):
        if n <= 0:
            continue
        if chunk_bytes is None:
            out.append((g, start, start + n))
            continue
        max_elems = chunk_bytes // itemsize
        count = -(-n // max_elems)
        size = -(-n // count)
        a = start
        while a < start + n:
            b = min(a + size, start + n)
            out.append((g, a, b))
            a = b
    return out


def fuse_micro_ops(ranges: Sequence[tuple[int, int]], itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The micro-ops of gradients laid out in one buffer when large gradients are partitioned
    (Lina) and small ones fused (SE-MoE): each gradient is cut as :func:`partition` cuts it (at
    most ``chunk_bytes`` a piece), then consecutive pieces are merged greedily while the span
    they cover (gaps between gradients included) stays within ``chunk_bytes``.

    Args:
        ranges: (first element, elements) of each gradient in the buffer.
    Returns: (first, end) element spans in buffer order; every gradient element lies in exactly
    one span and no span exceeds ``chunk_bytes``.
    """
    spans: list[tuple[int, int]] = []
    limit = chunk_bytes // itemsize
    for _, a, b in partition(sorted(ranges), itemsize, chunk_bytes):
        if spans and b - spans[-1][0] <= limit:
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    return spans


def _check_fuse(fuse) -> bool:
    if not isinstance(fuse, bool):
        raise TypeError(f"fuse must be a bool, got {type(fuse).__name__}")
    return fuse


def _spans(ranges, itemsize: int, chunk_bytes: Optional[int], fuse: bool) -> list[tuple[int, int]]:
    """The gradient lane's micro-ops of one buffer: SE-MoE's fused ones or Lina's partition."""
    if fuse and chunk_bytes is not None:
        return fuse_micro_ops(ranges, itemsize, chunk_bytes)
    return [(a, b) for _, a, b in partition(ranges, itemsize, chunk_bytes)]


def ordered_all_reduce_(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` (contiguous) over ``group`` in place, every element in group-rank order
    ``((x_0 + x_1) + x_2) + ...``, independent of how the caller cut its buffers: rank r receives
    segment r of every rank (all-to-all), sums the rows in rank order, and every rank gathers
    the sums (all-gather). 2 (P-1)/P of the bytes, like a ring allreduce."""
    P = dist.get_world_size(group)
    if P == 1 or t.numel() == 0:
        return t
    n = t.numel()
    seg = -(-n // P)
    send = t.new_zeros(P * seg)
    send[:n] = t.reshape(-1)
    recv = torch.empty_like(send)
    with backend_errors("the ordered allreduce's all-to-all", group):
        dist.all_to_all_single(recv, send, group=group)
    rows = recv.view(P, seg)
    acc = rows[0].clone()
    for r in range(1, P):
        acc += rows[r]
    out = torch.empty_like(send)
    with backend_errors("the ordered allreduce's all-gather", group):
        all_gather_single(out, acc, group=group)
    t.view(-1).copy_(out[:n])
    return t


@dataclass
class _Bucket:
    """One :meth:`CommScheduler.reduce` request: its buffer, micro-ops left, and future."""

    flat: torch.Tensor
    left: int
    future: torch.futures.Future
    #: Reduced inside a backward pass: a failure completes the future with the unreduced buffer
    #: and raises ScheduleError from the scheduler's final autograd callback instead (DDP's
    #: reducer turns a failed hook future into an untyped RuntimeError).
    in_backward: bool = False


@dataclass
class _Item:
    """One gradient micro-op waiting on the gradient lane."""

    tensor: torch.Tensor
    group: Any
    bucket: _Bucket
    ready: Any = None  # CUDA: the event after which the gradient is complete


@dataclass
class _Exchanges:
    """Exchanges in flight on this rank: a count (CPU: decremented by gloo's completion
    callbacks) and CUDA events (queried)."""

    count: int = 0
    events: list = field(default_factory=list)


class _BackwardFailures:
    """How a failed reduction reaches the program. Inside a backward pass (a DDP comm hook) a
    failed hook future would surface as DDP's untyped RuntimeError, so a failure there completes
    the future with the unreduced buffer and the typed error is raised by a final autograd
    callback (:meth:`check`, queued once per pass; it runs after DDP's own, which waits for the
    reductions); outside one, the future raises it. Shares the scheduler's lock ``cv``."""

    def __init__(self, cv: threading.Condition, timeout_s: float) -> None:
        self._cv = cv
        self.timeout_s = timeout_s
        self._queued = False
        self._buckets: list[_Bucket] = []  # this pass's reductions
        self._error: Optional[tuple[str, type]] = None

    def enter(self) -> bool:
        """Inside a backward pass, queue :meth:`check` as a final autograd callback (once per
        pass) and return True; outside one, return False."""
        if self._queued:
            return True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.check)
        except RuntimeError:  # not inside a backward pass: failures go through the futures
            return False
        self._queued = True
        return True

    def track(self, bucket: _Bucket) -> None:
        """A reduction of this backward pass (:meth:`check` waits for it)."""
        self._buckets.append(bucket)

    def check(self) -> None:
        """Final autograd callback: wait for this backward pass's reductions, then raise the
        typed error of one that failed (every rank whose lane failed raises it; the gradients
        were not reduced)."""
        self._queued = False
        buckets, self._buckets = self._buckets, []
        deadline = time.monotonic() + self.timeout_s
        for b in buckets:  # the pass's reductions (each bounded by its group's timeout)
            while not b.future.done() and time.monotonic() < deadline:
                time.sleep(_GATE_POLL_S)
        with self._cv:
            failed, self._error = self._error, None
        if failed is not None:
            msg, cls = failed
            raise cls(f"{msg}; the gradients of this step were not reduced (do not step the optimizer)")

    def deliver(self, bucket: _Bucket, msg: str, cls: type = ScheduleError) -> None:
        """Deliver a failed reduction as ``cls(msg)``: in a backward pass through :meth:`check`,
        else as the future's exception."""
        if bucket.future.done():
            return
        if bucket.in_backward:
            with self._cv:
                if self._error is None:
                    self._error = (msg, cls)
            bucket.future.set_result(bucket.flat)
        else:
            bucket.future.set_exception(cls(msg))


class CommScheduler:
    """A rank's communication scheduler (see the module docstring).

    Args:
        priority: gate gradient micro-ops behind exchanges (Lina) or not (FIFO).
        chunk_bytes: cut each gradient into micro-ops of at most this many bytes (None: one
            reduction per submitted buffer).
        reduction: "allreduce" or "ordered" (see the module docstring).
        fuse: with ``chunk_bytes``, consecutive small gradients of a submitted buffer share one
            micro-op of at most ``chunk_bytes`` instead of one each (SE-MoE's fusion,
            :func:`fuse_micro_ops`); large ones are still partitioned. One scheduler decides both.
        gate_timeout_s: how long queued gradient micro-ops may be held back by exchanges before
            the lane fails (every pending reduction then raises instead of waiting forever; an
            exchange itself is bounded by its group's timeout, so this only fires on a broken
            announcement).

    Attributes:
        timeline: a :class:`~tritonmoe.comm.Timeline` the gradient lane records its micro-ops
            into (kind "allreduce", lane "comm2", phase "bwd"), or None.

    Thread safety: :meth:`launch`, :meth:`reduce`, :meth:`exchange_imminent` and
    :meth:`exchanges_done` are called from the thread that runs forward and backward (autograd
    runs CPU backward on it); the gradient lane's worker thread is started on first use and
    stopped by :meth:`close` (or when the scheduler is garbage-collected).
    """

    def __init__(
        self, *, priority: bool, chunk_bytes: Optional[int] = None, reduction: str = "allreduce", gate_timeout_s: float = 300.0,
        fuse: bool = False,
    ) -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}; use one of {REDUCTIONS}")
        if chunk_bytes is not None:
            partition([], 1, chunk_bytes)  # validates the type
            if chunk_bytes < 1:
                raise ValueError(f"chunk_bytes={chunk_bytes} must be positive (or None: no partitioning)")
        if not gate_timeout_s > 0:
            raise ValueError(f"gate_timeout_s={gate_timeout_s} must be > 0")
        self.priority = bool(priority)
        self.chunk_bytes = chunk_bytes
        self.fuse = _check_fuse(fuse)
        self.gate_timeout_s = float(gate_timeout_s)
        self.reduction = reduction
        self.timeline: Optional[Timeline] = None
        self._cv = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._exchanges = _Exchanges()
        self._imminent = 0
        self._error: Optional[BaseException] = None
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._micro_op = 0
        self._held_since: Optional[float] = None
        self._backward = _BackwardFailures(self._cv, self.gate_timeout_s)

    @classmethod
    def fifo(cls, **kwargs) -> "CommScheduler":
        """Today's behaviour: buckets reduced whole, in order, concurrently with exchanges
        (``kwargs``: ``reduction``, ``gate_timeout_s``)."""
        return cls(priority=False, chunk_bytes=None, **kwargs)

    @classmethod
    def lina(cls, chunk_bytes: Optional[int] = DEFAULT_CHUNK_BYTES, **kwargs) -> "CommScheduler":
        """Lina: gradients partitioned into micro-ops of at most ``chunk_bytes``, exchanges first
        (``chunk_bytes=None``: priority without partitioning, the paper's variant (b));
        ``kwargs``: ``reduction``, ``gate_timeout_s``."""
        return cls(priority=True, chunk_bytes=chunk_bytes, **kwargs)

    @property
    def policy(self) -> str:
        return "lina" if self.priority else "fifo"

    def __repr__(self) -> str:
        return f"CommScheduler({self.policy}, chunk_bytes={self.chunk_bytes}, reduction={self.reduction!r}, fuse={self.fuse})"

    # -- the exchange lane ----------------------------------------------------------------------

    def launch(self, run: Callable[[], tuple[Any, Any]], *, priority: int = PRIORITY_EXCHANGE, cuda: bool = False):
        """Start an exchange now: ``run() -> (out, work)`` (the executor's collective). Under
        Lina it holds gradient micro-ops back until ``work`` completes (CPU: gloo's completion
        callback; CUDA: the executor passes the exchange's done event to
        :meth:`track_cuda_exchange`). Collectives of negative priority (gradient micro-ops) are
        submitted with :meth:`reduce`, not here."""
        if priority < PRIORITY_EXCHANGE:
            raise ValueError(
                f"priority={priority}: gradient micro-ops go through CommScheduler.reduce (the DDP hook of "
                "tritonmoe.parallel.data_parallel), not the executor"
            )
        if not self.priority or cuda:
            return run()
        with self._cv:
            self._exchanges.count += 1
        try:
            out, work = run()
        except BaseException:
            self._exchange_finished()
            raise
        if work is None:
            self._exchange_finished()
        else:
            work.get_future().add_done_callback(lambda _f, s=weakref.ref(self): s() and s()._exchange_finished())
        return out, work

    def track_cuda_exchange(self, done_event) -> None:
        """CUDA: an exchange whose completion is ``done_event`` (recorded on its stream)."""
        if self.priority:
            with self._cv:
                self._exchanges.events.append(done_event)
                self._cv.notify_all()

    def _exchange_finished(self) -> None:
        with self._cv:
            self._exchanges.count -= 1
            self._cv.notify_all()

    def exchange_imminent(self) -> None:
        """The program will issue exchanges soon (an expert-parallel layer's backward reached its
        output): hold gradient micro-ops back until :meth:`exchanges_done`."""
        if self.priority:
            with self._cv:
                self._imminent += 1

    def exchanges_done(self) -> None:
        """The exchanges announced by :meth:`exchange_imminent` were issued and waited for."""
        if self.priority:
            with self._cv:
                self._imminent = max(0, self._imminent - 1)
                self._cv.notify_all()

    def _gate_open(self) -> bool:
        """Called with the lock held: may a gradient micro-op start now?"""
        if not self.priority:
            return True
        ex = self._exchanges
        if ex.events:
            ex.events = [e for e in ex.events if not e.query()]
        return ex.count == 0 and not ex.events and self._imminent == 0

    # -- the gradient lane ----------------------------------------------------------------------

    def reduce(self, flat: torch.Tensor, grads: Optional[Sequence[torch.Tensor]] = None, group=None) -> torch.futures.Future:
        """Sum ``flat`` over ``group`` in place, on the gradient lane; the returned future holds
        ``flat`` once every micro-op is done.

        ``grads``: the gradients laid out in ``flat`` (views of it; default: ``flat`` is one
        gradient). Under Lina each is cut into micro-ops of at most ``chunk_bytes``
        (:func:`partition`), and with ``fuse`` consecutive small ones share a micro-op of at most
        ``chunk_bytes`` (:func:`fuse_micro_ops`); FIFO reduces ``flat`` whole. Must be called in the same order on
        every rank (the autograd hooks are)."""
        if not flat.is_contiguous():
            raise ValueError("reduce needs a contiguous buffer (reduce a contiguous copy and copy it back)")
        fut: torch.futures.Future = torch.futures.Future()
        in_backward = self._backward.enter()
        if self._error is not None:
            self._backward.deliver(_Bucket(flat, 1, fut, in_backward), f"the gradient lane failed earlier: {self._error}",
                              type(self._error) if isinstance(self._error, LaneStartError) else ScheduleError)
            return fut
        if flat.numel() == 0 or group_size(group) == 1:
            fut.set_result(flat)
            return fut
        base = flat.view(-1)
        ranges = _ranges(base, grads) if (self.chunk_bytes is not None and grads is not None) else [(0, base.numel())]
        pieces = [base[a:b] for a, b in _spans(ranges, base.element_size(), self.chunk_bytes, self.fuse)]
        bucket = _Bucket(flat, len(pieces), fut, in_backward)
        if in_backward:
            self._backward.track(bucket)
        ready = None
        if flat.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(flat.device))
        with self._cv:
            try:
                self._ensure_worker()  # first: nothing is queued on a lane that cannot start
            except LaneStartError as e:
                self._error = e
            else:
                for p in pieces:
                    self._queue.append(_Item(p, group, bucket, ready))
                self._cv.notify_all()
        if isinstance(self._error, LaneStartError):  # delivered like a failed reduction, typed
            self._backward.deliver(bucket, str(self._error), LaneStartError)
        return fut

    def _ensure_worker(self) -> None:
        """Start the gradient lane's thread if it is not running; a thread that cannot start
        raises :class:`~tritonmoe.comm.errors.LaneStartError` (nothing is queued then)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            thread = threading.Thread(
                target=_worker_main, args=(weakref.ref(self),), name="tritonmoe-grad-lane", daemon=True
            )
            with lane_start("the gradient lane's worker thread (CommScheduler)"):
                thread.start()
            self._thread = thread
            weakref.finalize(self, _stop_worker, self._cv, self._thread)

    def _next_item(self, timeout_s: float) -> Optional[_Item]:
        """Worker: the next micro-op once the gate opens (None after ``timeout_s`` or at stop).
        Raises :class:`TimeoutError` when queued micro-ops have been held back for
        ``gate_timeout_s``."""
        now = time.monotonic()
        deadline = now + timeout_s
        with self._cv:
            while True:
                if self._stop:
                    return None
                if self._queue:
                    if self._gate_open():
                        self._held_since = None
                        return self._queue.popleft()
                    if self._held_since is None:
                        self._held_since = now
                    elif now - self._held_since > self.gate_timeout_s:
                        raise TimeoutError(
                            f"gradient micro-ops were held back for {now - self._held_since:.0f} s by exchanges "
                            f"({self._exchanges.count} running, {self._imminent} announced) that never completed"
                        )
                left = deadline - now
                if left <= 0:
                    return None
                poll = _GATE_POLL_S if self._exchanges.events else left
                self._cv.wait(min(left, poll))
                now = time.monotonic()

    def _run(self, item: _Item) -> None:
        """Worker: one gradient micro-op, start to end."""
        t = item.tensor
        rec = None
        if self.timeline is not None:
            rec = self.timeline.start("allreduce", self._micro_op, "bwd", lane="comm2")
        self._micro_op += 1
        if t.is_cuda:
            stream = _grad_stream(t.device)
            stream.wait_event(item.ready)
            with torch.cuda.device(t.device), torch.cuda.stream(stream):  # this thread's device is not the caller's
                self._reduce(t, item.group)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()  # host sync (worker thread only): one micro-op on the network at a time
        else:
            self._reduce(t, item.group)
        if rec is not None:
            self.timeline.stop(rec)

    def _reduce(self, t: torch.Tensor, group) -> None:
        if self.reduction == "ordered":
            ordered_all_reduce_(t, group)
        else:
            with backend_errors("a gradient micro-op's allreduce", group):
                dist.all_reduce(t, group=group)

    def _finish(self, item: _Item, error: Optional[BaseException]) -> None:
        if error is not None:
            self._fail(f"gradient micro-op on ranks {_ranks(item.group)} failed: {error}", error, [item])
            return
        b = item.bucket
        b.left -= 1
        if b.left == 0:
            b.future.set_result(b.flat)

    def _fail(self, msg: str, error: BaseException, items: Sequence[_Item] = ()) -> None:
        """The lane is broken: every pending reduction's future raises ``msg``; later ones too."""
        with self._cv:
            self._error = error
            dropped = list(self._queue)
            self._queue.clear()
        for it in list(items) + dropped:
            self._backward.deliver(it.bucket, msg)

    def close(self) -> None:
        """Stop the worker thread (queued micro-ops are dropped)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


def _worker_main(ref) -> None:
    """The gradient lane: run micro-ops one at a time; exit when the scheduler is gone."""
    while True:
        s = ref()
        if s is None or s._stop:
            return
        try:
            item = s._next_item(0.5)
        except TimeoutError as e:
            s._fail(str(e), e)
            return
        if item is None:
            del s
            continue
        try:
            s._run(item)
        except BaseException as e:  # noqa: BLE001 - delivered through the futures
            s._finish(item, e)
        else:
            s._finish(item, None)
        del s


def _stop_worker(cv: threading.Condition, thread: threading.Thread) -> None:
    with cv:
        cv.notify_all()


def _grad_stream(device: torch.device):
    """The CUDA stream of the gradient lane on ``device`` (created once per device)."""
    return _grad_stream_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _grad_stream_of(index: int):
    with lane_start(f"the gradient lane's CUDA stream on cuda:{index}"):
        return torch.cuda.Stream(device=index)


def group_size(group) -> int:
    return dist.get_world_size(group)


def _ranks(group) -> list[int]:
    try:
        return [int(r) for r in dist.get_process_group_ranks(group)] if group is not None else list(range(dist.get_world_size()))
    except Exception:  # noqa: BLE001 - only for a message
        return []


def _ranges(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(first element, elements) of each gradient inside ``flat`` (they must be views of it)."""
    base = flat.data_ptr()
    size = flat.element_size()
    out = []
    for g in grads:
        if g.numel() == 0:
            continue
        off, rem = divmod(g.data_ptr() - base, size)
        if rem or off < 0 or off + g.numel() > flat.numel() or not g.is_contiguous():
            raise ValueError("each gradient must be a contiguous view of the buffer being reduced")
        out.append((off, g.numel()))
    out.sort()
    for (a, n), (b, _) in zip(out, out[1:]):
        if a + n > b:
            raise ValueError("gradients overlap in the buffer being reduced")
    return out


# ---------------------------------------------------------------------------------------------
# The gradient lane as executor operations (what the simulator records)
# ---------------------------------------------------------------------------------------------


def issue_gradient_sync(
    ex,
    grads: Sequence[Any],
    *,
    group=None,
    chunk_bytes: Optional[int] = None,
    bucket_bytes: Optional[int] = None,
    priority: int = PRIORITY_GRADIENT,
    lane: str = "comm2",
    kind: str = "allreduce",
    after: Sequence[Any] = (),
    fuse: bool = False,
) -> list:
    """Issue the reduction of ``grads`` (tensors or :class:`~tritonmoe.comm.VirtualTensor`, in the
    order they became ready) through executor ``ex`` as the gradient lane runs it: with
    ``chunk_bytes`` (Lina) every gradient in micro-ops of at most ``chunk_bytes``
    (:func:`partition`), and with ``fuse`` too consecutive small gradients fused into one
    micro-op of at most ``chunk_bytes`` (:func:`fuse_micro_ops`); without (FIFO) consecutive gradients fused into buckets of at most
    ``bucket_bytes`` as DDP does (one gradient per bucket when None), one all-reduce each. Every
    operation carries ``priority`` (:data:`PRIORITY_GRADIENT`: behind the exchanges under a
    priority policy) on ``lane``. Returns the handles in issue order."""

    handles: list = []

    def issue(like, numel: int) -> None:
        x = VirtualTensor((numel,), like.dtype) if isinstance(like, VirtualTensor) else like.new_empty(numel)
        handles.append(ex.all_reduce(x, group=group, kind=kind, micro_op=len(handles), lane=lane, priority=priority,
                                     after=after))

    if chunk_bytes is not None and fuse and grads:  # the scheduler's fuse rule over one buffer
        ranges, off = [], 0
        for g in grads:
            ranges.append((off, g.numel()))
            off += g.numel()
        for a, b in fuse_micro_ops(ranges, grads[0].dtype.itemsize, chunk_bytes):
            issue(grads[0], b - a)
        return handles
    if chunk_bytes is not None:
        for g in grads:
            for _, a, b in partition([(0, g.numel())], g.dtype.itemsize, chunk_bytes):
                issue(g, b - a)
        return handles
    bucket: list = []
    size = 0
    for g in grads:
        nb = g.numel() * g.dtype.itemsize
        if bucket and (bucket_bytes is None or size + nb > bucket_bytes):
            issue(bucket[0], sum(x.numel() for x in bucket))
            bucket, size = [], 0
        bucket.append(g)
        size += nb
    if bucket:
        issue(bucket[0], sum(x.numel() for x in bucket))
    return handles


# ---------------------------------------------------------------------------------------------
# DDP communication hook
# ---------------------------------------------------------------------------------------------


@dataclass
class GradSyncState:
    """State of :func:`scheduled_allreduce_hook`: the scheduler, the reduction group (used by the
    gradient lane only) and the divisor (the data-parallel size: gradients of the mean loss)."""

    scheduler: CommScheduler
    group: Any
    divisor: int


def scheduled_allreduce_hook(state: GradSyncState, bucket):  # DDP checks a real (non-string) return annotation
    """DDP communication hook (returns ``torch.futures.Future[torch.Tensor]``): divide the bucket by ``state.divisor`` and sum it over
    ``state.group`` on ``state.scheduler``'s gradient lane (FIFO: the bucket whole; Lina: each
    gradient in micro-ops of at most ``chunk_bytes``). Register with
    ``ddp.register_comm_hook(GradSyncState(...), scheduled_allreduce_hook)``."""
    buf = bucket.buffer()
    buf.div_(state.divisor)
    return state.scheduler.reduce(buf, bucket.gradients(), state.group)
