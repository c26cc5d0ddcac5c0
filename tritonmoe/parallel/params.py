"""Finding MoE layers and their expert parameters in a model.

A module holds experts when it declares ``expert_parameter_names`` (a tuple of its own
parameter names; :class:`~tritonmoe.MoELayer` declares ``("w1", "w2")``). The names are
resolved on the module when asked, so they stay valid when a wrapper replaces the parameter
objects (FSDP installs DTensor parameters under the same names).
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["moe_layers", "named_expert_parameters", "expert_parameters", "is_expert_parameter"]


def moe_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every module of ``model`` that holds experts."""
    for name, m in model.named_modules():
        if getattr(type(m), "expert_parameter_names", None):
            yield name, m


def named_expert_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(qualified name, parameter)`` of every expert parameter of ``model`` (each once), with
    the names ``model.named_parameters()`` uses."""
    ids = set()
    for name, m in moe_layers(model):
        for n in type(m).expert_parameter_names:
            p = getattr(m, n, None)
            if isinstance(p, torch.nn.Parameter):
                ids.add(id(p))
    for name, p in model.named_parameters():
        if id(p) in ids:
            yield name, p


def expert_parameters(model: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    """Every expert parameter of ``model`` (``w1``/``w2`` of each MoE layer), each once."""
    for _, p in named_expert_parameters(model):
        yield p


def is_expert_parameter(model: torch.nn.Module, param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter of ``model``."""
    return any(p is param for p in expert_parameters(model))
