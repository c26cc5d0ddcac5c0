"""torch.compile / torch.export of the local layer through the custom ops (tritonmoe.custom_ops):
zero graph breaks forward and backward, compiled equals eager, dynamic batch sizes (with a
capacity), opcheck of every op."""

from __future__ import annotations

import pytest
import torch

import tritonmoe as tm
from tritonmoe import custom_ops as ops

CFG = dict(d_model=16, d_ffn=12, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001)


def _layers(backend, dtype, **extra):
    torch.manual_seed(0)
    eager = tm.MoELayer(tm.MoEConfig(**CFG, backend=backend, **extra), dtype=dtype)
    torch.manual_seed(0)
    compiled_layer = tm.MoELayer(tm.MoEConfig(**CFG, backend=backend, **extra), dtype=dtype)
    return eager, compiled_layer


def _step(fn, layer, x, g):
    """Forward + backward of ``fn`` (the layer or its compiled module) with ``layer``'s aux loss."""
    x = x.clone().requires_grad_()
    out = fn(x)
    ((out * g).sum() + layer.aux_loss).backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,dtype,ffn_path,want_path",
    [
        ("torch", torch.float64, "auto", "unfused"),
        ("triton", torch.float32, "auto", "fused"),
        ("torch", torch.float64, "fused", "fused"),
        ("triton", torch.float32, "unfused", "unfused"),
    ],
)
def test_no_graph_breaks_and_compiled_equals_eager(backend, dtype, ffn_path, want_path):
    """fullgraph=True (any graph break raises), forward and backward, three batch sizes
    (dynamic) under ``error_on_recompile``, with a capacity: the compiled layer runs the variant
    the eager layer chooses (``config.ffn_path``; "auto" is unfused on the reference, fused on the
    kernels) and is bitwise equal to eager with the aot_eager backend (the same implementations
    run inside the ops)."""
    extra = dict(capacity_factor=1.25, expert_ffn_bias=True, shared_d_ffn=8, routed_scaling_factor=1.5,
                 ffn_path=ffn_path)
    eager, layer = _layers(backend, dtype, **extra)
    ex = torch._dynamo.explain(layer)(torch.randn(5, 16, dtype=dtype))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, [str(b.reason)[:200] for b in ex.break_reasons]
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompilation raises
        for T in (7, 11, 3):
            x = torch.randn(T, 16, dtype=dtype)
            g = torch.randn(T, 16, dtype=dtype)
            eager.zero_grad(set_to_none=True)
            layer.zero_grad(set_to_none=True)
            want = _step(eager, eager, x, g)
            got = _step(compiled, layer, x, g)
            assert eager.ffn_path_used == layer.ffn_path_used == want_path
            assert torch.equal(got[0], want[0])
            # The compiled step trains through the *_train ops (saved activations, explicit
            # backward): the kernels' shared backward (bitwise), the reference's grouped FFN
            # (bitwise); the reference's fused moe_ffn_train sums dx and the gate gradient in
            # another order than autograd of the composition (to rounding).
            exact = not (backend == "torch" and want_path == "fused")
            for n, gw in [("x", want[1])] + list(want[2].items()):
                g_got = got[1] if n == "x" else got[2][n]
                if exact:
                    assert torch.equal(g_got, gw), n
                else:
                    torch.testing.assert_close(g_got, gw, rtol=1e-12, atol=1e-13, msg=lambda m: f"{n}: {m}")
            assert torch.equal(layer.last_routing.topk_ids, eager.last_routing.topk_ids)
            frames.append(counter.frame_count)
    assert frames[0] == frames[-1], frames  # no recompilation for a new batch size (the capacity is symbolic)
    ops_in_graph = {n.target._qualified_op_name for gm in counter.graphs for n in gm.graph.nodes
                    if n.op == "call_function" and hasattr(n.target, "_qualified_op_name")}
    fused_ops = {"tritonmoe::moe_ffn_train"}
    unfused_ops = {"tritonmoe::permute", "tritonmoe::grouped_ffn_train", "tritonmoe::unpermute"}
    assert (fused_ops if want_path == "fused" else unfused_ops) <= ops_in_graph, ops_in_graph
    assert not ((unfused_ops if want_path == "fused" else fused_ops) & ops_in_graph), ops_in_graph


