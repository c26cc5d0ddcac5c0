"""The ``gemm`` suite: the grouped-GEMM kernel variants against each other and torch._grouped_mm.

``python -m bench gemm`` (GPU only; in CPU mode the suite plans nothing and says so) times, at the
Mixtral-like (T=16384) and Qwen3-30B-A3B-like (T=32768) presets unless ``--preset`` /
``--tokens`` say otherwise, forward only, in the run's dtype (bf16 by default), on the permuted
rows of one routing draw (uniform unless ``--routing``):

* ``gemm1``: x [R, d] @ w1[e] [d, n1] with the activation (SwiGLU for these presets) fused
  into the epilogue, through the launcher of :mod:`tritonmoe.kernels.grouped_gemm` (``_mm``: the
  public ops only reach it inside ``grouped_ffn``); the ``grouped_mm`` baseline is
  ``torch._grouped_mm`` followed by the activation in PyTorch;
* ``gemm2``: a [R, f] @ w2[e] [f, d] (public ``grouped_gemm``);
* ``ffn``: the whole forward ``grouped_ffn`` (both GEMMs).

Implementations: ``tile``, ``persistent`` and ``wide`` (the persistent kernel with the SwiGLU
GEMM1 in one 2*BN-wide accumulator; for GEMM2 it is the persistent kernel) (the config policy's
configs for these shapes,
with ``TileConfig.variant`` set to each, through ``tritonmoe.kernels.config.override``, so the comparison
does not depend on ``TRITONMOE_GEMM_VARIANT``), and ``grouped_mm``. Each row's ``roof_frac`` is
the fraction of the dense bf16 matmul roof measured at the start of the same run (these GEMMs are
compute-bound: the work is 2*R*K*N FLOPs per GEMM), and ``speedup["grouped_mm"]`` (``x gmm``) its
ratio to torch._grouped_mm; the tile and persistent rows of a case sit side by side. The faster
variant per shape is what the policy's default variant (or a per-shape rule in the policy)
should be set from. On the GPU the first call of each variant compiles and autotunes its
pipeline depth (warm-up, untimed).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from tritonmoe.kernels import config as KC
from tritonmoe.kernels import gemm_kinds as C
from tritonmoe.kernels import grouped_gemm as K

import tritonmoe as tm

from .. import baselines as B
from ..harness import Work
from ..presets import PRESETS, Preset, RoutingSpec
from .common import Case, Entry, active_experts, case_params, ffn_weights, make_routing

#: The presets and token counts of the suite when the run does not choose them (issue 16's
#: Mixtral-like T=16k and Qwen3-30B-A3B-like T=32k targets).
DEFAULT_SHAPES = (("mixtral-8x7b-like", 16384), ("qwen3-30b-a3b-like", 32768))
OPS = ("gemm1", "gemm2", "ffn")
VARIANT_IMPLS = ("tile", "persistent", "wide")


def gemm_work(R: int, K: int, N: int, Ea: int, s: int) -> Work:
    """One grouped GEMM [R, K] @ w[e] [K, N] over Ea active experts: 2*R*K*N FLOPs; reads the rows
    and the active experts' weights, writes [R, N] once."""
    return Work(flops=2.0 * R * K * N, bytes=(R * K + Ea * K * N + R * N) * s)


def policy_configs(variant: str, *, R: int, E: int, d: int, f: int, activation: str, dtype: torch.dtype,
                   device: torch.device) -> dict:
    """The config policy's per-kind configs at this shape with ``variant`` (for
    ``tritonmoe.kernels.config.override("gemm.<kind>", config)``)."""
    tf32 = dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)
    kind1 = {"swiglu": "swiglu", "gelu": "mm_act", "relu": "mm_act"}[activation]
    sel = dict(rows=R, num_experts=E, dtype=dtype, tf32=tf32, device=device)
    return {
        kind1: dataclasses.replace(C.select(kind1, n=f, k=d, **sel), variant=variant),
        "mm": dataclasses.replace(C.select("mm", n=d, k=f, **sel), variant=variant),
    }


