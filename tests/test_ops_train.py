"""The training custom ops ``tritonmoe::moe_ffn_train`` / ``grouped_ffn_train``: the forward
returns the activations backward needs (saved by the autograd registration), the backward op
takes them and reruns no GEMM. Checked against the eager ops' autograd: bitwise on the Triton
kernels (one shared backward), to rounding on the reference's fused form; opcheck of every op;
and that backward runs no forward GEMM (counted)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe import custom_ops as ops, reference

E, D, F = 4, 8, 6


def _case(dtype, T, k, act, bias, capacity, seed=0):
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * F if act.startswith("swiglu") else F
    mk = lambda *s: torch.randn(*s, dtype=dtype, generator=g).requires_grad_()  # noqa: E731
    r = tm.route(torch.randn(T, E, dtype=dtype, generator=g), k, capacity=capacity, backend="torch")
    w = r.topk_weights.detach().clone().requires_grad_()
    routing = tm.Routing(topk_ids=r.topk_ids, topk_weights=w, counts=r.counts, selected_counts=r.counts)
    x, w1, w2 = mk(T, D), mk(E, D, n1), mk(E, F, D)
    b1, b2 = (mk(E, n1), mk(E, D)) if bias else (None, None)
    kw = dict(swiglu_limit=0.8, swiglu_alpha=1.3) if act == "swiglu_oai" else {}
    dout = torch.randn(T, D, dtype=dtype, generator=g)
    return routing, x, w, w1, w2, b1, b2, kw, dout


CASES = [
    # backend, dtype, T, k, activation, biases, capacity, bitwise (the fused reference sums in another order)
    ("torch", torch.float64, 7, 2, "swiglu", True, 3, False),
    ("torch", torch.float64, 5, 1, "swiglu_oai", True, None, False),
    ("torch", torch.float64, 6, 2, "gelu", False, 1, False),
    ("torch", torch.float64, 0, 2, "swiglu", True, None, False),  # no tokens
    ("triton", torch.float32, 7, 2, "swiglu", True, 3, True),
    ("triton", torch.float32, 5, 1, "swiglu_oai", True, None, True),
    ("triton", torch.float32, 70, 2, "relu", False, None, True),  # past the decode path's T <= 64
]


@pytest.mark.parametrize("backend,dtype,T,k,act,bias,capacity,bitwise", CASES)
def test_train_ops_equal_eager_autograd(backend, dtype, T, k, act, bias, capacity, bitwise):
    routing, x, w, w1, w2, b1, b2, kw, dout = _case(dtype, T, k, act, bias, capacity)
    params = [t for t in (x, w, w1, w2, b1, b2) if t is not None]
    want = tm.moe_ffn(x, routing, w1, w2, act, b1, b2, backend=backend, **kw)
    want_g = torch.autograd.grad(want, params, dout, allow_unused=True)
    got = ops.moe_ffn_train(x, routing, w1, w2, act, b1, b2, backend=backend, **kw)
    got_g = torch.autograd.grad(got, params, dout, allow_unused=True)
    assert torch.equal(got, want)
    for name, a, b in zip(("x", "w", "w1", "w2", "b1", "b2"), got_g, want_g):
        b = torch.zeros_like(a) if b is None else b
        if bitwise:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=lambda m: f"{name}: {m}")
    # the grouped FFN on the permuted rows of the same routing (a buffer with a zero tail)
    xp, info = tm.permute(x.detach(), routing.topk_ids, E, num_rows=T * k + 3, backend=backend)
    xp.requires_grad_()
    params = [t for t in (xp, w1, w2, b1, b2) if t is not None]
    dy = torch.randn(xp.shape, dtype=dtype)
    want = tm.grouped_ffn(xp, info.expert_offsets, w1, w2, act, b1, b2, backend=backend, **kw)
    want_g = torch.autograd.grad(want, params, dy)
    got = ops.grouped_ffn_train(xp, info.expert_offsets, w1, w2, act, b1, b2, backend=backend, **kw)
    got_g = torch.autograd.grad(got, params, dy)
    assert torch.equal(got, want)
    for a, b in zip(got_g, want_g):
        assert torch.equal(a, b)


@settings(max_examples=15)
@given(T=st.integers(0, 9), k=st.integers(1, 3), act=st.sampled_from(["swiglu", "swiglu_oai", "gelu", "relu"]),
       bias=st.booleans(), capacity=st.none() | st.integers(1, 4), seed=st.integers(0, 2**16))
def test_train_ops_property_reference(T, k, act, bias, capacity, seed):
    """Any routing (ragged experts, dropped slots, no tokens): the reference's training ops equal
    the autograd of the eager ops (fp64, to rounding), output bitwise."""
    routing, x, w, w1, w2, b1, b2, kw, dout = _case(torch.float64, T, k, act, bias, capacity, seed)
    params = [t for t in (x, w, w1, w2, b1, b2) if t is not None]
    want = tm.moe_ffn(x, routing, w1, w2, act, b1, b2, backend="torch", **kw)
    got = ops.moe_ffn_train(x, routing, w1, w2, act, b1, b2, backend="torch", **kw)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, params, dout), torch.autograd.grad(want, params, dout)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_train_ops_needs_input_grad():
    """Only the gradients autograd asks for are computed (x without grad: no dx; frozen w1)."""
    routing, x, w, w1, w2, b1, b2, kw, dout = _case(torch.float64, 6, 2, "swiglu", True, None)
    x.requires_grad_(False)
    w1.requires_grad_(False)
    out = ops.moe_ffn_train(x, routing, w1, w2, "swiglu", b1, b2, backend="torch")
    got = torch.autograd.grad(out, [w, w2, b1, b2], dout)
    want = torch.autograd.grad(tm.moe_ffn(x, routing, w1, w2, "swiglu", b1, b2, backend="torch"), [w, w2, b1, b2], dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_backward_reruns_no_gemm(monkeypatch):
    """The recomputing op's backward runs the forward GEMM again; the training op's does not
    (calls of the reference's grouped GEMM counted during backward)."""
    routing, x, w, w1, w2, b1, b2, kw, dout = _case(torch.float64, 6, 2, "swiglu", True, None)
    calls = []
    real = reference._grouped_gemm_acc

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "_grouped_gemm_acc", counting)
    for fn, want_calls in ((ops.moe_ffn, 2), (ops.moe_ffn_train, 0)):
        out = fn(x, routing, w1, w2, "swiglu", b1, b2, backend="torch")
        calls.clear()
        out.backward(dout)
        assert len(calls) == want_calls, (fn.__name__, len(calls))