def test_compiled_auto_path_follows_backward(monkeypatch):
    """``ffn_path="auto"`` under torch.compile with the CUDA rule (unfused when a backward
    follows) widened to CPU, on the interpreter's kernels: fullgraph (no graph break), the
    training graph holds the unfused training ops and equals the eager auto layer bitwise
    (output and every gradient); called under no_grad it retraces once (grad mode is guarded)
    into the fused op and equals eager bitwise."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from tritonmoe.experts import local as X

    monkeypatch.setattr(X, "_TRAIN_UNFUSED_DEVICES", frozenset({"cuda", "cpu"}))
    eager, layer = _layers("triton", torch.float32, ffn_path="auto")
    x, g = torch.randn(6, 16), torch.randn(6, 16)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    want, got = _step(eager, eager, x, g), _step(compiled, layer, x, g)
    assert eager.ffn_path_used == layer.ffn_path_used == "unfused"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for n, gw in want[2].items():
        assert torch.equal(got[2][n], gw), n
    with torch.no_grad():
        y_want, y_got = eager(x), compiled(x)
    assert eager.ffn_path_used == layer.ffn_path_used == "fused"
    assert torch.equal(y_got, y_want)
    names = [{n.target._qualified_op_name for n in gm.graph.nodes
              if n.op == "call_function" and hasattr(n.target, "_qualified_op_name")} for gm in counter.graphs]
    assert counter.frame_count == 2 and len(names) == 2
    assert {"tritonmoe::permute", "tritonmoe::grouped_ffn_train", "tritonmoe::unpermute"} <= names[0]
    assert not {"tritonmoe::moe_ffn", "tritonmoe::moe_ffn_train"} & names[0]
    assert "tritonmoe::moe_ffn" in names[1] and "tritonmoe::grouped_ffn" not in names[1]
    torch._dynamo.reset()


@pytest.mark.parametrize("ffn_path", ["fused", "unfused"])
def test_compiled_ffn_op_forms(ffn_path):
    """Which expert-FFN op a compiled layer traces: the ``*_train`` form (activations saved, no
    GEMM rerun in backward) when training in the default "save" mode; the recomputing form under
    ``override("ffn.preact", "recompute")`` (memory) and for inference (no grad: nothing to save). Every
    form gives the eager gradients (reference, fp64)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from tritonmoe.kernels.config import override

    ffn = "tritonmoe::moe_ffn" if ffn_path == "fused" else "tritonmoe::grouped_ffn"
    eager, layer = _layers("torch", torch.float64, ffn_path=ffn_path)
    x, g = torch.randn(6, 16, dtype=torch.float64), torch.randn(6, 16, dtype=torch.float64)
    want = _step(eager, eager, x, g)
    for mode, grad, want_op in (("save", True, ffn + "_train"), ("recompute", True, ffn), ("save", False, ffn)):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        compiled = torch.compile(layer, backend=counter, fullgraph=True)
        layer.zero_grad(set_to_none=True)
        with override("ffn.preact", mode), torch.set_grad_enabled(grad):
            if grad:
                got = _step(compiled, layer, x, g)
                for n, gw in want[2].items():
                    torch.testing.assert_close(got[2][n], gw, rtol=1e-12, atol=1e-13)
            else:
                assert torch.equal(compiled(x), want[0])
        names = {n.target._qualified_op_name for gm in counter.graphs for n in gm.graph.nodes
                 if n.op == "call_function" and hasattr(n.target, "_qualified_op_name")}
        assert want_op in names and not ({ffn, ffn + "_train"} - {want_op}) & names, (mode, grad, names)


