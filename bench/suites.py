"""The benchmark suites: what is measured, at which shapes, against what.

Every suite measures tritonmoe through its public API (``tritonmoe.route``, ``permute``,
``unpermute``, ``grouped_ffn``, ``moe_ffn`` when present, ``MoELayer``) once per backend asked
for (``triton``: the kernels, ``torch``: the reference path, ``auto``), beside the baselines of
:mod:`bench.baselines` on the same inputs in the same process.

A suite plans a list of :class:`Case` (one problem: shape, token count, routing) whose inputs
are built only when the case runs; each case holds :class:`Entry` items (one mode and one
implementation). ``fwd`` is an inference forward (under ``torch.no_grad()``); ``fwd+bwd`` is a
forward and ``torch.autograd.grad`` of the outputs, with a fixed random output gradient, with
respect to every differentiable input (no gradient accumulation into ``.grad``). Value checks
of the public API are switched off while timing (``tritonmoe.validation(False)``), as a
training loop would. The permute suite's ``metadata`` mode times the routing metadata alone
(ids -> counts, offsets, slot rows; no row moved): ``tritonmoe.kernels.permute.permute_metadata``
for backend ``triton`` against ``tritonmoe.reference.permute_metadata`` for ``torch``. After a
run with the layer suite, :func:`attach_layer_fractions` gives each metadata row the fraction of
the MoELayer forward (same backend, shape, token count and routing) it takes. Its ``move`` mode
times the row movement alone, the metadata precomputed and the row count known:
``tritonmoe.kernels.permute.permute_rows`` (one scatter kernel) against
``tritonmoe.reference.permute_rows``; ``fwd`` of the permute op includes the metadata kernels
and the host sync that reads R, and unpermute's ``fwd`` is movement alone (one gather).

An implementation that cannot run here (``backend="triton"`` for an op without a kernel yet,
``torch._grouped_mm`` missing or not supporting the dtype) is recorded as "unavailable" with
the reason; a failure of any other kind is recorded as "error"; neither stops the run.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import tritonmoe as tm
from tritonmoe import reference

from . import baselines as B
from . import work as W
from .harness import (
    Timer,
    Unavailable,
    Work,
    attach_speedups,
    fill_timing,
    first_line,
    free_memory,
    is_oom,
    new_row,
)
from .presets import PRESETS, Preset, RoutingSpec, parse_routing
from .roofs import dtype_name

MODES = ("fwd", "fwd+bwd")

#: The permute suite's extra mode: the routing metadata alone (no rows moved, no backward).
METADATA = "metadata"
#: The permute suite's row movement alone: the rows of a precomputed permutation moved into a
#: buffer of known size (no metadata kernels, no host sync), what the copy roof bounds.
MOVE = "move"

#: The issue's router grid (GPU default of the route suite when no preset is chosen).
ROUTE_GRID_TOKENS = (4096, 16384, 65536)
ROUTE_GRID_EXPERTS = (8, 64, 128, 256)
ROUTE_GRID_TOPK = (2, 6, 8)


@dataclass
class Context:
    """Everything a suite needs to plan and run its cases."""

    device: torch.device
    dtype: torch.dtype
    presets: list[Preset]
    presets_chosen: bool = False
    tokens: tuple[int, ...] | None = None
    routings: list[RoutingSpec] | None = None
    backends: tuple[str, ...] = ("torch",)
    baselines: tuple[str, ...] = ("loop", "grouped_mm")
    seed: int = 0
    timer: Timer | None = None
    roofs: dict = field(default_factory=dict)
    log: Callable[[str], None] = print
    ep_world_sizes: tuple[int, ...] = (2, 4)
    ep_degrees: tuple[int, ...] = (1, 2, 4, 8)
    ep_timeout_s: float = 60.0

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def tokens_for(self, preset: Preset) -> tuple[int, ...]:
        return self.tokens or preset.tokens(self.device)

    def routings_for(self, suite: str) -> list[RoutingSpec]:
        if self.routings:
            return list(self.routings)
        if suite == "ffn" and self.is_cuda:
            return [parse_routing("uniform"), parse_routing("zipf:1.2")]
        return [parse_routing("uniform")]

    def generator(self, salt: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + salt)

    def randn(self, *shape, salt: int, dtype: torch.dtype | None = None, scale: float = 1.0) -> torch.Tensor:
        # Drawn in the target dtype: an fp32 draw of DeepSeek-like weights would take 30 GB more.
        t = torch.randn(*shape, generator=self.generator(salt), device=self.device, dtype=dtype or self.dtype)
        if scale != 1.0:
            t.mul_(scale)
        return t


@dataclass
class Entry:
    """One implementation in one mode; ``make(state)`` returns the timed callable and its work.
    ``make`` may raise :class:`Unavailable`."""

    mode: str
    impl: str
    make: Callable[[Any], tuple[Callable[[], Any], Work]]


@dataclass
class Case:
    suite: str
    label: str
    params: dict
    build: Callable[[], Any]
    entries: list[Entry]


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def require_backend(ctx: Context, backend: str) -> None:
    """Triton on CPU tensors runs in Triton's interpreter: only when it was switched on before
    tritonmoe was imported, and it is no performance path; say so instead of failing."""
    if backend == "triton" and not ctx.is_cuda:
        from tritonmoe import _settings

        if not _settings.TRITON_INTERPRET:
            raise Unavailable("backend='triton' on CPU needs TRITON_INTERPRET=1 set before import (interpreter)")


#: One implementation of a case: (impl name, forward(state) -> output, check(backward) or None).
#: ``check`` raises :class:`Unavailable` when the implementation cannot run here.
Impl = tuple[str, Callable[[dict], torch.Tensor], Callable[[bool], None] | None]


def make_entries(
    impls: list[Impl],
    *,
    inputs: Callable[[dict], list[torch.Tensor]],
    out_grad: Callable[[dict], torch.Tensor],
    work: Callable[[dict, bool], Work],
) -> list[Entry]:
    """Every implementation in both modes, forward-only entries first.

    ``fwd`` runs ``forward(state)`` under ``torch.no_grad()``. ``fwd+bwd`` runs it and
    ``torch.autograd.grad`` of the output for ``inputs(state)`` (the differentiable leaves, the
    same tensors in both modes); the output gradient is drawn by ``out_grad(state)`` on the first
    backward entry, so forward-only entries do not count it in their peak memory.
    """
    entries = []
    for mode in MODES:
        backward = mode != "fwd"
        for impl, forward, check in impls:

            def make(st, forward=forward, check=check, backward=backward):
                if check is not None:
                    check(backward)
                if not backward:
                    return no_grad_fn(lambda: forward(st)), work(st, False)
                if "grad_out" not in st:
                    st["grad_out"] = out_grad(st)
                return grad_fn(lambda: forward(st), inputs(st), st["grad_out"]), work(st, True)

            entries.append(Entry(mode, impl, make))
    return entries


def backend_impls(ctx: Context, forward_of: Callable[[dict, str], torch.Tensor], *, skip_torch: bool = False,
                  suffix: str = "") -> list[Impl]:
    """One Impl per tritonmoe backend of the run (``forward_of(state, backend)``), named after
    the backend (plus ``suffix``)."""
    return [
        (b + suffix, lambda st, b=b: forward_of(st, b), lambda backward, b=b: require_backend(ctx, b))
        for b in ctx.backends
        if not (skip_torch and b == "torch")
    ]


def grouped_mm_check(ctx: Context) -> Callable[[bool], None]:
    return lambda backward: B.require_grouped_mm(ctx.device, ctx.dtype, backward=backward)


def grad_fn(forward: Callable[[], Any], inputs: list[torch.Tensor], grad_out: torch.Tensor) -> Callable[[], Any]:
    """forward, then d(output)/d(inputs) for a fixed output gradient."""

    def fn():
        out = forward()
        return torch.autograd.grad(out, inputs, grad_out)

    return fn


def no_grad_fn(forward: Callable[[], Any]) -> Callable[[], Any]:
    def fn():
        with torch.no_grad():
            return forward()

    return fn


def leaf(t: torch.Tensor) -> torch.Tensor:
    """An input of the benchmark: a leaf that requires grad (ignored under no_grad)."""
    return t.detach().requires_grad_(True)


def make_routing(ctx: Context, T: int, preset: Preset, spec: RoutingSpec, *, salt: int):
    """The reference router's decision for logits drawn from the routing distribution."""
    logits = spec.logits(T, preset.num_experts, seed=ctx.seed * 7919 + salt, device=ctx.device, dtype=torch.float32)
    bias = None
    if preset.expert_bias:
        bias = ctx.randn(preset.num_experts, salt=salt + 1, dtype=torch.float32, scale=0.01)
    return reference.route(logits, preset.top_k, expert_bias=bias, **preset.route_kwargs())


