"""MoEConfig: the validated description of a MoE layer."""

from __future__ import annotations

import math
import os
from fractions import Fraction
import dataclasses
import hashlib
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import torch

from tritonmoe.core import validation as V
from tritonmoe.core.settings import BACKENDS
from tritonmoe.policy.memory_strategy import check_memory_strategy
from tritonmoe.comm.programs.memory_reuse import check_mi_buffers
from tritonmoe.core.specs import FFNSpec, RouterSpec
from tritonmoe.core.suggest import suggest_unknown_kwargs

#: Values of MoEConfig.ffn_path.
FFN_PATHS = ("auto", "fused", "unfused")
#: Values of MoEConfig.parm_schedule ("s1"/"s2" are Parm's names: pause model parallelism before /
#: after the gate; see tritonmoe.experts.model_parallel).
PARM_SCHEDULES = ("auto", "baseline", "s1", "s2")
#: Non-integer values of MoEConfig.pipeline_degree: chosen at run time (tritonmoe.policy.degree).
PIPELINE_DEGREE_MODES = ("auto", "search")
#: Values of MoEConfig.aux_loss_type (Megatron-Core: aux_loss, seq_aux_loss, global_aux_loss).
AUX_LOSS_TYPES = ("switch", "seq", "global")
#: Values of MoEConfig.aux_loss_mode: the loss as a tensor the caller adds, or attached to the
#: layer's output so that its gradient flows with the main loss's (Megatron's MoEAuxLossAutoScaler).
AUX_LOSS_MODES = ("tensor", "attach")


def aux_loss_forms(types, coefs) -> tuple:
    """Checked ``(aux_loss_type, aux_loss_coef)`` of a MoEConfig: one type and a number, or a
    tuple of distinct types and a tuple of as many numbers; returned as a str and a float, or as
    two tuples (a one-element tuple takes the scalar form)."""
    many = isinstance(types, (tuple, list))
    if many:
        types = tuple(types)
        if not types:
            raise ValueError("aux_loss_type=() names no loss; use 'switch', 'seq', 'global' or a tuple of them")
        for t in types:
            V.choice("aux_loss_type", t, AUX_LOSS_TYPES)
        if len(set(types)) != len(types):
            raise ValueError(f"aux_loss_type={types} names a loss twice; give each type once with its coefficient")
        if not isinstance(coefs, (tuple, list)) or len(coefs) != len(types):
            raise ValueError(
                f"aux_loss_type={types} needs one coefficient per type: aux_loss_coef as a tuple of {len(types)} "
                f"numbers (Megatron's moe_aux_loss_coeff list), got {coefs!r}"
            )
        coefs = tuple(coefs)
    else:
        V.choice("aux_loss_type", types, AUX_LOSS_TYPES)
        if isinstance(coefs, (tuple, list)):
            raise ValueError(
                f"aux_loss_coef={coefs!r} is a sequence but aux_loss_type={types!r} is one type; give one number, or "
                "a tuple of types with one coefficient each"
            )
        coefs = (coefs,)
    for v in coefs:
        if not V.is_real(v):
            raise TypeError(f"aux_loss_coef must be a number (or a tuple of numbers), got {type(v).__name__} {v!r}")
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"aux_loss_coef={v} must be finite and >= 0")
    coefs = tuple(float(v) for v in coefs)
    if many and len(types) > 1:
        return types, coefs
    return (types[0] if many else types), coefs[0]


def _router_loss_options(cfg) -> None:
    """The router and balance-loss options of issue 31 (stored normalized)."""
    types, coefs = aux_loss_forms(cfg.aux_loss_type, cfg.aux_loss_coef)
    object.__setattr__(cfg, "aux_loss_type", types)
    object.__setattr__(cfg, "aux_loss_coef", coefs)
    V.choice("aux_loss_mode", cfg.aux_loss_mode, AUX_LOSS_MODES)
    V.choice("drop_policy", cfg.drop_policy, V.DROP_POLICIES)
    if cfg.group_score == "sum_topn" and cfg.n_groups is not None and cfg.n_groups > 1:
        V.routing_options(cfg.num_experts, cfg.top_k, cfg.score_func, cfg.renormalize, cfg.n_groups,
                          cfg.topk_groups, group_score=cfg.group_score)


