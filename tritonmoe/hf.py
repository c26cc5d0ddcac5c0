"""Hugging Face transformers interoperability (``pip install tritonmoe[hf]``).

Convert a transformers MoE block to a :class:`~tritonmoe.MoELayer` and back, patch a loaded model
in place, or register tritonmoe as an experts implementation of transformers::

    layer = tritonmoe.hf.from_hf(model.model.layers[3].mlp)      # a MoELayer with the block's weights
    tritonmoe.hf.to_hf(layer, block)                              # copy (trained) weights back
    tritonmoe.hf.apply(model)                                     # every MoE block -> tritonmoe
    tritonmoe.hf.restore(model)                                   # and back
    tritonmoe.hf.use_experts_implementation(model)                # or: only the experts run on tritonmoe

**By structure, not by name.** A block is any module with an ``experts`` module and a ``gate`` /
``router`` module; :func:`tritonmoe.hf_structure.inspect_block` reads what it computes: the
experts' layout and activation (transformers' ``use_experts_implementation`` flags, shapes), the
router's weight wherever it sits, its routing function (found by running a float64 copy of the
router with random weights and matching its top-k against tritonmoe's routings), the shared
experts and their gate, Mixtral/DBRX router jitter. Then :func:`from_hf` runs the block and the
converted layer on a probe batch (fp32/fp64 blocks) and refuses a conversion that does not
reproduce the block. A block tritonmoe cannot express raises :class:`HFConversionError` (a
``TypeError``) naming every feature that blocks it and the experts-registry path where that works
(:data:`tritonmoe.hf_structure.KNOWN_GAPS`; docs/hf.md has the table of architectures).

Weight layouts: transformers' fused experts hold ``gate_up_proj`` [E, 2F, D] and ``down_proj``
[E, D, F] (``F.linear`` convention; ``is_transposed``: [E, D, 2F] and [E, F, D]; GPT-OSS's gate
and up interleaved; DBRX: ``mlp.w1``/``v1``/``w2`` [E*F, D]); tritonmoe's ``w1`` is [E, D, 2F]
(gate, then up) and ``w2`` [E, F, D]. The conversion copies, in the block's dtype and device.

**fp64.** transformers' default experts implementation (``grouped_mm``) does not take float64;
compare a model in fp64 inside ``with tritonmoe.hf.eager_experts(model):`` (it sets
``config._experts_implementation = "eager"`` on the model's configs and puts the old value back),
or call ``model.set_experts_implementation("eager")``. :func:`from_hf`'s probe does it itself.

Training a patched model: :class:`HFMoEBlock` hands its layer's router logits to transformers'
output collector (``output_router_logits=True``: the model's ``router_logits`` and ``aux_loss``
are there and train the router) and applies Mixtral's ``router_jitter_noise`` / DBRX's
``moe_jitter_eps`` in training. :func:`apply` and :func:`to_hf` are all or nothing;
:func:`restore` undoes :func:`apply` and refuses a partially converted model.

Load-balancing loss: transformers' ``load_balancing_loss_func`` (Mixtral, Qwen, OLMoE) equals
``top_k`` times tritonmoe's :func:`tritonmoe.load_balancing_loss` on the same routing (its
fraction of tokens per expert sums over the k slots; tritonmoe's is normalized by T*k so that a
balanced router scores 1). ``from_hf(..., aux_loss_coef=c, loss_convention="transformers")``
scales the layer's coefficient by ``top_k`` so that ``layer.aux_loss`` equals
``c * load_balancing_loss_func(...)`` of that block; ``"tritonmoe"`` (default) keeps ``c``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import os
from typing import Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from .config import MoEConfig
from .hf_structure import (KNOWN_GAPS, REGISTRY_HINT, BlockSpec, HFConversionError, experts_layout, inspect_block,
                           is_moe_block, registry_ready)
from .layer import MoELayer, hold_fp8_experts
from .fp8 import FP8Experts, load_fp8_experts
from .fp8_reference import dequantize_weight
from tritonmoe.functional import moe_ffn
from tritonmoe.core.types import Routing

__all__ = ["UNSUPPORTED", "HFConversionError", "BlockSpec", "inspect_block", "is_moe_block", "config_from_hf",
           "from_hf", "to_hf", "apply", "restore", "HFMoEBlock", "eager_experts", "register_experts_implementation",
           "use_experts_implementation", "hf_to_tensors", "tensors_to_hf", "checkpoint_tensors",
           "load_fp8_checkpoint"]

LOSS_CONVENTIONS = ("tritonmoe", "transformers")
#: Known blocks tritonmoe cannot express and why (message text; the decision is structural).
UNSUPPORTED = KNOWN_GAPS


def _spec(block: nn.Module) -> BlockSpec:
    if isinstance(block, HFMoEBlock):
        raise HFConversionError(
            f"this block is already a tritonmoe HFMoEBlock (installed by tritonmoe.hf.apply); its layer is block.moe, "
            "and tritonmoe.hf.restore(model) puts the transformers blocks back"
        )
    return inspect_block(block)


def _block_dtype(block: nn.Module) -> torch.dtype:
    w = next((p for n, p in block.named_parameters() if n.startswith("experts.")), None)
    return w.dtype if w is not None else torch.get_default_dtype()


def config_from_hf(block: nn.Module, *, aux_loss_coef: float = 0.0, loss_convention: str = "tritonmoe",
                   backend: Optional[str] = None, spec: Optional[BlockSpec] = None) -> MoEConfig:
    """The :class:`~tritonmoe.MoEConfig` of a transformers MoE block (see the module docstring)."""
    spec = spec if spec is not None else _spec(block)
    if loss_convention not in LOSS_CONVENTIONS:
        raise ValueError(f"loss_convention={loss_convention!r}; use one of {LOSS_CONVENTIONS}")
    x = spec.experts
    coef = float(aux_loss_coef) * (spec.top_k if loss_convention == "transformers" else 1)
    return MoEConfig(x.d_model, x.d_ffn, x.num_experts, spec.top_k, aux_loss_coef=coef, backend=backend,
                     **spec.options(_block_dtype(block)))


def hf_to_tensors(block: nn.Module, spec: Optional[BlockSpec] = None) -> dict[str, torch.Tensor]:
    """The block's weights as a :class:`~tritonmoe.MoELayer` state dict (tritonmoe layouts)."""
    spec = spec if spec is not None else _spec(block)
    out = {"router.weight": block.get_parameter(spec.router_weight)}
    if spec.router_bias is not None:
        out["router.bias"] = block.get_parameter(spec.router_bias)
    out.update(spec.experts.to_tritonmoe(block.experts))
    if spec.shared is not None:
        m = getattr(block, spec.shared)
        if spec.shared_style == "input_output":
            out["shared_experts.w1"], out["shared_experts.w2"] = m.input_linear.weight.t(), m.output_linear.weight.t()
        else:
            out["shared_experts.w1"] = torch.cat([m.gate_proj.weight.t(), m.up_proj.weight.t()], dim=1)
            out["shared_experts.w2"] = m.down_proj.weight.t()
    if spec.shared_gate is not None:
        out["shared_experts.gate"] = getattr(block, spec.shared_gate).weight[0]
    if spec.selection_bias is not None:
        out["expert_bias"] = _tensor(block, spec.selection_bias).reshape(-1).float()
    return {n: t.detach() for n, t in out.items()}