def active_experts(counts: torch.Tensor) -> int:
    return int((counts > 0).sum())  # setup only (not timed): the work accounting needs the count


def ffn_weights(ctx: Context, preset: Preset, *, salt: int):
    """w1 [E, d, n1] and w2 [E, f, d], scaled like an nn.Linear init, requiring grad."""
    E, d, f, n1 = preset.num_experts, preset.d_model, preset.d_ffn, preset.n1
    w1_EDN = leaf(ctx.randn(E, d, n1, salt=salt, scale=d**-0.5))
    w2_EFD = leaf(ctx.randn(E, f, d, salt=salt + 1, scale=f**-0.5))
    return w1_EDN, w2_EFD


def case_params(ctx: Context, preset: Preset | None, T: int, spec: RoutingSpec | None, **more) -> dict:
    p = preset.params() if preset is not None else {}
    p.update(T=T, routing=spec.label if spec is not None else None, dtype=ctx.dtype_name)
    p.update(more)
    return p


# ---------------------------------------------------------------------------------------------
# route
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteShape:
    E: int
    k: int
    score_func: str = "softmax"
    expert_bias: bool = False
    n_groups: int | None = None
    topk_groups: int | None = None
    preset: str | None = None

    @property
    def label(self) -> str:
        if self.preset:
            return self.preset
        s = f"E={self.E} k={self.k} {self.score_func}"
        if self.expert_bias:
            s += "+bias"
        if self.n_groups:
            s += f" groups={self.n_groups}/{self.topk_groups}"
        return s

    def kwargs(self) -> dict:
        return dict(score_func=self.score_func, n_groups=self.n_groups, topk_groups=self.topk_groups)


