"""Hugging Face transformers interoperability (``pip install tritonmoe[hf]``).

Convert a transformers MoE block to a :class:`~tritonmoe.MoELayer` and back, patch a loaded model
in place, or register tritonmoe as an experts implementation of transformers::

    layer = tritonmoe.hf.from_hf(model.model.layers[3].mlp)      # a MoELayer with the block's weights
    tritonmoe.hf.to_hf(layer, block)                              # copy (trained) weights back
    tritonmoe.hf.apply(model)                                     # every supported block -> tritonmoe
    tritonmoe.hf.register_experts_implementation()                # then: config._experts_implementation = "tritonmoe"

Supported blocks (transformers 5.x class names) and how each maps:

=========================  ======================================================================
``MixtralSparseMoeBlock``  softmax, top-k, renormalized; SwiGLU experts
``Qwen2MoeSparseMoeBlock`` softmax, renormalized iff ``norm_topk_prob``; a shared expert behind a
                           sigmoid gate (``shared_d_ffn``, ``shared_expert_gate``)
``Qwen3MoeSparseMoeBlock`` softmax, renormalized iff ``norm_topk_prob``
``OlmoeSparseMoeBlock``    softmax, renormalized iff ``norm_topk_prob``
``DeepseekV3MoE``          sigmoid scores computed in fp32 (``router_dtype``), the selection bias
                           ``e_score_correction_bias`` (``expert_bias``), group-limited routing
                           (top-2-sum group score), ``routed_scaling_factor``, shared experts
``GptOssMLP``              router bias, softmax over the top-k logits (= renormalized softmax),
                           expert biases, clamped SwiGLU (``swiglu_oai``; transformers stores gate
                           and up interleaved, tritonmoe gate columns then up columns)
=========================  ======================================================================

Weight layouts: transformers' fused experts hold ``gate_up_proj`` [E, 2F, D] and ``down_proj``
[E, D, F] (``F.linear`` convention; GPT-OSS: [E, D, 2F] interleaved and [E, F, D]); tritonmoe's
``w1`` is [E, D, 2F] (gate, then up) and ``w2`` [E, F, D]. The conversion copies (the layouts
differ), in the block's dtype and device.

Load-balancing loss: transformers' ``load_balancing_loss_func`` (Mixtral, Qwen, OLMoE) equals
``top_k`` times tritonmoe's :func:`tritonmoe.load_balancing_loss` on the same routing (its
fraction of tokens per expert sums over the k slots; tritonmoe's is normalized by T*k so that a
balanced router scores 1). ``from_hf(..., aux_loss_coef=c, loss_convention="transformers")``
scales the layer's coefficient by ``top_k`` so that ``layer.aux_loss`` equals
``c * load_balancing_loss_func(...)`` of that block; ``"tritonmoe"`` (default) keeps ``c``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .config import MoEConfig
from .layer import MoELayer

__all__ = ["SUPPORTED", "config_from_hf", "from_hf", "to_hf", "apply", "HFMoEBlock", "register_experts_implementation"]

#: Class names of the supported transformers MoE blocks.
SUPPORTED = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock",
             "DeepseekV3MoE", "GptOssMLP")
LOSS_CONVENTIONS = ("tritonmoe", "transformers")


def _kind(block: nn.Module) -> str:
    name = type(block).__name__
    if name not in SUPPORTED:
        raise TypeError(
            f"tritonmoe.hf does not know the block {name} ({type(block).__module__}); supported: {', '.join(SUPPORTED)}. "
            "A block converts when it has a top-k router and fused experts (gate_up_proj/down_proj) of one of these layouts"
        )
    return name


def _need(block: nn.Module, path: str):
    obj = block
    for part in path.split("."):
        if not hasattr(obj, part):
            raise TypeError(f"{type(block).__name__} has no attribute {path!r}, which tritonmoe.hf needs to convert it "
                            "(a transformers version with another layout?)")
        obj = getattr(obj, part)
    return obj


def _act_swiglu(block: nn.Module, experts: nn.Module) -> str:
    """The activation of a gate-up block: SwiGLU needs SiLU (the only one these models use)."""
    act = getattr(getattr(block, "config", None), "hidden_act", None) or getattr(experts, "config", None)
    fn = getattr(experts, "act_fn", None)
    name = type(fn).__name__ if fn is not None else str(act)
    if fn is not None and name not in ("SiLU", "SiLUActivation"):
        raise TypeError(f"{type(block).__name__}'s experts use {name}; tritonmoe.hf converts SiLU-gated (SwiGLU) experts")
    return "swiglu"


def config_from_hf(block: nn.Module, *, aux_loss_coef: float = 0.0, loss_convention: str = "tritonmoe",
                   backend: Optional[str] = None) -> MoEConfig:
    """The :class:`~tritonmoe.MoEConfig` of a transformers MoE block (see the module docstring)."""
    kind = _kind(block)
    if loss_convention not in LOSS_CONVENTIONS:
        raise ValueError(f"loss_convention={loss_convention!r}; use one of {LOSS_CONVENTIONS}")
    if kind == "GptOssMLP":
        router, experts = _need(block, "router"), _need(block, "experts")
        E, D = router.weight.shape
        F = experts.down_proj.shape[1]
        k = router.top_k
        opts = dict(activation="swiglu_oai", swiglu_limit=float(experts.limit), swiglu_alpha=float(experts.alpha),
                    expert_ffn_bias=True, router_bias=True)
    else:
        gate, experts = _need(block, "gate"), _need(block, "experts")
        _need(block, "experts.gate_up_proj")
        E, D = gate.weight.shape
        F = experts.down_proj.shape[2]
        k = gate.top_k
        opts = dict(activation=_act_swiglu(block, experts))
        if kind in ("Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock"):
            opts["renormalize"] = bool(gate.norm_topk_prob)
        if kind == "Qwen2MoeSparseMoeBlock":
            opts.update(shared_d_ffn=_need(block, "shared_expert.gate_proj").weight.shape[0], shared_expert_gate=True)
        if kind == "DeepseekV3MoE":
            groups = int(gate.num_group)
            opts.update(
                score_func="sigmoid", renormalize=bool(gate.norm_topk_prob), expert_bias=True,
                routed_scaling_factor=float(gate.routed_scaling_factor),
                # transformers computes this router in fp32; an fp64 block keeps its weight in fp64
                router_dtype=None if gate.weight.dtype == torch.float64 else torch.float32,
                shared_d_ffn=_need(block, "shared_experts.gate_proj").weight.shape[0],
            )
            if groups > 1:
                opts.update(n_groups=groups, topk_groups=int(gate.topk_group), group_score="top2sum")
    coef = float(aux_loss_coef) * (k if loss_convention == "transformers" else 1)
    return MoEConfig(D, F, E, k, aux_loss_coef=coef, backend=backend, **opts)


def _interleaved_to_halves(t: torch.Tensor) -> torch.Tensor:
    """[..., 2F] with gate/up interleaved (g0, u0, g1, u1, ...) -> gate columns, then up."""
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


def _halves_to_interleaved(t: torch.Tensor) -> torch.Tensor:
    F = t.shape[-1] // 2
    return torch.stack([t[..., :F], t[..., F:]], dim=-1).flatten(-2)


def hf_to_tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    """The block's weights as a :class:`~tritonmoe.MoELayer` state dict (tritonmoe layouts)."""
    kind = _kind(block)
    out: dict[str, torch.Tensor] = {}
    if kind == "GptOssMLP":
        r, x = block.router, block.experts
        out["router.weight"], out["router.bias"] = r.weight, r.bias
        out["w1"] = _interleaved_to_halves(x.gate_up_proj)
        out["b1"] = _interleaved_to_halves(x.gate_up_proj_bias)
        out["w2"], out["b2"] = x.down_proj, x.down_proj_bias
        return {n: t.detach() for n, t in out.items()}
    out["router.weight"] = block.gate.weight
    out["w1"] = block.experts.gate_up_proj.transpose(1, 2)
    out["w2"] = block.experts.down_proj.transpose(1, 2)
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    if shared is not None:
        out["shared_experts.w1"] = torch.cat([shared.gate_proj.weight.t(), shared.up_proj.weight.t()], dim=1)
        out["shared_experts.w2"] = shared.down_proj.weight.t()
    if kind == "Qwen2MoeSparseMoeBlock":
        out["shared_experts.gate"] = block.shared_expert_gate.weight[0]
    if kind == "DeepseekV3MoE":
        out["expert_bias"] = block.gate.e_score_correction_bias.float()
    return {n: t.detach() for n, t in out.items()}