def _tensor(block: nn.Module, name: str) -> torch.Tensor:
    mod, _, attr = name.rpartition(".")
    return getattr(block.get_submodule(mod) if mod else block, attr)


def tensors_to_hf(tensors: dict[str, torch.Tensor], block: nn.Module,
                  spec: Optional[BlockSpec] = None) -> dict[str, torch.Tensor]:
    """tritonmoe-layout tensors (a layer's state dict, or its gradients by parameter name) as the
    block's parameter and buffer names and layouts (the inverse of :func:`hf_to_tensors`)."""
    spec = spec if spec is not None else _spec(block)
    t = tensors
    out = {spec.router_weight: t["router.weight"]}
    if spec.router_bias is not None and "router.bias" in t:
        out[spec.router_bias] = t["router.bias"]
    out.update(spec.experts.from_tritonmoe(t))
    if spec.shared is not None and "shared_experts.w1" in t:
        w1, w2, p = t["shared_experts.w1"], t["shared_experts.w2"], spec.shared
        if spec.shared_style == "input_output":
            out[f"{p}.input_linear.weight"], out[f"{p}.output_linear.weight"] = w1.t(), w2.t()
        else:
            fs = w1.shape[1] // 2
            out[f"{p}.gate_proj.weight"], out[f"{p}.up_proj.weight"] = w1[:, :fs].t(), w1[:, fs:].t()
            out[f"{p}.down_proj.weight"] = w2.t()
    if spec.shared_gate is not None and "shared_experts.gate" in t:
        out[f"{spec.shared_gate}.weight"] = t["shared_experts.gate"].unsqueeze(0)
    if spec.selection_bias is not None and "expert_bias" in t:
        out[spec.selection_bias] = t["expert_bias"].reshape(_tensor(block, spec.selection_bias).shape)
    return out


