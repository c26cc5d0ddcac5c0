"""Checkpoints that do not depend on the expert-parallel layout.

An expert-parallel :class:`~tritonmoe.MoELayer`'s ``state_dict()`` describes its experts by
**global index**: ``w1`` and ``w2`` are :class:`~torch.distributed.tensor.DTensor` views of the
parameters (no copy) with the global shape ``[E, ...]``, sharded along experts over the
expert-parallel ranks (placements ``Shard(0)`` on the "ep" dimension of
:meth:`MoEMesh.checkpoint_mesh`, and ``Replicate()`` on "dp" -- or ``Shard(0)`` when FSDP shards
the experts there). Therefore:

* ``torch.distributed.checkpoint.save(model.state_dict(), ...)`` stores every expert once, by
  global index, whatever the layout;
* ``sd = model.state_dict(); dcp.load(sd, ...); model.load_state_dict(sd)`` on another layout
  (EP = 1, 2, 4, ...) reads each rank's experts from wherever they were saved (DCP reshards by
  global offset; since the DTensors alias the parameters, ``dcp.load`` already writes them);
* ``model.load_state_dict`` accepts, for ``w1``/``w2``: such a DTensor of this layout, a full
  global ``[E, ...]`` tensor (this rank's experts are sliced from it), or a tensor of this rank's
  local shape (a same-layout copy). A DTensor of another layout raises (load it with DCP).

Plain (non-DCP) state dicts: :func:`full_state_dict` gathers a global state dict (every tensor
full, as a single process would hold it; collective), and :func:`load_full_state_dict` scatters
one from a single rank (each rank receives only its experts) and loads it.

Optimizer state: :func:`optimizer_state_dict` / :func:`load_optimizer_state_dict` wrap
``torch.distributed.checkpoint.state_dict``'s optimizer helpers and describe the per-expert
states (Adam's moments, momentum) by global expert index the same way, so
``dcp.save({"model": model.state_dict(), "optim": optimizer_state_dict(model, opt)})`` resumes on
another expert-parallel size. (A plain ``optimizer.state_dict()`` is keyed by parameter index and
holds this rank's experts only: do not save it with DCP across ranks.)

Layers without expert parallelism keep plain local tensors (they are already global).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tritonmoe.comm.errors import backend_errors
from tritonmoe.parallel.params import moe_layers

from .embedding import to_global as partitioned_to_global
from .embedding import to_local as partitioned_to_local

__all__ = [
    "expert_state_dict_hook",
    "expert_load_pre_hook",
    "full_state_dict",
    "load_full_state_dict",
    "optimizer_state_dict",
    "load_optimizer_state_dict",
]


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def _checkpoint_mesh(layer) -> DeviceMesh:
    """The mesh the layer's experts are described on (cached on the layer)."""
    mesh = getattr(layer, "_tm_ckpt_mesh", None)
    if mesh is None:
        if layer.mesh is not None:
            mesh = layer.mesh.checkpoint_mesh()
        else:
            mesh = DeviceMesh.from_group(layer.ep_group, layer.w1.device.type)
        layer._tm_ckpt_mesh = mesh
    return mesh


def _is_expert_parallel(layer) -> bool:
    return layer.ep_group is not None and dist.get_world_size(layer.ep_group) > 1


