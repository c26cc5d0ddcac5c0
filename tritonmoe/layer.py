"""MoELayer: a drop-in replacement for a transformer FFN."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from tritonmoe import reference
from .aux_loss import GlobalBalanceState, attach_aux_loss, check_layer_options, token_options
from .config import MoEConfig
from tritonmoe.core.exact import rowwise_mm
from tritonmoe.core.validation import GLU_ACTIVATIONS
from .router import Router, RouteStep, router_logits
from .experts import (
    ExpertPath,
    FP8ExpertStore,
    ExpertWeights,
    LocalExperts,
    make_expert_path,
    micro_batch_bounds,
)
from .parallel.guard import check_ddp
from .parallel.init import draw_seed, init_experts_
from tritonmoe.core.types import Routing
from tritonmoe.fp8 import FP8Experts, check_fp8_experts
from tritonmoe.parallel.mesh import as_moe_mesh
from tritonmoe.comm import check_agreement
from tritonmoe.parallel.checkpoint import expert_load_pre_hook, expert_state_dict_hook
from tritonmoe.parallel.guard import check_sharded_expert
from tritonmoe.core.suggest import suggest_unknown_kwargs

__all__ = ["MoELayer", "Router", "RouteStep", "SharedExperts", "hold_fp8_experts", "router_logits"]


class _StepState:
    """What a forward leaves on the layer for the caller (the auxiliary loss, the routing, the
    accumulated expert load). Not module state: a deep copy or a pickle of the layer drops it
    (the loss holds the autograd graph, which cannot be copied)."""

    def __init__(self) -> None:
        self.aux_loss: torch.Tensor | None = None
        self.routing: Routing | None = None
        self.load: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.padding_mask: torch.Tensor | None = None  # of the forward in progress (flattened)
        self.sequence_length: int | None = None

    def __deepcopy__(self, memo) -> "_StepState":
        return _StepState()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


class SharedExperts(nn.Module):
    """The shared expert(s) every token goes through beside its routed experts: a dense FFN
    ``act(x @ w1) @ w2`` of hidden width ``config.shared_d_ffn`` with the routed experts'
    activation (``w1`` [d_model, n1], gate columns first for the GLUs; ``w2`` [shared_d_ffn,
    d_model]), optionally scaled per token by ``sigmoid(x @ gate)`` (``gate`` [d_model];
    Qwen2-MoE). Replicated on every rank (a dense parameter for data parallelism). In fp64 the
    products are row-invariant (:func:`tritonmoe.core.exact.rowwise_mm`), like the router's."""

    def __init__(self, config: MoEConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        f = config.shared_d_ffn
        n1 = 2 * f if config.activation in GLU_ACTIVATIONS else f
        self.w1 = nn.Parameter(torch.empty(config.d_model, n1, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(f, config.d_model, device=device, dtype=dtype))
        self.gate = (nn.Parameter(torch.empty(config.d_model, device=device, dtype=dtype))
                     if config.shared_expert_gate else None)

    def reset_parameters(self) -> None:
        """nn.Linear's default init (from the default generator)."""
        with torch.no_grad():
            for w in (self.w1, self.w2, self.gate):
                if w is not None and not w.is_meta:
                    bound = 1.0 / math.sqrt(w.shape[0])
                    w.uniform_(-bound, bound)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        c = self.config
        mm = rowwise_mm if x_TD.dtype == torch.float64 else torch.matmul
        h = mm(x_TD, self.w1)
        a = reference._activation(h, c.activation, c.swiglu_limit, c.swiglu_alpha, scalar=h.dtype == torch.float64)
        y = mm(a, self.w2)
        if self.gate is not None:
            y = y * torch.sigmoid(mm(x_TD, self.gate.unsqueeze(1)))
        return y


def _refuse_vmap(x: torch.Tensor) -> None:
    """``torch.vmap`` over the layer: a clear error instead of torch's internal one. Routing,
    capacity and the balance losses count tokens across the whole batch, so a vmapped call
    would not be the per-sample layer anyway."""
    is_batched = getattr(torch._C._functorch, "is_batchedtensor", None)
    if is_batched is not None and is_batched(x):
        raise NotImplementedError(
            "tritonmoe.MoELayer does not support torch.vmap: routing, capacity and the balance losses count the "
            "tokens of the whole batch. Call the layer on the batch itself (x [..., d_model]: every leading "
            "dimension is tokens); torch.func.grad / functional_call are supported with backend='torch'"
        )


def _make_parameters(layer: "MoELayer", config: MoEConfig, device, dtype) -> None:
    """The layer's parameters and buffers, shaped by its expert path (this rank's experts, or
    their shards): the gate, ``w1``/``w2`` (and ``b1``/``b2``), the shared experts and the expert
    bias; left uninitialized (``reset_parameters`` fills them)."""
    factory = {"device": device, "dtype": dtype}
    E, d = config.num_experts, config.d_model
    w1_shape, w2_shape = layer.expert_path.weight_shapes()
    # Built without initializing (reset_parameters does, once): the initialization consumes the
    # default generator the same way whether the layer is built here or on meta + to_empty.
    layer.router = torch.nn.utils.skip_init(
        Router, d, E, bias=config.router_bias, device=device if device is not None else torch.get_default_device(),
        dtype=config.router_dtype if config.router_dtype is not None else dtype,
    )
    layer.w1 = nn.Parameter(torch.empty(*w1_shape, **factory))
    layer.w2 = nn.Parameter(torch.empty(*w2_shape, **factory))
    if config.expert_ffn_bias:
        layer.b1 = nn.Parameter(torch.empty(w1_shape[0], w1_shape[2], **factory))
        layer.b2 = nn.Parameter(torch.empty(w2_shape[0], d, **factory))
    else:
        layer.b1 = layer.b2 = None
    layer.shared_experts = SharedExperts(config, **factory) if config.shared_d_ffn > 0 else None
    if config.expert_bias:
        layer.register_buffer("expert_bias", torch.zeros(E, device=device, dtype=torch.float32))
    else:
        layer.expert_bias = None


class _LayerRouting:
    """The routing side of :class:`MoELayer`: the per-forward :class:`~tritonmoe.router.RouteStep`
    built from the layer's config, gate, expert bias and balance-loss state, and the routing
    methods of earlier versions, each one step of it."""

    def route_step(self) -> RouteStep:
        """This forward's routing step (:class:`~tritonmoe.router.RouteStep`): what an expert
        path that routes by itself is handed instead of the layer."""
        st = self._step
        return RouteStep(self.config, self.router, self.expert_bias, self._record_logits,
                         padding_mask=st.padding_mask, sequence_length=st.sequence_length,
                         global_balance=self._global_balance, aux_loss_group=self.aux_loss_group)

    def _record_logits(self, logits_TE: torch.Tensor) -> None:
        self._step.logits = logits_TE

    def route_options(self) -> dict:
        """The keyword options of the route op for this layer (every routed layout uses them)."""
        return self.route_step().options()

    def router_input(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The router's input: ``x`` in the router's dtype (``config.router_dtype``)."""
        return self.route_step().input(x_TD)

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        """Router logits and routing for flattened tokens."""
        return self.route_step().route(x_TD)

    def compute_aux_loss(self, logits_TE: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.route_step().aux_loss(logits_TE, routing)

    def reset_aux_loss_state(self) -> None:
        """Start a new global batch for the "global" balance loss: zero its accumulated token
        counts (call at each optimizer step, after the last micro-batch's backward)."""
        self._global_balance.reset()

    @property
    def global_balance_state(self) -> GlobalBalanceState:
        """The accumulated counts of the "global" balance loss since the last reset."""
        return self._global_balance



class _LayerStepOutputs:
    """What a forward of :class:`MoELayer` leaves for the caller, kept outside the module's state
    (in ``_step``, see :class:`_StepState`): the auxiliary loss, the router logits, the routing
    and the accumulated expert load."""

    @property
    def aux_loss(self) -> torch.Tensor:
        """``aux_loss_coef * load_balancing_loss + z_loss_coef * z_loss`` of the last forward (a
        zero tensor before the first or when both coefficients are 0). Held outside the module's
        state: ``copy.deepcopy`` and ``AveragedModel`` of a layer after a training forward work
        (the copy starts without it)."""
        a = self._step.aux_loss
        return a if a is not None else torch.zeros((), device=self.w1.device)

    @aux_loss.setter
    def aux_loss(self, value: torch.Tensor) -> None:
        self._step.aux_loss = value

    @property
    def last_router_logits(self) -> torch.Tensor | None:
        """The router logits ``[T, E]`` of the last forward (in the autograd graph: a loss on them
        trains the router, e.g. transformers' load-balancing loss through
        :class:`tritonmoe.hf.HFMoEBlock`); None before the first. Parm's S1: this MP rank's
        slice of the tokens. Kept outside the module's state, like ``aux_loss``."""
        return self._step.logits

    @property
    def last_routing(self) -> Routing | None:
        """The :class:`Routing` of the last forward (None before the first)."""
        return self._step.routing

    @last_routing.setter
    def last_routing(self, value: Routing | None) -> None:
        self._step.routing = value

    def expert_load(self, reset: bool = False) -> torch.Tensor:
        """Tokens this rank routed to each global expert (kept slots, int64 [E]) summed over the
        forwards since the last reset, on the layer's device; no host sync (log it where the loop
        synchronizes anyway). ``reset``: zero the count after reading it (the aux-loss-free bias
        update, :func:`tritonmoe.update_expert_bias`, does)."""
        load = self._step.load
        if load is None:
            load = torch.zeros(self.config.num_experts, dtype=torch.int64, device=self.w1.device)
        if reset:
            self._step.load = torch.zeros_like(load)
        return load


@suggest_unknown_kwargs
class MoELayer(_LayerRouting, _LayerStepOutputs, nn.Module):
    """Mixture-of-Experts FFN: ``forward(x[..., d_model]) -> [..., d_model]``.

    Parameters: ``router`` (nn.Linear(d_model, E, bias=False)), ``w1`` [E_local, d_model, n1]
    (n1 = 2*d_ffn for swiglu, gate columns first) and ``w2`` [E_local, d_ffn, d_model], each
    expert initialized like an nn.Linear. With ``config.expert_bias`` a buffer ``expert_bias``
    (fp32 [E], zeros) biases selection only.

    After each forward, ``ffn_path_used`` says which expert path ran (``config.ffn_path``), and
    ``aux_loss`` holds ``aux_loss_coef * load_balancing_loss +
    z_loss_coef * z_loss`` (a zero tensor when both coefficients are 0) and ``last_routing`` the
    :class:`Routing` of that batch.

    The layer is thin: it routes, hands the tokens to ``self.expert_path`` (one object per
    parallel layout, :mod:`tritonmoe.experts`) and adds the auxiliary loss. It produces its own
    routing metadata, so its internal op calls skip the value checks of the public functional API
    (no validation syncs on the hot path).

    Expert parallelism (``ep_group``, a process group of P ranks; E divisible by P): rank r owns
    the experts [r*E/P, (r+1)*E/P), so ``w1``/``w2`` hold E/P experts; communication goes through
    ``self.dispatcher`` (:class:`tritonmoe.comm.AllToAllDispatcher`). Semantics:

    * Each rank routes its own tokens, so capacity is computed from the local token count
      (``config.capacity(T_local)``): the layer equals a single-process layer holding all E
      experts applied to each rank's batch separately, not to the concatenated global batch.
    * The router is replicated: initialize it identically on every rank; its gradient is this
      rank's (a data-parallel wrapper averages it). ``aux_loss`` is this rank's batch's loss.
    * ``config.pipeline_degree`` = n cuts the local tokens into n micro-batches whose dispatch,
      expert FFN and combine are pipelined (:mod:`tritonmoe.comm.programs.pipeline`); every rank of the
      group must use the same n. Routing is decided once for the whole local batch, so n changes
      the schedule, not the result: bitwise in fp64 on the reference backend (see that module).
    * Set ``layer.timeline = tritonmoe.comm.Timeline()`` to record each micro-op's spans.

    Parallel layout on a mesh (``mesh``, a :class:`tritonmoe.parallel.MoEMesh` or a
    ``DeviceMesh`` with dimensions named "dp" and/or "ep"): the expert-parallel group is the
    mesh's "ep" dimension (none when it is absent or of size 1); ``layer.mesh`` keeps the mesh
    for :func:`tritonmoe.parallel.data_parallel`, :func:`tritonmoe.parallel.fully_shard_moe` and
    checkpoints. ``ep_group=`` alone still works (``layer.mesh`` is then None).

    * Expert parameters are named by ``expert_parameter_names`` (``("w1", "w2")``) and found by
      :func:`tritonmoe.parallel.expert_parameters`.
    * Initialization does not depend on the layout: the router first (default generator), then a
      base seed drawn from the default CPU generator (``layer.init_seed``), then each global expert
      e from its own generator seeded with (base seed, e) (:mod:`tritonmoe.parallel.init`). A layer
      built from one seed holds the same global experts on 1, 2 or 4 expert-parallel ranks. With a
      group, construction checks that every rank drew the same base seed (seed every rank alike).
    * ``state_dict()`` gives an expert-parallel layer's ``w1``/``w2`` as DTensors of the global
      experts ``[E, ...]`` (views, no copy), so ``torch.distributed.checkpoint`` saves experts by
      global index and reshards them on load; ``load_state_dict`` also takes full ``[E, ...]``
      tensors (:mod:`tritonmoe.parallel.checkpoint`).
    * Wrapping an expert-parallel layer in plain ``DistributedDataParallel`` or ``fully_shard``
      over expert-parallel ranks raises :class:`tritonmoe.parallel.ExpertParallelWrapError`
      (:mod:`tritonmoe.parallel.guard`).
    * ``layer.comm_scheduler``: a :class:`tritonmoe.comm.CommScheduler` the expert path's
      all-to-alls go through (set by :func:`tritonmoe.parallel.data_parallel`; None: issued
      directly).

    Model + expert + expert-sharding parallelism (``mp_group`` and/or ``esp_group`` beside
    ``ep_group``, or ``parm_groups`` from :meth:`tritonmoe.ParmLayout.process_groups` /
    :meth:`tritonmoe.ParmGroups.from_device_mesh`): Parm's layouts and schedules
    (:mod:`tritonmoe.experts.model_parallel`, ``config.parm_schedule``). The input and output are replicated
    over the MP group; ``w1``/``w2`` hold this rank's shard of its EP rank's experts
    (``[E/n_ep, d, n1/n_esp]``, ``[E/n_ep, F/n_esp, d]``; with ``expert_ffn_bias``, ``b1``
    ``[E/n_ep, n1/n_esp]`` and ``b2`` ``[E/n_ep, d]``, the latter whole on every ESP shard and
    added by shard 0 only). Construction from process groups is
    collective over the default group (one small exchange checks that every rank passes
    consistent groups and the same config).
    """

    #: The parameters that hold experts (partitioned under expert parallelism; the biases exist
    #: with ``config.expert_ffn_bias``).
    expert_parameter_names = ("w1", "w2", "b1", "b2")

    def __init__(
        self,
        config: MoEConfig,
        *,
        ep_group=None,
        mesh=None,
        mp_group=None,
        esp_group=None,
        ep_esp_group=None,
        parm_groups=None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        aux_loss_group=None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a tritonmoe.MoEConfig, got {type(config).__name__}")
        check_layer_options(config, aux_loss_group, mp_group is not None or esp_group is not None or
                            parm_groups is not None)
        #: The group the "global" balance loss sums its token counts over (e.g. data parallel).
        self.aux_loss_group = aux_loss_group
        if mesh is not None:
            if ep_group is not None:
                raise ValueError("pass mesh= or ep_group=, not both (the mesh's 'ep' dimension is the expert-parallel group)")

            mesh = as_moe_mesh(mesh)
            ep_group = mesh.ep_group
        self.config = config
        self.mesh = mesh
        self.ep_group = ep_group
        #: The expert computation of this layout (:mod:`tritonmoe.experts`).
        self.expert_path: ExpertPath = make_expert_path(
            config, ep_group=ep_group, mp_group=mp_group, esp_group=esp_group, ep_esp_group=ep_esp_group,
            parm_groups=parm_groups, dtype=dtype,
        )
        E = config.num_experts
        _make_parameters(self, config, device, dtype)
        self._step = _StepState()
        self._global_balance = GlobalBalanceState(E, device=device)
        self._step.load = torch.zeros(E, dtype=torch.int64, device=device)  # a tensor from the start (no
        # None -> tensor change for torch.compile to guard on); _apply moves it with the layer
        self.init_seed: int = 0
        self.reset_parameters()
        seed_group = mesh.dense_group if mesh is not None else ep_group
        if seed_group is not None and dist.get_world_size(seed_group) > 1:

            check_agreement(
                {"init_seed": self.init_seed},
                group=seed_group,
                what="the layer's initialization seed (seed every rank identically, e.g. torch.manual_seed(s), before "
                "building the model: the replicated router and the experts' seeds come from it)",
            )
        if self.expert_parallel:

            self.register_state_dict_post_hook(expert_state_dict_hook)
            self.register_load_state_dict_pre_hook(expert_load_pre_hook)

    # -- the layout, as attributes users and tests read ------------------------------------------

    @property
    def expert_parallel(self) -> bool:
        """True when the experts are partitioned over an expert-parallel group of 2+ ranks."""
        return self.ep_group is not None and dist.get_world_size(self.ep_group) > 1

    @property
    def comm_scheduler(self):
        """The :class:`~tritonmoe.comm.CommScheduler` the expert path's collectives go through
        (None: issued directly)."""
        return getattr(self.expert_path, "scheduler", None)

    @comm_scheduler.setter
    def comm_scheduler(self, value) -> None:
        if not hasattr(self.expert_path, "scheduler"):
            raise ValueError("comm_scheduler applies to expert-parallel layers (built with ep_group= or a mesh with ep > 1)")
        self.expert_path.scheduler = value

    def __setattr__(self, name: str, value) -> None:
        # fully_shard installs sharded parameters through setattr when a module defines it: the
        # detection point for FSDP over expert-parallel ranks (tritonmoe.parallel.guard).
        if name in type(self).expert_parameter_names and hasattr(value, "device_mesh") and hasattr(value, "placements"):

            check_sharded_expert(self, name, value)
        super().__setattr__(name, value)

    @property
    def num_local_experts(self) -> int:
        """Experts held on this rank."""
        return self.expert_path.num_local_experts

    @property
    def expert_start(self) -> int:
        """Global index of this rank's first expert."""
        return self.expert_path.expert_start

    @property
    def dispatcher(self):
        """The expert-parallel :class:`~tritonmoe.comm.AllToAllDispatcher` (None when local)."""
        return getattr(self.expert_path, "dispatcher", None)

    @property
    def timeline(self):
        """A :class:`~tritonmoe.comm.Timeline` the expert path records its schedule into."""
        return self.expert_path.timeline

    @timeline.setter
    def timeline(self, value) -> None:
        self.expert_path.timeline = value

    @property
    def memory_strategy_used(self) -> str | None:
        """The memory strategy (:mod:`tritonmoe.policy.memory_strategy`) the last forward's expert-parallel
        pipeline ran (the planner's pick under ``memory_strategy="auto"``); None when unmanaged."""
        return getattr(self.expert_path, "memory_strategy_used", None)

    @property
    def ffn_path_used(self) -> str | None:
        """The expert path variant the last forward ran ("fused", "unfused" or
        "expert_parallel"; None before the first forward)."""
        return self.expert_path.path_used

    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), independent of
        the layout: the router from the default generator, then ``init_seed`` drawn from the
        default CPU generator, then global expert e from a generator seeded with (init_seed, e)."""
        self.router.reset_parameters()
        self.init_seed = draw_seed()
        w1, w2, first = self.w1, self.w2, self.expert_start
        if hasattr(w1, "device_mesh"):  # sharded by FSDP (e.g. meta init, fully_shard, to_empty): this shard's experts
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offset = compute_local_shape_and_global_offset(w1.shape, w1.device_mesh, w1.placements)
            w1, w2, first = w1.to_local(), w2.to_local(), first + int(offset[0])
        with torch.no_grad():
            for b in (self.b1, self.b2):
                if b is not None and not b.is_meta:
                    b.zero_()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        init_shards = getattr(self.expert_path, "init_weights_", None)
        if init_shards is not None:  # a path that shards experts (Parm's ESP) slices the whole experts
            init_shards(w1, w2, base_seed=self.init_seed, expert_start=first)
        else:
            init_experts_(w1, w2, base_seed=self.init_seed, expert_start=first, d_model=self.config.d_model,
                          d_ffn=self.config.d_ffn)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"d_model={c.d_model}, d_ffn={c.d_ffn}, num_experts={c.num_experts}, top_k={c.top_k}, "
            f"activation={c.activation}, score_func={c.score_func}"
        )

    def expert_weights(self) -> ExpertWeights:
        store = self._modules.get("fp8_experts")
        return ExpertWeights(self.w1, self.w2, self.b1, self.b2, store.experts() if store is not None else None)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., d_model]; ``padding_mask`` (optional, bool ``x.shape[:-1]``, True = a real
        token): padded tokens still pass through the experts, but leave the balance and z losses
        and the expert load counts (:meth:`expert_load`, the expert-bias update). The "seq" balance
        loss reads ``x`` as [B, S, d_model]."""
        _refuse_vmap(x)
        if not isinstance(self.expert_path, LocalExperts):
            return self._forward_eagerly(x, padding_mask)
        return self._forward(x, padding_mask)

    @torch.compiler.disable
    def _forward_eagerly(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The forward of the distributed layouts (expert parallel, static or dynamic; Parm),
        always eager: inside a model under ``torch.compile`` the layer is a deliberate graph
        break (dynamo compiles the code before and after it and runs the layer as it runs without
        compile). Their collectives take host-side split sizes, their schedules drive streams,
        events and process groups dynamo does not trace, and their exact weight-gradient
        deferral cannot live in a custom op. ``fullgraph=True`` therefore refuses a model with
        such a layer; the local layer compiles into the graph (:mod:`tritonmoe.custom_ops`)."""
        return self._forward(x, padding_mask)

    def _forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        x, padding_mask, refused = refused_input(self, x, padding_mask)
        if self.expert_parallel:
            check_ddp(self)  # before any collective: plain DDP over different experts is refused
        x_TD = x.reshape(-1, c.d_model)
        self._step.padding_mask, self._step.sequence_length = token_options(c.aux_losses, x, padding_mask)
        self.expert_path.input_error = refused
        try:
            out_TD, routing, aux = self.expert_path.step(x_TD, self.route_step(), self.expert_weights())
        finally:
            mask, self._step.padding_mask = self._step.padding_mask, None
            self.expert_path.input_error = None
        if refused is not None:  # the path's first exchange raises first; never return a result for refused input
            raise refused
        if c.aux_loss_mode == "attach":
            out_TD = attach_aux_loss(out_TD, aux)
            aux = aux.detach()
        self.aux_loss = aux
        self.last_routing = routing
        with torch.no_grad():
            if mask is None:
                counts = routing.counts.to(torch.int64)
            else:  # the real tokens' routed (kept) slots
                counts = reference.selected_slot_counts(routing, mask).to(torch.int64)
            self._step.load = counts if self._step.load is None else self._step.load + counts
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD if x.dim() == 2 else out_TD.view(x.shape)

    def _apply(self, fn, recurse: bool = True):
        # layer.to(dtype) / .half() / .bfloat16() cast every parameter; an fp32 router
        # (config.router_dtype) stays in its dtype.
        super()._apply(fn, recurse)
        load = self._step.load
        if load is not None:
            self._step.load = torch.zeros(load.shape, dtype=load.dtype, device=self.w1.device)
        rd = self.config.router_dtype
        if rd is not None and self.router.weight.dtype != rd:
            self.router._apply(lambda t: t.to(rd) if t.is_floating_point() else t)
        return self


def check_input(layer: "MoELayer", x: torch.Tensor, padding_mask: torch.Tensor | None) -> None:
    """A forward's input checks (typed errors; local, no collective)."""
    c = layer.config
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != c.d_model:
        raise ValueError(f"x has shape {tuple(x.shape)}; the last dimension must be d_model={c.d_model}")
    if x.dtype != layer.w1.dtype:
        raise TypeError(f"x is {x.dtype} but the layer's parameters are {layer.w1.dtype}; cast one of them")
    if x.device != layer.w1.device:
        raise ValueError(f"x is on {x.device} but the layer is on {layer.w1.device}; move one of them")
    token_options(c.aux_losses, x, padding_mask)


def refused_input(layer: "MoELayer", x, padding_mask) -> tuple[torch.Tensor, torch.Tensor | None, BaseException | None]:
    """(x, padding_mask, None) when the input passes :func:`check_input`. Otherwise, on a path
    that reports refused inputs to its group (:attr:`ExpertPath.reports_input_errors`: the other
    ranks are about to wait for this one in the step's first exchange), an empty batch of the
    layer's dtype and device, no mask, and the error: the step runs on the empty batch up to its
    first exchange, which raises the error on every rank
    (:class:`~tritonmoe.comm.errors.RankInputError`). Elsewhere the error is raised here."""
    try:
        check_input(layer, x, padding_mask)
        return x, padding_mask, None
    except (TypeError, ValueError, IndexError) as exc:
        if not layer.expert_path.reports_input_errors:
            raise
        d = layer.config.d_model
        return layer.w1.new_zeros((0, 1, d) if "seq" in layer.config.aux_losses else (0, d)), None, exc


def hold_fp8_experts(layer: "MoELayer", experts: FP8Experts) -> "MoELayer":
    """Make ``layer``'s routed experts ``experts`` (e4m3, e.g. :func:`tritonmoe.load_fp8_experts`
    of an FP8 checkpoint), kept in FP8: nothing is dequantized. Returns the layer.

    The layer must have ``expert_dtype="fp8_e4m3"`` and ``fp8_recipe`` of the experts' format
    ("block128" for "e4m3_block128"). ``experts`` holds all ``num_experts`` experts (an
    expert-parallel rank keeps its own ``[expert_start, expert_start + num_local_experts)``) or
    exactly this rank's. They become the submodule ``layer.fp8_experts``
    (:class:`~tritonmoe.experts.FP8ExpertStore`, on the layer's device; its state-dict keys
    ``fp8_experts.w1`` etc.), and ``w1``/``w2`` become empty placeholders (no 16-bit copy of the
    experts stays; they still give the layer's dtype and device). The held experts are frozen:
    the layer runs them without a backward through the experts (``torch.no_grad()``; the
    router, shared experts and the rest of a model train as usual around a frozen FP8 layer
    only where no gradient must pass through the experts). To load a checkpoint saved from such
    a layer, call this on the new layer first (with any experts of the right shapes), then
    ``load_state_dict``."""
    if not isinstance(layer, MoELayer):
        raise TypeError(f"layer must be a tritonmoe.MoELayer, got {type(layer).__name__}")
    if not isinstance(experts, FP8Experts):
        raise TypeError(f"experts must be tritonmoe.fp8.FP8Experts (quantize_experts / load_fp8_experts), got "
                        f"{type(experts).__name__}")
    c = layer.config
    if c.expert_dtype != "fp8_e4m3" or experts.format != "e4m3_" + c.fp8_recipe:
        raise ValueError(f"the layer has expert_dtype={c.expert_dtype!r}, fp8_recipe={c.fp8_recipe!r} but the experts "
                         f"are {experts.format!r}; build it with MoEConfig(expert_dtype='fp8_e4m3', "
                         f"fp8_recipe={experts.format[5:]!r})")
    check_fp8_experts(experts)
    E, first, L = c.num_experts, layer.expert_start, layer.num_local_experts
    if experts.d_model != c.d_model or experts.d_ffn != c.d_ffn or experts.num_experts not in (E, L):
        raise ValueError(f"the experts are {experts.num_experts} x (d_model={experts.d_model}, d_ffn={experts.d_ffn}); "
                         f"the layer needs {E} (or this rank's {L}) x (d_model={c.d_model}, d_ffn={c.d_ffn})")
    if c.expert_ffn_bias or (layer.w1.dim() == 3 and layer.w1.shape[0] != L):
        raise ValueError("hold_fp8_experts needs a layer whose ranks hold whole experts without biases (local or "
                         "expert parallel; not Parm's sharded experts)")
    if experts.num_experts != L:
        experts = FP8Experts(*(getattr(experts, n)[first:first + L] for n in ("w1", "w1_scale", "w2", "w2_scale")),
                             experts.format)
    dev = layer.w1.device
    moved = FP8Experts(*(getattr(experts, n).to(dev) for n in ("w1", "w1_scale", "w2", "w2_scale")), experts.format)
    layer.fp8_experts = FP8ExpertStore(moved)
    for name in ("w1", "w2"):
        setattr(layer, name, nn.Parameter(torch.empty(0, device=dev, dtype=layer.w1.dtype), requires_grad=False))
    return layer


#: Kept for callers of the v0 private helper.
_micro_batch_bounds = micro_batch_bounds
