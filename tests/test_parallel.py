"""Data parallelism x expert parallelism (tritonmoe.parallel) and Lina's priority communication
(tritonmoe.comm.priority): exactness against a single process on the concatenated global batch,
layout-independent initialization, checkpoints across expert-parallel sizes, refusal of plain
DDP / FSDP, micro-op sizes and ordering measured at the backend, no deadlock under skew. The
per-rank bodies are in tests/_parallel_cases.py (see its docstring for the reference design)."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonmoe as tm
from tritonmoe.comm.priority import CommScheduler, partition
from tritonmoe.parallel.init import expert_seed, init_experts_

from _dist import run_group, values_or_fail
import _parallel_cases as cases


# ---------------------------------------------------------------------------------------------
# Spawned groups
# ---------------------------------------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.slow
def test_training_step_equals_single_process():
    """4 ranks as 2 DP x 2 EP and as 4 EP: one SGD step with FIFO and with Lina equals the
    single process on the concatenated batch (1e-12, fp64); Lina == FIFO bitwise with the
    ordered reduction; Lina's micro-ops (measured at the backend) are <= chunk_bytes, inside one
    gradient, tile every gradient, one at a time, never started during an all-to-all; gradient
    accumulation under no_sync equals the single process on the summed losses."""
    results, _ = run_group(4, cases.training_table, [(2, 2), (1, 4)], deadline_s=300)
    values = values_or_fail(results)
    failures = [f"rank {r}: {f}" for r, v in enumerate(values) for f in v["failures"]]
    assert not failures, "\n".join(failures[:30])
    for v in values:
        for lab, info in v["info"].items():
            assert info["micro_ops"] > 0, (lab, info)
            if lab.endswith("lina"):
                assert info["max_bytes"] <= 96 and info["spans_two"] == 0, (lab, info)
                assert info["a2a"] > 0 and info["allreduce"] == info["micro_ops"], (lab, info)
            else:  # FIFO reduces DDP's buckets whole: some span several gradients
                assert info["spans_two"] > 0, (lab, info)
        # dense gradients are reduced everywhere; experts too when they have replicas (dp = 2)
        reduced = v["info"]["dp=2 ep=2 lina"]["reduced"]
        assert any(n.endswith("moe1.w1") for n in reduced) and any(n.endswith("inp.weight") for n in reduced)
        assert not any(n.endswith(".w1") for n in v["info"]["dp=1 ep=4 lina"]["reduced"])


@pytest.mark.dist
@pytest.mark.slow
def test_layouts_checkpoints_misuse_fsdp():
    """One seed gives the same global model at EP = 1, 2, 4; DCP save at EP=2 loads at EP=1 and
    EP=4, save at EP=4 loads at EP=2 (outputs equal); the plain full state dict scatters across
    sizes; plain DDP raises, DDP ignoring the experts warns, fully_shard over EP ranks raises; the
    FSDP2 recipe trains like the single process and checkpoints into EP=4."""
    ckdir = cases.new_ckdir()
    try:
        results, _ = run_group(4, cases.layouts_table, ckdir, deadline_s=300)
    finally:
        shutil.rmtree(ckdir, ignore_errors=True)
    values = values_or_fail(results)
    failures = [f"rank {r}: {f}" for r, v in enumerate(values) for f in v["failures"]]
    assert not failures, "\n".join(failures[:30])
    mis = [v["info"]["misuse"] for v in values]
    for m in mis:
        assert m["ddp"] is not None and "DistributedDataParallel reduces the expert parameters ['w1', 'w2']" in m["ddp"]
        assert "tritonmoe.parallel.data_parallel" in m["ddp"]
        assert len(m["ddp_ignored_warnings"]) == 2, m["ddp_ignored_warnings"]  # once per layer, not per step
        assert m["fsdp"] is not None and "expert-parallel ranks" in m["fsdp"] and "fully_shard_moe" in m["fsdp"]
        assert m["names"] == ["moe1.w1", "moe1.w2", "moe2.w1", "moe2.w2"]
    for r, m in enumerate(mis):  # each rank names its own expert-parallel group: {0, 1} or {2, 3}
        assert f"contains expert-parallel ranks {[0, 1] if r < 2 else [2, 3]}" in m["fsdp"], m["fsdp"]


@pytest.mark.dist
@pytest.mark.slow
def test_lina_no_deadlock_under_skew():
    """2 ranks whose dense and expert-parallel groups are the same ranks; one rank sleeps at
    random before every gradient micro-op and in forward and backward, 4 steps: the run finishes
    (every wait is bounded by the group timeout) with parameters bitwise equal to a calm run."""
    results, wall = run_group(2, cases.skew, 1, 4, 0, deadline_s=90, pg_timeout_s=30)
    values = values_or_fail(results)
    for v in values:
        assert v["equal"] and not v["failures"], v
        held = v["held"]  # an announcement never followed by an exchange: a bounded failure, not a hang
        assert held["raised"] is not None and "held back" in held["raised"] and held["elapsed"] < 5.0, held
    assert wall < 90

    # The same group also measured bench.lina's all-to-all part (python -m bench lina) at a tiny
    # shape: one dict per variant with the agreed keys; standalone sees no gradient lane.
    from bench.lina import _aggregate_priority

    res = _aggregate_priority([v["bench"] for v in values], cases.BENCH_SPEC, 2)
    assert [r["variant"] for r in res] == ["standalone", "fifo", "lina/0.0625MB"]
    for r in res:
        assert {"name", "world_size", "a2a_s", "a2a_bytes", "grad_bytes", "a2a_slowdown_median", "a2a_slowdown_p90",
                "a2a_overlap_frac", "chunk_bytes"} <= set(r)
        assert len(r["a2a_s"]) == 2 and all(t > 0 for t in r["a2a_s"])
    assert res[0]["a2a_overlap_frac"] == 0.0 and res[0]["a2a_slowdown_median"] == pytest.approx(1.0)
    assert res[2]["chunk_bytes"] == 2**16


# ---------------------------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------------------------


@given(
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=8),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    chunk=st.one_of(st.none(), st.integers(1, 400)),
)
def test_partition_properties(sizes, itemsize, chunk):
    """Micro-ops tile each gradient in order, never span two, are <= chunk_bytes, and have
    torch.chunk's sizes for ceil(bytes / chunk_bytes) chunks (all equal but a smaller last one)."""
    if chunk is not None and chunk < itemsize:
        with pytest.raises(ValueError, match="smaller than one element"):
            partition([(0, 1)], itemsize, chunk)
        return
    ranges, start = [], 0
    for n in sizes:
        ranges.append((start, n))
        start += n + 3  # gaps between gradients
    ops = partition(ranges, itemsize, chunk)
    for g, (a0, n) in enumerate(ranges):
        mine = [(a, b) for gg, a, b in ops if gg == g]
        if n == 0:
            assert mine == []
            continue
        assert mine[0][0] == a0 and mine[-1][1] == a0 + n
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(mine, mine[1:]))
        if chunk is None:
            assert len(mine) == 1
        else:
            count = -(-n // (chunk // itemsize))  # ceil(bytes / chunk) with whole elements
            size = -(-n // count)  # torch.chunk's piece size
            lens = [b - a for a, b in mine]
            assert all(k * itemsize <= chunk for k in lens)
            assert lens[:-1] == [size] * (len(lens) - 1) and 0 < lens[-1] <= size and len(lens) <= count
    assert [g for g, _, _ in ops] == sorted(g for g, _, _ in ops)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(priority=True, chunk_bytes=0), ValueError, "chunk_bytes=0"),
        (dict(priority=True, chunk_bytes=2.5), TypeError, "chunk_bytes must be an int"),
        (dict(priority=False, reduction="ring"), ValueError, "reduction='ring'"),
    ],
)
def test_scheduler_rejects_bad_settings(kwargs, err, match):
    with pytest.raises(err, match=match):
        CommScheduler(**kwargs)


