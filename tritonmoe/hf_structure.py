"""Recognise a transformers MoE block by what it computes (used by :mod:`tritonmoe.hf`).

No class names decide anything here. A block is read in three parts:

* **experts** (``block.experts``): the layout of its weights, read from the attributes transformers'
  ``use_experts_implementation`` sets (``has_gate``, ``has_bias``, ``is_transposed``,
  ``is_concatenated``, ``has_post_expert_norm``), from the shapes, or DBRX's ``mlp.w1/v1/w2``;
  its activation from ``act_fn`` (a custom ``_apply_gate`` with ``limit``/``alpha`` is GPT-OSS's
  clamped SwiGLU).
* **router** (``block.gate`` or ``block.router``): its [E, D] weight (and bias) wherever it sits
  (``weight``, ``wg.weight``, ``layer.weight``), and its routing function, found by running a
  float64 copy of the router, with random weights, on random tokens and matching its top-k ids and
  weights against tritonmoe's routings (softmax / sigmoid, renormalized or not, the selection bias
  ``e_score_correction_bias``, group-limited top-2-sum / max, the scaling factor). A router whose
  output matches none is refused.
* **shared experts** (``shared_expert``, ``shared_experts``, ``shared_mlp``: gate/up/down or
  input/output projections) and Qwen's sigmoid ``shared_expert_gate``.

:func:`inspect_block` returns a :class:`BlockSpec` or raises :class:`HFConversionError` listing
every feature that blocks the conversion.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from . import reference

__all__ = ["HFConversionError", "BlockSpec", "ExpertsLayout", "inspect_block", "experts_layout", "is_moe_block",
           "KNOWN_GAPS", "REGISTRY_HINT"]

#: What the registry path is, named in every refusal whose model can use it.
REGISTRY_HINT = (
    "the experts-registry path keeps the model's own routing and runs only the experts on tritonmoe: "
    "tritonmoe.hf.use_experts_implementation(model)"
)

#: Known blocks tritonmoe cannot express, by what they compute (the messages of their refusals;
#: the decision itself is made by :func:`inspect_block`).
KNOWN_GAPS = {
    "Llama4TextMoe": (
        "Llama 4 scales each expert's *input* by the router's sigmoid score (routed_in = x * score, its router "
        "returns dense scores [T, E]) and runs every expert densely; tritonmoe weights the experts' *outputs*, "
        "which differs for SwiGLU experts"
    ),
    "PhimoeSparseMoeBlock": (
        "PhiMoE routes with SparseMixer (a masked, jittered softmax per slot: router_jitter_noise, "
        "input_jitter_noise) that tritonmoe's router does not implement"
    ),
}


#: Tokens of the router probe: enough that group-limited routing, its group score (top-2 sum or
#: max) and plain top-k routing all differ on some token of a random batch.
PROBE_TOKENS = 2048


class HFConversionError(TypeError):
    """A transformers block or option tritonmoe.hf cannot convert (names what is missing)."""


def _act_name(fn) -> str:
    if fn is None:
        return "none"
    name = getattr(fn, "__name__", None) if callable(fn) and not isinstance(fn, nn.Module) else None
    name = {"silu": "SiLU", "gelu": "GELU", "relu": "ReLU"}.get(name, name) if name else type(fn).__name__
    return {"SiLU": "silu", "SiLUActivation": "silu", "GELUActivation": "gelu", "GELU": "gelu", "ReLU": "relu",
            "ReLUActivation": "relu"}.get(name, name)


def _linear_weight(m: Optional[nn.Module], what: str, problems: list[str]) -> Optional[torch.Tensor]:
    if m is None:
        return None
    if getattr(m, "bias", None) is not None:
        problems.append(f"{what} has a bias (tritonmoe's shared expert has none)")
    return m.weight


@dataclass
class ExpertsLayout:
    """How an experts module stores its weights (see :func:`experts_layout`)."""

    style: str  # "fused" (gate_up_proj / up_proj + down_proj) or "dbrx" (mlp.w1, mlp.v1, mlp.w2)
    num_experts: int
    d_model: int
    d_ffn: int
    activation: str
    gated: bool = True
    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    swiglu_limit: Optional[float] = None
    swiglu_alpha: Optional[float] = None

    def to_tritonmoe(self, experts: nn.Module) -> dict[str, torch.Tensor]:
        """The experts' tensors as tritonmoe's ``w1`` [E, D, n1], ``w2`` [E, F, D] (+ ``b1``, ``b2``)."""
        E, D, F = self.num_experts, self.d_model, self.d_ffn
        if self.style == "dbrx":
            mlp = experts.mlp
            w1 = torch.cat([mlp.w1.view(E, F, D).transpose(1, 2), mlp.v1.view(E, F, D).transpose(1, 2)], dim=2)
            return {"w1": w1, "w2": mlp.w2.view(E, F, D)}
        up = experts.gate_up_proj if self.gated else experts.up_proj
        w1 = up if self.transposed else up.transpose(1, 2)
        w2 = experts.down_proj if self.transposed else experts.down_proj.transpose(1, 2)
        out = {"w1": w1, "w2": w2}
        if self.bias:
            out["b1"] = experts.gate_up_proj_bias if self.gated else experts.up_proj_bias
            out["b2"] = experts.down_proj_bias
        if self.interleaved:
            for n in ("w1", "b1"):
                if n in out:
                    t = out[n]
                    out[n] = torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)
        return out

    def from_tritonmoe(self, t: dict[str, torch.Tensor], prefix: str = "experts.") -> dict[str, torch.Tensor]:
        """The inverse of :meth:`to_tritonmoe`: the experts' parameter names (with ``prefix``) and layouts."""
        E, D, F = self.num_experts, self.d_model, self.d_ffn
        w1, w2, b1 = t["w1"], t["w2"], t.get("b1")
        if self.style == "dbrx":
            return {f"{prefix}mlp.w1": w1[:, :, :F].transpose(1, 2).reshape(E * F, D),
                    f"{prefix}mlp.v1": w1[:, :, F:].transpose(1, 2).reshape(E * F, D),
                    f"{prefix}mlp.w2": w2.reshape(E * F, D)}
        if self.interleaved:
            def inter(x):
                h = x.shape[-1] // 2
                return torch.stack([x[..., :h], x[..., h:]], dim=-1).flatten(-2)
            w1 = inter(w1)
            b1 = inter(b1) if b1 is not None else None
        up = "gate_up_proj" if self.gated else "up_proj"
        out = {f"{prefix}{up}": w1 if self.transposed else w1.transpose(1, 2),
               f"{prefix}down_proj": w2 if self.transposed else w2.transpose(1, 2)}
        if self.bias and b1 is not None:
            out[f"{prefix}{up}_bias"] = b1
            out[f"{prefix}down_proj_bias"] = t["b2"]
        return out


