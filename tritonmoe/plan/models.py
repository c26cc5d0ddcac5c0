"""Model shapes for the sizing planner: :class:`ModelSpec`, published presets, and transformers
configs read into the same description.

A :class:`ModelSpec` holds what the planner needs of a decoder-only MoE transformer: how many
decoder layers and how many of them are MoE, the widths of attention (grouped-query or
DeepSeek's multi-head latent attention, MLA), of the routed experts, the shared experts and the
dense MLPs, the vocabulary, and the small parameters that transformers' modules hold (biases,
attention sinks, QK norms, the shared-expert gate, DeepSeek-V3's selection bias).
:meth:`ModelSpec.params_by_part` counts parameters EXACTLY from those shapes: the counts equal
``sum(p.numel() for p in model.parameters())`` of the transformers model built from the same
config (``tests/test_plan_models.py`` checks every preset's structure at a tiny width, and each
architecture of :data:`tritonmoe.hf_archs.ARCHITECTURES` the planner reads).

:data:`MODEL_PRESETS` hold the published Hugging Face configs (``config.json`` of the repository
named in each spec's ``source``) of the models ``docs/hf.md`` lists as swapping exactly; their
totals agree with the published parameter counts (Mixtral-8x7B 46.7B, Qwen3-30B-A3B 30.5B,
DeepSeek-V3 671B (without its multi-token-prediction module), ...).

:func:`get_model` takes a preset name, a transformers ``PretrainedConfig``, a dict (a
``config.json``'s content) or a path to a ``config.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from tritonmoe.core.suggest import did_you_mean

__all__ = ["ModelSpec", "MODEL_PRESETS", "HF_PRESET_CONFIGS", "get_model", "spec_from_hf_config",
           "READABLE_MODEL_TYPES"]

#: activations whose expert FFN is gated (gate and up projections: three matrices per expert)
GATED = ("swiglu", "swiglu_oai", "geglu")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only MoE transformer's shapes (see the module docstring).

    Attributes:
        name: a label.
        num_layers: decoder layers in total; ``moe_layers`` of them are MoE, the rest dense
            (``dense_d_ffn`` wide).
        d_model: the hidden width; ``d_ffn``: each routed expert's intermediate width.
        num_experts, top_k: routed experts and experts chosen per token.
        n_shared_experts, shared_d_ffn: shared experts (always active) and each one's width
            (transformers builds them as one MLP of ``n_shared_experts * shared_d_ffn``).
        vocab_size, tie_embeddings: the vocabulary and whether the LM head is the embedding.
        n_heads, n_kv_heads, head_dim: grouped-query attention (ignored for MLA but n_heads).
        activation: the expert activation ("swiglu", "swiglu_oai" (GPT-OSS), "gelu", ...).
        q_lora_rank, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim: DeepSeek's
            MLA (``kv_lora_rank`` set: MLA; ``q_lora_rank`` None: a full-rank query projection).
        qkv_bias, o_bias: biases of the q/k/v projections and of the output projection.
        qk_norm: "none", "head" (RMSNorm over head_dim: Qwen3) or "full" (over all heads: OLMoE).
        attention_sinks: one learned sink logit per head (GPT-OSS).
        expert_bias: per-expert biases of both expert GEMMs (GPT-OSS); ``router_bias``: the
            router's bias; ``router_selection_bias``: DeepSeek-V3's ``e_score_correction_bias``
            (a buffer in transformers 5: not counted among the parameters).
        shared_expert_gate: Qwen2-MoE's sigmoid gate [1, d] on the shared expert.
        model_type: the transformers model type; ``source``: where the numbers come from.
    """

    name: str
    num_layers: int
    moe_layers: int
    d_model: int
    d_ffn: int
    num_experts: int
    top_k: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_shared_experts: int = 0
    shared_d_ffn: int = 0
    dense_d_ffn: int = 0
    tie_embeddings: bool = False
    activation: str = "swiglu"
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"
    attention_sinks: bool = False
    expert_bias: bool = False
    router_bias: bool = False
    router_selection_bias: bool = False
    shared_expert_gate: bool = False
    model_type: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("num_layers", "d_model", "d_ffn", "num_experts", "top_k", "vocab_size", "n_heads", "n_kv_heads",
                  "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelSpec {self.name!r}: {f} must be a positive int, got {v!r}")
        for f in ("moe_layers", "n_shared_experts", "shared_d_ffn", "dense_d_ffn", "qk_rope_head_dim",
                  "qk_nope_head_dim", "v_head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ModelSpec {self.name!r}: {f} must be a non-negative int, got {v!r}")
        if self.moe_layers > self.num_layers:
            raise ValueError(f"ModelSpec {self.name!r}: moe_layers={self.moe_layers} > num_layers={self.num_layers}")
        if self.moe_layers < self.num_layers and self.dense_d_ffn < 1:
            raise ValueError(f"ModelSpec {self.name!r}: {self.num_layers - self.moe_layers} dense layers need "
                             "dense_d_ffn >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelSpec {self.name!r}: top_k={self.top_k} > num_experts={self.num_experts}")
        if self.qk_norm not in ("none", "head", "full"):
            raise ValueError(f"ModelSpec {self.name!r}: qk_norm={self.qk_norm!r}; use 'none', 'head' or 'full'")
        if self.kv_lora_rank is not None and not (self.qk_nope_head_dim + self.qk_rope_head_dim > 0
                                                  and self.v_head_dim > 0):
            raise ValueError(f"ModelSpec {self.name!r}: MLA (kv_lora_rank={self.kv_lora_rank}) needs "
                             "qk_nope_head_dim + qk_rope_head_dim > 0 and v_head_dim > 0")

    # -- shapes ---------------------------------------------------------------------------------

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    @property
    def n1(self) -> int:
        """The first expert GEMM's output width (2 * d_ffn for gated activations)."""
        return 2 * self.d_ffn if self.gated else self.d_ffn

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    def _mlp(self, width: int) -> int:
        return (3 if self.gated else 2) * self.d_model * width

    def expert_params_per_layer(self) -> int:
        """The routed experts' parameters of one MoE layer (all E experts)."""
        per = self._mlp(self.d_ffn) + (self.n1 + self.d_model if self.expert_bias else 0)
        return self.num_experts * per

    def attention_params_per_layer(self) -> int:
        """One layer's attention projections (biases and sinks included; its norms are in
        ``norms``)."""
        d, H = self.d_model, self.n_heads
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = d * H * qk if self.q_lora_rank is None else d * self.q_lora_rank + self.q_lora_rank * H * qk
            kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * H * (
                self.qk_nope_head_dim + self.v_head_dim)
            o = H * self.v_head_dim * d
            n = q + kv + o
            q_out, kv_out = H * qk, 0
        else:
            q_out, kv_out = H * self.head_dim, self.n_kv_heads * self.head_dim
            n = d * q_out + 2 * d * kv_out + q_out * d
        if self.qkv_bias:
            n += q_out + (2 * kv_out if not self.mla else self.kv_lora_rank + self.qk_rope_head_dim)
        if self.o_bias:
            n += d
        if self.attention_sinks:
            n += H
        return n

    def norm_params_per_layer(self) -> int:
        n = 2 * self.d_model
        if self.qk_norm == "head":
            n += 2 * self.head_dim
        elif self.qk_norm == "full":
            n += (self.n_heads + self.n_kv_heads) * self.head_dim
        if self.mla:
            n += self.kv_lora_rank + (self.q_lora_rank or 0)
        return n

    def router_params_per_layer(self) -> int:
        E = self.num_experts
        # DeepSeek-V3's selection bias (e_score_correction_bias) is a buffer in transformers 5,
        # not a parameter: it takes no gradient and no optimizer state, so it is not counted here
        return E * self.d_model + (E if self.router_bias else 0)

    def shared_params_per_layer(self) -> int:
        if not self.n_shared_experts:
            return 0
        return self._mlp(self.n_shared_experts * self.shared_d_ffn) + (self.d_model if self.shared_expert_gate else 0)

    def params_by_part(self) -> dict:
        """Exact parameter counts: embedding, attention, dense_mlp, router, routed_experts,
        shared_experts, norms (every RMSNorm, the final one included), lm_head (0 when tied)."""
        L, M = self.num_layers, self.moe_layers
        emb = self.vocab_size * self.d_model
        return {
            "embedding": emb,
            "attention": L * self.attention_params_per_layer(),
            "dense_mlp": self.dense_layers * self._mlp(self.dense_d_ffn),
            "router": M * self.router_params_per_layer(),
            "routed_experts": M * self.expert_params_per_layer(),
            "shared_experts": M * self.shared_params_per_layer(),
            "norms": L * self.norm_params_per_layer() + self.d_model,
            "lm_head": 0 if self.tie_embeddings else emb,
        }

    def param_tensors(self) -> int:
        """How many parameter tensors the transformers model holds (its fused experts: one
        gate-up and one down tensor per MoE layer, plus their biases): torch.optim keeps one
        ``step`` counter per tensor."""
        if self.mla:
            attn = (1 if self.q_lora_rank is None else 2) + 3
        else:
            attn = 4 + (3 if self.qkv_bias else 0)
        attn += int(self.o_bias) + int(self.attention_sinks)
        norms = 2 + (2 if self.qk_norm != "none" else 0) + (int(self.mla) + int(self.q_lora_rank is not None))
        mlp = 3 if self.gated else 2
        moe = 1 + int(self.router_bias) + 2 + (2 if self.expert_bias else 0)
        if self.n_shared_experts:
            # GraniteMoeShared fuses the shared expert's gate and up projections (input_linear)
            moe += (2 if self.model_type == "granitemoeshared" else mlp) + int(self.shared_expert_gate)
        return (self.num_layers * (attn + norms) + self.dense_layers * mlp + self.moe_layers * moe + 2
                + (0 if self.tie_embeddings else 1))

    def total_params(self) -> int:
        return sum(self.params_by_part().values())

    def active_params_per_token(self) -> int:
        """Parameters one token uses: everything but the routed experts it does not choose
        (embedding and LM head included, as the published "active" counts do)."""
        idle = self.moe_layers * (self.num_experts - self.top_k) * (self.expert_params_per_layer() // self.num_experts)
        return self.total_params() - idle

    def with_(self, **changes: Any) -> "ModelSpec":
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# transformers configs
# ---------------------------------------------------------------------------------------------

#: model types :func:`spec_from_hf_config` reads (the architectures docs/hf.md lists as swapping
#: whose shapes the planner knows)
READABLE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss",
                        "granitemoe", "granitemoeshared")