def _check_routing(c: "MoEConfig") -> None:
    """The sizes and the router's options (routing, capacity, losses)."""
    V.positive_int("d_model", c.d_model)
    V.positive_int("d_ffn", c.d_ffn)
    V.positive_int("num_experts", c.num_experts)
    V.choice("activation", c.activation, V.ACTIVATIONS)
    V.routing_options(
        c.num_experts, c.top_k, c.score_func, c.renormalize, c.n_groups, c.topk_groups
    )
    if c.capacity_factor is not None:
        cf = c.capacity_factor
        if not V.is_real(cf):
            raise TypeError(f"capacity_factor must be a number or None, got {type(cf).__name__}")
        if not (math.isfinite(cf) and cf > 0):
            raise ValueError(f"capacity_factor={cf} must be a finite number > 0 (or None for dropless)")
    _router_loss_options(c)
    for name in ("z_loss_coef",):
        v = getattr(c, name)
        if not V.is_real(v):
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}={v} must be finite and >= 0")


def _check_layout(c: "MoEConfig") -> None:
    """The expert-parallel layout options: expert bias, pipeline degree, cost model, backend, FFN path, FP8."""
    if not isinstance(c.expert_bias, bool):
        raise TypeError(f"expert_bias must be a bool, got {type(c.expert_bias).__name__}")
    if isinstance(c.pipeline_degree, str):
        V.choice("pipeline_degree", c.pipeline_degree, PIPELINE_DEGREE_MODES)
    elif not V.is_int(c.pipeline_degree):
        raise TypeError(
            f"pipeline_degree must be a positive int, 'auto' or 'search', got {type(c.pipeline_degree).__name__} "
            f"{c.pipeline_degree!r}"
        )
    else:
        V.positive_int("pipeline_degree", c.pipeline_degree)
    if c.cost_model is not None:
        if not isinstance(c.cost_model, (str, os.PathLike)):
            raise TypeError(f"cost_model must be a file path or None, got {type(c.cost_model).__name__}")
        object.__setattr__(c, "cost_model", os.fspath(c.cost_model))
    if c.backend is not None:
        V.choice("backend", c.backend, BACKENDS)
    V.choice("ffn_path", c.ffn_path, FFN_PATHS)
    c._check_fp8()


def _check_ffn(c: "MoEConfig") -> None:
    """The experts' and the shared expert's options."""
    V.choice("group_score", c.group_score, V.GROUP_SCORES)
    rsf = c.routed_scaling_factor
    if not V.is_real(rsf):
        raise TypeError(f"routed_scaling_factor must be a number, got {type(rsf).__name__}")
    if not (math.isfinite(rsf) and rsf > 0):
        raise ValueError(f"routed_scaling_factor={rsf} must be finite and > 0")
    V.swiglu_options(c.activation, c.swiglu_limit, c.swiglu_alpha)
    for name in ("expert_ffn_bias", "router_bias", "shared_expert_gate"):
        if not isinstance(getattr(c, name), bool):
            raise TypeError(f"{name} must be a bool, got {type(getattr(c, name)).__name__}")
    if c.router_dtype is not None and (
        not isinstance(c.router_dtype, torch.dtype) or c.router_dtype not in V.FLOAT_DTYPES
    ):
        raise TypeError(f"router_dtype={c.router_dtype!r}; use None or one of {V.FLOAT_DTYPES}")
    if not V.is_int(c.shared_d_ffn) or c.shared_d_ffn < 0:
        raise ValueError(f"shared_d_ffn={c.shared_d_ffn!r} must be an int >= 0 (0: no shared expert)")
    if c.ep_capacity is not None:
        V.positive_int("ep_capacity", c.ep_capacity)
        object.__setattr__(c, "ep_capacity", int(c.ep_capacity))
        if c.capacity_factor is not None:
            raise ValueError(
                f"ep_capacity={c.ep_capacity} and capacity_factor={c.capacity_factor}: the static mode's "
                "capacity is ep_capacity; drop capacity_factor"
            )
        if c.pipeline_degree != 1:
            raise ValueError(
                f"ep_capacity (the static expert-parallel mode) runs one micro-op; use pipeline_degree=1, not "
                f"{c.pipeline_degree!r}"
            )
    if c.shared_expert_gate and c.shared_d_ffn == 0:
        raise ValueError("shared_expert_gate=True needs a shared expert: set shared_d_ffn > 0")


