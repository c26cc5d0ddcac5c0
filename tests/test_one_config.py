"""One config, any world size (issue 33): a MoELayer built without ep_group runs a config whose
pipeline_degree is > 1 ("auto", "search" too) or that names a memory strategy as degree 1,
unmanaged, and says so once in the log; the same MoEConfig is then the single-process reference of
the expert-parallel run (fp64: outputs and input gradients bitwise, expert gradients to rounding)."""

from __future__ import annotations

import logging

import pytest
import torch

import _one_config_cases
import tritonmoe as tm
from _dist import run_group, values_or_fail
from tritonmoe import experts as experts_mod


@pytest.mark.parametrize("opts", [dict(pipeline_degree=2), dict(pipeline_degree=3, memory_strategy="recompute"),
                                  dict(pipeline_degree="auto"), dict(pipeline_degree="search")])
def test_local_layer_runs_an_ep_config_as_degree_one(opts, caplog):
    experts_mod._NOTED.clear()
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    with caplog.at_level(logging.WARNING, logger="tritonmoe"):
        for o in (opts, {}, opts):
            torch.manual_seed(3)
            layer = tm.MoELayer(tm.MoEConfig(8, 6, 4, 2, **o), dtype=torch.float64)
            xi = x.clone().requires_grad_()
            out = layer(xi)
            out.square().sum().backward()
            outs.append(out)
            grads.append((xi.grad, layer.w1.grad, layer.w2.grad, layer.router.weight.grad))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[1])
    for a, b in zip(grads[0], grads[1]):
        assert torch.equal(a, b)
    notes = [r for r in caplog.records if "without ep_group" in r.getMessage()]
    assert len(notes) == 1, [r.getMessage() for r in caplog.records]  # once, though two layers were built
    assert f"pipeline_degree={opts['pipeline_degree']!r}" in notes[0].getMessage()


def test_a_plain_local_config_logs_nothing(caplog):
    experts_mod._NOTED.clear()
    with caplog.at_level(logging.DEBUG, logger="tritonmoe"):
        tm.MoELayer(tm.MoEConfig(8, 6, 4, 2))
    assert not [r for r in caplog.records if "without ep_group" in r.getMessage()]


def test_memory_strategy_with_parm_groups_is_still_refused():
    cfg = tm.MoEConfig(8, 6, 4, 2, memory_strategy="keep")
    with pytest.raises(ValueError, match="needs ep_group alone"):
        experts_mod.make_expert_path(cfg, mp_group=object())


def test_the_same_config_is_the_reference_of_the_ep_run():
    results, _ = run_group(2, _one_config_cases.ep_against_local)
    failures = [f for v in values_or_fail(results) for f in v]
    assert not failures, failures
