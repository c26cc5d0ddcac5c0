"""Expert-parallel serving of a placement with replicas and packing
(tritonmoe.inference.ReplicatedMoELayer, LinaScheduler): on 4 gloo ranks, fp64, Zipf-skewed
routing, the outputs equal the local layer's bitwise for the contiguous, Lina, EPLB and
hand-made placements (an expert on every device, a device with no expert, unequal replica
weights), with even and ragged batches (a rank with zero tokens), and for a stack under the
two-phase scheduler; bad input raises on every rank. One spawned group for everything."""

from __future__ import annotations

import pytest

from _dist import run_group, values_or_fail
from _inference_cases import replicated_cases


@pytest.fixture(scope="module")
def results():
    res, _ = run_group(4, replicated_cases, deadline_s=150.0)
    return values_or_fail(res)


@pytest.mark.parametrize("toks", ["even", "ragged", "even/top1", "ragged/top1"])
@pytest.mark.parametrize("case", ["contiguous", "lina", "eplb", "hand", "empty_device"])
def test_replicated_equals_local(results, toks, case):
    for rank, r in enumerate(results):
        got = r[f"{toks}/{case}"]
        assert got["equal"], (rank, got.get("error"))
    # the rows every rank computed add up to every token's routed slots (measured per rank)
    load = results[0][f"{toks}/{case}"]["load"]
    assert sum(r[f"{toks}/{case}"]["rows"] for r in results) == sum(load)


def test_skewed_routing_gets_replicas(results):
    r = results[0]["even/top1/lina"]  # top-1 routing: an expert can take over half the tokens
    load = r["load"]
    assert max(load) > 3 * min(load)  # the Zipf router is skewed
    assert max(r["replicas"]) >= 2 and r["max_hosted"] <= 4
    assert results[0]["even/contiguous"]["replicas"] == [1] * 8
    # the hand placement sends expert 0 to every device: every rank computes rows
    assert all(res["even/hand"]["rows"] > 0 for res in results)


def test_two_phase_scheduler_stack(results):
    for rank, r in enumerate(results):
        assert r["scheduler"]["equal"], rank
    s = results[0]["scheduler"]
    # layer 0 has no estimate; layers 1 and 2 are planned in phase one, then resumed or re-planned
    assert [l for l, d in s["decisions"] if d == "unplanned"] == [0, 0, 0]
    assert s["resumes"] + s["replans"] == 6
    for r in results[1:]:  # every rank took the same decisions and placements
        assert r["scheduler"]["decisions"] == s["decisions"] and r["scheduler"]["hosted"] == s["hosted"]


def test_bad_input_on_every_rank(results):
    for r in results:
        assert r["bad_devices"] == "ok" and r["disagree"] == "ok" and r["not_layer"] == "ok"
