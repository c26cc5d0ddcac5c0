"""MoEConfig and the single-device MoELayer against the naive per-token layer of tests/naive.py."""

from __future__ import annotations

import math

import pytest
import torch

import tritonmoe as tm
from tritonmoe import reference as ref

import naive

# Why each case exists: every activation; both score functions; renormalization off; capacity
# dropping (tight and generous); group-limited routing; k = E; E = 1; prime E; the bias.
LAYER_CASES = {
    "swiglu softmax": dict(activation="swiglu"),
    "gelu sigmoid": dict(activation="gelu", score_func="sigmoid"),
    "relu no-renorm": dict(activation="relu", renormalize=False),
    "capacity tight": dict(capacity_factor=0.5),
    "capacity generous": dict(capacity_factor=1.25, activation="gelu"),
    "groups": dict(num_experts=6, n_groups=3, topk_groups=2, top_k=3, score_func="sigmoid"),
    "k = E": dict(num_experts=3, top_k=3),
    "E = 1": dict(num_experts=1, top_k=1),
    "prime E": dict(num_experts=7, top_k=2, capacity_factor=1.0),
    "bias": dict(expert_bias=True, score_func="sigmoid"),
}


def _layer(dtype=torch.float64, device="cpu", seed=0, **over):
    base = dict(d_model=6, d_ffn=5, num_experts=4, top_k=2)
    base.update(over)
    torch.manual_seed(seed)
    return tm.MoELayer(tm.MoEConfig(**base), dtype=dtype, device=device)


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_forward_backward_match_naive_fp64(name):
    layer = _layer(**LAYER_CASES[name])
    if layer.expert_bias is not None:
        layer.expert_bias.copy_(torch.tensor([0.5, 0.0, -0.25, 0.125]))
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == x.dtype

    x2 = x.detach().clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) for p in (layer.router.weight, layer.w1, layer.w2)]
    expect, kept = naive.moe_layer(x2.view(-1, 6), *params, layer.config, expert_bias=layer.expert_bias)
    assert layer.last_routing.topk_ids.tolist() == kept
    torch.testing.assert_close(out.view(-1, 6), expect, rtol=1e-10, atol=1e-12)

    g = torch.randn_like(out)
    out.backward(g)
    expect.backward(g.view(-1, 6))
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-12)
    for p, q in zip((layer.router.weight, layer.w1, layer.w2), params):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def _devices():
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


# bf16 keeps 8 bits of mantissa: 2^-8 relative per rounding, a few roundings deep.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_layer_low_precision(device, dtype):
    layer = _layer(dtype=dtype, device=device, d_model=16, d_ffn=24, num_experts=5, top_k=2)
    x = torch.randn(13, 16, dtype=dtype, device=device)
    out = layer(x)
    assert out.dtype == dtype
    params = [p.detach().double().cpu() for p in (layer.router.weight, layer.w1, layer.w2)]
    # route on the layer's own logits so a near-tie rounded differently cannot change experts
    logits = layer.router(x).double().cpu()
    ids, weights, _, _ = naive.route(logits, 2)
    expect = torch.zeros(13, 16, dtype=torch.float64)
    for t in range(13):
        for j, e in enumerate(ids[t]):
            expect[t] += weights[t][j] * naive.expert_ffn(x[t].double().cpu(), params[1][e], params[2][e], "swiglu")
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double().cpu(), expect, rtol=rtol, atol=atol)


def test_aux_loss():
    layer = _layer(dtype=torch.float64, aux_loss_coef=0.01, z_loss_coef=0.001, capacity_factor=1.0)
    x = torch.randn(9, 6, dtype=torch.float64)
    layer(x)
    logits = layer.router(x)
    r = ref.route(logits, 2, capacity=layer.config.capacity(9))
    expect = 0.01 * ref.load_balancing_loss(logits, r) + 0.001 * ref.z_loss(logits)
    torch.testing.assert_close(layer.aux_loss, expect)
    layer.aux_loss.backward()
    assert layer.router.weight.grad is not None and float(layer.router.weight.grad.abs().sum()) > 0
    plain = _layer()
    plain(x)
    assert plain.aux_loss.shape == () and float(plain.aux_loss) == 0.0


