"""Parm's layouts (model + expert + expert-sharding parallelism, schedules baseline / S1 / S2)
with the options real models use, against the single-process MoELayer in fp64 on spawned gloo
groups of 2 and 4 ranks (tests/_parm_model_cases.py): GPT-OSS's clamped SwiGLU with a
non-default limit and alpha (the layouts used to run the shards with the defaults). Outputs,
input gradients, router gradients, auxiliary loss and every expert gradient, zero-token batches
and MP ranks without an S1 slice included."""

from __future__ import annotations

import pytest

from _dist import run_group, values_or_fail
import _parm_model_cases

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("P", [2, 4])
def test_parm_swiglu_oai_limit_alpha_equal_single_process(P):
    results, _ = run_group(P, _parm_model_cases.parm_model_table, False, deadline_s=240, pg_timeout_s=60)
    values = values_or_fail(results)
    failures = [f"rank {r}: {f}" for r, v in enumerate(values) for f in v["failures"]]
    assert values[0]["cases"] >= 4
    assert not failures, "\n".join(failures[:15])
