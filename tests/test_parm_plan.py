"""Parm without processes: layouts (placement, validation), the plans every split of a step
derives from (consistency across ranks, the Dump / combine positions, S2's gathered rows, the
baseline's origins), the hierarchical all-to-all's step sizes (a label simulation equals the flat
exchange), SAA's schedule recorded on the simulator (every point-to-point message has a matching
receive), Algorithm 1 and the alpha-beta fit. Properties with hypothesis, named edge cases."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe.comm.programs.hierarchical import _send_layout_index, hierarchical_plan
from tritonmoe.comm.programs.model_parallel import baseline_plan, pause_plan, s2_part_counts, saa_plan
from tritonmoe.parm_layout import LayoutError, ParmLayout
from tritonmoe.policy.parm_schedule import AlphaBeta, ParmCostModel, algorithm1, fit_alpha_beta, step_times


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


def test_paper_figure_2_layout():
    """003 Fig. 2: N_MP = N_EP = N_ESP = 2 on 2 nodes x 2 GPUs: EP groups inside a node, ESP
    groups across nodes, MP groups inside a node (EP-inner placement)."""
    lay = ParmLayout.make(2, 2, 2, placement="ep_inner")
    groups = lay.all_groups()
    assert groups["ep"] == [(0, 1), (2, 3)]
    assert groups["esp"] == [(0, 2), (1, 3)]
    assert groups["mp"] == [(0, 1), (2, 3)]
    assert [lay.holder(a, s) for s in range(2) for a in range(2)] == [0, 1, 2, 3]


def test_esp_inner_places_shards_of_an_expert_on_consecutive_ranks():
    lay = ParmLayout.make(4, 2, 4)
    assert lay.all_groups()["esp"] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert lay.all_groups()["ep"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert lay.num_batches == 2


layout_params = st.sampled_from([1, 2, 4, 8]).flatmap(
    lambda P: st.tuples(
        st.just(P),
        st.sampled_from([d for d in (1, 2, 4, 8) if P % d == 0]),
        st.sampled_from([d for d in (1, 2, 4, 8) if P % d == 0]),
        st.sampled_from(["esp_inner", "ep_inner"]),
    )
)


@given(layout_params)
def test_layout_is_a_grid_and_coordinates_are_group_positions(params):
    P, n_mp, n_esp, placement = params
    lay = ParmLayout.make(n_mp, P // n_esp, n_esp, placement=placement)
    for i in range(P):
        ep, esp, mp = lay.ep_group_of(i), lay.esp_group_of(i), lay.mp_group_of(i)
        assert ep.index(i) == lay.ep[i] and esp.index(i) == lay.esp[i] and mp.index(i) == lay.mp_rank[i]
        assert len(set(ep) & set(esp)) == 1
        assert all(lay.ep[j] == lay.ep[i] for j in esp) and all(lay.esp[j] == lay.esp[i] for j in ep)
        assert mp == tuple(range(i - i % n_mp, i - i % n_mp + n_mp))  # consecutive: inside a node
    assert sorted(lay.encode()) == sorted(ParmLayout.from_coords(
        [(lay.mp_group[i], lay.mp_rank[i], lay.ep[i], lay.esp[i]) for i in range(P)], n_mp=n_mp, n_ep=P // n_esp,
        n_esp=n_esp).encode())


@pytest.mark.parametrize(
    "build, needle",
    [
        (lambda: ParmLayout.make(3, 2, 2), "n_mp=3 does not divide"),
        (lambda: ParmLayout.make(2, 2, 2, placement="diagonal"), "placement='diagonal'"),
        (lambda: ParmLayout.make(0, 2, 2), "n_mp must be a positive int"),
        (lambda: ParmLayout.from_coords([(0, 0, 0, 0), (0, 1, 0, 0)], n_mp=2, n_ep=2, n_esp=1), "appear once"),
        (lambda: ParmLayout.from_coords([(0, 1, 0, 0), (0, 0, 1, 0)], n_mp=2, n_ep=2, n_esp=1), "mp ranks 0..1"),
        (lambda: ParmLayout.from_coords([(0, 0, 1, 0), (0, 1, 0, 0)], n_mp=2, n_ep=2, n_esp=1), "increase with the rank"),
        (lambda: ParmLayout.make(2, 2, 2).check_model(7, 24), "num_experts=7 is not divisible by the expert-parallel size n_ep=2"),
        (lambda: ParmLayout.make(2, 2, 4).check_model(8, 6), "d_ffn=6 is not divisible by the expert-sharding size n_esp=4"),
    ],
)
def test_bad_layouts(build, needle):
    with pytest.raises(LayoutError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        build()


def test_parm_schedule_is_validated():
    with pytest.raises(ValueError, match="parm_schedule='s3'"):
        tm.MoEConfig(8, 8, 4, 1, parm_schedule="s3")
    assert tm.MoEConfig(8, 8, 4, 1).parm_schedule == "auto"


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------

E = 8


def _tables(draw_counts, P):
    return [[draw_counts[(j * E + e) % len(draw_counts)] for e in range(E)] for j in range(P)]


@settings(max_examples=15)
@given(layout_params, st.lists(st.integers(0, 5), min_size=1, max_size=64))
def test_pause_plans_agree_and_dump_is_inverted_by_the_combine(params, counts):
    P, n_mp, n_esp, placement = params
    lay = ParmLayout.make(n_mp, P // n_esp, n_esp, placement=placement)
    if E % lay.n_ep:
        return
    table = _tables(counts, P)
    plans = [pause_plan(lay, i, table, E) for i in range(P)]
    L = E // lay.n_ep
    for j, d in itertools.product(range(P), range(P)):
        assert plans[j].send_splits[d] == plans[d].recv_splits[j]
        assert plans[d].recv_counts[j].tolist() == table[j][lay.ep[d] * L : (lay.ep[d] + 1) * L]
    for i, pl in enumerate(plans):
        R = sum(table[i])
        assert pl.send_rows == n_esp * R
        # the reverse all-to-all returns rows in place: copy s of row r sits at combine_pos[r, s]
        assert torch.equal(pl.dump_index[pl.combine_pos], torch.arange(R).unsqueeze(1).expand(R, n_esp))
        assert sorted(pl.combine_pos.reshape(-1).tolist()) == list(range(pl.send_rows))
        # copy s of a row of expert e goes to the rank holding shard s of e
        cs = [0]
        for v in pl.send_splits:
            cs.append(cs[-1] + v)
        for r in range(R):
            e = next(e for e in range(E) if sum(table[i][: e + 1]) > r)
            for s in range(n_esp):
                d = next(d for d in range(P) if cs[d] <= int(pl.combine_pos[r, s]) < cs[d + 1])
                assert (lay.ep[d], lay.esp[d]) == (e // L, s)
        order = [(lay.mp_group[j], lay.mp_rank[j]) for j in pl.wgrad_groups]
        assert order == sorted(order) and sorted(pl.wgrad_groups) == list(range(P))


@settings(max_examples=10)
@given(layout_params, st.lists(st.integers(0, 7), min_size=1, max_size=32))
def test_saa_plan_finds_every_rows_partials_in_the_gathered_buffer(params, counts):
    """Label every row of a batch, run S2's split, Dump and (simulated) reverse exchange for
    each MP rank, concatenate the MP ranks' returned buffers as SAA does: full_pos[r, s] must
    point at row r's copy for shard s."""
    P, n_mp, n_esp, placement = params
    lay = ParmLayout.make(n_mp, P // n_esp, n_esp, placement=placement)
    if E % lay.n_ep:
        return
    batch = [[counts[(g * E + e) % len(counts)] for e in range(E)] for g in range(lay.num_batches)]
    table = [s2_part_counts(batch[lay.mp_group[i]], n_mp, lay.mp_rank[i]) for i in range(P)]
    for i in range(P):
        g = lay.mp_group[i]
        sp = saa_plan(lay, i, batch[g], E)
        gathered = []
        for q, peer in enumerate(sp.mp_peers):
            part_rows = _part_rows(batch[g], n_mp, q)  # batch rows of peer q's part
            pl = pause_plan(lay, peer, table, E)
            assert pl.send_splits == sp.peer_recv_splits[q]
            gathered += [(part_rows[int(r)], _shard_of(lay, pl, k)) for k, r in enumerate(pl.dump_index)]
        R = sum(batch[g])
        assert sp.full_pos.shape == (R, n_esp)
        for r in range(R):
            for s in range(n_esp):
                assert gathered[int(sp.full_pos[r, s])] == (r, s)


def _part_rows(counts, n_mp, q):
    rows, off = [], 0
    for c in counts:
        base, extra = divmod(c, n_mp)
        lo = q * base + min(q, extra)
        hi = lo + base + (1 if q < extra else 0)
        rows += range(off + lo, off + hi)
        off += c
    return rows


def _shard_of(lay, pl, k):
    acc = 0
    for d, n in enumerate(pl.send_splits):
        if acc <= k < acc + n:
            return lay.esp[d]
        acc += n
    raise AssertionError


@settings(max_examples=12)
@given(layout_params, st.lists(st.integers(0, 5), min_size=1, max_size=40), st.lists(st.integers(0, 6), min_size=8, max_size=8))
def test_baseline_plans_agree_and_keep_one_copy_per_batch(params, counts, tokens):
    P, n_mp, n_esp, placement = params
    lay = ParmLayout.make(n_mp, P // n_esp, n_esp, placement=placement)
    if E % lay.n_ep:
        return
    G = lay.num_batches
    batch = [[counts[(g * E + e) % len(counts)] for e in range(E)] for g in range(G)]
    table = [batch[lay.mp_group[i]] for i in range(P)]
    tok = [tokens[lay.mp_group[i] % 8] for i in range(P)]
    plans = [baseline_plan(lay, i, tok, table, E) for i in range(P)]
    for i, pl in enumerate(plans):
        assert pl.origins == list(lay.esp_group_of(i)) and pl.own == lay.esp[i]
        total = sum(pl.own_rows)
        assert sorted(pl.send_index.tolist()) == list(range(total))
        base = 0
        for k, rows in enumerate(pl.own_rows):  # origin k's rows sit where send_index says
            assert pl.send_index[pl.origin_pos[k]].tolist() == list(range(base, base + rows))
            base += rows
        for j in lay.ep_group_of(i):
            assert pl.send_splits[lay.ep[j]] == plans[j].recv_splits[lay.ep[i]]
        kept = [lay.holder(o // n_esp, o % n_esp) for o in pl.wgrad_groups]
        assert [lay.mp_group[o] for o in kept] == list(range(G))
        assert all(lay.mp_rank[o] == 0 for o in kept)


# ---------------------------------------------------------------------------------------------
# Hierarchical all-to-all: the step sizes move every row where the flat exchange does
# ---------------------------------------------------------------------------------------------


def _a2a(buffers, splits):
    """Simulated all-to-all of labelled rows: splits[r][d] rows of rank r's buffer go to d."""
    P = len(buffers)
    out = [[] for _ in range(P)]
    for r in range(P):
        off = 0
        for d in range(P):
            out[d].append(buffers[r][off : off + splits[r][d]])
            off += splits[r][d]
    return [[x for chunk in out[d] for x in chunk] for d in range(P)]


@settings(max_examples=60)
@given(st.sampled_from([(1, 4), (2, 2), (2, 4), (4, 2), (3, 2), (2, 3)]), st.data())
def test_hierarchical_steps_equal_the_flat_exchange(shape, data):
    n, p = shape
    P = n * p
    S = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=P, max_size=P), min_size=P, max_size=P))
    inputs = [[(r, d, k) for d in range(P) for k in range(S[r][d])] for r in range(P)]
    flat = _a2a(inputs, S)
    # step 1 (intra-node, per node): regroup by local peer, exchange
    plans = []
    for r in range(P):
        a, j = divmod(r, p)
        recv = [S[s][r] for s in range(P)]
        peer = [[S[a * p + i][b * p + j] for b in range(n)] for i in range(p)]
        plans.append(hierarchical_plan(S[r], recv, peer, r, p))
    stage = []
    for r in range(P):
        rows = [x for st_, c in _send_layout_index(S[r], p) for x in inputs[r][st_ : st_ + c]]
        stage.append(rows)
    mid = [None] * P
    for a in range(n):
        node = list(range(a * p, (a + 1) * p))
        splits = [[plans[r].intra_send[k] for k in range(p)] for r in node]
        res = _a2a([stage[r] for r in node], splits)
        for k, r in enumerate(node):
            assert len(res[k]) == plans[r].rows_mid and [len(x) for x in [res[k]]] == [sum(plans[r].intra_recv)]
            mid[r] = res[k]
    # layout transform (i, b) -> (b, i), then step 3 over each rail
    for r in range(P):
        chunks, off = {}, 0
        for i in range(p):
            for b in range(n):
                c = plans[r].transform[i][b]
                chunks[(i, b)] = mid[r][off : off + c]
                off += c
        mid[r] = [x for b in range(n) for i in range(p) for x in chunks[(i, b)]]
    out = [None] * P
    for j in range(p):
        rail = [b * p + j for b in range(n)]
        res = _a2a([mid[r] for r in rail], [plans[r].inter_send for r in rail])
        for k, r in enumerate(rail):
            out[r] = res[k]
            assert len(out[r]) == plans[r].rows_out
    assert out == flat


# ---------------------------------------------------------------------------------------------
# SAA on the simulator: every message has its matching receive
# ---------------------------------------------------------------------------------------------


@settings(max_examples=25)
@given(st.sampled_from([(4, 2), (4, 4), (8, 2), (8, 4)]), st.data())
def test_saa_schedule_messages_match_across_ranks(shape, data):
    from tritonmoe.comm.executor import VirtualTensor
    from tritonmoe.comm.programs.saa import saa_schedule
    from tritonmoe.plan import SimExecutor, VirtualGroup

    P, n_mp = shape
    S = data.draw(st.lists(st.lists(st.integers(0, 4), min_size=P, max_size=P), min_size=P, max_size=P))
    world = VirtualGroup(tuple(range(P)))
    sent, recvd = {}, {}
    for r in range(P):
        mp = VirtualGroup(tuple(range(r - r % n_mp, r - r % n_mp + n_mp)))
        peers = list(mp.ranks)
        ex = SimExecutor(r, world, host_compute=True)
        send = S[r]
        recv = [S[s][r] for s in range(P)]
        h = saa_schedule(ex, VirtualTensor((sum(send), 4), torch.float32), send, recv, group=world, rank=r,
                         mp_group=mp, mp_peers=peers, peer_recv_splits=[[S[s][q] for s in range(P)] for q in peers])
        assert h.value.shape[0] == sum(S[s][q] for q in peers for s in range(P))
        for op in ex.program.ops:
            if op.op != "send_recv":
                continue
            for k, b in enumerate(op.send_bytes):
                if b:
                    sent.setdefault((op.lane, r, op.group.ranks[k], op.micro_op), []).append(b)
            for k, b in enumerate(op.recv_bytes):
                if b:
                    recvd.setdefault((op.lane, op.group.ranks[k], r, op.micro_op), []).append(b)
        lanes = {op.lane for op in ex.program.ops if op.op == "send_recv"}
        assert lanes <= {"comm", "comm2"}
    assert sent == recvd


# ---------------------------------------------------------------------------------------------
# Algorithm 1 and the fit
# ---------------------------------------------------------------------------------------------


def test_fit_recovers_alpha_beta_and_clamps_noise():
    sizes = [1e3, 1e4, 1e5, 1e6]
    ab = fit_alpha_beta(sizes, [6.64e-4 + 5.38e-10 * x for x in sizes])
    assert ab.alpha == pytest.approx(6.64e-4, rel=1e-9) and ab.beta == pytest.approx(5.38e-10, rel=1e-9)
    assert fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0]).beta == 0.0  # decreasing times: noise
    assert fit_alpha_beta([10, 20], [0.0, 1.0]).alpha == 0.0
    with pytest.raises(ValueError):
        fit_alpha_beta([1, 2], [1.0])


