"""Per-rank body of tests/test_double_backward.py's expert-parallel case (a spawned gloo group,
tests/_dist.py): a gradient penalty through the expert-parallel layer on each schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tritonmoe as tm

SCHEDULES = [(1, "keep"), (2, "recompute")]


def ep_penalty(rank: int, P: int) -> dict:
    out = {}
    for degree, strategy in SCHEDULES:
        torch.manual_seed(0)
        cfg = tm.MoEConfig(4, 6, 2 * P, 2, pipeline_degree=degree, memory_strategy=strategy, backend="torch")
        layer = tm.MoELayer(cfg, ep_group=dist.group.WORLD, dtype=torch.float64)
        torch.manual_seed(1 + rank)
        x = torch.randn(5 + rank, 4, dtype=torch.float64, requires_grad=True)
        (gx,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
        try:
            grads = torch.autograd.grad(gx.pow(2).sum(), [layer.w1, layer.w2], allow_unused=True)
            out[f"{degree}-{strategy}"] = ("ok", [g is not None and bool(torch.isfinite(g).all()) for g in grads])
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[f"{degree}-{strategy}"] = (type(e).__name__, str(e))
        dist.barrier()
    return out
