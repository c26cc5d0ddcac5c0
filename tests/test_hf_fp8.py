"""An FP8 DeepSeek-V3 checkpoint through tritonmoe.hf (issue 36): a tiny DeepSeek-V3-shaped model,
its linear weights quantized to e4m3 with 128x128 block scales and saved as HF stores them
(``weight`` + ``weight_scale_inv``, safetensors shards in a tmp dir), loads with the experts kept
in e4m3 and runs within the FP8 tolerance of the same checkpoint dequantized.

Shapes: d_model=160 and moe d_ffn=96 (neither a multiple of 128: partial scale blocks on both
GEMMs' K), 4 experts top-2 with group-limited routing and a shared expert, one dense layer."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import tritonmoe as tm  # noqa: E402
from tritonmoe import hf  # noqa: E402
from tritonmoe.fp8_reference import dequantize_weight, quantize_weight  # noqa: E402

E, D, F = 4, 160, 96
FMT = "e4m3_block128"
FP8 = torch.float8_e4m3fn
TOL = 0.05  # relative (Frobenius) error of the logits, FP8 experts against the dequantized model


def _config():
    return transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=D, intermediate_size=192, moe_intermediate_size=F, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=E, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=64)


_BASE = []


def _model(seed: int):
    if not _BASE:  # building a transformers model costs ~1 s; copies are cheap
        torch.manual_seed(0)
        _BASE.append(transformers.DeepseekV3ForCausalLM(_config()).eval())
    m = copy.deepcopy(_BASE[0])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        m.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    return m


_CKPT = []


def _source_checkpoint() -> dict[str, torch.Tensor]:
    if not _CKPT:  # one per module (the tests do not modify it)
        _CKPT.append(_checkpoint(_model(0)))
    return _CKPT[0]


def _checkpoint(model) -> dict[str, torch.Tensor]:
    """The model as an FP8 checkpoint as DeepSeek-V3 ships it: every linear weight of the
    decoder e4m3 + ``weight_scale_inv`` (128x128 blocks), per-expert projections, the router,
    norms, embeddings and the head in fp32."""
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            for j in range(E):
                for proj, w in (("gate_proj", t[j, :F]), ("up_proj", t[j, F:])):
                    sd[f"{pre}{j}.{proj}.weight"], sd[f"{pre}{j}.{proj}.weight_scale_inv"] = quantize_weight(w, FMT)
        elif name.endswith("experts.down_proj"):
            pre = name[: -len("down_proj")]
            for j in range(E):
                sd[f"{pre}{j}.down_proj.weight"], sd[f"{pre}{j}.down_proj.weight_scale_inv"] = quantize_weight(t[j], FMT)
        elif name.startswith("model.layers.") and t.dim() == 2 and not name.endswith("mlp.gate.weight"):
            sd[name], sd[name[: -len("weight")] + "weight_scale_inv"] = quantize_weight(t, FMT)
        else:
            sd[name] = t.clone()
    return {k: v.contiguous() for k, v in sd.items()}


def _dequantized_model(sd, seed: int):
    """The checkpoint dequantized into a transformers model (what transformers' FP8 path runs)."""
    m = _model(seed)
    own = m.state_dict()
    with torch.no_grad():
        for name, t in own.items():
            if name.endswith("experts.gate_up_proj"):
                pre = name[: -len("gate_up_proj")]
                for j in range(E):
                    for lo, proj in ((0, "gate_proj"), (F, "up_proj")):
                        k = f"{pre}{j}.{proj}.weight"
                        t[j, lo:lo + F] = dequantize_weight(sd[k], sd[k + "_scale_inv"], FMT)
            elif name.endswith("experts.down_proj"):
                pre = name[: -len("down_proj")]
                for j in range(E):
                    k = f"{pre}{j}.down_proj.weight"
                    t[j] = dequantize_weight(sd[k], sd[k + "_scale_inv"], FMT)
            elif name in sd:
                v = sd[name]
                t.copy_(dequantize_weight(v, sd[name[:-6] + "weight_scale_inv"], FMT) if v.dtype == FP8 else v)
    return m


def test_fp8_deepseek_v3_checkpoint_runs_in_fp8(tmp_path):
    sd = _source_checkpoint()
    keys = sorted(sd)
    half = len(keys) // 2  # two shards, as a sharded checkpoint
    safetensors_torch.save_file({k: sd[k] for k in keys[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors_torch.save_file({k: sd[k] for k in keys[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert sd["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == FP8
    assert sd["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = _dequantized_model(sd, seed=7)
    with hf.eager_experts(ref), torch.no_grad():
        want = ref(ids).logits

    model = _model(seed=3)  # other weights: everything must come from the checkpoint
    names = hf.load_fp8_checkpoint(model, tmp_path)
    assert names == ["model.layers.1.mlp"]
    block = model.get_submodule(names[0])
    layer = block.moe
    assert isinstance(block, hf.HFMoEBlock) and layer.config.expert_dtype == "fp8_e4m3"
    held = layer.fp8_experts
    assert held.w1.dtype == FP8 and held.w2.dtype == FP8 and tuple(held.w1.shape) == (E, 2 * F, D)
    # the experts exist in e4m3 only: no 16-bit copy anywhere in the layer
    assert layer.w1.numel() == 0 and layer.w2.numel() == 0
    big = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers())
           if t.is_floating_point() and t.dtype != FP8 and t.numel() >= E * F * D]
    assert big == [], big
    # the e4m3 bytes are the checkpoint's
    assert torch.equal(held.w2[3].view(torch.uint8), sd["model.layers.1.mlp.experts.3.down_proj.weight"].view(torch.uint8))
    assert torch.equal(held.w1_scale[2, 1], sd["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"][0])
    sdict = layer.state_dict()
    assert sdict["fp8_experts.w1"].dtype == FP8 and "fp8_experts.w2_scale" in sdict

    with torch.no_grad():
        got = model(ids).logits
    assert layer.ffn_path_used == "fp8"
    err = float((got - want).norm() / want.norm())
    # the FP8 path also quantizes the expert inputs and the SwiGLU output to e4m3 (3 mantissa
    # bits): ~4% relative on the routed experts' output (docs/fp8.md), ~2.6% on these logits
    assert err < TOL, err

    # and that is the only difference: the block is exactly the FP8 op on the held experts plus
    # the shared expert, the dequantized block exactly the 16-bit op on the dequantized experts
    x = torch.randn(18, D, generator=torch.Generator().manual_seed(2))
    rblock = ref.model.layers[1].mlp
    with torch.no_grad(), hf.eager_experts(ref):
        a, b = block(x[None])[0], rblock(x[None])[0]
        _, routing = layer.route(x)
        w1, w2 = held.experts().dequantize()
        shared = layer.shared_experts(x)
        assert torch.equal(a, tm.fp8_moe_ffn(x, routing, held.experts()) + shared)
        torch.testing.assert_close(b, tm.moe_ffn(x, routing, w1, w2) + shared, rtol=1e-5, atol=1e-5)

    # the tolerance catches a wrong expert: the reference with experts 1 and 2 swapped is far off
    ex = ref.model.layers[1].mlp.experts
    with torch.no_grad():
        ex.gate_up_proj[[1, 2]] = ex.gate_up_proj[[2, 1]].clone()
        ex.down_proj[[1, 2]] = ex.down_proj[[2, 1]].clone()
    with hf.eager_experts(ref), torch.no_grad():
        wrong = ref(ids).logits
    assert float((wrong - want).norm() / want.norm()) > 2 * TOL

    # inference only; to_hf will not dequantize silently
    with pytest.raises(ValueError, match="torch.no_grad"):
        layer(torch.randn(3, D, requires_grad=True))
    with pytest.raises(ValueError, match="e4m3"):
        hf.to_hf(layer, ref.model.layers[1].mlp)


def test_fp8_checkpoint_errors(tmp_path):
    sd = _source_checkpoint()
    model = _model(3)
    bad = {k: v for k, v in sd.items() if not k.startswith("model.layers.1.mlp.experts.2.")}
    with pytest.raises(hf.HFConversionError, match="experts.2.gate_proj"):
        hf.apply(model, fp8_experts=bad)
    assert not any(isinstance(m, hf.HFMoEBlock) for m in model.modules())  # nothing replaced
    with pytest.raises(ValueError, match="no tensor for"):
        hf.load_fp8_checkpoint(model, {k: v for k, v in sd.items() if "o_proj" not in k})
    with pytest.raises(ValueError, match="no .safetensors"):
        hf.load_fp8_checkpoint(model, tmp_path)
    layer = tm.MoELayer(tm.MoEConfig(d_model=D, d_ffn=F, num_experts=E, top_k=2))
    experts = tm.load_fp8_experts(sd, "model.layers.1.mlp.experts.", E)
    with pytest.raises(ValueError, match="expert_dtype"):
        tm.layer.hold_fp8_experts(layer, experts)