def test_zero_and_one_token_and_noncontiguous():
    layer = _layer()
    empty = torch.zeros(0, 6, dtype=torch.float64, requires_grad=True)
    out = layer(empty)
    assert out.shape == (0, 6)
    out.sum().backward()
    one = torch.randn(1, 6, dtype=torch.float64)
    torch.testing.assert_close(layer(one), naive.moe_layer(one, layer.router.weight, layer.w1, layer.w2, layer.config)[0])
    base = torch.randn(6, 12, dtype=torch.float64)
    x = base[:, ::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x), layer(x.contiguous()))


def test_all_tokens_to_one_expert_and_empty_experts():
    layer = _layer(num_experts=5)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3] = 10.0  # everyone prefers expert 3 (x has positive entries)
    x = torch.rand(7, 6, dtype=torch.float64) + 0.1
    layer(x)
    r = layer.last_routing
    assert bool((r.topk_ids[:, 0] == 3).all())
    assert r.counts.tolist().count(0) >= 1


def test_parameters_and_init():
    layer = _layer(dtype=torch.float32, d_model=64, d_ffn=32, num_experts=3)
    assert tuple(layer.w1.shape) == (3, 64, 64) and tuple(layer.w2.shape) == (3, 32, 64)
    assert tuple(layer.router.weight.shape) == (3, 64) and layer.router.bias is None
    assert float(layer.w1.detach().abs().max()) <= 1 / math.sqrt(64)
    assert float(layer.w2.detach().abs().max()) <= 1 / math.sqrt(32)
    gelu = _layer(activation="gelu")
    assert gelu.w1.shape[-1] == gelu.config.d_ffn
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"router.weight", "w1", "w2"}


def test_config_capacity_and_groups():
    cfg = tm.MoEConfig(8, 16, 4, 2, capacity_factor=1.1)
    assert cfg.capacity(20) == 11  # ceil(1.1 * 20 * 2 / 4) = 11, exactly
    assert tm.MoEConfig(8, 16, 4, 2).capacity(20) is None
    with pytest.raises(ValueError, match="topk_groups"):
        tm.MoEConfig(8, 16, 4, 2, n_groups=2)
    with pytest.raises(ValueError, match="activation"):
        tm.MoEConfig(8, 16, 4, 2, activation="silu")


def test_capacity_is_exact_decimal_arithmetic():
    """ceil(cf * T * k / E) with cf read as the decimal it prints as, for every T up to 100 and
    factors whose float products round the wrong way (1.1 * 20 = 22.000000000000004)."""
    from fractions import Fraction

    for cf in (0.5, 1.0, 1.1, 1.25, 2 / 3, 3.7, 0.001):
        for E, k in ((6, 2), (7, 3), (64, 8)):
            cfg = tm.MoEConfig(8, 16, E, k, capacity_factor=cf)
            for T in range(101):
                assert cfg.capacity(T) == math.ceil(Fraction(repr(cf)) * T * k / E), (cf, E, k, T)


def test_capacity_of_a_dynamic_batch_size():
    """Under torch.compile with dynamic shapes the token count is a SymInt; capacity() traces
    (it used to fail on Fraction arithmetic) and gives the eager values for every batch size."""
    cfg = tm.MoEConfig(8, 16, 4, 2, capacity_factor=1.1)
    f = torch.compile(lambda x: x.new_zeros(cfg.capacity(x.shape[0])), backend="eager", fullgraph=True, dynamic=True)
    for T in (20, 37, 3, 91):
        assert f(torch.zeros(T)).shape[0] == cfg.capacity(T)
