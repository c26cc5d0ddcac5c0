"""Model presets and transformers configs for the sizing planner (tritonmoe.plan.models).

The parameter counts are checked two ways: every preset's total against the published total
(within 1%), and every preset's STRUCTURE exactly against the transformers model built from the
same config at a tiny width (``sum(p.numel())`` and the number of parameter tensors), so a key the
reader misses (a dense first layer, a bias, a shared expert) shows as a mismatch.
"""

from __future__ import annotations

import json

import pytest

from tritonmoe.plan.models import HF_PRESET_CONFIGS, MODEL_PRESETS, ModelSpec, get_model

transformers = pytest.importorskip("transformers")

#: published totals (model cards / papers), parameters; active per token where published
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "mixtral-8x22b": (141e9, 39e9),
    "qwen2-57b-a14b": (57.4e9, 14e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "olmoe-1b-7b": (6.9e9, 1.3e9),
    "deepseek-v2-lite": (15.7e9, None),  # "2.4B activated" counts without embedding and head
    "deepseek-v3": (671e9, 37e9),
    "gpt-oss-20b": (20.91e9, None),  # active 3.61B: OpenAI's count excludes the embedding
    "gpt-oss-120b": (116.83e9, None),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_totals_match_the_published_counts(name):
    spec = MODEL_PRESETS[name]
    total, active = PUBLISHED[name]
    assert abs(spec.total_params() - total) <= 0.01 * total, (name, spec.total_params())
    if active is not None:
        assert abs(spec.active_params_per_token() - active) <= 0.025 * active, (name, spec.active_params_per_token())
    if name == "gpt-oss-20b":  # OpenAI's active count: without the embedding
        emb = spec.params_by_part()["embedding"]
        assert abs(spec.active_params_per_token() - emb - 3.61e9) <= 0.01 * 3.61e9


def _shrink(cfg: dict, experts: int = 0) -> dict:
    """The preset's config at a tiny width: every structural key kept (layer kinds, biases,
    shared experts, MLA, tied embeddings), the widths small (and, given ``experts``, that many
    routed experts)."""
    c = dict(cfg)
    if experts:
        for k in ("num_local_experts", "num_experts", "n_routed_experts"):
            if k in c:
                c[k] = experts
    H = c["num_attention_heads"]
    KV = c.get("num_key_value_heads", H)
    c.update(hidden_size=16, num_attention_heads=4, num_key_value_heads=4 if KV == H else 2, vocab_size=64,
             max_position_embeddings=64)
    if "head_dim" in c:
        c["head_dim"] = 4
    for k, v in (("intermediate_size", 20), ("moe_intermediate_size", 8), ("shared_expert_intermediate_size", 12)):
        if k in c:
            c[k] = v
    if "kv_lora_rank" in c:
        c.update(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
        if c.get("q_lora_rank"):
            c["q_lora_rank"] = 8
    c["num_hidden_layers"] = min(c["num_hidden_layers"], c.get("first_k_dense_replace", 0) + 2)
    if c["model_type"] == "gpt_oss":
        c["layer_types"] = ["sliding_attention", "full_attention"]
    return c


def _tiny_model(cfg: dict):
    c = dict(cfg)
    mt = c.pop("model_type")
    hc = transformers.AutoConfig.for_model(mt, **c)
    return hc, transformers.AutoModelForCausalLM.from_config(hc)


@pytest.mark.parametrize("name", sorted(HF_PRESET_CONFIGS))
def test_preset_structure_counts_exactly_as_transformers_builds_it(name):
    _, cfg = HF_PRESET_CONFIGS[name]
    small = _shrink(cfg)
    hc, model = _tiny_model(small)
    params = list(model.parameters())
    for spec in (get_model(hc), get_model(small)):  # the config object and the config.json dict
        assert spec.total_params() == sum(p.numel() for p in params), (name, spec.params_by_part())
        assert spec.param_tensors() == len(params), name
        assert spec.moe_layers == MODEL_PRESETS[name].moe_layers - (MODEL_PRESETS[name].num_layers - spec.num_layers)
    # the parts: routed experts and routers are what the model's MoE blocks hold
    parts = get_model(hc).params_by_part()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert parts["routed_experts"] == experts, name


def test_reader_against_the_hf_architecture_registry():
    """The tiny configs tests/test_hf_archs.py builds, for every architecture the planner reads."""
    from tritonmoe.hf_archs import ARCHITECTURES, build
    from tritonmoe.plan.models import READABLE_MODEL_TYPES

    seen = set()
    for case in ARCHITECTURES:
        if case.name not in READABLE_MODEL_TYPES:
            continue
        cfg, cls = build(case)
        model = cls(cfg)
        spec = get_model(cfg)
        assert spec.total_params() == sum(p.numel() for p in model.parameters()), (case.name, spec)
        assert spec.param_tensors() == len(list(model.parameters())), case.name
        seen.add(case.name)
    assert seen == set(READABLE_MODEL_TYPES)


def test_get_model_inputs(tmp_path):
    assert get_model("Mixtral-8x7B") is MODEL_PRESETS["mixtral-8x7b"]
    assert get_model("Qwen/Qwen3-30B-A3B") is MODEL_PRESETS["qwen3-30b-a3b"]
    spec = MODEL_PRESETS["deepseek-v3"]
    assert get_model(spec) is spec
    _, cfg = HF_PRESET_CONFIGS["deepseek-v3"]
    p = tmp_path / "dsv3" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(cfg))
    for x in (p, str(p), str(p.parent)):
        got = get_model(x)
        assert got.total_params() == spec.total_params() and got.moe_layers == 58 and str(p) in got.source
    assert "deepseek-ai/DeepSeek-V3" in spec.source
    assert spec.num_layers == 61 and spec.dense_layers == 3 and spec.mla and spec.n_shared_experts == 1


def test_get_model_bad_input_is_typed():
    with pytest.raises(ValueError, match=r"unknown model 'mixtral-8x7'.*did you mean 'mixtral-8x7b'.*presets: "):
        get_model("mixtral-8x7")
    with pytest.raises(ValueError, match="model_type='llama'"):
        get_model({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(TypeError, match="got int"):
        get_model(3)
    with pytest.raises(ValueError, match="no config.json"):
        get_model("/nonexistent/config.json")
    with pytest.raises(ValueError, match="top_k=9 > num_experts=8"):
        ModelSpec("x", 2, 2, 8, 8, 8, 9, 32, 2, 2, 4)
    with pytest.raises(ValueError, match="dense layers need dense_d_ffn"):
        ModelSpec("x", 2, 1, 8, 8, 8, 2, 32, 2, 2, 4)
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        ModelSpec("x", 2, 2, 0, 8, 8, 2, 32, 2, 2, 4)


@pytest.mark.parametrize("name", ["deepseek-v3"])
def test_counts_hold_after_the_swap_to_tritonmoe(name):
    """hf.apply swaps every MoE block for a tritonmoe MoELayer holding the same parameters (the
    router's, the experts' concatenated gate-up and down, the shared experts'): the total is the
    spec's, and the routed experts are the layers' w1 / w2."""
    from tritonmoe import hf

    small = _shrink(HF_PRESET_CONFIGS[name][1], experts=8)
    small.update(num_experts_per_tok=2, **({"n_group": 1, "topk_group": 1} if "n_routed_experts" in small else {}))
    hc, model = _tiny_model(small)
    spec = get_model(hc)
    names = hf.apply(model.float())
    assert names
    assert sum(p.numel() for p in model.parameters()) == spec.total_params()
    w = sum(p.numel() for n, p in model.named_parameters()
            if n.endswith((".w1", ".w2", ".b1", ".b2")) and "shared" not in n)
    assert w == spec.params_by_part()["routed_experts"]