def _configs(module: nn.Module) -> list:
    seen: dict[int, object] = {}
    for m in module.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "to_dict") and id(c) not in seen:
            seen[id(c)] = c
    return list(seen.values())


@contextlib.contextmanager
def eager_experts(module: nn.Module) -> Iterator[nn.Module]:
    """Run ``module``'s transformers experts with the eager implementation inside the block (the
    one that takes float64; the default ``grouped_mm`` does not): sets
    ``config._experts_implementation = "eager"`` on every config of ``module`` and restores it."""
    configs = _configs(module)
    old = [c.__dict__.get("_experts_implementation", None) for c in configs]
    try:
        for c in configs:
            c._experts_implementation = "eager"
        yield module
    finally:
        for c, v in zip(configs, old):
            c._experts_implementation = v


@contextlib.contextmanager
def _evaluating(block: nn.Module):
    modes = [(m, m.training) for m in block.modules()]
    block.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.train(mode)


def _probe(block: nn.Module, layer: MoELayer) -> bool:
    """Run the block and the layer on a probe batch: the block's return kind (a tuple: GPT-OSS's
    (out, weights)), and for fp32/fp64 blocks a check that the layer computes what the block
    computes (anything the structure did not show, e.g. another way of combining shared experts)."""
    w = layer.w1
    if w.is_meta:
        return False
    D = layer.config.d_model
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(1, 8, D, generator=g, dtype=torch.float64).to(device=w.device, dtype=w.dtype)
    with torch.no_grad(), _evaluating(block), eager_experts(block):
        try:
            out = block(x.clone())
        except Exception as e:  # noqa: BLE001 - a block whose forward needs more than the hidden states
            raise HFConversionError(
                f"{type(block).__name__}'s forward does not run on hidden states alone ({type(e).__name__}: "
                f"{str(e)[:160]}); a MoELayer takes only them. Alternative: {REGISTRY_HINT}") from e
        got = layer(x)
    tup = isinstance(out, tuple)
    want = out[0] if tup else out
    # an uninitialized block (torch.empty weights) gives NaN/inf: nothing to compare against
    if w.dtype in (torch.float32, torch.float64) and bool(torch.isfinite(want).all()):
        tol = 1e-5 if w.dtype == torch.float64 else 2e-3
        err = (got.double() - want.double()).abs().max().item()
        scale = max(want.double().abs().max().item(), 1e-30)
        if not err <= tol * scale:
            raise HFConversionError(
                f"converting {type(block).__name__} gives a layer that does not compute what the block computes "
                f"(max |difference| {err:.3g} on a probe batch, output scale {scale:.3g}): its forward does something "
                f"its structure does not show, which tritonmoe.hf cannot express; nothing was converted. Alternative: "
                f"{REGISTRY_HINT}"
            )
    return tup


def from_hf(block: nn.Module, *, aux_loss_coef: float = 0.0, loss_convention: str = "tritonmoe",
            backend: Optional[str] = None, ignore_router_jitter: bool = False, verify: bool = True) -> MoELayer:
    """A :class:`~tritonmoe.MoELayer` computing what ``block`` computes, with a copy of its
    weights, in its dtype and on its device (the router in fp32 where the block computes it so).

    ``verify``: run the block and the layer on a probe batch of 8 tokens (eval mode, no grad) and
    raise :class:`HFConversionError` if they differ (fp32/fp64 blocks; lower precisions are not
    compared: their routing may tie).

    A block with router jitter (Mixtral's ``router_jitter_noise``, DBRX's ``moe_jitter_eps``) > 0
    multiplies its input by noise in training, which a bare MoELayer does not: ``from_hf``
    refuses it (``ValueError``) unless ``ignore_router_jitter=True`` (e.g. for inference, where the
    block applies none); :class:`HFMoEBlock` / :func:`apply` apply the noise as the block does."""
    return _convert(block, aux_loss_coef=aux_loss_coef, loss_convention=loss_convention, backend=backend,
                    ignore_router_jitter=ignore_router_jitter, verify=verify)[0]