def test_opcheck_train_ops():
    routing, x, w, w1, w2, b1, b2, kw, dout = _case(torch.float64, 6, 2, "swiglu_oai", True, None)
    for biases in ((b1, b2), (None, None)):
        torch.library.opcheck(torch.ops.tritonmoe.moe_ffn_train.default,
                              (x, routing.topk_ids, w, routing.counts, w1, w2, *biases, "swiglu_oai", 0.8, 1.3,
                               "torch"))
    xp, info = tm.permute(x.detach(), routing.topk_ids, E, num_rows=15, backend="torch")
    xp.requires_grad_()
    for biases in ((b1, b2), (b1, None)):
        torch.library.opcheck(torch.ops.tritonmoe.grouped_ffn_train.default,
                              (xp, info.expert_offsets, w1, w2, *biases, "swiglu_oai", 0.8, 1.3, "torch"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [16, 600])  # the decode path, the prefill path
def test_gpu_train_ops_equal_eager_kernels_bitwise(dtype, T):
    """On CUDA: the training ops' gradients are the eager kernels' bit for bit (one backward)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    E_, D_, F_, k = 8, 256, 128, 2
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.1).to(dtype).requires_grad_()  # noqa: E731
    r = tm.route(torch.randn(T, E_, device="cuda", generator=g), k, backend="triton")
    w = r.topk_weights.detach().clone().requires_grad_()
    routing = tm.Routing(topk_ids=r.topk_ids, topk_weights=w, counts=r.counts, selected_counts=r.counts)
    x, w1, w2, b1, b2 = mk(T, D_), mk(E_, D_, 2 * F_), mk(E_, F_, D_), mk(E_, 2 * F_), mk(E_, D_)
    dout = torch.randn(T, D_, device="cuda", generator=g).to(dtype)
    params = [x, w, w1, w2, b1, b2]
    want = tm.moe_ffn(x, routing, w1, w2, "swiglu", b1, b2, backend="triton")
    want_g = torch.autograd.grad(want, params, dout)
    got = ops.moe_ffn_train(x, routing, w1, w2, "swiglu", b1, b2, backend="triton")
    got_g = torch.autograd.grad(got, params, dout)
    assert torch.equal(got, want)
    for name, a, b in zip(("x", "w", "w1", "w2", "b1", "b2"), got_g, want_g):
        assert torch.equal(a, b), name
    xp, info = tm.permute(x.detach(), routing.topk_ids, E_, num_rows=T * k, backend="triton")
    xp.requires_grad_()
    dy = torch.randn(xp.shape, device="cuda", generator=g).to(dtype)
    want = tm.grouped_ffn(xp, info.expert_offsets, w1, w2, "swiglu", b1, b2, backend="triton")
    want_g = torch.autograd.grad(want, [xp, w1, w2, b1, b2], dy)
    got = ops.grouped_ffn_train(xp, info.expert_offsets, w1, w2, "swiglu", b1, b2, backend="triton")
    got_g = torch.autograd.grad(got, [xp, w1, w2, b1, b2], dy)
    assert torch.equal(got, want)
    for a, b in zip(got_g, want_g):
        assert torch.equal(a, b)
