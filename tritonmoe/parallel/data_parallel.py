"""Data parallelism for models with expert-parallel MoE layers, correct by construction.

Gradient semantics. With a :class:`MoEMesh` of ``D = data_parallel_size`` ranks that see
different batches (dp x ep), rank r computes a loss ``L_r`` on its batch and calls
``L_r.backward()``. After the backward, on every rank, **every parameter's gradient is the
gradient of** ``L = (1/D) * sum_r L_r`` (the mean of the ranks' losses), and replicas agree:

* dense parameters (router, attention, ...): rank r's local gradient is ``dL_r/dp``; they are
  summed over the dense group (all D ranks) and divided by D (DDP, with the communication hook
  of :mod:`tritonmoe.comm.priority`);
* expert parameters: the expert-parallel all-to-all already brings the gradients of every rank
  of the expert-parallel group to the experts' owner, so the local gradient is
  ``d(sum over the ep group's ranks of L_r)/dp``; they are summed over the expert-data-parallel
  group (the ranks holding the same experts) and divided by D -- not by the size of that group.

When every rank's ``L_r`` is the mean over its own tokens with the same number of tokens per
rank, ``L`` is the mean loss over the global batch, and the model's gradients equal those of a
single process running the whole model on the concatenated global batch (with dropless routing
and no auxiliary loss; capacity and the load-balancing loss are computed per rank's batch, as the
layer documents). The optimizer step then moves every replica identically.

:func:`data_parallel` returns a ``DistributedDataParallel`` that does this: expert parameters of
expert-parallel layers excluded from DDP (``_ddp_params_and_buffers_to_ignore``) and reduced by
hooks on the same per-rank :class:`~tritonmoe.comm.CommScheduler` as DDP's buckets and the
layers' all-to-alls (``comm="lina"`` for Lina's priority scheduling, ``"fifo"`` for today's
behaviour). At construction DDP broadcasts the dense parameters from rank 0 and the wrapper
broadcasts each expert from the first rank of its expert-data-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tritonmoe.comm.errors import backend_errors, new_group
from tritonmoe.comm.fused import GradientBuckets, plan_buckets
from tritonmoe.comm.priority import DEFAULT_CHUNK_BYTES, CommScheduler, GradSyncState, scheduled_allreduce_hook

from .mesh import ROLES, MoEMesh, as_moe_mesh, group_ranks
from .params import moe_layers, named_expert_parameters

__all__ = ["COMM_POLICIES", "DataParallelState", "ExpertGradSync", "data_parallel"]

#: Values of ``data_parallel(comm=...)``.
COMM_POLICIES = ("fifo", "lina")


def _enumerate_groups(mesh: MoEMesh, which: str) -> list[list[int]]:
    """Every rank set of the ``which`` family over the whole mesh: "dense" (dimensions where
    tokens differ and dense parameters are replicated) or "expert_dp" (experts replicated)."""
    m = mesh.device_mesh.mesh
    roles = [ROLES[n] for n in mesh.dim_names]
    if which == "dense":
        keep = [i for i, r in enumerate(roles) if r.tokens == "split" and r.dense == "replicate"]
    else:
        keep = [i for i, r in enumerate(roles) if r.experts == "replicate"]
    rest = [i for i in range(m.dim()) if i not in keep]
    size = math.prod(m.shape[i] for i in keep)
    return [[int(r) for r in row] for row in m.permute(*rest, *keep).reshape(-1, size).tolist()]


def _new_groups(rank_sets: list[list[int]]):
    """One new process group per rank set (collective over the default group); this rank's."""
    mine = None
    me = dist.get_rank()
    for ranks in rank_sets:
        g = new_group(ranks)  # the default group's timeout, not the 30-minute default
        if me in ranks:
            mine = g
    return mine


