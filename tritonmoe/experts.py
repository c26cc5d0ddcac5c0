"""The expert path: one object per parallel layout, one call shape.

:class:`~tritonmoe.MoELayer` is thin: it routes, hands the tokens to its expert path and adds the
auxiliary loss. The expert path computes, for a batch of tokens and their routing, the weighted
sum of the chosen experts' FFN outputs per token, wherever those experts live::

    path(x_TD, routing, weights) -> y_TD

* :class:`LocalExperts`: every expert on this device (the fused ``moe_ffn`` or permute ->
  grouped FFN -> unpermute).
* :class:`ExpertParallelExperts`: rank r of an expert-parallel group of P ranks owns the experts
  [r*E/P, (r+1)*E/P); the tokens travel to their experts and back (all-to-all), in
  ``pipeline_degree`` micro-ops whose communication overlaps expert compute
  (:mod:`tritonmoe.comm.pipeline`).
* :class:`tritonmoe.parm_experts.ParmExperts`: model + expert + expert-sharding parallelism
  (paper 003), with Parm's schedules. Its S1 schedule routes only this model-parallel rank's
  slice of the tokens, so it takes over the layer's whole step (:meth:`ExpertPath.layer_forward`).

A new parallel layout or schedule is a new expert path (or a new schedule inside one), not a new
branch in the layer. Every path takes the layer's expert parameters as :class:`ExpertWeights`
(it owns none: ``layer.w1``/``layer.w2`` stay where checkpoints and optimizers expect them) and
records which variant ran in :attr:`ExpertPath.path_used`.

The ops run on the implementation :mod:`tritonmoe.dispatch` picks for the layer's backend,
device and dtype; the layer produces its own routing metadata, so no value checks run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import fp8, fp8_reference, ops, reference
from .config import MoEConfig
from .dispatch import implementation
from .types import Routing

__all__ = [
    "ExpertWeights",
    "ExpertPath",
    "LocalExperts",
    "ExpertParallelExperts",
    "StaticExpertParallelExperts",
    "micro_batch_bounds",
    "make_expert_path",
]


@dataclass(frozen=True)
class ExpertWeights:
    """The expert parameters of a layer (this rank's experts under expert parallelism):
    ``w1`` [E_local, d_model, n1], ``w2`` [E_local, d_ffn, d_model], and the optional biases
    ``b1`` [E_local, n1] and ``b2`` [E_local, d_model]."""

    w1: torch.Tensor
    w2: torch.Tensor
    b1: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None

    def params(self) -> tuple[torch.Tensor, ...]:
        """The tensors a schedule differentiates (in a fixed order: w1, w2, then the biases
        present)."""
        return (self.w1, self.w2) + tuple(b for b in (self.b1, self.b2) if b is not None)

    def with_params(self, params) -> "ExpertWeights":
        """The weights with :meth:`params` replaced by ``params`` (same order and presence)."""
        w1, w2, *rest = params
        rest = list(rest)
        b1 = rest.pop(0) if self.b1 is not None else None
        b2 = rest.pop(0) if self.b2 is not None else None
        return ExpertWeights(w1, w2, b1, b2)


def ffn_options(config: MoEConfig) -> dict:
    """The keyword options of the expert FFN ops for ``config`` (the clamped SwiGLU's)."""
    if config.activation == "swiglu_oai":
        return {"swiglu_limit": config.swiglu_limit, "swiglu_alpha": config.swiglu_alpha}
    return {}


def micro_batch_bounds(num_tokens: int, n: int) -> list[tuple[int, int]]:
    """n contiguous token ranges covering [0, num_tokens), sizes differing by at most one (the
    first num_tokens % n one longer); empty ranges when num_tokens < n."""
    base, extra = divmod(num_tokens, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class ExpertPath:
    """Base of the expert paths: ``path(x_TD, routing, weights) -> y_TD``.

    Attributes:
        config: the layer's :class:`~tritonmoe.MoEConfig`.
        num_local_experts: experts held on this rank (E_local; E without expert parallelism).
        expert_start: global index of this rank's first expert.
        path_used: the variant the last call ran ("fused", "unfused", "expert_parallel", ...),
            None before the first call.
        timeline: a :class:`~tritonmoe.comm.Timeline` the path records its schedule into, or None.
    """

    def __init__(self, config: MoEConfig) -> None:
        self.config = config
        self.num_local_experts = config.num_experts
        self.expert_start = 0
        self.path_used: Optional[str] = None
        self.timeline = None

    def impl(self, op: str, x: torch.Tensor):
        """The implementation of ``op`` for the layer's backend and ``x``'s device and dtype."""
        return implementation(op, self.config.backend, x.device, x.dtype)

    def weight_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Shapes of this rank's ``w1`` and ``w2`` (a layout that shards the experts' hidden
        dimension holds a slice of it)."""
        c = self.config
        return (self.num_local_experts, c.d_model, c.n1), (self.num_local_experts, c.d_ffn, c.d_model)

    def layer_forward(self, layer, x_TD: torch.Tensor) -> tuple[torch.Tensor, Routing, torch.Tensor]:
        """The layer's step on flattened tokens: ``(output, routing, aux_loss)``.

        The default routes every token (``layer.route``), runs this path on them and computes the
        layer's auxiliary loss. A path whose schedule routes differently overrides it (Parm's S1
        routes only this model-parallel rank's slice and reduces the counts over the MP group)."""
        logits_TE, routing = layer.route(x_TD)
        aux = layer.compute_aux_loss(logits_TE, routing)
        return self(x_TD, routing, layer.expert_weights()), routing, aux

    def __call__(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        raise NotImplementedError


class LocalExperts(ExpertPath):
    """All E experts on this device.

    The variant comes from ``config.ffn_path``: "fused" runs :func:`tritonmoe.moe_ffn` (token
    gather and weighted combine inside the expert GEMMs); "unfused" runs permute -> grouped FFN
    -> unpermute; "auto" picks per call (:func:`auto_ffn_path`):

    * "unfused" on the reference backend, where both are the same plain-PyTorch composition;
    * on CUDA with the Triton kernels, "unfused" when a backward will follow (grad enabled and x,
      the expert weights or the gate weights require grad) and "fused" otherwise. Measured on
      one H100 (bf16, ``bench/results/nvidia-h100-80gb-hbm3-2026-11-26.md``): forward + backward
      the unfused path is faster (Mixtral-like T=16k 65.4 against 83.5 ms, Qwen3-30B-A3B-like
      T=32k 18.0 against 20.5 ms), forward alone the fused one, which skips the permuted copy
      of x and the expert-ordered y, is as fast or faster (20.4 against 20.8 ms, 5.38 against
      6.06 ms; decode T <= 64 faster). The price of training unfused is those buffers, held for
      backward: peak 7.8 against 5.9 GiB at Qwen3-like T=32k (pass ``ffn_path="fused"`` where
      memory is the limit);
    * "fused" elsewhere (the Triton kernels in the interpreter: no timing to go by).
    """

    def choose(self, x_TD: torch.Tensor, routing: Optional[Routing] = None,
               weights: Optional[ExpertWeights] = None) -> str:
        """The variant for ``x_TD`` ("fused" or "unfused"): ``config.ffn_path``, or for "auto" the
        rule above. The same decision eager and compiled (under ``torch.compile`` it is taken once
        at trace time, see :func:`_local_ffn_path`: grad mode and ``requires_grad`` are static
        there, and guarded, so a compiled layer called under ``no_grad`` after training retraces
        and takes the forward choice)."""
        c = self.config
        return _local_ffn_path(c.ffn_path, c.backend, x_TD.device.type, x_TD.dtype,
                               _needs_backward(x_TD, routing, weights))

    def fp8_forward(self, x_TD: torch.Tensor, routing: Routing, w: ExpertWeights) -> torch.Tensor:
        """``config.expert_dtype="fp8_e4m3"``: the layer's weights are the master weights."""
        c = self.config
        if torch.compiler.is_compiling():
            raise NotImplementedError("expert_dtype='fp8_e4m3' runs eagerly only (the FP8 ops are not custom ops "
                                      "yet); call the layer outside torch.compile")
        if _needs_backward(x_TD, routing, w):
            if c.fp8_recipe != "block128" or c.d_ffn % 128:
                raise ValueError(f"FP8 training needs fp8_recipe='block128' and d_ffn a multiple of 128; this layer "
                                 f"has {c.fp8_recipe!r} and d_ffn={c.d_ffn} (run it under torch.no_grad() for "
                                 "inference)")
            self.path_used = "fp8_train"
            T, k = routing.topk_ids.shape
            rows = reference.max_permuted_rows(T, k, c.num_experts)
            x_perm, info = self.impl("permute", x_TD)(x_TD, routing.topk_ids, c.num_experts, num_rows=rows)
            y_perm = fp8.fp8_grouped_ffn_train(x_perm, info.expert_offsets, w.w1, w.w2, backend=c.backend)
            return self.impl("unpermute", x_TD)(y_perm, info, routing.topk_weights)
        self.path_used = "fp8"
        # the layer's weights, quantized without quantize_experts' finiteness check (a host sync)
        experts = fp8_reference.quantize_experts(w.w1.detach(), w.w2.detach(), "e4m3_" + c.fp8_recipe)
        return fp8.fp8_moe_ffn(x_TD, routing, experts, backend=c.backend)

    def __call__(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        c = self.config
        w, kw = weights, ffn_options(c)
        if c.expert_dtype is not None:
            return self.fp8_forward(x_TD, routing, w)
        path = self.choose(x_TD, routing, w)
        self.path_used = path
        # Traced by torch.compile: the custom ops (tritonmoe.ops; one opaque node each, no graph
        # break), the same variant and implementations as eager.
        compiling = torch.compiler.is_compiling()
        # Training (grad enabled) in the "save" pre-activation mode: the ops that return the
        # activations backward needs, so the compiled backward reruns no GEMM, as eager; else
        # (inference, or TRITONMOE_FFN_PREACT=recompute for memory) the recomputing ops.
        train = compiling and torch.is_grad_enabled() and _saves_activations()
        if path == "fused":
            if train:
                return ops.moe_ffn_train(x_TD, routing, w.w1, w.w2, c.activation, w.b1, w.b2, backend=c.backend, **kw)
            if compiling:
                return ops.moe_ffn(x_TD, routing, w.w1, w.w2, c.activation, w.b1, w.b2, backend=c.backend, **kw)
            return self.impl("moe_ffn", x_TD)(x_TD, routing, w.w1, w.w2, c.activation, w.b1, w.b2, **kw)
        # num_rows: the static bound of the permuted rows, so permute needs no host sync
        T, k = routing.topk_ids.shape
        rows = reference.max_permuted_rows(T, k, c.num_experts)
        if compiling:
            x_perm, info = ops.permute(x_TD, routing.topk_ids, c.num_experts, num_rows=rows, backend=c.backend)
            ffn = ops.grouped_ffn_train if train else ops.grouped_ffn
            y_perm = ffn(x_perm, info.expert_offsets, w.w1, w.w2, c.activation, w.b1, w.b2, backend=c.backend, **kw)
            return ops.unpermute(y_perm, info, routing.topk_weights, backend=c.backend)
        x_perm, info = self.impl("permute", x_TD)(x_TD, routing.topk_ids, c.num_experts, num_rows=rows)
        y_perm = self.impl("grouped_ffn", x_TD)(x_perm, info.expert_offsets, w.w1, w.w2, c.activation, w.b1, w.b2, **kw)
        return self.impl("unpermute", x_TD)(y_perm, info, routing.topk_weights)


@torch._dynamo.assume_constant_result
def _saves_activations() -> bool:
    """Whether the compiled layer's expert FFN saves its activations for backward (the
    ``*_train`` custom ops) rather than recomputing them: :func:`tritonmoe.ops.preact_mode`,
    read once at trace time."""
    return ops.preact_mode() == "save"


#: Device types where "auto" trains on the unfused path (measured on CUDA; a test widens it to
#: run the rule on CPU in Triton's interpreter).
_TRAIN_UNFUSED_DEVICES = frozenset({"cuda"})


def _needs_backward(x_TD: torch.Tensor, routing: Optional[Routing], weights: Optional[ExpertWeights]) -> bool:
    """Whether autograd will run a backward through this call's expert FFN: grad enabled and x,
    an expert weight (or bias) or the gate weights require grad. Plain Python on tensor metadata:
    under ``torch.compile`` these are trace-time constants (dynamo guards on grad mode and on
    ``requires_grad``), so the choice adds no graph break."""
    if not torch.is_grad_enabled():
        return False
    tensors = [x_TD]
    if routing is not None:
        tensors.append(routing.topk_weights)
    if weights is not None:
        tensors += [weights.w1, weights.w2, weights.b1, weights.b2]
    return any(t is not None and t.requires_grad for t in tensors)


def auto_ffn_path(backend: Optional[str], device_type: str, dtype: torch.dtype, backward: bool) -> str:
    """What ``ffn_path="auto"`` runs (see :class:`LocalExperts`): "unfused" on the reference
    backend and for training on CUDA, "fused" otherwise."""
    impl = implementation("moe_ffn", backend, torch.device(device_type), dtype)
    if impl is reference.moe_ffn:
        return "unfused"
    if backward and device_type in _TRAIN_UNFUSED_DEVICES:
        return "unfused"
    return "fused"


@torch._dynamo.assume_constant_result
def _local_ffn_path(ffn_path: str, backend: Optional[str], device_type: str, dtype: torch.dtype,
                    backward: bool = False) -> str:
    """:meth:`LocalExperts.choose` from plain values. Marked ``assume_constant_result``: under
    ``torch.compile`` it runs once at trace time (the dispatch table is Python state dynamo need
    not trace) and its answer is a constant of the graph, like the backend the custom ops are
    given; changing the process default backend afterwards does not retrace a compiled layer.
    ``backward`` (:func:`_needs_backward`) is itself a trace-time constant."""
    if ffn_path != "auto":
        return ffn_path
    return auto_ffn_path(backend, device_type, dtype, backward)


def _under_nonreentrant_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are ``torch.utils.checkpoint``'s (a non-reentrant
    checkpoint's forward or its recomputation)."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError, TypeError):  # a torch without the query: cannot tell
        return False
    return bool(hooks) and (getattr(hooks[0], "__module__", "") or "").startswith("torch.utils.checkpoint")


#: dtypes as small ints for the cross-rank agreement check.
_DTYPE_CODES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
#: run-time pipeline degrees as ints for the agreement check
_DEGREE_CODES = {"auto": -1, "search": -2}


def _group_device(group: Any) -> torch.device:
    """The device a group's layer runs on: the current CUDA device for NCCL, else CPU."""
    from .comm.splits import comm_device

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
    step where the GEMM supports it (:mod:`tritonmoe.exact`).

    Construction is collective (one small all-to-all): every rank of the group must agree on the
    settings that size later collectives, or every rank raises the same ``ValueError``.

    ``config.pipeline_degree`` "auto" or "search" chooses the degree per forward through
    ``self.degree_policy`` (:mod:`tritonmoe.plan.runtime`: one small all-reduce per forward makes
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

    def __init__(self, config: MoEConfig, group: Any, dtype: torch.dtype) -> None:
        super().__init__(config)
        from .comm import AllToAllDispatcher, check_agreement

        c = config
        # The sizes of every later collective follow from these; a rank that disagrees would
        # make gloo abort mid-forward, so compare them once here (one small collective), before
        # any check that could fail on some ranks only.
        dtype_code = _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1
        self.degree_policy = None
        policy_code = 0
        if isinstance(c.pipeline_degree, str):
            from .plan.runtime import make_policy

            # built on every rank before the agreement check; a rank that failed (a missing cost
            # model file) reports -1 so that every rank raises, not only that one
            policy = make_policy(c, group, _group_device(group), dtype)
            policy_code = -1 if isinstance(policy, Exception) else policy.fingerprint
        # memory strategies: bad input fails here, on every rank, before any collective
        from .memory import MEMORY_STRATEGIES, check_offload

        device = _group_device(group)
        check_offload(c.memory_strategy, device)
        memory_code = -1 if c.memory_strategy is None else MEMORY_STRATEGIES.index(c.memory_strategy)
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
            check_agreement(
                dict(
                    num_experts=c.num_experts, d_model=c.d_model, dtype=dtype_code,
                    pipeline_degree=_DEGREE_CODES.get(c.pipeline_degree, c.pipeline_degree),
                    degree_policy=policy_code, memory_strategy=memory_code, memory_budget=c.memory_budget_bytes or 0,
                    memory_mi_buffers=c.memory_mi_buffers,
                    memory_policy=memory_policy_code,
                ),
                group=group,
                what="the expert-parallel MoEConfig (degree_policy, memory_policy: the cost model's fingerprint, -1 "
                     "where it failed to load)",
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
        from .memory import pinned_memory_available, uses_offload
        from .plan.memory import AutoMemory, SearchMemory
        from .comm.memory import STRATEGIES

        device = _group_device(group)
        strategies = STRATEGIES
        if device.type == "cuda" and not pinned_memory_available():
            strategies = tuple(s for s in STRATEGIES if not uses_offload(s))
        if self.config.pipeline_degree == "search":
            return SearchMemory(self.config, group, device, strategies)
        return AutoMemory(self.config, group, device, dtype, strategies)

    def memory_ffn(self, plan, x_TD: torch.Tensor, routing: Routing, bounds, weights: ExpertWeights):
        """The :class:`tritonmoe.comm.memory.ExpertFFN` of the managed block: the layer's grouped
        GEMM and activation, the dispatcher's re-layouts, and the re-permute of micro-batch i's
        tokens (from the layer input, which the router keeps anyway) for "recomm"."""
        from .comm.memory import ExpertFFN

        c, disp = self.config, self.dispatcher
        permute = self.impl("permute", x_TD)
        x_keep, ids = x_TD.detach(), routing.topk_ids

        def resend(i: int) -> torch.Tensor:
            a, b = bounds[i]
            # the slot bound as the buffer's rows (no host sync), then the rows the forward sent
            rows = permute(x_keep[a:b], ids[a:b], c.num_experts, num_rows=(b - a) * ids.shape[1])[0]
            return rows[: plan.send_rows(i)]

        from .comm.partition import _transpose_chunks

        # the re-layouts without timeline spans of their own (they run inside the expert op's span,
        # forward and backward)
        return ExpertFFN(
            activation=c.activation, gemm=self.impl("grouped_gemm", x_TD),
            to_expert_major=lambda i, r: _transpose_chunks(r, plan.recv_counts[i], disp.backend),
            to_source_major=lambda i, y: _transpose_chunks(y, plan.recv_counts[i].t(), disp.backend),
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
        plan = disp.exchange_counts(torch.stack([info.counts for info in infos]), row_dtype=x_TD.dtype,
                                    row_width=x_TD.shape[1])
        # the rows each micro-op really sends (the split exchange's host sync has them)
        sends = [s if s.shape[0] == plan.send_rows(i) else s[: plan.send_rows(i)] for i, s in enumerate(sends)]
        if strategy is None:
            backs = disp.run_pipelined(sends, plan, self.expert_fn(plan, x_TD, weights), weights.params(),
                                       trace=self.trace)
        else:
            from .comm import memory as _memory

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


class StaticExpertParallelExperts(ExpertPath):
    """Expert parallelism with static shapes (``config.ep_capacity`` = C; Megatron's
    pad-to-capacity): rank r of P owns the experts [r*E/P, (r+1)*E/P) as in
    :class:`ExpertParallelExperts`, but every rank sends exactly C rows to every expert (its
    first C kept slots, then zero rows). The exchanges are equal-split all-to-alls of E*C rows
    whose sizes are known on the host, so there is no counts exchange and no host
    synchronization in the forward or the backward (capturable in a CUDA graph); the experts run
    as one batched GEMM pair over [E/P, P*C] rows. The price is the padding: E*C rows per rank
    per exchange whatever the routing.

    Semantics: routing keeps at most C slots per expert on each rank (``config.capacity`` is C;
    later slots are dropped, weight 0), so the layer equals a single-process layer with the same
    config applied to each rank's batch; padding rows never reach an output.

    Construction is collective (one small all-to-all checks that the ranks agree on the config).

    Dtype of the rows: the ranks agree on it at construction, and the equal-split exchanges move
    rows of that dtype with no counts exchange to compare it in. A rank whose rows have another
    dtype at a forward (it cast its layer and input after construction) first re-agrees on a
    control group of the same ranks (one small all-gather and a host sync, only on that forward):
    when every rank cast the same way they all re-agree and go on; otherwise every rank ends in a
    typed error before any row of the wrong size moves, the ranks that changed in a ``TypeError``
    naming every rank's dtype, the others in :class:`~tritonmoe.comm.ScheduleError` (their
    exchange's peer never joined) within the group's timeout. The forward whose dtype is the
    agreed one costs nothing more (a host-side dtype comparison).
    """

    def __init__(self, config: MoEConfig, group: Any, dtype: torch.dtype) -> None:
        super().__init__(config)
        from .comm import check_agreement
        from .comm.splits import group_rank_size

        rank, P = group_rank_size(group)
        E = config.num_experts
        check_agreement(
            dict(num_experts=E, d_model=config.d_model, ep_capacity=config.ep_capacity,
                 dtype=_DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1),
            group=group, what="the static expert-parallel MoEConfig",
        )
        if E % P:
            raise ValueError(f"num_experts={E} is not divisible by the expert-parallel group size {P}")
        self.group, self.rank, self.world_size = group, rank, P
        self.num_local_experts = E // P
        self.expert_start = rank * self.num_local_experts
        #: the dtype of the exchanged rows every rank of the group agreed on
        self.wire_dtype = dtype
        self._control = _control_group(group)

    def _check_wire_dtype(self, dtype: torch.dtype) -> None:
        """Re-agree on the rows' dtype when this rank's changed (see the class docstring)."""
        if dtype == self.wire_dtype:
            return
        from .comm.compat import all_gather_single
        from .comm.errors import ScheduleError, backend_errors
        from .comm.splits import comm_device

        P = self.world_size
        code = _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else -1
        mine = torch.tensor([code], dtype=torch.int64, device=comm_device(self._control))
        table = torch.empty(P, dtype=torch.int64, device=mine.device)
        try:
            with backend_errors("the static expert-parallel dtype re-agreement", self._control):
                all_gather_single(table, mine, group=self._control)
        except ScheduleError as e:
            raise TypeError(
                f"rank {self.rank}'s expert-parallel rows are {dtype} but the group agreed on {self.wire_dtype}, and the "
                "other ranks did not re-agree (their rows kept the agreed dtype, or they failed): cast every rank's "
                f"layer and input the same way ({type(e).__name__}: {str(e)[:200]})"
            ) from e
        codes = table.tolist()  # host sync: only on a forward whose dtype changed
        if len(set(codes)) > 1:
            names = ", ".join(
                f"rank {r}: {str(_DTYPE_CODES[c]).replace('torch.', '') if c >= 0 else 'unsupported'}"
                for r, c in enumerate(codes)
            )
            raise TypeError(
                f"the ranks of the static expert-parallel group would exchange rows of different dtypes ({names}); "
                "cast every rank's layer and input the same way"
            )
        if code < 0:
            raise TypeError(f"static expert parallelism exchanges rows of {_DTYPE_CODES}, got {dtype}")
        self.wire_dtype = dtype

    def send_rows(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dest [T*k], valid [T*k])``: the row of the [E*C] send buffer each slot goes to
        (expert e's block [e*C, (e+1)*C), its kept slots in slot order) and whether it is sent;
        slots not sent point at row E*C. Device ops only (a stable sort, a scatter-add, a cumsum):
        no host sync."""
        E, C = self.config.num_experts, self.config.ep_capacity
        ids = routing.topk_ids.reshape(-1).long()
        S = ids.shape[0]
        valid = (ids >= 0) & (ids < E)
        key = torch.where(valid, ids, torch.full_like(ids, E))
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(key)
        pos[order] = torch.arange(S, device=ids.device) - starts[key[order]]
        valid = valid & (pos < C)  # routing kept at most C per expert; a longer list is cut, never overflows
        dest = torch.where(valid, key * C + pos, torch.full_like(key, E * C))
        return dest, valid

    def __call__(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:
        from .comm.all_to_all import _AllToAll

        c = self.config
        self.path_used = "expert_parallel_static"
        E, C, P, L = c.num_experts, c.ep_capacity, self.world_size, self.num_local_experts
        T, d = x_TD.shape
        self._check_wire_dtype(x_TD.dtype)  # before any row moves; free unless the dtype changed
        k = routing.topk_ids.shape[1]
        dest, valid = self.send_rows(routing)
        x_slots = x_TD.unsqueeze(1).expand(T, k, d).reshape(T * k, d)
        send = x_TD.new_zeros(E * C + 1, d).index_add(0, dest, x_slots)[: E * C]  # row E*C: the unsent slots
        splits = [L * C] * P
        recv = _AllToAll.apply(send, splits, splits, self.group)  # [P (source), L, C, d]
        x_LRD = recv.view(P, L, C, d).transpose(0, 1).reshape(L, P * C, d)
        h = torch.bmm(x_LRD, weights.w1)
        if weights.b1 is not None:
            h = h + weights.b1.unsqueeze(1)
        a = reference._activation(h, c.activation, c.swiglu_limit, c.swiglu_alpha, scalar=False)
        y = torch.bmm(a, weights.w2)
        if weights.b2 is not None:
            y = y + weights.b2.unsqueeze(1)
        y = y.view(L, P, C, d).transpose(0, 1).reshape(P * L * C, d)
        back = _AllToAll.apply(y, splits, splits, self.group)  # [E*C, d]: this rank's rows, back
        acc = torch.float64 if x_TD.dtype == torch.float64 else torch.float32
        back = torch.cat([back, back.new_zeros(1, d)], dim=0)
        w = torch.where(valid.view(T, k), routing.topk_weights.to(acc), torch.zeros((), dtype=acc, device=x_TD.device))
        return (back[dest].view(T, k, d).to(acc) * w.unsqueeze(-1)).sum(1).to(x_TD.dtype)


#: control groups of expert-parallel groups: id(group) -> (group, control group); one per group,
#: however many layers use it (the group is kept to tell a recycled id from the same group)
_CONTROL_GROUPS: dict[int, tuple[Any, Any]] = {}


def _control_group(group: Any) -> Any:
    """A second process group with ``group``'s ranks and timeout, for agreements that must not
    be matched against ``group``'s data exchanges (created once per group; collective over its
    ranks only)."""
    import torch.distributed as dist

    from .comm.errors import new_group

    hit = _CONTROL_GROUPS.get(id(group))
    if hit is None or hit[0] is not group:
        control = new_group(dist.get_process_group_ranks(group), parent=group, use_local_synchronization=True)
        hit = _CONTROL_GROUPS[id(group)] = (group, control)
    return hit[1]


def _announce(scheduler):
    """A gradient hook that announces the backward's exchanges to ``scheduler``."""

    def hook(grad: torch.Tensor) -> None:
        scheduler.exchange_imminent()

    return hook


def make_expert_path(
    config: MoEConfig,
    *,
    ep_group: Any = None,
    mp_group: Any = None,
    esp_group: Any = None,
    ep_esp_group: Any = None,
    parm_groups: Any = None,
    dtype: Optional[torch.dtype] = None,
) -> ExpertPath:
    """The expert path of a layer with this config and layout."""
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    if config.expert_dtype is not None and any(
            g is not None for g in (ep_group, mp_group, esp_group, ep_esp_group, parm_groups)):
        raise ValueError(f"expert_dtype={config.expert_dtype!r} runs on the local expert path only; expert "
                         "parallelism with FP8 experts is not built yet (use expert_dtype=None)")
    if config.memory_strategy is not None and (
        ep_group is None or parm_groups is not None or mp_group is not None or esp_group is not None
        or ep_esp_group is not None
    ):
        raise ValueError(
            f"memory_strategy={config.memory_strategy!r} manages the activations of the pipelined expert-parallel path "
            "and needs ep_group alone (no model-parallel / expert-sharding groups); use memory_strategy=None here"
        )
    if parm_groups is not None or mp_group is not None or esp_group is not None or ep_esp_group is not None:
        from .parm_experts import ParmExperts

        return ParmExperts.from_groups(
            config, ep_group=ep_group, mp_group=mp_group, esp_group=esp_group, ep_esp_group=ep_esp_group,
            groups=parm_groups, dtype=dtype,
        )
    if ep_group is not None:
        if config.ep_capacity is not None:
            return StaticExpertParallelExperts(config, ep_group, dtype)
        return ExpertParallelExperts(config, ep_group, dtype)
    if isinstance(config.pipeline_degree, str):
        raise ValueError(
            f"pipeline_degree={config.pipeline_degree!r} chooses the degree of the expert-parallel pipeline at run "
            "time and needs ep_group (a torch.distributed process group); without expert parallelism use "
            "pipeline_degree=1"
        )
    if config.pipeline_degree != 1:
        raise ValueError(
            f"pipeline_degree={config.pipeline_degree} overlaps expert-parallel communication with "
            "expert compute and needs ep_group (a torch.distributed process group); use "
            "pipeline_degree=1 without expert parallelism"
        )
    return LocalExperts(config)