def tensors_to_hf(tensors: dict[str, torch.Tensor], block: nn.Module) -> dict[str, torch.Tensor]:
    """tritonmoe-layout tensors (a layer's state dict, or its gradients by parameter name) as the
    block's parameter and buffer names and layouts (the inverse of :func:`hf_to_tensors`)."""
    kind = _kind(block)
    out: dict[str, torch.Tensor] = {}
    t = tensors
    if kind == "GptOssMLP":
        out["router.weight"], out["router.bias"] = t["router.weight"], t["router.bias"]
        out["experts.gate_up_proj"] = _halves_to_interleaved(t["w1"])
        out["experts.gate_up_proj_bias"] = _halves_to_interleaved(t["b1"])
        out["experts.down_proj"], out["experts.down_proj_bias"] = t["w2"], t["b2"]
        return out
    out["gate.weight"] = t["router.weight"]
    out["experts.gate_up_proj"] = t["w1"].transpose(1, 2)
    out["experts.down_proj"] = t["w2"].transpose(1, 2)
    prefix = {"Qwen2MoeSparseMoeBlock": "shared_expert", "DeepseekV3MoE": "shared_experts"}.get(kind)
    if prefix is not None and "shared_experts.w1" in t:
        w1 = t["shared_experts.w1"]
        Fs = w1.shape[1] // 2
        out[f"{prefix}.gate_proj.weight"] = w1[:, :Fs].t()
        out[f"{prefix}.up_proj.weight"] = w1[:, Fs:].t()
        out[f"{prefix}.down_proj.weight"] = t["shared_experts.w2"].t()
    if kind == "Qwen2MoeSparseMoeBlock" and "shared_experts.gate" in t:
        out["shared_expert_gate.weight"] = t["shared_experts.gate"].unsqueeze(0)
    if kind == "DeepseekV3MoE" and "expert_bias" in t:
        out["gate.e_score_correction_bias"] = t["expert_bias"]
    return out


