"""Double backward (issue 35, item 4): a gradient penalty through every op is either exact
(backend "torch", every dtype: checked by gradgradcheck in fp64, and in fp32 against the fp64
result) or raises NotTwiceDifferentiableError naming the op and the fix (the Triton kernels, the
custom ops of torch.compile, the schedules). Never a silent None."""

import pytest
import torch

import tritonmoe as tm
from tritonmoe.core.autograd import NotTwiceDifferentiableError, first_order
from conftest import INTERPRETER_ON

T, K, E, D, F = 4, 2, 3, 2, 2
needs_interp = pytest.mark.skipif(not INTERPRETER_ON, reason="the Triton backend on CPU needs the interpreter")


def _routing(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=dtype)
    return logits, tm.route(logits, K, backend="torch")


def _case(op, dtype, backend, seed=0):
    """(fn, inputs): fn(*inputs) is the op on ``backend`` with every float input differentiable."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    logits, routing = _routing()
    x = r(T, D)
    if op == "permute":
        return (lambda x: tm.permute(x, routing.topk_ids, E, backend=backend)[0]), (x,)
    _, info = tm.permute(x.detach(), routing.topk_ids, E, backend="torch")
    R = int(info.expert_offsets[-1])
    if op == "unpermute":
        return (lambda y, w: tm.unpermute(y, info, w, backend=backend)), (r(R, D), r(T, K))
    if op == "grouped_gemm":
        return (lambda x, w, b: tm.grouped_gemm(x, info.expert_offsets, w, b, backend=backend)), (
            r(R, D), r(E, D, F), r(E, F))
    if op == "grouped_ffn":
        return (lambda x, w1, w2: tm.grouped_ffn(x, info.expert_offsets, w1, w2, "gelu", backend=backend)), (
            r(R, D), r(E, D, F), r(E, F, D))
    if op == "moe_ffn":
        ids, counts = routing.topk_ids, routing.counts

        def fn(x, w, w1, w2):
            rt = tm.Routing(topk_ids=ids, topk_weights=w, counts=counts, selected_counts=counts)
            return tm.moe_ffn(x, rt, w1, w2, "swiglu", backend=backend)
        return fn, (x, r(T, K), r(E, D, 2 * F), r(E, F, D))
    if op == "route":
        return (lambda lg: tm.route(lg, K, backend=backend).topk_weights), (r(T, E),)
    raise KeyError(op)


OPS = ["permute", "unpermute", "grouped_gemm", "grouped_ffn", "moe_ffn", "route"]


def _penalty_grads(fn, inputs, quadratic=False):
    """The issue's probe: g = d<fn(x), c>/d(inputs[0]) with create_graph, then d|g|^2/d(all).
    ``quadratic``: <fn(x), c> + |fn(x)|^2 / 2 instead (a cotangent that depends on x)."""
    out = fn(*inputs)
    c = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    loss = (out * c).sum() + (out.pow(2).sum() / 2 if quadratic else 0)
    (gx,) = torch.autograd.grad(loss, inputs[0], create_graph=True)
    return torch.autograd.grad(gx.pow(2).sum(), inputs, allow_unused=True)


@pytest.mark.parametrize("op", OPS)
def test_reference_backend_is_twice_differentiable_fp64(op):
    fn, inputs = _case(op, torch.float64, "torch")
    assert torch.autograd.gradgradcheck(fn, inputs, atol=1e-6, rtol=1e-5, fast_mode=True)
    grads = _penalty_grads(fn, inputs, quadratic=op == "permute")
    # (a None is a true zero here: gradgradcheck above checked every second-order term)
    assert any(g is not None and g.abs().sum() > 0 for g in grads), grads


@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_ffn", "moe_ffn"])
def test_reference_backend_fp32_second_order_matches_fp64(op):
    want = _penalty_grads(*_case(op, torch.float64, "torch"))
    got = _penalty_grads(*_case(op, torch.float32, "torch"))
    for w, g in zip(want, got):
        assert (w is None) == (g is None)
        if w is not None:
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)


@needs_interp
@pytest.mark.parametrize("op", ["permute", "unpermute"])
def test_triton_row_movers_are_twice_differentiable(op):
    """The permute kernels' backward passes are each other's kernels (and a few torch ops) under
    create_graph: gradgradcheck in fp64 (the row movers' kernels run in every dtype), and the
    penalty's gradients equal the reference's in fp32."""
    assert torch.autograd.gradgradcheck(*_case(op, torch.float64, "triton"), atol=1e-6, rtol=1e-5, fast_mode=True)
    for quadratic in (False, True):
        want = _penalty_grads(*_case(op, torch.float32, "torch"), quadratic=quadratic or op == "permute")
        got = _penalty_grads(*_case(op, torch.float32, "triton"), quadratic=quadratic or op == "permute")
        assert any(w is not None for w in want)
        for w, g in zip(want, got):
            assert (w is None) == (g is None), (w, g)
            if w is not None:
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@needs_interp
@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_ffn", "moe_ffn", "route"])
def test_triton_backend_raises_not_twice_differentiable(op):
    fn, inputs = _case(op, torch.float32, "triton")
    # the first-order gradient under create_graph equals the plain one
    out = fn(*inputs)
    c = torch.linspace(-1, 1, out.numel()).view_as(out)
    (plain,) = torch.autograd.grad((out * c).sum(), inputs[0], retain_graph=True)
    (gx,) = torch.autograd.grad((out * c).sum(), inputs[0], create_graph=True)
    torch.testing.assert_close(gx.detach(), plain, rtol=0, atol=0)
    assert gx.requires_grad  # never a silent constant
    with pytest.raises(NotTwiceDifferentiableError, match=r"not twice differentiable.*backend='torch'") as ei:
        torch.autograd.grad(gx.pow(2).sum(), inputs, allow_unused=True)
    assert f"{op} (Triton)" in str(ei.value)
    assert isinstance(ei.value, RuntimeError)


@pytest.mark.parametrize("name,call", [
    ("grouped_gemm_backward", lambda x, off, w: torch.ops.tritonmoe.grouped_gemm(x, off, w, None, "torch")),
    ("grouped_ffn_backward", lambda x, off, w: torch.ops.tritonmoe.grouped_ffn(
        x, off, w, w.transpose(1, 2).contiguous(), None, None, "gelu", 7.0, 1.702, "torch")),
])
def test_custom_ops_raise_not_twice_differentiable(name, call):
    import tritonmoe.custom_ops  # noqa: F401  (registers torch.ops.tritonmoe)
    off = torch.tensor([0, 2, 2, 4])
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(E, 3, 3, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(call(x, off, w).sum(), x, create_graph=True)
    with pytest.raises(NotTwiceDifferentiableError, match=rf"tritonmoe::{name} .*eagerly.*backend='torch'"):
        torch.autograd.grad(gx.pow(2).sum(), w)


def _layer(backend, dtype=torch.float64):
    torch.manual_seed(0)
    cfg = tm.MoEConfig(d_model=D, d_ffn=F, num_experts=E, top_k=K, backend=backend)
    return tm.MoELayer(cfg).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_gradient_penalty_reference_is_exact(dtype):
    layer = _layer("torch", dtype)
    x = torch.randn(T, D, dtype=dtype, requires_grad=True)
    out = layer(x)
    (gx,) = torch.autograd.grad(out.pow(3).sum(), x, create_graph=True)
    grads = torch.autograd.grad(gx.pow(2).sum(), list(layer.parameters()), allow_unused=True)
    assert all(g is not None and torch.isfinite(g).all() for g in grads[:1])
    # against the plain composition of the same computation by torch.func (an independent path)
    params = dict(layer.named_parameters())

    def penalty(p):
        def f(xx):
            return torch.func.functional_call(layer, p, (xx,)).pow(3).sum()
        return torch.func.grad(f)(x.detach()).pow(2).sum()
    want = torch.func.grad(penalty)(params)
    for (name, _), g in zip(layer.named_parameters(), grads):
        torch.testing.assert_close(g if g is not None else torch.zeros_like(want[name]), want[name])


@needs_interp
def test_layer_gradient_penalty_triton_raises():
    layer = _layer("triton", torch.float32)
    x = torch.randn(T, D, requires_grad=True)
    (gx,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(NotTwiceDifferentiableError, match="not twice differentiable"):
        torch.autograd.grad(gx.pow(2).sum(), list(layer.parameters()), allow_unused=True)


def test_first_order_guard_is_plain_outside_create_graph_and_lazy_inside():
    calls = []

    class Sq(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @first_order("sq")
        def backward(ctx, g):
            calls.append(torch.is_grad_enabled())
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = torch.tensor([3.0], requires_grad=True)
    (g,) = torch.autograd.grad(Sq.apply(x).sum(), x)
    assert g.item() == 6.0 and not g.requires_grad and calls == [False]
    (g,) = torch.autograd.grad(Sq.apply(x).sum(), x, create_graph=True)  # not differentiated again: fine
    assert g.item() == 6.0 and g.requires_grad and calls[-1] is False
    with pytest.raises(NotTwiceDifferentiableError, match="tritonmoe: sq is not twice differentiable"):
        g.backward()
    # a linear op (nothing saved that requires grad) under a constant cotangent: its gradient is
    # truly a constant, returned without a graph and without an error

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        @first_order("twice")
        def backward(ctx, g):
            return 2 * g

    (g,) = torch.autograd.grad(Twice.apply(x).sum(), x, create_graph=True)
    assert g.item() == 2.0 and not g.requires_grad



def test_vmap_over_the_layer_is_a_clear_error():
    layer = _layer("torch", torch.float32)
    with pytest.raises(NotImplementedError, match=r"MoELayer does not support torch.vmap.*functional_call"):
        torch.vmap(layer)(torch.randn(2, T, D))
