"""Planning schedules: cost models, cluster descriptions, the simulator and the planner.

* :class:`CostModel` (:mod:`.cost_model`): alpha-beta collectives per (kind, group size, link
  class) fitted by least squares, compute rooflines, interference factors; versioned JSON.
* :class:`Cluster` (:mod:`.cluster`): a cluster from its hardware, and presets for the papers'
  testbeds and DGX H100/H200 nodes; ``cluster.cost_model(dtype)``.
* :class:`SimExecutor` / :class:`VirtualGroup` / :class:`Program` / :class:`SimOp`
  (:mod:`.sim_executor`): the schedule code of :mod:`tritonmoe.comm` recorded for every rank of a
  virtual cluster, without a process group or real tensors.
* :mod:`.engine`: the discrete-event engine (lanes, dependencies, collectives matched across
  ranks, fair-share links, interference).
* :func:`simulate` (:mod:`.simulate`): one layer step of every rank -> :class:`SimTimeline`.
* :func:`choose_bucket_bytes` (:mod:`.fusion`): SE-MoE's gradient bucket size from the
  alpha-beta fit; :func:`allocate_tasks` / :func:`plan_tasks` (from
  :mod:`tritonmoe.parallel.elastic`): SE-MoE's GPUs per task.
* :class:`ModelSpec` / :data:`MODEL_PRESETS` / :func:`get_model` (:mod:`.models`): published
  MoE models' shapes and exact parameter counts; :func:`memory_per_gpu` (:mod:`.memory_budget`):
  weights, gradients, optimizer state and activations per GPU under EP x DP.
* :func:`size` (:mod:`.sizing`): size a model on N GPUs (EP x DP, capacity factor, pipeline
  degree, memory strategy, all-to-all) under the simulator and the memory estimate ->
  :class:`SizingReport` (ranked candidates, ``explain()``); CLI ``plan --model NAME``.
* :func:`choose` (:mod:`.planner`): evaluate candidates (registered schedules and dimensions,
  :mod:`.schedules`) and pick the fastest -> :class:`Plan`.
"""

from tritonmoe.sim.cost_model import GPU, GPUS, LINKS, PRESETS, Cluster, Link
from tritonmoe.sim.cost_model import (
    CommSample,
    ComputeRate,
    ComputeSample,
    CostModel,
    CostModelError,
    HostSample,
    InterferenceSample,
    LinearFit,
    fit_linear,
)
from tritonmoe.sim.engine import CollectiveMismatchError, EngineResult, ScheduleHangError, SimulationError
from tritonmoe.sim.schedules import (
    DIMENSIONS,
    SCHEDULES,
    Dimension,
    PlanContext,
    RankStep,
    ScheduleSpec,
    register_dimension,
    register_schedule,
)
from tritonmoe.sim.executor import Program, SimExecutor, SimOp, VirtualGroup
from tritonmoe.sim.simulate import SimTimeline, routing_counts, simulate
from tritonmoe.sim.planner import Candidate, Plan, choose
from tritonmoe.sim.search import GranularitySearch
from tritonmoe.sim.memory_model import (
    MemoryBudgetError,
    MemoryPlan,
    choose_memory,
    expert_block_bytes,
    paper_memory,
    search_joint,
)
from .fusion import FusionChoice, choose_bucket_bytes
from tritonmoe.parallel.elastic import TaskPlan, allocate_tasks, plan_tasks
from .models import MODEL_PRESETS, ModelSpec, get_model
from .memory_budget import MemoryEstimate, MemoryRow, TrainingSetup, device_memory_bytes, memory_per_gpu
from .sizing import SizingCandidate, SizingError, SizingReport, size

__all__ = [
    "SizingCandidate",
    "SizingError",
    "SizingReport",
    "size",
    "MODEL_PRESETS",
    "ModelSpec",
    "get_model",
    "MemoryEstimate",
    "MemoryRow",
    "TrainingSetup",
    "device_memory_bytes",
    "memory_per_gpu",
    "FusionChoice",
    "TaskPlan",
    "allocate_tasks",
    "choose_bucket_bytes",
    "plan_tasks",
    "Cluster",
    "GPU",
    "GPUS",
    "LINKS",
    "Link",
    "PRESETS",
    "CommSample",
    "ComputeRate",
    "ComputeSample",
    "CostModel",
    "CostModelError",
    "HostSample",
    "InterferenceSample",
    "LinearFit",
    "fit_linear",
    "CollectiveMismatchError",
    "EngineResult",
    "ScheduleHangError",
    "SimulationError",
    "DIMENSIONS",
    "SCHEDULES",
    "Dimension",
    "PlanContext",
    "RankStep",
    "ScheduleSpec",
    "register_dimension",
    "register_schedule",
    "Program",
    "SimExecutor",
    "SimOp",
    "VirtualGroup",
    "SimTimeline",
    "routing_counts",
    "simulate",
    "Candidate",
    "Plan",
    "choose",
    "GranularitySearch",
    "MemoryBudgetError",
    "MemoryPlan",
    "choose_memory",
    "expert_block_bytes",
    "paper_memory",
    "search_joint",
]
