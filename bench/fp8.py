"""The ``fp8`` suite: FP8 (e4m3) experts against our bf16 kernels and torch._scaled_grouped_mm,
speed and accuracy.

``python -m bench fp8`` (GPU only; in CPU mode the suite plans nothing and says so) runs, forward
only, at the Mixtral-like (T=16384) and Qwen3-30B-A3B-like (T=32768) presets and at decode size
(T=64) on both (``--preset`` / ``--tokens`` override), one routing draw (uniform unless
``--routing``):

* ``moe_ffn`` (routing in, combined output out): ``bf16`` = ``tm.moe_ffn`` on the run's dtype
  and the original weights (the kernels we have), ``fp8_block128`` / ``fp8_rowwise`` =
  ``tm.fp8_moe_ffn`` on the weights quantized by ``tm.quantize_experts`` (activation
  quantization included in the time);
* ``grouped_ffn`` (a permuted buffer in, expert outputs out): ``bf16`` = ``tm.grouped_ffn``,
  ``fp8_*`` = ``tm.fp8.fp8_grouped_ffn`` on the buffer quantized by ``fp8_permute`` (outside the
  time: in the pipeline the permute writes it), and ``scaled_grouped_mm`` = torch's
  ``torch._scaled_grouped_mm`` rowwise (x and the SwiGLU output quantized per row in PyTorch,
  inside the time; unavailable where this torch or GPU lacks it).

Speed: each FP8 row's ``extra["speedup_vs_bf16"]`` is its median-time ratio to our bf16 kernels
(targets of the FP8 issue: >= 1.6x at T=16k/32k, >= 1.7x at T=64) and ``roof_frac`` the fraction
of the run dtype's dense matmul roof measured at the start (FP8's tensor-core peak is twice
bf16's, so an FP8 row at that peak would show about 2). Accuracy, in each FP8 row's
``extra["accuracy"]``: the output's relative error against the bf16 path on the original weights
(``rel_fro``: ||fp8 - bf16|| / ||bf16||) and the distribution of the per-token relative errors
(p50, p90, p99, max), computed once per case (untimed) on the same inputs.
"""

from __future__ import annotations

from typing import Callable

import torch

import tritonmoe as tm

from .harness import Unavailable, Work
from .presets import PRESETS, Preset, RoutingSpec

#: Presets and token counts when the run does not choose them.
DEFAULT_SHAPES = (("mixtral-8x7b-like", 16384), ("qwen3-30b-a3b-like", 32768),
                  ("mixtral-8x7b-like", 64), ("qwen3-30b-a3b-like", 64))
OPS = ("moe_ffn", "grouped_ffn")
FP8_IMPLS = ("fp8_block128", "fp8_rowwise")


def _fmt(impl: str) -> str:
    return "e4m3_" + impl.split("_", 1)[1]