def _convert(block: nn.Module, *, aux_loss_coef=0.0, loss_convention="tritonmoe", backend=None,
             ignore_router_jitter=False, verify=True, fp8: Optional[tuple[Mapping, str]] = None
             ) -> tuple[MoELayer, BlockSpec, bool]:
    """``fp8``: (an FP8 checkpoint's tensors, the block's experts prefix in it): the layer holds
    those experts in e4m3 (see :func:`apply`)."""
    spec = _spec(block)
    experts = _block_fp8_experts(*fp8, spec.experts.num_experts, block) if fp8 is not None else None
    cfg = config_from_hf(block, aux_loss_coef=aux_loss_coef, loss_convention=loss_convention, backend=backend,
                         spec=spec)
    if spec.jitter > 0 and not ignore_router_jitter:
        raise ValueError(
            f"{type(block).__name__} has router_jitter_noise={spec.jitter}: in training it multiplies its input by "
            "U(1-j, 1+j) noise, which a bare MoELayer does not do. Use tritonmoe.hf.HFMoEBlock.from_hf(block) (or "
            "hf.apply(model)), which applies it, or pass ignore_router_jitter=True to convert without it (inference)"
        )
    ref = next(p for n, p in block.named_parameters() if n.startswith("experts."))
    layer = MoELayer(cfg, device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        own = layer.state_dict()
        for name, t in hf_to_tensors(block, spec).items():
            own[name].copy_(t)
    returns_tuple = _probe(block, layer) if verify else False
    if experts is not None:
        layer = _fp8_layer(layer, experts)
    return layer, spec, returns_tuple


def _fp8_layer(layer: MoELayer, experts: FP8Experts) -> MoELayer:
    """``layer`` (converted and probed with the block's own weights: the structure is checked)
    rebuilt with ``expert_dtype="fp8_e4m3"`` holding ``experts`` in e4m3, its other tensors copied."""
    c = layer.config
    if (experts.num_experts, experts.d_model, experts.d_ffn) != (c.num_experts, c.d_model, c.d_ffn):
        raise HFConversionError(
            f"the FP8 experts are {experts.num_experts} x (d_model={experts.d_model}, d_ffn={experts.d_ffn}) but the "
            f"block has {c.num_experts} x (d_model={c.d_model}, d_ffn={c.d_ffn}); load the checkpoint of this model")
    if c.activation != "swiglu" or c.expert_ffn_bias:
        raise HFConversionError(f"FP8 experts run SwiGLU experts without biases; this block has activation="
                                f"{c.activation!r}{' with expert biases' if c.expert_ffn_bias else ''}")
    cfg = dataclasses.replace(c, expert_dtype="fp8_e4m3", fp8_recipe=experts.format[len("e4m3_"):])
    w = layer.w1
    new = MoELayer(cfg, device=w.device, dtype=w.dtype)
    hold_fp8_experts(new, experts)
    rest = {n: t for n, t in layer.state_dict().items() if n not in ("w1", "w2")}
    missing, unexpected = new.load_state_dict(rest, strict=False)
    stray = list(unexpected) + [n for n in missing if n not in ("w1", "w2") and not n.startswith("fp8_experts.")]
    if stray:  # the FP8 layer must take every tensor of the converted one but its 16-bit experts
        raise HFConversionError(f"the FP8 layer does not match the converted block's state dict ({stray}); this is "
                                "a tritonmoe bug: please report it with the model's config")
    new.train(layer.training)
    return new


def _config_fields(cfg: MoEConfig) -> dict:
    """The fields of a config that fix what a converted block computes (not the training or
    runtime options: aux-loss coefficients, backend, schedules)."""
    skip = {"aux_loss_coef", "z_loss_coef", "backend", "ffn_path", "parm_schedule", "cost_model", "pipeline_degree",
            "ep_capacity", "capacity_factor", "memory_strategy", "memory_budget_bytes", "memory_mi_buffers"}
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
    if layer._modules.get("fp8_experts") is not None:
        raise ValueError("the layer holds its experts in e4m3 (an FP8 checkpoint's, hold_fp8_experts); to_hf writes "
                         "16-bit weights and will not dequantize silently: write layer.fp8_experts.experts()"
                         ".dequantize() into the block yourself, or keep the FP8 checkpoint")
    spec = _spec(block)
    want = _config_fields(config_from_hf(block, spec=spec))
    have = _config_fields(layer.config)
    want["router_dtype"] = have["router_dtype"]  # where the router computes, not what: either converts exactly
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
    out = tensors_to_hf(state, block, spec)
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
    * Mixtral's ``router_jitter_noise`` (DBRX's ``moe_jitter_eps``): in training the input is multiplied by U(1-j, 1+j)
      noise before the layer, drawn exactly as the block draws it (same generator calls).
    * Padding: the model's ``attention_mask`` (captured by a hook on the model that
      :func:`apply` installs) reaches the layer as its ``padding_mask``, so padded tokens leave
      the balance and z losses and the expert load counts.
    * :func:`restore` puts the transformers block back: the original module is kept on the meta
      device (no memory; not a submodule, so not in ``parameters()``)."""

    def __init__(self, layer: MoELayer, kind: str, *, jitter_noise: float = 0.0, original: Optional[nn.Module] = None,
                 returns_tuple: bool = False):
        super().__init__()
        self.moe = layer
        self.kind = kind
        self.jitter_noise = float(jitter_noise)
        self.returns_tuple = bool(returns_tuple)
        self.__dict__["_original"] = original  # not registered: no parameters, no state-dict keys

    @classmethod
    def from_hf(cls, block: nn.Module, *, keep_original: bool = True, **kwargs) -> "HFMoEBlock":
        """The replacement of ``block`` (``kwargs`` as :func:`from_hf`)."""
        layer, spec, returns_tuple = _convert(block, ignore_router_jitter=True, **kwargs)
        layer.train(block.training)
        original = _meta_copy(block) if keep_original else None
        return cls(layer, type(block).__name__, jitter_noise=spec.jitter, original=original, returns_tuple=returns_tuple)

    def forward(self, hidden_states: torch.Tensor):
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, as transformers draws it
            j = self.jitter_noise
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - j, 1.0 + j)
        out = self.moe(hidden_states, padding_mask=_padding_mask(hidden_states))
        _record_router_logits(self.moe.last_router_logits)
        if self.returns_tuple:  # GPT-OSS's block returns (out, routing weights)
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


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE blocks of ``model`` by structure (:func:`tritonmoe.hf_structure.is_moe_block`),
    outermost only (a block's own submodules are not searched)."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if isinstance(m, HFMoEBlock) or any(name.startswith(f"{n}.") for n, _ in found):
            continue
        if is_moe_block(m):
            found.append((name, m))
    return found


def apply(model: nn.Module, *, backend: Optional[str] = None, aux_loss_coef: float = 0.0,
          loss_convention: str = "tritonmoe", fp8_experts=None, fp8_prefix: str = "") -> list[str]:
    """Replace every MoE block of ``model`` (in place; found by structure) by an
    :class:`HFMoEBlock` holding a converted :class:`~tritonmoe.MoELayer`; returns the replaced
    modules' names. All or nothing: every block is converted before the first is replaced, so a
    block that cannot be converted leaves the model as it was: :class:`HFConversionError` names
    each refused block class, what blocks it and whether the experts-registry path
    (:func:`use_experts_implementation`) works instead. ``TypeError`` when the model has no MoE
    block.

    ``fp8_experts``: an FP8 checkpoint (a state dict, a ``.safetensors`` file or a directory of
    them; DeepSeek-V3 / Qwen3 FP8 keys ``<block>.experts.<j>.{gate,up,down}_proj.weight`` e4m3
    with ``weight_scale_inv`` 128x128 block scales, or ``weight_scale`` per channel). Each
    block's experts are read from it (:func:`tritonmoe.load_fp8_experts` under the prefix
    ``fp8_prefix + <block's module name> + ".experts."``) and held in e4m3 by the converted layer
    (:func:`tritonmoe.layer.hold_fp8_experts`: ``expert_dtype="fp8_e4m3"``, nothing dequantized;
    inference only). The block's structure is still checked on the probe batch with its own
    16-bit weights. :func:`load_fp8_checkpoint` loads a whole FP8 checkpoint this way."""
    targets = moe_blocks(model)
    if not targets:
        raise TypeError(f"{type(model).__name__} has no MoE block tritonmoe.hf reads (a module with an `experts` module "
                        "and a `gate`/`router` module with a 2-D weight); nothing was replaced")
    made, refused = [], {}
    sd = checkpoint_tensors(fp8_experts) if fp8_experts is not None else None
    for name, block in targets:
        try:
            fp8 = (sd, f"{fp8_prefix}{name}.experts.") if sd is not None else None
            made.append((name, HFMoEBlock.from_hf(block, backend=backend, aux_loss_coef=aux_loss_coef,
                                                  loss_convention=loss_convention, fp8=fp8)))
        except HFConversionError as e:
            refused.setdefault(type(block).__name__, (name, str(e)))
    if refused:
        parts = [f"{type(model).__name__}.{n} ({why})" for n, why in refused.values()]
        raise HFConversionError(f"{'; '.join(parts)}; nothing was replaced")
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
    HFMoEBlocks with transformers MoE blocks still unconverted (``apply`` on a submodule,
    blocks replaced by hand), since the result would depend on which were converted; and an
    HFMoEBlock without its original block (built with ``keep_original=False``)."""
    converted = [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    plain = [n for n, _ in moe_blocks(model)]
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
    on tritonmoe's fused expert FFN (the block's routing; any experts layout
    :func:`tritonmoe.hf_structure.experts_layout` reads)."""

    problems: list[str] = []
    lay = experts_layout(self, problems)
    if problems or lay is None:
        raise NotImplementedError(f"the tritonmoe experts implementation cannot run {type(self).__name__}: "
                                  f"{'; '.join(problems)}; use the eager implementation")
    E = lay.num_experts
    ids = top_k_index.to(torch.int32)
    valid = (ids >= 0) & (ids < E)  # expert-parallel sentinels (ids >= E) are not routed here
    counts = torch.bincount(ids[valid].long(), minlength=E).to(torch.int32)
    routing = Routing(topk_ids=torch.where(valid, ids, torch.full_like(ids, -1)), topk_weights=top_k_weights.float(),
                      counts=counts, selected_counts=counts)
    w = lay.to_tritonmoe(self)
    extra = {}
    if lay.activation == "swiglu_oai":
        extra = dict(swiglu_limit=lay.swiglu_limit, swiglu_alpha=lay.swiglu_alpha)
    return moe_ffn(hidden_states, routing, w["w1"], w["w2"], lay.activation, w.get("b1"), w.get("b2"), **extra)


def register_experts_implementation(name: str = "tritonmoe") -> Callable:
    """Register tritonmoe's fused expert FFN as the transformers experts implementation ``name``
    (transformers >= 5 has the registry): a model loaded with
    ``from_pretrained(..., experts_implementation=name)`` (or ``config._experts_implementation =
    name``) keeps its own routing and runs its experts through :func:`tritonmoe.moe_ffn`. Only
    experts classes decorated with transformers' ``use_experts_implementation`` dispatch through
    the registry: :func:`use_experts_implementation` checks that for a model (Llama 4's do not)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        raise ImportError("this transformers has no experts-implementation registry (transformers >= 5 has); use "
                          "tritonmoe.hf.apply(model) instead") from e
    ALL_EXPERTS_FUNCTIONS.register(name, _experts_forward)
    return _experts_forward