def _to_global(layer, name: str, value: torch.Tensor):
    """``value`` (this rank's experts: a plain tensor, or FSDP's DTensor shard over the
    expert-data-parallel mesh) as a DTensor of the global experts."""
    from torch.distributed.tensor import Replicate, Shard

    DTensor = _dtensor_cls()
    mesh = _checkpoint_mesh(layer)
    if isinstance(value, DTensor):  # FSDP-sharded experts: the dp dimension shards them too
        if mesh.ndim != 2 or value.device_mesh.size() != mesh.size(1) or value.placements != (Shard(0),):
            raise NotImplementedError(
                f"{name} is a DTensor on {value.device_mesh} with {value.placements}; checkpoints of expert-parallel "
                "layers support experts sharded by FSDP over the expert-data-parallel mesh (Shard(0)) only"
            )
        local = value.to_local()
        placements = (Shard(0), Shard(0))
        inner = tuple(value.shape[1:])
    else:
        local = value
        placements = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
        inner = tuple(value.shape[1:])
    shape = (layer.config.num_experts,) + inner
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def expert_state_dict_hook(layer, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` post-hook of an expert-parallel layer: expert tensors as global DTensors."""
    if not _is_expert_parallel(layer):
        return
    for name in layer.expert_parameter_names:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _to_global(layer, name, state_dict[key])


def _to_local(layer, name: str, value, key: str):
    """``value`` for expert parameter ``name`` (a global DTensor of this layout or a full
    ``[E, ...]`` tensor) as what the parameter holds on this rank (its local experts, or FSDP's
    shard of them); None when ``value`` already has the local shape (or a shape to report)."""
    DTensor = _dtensor_cls()
    param = getattr(layer, name)
    E = layer.config.num_experts
    if isinstance(value, DTensor):
        mine = _to_global(layer, name, param.detach())
        if value.device_mesh != mine.device_mesh or value.placements != mine.placements or value.shape != mine.shape:
            raise ValueError(
                f"{key} is a DTensor for another layout ({value.device_mesh}, {value.placements}, shape "
                f"{tuple(value.shape)}) than this layer's ({mine.device_mesh}, {mine.placements}); load it into this "
                "layer's own state_dict() with torch.distributed.checkpoint.load (which reshards), or pass a full "
                "global tensor (tritonmoe.parallel.full_state_dict)"
            )
        local = value.to_local()
    elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == E and E != layer.num_local_experts:
        local = value[layer.expert_start : layer.expert_start + layer.num_local_experts]
    else:
        return None
    if isinstance(param, DTensor):  # FSDP-sharded: this rank's shard of its experts
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape_l, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = DTensor.from_local(
            local.narrow(0, offset[0], shape_l[0]), param.device_mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )
    return local


def expert_load_pre_hook(layer, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: turn a global DTensor or a full ``[E, ...]`` tensor into this
    rank's experts (see the module docstring)."""
    if not _is_expert_parallel(layer):
        return
    for name in layer.expert_parameter_names:
        key = prefix + name
        if key in state_dict:
            local = _to_local(layer, name, state_dict[key], key)
            if local is not None:
                state_dict[key] = local


# ---------------------------------------------------------------------------------------------
# Optimizer state
# ---------------------------------------------------------------------------------------------


def _expert_fqns(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Canonical FQN (as ``torch.distributed.checkpoint.state_dict`` names it, DDP prefix
    removed) -> (layer, parameter name) of every expert parameter of an expert-parallel layer."""
    from torch.distributed.checkpoint.state_dict import _get_fqns


    owners = {}
    for _, layer in moe_layers(model):
        if _is_expert_parallel(layer):
            for n in layer.expert_parameter_names:
                owners[id(getattr(layer, n))] = (layer, n)
    out = {}
    for name, p in model.named_parameters():
        if id(p) in owners:
            for fqn in _get_fqns(model, name):
                out[fqn] = owners[id(p)]
    return out


def _partitioned_fqns(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Canonical FQN -> module of every row-partitioned parameter
    (:class:`~tritonmoe.parallel.PartitionedEmbedding`'s ``weight``) on a group of several ranks."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    owners = {id(m.weight): m for m in model.modules()
              if getattr(type(m), "partitioned_parameter_names", None) and m.world_size > 1}
    return {fqn: owners[id(p)] for name, p in model.named_parameters() if id(p) in owners for fqn in _get_fqns(model, name)}


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict keyed by parameter FQN
    (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``), with the per-expert
    states of expert-parallel layers (tensors shaped like the parameter: Adam's ``exp_avg``,
    ``exp_avg_sq``, momentum buffers) as global DTensors like the model's ``state_dict()``, so
    ``torch.distributed.checkpoint`` stores them by global expert index and reshards them. Load
    with :func:`load_optimizer_state_dict`. Initializes an empty optimizer's state (as
    ``get_optimizer_state_dict`` does) so it can serve as the template of ``dcp.load``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    DTensor = _dtensor_cls()
    osd = get_optimizer_state_dict(model, optimizer)
    for fqn, (layer, name) in _expert_fqns(model).items():
        param = getattr(layer, name)
        for k, v in osd["state"].get(fqn, {}).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == param.shape:
                osd["state"][fqn][k] = _to_global(layer, name, v)
            elif isinstance(v, DTensor) and v.placements == getattr(param, "placements", None) and v.shape == param.shape:
                osd["state"][fqn][k] = _to_global(layer, name, v)
    for fqn, module in _partitioned_fqns(model).items():  # per-row states of a partitioned table
        for k, v in osd["state"].get(fqn, {}).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == module.weight.shape:
                osd["state"][fqn][k] = partitioned_to_global(module, v)
    return osd


def load_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load an optimizer state dict from :func:`optimizer_state_dict` (after ``dcp.load`` into one
    of this layout, or full global tensors) into ``optimizer``
    (``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for fqn, (layer, name) in _expert_fqns(model).items():
        st = state_dict["state"].get(fqn, {})
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor):
                local = _to_local(layer, name, v, f"state[{fqn!r}][{k!r}]")
                if local is not None:
                    st[k] = local
    for fqn, module in _partitioned_fqns(model).items():
        st = state_dict["state"].get(fqn, {})
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor):
                local = partitioned_to_local(module, v, f"state[{fqn!r}][{k!r}]")
                if local is not None:
                    st[k] = local
    set_optimizer_state_dict(model, optimizer, state_dict)


# ---------------------------------------------------------------------------------------------
# Plain state dicts: gather to one global dict, scatter from one rank
# ---------------------------------------------------------------------------------------------


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor global and plain (experts ``[E, ...]`` as one
    process holding every expert would have them), identical on every rank. Collective over
    every rank of the model's meshes (call it on all ranks); ``torch.save`` it from one."""
    DTensor = _dtensor_cls()
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def _local_box(t) -> tuple[int, int]:
    """(first row, rows) of this rank's part of a DTensor sharded along dim 0."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return int(offset[0]), int(shape[0])


def load_full_state_dict(model: torch.nn.Module, state_dict: Optional[dict] = None, *, src: int = 0, strict: bool = True):
    """Load a global state dict held by rank ``src`` (``state_dict`` there, None elsewhere) into
    every rank's model: dense tensors are broadcast, each rank receives only its own experts
    (one ``scatter`` per expert tensor). Collective over the default group. Returns
    ``load_state_dict``'s result."""
    DTensor = _dtensor_cls()
    rank = dist.get_rank()
    target = model.state_dict()
    keys = list(target)
    if rank == src:
        if not isinstance(state_dict, dict):
            raise TypeError(f"rank {src} (src) must pass the global state dict, got {type(state_dict).__name__}")
        missing = [k for k in keys if k not in state_dict]
        bad = [
            f"{k}: {tuple(state_dict[k].shape)} (the model expects {tuple(target[k].shape)})"
            for k in keys
            if k in state_dict and isinstance(state_dict[k], torch.Tensor) and tuple(state_dict[k].shape) != tuple(target[k].shape)
        ]
        meta = {"missing": missing, "unexpected": [k for k in state_dict if k not in target], "bad": bad}
    else:
        meta = None
    box = [meta]
    with backend_errors("the broadcast of the checkpoint's key check"):
        dist.broadcast_object_list(box, src=src)
    meta = box[0]
    if meta["bad"]:
        raise ValueError(f"the global state dict on rank {src} has wrong shapes: " + "; ".join(meta["bad"][:8]))
    if strict and (meta["missing"] or meta["unexpected"]):
        raise KeyError(
            f"the global state dict on rank {src} does not match the model: missing {meta['missing'][:8]}, "
            f"unexpected {meta['unexpected'][:8]}"
        )
    world = dist.get_world_size()
    for k in keys:
        if k in meta["missing"]:
            continue
        t = target[k]
        if isinstance(t, DTensor):
            first, rows = _local_box(t)
            boxes: list = [None] * world
            with backend_errors(f"the all-gather of {k!r}'s shard boxes"):
                dist.all_gather_object(boxes, (first, rows))
            out = torch.empty_like(t.to_local())
            pieces = None
            if rank == src:
                full = state_dict[k].to(device=out.device, dtype=out.dtype)
                pieces = [full.narrow(0, a, n).contiguous() for a, n in boxes]
            with backend_errors(f"the scatter of {k!r}"):
                dist.scatter(out, pieces, src=src)
            t.to_local().copy_(out)
        elif isinstance(t, torch.Tensor):
            buf = state_dict[k].to(device=t.device, dtype=t.dtype).contiguous() if rank == src else torch.empty_like(t)
            with backend_errors(f"the broadcast of {k!r}"):
                dist.broadcast(buf, src=src)
            t.copy_(buf)
    return model.load_state_dict(target, strict=strict)
