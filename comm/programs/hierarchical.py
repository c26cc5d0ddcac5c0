"""Hierarchical all-to-all (SE-MoE section 4.2, Tutel's 2D all-to-all; PAPERS.md 2.6).

A group of P = n nodes x p GPUs, rank (a, i) = a*p + i (node a, local index i). A flat all-to-all
sends (n-1)*p inter-node messages per rank, each 1/P of its buffer. The hierarchical one:

1. **intra-node all-to-all** over the node's p ranks: (a, i) sends to local peer (a, j) the n
   chunks it has for the ranks (b, j), b = 0..n-1 (in b order);
2. **layout transform** (local): (a, j) regroups what it received, (i, b) -> (b, i), so that the
   rows for node b are contiguous, from local source i = 0..p-1;
3. **inter-node all-to-all** among the same-local-index ranks (the "rail" group of j: (b, j),
   b = 0..n-1): (a, j) sends to (b, j) everything its node has for (b, j).

Rank (b, j) then holds, from each node a, the chunks of the sources (a, 0..p-1): the source-rank
order of the flat all-to-all, so no final reorder is needed. Inter-node bytes are the same;
inter-node messages drop from (n-1)*p to n-1, each p times larger; intra-node bytes grow n times.
It pays when the per-message cost of the inter-node links dominates (SE-MoE reports it at 32 GPUs).

:func:`hierarchical_all_to_all` has the flat :func:`~tritonmoe.comm.all_to_all`'s contract
(uneven splits, zero included; caller splits checked or derived; differentiable, the backward is
the hierarchical exchange of the reverse splits). The split sizes of the two steps come from one
small intra-node exchange (each rank sends each local peer the n sizes it has for it, and the n it
expects back from it, for the backward). :func:`hierarchical_schedule` is the exchange as
executor code, so the simulator and the planner can substitute it for a flat all-to-all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from tritonmoe.core.autograd import first_order
from tritonmoe.comm.errors import backend_errors, new_group
from tritonmoe.comm.executor import Executor, Handle, RealExecutor, VirtualTensor, Work
from tritonmoe.comm.partition import transpose_chunks_unchecked
from tritonmoe.comm.splits import as_int_list, check_splits, comm_device, exchange_splits, group_rank_size

__all__ = ["HierarchicalGroups", "HierarchicalPlan", "hierarchical_groups", "hierarchical_plan",
           "hierarchical_schedule", "hierarchical_all_to_all"]


@dataclass(frozen=True)
class HierarchicalGroups:
    """The groups of a hierarchical all-to-all over ``group`` (n nodes x ``local_size`` ranks,
    node-major: group rank = node * local_size + local index).

    Attributes:
        group: the whole group (None: the default group); ``local_size``: p.
        intra: this rank's node group (p ranks; None when p == 1).
        inter: this rank's rail group (the n ranks with its local index; None when n == 1).
    """

    group: Any
    local_size: int
    intra: Any
    inter: Any

    @property
    def num_nodes(self) -> int:
        return group_rank_size(self.group)[1] // self.local_size


def hierarchical_groups(local_size: int, *, group=None, cache: Optional[dict] = None) -> HierarchicalGroups:
    """Create the node and rail groups of ``group`` for ``local_size`` ranks per node. Collective
    over the default group (``torch.distributed.new_group`` for every node group, then every rail
    group, in that order on every rank); ``cache`` (a dict) reuses groups with the same members.
    The groups inherit ``group``'s timeout (:func:`~tritonmoe.comm.errors.group_timeout`)."""
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        raise ValueError(f"local_size must be a positive int, got {local_size!r}")
    rank, P = group_rank_size(group)
    if P % local_size:
        raise ValueError(
            f"local_size={local_size} does not divide the {P} ranks of the group; a hierarchical all-to-all "
            "needs whole nodes (use the GPUs per node)"
        )
    n = P // local_size
    members = dist.get_process_group_ranks(group) if group is not None else list(range(P))
    cache = {} if cache is None else cache

    def make(ranks: list[int]):
        key = tuple(ranks)
        if key not in cache:
            cache[key] = new_group(ranks, parent=group)  # the parent's timeout, not the 30-minute default
        return cache[key]

    a, i = divmod(rank, local_size)
    intra = inter = None
    if local_size > 1:
        for b in range(n):
            g = make([members[b * local_size + j] for j in range(local_size)])
            if b == a:
                intra = g
    if n > 1:
        for j in range(local_size):
            g = make([members[b * local_size + j] for b in range(n)])
            if j == i:
                inter = g
    return HierarchicalGroups(group=group, local_size=local_size, intra=intra, inter=inter)


