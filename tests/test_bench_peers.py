"""The peers timed beside tritonmoe in ``python -m bench check`` (bench.peers): Liger-Kernel's fused
MoE, run under Triton's interpreter on CPU, gives tritonmoe's reference outputs and gradients on
the same inputs once its weights are converted; the suite's liger entry is that adapter.

Skipped cleanly when liger-kernel is not installed (``scripts/setup_env.sh`` installs it with
``--no-deps`` on CPU machines, so CI runs these)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench import peers
from bench import suites as S
from bench.harness import Unavailable
from bench.presets import PRESETS, parse_routing, with_overrides
from tritonmoe import reference

pytest.importorskip("liger_kernel")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_liger_adapter_matches_the_reference_forward_and_backward():
    """T=8, E=2, k=2 in fp32 (interpreter): output, and the gradients of x, both weights (in
    liger's layout, transposed back) and the gate weights, against the fp64 reference autograd."""
    g = torch.Generator().manual_seed(3)
    T, E, k, d, f = 8, 2, 2, 16, 16
    x = torch.randn(T, d, generator=g)
    r = reference.route(torch.randn(T, E, generator=g), k)
    w1 = torch.randn(E, d, 2 * f, generator=g) * d**-0.5
    w2 = torch.randn(E, f, d, generator=g) * f**-0.5
    fn = peers.require_liger(torch.device("cpu"), "swiglu")
    gate_up, down = peers.liger_weights(w1, w2)
    assert gate_up.shape == (E, 2 * f, d) and down.shape == (E, d, f)
    xl, wl = x.clone().requires_grad_(True), r.topk_weights.clone().requires_grad_(True)
    y = peers.liger_moe_ffn(fn, xl, r.topk_ids, wl, gate_up, down)
    dy = torch.randn(T, d, generator=g)
    grads = torch.autograd.grad(y, [xl, gate_up, down, wl], dy)

    x64, w164, w264 = (t.double().requires_grad_(True) for t in (x, w1, w2))
    wk64 = r.topk_weights.double().requires_grad_(True)
    ref = reference.moe_ffn(x64, dataclasses.replace(r, topk_weights=wk64), w164, w264)
    rgrads = torch.autograd.grad(ref, [x64, w164, w264, wk64], dy.double())
    assert _rel(y, ref) < 1e-5
    assert _rel(grads[0], rgrads[0]) < 1e-5
    assert _rel(grads[1].transpose(1, 2), rgrads[1]) < 1e-5
    assert _rel(grads[2].transpose(1, 2), rgrads[2]) < 1e-5
    assert _rel(grads[3], rgrads[3]) < 1e-5


def test_liger_refuses_other_activations_with_a_reason():
    with pytest.raises(Unavailable, match="SwiGLU only"):
        peers.require_liger(torch.device("cpu"), "gelu")


def test_suite_entries_of_the_peers_compute_the_reference():
    """The moe_ffn case's liger and grouped_mm entries (what the check times) give the reference's
    output on the case's own inputs."""
    p = with_overrides(PRESETS["small"], dict(num_experts=4, d_model=16, d_ffn=16, top_k=2))
    ctx = S.Context(device=torch.device("cpu"), dtype=torch.float32, presets=[p], backends=("torch",),
                    baselines=("liger", "grouped_mm"))
    case = S.moe_ffn_case(ctx, p, 8, parse_routing("uniform"))
    st = case.build()
    ref = reference.moe_ffn(st["x"].detach().double(),
                            dataclasses.replace(st["routing"], topk_weights=st["w"].detach().double()),
                            st["w1"].detach().double(), st["w2"].detach().double())
    ran = 0
    for e in case.entries:
        if e.mode != "fwd":
            continue
        try:
            fn, work = e.make(st)
            out = fn()
        except Unavailable:  # torch._grouped_mm on a CPU build without it
            assert e.impl == "grouped_mm"
            continue
        assert _rel(out, ref) < 1e-5, e.impl
        assert work.flops > 0
        ran += 1
    assert ran >= 1 and any(e.impl == "liger" for e in case.entries)
    # forward+backward of the liger entry differentiates its own leaves: x, both converted
    # weights and the gate weights
    bwd = next(e for e in case.entries if e.mode == "fwd+bwd" and e.impl == "liger")
    fn, _ = bwd.make(st)
    grads = fn()
    assert [tuple(g.shape) for g in grads] == [(8, 16), (4, 32, 16), (4, 16, 16), (8, 2)]
