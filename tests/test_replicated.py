"""Expert-parallel serving of a placement with replicas and packing
(tritonmoe.inference.ReplicatedMoELayer, LinaScheduler): on 4 gloo ranks, fp64, Zipf-skewed
routing, the outputs equal the local layer's bitwise for the contiguous, Lina, EPLB and
hand-made placements (an expert on every device, a device with no expert, unequal replica
weights), with even and ragged batches (a rank with zero tokens), and for a stack under the
two-phase scheduler; bad input raises on every rank. One spawned group for everything."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _dist import run_group, values_or_fail
from tritonmoe.inference.replicated import plan_slots, slot_segments
from tritonmoe.reference import copy_segments
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


@pytest.mark.parametrize("toks", ["even", "ragged", "even/top1", "ragged/top1"])
@pytest.mark.parametrize("case", ["contiguous", "lina", "eplb", "hand", "empty_device"])
def test_device_holds_only_hosted_experts(results, toks, case):
    # measured from the storages of the serving layer's expert tensors, per rank
    for rank, r in enumerate(results):
        got = r[f"{toks}/{case}"]
        assert got["held"] == got["n_hosted"] * got["per_expert"], (rank, got)
        assert not got["shares_host"]  # copies on the device, not views of the full host tensors
    # the experts held over all ranks are the placement's replicas, not P * E
    held = sum(r[f"{toks}/{case}"]["n_hosted"] for r in results)
    assert held == sum(results[0][f"{toks}/{case}"]["replicas"]) < 4 * 8


@pytest.mark.parametrize("slots", [None, 4])
def test_replan_loads_only_newly_hosted_experts(results, slots):
    for rank, r in enumerate(results):
        steps = r[f"replan/slots={slots}"]
        assert [s["name"] for s in steps] == ["contiguous", "lina", "hand", "empty_device", "eplb", "contiguous2"]
        for s in steps:
            assert s["equal"], (rank, s.get("error"), s["name"])
            # counted by wrapping the copy: exactly the newly hosted experts, from the host copy
            assert s["loaded"] == s["expected"], (rank, s)
            assert s["loaded_bytes"] == len(s["expected"]) * s["per_expert"], (rank, s)
            assert s["from_host"]
            want_slots = s["n_hosted"] if slots is None else slots
            assert s["held"] == want_slots * s["per_expert"], (rank, s)
        for s in steps[1:]:
            if slots is not None or s["same_size"]:  # the same buffers: kept experts stay in their slots
                assert s["kept_in_place"], (rank, s)
    # the sequence moves experts on some rank and keeps some on another (not trivially all/none)
    moved = [len(s["loaded"]) for r in results for s in r[f"replan/slots={slots}"][1:]]
    assert any(moved) and 0 in moved


def test_scheduler_replans_load_only_new_experts(results):
    for rank, r in enumerate(results):
        s = r["scheduler_loads"]
        assert s["equal"], rank
        assert s["loaded"] == s["expected"], rank
    assert sum(r["scheduler_loads"]["changes"] for r in results) > 0  # the placements did change


def test_host_state_dict_source(results):
    for r in results:
        h = r["host_state_dict"]
        assert h["equal"] and h["loaded"] == h["hosted"]
        assert h["from_host"] or not h["hosted"]


def test_bad_placement_and_capacity_on_every_rank(results):
    for r in results:
        assert r["bad_expert_id"] == "ok" and r["over_capacity"] == "ok" and r["over_capacity_ctor"] == "ok"
        assert r["bad_slots"] == ["ok", "ok"] and r["bad_host"] == "ok"
        assert r["unchanged_after_error"] and r["after_errors_equal"]


def test_refresh_and_set_placement_agreement(results):
    for r in results:
        assert r["refresh"] == [True] * 4, r["refresh"]
        assert r["set_placement_disagree"] == "ok" and r["after_disagree"], r["set_placement_disagree"]


def _check_single_device(s: dict, cuda: bool) -> None:
    assert "error" not in s, s.get("error")
    assert s["held"] and s["held2"]
    if cuda:  # the layer's device copies moved to pinned host memory, shared by a second wrapper
        assert s["released"] and s["pinned"] and s["shared_host"] and not s["host_is_layer"]
        assert s["max_diff_local"] <= 1e-5
    else:  # the layer's CPU tensors are the host copy (shared, not copied)
        assert s["host_is_layer"] and s["shared_host"] and s["equal_local"]
    # slots not in expert order serve the same outputs (bitwise: the same rows per expert)
    assert s["slot_order"] == [5, 6, 7, 0, 1, 2, 3, 4] and s["loaded"] == [0, 1, 2, 3, 4] and s["equal_resized"]
    assert s["slot_order2"] == [4, 5, 6, 7, 0, 1, 2, 3] and s["loaded2"] == [0, 1, 2, 3]
    assert s["equal_fixed"] and s["empty_batch"]


def test_single_device_slot_orders(results):
    for r in results:
        _check_single_device(r["single_device"], cuda=False)


@pytest.mark.gpu
def test_cuda_hosted_slots_copy_stream():
    """On a GPU: pinned host source, the layer's device copies released, loads on the copy
    stream ordered before the compute by an event."""
    from _inference_cases import cuda_single_device_case

    res, _ = run_group(1, cuda_single_device_case, deadline_s=300.0)
    r = values_or_fail(res)[0]
    _check_single_device(r, cuda=True)
    _check_released(r["released_case"])


def _check_released(s: dict) -> None:
    assert "error" not in s, s.get("error")
    assert s["released"] and s["equal"]
    assert s["direct"] == "ok", s["direct"]  # a typed refusal naming the wrapper and the fix
    assert s["state_dict"] and s["fresh_equal"] and s["pickled"]  # the real weights, not empty tensors
    assert s["load_equal"] and s["bad_shape"] == "ok", s["bad_shape"]
    assert s["restored"] and s["restore_twice"] == "ok", s["restore_twice"]


def test_released_layer_refuses_direct_calls_and_saves_real_weights(results):
    """The release path of a GPU layer (ReplicatedMoELayer's release_to_host), run on CPU with
    unpinned memory: see _inference_cases.released_case."""
    for r in results:
        _check_released(r["released"])


_subsets = st.lists(st.integers(0, 7), unique=True, max_size=5).map(lambda h: tuple(sorted(h)))


@given(seq=st.lists(_subsets, min_size=1, max_size=6), fixed=st.booleans())
def test_plan_slots_keeps_and_loads_only_new(seq, fixed):
    """Along any sequence of hosted sets: the slots hold exactly the hosted experts, the loads
    are exactly the newly hosted ones, and kept experts stay in their slot while the buffers
    keep their size (moves, device to device, only when they are resized)."""
    cur: list = []
    for hosted in seq:
        S = 5 if fixed else len(hosted)
        new, moves, loads = plan_slots(cur, hosted, S)
        assert len(new) == S and sorted(e for e in new if e >= 0) == list(hosted)
        assert sorted(e for e, _ in loads) == sorted(set(hosted) - set(cur))
        assert all(new[k] == e for e, k in loads)
        kept = set(hosted) & set(cur)
        if S == len(cur):
            assert not moves and all(new[k] == cur[k] for k, e in enumerate(cur) if e in kept)
        else:
            assert sorted(cur[a] for a, _ in moves) == sorted(kept)
            assert all(new[b] == cur[a] for a, b in moves)
        cur = new


@given(data=st.data())
def test_slot_segments_reorder_rows_by_slot(data):
    """The segment copy puts the received rows (source-major, hosted experts in order) into
    slot order, then source, matching the slot offsets; the reverse copy restores them."""
    P = data.draw(st.integers(1, 4))
    hosted = data.draw(_subsets.filter(bool))
    free = data.draw(st.integers(0, 2))
    slots = data.draw(st.permutations(list(hosted) + [-1] * free))
    counts = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=len(hosted), max_size=len(hosted)),
                                             min_size=P, max_size=P)), dtype=torch.int64).view(P, len(hosted))
    # tag each received row with (source, expert, index within the chunk)
    tags = [(s, e, i) for s in range(P) for j, e in enumerate(hosted) for i in range(int(counts[s, j]))]
    x = torch.tensor([[s, e, i] for s, e, i in tags], dtype=torch.float64).view(-1, 3)
    src, dst, lens, off = slot_segments(counts, hosted, slots)
    y = copy_segments(x, src, dst, lens, x.shape[0])
    want = sorted(tags, key=lambda t: (slots.index(t[1]), t[0], t[2]))
    assert [tuple(int(v) for v in r) for r in y.tolist()] == want
    for k, e in enumerate(slots):  # slot k's rows are expert e's (none for a free slot)
        rows = y[int(off[k]):int(off[k + 1])]
        assert (rows[:, 1] == e).all() and rows.shape[0] == (int(counts[:, hosted.index(e)].sum()) if e >= 0 else 0)
    assert torch.equal(copy_segments(y, dst, src, lens, y.shape[0]), x)
