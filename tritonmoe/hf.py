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

Training a patched model: :class:`HFMoEBlock` hands its layer's router logits to transformers'
output collector (``output_router_logits=True``: the model's ``router_logits`` and ``aux_loss``
are there and train the router) and applies Mixtral's ``router_jitter_noise`` in training.
Refused with :class:`HFConversionError` (a ``TypeError``), naming why: Llama 4's and PhiMoE's
blocks (:data:`UNSUPPORTED`). :func:`apply` and :func:`to_hf` are all or nothing;
:func:`restore` undoes :func:`apply` and refuses a partially converted model.

Load-balancing loss: transformers' ``load_balancing_loss_func`` (Mixtral, Qwen, OLMoE) equals
``top_k`` times tritonmoe's :func:`tritonmoe.load_balancing_loss` on the same routing (its
fraction of tokens per expert sums over the k slots; tritonmoe's is normalized by T*k so that a
balanced router scores 1). ``from_hf(..., aux_loss_coef=c, loss_convention="transformers")``
scales the layer's coefficient by ``top_k`` so that ``layer.aux_loss`` equals
``c * load_balancing_loss_func(...)`` of that block; ``"tritonmoe"`` (default) keeps ``c``.
"""

from __future__ import annotations

import contextvars
import copy
from typing import Callable, Optional

import torch
from torch import nn

from .config import MoEConfig
from .layer import MoELayer

__all__ = ["SUPPORTED", "UNSUPPORTED", "HFConversionError", "config_from_hf", "from_hf", "to_hf", "apply", "restore",
           "HFMoEBlock", "register_experts_implementation"]

#: Class names of the supported transformers MoE blocks.
SUPPORTED = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock",
             "DeepseekV3MoE", "GptOssMLP")
LOSS_CONVENTIONS = ("tritonmoe", "transformers")


#: Blocks tritonmoe cannot express, and what they do that it lacks.
UNSUPPORTED = {
    "Llama4TextMoe": (
        "Llama 4 multiplies each expert's *input* by the router's sigmoid score (routed_in = x * score) before the "
        "experts; tritonmoe weights the experts' *outputs*, which differs for SwiGLU experts"
    ),
    "PhimoeSparseMoeBlock": (
        "PhiMoE routes with SparseMixer (a masked, jittered softmax per slot: router_jitter_noise, "
        "input_jitter_noise) that tritonmoe's router does not implement"
    ),
}


class HFConversionError(TypeError):
    """A transformers block or option tritonmoe.hf cannot convert (names what is missing)."""


def _kind(block: nn.Module) -> str:
    name = type(block).__name__
    if isinstance(block, HFMoEBlock):
        raise HFConversionError(
            f"this block is already a tritonmoe HFMoEBlock (installed by tritonmoe.hf.apply); its layer is block.moe, "
            "and tritonmoe.hf.restore(model) puts the transformers blocks back"
        )
    if name in UNSUPPORTED:
        raise HFConversionError(f"tritonmoe.hf cannot convert {name}: {UNSUPPORTED[name]}")
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


def _jitter(block: nn.Module) -> float:
    """Mixtral's ``router_jitter_noise`` (the block's ``jitter_noise``): in training the block
    multiplies its input by U(1 - j, 1 + j) noise before routing and the experts."""
    return float(getattr(block, "jitter_noise", 0.0) or 0.0)


def from_hf(block: nn.Module, *, aux_loss_coef: float = 0.0, loss_convention: str = "tritonmoe",
            backend: Optional[str] = None, ignore_router_jitter: bool = False) -> MoELayer:
    """A :class:`~tritonmoe.MoELayer` computing what ``block`` computes, with a copy of its
    weights, in its dtype and on its device (the router in fp32 where the block computes it so).

    A block with Mixtral's ``router_jitter_noise`` > 0 multiplies its input by noise in training,
    which a bare MoELayer does not: ``from_hf`` refuses it (``ValueError``) unless
    ``ignore_router_jitter=True`` (e.g. for inference, where the block applies none);
    :class:`HFMoEBlock` / :func:`apply` apply the noise as the block does."""
    cfg = config_from_hf(block, aux_loss_coef=aux_loss_coef, loss_convention=loss_convention, backend=backend)
    if _jitter(block) > 0 and not ignore_router_jitter:
        raise ValueError(
            f"{type(block).__name__} has router_jitter_noise={_jitter(block)}: in training it multiplies its input by "
            "U(1-j, 1+j) noise, which a bare MoELayer does not do. Use tritonmoe.hf.HFMoEBlock.from_hf(block) (or "
            "hf.apply(model)), which applies it, or pass ignore_router_jitter=True to convert without it (inference)"
        )
    dtype, device = _block_dtype_device(block)
    layer = MoELayer(cfg, device=device, dtype=dtype)
    state = hf_to_tensors(block)
    with torch.no_grad():
        own = layer.state_dict()
        for name, t in state.items():
            own[name].copy_(t)
    return layer


def _config_fields(cfg: MoEConfig) -> dict:
    """The fields of a config that fix what a converted block computes (not the training or
    runtime options: aux-loss coefficients, backend, schedules)."""
    skip = {"aux_loss_coef", "z_loss_coef", "backend", "ffn_path", "parm_schedule", "cost_model", "pipeline_degree",
            "ep_capacity", "capacity_factor", "memory_strategy", "memory_budget_bytes", "memory_mi_buffers"}
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


@torch.no_grad()
def to_hf(layer: MoELayer, block: nn.Module) -> nn.Module:
    """Copy ``layer``'s weights into ``block`` (in place; the block's dtypes) and return it.

    All or nothing: before anything is written, the layer must compute what the block computes
    (every option :func:`config_from_hf` derives from the block, not only the shapes) and hold
    every expert (a layer whose experts are partitioned over ranks, expert-parallel or Parm,
    holds a shard: gather the full weights first), and the conversion must write every
    parameter of the block; otherwise ``ValueError`` names what differs or is missing and the
    block is left as it was. ``layer`` may be an :class:`HFMoEBlock` (its ``moe`` is used)."""
    if isinstance(layer, HFMoEBlock):
        layer = layer.moe
    if not isinstance(layer, MoELayer):
        raise TypeError(f"layer must be a tritonmoe.MoELayer, got {type(layer).__name__}")
    want = _config_fields(config_from_hf(block))
    have = _config_fields(layer.config)
    diff = [f"{k}={have[k]!r} (the block's: {want[k]!r})" for k in want if have[k] != want[k]]
    if diff:
        raise ValueError(f"the layer does not compute what {type(block).__name__} computes: its {'; '.join(diff)}; "
                         "convert between a layer and a block of the same architecture and shape")
    params = dict(block.named_parameters())
    params.update(dict(block.named_buffers()))
    state = dict(layer.state_dict())
    for name in ("w1", "w2"):
        t = state[name]
        if hasattr(t, "full_tensor") or t.shape[0] != layer.config.num_experts:
            raise ValueError(
                f"the layer holds {t.shape[0] if not hasattr(t, 'full_tensor') else 'a sharded tensor of'} experts "
                f"in {name}, not all {layer.config.num_experts} (expert-parallel or Parm layouts partition them): gather "
                "the full weights into a local MoELayer (tm.MoELayer(cfg) + load_state_dict) before to_hf"
            )
    out = tensors_to_hf(state, block)
    missing = [n for n, p in block.named_parameters() if n not in out]
    unknown = [n for n in out if n not in params]
    bad_shape = [f"{n} {tuple(t.shape)} vs {tuple(params[n].shape)}" for n, t in out.items()
                 if n in params and tuple(t.shape) != tuple(params[n].shape)]
    if missing or unknown or bad_shape:
        raise ValueError(
            f"to_hf would convert {type(block).__name__} only partially (nothing was written): "
            + "; ".join(x for x in (
                f"parameters the layer has no value for: {missing}" if missing else "",
                f"names the block does not have: {unknown}" if unknown else "",
                f"shapes that differ: {bad_shape}" if bad_shape else "",
            ) if x)
        )
    for name, t in out.items():
        params[name].copy_(t)
    return block


def _record_router_logits(logits: Optional[torch.Tensor]) -> None:
    """Hand the layer's router logits to transformers' output collector when the running model
    asked for them (``output_router_logits=True``: its load-balancing loss reads them). The
    collector is transformers' own (``transformers.utils.output_capturing``), the one its
    router hooks append to; absent in other versions, nothing is recorded."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - another transformers layout
        return
    collected = _active_collector.get()
    if collected is not None and "router_logits" in collected and logits is not None:
        collected["router_logits"].append(logits)


