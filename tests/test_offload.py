"""Ring-memory expert offloading (tritonmoe.inference.OffloadedExperts): a stack served from K
slots equals the all-resident stack, holds K slots of expert memory (measured from the storages),
prefetches on a thread, and refuses bad input."""

from __future__ import annotations

import copy

import pytest
import torch

import tritonmoe as tm
from tritonmoe.inference import OffloadedExperts


def _model(N: int, **cfg):
    torch.manual_seed(0)
    mods = []
    for _ in range(N):
        mods += [torch.nn.Linear(8, 8, dtype=torch.float64), tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, **cfg),
                                                                          dtype=torch.float64)]
    return torch.nn.Sequential(*mods)


@pytest.mark.parametrize("N,K", [(5, 2), (4, 1), (3, 2)])
def test_offloaded_stack_equals_resident(N, K):
    model = _model(N, expert_ffn_bias=True, activation="swiglu_oai")
    with torch.no_grad():
        for m in model:
            if isinstance(m, tm.MoELayer):
                m.b1.normal_()
    resident = copy.deepcopy(model)
    layers = [m for m in model if isinstance(m, tm.MoELayer)]
    one_layer = sum(getattr(layers[0], n).numel() * 8 for n in ("w1", "w2", "b1", "b2"))
    stack = OffloadedExperts(layers, slots=K)
    try:
        assert stack.slot_bytes == one_layer
        assert stack.resident_bytes() == K * one_layer  # the N layers' own copies are freed
        with torch.no_grad():
            for T in (7, 0, 3):  # several passes: the ring wraps around
                x = torch.randn(T, 8, dtype=torch.float64)
                assert torch.equal(model(x), resident(x))
                assert stack.resident_bytes() == K * one_layer
        assert len(stack.waits) == 3 * N
    finally:
        stack.close()


def test_layers_out_of_order_and_bad_input():
    model = _model(3)
    layers = [m for m in model if isinstance(m, tm.MoELayer)]
    with pytest.raises(ValueError, match="slots=3 for 3 layers"):
        OffloadedExperts(layers, slots=3)
    with pytest.raises(ValueError, match="slots=0"):
        OffloadedExperts(layers, slots=0)
    with pytest.raises(ValueError, match="layers is empty"):
        OffloadedExperts([], slots=1)
    with pytest.raises(TypeError, match="not a tritonmoe.MoELayer"):
        OffloadedExperts([torch.nn.Linear(2, 2)], slots=1)
    other = tm.MoELayer(tm.MoEConfig(8, 10, 4, 2), dtype=torch.float64)
    with pytest.raises(ValueError, match="the slots hold one shape"):
        OffloadedExperts(layers[:2] + [other], slots=1)
    stack = OffloadedExperts(layers, slots=2)
    try:
        with pytest.raises(RuntimeError, match="layer 1 called but layer 0 is next"):
            with torch.no_grad():
                layers[1](torch.randn(2, 8, dtype=torch.float64))
    finally:
        stack.close()