def test_partition_rejects_chunk_below_itemsize():
    with pytest.raises(ValueError, match="chunk_bytes=4 is smaller than one element \\(8 bytes\\)"):
        partition([(0, 10)], 8, 4)


def test_expert_init_depends_on_seed_and_index_only():
    """Experts [2, 6) initialized as a slice starting at global expert 2 equal the same experts
    of a full initialization; different experts and seeds differ."""
    E, d, f = 8, 5, 3
    full1, full2 = torch.empty(E, d, 2 * f, dtype=torch.float64), torch.empty(E, f, d, dtype=torch.float64)
    init_experts_(full1, full2, base_seed=123, expert_start=0, d_model=d, d_ffn=f)
    part1, part2 = torch.empty(4, d, 2 * f, dtype=torch.float64), torch.empty(4, f, d, dtype=torch.float64)
    init_experts_(part1, part2, base_seed=123, expert_start=2, d_model=d, d_ffn=f)
    assert torch.equal(part1, full1[2:6]) and torch.equal(part2, full2[2:6])
    assert not torch.equal(full1[0], full1[1])
    assert expert_seed(123, 0) != expert_seed(124, 0) and expert_seed(123, 0) != expert_seed(123, 1)
    assert full1.abs().max() <= d**-0.5 and full2.abs().max() <= f**-0.5


