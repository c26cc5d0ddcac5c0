"""What every suite shares: the run context, entries and cases, and the helpers that build them
(see :mod:`bench.suites` for what the suites measure)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import tritonmoe as tm
from tritonmoe import reference

from .. import baselines as B
from ..harness import Timer, Unavailable, Work
from ..presets import Preset, RoutingSpec, parse_routing

MODES = ("fwd", "fwd+bwd")

#: The permute suite's extra mode: the routing metadata alone (no rows moved, no backward).
METADATA = "metadata"
#: The permute suite's row movement alone: the rows of a precomputed permutation moved into a
#: buffer of known size (no metadata kernels, no host sync), what the copy roof bounds.
MOVE = "move"



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
    #: The interleaved-rounds timer (bench.timing.DeviceTimer) of ``python -m bench check``; None:
    #: the classic per-entry ``timer``.
    rounds: Any = None
    #: Roof pseudo-implementations joining every comparison's rounds (bench.suites.runner.prepare_roofs).
    roof_preps: dict = field(default_factory=dict)
    #: SMs and peak dense FLOP per clock per SM of the device, for per-clock efficiency (None: not reported).
    sms: int | None = None
    flop_per_clock: float | None = None

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
        if not tm.interpreter_enabled():
            raise Unavailable("backend='triton' on CPU needs TRITON_INTERPRET=1 set before import (interpreter)")


#: One implementation of a case: (impl name, forward(state) -> output, check(backward) or None).
#: ``check`` raises :class:`Unavailable` when the implementation cannot run here.
#: An optional fourth element ``own_inputs(state)`` names the leaves its backward differentiates
#: (see :func:`make_entries`).
Impl = tuple  # (str, Callable[[dict], Tensor], Callable[[bool], None] | None[, Callable[[dict], list[Tensor]]])


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
    backward entry, so forward-only entries do not count it in their peak memory. An Impl with a
    fourth element ``own_inputs(state)`` differentiates with respect to those leaves instead (a
    peer that holds the weights in its own layout: the same inputs, converted once).
    """
    entries = []
    for mode in MODES:
        backward = mode != "fwd"
        for impl, forward, check, *own in impls:
            leaves = own[0] if own else inputs

            def make(st, forward=forward, check=check, backward=backward, leaves=leaves):
                if check is not None:
                    check(backward)
                if not backward:
                    return no_grad_fn(lambda: forward(st)), work(st, False)
                if "grad_out" not in st:
                    st["grad_out"] = out_grad(st)
                return grad_fn(lambda: forward(st), leaves(st), st["grad_out"]), work(st, True)

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


