"""The layers real models use: expert and router biases, GPT-OSS's clamped SwiGLU, a routed
scaling factor, DeepSeek-V2's group score, gated shared experts, an fp32 router on bf16
activations; the auxiliary-loss-free bias update and load statistics; copies of a layer after a
training forward. Each layer is checked against the naive per-token loop (tests/naive.py) in
fp64, output and every gradient."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import tritonmoe as tm

import naive

FULL = dict(activation="swiglu_oai", swiglu_limit=0.6, swiglu_alpha=1.3, expert_ffn_bias=True, router_bias=True,
            routed_scaling_factor=2.5, n_groups=4, topk_groups=2, group_score="max", shared_d_ffn=10,
            shared_expert_gate=True)


def _randomize(layer: tm.MoELayer, seed: int) -> None:
    """Non-zero values in every parameter (the biases start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.4)


CASES = {
    "everything, softmax": dict(FULL),
    "everything, sigmoid (DeepSeek-V3 style), top2sum": dict(FULL, score_func="sigmoid", group_score="top2sum"),
    "biases + swiglu_oai only": dict(activation="swiglu_oai", expert_ffn_bias=True),
    "gelu + biases + ungated shared": dict(activation="gelu", expert_ffn_bias=True, shared_d_ffn=6),
    "relu + scaling, no renormalize": dict(activation="relu", renormalize=False, routed_scaling_factor=0.5),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_naive_loop(name, backend):
    if backend == "triton" and name != "everything, softmax":
        pytest.skip("the Triton backend runs fp64 on the reference (dispatch rule 3); one case covers the call path")
    cfg = tm.MoEConfig(8, 6, 8, 2, backend=backend, **CASES[name])
    torch.manual_seed(0)
    layer = tm.MoELayer(cfg, dtype=torch.float64)
    _randomize(layer, 1)
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    xn = x.detach().clone().requires_grad_()
    want, kept = naive.model_layer(xn, layer)
    params = dict(layer.named_parameters())
    grads = {n: p.grad.clone() for n, p in params.items()}
    layer.zero_grad(set_to_none=True)
    (want * g).sum().backward()
    assert layer.last_routing.topk_ids.tolist() == kept
    torch.testing.assert_close(out.detach(), want.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, xn.grad, rtol=1e-10, atol=1e-10)
    for n, p in params.items():
        assert p.grad is not None, n
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-10, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("ffn_path", ["fused", "unfused"])
def test_kernels_run_the_full_layer(ffn_path):
    """The Triton path (interpreter, fp32) of a layer with every option equals the reference
    backend to fp32 rounding: biases and the clamped SwiGLU are in the kernels."""
    torch.manual_seed(0)
    ref = tm.MoELayer(tm.MoEConfig(8, 6, 8, 2, backend="torch", **FULL))
    _randomize(ref, 2)
    tri = tm.MoELayer(tm.MoEConfig(8, 6, 8, 2, backend="triton", ffn_path=ffn_path, **FULL))
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(9, 8)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ref(xa), tri(xb)
    a.sum().backward()
    b.sum().backward()
    assert torch.equal(ref.last_routing.topk_ids, tri.last_routing.topk_ids)
    torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=2e-5, atol=2e-5)
    for (n, p), q in zip(ref.named_parameters(), tri.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=2e-5, atol=2e-5, msg=lambda m: f"{n}: {m}")


def test_fp32_router_on_bf16_activations():
    """router_dtype=float32: the router weight stays fp32 through layer.to(bfloat16), the logits
    are fp32 (routing decided on the fp32 product of the bf16 input)."""
    cfg = tm.MoEConfig(16, 8, 4, 2, router_dtype=torch.float32, router_bias=True, backend="torch")
    layer = tm.MoELayer(cfg).to(torch.bfloat16)
    assert layer.w1.dtype == torch.bfloat16
    assert layer.router.weight.dtype == torch.float32 and layer.router.bias.dtype == torch.float32
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and layer.router.weight.grad.dtype == torch.float32
    want = torch.nn.functional.linear(x.detach().float(), layer.router.weight, layer.router.bias)
    logits, routing = layer.route(x.detach())
    assert logits.dtype == torch.float32 and torch.equal(logits, want)
    assert torch.equal(routing.topk_ids, tm.route(want, 2).topk_ids)


