"""The public functional API: validation at the boundary, backend selection, gradients."""

from __future__ import annotations

import pytest
import torch

import tritonmoe as tm
from tritonmoe.core import settings as _settings
from tritonmoe import backends as dispatch
from tritonmoe import reference as ref


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.int64)


X = torch.randn(4, 8)
LOGITS = torch.randn(4, 6)
IDS = _ids([0, 1], [2, 3], [4, 5], [0, 5])
OFFS = torch.tensor([0, 2, 4])
W = torch.randn(2, 8, 3)
W1 = torch.randn(2, 8, 6)
W2 = torch.randn(2, 3, 8)

# (name, call, expected error type, a fragment the message must contain)
BAD_INPUTS = [
    ("top_k > E", lambda: tm.route(LOGITS, 7), ValueError, "top_k=7"),
    ("top_k = 0", lambda: tm.route(LOGITS, 0), ValueError, "top_k=0"),
    ("top_k float", lambda: tm.route(LOGITS, 2.0), TypeError, "top_k"),
    ("logits 3-D", lambda: tm.route(LOGITS.unsqueeze(0), 2), ValueError, "2-D"),
    ("logits int", lambda: tm.route(LOGITS.long(), 2), TypeError, "int64"),
    ("E not divisible by n_groups", lambda: tm.route(LOGITS, 2, n_groups=4, topk_groups=2), ValueError, "n_groups=4"),
    ("topk_groups > n_groups", lambda: tm.route(LOGITS, 2, n_groups=3, topk_groups=4), ValueError, "topk_groups=4"),
    ("topk_groups without n_groups", lambda: tm.route(LOGITS, 2, topk_groups=1), ValueError, "topk_groups=1"),
    ("groups too few for k", lambda: tm.route(LOGITS, 4, n_groups=3, topk_groups=1), ValueError, "top_k=4"),
    ("bad score_func", lambda: tm.route(LOGITS, 2, score_func="tanh"), ValueError, "tanh"),
    ("bias wrong shape", lambda: tm.route(LOGITS, 2, expert_bias=torch.zeros(5)), ValueError, "[6]"),
    ("negative capacity", lambda: tm.route(LOGITS, 2, capacity=-1), ValueError, "capacity=-1"),
    ("NaN logits", lambda: tm.route(torch.tensor([[0.0, float("nan")]]), 1), ValueError, "NaN"),
    ("+inf logits under softmax", lambda: tm.route(torch.tensor([[0.0, float("inf")]]), 1), ValueError, "+inf"),
    ("all -inf row under softmax", lambda: tm.route(torch.full((2, 3), float("-inf")), 1), ValueError, "token 0"),
    ("unknown backend", lambda: tm.route(LOGITS, 2, backend="cuda"), ValueError, "cuda"),
    ("bad group_score", lambda: tm.route(LOGITS, 2, n_groups=2, topk_groups=1, group_score="sum"), ValueError,
     "group_score='sum'"),
    ("routed_scaling_factor 0", lambda: tm.route(LOGITS, 2, routed_scaling_factor=0.0), ValueError,
     "routed_scaling_factor=0.0"),
    ("routed_scaling_factor NaN", lambda: tm.route(LOGITS, 2, routed_scaling_factor=float("nan")), ValueError,
     "finite"),
    ("routed_scaling_factor str", lambda: tm.route(LOGITS, 2, routed_scaling_factor="2.5"), TypeError,
     "routed_scaling_factor"),
    ("id == E", lambda: tm.permute(X, _ids([0, 6], [1, 2], [3, 4], [5, 0]), 6), IndexError, "6"),
    ("id == -2", lambda: tm.permute(X, _ids([0, -2], [1, 2], [3, 4], [5, 0]), 6), IndexError, "-2"),
    ("id 2**40 (no wrap)", lambda: tm.permute(X, _ids([0, 2**40], [1, 2], [3, 4], [5, 0]), 6), IndexError, str(2**40)),
    ("float ids", lambda: tm.permute(X, IDS.float(), 6), TypeError, "float32"),
    ("ids rows != tokens", lambda: tm.permute(X, IDS[:3], 6), ValueError, "3 rows"),
    ("pad_to = 0", lambda: tm.permute(X, IDS, 6, pad_to=0), ValueError, "pad_to=0"),
    ("weights shape", lambda: tm.unpermute(*_perm_and(torch.rand(4, 3))), ValueError, "[T, k]"),
    ("offsets not monotone", lambda: tm.grouped_gemm(X, torch.tensor([0, 3, 2]), W), ValueError, "not monotone"),
    ("offsets[E] > R", lambda: tm.grouped_gemm(X, torch.tensor([0, 2, 5]), W), ValueError, "offsets[E]=5"),
    ("offsets float", lambda: tm.grouped_gemm(X, OFFS.float(), W), TypeError, "float32"),
    ("offsets count != E+1", lambda: tm.grouped_gemm(X, torch.tensor([0, 4]), W), ValueError, "expected 3"),
    ("K mismatch", lambda: tm.grouped_gemm(X, OFFS, torch.randn(2, 7, 3)), ValueError, "K=7"),
    ("dtype mix", lambda: tm.grouped_gemm(X, OFFS, W.double()), TypeError, "float64"),
    ("w1/w2 expert counts", lambda: tm.grouped_ffn(X, OFFS, W1, torch.randn(3, 3, 8)), ValueError, "3"),
    ("swiglu w1 width", lambda: tm.grouped_ffn(X, OFFS, W1, torch.randn(2, 6, 8)), ValueError, "12"),
    ("bad activation", lambda: tm.grouped_ffn(X, OFFS, W1, W2, "tanh"), ValueError, "tanh"),
    ("config top_k > E", lambda: tm.MoEConfig(8, 16, 4, 5), ValueError, "top_k=5"),
    ("config capacity_factor <= 0", lambda: tm.MoEConfig(8, 16, 4, 2, capacity_factor=0.0), ValueError, "capacity_factor"),
    ("config d_model float", lambda: tm.MoEConfig(8.0, 16, 4, 2), TypeError, "d_model"),
    ("config negative aux coef", lambda: tm.MoEConfig(8, 16, 4, 2, aux_loss_coef=-1.0), ValueError, "aux_loss_coef"),
    ("layer input width", lambda: tm.MoELayer(tm.MoEConfig(8, 16, 4, 2))(torch.randn(3, 7)), ValueError, "d_model=8"),
    ("layer input dtype", lambda: tm.MoELayer(tm.MoEConfig(8, 16, 4, 2))(torch.randn(3, 8).double()), TypeError, "float64"),
]