#: The attention mask of the model forward in progress (set by the hook :func:`apply` installs).
_attention_mask: contextvars.ContextVar[Optional[torch.Tensor]] = contextvars.ContextVar(
    "tritonmoe_hf_attention_mask", default=None)
_MASK_HOOKS = "_tritonmoe_mask_hooks"


def _capture_mask(module, args, kwargs):
    mask = kwargs.get("attention_mask")
    _attention_mask.set(mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)


def _release_mask(module, args, kwargs, output):
    _attention_mask.set(None)


def _padding_mask(hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
    """The model's 2-D attention mask ([B, S_total], 1 = a real token) as the layer's padding
    mask for ``hidden_states`` [B, S, D]: its last S columns (a generation step's new tokens);
    None when there is none or the shapes do not fit."""
    mask = _attention_mask.get()
    if mask is None or hidden_states.dim() != 3:
        return None
    B, S = hidden_states.shape[:2]
    if mask.shape[0] != B or mask.shape[1] < S:
        return None
    return mask[:, mask.shape[1] - S:].to(device=hidden_states.device).bool()


class HFMoEBlock(nn.Module):
    """A transformers MoE block replaced by a :class:`~tritonmoe.MoELayer` (what :func:`apply`
    installs): the same call (``hidden_states`` [..., D]) and return value (GPT-OSS's block also
    returns its routing weights).

    * ``output_router_logits=True`` (training with transformers' load-balancing loss): the
      layer's router logits (:attr:`MoELayer.last_router_logits`, in the graph) go to
      transformers' collector where the block's router would have put them, so the model's
      ``router_logits`` and ``aux_loss`` are there and train the router.
    * Mixtral's ``router_jitter_noise``: in training the input is multiplied by U(1-j, 1+j)
      noise before the layer, drawn exactly as the block draws it (same generator calls).
    * Padding: the model's ``attention_mask`` (captured by a hook on the model that
      :func:`apply` installs) reaches the layer as its ``padding_mask``, so padded tokens leave
      the balance and z losses and the expert load counts.
    * :func:`restore` puts the transformers block back: the original module is kept on the meta
      device (no memory; not a submodule, so not in ``parameters()``)."""

    def __init__(self, layer: MoELayer, kind: str, *, jitter_noise: float = 0.0, original: Optional[nn.Module] = None):
        super().__init__()
        self.moe = layer
        self.kind = kind
        self.jitter_noise = float(jitter_noise)
        self.__dict__["_original"] = original  # not registered: no parameters, no state-dict keys

    @classmethod
    def from_hf(cls, block: nn.Module, *, keep_original: bool = True, **kwargs) -> "HFMoEBlock":
        """The replacement of ``block`` (``kwargs`` as :func:`from_hf`)."""
        kind = _kind(block)
        layer = from_hf(block, ignore_router_jitter=True, **kwargs)
        layer.train(block.training)
        original = _meta_copy(block) if keep_original else None
        return cls(layer, kind, jitter_noise=_jitter(block), original=original)

    def forward(self, hidden_states: torch.Tensor):
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, as transformers draws it
            j = self.jitter_noise
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - j, 1.0 + j)
        out = self.moe(hidden_states, padding_mask=_padding_mask(hidden_states))
        _record_router_logits(self.moe.last_router_logits)
        if self.kind == "GptOssMLP":
            return out, self.moe.last_routing.topk_weights.to(out.dtype)
        return out


