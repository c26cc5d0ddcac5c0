"""Micro-op pipelining of dispatch, expert compute and combine (Lina / MPMoE style).

The local tokens are cut into N micro-batches along the token dimension; micro-op i is
``dispatch_i -> expert_i -> combine_i``. The schedule, identical on every rank (collectives must
be issued in the same order everywhere), is::

    issue dispatch_0
    for i in 0..N-1:
        issue dispatch_{i+1}            (runs while expert_i computes)
        wait dispatch_i; expert_i       (overlaps dispatch_{i+1} and combine_{i-1})
        issue combine_i
        wait combine_{i-1}
    wait combine_{N-1}

* CUDA: communication runs on a dedicated stream, expert compute on the caller's current stream;
  events order them (a collective waits for the event recorded after its input was produced,
  an expert FFN waits for the event recorded after its rows arrived). The host never blocks.
* CPU (gloo): collectives are issued with ``async_op=True`` and run on gloo's worker threads
  while the calling thread computes; ``work.wait()`` orders them.

The backward pass runs the same schedule with the same splits: the combine's reverse all-to-all
brings the output gradients to the experts, the expert backward (autograd of the micro-op's
stored expert graph) computes the input gradients (the "B" step), and the dispatch's reverse
all-to-all returns them. Weight gradients are computed as in zero-bubble pipelines' deferred "W"
step: GEMMs that support it (:mod:`tritonmoe._wgrad`; the fp64 reference grouped GEMM) record
their rows instead of computing ``X_i^T dY_i`` per micro-op, and one W step after the last
micro-op's expert backward (while its input gradients travel back) computes each expert's
``X^T dY`` over all micro-ops' rows, concatenated in the order N = 1 has them: per local expert,
source rank, then token (micro-batches are contiguous token ranges). Weight gradients of other
GEMMs (the Triton kernels, reduced-precision reference) are summed over micro-ops in micro-op
order. The W step runs for N = 1 too, so every N takes the same path.

Equality with N = 1: routing, capacity and the per-token combine are computed once for the whole
batch or per token in a fixed order, so every per-token quantity (outputs, input and router
gradients) is computed by the same arithmetic for every N whenever the expert compute is
row-independent (each output row a function of its input row alone). Tiled Triton GEMMs are;
vendor BLAS GEMMs (MKL on CPU, cuBLAS) are not (they choose kernels by the row count of the
call), nor are ATen's vectorized elementwise transcendentals (a vector or scalar-tail rounding by
position in the buffer), so the fp64 reference computes its GEMMs and activations row-invariantly
(:func:`tritonmoe.reference.grouped_ffn`). With the deferred W step this makes outputs and every
gradient bitwise identical to N = 1 in fp64 on the reference backend. In fp32/bf16 the reference
keeps plain per-expert matmuls and summed weight gradients: equal to N = 1 to rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

from tritonmoe._wgrad import WeightGradStore

from .all_to_all import all_to_all_raw
from .splits import DispatchPlan
from .timeline import Timeline

__all__ = ["run_pipelined", "ExpertFn"]

#: ``expert_fn(i, recv_RD, params) -> y_RD``: the local expert compute of micro-op i on the rows
#: it received (source-major), differentiable in ``recv_RD`` and ``params``; ``y_RD`` has one row
#: per received row, in the same order.
ExpertFn = Callable[[int, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


@functools.lru_cache(maxsize=None)
def _comm_stream(device_index: int) -> "torch.cuda.Stream":
    """The dedicated communication stream of a CUDA device (created once, reused)."""
    return torch.cuda.Stream(device=device_index)


@dataclass
class _Pending:
    """An all-to-all in flight: its output buffer and what to wait on."""

    out: torch.Tensor
    work: object
    kind: str
    micro_op: int
    done: Optional["torch.cuda.Event"] = None


class _Executor:
    """Issues the all-to-alls and expert computes of one pass; see the module docstring."""

    def __init__(self, group, device: torch.device, timeline: Optional[Timeline], phase: str) -> None:
        self.group = group
        self.timeline = timeline
        self.phase = phase
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(device)
            self.comm_stream = _comm_stream(device.index if device.index is not None else torch.cuda.current_device())

    def start(self, x: torch.Tensor, send: list[int], recv: list[int], kind: str, i: int) -> _Pending:
        tl = self.timeline
        if not self.cuda:
            rec = tl.start(kind, i, self.phase) if tl is not None else None
            out, work = all_to_all_raw(x, send, recv, self.group, async_op=True)
            if rec is not None:
                tl.stop_when_done(rec, work.get_future())
            return _Pending(out, work, kind, i)
        ready = torch.cuda.Event()
        ready.record(self.compute_stream)
        with torch.cuda.stream(self.comm_stream):
            self.comm_stream.wait_event(ready)
            rec = tl.start(kind, i, self.phase, stream=self.comm_stream) if tl is not None else None
            out, work = all_to_all_raw(x, send, recv, self.group, async_op=True)
            work.wait()  # NCCL: the comm stream waits for the collective; the host does not block
            if rec is not None:
                tl.stop(rec, stream=self.comm_stream)
            done = torch.cuda.Event()
            done.record(self.comm_stream)
        x.record_stream(self.comm_stream)  # produced on the compute stream, read on the comm stream
        return _Pending(out, work, kind, i, done)

    def finish(self, p: _Pending) -> torch.Tensor:
        if not self.cuda:
            try:
                p.work.wait()
            except RuntimeError as e:  # a peer died or timed out: say which step of which pass
                raise RuntimeError(
                    f"expert-parallel {p.kind} of micro-op {p.micro_op} ({self.phase}) failed: {e}"
                ) from e
            return p.out
        self.compute_stream.wait_event(p.done)
        p.out.record_stream(self.compute_stream)  # allocated on the comm stream
        return p.out

    def compute(self, i: int, fn: Callable[[int, torch.Tensor], torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        tl = self.timeline
        stream = self.compute_stream if self.cuda else None
        rec = tl.start("expert", i, self.phase, stream=stream) if tl is not None else None
        y = fn(i, rows)
        if rec is not None:
            tl.stop(rec, stream=stream)
        return y


def _schedule(
    ex: _Executor,
    sends: Sequence[torch.Tensor],
    plan: DispatchPlan,
    compute: Callable[[int, torch.Tensor], torch.Tensor],
    kinds: tuple[str, str],
    tail: Optional[Callable[[], None]] = None,
) -> list[torch.Tensor]:
    """Run the micro-ops: first exchange (send_splits -> recv_splits), compute, second exchange
    (recv_splits -> send_splits). ``tail`` (compute) runs while the last second exchange is in
    flight. Returns the second exchange's outputs, one per micro-op."""
    n = plan.num_micro_ops
    first: list[Optional[_Pending]] = [None] * n
    second: list[Optional[_Pending]] = [None] * n
    backs: list[Optional[torch.Tensor]] = [None] * n

    def issue_first(i: int) -> None:
        first[i] = ex.start(sends[i], plan.send_splits[i], plan.recv_splits[i], kinds[0], i)

    issue_first(0)
    for i in range(n):
        if i + 1 < n:
            issue_first(i + 1)
        rows = ex.finish(first[i])
        first[i] = None
        y = ex.compute(i, compute, rows)
        second[i] = ex.start(y, plan.recv_splits[i], plan.send_splits[i], kinds[1], i)
        if i >= 1:
            backs[i - 1] = ex.finish(second[i - 1])
            second[i - 1] = None
    if tail is not None:
        tail()
    backs[n - 1] = ex.finish(second[n - 1])
    return backs