def use_experts_implementation(model: nn.Module, name: str = "tritonmoe") -> list[str]:
    """Register tritonmoe's experts implementation (:func:`register_experts_implementation`) and
    switch ``model`` to it (``config._experts_implementation = name`` on every config of the
    model); returns the names of the experts modules that now run on tritonmoe.

    Raises :class:`HFConversionError` (nothing changed) when an experts module of the model does
    not dispatch through the registry (Llama 4's experts run their own bmm: the setting would do
    nothing) or has a layout tritonmoe's function cannot run, and ``TypeError`` when the model has
    no MoE block."""
    blocks = moe_blocks(model)
    if not blocks:
        raise TypeError(f"{type(model).__name__} has no MoE block (a module with `experts` and a `gate`/`router`)")
    bad = {}
    for bname, block in blocks:
        why = registry_ready(block.experts)
        if why is not None:
            bad.setdefault(type(block.experts).__name__, f"{bname}.experts: {why}")
    if bad:
        raise HFConversionError(
            f"the experts-registry path cannot run {type(model).__name__}'s experts, nothing was changed: "
            f"{'; '.join(bad.values())}" + ("" if all(type(b).__name__ in KNOWN_GAPS for _, b in blocks) else
                                             ". tritonmoe.hf.apply(model) converts blocks whose structure it reads")
        )
    register_experts_implementation(name)
    for c in _configs(model):
        c._experts_implementation = name
    return [f"{n}.experts" if n else "experts" for n, _ in blocks]


