"""Schedules behind executors: the real and the simulated executor run the same schedule code."""

from __future__ import annotations

import pytest
import torch

from tritonmoe.comm import VirtualTensor, Work, plan_from_counts
from tritonmoe.comm.programs.pipeline import backward_pass, forward_pass
from tritonmoe.plan import SimExecutor, VirtualGroup

from _dist import run_group, values_or_fail
import _schedule_cases


@pytest.mark.dist
def test_real_and_simulated_executors_issue_the_same_operations():
    results, _ = run_group(3, _schedule_cases.swap_executors, deadline_s=180, pg_timeout_s=60)
    for rank, per_n in enumerate(values_or_fail(results)):
        for n, v in per_n.items():
            assert v["same_plan"], f"rank {rank} n={n}: plan_from_counts differs from exchange_counts"
            assert v["real"] == v["sim"], f"rank {rank} n={n}:\nreal {v['real']}\nsim  {v['sim']}"
            # dispatch + combine per micro-op and pass on the comm lane; expert per micro-op and
            # pass plus the W step on the compute lane
            assert len(v["sim"]["comm"]) == 4 * n
            assert len(v["sim"]["compute"]) == 2 * n + 1


def _program(n: int, host_compute: bool):
    counts = torch.tensor([[[3, 1, 0, 2]] * n, [[0, 4, 1, 1]] * n])  # [P=2, n, E=4]
    plan = plan_from_counts(counts, 0)
    ex = SimExecutor(0, VirtualGroup((0, 1)), host_compute=host_compute)
    sends = [VirtualTensor((plan.send_rows(i), 8)) for i in range(n)]
    like = lambda i: VirtualTensor((plan.recv_rows(i), 8))  # noqa: E731
    w = lambda i: Work(flops=1e6 * (i + 1))  # noqa: E731
    backs = forward_pass(ex, sends, plan, None, work=w, out_like=like)
    ex.phase = "bwd"
    backward_pass(ex, backs, plan, None, work=w, out_like=like, weight_step_work=Work(flops=5e5))
    return plan, ex


@pytest.mark.parametrize("host_compute", [True, False])
def test_simulated_program_dependencies(host_compute):
    plan, ex = _program(3, host_compute)
    ops = ex.program.ops
    assert [o.phase for o in ops].count("fwd") == 9 and [o.phase for o in ops].count("bwd") == 10
    experts = [o for o in ops if o.kind == "expert"]
    for o in experts:  # computes on what arrived (plus, on CUDA, stream waits for earlier exchanges)
        first = "dispatch" if o.phase == "fwd" else "combine"
        deps = [ops[d] for d in o.deps]
        assert any(d.kind == first and d.micro_op == o.micro_op and d.phase == o.phase for d in deps)
        if host_compute:
            assert len(deps) == 1
    combine_fwd = [o for o in ops if o.kind == "combine" and o.phase == "fwd"]
    for o in combine_fwd:
        assert [ops[d].kind for d in o.deps] == ["expert"]
        assert o.send_bytes == tuple(s * 8 * 2 for s in plan.recv_splits[o.micro_op])  # bf16 rows back
    # CPU host model: an expert runs on the issuing thread, so everything after it is issued
    # after it; CUDA: the host runs ahead, the compute lane waits for the combines it was told to.
    first_expert = experts[0].index
    later = [o for o in ops if o.index > first_expert]
    if host_compute:
        assert all(o.host_after is not None and o.host_after >= first_expert for o in later)
    else:
        assert all(o.host_after is None for o in ops)
        bwd_expert0 = next(o for o in experts if o.phase == "bwd")
        assert any(ops[d].kind == "combine" and ops[d].phase == "fwd" for d in bwd_expert0.deps)


def test_simulated_executor_rejects_bad_input():
    ex = SimExecutor(0, VirtualGroup((0, 1)), host_compute=True)
    with pytest.raises(TypeError, match="work=Work"):
        ex.compute(None, work=None, kind="expert")
    with pytest.raises(ValueError, match="needs 2 splits"):
        ex.all_to_all(VirtualTensor((3, 4)), [3], [3], kind="dispatch")
    with pytest.raises(ValueError, match="not in"):
        ex.all_gather(VirtualTensor((3, 4)), group=VirtualGroup((1, 2)), kind="x")
    with pytest.raises(ValueError, match="unknown lane"):
        ex.compute(None, work=Work(), kind="expert", lane="gpu")
    with pytest.raises(ValueError, match="distinct ranks"):
        VirtualGroup((1, 1))