@dataclass(frozen=True)
class HierarchicalPlan:
    """The splits of the two steps for one rank (see the module docstring).

    Attributes:
        intra_send, intra_recv: splits of step 1 over the node group (p entries).
        transform: int [p, n] rows received from local peer i for node b (the layout transform
            regroups them (i, b) -> (b, i)).
        inter_send, inter_recv: splits of step 3 over the rail group (n entries).
    """

    intra_send: list[int]
    intra_recv: list[int]
    transform: list[list[int]]
    inter_send: list[int]
    inter_recv: list[int]

    @property
    def rows_in(self) -> int:
        return sum(self.intra_send)

    @property
    def rows_mid(self) -> int:
        return sum(self.intra_recv)

    @property
    def rows_out(self) -> int:
        return sum(self.inter_recv)


def hierarchical_plan(
    send_splits: Sequence[int], recv_splits: Sequence[int], peer_sends: Sequence[Sequence[int]], rank: int, local_size: int
) -> HierarchicalPlan:
    """The plan of rank ``rank`` (node-major) from its splits and, per local peer i (in local
    order, itself included), the n sizes peer i sends to this rank's local index on each node
    (``peer_sends[i][b]`` = rows (a, i) sends to (b, j))."""
    P = len(send_splits)
    p = local_size
    n = P // p
    a, j = divmod(rank, p)
    intra_send = [sum(send_splits[b * p + k] for b in range(n)) for k in range(p)]
    transform = [list(peer_sends[i]) for i in range(p)]
    intra_recv = [sum(transform[i]) for i in range(p)]
    inter_send = [sum(transform[i][b] for i in range(p)) for b in range(n)]
    inter_recv = [sum(recv_splits[b * p + i] for i in range(p)) for b in range(n)]
    return HierarchicalPlan(intra_send, intra_recv, transform, inter_send, inter_recv)


def _send_layout_index(send_splits: Sequence[int], p: int) -> Optional[list[tuple[int, int]]]:
    """Row ranges of the input in step-1 order: for local peer k, nodes b = 0..n-1 (the input is
    in destination order b*p + k; step 1 wants it grouped by k)."""
    P = len(send_splits)
    n = P // p
    starts, acc = [], 0
    for s in send_splits:
        starts.append(acc)
        acc += s
    return [(starts[b * p + k], send_splits[b * p + k]) for k in range(p) for b in range(n)]


