"""Model presets and routing distributions of the benchmark harness.

A preset is the shape of one MoE layer of a well-known model ("-like": the expert FFN and router
of that model, not the whole model). Token counts are per machine kind: the GPU lists reach the
issues' targets (decode T=64 and training batches), the CPU lists keep the default run short.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Preset:
    """One MoE layer shape. ``n1`` (w1's output columns) is 2*d_ffn for swiglu."""

    name: str
    num_experts: int
    d_model: int
    d_ffn: int
    top_k: int
    activation: str = "swiglu"
    score_func: str = "softmax"
    renormalize: bool = True
    expert_bias: bool = False
    n_groups: int | None = None
    topk_groups: int | None = None
    tokens_gpu: tuple[int, ...] = (64, 4096, 16384)
    tokens_cpu: tuple[int, ...] = (128, 512)
    about: str = ""

    @property
    def n1(self) -> int:
        return 2 * self.d_ffn if self.activation == "swiglu" else self.d_ffn

    def tokens(self, device: torch.device) -> tuple[int, ...]:
        return self.tokens_gpu if device.type == "cuda" else self.tokens_cpu

    def route_kwargs(self) -> dict:
        """Keyword arguments of tritonmoe.route for this preset's router."""
        return dict(
            score_func=self.score_func,
            renormalize=self.renormalize,
            n_groups=self.n_groups,
            topk_groups=self.topk_groups,
        )

    def params(self) -> dict:
        """The shape as it is recorded in a result row."""
        return dict(
            preset=self.name,
            E=self.num_experts,
            d=self.d_model,
            f=self.d_ffn,
            k=self.top_k,
            activation=self.activation,
            score_func=self.score_func,
            expert_bias=self.expert_bias,
            n_groups=self.n_groups,
            topk_groups=self.topk_groups,
        )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "mixtral-8x7b-like", 8, 4096, 14336, 2,
            about="Mixtral 8x7B: 8 experts, top-2, SwiGLU",
        ),
        Preset(
            "qwen3-30b-a3b-like", 128, 2048, 768, 8,
            tokens_gpu=(64, 4096, 32768),
            about="Qwen3-30B-A3B: 128 small experts, top-8, SwiGLU",
        ),
        Preset(
            "deepseek-v3-like", 256, 7168, 2048, 8,
            score_func="sigmoid", expert_bias=True, n_groups=8, topk_groups=4,
            about="DeepSeek-V3: 256 experts, top-8, sigmoid scores + selection bias, 8 groups / 4 kept",
        ),
        Preset(
            "switch-base-8-like", 8, 768, 3072, 1, activation="relu",
            about="Switch-Base-8: 8 experts, top-1, ReLU FFN (use --activation gelu for the GELU variant)",
        ),
        Preset(
            "small", 8, 256, 512, 2,
            tokens_gpu=(1024, 4096),
            about="a small layer for CPU runs and smoke tests",
        ),
        Preset(
            "medium", 16, 1024, 2048, 2,
            tokens_gpu=(4096, 16384), tokens_cpu=(4096,),
            about="a medium layer (the expert-parallel issue's gloo target: python -m bench ep --preset medium)",
        ),
    ]
}

#: The presets a run uses when --preset is not given.
DEFAULT_PRESETS_GPU = ("mixtral-8x7b-like", "qwen3-30b-a3b-like", "deepseek-v3-like", "switch-base-8-like")
DEFAULT_PRESETS_CPU = ("small",)

#: Shape flags of the CLI and the Preset field each overrides.
SHAPE_FIELDS = {
    "num_experts": int,
    "d_model": int,
    "d_ffn": int,
    "top_k": int,
    "activation": str,
    "score_func": str,
    "n_groups": int,
    "topk_groups": int,
    "expert_bias": bool,
}


def with_overrides(preset: Preset, overrides: dict) -> Preset:
    """The preset with custom shape fields; its name records what changed
    (``small[d_model=512,top_k=4]``) so result rows never pass for the preset itself."""
    changes = {k: v for k, v in overrides.items() if v is not None and getattr(preset, k) != v}
    if not changes:
        return preset
    label = ",".join(f"{k}={v}" for k, v in sorted(changes.items()))
    return dataclasses.replace(preset, name=f"{preset.name}[{label}]", **changes)


# ---------------------------------------------------------------------------------------------
# Routing distributions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingSpec:
    """How router logits are drawn: ``uniform`` (every expert equally popular) or ``zipf:S``
    (expert e's popularity proportional to 1/(e+1)^S; expert 0 is the most popular).

    Logits are log(popularity) plus Gumbel noise, so a token's top-k is a sample of k distinct
    experts drawn without replacement in proportion to popularity (the Gumbel-top-k trick).
    """

    kind: str
    s: float = 0.0

    @property
    def label(self) -> str:
        return "uniform" if self.kind == "uniform" else f"zipf:{self.s:g}"

    def popularity(self, num_experts: int) -> torch.Tensor:
        if self.kind == "uniform":
            return torch.full((num_experts,), 1.0 / num_experts, dtype=torch.float64)
        p = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-self.s)
        return p / p.sum()

    def logits(self, T: int, E: int, *, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(seed)
        u = torch.rand(T, E, generator=gen, device=device, dtype=torch.float32).clamp_(1e-7, 1.0 - 1e-7)
        gumbel = -torch.log(-torch.log(u))
        logp = self.popularity(E).log().to(device=device, dtype=torch.float32)
        return (gumbel + logp).to(dtype)


def parse_routing(text: str) -> RoutingSpec:
    """``uniform`` or ``zipf:S`` with S > 0 (e.g. ``zipf:1.2``)."""
    t = text.strip().lower()
    if t == "uniform":
        return RoutingSpec("uniform")
    if t.startswith("zipf:"):
        try:
            s = float(t[5:])
        except ValueError:
            raise ValueError(f"routing {text!r}: the Zipf exponent must be a number, e.g. zipf:1.2") from None
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"routing {text!r}: the Zipf exponent must be finite and > 0")
        return RoutingSpec("zipf", s)
    raise ValueError(f"routing {text!r} is not 'uniform' or 'zipf:S' (e.g. zipf:1.2)")
