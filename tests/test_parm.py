"""Parm (paper 003) on spawned gloo groups of 4 and 8 ranks: the three schedules against one
process running the unsharded experts on the de-duplicated batches (outputs, input / router /
expert gradients, auxiliary loss, routing decisions) for every (N_MP, N_EP, N_ESP) with
N_EP * N_ESP = P and N_MP | P, ESP-inner and EP-inner; the bytes each rank sends per collective
and the rows each expert shard computes, counted by wrapping torch.distributed and the grouped
FFN, against the paper's volumes; SAA against all_gather(all_to_all(x)); the hierarchical
all-to-all against the flat one; bad layouts; auto's decision; the simulator's trace of the same
schedule. One group per world size runs everything (tests/_parm_cases.py)."""

from __future__ import annotations

import pytest

from _dist import run_group, values_or_fail
import _parm_cases

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module", params=[4, 8], ids=["P4", "P8"])
def table(request):
    P = request.param
    results, _ = run_group(P, _parm_cases.parm_table, deadline_s=400, pg_timeout_s=60)
    return P, values_or_fail(results)


def test_schedules_equal_single_process_and_send_the_papers_volumes(table):
    """Every case, every schedule, every rank: equality with the reference (bitwise where
    _parm_cases says), routing decisions, and every collective's bytes and the shard rows."""
    P, values = table
    failures = [f"rank {r}: {f}" for r, v in enumerate(values) for c in v["cases"] for f in c["failures"]]
    assert not failures, "\n".join(failures[:15])


