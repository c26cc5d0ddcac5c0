"""Autograd all-to-all with uneven splits, on any torch.distributed process group.

``all_to_all(x, input_split_sizes, output_split_sizes)`` sends rows
``[sum(input_split_sizes[:j]), sum(input_split_sizes[:j+1]))`` of ``x`` to rank j and returns the
rows received from every rank, concatenated in rank order. Its backward is the reverse
all-to-all (the splits swapped), so gradients of the received rows go back to the rows that were
sent. Works on NCCL (CUDA tensors) and gloo (CPU tensors; torch's gloo backend supports uneven
``all_to_all_single`` splits).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .errors import backend_errors
from .splits import as_int_list, check_splits, exchange_splits, group_rank_size

__all__ = ["all_to_all", "all_to_all_raw"]


def all_to_all_raw(
    x: torch.Tensor,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    group=None,
    *,
    async_op: bool = False,
):
    """Unchecked, non-differentiable all-to-all of rows: ``(out, work)`` (``work`` is None unless
    ``async_op``). The splits must already agree across the group (derived from
    :func:`~tritonmoe.comm.exchange_counts` or checked with :func:`~tritonmoe.comm.check_splits`).
    A backend failure raises :class:`~tritonmoe.comm.ScheduleError` (with ``async_op``, when the
    collective is issued; wait for the work inside :func:`~tritonmoe.comm.errors.backend_errors`)."""
    x = x.contiguous()
    out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
    with backend_errors(f"an all-to-all of {x.shape[0]} rows", group):
        work = dist.all_to_all_single(
            out, x, list(output_split_sizes), list(input_split_sizes), group=group, async_op=async_op
        )
    return out, work


class AllToAllFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, input_split_sizes, output_split_sizes, group):
        ctx.splits = (list(input_split_sizes), list(output_split_sizes))
        ctx.group = group
        out, _ = all_to_all_raw(x, input_split_sizes, output_split_sizes, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ins, outs = ctx.splits
        if torch.is_grad_enabled():  # create_graph: the reverse exchange, recorded (double backward exact)
            return AllToAllFunction.apply(grad_out.contiguous(), outs, ins, ctx.group), None, None, None
        grad_x, _ = all_to_all_raw(grad_out, outs, ins, ctx.group)  # the reverse exchange
        return grad_x, None, None, None


def all_to_all(
    x: torch.Tensor,
    input_split_sizes: Optional[Sequence[int]] = None,
    output_split_sizes: Optional[Sequence[int]] = None,
    *,
    group=None,
    check: bool = True,
) -> torch.Tensor:
    """Differentiable all-to-all of the rows (dim 0) of ``x``.

    Args:
        x: [N, ...] rows to send; ``input_split_sizes[j]`` consecutive rows go to rank j.
        input_split_sizes: P ints summing to N, or None for N/P rows to every rank.
        output_split_sizes: P ints, the rows expected from each rank; None derives them by
            exchanging the input splits (one small all-to-all), so they always agree.
        group: process group (None = default group).
        check: when both split lists are given, exchange and compare them first
            (:func:`~tritonmoe.comm.check_splits`: one small all-to-all and a host sync), so a
            disagreement raises the same :class:`~tritonmoe.comm.SplitMismatchError` on every
            rank instead of aborting (gloo) or scrambling rows. Pass ``check=False`` only for
            splits that come from :func:`~tritonmoe.comm.exchange_counts`.

    Returns: [sum(output_split_sizes), ...] rows received, in source-rank order. The backward
    is the reverse all-to-all. Collective: every rank of ``group`` must call it, in the same order.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the rows to exchange)")
    _, P = group_rank_size(group)
    if input_split_sizes is None:
        # Rows not divisible by P: invalid splits, reported by the collective check on every rank.
        input_split_sizes = [x.shape[0] // P] * P if x.shape[0] % P == 0 else [-1] * P
    if output_split_sizes is None:
        output_split_sizes = exchange_splits(input_split_sizes, group=group, input_rows=x.shape[0])
    elif check:
        check_splits(input_split_sizes, output_split_sizes, group=group, input_rows=x.shape[0])
    ins, outs = as_int_list(input_split_sizes), as_int_list(output_split_sizes)
    if ins is None or outs is None:
        raise TypeError("input_split_sizes and output_split_sizes must be sequences of ints (or 1-D int tensors)")
    return AllToAllFunction.apply(x, ins, outs, group)
