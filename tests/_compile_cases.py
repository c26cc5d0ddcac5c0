"""Per-rank body of the compiled-model-with-an-expert-parallel-layer test (tests/test_compile_ep.py,
spawned gloo groups, tests/_dist.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tritonmoe as tm

D = 8


class _Model(torch.nn.Module):
    def __init__(self, cfg: tm.MoEConfig) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, D, dtype=torch.float64)
        self.moe = tm.MoELayer(cfg, ep_group=dist.group.WORLD, dtype=torch.float64)
        self.out = torch.nn.Linear(D, D, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.moe(h))) + h


def _model(cfg: tm.MoEConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return _Model(cfg)


def compiled_model_with_ep_layer(rank: int, P: int) -> dict:
    """A model with an expert-parallel layer (dynamic and static mode) under torch.compile: the
    layer runs eagerly (a graph break around it, none of its ops in a graph), the linear layers
    around it are compiled, and the compiled model equals the eager one bitwise (fp64, output and
    every gradient) on two batch sizes, a rank with zero tokens included."""
    from torch._dynamo.testing import CompileCounterWithBackend

    failures, info = [], {}
    tokens = {0: (5, 0), 1: (7, 4)}[rank % 2]
    for mode, extra in (("dynamic", {}), ("static", {"ep_capacity": 3})):
        cfg = tm.MoEConfig(D, 6, 4, 2, aux_loss_coef=0.01, **extra)
        eager, model = _model(cfg, 7), _model(cfg, 7)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter)
        gen = torch.Generator().manual_seed(100 + rank)
        for T in tokens:
            x = torch.randn(T, D, dtype=torch.float64, generator=gen)
            g = torch.randn(T, D, dtype=torch.float64, generator=gen)
            outs = []
            for m, fn in ((eager, eager), (model, compiled)):
                m.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                out = fn(xi)
                ((out * g).sum() + m.moe.aux_loss).backward()
                outs.append((out.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
            (o1, gx1, gp1), (o2, gx2, gp2) = outs
            if not (torch.equal(o1, o2) and torch.equal(gx1, gx2)):
                failures.append(f"{mode} T={T}: output or x.grad differ")
            for n in gp1:
                if (gp1[n] is None) != (gp2[n] is None) or (gp1[n] is not None and not torch.equal(gp1[n], gp2[n])):
                    failures.append(f"{mode} T={T}: {n}.grad differs")
            if model.moe.ffn_path_used != eager.moe.ffn_path_used:
                failures.append(f"{mode}: path {model.moe.ffn_path_used} != {eager.moe.ffn_path_used}")
        names = [str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"]
        info[mode] = {"graphs": len(counter.graphs), "tritonmoe_ops": [n for n in names if "tritonmoe" in n],
                      "has_linear": any("linear" in n for n in names), "path": model.moe.ffn_path_used}
    return {"failures": failures, "info": info}
