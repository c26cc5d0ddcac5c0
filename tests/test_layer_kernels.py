"""MoELayer end to end on the Triton kernels (route, permute, grouped FFN / fused moe_ffn,
unpermute) against the same layer on the reference backend. On CPU the kernels run in Triton's
interpreter, so shapes stay small; on CUDA the `gpu` case runs bf16 at a realistic size."""

from __future__ import annotations


import pytest
import torch

import tritonmoe as tm

# Why each case exists: both FFN paths; capacity dropping (ids -1 through every kernel);
# group-limited sigmoid routing with the selection bias; gelu/relu epilogues; k = E.
CASES = {
    "unfused swiglu capacity": dict(ffn_path="unfused", capacity_factor=0.75),
    "fused swiglu capacity": dict(ffn_path="fused", capacity_factor=0.75),
    "fused groups bias gelu": dict(ffn_path="fused", num_experts=6, n_groups=3, topk_groups=2, top_k=3,
                                   score_func="sigmoid", expert_bias=True, activation="gelu"),
    "unfused relu k=E": dict(ffn_path="unfused", num_experts=3, top_k=3, activation="relu"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layer_triton_matches_reference(name):
    over = dict(d_model=12, d_ffn=10, num_experts=5, top_k=2, aux_loss_coef=0.01, z_loss_coef=1e-3)
    over.update(CASES[name])
    torch.manual_seed(0)
    ref_layer = tm.MoELayer(tm.MoEConfig(**over, backend="torch"))
    tri_layer = tm.MoELayer(tm.MoEConfig(**over, backend="triton"))
    tri_layer.load_state_dict(ref_layer.state_dict())
    if ref_layer.expert_bias is not None:
        bias = torch.linspace(-0.1, 0.1, over["num_experts"])
        ref_layer.expert_bias.copy_(bias)
        tri_layer.expert_bias.copy_(bias)
    x = torch.randn(2, 9, 12)
    x_ref = x.clone().requires_grad_(True)
    x_tri = x.clone().requires_grad_(True)
    y_ref, y_tri = ref_layer(x_ref), tri_layer(x_tri)
    assert tri_layer.ffn_path_used == over["ffn_path"]
    # routing metadata exactly, values to fp32 tolerance
    assert torch.equal(tri_layer.last_routing.topk_ids, ref_layer.last_routing.topk_ids)
    assert torch.equal(tri_layer.last_routing.counts, ref_layer.last_routing.counts)
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tri_layer.aux_loss, ref_layer.aux_loss, rtol=1e-5, atol=1e-7)
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().add(ref_layer.aux_loss).backward()
    (y_tri * g).sum().add(tri_layer.aux_loss).backward()
    torch.testing.assert_close(x_tri.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(ref_layer.named_parameters(), tri_layer.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("ffn_path", ["fused", "unfused"])
def test_layer_triton_bf16_on_gpu(ffn_path):
    cfg = dict(d_model=1024, d_ffn=512, num_experts=16, top_k=2)
    torch.manual_seed(0)
    ref_layer = tm.MoELayer(tm.MoEConfig(**cfg, backend="torch"), device="cuda", dtype=torch.bfloat16)
    tri_layer = tm.MoELayer(tm.MoEConfig(**cfg, backend="auto", ffn_path=ffn_path), device="cuda", dtype=torch.bfloat16)
    tri_layer.load_state_dict(ref_layer.state_dict())
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    y_ref, y_tri = ref_layer(x), tri_layer(x)
    assert torch.equal(tri_layer.last_routing.topk_ids, ref_layer.last_routing.topk_ids)
    torch.testing.assert_close(y_tri.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
