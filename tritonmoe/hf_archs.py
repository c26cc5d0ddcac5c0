"""The transformers MoE architectures tritonmoe.hf is tested against, as tiny random configs.

:data:`ARCHITECTURES` is the one registry behind both ``tests/test_hf_archs.py`` (every entry
is built from its config class, no downloads, and checked: a swap equal to the original model,
or the typed refusal) and the table of ``docs/hf.md`` (:func:`architecture_table`; a test
checks that the page holds exactly this table). ``expect`` is what the tests verify:
"swap" (:func:`tritonmoe.hf.apply` converts it exactly) or "refused" (:class:`HFConversionError`),
and ``registry`` whether :func:`tritonmoe.hf.use_experts_implementation` runs its experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["ArchCase", "ARCHITECTURES", "architecture_table", "build"]

D, F, E, K = 16, 8, 8, 2
_COMMON = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
               max_position_embeddings=64)


@dataclass(frozen=True)
class ArchCase:
    name: str  # transformers model type
    label: str
    config: str  # transformers config class
    model: str  # causal LM class
    kwargs: dict = field(default_factory=dict)
    expect: str = "swap"  # or "refused"
    registry: bool = True  # use_experts_implementation runs its experts
    why: str = ""  # what blocks a refused one (docs)
    fp64: bool = True  # the model runs in float64


ARCHITECTURES: tuple[ArchCase, ...] = (
    ArchCase("mixtral", "Mixtral", "MixtralConfig", "MixtralForCausalLM",
             dict(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, **_COMMON)),
    ArchCase("qwen2_moe", "Qwen2-MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
             dict(moe_intermediate_size=F, shared_expert_intermediate_size=12, num_experts=E, num_experts_per_tok=K,
                  norm_topk_prob=False, intermediate_size=20, **_COMMON)),
    ArchCase("qwen3_moe", "Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
             dict(moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
                  intermediate_size=20, head_dim=8, **_COMMON)),
    ArchCase("olmoe", "OLMoE", "OlmoeConfig", "OlmoeForCausalLM",
             dict(intermediate_size=F, num_experts=E, num_experts_per_tok=K, norm_topk_prob=False, **_COMMON)),
    ArchCase("deepseek_v3", "DeepSeek-V3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
             dict(moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=2, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                  intermediate_size=20, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=8, **_COMMON)),
    ArchCase("gpt_oss", "GPT-OSS", "GptOssConfig", "GptOssForCausalLM",
             dict(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, head_dim=8, swiglu_limit=0.8,
                  **_COMMON)),
    ArchCase("deepseek_v2", "DeepSeek-V2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
             dict(moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, n_group=4,
                  topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5, first_k_dense_replace=1,
                  intermediate_size=20, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=8, head_dim=4, **_COMMON)),
    ArchCase("granitemoe", "GraniteMoE", "GraniteMoeConfig", "GraniteMoeForCausalLM",
             dict(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, **_COMMON)),
    ArchCase("granitemoeshared", "GraniteMoeShared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
             dict(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, shared_intermediate_size=12,
                  **_COMMON)),
    ArchCase("phimoe", "PhiMoE", "PhimoeConfig", "PhimoeForCausalLM",
             dict(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, **_COMMON), expect="refused",
             why="SparseMixer routing (a masked, jittered softmax per slot) that tritonmoe's router does not implement"),
    ArchCase("llama4_text", "Llama 4", "Llama4TextConfig", "Llama4ForCausalLM",
             dict(intermediate_size=F, intermediate_size_mlp=20, num_local_experts=E, num_experts_per_tok=1,
                  head_dim=8, **_COMMON), expect="refused", registry=False,
             why="the router's sigmoid score scales each expert's input (not its output) and the experts run densely "
                 "over all E; its experts do not go through transformers' registry"),
    ArchCase("glm4_moe", "GLM-4-MoE", "Glm4MoeConfig", "Glm4MoeForCausalLM",
             dict(moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1, n_group=2,
                  topk_group=1, routed_scaling_factor=2.0, first_k_dense_replace=1, intermediate_size=20, head_dim=8,
                  **_COMMON)),
    ArchCase("qwen3_next", "Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
             dict(moe_intermediate_size=F, shared_expert_intermediate_size=12, num_experts=E, num_experts_per_tok=K,
                  intermediate_size=20, head_dim=8, linear_key_head_dim=4, linear_value_head_dim=4,
                  linear_num_key_heads=2, linear_num_value_heads=2, layer_types=["linear_attention", "full_attention"],
                  **_COMMON)),
    ArchCase("ernie4_5_moe", "Ernie 4.5 MoE", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
             dict(moe_intermediate_size=F, moe_num_experts=E, moe_k=K, moe_num_shared_experts=1, intermediate_size=20,
                  moe_layer_start_index=0, **_COMMON)),
    ArchCase("dots1", "dots1", "Dots1Config", "Dots1ForCausalLM",
             dict(moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=1,
                  first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True, intermediate_size=20,
                  **_COMMON)),
    ArchCase("flex_olmo", "FlexOlmo", "FlexOlmoConfig", "FlexOlmoForCausalLM",
             dict(intermediate_size=F, num_experts=E, num_experts_per_tok=K, pad_token_id=0, eos_token_id=1,
                  **_COMMON)),
    ArchCase("dbrx", "DBRX", "DbrxConfig", "DbrxForCausalLM",
             dict(d_model=D, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=64,
                  attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
                  ffn_config=dict(ffn_hidden_size=F, moe_num_experts=E, moe_top_k=K)),
             registry=False),
    ArchCase("jamba", "Jamba", "JambaConfig", "JambaForCausalLM",
             dict(intermediate_size=F, num_experts=E, num_experts_per_tok=K, use_mamba_kernels=False, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0, mamba_d_state=4,
                  **_COMMON)),
    ArchCase("minimax", "MiniMax", "MiniMaxConfig", "MiniMaxForCausalLM",
             dict(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, head_dim=8, block_size=4,
                  layer_types=["linear_attention", "full_attention"], **_COMMON)),
    ArchCase("hunyuan_v1_moe", "HunYuan-MoE v1", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
             dict(intermediate_size=F, num_experts=E, moe_topk=K, head_dim=8, **_COMMON)),
)


def build(case: ArchCase):
    """(config, model class) of ``case`` (needs transformers)."""
    import transformers

    cfg = getattr(transformers, case.config)(**case.kwargs)
    return cfg, getattr(transformers, case.model)


def architecture_table(cases: Optional[tuple[ArchCase, ...]] = None) -> str:
    """The Markdown table of docs/hf.md: each architecture and what tritonmoe.hf does with it."""
    rows = ["| architecture | transformers model type | `hf.apply` (swap) | experts registry |",
            "| --- | --- | --- | --- |"]
    for c in cases if cases is not None else ARCHITECTURES:
        swap = "swaps exactly" if c.expect == "swap" else f"refused: {c.why}"
        reg = "runs on tritonmoe" if c.registry else "no (its experts do not go through the registry)"
        rows.append(f"| {c.label} | `{c.name}` | {swap} | {reg} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m tritonmoe.hf_archs: the table for docs/hf.md
    print(architecture_table(), end="")
