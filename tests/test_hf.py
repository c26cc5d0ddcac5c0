"""Hugging Face interoperability: tiny random-config transformers MoE blocks (no downloads)
converted to MoELayer match the originals in fp64 (output, input gradient and every parameter's
gradient), convert back exactly, and a patched model's logits match the unpatched model's.

Tolerance: both sides compute the routing weights in fp32 (transformers' routers take the
softmax/sigmoid in fp32; tritonmoe's weights are fp32 by contract), rounded in different orders,
so fp64 results agree to fp32 rounding of the weights (~1e-7 relative), not bitwise. A wrong
expert or a wrong layout is off by O(0.1)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tritonmoe as tm  # noqa: E402
from tritonmoe import hf  # noqa: E402

D, F, E, K = 16, 8, 8, 2
COMMON = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
              max_position_embeddings=64)


def _arch(name: str):
    """(block class, model class, config) of each supported architecture, tiny."""
    m = transformers.models
    if name == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, **COMMON)
        mod = m.mixtral.modeling_mixtral
        return mod.MixtralSparseMoeBlock, mod.MixtralForCausalLM, cfg
    if name == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=F, shared_expert_intermediate_size=12, num_experts=E,
                                          num_experts_per_tok=K, norm_topk_prob=False, intermediate_size=20, **COMMON)
        mod = m.qwen2_moe.modeling_qwen2_moe
        return mod.Qwen2MoeSparseMoeBlock, mod.Qwen2MoeForCausalLM, cfg
    if name == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                                          norm_topk_prob=True, intermediate_size=20, head_dim=8, **COMMON)
        mod = m.qwen3_moe.modeling_qwen3_moe
        return mod.Qwen3MoeSparseMoeBlock, mod.Qwen3MoeForCausalLM, cfg
    if name == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=F, num_experts=E, num_experts_per_tok=K, norm_topk_prob=False,
                                       **COMMON)
        mod = m.olmoe.modeling_olmoe
        return mod.OlmoeSparseMoeBlock, mod.OlmoeForCausalLM, cfg
    if name == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K, n_shared_experts=2, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, intermediate_size=20,
            q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, **COMMON)
        mod = m.deepseek_v3.modeling_deepseek_v3
        return mod.DeepseekV3MoE, mod.DeepseekV3ForCausalLM, cfg
    if name == "gpt_oss":
        cfg = transformers.GptOssConfig(intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, head_dim=8,
                                        swiglu_limit=0.8, **COMMON)
        mod = m.gpt_oss.modeling_gpt_oss
        return mod.GptOssMLP, mod.GptOssForCausalLM, cfg
    raise KeyError(name)


TOL = dict(rtol=1e-5, atol=1e-6)
ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in list(module.parameters()) + [b for n, b in module.named_buffers() if "correction_bias" in n]:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


@pytest.mark.parametrize("arch", ARCHS)
def test_block_round_trip_matches_in_fp64(arch):
    block_cls, _, cfg = _arch(arch)
    block = block_cls(cfg).double()
    _randomize(block, 1)
    layer = hf.from_hf(block)
    x = torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    g = torch.randn(2, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = block(xa)
    want = want[0] if isinstance(want, tuple) else want
    (want * g).sum().backward()
    got = layer(xb)
    (got * g).sum().backward()
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(xb.grad, xa.grad, **TOL)
    grads = hf.tensors_to_hf({n: p.grad for n, p in layer.named_parameters()}, block)
    want_grads = {n: p.grad for n, p in block.named_parameters()}
    assert set(grads) == set(want_grads), (set(grads) ^ set(want_grads))
    for n, gr in grads.items():
        # DeepSeek-V3 computes its router in fp32 (tritonmoe keeps that weight in fp32: router_dtype)
        torch.testing.assert_close(gr.to(want_grads[n].dtype), want_grads[n], **TOL, msg=lambda m: f"{arch} {n}: {m}")
    # back: to_hf of the converted layer reproduces every tensor exactly
    other = block_cls(cfg).double()
    hf.to_hf(layer, other)
    theirs = dict(other.state_dict())
    for n, t in block.state_dict().items():
        if n == "gate.e_score_correction_bias":  # tritonmoe's selection bias is fp32 by contract
            t = t.float().to(t.dtype)
        assert torch.equal(theirs[n], t), n


@pytest.mark.parametrize("arch", ARCHS)
def test_patched_model_logits_match(arch):
    _, model_cls, cfg = _arch(arch)
    cfg._experts_implementation = "eager"  # transformers' grouped_mm default does not take fp64
    torch.manual_seed(0)
    model = model_cls(cfg).double().eval()
    _randomize(model, 4)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(ids).logits
    names = hf.apply(model)
    assert names and all(isinstance(model.get_submodule(n), hf.HFMoEBlock) for n in names)
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, **TOL)


def test_load_balancing_loss_convention():
    """transformers' Mixtral loss is top_k times tritonmoe's; loss_convention='transformers'
    makes layer.aux_loss equal coef * transformers' loss."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    block_cls, _, cfg = _arch("mixtral")
    block = block_cls(cfg).double()
    _randomize(block, 6)
    x = torch.randn(11, D, dtype=torch.float64)
    logits = x @ block.gate.weight.t()
    theirs = load_balancing_loss_func((logits,), E, K)
    ours = tm.load_balancing_loss(logits, tm.route(logits, K))
    torch.testing.assert_close(theirs.double(), K * ours.double(), rtol=1e-6, atol=1e-9)
    layer = hf.from_hf(block, aux_loss_coef=0.01, loss_convention="transformers")
    layer(x)
    torch.testing.assert_close(layer.aux_loss.double(), 0.01 * theirs.double(), rtol=1e-6, atol=1e-9)


def test_experts_registry_runs_the_fused_ffn():
    """register_experts_implementation: the block keeps its routing, its experts run moe_ffn."""
    block_cls, _, cfg = _arch("qwen3_moe")
    block = block_cls(cfg)
    _randomize(block, 7)
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        want = block(x)
        hf.register_experts_implementation()
        cfg._experts_implementation = "tritonmoe"
        got = block(x)
    cfg._experts_implementation = "eager"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_unsupported_blocks_are_named():
    with pytest.raises(TypeError, match="does not know the block Linear"):
        hf.from_hf(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="has no MoE block tritonmoe.hf supports"):
        hf.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    block_cls, _, cfg = _arch("mixtral")
    block = block_cls(cfg)
    del block.experts.gate_up_proj
    with pytest.raises(TypeError, match="no attribute 'experts.gate_up_proj'"):
        hf.from_hf(block)
