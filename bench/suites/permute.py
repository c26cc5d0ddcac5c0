"""The ``permute`` suite: permute and unpermute, the row movement alone (``move``) and the routing
metadata alone (``metadata``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import tritonmoe as tm
from tritonmoe import reference
from tritonmoe.kernels import config as KC

from .. import work as W
from ..harness import Unavailable, first_line
from ..presets import Preset
from .common import (
    METADATA,
    MOVE,
    Case,
    Context,
    Entry,
    Impl,
    RoutingSpec,
    backend_impls,
    case_params,
    leaf,
    make_entries,
    make_routing,
    no_grad_fn,
    require_backend,
)


def plan_permute(ctx: Context) -> list[Case]:
    cases = []
    for p in ctx.presets:
        for spec in ctx.routings_for("permute"):
            for T in ctx.tokens_for(p):
                cases.append(permute_case(ctx, p, T, spec))
                cases.append(unpermute_case(ctx, p, T, spec))
    return cases


def permute_case(ctx: Context, p: Preset, T: int, spec: RoutingSpec) -> Case:
    E, d, k = p.num_experts, p.d_model, p.top_k
    R = T * k  # dropless routing, pad_to=1

    def build():
        r = make_routing(ctx, T, p, spec, salt=T)
        return dict(x=leaf(ctx.randn(T, d, salt=T + 10)), ids=r.topk_ids,
                    info=reference.permute_metadata(r.topk_ids, E))

    entries = make_entries(
        backend_impls(ctx, lambda st, b: tm.permute(st["x"], st["ids"], E, backend=b)[0]),
        inputs=lambda st: [st["x"]],
        out_grad=lambda st: ctx.randn(R, d, salt=T + 11),  # d(x_perm)
        work=lambda st, backward: W.permute(T, k, d, R, E, ctx.itemsize, backward=backward),
    )
    entries += move_entries(ctx, T, k, d, R)
    entries += metadata_entries(ctx, T, k, E, pad_to=1)
    return Case("permute", f"permute {p.name} T={T} {spec.label}", case_params(ctx, p, T, spec, op="permute"),
                build, entries)


def metadata_impl(ctx: Context, backend: str) -> Callable:
    """``permute_metadata(topk_ids, num_experts, pad_to)`` of a backend: the Triton kernels'
    (``triton``; ``auto`` on CUDA) or the reference's (``torch``; ``auto`` on CPU), as
    :func:`tritonmoe.backends.implementation` chooses for the permute op."""
    require_backend(ctx, backend)
    if backend == "torch" or (backend == "auto" and not ctx.is_cuda):
        return reference.permute_metadata
    try:
        from tritonmoe.kernels.permute import permute_metadata
    except ImportError as exc:  # no triton in this environment
        raise Unavailable(f"tritonmoe.kernels.permute is not importable: {first_line(exc)}") from None
    return permute_metadata


def metadata_entries(ctx: Context, T: int, k: int, E: int, *, pad_to: int) -> list[Entry]:
    """One ``metadata`` entry per backend of the run: ``state["ids"]`` -> PermuteInfo, timed alone."""

    def make(st, b):
        fn = metadata_impl(ctx, b)
        ids = st["ids"]
        return no_grad_fn(lambda: fn(ids, E, pad_to)), W.permute_metadata(T, k, E)

    return [Entry(METADATA, b, lambda st, b=b: make(st, b)) for b in ctx.backends]


def rows_impl(ctx: Context, backend: str) -> Callable:
    """``permute_rows(x, info, num_rows=N)`` of a backend: the Triton scatter (``triton``; ``auto``
    on CUDA) or the reference's gather (``torch``; ``auto`` on CPU)."""
    require_backend(ctx, backend)
    if backend == "torch" or (backend == "auto" and not ctx.is_cuda):
        return reference.permute_rows
    try:
        from tritonmoe.kernels.permute import permute_rows
    except ImportError as exc:  # no triton in this environment
        raise Unavailable(f"tritonmoe.kernels.permute is not importable: {first_line(exc)}") from None
    return lambda x, info, num_rows: permute_rows(x, info, num_rows=num_rows)


