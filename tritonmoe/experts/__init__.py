"""The expert path: one object per parallel layout, one call shape.

:class:`~tritonmoe.MoELayer` is thin: it routes, hands the tokens to its expert path and adds the
auxiliary loss. The expert path computes, for a batch of tokens and their routing, the weighted
sum of the chosen experts' FFN outputs per token, wherever those experts live::

    path(x_TD, routing, weights) -> y_TD

* :class:`LocalExperts`: every expert on this device (the fused ``moe_ffn`` or permute ->
  grouped FFN -> unpermute).
* :class:`ExpertParallelExperts`: rank r of an expert-parallel group of P ranks owns the experts
  [r*E/P, (r+1)*E/P); the tokens travel to their experts and back (all-to-all), in
  ``pipeline_degree`` micro-ops whose communication overlaps expert compute
  (:mod:`tritonmoe.comm.programs.pipeline`).
* :class:`tritonmoe.experts.model_parallel.ParmExperts`: model + expert + expert-sharding parallelism
  (paper 003), with Parm's schedules. Its S1 schedule routes only this model-parallel rank's
  slice of the tokens, so it takes over the layer's whole step (:meth:`ExpertPath.layer_forward`).

A new parallel layout or schedule is a new expert path (or a new schedule inside one), not a new
branch in the layer. Every path takes the layer's expert parameters as :class:`ExpertWeights`
(it owns none: ``layer.w1``/``layer.w2`` stay where checkpoints and optimizers expect them) and
records which variant ran in :attr:`ExpertPath.path_used`.

The ops run on the implementation :mod:`tritonmoe.backends` picks for the layer's backend,
device and dtype; the layer produces its own routing metadata, so no value checks run here.
"""

from __future__ import annotations

import logging

from typing import Any, Optional

import torch

from tritonmoe.comm.programs.pipeline import micro_batch_bounds
from tritonmoe.config import MoEConfig
from tritonmoe.core.specs import ffn_options

from .base import ExpertPath, ExpertWeights
from .expert_parallel import ExpertParallelExperts
from .fp8_store import FP8ExpertStore
from .local import LocalExperts, auto_ffn_path
from .model_parallel import ParmExperts
from .static import StaticExpertParallelExperts
from tritonmoe.experts.model_parallel import ParmExperts

__all__ = [
    "ExpertWeights",
    "ExpertPath",
    "LocalExperts",
    "ExpertParallelExperts",
    "FP8ExpertStore",
    "StaticExpertParallelExperts",
    "ParmExperts",
    "auto_ffn_path",
    "ffn_options",
    "micro_batch_bounds",
    "make_expert_path",
]


#: The single-process notes already logged (one line per distinct note per process).
_NOTED: set[str] = set()
_log = logging.getLogger("tritonmoe")


def _note_single_process(config: MoEConfig) -> None:
    """One config, any world size: without ``ep_group`` the expert-parallel schedule options
    (``pipeline_degree`` > 1, "auto" or "search"; ``memory_strategy``) do not change what the
    layer computes (bitwise in fp64: the pipeline changes the schedule, not the result), so a
    local layer runs them as degree 1 and unmanaged: the single-process reference of the same
    ``MoEConfig``. Logged once per process and option value (not an error)."""
    opts = [f"pipeline_degree={config.pipeline_degree!r}" if config.pipeline_degree != 1 else "",
            f"memory_strategy={config.memory_strategy!r}" if config.memory_strategy is not None else ""]
    note = ", ".join(o for o in opts if o)
    if note and note not in _NOTED:
        _NOTED.add(note)
        _log.warning("tritonmoe: a MoELayer without ep_group runs %s as pipeline_degree=1 without a memory strategy "
                     "(the single-process reference of this expert-parallel config; same result)", note)


def make_expert_path(
    config: MoEConfig,
    *,
    ep_group: Any = None,
    mp_group: Any = None,
    esp_group: Any = None,
    ep_esp_group: Any = None,
    parm_groups: Any = None,
    dtype: Optional[torch.dtype] = None,
) -> ExpertPath:
    """The expert path of a layer with this config and layout."""
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    if config.expert_dtype is not None and (any(g is not None for g in (mp_group, esp_group, ep_esp_group, parm_groups))
                                            or (ep_group is not None and (config.ep_capacity is not None
                                                                          or config.memory_strategy is not None))):
        raise ValueError(f"expert_dtype={config.expert_dtype!r} runs on the local expert path and the dynamic "
                         "expert-parallel path (ep_group=, without ep_capacity or memory_strategy); Parm layouts, the "
                         "static capacity path and memory strategies with FP8 experts are not built yet (use "
                         "expert_dtype=None there)")
    parm = parm_groups is not None or mp_group is not None or esp_group is not None or ep_esp_group is not None
    if config.memory_strategy is not None and parm:
        raise ValueError(
            f"memory_strategy={config.memory_strategy!r} manages the activations of the pipelined expert-parallel path "
            "and needs ep_group alone (no model-parallel / expert-sharding groups); use memory_strategy=None here "
            "(without any group the layer runs it as the single-process reference and ignores it)"
        )
    if parm_groups is not None or mp_group is not None or esp_group is not None or ep_esp_group is not None:

        return ParmExperts.from_groups(
            config, ep_group=ep_group, mp_group=mp_group, esp_group=esp_group, ep_esp_group=ep_esp_group,
            groups=parm_groups, dtype=dtype,
        )
    if ep_group is not None:
        if config.ep_capacity is not None:
            return StaticExpertParallelExperts(config, ep_group, dtype)
        return ExpertParallelExperts(config, ep_group, dtype)
    _note_single_process(config)
    return LocalExperts(config)