def test_layer_init_reproducible_from_seed():
    cfg = tm.MoEConfig(8, 6, 4, 2)
    torch.manual_seed(3)
    a = tm.MoELayer(cfg)
    torch.manual_seed(3)
    b = tm.MoELayer(cfg)
    assert a.init_seed == b.init_seed
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert tm.parallel.named_expert_parameters(torch.nn.Sequential(a)).__next__()[0] == "0.w1"
    assert [n for n, _ in tm.parallel.named_expert_parameters(a)] == ["w1", "w2"]


def test_layer_rejects_mesh_and_group_together():
    with pytest.raises(ValueError, match="pass mesh= or ep_group=, not both"):
        tm.MoELayer(tm.MoEConfig(8, 6, 4, 2), mesh=object(), ep_group=object())


def test_bench_lina_step_aggregation():
    """The training-step part's figures from synthetic per-rank measurements: per-rep max over
    ranks, slowdown per (rank, all-to-all) against that all-to-all's standalone median."""
    from bench.lina import DEFAULTS, _aggregate_steps

    spec = dict(DEFAULTS, chunk_mb=(1.0,))

    def rep(step, a2a, micro):
        return {"step_s": step, "a2a": {"0/combine/0": a2a, "0/dispatch/0": 2 * a2a}, "a2a_total_s": 3 * a2a,
                "overlap_s": 0.5 * a2a if micro else 0.0, "grad_micro_ops": micro}

    ranks = [
        {"reps": {"standalone": [rep(1.0, 0.1, 0)] * 3, "fifo": [rep(2.0, 0.2, 2)] * 3, "lina/1MB": [rep(1.5, 0.11, 9)] * 3},
         "grad_bytes": 100},
        {"reps": {"standalone": [rep(1.2, 0.1, 0)] * 3, "fifo": [rep(1.0, 0.3, 2)] * 3, "lina/1MB": [rep(1.0, 0.1, 9)] * 3},
         "grad_bytes": 100},
    ]
    out = {r["variant"]: r for r in _aggregate_steps(ranks, spec, 2)}
    assert out["standalone"]["step_s"] == [1.2] * 3 and out["fifo"]["step_s"] == [2.0] * 3
    assert out["standalone"]["a2a_slowdown_median"] == pytest.approx(1.0)
    assert out["fifo"]["a2a_slowdown_median"] == pytest.approx(2.5)  # ratios 2 (rank 0) and 3 (rank 1)
    assert out["lina/1MB"]["a2a_slowdown_max"] == pytest.approx(1.1)
    assert out["lina/1MB"]["step_speedup_vs_fifo"] == pytest.approx(2.0 / 1.5)
    assert out["fifo"]["a2a_overlap_frac"] == pytest.approx(0.5 / 3) and out["lina/1MB"]["chunk_bytes"] == 2**20


# ---------------------------------------------------------------------------------------------
# Planner options (pure functions)
# ---------------------------------------------------------------------------------------------