@given(st.floats(1e-6, 1e-2), st.floats(1e-12, 1e-7), st.integers(2, 8))
def test_relative_fit_recovers_alpha_beta_exactly(alpha, beta, n):
    """Least squares on the relative error (weights 1/t^2) is exact on exact data, at any
    spread of the sizes."""
    from tritonmoe.policy.parm_schedule import geometric_sizes

    sizes = [float(x) for x in geometric_sizes(64, 64 * 4 ** n)]
    ab = fit_alpha_beta(sizes, [alpha + beta * x for x in sizes], relative=True)
    assert ab.alpha == pytest.approx(alpha, rel=1e-6) and ab.beta == pytest.approx(beta, rel=1e-6)


def test_relative_fit_keeps_the_startup_when_the_largest_message_is_noisy():
    """5% noise on the largest of sizes spanning four decades: unweighted least squares lets it
    move alpha (what decides between schedules with different numbers of collectives) by more
    than alpha itself; on the relative error alpha moves by a few percent."""
    alpha, beta = 5e-4, 2e-9
    sizes = [1e2, 1e3, 1e4, 1e5, 1e6]
    t = [alpha + beta * x for x in sizes]
    t[-1] *= 1.05
    plain = fit_alpha_beta(sizes, t)
    rel = fit_alpha_beta(sizes, t, relative=True)
    assert abs(rel.alpha - alpha) < 0.05 * alpha
    assert abs(plain.alpha - alpha) > abs(rel.alpha - alpha)
    assert fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0], relative=True).beta == 0.0
    assert fit_alpha_beta([10, 20], [0.0, 1.0], relative=True).alpha == 0.0  # a zero time weighs as the least