def _perm_and(weights):
    x_perm, info = tm.permute(X, IDS, 6)
    return x_perm, info, weights


@pytest.mark.parametrize("name,call,exc,fragment", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_typed_errors(name, call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value), str(info.value)


def test_value_checks_can_be_switched_off():
    bad = _ids([0, 1], [2, 3], [4, 5], [0, 7])
    with pytest.raises(IndexError):
        tm.permute(X, bad, 8 - 2)
    nan_logits = torch.tensor([[0.0, float("nan"), 1.0]])
    with tm.validation(False):
        assert not tm.validation_enabled()
        r = tm.route(nan_logits, 1, score_func="sigmoid")  # NaN ranks as -inf: expert 2 wins
        assert r.topk_ids.tolist() == [[2]]
        # under softmax selection compares the logits too (the NaN one ranks last, expert 2
        # wins), but one NaN logit makes every weight of the row NaN (loud, not silently wrong)
        r = tm.route(nan_logits, 1, renormalize=False)
        assert r.topk_ids.tolist() == [[2]] and bool(torch.isnan(r.topk_weights).all())
        # shape and dtype checks still run
        with pytest.raises(TypeError):
            tm.permute(X, IDS.float(), 6)
    assert tm.validation_enabled()


def test_backend_selection():
    with tm.use_backend("torch"):
        assert tm.get_backend() == "torch"
        assert dispatch.implementation("route", None, torch.device("cpu")) is ref.route
    # auto on CPU tensors uses the reference
    assert dispatch.implementation("permute", "auto", torch.device("cpu")) is ref.permute
    # fp64 runs the reference on every backend for the tensor-core ops, not for row movers
    for op in ("route", "grouped_gemm", "grouped_ffn", "moe_ffn"):
        assert dispatch.implementation(op, "triton", torch.device("cuda"), torch.float64) is dispatch.OPS[op].reference
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.implementation("matmul", "auto", torch.device("cpu"))
    prev = tm.set_backend("auto")
    assert tm.set_backend(prev) == "auto"
    with pytest.raises(ValueError, match="not a backend"):
        tm.set_backend("cudnn")
    with pytest.raises(TypeError):
        tm.set_validation(1)


def test_triton_backend_errors_are_clear(monkeypatch):
    """Without a kernel for the op the error names the op; on CPU without the interpreter it
    names TRITON_INTERPRET."""
    monkeypatch.setattr(dispatch, "kernel", lambda op: None)
    with pytest.raises(NotImplementedError, match="'route'"):
        tm.route(LOGITS, 2, backend="triton")
    monkeypatch.setattr(dispatch, "kernel", lambda op: ref.route)
    monkeypatch.setattr(_settings, "TRITON_INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        tm.route(LOGITS, 2, backend="triton")


def test_env_var_parsing():
    assert _settings._parse_backend(" Torch ", "X") == "torch"
    with pytest.raises(ValueError, match="TRITONMOE_BACKEND"):
        _settings._parse_backend("gpu", "TRITONMOE_BACKEND")
    assert _settings._parse_bool("0", "X") is False
    with pytest.raises(ValueError):
        _settings._parse_bool("maybe", "TRITONMOE_VALIDATE")


def test_offsets_may_be_int32_or_int64():
    for dt in (torch.int32, torch.int64):
        out = tm.grouped_gemm(X, OFFS.to(dt), W)
        torch.testing.assert_close(out, torch.cat([X[:2] @ W[0], X[2:] @ W[1]]))


# ---------------------------------------------------------------------------------------------
# fp64 gradcheck of every op
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gradcheck_route(score_func, renormalize):
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)

    def f(lg):
        r = tm.route(lg, 2, score_func=score_func, renormalize=renormalize, capacity=2, with_aux=True)
        return r.topk_weights, tm.load_balancing_loss(lg, r), tm.z_loss(lg, r)

    assert torch.autograd.gradcheck(f, (logits,))


def test_gradcheck_permute_unpermute():
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    ids = _ids([0, 2], [1, -1], [2, 0], [0, 1], [-1, -1])
    w = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)

    def f(x, w):
        x_perm, info = tm.permute(x, ids, 3, pad_to=4)
        return tm.unpermute(x_perm * 1.5, info, w)

    assert torch.autograd.gradcheck(f, (x, w))


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu"])
def test_gradcheck_grouped_ffn(activation):
    g = torch.Generator().manual_seed(1)
    offs = torch.tensor([0, 3, 3, 7])
    f = 3
    n1 = 2 * f if activation == "swiglu" else f
    x = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w1 = torch.randn(3, 4, n1, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(3, f, 4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: tm.grouped_ffn(*a[:1], offs, *a[1:], activation), (x, w1, w2))
    assert torch.autograd.gradcheck(lambda a, b: tm.grouped_gemm(a, offs, b), (x, w1))


# ---------------------------------------------------------------------------------------------
# Autograd with nothing to compute: outputs stay in the graph (zero gradients, not None)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ops_stay_differentiable_when_nothing_is_routed(backend):
    d, f, E = 4, 3, 3
    x = torch.randn(3, d, requires_grad=True)
    w1 = torch.randn(E, d, 2 * f, requires_grad=True)
    w2 = torch.randn(E, f, d, requires_grad=True)
    ids = torch.full((3, 2), -1)
    x_perm, info = tm.permute(x, ids, E, backend=backend)
    assert x_perm.shape == (0, d)
    y = tm.grouped_ffn(x_perm, info.expert_offsets, w1, w2, backend=backend)
    out = tm.unpermute(y, info, torch.rand(3, 2), backend=backend)
    out.sum().backward()
    for name, t in (("x", x), ("w1", w1), ("w2", w2)):
        assert t.grad is not None and float(t.grad.abs().sum()) == 0.0, name
    src = torch.randn(5, d, requires_grad=True)
    empty = torch.zeros(2, dtype=torch.int64)
    moved = tm.comm.copy_segments(src, empty, empty, empty, 4, backend=backend)
    moved.sum().backward()
    assert src.grad is not None and float(src.grad.abs().sum()) == 0.0


def test_layer_with_no_tokens_gives_zero_expert_gradients():
    for cfg_backend in ("torch", "triton"):
        layer = tm.MoELayer(tm.MoEConfig(6, 5, 4, 2, backend=cfg_backend))
        layer(torch.zeros(0, 6)).sum().backward()
        assert layer.w1.grad is not None and float(layer.w1.grad.abs().sum()) == 0.0, cfg_backend


def test_double_backward():
    """The reference route and copy_segments support double backward; the Triton route's fused
    backward kernel does not, and says so instead of silently dropping second-order terms."""
    logits = torch.randn(4, 5, dtype=torch.float32, requires_grad=True)
    for backend in ("torch", "triton"):
        r = tm.route(logits, 2, backend=backend)
        (g,) = torch.autograd.grad(r.topk_weights.square().sum(), logits, create_graph=True)
        if backend == "torch":
            g.square().sum().backward()
            assert logits.grad is not None
        else:
            with pytest.raises(RuntimeError, match="not twice differentiable"):
                g.square().sum().backward()
    src = torch.randn(6, 3, requires_grad=True)
    starts = torch.tensor([0, 3]), torch.tensor([2, 0]), torch.tensor([2, 2])
    for backend in ("torch", "triton"):
        out = tm.comm.copy_segments(src, *starts, 5, backend=backend)
        up = torch.randn(5, 3, requires_grad=True)
        (gs,) = torch.autograd.grad((out * up).sum(), src, create_graph=True)
        (gu,) = torch.autograd.grad(gs.sum(), up)
        expect = torch.zeros(5, 3)
        expect[2:4] = 1.0
        expect[0:2] = 1.0
        assert torch.equal(gu, expect), backend


def test_numpy_integer_scalars_are_accepted():
    import numpy as np

    r = tm.route(LOGITS, np.int64(2), capacity=np.int32(3))
    assert r.topk_ids.shape == (4, 2)
    torch.testing.assert_close(r.topk_weights, tm.route(LOGITS, 2, capacity=3).topk_weights)
    x_perm, info = tm.permute(X, IDS, np.int64(6), pad_to=np.int16(2))
    assert info.expert_offsets.shape == (7,)
    cfg = tm.MoEConfig(np.int64(8), 16, 4, np.int64(2), capacity_factor=np.float32(1.0))
    assert type(cfg.top_k) is int and type(cfg.capacity_factor) is float
    with pytest.raises(TypeError):
        tm.route(LOGITS, np.float64(2.0))


@pytest.mark.parametrize("v", [0.0, 1.5, -2.5, 7, 1e308, -1e-308, float("inf"), float("-inf"), float("nan")])
def test_finite_is_math_isfinite(v):
    """The validators' comparison-only finiteness check (traceable on symbolic floats)."""
    import math

    from tritonmoe.core.validation import finite

    assert finite(v) == math.isfinite(v)
