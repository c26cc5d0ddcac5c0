"""Expert parallelism with a dynamic, pipelined exchange: :class:`ExpertParallelExperts`."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tritonmoe.comm import AllToAllDispatcher, check_agreement
from tritonmoe.comm.programs import memory_reuse as _memory
from tritonmoe.comm.programs.memory_reuse import STRATEGIES, ExpertFFN
from tritonmoe.comm.programs.pipeline import micro_batch_bounds
from tritonmoe.comm.splits import comm_device
from tritonmoe.config import MoEConfig
from tritonmoe.core.specs import ffn_options
from tritonmoe.core.types import Routing
from tritonmoe.policy.degree import make_policy
from tritonmoe.policy.memory_strategy import (
    AutoMemory,
    SearchMemory,
    check_offload,
    pinned_memory_available,
    uses_offload,
)

from tritonmoe import fp8
from tritonmoe.backends import implementation

from .base import ExpertPath, ExpertWeights, dtype_code
from .local import fp8_experts_of, fp8_training


def _under_nonreentrant_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are ``torch.utils.checkpoint``'s (a non-reentrant
    checkpoint's forward or its recomputation)."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError, TypeError):  # a torch without the query: cannot tell
        return False
    return bool(hooks) and (getattr(hooks[0], "__module__", "") or "").startswith("torch.utils.checkpoint")


#: dtypes as small ints for the cross-rank agreement check.
#: run-time pipeline degrees as ints for the agreement check


def group_device(group: Any) -> torch.device:
    """The device a group's layer runs on: the current CUDA device for NCCL, else CPU."""

    return comm_device(group)