class ExpertGradSync:
    """Reduces expert gradients over the expert-data-parallel group after each backward.

    A post-accumulate-grad hook per expert parameter divides its gradient by the data-parallel
    size and submits it to the scheduler's gradient lane (program order); the first hook of a
    backward queues an end-of-backward callback that waits for all of them, so gradients are
    final when ``backward()`` returns. Skipped under ``ddp.no_sync()``.
    """

    def __init__(self, params: list[torch.nn.Parameter], scheduler: CommScheduler, group, divisor: int, ddp) -> None:
        self.scheduler = scheduler
        self.group = group
        self.divisor = divisor
        self._ddp = ddp
        self._pending: list[tuple[torch.futures.Future, torch.Tensor, Optional[torch.Tensor]]] = []
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _hook(self, p: torch.Tensor) -> None:
        if not self._ddp.require_backward_grad_sync:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            self._queued = True
        g = p.grad
        g.div_(self.divisor)
        if g.is_contiguous():
            buf, back = g.view(-1), None
        else:
            buf, back = g.reshape(-1).clone(), g
        self._pending.append((self.scheduler.reduce(buf, None, self.group), buf, back))

    def _finalize(self) -> None:
        pending, self._pending, self._queued = self._pending, [], False
        for fut, buf, back in pending:
            fut.wait()
            if back is not None:
                back.copy_(buf.view_as(back))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class DataParallelState:
    """What :func:`data_parallel` attached to its DDP (``ddp._tritonmoe_data_parallel``).

    Attributes:
        mesh: the layout.
        scheduler: the rank's :class:`~tritonmoe.comm.CommScheduler` (exchanges and gradients).
        expert_sync: the expert-gradient hooks (:class:`ExpertGradSync`, or
            :class:`~tritonmoe.comm.GradientBuckets` with ``fuse_bytes``).
        expert_names: fully qualified names of the parameters DDP ignores (the experts of
            expert-parallel layers).
        dense_group, expert_group: the reduction groups of the gradient lane.
    """

    mesh: MoEMesh
    scheduler: CommScheduler
    expert_sync: "ExpertGradSync | GradientBuckets"
    expert_names: list[str]
    dense_group: Any
    expert_group: Any


def _partitioned(model: torch.nn.Module, mesh: MoEMesh) -> list[tuple[str, torch.nn.Module]]:
    """The row-partitioned modules of ``model``; each must be partitioned over the dense group."""
    out = []
    dense = mesh.ranks("dense")
    for name, m in model.named_modules():
        if getattr(type(m), "partitioned_parameter_names", None):
            ranks = group_ranks(m.group) if m.group is not None else list(range(dist.get_world_size()))
            if ranks != dense:
                raise ValueError(
                    f"{name!r} is partitioned over ranks {ranks} but the mesh's data-parallel (dense) group of this rank "
                    f"is {dense}; build it with group=mesh.dense_group"
                )
            out.append((name, m))
    return out