def _meta_copy(block: nn.Module) -> nn.Module:
    """A copy of ``block`` whose parameters are on the meta device (no memory, nothing copied);
    buffers (small: e.g. rotary tables, a correction bias) are copied as they are."""
    memo = {id(p): nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad) for p in block.parameters()}
    return copy.deepcopy(block, memo)


def _materialize(block: nn.Module, device: torch.device, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Give a meta copy's parameters (uninitialized) storage on ``device``; buffers move there.
    ``dtype``: the layer's current dtype; when the copy's floating tensors all had one dtype (the
    model's at apply time) they take ``dtype`` (the model was cast since, e.g. ``model.float()``);
    a block that mixed dtypes keeps each tensor's own."""
    floats = {t.dtype for t in list(block.parameters()) + list(block.buffers()) if t.is_floating_point()}
    cast = dtype if dtype is not None and len(floats) == 1 and dtype not in floats else None
    for module in block.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                dt = cast if cast is not None and p.is_floating_point() else p.dtype
                module._parameters[name] = nn.Parameter(torch.empty_like(p, device=device, dtype=dt),
                                                        requires_grad=p.requires_grad)
    block = block.to(device)
    return block.to(cast) if cast is not None else block


def apply(model: nn.Module, *, backend: Optional[str] = None, aux_loss_coef: float = 0.0,
          loss_convention: str = "tritonmoe") -> list[str]:
    """Replace every supported MoE block of ``model`` (in place) by an :class:`HFMoEBlock` holding
    a converted :class:`~tritonmoe.MoELayer`; returns the replaced modules' names. All or
    nothing: every block is converted before the first is replaced, so a block that fails to
    convert leaves the model as it was. Raises ``TypeError`` when the model has no supported
    block, or has a block tritonmoe cannot express (:data:`UNSUPPORTED`, e.g. Llama 4's or
    PhiMoE's)."""
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in SUPPORTED]
    refused = [(name, type(m).__name__) for name, m in model.named_modules() if type(m).__name__ in UNSUPPORTED]
    if refused:
        name, kind = refused[0]
        raise HFConversionError(f"{type(model).__name__}.{name} is a {kind}: {UNSUPPORTED[kind]}; nothing was replaced")
    if not targets:
        kinds = sorted({type(m).__name__ for _, m in model.named_modules() if "moe" in type(m).__name__.lower()
                        or "expert" in type(m).__name__.lower()})
        raise TypeError(f"{type(model).__name__} has no MoE block tritonmoe.hf supports ({', '.join(SUPPORTED)}); "
                        f"its MoE-like modules: {kinds or 'none'}")
    made = [(name, HFMoEBlock.from_hf(block, backend=backend, aux_loss_coef=aux_loss_coef,
                                      loss_convention=loss_convention)) for name, block in targets]
    for name, new in made:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    if _MASK_HOOKS not in model.__dict__:  # the attention mask reaches the blocks as their padding mask
        model.__dict__[_MASK_HOOKS] = (model.register_forward_pre_hook(_capture_mask, with_kwargs=True),
                                       model.register_forward_hook(_release_mask, with_kwargs=True, always_call=True))
    return [n for n, _ in targets]


@torch.no_grad()
def restore(model: nn.Module) -> list[str]:
    """The reverse of :func:`apply`: put a transformers block back for every :class:`HFMoEBlock`
    of ``model``, holding the layer's (trained) weights (:func:`to_hf`), on the layer's device
    and in its current dtype (after ``model.float()`` etc. too); returns the restored modules' names.

    Refuses (``ValueError``, nothing changed) a partially converted model: one that mixes
    HFMoEBlocks with supported transformers blocks still unconverted (``apply`` on a submodule,
    blocks replaced by hand), since the result would depend on which were converted; and an
    HFMoEBlock without its original block (built with ``keep_original=False``)."""
    converted = [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    plain = [n for n, m in model.named_modules() if type(m).__name__ in SUPPORTED]
    if not converted:
        raise ValueError(f"{type(model).__name__} has no HFMoEBlock (tritonmoe.hf.apply installs them); nothing to restore")
    if plain:
        raise ValueError(
            f"{type(model).__name__} is partially converted: {[n for n, _ in converted]} are tritonmoe HFMoEBlocks but "
            f"{plain} are still transformers blocks. Convert the rest (tritonmoe.hf.apply(model)) or restore the "
            "blocks one by one (tritonmoe.hf.to_hf(layer, block)); nothing was changed"
        )
    lost = [n for n, m in converted if m._original is None]
    if lost:
        raise ValueError(f"the HFMoEBlocks {lost} do not keep their original block (keep_original=False): restore them "
                         "with tritonmoe.hf.to_hf(block.moe, a_new_transformers_block); nothing was changed")
    made = []
    for name, m in converted:
        block = _materialize(copy.deepcopy(m._original), m.moe.w1.device, m.moe.w1.dtype)
        to_hf(m.moe, block)  # writes every parameter (or raises): nothing stays uninitialized
        block.train(m.training)
        made.append((name, block))
    for name, block in made:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, block)
    for h in model.__dict__.pop(_MASK_HOOKS, ()):
        h.remove()
    return [n for n, _ in made]


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
