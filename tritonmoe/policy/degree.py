"""Choosing the pipeline degree at run time: ``MoEConfig(pipeline_degree="auto" | "search")``.

Every rank of an expert-parallel group must run the same degree (the degree fixes how many
all-to-alls each rank issues), but ranks hold different token counts. Both policies agree
through **one small collective per forward**: an all-reduce (MAX) of a 2-element vector (this
rank's token count and, for "search", its last measured time), followed by one host sync
(the degree is a host decision). Every rank then decides from the same values with the same
deterministic code, so the decisions agree without further communication. The forward of the
expert-parallel path already has one host sync (the counts exchange); this adds a second one
and an 8-16 byte collective.

* :class:`AutoDegree` ("auto"): the planner (:func:`tritonmoe.plan.choose`) simulates the layer
  for the group's largest token count, rounded up to a bucket (:func:`token_bucket`, steps of
  2^(1/4)), with a cost model from ``config.cost_model``, else the file named by the environment
  variable :data:`ENV_COST_MODEL`, else a default (a packaged model fitted on a CPU/gloo machine
  for CPU tensors; the DGX preset of the detected GPU for CUDA). The choice is cached per bucket.
  Construction checks, on every rank, that the model can price this group size, and the ranks
  compare the model's fingerprint (a different file on one rank is an error on all ranks).
* :class:`SearchDegree` ("search"): MPMoE's profile-based search (paper 004 Algorithm 1,
  :class:`~tritonmoe.sim.search.GranularitySearch`, degrees 2..8): a step of a bucket not yet
  decided runs the next candidate degree; the next forward reads that step's measured time
  (the expert block's forward + backward spans on this rank's timeline), takes the maximum over
  ranks (in the same all-reduce) and feeds it to the search, which stops at the turning point
  and caches the answer for the bucket.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from tritonmoe.comm.errors import backend_errors
from tritonmoe.comm.splits import comm_device, group_rank_size
from tritonmoe.comm.timeline import Timeline

from tritonmoe.sim.cost_model import Cluster
from tritonmoe.sim.cost_model import CostModel, CostModelError
from tritonmoe.sim.schedules import DEFAULT_DEGREES
from tritonmoe.sim.search import GranularitySearch
from tritonmoe.sim.planner import choose

__all__ = ["ENV_COST_MODEL", "DEFAULT_CPU_MODEL", "token_bucket", "runtime_cost_model", "AutoDegree", "SearchDegree",
           "make_policy"]

#: Environment variable naming a cost-model file for ``pipeline_degree="auto"``.
ENV_COST_MODEL = "TRITONMOE_COST_MODEL"
#: The packaged default for CPU tensors (fitted with ``python -m tritonmoe.plan profile`` on a
#: 2-core CPU machine over gloo; its meta says where and when).
DEFAULT_CPU_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "sim", "data", "cpu_gloo.json")


def token_bucket(tokens: int) -> tuple[int, int]:
    """(bucket id, representative token count): buckets grow by 2^(1/4) (~19%); the
    representative is the bucket's upper edge, so a bucket's choice is planned for its
    largest batch."""
    t = max(int(tokens), 1)
    b = math.ceil(4 * math.log2(t) - 1e-9)
    return b, max(1, math.ceil(2 ** (b / 4) - 1e-9))


def _gpu_cluster(device: torch.device, world_size: int) -> Cluster:
    name = torch.cuda.get_device_name(device)
    per_node = max(1, min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))))
    for key, preset in (("H200", "dgx-h200"), ("H100", "dgx-h100"), ("A100", "mpmoe-adira")):
        if key in name:
            c = Cluster.preset(preset)
            nodes = max(1, math.ceil(world_size / c.gpus_per_node))
            return c.with_nodes(nodes)
    raise CostModelError(
        f"pipeline_degree='auto': no built-in description of GPU {name!r} ({per_node} per node). Fix: measure one with "
        f"`torchrun --nproc-per-node {per_node} -m tritonmoe.plan profile --out FILE` and pass "
        f"MoEConfig(cost_model=FILE) or set {ENV_COST_MODEL}=FILE"
    )


def runtime_cost_model(config: Any, world_size: int, device: torch.device) -> CostModel:
    """The cost model "auto" plans with (see the module docstring for the order)."""
    path = getattr(config, "cost_model", None) or os.environ.get(ENV_COST_MODEL)
    if path:
        return CostModel.load(path)
    if device.type == "cuda":
        return _gpu_cluster(device, world_size).cost_model("bfloat16")
    return CostModel.load(DEFAULT_CPU_MODEL)


def fingerprint_int(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


@dataclass
class Pending:
    bucket: int
    degree: int
    timeline: Timeline
    mark: int


class DegreePolicy:
    """Chooses the pipeline degree of each forward (collective: every rank calls :meth:`step`
    with its own token count, in the same order)."""

    #: an integer every rank must agree on (compared at construction)
    fingerprint: int = 0

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.rank, self.world_size = group_rank_size(group)
        self.device = comm_device(group)

    def _agree(self, values: list[float]) -> list[float]:
        """Element-wise maximum over the group (one all-reduce, one host sync)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        with backend_errors("the pipeline-degree agreement (allreduce MAX)", self.group):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()  # host sync: the degree is a host decision

    def step(self, tokens: int, timeline: Optional[Timeline]) -> tuple[int, Optional[Timeline]]:
        """(degree for this forward, timeline the expert block should record into)."""
        raise NotImplementedError