def _check_memory(c: "MoEConfig") -> None:
    """Parm's schedule and MPMoE's memory options."""
    V.choice("parm_schedule", c.parm_schedule, PARM_SCHEDULES)

    check_memory_strategy(c.memory_strategy)
    if c.memory_budget_bytes is not None:
        b = c.memory_budget_bytes
        if not V.is_int(b):
            raise TypeError(f"memory_budget_bytes must be an int or None, got {type(b).__name__} {b!r}")
        if b <= 0:
            raise ValueError(f"memory_budget_bytes={b} must be > 0 (or None for no budget)")
        if c.memory_strategy != "auto":
            raise ValueError(
                f"memory_budget_bytes={b} is used by memory_strategy='auto' (the planner's choice under the budget); "
                f"got memory_strategy={c.memory_strategy!r}"
            )
        object.__setattr__(c, "memory_budget_bytes", int(b))

    object.__setattr__(c, "memory_mi_buffers", check_mi_buffers(c.memory_mi_buffers))
    if c.memory_mi_buffers != 1 and c.memory_strategy in (None, "keep"):
        raise ValueError(
            f"memory_mi_buffers={c.memory_mi_buffers} sets the shared MI buffers of a memory reuse strategy; "
            f"memory_strategy={c.memory_strategy!r} shares none: use memory_strategy='offload', 'recomm', "
            "'recompute', 'recomm_recompute' or 'auto', or leave memory_mi_buffers=1"
        )
    if c.memory_strategy is not None:
        if c.ep_capacity is not None:
            raise ValueError(
                f"memory_strategy={c.memory_strategy!r} manages the pipelined expert-parallel path; the static "
                "mode (ep_capacity) runs one micro-op and keeps nothing to reuse: drop one of them"
            )
        if c.pipeline_degree == "search" and c.memory_budget_bytes is not None:
            raise ValueError(
                f"memory_budget_bytes={c.memory_budget_bytes} with pipeline_degree='search': the profile-based "
                "search measures time only; use pipeline_degree='auto' (the model checks the budget) or an int degree"
            )


def _normalize(c: "MoEConfig") -> None:
    """Plain Python numbers (numpy scalars pass validation but must not reach kernels), and
    capacity_factor as an exact ratio."""
    # Store plain Python numbers (numpy scalars pass validation but must not reach kernels).
    for name in ("d_model", "d_ffn", "num_experts", "top_k", "n_groups", "topk_groups", "pipeline_degree",
                 "shared_d_ffn"):
        v = getattr(c, name)
        if v is not None and not isinstance(v, str):
            object.__setattr__(c, name, int(v))
    for name in ("capacity_factor", "z_loss_coef", "routed_scaling_factor", "swiglu_limit", "swiglu_alpha"):
        v = getattr(c, name)
        if v is not None:
            object.__setattr__(c, name, float(v))
    # capacity_factor as an exact ratio of Python ints (its shortest decimal form: 1.1 is
    # 11/10), computed once here so that capacity() is integer arithmetic only.
    ratio = None
    if c.capacity_factor is not None:
        ratio = Fraction(repr(c.capacity_factor)).as_integer_ratio()
    object.__setattr__(c, "_capacity_ratio", ratio)
    # the frozen option specs the layer and the expert paths take the ops' options from
    object.__setattr__(c, "router_spec", RouterSpec(
        c.top_k, c.score_func, c.renormalize, c.n_groups, c.topk_groups, c.group_score, c.routed_scaling_factor,
        c.drop_policy))
    object.__setattr__(c, "ffn_spec", FFNSpec(c.activation, c.swiglu_limit, c.swiglu_alpha))


