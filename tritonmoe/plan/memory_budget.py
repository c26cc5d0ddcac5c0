"""Memory per GPU of a MoE model trained (or served) with expert parallelism x data parallelism.

:func:`memory_per_gpu` returns a :class:`MemoryEstimate`: one row per kind of bytes, each with
its provenance:

* **exact**: counted from the shapes (:meth:`tritonmoe.plan.models.ModelSpec.params_by_part`):
  weights, gradients, fp32 master weights and optimizer state (torch.optim.Adam's two moments
  and its per-tensor ``step`` counter; SGD's momentum buffer). ``tests/test_plan_memory_budget.py``
  checks these against the storages of a model stepped once on CPU, byte for byte.
* **formula**: activations. The MoE layers' follow what tritonmoe's own layer keeps for
  backward: the managed expert block's DI and MI buffers by memory strategy are
  :func:`tritonmoe.sim.memory_model.expert_block_bytes` (MPMoE's accounting adapted to the real
  tensors), plus the router's and the combine's saved tensors read from the layer's code
  (:func:`moe_layer_saved_bytes`); the test measures a layer stack with the allocator (glibc's
  ``mallinfo2``) for every strategy on one rank, within 10%. The attention / dense part models
  what transformers' own modules save for backward (:func:`attention_layer_saved_bytes`, read
  from their code; Korthikanti et al. 2022, arXiv:2205.05198 §4.1, is the method, not the
  numbers: their fused kernels keep less): each RMSNorm keeps its input upcast to fp32, a
  reciprocal RMS and the normalized values (and its output, which the next linear saves); QK
  norms (Qwen3, OLMoE) the same over q and k; the rotary embedding only cos and sin (per model);
  ``attn_implementation="sdpa"`` (transformers' default: FlashAttention / memory-efficient
  attention on a GPU) q, k and v (k and v not repeated for grouped-query attention), the output
  and the fp32 log-sum-exp; ``"eager"`` the fp32 [heads, s, s] softmax probabilities too (and
  their 16-bit copy), q, k and v repeated to every head; MLA its latent norms and the
  up-projection's output; a dense MLP four [d_ffn] tensors; the model once: the ids, cos / sin,
  the final norm; the LM head's logits (held by the model's output) and the loss's fp32
  log-softmax. ``tests/test_plan_activation_memory.py`` builds tiny Mixtral-, Qwen3-MoE-,
  DeepSeek-V3-, Qwen2-MoE- and GPT-OSS-shaped models (MoE blocks swapped to tritonmoe by
  ``hf.apply``), trains a step on CPU in fp32 and checks the three activation rows against the
  allocator's bytes held between forward and backward, within 10% (measured: 0-1.6% under for
  Mixtral, Qwen3, Qwen2 and GPT-OSS, sdpa and eager;
  DeepSeek-V3 3-5% under with sdpa: torch's CPU attention keeps the query's [B, H, S, D] layout
  for MLA's concatenated query, so the output projection's input is a second copy of the output,
  which a GPU's kernels, whose output is [B, S, H, D], do not make), and the part outside the MoE
  blocks in fp32 and bf16 against the storages autograd saves. Assumed: transformers' Python
  modules (fused RMSNorm / RoPE from the kernels hub or Liger keep less: this is then an upper
  bound), ``use_cache=False`` in training (with a cache and eager attention the output also
  holds k and v), no padding mask (with one, sdpa repeats k and v to every head), no dropout.
* **assumed**: what the estimate cannot know (routing balance: uniform unless told).

Layout assumed (what tritonmoe's expert-parallel layer does): every rank holds every dense
parameter (attention, norms, embedding, LM head, routers, shared experts, dense MLPs) and
``E / ep_size`` routed experts of every MoE layer; the world is ``ep_size`` x ``dp`` (DP =
world / ep_size); an expert's gradients are reduced over its DP replicas. ZeRO-1
(``shard_optimizer``) shards each parameter's optimizer state and master copy over the group
that holds a replica of it: dense parameters over the whole world, experts over their DP group.

Where E is not divisible by ``ep_size``: training is refused (the expert-parallel layer needs E
divisible by its group: ``ValueError`` naming the EP sizes that work), serving replicates each
expert ``expert_replicas`` times (tritonmoe.inference.ReplicatedMoELayer serves any placement of
replicas: each rank hosts ``E * replicas / ep_size`` experts).

The sums are an upper bound of the step's peak: gradients and activations are both counted
whole (gradient accumulation holds both; without it gradients grow as activations are freed).
Not counted: the CUDA context and the allocator's fragmentation (say ~1-3 GiB on an H100), the
communication buffers of NCCL, temporary workspaces of one op.

Example: Qwen3-30B-A3B on 16 H100s (two DGX nodes), EP 8 x DP 2, 4096 tokens per GPU, ZeRO-1,
MoE layers with "recompute" at pipeline degree 4::

    from tritonmoe.plan import TrainingSetup, device_memory_bytes, memory_per_gpu
    est = memory_per_gpu("qwen3-30b-a3b", world_size=16, ep_size=8, tokens_per_gpu=4096, seq_len=4096,
                         setup=TrainingSetup(shard_optimizer=True), memory_strategy="recompute",
                         pipeline_degree=4)
    print(est.table(device_memory_bytes("dgx-h100")))

                                                GiB  provenance  note
    weights: dense (replicated)                2.87  exact       1.541B params x 2 B
    weights: routed experts                    6.75  exact       16 of 128 experts x 48 MoE layers
    gradients                                  9.62  exact       2 B per parameter
    fp32 master weights                        7.11  exact       4 B per parameter, sharded over DP (dense / 16, experts / 2)
    optimizer state (adam)                    14.22  exact       Adam's two moments x 4 B + a 4 B step per tensor, sharded over DP (dense / 16, experts / 2)
    activations: attention + dense MLPs       14.55  formula     transformers' modules, attn_implementation='sdpa': 79128 B/token/layer (norms, q/k/v, output, log-sum-exp)
    activations: MoE layers                   16.36  formula     memory_strategy='recompute', pipeline_degree=4: 32768 rows per layer (tritonmoe's layer: router, combine, expert block)
    activations: logits + loss                 3.48  formula     [4096, 151936] logits and their fp32 log-softmax
    total                                     74.96
    host (offloaded)                           6.00
    capacity                                  79.19
    headroom                                   4.23  fits
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from tritonmoe.core.suggest import did_you_mean
from tritonmoe.comm.programs.memory_reuse import STRATEGIES
from tritonmoe.sim.cost_model import GPUS, PRESETS, Cluster, GPU
from tritonmoe.sim.memory_model import expert_block_bytes

from .models import ModelSpec, get_model

__all__ = ["ATTN_IMPLEMENTATIONS", "TrainingSetup", "MemoryRow", "MemoryEstimate", "memory_per_gpu", "device_memory_bytes",
           "PROVENANCES", "OPTIMIZERS", "GiB"]

GiB = 2 ** 30
PROVENANCES = ("exact", "measured", "formula", "assumed")
OPTIMIZERS = ("adam", "sgd", "none")
#: attention implementations the activation estimate models (transformers' ``attn_implementation``)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
#: the usable device memory (``torch.cuda.get_device_properties(i).total_memory``, what torch's
#: out-of-memory messages call "total capacity") of the GPUs the simulator describes, where
#: known: an H100 SXM5 80GB (80 GB of HBM3) reports about 79.19 GiB (79.1-79.3 GiB by driver:
#: 85,029,158,912 bytes used here), an H200 (141 GB of HBM3e) 139.80 GiB (to 0.01 GiB). Others: the
#: description's nominal ``memory``.
USABLE_MEMORY = {
    "H100-SXM5-80GB": 85_029_158_912,
    "H200-SXM-141GB": round(139.80 * 2**30),
}


def _itemsize(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt).element_size()


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained.

    Attributes:
        optimizer: "adam" (torch.optim.Adam / AdamW: two moments and a step counter per
            parameter tensor), "sgd" (SGD with momentum: one buffer) or "none" (inference: no
            gradients, no optimizer state, no activations kept for backward).
        param_dtype: the dtype of the weights the model computes with (default bfloat16).
        master_weights: an fp32 master copy of every parameter (mixed precision; none when
            ``param_dtype`` is fp32 already); the optimizer state is then fp32 too; without it
            the state has the parameters' dtype (as torch.optim keeps it).
        grad_dtype: the gradients' dtype (None: param_dtype).
        shard_optimizer: ZeRO-1: optimizer state and master weights sharded over each
            parameter's data-parallel group (experts over their DP replicas, dense parameters
            over the world).
        activation_checkpointing: recompute the attention / dense part of every layer in
            backward (only each layer's input is kept; one layer's activations at a time are
            rebuilt).
    """

    optimizer: str = "adam"
    param_dtype: torch.dtype = torch.bfloat16
    master_weights: bool = True
    grad_dtype: Optional[torch.dtype] = None
    shard_optimizer: bool = False
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        for f in ("master_weights", "shard_optimizer", "activation_checkpointing"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"TrainingSetup.{f} must be a bool, got {getattr(self, f)!r}")
        if not isinstance(self.param_dtype, torch.dtype) or not self.param_dtype.is_floating_point:
            raise TypeError(f"TrainingSetup.param_dtype must be a floating torch.dtype, got {self.param_dtype!r}")
        for f in ("param_dtype", "grad_dtype"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, torch.dtype):
                raise TypeError(f"TrainingSetup.{f} must be a torch.dtype, got {v!r}")

    @property
    def training(self) -> bool:
        return self.optimizer != "none"

    @property
    def keeps_master_copy(self) -> bool:
        """Whether a separate fp32 master copy exists (not when the parameters are fp32 already)."""
        return self.master_weights and self.training and self.param_dtype != torch.float32

    @property
    def state_dtype(self) -> torch.dtype:
        return torch.float32 if self.master_weights else self.param_dtype

    @property
    def optimizer_states(self) -> int:
        return {"adam": 2, "sgd": 1, "none": 0}[self.optimizer]