class AutoDegree(DegreePolicy):
    """``pipeline_degree="auto"``: the planner's choice for the group's largest token count."""

    def __init__(self, config: Any, group: Any, device: torch.device, dtype: torch.dtype,
                 degrees: tuple[int, ...] = DEFAULT_DEGREES) -> None:
        super().__init__(group, device)
        self.config = config
        self.dtype = dtype
        self.degrees = degrees
        self.cost = runtime_cost_model(config, self.world_size, device)
        if self.world_size > 1 and self.cost.cluster is None:
            self.cost.check_group_size(self.world_size, ("all_to_all",))
        self.fingerprint = fingerprint_int(self.cost.fingerprint())
        self.cache: dict[int, int] = {}
        self.plans: dict[int, Any] = {}

    def step(self, tokens: int, timeline: Optional[Timeline]) -> tuple[int, Optional[Timeline]]:

        t_max = int(self._agree([float(tokens)])[0])
        b, rep = token_bucket(t_max)
        if b not in self.cache:
            degs = [n for n in self.degrees if n == 1 or n <= rep]
            plan = choose(self.config, rep, self.cost, world_size=self.world_size, dtype=self.dtype,
                          pipeline_degree=degs, breakdown=False)  # run time: only the choice is read
            self.cache[b] = plan.pipeline_degree
            self.plans[b] = plan
        return self.cache[b], timeline


class SearchDegree(DegreePolicy):
    """``pipeline_degree="search"``: MPMoE's profile-based online search (see the module
    docstring). ``search`` is the :class:`~tritonmoe.sim.search.GranularitySearch`;
    ``steps_profiled`` counts forwards that ran a candidate rather than a decided degree."""

    fingerprint = 0

    def __init__(self, config: Any, group: Any, device: torch.device, n_min: int = 2, n_max: int = 8) -> None:
        super().__init__(group, device)
        self.search = GranularitySearch(n_min, n_max)
        self._gens: dict[int, Any] = {}
        self._next: dict[int, int] = {}
        self._pending: Optional[Pending] = None
        self._own = Timeline()
        self.steps_profiled = 0

    @staticmethod
    def measure(timeline: Timeline, mark: int) -> float:
        """The expert block's time in one step: forward span + backward span (each first start
        to last end) of what was recorded after ``mark``; -1 when nothing was recorded."""
        # host sync (CUDA): reading the previous step's event timestamps, only on profiling steps
        spans = timeline.spans(since=mark)
        total = 0.0
        for phase in ("fwd", "bwd"):
            ss = [s for s in spans if s.phase == phase]
            if ss:
                total += max(s.end for s in ss) - min(s.start for s in ss)
        return total if spans else -1.0

    def step(self, tokens: int, timeline: Optional[Timeline]) -> tuple[int, Optional[Timeline]]:
        pend = self._pending
        measured = self.measure(pend.timeline, pend.mark) if pend is not None else -1.0
        t_max, m_max = self._agree([float(tokens), measured])
        if pend is not None:
            self._pending = None
            if m_max > 0:  # every rank recorded the step (else profile the same degree again)
                try:
                    self._next[pend.bucket] = self._gens[pend.bucket].send(m_max)
                except StopIteration:
                    self._gens.pop(pend.bucket)
                    self._next.pop(pend.bucket, None)
        b, rep = token_bucket(int(t_max))
        n = self.search.answer(rep)
        if n is None and b not in self._gens:
            gen = self.search.steps(rep)
            try:
                self._next[b] = next(gen)
                self._gens[b] = gen
            except StopIteration as stop:  # answered from a known range without profiling
                n = stop.value
        if n is not None:
            return n, timeline
        n = self._next[b]
        tl = timeline
        if tl is None:
            tl = self._own
            tl.clear()
        self._pending = Pending(b, n, tl, tl.mark())
        self.steps_profiled += 1
        return n, tl


def make_policy(config: Any, group: Any, device: torch.device, dtype: torch.dtype):
    """The policy of ``config.pipeline_degree`` ("auto" or "search"), or the exception its
    construction raised (returned, not raised, so every rank can first compare outcomes)."""
    try:
        if config.pipeline_degree == "auto":
            return AutoDegree(config, group, device, dtype)
        return SearchDegree(config, group, device)
    except (OSError, ValueError) as exc:
        return exc
