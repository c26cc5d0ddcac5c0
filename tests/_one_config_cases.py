"""One MoEConfig, any world size (issue 33): the expert-parallel run of a config with
pipeline_degree=2 against the single-process layer built from the *same* config (no ep_group),
fp64 on gloo. Run by tests/test_one_config.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tritonmoe as tm

CFG = dict(d_model=8, d_ffn=6, num_experts=4, top_k=2, pipeline_degree=2, backend="torch")


def _batch(r: int) -> torch.Tensor:
    return torch.randn(3 + 2 * r, CFG["d_model"], dtype=torch.float64, generator=torch.Generator().manual_seed(50 + r))


def ep_against_local(rank: int, P: int) -> list[str]:
    cfg = tm.MoEConfig(**CFG)
    torch.manual_seed(7)
    ep = tm.MoELayer(cfg, ep_group=dist.group.WORLD, dtype=torch.float64)
    torch.manual_seed(7)
    ref = tm.MoELayer(cfg, dtype=torch.float64)  # the same config, one process
    failures = []
    x = _batch(rank).requires_grad_()
    out = ep(x)
    out.sum().backward()
    for r in range(P):  # the reference sees every rank's batch, one at a time (routing is per rank)
        xr = _batch(r).requires_grad_()
        o = ref(xr)
        o.sum().backward()
        if r == rank:
            if not torch.equal(o, out):
                failures.append(f"rank {rank}: output differs by {(o - out).abs().max().item()}")
            if not torch.equal(xr.grad, x.grad):
                failures.append(f"rank {rank}: input gradient differs")
    s, n = ep.expert_start, ep.num_local_experts
    for name in ("w1", "w2"):
        got, want = getattr(ep, name).grad, getattr(ref, name).grad[s:s + n]
        if not torch.allclose(got, want, rtol=1e-12, atol=1e-14):
            failures.append(f"rank {rank}: {name} gradient differs by {(got - want).abs().max().item()}")
    return failures