def move_entries(ctx: Context, T: int, k: int, d: int, R: int) -> list[Entry]:
    """One ``move`` entry per backend: ``state["x"]`` moved by the precomputed ``state["info"]``
    into R rows (dropless, pad_to=1: R = T * k is known on the host), timed alone."""

    def make(st, b):
        fn = rows_impl(ctx, b)
        x, info = st["x"], st["info"]
        return no_grad_fn(lambda: fn(x, info, R)), W.permute_rows(T, k, d, R, ctx.itemsize)

    return [Entry(MOVE, b, lambda st, b=b: make(st, b)) for b in ctx.backends]


#: The key of :attr:`extra` that :func:`attach_layer_fractions` fills.
LAYER_FRACTION = "layer_fwd_frac"


def attach_layer_fractions(rows: list[dict]) -> list[dict]:
    """Give each measured ``metadata`` row of the permute suite ``extra["layer_fwd_frac"]``: its
    median over the median of the layer suite's ``fwd`` row of the same implementation and the
    same params (preset shape, T, routing, dtype), when the run measured that row. Returns the
    metadata rows that got one. (The permute case draws its own routing from the same
    distribution as the layer's router, so the ids differ but have the same statistics.)"""

    def key(r):
        return r["impl"], tuple(sorted((k, repr(v)) for k, v in r["params"].items() if k != "op"))

    layer = {key(r): r["time_s"]["median"] for r in rows
             if r["suite"] == "layer" and r["mode"] == "fwd" and r["status"] == "ok" and r["time_s"]}
    done = []
    for r in rows:
        if r["suite"] == "permute" and r["mode"] == METADATA and r["status"] == "ok" and r["time_s"]:
            t_layer = layer.get(key(r))
            if t_layer:
                r["extra"][LAYER_FRACTION] = r["time_s"]["median"] / t_layer
                done.append(r)
    return done


def gather_split_impls(ctx: Context, T: int, k: int, d: int, forward: Callable[[dict], torch.Tensor]) -> list[Impl]:
    """An A/B variant of the Triton gather (unpermute's forward) for GPU runs: every program
    takes one d-chunk of a token (``nsplit`` = chunks per row) instead of looping over the row's
    chunks. At Qwen3-30B-A3B-like k=8, d=2048 the default loops over two chunks and the first
    H100 run measured unpermute at 0.52 of the copy roof, against 0.92 at Mixtral's k=2, d=4096
    (one chunk); this entry, "triton-split", measures the alternative in the same run (where few
    tokens already split the row, the two launch the same). Nothing when the row is one chunk,
    or without the Triton backend on CUDA."""
    if "triton" not in ctx.backends or ctx.device.type != "cuda":
        return []
    from tritonmoe.kernels import permute as kp
    block = kp.gather_block_d(k, d, ctx.itemsize)
    chunks = -(-d // block)  # planned without touching the device
    if chunks <= 1:
        return []

    def run(st):
        with KC.override("permute.gather", nsplit=chunks):
            return forward(st)

    return [("triton-split", run, lambda backward: require_backend(ctx, "triton"))]


def unpermute_case(ctx: Context, p: Preset, T: int, spec: RoutingSpec) -> Case:
    E, d, k = p.num_experts, p.d_model, p.top_k
    R = T * k

    def build():
        r = make_routing(ctx, T, p, spec, salt=T)
        _, info = reference.permute(torch.empty(T, 0, device=ctx.device), r.topk_ids, E)  # metadata only
        return dict(y=leaf(ctx.randn(R, d, salt=T + 12)), info=info, w=leaf(r.topk_weights))

    impls = backend_impls(ctx, lambda st, b: tm.unpermute(st["y"], st["info"], st["w"], backend=b))
    impls += gather_split_impls(ctx, T, k, d, lambda st: tm.unpermute(st["y"], st["info"], st["w"], backend="triton"))
    entries = make_entries(
        impls,
        inputs=lambda st: [st["y"], st["w"]],
        out_grad=lambda st: ctx.randn(T, d, salt=T + 13),  # d(out)
        work=lambda st, backward: W.unpermute(T, k, d, R, ctx.itemsize, backward=backward),
    )
    return Case("permute", f"unpermute {p.name} T={T} {spec.label}", case_params(ctx, p, T, spec, op="unpermute"),
                build, entries)