def test_fit_sizes_span_the_layers_messages():
    """The collectives are timed from one row per peer up to the layer's largest message (so
    the fits are evaluated inside their span), the local work up to the baseline's rows."""
    from tritonmoe.policy.parm_schedule import (
        collective_rows,
        geometric_sizes,
        local_tokens,
        message_elements,
    )

    assert geometric_sizes(1, 64) == [1, 4, 16, 64] and geometric_sizes(16, 100) == [16, 64, 100]
    assert geometric_sizes(5, 5) == [5, 6]
    for n_mp, n_ep, n_esp in ((2, 4, 1), (2, 2, 2), (4, 2, 2)):
        lay = ParmLayout.make(n_mp, n_ep, n_esp)
        for T, d, k in ((64, 64, 1), (512, 64, 2), (256, 256, 2)):
            cfg = tm.MoEConfig(d, 2 * d, 8, k)
            rows = collective_rows(cfg, lay, T, 64)
            assert rows[0] == 1 and rows == sorted(set(rows))
            assert rows[-1] * 2 * 64 >= message_elements(cfg, lay, T) >= k * T * d
            toks = local_tokens(lay, T)
            assert toks[0] == 16 and toks[-1] >= T * n_esp


def test_interleaved_timing_calls_each_size_in_every_round_in_a_rotating_order():
    from tritonmoe.policy.parm_schedule import _time_interleaved

    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    out = _time_interleaved(fns, 4)
    assert len(out) == 3 and all(t >= 0 for t in out)
    assert calls == [0, 1, 2, 0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]  # warm-up, then rotated rounds