def plan_gemm(ctx) -> list:
    """Cases of the suite (see the module docstring); none in CPU mode."""
    if not ctx.is_cuda:
        ctx.log("gemm: skipped in CPU mode (it times the GPU kernels: tile vs persistent vs torch._grouped_mm)")
        return []
    if ctx.presets_chosen:
        shapes = [(p, T) for p in ctx.presets for T in ctx.tokens_for(p)]
    else:
        shapes = [(PRESETS[name], T) for name, T in DEFAULT_SHAPES]
        if ctx.tokens:
            shapes = [(p, T) for p, _ in shapes for T in ctx.tokens]
    cases = []
    for p, T in shapes:
        for spec in ctx.routings_for("gemm"):
            for op in OPS:
                entries = [Entry("fwd", impl, _make(ctx, p, op, impl)) for impl in (*VARIANT_IMPLS, "grouped_mm")]
                cases.append(Case("gemm", f"{op} {p.name} T={T} {spec.label}",
                                  case_params(ctx, p, T, spec, op=op), _builder(ctx, p, T, spec), entries))
    return cases


def _builder(ctx, p: Preset, T: int, spec: RoutingSpec) -> Callable[[], dict]:
    """Inputs of one case: the routing's per-expert row counts, permuted rows x [R, d] and
    a [R, f], the weights (built per case, so each case's memory is freed after it)."""
    def build() -> dict:
        counts_E = make_routing(ctx, T, p, spec, salt=T).counts.long()
        offsets = torch.zeros(p.num_experts + 1, dtype=torch.int64, device=ctx.device)
        offsets[1:] = torch.cumsum(counts_E, 0)
        R = int(offsets[-1])  # setup only
        w1, w2 = ffn_weights(ctx, p, salt=T + 51)
        return dict(x=ctx.randn(R, p.d_model, salt=T + 50), a=ctx.randn(R, p.d_ffn, salt=T + 52), offsets=offsets,
                    offs32=B.grouped_mm_offsets(offsets), w1=w1.detach(), w2=w2.detach(), R=R,
                    Ea=active_experts(counts_E))

    return build


def _make(ctx, p: Preset, op: str, impl: str):
    """Entry.make for one op and implementation: (timed callable, work)."""
    d, f, n1, act = p.d_model, p.d_ffn, p.n1, p.activation
    s = ctx.itemsize

    def make(st):
        x, a, offs, w1, w2, R, Ea = st["x"], st["a"], st["offsets"], st["w1"], st["w2"], st["R"], st["Ea"]
        work = {"gemm1": gemm_work(R, d, n1, Ea, s), "gemm2": gemm_work(R, f, d, Ea, s)}
        work["ffn"] = Work(flops=work["gemm1"].flops + work["gemm2"].flops,
                           bytes=(R * d + Ea * (d * n1 + f * d) + R * d) * s)
        if impl == "grouped_mm":
            B.require_grouped_mm(ctx.device, ctx.dtype, backward=False)
            o32 = st["offs32"]
            fn = {
                "gemm1": lambda: B.activation_fn(torch._grouped_mm(x, w1, offs=o32), act),
                "gemm2": lambda: torch._grouped_mm(a, w2, offs=o32),
                "ffn": lambda: B.grouped_mm_ffn(x, o32, w1, w2, act),
            }[op]
        else:
            cfgs = policy_configs(impl, R=R, E=p.num_experts, d=d, f=f, activation=act, dtype=ctx.dtype,
                                  device=ctx.device)
            out1 = torch.empty(R, f, device=ctx.device, dtype=ctx.dtype)
            kact = K._act(act, 7.0, 1.702)
            inner = {
                # a fresh row space per call: its tile map is built in the call, as in grouped_ffn
                "gemm1": lambda: K._mm(x, K.RowSpace(offs, R, w1.shape[0]), w1, out1, act=kact),
                "gemm2": lambda: tm.grouped_gemm(a, offs, w2, backend="triton"),
                "ffn": lambda: tm.grouped_ffn(x, offs, w1, w2, act, backend="triton"),
            }[op]

            def fn():
                with contextlib.ExitStack() as stack:
                    for kind, cfg in cfgs.items():
                        stack.enter_context(KC.override(f"gemm.{kind}", cfg))
                    return inner()

        def timed():
            with torch.no_grad():
                return fn()

        return timed, work[op]

    return make