def _block_dtype_device(block: nn.Module) -> tuple[torch.dtype, torch.device]:
    p = block.experts.down_proj
    return p.dtype, p.device


def from_hf(block: nn.Module, *, aux_loss_coef: float = 0.0, loss_convention: str = "tritonmoe",
            backend: Optional[str] = None) -> MoELayer:
    """A :class:`~tritonmoe.MoELayer` computing what ``block`` computes, with a copy of its
    weights, in its dtype and on its device (the router in fp32 where the block computes it so)."""
    cfg = config_from_hf(block, aux_loss_coef=aux_loss_coef, loss_convention=loss_convention, backend=backend)
    dtype, device = _block_dtype_device(block)
    layer = MoELayer(cfg, device=device, dtype=dtype)
    state = hf_to_tensors(block)
    with torch.no_grad():
        own = layer.state_dict()
        for name, t in state.items():
            own[name].copy_(t)
    return layer


@torch.no_grad()
def to_hf(layer: MoELayer, block: nn.Module) -> nn.Module:
    """Copy ``layer``'s weights into ``block`` (in place; the block's dtypes) and return it."""
    if not isinstance(layer, MoELayer):
        raise TypeError(f"layer must be a tritonmoe.MoELayer, got {type(layer).__name__}")
    want = config_from_hf(block)
    have = layer.config
    for f in ("d_model", "d_ffn", "num_experts", "top_k", "activation"):
        if getattr(want, f) != getattr(have, f):
            raise ValueError(f"the layer's {f}={getattr(have, f)!r} but the block's is {getattr(want, f)!r}; convert "
                             "between a layer and a block of the same shape")
    params = dict(block.named_parameters())
    params.update(dict(block.named_buffers()))
    for name, t in tensors_to_hf(dict(layer.state_dict()), block).items():
        params[name].copy_(t)
    return block