def _deepseek_route(E: int = 256, k: int = 8) -> RouteShape:
    return RouteShape(E, k, "sigmoid", True, 8, 4)


def route_shapes(ctx: Context) -> list[tuple[RouteShape, tuple[int, ...]]]:
    """The presets' routers when presets were chosen; else on GPU the issue's grid (T x E x k plus
    DeepSeek-V3-like sigmoid + bias + 8 groups / 4 kept), on CPU three small routers."""
    if ctx.presets_chosen:
        return [
            (
                RouteShape(p.num_experts, p.top_k, p.score_func, p.expert_bias, p.n_groups, p.topk_groups, p.name),
                ctx.tokens_for(p),
            )
            for p in ctx.presets
        ]
    if ctx.is_cuda:
        grid = [RouteShape(E, k) for E in ROUTE_GRID_EXPERTS for k in ROUTE_GRID_TOPK if k <= E]
        grid.append(_deepseek_route())
        return [(s, ctx.tokens or ROUTE_GRID_TOKENS) for s in grid]
    small = PRESETS["small"]
    shapes = [RouteShape(small.num_experts, small.top_k), RouteShape(64, 6), _deepseek_route(64, 8)]
    return [(s, ctx.tokens or small.tokens_cpu) for s in shapes]


def plan_route(ctx: Context) -> list[Case]:
    return [
        route_case(ctx, shape, T, spec)
        for shape, tokens in route_shapes(ctx)
        for spec in ctx.routings_for("route")
        for T in tokens
    ]


def route_case(ctx: Context, shape: RouteShape, T: int, spec: RoutingSpec) -> Case:
    E, k = shape.E, shape.k
    salt = (E * 131 + k * 17 + T) & 0xFFFF

    def build():
        logits_TE = spec.logits(T, E, seed=ctx.seed * 7919 + salt, device=ctx.device, dtype=ctx.dtype)
        bias_E = ctx.randn(E, salt=salt + 1, dtype=torch.float32, scale=0.01) if shape.expert_bias else None
        return dict(logits=leaf(logits_TE), bias=bias_E)

    def forward_of(st, b):
        return tm.route(st["logits"], k, expert_bias=st["bias"], backend=b, **shape.kwargs()).topk_weights

    entries = make_entries(
        backend_impls(ctx, forward_of),
        inputs=lambda st: [st["logits"]],
        out_grad=lambda st: ctx.randn(T, k, salt=salt + 2, dtype=torch.float32),  # d(topk_weights)
        work=lambda st, backward: W.route(T, E, k, ctx.itemsize, backward=backward),
    )
    params = dict(
        preset=shape.preset, E=E, k=k, score_func=shape.score_func, expert_bias=shape.expert_bias,
        n_groups=shape.n_groups, topk_groups=shape.topk_groups, T=T, routing=spec.label, dtype=ctx.dtype_name,
    )
    return Case("route", f"{shape.label} T={T} {spec.label}", params, build, entries)


