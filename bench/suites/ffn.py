"""The ``ffn`` suite: grouped_ffn over a permuted buffer, and the routed FFN x -> out (moe_ffn)."""

from __future__ import annotations

import dataclasses

import torch

import tritonmoe as tm

from .. import baselines as B
from .. import peers as PE
from .. import work as W
from ..harness import Unavailable
from ..presets import Preset
from .common import (
    Case,
    Context,
    RoutingSpec,
    active_experts,
    backend_impls,
    case_params,
    ffn_weights,
    grouped_mm_check,
    leaf,
    make_entries,
    make_routing,
)


def plan_ffn(ctx: Context) -> list[Case]:
    """grouped_ffn cases, and moe_ffn cases when a backend other than the reference is measured:
    the routed FFN compares tritonmoe's fused op and its permute + grouped_ffn + unpermute
    pipeline against the baselines' pipelines. The reference pipeline is left out there: it is
    the grouped_ffn reference plus the permutations (both measured on their own, and the whole
    layer in the layer suite) and would add minutes of fp32 GEMMs at the large presets."""
    routed = any(b != "torch" for b in ctx.backends)
    cases = []
    for p in ctx.presets:
        for spec in ctx.routings_for("ffn"):
            for T in ctx.tokens_for(p):
                cases.append(grouped_ffn_case(ctx, p, T, spec))
                if routed:
                    cases.append(moe_ffn_case(ctx, p, T, spec))
    return cases


def grouped_ffn_case(ctx: Context, p: Preset, T: int, spec: RoutingSpec) -> Case:
    d, f, n1, act = p.d_model, p.d_ffn, p.n1, p.activation

    def build():
        counts_E = make_routing(ctx, T, p, spec, salt=T).counts.long()
        offsets = torch.zeros(p.num_experts + 1, dtype=torch.int64, device=ctx.device)
        offsets[1:] = torch.cumsum(counts_E, 0)
        R = int(offsets[-1])  # setup only
        w1, w2 = ffn_weights(ctx, p, salt=T + 21)
        return dict(x=leaf(ctx.randn(R, d, salt=T + 20)), offsets=offsets, offs32=B.grouped_mm_offsets(offsets),
                    w1=w1, w2=w2, R=R, Ea=active_experts(counts_E))

    impls = backend_impls(ctx, lambda st, b: tm.grouped_ffn(st["x"], st["offsets"], st["w1"], st["w2"], act, backend=b))
    if "grouped_mm" in ctx.baselines:
        impls.append(("grouped_mm", lambda st: B.grouped_mm_ffn(st["x"], st["offs32"], st["w1"], st["w2"], act),
                      grouped_mm_check(ctx)))
    if "loop" in ctx.baselines:
        impls.append(("loop", lambda st: B.loop_grouped_ffn(st["x"], st["offsets"], st["w1"], st["w2"], act), None))
    entries = make_entries(
        impls,
        inputs=lambda st: [st["x"], st["w1"], st["w2"]],
        out_grad=lambda st: ctx.randn(st["R"], d, salt=T + 22),  # d(y)
        work=lambda st, backward: W.grouped_ffn(st["R"], d, f, n1, st["Ea"], ctx.itemsize, backward=backward),
    )
    return Case("ffn", f"grouped_ffn {p.name} T={T} {spec.label}", case_params(ctx, p, T, spec, op="grouped_ffn"),
                build, entries)


def moe_ffn_case(ctx: Context, p: Preset, T: int, spec: RoutingSpec) -> Case:
    E, d, f, n1, k, act = p.num_experts, p.d_model, p.d_ffn, p.n1, p.top_k, p.activation

    def build():
        r = make_routing(ctx, T, p, spec, salt=T)
        w1, w2 = ffn_weights(ctx, p, salt=T + 31)
        w_TK = leaf(r.topk_weights)  # the gate weights are differentiable inputs too
        return dict(x=leaf(ctx.randn(T, d, salt=T + 30)), routing=dataclasses.replace(r, topk_weights=w_TK),
                    w=w_TK, w1=w1, w2=w2, R=T * k, Ea=active_experts(r.counts))

    def pipeline(st, b):
        r = st["routing"]
        x_perm, info = tm.permute(st["x"], r.topk_ids, E, backend=b)
        y_perm = tm.grouped_ffn(x_perm, info.expert_offsets, st["w1"], st["w2"], act, backend=b)
        return tm.unpermute(y_perm, info, r.topk_weights, backend=b)

    def fused(st, b):
        moe_ffn = getattr(tm, "moe_ffn", None)
        if moe_ffn is None:
            raise Unavailable("tritonmoe.moe_ffn (the fused gather/FFN/scatter op) is not in this build")
        return moe_ffn(st["x"], st["routing"], st["w1"], st["w2"], act, backend=b)

    impls = []
    for pair in zip(backend_impls(ctx, fused, skip_torch=True, suffix="-fused"),
                    backend_impls(ctx, pipeline, skip_torch=True)):
        impls.extend(pair)
    if "grouped_mm" in ctx.baselines:
        impls.append(("grouped_mm", lambda st: B.grouped_mm_moe_ffn(
            st["x"], st["routing"].topk_ids, st["w"], st["w1"], st["w2"], act), grouped_mm_check(ctx)))
    if "liger" in ctx.baselines:
        impls.append(liger_impl(ctx, act))
    if "loop" in ctx.baselines:
        impls.append(("loop", lambda st: B.loop_moe_ffn(
            st["x"], st["routing"].topk_ids, st["w"], st["w1"], st["w2"], act), None))
    entries = make_entries(
        impls,
        inputs=lambda st: [st["x"], st["w1"], st["w2"], st["w"]],
        out_grad=lambda st: ctx.randn(T, d, salt=T + 32),  # d(out)
        work=lambda st, backward: W.moe_ffn(T, k, st["R"], d, f, n1, st["Ea"], ctx.itemsize, backward=backward),
    )
    return Case("ffn", f"moe_ffn {p.name} T={T} {spec.label}", case_params(ctx, p, T, spec, op="moe_ffn"),
                build, entries)


def liger_impl(ctx: Context, activation: str) -> tuple:
    """Liger-Kernel's fused MoE (:mod:`bench.peers`) on a moe_ffn case's inputs: its weights
    converted to liger's layout once per case (untimed, kept in the state), differentiated with
    respect to those converted leaves, x and the gate weights."""

    def weights(st):
        if "liger_w" not in st:
            st["liger_w"] = PE.liger_weights(st["w1"], st["w2"])
        return st["liger_w"]

    def forward(st):
        if "liger_fn" not in st:  # resolved once (the first, untimed call)
            st["liger_fn"] = PE.require_liger(ctx.device, activation)
        gate_up, down = weights(st)
        return PE.liger_moe_ffn(st["liger_fn"], st["x"], st["routing"].topk_ids, st["w"], gate_up, down)

    def check(backward: bool) -> None:
        PE.require_liger(ctx.device, activation)

    return ("liger", forward, check, lambda st: [st["x"], *weights(st), st["w"]])
