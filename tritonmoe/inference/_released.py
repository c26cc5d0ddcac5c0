"""MoE layers whose expert tensors a serving wrapper moved to host memory.

:class:`~tritonmoe.inference.ReplicatedMoELayer` (on a GPU) and
:class:`~tritonmoe.inference.OffloadedExperts` keep a layer's experts in host memory (or on disk)
and leave the layer's own expert parameters as empty placeholders. Such a *released* layer:

* refuses a direct call with :class:`ExpertsReleasedError` (a ``RuntimeError``) saying which
  wrapper holds the experts and what to do (call the wrapper, or :func:`restore_experts`),
  instead of failing inside the expert computation on the empty tensors (the ring of an open
  ``OffloadedExperts`` still serves its layers' calls: it swaps the experts in first);
* reports its real expert weights in ``state_dict()`` (the host copies, or the disk tier read
  back), never the empty placeholders, so a saved checkpoint is complete;
* accepts full ``[E, ...]`` expert tensors in ``load_state_dict()``: they are written into the
  host copy (the wrapper then reloads its device copies), except for the read-only disk tier.

:func:`restore_experts` copies the host weights back into the layer's parameters (on the device
they were on) and makes it an ordinary layer again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

__all__ = ["ExpertsReleasedError", "restore_experts", "is_released"]

_ATTR = "_tritonmoe_released"


def _nothing() -> None:
    return None


class ExpertsReleasedError(RuntimeError):
    """A released layer (its expert weights live in host memory, held by a serving wrapper) was
    called directly, or restored while its wrapper still serves it."""


@dataclass
class _Released:
    # (module-level functions and partials where the wrapper allows it: a released layer of a
    # ReplicatedMoELayer stays picklable, e.g. torch.save(model))
    owner: str  # the wrapper, for the messages
    names: list  # the released expert tensors' names
    host: Callable[[], dict]  # name -> the full [E, ...] weights (host tensors)
    write: Optional[Callable[[dict], None]]  # writes full weights into the host copy; None: read-only
    call_hint: str  # what serves the layer instead, for the direct-call refusal
    busy: Callable[[], Optional[str]] = _nothing  # why restoring is refused now (None: allowed)
    on_restore: Callable[[], None] = _nothing
    handles: list = field(default_factory=list)


def is_released(layer: torch.nn.Module) -> bool:
    """True when ``layer``'s expert tensors were moved to host memory by a serving wrapper."""
    return getattr(layer, _ATTR, None) is not None


def mark_released(layer: torch.nn.Module, info: _Released) -> None:
    """Mark ``layer`` released (its expert parameters already point at empty placeholders):
    installs the direct-call refusal, the state_dict and the load_state_dict hooks. A layer
    released again (a new wrapper) gets the new wrapper's record."""
    old = getattr(layer, _ATTR, None)
    if old is not None:
        for h in old.handles:
            h.remove()
    info.handles = [
        layer.register_forward_pre_hook(_refuse_direct_call),
        layer.register_state_dict_post_hook(_state_dict_hook),
        layer.register_load_state_dict_pre_hook(_load_pre_hook),
    ]
    object.__setattr__(layer, _ATTR, info)


def _placeholder(layer, info: _Released) -> bool:
    """Whether the layer's parameters are the empty placeholders right now (an open
    OffloadedExperts ring swaps a slot in for the layer's own forward)."""
    return getattr(layer, info.names[0]).numel() == 0


def _refuse_direct_call(module, args):
    info = getattr(module, _ATTR, None)
    if info is None or not _placeholder(module, info):
        return None
    raise ExpertsReleasedError(
        f"this MoELayer's expert weights ({', '.join(info.names)}) were moved to host memory by {info.owner} and its own "
        f"parameters are empty placeholders, so it cannot run by itself ({info.call_hint}); call "
        "tritonmoe.inference.restore_experts(layer) to copy the weights back into the layer first"
    )


def _state_dict_hook(module, state_dict: dict, prefix: str, local_metadata) -> None:
    """The real expert weights (the host copies) in place of the empty placeholders."""
    info = getattr(module, _ATTR, None)
    if info is None:
        return
    keys = [prefix + n for n in info.names if prefix + n in state_dict and state_dict[prefix + n].numel() == 0]
    if not keys:
        return
    host = info.host()
    for n in info.names:
        if prefix + n in keys:
            state_dict[prefix + n] = host[n].detach()


def _load_pre_hook(module, state_dict: dict, prefix: str, local_metadata, strict, missing_keys, unexpected_keys,
                   error_msgs) -> None:
    """Full expert weights go into the host copy; the parameters (placeholders) get placeholders."""
    info = getattr(module, _ATTR, None)
    if info is None or not _placeholder(module, info):
        return
    incoming = {n: state_dict[prefix + n] for n in info.names if prefix + n in state_dict}
    if not incoming:
        return
    host = info.host()
    bad = False
    for n, v in incoming.items():
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(host[n].shape):
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            error_msgs.append(
                f"size mismatch for {prefix + n}: copying {shape} from the checkpoint, the layer's experts (held in host "
                f"memory by {info.owner}) are {tuple(host[n].shape)}"
            )
            bad = True
        # the parameter itself stays the placeholder: give it an empty value of its own shape
        state_dict[prefix + n] = torch.empty(0, dtype=getattr(module, n).dtype)
    if bad:  # none of this layer's expert tensors is written (load_state_dict raises)
        return
    if info.write is None:
        error_msgs.append(
            f"{', '.join(prefix + n for n in incoming)}: the layer's experts are held read-only by {info.owner}; load the "
            "checkpoint into the layers before offloading them (or restore_experts(layer) after close(), then load)"
        )
        return
    info.write(incoming)


def restore_experts(layer: torch.nn.Module) -> None:
    """Copy a released layer's expert weights back into its parameters (on the device the
    parameters were on) and make it an ordinary, directly callable layer again. The wrapper's
    host copy is not changed; an open ``OffloadedExperts`` must be closed first
    (:class:`ExpertsReleasedError` otherwise). A layer that was not released: ValueError."""
    info = getattr(layer, _ATTR, None)
    if info is None:
        raise ValueError(f"{type(layer).__name__} was not released by a serving wrapper; its expert weights are in "
                         "its parameters already (nothing to restore)")
    why = info.busy()
    if why is not None:
        raise ExpertsReleasedError(why)
    host = info.host()
    with torch.no_grad():
        for n in info.names:
            p = getattr(layer, n)
            p.data = host[n].detach().to(p.device, copy=True)
    for h in info.handles:
        h.remove()
    object.__setattr__(layer, _ATTR, None)
    info.on_restore()