def experts_layout(experts: nn.Module, problems: list[str]) -> Optional[ExpertsLayout]:
    """The layout of a transformers experts module; what tritonmoe cannot run goes to ``problems``."""
    name = type(experts).__name__
    if getattr(experts, "has_post_expert_norm", False):
        problems.append(f"{name} normalizes each expert's output (has_post_expert_norm)")
    mlp = getattr(experts, "mlp", None)
    if mlp is not None and all(isinstance(getattr(mlp, n, None), torch.Tensor) for n in ("w1", "v1", "w2")):
        E = int(getattr(experts, "num_experts"))
        rows, D = mlp.w1.shape
        act = _act_name(getattr(mlp, "activation_fn", None))
        if act != "silu":
            problems.append(f"{name}'s gated experts use the activation {act} (tritonmoe's GLU experts use SiLU)")
        return ExpertsLayout("dbrx", E, int(D), int(rows) // E, "swiglu")
    gated = isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
    up = experts.gate_up_proj if gated else getattr(experts, "up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or up.dim() != 3 or down.dim() != 3:
        params = [n for n, _ in experts.named_parameters()]
        problems.append(f"{name} stores its experts in a layout tritonmoe.hf does not read (parameters {params}; it "
                        "reads gate_up_proj/up_proj and down_proj [E, ...] or DBRX's mlp.w1/v1/w2)")
        return None
    E = up.shape[0]
    # transformers' flag when the decorator set it, else the shapes: down_proj [E, D, F] is F.linear's
    transposed = bool(getattr(experts, "is_transposed", down.shape[1] != up.shape[2]))
    D = up.shape[1] if transposed else up.shape[2]
    F = down.shape[1] if transposed else down.shape[2]
    interleaved = not bool(getattr(experts, "is_concatenated", True))
    bias = bool(getattr(experts, "has_bias", isinstance(getattr(experts, "down_proj_bias", None), torch.Tensor)))
    lay = ExpertsLayout("fused", int(E), int(D), int(F), "swiglu", gated=gated, transposed=transposed,
                        interleaved=interleaved, bias=bias)
    n1 = up.shape[2] if transposed else up.shape[1]
    want_down = (E, F, D) if transposed else (E, D, F)
    if tuple(down.shape) != want_down or n1 != (2 * F if gated else F):
        problems.append(f"{name}'s weights disagree: {'gate_up_proj' if gated else 'up_proj'} {tuple(up.shape)} and "
                        f"down_proj {tuple(down.shape)} are not the two projections of the same {E} experts")
        return None
    default_gate = _default_gate()
    fn = getattr(type(experts), "_apply_gate", default_gate)
    custom_gate = None if fn is default_gate else fn
    if custom_gate is not None and gated:
        if hasattr(experts, "limit") and hasattr(experts, "alpha"):
            lay.activation, lay.swiglu_limit, lay.swiglu_alpha = "swiglu_oai", float(experts.limit), float(experts.alpha)
            return lay
        problems.append(f"{name} gates with its own function {custom_gate.__qualname__} (tritonmoe's GLUs: SwiGLU, "
                        "GPT-OSS's clamped SwiGLU)")
        return lay
    act = _act_name(getattr(experts, "act_fn", None))
    if gated:
        if act != "silu":
            problems.append(f"{name}'s gated experts use the activation {act} (tritonmoe's GLU experts use SiLU)")
    elif act in ("gelu", "relu"):
        lay.activation = act
    else:
        problems.append(f"{name}'s ungated experts use the activation {act} (tritonmoe: gelu or relu)")
    return lay


def _default_gate():
    """transformers' default gate of fused gate-up experts (``act_fn(gate) * up``), if it has one."""
    try:
        import transformers.integrations.moe as hf_moe
    except ImportError:  # pragma: no cover - transformers without the experts integration
        return None
    return getattr(hf_moe, "_default_apply_gate", None)


@dataclass
class BlockSpec:
    """What a block computes, in tritonmoe's terms (:func:`inspect_block`)."""

    experts: ExpertsLayout
    top_k: int
    router_weight: str  # the [E, D] router weight's name in the block, e.g. "gate.weight", "gate.wg.weight"
    router_bias: Optional[str] = None
    routing: dict = field(default_factory=dict)  # MoEConfig routing options
    selection_bias: Optional[str] = None  # e.g. "gate.e_score_correction_bias"
    router_fp32: bool = False  # the router computes its logits in fp32 on low-precision activations
    shared: Optional[str] = None  # "shared_expert", "shared_experts" or "shared_mlp"
    shared_style: str = "gate_up_down"  # or "input_output" (GraniteMoeShared's)
    shared_d_ffn: int = 0
    shared_gate: Optional[str] = None  # "shared_expert_gate"
    jitter: float = 0.0

    def options(self, dtype: torch.dtype) -> dict:
        """The MoEConfig keyword arguments (without the loss coefficients and the backend)."""
        x = self.experts
        opts = dict(self.routing, activation=x.activation, expert_ffn_bias=x.bias, router_bias=self.router_bias is not None,
                    expert_bias=self.selection_bias is not None, shared_d_ffn=self.shared_d_ffn,
                    shared_expert_gate=self.shared_gate is not None)
        if x.activation == "swiglu_oai":
            opts.update(swiglu_limit=x.swiglu_limit, swiglu_alpha=x.swiglu_alpha)
        if self.router_fp32 and dtype != torch.float64:
            opts["router_dtype"] = torch.float32
        return opts


def _router_of(block: nn.Module) -> tuple[Optional[str], Optional[nn.Module]]:
    for name in ("gate", "router"):
        m = getattr(block, name, None)
        if isinstance(m, nn.Module):
            return name, m
    return None, None


def is_moe_block(module: nn.Module) -> bool:
    """A module with an ``experts`` submodule and a router module (``gate`` / ``router``) holding
    a 2-D weight: what :func:`tritonmoe.hf.apply` tries to convert."""
    experts = getattr(module, "experts", None)
    _, router = _router_of(module)
    if not isinstance(experts, nn.Module) or router is None:
        return False
    return any(p.dim() == 2 for p in router.parameters())


def _find_router_weight(router: nn.Module, rname: str, E: int, D: int) -> tuple[Optional[str], Optional[str]]:
    for n, p in router.named_parameters():
        if p.dim() == 2 and tuple(p.shape) == (E, D):
            prefix = n.rpartition(".")[0]
            owner = router.get_submodule(prefix) if prefix else router
            b = getattr(owner, "bias", None)
            bias = f"{rname}.{prefix + '.' if prefix else ''}bias" if isinstance(b, torch.Tensor) else None
            return f"{rname}.{n}", bias
    return None, None


def _find_attr(mods, names):
    for m in mods:
        for n in names:
            v = getattr(m, n, None)
            if v is not None and not isinstance(v, (nn.Module, torch.Tensor)):
                return v
    return None


def _split_router_output(out) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(logits [T, E], weights [T, k], ids [T, k]) from a router's or a routing method's output."""
    ts = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
    ids = next((t for t in ts if not t.is_floating_point()), None)
    floats = [t for t in ts if t.is_floating_point()]
    k = ids.shape[-1] if ids is not None else None
    weights = next((t for t in floats if k is not None and t.shape[-1] == k), None)
    logits = next((t for t in floats if t is not weights), None)
    return logits, weights, ids


def _candidates(block, router, has_bias: bool):
    from itertools import product

    mods = (router, block, getattr(block, "config", None))
    groups = _find_attr(mods, ("n_group", "num_group", "n_groups"))
    topk_groups = _find_attr(mods, ("topk_group", "topk_groups"))
    scale = _find_attr(mods, ("routed_scaling_factor",))
    group_opts = [{}]
    if groups is not None and topk_groups is not None and int(groups) > 1:
        group_opts = [dict(n_groups=int(groups), topk_groups=int(topk_groups), group_score=s) for s in ("top2sum", "max")]
        group_opts.append({})
    scales = [float(scale)] if scale is not None and float(scale) != 1.0 else []
    for sf, renorm, g, rsf, bias in product(("softmax", "sigmoid"), (True, False), group_opts, scales + [1.0],
                                            ((True, False) if has_bias else (False,))):
        yield dict(score_func=sf, renormalize=renorm, routed_scaling_factor=rsf, **g), bias


def _probe_routing(block: nn.Module, rname: str, router: nn.Module, spec: BlockSpec, problems: list[str]) -> None:
    """Find the routing function by running a float64 copy of the router with random weights."""
    E, D = spec.experts.num_experts, spec.experts.d_model
    g = torch.Generator().manual_seed(1234)
    probe = copy.deepcopy(router).to(device="cpu", dtype=torch.float64).eval()
    with torch.no_grad():
        for p in list(probe.parameters()) + list(probe.buffers()):
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.1 if p.dim() == 1 or p.shape[0] == 1 else 1))
        x = torch.randn(PROBE_TOKENS, D, generator=g, dtype=torch.float64)
        extra = _router_extra_args(block, probe, g)
        try:
            out = probe(x, *[t for _, t in extra])
            logits, weights, ids = _split_router_output(out)
            via_block = ids is None and logits is not None and hasattr(block, "route_tokens_to_experts")
            if via_block:  # the block routes the router's logits (DBRX's route_tokens_to_experts)
                proxy = copy.copy(block)
                proxy._modules = dict(block._modules, **{rname: probe})
                _, weights, ids = _split_router_output(type(block).route_tokens_to_experts(proxy, logits))
        except Exception as e:  # noqa: BLE001 - e.g. a hash router that needs input_ids
            problems.append(f"its router {type(router).__name__} does not route hidden states alone "
                            f"({type(e).__name__}: {str(e)[:160]}); tritonmoe's router sees only the hidden states")
            return
        sel = None
        for n, b in list(probe.named_buffers()) + list(probe.named_parameters()):
            if n.endswith("e_score_correction_bias"):
                sel, spec.selection_bias = b.reshape(-1), f"{rname}.{n}"
        for n, t in extra:  # a selection bias the block holds and hands to its router (MiniMax-M2, AFMoE)
            sel, spec.selection_bias = t.reshape(-1), n
    if ids is None or weights is None or logits is None or logits.shape != (x.shape[0], E):
        shapes = [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
        problems.append(f"its router {type(router).__name__} does not return top-k (weights, ids) but tensors of shapes "
                        f"{shapes} (dense per-expert scores)")
        return
    spec.top_k = int(ids.shape[-1])
    w = probe.get_parameter(spec.router_weight.partition(".")[2])
    want = x @ w.t()
    if spec.router_bias is not None:
        want = want + probe.get_parameter(spec.router_bias.partition(".")[2])
    # a router that takes its logits in fp32 (DeepSeek-V3's) differs from the fp64 product by fp32
    # rounding: at most ~D * 2^-24 of sum |x||w| per logit (a wrong layout is off by O(|logit|))
    bound = 1e-6 + 1e-5 * want.abs() + 4 * D * 2.0 ** -24 * (x.abs() @ w.abs().t())
    if not bool(((logits.double() - want).abs() <= bound).all()):
        problems.append(f"its router {type(router).__name__}'s logits are not x @ weight.T (+ bias)")
        return
    mine = torch.sort(ids.long(), dim=-1)
    mine_w = weights.double().gather(-1, mine.indices)
    for opts, use_bias in _candidates(block, probe, sel is not None):
        r = reference.route(logits.double(), spec.top_k, expert_bias=sel if use_bias else None, **opts)
        theirs = torch.sort(r.topk_ids.long(), dim=-1)
        if torch.equal(theirs.values, mine.values) and torch.allclose(
                r.topk_weights.double().gather(-1, theirs.indices), mine_w, rtol=1e-5, atol=1e-7):
            spec.routing = opts
            if not use_bias:
                spec.selection_bias = None
            return
    problems.append(f"its router {type(router).__name__} routes in a way none of tritonmoe's routings reproduces "
                    "(softmax or sigmoid top-k, renormalized or not, a selection bias, group-limited top-2-sum or max "
                    "group scores, a scaling factor)")


def _router_extra_args(block: nn.Module, router: nn.Module, g: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """Tensors a router's forward takes beside the hidden states that the block holds under the
    same name (MiniMax-M2's ``gate(x, self.e_score_correction_bias)``): random float64 copies, in order."""
    try:
        params = list(inspect.signature(router.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    out = []
    for p in params:
        t = getattr(block, p.name, None)
        if p.default is not inspect.Parameter.empty or not isinstance(t, torch.Tensor) or t.dim() > 2:
            break
        out.append((p.name, torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.1))
    return out


def _router_computes_in_fp32(block: nn.Module, router: nn.Module, D: int) -> bool:
    try:
        probe = copy.deepcopy(router).to(device="cpu", dtype=torch.bfloat16).eval()
        extra = [t.to(torch.bfloat16) for _, t in _router_extra_args(block, probe, torch.Generator().manual_seed(0))]
        with torch.no_grad():
            logits, _, _ = _split_router_output(probe(torch.zeros(2, D, dtype=torch.bfloat16), *extra))
        return logits is not None and logits.dtype == torch.float32
    except Exception:  # noqa: BLE001 - a router that cannot run in bf16: keep the block's dtype
        return False


def _shared(block: nn.Module, spec: BlockSpec, problems: list[str]) -> None:
    for name in ("shared_expert", "shared_experts", "shared_mlp"):
        m = getattr(block, name, None)
        if isinstance(m, nn.Module):
            break
    else:
        return
    spec.shared = name
    if all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        for n in ("gate_proj", "up_proj", "down_proj"):
            _linear_weight(getattr(m, n), f"{name}.{n}", problems)
        spec.shared_d_ffn = m.gate_proj.weight.shape[0]
        act = _act_name(getattr(m, "act_fn", None))
    elif all(isinstance(getattr(m, n, None), nn.Linear) for n in ("input_linear", "output_linear")):
        for n in ("input_linear", "output_linear"):
            _linear_weight(getattr(m, n), f"{name}.{n}", problems)
        spec.shared_style, spec.shared_d_ffn = "input_output", m.input_linear.weight.shape[0] // 2
        act = _act_name(getattr(m, "activation", None))
    else:
        problems.append(f"its shared expert {name} ({type(m).__name__}) is not a gate/up/down SwiGLU MLP")
        return
    if spec.experts.activation != "swiglu" or act != "silu":
        problems.append(f"its shared expert uses {act} and its routed experts {spec.experts.activation} (tritonmoe's "
                        "shared expert has the routed experts' activation)")
    gate = getattr(block, "shared_expert_gate", None)
    if isinstance(gate, nn.Linear):
        if tuple(gate.weight.shape) != (1, spec.experts.d_model) or gate.bias is not None:
            problems.append(f"its shared_expert_gate has shape {tuple(gate.weight.shape)} (tritonmoe: a [1, D] sigmoid gate)")
        spec.shared_gate = "shared_expert_gate"


def inspect_block(block: nn.Module) -> BlockSpec:
    """The :class:`BlockSpec` of a transformers MoE block, or :class:`HFConversionError` naming
    every feature tritonmoe cannot express (and the registry path where the model can use it)."""
    name = type(block).__name__
    experts = getattr(block, "experts", None)
    rname, router = _router_of(block)
    if not isinstance(experts, nn.Module) or router is None:
        raise HFConversionError(
            f"{name} ({type(block).__module__}) is not a MoE block tritonmoe.hf reads: it needs an `experts` module and "
            "a router module `gate` or `router` (transformers 5 MoE blocks have both)")
    problems: list[str] = []
    lay = experts_layout(experts, problems)
    if lay is None:
        raise refusal(block, problems)
    spec = BlockSpec(experts=lay, top_k=0, router_weight="")
    w, b = _find_router_weight(router, rname, lay.num_experts, lay.d_model)
    if w is None:
        problems.append(f"its router {type(router).__name__} has no [{lay.num_experts}, {lay.d_model}] weight")
        raise refusal(block, problems)
    spec.router_weight, spec.router_bias = w, b
    _probe_routing(block, rname, router, spec, problems)
    spec.router_fp32 = _router_computes_in_fp32(block, router, lay.d_model)
    _shared(block, spec, problems)
    spec.jitter = float(getattr(block, "jitter_noise", 0.0) or getattr(router, "moe_jitter_eps", 0.0) or 0.0)
    if getattr(block, "input_jitter_noise", 0.0) or getattr(router, "input_jitter_noise", 0.0):
        problems.append("it multiplies its input by noise in the router (input_jitter_noise)")
    if problems:
        raise refusal(block, problems)
    return spec


def registry_ready(experts: nn.Module) -> Optional[str]:
    """None when ``experts`` dispatches through transformers' experts registry in a layout
    tritonmoe's experts function runs; else why not."""
    if not hasattr(experts, "is_concatenated") or not hasattr(experts, "has_gate"):
        return (f"{type(experts).__name__} does not dispatch through transformers' experts registry "
                "(no use_experts_implementation: config._experts_implementation has no effect on it)")
    problems: list[str] = []
    experts_layout(experts, problems)
    return "; ".join(problems) if problems else None


def refusal(block: nn.Module, problems: list[str]) -> HFConversionError:
    name = type(block).__name__
    known = KNOWN_GAPS.get(name)
    why = "; ".join(dict.fromkeys(problems))
    msg = f"tritonmoe.hf cannot convert {name}: {why}"
    if known:
        msg += f" ({known})"
    experts = getattr(block, "experts", None)
    reg = registry_ready(experts) if isinstance(experts, nn.Module) else "it has no experts module"
    msg += f". Alternative: {REGISTRY_HINT}" if reg is None else f". The experts-registry path does not work either: {reg}"
    return HFConversionError(msg)