def _get(cfg: Mapping, *keys: str, default: Any = None) -> Any:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return default


def _as_dict(config: Any) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        d = to_dict()
        # attributes a config class sets in __init__ but does not serialize by default
        for k in ("head_dim", "model_type", "tie_word_embeddings"):
            if d.get(k) is None and getattr(config, k, None) is not None:
                d[k] = getattr(config, k)
        return d
    raise TypeError(f"expected a transformers PretrainedConfig, a dict or a config.json path, got "
                    f"{type(config).__name__}")


def _moe_layer_count(mt: str, c: Mapping, L: int) -> int:
    if mt in ("deepseek_v2", "deepseek_v3"):
        first = int(_get(c, "first_k_dense_replace", default=0))
        freq = int(_get(c, "moe_layer_freq", default=1))
        return sum(1 for i in range(L) if i >= first and i % freq == 0)
    if mt in ("qwen2_moe", "qwen3_moe"):
        only = set(_get(c, "mlp_only_layers", default=[]) or [])
        step = int(_get(c, "decoder_sparse_step", default=1))
        return sum(1 for i in range(L) if i not in only and (i + 1) % step == 0)
    return L


def spec_from_hf_config(config: Any, name: Optional[str] = None, source: Optional[str] = None) -> ModelSpec:
    """A :class:`ModelSpec` from a transformers config (object or ``config.json`` dict) of one of
    :data:`READABLE_MODEL_TYPES`, reading the keys transformers' modeling code reads."""
    c = _as_dict(config)
    mt = c.get("model_type")
    if mt not in READABLE_MODEL_TYPES:
        raise ValueError(f"model_type={mt!r} is not one the planner reads{did_you_mean(str(mt), READABLE_MODEL_TYPES)}; "
                         f"it reads {', '.join(READABLE_MODEL_TYPES)} (or build a ModelSpec by hand)")
    d = int(c["hidden_size"])
    L = int(c["num_hidden_layers"])
    H = int(c["num_attention_heads"])
    KV = int(_get(c, "num_key_value_heads", default=H))
    hd = int(_get(c, "head_dim", default=d // H))
    E = int(_get(c, "num_local_experts", "num_experts", "n_routed_experts"))
    K = int(_get(c, "num_experts_per_tok", "experts_per_token"))
    f = int(_get(c, "moe_intermediate_size", "intermediate_size"))
    M = _moe_layer_count(mt, c, L)
    kw: dict = dict(model_type=mt, tie_embeddings=bool(_get(c, "tie_word_embeddings", default=False)))
    if M < L:
        kw["dense_d_ffn"] = int(c["intermediate_size"])
    if mt in ("deepseek_v2", "deepseek_v3"):
        kw.update(q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=int(c["kv_lora_rank"]),
                  qk_rope_head_dim=int(c["qk_rope_head_dim"]), qk_nope_head_dim=int(c["qk_nope_head_dim"]),
                  v_head_dim=int(c["v_head_dim"]), qkv_bias=bool(_get(c, "attention_bias", default=False)),
                  o_bias=bool(_get(c, "attention_bias", default=False)),
                  n_shared_experts=int(_get(c, "n_shared_experts", default=0)), shared_d_ffn=f,
                  router_selection_bias=mt == "deepseek_v3")
    elif mt == "qwen2_moe":
        kw.update(qkv_bias=bool(_get(c, "qkv_bias", default=True)), n_shared_experts=1,
                  shared_d_ffn=int(c["shared_expert_intermediate_size"]), shared_expert_gate=True)
    elif mt == "qwen3_moe":
        kw.update(qkv_bias=bool(_get(c, "attention_bias", default=False)),
                  o_bias=bool(_get(c, "attention_bias", default=False)), qk_norm="head")
    elif mt == "olmoe":
        kw.update(qkv_bias=bool(_get(c, "attention_bias", default=False)),
                  o_bias=bool(_get(c, "attention_bias", default=False)), qk_norm="full")
    elif mt == "gpt_oss":
        kw.update(activation="swiglu_oai", qkv_bias=bool(_get(c, "attention_bias", default=True)),
                  o_bias=bool(_get(c, "attention_bias", default=True)), attention_sinks=True, expert_bias=True,
                  router_bias=True)
    elif mt == "granitemoeshared":
        shared = int(_get(c, "shared_intermediate_size", default=0))
        kw.update(n_shared_experts=1 if shared else 0, shared_d_ffn=shared)
    return ModelSpec(name=name or str(c.get("_name_or_path") or mt), num_layers=L, moe_layers=M, d_model=d, d_ffn=f,
                     num_experts=E, top_k=K, vocab_size=int(c["vocab_size"]), n_heads=H, n_kv_heads=KV, head_dim=hd,
                     source=source or f"transformers config (model_type {mt})", **kw)


# ---------------------------------------------------------------------------------------------
# Presets: the published config.json values (the keys that fix the shapes)
# ---------------------------------------------------------------------------------------------

_MIXTRAL = dict(model_type="mixtral", num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2)
_QWEN3 = dict(model_type="qwen3_moe", head_dim=128, vocab_size=151936, tie_word_embeddings=False, num_experts=128,
              num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False)
_GPT_OSS = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                num_key_value_heads=8, head_dim=64, vocab_size=201088, tie_word_embeddings=False, experts_per_token=4,
                num_experts_per_tok=4, attention_bias=True)
_DSV = dict(tie_word_embeddings=False, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512,
            moe_layer_freq=1, first_k_dense_replace=1, attention_bias=False)

#: preset name -> (Hugging Face repository, the shape keys of its config.json)
HF_PRESET_CONFIGS: dict[str, tuple[str, dict]] = {
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", dict(
        _MIXTRAL, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32)),
    "mixtral-8x22b": ("mistralai/Mixtral-8x22B-v0.1", dict(
        _MIXTRAL, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48)),
    "qwen2-57b-a14b": ("Qwen/Qwen2-57B-A14B", dict(
        model_type="qwen2_moe", hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
        shared_expert_intermediate_size=20480, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=151936, tie_word_embeddings=False, num_experts=64, num_experts_per_tok=8, decoder_sparse_step=1,
        mlp_only_layers=[])),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", dict(
        _QWEN3, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4)),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B", dict(
        _QWEN3, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4)),
    "olmoe-1b-7b": ("allenai/OLMoE-1B-7B-0924", dict(
        model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=50304, tie_word_embeddings=False, num_experts=64, num_experts_per_tok=8,
        attention_bias=False)),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", dict(
        _DSV, model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, vocab_size=102400, q_lora_rank=None,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6)),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", dict(
        _DSV, model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, q_lora_rank=1536,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3)),
    "gpt-oss-20b": ("openai/gpt-oss-20b", dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32)),
    "gpt-oss-120b": ("openai/gpt-oss-120b", dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128)),
    "granite-3.0-3b-a800m": ("ibm-granite/granite-3.0-3b-a800m-base", dict(
        model_type="granitemoe", hidden_size=1536, intermediate_size=512, num_hidden_layers=32, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=49155, tie_word_embeddings=True, num_local_experts=40,
        num_experts_per_tok=8)),
    "granite-3.0-1b-a400m": ("ibm-granite/granite-3.0-1b-a400m-base", dict(
        model_type="granitemoe", hidden_size=1024, intermediate_size=512, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=49155, tie_word_embeddings=True, num_local_experts=32,
        num_experts_per_tok=8)),
}

