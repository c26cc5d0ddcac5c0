"""SE-MoE's elastic multi-task training (PAPERS.md 2.5; 002 section 4.1, Fig. 6).

Several tasks (each its own model or head, on its own data) share G GPUs. Each task t runs data
parallel on ``g_t`` ranks; with loads ``w_t`` (work per step, e.g. samples), the step time is set
by the busiest GPU, ``max_t w_t / g_t``.

* :func:`allocate_tasks` -- the greedy min-max: one GPU per task, then each further GPU to the
  task with the largest ``w_t / g_t``. Optimal for ``max_t w_t / g_t`` (an exchange argument:
  the greedy's final bottleneck task got its last GPU while it was the largest ratio, so no
  allocation can lower it without taking a GPU from a task that would then exceed it), and
  ``sum g_t = G``. ``allocate_tasks([512, 256, 128, 128], 8) == [4, 2, 1, 1]``, the paper's.
* :func:`plan_tasks` -- the same with the paper's option (b): light tasks merged onto one GPU
  when memory allows (and when that lowers the bottleneck or is needed because T > G); the plan
  says why for every merge it made or refused.
* :func:`task_layout` -- the run-time side: contiguous rank blocks per task and one
  data-parallel process group per task (:class:`TaskLayout`).
* :func:`sync_gradients` -- per-task gradients (summed over the task's group) and gradients of
  parameters the tasks share (summed over every rank); experts of an MoE layer that is
  expert-parallel over every rank are shared by the tasks with no extra reduction.
* :func:`reallocate` -- elastic re-allocation between steps: new loads from measured per-task
  throughput, a new allocation, and, when it differs, the ranks regrouped with every task's
  parameters and optimizer state carried through the checkpoint path
  (``torch.distributed.checkpoint``: each task saves on its old group, each rank loads its new
  task's checkpoint on its new group).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from tritonmoe.comm.errors import backend_errors, new_group
from tritonmoe.comm.fused import bucketed_all_reduce

__all__ = ["TaskLayout", "TaskPlan", "allocate_tasks", "loads_from_throughput", "plan_tasks", "reallocate", "sync_gradients",
           "task_layout"]


def _check_loads(loads: Any) -> list[float]:
    if isinstance(loads, (str, bytes)) or not hasattr(loads, "__len__"):
        raise TypeError(f"loads must be a sequence of numbers, got {type(loads).__name__}")
    out = []
    for i, w in enumerate(loads):
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise TypeError(f"loads[{i}]={w!r} is not a number")
        if not w > 0 or w != w or w == float("inf"):
            raise ValueError(f"loads[{i}]={w!r}: every task's load must be a positive finite number")
        out.append(float(w) if isinstance(w, float) else w)
    if not out:
        raise ValueError("loads is empty: give at least one task")
    return out


def _check_gpus(num_gpus: Any, tasks: int) -> int:
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int):
        raise TypeError(f"num_gpus must be an int, got {type(num_gpus).__name__}")
    if num_gpus < tasks:
        raise ValueError(
            f"num_gpus={num_gpus} is fewer than the {tasks} tasks: every task needs a GPU (merge light tasks onto "
            "shared GPUs with tritonmoe.plan.plan_tasks(..., merge=True), or add GPUs)"
        )
    return num_gpus


def allocate_tasks(loads: Sequence[float], num_gpus: int) -> list[int]:
    """GPUs per task minimising ``max_t loads[t] / g_t`` with ``sum g_t = num_gpus`` and every
    ``g_t >= 1`` (greedy; ties go to the lower task index). Raises ``ValueError`` for fewer GPUs
    than tasks or a non-positive load, ``TypeError`` for non-numbers."""
    w = _check_loads(loads)
    G = _check_gpus(num_gpus, len(w))
    g = [1] * len(w)
    for _ in range(G - len(w)):
        # compare w_a / g_a with w_b / g_b by cross-multiplying: exact for integer loads
        t = 0
        for u in range(1, len(w)):
            if w[u] * g[t] > w[t] * g[u]:
                t = u
        g[t] += 1
    return g


@dataclass
class TaskPlan:
    """A multi-task allocation with merged light tasks.

    Attributes:
        units: task indices per unit (a unit of several tasks shares its GPUs; its load is the
            sum); gpus: GPUs per unit (sum = num_gpus); bottleneck: ``max load / gpus``;
        reasons: one line per merge made or refused.
    """

    units: list[list[int]]
    gpus: list[int]
    bottleneck: float
    reasons: list[str] = field(default_factory=list)

    def gpus_of_task(self) -> list[int]:
        """GPUs each task runs on (tasks of a merged unit share them)."""
        out = {}
        for u, g in zip(self.units, self.gpus):
            for t in u:
                out[t] = g
        return [out[t] for t in sorted(out)]


def plan_tasks(loads: Sequence[float], num_gpus: int, *, merge: bool = True,
               task_bytes: Optional[Sequence[float]] = None, gpu_bytes: Optional[float] = None) -> TaskPlan:
    """:func:`allocate_tasks` with the paper's option (b): merge light tasks onto shared GPUs.

    Starting from one unit per task, repeatedly try merging the two lightest units while both
    are light (load below the mean load per GPU, ``sum(loads) / num_gpus``; the paper merges
    light tasks only): the merge is kept when the units' memory fits one GPU (``sum task_bytes <= gpu_bytes``; unchecked when
    either is None) and it lowers the bottleneck ``max w_u / g_u`` of the greedy allocation of
    the units -- or is needed because there are more units than GPUs. Stops at the first merge
    that does not help. Every decision is recorded in ``reasons``.
    """
    w = _check_loads(loads)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus!r} must be a positive int")
    if task_bytes is not None and len(task_bytes) != len(w):
        raise ValueError(f"task_bytes has {len(task_bytes)} entries for {len(w)} tasks")
    mem = list(task_bytes) if task_bytes is not None else [0.0] * len(w)
    units = [[t] for t in range(len(w))]
    reasons: list[str] = []

    def load(u):
        return sum(w[t] for t in u)

    def best(us):
        if len(us) > num_gpus:
            return None, float("inf")
        g = allocate_tasks([load(u) for u in us], num_gpus)
        return g, max(load(u) / n for u, n in zip(us, g))

    gpus, bottleneck = best(units)
    while merge and len(units) > 1:
        order = sorted(range(len(units)), key=lambda i: (load(units[i]), units[i]))
        a, b = order[0], order[1]
        merged = sorted(units[a] + units[b])
        light = sum(w) / num_gpus  # the mean load per GPU: units below it are light
        if gpus is not None and load(units[b]) >= light:
            reasons.append(f"kept tasks {units[a]} and {units[b]} apart: {units[b]} is not light (load {load(units[b]):.4g} >= "
                           f"the mean per-GPU load {light:.4g})")
            break
        need = sum(mem[t] for t in merged)
        if gpu_bytes is not None and task_bytes is not None and need > gpu_bytes:
            reasons.append(f"kept tasks {units[a]} and {units[b]} apart: together they need {need:.4g} bytes > {gpu_bytes:.4g} per GPU")
            break
        trial = [u for i, u in enumerate(units) if i not in (a, b)] + [merged]
        g2, b2 = best(trial)
        if g2 is None or not (b2 < bottleneck or gpus is None):
            reasons.append(f"kept tasks {units[a]} and {units[b]} apart: merging them gives a bottleneck of {b2:.4g} "
                           f"per GPU, not below {bottleneck:.4g}")
            break
        why = "there are more tasks than GPUs" if gpus is None else f"the bottleneck drops from {bottleneck:.4g} to {b2:.4g} per GPU"
        reasons.append(f"merged tasks {units[a]} and {units[b]} onto shared GPUs: {why}")
        units, gpus, bottleneck = trial, g2, b2
    if gpus is None:
        raise ValueError(f"{len(w)} tasks cannot fit {num_gpus} GPUs: merging stopped ({reasons[-1] if reasons else 'merge=False'})")
    order = sorted(range(len(units)), key=lambda i: units[i][0])
    return TaskPlan([units[i] for i in order], [gpus[i] for i in order], bottleneck, reasons)


# ---------------------------------------------------------------------------------------------
# Run time
# ---------------------------------------------------------------------------------------------


@dataclass
class TaskLayout:
    """Ranks per task and this rank's task's data-parallel group.

    Attributes:
        allocation: GPUs (ranks) per task; ranks: the global ranks of each task (contiguous
        blocks in task order); task: this rank's task; group: its task's process group;
        rank_in_task, task_size."""

    allocation: list[int]
    ranks: list[list[int]]
    task: int
    group: Any

    @property
    def task_size(self) -> int:
        return len(self.ranks[self.task])

    @property
    def rank_in_task(self) -> int:
        return self.ranks[self.task].index(dist.get_rank())

    @property
    def loss_scale(self) -> float:
        """Multiply this rank's loss (the mean over its samples) by it: the sum over the task's
        ranks is then the task's mean loss, and the sum over every rank the sum of the tasks'
        mean losses (the objective :func:`sync_gradients` reduces for)."""
        return 1.0 / self.task_size


def task_layout(allocation: Sequence[int]) -> TaskLayout:
    """Contiguous rank blocks per task (task 0 first) and one process group per task (with the
    default group's timeout). Collective over the default group; ``sum(allocation)`` must be its
    size (every rank passes the same allocation)."""
    alloc = [int(a) for a in allocation]
    if any(a < 1 for a in alloc):
        raise ValueError(f"allocation={alloc}: every task needs at least one rank")
    world = dist.get_world_size()
    if sum(alloc) != world:
        raise ValueError(f"allocation={alloc} sums to {sum(alloc)} but the world has {world} ranks")
    ranks, start = [], 0
    for a in alloc:
        ranks.append(list(range(start, start + a)))
        start += a
    me = dist.get_rank()
    mine, task = None, -1
    for t, rs in enumerate(ranks):
        g = new_group(rs)  # collective over the default group, in task order on every rank
        if me in rs:
            mine, task = g, t
    return TaskLayout(alloc, ranks, task, mine)


def sync_gradients(layout: TaskLayout, task_params: Sequence[torch.nn.Parameter],
                   shared_params: Sequence[torch.nn.Parameter] = (), *, bucket_bytes: int = 25 * 2**20) -> None:
    """Reduce gradients after ``(loss * layout.loss_scale).backward()`` on every rank, so that
    every gradient is that of the sum over tasks of each task's mean loss:

    * ``task_params`` (this rank's task's model): summed over the task's group;
    * ``shared_params`` (dense parameters every rank holds, e.g. the router of an MoE layer
      shared by the tasks): summed over every rank (the default group), identical everywhere;
    * the experts of an MoE layer that is expert-parallel over every rank need nothing: its
      all-to-alls already bring every rank's (scaled) gradient to the expert's owner.

    One ``bucketed_all_reduce`` per group (:mod:`tritonmoe.comm.fused`); a parameter without a
    gradient on this rank contributes zeros (and gets the reduced gradient). Collective over
    the task's group, then the default group."""
    for group, params in ((layout.group, list(task_params)), (None, list(shared_params))):
        if not params:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for p, red in zip(params, bucketed_all_reduce(grads, group, bucket_bytes)):
            if p.grad is None:
                p.grad = red
            else:
                p.grad.copy_(red)


def loads_from_throughput(samples_per_step: Sequence[float], samples_per_s: Sequence[float], allocation: Sequence[int]) -> list[float]:
    """GPU-seconds per step of each task: its samples per step over its measured per-GPU rate
    (``samples_per_s[t] / allocation[t]``). A task that is slower per sample gets more load."""
    if not (len(samples_per_step) == len(samples_per_s) == len(allocation)):
        raise ValueError("samples_per_step, samples_per_s and allocation need one entry per task")
    _check_loads(samples_per_step)
    _check_loads(samples_per_s)
    return [n / (s / g) for n, s, g in zip(samples_per_step, samples_per_s, allocation)]


def reallocate(
    layout: TaskLayout,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    samples_per_step: Sequence[float],
    samples_per_s: float,
    checkpoint_dir: str,
    build: Callable[[int, TaskLayout], tuple[torch.nn.Module, torch.optim.Optimizer]],
) -> tuple[TaskLayout, torch.nn.Module, torch.optim.Optimizer]:
    """Re-allocate GPUs between steps from measured throughput (collective over the default group).

    Args:
        layout: the current :class:`TaskLayout`; model, optimizer: this rank's task's.
        samples_per_step: every task's global batch (the same list on every rank).
        samples_per_s: this rank's task's measured throughput (samples/s of the whole task);
            the task's ranks' values are averaged.
        checkpoint_dir: where each task's state passes through (``<dir>/task<t>``).
        build: ``build(task, new_layout) -> (model, optimizer)``, a fresh model and optimizer of
            a task (called on a rank that joins another task; its state is then loaded).

    Returns the new layout and this rank's model and optimizer: the same objects when its task
    is unchanged (the state stays in place), else the built ones holding the task's parameters
    and optimizer state as they were on the task's old ranks. When the allocation is unchanged,
    nothing is saved or regrouped.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    import torch.distributed.checkpoint as dcp

    T = len(layout.allocation)
    if len(samples_per_step) != T:
        raise ValueError(f"samples_per_step has {len(samples_per_step)} entries for {T} tasks")
    if not (isinstance(samples_per_s, (int, float)) and samples_per_s > 0):
        raise ValueError(f"samples_per_s={samples_per_s!r} must be a positive number (this task's measured throughput)")
    every: list = [None] * dist.get_world_size()
    with backend_errors("the throughput exchange of reallocate"):
        dist.all_gather_object(every, (layout.task, float(samples_per_s)))
    rates = [sum(s for t, s in every if t == u) / sum(1 for t, _ in every if t == u) for u in range(T)]
    new_alloc = allocate_tasks(loads_from_throughput(samples_per_step, rates, layout.allocation), dist.get_world_size())
    if new_alloc == layout.allocation:
        return layout, model, optimizer
    path = os.path.join(checkpoint_dir, f"task{layout.task}")
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=path, process_group=layout.group)  # on the task's old group
    with backend_errors("the barrier after the tasks' checkpoints"):
        dist.barrier()
    new = task_layout(new_alloc)
    joined = set(new.ranks[new.task]) - set(layout.ranks[new.task])
    if not joined:  # nobody joins this task: its ranks keep their state in place
        return new, model, optimizer
    # dcp.load is collective over the task's new group: ranks that stay reload their own state
    if new.task != layout.task:
        model, optimizer = build(new.task, new)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint_dir, f"task{new.task}"), process_group=new.group)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return new, model, optimizer