def test_measured_startup_adds_to_each_schedules_step():
    """``ParmCostModel.startup`` (measured on the layer) shifts each schedule's prediction by
    its own constant, so it can reverse a pick the fitted terms alone make."""
    import dataclasses

    from tritonmoe.policy.parm_schedule import COLLECTIVES, choose_schedule

    lay = ParmLayout.make(2, 2, 2)
    cfg = tm.MoEConfig(64, 128, 8, 2)
    fits = {k: AlphaBeta(1e-4, 1e-9) for k in COLLECTIVES}
    m = ParmCostModel(ag_mp=fits["ag_mp"], a2a=fits["a2a_all"], overlap=fits["saa"], collectives=fits,
                      flops_per_s=1e10, copy_bytes_per_s=1e10, local=AlphaBeta(1e-3, 1e-5))
    base = step_times(m, cfg, lay, 256)
    first = choose_schedule(m, cfg, lay, 256)
    shift = {s: (0.0 if s == first else -1.0) for s in ("baseline", "s1", "s2")}
    m2 = dataclasses.replace(m, startup=shift)
    t = step_times(m2, cfg, lay, 256)
    assert all(t[s] == pytest.approx(base[s] + shift[s]) for s in t)
    assert choose_schedule(m2, cfg, lay, 256) != first


