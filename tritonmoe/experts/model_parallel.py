"""The expert path of model + expert + expert-sharding parallelism, with Parm's schedules
(paper 003; PAPERS.md 3.1-3.5).

Layout (:mod:`tritonmoe.parm_layout`): P = n_ep * n_esp ranks. EP rank a owns the experts
[a*E/n_ep, (a+1)*E/n_ep); the n_esp ranks of an ESP group each hold hidden units
[s*F/n_esp, (s+1)*F/n_esp) of those experts (``w1`` [E/n_ep, d, n1/n_esp]: for SwiGLU the
shard's gate columns then its up columns; ``w2`` [E/n_ep, F/n_esp, d]); their outputs are partial
sums. An MP group (n_mp ranks) holds one batch: the layer's input and output are replicated over
it, and the gradient arriving at the output is too (a tensor-parallel region's convention).

Schedules (``MoEConfig.parm_schedule``; the communication steps are :mod:`tritonmoe.comm.programs.model_parallel`):

* ``"baseline"``: DeepSpeed-MoE's order; every MP rank processes its copy of the batch.
* ``"s1"`` (pause MP *before* the gate): MP rank m routes tokens
  ``micro_batch_bounds(T, n_mp)[m]`` of the batch.
* ``"s2"`` (pause MP *after* the gate): every MP rank routes all T tokens, then sends part m of
  every expert's rows, and SAA returns every part to every MP rank.
* ``"auto"``: Parm's Algorithm 1 on fitted alpha-beta costs (:mod:`tritonmoe.policy.parm_schedule`) picks s1
  or s2 per batch size; every rank takes the same decision.

Semantics kept equal across the three (what the tests check against one process running the
unsharded experts on the de-duplicated batches):

* **Routing decisions.** Baseline and S2 route the whole batch (capacity from its T tokens). S1
  routes a slice but gives the same decisions: the router logits are row-invariant in fp64
  (:func:`tritonmoe.router.router_logits`), and capacity counts are reduced over the MP group
  first -- each rank all-gathers the per-(slot, expert) selection counts of its MP peers, and a
  slot is kept iff its position in the whole batch's priority order (slot j, then token t) is
  below ``capacity(T)`` (PAPERS.md 3.2 ambiguity 3: the reading "reduce the counts", not
  "per-slice capacity"). The load-balancing and z losses use the batch's selection counts and an
  all-reduce of the score sums and squared logsumexps (backward: the identity, as Megatron's
  reduce-from-tensor-parallel region), so ``aux_loss`` is the batch's on every MP rank.
* **Gradients.** The input gradient is the batch's on every MP rank (S1: the MP split's backward
  all-gathers the slices' gradients; S2: the MP split of the rows all-gathers the rows'
  gradients). The router's gradient is the batch's on every MP rank (S1 all-reduces the slices'
  contributions over the MP group). The expert weights' gradient counts each token once: the
  baseline's experts see every batch n_mp times (one copy per MP rank), so its deferred weight
  gradient (fp64 reference) keeps one copy of each batch and a non-deferred one is divided by
  n_mp.
* ``last_routing`` is the batch's routing (baseline, S2) or this MP rank's slice's (S1).
* Bitwise in fp64 where the summation order allows: with n_esp = 1, outputs, input, router and
  expert-weight gradients of all three equal the single-process reference bit for bit, except S1's
  router gradient and auxiliary loss (sums over the MP slices: equal to rounding). With n_esp > 1
  the expert output is a sum of n_esp partials (and the input gradient a sum of n_esp partial
  products), which rounds differently from one product over the whole hidden dimension.
"""

from __future__ import annotations

from typing import Optional

import torch

from tritonmoe.comm.errors import input_status, raise_rank_input_error
from tritonmoe.core.autograd import first_order
from tritonmoe.comm.executor import RealExecutor
from tritonmoe.comm.partition import transpose_chunks_unchecked
from tritonmoe.comm.programs.model_parallel import (
    BASELINE,
    PAUSE_AFTER_GATE,
    PAUSE_BEFORE_GATE,
    ExpertShard,
    ParmBlockState,
    ffn_shard_work,
    part_bounds,
    baseline_plan,
    parm_block,
    pause_plan,
    ranges,
    run_collective,
    saa_plan,
)
from tritonmoe.comm.splits import check_agreement, comm_device
from tritonmoe.config import MoEConfig
from tritonmoe.core.types import Routing
from tritonmoe.core.validation import GLU_ACTIVATIONS
from tritonmoe.comm.programs.pipeline import micro_batch_bounds
from tritonmoe.core.specs import ffn_options
from tritonmoe.experts.base import ExpertPath, ExpertWeights, dtype_code
from tritonmoe.router import RouteStep, router_logits
from tritonmoe.parallel.init import init_experts_
from tritonmoe.parm_layout import LayoutError, ParmGroups, groups_from_process_groups
from tritonmoe.policy.parm_schedule import ParmSchedulePolicy
from tritonmoe.reference import SegmentBias

__all__ = ["ParmExperts", "EspShard", "SCHEDULE_NAMES", "shard_expert_weights", "shard_expert_biases"]

#: MoEConfig.parm_schedule -> the schedule's name in tritonmoe.comm.programs.model_parallel.
SCHEDULE_NAMES = {"baseline": BASELINE, "s1": PAUSE_BEFORE_GATE, "s2": PAUSE_AFTER_GATE}