def test_deepcopy_and_averaged_model_after_a_training_forward():
    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, aux_loss_coef=0.01, shared_d_ffn=4))
    x = torch.randn(5, 8)
    out = layer(x)
    assert layer.aux_loss.requires_grad
    clone = copy.deepcopy(layer)  # the aux loss holds the graph; the copy starts without it
    assert clone.last_routing is None and not clone.aux_loss.requires_grad
    for a, b in zip(layer.state_dict().values(), clone.state_dict().values()):
        assert torch.equal(a, b)
    avg = torch.optim.swa_utils.AveragedModel(layer)
    avg.update_parameters(layer)
    (out.sum() + layer.aux_loss).backward()  # the original's graph is intact
    torch.testing.assert_close(avg.module(x), clone(x), rtol=0, atol=0)


def test_expert_load_accumulates_without_sync():
    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, capacity_factor=1.0))
    assert torch.equal(layer.expert_load(), torch.zeros(4, dtype=torch.int64))
    total = torch.zeros(4, dtype=torch.int64)
    for T in (5, 9, 0, 3):
        layer(torch.randn(T, 8))
        total += layer.last_routing.counts.long()
    assert torch.equal(layer.expert_load(reset=True), total) and int(total.sum()) <= 17 * 2
    assert torch.equal(layer.expert_load(), torch.zeros(4, dtype=torch.int64))


def test_update_expert_bias_sign_rule():
    """bias += rate * sign(mean load - load), per layer, from the loads since the last update."""
    torch.manual_seed(0)
    layers = [tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, expert_bias=True)) for _ in range(2)]
    for layer in layers:
        layer(torch.randn(13, 8))
    loads = [layer.expert_load().clone() for layer in layers]
    out = tm.update_expert_bias(layers, rate=0.01)
    for layer, load, got in zip(layers, loads, out):
        assert torch.equal(got, load)
        want = 0.01 * torch.sign(load.double().mean() - load.double())
        torch.testing.assert_close(layer.expert_bias, want.float())
        assert torch.equal(layer.expert_load(), torch.zeros(4, dtype=torch.int64))  # consumed
    with pytest.raises(ValueError, match="rate=nan"):
        tm.update_expert_bias(layers, rate=math.nan)
    with pytest.raises(ValueError, match="expert_bias=True"):
        tm.update_expert_bias([tm.MoELayer(tm.MoEConfig(8, 6, 4, 2))], rate=0.01)
    layers[0].expert_bias[1] = math.inf  # a corrupt bias is refused, naming it; nothing is written
    others = layers[1].expert_bias.clone()
    with pytest.raises(ValueError, match=r"expert_bias\[0\]\[1\]=inf"):
        tm.update_expert_bias(layers, rate=0.01)
    assert torch.equal(layers[1].expert_bias, others) and layers[0].expert_bias[1] == math.inf


@pytest.mark.parametrize("bad, error, match", [
    (dict(routed_scaling_factor=-1.0), ValueError, "routed_scaling_factor=-1.0 must be finite and > 0"),
    (dict(group_score="sum"), ValueError, "group_score"),
    (dict(swiglu_limit=3.0), ValueError, "only apply to activation='swiglu_oai'"),
    (dict(shared_expert_gate=True), ValueError, "needs a shared expert"),
    (dict(shared_d_ffn=-2), ValueError, "shared_d_ffn=-2"),
    (dict(router_dtype="float32"), TypeError, "router_dtype='float32'"),
    (dict(expert_ffn_bias=1), TypeError, "expert_ffn_bias must be a bool"),
])
def test_bad_options(bad, error, match):
    with pytest.raises(error, match=match):
        tm.MoEConfig(8, 6, 4, 2, **bad)
