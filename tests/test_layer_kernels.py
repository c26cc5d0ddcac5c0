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


# ---------------------------------------------------------------------------------------------
# ffn_path="auto": unfused when a backward follows on CUDA, fused otherwise
# ---------------------------------------------------------------------------------------------
#
# The rule (tritonmoe.experts.auto_ffn_path) follows the first H100 run: forward + backward the
# unfused path was faster (Mixtral-like T=16k 65.4 vs 83.5 ms, Qwen3-like T=32k 18.0 vs 20.5 ms),
# forward alone the fused one. Without a GPU, the ``cuda_rule_on_cpu`` fixture widens the rule's
# device set to CPU so the layer runs it on the interpreter's kernels.

import dataclasses  # noqa: E402

from tritonmoe.experts import local as X  # noqa: E402

AUTO = dict(d_model=8, d_ffn=6, num_experts=4, top_k=2)


@pytest.fixture
def cuda_rule_on_cpu(monkeypatch):
    monkeypatch.setattr(X, "_TRAIN_UNFUSED_DEVICES", frozenset({"cuda", "cpu"}))


@pytest.mark.parametrize(
    "backend,device,dtype,backward,want",
    [
        ("triton", "cuda", torch.bfloat16, True, "unfused"),
        ("triton", "cuda", torch.bfloat16, False, "fused"),
        (None, "cuda", torch.bfloat16, True, "unfused"),   # the process default: the kernels on CUDA
        (None, "cuda", torch.float16, False, "fused"),
        ("auto", "cuda", torch.float32, True, "unfused"),
        ("torch", "cuda", torch.bfloat16, True, "unfused"),  # the reference: one composition either way
        ("torch", "cuda", torch.bfloat16, False, "unfused"),
        ("triton", "cpu", torch.float32, True, "fused"),  # interpreter: not measured, stays fused
        ("triton", "cpu", torch.float32, False, "fused"),
        (None, "cpu", torch.float32, True, "unfused"),  # the reference is the CPU default
    ],
)
def test_auto_ffn_path_rule(backend, device, dtype, backward, want):
    assert X.auto_ffn_path(backend, device, dtype, backward) == want
    assert X._local_ffn_path("auto", backend, device, dtype, backward) == want
    for forced in ("fused", "unfused"):
        assert X._local_ffn_path(forced, backend, device, dtype, backward) == forced


def test_needs_backward_reads_grad_mode_and_requires_grad():
    x = torch.zeros(3, 4)
    w = X.ExpertWeights(torch.zeros(2, 4, 6), torch.zeros(2, 3, 4))
    r = tm.route(torch.zeros(3, 2), 1, backend="torch")
    assert not X._needs_backward(x, r, w)  # nothing requires grad
    assert X._needs_backward(x.clone().requires_grad_(), r, w)
    assert X._needs_backward(x, r, X.ExpertWeights(w.w1.clone().requires_grad_(), w.w2))
    assert X._needs_backward(x, r, X.ExpertWeights(w.w1, w.w2, b2=torch.zeros(2, 4, requires_grad=True)))
    gated = dataclasses.replace(r, topk_weights=r.topk_weights.clone().requires_grad_())  # only the gate trains
    assert X._needs_backward(x, gated, w)
    with torch.no_grad():
        assert not X._needs_backward(x.clone().requires_grad_(), gated, w)


def _auto_layers(**over):
    torch.manual_seed(0)
    layers = {p: tm.MoELayer(tm.MoEConfig(**AUTO, backend="triton", ffn_path=p, **over)) for p in ("auto", "fused", "unfused")}
    for lay in layers.values():
        lay.load_state_dict(layers["auto"].state_dict())
    return layers


def _train_step(layer, x, g):
    for q in layer.parameters():
        q.grad = None
    xg = x.clone().requires_grad_()
    y = layer(xg)
    (y * g).sum().backward()
    return [y.detach(), xg.grad] + [q.grad for q in layer.parameters()]


def test_auto_layer_trains_unfused_and_infers_fused(cuda_rule_on_cpu):
    """With the CUDA rule: the layer's training step runs the unfused path and equals the
    explicit ``ffn_path="unfused"`` layer bitwise (outputs and every gradient); under no_grad,
    and with every parameter frozen and an input that needs no grad, it runs fused and equals
    ``ffn_path="fused"`` bitwise; a frozen layer whose input requires grad trains unfused."""
    layers = _auto_layers(expert_ffn_bias=True)
    x, g = torch.randn(7, 8), torch.randn(7, 8)
    got, want = _train_step(layers["auto"], x, g), _train_step(layers["unfused"], x, g)
    assert layers["auto"].ffn_path_used == "unfused"
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad():
        y = layers["auto"](x)
    assert layers["auto"].ffn_path_used == "fused" and torch.equal(y, layers["fused"](x))
    layers["auto"].requires_grad_(False)
    y = layers["auto"](x)
    assert layers["auto"].ffn_path_used == "fused" and torch.equal(y, layers["fused"](x))
    layers["auto"](x.clone().requires_grad_())
    assert layers["auto"].ffn_path_used == "unfused"
    layers["fused"](x.clone().requires_grad_())
    assert layers["fused"].ffn_path_used == "fused"  # an explicit choice is kept in training


def test_auto_layer_on_cpu_kernels_keeps_fused_for_training():
    """Without the fixture (the rule as shipped): off CUDA the kernels' training stays fused."""
    layers = _auto_layers()
    x, g = torch.randn(5, 8), torch.randn(5, 8)
    _train_step(layers["auto"], x, g)
    assert layers["auto"].ffn_path_used == "fused"