#: preset name -> ModelSpec (the published HF configs of :data:`HF_PRESET_CONFIGS`)
MODEL_PRESETS: dict[str, ModelSpec] = {
    name: spec_from_hf_config(cfg, name=name, source=f"preset {name} (HF config of {repo})")
    for name, (repo, cfg) in HF_PRESET_CONFIGS.items()
}


def _normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-").split("/")[-1]


def get_model(name_or_config: Any) -> ModelSpec:
    """A :class:`ModelSpec` from a preset name (case-insensitive; a HF repository name of a preset
    works too), a transformers ``PretrainedConfig``, a ``config.json`` dict, a path to a
    ``config.json`` (or to the folder holding one), or a ModelSpec (returned as is).

    Raises:
        ValueError: an unknown preset name (with the closest presets and the full list), an
            unreadable model type.
        TypeError: anything else.
    """
    x = name_or_config
    if isinstance(x, ModelSpec):
        return x
    if isinstance(x, os.PathLike) or (isinstance(x, str) and (x.endswith(".json") or os.path.isdir(x))):
        path = os.fspath(x)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no config.json at {path!r}; pass a preset name ({', '.join(MODEL_PRESETS)}) or the "
                             "path of a transformers config.json")
        with open(path) as fh:
            return spec_from_hf_config(json.load(fh), name=os.path.basename(os.path.dirname(os.path.abspath(path))),
                                       source=f"transformers config {path}")
    if isinstance(x, str):
        key = _normalize(x)
        for name, (repo, _) in HF_PRESET_CONFIGS.items():
            if key in (name, _normalize(repo)):
                return MODEL_PRESETS[name]
        raise ValueError(f"unknown model {x!r}{did_you_mean(key, MODEL_PRESETS)}; presets: "
                         f"{', '.join(MODEL_PRESETS)} (or pass a transformers config / config.json path)")
    if isinstance(x, Mapping) or callable(getattr(x, "to_dict", None)):
        return spec_from_hf_config(x)
    raise TypeError(f"get_model takes a preset name, a transformers config, a dict or a config.json path; got "
                    f"{type(x).__name__}")
