"""How ``tritonmoe.plan.profile`` times things (the statistics themselves are checked in
tests/test_plan_runtime.py::test_auto_and_search_agree_across_ranks)."""

from __future__ import annotations

import json

import pytest

import _plan_profile_cases
from _dist import run_group, values_or_fail


@pytest.mark.dist
def test_profile_timing_protocol():
    """Compute ops are timed in rounds: no timed run follows a run of the same op (its data
    would still be in cache), on any rank; one (shape, token count)'s ops are alive at a time
    (memory does not grow with shapes x token counts); every collective is timed with a compute
    phase in place, none with ``collectives_in_place=False``."""
    per_rank = values_or_fail(run_group(2, _plan_profile_cases.all_cases, deadline_s=180)[0])
    for r in per_rank:
        seq = r["once_sequence"]
        assert seq, "nothing timed"
        repeats = sum(a == b for a, b in zip(seq, seq[1:]))
        assert repeats == 0, f"{repeats} of {len(seq)} timed runs follow a run of the same op: {seq[:16]}"
        assert r["op_sets_alive"] == 1, r["op_sets_alive"]
        assert r["phases"][True] and all(r["phases"][True]), r["phases"]
        assert r["phases"][False] and not any(r["phases"][False]), r["phases"]
    # rank 0 also times every op alone: twice as many timed runs as rank 1
    assert len(per_rank[0]["once_sequence"]) == 2 * len(per_rank[1]["once_sequence"])


def test_packaged_model_host_cores_within_the_machine():
    """The packaged CPU/gloo model does not share more cores than its machine had."""
    from tritonmoe.policy.degree import DEFAULT_CPU_MODEL

    with open(DEFAULT_CPU_MODEL) as f:
        d = json.load(f)
    assert d["meta"]["world_size"] == 4 and d["meta"]["backend"] == "gloo"
    assert d["host_cores"] <= d["meta"]["cpu_count"], (d["host_cores"], d["meta"]["cpu_count"])