@suggest_unknown_kwargs
@dataclass(frozen=True)
class MoEConfig:
    """Configuration of a :class:`tritonmoe.MoELayer`.

    Attributes:
        d_model, d_ffn: model and expert hidden widths.
        num_experts: E, the global number of experts.
        top_k: experts per token.
        activation: "swiglu" (w1 holds gate then up, 2*d_ffn columns), "swiglu_oai" (GPT-OSS's
            clamped SwiGLU, same layout), "gelu" (exact) or "relu".
        score_func: "softmax" or "sigmoid".
        renormalize: renormalize the k weights to sum to 1.
        n_groups, topk_groups: group-limited routing (both or neither).
        capacity_factor: None for dropless; otherwise capacity = ceil(cf * T * k / E) for a batch
            of T tokens.
        aux_loss_coef, z_loss_coef: weights of the load-balancing and z losses in ``aux_loss``.
            With several ``aux_loss_type`` values, ``aux_loss_coef`` is a tuple of one
            coefficient per type.
        aux_loss_type: which load-balancing loss ``aux_loss_coef`` weighs (docs/routing.md):
            "switch" (the batch's Switch loss), "seq" (the Switch loss of each sequence averaged
            over the batch; the forward's ``x`` must be [B, S, d_model]) or "global" (token
            counts accumulated over micro-batches and the layer's ``aux_loss_group`` until
            ``layer.reset_aux_loss_state()``), or a tuple of them, e.g. ``("seq", "global")``
            with ``aux_loss_coef=(1e-3, 1e-2)``.
        aux_loss_mode: "tensor" (``layer.aux_loss`` is in the graph; the caller adds it to the
            loss) or "attach" (the loss is attached to the layer's output: its gradient flows
            when the main loss is backpropagated, times the scale of
            :func:`tritonmoe.set_aux_loss_scale`; ``layer.aux_loss`` then holds its value,
            detached).
        drop_policy: which slots an expert keeps at its capacity (``capacity_factor``): "slot",
            "position" or "probs" (:func:`tritonmoe.route`).
        expert_bias: keep an fp32 [E] selection bias buffer (auxiliary-loss-free balancing, as in
            DeepSeek-V3); the layer never updates it, the training loop does.
        pipeline_degree: micro-batches for expert-parallel pipelining (1 = none), or chosen per
            forward by the expert-parallel path: "auto" (the planner simulates the candidates
            with a cost model, ``tritonmoe.plan.choose``; cached per token-count bucket) or
            "search" (MPMoE's profile-based search over 2..8); see :mod:`tritonmoe.policy.degree`.
            A layer built without ``ep_group`` runs any of these as 1 and logs so once: the same
            config is the single-process reference of the expert-parallel run (same result).
        cost_model: path of a cost-model file for ``pipeline_degree="auto"`` (default: the
            ``TRITONMOE_COST_MODEL`` environment variable, else a built-in default).
        backend: backend of the layer's ops, or None for the process default.
        ffn_path: how the layer runs its experts: "fused" (:func:`tritonmoe.moe_ffn`, token gather
            and weighted combine fused into the expert GEMMs), "unfused" (permute ->
            grouped_ffn -> unpermute) or "auto" (the layer picks per call and records the choice
            in ``MoELayer.ffn_path_used``: on CUDA unfused when a backward follows, fused for
            inference; unfused on the reference; see :class:`tritonmoe.experts.LocalExperts`).
        group_score: how group-limited routing scores a group: "top2sum" (the sum of its two
            largest selection values; DeepSeek-V3) or "max" (DeepSeek-V2).
        routed_scaling_factor: multiplies the routed experts' weights after renormalization
            (DeepSeek-V3 2.5, GLM-4-MoE); finite, > 0.
        swiglu_limit, swiglu_alpha: the clamp bound and sigmoid scale of activation
            "swiglu_oai" (GPT-OSS: 7.0, 1.702).
        expert_ffn_bias: per-expert biases ``b1`` [E, n1] and ``b2`` [E, d_model] on the two
            expert projections (GPT-OSS), initialized to zero.
        router_bias: a bias on the router's logits (GPT-OSS).
        router_dtype: None (the router computes in the layer's dtype) or a float dtype (e.g.
            ``torch.float32``) the router's weight is kept in and its logits computed in, on
            bf16/fp16 activations; ``layer.to(dtype)`` keeps it.
        shared_d_ffn: hidden width of the shared expert(s) every token goes through besides its
            routed experts (DeepSeek, Qwen2-MoE, Llama 4; several shared experts of width f are
            one of width n*f); 0 for none. Same activation as the routed experts.
        shared_expert_gate: scale the shared expert's output by ``sigmoid(x @ g)`` per token
            (Qwen2-MoE's ``shared_expert_gate``).
        ep_capacity: static expert-parallel mode (Megatron's pad-to-capacity): every rank keeps
            at most this many slots per expert (later ones dropped, as ``capacity_factor``
            drops) and sends exactly this many rows to every expert, padded with zeros. Every
            exchange then has a static size, so the expert-parallel forward and backward run
            without a host synchronization (capturable in a CUDA graph; with validation on, the
            forward reads the ranks' refused-input status words once, outside a capture:
            docs/rank-input.md). None: dropless or
            ``capacity_factor`` (one host sync per forward: the counts exchange). Excludes
            ``capacity_factor`` and ``pipeline_degree`` > 1.
        parm_schedule: the schedule of a layer with model-parallel or expert-sharding groups
            (``MoELayer(..., mp_group=..., esp_group=...)``, paper 003 "Parm"): "baseline"
            (DeepSpeed-MoE's order), "s1" (pause model parallelism before the gate), "s2" (after
            the gate, with the SAA collective) or "auto" (Parm's Algorithm 1 on fitted alpha-beta
            costs picks s1 or s2 per batch size). Ignored by other layouts.
        memory_strategy: MPMoE's memory reuse on the pipelined expert-parallel path
            (:mod:`tritonmoe.policy.memory_strategy`): None (unmanaged), "keep", "offload", "recomm",
            "recompute", "recomm_recompute" or "auto" (the planner's choice under
            ``memory_budget_bytes``; with ``pipeline_degree="search"``, MPMoE's profile-based
            search over degree and strategy). Without ``ep_group`` the layer runs unmanaged (logged
            once, like ``pipeline_degree``); with model-parallel / expert-sharding groups it is refused.
        memory_budget_bytes: device bytes the expert block may keep for backward per rank
            (``memory_strategy="auto"`` only); the planner rejects candidates that need more.
        memory_mi_buffers: shared device buffers for the middle activation (MI, the first GEMM's
            output) under a reuse strategy: 1 (the paper's single T_M buffer; least memory, but a
            micro-op's MI host copy or restore serializes with its neighbour's compute) or 2
            (double-buffered like DI: one more MI buffer, and the MI copies of "offload" /
            "recomm" can run beside the next micro-op's compute). Needs a memory strategy other
            than "keep"; ``memory_strategy="auto"`` plans with this count (it does not switch).
        expert_dtype: None (the experts compute in the layer's dtype) or "fp8_e4m3": the routed
            experts run through :mod:`tritonmoe.fp8` with the layer's weights as master weights
            (quantized at each call; the state dict keeps the master weights): inference by
            :func:`tritonmoe.fp8_moe_ffn`, training (a backward follows) by permute ->
            :func:`tritonmoe.fp8.fp8_grouped_ffn_train` -> unpermute. SwiGLU experts without
            expert biases, on the local expert path (no expert parallelism), eager (not under
            torch.compile); training needs fp8_recipe="block128" and d_ffn a multiple of 128.
        fp8_recipe: "block128" (DeepSeek-V3: 1x128 activation groups, 128x128 weight blocks) or
            "rowwise" (inference only).
    """

    d_model: int
    d_ffn: int
    num_experts: int
    top_k: int
    activation: str = "swiglu"
    score_func: str = "softmax"
    renormalize: bool = True
    n_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    capacity_factor: Optional[float] = None
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_bias: bool = False
    pipeline_degree: int | str = 1
    backend: Optional[str] = None
    ffn_path: str = "auto"
    parm_schedule: str = "auto"
    cost_model: Optional[str] = None
    group_score: str = "top2sum"
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = V.SWIGLU_LIMIT
    swiglu_alpha: float = V.SWIGLU_ALPHA
    expert_ffn_bias: bool = False
    router_bias: bool = False
    router_dtype: Optional[torch.dtype] = None
    shared_d_ffn: int = 0
    shared_expert_gate: bool = False
    ep_capacity: Optional[int] = None
    memory_strategy: Optional[str] = None
    memory_budget_bytes: Optional[int] = None
    memory_mi_buffers: int = 1
    aux_loss_type: str | tuple = "switch"
    aux_loss_mode: str = "tensor"
    drop_policy: str = "slot"
    expert_dtype: Optional[str] = None
    fp8_recipe: str = "block128"

    def __post_init__(self) -> None:
        _check_routing(self)
        _check_layout(self)
        _check_ffn(self)
        _check_memory(self)
        _normalize(self)

    def _check_fp8(self) -> None:
        if self.expert_dtype is None:
            return
        V.choice("expert_dtype", self.expert_dtype, ("fp8_e4m3",))
        V.choice("fp8_recipe", self.fp8_recipe, ("block128", "rowwise"))
        if self.activation != "swiglu" or self.expert_ffn_bias:
            raise ValueError(f"expert_dtype='fp8_e4m3' runs SwiGLU experts without biases; this config has "
                             f"activation={self.activation!r}, expert_ffn_bias={self.expert_ffn_bias}")

    @property
    def aux_losses(self) -> dict:
        """{aux_loss_type: coefficient} of the load-balancing losses with a coefficient > 0."""
        types = self.aux_loss_type if isinstance(self.aux_loss_type, tuple) else (self.aux_loss_type,)
        coefs = self.aux_loss_coef if isinstance(self.aux_loss_coef, tuple) else (self.aux_loss_coef,)
        return {t: c for t, c in zip(types, coefs) if c > 0}

    @property
    def n1(self) -> int:
        """Output columns of w1: 2*d_ffn for swiglu (gate then up), d_ffn otherwise."""
        return 2 * self.d_ffn if self.activation in V.GLU_ACTIVATIONS else self.d_ffn

    def agreement_values(self) -> dict[str, int]:
        """Every field that changes what a rank computes, as an int64 code (equal values, equal
        codes: floats by their exact bits, whatever their Python type; strings, dtypes and
        tuples by a stable hash): what the ranks of a group compare at construction. The fields
        of :data:`RANK_LOCAL_FIELDS` are left out."""
        return {f.name: agreement_code(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in RANK_LOCAL_FIELDS}

    def agreement_labels(self) -> dict[str, str]:
        """The readable values of :meth:`agreement_values`' fields (for the error that names
        each rank's value)."""
        return {f.name: repr(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in RANK_LOCAL_FIELDS}

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Per-expert capacity ``ceil(capacity_factor * num_tokens * top_k / num_experts)`` for a
        batch of ``num_tokens`` tokens (``ep_capacity`` when set; None when dropless).

        Exact: capacity_factor is taken as the decimal it prints as (1.1 is 11/10, so
        capacity_factor=1.1 with T*k/E = 10 gives 11, not the 12 of float arithmetic), and the
        ceiling is one integer floor division. ``num_tokens`` may be a ``torch.SymInt`` (a
        dynamic batch size under ``torch.compile``): the same expression is then traced
        symbolically and gives the same value at run time.
        """
        if self.ep_capacity is not None:  # the static mode: a fixed capacity per expert
            return self.ep_capacity
        if self._capacity_ratio is None:
            return None
        num, den = self._capacity_ratio
        # ceil(a / b) = -((-a) // b) for integers a >= 0, b > 0.
        return -((-num * num_tokens * self.top_k) // (den * self.num_experts))


#: MoEConfig fields a rank may set on its own: how it computes, not what (``backend`` and
#: ``ffn_path`` pick implementations of the same ops; ``cost_model`` is a path on that rank's
#: disk, and the ranks compare the loaded model's fingerprint instead).
RANK_LOCAL_FIELDS = frozenset({"backend", "ffn_path", "cost_model"})


def agreement_code(value: Any) -> int:
    """A value as a non-negative int64 code, equal for equal values across processes: bools and
    ints as numbers, other reals by their float64 bits (``1`` and ``1.0`` agree), everything else
    by a hash of its type and ``repr``."""
    if isinstance(value, bool):
        text = f"b:{int(value)}"
    elif isinstance(value, numbers.Integral):
        text = f"r:{float(value).hex()}" if abs(int(value)) <= 2**53 else f"i:{int(value)}"
    elif isinstance(value, numbers.Real):
        text = f"r:{(float(value) + 0.0).hex()}"  # + 0.0: -0.0 and 0.0 agree
    elif value is None:
        text = "none"
    elif isinstance(value, str):
        text = f"s:{str.__str__(value)}"  # a str subclass (a str Enum) agrees with its plain value
    elif isinstance(value, (tuple, list)):
        text = "t:" + ",".join(str(agreement_code(v)) for v in value)
    else:
        text = f"{type(value).__name__}:{value!r}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