@dataclass
class _State:
    """What the pipelined block's backward needs: the plan, the expert function, the detached
    parameters and each micro-op's expert graph (received rows, expert output)."""

    group: object
    plan: DispatchPlan
    expert_fn: ExpertFn
    timeline: Optional[Timeline]
    params: list[torch.Tensor] = field(default_factory=list)
    wgrads: Optional[WeightGradStore] = None
    graphs: list = field(default_factory=list)
    out_width: list[int] = field(default_factory=list)


class _PipelinedExperts(torch.autograd.Function):
    """sends (N micro-op send buffers), params -> N combined buffers; backward pipelined."""

    @staticmethod
    def forward(ctx, state: _State, *tensors):
        n = state.plan.num_micro_ops
        sends, params = tensors[:n], tensors[n:]
        state.params = [p.detach().requires_grad_(p.requires_grad) for p in params]
        state.wgrads = WeightGradStore([p for p in state.params if p.requires_grad], n)
        state.graphs = [None] * n

        def expert_fwd(i: int, recv: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad(), state.wgrads.recording(i):
                r = recv.detach().requires_grad_(True)
                y = state.expert_fn(i, r, state.params)
            state.graphs[i] = (r, y)
            return y.detach()

        ex = _Executor(state.group, sends[0].device, state.timeline, "fwd")
        backs = _schedule(ex, sends, state.plan, expert_fwd, ("dispatch", "combine"))
        state.out_width = [b.shape[1] for b in backs]
        ctx.state = state
        return tuple(backs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        state: _State = ctx.state
        plan = state.plan
        n = plan.num_micro_ops
        if any(not g for g in state.graphs):
            raise RuntimeError(
                "the expert-parallel block was back-propagated twice; its micro-op graphs are freed "
                "after the first backward (retain_graph is not supported through it)"
            )
        params = state.params
        want = [p for p in params if p.requires_grad]
        acc: list[Optional[torch.Tensor]] = [None] * len(want)
        dys = []
        for i, g in enumerate(grads):
            if g is None:
                like = state.graphs[i][1]
                g = like.new_zeros((plan.send_rows(i), state.out_width[i]))
            dys.append(g.contiguous())

        def expert_bwd(i: int, dy: torch.Tensor) -> torch.Tensor:
            r, y = state.graphs[i]
            state.graphs[i] = ()  # free the graph as soon as it is used
            if y.requires_grad:
                gs = torch.autograd.grad(y, [r] + want, dy, allow_unused=True)
            else:  # no rows reached this rank's experts: nothing depends on the inputs
                gs = [None] * (1 + len(want))
            for j, gw in enumerate(gs[1:]):
                if gw is not None:
                    acc[j] = gw if acc[j] is None else acc[j] + gw
            return gs[0] if gs[0] is not None else torch.zeros_like(r)

        def weight_step() -> None:
            # The W step: the deferred weight gradients, once over every micro-op's rows in the
            # order of N = 1, while the last input gradients travel back.
            tl, stream = state.timeline, (ex.compute_stream if ex.cuda else None)
            rec = tl.start("wgrad", n - 1, "bwd", stream=stream) if tl is not None else None
            deferred = state.wgrads.flush(plan.recv_counts)
            if rec is not None:
                tl.stop(rec, stream=stream)
            for j, g in enumerate(deferred):
                if g is not None:
                    acc[j] = g if acc[j] is None else acc[j] + g

        ex = _Executor(state.group, dys[0].device, state.timeline, "bwd")
        d_sends = _schedule(ex, dys, plan, expert_bwd, ("combine", "dispatch"), tail=weight_step)
        it = iter(acc)
        d_params = []
        for p in params:
            if not p.requires_grad:
                d_params.append(None)
                continue
            g = next(it)
            d_params.append(torch.zeros_like(p) if g is None else g)
        return (None, *d_sends, *d_params)


def run_pipelined(
    sends: Sequence[torch.Tensor],
    plan: DispatchPlan,
    expert_fn: ExpertFn,
    params: Sequence[torch.Tensor] = (),
    *,
    group=None,
    timeline: Optional[Timeline] = None,
) -> list[torch.Tensor]:
    """Run N micro-ops (dispatch, expert compute, combine) pipelined; differentiable.

    Args:
        sends: N send buffers; micro-op i's rows, destination-major as ``plan.send_splits[i]``.
        plan: the :class:`~tritonmoe.comm.DispatchPlan` from :func:`~tritonmoe.comm.exchange_counts`.
        expert_fn: ``expert_fn(i, recv_RD, params) -> y_RD`` (see :data:`ExpertFn`).
        params: tensors ``expert_fn`` uses whose gradients are wanted (the expert weights).
        group: the expert-parallel process group.
        timeline: record each step's span (:class:`~tritonmoe.comm.Timeline`).

    Returns: N buffers, micro-op i's expert outputs back on this rank in the order of
    ``sends[i]``. Backward runs the same pipeline in reverse (see the module docstring). Weight
    gradients deferred by ``expert_fn``'s GEMMs assume that the rows each GEMM sees for local
    expert e are micro-op i's received rows of e grouped by source rank
    (``plan.recv_counts[i][:, e]``), as :meth:`AllToAllDispatcher.to_expert_major` lays them out.
    """
    n = plan.num_micro_ops
    if len(sends) != n:
        raise ValueError(f"got {len(sends)} send buffers for a plan of {n} micro-ops")
    for i, s in enumerate(sends):
        if s.shape[0] != plan.send_rows(i):
            raise ValueError(
                f"send buffer {i} has {s.shape[0]} rows but the plan sends {plan.send_rows(i)}; build the "
                "plan from the counts of the same permutation"
            )
    state = _State(group, plan, expert_fn, timeline)
    tensors = (*sends, *params)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_PipelinedExperts.apply(state, *tensors))
    ex = _Executor(group, sends[0].device, timeline, "fwd")
    return _schedule(ex, sends, plan, lambda i, r: expert_fn(i, r, list(params)), ("dispatch", "combine"))