class _SafetensorsIndex(Mapping):
    """The tensors of ``.safetensors`` files by name, read lazily (one tensor per lookup)."""

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open  # the [hf] extra (transformers depends on it)
        self._open, self._where = safe_open, {}
        for f in files:
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    self._where[k] = f

    def __getitem__(self, key: str) -> torch.Tensor:
        with self._open(self._where[key], framework="pt") as h:
            return h.get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def checkpoint_tensors(source) -> Mapping:
    """The tensors of a checkpoint by name: ``source`` a state dict (returned as is), a
    ``.safetensors`` file or a directory of them (read lazily: a tensor is loaded when looked up)."""
    if isinstance(source, Mapping):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a checkpoint is a state dict, a .safetensors file or a directory of them; got "
                        f"{type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"{path!r} is neither a file nor a directory")
    if not files:
        raise ValueError(f"{path!r} holds no .safetensors file")
    return _SafetensorsIndex(files)


def _block_fp8_experts(sd: Mapping, prefix: str, n: int, block: nn.Module) -> FP8Experts:
    if f"{prefix}0.gate_proj.weight" not in sd:
        raise HFConversionError(f"the FP8 checkpoint has no experts under {prefix!r} (expected "
                                f"'{prefix}0.gate_proj.weight'; pass fp8_prefix= if the model is a submodule of the "
                                "checkpoint's)")
    try:
        return load_fp8_experts(sd, prefix, n, device=next(block.parameters()).device)
    except (TypeError, ValueError) as e:
        raise HFConversionError(f"the FP8 experts under {prefix!r}: {e}") from e