class HFMoEBlock(nn.Module):
    """A transformers MoE block replaced by a :class:`~tritonmoe.MoELayer` (what :func:`apply`
    installs): the same call (``hidden_states`` [..., D]) and return value (GPT-OSS's block also
    returns its routing weights)."""

    def __init__(self, layer: MoELayer, kind: str) -> None:
        super().__init__()
        self.moe = layer
        self.kind = kind

    def forward(self, hidden_states: torch.Tensor):
        out = self.moe(hidden_states)
        if self.kind == "GptOssMLP":
            return out, self.moe.last_routing.topk_weights.to(out.dtype)
        return out


def apply(model: nn.Module, *, backend: Optional[str] = None, aux_loss_coef: float = 0.0,
          loss_convention: str = "tritonmoe") -> list[str]:
    """Replace every supported MoE block of ``model`` (in place) by an :class:`HFMoEBlock` holding
    a converted :class:`~tritonmoe.MoELayer`; returns the replaced modules' names. Raises
    ``TypeError`` when the model has no supported block."""
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in SUPPORTED]
    if not targets:
        kinds = sorted({type(m).__name__ for _, m in model.named_modules() if "moe" in type(m).__name__.lower()
                        or "expert" in type(m).__name__.lower()})
        raise TypeError(f"{type(model).__name__} has no MoE block tritonmoe.hf supports ({', '.join(SUPPORTED)}); "
                        f"its MoE-like modules: {kinds or 'none'}")
    for name, block in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = from_hf(block, backend=backend, aux_loss_coef=aux_loss_coef, loss_convention=loss_convention)
        layer.train(block.training)
        setattr(parent, attr, HFMoEBlock(layer, type(block).__name__))
    return [n for n, _ in targets]


def _experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call ``(hidden_states [T, D], top_k_index [T, k], top_k_weights)``
    on tritonmoe's fused expert FFN (the block's routing; transformers' gate-up experts)."""
    from .functional import moe_ffn
    from .types import Routing

    if getattr(self, "has_bias", False) or not getattr(self, "has_gate", True) or getattr(self, "is_transposed", False):
        raise NotImplementedError(f"the tritonmoe experts implementation runs gate-up SwiGLU experts without biases; "
                                  f"{type(self).__name__} needs the eager implementation")
    E = self.num_experts
    ids = top_k_index.to(torch.int32)
    valid = (ids >= 0) & (ids < E)  # expert-parallel sentinels (ids >= E) are not routed here
    counts = torch.bincount(ids[valid].long(), minlength=E).to(torch.int32)
    routing = Routing(topk_ids=torch.where(valid, ids, torch.full_like(ids, -1)), topk_weights=top_k_weights.float(),
                      counts=counts, selected_counts=counts)
    w1 = self.gate_up_proj.transpose(1, 2)
    w2 = self.down_proj.transpose(1, 2)
    return moe_ffn(hidden_states, routing, w1, w2, "swiglu")


def register_experts_implementation(name: str = "tritonmoe") -> Callable:
    """Register tritonmoe's fused expert FFN as the transformers experts implementation ``name``
    (transformers >= 5 has the registry): a model loaded with
    ``from_pretrained(..., experts_implementation=name)`` (or ``config._experts_implementation =
    name``) keeps its own routing and runs its experts through :func:`tritonmoe.moe_ffn`."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        raise ImportError("this transformers has no experts-implementation registry (transformers >= 5 has); use "
                          "tritonmoe.hf.apply(model) instead") from e
    ALL_EXPERTS_FUNCTIONS.register(name, _experts_forward)
    return _experts_forward