def test_default_dynamic_recompiles_once():
    """``torch.compile`` without ``dynamic=``: the second batch size makes dynamo mark the batch
    dimension dynamic (one recompilation, PyTorch's automatic dynamic shapes); later sizes, and
    training steps with an optimizer, reuse that graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager, layer = _layers("torch", torch.float64, ffn_path="unfused")
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    counts = []
    for T in (5, 8, 13, 6):
        x = torch.randn(T, 16, dtype=torch.float64)
        assert torch.equal(compiled(x), eager(x))
        counts.append(counter.frame_count)
    assert counts == [1, 2, 2, 2], counts
    # training steps (backward, optimizer updates in place, aux loss read back): no recompilation
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for T in (7, 9, 4):
        opt.zero_grad()
        (compiled(torch.randn(T, 16, dtype=torch.float64)).square().sum() + layer.aux_loss).backward()
        opt.step()
    assert counter.frame_count == 2, counter.frame_count


@pytest.mark.slow
def test_inductor_matches_eager_to_rounding():
    eager, layer = _layers("torch", torch.float32)
    compiled = torch.compile(layer, fullgraph=True)
    x, g = torch.randn(9, 16), torch.randn(9, 16)
    want, got = _step(eager, eager, x, g), _step(compiled, layer, x, g)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for n, gw in want[2].items():
        torch.testing.assert_close(got[2][n], gw, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_export():
    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(**CFG, backend="torch"))
    x = torch.randn(6, 16)
    batch = torch.export.Dim("batch", min=2, max=1024)
    ep = torch.export.export(layer, (x,), dynamic_shapes=({0: batch},))
    names = {n.target.name() for n in ep.graph.nodes if n.op == "call_function" and hasattr(n.target, "name")}
    # ffn_path "auto" on the reference backend: the unfused path, as in eager
    # (traced with grad enabled: the training form of the grouped FFN)
    assert {"tritonmoe::route", "tritonmoe::permute", "tritonmoe::grouped_ffn_train", "tritonmoe::unpermute"} <= names, \
        names
    x2 = torch.randn(13, 16)
    torch.testing.assert_close(ep.module()(x2), layer(x2), rtol=0, atol=0)


def test_opcheck():
    """torch.library.opcheck: schema, fake (meta) implementation, autograd registration and
    AOT dispatch of every op, on CPU."""
    torch.manual_seed(0)
    logits = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(4)
    for args in (
        (logits, None, 2, "softmax", True, None, None, None, True, "top2sum", 1.0, "torch"),
        (logits, bias, 2, "sigmoid", True, 2, 1, 2, False, "max", 2.5, "torch"),
    ):
        torch.library.opcheck(torch.ops.tritonmoe.route.default, args)
    r = ops.route(logits.detach(), 2, backend="torch")
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(4, 8, 10, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(4, 5, 8, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    w = r.topk_weights.clone().requires_grad_()
    for bias_args in ((None, None), (b1, None)):
        torch.library.opcheck(torch.ops.tritonmoe.moe_ffn.default,
                              (x, r.topk_ids, w, r.counts, w1, w2, *bias_args, "swiglu", 7.0, 1.702, "torch"))


def test_opcheck_row_movers_and_gemms():
    """opcheck of permute_metadata, permute (static num_rows), unpermute, grouped_gemm and
    grouped_ffn (reference backend, fp64; with biases and the clamped SwiGLU)."""
    g = torch.Generator().manual_seed(3)
    T, d, E, k, f = 6, 8, 4, 2, 5
    x = torch.randn(T, d, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.tensor([[0, 1], [2, -1], [1, 3], [0, 0], [3, 2], [1, 2]], dtype=torch.int32)
    ids[3, 1] = 2
    torch.library.opcheck(torch.ops.tritonmoe.permute_metadata.default, (ids, E, 2, "torch"))
    rows = 20  # >= max_permuted_rows(6, 2, 4, 2) = 16
    torch.library.opcheck(torch.ops.tritonmoe.permute.default, (x, ids, E, 2, rows, "torch"))
    xp, offs, slots, counts = torch.ops.tritonmoe.permute(x.detach(), ids, E, 2, rows, "torch")
    y = torch.randn(rows, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(T, k, dtype=torch.float64, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.tritonmoe.unpermute.default, (y, offs, slots, counts, w, T, 2, "torch"))
    w1 = torch.randn(E, d, 2 * f, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(E, f, d, dtype=torch.float64, generator=g, requires_grad=True)
    b1 = torch.randn(E, 2 * f, dtype=torch.float64, generator=g, requires_grad=True)
    b2 = torch.randn(E, d, dtype=torch.float64, generator=g, requires_grad=True)
    xq = xp.detach().clone().requires_grad_()
    torch.library.opcheck(torch.ops.tritonmoe.grouped_gemm.default, (xq, offs, w1, b1, "torch"))
    torch.library.opcheck(torch.ops.tritonmoe.grouped_gemm.default, (xq, offs, w1, None, "torch"))
    torch.library.opcheck(torch.ops.tritonmoe.grouped_ffn.default,
                          (xq, offs, w1, w2, b1, b2, "swiglu_oai", 0.8, 1.3, "torch"))
    # and the ops compute what the implementations compute
    want = tm.grouped_ffn(xq.detach(), offs, w1.detach(), w2.detach(), "swiglu_oai", b1.detach(), b2.detach(),
                          swiglu_limit=0.8, swiglu_alpha=1.3, backend="torch")
    got = torch.ops.tritonmoe.grouped_ffn(xq.detach(), offs, w1.detach(), w2.detach(), b1.detach(), b2.detach(),
                                          "swiglu_oai", 0.8, 1.3, "torch")
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ffn_path", ["fused", "unfused", "auto"])
def test_gpu_compiled_layer_equals_eager(ffn_path):
    """On CUDA with the Triton kernels (bf16): fullgraph, dynamic batch, no recompilation, the
    eager variant ("auto" trains unfused on CUDA), bitwise equal to eager with aot_eager
    (training ops' shared backward) and to rounding with inductor."""
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = dict(CFG, d_model=128, d_ffn=64, num_experts=8, backend="triton", ffn_path=ffn_path, capacity_factor=1.25)
    mk = lambda: tm.MoELayer(tm.MoEConfig(**cfg), device="cuda", dtype=torch.bfloat16)  # noqa: E731
    torch.manual_seed(0)
    eager = mk()
    torch.manual_seed(0)
    layer = mk()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (40, 300, 97):
            x = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
            g = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
            eager.zero_grad(set_to_none=True)
            layer.zero_grad(set_to_none=True)
            want, got = _step(eager, eager, x, g), _step(compiled, layer, x, g)
            assert layer.ffn_path_used == eager.ffn_path_used == {"auto": "unfused"}.get(ffn_path, ffn_path)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            for n, gw in want[2].items():
                assert torch.equal(got[2][n], gw), n
    torch._dynamo.reset()
    layer.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    want, got = _step(eager, eager, x, g), _step(torch.compile(layer, fullgraph=True), layer, x, g)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    for n, gw in want[2].items():
        torch.testing.assert_close(got[2][n], gw, rtol=5e-2, atol=5e-2, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)])
