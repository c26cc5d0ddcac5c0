"""Parallel layouts for MoE models: a named DeviceMesh, data parallelism that is correct by
construction, layout-independent initialization and checkpoints, and guards against wrappers
that would corrupt expert-parallel layers.

* :class:`MoEMesh` (:mod:`.mesh`): a DeviceMesh with dimensions named "dp" and "ep" (room for
  "mp" and "esp"), from which the expert-parallel, expert-data-parallel and dense groups derive.
  ``MoELayer(cfg, mesh=mesh)`` builds a layer on it.
* :func:`expert_parameters` / :func:`named_expert_parameters` / :func:`moe_layers`
  (:mod:`.params`): what holds experts.
* :func:`data_parallel` (:mod:`.data_parallel`): DDP with the experts excluded and reduced over
  the expert-data-parallel group, every gradient that of the mean of the ranks' losses; FIFO or
  Lina's priority communication (:mod:`tritonmoe.comm.priority`).
* :func:`fully_shard_moe` (:mod:`.fsdp`): the FSDP2 recipe with the same semantics.
* :func:`full_state_dict` / :func:`load_full_state_dict` (:mod:`.checkpoint`): global plain state
  dicts; an expert-parallel layer's own ``state_dict()`` is in global DTensors, so
  ``torch.distributed.checkpoint`` reshards across expert-parallel sizes;
  :func:`optimizer_state_dict` / :func:`load_optimizer_state_dict` do the same for the
  optimizer's per-expert states.
* :class:`PartitionedEmbedding` (:mod:`.embedding`): SE-MoE's embedding partition in data
  parallelism: the table's rows split over the data-parallel ranks, looked up through two
  all-to-alls (one in backward), no all-reduce of its gradient; checkpoints as a global table.
* :func:`allocate_tasks` / :func:`plan_tasks` / :func:`task_layout` / :func:`reallocate`
  (:mod:`.elastic`): SE-MoE's elastic multi-task training: GPUs per task by load (greedy
  min-max), a data-parallel group per task, re-allocation between steps through checkpoints.
* :class:`ExpertParallelWrapError` (:mod:`.guard`): raised when plain DDP or FSDP would treat
  different experts as replicas.
* :mod:`.init`: per-expert generators (expert e's weights depend on the seed and e alone).
"""

from .checkpoint import full_state_dict, load_full_state_dict, load_optimizer_state_dict, optimizer_state_dict
from .embedding import PartitionedEmbedding, shard_range
from .elastic import (
    TaskLayout,
    TaskPlan,
    allocate_tasks,
    loads_from_throughput,
    plan_tasks,
    reallocate,
    sync_gradients,
    task_layout,
)
from .data_parallel import COMM_POLICIES, DataParallelState, ExpertGradSync, data_parallel
from .fsdp import fully_shard_moe
from .guard import ExpertParallelWrapError
from .init import expert_seed
from .mesh import MoEMesh, as_moe_mesh
from .params import expert_parameters, is_expert_parameter, moe_layers, named_expert_parameters

__all__ = [
    "COMM_POLICIES",
    "DataParallelState",
    "ExpertGradSync",
    "ExpertParallelWrapError",
    "MoEMesh",
    "PartitionedEmbedding",
    "TaskLayout",
    "TaskPlan",
    "allocate_tasks",
    "loads_from_throughput",
    "plan_tasks",
    "reallocate",
    "sync_gradients",
    "task_layout",
    "shard_range",
    "as_moe_mesh",
    "data_parallel",
    "expert_parameters",
    "expert_seed",
    "full_state_dict",
    "fully_shard_moe",
    "is_expert_parameter",
    "load_full_state_dict",
    "load_optimizer_state_dict",
    "moe_layers",
    "named_expert_parameters",
    "optimizer_state_dict",
]
