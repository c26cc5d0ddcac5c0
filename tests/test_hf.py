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
    torch.manual_seed(0)
    model = model_cls(cfg).double().eval()
    _randomize(model, 4)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    with hf.eager_experts(model), torch.no_grad():  # transformers' grouped_mm default does not take fp64
        want = model(ids).logits
    assert all(c._experts_implementation != "eager" for c in hf._configs(model))  # put back
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
    with pytest.raises(hf.HFConversionError, match="Linear .* is not a MoE block tritonmoe.hf reads"):
        hf.from_hf(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="has no MoE block tritonmoe.hf reads"):
        hf.apply(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    block_cls, _, cfg = _arch("mixtral")
    block = block_cls(cfg)
    del block.experts.gate_up_proj
    with pytest.raises(hf.HFConversionError, match="MixtralExperts stores its experts in a layout tritonmoe.hf does not"):
        hf.from_hf(block)


# ---------------------------------------------------------------------------------------------
# Training through a patched model: router logits, jitter; refusals; the reverse conversion
# ---------------------------------------------------------------------------------------------


def _router_weight(block) -> torch.Tensor:
    if isinstance(block, hf.HFMoEBlock):
        return block.moe.router.weight
    return block.router.weight if hasattr(block, "router") else block.gate.weight


def _moe_blocks(model):
    return [m for m in model.modules() if hf.is_moe_block(m) or isinstance(m, hf.HFMoEBlock)]


@pytest.mark.parametrize("arch", ARCHS)
def test_output_router_logits_training_matches(arch):
    """output_router_logits=True on a patched model in training mode: the model's router_logits
    (one per MoE layer), its aux_loss and loss, and the router and expert gradients equal the
    unpatched model's (the HFMoEBlock hands the layer's logits, in the graph, to transformers'
    collector; before, a patched model returned no router logits)."""
    import copy

    _, model_cls, cfg = _arch(arch)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(cfg).double().train()
    _randomize(model, 8)
    patched = copy.deepcopy(model)
    hf.apply(patched)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(9))
    outs = []
    for m in (model, patched):
        out = m(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        outs.append(out)
    want, got = outs
    assert want.router_logits is not None and len(got.router_logits) == len(want.router_logits) == len(_moe_blocks(model))
    for a, b in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(a.double(), b.double(), **TOL)
    if want.aux_loss is not None:  # DeepSeek-V3's causal LM computes no aux loss
        torch.testing.assert_close(got.aux_loss.double(), want.aux_loss.double(), **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    for b_got, b_want in zip(_moe_blocks(patched), _moe_blocks(model)):
        g_got, g_want = _router_weight(b_got).grad, _router_weight(b_want).grad
        assert g_got is not None and g_got.abs().sum() > 0
        torch.testing.assert_close(g_got, g_want, **TOL)


def test_mixtral_router_jitter_in_training():
    """Mixtral's router_jitter_noise: HFMoEBlock draws the same noise as the block in training
    (same generator calls: equal logits and gradients), none in eval; a bare from_hf refuses the
    block rather than silently dropping the noise."""
    import copy

    block_cls, model_cls, cfg = _arch("mixtral")
    cfg = copy.deepcopy(cfg)
    cfg.router_jitter_noise = 0.3
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(cfg).double().train()
    _randomize(model, 10)
    patched = copy.deepcopy(model)
    hf.apply(patched)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(11))
    res = []
    for m in (model, patched):
        torch.manual_seed(123)
        out = m(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        res.append((out.logits, _router_weight(_moe_blocks(m)[0]).grad))
    torch.testing.assert_close(res[1][0], res[0][0], **TOL)
    torch.testing.assert_close(res[1][1], res[0][1], **TOL)
    torch.manual_seed(5)
    noisy = patched(ids).logits
    with torch.no_grad():
        patched.eval()
        model.eval()
        torch.testing.assert_close(patched(ids).logits, model(ids).logits, **TOL)
    assert (noisy - patched(ids).logits).abs().max() > 1e-3  # the noise is really applied in training
    block = block_cls(cfg)
    with pytest.raises(ValueError, match="router_jitter_noise=0.3"):
        hf.from_hf(block)
    assert isinstance(hf.from_hf(block, ignore_router_jitter=True), tm.MoELayer)


def test_llama4_and_phimoe_are_refused_with_the_reason():
    m = transformers.models
    llama = m.llama4.modeling_llama4.Llama4TextMoe(transformers.Llama4TextConfig(
        hidden_size=16, intermediate_size=8, intermediate_size_mlp=8, num_local_experts=4, num_experts_per_tok=1,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=32, head_dim=8))
    with pytest.raises(hf.HFConversionError, match="Llama4TextMoe.*dense per-expert scores.*input.*sigmoid score"):
        hf.from_hf(llama)
    pcfg = transformers.PhimoeConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    with pytest.raises(TypeError, match="PhimoeSparseMoeBlock.*SparseMixer"):
        hf.from_hf(m.phimoe.modeling_phimoe.PhimoeSparseMoeBlock(pcfg))
    model = m.phimoe.modeling_phimoe.PhimoeForCausalLM(pcfg)
    with pytest.raises(hf.HFConversionError, match="PhimoeSparseMoeBlock.*nothing was replaced"):
        hf.apply(model)
    assert not any(isinstance(x, hf.HFMoEBlock) for x in model.modules())


def test_to_hf_refuses_partial_conversions():
    """to_hf writes all of a block or nothing: a layer of another architecture (here: no shared
    expert for a Qwen2-MoE block, which would leave the shared expert's weights as they were), a
    layer holding a shard of the experts, or an already-converted block."""
    block_cls, _, cfg = _arch("qwen2_moe")
    block = block_cls(cfg)
    _randomize(block, 12)
    before = {n: t.clone() for n, t in block.state_dict().items()}
    other = tm.MoELayer(tm.MoEConfig(D, F, E, K, renormalize=False))
    with pytest.raises(ValueError, match=r"shared_d_ffn=0 \(the block's: 12\)"):
        hf.to_hf(other, block)
    sharded = hf.from_hf(block)
    sharded.w1 = torch.nn.Parameter(sharded.w1.detach()[: E // 2].clone())
    with pytest.raises(ValueError, match=f"holds {E // 2} experts in w1"):
        hf.to_hf(sharded, block)
    assert all(torch.equal(t, before[n]) for n, t in block.state_dict().items())
    with pytest.raises(TypeError, match="already a tritonmoe HFMoEBlock"):
        hf.from_hf(hf.HFMoEBlock.from_hf(block))


def test_restore_puts_trained_blocks_back_and_refuses_a_partial_model():
    """apply -> an optimizer step on the patched model -> restore: transformers blocks again, with
    the trained weights (logits equal the patched model's); a model converted only in part is
    refused and left as it is."""
    import copy

    block_cls, model_cls, cfg = _arch("gpt_oss")
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(cfg).double()
    _randomize(model, 13)
    partial = copy.deepcopy(model)
    hf.apply(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(14))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        want = model(ids).logits
    names = hf.restore(model)
    assert names and all(type(model.get_submodule(n)) is block_cls for n in names)
    assert not any(isinstance(m, hf.HFMoEBlock) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, **TOL)
    hf.apply(partial.model.layers[0])
    with pytest.raises(ValueError, match="partially converted"):
        hf.restore(partial)
    assert isinstance(partial.model.layers[0].mlp, hf.HFMoEBlock) and type(partial.model.layers[1].mlp) is block_cls
    # apply -> a dtype cast -> restore: the blocks come back in the model's current dtype
    hf.apply(model)
    model.float()
    with torch.no_grad():
        want32 = model(ids).logits
    hf.restore(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want32, rtol=1e-5, atol=1e-5)