# ---------------------------------------------------------------------------------------------
# permute / unpermute
# ---------------------------------------------------------------------------------------------


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
    :func:`tritonmoe.dispatch.implementation` chooses for the permute op."""
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
    from tritonmoe.kernels._host import cdiv

    chunks = cdiv(d, kp.gather_block_d(k, d, ctx.itemsize))  # planned without touching the device
    if chunks <= 1:
        return []

    def run(st):
        with kp.config_override(gather={"nsplit": chunks}):
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


# ---------------------------------------------------------------------------------------------
# ffn: grouped_ffn over a permuted buffer, and the routed FFN x -> out (moe_ffn)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# layer
# ---------------------------------------------------------------------------------------------


def plan_layer(ctx: Context) -> list[Case]:
    return [
        layer_case(ctx, p, T, spec)
        for p in ctx.presets
        for spec in ctx.routings_for("layer")
        for T in ctx.tokens_for(p)
    ]


def skew_router(layer: "tm.MoELayer", x_TD: torch.Tensor, spec: RoutingSpec) -> None:
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


# ---------------------------------------------------------------------------------------------
# Running cases
# ---------------------------------------------------------------------------------------------


def run_case(ctx: Context, case: Case, progress=None) -> list[dict]:
    """Build the case's inputs once, measure each entry, attach speedups per mode."""
    rows: list[dict] = []
    state = None
    build_error: str | None = None
    try:
        with tm.validation(False):
            state = case.build()
    except Exception as exc:  # e.g. out of memory for the inputs: every entry records it
        build_error = ("out of memory building the inputs: " if is_oom(exc) else "building the inputs: ") + first_line(exc)
    for e in case.entries:
        if progress is not None:
            progress.step(f"{case.suite} {case.label} {e.mode} {e.impl}")
        row = new_row(suite=case.suite, case=case.label, mode=e.mode, impl=e.impl, params=case.params)
        if build_error is not None:
            row["status"], row["note"] = "error", build_error
        else:
            _run_entry(ctx, e, state, row)
        rows.append(row)
    del state
    free_memory()
    for mode in {r["mode"] for r in rows}:
        attach_speedups([r for r in rows if r["mode"] == mode])
    return rows


def _run_entry(ctx: Context, e: Entry, state, row: dict) -> None:
    """Measure one entry into its row. Tensors of a finished entry go by reference counting
    (a full garbage collection takes tens of ms, so it runs once per case, and after a failure,
    whose traceback may hold the failed call's tensors)."""
    try:
        with tm.validation(False):
            fn, work = e.make(state)
            m = ctx.timer.measure(fn)
        del fn
    except (Unavailable, NotImplementedError) as exc:
        row["status"], row["note"] = "unavailable", _one_line(exc)
        return
    except Exception as exc:  # any failure is recorded on its row; the run goes on
        row["status"] = "error"
        row["note"] = ("out of memory: " if is_oom(exc) else "") + first_line(exc)
    if row["status"] == "error":
        free_memory()  # outside the except block, whose traceback holds the failed call's frames
        return
    fill_timing(row, m.times_s, work, ctx.roofs)
    mem = row["memory"]
    mem["peak_bytes"], mem["peak_extra_bytes"] = m.peak_bytes, m.peak_extra_bytes
    if m.peak_bytes is not None and mem["analytic_min_bytes"]:
        mem["ratio"] = m.peak_bytes / mem["analytic_min_bytes"]
    row["telemetry"] = m.telemetry


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# ep: expert parallelism over torch.distributed (bench/ep.py, from the expert-parallel issue)
# ---------------------------------------------------------------------------------------------


def load_ep():
    """bench.ep, imported when the ep suite runs; raises ImportError while it does not exist."""
    return importlib.import_module("bench.ep")


def ep_cases(ctx: Context) -> tuple[list[tuple[Preset, int]], torch.dtype, str]:
    """The (preset, tokens per rank) runs of the ep suite, their dtype, and where they run.

    With a GPU per rank, ranks run on NCCL at the run's presets and dtype. Otherwise ranks are
    CPU processes over gloo, in fp32, at the small preset unless presets were chosen (a model
    preset's expert FFN on CPU would take minutes per call). Each token count spawns every
    world size's processes again, so without --tokens only the preset's largest count runs.
    """
    gpus = torch.cuda.device_count() if ctx.is_cuda else 0
    if gpus >= max(ctx.ep_world_sizes):
        presets, dev, dtype, where = ctx.presets, ctx.device, ctx.dtype, f"NCCL on {gpus} GPUs"
    else:
        presets = ctx.presets if ctx.presets_chosen else [PRESETS["small"]]
        dev, dtype, where = torch.device("cpu"), torch.float32, "gloo on CPU processes"
    runs = [(p, T) for p in presets for T in (ctx.tokens or (max(p.tokens(dev)),))]
    return runs, dtype, where


