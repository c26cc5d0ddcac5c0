"""The model layers on spawned gloo groups of 2 and 4 ranks (tests/_dist_model_cases.py; one group
per world size runs every check).

The aux-loss-free bias update with a group: a non-finite bias on one rank, bad arguments on one
rank or different layers per rank raise a typed error on every rank, nothing written, the loads
kept, the group usable afterwards.

Parm's layouts (model + expert + expert-sharding parallelism, schedules baseline / S1 / S2)
with the options real models use, against the single-process MoELayer in fp64:

* GPT-OSS's clamped SwiGLU with a non-default limit and alpha (the layouts used to run the shards
  with the defaults);
* expert biases (b1 sharded with w1's columns, b2 added once across the ESP shards) and a router
  bias, which the layouts used to refuse.

Outputs, input gradients, router weight and bias gradients, auxiliary loss and every expert
gradient (biases included), with zero-token batches and MP ranks without an S1 slice."""

from __future__ import annotations

import pytest

from _dist import run_group, values_or_fail
import _dist_model_cases

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def table(request):
    P = request.param
    results, _ = run_group(P, _dist_model_cases.parm_model_table, deadline_s=300, pg_timeout_s=60)
    return P, values_or_fail(results)


def _failures(values, key):
    assert values[0][key]["cases"] >= 4
    return [f"rank {r}: {f}" for r, v in enumerate(values) for f in v[key]["failures"]]


def test_parm_swiglu_oai_limit_alpha_equal_single_process(table):
    _, values = table
    failures = _failures(values, "swiglu")
    assert not failures, "\n".join(failures[:15])


def test_parm_expert_and_router_biases_equal_single_process(table):
    _, values = table
    failures = _failures(values, "biases")
    assert not failures, "\n".join(failures[:15])


def test_bias_update_refuses_on_every_rank(table):
    _, values = table
    failures = [f"rank {r}: {f}" for r, v in enumerate(values) for f in v["bias_update"]]
    assert not failures, "\n".join(failures[:15])
