"""Meta tensors: a layer built and run on the meta device (shape inference, deferred
initialization) gives outputs and gradients of the right shapes on every backend, and the
functional API checks shapes (not values) there."""

from __future__ import annotations

import pytest
import torch

import tritonmoe as tm

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ffn_path", ["fused", "unfused"])
def test_layer_on_meta(backend, ffn_path):
    cfg = tm.MoEConfig(16, 24, 4, 2, backend=backend, ffn_path=ffn_path, aux_loss_coef=0.01, z_loss_coef=0.001,
                       expert_bias=True, capacity_factor=1.25)
    layer = tm.MoELayer(cfg, device="meta", dtype=torch.float32)
    x = torch.randn(2, 5, 16, device="meta", requires_grad=True)
    out = layer(x)
    (out.sum() + layer.aux_loss).backward()
    assert out.is_meta and out.shape == x.shape and out.dtype == x.dtype
    assert x.grad.shape == x.shape
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.is_meta and p.grad.shape == p.shape, name
    r = layer.last_routing
    assert r.topk_ids.shape == (10, 2) and r.topk_ids.dtype == torch.int32 and r.counts.shape == (4,)


def test_deferred_init_equals_eager_init():
    """Meta construction, then to_empty + reset_parameters from the same seed: the same weights
    as a layer built on the CPU (initialization does not depend on where the layer was built)."""
    cfg = tm.MoEConfig(8, 12, 4, 2)
    torch.manual_seed(3)
    eager = tm.MoELayer(cfg)
    lazy = tm.MoELayer(cfg, device="meta")
    assert all(p.is_meta for p in lazy.parameters())
    lazy = lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.reset_parameters()
    for (n, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), n
    x = torch.randn(6, 8)
    torch.testing.assert_close(lazy(x), eager(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_ops_on_meta(backend):
    """Shapes and dtypes of every op's outputs on meta, validation on (shape checks still run)."""
    T, d, E, k, f = 5, 8, 4, 2, 6
    m = dict(device="meta")
    logits = torch.randn(T, E, **m)
    r = tm.route(logits, k, backend=backend)
    assert r.topk_ids.shape == (T, k) and r.topk_weights.dtype == torch.float32
    x = torch.randn(T, d, **m)
    xp, info = tm.permute(x, r.topk_ids, E, backend=backend)
    assert xp.shape == (T * k, d) and info.slot_rows.shape == (T, k) and info.expert_offsets.shape == (E + 1,)
    xp, info = tm.permute(x, r.topk_ids, E, pad_to=4, num_rows=40, backend=backend)
    assert xp.shape == (40, d)
    w1, w2 = torch.randn(E, d, 2 * f, **m), torch.randn(E, f, d, **m)
    y = tm.grouped_ffn(xp, info.expert_offsets, w1, w2, backend=backend)
    assert y.shape == (40, d)
    assert tm.unpermute(y, info, r.topk_weights, backend=backend).shape == (T, d)
    assert tm.moe_ffn(x, r, w1, w2, backend=backend).shape == (T, d)
    assert tm.grouped_gemm(xp, info.expert_offsets, w1, backend=backend).shape == (40, 2 * f)
    with pytest.raises(ValueError, match="inner dimensions must match"):  # shape checks still apply
        tm.moe_ffn(torch.randn(T, d + 1, **m), r, w1, w2, backend=backend)
