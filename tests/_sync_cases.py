"""Per-rank body of tests/test_host_sync.py (spawned gloo groups, tests/_dist.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tritonmoe as tm
from _sync import HostSyncs

D = 8


def _layer_step(layer: tm.MoELayer, T: int, seed: int, dtype: torch.dtype = torch.float64) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, dtype=dtype, generator=gen).requires_grad_()
    out = layer(x)
    ((out * torch.randn(out.shape, dtype=dtype, generator=gen)).sum() + layer.aux_loss).backward()


def layer_syncs(rank: int, P: int) -> dict:
    """Host syncs of a whole expert-parallel layer step (route, aux loss, expert path, shared
    expert, load statistics; forward and backward), static mode (several configs and batch
    sizes, a rank with zero tokens) and dynamic mode: ``{case: [(kind, where, source), ...]}``."""
    out = {}
    static = [
        ("static", dict(ep_capacity=3, aux_loss_coef=0.01, z_loss_coef=0.001), (5, 0)),
        ("static+features", dict(ep_capacity=2, aux_loss_coef=0.01, expert_ffn_bias=True, shared_d_ffn=4,
                                 routed_scaling_factor=1.5, activation="swiglu_oai", expert_bias=True,
                                 n_groups=2, topk_groups=1), (7, 3)),
    ]
    for name, opts, tokens in static:
        torch.manual_seed(0)
        layer = tm.MoELayer(tm.MoEConfig(D, 6, 4, 2, **opts), ep_group=dist.group.WORLD, dtype=torch.float64)
        _layer_step(layer, 4, 1)  # warm-up (first-call caches)
        for i, T in enumerate(tokens):
            T = T if rank == 0 else tokens[::-1][i]
            with tm.validation(False), HostSyncs() as s:  # the sync-free step (docs/rank-input.md)
                _layer_step(layer, T, 10 + i)
            out[f"{name} T={T}"] = [(y.kind, y.where, y.source().strip(), y.commented()) for y in s.syncs]
        # validation on: the refused-input status words' read, and nothing else
        T = tokens[0] if rank == 0 else tokens[-1]
        with tm.validation(True), HostSyncs() as s:
            _layer_step(layer, T, 30)
        out[f"{name} T={T} validation on"] = [(y.kind, y.where, y.source().strip(), y.commented()) for y in s.syncs]
    torch.manual_seed(0)
    dyn = tm.MoELayer(tm.MoEConfig(D, 6, 4, 2, aux_loss_coef=0.01), ep_group=dist.group.WORLD, dtype=torch.float64)
    _layer_step(dyn, 4, 1)
    with HostSyncs() as s:
        _layer_step(dyn, 6 if rank == 0 else 0, 20)
    out["dynamic"] = [(y.kind, y.where, y.source().strip(), y.commented()) for y in s.syncs]
    # the dynamic mode on the Triton kernels (the GPU's path; the interpreter on CPU, its kernel
    # runs not counted: on a GPU a launch is asynchronous), pipelined with capacity drops
    import triton.runtime.interpreter as interp

    # (the re-dispatching memory strategies too: their backward permutes again; with a rank that
    # has no tokens)
    for strategy, tokens in ((None, (7, 5)), ("recomm", (7, 0)), ("recomm_recompute", (0, 6))):
        torch.manual_seed(0)
        tri = tm.MoELayer(tm.MoEConfig(D, 6, 4, 2, aux_loss_coef=0.01, pipeline_degree=3, capacity_factor=1.0,
                                       backend="triton", memory_strategy=strategy),
                          ep_group=dist.group.WORLD, dtype=torch.float32)
        _layer_step(tri, 4, 1, torch.float32)
        run = interp.InterpretedFunction.run
        with HostSyncs() as s:
            interp.InterpretedFunction.run = s.as_device_work(run)
            try:
                _layer_step(tri, tokens[rank], 21, torch.float32)
            finally:
                interp.InterpretedFunction.run = run
        out[f"dynamic-triton {strategy}"] = [(y.kind, y.where, y.source().strip(), y.commented()) for y in s.syncs]
    return out