def _gather_ranges(x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    pieces = [x[s : s + c] for s, c in ranges if c]
    if not pieces:
        return x[0:0]
    return torch.cat(pieces, 0)


def _copy_work(rows: int, x: Any) -> Work:
    rb = x.row_bytes() if isinstance(x, VirtualTensor) else x.element_size() * math.prod(x.shape[1:])
    return Work(bytes=2.0 * rows * rb, kind="copy")


def hierarchical_schedule(
    ex: Executor,
    x: Any,
    send_splits: Sequence[int],
    plan: HierarchicalPlan,
    *,
    intra: Any,
    inter: Any,
    local_size: int,
    kind: str = "dispatch",
    micro_op: int = 0,
    after: Sequence[Handle] = (),
) -> Handle:
    """The hierarchical all-to-all as executor code: regroup by local peer (compute), intra-node
    all-to-all, layout transform (compute), inter-node all-to-all. Returns the handle of the
    received rows, in source-rank order (as the flat all-to-all's)."""
    p = local_size
    n = len(plan.inter_send)
    src = x.value if isinstance(x, Handle) else x
    ranges = _send_layout_index(send_splits, p)
    h = x
    if n > 1 and p > 1:  # dest order (b, k) -> step-1 order (k, b)
        h = ex.compute(
            lambda t: _gather_ranges(t, ranges), x, work=_copy_work(plan.rows_in, src), kind="partition",
            micro_op=micro_op, out=_rows_like(src, plan.rows_in), after=after,
        )
        after = ()
    if p > 1:
        h = ex.all_to_all(h, plan.intra_send, plan.intra_recv, group=intra, kind=kind + "_intra", micro_op=micro_op, after=after)
        after = ()
    if n > 1:
        if p > 1:
            counts = torch.tensor(plan.transform, dtype=torch.int64)
            h = ex.compute(
                lambda t: transpose_chunks_unchecked(t, counts.to(t.device), None), h,
                work=_copy_work(plan.rows_mid, src), kind="partition", micro_op=micro_op,
                out=_rows_like(src, plan.rows_mid),
            )
        h = ex.all_to_all(h, plan.inter_send, plan.inter_recv, group=inter, kind=kind + "_inter", micro_op=micro_op, after=after)
    if not isinstance(h, Handle):  # P == 1
        h = ex.compute(lambda t: t, h, work=Work(launches=0), kind="partition", micro_op=micro_op, out=src, after=after)
    return h


def _rows_like(v: Any, n: int) -> Any:
    if isinstance(v, VirtualTensor):
        return v.with_rows(n)
    return VirtualTensor((n,) + tuple(v.shape[1:]), v.dtype)


class _Hierarchical(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, fwd_plan, bwd_plan, groups):
        ctx.args = (send, recv, fwd_plan, bwd_plan, groups)
        return _run(x, send, fwd_plan, groups)

    @staticmethod
    @first_order("the hierarchical all-to-all")
    def backward(ctx, grad):
        send, recv, fwd_plan, bwd_plan, groups = ctx.args
        return _run(grad.contiguous(), recv, bwd_plan, groups), None, None, None, None, None


def _run(x: torch.Tensor, send: Sequence[int], plan: HierarchicalPlan, groups: HierarchicalGroups) -> torch.Tensor:
    ex = RealExecutor(x.device)
    h = hierarchical_schedule(ex, x.contiguous(), send, plan, intra=groups.intra, inter=groups.inter, local_size=groups.local_size)
    return ex.wait(h)


def hierarchical_all_to_all(
    x: torch.Tensor,
    input_split_sizes: Optional[Sequence[int]] = None,
    output_split_sizes: Optional[Sequence[int]] = None,
    *,
    groups: HierarchicalGroups,
    check: bool = True,
) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x`` over ``groups.group``, in two steps (see
    the module docstring); the same contract and result as :func:`tritonmoe.comm.all_to_all`.

    Args:
        x: [N, ...] rows; ``input_split_sizes[j]`` consecutive rows go to group rank j.
        input_split_sizes, output_split_sizes: as for the flat all-to-all (None: equal splits /
            derived by one small exchange); uneven and zero splits are fine.
        groups: the node and rail groups (:func:`hierarchical_groups`).
        check: compare caller-supplied splits across the group first.

    Collective over the group; besides the data exchanges, one small intra-node exchange of the
    step sizes (a host sync).
    """
    if not isinstance(groups, HierarchicalGroups):
        raise TypeError(f"groups must be a HierarchicalGroups (tritonmoe.comm.hierarchical_groups), got {type(groups).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the rows to exchange)")
    group = groups.group
    rank, P = group_rank_size(group)
    p = groups.local_size
    if P % p:
        raise ValueError(f"local_size={p} does not divide the {P} ranks of the group")
    if input_split_sizes is None:
        input_split_sizes = [x.shape[0] // P] * P if x.shape[0] % P == 0 else [-1] * P
    if output_split_sizes is None:
        output_split_sizes = exchange_splits(input_split_sizes, group=group, input_rows=x.shape[0])
    elif check:
        check_splits(input_split_sizes, output_split_sizes, group=group, input_rows=x.shape[0])
    send, recv = as_int_list(input_split_sizes), as_int_list(output_split_sizes)
    if send is None or recv is None:
        raise TypeError("input_split_sizes and output_split_sizes must be sequences of ints")
    n = P // p
    a, j = divmod(rank, p)
    # Step sizes: each rank tells each local peer k the n sizes it sends to (b, k) (forward) and
    # the n it receives from (b, k) (backward, the reverse exchange). One small intra-node exchange.
    vec = []
    for k in range(p):
        vec += [send[b * p + k] for b in range(n)] + [recv[b * p + k] for b in range(n)]
    if p > 1:
        t = torch.tensor(vec, dtype=torch.int64, device=comm_device(groups.intra))
        got = torch.empty_like(t)
        with backend_errors("the hierarchical all-to-all's step-size exchange (intra-node group)", groups.intra):
            dist.all_to_all_single(got, t, group=groups.intra)
        table = got.view(p, 2 * n).tolist()  # host sync: step sizes are host ints
    else:
        table = [vec]
    fwd = hierarchical_plan(send, recv, [row[:n] for row in table], rank, p)
    bwd = hierarchical_plan(recv, send, [row[n:] for row in table], rank, p)
    return _Hierarchical.apply(x, send, recv, fwd, bwd, groups)
