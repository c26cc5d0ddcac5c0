"""The FSDP2 recipe for models with expert-parallel MoE layers.

:func:`fully_shard_moe` applies ``torch.distributed.fsdp.fully_shard`` so that every parameter is
sharded over the ranks that hold the same copy of it, with the gradient semantics of
:mod:`tritonmoe.parallel.data_parallel` (every gradient that of the mean of the ranks' losses):

1. each expert-parallel layer's router: ``fully_shard(layer.router, mesh=mesh.dense_mesh)``
   (dense: every data-parallel rank holds it; FSDP divides its gradient by their number, D);
2. the layer itself, i.e. its experts ``w1``/``w2``: ``fully_shard(layer,
   mesh=mesh.expert_dp_mesh)`` (the ranks holding the same experts) and
   ``layer.set_gradient_divide_factor(D)``: the all-to-all already summed the expert-parallel
   ranks' contributions, so the reduce-scatter over the expert-data-parallel group must divide
   by D, not by its own size. Without an expert-data-parallel dimension (dp = 1) the experts
   get a one-rank mesh, so FSDP still applies the 1/D scale;
3. the rest of the model: ``fully_shard(model, mesh=mesh.dense_mesh)``.

Sharding experts over a mesh that spans expert-parallel ranks raises
:class:`~tritonmoe.parallel.ExpertParallelWrapError` inside ``fully_shard``
(:mod:`tritonmoe.parallel.guard`). Checkpoints of the sharded model keep experts by global index
(:mod:`tritonmoe.parallel.checkpoint`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tritonmoe.comm.errors import new_group

from .mesh import MoEMesh, as_moe_mesh, group_ranks
from .params import moe_layers

__all__ = ["fully_shard_moe"]


def _singleton_mesh(mesh: MoEMesh) -> DeviceMesh:
    """A one-rank mesh for this rank (collective: creates one group per rank)."""
    me = dist.get_rank()
    mine = None
    for r in range(dist.get_world_size()):
        g = new_group([r])
        if r == me:
            mine = g
    return DeviceMesh.from_group(mine, mesh.device_type)


def _set_divide_factor(module, factor: float) -> None:
    setter = getattr(module, "set_gradient_divide_factor", None) or getattr(module, "set_reduce_scatter_divide_factor")
    setter(float(factor))


def fully_shard_moe(model: torch.nn.Module, mesh, **fsdp_kwargs) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 following the recipe of the module docstring; returns it.

    Args:
        model: the model; its MoE layers built on ``mesh``.
        mesh: a :class:`MoEMesh` (or a DeviceMesh named "dp"/"ep") spanning every rank.
        fsdp_kwargs: passed to every ``fully_shard`` call (``reshard_after_forward``,
            ``mp_policy``, ...).

    Collective over the default group.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = as_moe_mesh(mesh)
    for bad in ("mesh", "ignored_params"):
        if bad in fsdp_kwargs:
            raise ValueError(f"{bad}= is derived from the mesh by the recipe; do not pass it")
    D = mesh.data_parallel_size
    dense = mesh.dense_mesh
    expert_mesh = mesh.expert_dp_mesh if mesh.expert_dp_mesh is not None else _singleton_mesh(mesh)
    ep_ranks = mesh.ranks("ep")
    root_done = False
    for name, layer in moe_layers(model):
        if not layer.expert_parallel:
            continue
        if group_ranks(layer.ep_group) != ep_ranks:
            raise ValueError(
                f"MoE layer {name!r} is expert-parallel over ranks {group_ranks(layer.ep_group)} but the mesh's 'ep' group "
                f"of this rank is {ep_ranks}; build the layers with MoELayer(cfg, mesh=mesh)"
            )
        fully_shard(layer.router, mesh=dense, **fsdp_kwargs)
        fully_shard(layer, mesh=expert_mesh, **fsdp_kwargs)
        _set_divide_factor(layer, D)
        root_done = root_done or layer is model
    if not root_done:
        fully_shard(model, mesh=dense, **fsdp_kwargs)
    return model
