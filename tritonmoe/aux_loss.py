"""A MoE layer's load-balancing losses (``MoEConfig.aux_loss_type``) and how they reach the
gradient (``MoEConfig.aux_loss_mode``); docs/routing.md maps them to Megatron-Core's names.

* "switch": :func:`tritonmoe.load_balancing_loss` of the batch.
* "seq": the same loss per sequence, averaged over the batch (``sequence_length=S``).
* "global": the Switch loss whose frequencies f_e are accumulated over micro-batches and the
  ranks of a group (the data-parallel group, say) until :meth:`GlobalBalanceState.reset`. On
  micro-batch m of rank r::

      loss_{r,m} = E * sum_e f_e * S_{r,m,e} / N_m,   f_e = C_e / (k * N_{<=m})

  with S_{r,m,e} the sum of rank r's balance scores of micro-batch m, C_e the selected slots of
  expert e in micro-batches 1..m on every rank of the group, N_{<=m} their tokens and N_m the
  tokens of micro-batch m on every rank. Summed over the ranks this is the Switch loss of
  micro-batch m's global batch with the frequencies of every token routed since the reset; with
  one micro-batch it is the Switch loss of the concatenated batch. Megatron-Core's
  ``global_aux_loss`` is the same for equal micro-batches (it averages the counts over the
  micro-batches and divides by this micro-batch's tokens); with padding or unequal micro-batches
  this form keeps f a true frequency.

``aux_loss_mode="attach"`` hands the loss to autograd through the layer's output
(:func:`attach_aux_loss`): its gradient is ``scale`` (:func:`set_aux_loss_scale`, default 1) when
the output's gradient arrives, whatever the caller does with the loss value. That is
Megatron's ``MoEAuxLossAutoScaler``: a trainer that scales its main loss (per-token averaging,
gradient accumulation, loss scaling) sets the same scale here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import reference
from tritonmoe.backends import implementation
from tritonmoe.comm.errors import backend_errors
from tritonmoe.core.types import Routing

__all__ = ["attach_aux_loss", "set_aux_loss_scale", "aux_loss_scale", "GlobalBalanceState", "balance_losses",
           "token_options"]

_scale: dict = {"value": None}


def set_aux_loss_scale(scale) -> None:
    """The factor the gradient of every attached aux loss gets in backward (default 1.0): set it
    to the scale of the main loss's gradient (e.g. ``1 / num_micro_batches``, or the loss scaler's
    factor), as Megatron's ``MoEAuxLossAutoScaler.set_loss_scale``. A float or a 0-d tensor; a
    tensor is read at backward time (no host sync)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise ValueError(f"the aux-loss scale must be a float or a one-element float tensor, got {scale!r}")
        _scale["value"] = scale.detach().reshape(())
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"the aux-loss scale must be a float or a one-element float tensor, got {type(scale).__name__}")
    if not torch.isfinite(torch.tensor(float(scale))):
        raise ValueError(f"the aux-loss scale {scale!r} is not finite; pass the main loss's (finite) gradient scale")
    _scale["value"] = float(scale)


def aux_loss_scale():
    """The scale of :func:`set_aux_loss_scale` (1.0 when never set)."""
    return 1.0 if _scale["value"] is None else _scale["value"]


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux_loss`` gets the gradient ``aux_loss_scale()``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        s = aux_loss_scale()
        g = torch.ones(shape, dtype=dtype, device=device)
        return grad_out, g * (s.to(device=device, dtype=dtype) if isinstance(s, torch.Tensor) else s)