def run_ep_suite(ctx: Context, progress=None) -> list[dict]:
    """Run ``bench.ep.run_ep`` for each preset and token count and turn its dicts into rows."""
    try:
        ep = load_ep()
    except ImportError as exc:
        note = f"bench/ep.py (the expert-parallel issue) is not importable: {first_line(exc)}"
        ctx.log(f"ep: unavailable ({note})")
        row = new_row(suite="ep", case="expert parallelism", mode="fwd+bwd", impl="ep", params={})
        row["status"], row["note"] = "unavailable", note
        return [row]
    runs, dtype, where = ep_cases(ctx)
    ctx.log(f"ep: world sizes {','.join(map(str, ctx.ep_world_sizes))}, pipeline degrees "
            f"{','.join(map(str, ctx.ep_degrees))}, {where}")
    rows: list[dict] = []
    for p, T in runs:
        if progress is not None:
            progress.step(f"ep {p.name} T/rank={T}")
        try:
            results = ep.run_ep(
                world_sizes=tuple(ctx.ep_world_sizes), degrees=tuple(ctx.ep_degrees), tokens=T,
                d_model=p.d_model, d_ffn=p.d_ffn, num_experts=p.num_experts, top_k=p.top_k, dtype=dtype,
                reps=ctx.timer.reps, warmup=ctx.timer.warmup, timeout_s=ctx.ep_timeout_s,
            )
        except Exception as exc:  # a failed spawn, a timeout: one error row, the run goes on
            row = new_row(suite="ep", case=f"{p.name} T/rank={T}", mode="fwd+bwd", impl="ep",
                          params=dict(preset=p.name, T=T))
            row["status"], row["note"] = "error", first_line(exc)
            rows.append(row)
            continue
        rows.extend(ep_rows(results, preset=p.name))
    return rows


def _ep_row(d: dict, preset: str | None, mode: str, impl: str, times, work: Work, extra: dict) -> dict:
    ws, n = d.get("world_size"), d.get("pipeline_degree")
    params = {
        "preset": preset,
        "world_size": ws,
        "pipeline_degree": n,
        "T": d.get("tokens_per_rank"),
        "d": d.get("d_model"),
        "f": d.get("d_ffn"),
        "E": d.get("num_experts"),
        "k": d.get("top_k"),
        "dtype": str(d.get("dtype")).replace("torch.", ""),
    }
    case = f"{d.get('name', preset)} P={ws} n={n} T/rank={params['T']}"
    row = new_row(suite="ep", case=case, mode=mode, impl=impl, params=params)
    row["extra"] = {k: v for k, v in extra.items() if v is not None}
    times = [float(t) for t in (times or [])]
    if not times:
        row["status"], row["note"] = "error", f"run_ep returned no {mode} times"
        return row
    fill_timing(row, times, work, None)
    return row


def ep_rows(results: list[dict], preset: str | None = None) -> list[dict]:
    """Rows from ``run_ep`` dicts: the layer's forward+backward per (world size, pipeline
    degree) with its pipelining efficiency, partition overhead and speedup over degree 1, and
    the dispatch and combine all-to-alls with bytes/s (algbw and busbw per nccl-tests)."""
    rows = []
    for d in results:
        nbytes = d.get("dispatch_bytes")
        layer = _ep_row(d, preset, "fwd+bwd", "ep-layer", d.get("layer_fwd_bwd_s"), Work(), {
            "pipeline_efficiency": d.get("pipeline_efficiency"),
            "partition_overhead_frac": d.get("partition_overhead_frac"),
        })
        rows.append(layer)
        comm = {"algbw_GBps": d.get("algbw_GBps"), "busbw_GBps": d.get("busbw_GBps")}
        rows.append(_ep_row(d, preset, "dispatch", "all-to-all", d.get("dispatch_s"), Work(bytes=nbytes), comm))
        rows.append(_ep_row(d, preset, "combine", "all-to-all", d.get("combine_s"), Work(bytes=nbytes), comm))
    # Speedup of pipelining: the degree-1 layer time over each degree's, per world size and case.
    base = {}
    for r in rows:
        if r["impl"] == "ep-layer" and r["status"] == "ok" and r["params"]["pipeline_degree"] == 1:
            base[_ep_key(r)] = r["time_s"]["median"]
    for r in rows:
        if r["impl"] == "ep-layer" and r["status"] == "ok" and _ep_key(r) in base:
            r["extra"]["speedup_vs_degree1"] = base[_ep_key(r)] / r["time_s"]["median"]
    return rows


def _run_plan_suite(ctx: Context, progress=None) -> list[dict]:
    from .plan_fidelity import run_plan_suite

    return run_plan_suite(ctx, progress)