def test_functional_api_compiles_without_graph_breaks(backend, dtype):
    """The public functional ops (``tm.route``, ``tm.permute`` with ``num_rows``, ``tm.grouped_gemm``,
    ``tm.grouped_ffn``, ``tm.unpermute``, ``tm.moe_ffn``) traced by torch.compile become their
    custom ops: one graph with fullgraph=True (before, ``tm.route`` broke on its value checks' host
    sync), and the compiled step equals eager bitwise with aot_eager, forward and backward."""
    E, k, d, f = 4, 2, 16, 12
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(E, d, 2 * f, generator=g, dtype=dtype) / 4).requires_grad_()
    w2 = (torch.randn(E, f, d, generator=g, dtype=dtype) / 4).requires_grad_()
    w3 = (torch.randn(E, d, d, generator=g, dtype=dtype) / 4).requires_grad_()
    wr = torch.randn(d, E, generator=g, dtype=dtype)
    bias = torch.zeros(E)

    def step(x):
        r = tm.route(x @ wr, k, expert_bias=bias, routed_scaling_factor=1.5, backend=backend)
        xp, info = tm.permute(x, r.topk_ids, E, num_rows=tm.max_permuted_rows(x.shape[0], k, E), backend=backend)
        h = tm.grouped_gemm(xp, info.expert_offsets, w3, backend=backend)
        y = tm.grouped_ffn(h, info.expert_offsets, w1, w2, "swiglu", backend=backend)
        out = tm.unpermute(y, info, r.topk_weights, backend=backend)
        return out + tm.moe_ffn(x, r, w1, w2, "swiglu", backend=backend)

    x0 = torch.randn(6, d, generator=g, dtype=dtype)
    ex = torch._dynamo.explain(step)(x0)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, [str(b.reason)[:200] for b in ex.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)

    def run(fn):
        x = x0.clone().requires_grad_()
        out = fn(x)
        grads = torch.autograd.grad(out.square().sum(), [x, w1, w2, w3])
        return [out.detach(), *grads]

    for a, b in zip(run(compiled), run(step)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # dynamic shapes: Python floats become symbolic there (the validators' finiteness check
    # must trace), and a new batch size runs without a recompile
    torch._dynamo.reset()
    dyn = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (5, 9):
            x = torch.randn(T, d, generator=g, dtype=dtype)
            torch.testing.assert_close(dyn(x), step(x), rtol=0, atol=0)
