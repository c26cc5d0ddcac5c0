"""Names of torch.distributed that changed across the torch versions tritonmoe runs on."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]


def all_gather_single(output_tensor, input_tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_single`` where it exists (torch >= 2.12, which deprecates
    the old name with a FutureWarning), else ``all_gather_into_tensor`` (the same collective:
    every rank's ``input_tensor`` concatenated into ``output_tensor``). Resolved at each call, so
    a test or a fault injector that replaces either name on ``torch.distributed`` is honoured."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_single(output_tensor, input_tensor, group=None, async_op: bool = False):
    """``torch.distributed.reduce_scatter_single`` where it exists (torch >= 2.12, which
    deprecates ``reduce_scatter_tensor``), else ``reduce_scatter_tensor`` (the same collective:
    the sum over ranks of ``input_tensor``, rank r keeping chunk r in ``output_tensor``)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output_tensor, input_tensor, group=group, async_op=async_op)
