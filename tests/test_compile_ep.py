"""A model with an expert-parallel MoELayer under torch.compile (2 gloo ranks): the layer runs
eagerly (torch.compiler.disable on its distributed forward: a deliberate graph break), the rest
of the model compiles, and the result equals eager bitwise."""

from __future__ import annotations

import pytest
import torch

import _compile_cases
from _dist import run_group, values_or_fail

import tritonmoe as tm


@pytest.mark.dist
@pytest.mark.slow
def test_compiled_model_runs_ep_layer_eagerly():
    results, _ = run_group(2, _compile_cases.compiled_model_with_ep_layer, deadline_s=180, pg_timeout_s=60)
    for v in values_or_fail(results):
        assert not v["failures"], "\n".join(v["failures"])
        for mode, info in v["info"].items():
            assert info["tritonmoe_ops"] == [], (mode, info)  # nothing of the layer was traced
            assert info["has_linear"] and info["graphs"] >= 2, (mode, info)  # the code around it compiled
        assert v["info"]["dynamic"]["path"] == "expert_parallel"
        assert v["info"]["static"]["path"] == "expert_parallel_static"


def test_fullgraph_refuses_an_ep_layer_with_a_clear_reason():
    """fullgraph=True cannot hold a distributed layer: dynamo names the disabled function."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port
    try:
        layer = tm.MoELayer(tm.MoEConfig(8, 6, 4, 2), ep_group=dist.group.WORLD, dtype=torch.float64)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="_forward_eagerly|disable"):
            torch.compile(layer, backend="eager", fullgraph=True)(torch.randn(3, 8, dtype=torch.float64))
    finally:
        dist.destroy_process_group()