def attach_aux_loss(out: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, with ``aux_loss`` attached: backpropagating anything that depends on
    the returned tensor also backpropagates ``aux_loss`` with gradient :func:`aux_loss_scale`."""
    if not isinstance(aux_loss, torch.Tensor) or aux_loss.dim() != 0:
        raise ValueError("aux_loss must be a scalar (0-d) tensor")
    if not aux_loss.requires_grad:
        return out
    return _AttachAuxLoss.apply(out, aux_loss)


class GlobalBalanceState:
    """The running selected-slot counts and token count of the "global" balance loss (since the
    last :meth:`reset`), summed over the micro-batches of this process and the ranks of the
    group. Tensors on the layer's device; the update issues one all-reduce and no host sync."""

    def __init__(self, num_experts: int, device=None) -> None:
        self.num_experts = num_experts
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.micro_batches = 0

    def reset(self) -> None:
        """Start a new global batch (call at each optimizer step)."""
        self.counts = torch.zeros_like(self.counts)
        self.tokens = torch.zeros_like(self.tokens)
        self.micro_batches = 0

    def update(self, counts_E: torch.Tensor, tokens: torch.Tensor, group=None) -> torch.Tensor:
        """Add this micro-batch's counts and tokens (reduced over ``group``: one all-reduce on
        every rank); returns the group's token count of this micro-batch (int64 0-d)."""
        vec = torch.cat([counts_E.to(torch.int64).reshape(-1), tokens.to(torch.int64).reshape(1)])
        if group is not None and dist.get_world_size(group) > 1:
            dev = self.counts.device
            if dist.get_backend(group) == "nccl" and vec.device.type != "cuda":
                vec = vec.cuda()
            with backend_errors("the global balance loss's count all-reduce", group):
                dist.all_reduce(vec, group=group)
            vec = vec.to(dev)
        if self.counts.device != vec.device:  # the layer moved since the last reset
            self.counts, self.tokens = self.counts.to(vec.device), self.tokens.to(vec.device)
        self.counts = self.counts + vec[:-1]
        self.tokens = self.tokens + vec[-1]
        self.micro_batches += 1
        return vec[-1]

    def frequencies(self, top_k: int, dtype: torch.dtype) -> torch.Tensor:
        """f_e = C_e / (k * N): the fraction of the slots routed since the reset that chose e."""
        return self.counts.to(dtype) / (top_k * self.tokens.clamp_min(1)).to(dtype)


def check_layer_options(config, aux_loss_group, parm: bool) -> None:
    """The layer's balance-loss options against its layout, before any collective."""
    types = config.aux_loss_type if isinstance(config.aux_loss_type, tuple) else (config.aux_loss_type,)
    if aux_loss_group is not None and "global" not in types:
        raise ValueError(
            f"aux_loss_group is the group the 'global' balance loss reduces its counts over, but "
            f"aux_loss_type={config.aux_loss_type!r}; add 'global' to aux_loss_type or drop aux_loss_group"
        )
    if parm and (config.aux_loss_type != "switch" or config.drop_policy != "slot"):
        raise ValueError(
            f"the Parm layouts (mp_group / esp_group) compute the batch's Switch loss and drop slot-major; "
            f"aux_loss_type={config.aux_loss_type!r}, drop_policy={config.drop_policy!r} are not supported there: "
            "use aux_loss_type='switch' and drop_policy='slot'"
        )


def token_options(losses: dict, x: torch.Tensor, padding_mask: Optional[torch.Tensor]):
    """(flattened padding mask or None, sequence length or None) of a layer's forward on ``x``
    [..., d_model], checked: the mask is bool of shape x.shape[:-1] on x's device; the "seq"
    loss (in ``losses``) reads x as [B, S, d_model]."""
    if padding_mask is not None:
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool:
            raise TypeError(
                f"padding_mask must be a bool tensor of shape x.shape[:-1] = {tuple(x.shape[:-1])} (True = a real "
                f"token), got {type(padding_mask).__name__} {getattr(padding_mask, 'dtype', '')}; e.g. "
                "attention_mask.bool()"
            )
        if tuple(padding_mask.shape) != tuple(x.shape[:-1]):
            raise ValueError(
                f"padding_mask has shape {tuple(padding_mask.shape)} but x has {tuple(x.shape)}; pass one entry per "
                f"token, shape {tuple(x.shape[:-1])}"
            )
        if padding_mask.device != x.device:
            raise ValueError(f"padding_mask is on {padding_mask.device} but x is on {x.device}; move it")
        padding_mask = padding_mask.reshape(-1)
    seq = None
    if "seq" in losses:
        if x.dim() != 3:
            raise ValueError(
                f"aux_loss_type 'seq' takes each sequence's tokens from x as [B, S, d_model]; x has shape "
                f"{tuple(x.shape)}: pass x batch-major with its sequence dimension"
            )
        seq = x.shape[1]
    return padding_mask, seq


def balance_losses(
    logits_TE: torch.Tensor,
    routing: Routing,
    losses: dict,
    *,
    padding_mask: Optional[torch.Tensor] = None,
    sequence_length: Optional[int] = None,
    global_state: Optional[GlobalBalanceState] = None,
    group=None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """sum over ``losses`` ({type: coefficient}) of coefficient * that balance loss, fp32 (fp64
    for fp64 logits) scalar; see the module docstring for the types. The score sums come from
    ``routing.score_sum`` (the router's fused sums) where no mask or sequence splits them, else
    from ``backend``'s ``balance_score_sums`` (a Triton kernel on CUDA)."""
    acc = torch.float64 if logits_TE.dtype == torch.float64 else torch.float32
    total = torch.zeros((), dtype=acc, device=logits_TE.device)
    # traced by torch.compile: the plain-torch sums (traceable), else the backend's
    sums = (reference.balance_score_sums if torch.compiler.is_compiling()
            else implementation("balance_score_sums", backend, logits_TE.device, logits_TE.dtype))
    batch_sums = None
    if padding_mask is not None or routing.score_sum is None:
        batch_sums = sums(logits_TE, routing.score_func, padding_mask, None)
    for kind, coef in losses.items():
        if kind == "switch":
            term = reference.load_balancing_loss(logits_TE, routing, padding_mask=padding_mask, score_sums=batch_sums)
        elif kind == "seq":
            term = reference.load_balancing_loss(
                logits_TE, routing, padding_mask=padding_mask, sequence_length=sequence_length,
                score_sums=sums(logits_TE, routing.score_func, padding_mask, sequence_length))
        else:
            s_E = routing.score_sum if batch_sums is None else batch_sums[0]
            term = _global_loss(s_E, routing, padding_mask, global_state, group)
        total = total + coef * term
    return total


def _global_loss(s_E, routing, padding_mask, state: GlobalBalanceState, group) -> torch.Tensor:
    counts = reference.selected_slot_counts(routing, padding_mask)
    tokens = padding_mask.sum() if padding_mask is not None else torch.tensor(routing.num_tokens, device=s_E.device)
    n_m = state.update(counts, tokens, group)
    return reference.switch_loss(s_E, state.frequencies(routing.top_k, s_E.dtype), n_m)