def _ep_key(r: dict):
    p = r["params"]
    return (p["preset"], p["world_size"], p["T"], p["d"], p["f"], p["E"], p["k"], p["dtype"])


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------


def describe_ep(ctx: Context) -> list[str]:
    """The ep suite's runs, one line each (``--list`` and the progress count)."""
    runs, dt, where = ep_cases(ctx)
    return [f"{pr.name} T/rank={T} world sizes {ctx.ep_world_sizes} degrees {ctx.ep_degrees} "
            f"[bench.ep.run_ep, {dtype_name(dt)}, {where}]" for pr, T in runs]


def describe_lina(ctx: Context) -> list[str]:
    from . import lina

    d = lina.DEFAULTS
    return [f"P=2 a2a {d['a2a_mb']:g} MB vs {d['grad_mb']:g} MB gradient, training step; fifo, lina {d['chunk_mb']} MB "
            "[bench.lina.run_lina, float32, gloo on CPU processes]"]


def run_lina_suite(ctx: Context, progress=None) -> list[dict]:
    """``bench.lina.run_lina`` (2 gloo ranks on CPU): the all-to-all alone and beside a gradient
    reduction (FIFO, Lina), and training steps with each; rows per variant."""
    from . import lina

    if progress is not None:
        progress.step("lina P=2")
    reps = max(ctx.timer.reps // 2, 5) if ctx.timer is not None else lina.DEFAULTS["reps"]
    try:
        results = lina.run_lina(world_size=2, reps=reps, a2a_reps=max(ctx.timer.reps if ctx.timer else 0, 20),
                                timeout_s=max(ctx.ep_timeout_s, 120.0))
    except Exception as exc:  # a failed spawn, a timeout: one error row, the run goes on
        row = new_row(suite="lina", case="P=2", mode="a2a", impl="lina", params={})
        row["status"], row["note"] = "error", first_line(exc)
        return [row]
    rows = []
    for d in results:
        params = {k: d.get(k) for k in ("world_size", "chunk_bytes", "a2a_bytes", "grad_bytes", "tokens", "d_model",
                                        "d_ffn", "num_experts", "top_k", "blocks") if d.get(k) is not None}
        params["dtype"] = "float32"
        a2a = d["bench"] == "a2a"
        row = new_row(suite="lina", case=f"P={d['world_size']} {'a2a beside a gradient reduction' if a2a else 'training step'}",
                      mode="a2a" if a2a else "fwd+bwd", impl=d["variant"], params=params)
        fill_timing(row, d["a2a_s"] if a2a else d["step_s"], Work(bytes=d["a2a_bytes"]) if a2a else Work(), None)
        row["extra"] = {k: d[k] for k in ("a2a_slowdown_median", "a2a_slowdown_p90", "a2a_overlap_frac",
                                          "step_speedup_vs_fifo", "grad_micro_ops") if d.get(k) is not None}
        rows.append(row)
    return rows


def describe_memory(ctx: Context) -> list[str]:
    from . import memory

    d = memory.DEFAULTS
    return [f"P=2 T/rank={d['tokens']} d={d['d_model']} f={d['d_ffn']} E={d['num_experts']} k={d['top_k']} "
            f"{d['activation']}, n in {d['degrees']}, strategies {', '.join(d['strategies'])} "
            f"with MI buffers {', '.join(str(m) for m in d['mi_buffers'])} (two from n = 3: impl +mi2) "
            "[bench.memory.run_memory, float32, gloo on CPU processes]"]


def run_memory_suite(ctx: Context, progress=None) -> list[dict]:
    """``bench.memory.run_memory`` (2 gloo ranks on CPU): per (degree, memory strategy), forward +
    backward time and the expert block's saved bytes (counted with saved_tensors_hooks) against
    "keep"."""
    from . import memory

    if progress is not None:
        progress.step("memory P=2")
    reps = max(ctx.timer.reps // 2, 3) if ctx.timer is not None else memory.DEFAULTS["reps"]
    try:
        results = memory.run_memory(world_size=2, reps=reps, timeout_s=max(ctx.ep_timeout_s, 180.0))
    except Exception as exc:  # a failed spawn, a timeout: one error row, the run goes on
        row = new_row(suite="memory", case="P=2", mode="fwd+bwd", impl="keep", params={})
        row["status"], row["note"] = "error", first_line(exc)
        return [row]
    rows = []
    for d in results:
        params = {k: d[k] for k in ("world_size", "tokens", "d_model", "d_ffn", "num_experts", "top_k", "activation",
                                    "dtype")}
        params["pipeline_degree"] = d["n"]
        params["memory_mi_buffers"] = d["mi_buffers"]
        impl = d["strategy"] if d["mi_buffers"] == 1 else f"{d['strategy']}+mi{d['mi_buffers']}"
        row = new_row(suite="memory", case=f"P={d['world_size']} n={d['n']}", mode="fwd+bwd", impl=impl,
                      params=params)
        fill_timing(row, d["step_s"], Work(), None)
        row["extra"] = {k: d.get(k) for k in ("saved_bytes", "model_bytes", "host_bytes", "model_host_bytes",
                                              "time_vs_keep", "saved_vs_keep", "copy_s", "copy_hidden_frac")}
        rows.append(row)
    return rows


def describe_inference(ctx: Context) -> list[str]:
    return ["balance (E=16, P=16 and 4, Zipf max/min 5.56), estimation (correlated/uncorrelated stacks), offload "
            "(host, disk), latency in the simulator (16 GPUs) and on gloo (4 ranks), device expert bytes per rank and "
            "re-plan loads (gloo) [bench.inference.run_inference]"]


def _inference_extra(d: dict) -> dict:
    """The figures of one bench.inference dict, flat, for the row's note."""
    f = d["figure"]
    if f == "balance":
        m = d["max_over_mean"]
        out = {"max/mean": m["mean"], "max/mean_p95": m["p95"]}
        if d.get("replan_rate") is not None:
            out["replan_rate"] = d["replan_rate"]
        return out
    if f == "serving-memory":
        held = d["device_expert_bytes_per_rank"]
        return {"device_expert_bytes_max": max(held), "device_expert_bytes_min": min(held),
                "all_resident_bytes": d["all_resident_bytes"], "max_fraction_of_all": d["max_fraction_of_all"]}
    if f == "replan-load":
        if "bytes_per_forward" in d:
            return {"loads_per_forward_max": max(d["loads_per_forward"]), "bytes_per_forward_max": max(d["bytes_per_forward"]),
                    "seconds_per_forward_max": max(d["seconds_per_forward"]), "forward_p50_s": d["forward_p50_s"]}
        return {"max_bytes": d["max_bytes"], "all_resident_bytes": d["all_resident_bytes"],
                "seconds_median": d["seconds_median"], "seconds_max": d["seconds_max"]}
    keys = {"two-phase": ("replan_rate", "phase1_max_over_mean"),
            "latency-gloo": ("p50_s", "p95_s", "p50_speedup_vs_contiguous", "p95_speedup_vs_contiguous",
                             "max_rows_per_rank_mean"),
            "latency-sim": ("p50_s", "p95_s", "p50_speedup_vs_contiguous", "p95_speedup_vs_contiguous"),
            "estimation": ("l1_conditional", "l1_unconditional", "top2_accuracy_conditional",
                           "top2_accuracy_unconditional"),
            "offload": ("slowdown_vs_resident", "overlap_fraction", "resident_expert_bytes", "all_layers_bytes",
                        "disk_reads", "equal_to_resident")}.get(f, ())
    return {k: d[k] for k in keys if d.get(k) is not None}


def run_inference_suite(ctx: Context, progress=None) -> list[dict]:
    """``bench.inference.run_inference``: one row per figure (latency rows carry the times)."""
    from . import inference

    if progress is not None:
        progress.step("inference")
    rows = []
    for d in inference.run_inference(timeout_s=max(ctx.ep_timeout_s, 300.0)):
        f = d["figure"]
        case = {"balance": "P={world_size} {placement}", "two-phase": "P={world_size} m={path_length}", "latency-gloo": "gloo P={world_size} {placement}",
                "latency-sim": "sim P={world_size} {placement}", "estimation": "{stack}",
                "offload": "{tier}", "serving-memory": "memory P={world_size} {placement}",
                "replan-load": "replan P={world_size} {change}"}.get(f, "{figure}")
        try:
            case = case.format(**d)
        except KeyError:
            case = f
        row = new_row(suite="inference", case=case, mode=f, impl=str(d.get("placement") or d.get("tier") or ("replan" if f == "replan-load" else "lina")),
                      params={k: v for k, v in d.items() if isinstance(v, (int, float, str)) and k in (
                          "world_size", "experts", "tokens", "tokens_per_rank", "d_model", "d_ffn", "layers", "slots")})
        if "error" in d:
            row["status"], row["note"] = "error", d["error"]
        elif d.get("times_s"):
            fill_timing(row, d["times_s"], Work(), None)
        elif "forward_s" in d:
            fill_timing(row, [d["forward_s"]], Work(), None)
        row["extra"] = _inference_extra(d)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Suite:
    """A suite either plans cases (run entry by entry by :func:`run_case`) or runs itself
    (``run(ctx, progress) -> rows``, for suites whose ranks are separate processes; ``describe``
    lists its runs). ``default``: part of the run when no suite is named."""

    name: str
    about: str
    plan: Callable[[Context], list[Case]] | None = None
    run: Callable[..., list[dict]] | None = None
    describe: Callable[[Context], list[str]] | None = None
    default: bool = True  # part of `python -m bench` without suite names


SUITES: dict[str, Suite] = {
    s.name: s
    for s in [
        Suite("route", "router: scores, (grouped) top-k, weights, counts; forward and forward+backward", plan=plan_route),
        Suite("permute", "token permutation and weighted unpermutation; forward and forward+backward; the "
              "row movement alone (mode move) and the routing metadata alone (mode metadata)", plan=plan_permute),
        Suite("ffn", "grouped expert FFN over a permuted buffer (grouped_ffn); with a non-reference backend also "
              "the routed FFN x -> out (fused moe_ffn vs permute + grouped_ffn + unpermute)", plan=plan_ffn),
        Suite("layer", "MoELayer forward (inference) and forward+backward", plan=plan_layer),
        Suite("gemm", "grouped-GEMM kernel variants (tile, persistent TMA) vs torch._grouped_mm, forward; GPU only",
              plan=lambda ctx: importlib.import_module("bench.gemm_variants").plan_gemm(ctx)),
        Suite("fp8", "FP8 experts (e4m3 block-128 / rowwise) vs our bf16 kernels and torch._scaled_grouped_mm: "
              "moe_ffn and grouped_ffn forward, speed and accuracy; GPU only, not default",
              run=lambda ctx, progress=None: importlib.import_module("bench.fp8").run_fp8_suite(ctx, progress),
              default=False),
        Suite("ep", "expert parallelism over torch.distributed (gloo on CPU): dispatch/combine all-to-all "
              "and the layer per world size and pipeline degree", run=run_ep_suite, describe=describe_ep),
        Suite("parm", "Parm's schedules of an MP+EP+ESP layer over gloo, and the pick of parm_schedule='auto'", run=lambda ctx, progress=None: importlib.import_module("bench.parm").run_parm_suite(ctx, progress), default=False),
        Suite("plan", "simulator fidelity: a cost model fitted here vs the measured expert-parallel layer (gloo, "
              "2 and 4 ranks, degrees 1-8), and the planner's choice (bench/plan_fidelity.py; ~10 min, not default)",
              run=_run_plan_suite, default=False),
        Suite("memory", "MPMoE's memory strategies on the expert-parallel layer over gloo (2 ranks): fwd+bwd time "
              "and saved bytes (saved_tensors_hooks) per strategy vs 'keep'; not default", run=run_memory_suite,
              describe=describe_memory, default=False),
        Suite("lina", "Lina's priority communication vs FIFO over gloo (2 ranks): an all-to-all beside a gradient "
              "reduction, and training steps (all-to-all slowdown, step time); not default", run=run_lina_suite,
              describe=describe_lina, default=False),
        Suite("inference", "Lina's replicate-and-pack placement vs EPLB and the contiguous layout (balance, latency on "
              "gloo and in the simulator), popularity estimation, ring-memory offloading (host, disk); not default",
              run=run_inference_suite, describe=describe_inference, default=False),
    ]
}

SUITE_ORDER = tuple(SUITES)


def plan(ctx: Context, suite: str) -> list[Case]:
    s = SUITES[suite]
    return s.plan(ctx) if s.plan is not None else []


def run_suite(
    ctx: Context,
    suite: str,
    cases: list[Case] | None = None,
    progress=None,
    *,
    sink: list[dict] | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> list[dict]:
    """Run a suite's cases (planned now unless given). Rows are appended to ``sink`` case by case
    and ``checkpoint()`` is called after each case, so an interrupted run keeps what it measured;
    the suite's rows are also returned."""
    rows: list[dict] = [] if sink is None else sink
    first = len(rows)
    s = SUITES[suite]
    if s.run is not None:
        rows.extend(s.run(ctx, progress))
    else:
        for case in cases if cases is not None else plan(ctx, suite):
            rows.extend(run_case(ctx, case, progress))
            if checkpoint is not None:
                checkpoint()
    return rows[first:]


def count_entries(cases: list[Case]) -> int:
    return sum(len(c.entries) for c in cases)


__all__ = [
    "Case",
    "Context",
    "Entry",
    "SUITES",
    "SUITE_ORDER",
    "attach_layer_fractions",
    "ep_rows",
    "plan",
    "run_case",
    "run_suite",
]