def test_every_layout_the_reading_allows_is_covered(table):
    P, values = table
    seen = {tuple(c["layout"]) for c in values[0]["cases"]}
    want = {(n_mp, P // n_esp, n_esp, pl) for n_mp, n_esp, pl in _parm_cases.layouts(P)}
    assert want <= seen


def _first_a2a(entry: dict, phase: str = "fwd") -> int:
    ops = [n for op, _, n in entry["sent"][phase] if op == "all_to_all"]
    return ops[0] if ops else 0


def test_pause_schedules_divide_all_to_all_volume_and_expert_rows_by_n_mp(table):
    """Parm's claims, measured: S1's and S2's all-to-all carries the baseline's EP all-to-all
    volume / N_MP (summed over ranks), and each expert shard computes N_MP times fewer rows."""
    P, values = table
    for k, case in enumerate(values[0]["cases"]):
        n_mp, n_ep, n_esp, _ = case["layout"]
        res = [v["cases"][k]["results"] for v in values]
        base = sum(_first_a2a(r["baseline"]) for r in res)
        s1 = sum(_first_a2a(r["s1"]) for r in res)
        s2 = sum(_first_a2a(r["s2"]) for r in res)
        if n_ep > 1:
            assert base == s1 * n_mp, (case["layout"], base, s1)
        assert s2 == s1, (case["layout"], s1, s2)
        for r in res:
            assert r["baseline"]["rows"] == n_mp * r["s1"]["rows"] == n_mp * r["s2"]["rows"], (case["layout"], r)


def test_s1_all_gather_is_blm_over_n_mp(table):
    """S1's MP all-gather input per rank is B*L*M / N_MP (even batches, T divisible by N_MP)."""
    P, values = table
    for k, case in enumerate(values[0]["cases"]):
        n_mp = case["layout"][0]
        T = case["tokens"][0]
        if n_mp == 1 or len(set(case["tokens"])) != 1 or T % n_mp:
            continue
        for v in values:
            r = v["cases"][k]["results"]["s1"]
            gathers = [n for op, g, n in r["sent"]["fwd"] if op == "all_gather" and len(g) == n_mp]
            assert gathers[-1] == T * _parm_cases.D_MODEL * v["cases"][k]["itemsize"] // n_mp


def test_saa_equals_all_gather_of_all_to_all(table):
    P, values = table
    failures = [f"rank {r}: {f}" for r, v in enumerate(values) for f in v["saa"]]
    assert not failures, "\n".join(failures[:10])


def test_hierarchical_all_to_all_equals_flat(table):
    """Bitwise equal forward and backward on n x p virtual nodes (uneven and zero splits); the
    inter-node bytes of a node are the flat ones, in at most n - 1 messages per rank."""
    P, values = table
    failures = [f"rank {r}: {f}" for r, v in enumerate(values) for f in v["hier"]["failures"]]
    assert not failures, "\n".join(failures[:10])
    stats = [s for v in values for s in v["hier"]["stats"]]
    for key in {(s["shape"], s["seed"]) for s in stats}:
        (n, p), _ = key
        group = [s for s in stats if (s["shape"], s["seed"]) == key]
        assert sum(s["hier_bytes"] for s in group) == sum(s["flat_bytes"] for s in group)
        assert max(s["hier_msgs"] for s in group) <= n - 1
        assert all(s["rail_calls"] == 1 for s in group)
        # every hierarchical message to node b stands for >= 1 flat message from its node to b
        assert sum(s["hier_msgs"] for s in group) <= sum(s["flat_msgs"] for s in group)


@pytest.mark.parametrize(
    "name, exc, needle",
    [
        ("n_mp does not divide P", "LayoutError", "n_mp=3 does not divide"),
        ("experts do not fit the EP size", "LayoutError", "is not divisible by the expert-parallel size"),
        ("d_ffn does not divide over ESP", "LayoutError", "d_ffn=25 is not divisible by the expert-sharding size"),
        ("config differs on one rank", "LayoutError", "parm_schedule: rank 0='s1', rank 1='s2'"),
        ("mismatched groups", "LayoutError", "every member of a group must pass that same group"),
        ("layout differs on one rank", "LayoutError", "passed another layout than rank 0"),
    ],
)
def test_bad_input_raises_the_same_error_on_every_rank(table, name, exc, needle):
    P, values = table
    outcomes = [next(e for e in v["errors"] if e[0] == name) for v in values]
    assert all(o[1] == exc for o in outcomes), outcomes
    assert len({o[2] for o in outcomes}) == 1, "ranks raised different messages"
    assert needle in outcomes[0][2], outcomes[0][2]
    assert all(o[3] < 5.0 for o in outcomes)


@pytest.mark.parametrize("name", ["from process groups", "from a DeviceMesh (esp_inner)", "from a DeviceMesh (ep_inner)"])
def test_layout_read_from_groups_or_mesh(table, name):
    P, values = table
    for v in values:
        got = next(e for e in v["errors"] if e[0] == name)
        assert got[1] is None and got[2] == "same", got


def test_auto_decides_the_same_everywhere(table):
    P, values = table
    if P > 4:
        pytest.skip("auto runs in the 4-rank group (its fit times every collective: the test-time budget)")
    decisions = {v["auto_trace"]["auto"] for v in values}
    assert len(decisions) == 1 and decisions <= {"baseline", "s1", "s2"}, decisions
    # every rank fitted the same model (fits, local work, measured startups): the same
    # predictions, so the same pick at every batch size
    models = [v["auto_trace"]["auto_model"] for v in values]
    differ = [k for k in models[0] if any(m[k] != models[0][k] for m in models[1:])]
    assert not differ, (differ, [m[differ[0]] for m in models])
    assert set(models[0]["startup"]) == {"baseline", "s1", "s2"}
    assert all(all(v["auto_trace"]["auto_grads_before_backward"]) for v in values)


def test_simulator_records_the_schedule_the_layer_runs(table):
    """The simulator's program of each rank has the same communication operations (lane, op,
    kind, phase), in the same order, as the real layer's trace, for all three schedules."""
    P, values = table
    assert _parm_cases.sim_trace_mismatches(values, P) == []


def test_rank_dying_during_saa_raises_on_survivors():
    """Rank 1 of 2 exits inside S2's SAA (between two of its point-to-point phases): the
    survivor's step ends in an exception within the group timeout, never a hang (gloo reports
    the closed connection at once; the short timeout bounds the survivor's exit barrier)."""
    pg_timeout = 4.0
    results, _ = run_group(2, _parm_cases.saa_peer_exit, 1, deadline_s=pg_timeout + 40, pg_timeout_s=pg_timeout)
    assert results[1].status == "missing"
    r = results[0]
    assert r.status == "ok", r.value
    assert r.value["raised"] is not None, "the survivor finished a step with a dead peer"
    assert r.value["elapsed"] < pg_timeout + 5.0, r.value
