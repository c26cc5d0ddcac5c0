"""Micro-op pipelining of dispatch, expert compute and combine (Lina / MPMoE style).

The local tokens are cut into N micro-batches along the token dimension; micro-op i is
``dispatch_i -> expert_i -> combine_i``. :func:`pipeline_pass` is the schedule, issued through an
:class:`~tritonmoe.comm.executor.Executor` (so the same code runs for real and in the simulator,
:mod:`tritonmoe.plan`), identical on every rank (collectives must be issued in the same order
everywhere)::

    issue exchange1_0                              (comm lane)
    for i in 0..N-1:
        issue exchange1_{i+1}                      (runs while expert_i computes)
        expert_i after exchange1_i                 (compute lane; overlaps exchange1_{i+1}, exchange2_{i-1})
        issue exchange2_i after expert_i           (comm lane)
        wait exchange2_{i-1}
    tail                                           (compute lane, e.g. the W step)
    wait exchange2_{N-1}

The forward pass runs it with exchange1 = dispatch, exchange2 = combine; the backward pass with
the same splits reversed: the combine's reverse all-to-all brings the output gradients to the
experts, the expert backward (autograd of the micro-op's stored expert graph) computes the input
gradients (the "B" step), and the dispatch's reverse all-to-all returns them. Weight gradients
are computed as in zero-bubble pipelines' deferred "W" step (:mod:`tritonmoe.core.exact`): the pipeline
creates a :class:`~tritonmoe.core.exact.WeightGradStore` per pass and hands micro-op i's slot to the
expert function, whose GEMMs (those that support it: the fp64 reference grouped GEMM) record
their rows instead of computing ``X_i^T dY_i``; one W step after the last micro-op's expert
backward (while its input gradients travel back) computes each expert's ``X^T dY`` over all
micro-ops' rows in the order N = 1 has them. Weight gradients of other GEMMs are summed over
micro-ops in micro-op order. The W step runs for N = 1 too, so every N takes the same path.

Equality with N = 1: routing, capacity and the per-token combine are computed once for the whole
batch or per token in a fixed order, so every per-token quantity (outputs, input and router
gradients) is computed by the same arithmetic for every N whenever the expert compute is
row-independent; with the fp64 reference's row-invariant GEMMs and activations and the deferred W
step, outputs and every gradient are bitwise identical to N = 1 in fp64 (see
:mod:`tritonmoe.core.exact`). In fp32/bf16 they are equal to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from tritonmoe.core.autograd import first_order
from tritonmoe.core.exact import WeightGradSlot, WeightGradStore

from tritonmoe.comm.executor import Executor, RealExecutor, TraceEntry, Work
from tritonmoe.comm.splits import DispatchPlan
from tritonmoe.comm.timeline import Timeline

__all__ = ["run_pipelined", "pipeline_pass", "forward_pass", "backward_pass", "ExpertFn", "micro_batch_bounds"]

#: ``expert_fn(i, recv_RD, params, wgrad) -> y_RD``: the local expert compute of micro-op i on
#: the rows it received (source-major), differentiable in ``recv_RD`` and ``params``; ``y_RD``
#: has one row per received row, in the same order. ``wgrad`` is micro-op i's
#: :class:`~tritonmoe.core.exact.WeightGradSlot` (pass it as ``wgrad=`` to GEMMs that defer their weight
#: gradients, see :mod:`tritonmoe.core.exact`), or None when no weight gradient is wanted.
ExpertFn = Callable[[int, torch.Tensor, Sequence[torch.Tensor], Optional[WeightGradSlot]], torch.Tensor]

_NO_WORK = Work()


def pipeline_pass(
    ex: Executor,
    sends: Sequence[Any],
    plan: DispatchPlan,
    compute: Optional[Callable[[int, Any], Any]],
    *,
    group: Any = None,
    kinds: tuple[str, str] = ("dispatch", "combine"),
    work: Optional[Callable[[int], Work]] = None,
    out_like: Optional[Callable[[int], Any]] = None,
    tail: Optional[Callable[[], None]] = None,
    tail_work: Optional[Work] = None,
    prefetch: Optional[Callable[[int], Sequence[Any]]] = None,
    pre_compute: Optional[Callable[[int], Sequence[Any]]] = None,
    post_compute: Optional[Callable[[int, Any], Optional[Sequence[Any]]]] = None,
) -> list[Any]:
    """One pass of the micro-op pipeline (see the module docstring) on executor ``ex``.

    Args:
        sends: N send buffers (tensors, or :class:`~tritonmoe.comm.executor.VirtualTensor` for
            the simulator); micro-op i's rows, destination-major as ``plan.send_splits[i]``.
        plan: the splits (``plan.send_splits`` out, ``plan.recv_splits`` back).
        compute: ``compute(i, received_rows) -> rows`` for micro-op i (not called by the
            simulator).
        kinds: timeline kinds of the first and second exchange.
        work, out_like: per micro-op, the compute's :class:`~tritonmoe.comm.executor.Work` and
            result shape (for the simulator; the real executor ignores them).
        tail, tail_work: local work issued after the last compute, while the last second
            exchange is in flight (the backward's W step), timeline kind "wgrad".
        prefetch: ``prefetch(i)`` is called right after micro-op i's first exchange is issued
            (before micro-op i-1's compute) and may issue operations on other lanes (the memory
            strategies' restores, :mod:`tritonmoe.comm.programs.memory_reuse`); the handles it returns become
            dependencies of micro-op i's compute.
        pre_compute: ``pre_compute(i)`` is called just before micro-op i's compute is issued
            (after micro-op i-1's); its handles become dependencies of that compute too.
        post_compute: ``post_compute(i, handle)`` is called right after micro-op i's compute is
            issued (the simulator's MI store and offload copies hang off it; in backward, the
            restore of the MI buffer's next occupant); the handles it returns, if any, become
            dependencies of micro-op i's second exchange (the simulator's MI store, which the
            runtime runs inside the compute the exchange reads).

    Returns: the N second-exchange results, micro-op i's rows back in the order of ``sends[i]``.
    """
    n = plan.num_micro_ops
    first: list[Any] = [None] * n
    second: list[Any] = [None] * n
    backs: list[Any] = [None] * n
    deps: list[list[Any]] = [[] for _ in range(n)]

    def issue_first(i: int) -> None:
        first[i] = ex.all_to_all(
            sends[i], plan.send_splits[i], plan.recv_splits[i], group=group, kind=kinds[0], micro_op=i
        )
        if prefetch is not None:
            deps[i].extend(prefetch(i))

    issue_first(0)
    for i in range(n):
        if i + 1 < n:
            issue_first(i + 1)
        if pre_compute is not None:
            deps[i].extend(pre_compute(i))
        y = ex.compute(
            compute,
            i,
            first[i],
            work=work(i) if work is not None else _NO_WORK,
            kind="expert",
            micro_op=i,
            out=out_like(i) if out_like is not None else None,
            after=tuple(deps[i]),
        )
        first[i] = None
        deps[i] = []
        extra = post_compute(i, y) if post_compute is not None else None
        second[i] = ex.all_to_all(y, plan.recv_splits[i], plan.send_splits[i], group=group, kind=kinds[1], micro_op=i,
                                  after=tuple(extra or ()))
        if i >= 1:
            backs[i - 1] = ex.wait(second[i - 1])
            second[i - 1] = None
    if tail is not None or tail_work is not None:
        ex.compute(tail if tail is not None else _noop, work=tail_work or _NO_WORK, kind="wgrad", micro_op=n - 1)
    backs[n - 1] = ex.wait(second[n - 1])
    return backs


def _noop() -> None:
    return None


def forward_pass(
    ex: Executor,
    sends: Sequence[Any],
    plan: DispatchPlan,
    compute: Optional[Callable[[int, Any], Any]],
    *,
    group: Any = None,
    work: Optional[Callable[[int], Work]] = None,
    out_like: Optional[Callable[[int], Any]] = None,
    pre_compute: Optional[Callable[[int], Sequence[Any]]] = None,
    post_compute: Optional[Callable[[int, Any], None]] = None,
) -> list[Any]:
    """The forward schedule of the expert-parallel block: dispatch, expert, combine per micro-op
    (:func:`pipeline_pass`). Used by the autograd block and by the simulator alike."""
    return pipeline_pass(ex, sends, plan, compute, group=group, work=work, out_like=out_like, pre_compute=pre_compute,
                         post_compute=post_compute)


def backward_pass(
    ex: Executor,
    grads: Sequence[Any],
    plan: DispatchPlan,
    compute: Optional[Callable[[int, Any], Any]],
    *,
    group: Any = None,
    weight_step: Optional[Callable[[], None]] = None,
    work: Optional[Callable[[int], Work]] = None,
    out_like: Optional[Callable[[int], Any]] = None,
    weight_step_work: Optional[Work] = None,
    prefetch: Optional[Callable[[int], Sequence[Any]]] = None,
    pre_compute: Optional[Callable[[int], Sequence[Any]]] = None,
    post_compute: Optional[Callable[[int, Any], None]] = None,
) -> list[Any]:
    """The backward schedule: the combine's reverse exchange, the expert backward (input
    gradients), the dispatch's reverse exchange per micro-op, and the W step (``weight_step``,
    always issued, kind "wgrad") while the last input gradients travel back. ``prefetch`` /
    ``pre_compute`` / ``post_compute``: the memory strategies' restores (see
    :func:`pipeline_pass`)."""
    return pipeline_pass(
        ex, grads, plan, compute, group=group, kinds=("combine", "dispatch"), work=work, out_like=out_like,
        tail=weight_step if weight_step is not None else _noop, tail_work=weight_step_work,
        prefetch=prefetch, pre_compute=pre_compute, post_compute=post_compute,
    )


@dataclass
class _State:
    """What the pipelined block's backward needs: the plan, the expert function, the detached
    parameters and each micro-op's expert graph (received rows, expert output)."""

    group: object
    plan: DispatchPlan
    expert_fn: ExpertFn
    timeline: Optional[Timeline]
    trace: Optional[list]
    scheduler: Any = None
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
        want = [p for p in state.params if p.requires_grad]
        state.wgrads = WeightGradStore(want, n) if want else None
        state.graphs = [None] * n

        def expert_fwd(i: int, recv: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                r = recv.detach().requires_grad_(True)
                slot = state.wgrads.slot(i) if state.wgrads is not None else None
                y = state.expert_fn(i, r, state.params, slot)
            state.graphs[i] = (r, y)
            return y.detach()

        ex = RealExecutor(sends[0].device, phase="fwd", timeline=state.timeline, scheduler=state.scheduler)
        backs = forward_pass(ex, sends, state.plan, expert_fwd, group=state.group)
        if state.trace is not None:
            state.trace.extend(ex.trace)
        state.out_width = [b.shape[1] for b in backs]
        ctx.state = state
        return tuple(backs)

    @staticmethod
    @first_order("the pipelined expert-parallel schedule")
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
            if state.wgrads is None:
                return
            deferred = state.wgrads.flush(plan.recv_counts)
            for j, g in enumerate(deferred):
                if g is not None:
                    acc[j] = g if acc[j] is None else acc[j] + g

        ex = RealExecutor(dys[0].device, phase="bwd", timeline=state.timeline, scheduler=state.scheduler)
        try:
            d_sends = backward_pass(ex, dys, plan, expert_bwd, group=state.group, weight_step=weight_step)
        finally:
            if state.scheduler is not None:
                state.scheduler.exchanges_done()  # the exchanges announced at the layer output are over
        if state.trace is not None:
            state.trace.extend(ex.trace)
        return (None, *d_sends, *param_grads(params, acc))


def param_grads(params: Sequence[torch.Tensor], acc: Sequence[Optional[torch.Tensor]]) -> list:
    """The gradients autograd expects for ``params``: None for a parameter that needs none, else
    the next accumulated gradient of ``acc`` (one per parameter that requires grad, in order),
    zeros where nothing was accumulated."""
    it = iter(acc)
    out = []
    for p in params:
        if not p.requires_grad:
            out.append(None)
            continue
        g = next(it)
        out.append(torch.zeros_like(p) if g is None else g)
    return out


def run_pipelined(
    sends: Sequence[torch.Tensor],
    plan: DispatchPlan,
    expert_fn: ExpertFn,
    params: Sequence[torch.Tensor] = (),
    *,
    group=None,
    timeline: Optional[Timeline] = None,
    trace: Optional[list[TraceEntry]] = None,
    scheduler: Any = None,
) -> list[torch.Tensor]:
    """Run N micro-ops (dispatch, expert compute, combine) pipelined; differentiable.

    Args:
        sends: N send buffers; micro-op i's rows, destination-major as ``plan.send_splits[i]``.
        plan: the :class:`~tritonmoe.comm.DispatchPlan` from :func:`~tritonmoe.comm.exchange_counts`.
        expert_fn: ``expert_fn(i, recv_RD, params, wgrad) -> y_RD`` (see :data:`ExpertFn`).
        params: tensors ``expert_fn`` uses whose gradients are wanted (the expert weights).
        group: the expert-parallel process group.
        timeline: record each step's span (:class:`~tritonmoe.comm.Timeline`).
        trace: a list that receives every issued operation (:class:`~tritonmoe.comm.executor.TraceEntry`)
            of the forward and, later, the backward pass, in issue order.
        scheduler: a :class:`~tritonmoe.comm.CommScheduler` the exchanges are started through
            (forward and backward); its ``exchanges_done`` is called when the backward pass's
            exchanges are over (the caller announces them with ``exchange_imminent``).

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
    state = _State(group, plan, expert_fn, timeline, trace, scheduler)
    tensors = (*sends, *params)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_PipelinedExperts.apply(state, *tensors))
    ex = RealExecutor(sends[0].device, phase="fwd", timeline=timeline, scheduler=scheduler)
    out = forward_pass(ex, sends, plan, lambda i, r: expert_fn(i, r, list(params), None), group=group)
    if trace is not None:
        trace.extend(ex.trace)
    return out


def micro_batch_bounds(num_tokens: int, n: int) -> list[tuple[int, int]]:
    """n contiguous token ranges covering [0, num_tokens), sizes differing by at most one (the
    first num_tokens % n one longer); empty ranges when num_tokens < n."""
    base, extra = divmod(num_tokens, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
