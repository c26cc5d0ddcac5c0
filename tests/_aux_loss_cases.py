"""Rank functions of the global balance-loss tests (run by tests/_dist.run_group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tritonmoe as tm

D, F, E, K = 6, 8, 8, 2
#: tokens of micro-batch m on rank r (ragged; rank 1 has an empty micro-batch)
SIZES = ((5, 3, 4, 6), (4, 0, 7, 2))


def inputs(seed: int = 0):
    """x[r][m] and padding masks[r][m] of every rank and micro-batch (the same on every process)."""
    g = torch.Generator().manual_seed(seed + 7)
    xs = [[torch.randn(t, D, generator=g, dtype=torch.float64) for t in row] for row in SIZES]
    masks = [[torch.rand(t, generator=g) > 0.25 for t in row] for row in SIZES]
    return xs, masks


def global_losses(rank: int, world: int, score_func: str, use_mask: bool):
    """Run the 4 micro-batches of this rank, then a reset and micro-batch 0 again; return every
    forward's loss and router-weight gradient."""
    torch.manual_seed(0)
    cfg = tm.MoEConfig(D, F, E, K, score_func=score_func, aux_loss_type="global", aux_loss_coef=1.0, backend="torch")
    layer = tm.MoELayer(cfg, dtype=torch.float64, aux_loss_group=dist.group.WORLD)
    xs, masks = inputs()
    out = []
    order = list(range(4)) + [0]
    for i, m in enumerate(order):
        if i == 4:
            layer.reset_aux_loss_state()
        layer.zero_grad()
        layer(xs[rank][m], padding_mask=masks[rank][m] if use_mask else None)
        loss = layer.aux_loss
        loss.backward()
        g = layer.router.weight.grad
        out.append((float(loss), None if g is None else g.clone()))
    return out
