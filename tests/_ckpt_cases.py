"""Cases of tests/test_ep_checkpoint.py, run on every rank of a spawned gloo group."""

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import tritonmoe as tm


def _run(n, strategy, mode, rank):
    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, pipeline_degree=n, memory_strategy=strategy),
                        ep_group=dist.group.WORLD, dtype=torch.float64)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6 + 3 * rank if rank else 0, 8, dtype=torch.float64, generator=g).requires_grad_()  # rank 0: no tokens
    if mode == "plain":
        y = layer(x)
    elif mode == "checkpoint":
        y = checkpoint(layer, x, use_reentrant=False)
    elif mode == "checkpoint_reentrant":
        y = checkpoint(layer, x, use_reentrant=True)
    else:
        with torch.autograd.graph.save_on_cpu():
            y = layer(x)
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def checkpoint_cases(rank: int, P: int):
    """{case: bitwise equal to the plain layer} and {strategy: error type under checkpoint}."""
    equal = {}
    for n, strategy, modes in [
        (1, None, ("checkpoint", "save_on_cpu")),
        (2, None, ("checkpoint", "save_on_cpu", "checkpoint_reentrant")),
        (3, None, ("checkpoint",)),
        (2, "keep", ("checkpoint",)),
        (2, "recompute", ("save_on_cpu", "checkpoint_reentrant")),
        (2, "offload", ("save_on_cpu",)),
    ]:
        want = _run(n, strategy, "plain", rank)
        for mode in modes:
            got = _run(n, strategy, mode, rank)
            equal[f"n={n} {strategy} {mode}"] = all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)) for a, b in zip(want, got)
            )
    refused = {}
    for strategy in ("recompute", "offload", "auto"):
        try:
            _run(2, strategy, "checkpoint", rank)
            refused[strategy] = None
        except ValueError as e:
            refused[strategy] = "use_reentrant=False" in str(e)
    return equal, refused