def test_packing_candidates():
    from tritonmoe.plan.lina import packing_candidates

    assert packing_candidates(16, 16) == [1, 2, 4, 8, 16]
    assert packing_candidates(8, 4) == [2, 4, 8]  # E=4 on 8 devices: the EP group has at most 4 ranks
    assert packing_candidates(6, 6) == [1, 2]  # powers of two dividing P
    with pytest.raises(ValueError, match="must be >= 1"):
        packing_candidates(0, 4)


@pytest.mark.parametrize(
    "ffn, a2a, fits, want_p, why",
    [
        # FFN time grows with p (more experts' rows per device), all-to-all shrinks (smaller group)
        ({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}, {1: 6.0, 2: 5.0, 4: 3.0, 8: 1.0, 16: 0.0}, None, 4, "outlasts"),
        ({1: 7.0}, {1: 6.0}, None, 1, "outlasts"),  # FFN already longer: no packing
        ({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}, {1: 6.0, 2: 5.0, 4: 5.0, 8: 9.0, 16: 0.0}, None, 16, "outlasts"),
        ({1: 1.0, 2: 2.0, 4: 4.0}, {1: 6.0, 2: 5.0, 4: 5.0}, lambda p: p <= 2, 2, "memory"),
    ],
)
def test_expert_packing_rule(ffn, a2a, fits, want_p, why):
    """001 section 4.2 on synthetic timings: powers of two until the FFN micro-op outlasts the
    all-to-all micro-op; memory caps the search; P (pure data parallelism) at most."""
    from tritonmoe.plan.lina import expert_packing

    c = expert_packing(ffn, a2a, world_size=16, num_experts=16, fits=fits)
    assert c.p == want_p and c.ep == 16 // want_p and c.experts_per_device == want_p, c
    assert why in c.reason, c.reason
    assert [p for p, _, _ in c.trace] == [p for p in (1, 2, 4, 8, 16) if p <= want_p]


def test_expert_packing_needs_timings():
    from tritonmoe.plan.lina import expert_packing

    with pytest.raises(ValueError, match="no all-to-all time for packing p=2"):
        expert_packing({1: 1.0, 2: 2.0}, {1: 5.0}, world_size=4, num_experts=4)


def test_gradient_sync_as_executor_ops():
    """The gradient lane as recorded by the simulator's executor: Lina cuts each gradient into
    micro-ops <= chunk_bytes (the same partition as the DDP hook), FIFO fuses DDP-like buckets;
    every op carries the gradient priority on the second communication lane."""
    from tritonmoe.comm import VirtualTensor
    from tritonmoe.comm.priority import PRIORITY_GRADIENT, issue_gradient_sync
    from tritonmoe.plan import SimExecutor, VirtualGroup

    grads = [VirtualTensor((n,), torch.float32) for n in (1000, 300, 5000)]
    world = VirtualGroup((0, 1))
    lina = SimExecutor(0, world, host_compute=True, phase="bwd")
    issue_gradient_sync(lina, grads, chunk_bytes=4096)
    assert [o.nbytes for o in lina.program.ops] == [4000, 1200] + [4000] * 5
    assert {(o.op, o.lane, o.priority, o.kind) for o in lina.program.ops} == {("all_reduce", "comm2", PRIORITY_GRADIENT, "allreduce")}
    fifo = SimExecutor(0, world, host_compute=True, phase="bwd")
    issue_gradient_sync(fifo, grads, bucket_bytes=6000)
    assert [o.nbytes for o in fifo.program.ops] == [5200, 20000]


# ---------------------------------------------------------------------------------------------
# The scheduler's invariants, in one process (a fake backend records what it is asked to do)
# ---------------------------------------------------------------------------------------------