class ExpertParallelExperts(ExpertPath):
    """The experts of an expert-parallel group over this rank's tokens.

    Rank r of a group of P ranks owns the experts [r*E/P, (r+1)*E/P). Local steps here,
    communication in ``self.dispatcher`` (:class:`tritonmoe.comm.AllToAllDispatcher`): permute
    each of the ``pipeline_degree`` micro-batches (contiguous token ranges; routing and capacity
    were decided once for the whole local batch), exchange the per-expert counts once, then
    dispatch / expert FFN / combine per micro-op, pipelined (forward and backward), and unpermute
    each micro-batch. The expert FFN runs on the expert-major re-layout of the received rows: one
    grouped FFN per micro-op over the local experts; its weight gradients are deferred to one W
    step where the GEMM supports it (:mod:`tritonmoe.core.exact`).

    Construction is collective (one small all-to-all): every rank of the group must agree on the
    settings that size later collectives, or every rank raises the same ``ValueError``.

    ``config.pipeline_degree`` "auto" or "search" chooses the degree per forward through
    ``self.degree_policy`` (:mod:`tritonmoe.policy.degree`: one small all-reduce per forward makes
    every rank choose the same degree although their token counts differ).

    Attributes:
        dispatcher: the :class:`~tritonmoe.comm.AllToAllDispatcher` of the group.
        trace: when set to a list, receives every operation the schedule issues
            (:class:`~tritonmoe.comm.executor.TraceEntry`, forward then backward).
        degree_policy: the run-time degree policy ("auto"/"search"), else None.
        degree_used: the pipeline degree of the last forward.
        scheduler: a :class:`~tritonmoe.comm.CommScheduler` the exchanges go through (None:
            issued directly). When set, the backward announces its exchanges
            (``exchange_imminent``) as soon as it reaches the path's output, before the
            combine's backward (Lina's look-ahead stop), and the pipeline ends the announcement.
    """

    reports_input_errors = True

    def __init__(self, config: MoEConfig, group: Any, dtype: torch.dtype) -> None:
        super().__init__(config)

        c = config
        # The sizes of every later collective follow from these; a rank that disagrees would
        # make gloo abort mid-forward, so compare them once here (one small collective), before
        # any check that could fail on some ranks only.
        dt_code = dtype_code(dtype)
        self.degree_policy = None
        policy_code = 0
        if isinstance(c.pipeline_degree, str):

            # built on every rank before the agreement check; a rank that failed (a missing cost
            # model file) reports -1 so that every rank raises, not only that one
            policy = make_policy(c, group, group_device(group), dtype)
            policy_code = -1 if isinstance(policy, Exception) else policy.fingerprint
        # memory strategies: bad input fails here, on every rank, before any collective

        device = group_device(group)
        check_offload(c.memory_strategy, device)
        # memory_strategy="auto": the runtime (degree, strategy) choice, built (its cost model
        # loaded) on every rank before the agreement check, like the degree policy, so that a
        # rank where it fails makes every rank raise instead of leaving the others waiting in the
        # first forward's all-reduce
        memory_policy, memory_policy_code = None, 0
        if c.memory_strategy == "auto":
            memory_policy = self._memory_policy(group, dtype)
            memory_policy_code = -1 if isinstance(memory_policy, Exception) else memory_policy.fingerprint
        local_failures = [p for p in (policy if isinstance(c.pipeline_degree, str) else None, memory_policy)
                          if isinstance(p, Exception)]
        try:
            # every field that changes what a rank computes (MoEConfig.agreement_values), the
            # parameters' dtype, and the run-time policies' cost-model fingerprints
            check_agreement(
                {**c.agreement_values(), "dtype": dt_code, "degree_policy": policy_code,
                 "memory_policy": memory_policy_code},
                group=group,
                what="the expert-parallel MoEConfig (degree_policy, memory_policy: the cost model's fingerprint, -1 "
                     "where it failed to load)",
                labels={**c.agreement_labels(), "dtype": str(dtype)},
            )
        except ValueError as exc:
            if local_failures:  # name this rank's own cause too
                raise ValueError(f"{exc}. On this rank: {type(local_failures[0]).__name__}: "
                                 f"{local_failures[0]}") from local_failures[0]
            raise
        if local_failures:  # every rank failed alike
            raise local_failures[0]
        if isinstance(c.pipeline_degree, str):
            self.degree_policy = policy
        self.memory_policy = None
        if c.memory_strategy == "auto":
            # the runtime (degree, strategy) choice replaces the degree policy
            self.memory_policy = memory_policy
            self.degree_policy = None
        self.degree_used: Optional[int] = None
        #: the memory strategy of the last forward (None: unmanaged) and, when set to a dict,
        #: its statistics (layout, received rows, bytes copied to the host)
        self.memory_strategy_used: Optional[str] = None
        self.memory_stats: Optional[dict] = None
        self.group = group
        self.dispatcher = AllToAllDispatcher(c.num_experts, group, backend=c.backend)
        self.num_local_experts = self.dispatcher.num_local_experts
        self.expert_start = self.dispatcher.local_expert_start
        self.trace: Optional[list] = None
        self.scheduler = None

    def _memory_policy(self, group: Any, dtype: torch.dtype):
        """The ``memory_strategy="auto"`` policy, or the exception its construction raised (a
        cost model that does not load; returned, not raised, so every rank can first compare
        outcomes). Local: no collective."""
        try:
            return self._build_memory_policy(group, dtype)
        except (OSError, ValueError) as exc:
            return exc

    def _build_memory_policy(self, group: Any, dtype: torch.dtype):

        device = group_device(group)
        strategies = STRATEGIES
        if device.type == "cuda" and not pinned_memory_available():
            strategies = tuple(s for s in STRATEGIES if not uses_offload(s))
        if self.config.pipeline_degree == "search":
            return SearchMemory(self.config, group, device, strategies)
        return AutoMemory(self.config, group, device, dtype, strategies)

    def memory_ffn(self, plan, x_TD: torch.Tensor, routing: Routing, bounds, weights: ExpertWeights):
        """The :class:`tritonmoe.comm.programs.memory_reuse.ExpertFFN` of the managed block: the layer's grouped
        GEMM and activation, the dispatcher's re-layouts, and the re-permute of micro-batch i's
        tokens (from the layer input, which the router keeps anyway) for "recomm"."""

        c, disp = self.config, self.dispatcher
        permute = self.impl("permute", x_TD)
        x_keep, ids = x_TD.detach(), routing.topk_ids

        def resend(i: int) -> torch.Tensor:
            a, b = bounds[i]
            # the slot bound as the buffer's rows (no host sync), then the rows the forward sent
            rows = permute(x_keep[a:b], ids[a:b], c.num_experts, num_rows=(b - a) * ids.shape[1])[0]
            return rows[: plan.send_rows(i)]


        # the re-layouts without timeline spans of their own (they run inside the expert op's span,
        # forward and backward)
        return ExpertFFN(
            activation=c.activation, gemm=self.impl("grouped_gemm", x_TD),
            to_expert_major=lambda i, r: disp.to_expert_major(r, plan, i, span=False),
            to_source_major=lambda i, y: disp.to_source_major(y, plan, i, span=False),
            offsets=lambda i: disp.expert_offsets(plan, i), resend=resend,
            swiglu_limit=c.swiglu_limit, swiglu_alpha=c.swiglu_alpha,
            # the grouped FFN's forward and backward as the unmanaged path dispatches them (Triton
            # kernels on GPUs and backend='triton'; the reference on 'torch'); fp64 stays exact
            train=self.impl("grouped_ffn_train", x_TD), train_backward=self.impl("grouped_ffn_train_backward", x_TD),
        )

    def expert_fn(self, plan, x_like: torch.Tensor, weights: ExpertWeights):
        """The expert compute of micro-op i on its received rows (the schedule's ExpertFn);
        ``weights`` tells which biases the schedule's ``params`` carry."""
        disp = self.dispatcher
        ffn = self.impl("grouped_ffn", x_like)
        defers = getattr(ffn, "defers_weight_grad", False)
        activation = self.config.activation
        opts = ffn_options(self.config)

        def experts(i: int, recv_RD: torch.Tensor, params, wgrad) -> torch.Tensor:
            w = weights.with_params(params)
            x_RD = disp.to_expert_major(recv_RD, plan, i)
            kw = {"wgrad": wgrad} if (defers and wgrad is not None) else {}
            y_RD = ffn(x_RD, disp.expert_offsets(plan, i), w.w1, w.w2, activation, w.b1, w.b2, **opts, **kw)
            return disp.to_source_major(y_RD, plan, i)

        return experts

    def fp8_forward(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights, bounds) -> torch.Tensor:
        """The micro-ops with FP8 experts (:class:`_FP8Exchange`); same plan, pipeline and
        unpermute as the 16-bit path."""
        ex, disp = _FP8Exchange(self, x_TD, routing, weights), self.dispatcher
        sends, infos = [], []
        for a, b in bounds:
            buf, info = ex.send(x_TD[a:b], routing.topk_ids[a:b])
            sends.append(buf)
            infos.append(info)
        plan = disp.exchange_counts(torch.stack([info.counts for info in infos]), row_dtype=sends[0].dtype,
                                    row_width=sends[0].shape[1])
        sends = [s if s.shape[0] == plan.send_rows(i) else s[: plan.send_rows(i)] for i, s in enumerate(sends)]
        params = weights.params() if ex.train else ()
        backs = disp.run_pipelined(sends, plan, ex.expert_fn(plan), params, trace=self.trace)
        unpermute = self.impl("unpermute", x_TD)
        outs = [unpermute(backs[i], infos[i], routing.topk_weights[a:b]) for i, (a, b) in enumerate(bounds)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def __call__(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        c = self.config
        disp = self.dispatcher
        n, timeline = c.pipeline_degree, self.timeline
        strategy = c.memory_strategy
        if strategy not in (None, "keep") and _under_nonreentrant_checkpoint():
            # local and the same on every rank (the model code is): raised before any collective
            raise ValueError(
                f"memory_strategy={strategy!r} reuses buffers across micro-ops and restores them itself; inside "
                "torch.utils.checkpoint(use_reentrant=False) the recomputed forward's buffers would replace the "
                "restored ones in backward. Use memory_strategy='keep' (or None) under that checkpoint, checkpoint "
                "with use_reentrant=True, or let the memory strategy do the saving instead of the checkpoint"
            )
        if self.memory_policy is not None:  # one small all-reduce; a budget error is raised on every rank
            n, strategy, timeline = self.memory_policy.step(x_TD.shape[0], self.timeline)
        elif self.degree_policy is not None:
            n, timeline = self.degree_policy.step(x_TD.shape[0], self.timeline)
        self.memory_strategy_used = strategy
        disp.timeline = timeline
        disp.scheduler = sched = self.scheduler
        self.degree_used = n
        self.path_used = "expert_parallel"
        bounds = micro_batch_bounds(x_TD.shape[0], n)
        if c.expert_dtype is not None:
            return self.fp8_forward(x_TD, routing, weights, bounds)
        permute = self.impl("permute", x_TD)
        sends, infos = [], []
        for a, b in bounds:
            # num_rows = the micro-batch's slots, a bound on its routed rows known on the host, so
            # the permute reads nothing back (without it every micro-op's permute synchronizes to
            # size its buffer); the rows past R (capacity drops) are zero and cut off below (the
            # price, only with drops: the dropped slots' rows are zero-filled, and the backward of
            # the cut materializes them as zero gradient rows)
            x_perm, info = permute(x_TD[a:b], routing.topk_ids[a:b], c.num_experts,
                                   num_rows=(b - a) * routing.topk_ids.shape[1])
            sends.append(x_perm)
            infos.append(info)
        # the step's first exchange (after the degree policy's all-reduce, if any); it carries
        # this rank's refused input, if any, and then raises on every rank
        plan = disp.exchange_counts(torch.stack([info.counts for info in infos]), row_dtype=x_TD.dtype,
                                    row_width=x_TD.shape[1], status=self.input_error)
        # the rows each micro-op really sends (the split exchange's host sync has them)
        sends = [s if s.shape[0] == plan.send_rows(i) else s[: plan.send_rows(i)] for i, s in enumerate(sends)]
        if strategy is None:
            backs = disp.run_pipelined(sends, plan, self.expert_fn(plan, x_TD, weights), weights.params(),
                                       trace=self.trace)
        else:

            backs = _memory.run_memory_pipelined(
                sends, plan, self.memory_ffn(plan, x_TD, routing, bounds, weights), weights.params(),
                strategy=strategy, n1=c.n1, has_b1=weights.b1 is not None, has_b2=weights.b2 is not None,
                group=self.group, timeline=timeline, trace=self.trace, scheduler=sched, stats=self.memory_stats,
                mi_buffers=c.memory_mi_buffers,
            )
        unpermute = self.impl("unpermute", x_TD)
        outs = [unpermute(backs[i], infos[i], routing.topk_weights[a:b]) for i, (a, b) in enumerate(bounds)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        if sched is not None and backs[0].requires_grad:
            # backs require grad exactly when the pipelined block is in the graph, whose backward
            # ends the announcement (comm.pipeline), so an announcement is never left open.
            out.register_hook(_announce(sched))
        return out




class _FP8Exchange:
    """The FP8 expert-parallel micro-ops (``config.expert_dtype="fp8_e4m3"``).

    Inference: each micro-batch is quantized in the permute (:func:`tritonmoe.fp8.fp8_permute`,
    1x128 groups or per row, once per token row) and its rows travel as e4m3 plus their fp32
    scales, packed into one uint8 row (:func:`tritonmoe.fp8.pack_fp8_rows`: d + 4*cdiv(d,128)
    bytes against 2d for bf16); the expert side runs :func:`tritonmoe.fp8.fp8_grouped_ffn` on the
    received rows and the outputs return in x's dtype. Training: rows travel in x's dtype and the
    experts run :func:`tritonmoe.fp8.fp8_grouped_ffn_train` (its backward quantizes dgrad and
    wgrad itself); the weight gradients are not deferred to the W step."""

    def __init__(self, path: "ExpertParallelExperts", x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights):
        c = path.config
        self.path, self.weights, self.dtype, self.d = path, weights, x_TD.dtype, x_TD.shape[1]
        self.train = fp8_training(c, x_TD, routing, weights)
        self.fmt = "e4m3_" + c.fp8_recipe
        # the quantized experts of this rank, once per forward (the held ones as they are)
        self.experts = None if self.train else fp8_experts_of(weights, c.fp8_recipe)

    def send(self, x: torch.Tensor, ids: torch.Tensor):
        c = self.path.config
        rows = ids.shape[0] * ids.shape[1]  # the slot bound: no host sync (see the 16-bit path)
        if self.train:
            return self.path.impl("permute", x)(x, ids, c.num_experts, num_rows=rows)
        # the ops' implementations, not the public ops: the layer's metadata is valid by
        # construction, so no value check (a host sync each) runs per micro-op
        q, s, info = implementation("fp8_permute", c.backend, x.device, x.dtype)(x, ids, c.num_experts, self.fmt,
                                                                                 num_rows=rows)
        return fp8.pack_fp8_rows(q, s), info

    def expert_fn(self, plan):
        disp, c = self.path.dispatcher, self.path.config

        def experts(i: int, recv_RD: torch.Tensor, params, wgrad) -> torch.Tensor:
            x_RD = disp.to_expert_major(recv_RD, plan, i)
            offsets = disp.expert_offsets(plan, i)
            if self.train:
                w = self.weights.with_params(params)
                y_RD = implementation("fp8_grouped_ffn_train", c.backend, x_RD.device, x_RD.dtype)(
                    x_RD, offsets, w.w1, w.w2)
            else:
                q, s = fp8.unpack_fp8_rows(x_RD, self.d)
                ex = self.experts
                y_RD = implementation("fp8_grouped_ffn", c.backend, q.device, None)(
                    q, s, offsets, ex.w1, ex.w1_scale, ex.w2, ex.w2_scale, ex.format, self.dtype)
            return disp.to_source_major(y_RD, plan, i)

        return experts


def _announce(scheduler):
    """A gradient hook that announces the backward's exchanges to ``scheduler``."""

    def hook(grad: torch.Tensor) -> None:
        scheduler.exchange_imminent()

    return hook