def shard_expert_weights(w1: torch.Tensor, w2: torch.Tensor, config: MoEConfig, layout, rank: int):
    """This layout rank's ``(w1, w2)`` slices of the full expert weights ``w1`` [E, d, n1] and
    ``w2`` [E, F, d] (e.g. to load an unsharded checkpoint)."""
    a = layout.ep[rank]
    L = config.num_experts // layout.n_ep
    e = slice(a * L, (a + 1) * L)
    w1_s, w2_s = EspShard(config, layout.esp[rank], layout.n_esp).slice_weights(w1[e], w2[e])
    return w1_s.contiguous(), w2_s.contiguous()


def shard_expert_biases(b1: torch.Tensor, b2: torch.Tensor, config: MoEConfig, layout, rank: int):
    """This layout rank's ``(b1, b2)`` of the full expert biases ``b1`` [E, n1] and ``b2``
    [E, d]: ``b1`` sliced like ``w1``'s columns (for SwiGLU the shard's gate then up columns),
    ``b2`` whole for the rank's experts (every ESP shard holds it; shard 0 adds it)."""
    a, s = layout.ep[rank], layout.esp[rank]
    L = config.num_experts // layout.n_ep
    F = config.d_ffn
    Fs = F // layout.n_esp
    e = slice(a * L, (a + 1) * L)
    if config.activation in GLU_ACTIVATIONS:
        b1_s = torch.cat([b1[e, s * Fs : (s + 1) * Fs], b1[e, F + s * Fs : F + (s + 1) * Fs]], dim=-1)
    else:
        b1_s = b1[e, s * Fs : (s + 1) * Fs]
    return b1_s.contiguous(), b2[e].contiguous()


def _executor(x: torch.Tensor, path: "ParmExperts", phase: str) -> RealExecutor:
    return RealExecutor(x.device, phase=phase, timeline=path.timeline)


