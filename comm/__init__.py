"""Communication building blocks for expert parallelism on torch.distributed (installed as
``tritonmoe.comm``). NCCL on CUDA tensors, gloo on CPU tensors; no custom extension. This
package never imports the layer.

* :func:`all_to_all` - differentiable all-to-all with uneven splits (backward: the reverse one).
* :func:`exchange_counts` / :class:`DispatchPlan` - one small all-to-all of per-expert counts
  from which every split derives; :func:`check_splits` / :class:`SplitMismatchError` - caller
  splits compared across the group, the same error on every rank.
* :class:`AllToAllDispatcher` - the expert-parallel communication steps (counts exchange,
  dispatch, combine) apart from the layer's local work; :func:`run_pipelined` - micro-op
  pipelining of dispatch / expert compute / combine, forward and backward.
* :func:`copy_segments` / :func:`transpose_chunks` - the partition/concat op (a Triton kernel on
  CUDA) that re-lays-out all-to-all buffers.
* :class:`Executor` - the interface schedules issue their operations through (lanes,
  dependencies); :class:`RealExecutor` runs them on torch.distributed, and
  :class:`tritonmoe.plan.SimExecutor` records them for the simulator (:mod:`.executor`).
* :class:`CommScheduler` - a rank's communication scheduler: token exchanges first, gradient
  reductions one micro-op at a time behind them (Lina, :mod:`.priority`), or FIFO; the DDP
  communication hook :func:`scheduled_allreduce_hook`.
* :class:`Timeline` - per-operation spans (rank, lane, kind, micro-op, phase), the pipelining
  efficiency and a step-time breakdown.
* :func:`fused_all_gather` / :func:`bucketed_all_reduce` / :class:`BucketPlan` /
  :class:`GradientBuckets` - SE-MoE's fusion communication: several tensors in one all-gather,
  greedy buckets of small tensors in one all-reduce each, gradient buckets agreed across ranks
  once (:mod:`.fused`).
* :func:`saa` - Parm's simultaneous all-to-all and all-gather (two lanes, two process groups).
* :func:`hierarchical_all_to_all` / :func:`hierarchical_groups` - SE-MoE's two-step all-to-all
  (intra-node, layout transform, inter-node among same-local-rank GPUs).
* :mod:`.parm` - Parm's schedules (baseline, pause-before-gate, pause-after-gate) as executor code.
* :mod:`.errors` - :class:`ScheduleError` / :class:`LaneStartError`, :class:`RankInputError` (one
  rank's refused input, raised on every rank at the step's first exchange), :func:`backend_errors` (every
  collective of the library runs inside it) and :func:`group_timeout` / :func:`new_group` (every
  group the library creates inherits its parent's timeout).
"""

from .all_to_all import all_to_all
from .dispatcher import AllToAllDispatcher
from .partition import chunk_transpose_segments, copy_segments, transpose_chunks
from tritonmoe.comm.programs.pipeline import ExpertFn, pipeline_pass, run_pipelined
from .splits import (
    DispatchPlan,
    SplitMismatchError,
    check_agreement,
    check_splits,
    exchange_counts,
    exchange_splits,
    plan_from_counts,
)
from .errors import LaneStartError, RankIndexError, RankInputError, RankTypeError, RankValueError, backend_errors, group_timeout, new_group
from .executor import COMM, COMM2, COMPUTE, COPY, Executor, Handle, RealExecutor, ScheduleError, TraceEntry, VirtualTensor, Work
from .priority import (
    DEFAULT_CHUNK_BYTES,
    PRIORITY_EXCHANGE,
    PRIORITY_GRADIENT,
    CommScheduler,
    GradSyncState,
    ordered_all_reduce_,
    partition,
    scheduled_allreduce_hook,
)
from .fused import (
    BucketPlan,
    BucketPlanMismatchError,
    GradientBuckets,
    bucketed_all_reduce,
    fused_all_gather,
    plan_buckets,
)
from .priority import fuse_micro_ops
from .timeline import Span, Timeline
from tritonmoe.comm.programs.saa import saa
from tritonmoe.comm.programs.hierarchical import (
    HierarchicalGroups,
    hierarchical_all_to_all,
    hierarchical_groups,
)

__all__ = [
    "BucketPlan",
    "BucketPlanMismatchError",
    "GradientBuckets",
    "bucketed_all_reduce",
    "fuse_micro_ops",
    "fused_all_gather",
    "plan_buckets",
    "AllToAllDispatcher",
    "CommScheduler",
    "DEFAULT_CHUNK_BYTES",
    "GradSyncState",
    "PRIORITY_EXCHANGE",
    "PRIORITY_GRADIENT",
    "ordered_all_reduce_",
    "partition",
    "scheduled_allreduce_hook",
    "DispatchPlan",
    "ExpertFn",
    "Span",
    "SplitMismatchError",
    "Timeline",
    "all_to_all",
    "check_agreement",
    "check_splits",
    "chunk_transpose_segments",
    "copy_segments",
    "exchange_counts",
    "exchange_splits",
    "run_pipelined",
    "pipeline_pass",
    "plan_from_counts",
    "Executor",
    "RealExecutor",
    "Handle",
    "TraceEntry",
    "VirtualTensor",
    "Work",
    "ScheduleError",
    "RankInputError",
    "RankTypeError",
    "RankValueError",
    "RankIndexError",
    "LaneStartError",
    "backend_errors",
    "group_timeout",
    "new_group",
    "COMPUTE",
    "COMM",
    "COMM2",
    "COPY",
    "transpose_chunks",
    "saa",
    "HierarchicalGroups",
    "hierarchical_all_to_all",
    "hierarchical_groups",
]
