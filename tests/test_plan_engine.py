"""The discrete-event engine: invariants on random programs, fair sharing, collective matching,
the closed form of MPMoE's Paradigm 1, and the simulated layer step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe.comm import VirtualTensor, Work, plan_from_counts
from tritonmoe.comm.executor import COMM, COMM2, COMPUTE, COPY
from tritonmoe.comm.programs.pipeline import forward_pass
from tritonmoe.plan import (
    CollectiveMismatchError,
    ComputeRate,
    CostModel,
    LinearFit,
    ScheduleHangError,
    SimExecutor,
    VirtualGroup,
)
from tritonmoe.sim.simulate import simulate
from tritonmoe.sim import engine

EPS = 1e-12


def _model(*, alpha=0.0, inv_bw=1e-9, group_sizes=(1, 2, 3, 4), launch=0.0, flops=1e9, interference=None,
           slots=None, host_op=0.0, host_compute=False) -> CostModel:
    """A synthetic fitted model: every collective alpha + bytes * inv_bw, compute flops / rate."""
    coll = {(k, p, "intra"): LinearFit.line(alpha, inv_bw)
            for k in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "send_recv") for p in group_sizes}
    return CostModel(
        collectives=coll,
        copies={"copy_d2h": LinearFit.line(0.0, 1e-9), "copy_h2d": LinearFit.line(0.0, 1e-9)},
        compute={"gemm": ComputeRate(flops, math.inf, launch), "elementwise": ComputeRate(math.inf, 1e9, launch),
                 "copy": ComputeRate(math.inf, 1e9, launch)},
        interference=dict(interference or {}),
        lane_slots=dict(slots or {}),
        host_op_s=host_op,
        host_compute=host_compute,
    )


# ---------------------------------------------------------------------------------------------
# Random programs: every invariant of the engine
# ---------------------------------------------------------------------------------------------


@st.composite
def programs(draw):
    """P ranks; a shared sequence of collectives (same kind and sizes on every rank, in order)
    interleaved per rank with random computes, copies and waits; random lanes and deps."""
    P = draw(st.integers(1, 4))
    host_compute = draw(st.booleans())
    world = VirtualGroup(tuple(range(P)))
    coll = draw(st.lists(st.tuples(st.sampled_from(["all_to_all", "all_gather", "all_reduce"]),
                                   st.integers(1, 64), st.sampled_from([COMM, COMM2])), max_size=6))
    exs = [SimExecutor(r, world, host_compute=host_compute) for r in range(P)]
    for r, ex in enumerate(exs):
        handles = []
        queue = list(coll)
        local = draw(st.lists(st.tuples(st.sampled_from(["compute", "copy", "wait", "coll"]), st.integers(1, 50),
                                        st.integers(0, 1000)), max_size=12))
        local += [("coll", 1, 0)] * len(queue)
        for what, size, pick in local:
            after = (handles[pick % len(handles)],) if handles and pick % 3 == 0 else ()
            if what == "compute":
                lane = COMPUTE if pick % 4 else COPY
                handles.append(ex.compute(None, work=Work(size * 1e5, 0.0, "gemm", 1), kind="c", lane=lane, after=after))
            elif what == "copy":
                handles.append(ex.copy(VirtualTensor((size, 256), torch.float32), to="host", kind="off", after=after))
            elif what == "wait" and handles:
                ex.wait(handles[pick % len(handles)])
            elif what == "coll" and queue:
                kind, rows, lane = queue.pop(0)
                x = VirtualTensor((rows * P, 64), torch.float32)
                if kind == "all_to_all":
                    h = ex.all_to_all(x, [rows] * P, [rows] * P, kind="a2a", lane=lane, after=after)
                elif kind == "all_gather":
                    h = ex.all_gather(x, kind="ag", lane=lane, after=after)
                else:
                    h = ex.all_reduce(x, kind="ar", lane=lane, after=after)
                handles.append(h)
    return [ex.program for ex in exs], host_compute, draw(st.sampled_from([1, 2]))


@settings(max_examples=60)
@given(programs())
def test_engine_invariants(case):
    progs, host_compute, slots = case
    cost = _model(slots={COMM: slots}, host_op=2e-6, host_compute=host_compute,
                  interference={("comm", "comp"): 0.7, ("comp", "comm"): 0.9})
    res = engine.run(progs, cost)
    again = engine.run(progs, cost)
    for prog in progs:
        tim = res.timings[prog.rank]
        assert [(t.start, t.end) for t in tim] == [(t.start, t.end) for t in again.timings[prog.rank]]  # deterministic
        by_lane: dict = {}
        for o, t in zip(prog.ops, tim):
            assert t.issue - EPS <= t.start <= t.end + EPS
            for d in o.deps:  # dependencies end before the op starts
                assert tim[d].end <= t.start + EPS, (o, prog.ops[d])
            if o.host_after is not None:  # the host waited before issuing it
                assert tim[o.host_after].end <= t.issue + EPS
            by_lane.setdefault(o.lane, []).append(t)
        for lane, ts in by_lane.items():  # FIFO: starts in issue order, at most `slots` at once
            k = slots if lane == COMM else 1
            assert all(a.start <= b.start + EPS for a, b in zip(ts, ts[1:]))
            for i, t in enumerate(ts):
                running = sum(1 for u in ts[:i] if u.end > t.start + 1e-9)
                assert running < k
        issues = [t.issue for t in tim]
        assert issues == sorted(issues)  # the host issues in program order
    # a collective ends at the same time on every member (they start together)
    for k in range(len([o for o in progs[0].ops if o.op != "compute" and o.group is not None])):
        ends = []
        for prog in progs:
            colls = [i for i, o in enumerate(prog.ops) if o.group is not None]
            ends.append(res.timings[prog.rank][colls[k]].end)
        assert max(ends) - min(ends) <= 1e-12


# ---------------------------------------------------------------------------------------------
# Fair sharing, interference, host model
# ---------------------------------------------------------------------------------------------


def _a2a_programs(P, lanes, nbytes, host_compute=False):
    world = VirtualGroup(tuple(range(P)))
    progs = []
    rows = nbytes // 4 // 64
    for r in range(P):
        ex = SimExecutor(r, world, host_compute=host_compute)
        for lane in lanes:
            ex.all_to_all(VirtualTensor((rows, 64), torch.float32), [rows // P] * P, [rows // P] * P, kind="x", lane=lane)
        progs.append(ex.program)
    return progs


def _span(res, rank=0, i=0):
    t = res.timings[rank][i]
    return t.end - t.start


def test_fair_share_two_equal_transfers_take_twice_as_long():
    cost = _model(alpha=0.0, inv_bw=1e-9)
    one = engine.run(_a2a_programs(2, [COMM], 2**24), cost)
    two = engine.run(_a2a_programs(2, [COMM, COMM2], 2**24), cost)
    t1 = _span(one)
    assert t1 == pytest.approx(2**24 * 1e-9)
    assert _span(two, 0, 0) == pytest.approx(2 * t1) and _span(two, 0, 1) == pytest.approx(2 * t1)
    # on one lane they run one after the other (FIFO), same total
    serial = engine.run(_a2a_programs(2, [COMM, COMM], 2**24), cost)
    assert serial.timings[0][1].start == pytest.approx(t1) and serial.timings[0][1].end == pytest.approx(2 * t1)
    # latency is not shared: only the size-proportional part is
    lat = _model(alpha=1e-3, inv_bw=1e-9)
    two = engine.run(_a2a_programs(2, [COMM, COMM2], 2**24), lat)
    assert _span(two) == pytest.approx(1e-3 + 2 * t1)
    # a gloo-style lane with two slots runs both at once, sharing the link
    slots = _model(slots={COMM: 2})
    both = engine.run(_a2a_programs(2, [COMM, COMM], 2**24), slots)
    assert both.timings[0][1].start == 0.0 and _span(both, 0, 1) == pytest.approx(2 * t1)
    # and alpha(comm, comm) slows concurrent collectives beyond the fair share
    worse = engine.run(_a2a_programs(2, [COMM, COMM2], 2**24), _model(interference={("comm", "comm"): 0.5}))
    assert _span(worse) == pytest.approx(4 * t1)


def test_unequal_transfers_max_min_fair():
    """A short and a long transfer on one link: both at half speed until the short one ends, then
    the long one alone."""
    world = VirtualGroup((0, 1))
    progs = []
    for r in range(2):
        ex = SimExecutor(r, world, host_compute=False)
        ex.all_gather(VirtualTensor((1000, 250), torch.float32), kind="short", lane=COMM)  # 1 MB
        ex.all_gather(VirtualTensor((3000, 250), torch.float32), kind="long", lane=COMM2)  # 3 MB
        progs.append(ex.program)
    res = engine.run(progs, _model(inv_bw=1e-9))
    assert res.timings[0][0].end == pytest.approx(2e-3)  # 1 ms of work at half speed
    assert res.timings[0][1].end == pytest.approx(4e-3)  # 2 ms at half speed, then 2 ms alone


def test_interference_and_host_models():
    world = VirtualGroup((0, 1))
    cost = _model(inv_bw=1e-9, flops=1e9, interference={("comm", "comp"): 0.5, ("comp", "comm"): 0.8})

    def prog(host_compute):
        out = []
        for r in range(2):
            ex = SimExecutor(r, world, host_compute=host_compute)
            h = ex.all_gather(VirtualTensor((1000, 250), torch.float32), kind="comm")  # 1 ms alone
            ex.compute(None, work=Work(1e6, 0, "gemm", 1), kind="comp")  # 1 ms alone
            ex.wait(h)
            ex.compute(None, work=Work(1e6, 0, "gemm", 1), kind="after")
            out.append(ex.program)
        return out

    res = engine.run(prog(False), cost)
    t = res.timings[0]
    # concurrently: comm at 0.5, compute at 0.8 -> compute ends at 1.25 ms with comm 0.625 done;
    # then comm alone: 0.375 ms more
    assert t[1].end == pytest.approx(1.25e-3) and t[0].end == pytest.approx(1.625e-3)
    # CUDA host model: the op after the wait starts when the comm ends (a stream wait)
    assert t[2].start == pytest.approx(1.625e-3)
    # CPU host model: same timings here (the compute runs on the issuing thread after the
    # collective was issued); the op after the wait is issued only when the comm has ended
    res_cpu = engine.run(prog(True), cost)
    assert res_cpu.timings[0][2].issue == pytest.approx(1.625e-3)


def test_ranks_share_a_cpu():
    """CPU host model with host_cores: ranks computing at once share the node's cores; a rank
    computing alone runs at its measured rate."""
    world = VirtualGroup((0, 1, 2))
    cost = _model(flops=1e9, host_compute=True)
    cost.host_cores, cost.threads_per_rank = 2.0, 1

    def progs(busy):
        out = []
        for r in range(3):
            ex = SimExecutor(r, world, host_compute=True)
            if r in busy:
                ex.compute(None, work=Work(1e6, 0.0, "gemm", 1), kind="c")  # 1 ms alone
            out.append(ex.program)
        return out

    three = engine.run(progs({0, 1, 2}), cost)
    assert three.timings[0][0].end == pytest.approx(1.5e-3)  # 3 ranks on 2 cores
    two = engine.run(progs({0, 1}), cost)
    assert two.timings[0][0].end == pytest.approx(1e-3)  # 2 ranks on 2 cores: no slowdown
    with pytest.raises(ValueError, match="symmetric mode cannot model ranks sharing a CPU"):
        engine.run(progs({0})[:1], cost, symmetric=True)


def test_collective_mismatch_and_hang_are_errors():
    world = VirtualGroup((0, 1))
    a = SimExecutor(0, world, host_compute=False)
    b = SimExecutor(1, world, host_compute=False)
    a.all_to_all(VirtualTensor((4, 8)), [2, 2], [2, 2], kind="dispatch")
    b.all_gather(VirtualTensor((4, 8)), kind="gather")
    with pytest.raises(CollectiveMismatchError, match=r"collective #0 on group \(0, 1\).*all_to_all.*all_gather.*hang"):
        engine.run([a.program, b.program], _model())
    a = SimExecutor(0, world, host_compute=False)
    b = SimExecutor(1, world, host_compute=False)
    a.all_to_all(VirtualTensor((4, 8)), [2, 2], [2, 2], kind="dispatch")
    b.all_to_all(VirtualTensor((4, 8)), [1, 3], [2, 2], kind="dispatch")  # sends 1 row (16 B), rank 0 expects 2
    with pytest.raises(CollectiveMismatchError, match="rank 1 sends 16 bytes to rank 0, which expects 32"):
        engine.run([a.program, b.program], _model())
    a = SimExecutor(0, world, host_compute=False)
    b = SimExecutor(1, world, host_compute=False)
    a.all_gather(VirtualTensor((4, 8)), kind="gather")
    a.all_gather(VirtualTensor((4, 8)), kind="gather")
    b.all_gather(VirtualTensor((4, 8)), kind="gather")
    with pytest.raises(ScheduleHangError, match=r"rank 0: op 1 all_gather .* collective #1 .* never issued by ranks \[1\]"):
        engine.run([a.program, b.program], _model())


# ---------------------------------------------------------------------------------------------
# MPMoE Paradigm 1: closed form vs the engine (PAPERS.md §4.6 Verify 1)
# ---------------------------------------------------------------------------------------------


def _paradigm1_closed(n, tS, tC, tR, ac=1.0, ap=1.0):
    if n == 1:
        return tS + tC + tR
    return (tS + max(tS / ac, tC / ap) + (n - 2) * max((tR + tS) / ac, tC / ap) + max(tR / ac, tC / ap) + tR)


def _paradigm1_engine(n, tS, tC, tR, ac=1.0, ap=1.0):
    """The forward pass of comm.pipeline on 2 symmetric ranks: dispatch (S), expert (C),
    combine (R) of n equal micro-ops, costs chosen so each takes tS, tC, tR alone."""
    rows = 1000
    counts = torch.tensor([[[rows // 2, rows - rows // 2]] * n] * 2)  # [P=2, n, E=2]
    row_bytes = 64 * 4
    # dispatch moves rows*row_bytes per rank; combine the expert output of width wR
    wR = max(1, round(64 * tR / tS))
    cost = _model(inv_bw=tS / (rows * row_bytes), flops=1e9,
                  interference={("comm", "comp"): ac, ("comp", "comm"): ap})
    progs = []
    for r in range(2):
        plan = plan_from_counts(counts, r)
        ex = SimExecutor(r, VirtualGroup((0, 1)), host_compute=False)
        sends = [VirtualTensor((plan.send_rows(i), 64), torch.float32) for i in range(n)]
        forward_pass(ex, sends, plan, None, work=lambda i: Work(tC * 1e9, 0.0, "gemm", 1),
                     out_like=lambda i: VirtualTensor((plan.recv_rows(i), wR), torch.float32))
        progs.append(ex.program)
    res = engine.run(progs, cost)
    return res.step_time(), tS, tS * wR / 64  # the combine's time with the rounded width


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("tS,tC,tR", [(1.0, 3.0, 1.0), (1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 0.5, 2.0), (1.0, 1.5, 1.0)])
def test_paradigm1_closed_form_equals_engine(n, tS, tC, tR):
    scale = 1e-3 / n  # per micro-batch times
    t, _, tR_eff = _paradigm1_engine(n, tS * scale, tC * scale, tR * scale)
    closed = _paradigm1_closed(n, tS * scale, tC * scale, tR_eff)
    assert t == pytest.approx(closed, rel=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_paradigm1_with_interference_is_bounded_by_the_phase_form(n):
    """With alpha < 1 the phases interleave; the engine (no phase barriers) is never slower than
    the phase-barrier closed form, and never faster than the interference-free one."""
    s = 1e-3 / n
    for tS, tC, tR in [(1.0, 2.0, 1.0), (1.0, 1.0, 1.0), (2.0, 1.0, 1.0)]:
        t, _, tR_eff = _paradigm1_engine(n, tS * s, tC * s, tR * s, ac=0.7, ap=0.9)
        hi = _paradigm1_closed(n, tS * s, tC * s, tR_eff, ac=0.7, ap=0.9)
        lo = _paradigm1_closed(n, tS * s, tC * s, tR_eff)
        assert lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)


# ---------------------------------------------------------------------------------------------
# The simulated layer step
# ---------------------------------------------------------------------------------------------


def test_simulated_step_symmetric_mode_and_overlap():
    from tritonmoe.plan import Cluster

    cfg = tm.MoEConfig(1024, 512, 16, 2)
    c = Cluster.preset("dgx-h100", nodes=2)
    full = simulate(cfg, 2048, c, pipeline_degree=4, mode="full")
    sym = simulate(cfg, 2048, c, pipeline_degree=4, mode="symmetric")
    assert sym.symmetric and not full.symmetric
    assert sym.step_time() == pytest.approx(full.step_time(), rel=1e-12)  # identical ranks: exact
    # n = 1: the forward's communication never overlaps the expert compute
    one = simulate(cfg, 2048, c, pipeline_degree=1)
    b = one.breakdown("fwd")
    assert b["overlap"] == 0.0 and b["pipeline_efficiency"] == 0.0
    assert one.pipeline_efficiency("fwd") == 0.0
    # pipelined: some overlap; per-rank spans for every rank
    assert full.breakdown()["overlap"] > 0 and full.ranks() == list(range(16))
    bd = full.breakdown()
    assert bd["compute"] + bd["exposed_comm"] + bd["idle"] == pytest.approx(bd["step"], rel=1e-9)


def test_simulated_step_uses_the_schedule_functions_and_skewed_routing():
    from tritonmoe.plan import routing_counts

    cfg = tm.MoEConfig(64, 128, 8, 2)
    cost = _model(group_sizes=(4,), host_compute=True, launch=1e-5)
    tl = simulate(cfg, [64, 0, 17, 128], cost, pipeline_degree=2, routing="zipf:1.5", dtype=torch.float32)
    ops = tl.result.programs[0].ops
    # two dispatch and two combine all-to-alls per pass, and the counts exchange
    kinds = [(o.kind, o.phase) for o in ops if o.op == "all_to_all"]
    assert kinds.count(("dispatch", "fwd")) == 2 and kinds.count(("combine", "bwd")) == 2
    assert kinds[0] == ("counts", "fwd")
    # zipf: rank 0 owns the hottest experts and receives the most rows
    counts = routing_counts(cfg, [64, 0, 17, 128], 2, "zipf:1.5")
    recv = counts.sum(dim=(0, 1)).view(4, 2).sum(-1)
    assert recv[0] == recv.max() and counts[1].sum() == 0
    for r, T in enumerate([64, 0, 17, 128]):
        assert int(counts[r].sum()) == T * 2