def _record(path: "ParmExperts", ex: RealExecutor) -> None:
    if path.trace is not None:
        path.trace.extend(ex.trace)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_zeros((rows,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


# ---------------------------------------------------------------------------------------------
# The MP and ESP steps around the block, as small autograd functions on the real executor
# ---------------------------------------------------------------------------------------------


class _GatherSlices(torch.autograd.Function):
    """Rows split in contiguous slices over a group (slice q: ``sizes[q]`` rows) -> all rows.
    Forward: a padded all-gather. Backward: this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, y, path, group, sizes, me, kind):
        ctx.lo = sum(sizes[:me])
        ctx.n = sizes[me]
        rmax = max(sizes)
        ex = _executor(y, path, "fwd")
        g = run_collective(ex, "all_gather", _pad_rows(y, rmax), group=group, kind=kind)
        _record(path, ex)
        pieces = [g[q * rmax : q * rmax + sizes[q]] for q in range(len(sizes))]
        return torch.cat(pieces, 0)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.lo : ctx.lo + ctx.n], None, None, None, None, None


class _SplitSlices(torch.autograd.Function):
    """All rows -> this rank's contiguous slice. Backward: the slices' gradients all-gathered
    over the group (every rank gets the whole gradient)."""

    @staticmethod
    def forward(ctx, x, path, group, sizes, me, kind):
        ctx.args = (path, group, sizes, kind)
        lo = sum(sizes[:me])
        return x[lo : lo + sizes[me]].clone()

    @staticmethod
    @first_order("the model-parallel (Parm) expert path")
    def backward(ctx, grad):
        path, group, sizes, kind = ctx.args
        rmax = max(sizes)
        ex = _executor(grad, path, "bwd")
        g = run_collective(ex, "all_gather", _pad_rows(grad, rmax), group=group, kind=kind)
        _record(path, ex)
        return torch.cat([g[q * rmax : q * rmax + sizes[q]] for q in range(len(sizes))], 0), None, None, None, None, None


class _SplitRows(torch.autograd.Function):
    """S2's MP split of a permuted buffer: ``x[index[me]]``. Backward: every MP rank's rows'
    gradients all-gathered and put back at their rows (``index[q]`` for rank q)."""

    @staticmethod
    def forward(ctx, x, path, group, indices, me, kind):
        ctx.args = (path, group, indices, kind, x.shape[0])
        return x.index_select(0, indices[me])

    @staticmethod
    @first_order("the model-parallel (Parm) expert path")
    def backward(ctx, grad):
        path, group, indices, kind, R = ctx.args
        sizes = [int(i.numel()) for i in indices]
        rmax = max(sizes)
        ex = _executor(grad, path, "bwd")
        g = run_collective(ex, "all_gather", _pad_rows(grad, rmax), group=group, kind=kind)
        _record(path, ex)
        full = grad.new_zeros((R,) + tuple(grad.shape[1:]))
        for q, idx in enumerate(indices):
            if sizes[q]:
                full[idx] = g[q * rmax : q * rmax + sizes[q]]
        return full, None, None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group (S1's router weight:
    each MP rank's slice contributes, every MP rank gets the batch's gradient)."""

    @staticmethod
    def forward(ctx, w, path, group):
        ctx.args = (path, group)
        return w.clone()

    @staticmethod
    @first_order("the model-parallel (Parm) expert path")
    def backward(ctx, grad):
        path, group = ctx.args
        ex = _executor(grad, path, "bwd")
        g = run_collective(ex, "all_reduce", grad.contiguous(), group=group, kind="router_grad")
        _record(path, ex)
        return g, None, None


class _AllReduceForward(torch.autograd.Function):
    """All-reduce forward; identity backward (the sum is used identically on every rank, each of
    which back-propagates its own copy: Megatron's reduce-from-tensor-parallel-region)."""

    @staticmethod
    def forward(ctx, x, path, group):
        ex = _executor(x, path, "fwd")
        out = run_collective(ex, "all_reduce", x.contiguous(), group=group, kind="mp_scores")
        _record(path, ex)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherBatches(torch.autograd.Function):
    """The baseline's ESP all-gather of the tokens (padded to ``tmax`` rows per member).
    Backward: the reduce-scatter (every member's gradient of this rank's tokens, summed)."""

    @staticmethod
    def forward(ctx, x, path, group, tmax):
        ctx.args = (path, group, tmax, x.shape[0])
        ex = _executor(x, path, "fwd")
        g = run_collective(ex, "all_gather", _pad_rows(x, tmax), group=group, kind="esp_allgather")
        _record(path, ex)
        return g

    @staticmethod
    @first_order("the model-parallel (Parm) expert path")
    def backward(ctx, grad):
        path, group, tmax, T = ctx.args
        ex = _executor(grad, path, "bwd")
        g = run_collective(ex, "reduce_scatter", grad.contiguous(), group=group, kind="esp_reduce_scatter")
        _record(path, ex)
        return g[:T], None, None, None


class _Dump(torch.autograd.Function):
    """Parm's Dump: ``x[index]`` with every row of x sent once per ESP shard of its expert.
    Backward: each row's gradient is the sum of its copies' gradients, in shard order
    (``pos[r, s]`` is the position of row r's copy for shard s)."""

    @staticmethod
    def forward(ctx, x, index, pos):
        ctx.save_for_backward(pos)
        ctx.R = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    @first_order("the model-parallel (Parm) expert path")
    def backward(ctx, grad):
        (pos,) = ctx.saved_tensors
        return _sum_copies(grad, pos), None, None


def _sum_copies(buf: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out[r] = sum over s (in order) of buf[pos[r, s]] -- Parm's local combine."""
    out = buf.index_select(0, pos[:, 0])
    for s in range(1, pos.shape[1]):
        out = out + buf.index_select(0, pos[:, s])
    return out


class EspShard:
    """This rank's slice of the experts' hidden dimension: ESP shard ``index`` of ``n_esp``, the
    ``width = d_ffn / n_esp`` hidden units ``[index * width, (index + 1) * width)`` of every local
    expert -- which columns of ``w1`` and rows of ``w2`` it holds, and its compute on received
    rows. Shard 0 adds the second bias (:meth:`compute`)."""

    def __init__(self, config: MoEConfig, index: int, n_esp: int) -> None:
        self.config = config
        self.index = index
        self.width = config.d_ffn // n_esp

    def slice_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's ``(w1, w2)`` of whole experts ``w1`` [L, d, n1] and ``w2`` [L, F, d]: for
        a GLU activation its gate columns then its up columns of ``w1``; its rows of ``w2``
        (views or new tensors, not necessarily contiguous)."""
        c, s, Fs = self.config, self.index, self.width
        F = c.d_ffn
        h = slice(s * Fs, (s + 1) * Fs)
        if c.activation in GLU_ACTIVATIONS:
            w1_s = torch.cat([w1[:, :, h], w1[:, :, F + s * Fs : F + (s + 1) * Fs]], dim=-1)
        else:
            w1_s = w1[:, :, h]
        return w1_s, w2[:, h, :]

    def weight_shapes(self, num_local_experts: int):
        """Shapes of this shard's ``w1`` and ``w2`` for ``num_local_experts`` experts."""
        c, Fs = self.config, self.width
        n1 = 2 * Fs if c.activation in GLU_ACTIVATIONS else Fs
        return (num_local_experts, c.d_model, n1), (num_local_experts, Fs, c.d_model)

    def compute(self, ffn, weights: ExpertWeights, counts_GL: torch.Tensor, counts_list: Optional[list],
                dtype: torch.dtype) -> ExpertShard:
        """The shard's compute (:meth:`ParmExperts.shard` says what it does) with the grouped
        FFN implementation ``ffn`` on rows of ``dtype``."""
        c = self.config
        defers = getattr(ffn, "defers_weight_grad", False)
        counts_L = counts_GL.sum(0)
        offsets = counts_L.new_zeros(counts_GL.shape[1] + 1)
        offsets[1:] = torch.cumsum(counts_L, 0)
        backend = c.backend
        opts = ffn_options(c)  # the clamped SwiGLU's limit and alpha
        adds_b2 = self.index == 0
        offs_host = None
        if weights.b2 is not None and not adds_b2:
            if counts_list is None:
                counts_list = counts_GL.tolist()  # host sync: only without the plan's host counts
            per_expert = [sum(col) for col in zip(*counts_list)] if counts_list else []
            offs_host = [0]
            for n in per_expert:
                offs_host.append(offs_host[-1] + int(n))

        def fn(recv: torch.Tensor, params, wgrad) -> torch.Tensor:
            w = weights.with_params(params)
            x_em = transpose_chunks_unchecked(recv, counts_GL, backend)
            kw = {"wgrad": wgrad} if (defers and wgrad is not None) else {}
            b2 = w.b2 if adds_b2 else None
            y_em = ffn(x_em, offsets, w.w1, w.w2, c.activation, w.b1, b2, **opts, **kw)
            if w.b2 is not None and not adds_b2:
                slot = wgrad if (defers and y_em.dtype == torch.float64) else None
                y_em = SegmentBias.apply(y_em, offs_host, w.b2, slot, False)  # its gradient only
            return transpose_chunks_unchecked(y_em, counts_GL.t(), backend)

        return ExpertShard(fn=fn, params=weights.params(), work=ffn_shard_work(c, self.width, dtype))


# ---------------------------------------------------------------------------------------------
# The expert path
# ---------------------------------------------------------------------------------------------


class ParmExperts(ExpertPath):
    """Model + expert + expert-sharding parallelism with Parm's schedules (see the module
    docstring). Build it with :meth:`from_groups` (the layer does).

    Attributes:
        groups: this rank's :class:`~tritonmoe.parm_layout.ParmGroups`.
        schedule_used: "baseline", "s1" or "s2": what the last forward ran.
        schedule_policy: the :class:`~tritonmoe.policy.parm_schedule.ParmSchedulePolicy` that picks
            each forward's schedule.
        cost_model: the fitted :class:`tritonmoe.policy.parm_schedule.ParmCostModel` ``auto`` decides with
            (measured on the groups at the first ``auto`` forward when None; set one to skip).
        trace: when a list, receives every executor operation of forward and backward.
    """

    def __init__(self, config: MoEConfig, groups: ParmGroups) -> None:
        super().__init__(config)
        layout = groups.layout
        layout.check_model(config.num_experts, config.d_ffn)
        self.groups = groups
        self.layout = layout
        L = config.num_experts // layout.n_ep
        self.num_local_experts = L
        self.expert_start = groups.a * L
        self.esp_shard = EspShard(config, layout.esp[groups.rank], layout.n_esp)
        self.shard_width = self.esp_shard.width
        self.schedule_used: Optional[str] = None
        self.schedule_policy = ParmSchedulePolicy(config, groups)
        self.trace: Optional[list] = None

    @property
    def cost_model(self):
        """The fitted :class:`~tritonmoe.policy.parm_schedule.ParmCostModel` ``auto`` decides with
        (held by :attr:`schedule_policy`; None until the first ``auto`` forward; set one to skip
        the measurement)."""
        return self.schedule_policy.cost_model

    @cost_model.setter
    def cost_model(self, model) -> None:
        self.schedule_policy.cost_model = model

    @classmethod
    def from_groups(
        cls,
        config: MoEConfig,
        *,
        ep_group=None,
        mp_group=None,
        esp_group=None,
        ep_esp_group=None,
        groups: Optional[ParmGroups] = None,
        dtype: torch.dtype = torch.float32,
    ) -> "ParmExperts":
        """The path of this rank. With ``groups`` (from :meth:`ParmLayout.process_groups`)
        nothing is exchanged but the config check; otherwise the layout is read from the process
        groups with one exchange over the default group (collective: every rank builds its
        layer), which also checks that the ranks agree on the groups and the config; either way
        a disagreement raises the same :class:`~tritonmoe.parm_layout.LayoutError` on every
        rank before any data moves."""
        process_groups = dict(ep_group=ep_group, mp_group=mp_group, esp_group=esp_group, ep_esp_group=ep_esp_group)
        return cls(config, _agreed_groups(config, dtype, groups, process_groups))

    # -- shapes and weights ----------------------------------------------------------------------

    def init_weights_(self, w1: torch.Tensor, w2: torch.Tensor, *, base_seed: int, expert_start: int) -> None:
        """Fill this rank's shards in place with the slices of the layout-independent initial
        experts (:func:`tritonmoe.parallel.init.init_experts_` draws each whole local expert,
        then this rank keeps its ESP columns): the same global experts on every layout."""

        if w1.is_meta or w2.is_meta:
            return
        c = self.config
        L = w1.shape[0]
        full1 = w1.new_empty(L, c.d_model, c.n1)
        full2 = w2.new_empty(L, c.d_ffn, c.d_model)
        init_experts_(full1, full2, base_seed=base_seed, expert_start=expert_start, d_model=c.d_model, d_ffn=c.d_ffn)
        w1_s, w2_s = self.esp_shard.slice_weights(full1, full2)
        with torch.no_grad():
            w1.copy_(w1_s)
            w2.copy_(w2_s)

    def weight_shapes(self):
        return self.esp_shard.weight_shapes(self.num_local_experts)

    def shard(
        self, weights: ExpertWeights, x_like: torch.Tensor, counts_GL: torch.Tensor, counts_list: Optional[list] = None
    ) -> ExpertShard:
        """The expert-shard compute on received rows grouped by origin (``counts_GL`` rows per
        origin and local expert; ``counts_list`` the same as host ints): expert-major re-layout,
        grouped FFN on this shard, back.

        Biases: ``b1`` holds this shard's columns of the first projection (added by every shard);
        ``b2`` is whole on every shard of the ESP group but added to the output by shard 0 only,
        so the partial outputs sum to the expert's output with the bias once (with n_esp = 1 the
        shard computes exactly what the single-process layer does). Every shard gets the whole
        ``b2`` gradient (the column sums of its rows' output gradient, which every shard receives
        identically): the replicas stay equal, like a row-parallel linear's bias."""
        return self.esp_shard.compute(self.impl("grouped_ffn", x_like), weights, counts_GL, counts_list, x_like.dtype)

    # -- the step ----------------------------------------------------------------------------------

    def choose(self, x_TD: torch.Tensor, router=None, weights: Optional[ExpertWeights] = None) -> str:
        """The schedule of this forward ("baseline", "s1" or "s2"): :meth:`ParmSchedulePolicy.choose
        <tritonmoe.policy.parm_schedule.ParmSchedulePolicy.choose>` ("auto" asks the step model;
        every rank decides from the same agreed inputs). At the first "auto" forward the model is
        fitted (:meth:`fit_cost_model`; with the layer's ``router`` step and expert ``weights``,
        its per-schedule startup measured on the layer too)."""
        return self.schedule_policy.choose(x_TD, fit=lambda x, T: self.fit_cost_model(x, T, router, weights),
                                           refused=self.input_error)

    def fit_cost_model(self, x_TD: torch.Tensor, tokens: int, router=None, weights: Optional[ExpertWeights] = None,
                       *, reps: int = 9):
        """The step model ``auto`` decides with (collective over the P ranks; every rank gets the
        same model): :meth:`ParmSchedulePolicy.fit <tritonmoe.policy.parm_schedule.ParmSchedulePolicy.fit>`,
        with ``router`` (the layer's :class:`~tritonmoe.router.RouteStep`) and ``weights`` given,
        probing this layer's three schedules (:meth:`_schedule_probe`) for their startup: the
        host work of the schedule's Python steps -- plans, autograd nodes, copies -- that timing
        the collectives and the local ops alone does not see."""
        if router is None or weights is None:
            return self.schedule_policy.fit(x_TD, tokens, reps=reps)
        saved = (self.trace, self.timeline, self.schedule_used, self.path_used)
        self.trace = self.timeline = None
        try:
            return self.schedule_policy.fit(x_TD, tokens, self._schedule_probe(router, weights), reps=reps)
        finally:
            self.trace, self.timeline, self.schedule_used, self.path_used = saved

    def _schedule_probe(self, router, weights: ExpertWeights):
        """``run(x, schedule)``: this layer's forward + backward under ``schedule`` (gradients
        returned, not accumulated into the parameters), through a routing step that records no
        logits (the layer's last logits are left alone). The caller keeps the path's step state
        (trace, timeline) out of the probe."""
        params = [p for p in (*router.parameters(), *weights.params()) if p.requires_grad]
        quiet = RouteStep(router.config, router.router, router.expert_bias)  # records no logits

        def run(x: torch.Tensor, sched: str) -> None:
            out, _, _ = self._run_schedule(quiet, weights, x, sched)
            torch.autograd.grad(out.sum(), [x] + params, allow_unused=True)

        return run

    def step(self, x_TD: torch.Tensor, router, weights: ExpertWeights) -> tuple[torch.Tensor, Routing, torch.Tensor]:
        return self._run_schedule(router, weights, x_TD, self.choose(x_TD, router, weights))

    def _run_schedule(self, router, weights: ExpertWeights, x_TD: torch.Tensor,
                      sched: str) -> tuple[torch.Tensor, Routing, torch.Tensor]:
        self.schedule_used = sched
        self.path_used = f"parm_{sched}"
        if sched == "s1":
            return self._pause_before_gate(router, weights, x_TD)
        logits_TE, routing = router.route(x_TD)
        aux = router.aux_loss(logits_TE, routing)
        if sched == "s2":
            out = self._pause_after_gate(x_TD, routing, weights)
        else:
            out = self._baseline(x_TD, routing, weights)
        return out, routing, aux

    def __call__(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        """The experts on tokens routed by the caller (every token of the batch): the baseline or
        S2 (S1 routes itself: use the layer)."""
        sched = self.config.parm_schedule if self.config.parm_schedule != "auto" else "s2"
        if sched == "s1":
            raise ValueError("parm_schedule='s1' routes each MP rank's slice itself; call the layer, not its path")
        self.schedule_used = sched
        return self._pause_after_gate(x_TD, routing, weights) if sched == "s2" else self._baseline(x_TD, routing, weights)

    # -- metadata ----------------------------------------------------------------------------------

    #: The counts all-gather (:meth:`_table`) carries a rank's refused input in every fixed
    #: schedule (S1's MP exchanges before it have fixed sizes); under ``"auto"`` the schedule
    #: agreement's all-reduce carries it, before the first forward's fit and its probes
    #: (:meth:`ParmSchedulePolicy.agreed_tokens
    #: <tritonmoe.policy.parm_schedule.ParmSchedulePolicy.agreed_tokens>`; docs/rank-input.md).
    reports_input_errors = True

    def _table(self, tokens: int, counts_E: torch.Tensor) -> list[list[int]]:
        """Every rank's [tokens, rows per expert] (:func:`_counts_table`): one all-gather over
        the P ranks (the only host sync of the step besides the backend's), from which every
        split of the step derives; it carries this rank's refused input, if any."""
        return _counts_table(self, tokens, counts_E)

    # -- S1: pause MP before the gate ---------------------------------------------------------------

    def _pause_before_gate(self, router, weights: ExpertWeights, x_TD: torch.Tensor):
        G, lay = self.groups, self.layout
        T = x_TD.shape[0]
        sizes = [b - a for a, b in micro_batch_bounds(T, lay.n_mp)]
        m = G.m
        gate = router.router
        b = gate.bias
        if G.mp is not None:
            x_m = _SplitSlices.apply(x_TD, self, G.mp, sizes, m, "mp_allgather_grad")
            # each MP rank's slice contributes to the router's gradients: summed over the MP group
            w = _AllReduceGrad.apply(gate.weight, self, G.mp)
            b = _AllReduceGrad.apply(b, self, G.mp) if b is not None else None
        else:
            x_m, w = x_TD, gate.weight

        logits = router_logits(router.input(x_m), w, None if G.mp is not None else gate, bias=b)
        router.record(logits)
        routing, aux = _route_slice(self, router, logits, T)
        out_m = self._pause(x_m, routing, weights, PAUSE_BEFORE_GATE)
        if G.mp is not None:
            out = _GatherSlices.apply(out_m, self, G.mp, sizes, m, "mp_allgather")
        else:
            out = out_m
        return out, routing, aux

    # -- S1 / S2 common: Dump, EP&ESP all-to-all, shards, local combine ------------------------------

    def _pause(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights, schedule: str) -> torch.Tensor:
        c = self.config
        x_perm, info = self.impl("permute", x_TD)(x_TD, routing.topk_ids, c.num_experts)
        table = self._table(x_TD.shape[0], info.counts)
        plan = pause_plan(self.layout, self.groups.rank, [row[1:] for row in table], c.num_experts, x_TD.device)
        send = _Dump.apply(x_perm, plan.dump_index, plan.combine_pos)
        state = ParmBlockState(
            schedule=schedule, plan=plan, shard=self.shard(weights, x_TD, plan.recv_counts, plan.recv_counts_list), groups=self.groups,
            timeline=self.timeline, trace=self.trace,
        )
        back = parm_block(state, send, weights.params())
        y_perm = _sum_copies(back, plan.combine_pos)
        return self.impl("unpermute", x_TD)(y_perm, info, routing.topk_weights)

    # -- S2: pause MP after the gate ------------------------------------------------------------------

    def _pause_after_gate(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        c, G, lay = self.config, self.groups, self.layout
        if G.mp is None:
            return self._pause(x_TD, routing, weights, PAUSE_AFTER_GATE)
        x_perm, info = self.impl("permute", x_TD)(x_TD, routing.topk_ids, c.num_experts)
        batch_counts = info.counts.tolist()  # host sync: the parts' sizes are host ints
        sp = saa_plan(lay, G.rank, batch_counts, c.num_experts, x_TD.device)
        indices = [_part_index(batch_counts, lay.n_mp, q, x_TD.device) for q in range(lay.n_mp)]
        part = _SplitRows.apply(x_perm, self, G.mp, indices, G.m, "mp_allgather_grad")
        part_counts = torch.tensor(sp.part_counts[G.m], dtype=torch.int64)
        table = self._table(x_TD.shape[0], part_counts)
        plan = pause_plan(lay, G.rank, [row[1:] for row in table], c.num_experts, x_TD.device)
        send = _Dump.apply(part, plan.dump_index, plan.combine_pos)
        state = ParmBlockState(
            schedule=PAUSE_AFTER_GATE, plan=plan, shard=self.shard(weights, x_TD, plan.recv_counts, plan.recv_counts_list), groups=G,
            saa=sp, timeline=self.timeline, trace=self.trace,
        )
        gathered = parm_block(state, send, weights.params())
        y_perm = _sum_copies(gathered, sp.full_pos)
        return self.impl("unpermute", x_TD)(y_perm, info, routing.topk_weights)

    # -- the baseline -------------------------------------------------------------------------------

    def _baseline(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        c, G, lay = self.config, self.groups, self.layout
        E, K = c.num_experts, c.top_k
        T = x_TD.shape[0]
        info_counts = torch.zeros(E, dtype=torch.int64, device=x_TD.device)
        ids = routing.topk_ids
        if ids.numel():
            flat = ids.reshape(-1).long()
            info_counts = torch.bincount(flat[flat >= 0], minlength=E)
        table = self._table(T, info_counts)
        tokens = [row[0] for row in table]
        plan = baseline_plan(lay, G.rank, tokens, [row[1:] for row in table], E, x_TD.device)
        permute = self.impl("permute", x_TD)
        n = len(plan.origins)
        if G.esp is not None:
            tmax = plan.tokens_max
            xg = _GatherBatches.apply(x_TD, self, G.esp, tmax)
            ex = _executor(x_TD, self, "fwd")
            ids_pad = torch.full((tmax, K), -1, dtype=ids.dtype, device=ids.device)
            ids_pad[:T] = ids
            ids_g = run_collective(ex, "all_gather", ids_pad.to(comm_device(G.esp)), group=G.esp, kind="esp_ids")
            _record(self, ex)
            ids_g = ids_g.to(ids.device)
            perms, infos = [], []
            for k in range(n):
                Tk = plan.tokens[k]
                xk = xg[k * tmax : k * tmax + Tk]
                p, inf = permute(xk, ids_g[k * tmax : k * tmax + Tk], E)
                perms.append(p)
                infos.append(inf)
            own_info = infos[plan.own]
            cat = torch.cat(perms, 0) if n > 1 else perms[0]
        else:
            cat, own_info = permute(x_TD, ids, E)
        send = cat.index_select(0, plan.send_index)
        state = ParmBlockState(
            schedule=BASELINE, plan=plan, shard=self.shard(weights, x_TD, plan.recv_counts, plan.recv_counts_list), groups=G,
            timeline=self.timeline, trace=self.trace,
        )
        own_rows = parm_block(state, send, weights.params())
        return self.impl("unpermute", x_TD)(own_rows, own_info, routing.topk_weights)


def _counts_table(path: "ParmExperts", tokens: int, counts_E: torch.Tensor) -> list[list[int]]:
    """:meth:`ParmExperts._table`: each rank's [tokens, status word, counts] all-gathered; a
    non-zero status word (a rank that refused its input) raises the same RankInputError on every
    rank; the rows returned drop the word."""
    g = path.groups.ep_esp
    head = [tokens, input_status(path.input_error)]
    vec = torch.cat([torch.tensor(head, dtype=torch.int64, device=counts_E.device), counts_E.to(torch.int64)])
    if g is None:
        if path.input_error is not None:
            raise path.input_error
        return [[tokens] + vec[2:].tolist()]  # host sync: split sizes are host ints (one rank: no exchange)
    dev = comm_device(g)
    ex = RealExecutor(dev, timeline=path.timeline)
    out = run_collective(ex, "all_gather", vec.to(dev), group=g, kind="counts")
    _record(path, ex)
    rows = out.view(path.layout.P, -1).tolist()  # host sync: split sizes are host ints
    raise_rank_input_error([r[1] for r in rows], path.input_error, g, "Parm's counts all-gather")
    return [[r[0]] + r[2:] for r in rows]


def _part_index(batch_counts, n_mp: int, q: int, device) -> torch.Tensor:

    off, acc = [], 0
    for v in batch_counts:
        off.append(acc)
        acc += v
    b = [part_bounds(int(v), n_mp, q) for v in batch_counts]
    return ranges([off[e] + lo for e, (lo, _) in enumerate(b)], [hi - lo for lo, hi in b], device)


def _count(ids: torch.Tensor, E: int) -> torch.Tensor:
    flat = ids.reshape(-1)
    return torch.bincount(flat[flat >= 0].long(), minlength=E).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# S1's routing of an MP slice with the batch's capacity and auxiliary losses
# ---------------------------------------------------------------------------------------------


def _route_slice(path: "ParmExperts", router, logits: torch.Tensor, T: int) -> tuple[Routing, torch.Tensor]:
    """S1: route this MP rank's slice (``logits``) with the capacity and auxiliary losses of the
    whole batch of ``T`` tokens (the module docstring's routing decisions)."""
    c, G = path.config, path.groups
    need_aux = c.aux_loss_coef > 0 or c.z_loss_coef > 0
    routing = path.impl("route", logits)(logits, c.top_k, capacity=None, with_aux=need_aux, **router.options())
    routing = router.finish(routing)  # as RouteStep.route: a non-finite bias poisons the weights (no sync)
    cap = c.capacity(T)
    ids = routing.topk_ids.long()
    all_counts = _batch_slot_counts(path, ids, logits, gather=cap is not None or c.aux_loss_coef > 0)
    if cap is not None:
        routing = _within_capacity(routing, ids, all_counts, G.m if G.mp is not None else 0, cap, c.num_experts)
    aux = torch.zeros((), device=logits.device, dtype=torch.float32)
    if need_aux:
        return routing, _batch_aux_loss(path, routing, all_counts, T, aux)
    return routing, aux


def _batch_slot_counts(path: "ParmExperts", ids: torch.Tensor, logits: torch.Tensor, *, gather: bool) -> torch.Tensor:
    """[n_mp, K, E]: per MP rank, its slice's selections per (slot, expert) -- with ``gather``
    all-gathered over the MP group, else [1, K, E] with this rank's alone."""
    c, G = path.config, path.groups
    E, K = c.num_experts, c.top_k
    slot_counts = torch.zeros(K, E, dtype=torch.int64, device=ids.device)
    if ids.shape[0]:
        slot_counts.scatter_add_(1, ids.t(), torch.ones_like(ids.t()))
    if G.mp is None or not gather:
        return slot_counts.unsqueeze(0)
    ex = _executor(logits, path, "fwd")
    dev = comm_device(G.mp)
    allc = run_collective(ex, "all_gather", slot_counts.to(dev), group=G.mp, kind="mp_counts")
    _record(path, ex)
    return allc.view(path.layout.n_mp, K, E).to(ids.device)


def _batch_aux_loss(path: "ParmExperts", routing: Routing, all_counts: torch.Tensor, T: int, aux: torch.Tensor) -> torch.Tensor:
    """``aux`` plus the batch's load-balancing and z losses on every MP rank: the slices' score
    sums and squared logsumexps all-reduced over the MP group (backward: the identity), the
    selections from ``all_counts``."""
    c, G = path.config, path.groups
    E, K = c.num_experts, c.top_k
    s_E = routing.score_sum
    lse = routing.logsumexp
    z = lse.square().sum() if lse.numel() else lse.sum() * 0.0
    vec = torch.cat([s_E, z.reshape(1).to(s_E.dtype)])
    if G.mp is not None:
        vec = _AllReduceForward.apply(vec, path, G.mp)
    score_sum, z_sum = vec[:E], vec[E]
    if T == 0:
        return aux + 0.0 * vec.sum()
    if c.aux_loss_coef > 0:
        sel = all_counts.sum((0, 1)).to(score_sum.dtype)
        f_E = sel / float(T * K)
        aux = aux + c.aux_loss_coef * (E * (f_E * score_sum).sum() / T)
    if c.z_loss_coef > 0:
        aux = aux + c.z_loss_coef * (z_sum / T)
    return aux


def _within_capacity(routing: Routing, ids: torch.Tensor, all_counts: torch.Tensor, m: int, capacity: int,
                     E: int) -> Routing:
    """``routing`` of MP rank ``m``'s slice with the slots beyond the batch's ``capacity`` dropped
    (:func:`_mp_capacity_keep`): their ids -1, their weights 0, the counts recounted."""
    keep = _mp_capacity_keep(ids, all_counts, m, capacity)
    ids_k = torch.where(keep, ids, torch.full_like(ids, -1))
    return Routing(
        topk_ids=ids_k.to(torch.int32),
        topk_weights=torch.where(keep, routing.topk_weights, torch.zeros_like(routing.topk_weights)),
        counts=_count(ids_k, E),
        selected_counts=routing.selected_counts,
        score_func=routing.score_func,
        score_sum=routing.score_sum,
        logsumexp=routing.logsumexp,
    )


def _mp_capacity_keep(ids_TK: torch.Tensor, all_counts: torch.Tensor, m: int, capacity: int) -> torch.Tensor:
    """Which of this MP rank's slots survive the batch's capacity: slot (t, j) of expert e is
    kept iff its position among the batch's slots of e in priority order (slot j, then token t;
    this rank's tokens come after those of MP ranks < m) is below ``capacity``.

    ``all_counts`` [n_mp, K, E]: per MP rank, selections per (slot, expert)."""
    T, K = ids_TK.shape
    E = all_counts.shape[2]
    if T == 0:
        return torch.zeros(T, K, dtype=torch.bool, device=ids_TK.device)
    c = all_counts.to(torch.int64)
    total_KE = c.sum(0)  # [K, E]
    before_j = torch.cumsum(total_KE, 0) - total_KE  # slots of lower j, whole batch
    lower_ranks = c[:m].sum(0)  # [K, E] slots of the same j on lower MP ranks
    prefix_KE = before_j + lower_ranks
    local_KE = c[m]
    local_before_j = torch.cumsum(local_KE, 0) - local_KE
    flat = ids_TK.t().reshape(-1)  # (j, t) priority order
    order = torch.argsort(flat, stable=True)
    counts_E = torch.bincount(flat, minlength=E)
    starts = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    rank_local = torch.empty_like(rank_sorted)
    rank_local[order] = rank_sorted  # among this rank's slots of the same expert, (j, t) order
    j = torch.arange(K, device=flat.device).repeat_interleave(T)
    pos = prefix_KE[j, flat] + rank_local - local_before_j[j, flat]
    return (pos < capacity).view(K, T).t()


def _agreed_groups(config: MoEConfig, dtype: torch.dtype, groups: Optional[ParmGroups], process_groups: dict) -> ParmGroups:
    """This rank's :class:`ParmGroups` for :meth:`ParmExperts.from_groups`, the config checked
    (a typed error before any exchange) and agreed over the layout's ranks: ``groups`` as given,
    else read from the ``process_groups`` (``ep_group``, ``mp_group``, ``esp_group``,
    ``ep_esp_group``) with one exchange over the default group."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a tritonmoe.MoEConfig, got {type(config).__name__}")
    if config.pipeline_degree != 1:
        raise ValueError(
            f"pipeline_degree={config.pipeline_degree}: Parm's schedules run one micro-op; use "
            "pipeline_degree=1 with mp_group/esp_group"
        )
    values = _config_values(config, dtype)
    if groups is None:
        # the layout first (its exchange compares the sizes that shape the groups), then every
        # field, with each rank's value as written
        groups = groups_from_process_groups(
            **process_groups, values={k: values[k] for k in ("num_experts", "d_model", "d_ffn", "dtype")},
            what="MoELayer(ep_group=..., mp_group=..., esp_group=...)",
        )
    elif not isinstance(groups, ParmGroups):
        raise TypeError(f"parm_groups must be a ParmGroups, got {type(groups).__name__}")
    _check_config_agreement(groups, values, {**config.agreement_labels(), "dtype": str(dtype)})
    return groups


def _config_values(config: MoEConfig, dtype: torch.dtype) -> dict[str, int]:
    """What the ranks of a Parm layout compare: every field that changes what a rank computes
    (:meth:`MoEConfig.agreement_values`) and the parameters' dtype."""
    return {**config.agreement_values(), "dtype": dtype_code(dtype)}


def _check_config_agreement(groups: ParmGroups, values: dict[str, int], labels: Optional[dict] = None) -> None:
    """Every rank of the layout passes the same config values (one small collective; on a
    disagreement one more, naming each rank's value as written)."""

    if groups.ep_esp is None:
        return
    try:
        check_agreement(values, group=groups.ep_esp, what="the Parm MoEConfig", labels=labels)
    except ValueError as e:
        raise LayoutError(str(e)) from None