def _model():
    # Testbed A's AG fit (003 section VI-B); an inter-node-like all-to-all and an SAA that costs
    # the all-to-all plus a quarter of the all-gather per element (partially hidden).
    ag = AlphaBeta(6.64e-4, 5.38e-10)
    a2a = AlphaBeta(2e-4, 2e-9)
    return ParmCostModel(ag_mp=ag, a2a=a2a, overlap=AlphaBeta(a2a.alpha + 1e-4, a2a.beta + 0.25 * ag.beta))


def test_algorithm1_limits_of_the_paper():
    """003 IV-B: with N_ESP = 1 and T -> 0, S2 wins (t_D2 -> 0, t_D1 -> AG_MP(BLM)); as T grows
    (capacity factor f -> infinity) S1 wins, since AG_MP(BLM) does not grow with T."""
    kw = dict(tokens=4096, d_model=1024, num_experts=8, top_k=1, n_esp=1, n_mp=4)
    assert algorithm1(_model(), capacity_factor=1e-3, **kw) == "s2"
    assert algorithm1(_model(), capacity_factor=1e3, **kw) == "s1"
    assert algorithm1(_model(), capacity_factor=1.0, **{**kw, "n_mp": 1}) == "s1"


@given(st.floats(0.01, 100.0), st.sampled_from([1, 2, 4]), st.sampled_from([2, 4]))
def test_algorithm1_flips_once_in_the_capacity_factor(f, n_esp, n_mp):
    """t_D1 - t_D2 is linear in y (the capacity): once S1 wins it keeps winning as f grows."""
    kw = dict(tokens=2048, d_model=512, num_experts=8, top_k=2, n_esp=n_esp, n_mp=n_mp)
    if algorithm1(_model(), capacity_factor=f, **kw) == "s1":
        assert algorithm1(_model(), capacity_factor=2 * f, **kw) == "s1"