@dataclass(frozen=True)
class MemoryRow:
    """One kind of bytes: ``name``, ``bytes`` (per GPU), ``provenance`` (one of
    :data:`PROVENANCES`) and ``note`` (how it was counted)."""

    name: str
    bytes: int
    provenance: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.provenance not in PROVENANCES:
            raise ValueError(f"provenance={self.provenance!r}; use one of {', '.join(PROVENANCES)}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Device bytes per GPU (see the module docstring): ``rows``, ``host_bytes`` (what an
    offloading memory strategy copies to host memory), the inputs it was computed from
    (``model``, ``setup`` and ``params``: the keyword arguments of :func:`memory_per_gpu`)."""

    rows: tuple
    model: ModelSpec
    setup: TrainingSetup
    params: dict = field(default_factory=dict)
    host_bytes: int = 0
    assumptions: tuple = ()

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    def row(self, name: str) -> MemoryRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row {name!r}; rows: {', '.join(r.name for r in self.rows)}")

    def by_provenance(self) -> dict:
        out = {p: 0 for p in PROVENANCES}
        for r in self.rows:
            out[r.provenance] += r.bytes
        return out

    def fits(self, capacity_bytes: int) -> bool:
        return self.total_bytes <= _capacity(capacity_bytes)

    def shortfall(self, capacity_bytes: int) -> int:
        """Bytes over ``capacity_bytes`` (0 when it fits)."""
        return max(0, self.total_bytes - _capacity(capacity_bytes))

    def table(self, capacity_bytes: Optional[int] = None) -> str:
        """A plain-text table in GiB: every row with its provenance, the total, and against
        ``capacity_bytes`` (when given) the headroom or the shortfall."""
        w = max(len(r.name) for r in self.rows) + 2
        lines = [f"{'':{w}}{'GiB':>10}  provenance  note"]
        for r in self.rows:
            lines.append(f"{r.name:{w}}{r.bytes / GiB:>10.2f}  {r.provenance:<10}  {r.note}")
        lines.append(f"{'total':{w}}{self.total_bytes / GiB:>10.2f}")
        if self.host_bytes:
            lines.append(f"{'host (offloaded)':{w}}{self.host_bytes / GiB:>10.2f}")
        if capacity_bytes is not None:
            cap = _capacity(capacity_bytes)
            lines.append(f"{'capacity':{w}}{cap / GiB:>10.2f}")
            if self.fits(cap):
                lines.append(f"{'headroom':{w}}{(cap - self.total_bytes) / GiB:>10.2f}  fits")
            else:
                lines.append(f"{'shortfall':{w}}{self.shortfall(cap) / GiB:>10.2f}  does not fit")
        return "\n".join(lines)

    def what_would_fit(self, capacity_bytes: int) -> list:
        """Sentences naming the changes that save memory, each computed by re-running the
        estimate with that change (largest saving first; those that make it fit say so)."""
        return [s for _, s in _alternatives(self, _capacity(capacity_bytes))]


def _capacity(c: Any) -> int:
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c):
        raise TypeError(f"capacity_bytes must be a number of bytes, got {c!r}")
    if c < 0:
        raise ValueError(f"capacity_bytes={c} is negative; pass the device's memory in bytes "
                         "(e.g. device_memory_bytes('dgx-h100'))")
    return int(c)


def device_memory_bytes(cluster_or_name: Any) -> int:
    """A GPU's usable memory in bytes from a :class:`~tritonmoe.sim.Cluster`, a cluster preset
    name (``"dgx-h100"``), a :class:`~tritonmoe.sim.GPU` or a GPU name (``"H100-SXM5-80GB"``):
    :data:`USABLE_MEMORY` (what torch reports as the device's total memory) where known, else the
    GPU description's nominal ``memory``."""
    x = cluster_or_name
    if isinstance(x, str):
        if x in PRESETS:
            x = PRESETS[x]()
        elif x in GPUS:
            x = GPUS[x]
        else:
            raise ValueError(f"unknown cluster or GPU {x!r}{did_you_mean(x, list(PRESETS) + list(GPUS))}; use one of "
                             f"{', '.join(list(PRESETS) + list(GPUS))}")
    if isinstance(x, Cluster):
        x = x.gpu
    if not isinstance(x, GPU):
        raise TypeError(f"expected a Cluster, a GPU or a preset name, got {type(x).__name__}")
    return int(USABLE_MEMORY.get(x.name, x.memory))


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def _pos_int(name: str, v: Any, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ValueError(f"{name}={v} must be >= {lo}")
    return int(v)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _experts_per_rank(m: ModelSpec, world: int, ep: int, training: bool, replicas: Optional[int]) -> tuple:
    """(experts per rank, replicas of each expert) under the layout of the module docstring."""
    E = m.num_experts
    if ep > world or world % ep:
        raise ValueError(f"ep_size={ep} does not divide world_size={world}; use one of {_divisors(world)} "
                         f"(data parallelism is world_size / ep_size)")
    if replicas is not None:
        replicas = _pos_int("expert_replicas", replicas)
        if training and replicas != 1:
            raise ValueError(f"expert_replicas={replicas} in training: tritonmoe's expert-parallel layer holds each "
                             "expert once per EP group (replicas come from data parallelism); replication serves "
                             "inference (optimizer='none')")
    if E % ep == 0 and replicas in (None, 1):
        return E // ep, 1
    if training:
        ok = [d for d in _divisors(world) if E % d == 0]
        raise ValueError(f"num_experts={E} is not divisible by ep_size={ep}: the expert-parallel layer needs E "
                         f"divisible by its group; use ep_size in {ok} (EP x DP = {world}: e.g. ep_size={max(ok)}, "
                         f"DP={world // max(ok)}), or serve with expert replication (optimizer='none')")
    r = replicas if replicas is not None else ep // math.gcd(E, ep)
    if (E * r) % ep:
        raise ValueError(f"expert_replicas={r}: E * replicas = {E * r} is not divisible by ep_size={ep}; use a "
                         f"multiple of {ep // math.gcd(E, ep)}")
    return E * r // ep, r


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def moe_layer_saved_bytes(m: ModelSpec, tokens: int, rows: int, *, memory_strategy: Optional[str] = "keep",
                          pipeline_degree: int = 1, dtype: torch.dtype = torch.bfloat16,
                          mi_buffers: int = 1, expert_parallel: bool = True) -> dict:
    """Bytes one tritonmoe MoE layer (the expert-parallel path, :mod:`tritonmoe.comm.programs.memory_reuse`)
    keeps for backward on a rank with ``tokens`` input tokens whose experts receive ``rows`` rows,
    split evenly over ``pipeline_degree`` micro-ops. What the layer's code saves:

    * the router: the fp32 routing probabilities [T, E] (saved) and the fp32 logits [T, E] the
      layer keeps for its auxiliary losses (``MoELayer``'s step state), the top-k ids (int64)
      and fp32 weights [T, k], two fp32 per-token statistics of the softmax (8 B per token);
    * per micro-op, the combine (unpermute): each slot's ids (int64), kept mask (bool), fp32
      weight and expert output row ([T_i, k, d] in the layer's dtype), and the expert block's
      int64 row index of R_i + 1 entries;
    * the expert block: DI and MI by strategy, :func:`tritonmoe.sim.memory_model.expert_block_bytes`
      (``held``: the buffers every micro-op of which is restored anyway are freed until the
      backward starts), and an expert output [R_i, d] per micro-op until the backward;
    * ``host``: the DI / MI copies an offloading strategy keeps in host memory.

    ``memory_strategy=None`` is the layer's default, unmanaged path (the unfused grouped FFN
    under autograd, as ``ffn_path="auto"`` trains): each micro-op keeps its DI [R_i, d], the
    first GEMM's output [R_i, n1], the activation's output [R_i, f] that the second GEMM saves
    and, for gated activations, the SiLU / GELU output [R_i, f] the product saves; expert-parallel
    (``expert_parallel``) it also holds each micro-op's expert output until backward, as the
    managed block does; the local layer (``ep_size=1``) does not.

    Not counted: the CPU reference routing's top-k ids are a view of its [T, E] int64 sort
    (T*(E-k)*8 more bytes on CPU than the GPU kernels' [T, k] ids).

    Returns ``{"router", "combine", "experts", "host", "revive", "total"}`` (device bytes but
    host): ``total`` is what the layer holds between its forward and its backward; ``revive`` the
    buffers a managed block re-allocates when its backward starts (one layer at a time)."""
    n = _pos_int("pipeline_degree", pipeline_degree)
    es = _itemsize(dtype)
    T, E, K, d = tokens, m.num_experts, m.top_k, m.d_model
    tb, te = divmod(T, n)
    toks_i = [tb + (1 if i < te else 0) for i in range(n)]  # the layer's micro-batch bounds
    # each micro-op's rows: its share of the rank's rows (its tokens' k slots when T*k arrive)
    rows_i = [(rows * t) // T for t in toks_i] if T else [0] * n
    for i in range(rows - sum(rows_i)):
        rows_i[i % n] += 1
    router = 2 * T * E * 4 + T * K * (8 + 4) + T * 8
    combine = sum(t * K * (8 + 1 + 4 + d * es) for t in toks_i) + sum((r + 1) * 8 for r in rows_i)
    if memory_strategy is None:
        # GPT-OSS's clamped SwiGLU keeps five [R_i, f] tensors: the clamped gate, its sigmoid,
        # their product, the clamped up + 1 and the activation's output
        act = 5 * m.d_ffn if m.activation == "swiglu_oai" else 2 * m.d_ffn if m.gated else m.d_ffn
        per_row = d + m.n1 + act
        eb = {"device": rows * per_row * es, "held": rows * per_row * es, "host": 0}
    else:
        eb = expert_block_bytes(rows_i, d, m.n1, memory_strategy, es, mi_buffers)
    # the expert-parallel path and the managed block hold an expert output [R_i, d] per micro-op
    # until the backward (measured by the allocator test: the rows the combine reads); a managed
    # block frees the shared buffers it restores anyway until its backward starts ("held")
    experts = eb["held"] + (rows * d * es if expert_parallel or memory_strategy is not None else 0)
    return {"router": router, "combine": combine, "experts": experts, "host": eb["host"],
            "revive": eb["device"] - eb["held"], "total": router + combine + experts}


#: transformers models whose RMSNorm multiplies by its weight in fp32 and casts after
#: (``(weight * x).to(dtype)``): the normalized values it keeps are fp32
FP32_NORM_WEIGHT = ("gpt_oss",)


def _rmsnorm_bytes(width: int, es: int, *, feeds_linear: bool = True, storage: Optional[int] = None,
                   fp32_weight: bool = False) -> int:
    """Bytes one token keeps for transformers' RMSNorm over ``width`` values (``x.to(float32)``,
    ``x * rsqrt(mean(x^2) + eps)``, ``weight * normalized.to(dtype)``): its input in fp32 (the
    ``pow`` and the ``mul`` save it: in fp32 the input itself, the whole storage it is a view of,
    ``storage`` values; in a 16-bit dtype the fp32 upcast, ``width`` values), the fp32 reciprocal
    RMS (4 B), the normalized values in the compute dtype (the weight's ``mul`` saves them) and,
    where the output feeds a linear layer (``feeds_linear``), the output the linear saves.
    ``fp32_weight`` (:data:`FP32_NORM_WEIGHT`): the weight multiplies in fp32, so the normalized
    values are kept in fp32."""
    x = (storage if storage is not None else width) * 4 if es == 4 else width * 4
    return x + 4 + width * (4 if fp32_weight else es) + (width * es if feeds_linear else 0)


def attention_layer_saved_bytes(m: ModelSpec, dtype: torch.dtype = torch.bfloat16, seq_len: int = 1,
                                attn_implementation: str = "sdpa") -> int:
    """Bytes one token keeps for backward in one decoder layer's attention half and norms, as
    transformers' modules save them (read from their code, checked against the allocator by
    ``tests/test_plan_activation_memory.py``):

    * the input RMSNorm and the post-attention RMSNorm (:func:`_rmsnorm_bytes`: fp32 input,
      reciprocal RMS, normalized values, and the output the q/k/v projections, or the router and
      the MLP, save); the residual adds save nothing;
    * QK norms (Qwen3's per head, OLMoE's over all heads): their fp32 input, one reciprocal RMS
      per head (or per token) and the normalized values; their output goes to the rotary
      embedding, whose multiplications save only cos and sin (per model, not per layer);
    * ``sdpa`` (FlashAttention / memory-efficient attention on a GPU, the flash kernel on CPU):
      the rotated q [H x head_dim], k and v [H_kv x head_dim] (grouped-query: ``enable_gqa``, no
      repeated heads, as transformers calls it without a padding mask), the output [H x head_dim]
      (also the output projection's input: one storage) and the fp32 log-sum-exp per head;
    * ``eager``: q, k and v after ``repeat_kv`` (H heads each), the fp32 softmax probabilities
      [H x seq_len] per token (and, in a 16-bit dtype, their cast copy that the ``probs @ v``
      matmul saves), and the output's contiguous copy the output projection saves; with
      attention sinks (GPT-OSS, whose transformers model has no ``sdpa``: "sdpa" then stands
      for a FlashAttention kernel with sinks) the softmax runs in the compute dtype over one
      more column, and its row max keeps an int64 index;
    * MLA (DeepSeek): the query LoRA's norm (input, reciprocal RMS, normalized, output saved by
      ``q_b_proj``), the KV latent projection's output whole (in fp32 the norm saves a view of
      it; in 16-bit its fp32 upcast of the latent part), the latent norm, the up-projection's
      output [H x (qk_nope + v)] (v is a view of it), q and k concatenated [H x (qk_nope +
      qk_rope)] each, then attention as above.

    Assumes transformers' own Python modules (no fused RMSNorm / RoPE kernels from the kernels
    hub or Liger), ``use_cache=False``, no dropout, no padding mask."""
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={attn_implementation!r}"
                         f"{did_you_mean(str(attn_implementation), ATTN_IMPLEMENTATIONS)}; use one of "
                         f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    es = _itemsize(dtype)
    d, H = m.d_model, m.n_heads
    b = 2 * _rmsnorm_bytes(d, es, fp32_weight=m.model_type in FP32_NORM_WEIGHT)
    if m.mla:
        qk, vh = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        r = m.kv_lora_rank
        if m.q_lora_rank:
            b += _rmsnorm_bytes(m.q_lora_rank, es)
        b += _rmsnorm_bytes(r, es, storage=r + m.qk_rope_head_dim)
        b += H * (m.qk_nope_head_dim + vh) * es  # kv_b_proj's output: v is a view of it
        q, k, o, kv_heads = H * qk, H * qk, H * vh, H
        v = 0  # counted in kv_b_proj's output
    else:
        hd, kv_heads = m.head_dim, m.n_kv_heads
        q, k, v, o = H * hd, kv_heads * hd, kv_heads * hd, H * hd
        if m.qk_norm == "head":
            b += _rmsnorm_bytes(q, es, feeds_linear=False) + 4 * (H - 1)
            b += _rmsnorm_bytes(k, es, feeds_linear=False) + 4 * (kv_heads - 1)
        elif m.qk_norm == "full":
            b += _rmsnorm_bytes(q, es, feeds_linear=False) + _rmsnorm_bytes(k, es, feeds_linear=False)
    if attn_implementation == "sdpa":
        b += (q + k + v + o) * es + 4 * H
    else:
        rep = H // kv_heads if not m.mla else 1  # repeat_kv copies k and v to H heads
        k_e = k * rep
        v_e = (v * rep) if not m.mla else 0
        if m.attention_sinks:
            # GPT-OSS: the softmax in the compute dtype over one more column (the sink), the
            # probabilities' view saved by the matmul, and the row max's int64 index
            probs = H * (seq_len + 1) * es + 8 * H
        else:
            probs = H * seq_len * (4 + (es if es != 4 else 0))
        b += (q + k_e + v_e + o) * es + probs
    return b


def model_saved_bytes(m: ModelSpec, tokens: int, seq_len: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the model keeps once (not per layer): the embedding's int64 ids, the rotary
    embedding's cos and sin ([seq_len, rope dims] each: the positions of one sequence, broadcast
    over the batch) and the final RMSNorm (its output is the LM head's saved input)."""
    es = _itemsize(dtype)
    rope = m.qk_rope_head_dim if m.mla else m.head_dim
    return tokens * 8 + 2 * seq_len * rope * es + tokens * _rmsnorm_bytes(m.d_model, es,
                                                                          fp32_weight=m.model_type in FP32_NORM_WEIGHT)


def dense_mlp_saved_elements(m: ModelSpec) -> int:
    """Elements a token keeps in one dense (gated) MLP: the gate and up outputs, the activation's
    output and the down projection's input (its input is the norm output, counted above)."""
    f = m.dense_d_ffn
    return 4 * f if m.gated else 2 * f


def _routed_rows(m: ModelSpec, tokens: int, capacity_factor: Optional[float], imbalance: float) -> int:
    """Rows the most loaded rank's experts receive for ``tokens`` tokens per rank: T * k under
    balanced routing (every rank sends T * k rows; a rank receives as many on average) times
    ``imbalance`` (assumed), at most ``capacity_factor * T * k`` with a capacity (the layer drops
    the slots past each expert's capacity and pads nothing: a capacity caps the rows, it does not
    add any)."""
    ratio = imbalance if capacity_factor is None else min(imbalance, capacity_factor)
    return int(math.ceil(ratio * tokens * m.top_k))


def _check_inputs(model, world_size, ep_size, tokens_per_gpu, seq_len, setup, memory_strategy, pipeline_degree,
                  capacity_factor, routing_imbalance) -> ModelSpec:
    m = get_model(model)
    _pos_int("world_size", world_size)
    _pos_int("ep_size", ep_size)
    if isinstance(tokens_per_gpu, bool) or not isinstance(tokens_per_gpu, numbers.Integral):
        raise TypeError(f"tokens_per_gpu must be an int, got {type(tokens_per_gpu).__name__} {tokens_per_gpu!r}")
    if tokens_per_gpu <= 0:
        raise ValueError(f"tokens_per_gpu={tokens_per_gpu} must be > 0 (the tokens one GPU runs per micro-batch)")
    _pos_int("seq_len", seq_len)
    if not isinstance(setup, TrainingSetup):
        raise TypeError(f"setup must be a TrainingSetup, got {type(setup).__name__}")
    if memory_strategy is not None and memory_strategy not in STRATEGIES:
        raise ValueError(f"memory_strategy={memory_strategy!r}{did_you_mean(str(memory_strategy), STRATEGIES)}; "
                         f"use one of {', '.join(STRATEGIES)}")
    _pos_int("pipeline_degree", pipeline_degree)
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
                                        or not capacity_factor > 0):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a positive number or None (dropless)")
    if not (isinstance(routing_imbalance, numbers.Real) and routing_imbalance >= 1):
        raise ValueError(f"routing_imbalance={routing_imbalance!r} must be >= 1 (the most loaded rank's rows over "
                         "the mean)")
    return m


def memory_per_gpu(model: Any, *, world_size: int, ep_size: int, tokens_per_gpu: int, seq_len: int,
                   setup: TrainingSetup = TrainingSetup(), memory_strategy: str = "keep", pipeline_degree: int = 1,
                   capacity_factor: Optional[float] = None, expert_replicas: Optional[int] = None,
                   routing_imbalance: float = 1.0, mi_buffers: int = 1, mp_size: int = 1,
                   parm_schedule: str = "s1", attn_implementation: str = "sdpa") -> MemoryEstimate:
    """Device bytes per GPU of ``model`` (a :class:`ModelSpec` or anything
    :func:`~tritonmoe.plan.models.get_model` takes) on ``world_size`` GPUs with expert-parallel
    groups of ``ep_size`` (DP = world_size / ep_size), ``tokens_per_gpu`` tokens per micro-batch
    on every GPU in sequences of ``seq_len``.

    Args:
        setup: the :class:`TrainingSetup` (optimizer, dtypes, ZeRO-1, checkpointing).
        memory_strategy, pipeline_degree, mi_buffers: the MoE layers' memory strategy (None: the
            layer's default unmanaged path)
            (:data:`~tritonmoe.comm.programs.memory_reuse.STRATEGIES`) and micro-op count.
        capacity_factor: None (dropless) or the expert capacity factor.
        expert_replicas: copies of each expert when serving with E not divisible by ep_size
            (default: the fewest that place evenly).
        routing_imbalance: the most loaded rank's received rows over the balanced T*k (assumed;
            1.0: balanced).
        mp_size, parm_schedule: Parm's layout (:mod:`tritonmoe.experts.model_parallel`): the
            dense part tensor-parallel over MP groups of ``mp_size`` GPUs and every expert sharded
            over them (n_esp = n_mp = mp_size, ESP-inner), DP = world_size / (ep_size * mp_size);
            ``parm_schedule`` ("baseline", "s1", "s2") sets the MoE activations. With
            ``mp_size > 1``: the routed experts' weights, gradients and optimizer state divide by
            MP (each GPU holds a 1/MP slice of the hidden units of E/EP experts); so do the
            dense part's (Megatron: attention, dense MLPs, shared experts, embedding and LM head
            split over MP; norms and routers replicated); the attention / dense activations are
            those of ``tokens_per_gpu`` tokens (assumed: Megatron tensor + sequence parallelism
            over the MP group's batch of ``tokens_per_gpu * mp_size`` tokens); the MoE layers hold
            what Parm's path holds: the router on the rank's tokens (S1: its 1/MP slice,
            ``tokens_per_gpu``; S2 and the baseline: the whole batch), and the expert block on
            the rows Dump delivers, each row once per shard (S1/S2: ``mp_size`` x T*k rows of the
            shard's width d_ffn/MP; the baseline: every MP rank processes its copy, ``mp_size``
            times more). Parm's path runs the layer's default expert block (``memory_strategy``
            must be None, ``pipeline_degree`` 1).
        attn_implementation: transformers' attention the activations assume: "sdpa" (its default:
            FlashAttention-like, q, k, v, the output and the log-sum-exp kept) or "eager" (the
            [heads, seq_len, seq_len] softmax probabilities kept too).

    Raises:
        ValueError / TypeError naming the value and the fix (unknown model, ep_size not dividing
        world_size or E, tokens <= 0, ...)."""
    m = _check_inputs(model, world_size, ep_size, tokens_per_gpu, seq_len, setup, memory_strategy, pipeline_degree,
                      capacity_factor, routing_imbalance)
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={attn_implementation!r}"
                         f"{did_you_mean(str(attn_implementation), ATTN_IMPLEMENTATIONS)}; use one of "
                         f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    S = setup
    training = S.training
    mp = _check_mp(m, world_size, ep_size, mp_size, parm_schedule, memory_strategy, pipeline_degree)
    local, replicas = _experts_per_rank(m, world_size // mp, ep_size, training, expert_replicas)
    dp = world_size // (ep_size * mp)
    parts = m.params_by_part()
    per_expert = m.expert_params_per_layer() // m.num_experts
    expert_params = math.ceil(m.moe_layers * local * per_expert / mp)
    dense_params = m.total_params() - parts["routed_experts"]
    if mp > 1:
        replicated = parts["norms"] + parts["router"]
        dense_params = replicated + math.ceil((dense_params - replicated) / mp)
    pe = _itemsize(S.param_dtype)
    rows: list = [
        MemoryRow("weights: dense (replicated)" if mp == 1 else f"weights: dense (tensor-parallel over MP={mp})",
                  dense_params * pe, "exact",
                  f"{dense_params / 1e9:.3f}B params x {pe} B"),
        MemoryRow("weights: routed experts", expert_params * pe, "exact",
                  f"{local} of {m.num_experts} experts x {m.moe_layers} MoE layers"
                  + (f" ({replicas} replicas of each)" if replicas > 1 else "")
                  + (f", a 1/{mp} shard of each (Parm's ESP over the MP group)" if mp > 1 else "")),
    ]
    assumptions = []
    if training:
        ge = _itemsize(S.grad_dtype or S.param_dtype)
        rows.append(MemoryRow("gradients", (dense_params + expert_params) * ge, "exact",
                              f"{ge} B per parameter"))
        # ZeRO-1: a parameter's optimizer state (and master copy) is split over its DP group
        shard_dense = world_size // mp if S.shard_optimizer else 1
        shard_exp = dp if S.shard_optimizer else 1
        owned = math.ceil(dense_params / shard_dense) + math.ceil(expert_params / shard_exp)
        shard_note = f", sharded over DP (dense / {shard_dense}, experts / {shard_exp})" if S.shard_optimizer else ""
        if S.keeps_master_copy:
            rows.append(MemoryRow("fp32 master weights", owned * 4, "exact", "4 B per parameter" + shard_note))
        se = _itemsize(S.state_dtype)
        k = S.optimizer_states
        steps = m.param_tensors() * 4 if S.optimizer == "adam" else 0
        what = "Adam's two moments" if S.optimizer == "adam" else "SGD's momentum"
        rows.append(MemoryRow(f"optimizer state ({S.optimizer})", owned * k * se + steps, "exact",
                              f"{what} x {se} B" + (" + a 4 B step per tensor" if steps else "") + shard_note))
    rows.extend(_activation_rows(m, S, tokens_per_gpu, seq_len, memory_strategy, pipeline_degree, capacity_factor,
                                 routing_imbalance, mi_buffers, ep_size, (mp, parm_schedule), attn_implementation))
    host = rows.pop()  # _activation_rows returns the host bytes last
    R = _routed_rows(m, tokens_per_gpu, capacity_factor, routing_imbalance)
    assumptions.append(f"routing: the most loaded rank's experts receive {R} rows per MoE layer "
                       f"({routing_imbalance:g} x T*k" + (f", capacity factor {capacity_factor:g}" if capacity_factor
                                                          else ", dropless") + ")")
    if mp > 1:
        assumptions.append(f"Parm layout: dense part tensor-parallel and experts sharded over MP={mp} (Megatron tensor "
                           f"+ sequence parallelism for the dense activations), schedule {parm_schedule!r}")
    params = dict(world_size=world_size, ep_size=ep_size, tokens_per_gpu=tokens_per_gpu, seq_len=seq_len,
                  memory_strategy=memory_strategy, pipeline_degree=pipeline_degree, capacity_factor=capacity_factor,
                  expert_replicas=expert_replicas, routing_imbalance=routing_imbalance, mi_buffers=mi_buffers,
                  attn_implementation=attn_implementation)
    if mp > 1:
        params.update(mp_size=mp, parm_schedule=parm_schedule)
    return MemoryEstimate(tuple(rows), m, S, params, host, tuple(a for a in assumptions if a))


def _check_mp(m: ModelSpec, world: int, ep: int, mp: Any, schedule: Any, strategy: Any, n: int) -> int:
    """``mp_size`` checked against the layout (see :func:`memory_per_gpu`)."""
    mp = _pos_int("mp_size", mp)
    if mp == 1:
        return 1
    if world % (ep * mp):
        raise ValueError(f"mp_size={mp} x ep_size={ep} does not divide world_size={world}; use mp_size in "
                         f"{[d for d in _divisors(world // ep) if d > 1] or [1]} (EP x MP x DP = world_size)")
    if m.d_ffn % mp:
        raise ValueError(f"mp_size={mp} does not divide d_ffn={m.d_ffn}: Parm shards each expert's hidden units over "
                         f"the MP group; use an mp_size dividing {m.d_ffn}")
    if schedule not in ("baseline", "s1", "s2"):
        raise ValueError(f"parm_schedule={schedule!r}; use 'baseline', 's1' or 's2'")
    if strategy is not None or n != 1:
        raise ValueError(f"memory_strategy={strategy!r}, pipeline_degree={n} with mp_size={mp}: Parm's path runs the "
                         "layer's default expert block; pass memory_strategy=None and pipeline_degree=1")
    return mp


def _parm_moe_bytes(m: ModelSpec, S, T: int, R: int, mp: int, schedule: str) -> dict:
    """What one Parm MoE layer keeps on a GPU (see :func:`memory_per_gpu`, ``mp_size``)."""
    shard = replace(m, d_ffn=m.d_ffn // mp)
    toks = T if schedule == "s1" else T * mp
    rows = R * mp * (mp if schedule == "baseline" else 1)
    return moe_layer_saved_bytes(shard, toks, rows, memory_strategy=None, pipeline_degree=1, dtype=S.param_dtype,
                                 expert_parallel=True)


def _activation_rows(m, S, T, seq_len, strategy, n, capacity_factor, imbalance, mi_buffers, ep,
                     parm: tuple = (1, "s1"), attn: str = "sdpa") -> list:
    """The activation rows (and, last, the host bytes as a bare int)."""
    es = _itemsize(S.param_dtype)
    V = m.vocab_size
    if not S.training:
        # serving: no activation kept across layers; the KV cache of the context, and one MoE
        # layer's working set (its permuted rows, MI, the activation's output, the expert output)
        if m.mla:
            kv = m.kv_lora_rank + m.qk_rope_head_dim
        else:
            kv = 2 * m.n_kv_heads * m.head_dim
        R = _routed_rows(m, T, capacity_factor, imbalance)
        work = (R * (m.d_model + m.n1 + m.d_ffn + m.d_model) + T * m.d_model * 3) * es + T * m.num_experts * 4
        return [MemoryRow("KV cache", m.num_layers * T * kv * es, "exact",
                          f"{T} context tokens x {m.num_layers} layers x {kv} values"),
                MemoryRow("activations: one layer's working set", work, "formula",
                          "permuted rows, MI, activation and expert outputs of one MoE layer"),
                MemoryRow("logits", T * V * es, "formula", f"[{T}, {V}]"),
                0]
    rows = []
    per_layer_attn = T * attention_layer_saved_bytes(m, S.param_dtype, seq_len, attn)
    dense = m.dense_layers and T * dense_mlp_saved_elements(m) * es
    once = model_saved_bytes(m, T, seq_len, S.param_dtype)
    if S.activation_checkpointing:
        # each layer keeps its input; backward rebuilds one layer's attention block at a time
        attn_b = m.num_layers * T * m.d_model * es + per_layer_attn + dense + once
        note = "checkpointed: each layer's input + one layer rebuilt (Korthikanti et al. 2022)"
    else:
        attn_b = m.num_layers * per_layer_attn + m.dense_layers * dense + once
        note = (f"transformers' modules, attn_implementation={attn!r}: {per_layer_attn // T} B/token/layer "
                "(norms, q/k/v, output" + (", softmax probabilities" if attn == "eager" else ", log-sum-exp") + ")")
    rows.append(MemoryRow("activations: attention + dense MLPs", attn_b, "formula", note))
    R = _routed_rows(m, T, capacity_factor, imbalance)
    mp, sched = parm
    if mp > 1:
        moe = _parm_moe_bytes(m, S, T, R, mp, sched)
        note = (f"Parm {sched!r} over MP={mp}: {R * mp * (mp if sched == 'baseline' else 1)} rows of the 1/{mp} "
                "expert shard per layer (router, combine, expert block)")
    else:
        moe = moe_layer_saved_bytes(m, T, R, memory_strategy=strategy, pipeline_degree=n, dtype=S.param_dtype,
                                    mi_buffers=mi_buffers, expert_parallel=ep > 1)
        note = (f"memory_strategy={strategy!r}, pipeline_degree={n}: {R} rows per layer "
                "(tritonmoe's layer: router, combine, expert block)")
    # a shared expert: a dense gated MLP's four [F] tensors (tensor-parallel: 1/MP of them);
    # Qwen2-MoE's sigmoid gate on it keeps the shared output [d] and the gate [1] (their product
    # saves both)
    shared = T * (4 * m.n_shared_experts * m.shared_d_ffn // mp + (m.d_model + 1 if m.shared_expert_gate else 0)) \
        * es if m.n_shared_experts else 0
    rows.append(MemoryRow("activations: MoE layers", m.moe_layers * (moe["total"] + shared), "formula", note))
    if moe.get("revive"):
        rows.append(MemoryRow("activations: one MoE block's backward", moe["revive"], "formula",
                              "the shared DI/MI buffers a memory strategy frees between forward and backward, "
                              "re-allocated while one layer's backward runs"))
    # logits in the compute dtype and the fp32 log-softmax cross-entropy keeps
    # the logits in the compute dtype (the model's output holds them), the fp32 log-softmax the
    # cross-entropy saves, and its int64 labels
    rows.append(MemoryRow("activations: logits + loss", T * V * (es + 4) + T * 8, "formula",
                          f"[{T}, {V}] logits and their fp32 log-softmax"))
    rows.append(m.moe_layers * moe["host"])
    return rows


# ---------------------------------------------------------------------------------------------
# What would fit
# ---------------------------------------------------------------------------------------------


def _variants(est: MemoryEstimate) -> list:
    """(description, setup, params) of every single change that may save memory."""
    m, S, p = est.model, est.setup, dict(est.params)
    world, ep = p["world_size"], p["ep_size"]
    out = []
    if S.training and S.optimizer != "none":
        mp = p.get("mp_size", 1)
        if not S.shard_optimizer and world > mp:
            out.append((f"sharding the optimizer state over data parallelism (ZeRO-1: dense over {world // mp} GPUs, "
                        f"experts over DP={world // (ep * mp)})", replace(S, shard_optimizer=True), p))
        if not S.activation_checkpointing:
            out.append(("activation checkpointing of the attention / dense part", replace(S, activation_checkpointing=True),
                        p))
        if S.keeps_master_copy:
            out.append((f"no fp32 master weights (optimizer state in {str(S.param_dtype).replace('torch.', '')}; "
                         "changes the numerics)", replace(S, master_weights=False), p))
        best = None
        for s in (STRATEGIES[1:] if p.get("mp_size", 1) == 1 else ()):  # Parm's path: the default block
            for n in (2, 4, 8):
                if n > p["tokens_per_gpu"] or (s, n) == (p["memory_strategy"], p["pipeline_degree"]):
                    continue
                q = dict(p, memory_strategy=s, pipeline_degree=n)
                x = memory_per_gpu(m, setup=S, **q)
                b = (x.total_bytes, x.host_bytes)  # equal device bytes: the one keeping least on the host
                if best is None or b < best[0]:
                    best = (b, s, n, q)
        if best is not None:
            out.append((f"memory_strategy={best[1]!r} with pipeline_degree={best[2]} (MPMoE's buffer reuse; every "
                        "reuse strategy keeps the same device buffers)", S, best[3]))
    for e in _divisors(world):
        if e > ep and (not S.training and p.get("expert_replicas") is None or m.num_experts % e == 0):
            out.append((f"ep_size {e} instead of {ep} (DP {world // e})", S, dict(p, ep_size=e, expert_replicas=None)))
            break
    if p["tokens_per_gpu"] >= 2:
        t = p["tokens_per_gpu"] // 2
        out.append((f"tokens_per_gpu {t} instead of {p['tokens_per_gpu']} (two gradient-accumulation steps)"
                    if S.training else f"tokens_per_gpu {t} instead of {p['tokens_per_gpu']}", S,
                    dict(p, tokens_per_gpu=t)))
    return out


def _alternatives(est: MemoryEstimate, cap: int) -> list:
    found = []
    total = est.total_bytes
    for desc, S, p in _variants(est):
        try:
            new = memory_per_gpu(est.model, setup=S, **p)
        except ValueError:
            continue
        saved = total - new.total_bytes
        if saved <= 0:
            continue
        verdict = "fits" if new.fits(cap) else f"still {new.shortfall(cap) / GiB:.1f} GiB short"
        found.append((saved, f"{desc} saves {saved / GiB:.1f} GiB ({new.total_bytes / GiB:.1f} GiB: {verdict})"))
    found.sort(key=lambda x: -x[0])
    if len(found) > 1 and not est.fits(cap):
        # everything but the numerics-changing and the batch-changing ones, together
        S, p = est.setup, dict(est.params)
        if S.training:
            S = replace(S, shard_optimizer=S.shard_optimizer or p["world_size"] > 1, activation_checkpointing=True)
        for desc, S2, p2 in _variants(est):
            if desc.startswith("memory_strategy=") or desc.startswith("ep_size"):
                p.update({k: p2[k] for k in ("memory_strategy", "pipeline_degree", "ep_size", "expert_replicas")
                          if p2[k] != est.params[k]})
        try:
            new = memory_per_gpu(est.model, setup=S, **p)
        except ValueError:
            return found
        saved = est.total_bytes - new.total_bytes
        verdict = "fits" if new.fits(cap) else f"still {new.shortfall(cap) / GiB:.1f} GiB short"
        what = []
        if S.shard_optimizer != est.setup.shard_optimizer:
            what.append("ZeRO-1")
        if S.activation_checkpointing != est.setup.activation_checkpointing:
            what.append("checkpointing")
        if p["memory_strategy"] != est.params["memory_strategy"] or p["pipeline_degree"] != est.params["pipeline_degree"]:
            what.append(f"memory_strategy={p['memory_strategy']!r} at pipeline_degree={p['pipeline_degree']}")
        if p["ep_size"] != est.params["ep_size"]:
            what.append(f"ep_size {p['ep_size']}")
        if len(what) > 1:
            found.append((saved, f"together ({', '.join(what)}) they save {saved / GiB:.1f} GiB "
                                 f"({new.total_bytes / GiB:.1f} GiB: {verdict})"))
    return found