def _dequantized(sd: Mapping, name: str, v: torch.Tensor) -> torch.Tensor:
    """A non-expert e4m3 ``weight`` of an FP8 checkpoint in fp32 (its block or channel scales)."""
    stem = name[: -len("weight")]
    if stem + "weight_scale_inv" in sd:
        return dequantize_weight(v, sd[stem + "weight_scale_inv"].float(), "e4m3_block128")
    if stem + "weight_scale" in sd:
        return dequantize_weight(v, sd[stem + "weight_scale"].float().reshape(-1), "e4m3_rowwise")
    raise ValueError(f"{name} is e4m3 but the checkpoint has no {stem}weight_scale_inv / weight_scale")


@torch.no_grad()
def load_fp8_checkpoint(model: nn.Module, source, *, backend: Optional[str] = None, strict: bool = True) -> list[str]:
    """Load an FP8 checkpoint (DeepSeek-V3 / Qwen3 FP8 as HF stores it: a state dict, a
    ``.safetensors`` file or a directory of them) into a transformers ``model`` built from its
    config, with the MoE experts kept in e4m3: every MoE block becomes an :class:`HFMoEBlock`
    whose layer holds its experts in FP8 (:func:`apply` with ``fp8_experts=``), inference only.

    The other weights load into the model's own modules in the model's dtypes; an e4m3 one
    (``weight`` with ``weight_scale_inv`` 128x128 block scales, or ``weight_scale`` per channel)
    is dequantized, since plain ``nn.Linear`` layers compute in 16/32 bits. ``strict``: raise
    ``ValueError`` (before anything is loaded) when a tensor of the model's state dict outside
    the experts has none in the checkpoint. Returns the replaced blocks' names."""
    sd = checkpoint_tensors(source)
    experts = tuple(f"{n}.experts." for n, _ in moe_blocks(model))
    own = model.state_dict(keep_vars=True)
    loaded, missing = {}, []
    for name, t in own.items():
        if name.startswith(experts):
            continue
        if name not in sd:
            missing.append(name)
            continue
        v = sd[name]
        v = _dequantized(sd, name, v) if v.dtype == torch.float8_e4m3fn else v
        if tuple(v.shape) != tuple(t.shape):
            raise ValueError(f"{name}: the checkpoint's shape is {tuple(v.shape)}, the model's {tuple(t.shape)}")
        loaded[name] = v
    # tied weights (e.g. lm_head = embed_tokens) are saved once
    missing = [n for n in missing if not any(own[n] is own[m] for m in loaded)]
    if missing and strict:
        raise ValueError(f"the checkpoint has no tensor for {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
                         "nothing was loaded (strict=False loads what is there)")
    for name, v in loaded.items():
        own[name].copy_(v)
    return apply(model, backend=backend, fp8_experts=sd)