class _FakeDist:
    """Stands in for torch.distributed inside comm.priority: a 2-rank group whose all_reduce
    doubles the tensor after a short delay, recording (start, end, data_ptr, bytes)."""

    def __init__(self, delay_s: float) -> None:
        import threading as th

        self.delay_s = delay_s
        self.calls: list = []
        self.lock = th.Lock()

    def get_world_size(self, group=None) -> int:
        return 2

    def get_process_group_ranks(self, group) -> list:
        return [0, 1]

    def all_reduce(self, t, group=None, async_op=False):
        import time as tm_

        start = tm_.perf_counter()
        tm_.sleep(self.delay_s)
        t.mul_(2)
        with self.lock:
            self.calls.append((start, tm_.perf_counter(), t.data_ptr(), t.numel() * t.element_size()))


class _FakeWork:
    """An exchange that completes ``duration_s`` after launch (on a timer thread)."""

    def __init__(self, duration_s: float, log: list) -> None:
        import threading as th
        import time as tm_

        self.fut = torch.futures.Future()
        self.start = tm_.perf_counter()

        def done():
            log.append((self.start, tm_.perf_counter()))
            self.fut.set_result(None)

        th.Timer(duration_s, done).start()

    def get_future(self):
        return self.fut


_EVENT = st.one_of(
    st.tuples(st.just("grad"), st.lists(st.integers(1, 40), min_size=1, max_size=3)),
    st.tuples(st.just("exchange"), st.floats(0.0005, 0.003)),
    st.tuples(st.just("announce"), st.floats(0.0, 0.003)),
)


@settings(max_examples=40)
@given(events=st.lists(_EVENT, min_size=1, max_size=8), lina=st.booleans())
def test_scheduler_invariants(events, lina):
    """Random programs of gradient submissions, exchanges and announcements: every gradient
    micro-op runs once, in submission order, one at a time, <= chunk_bytes, and (Lina) none
    starts while an exchange is running or announced (except one that had already passed the
    gate when it began); every reduction's future completes with the reduced buffer."""
    import time as tm_

    from tritonmoe.comm import priority as pr

    fake = _FakeDist(0.0003)
    real = pr.dist
    pr.dist = fake
    try:
        sched = CommScheduler.lina(32) if lina else CommScheduler.fifo()
        exchanges: list = []
        announced: list = []
        futs, bufs, order = [], [], []
        for kind, arg in events:
            if kind == "grad":
                flat = torch.ones(sum(arg), dtype=torch.float64)
                grads = list(flat.split(arg))
                futs.append(sched.reduce(flat, grads, group=None))
                bufs.append(flat)
                order += [(g.data_ptr(), g.numel()) for g in grads]
            elif kind == "exchange":  # the work (and its start time) is made inside run, after the gate closed
                sched.launch(lambda d=arg: (None, _FakeWork(d, exchanges)))
                tm_.sleep(arg / 2)
            else:  # an announcement, lifted after a while (the layer's backward)
                sched.exchange_imminent()
                t0 = tm_.perf_counter()
                tm_.sleep(arg)
                announced.append((t0, tm_.perf_counter()))
                sched.exchanges_done()
        for f, b in zip(futs, bufs):
            assert f.wait() is b and torch.equal(b, torch.full_like(b, 2.0))
        tm_.sleep(0.005)  # let the exchange timers finish
        sched.close()
    finally:
        pr.dist = real
    calls = fake.calls
    starts = [c[0] for c in calls]
    assert starts == sorted(starts)
    for (s1, e1, _, _), (s2, _, _, _) in zip(calls, calls[1:]):
        assert s2 >= e1  # one micro-op at a time
    if lina:
        # every gradient tiled in order by micro-ops of <= 32 bytes
        pieces = [(p, n) for _, _, p, n in calls]
        want = []
        for ptr, numel in order:
            for _, a, b in partition([(0, numel)], 8, 32):
                want.append((ptr + 8 * a, 8 * (b - a)))
        assert pieces == want
        # Inside an exchange or an announcement at most one micro-op starts: one that had passed
        # the gate just before (never pre-empted); no second one until the window closes.
        for a, b in exchanges + announced:
            inside = [s for s, _, _, _ in calls if a < s < b]
            assert len(inside) <= 1, f"{len(inside)} gradient micro-ops started during one exchange/announcement"
    else:
        assert len(calls) == len(futs)  # FIFO: one reduction per submitted buffer