def accuracy(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Relative error of ``got`` against ``want``: Frobenius, and per-row quantiles."""
    g, w = got.float(), want.float()
    den = w.norm().clamp_min(1e-30)
    rows = (g - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-30)
    rows = rows[w.norm(dim=1) > 0]
    if rows.numel() == 0:
        rows = torch.zeros(1, device=g.device)
    q = torch.quantile(rows.double().cpu(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {"rel_fro": float((g - w).norm() / den), "row_p50": float(q[0]), "row_p90": float(q[1]),
            "row_p99": float(q[2]), "row_max": float(rows.max())}


def require_scaled_grouped_mm(device: torch.device) -> None:
    """Raise :class:`Unavailable` unless torch._scaled_grouped_mm runs here (rowwise, 2D x 3D)."""
    fn = getattr(torch, "_scaled_grouped_mm", None)
    if fn is None:
        raise Unavailable(f"torch {torch.__version__} has no torch._scaled_grouped_mm")
    try:
        a = torch.randn(32, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(2, 32, 32, device=device).to(torch.float8_e4m3fn)
        fn(a, b.transpose(1, 2), torch.ones(32, device=device), torch.ones(2, 32, device=device),
           offs=torch.tensor([16, 32], device=device, dtype=torch.int32), out_dtype=torch.bfloat16)
    except Exception as exc:  # no sm90 kernel in this build, or a signature this code does not know
        raise Unavailable(f"torch._scaled_grouped_mm does not run here: {str(exc).splitlines()[0][:200]}") from exc


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.float().abs().amax(1) / 448.0).clamp_min(1e-12)
    return (x.float() / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), s


def scaled_grouped_mm_ffn(x: torch.Tensor, offs32: torch.Tensor, ex) -> torch.Tensor:
    """torch._scaled_grouped_mm SwiGLU FFN over permuted rows with rowwise FP8 experts ``ex``."""
    F = ex.d_ffn
    xq, xs = _rowwise(x)
    h = torch._scaled_grouped_mm(xq, ex.w1.transpose(1, 2), xs, ex.w1_scale, offs=offs32, out_dtype=torch.bfloat16)
    a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    aq, as_ = _rowwise(a)
    return torch._scaled_grouped_mm(aq, ex.w2.transpose(1, 2), as_, ex.w2_scale, offs=offs32,
                                    out_dtype=torch.bfloat16)


def ffn_work(T: int, k: int, d: int, f: int, Ea: int, elem: float) -> Work:
    """SwiGLU FFN over T*k rows: 2*R*d*2f + 2*R*f*d FLOPs; x, out and the active experts'
    weights moved once (weights at ``elem`` bytes: 1 for e4m3)."""
    R = T * k
    return Work(flops=2.0 * R * d * 2 * f + 2.0 * R * f * d, bytes=2 * R * d * 2 + Ea * 3 * d * f * elem)


def plan_fp8(ctx) -> list:
    """Cases of the suite (see the module docstring); none in CPU mode."""
    from .suites.common import Case, Entry, case_params

    if not ctx.is_cuda:
        ctx.log("fp8: skipped in CPU mode (it times the FP8 GPU kernels against bf16 and torch._scaled_grouped_mm)")
        return []
    if ctx.presets_chosen:
        shapes = [(p, T) for p in ctx.presets for T in ctx.tokens_for(p)]
    else:
        shapes = [(PRESETS[name], T) for name, T in DEFAULT_SHAPES]
        if ctx.tokens:
            shapes = list(dict.fromkeys((p, T) for p, _ in shapes for T in ctx.tokens))
    cases = []
    for p, T in shapes:
        for spec in ctx.routings_for("fp8"):
            for op in OPS:
                acc: dict = {}
                impls = ["bf16", *FP8_IMPLS] + (["scaled_grouped_mm"] if op == "grouped_ffn" else [])
                entries = [Entry("fwd", impl, _make(ctx, p, T, op, impl, acc)) for impl in impls]
                cases.append(Case("fp8", f"{op} {p.name} T={T} {spec.label}", case_params(ctx, p, T, spec, op=op),
                                  _builder(ctx, p, T, spec), entries))
                cases[-1].accuracy = acc
    return cases


def _builder(ctx, p: Preset, T: int, spec: RoutingSpec) -> Callable[[], dict]:
    from .suites.common import active_experts, ffn_weights, make_routing

    def build() -> dict:
        if p.activation != "swiglu":
            raise Unavailable(f"the FP8 path is SwiGLU only; preset {p.name} uses {p.activation}")
        r = make_routing(ctx, T, p, spec, salt=T)
        w1, w2 = ffn_weights(ctx, p, salt=T + 61)
        w1, w2 = w1.detach(), w2.detach()
        x = ctx.randn(T, p.d_model, salt=T + 60)
        x_perm, info = tm.permute(x, r.topk_ids, p.num_experts)
        st = dict(x=x, routing=r, w1=w1, w2=w2, x_perm=x_perm, offsets=info.expert_offsets,
                  offs32=info.expert_offsets[1:].to(torch.int32), Ea=active_experts(r.counts))
        for impl in FP8_IMPLS:
            fmt = _fmt(impl)
            st[impl] = tm.quantize_experts(w1, w2, format=fmt)
            st[impl + "_x"] = tm.fp8.fp8_permute(x, r.topk_ids, p.num_experts, fmt)[:2]
        return st

    return build


def _forward(op: str, impl: str, st: dict, act: str) -> torch.Tensor:
    if op == "moe_ffn":
        if impl == "bf16":
            return tm.moe_ffn(st["x"], st["routing"], st["w1"], st["w2"], act, backend="triton")
        return tm.fp8_moe_ffn(st["x"], st["routing"], st[impl], backend="triton")
    if impl == "bf16":
        return tm.grouped_ffn(st["x_perm"], st["offsets"], st["w1"], st["w2"], act, backend="triton")
    if impl == "scaled_grouped_mm":
        return scaled_grouped_mm_ffn(st["x_perm"], st["offs32"], st["fp8_rowwise"])
    xq, xs = st[impl + "_x"]
    return tm.fp8.fp8_grouped_ffn(xq, xs, st["offsets"], st[impl], out_dtype=st["x"].dtype, backend="triton")


def _make(ctx, p: Preset, T: int, op: str, impl: str, acc: dict):
    """Entry.make: (timed callable, work); FP8 entries also record their accuracy in ``acc``."""

    def make(st):
        if impl == "scaled_grouped_mm":
            require_scaled_grouped_mm(ctx.device)
        with torch.no_grad():
            if impl != "bf16":
                if "bf16_out_" + op not in st:
                    st["bf16_out_" + op] = _forward(op, "bf16", st, p.activation)
                acc[impl] = accuracy(_forward(op, impl, st, p.activation), st["bf16_out_" + op])
        elem = ctx.itemsize if impl == "bf16" else 1
        work = ffn_work(T, p.top_k, p.d_model, p.d_ffn, st["Ea"], elem)

        def timed():
            with torch.no_grad():
                return _forward(op, impl, st, p.activation)

        return timed, work

    return make


def run_fp8_suite(ctx, progress=None) -> list[dict]:
    """Run the planned cases and attach each FP8 row's accuracy (``extra["accuracy"]``)."""
    from .suites.runner import run_case

    rows = []
    for case in plan_fp8(ctx):
        case_rows = run_case(ctx, case, progress)
        for r in case_rows:
            if r["impl"] in case.accuracy:
                r["extra"]["accuracy"] = case.accuracy[r["impl"]]
            bf16 = next((x for x in case_rows if x["impl"] == "bf16" and x["status"] == "ok"), None)
            if r["status"] == "ok" and bf16 is not None and r["time_s"] and r["impl"] != "bf16":
                r["extra"]["speedup_vs_bf16"] = bf16["time_s"]["median"] / r["time_s"]["median"]
        rows.extend(case_rows)
    return rows