def data_parallel(
    model: torch.nn.Module,
    mesh,
    *,
    comm: str = "fifo",
    chunk_bytes: Optional[int] = DEFAULT_CHUNK_BYTES,
    reduction: str = "allreduce",
    fuse_bytes: Optional[int] = None,
    **ddp_kwargs,
) -> DistributedDataParallel:
    """Wrap ``model`` (containing :class:`~tritonmoe.MoELayer`\\ s built on ``mesh``) for data
    parallelism with the gradient semantics of the module docstring.

    Args:
        model: the model; its MoE layers must be built on ``mesh`` (``MoELayer(cfg, mesh=mesh)``,
            or ``ep_group=`` a group with the same ranks as the mesh's "ep" dimension).
        mesh: a :class:`MoEMesh` (or a DeviceMesh named "dp"/"ep") spanning every rank.
        comm: "fifo" (today's behaviour) or "lina" (priority all-to-all, gradients in micro-ops
            of at most ``chunk_bytes``; see :mod:`tritonmoe.comm.priority`).
        chunk_bytes: Lina's partition size (default 30 MB, the paper's); None keeps gradients
            whole (priority only). Ignored by "fifo".
        reduction: "allreduce" (the backend's) or "ordered" (bitwise independent of bucketing
            and chunking; see :func:`tritonmoe.comm.priority.ordered_all_reduce_`).
        fuse_bytes: SE-MoE's fusion (PAPERS.md 2.3): expert gradients go through
            :class:`~tritonmoe.comm.GradientBuckets` of at most ``fuse_bytes`` (the biases and other
            small expert tensors share one reduction, a large one travels alone; the plan is
            agreed across the expert-data-parallel group here), and under "lina" consecutive
            small dense gradients of a DDP bucket share one micro-op of at most ``chunk_bytes``
            while large ones are partitioned (``CommScheduler(fuse=True)``). None: one
            reduction per expert parameter and per Lina piece, as before.
        ddp_kwargs: passed to ``DistributedDataParallel`` (``bucket_cap_mb``,
            ``find_unused_parameters``, ``gradient_as_bucket_view``, ...).

    Returns: the DDP module; ``ddp._tritonmoe_data_parallel`` is its :class:`DataParallelState`.
    Collective over the default group (it creates the reduction groups).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        raise ValueError("model is already wrapped in DistributedDataParallel; pass the unwrapped model")
    mesh = as_moe_mesh(mesh)
    if comm not in COMM_POLICIES:
        raise ValueError(f"comm={comm!r}; use one of {COMM_POLICIES}")
    for bad in ("process_group", "device_mesh"):
        if bad in ddp_kwargs:
            raise ValueError(f"{bad}= is derived from the mesh; do not pass it")
    world = dist.get_world_size()
    if mesh.device_mesh.mesh.numel() != world:
        raise ValueError(f"the mesh spans {mesh.device_mesh.mesh.numel()} ranks but the world has {world}; use a mesh over every rank")
    if fuse_bytes is not None:
        plan_buckets([], fuse_bytes)  # validates it before any collective
    fuse = fuse_bytes is not None
    scheduler = (CommScheduler.lina(chunk_bytes, reduction=reduction, fuse=fuse) if comm == "lina"
                 else CommScheduler.fifo(reduction=reduction))

    ep_ranks = mesh.ranks("ep")
    expert_layers = []
    for name, layer in moe_layers(model):
        if not layer.expert_parallel:
            continue
        layer_ranks = group_ranks(layer.ep_group)
        if layer_ranks != ep_ranks:
            raise ValueError(
                f"MoE layer {name!r} is expert-parallel over ranks {layer_ranks} but the mesh's 'ep' group of this rank is "
                f"{ep_ranks}; build the layers with MoELayer(cfg, mesh=mesh)"
            )
        expert_layers.append(layer)
    expert_ids = {id(getattr(layer, n)) for layer in expert_layers for n in layer.expert_parameter_names}
    expert_named = [(n, p) for n, p in named_expert_parameters(model) if id(p) in expert_ids]
    expert_names = [n for n, _ in expert_named]

    # Reduction groups used by the gradient lane only (DDP and the layers keep their own groups,
    # so each group's collectives come from one thread in one order).
    dense_group = _new_groups(_enumerate_groups(mesh, "dense"))
    expert_group = _new_groups(_enumerate_groups(mesh, "expert_dp")) if mesh.expert_dp_mesh is not None else None

    # Row-partitioned tables (PartitionedEmbedding) reduce nothing: their gradients reach the
    # owners through the all-to-alls; they take the data-parallel divisor like DDP's.
    partitioned = _partitioned(model, mesh)
    for _, m in partitioned:
        m.grad_divisor = float(mesh.data_parallel_size)
        m.comm_scheduler = scheduler  # its backward exchange goes before gradient micro-ops (Lina)
    # (their buffers -- the shard's row ids -- differ per rank: DDP must not broadcast them)
    ignored = expert_names + [f"{n}.{pn}" if n else pn for n, m in partitioned
                              for pn in type(m).partitioned_parameter_names + getattr(type(m), "partitioned_buffer_names", ())]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model, process_group=mesh.dense_group, **ddp_kwargs)
    D = mesh.data_parallel_size
    ddp.register_comm_hook(GradSyncState(scheduler, dense_group, D), scheduled_allreduce_hook)

    # Replicas of an expert start identical (they already are when every rank drew the same
    # seed; this makes it so whatever the user did between construction and wrapping).
    if mesh.expert_dp_group is not None:
        src = mesh.ranks("expert_dp")[0]
        with torch.no_grad():
            for _, p in expert_named:
                with backend_errors("the broadcast of expert replicas in data_parallel", mesh.expert_dp_group):
                    dist.broadcast(p.data, src=src, group=mesh.expert_dp_group)

    if fuse_bytes is None:
        sync = ExpertGradSync([p for _, p in expert_named], scheduler, expert_group, D, ddp)
    else:  # autograd readies gradients roughly in reverse registration order
        sync = GradientBuckets([p for _, p in expert_named][::-1], fuse_bytes, expert_group, scheduler=scheduler,
                               divisor=D, enabled=lambda: ddp.require_backward_grad_sync)
        for layer in expert_layers:
            sync.watch(layer)
    for layer in expert_layers:
        layer.comm_scheduler = scheduler
    ddp._tritonmoe_data_parallel = DataParallelState(mesh, scheduler, sync, expert_names, dense_group, expert_group)
    return ddp
