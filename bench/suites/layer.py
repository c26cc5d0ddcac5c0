"""The ``layer`` suite: MoELayer forward (inference) and forward+backward against the per-expert loop."""

from __future__ import annotations

import copy
import dataclasses

import torch

import tritonmoe as tm
from tritonmoe import reference

from .. import baselines as B
from .. import work as W
from ..presets import Preset
from .common import (
    Case,
    Context,
    RoutingSpec,
    active_experts,
    backend_impls,
    case_params,
    leaf,
    make_entries,
)


def plan_layer(ctx: Context) -> list[Case]:
    return [
        layer_case(ctx, p, T, spec)
        for p in ctx.presets
        for spec in ctx.routings_for("layer")
        for T in ctx.tokens_for(p)
    ]


def skew_router(layer: tm.MoELayer, x_TD: torch.Tensor, spec: RoutingSpec) -> None:
    """Make the layer's router prefer experts by ``spec``'s popularity: the last input feature
    is set to 1 and the router's last column to log(popularity), so every token's logits get
    log p_e added (a no-op for uniform routing)."""
    if spec.kind == "uniform":
        return
    with torch.no_grad():
        x_TD[:, -1] = 1.0
        logp = spec.popularity(layer.config.num_experts).log()
        layer.router.weight[:, -1] = logp.to(layer.router.weight)


def layer_case(ctx: Context, p: Preset, T: int, spec: RoutingSpec) -> Case:
    E, d, f, n1, k = p.num_experts, p.d_model, p.d_ffn, p.n1, p.top_k
    cfg = tm.MoEConfig(
        d, f, E, k, activation=p.activation, score_func=p.score_func, renormalize=p.renormalize,
        n_groups=p.n_groups, topk_groups=p.topk_groups, expert_bias=p.expert_bias,
    )

    def build():
        torch.manual_seed(ctx.seed + T)
        layer = tm.MoELayer(cfg, device=ctx.device, dtype=ctx.dtype)
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(ctx.randn(E, salt=T + 40, dtype=torch.float32, scale=0.01))
        x_TD = ctx.randn(T, d, salt=T + 41)
        skew_router(layer, x_TD, spec)
        with torch.no_grad():  # the routing this input gets, for the work accounting
            r = reference.route(layer.router(x_TD), k, expert_bias=layer.expert_bias, **p.route_kwargs())
        layers = {}
        for b in ctx.backends:  # shallow copies share parameters and buffers, each with its backend
            layers[b] = copy.copy(layer)
            layers[b].config = dataclasses.replace(cfg, backend=b)
        return dict(layer=layer, layers=layers, x=leaf(x_TD), params=[q for q in layer.parameters() if q.requires_grad],
                    Ea=active_experts(r.counts), R=int(r.counts.sum()))

    def loop(st):
        L = st["layer"]
        return B.per_expert_loop_moe(
            st["x"], L.router.weight, L.w1, L.w2, k, p.activation, score_func=p.score_func,
            renormalize=p.renormalize, expert_bias=L.expert_bias, n_groups=p.n_groups, topk_groups=p.topk_groups,
        )

    impls = backend_impls(ctx, lambda st, b: st["layers"][b](st["x"]))
    if "loop" in ctx.baselines:
        impls.append(("loop", loop, None))
    entries = make_entries(
        impls,
        inputs=lambda st: [st["x"], *st["params"]],
        out_grad=lambda st: ctx.randn(T, d, salt=T + 42),  # d(out)
        work=lambda st, backward: W.layer(T, E, k, st["R"], d, f, n1, st["Ea"], ctx.itemsize, backward=backward),
    )
    return Case("layer", f"{p.name} T={T} {spec.label}", case_params(ctx, p, T, spec, op="MoELayer"), build, entries)


