"""Refusing the wrappers that would silently corrupt an expert-parallel layer.

Under expert parallelism every rank of an expert-parallel group holds *different* experts under
the same parameter names (``w1``, ``w2``). Wrappers written for replicated parameters treat them
as replicas:

* ``DistributedDataParallel`` broadcasts rank 0's parameters at construction (every rank gets
  rank 0's experts) and averages the gradients of different experts together;
* ``fully_shard`` (FSDP2) over a mesh that spans expert-parallel ranks shards each rank's local
  experts across ranks that hold other experts, so the all-gathered weight splices them.

Detection points, both on every rank with the same verdict and before any gradient is used:

* DDP: the layer's forward checks ``DistributedDataParallel._get_active_ddp_module()`` (set by
  DDP around the wrapped module's forward). If that DDP reduces this layer's expert parameters
  (they are not in its ignore list), :class:`ExpertParallelWrapError`; if it ignores them but
  is not the wrapper of :func:`tritonmoe.parallel.data_parallel`, a ``UserWarning`` (once per
  layer and wrapper): nothing reduces the expert gradients over the expert-data-parallel group
  or gives them the data-parallel scale.
* FSDP2: ``fully_shard`` installs each sharded parameter on its module with ``setattr`` when the
  module defines ``__setattr__`` (its slow path); the layer's ``__setattr__`` checks a DTensor
  expert parameter's mesh and raises :class:`ExpertParallelWrapError` inside ``fully_shard`` when
  the mesh contains two ranks of one expert-parallel group. Sharding the experts over the
  expert-data-parallel mesh (:func:`tritonmoe.parallel.fully_shard_moe`) passes.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.distributed as dist
from tritonmoe.parallel.mesh import group_ranks

__all__ = ["ExpertParallelWrapError", "check_ddp", "check_sharded_expert"]

_RECIPE = (
    "wrap the model with tritonmoe.parallel.data_parallel(model, mesh) (DDP with the expert parameters reduced "
    "over the expert-data-parallel group), or shard it with tritonmoe.parallel.fully_shard_moe(model, mesh)"
)


class ExpertParallelWrapError(ValueError):
    """A data-parallel wrapper would treat different experts as replicas of one parameter."""


def _ep_ranks(layer) -> list[int]:

    return group_ranks(layer.ep_group)


def check_ddp(layer) -> None:
    """Called by an expert-parallel layer's forward: raise or warn when the active DDP would
    corrupt its experts (see the module docstring). Cheap after the first call per wrapper."""
    ddp_cls = torch.nn.parallel.DistributedDataParallel
    get = getattr(ddp_cls, "_get_active_ddp_module", None)
    ddp = get() if get is not None else None
    if ddp is None:
        return
    seen = getattr(layer, "_tm_checked_ddp", None)
    if seen is not None and seen() is ddp:
        return
    if getattr(ddp, "_tritonmoe_data_parallel", None) is None:
        synced = getattr(ddp, "_module_parameters", None)
        if synced is None:  # another torch: everything not ignored by name is synced
            ignored = getattr(ddp, "parameters_to_ignore", set())
            synced = [p for n, p in ddp.module.named_parameters() if n not in ignored]
        ids = {id(p) for p in synced}
        names = [n for n in layer.expert_parameter_names if id(getattr(layer, n)) in ids]
        where = f"{layer.__class__.__name__} (experts {layer.expert_start}..{layer.expert_start + layer.num_local_experts - 1} " \
                f"of {layer.config.num_experts} on this rank, expert-parallel ranks {_ep_ranks(layer)})"
        if names:
            raise ExpertParallelWrapError(
                f"DistributedDataParallel reduces the expert parameters {names} of an expert-parallel {where} as if "
                "every rank held the same experts: it broadcast rank 0's experts to every rank at construction and "
                f"averages different experts' gradients. {_RECIPE}."
            )
        warnings.warn(
            f"an expert-parallel {where} runs inside a DistributedDataParallel that ignores its experts but is not "
            "tritonmoe.parallel.data_parallel: nothing reduces the expert gradients over the expert-data-parallel "
            f"group or scales them like the router's. {_RECIPE}.",
            UserWarning,
            stacklevel=3,
        )
    layer._tm_checked_ddp = weakref.ref(ddp)


def check_sharded_expert(layer, name: str, value) -> None:
    """Called when a DTensor is installed as expert parameter ``name`` of ``layer`` (FSDP2's
    ``fully_shard`` does so): raise when its mesh spans two ranks of the layer's expert-parallel
    group (their experts differ, so sharding them as one tensor splices experts)."""
    if layer.ep_group is None or dist.get_world_size(layer.ep_group) == 1:
        return
    mesh = getattr(value, "device_mesh", None)
    if mesh is None:
        return
    key = id(mesh)
    ok = getattr(layer, "_tm_checked_meshes", None)
    if ok is None:
        ok = layer._tm_checked_meshes = set()
    if key in ok:
        return
    ranks = {int(r) for r in mesh.mesh.flatten().tolist()}
    shared = sorted(ranks & set(_ep_ranks(layer)))
    if len(shared) > 1:
        raise ExpertParallelWrapError(
            f"{name} of an expert-parallel {layer.__class__.__name__} is being sharded over a mesh of ranks "
            f"{sorted(ranks)} that contains expert-parallel ranks {shared}, which hold different experts: their "
            "local experts would be spliced into one tensor. Shard the experts over the expert-data-parallel mesh "
            f"(MoEMesh.expert_dp_mesh), e.g. with tritonmoe.parallel.fully_shard_moe(model, mesh). {_RECIPE}."
        )
    ok.add(key)