def test_step_model_ranks_by_the_fitted_terms():
    """The complete model: n_mp times fewer expert rows and all-to-all elements for S1/S2, more
    collectives; with free collectives the baseline (n_mp times the rows) is slowest, with free
    compute and expensive startups it is fastest (fewest collectives)."""
    from tritonmoe.policy.parm_schedule import COLLECTIVES, choose_schedule

    lay = ParmLayout.make(2, 2, 2)
    cfg = tm.MoEConfig(64, 128, 8, 2)
    free = {k: AlphaBeta(0.0, 0.0) for k in COLLECTIVES}
    compute_bound = ParmCostModel(ag_mp=free["ag_mp"], a2a=free["a2a_all"], overlap=free["saa"], collectives=free,
                                  flops_per_s=1e9, copy_bytes_per_s=1e10, local=AlphaBeta(0.0, 1e-5))
    t = step_times(compute_bound, cfg, lay, 512)
    assert t["baseline"] > t["s1"] and choose_schedule(compute_bound, cfg, lay, 512) != "baseline"
    latency = {k: AlphaBeta(1e-3, 0.0) for k in COLLECTIVES}
    latency_bound = ParmCostModel(ag_mp=latency["ag_mp"], a2a=latency["a2a_all"], overlap=latency["saa"],
                                  collectives=latency, flops_per_s=1e15, copy_bytes_per_s=1e15, local=AlphaBeta(0.0, 0.0))
    lay1 = ParmLayout.make(2, 4, 1)
    assert choose_schedule(latency_bound, cfg, lay1, 16) == "baseline"


def test_bench_parm_rows_follow_the_schema():
    from bench import schema
    from bench.parm import parm_rows, summary

    times = {"baseline": [0.03, 0.031], "s1": [0.02, 0.021], "s2": [0.025, 0.026]}
    r = dict(name="parm/P4/mp2-ep2-esp2/T64-d64-k1", world_size=4, n_mp=2, n_ep=2, n_esp=2, tokens=64, d_model=64,
             d_ffn=128, num_experts=8, top_k=1, capacity_factor=None, dtype="float32", times_s=times,
             median_s={k: sum(v) / 2 for k, v in times.items()}, fastest="s1", auto="s1", algorithm1="s1",
             predicted_s={"baseline": 0.03, "s1": 0.02, "s2": 0.03}, pick_vs_fastest=1.0, algorithm1_vs_fastest=1.0,
             s1_speedup=1.5, s2_speedup=1.2)
    rows = parm_rows([r])
    assert [x["impl"] for x in rows] == ["baseline", "s1", "s2"]
    assert all(x["suite"] == "parm" and x["extra"]["auto"] == "s1" for x in rows)
    for x in rows:
        schema._check(x, schema._resolve("#/$defs/result", schema.SCHEMA), schema.SCHEMA, "$")
    assert summary([r])["auto_hit_rate"] == 1.0
