"""Lina in the simulator (tritonmoe.plan.lina): the engine's priority gate, the data-parallel x
expert-parallel step with the gradient lane (FIFO vs Lina), packing's structure, the planner
over Lina's dimensions. Single process, a few seconds."""

from __future__ import annotations

import statistics

import pytest
import torch

import tritonmoe as tm
from tritonmoe.plan.lina import LinaModel, choose_lina, lina_cluster, simulate_lina_step


def _model(P: int, grad_mb: int = 64) -> LinaModel:
    # heavy gradient traffic (64 MB per layer) and short dense compute: reductions are in flight
    # when the next layer's all-to-alls start
    return LinaModel(tm.MoEConfig(512, 2048, P, 2, activation="gelu"), 3, 4096, 0.002, grad_mb * 2**20, torch.float16)


def test_priority_gate_in_the_engine():
    """With gradient reductions in flight, FIFO slows the backward all-to-alls (fair share);
    under Lina they take what they take alone, no gradient micro-op starts while a token
    exchange is issued and unfinished, and the same gradient bytes are reduced."""
    c, P = lina_cluster(), 16
    m = _model(P)
    alone = simulate_lina_step(m, c, world_size=P, comm="none")
    fifo = simulate_lina_step(m, c, world_size=P, comm="fifo")
    lina = simulate_lina_step(m, c, world_size=P, comm="lina", chunk_bytes=8 * 2**20)
    slow = lambda r: statistics.median(a / b for a, b in zip(r.a2a_s, alone.a2a_s))  # noqa: E731
    assert slow(fifo) > 1.5 and slow(lina) == pytest.approx(1.0, abs=1e-6)
    def grad_bytes(r) -> int:
        return sum(o.nbytes for o in r.result.programs[0].ops if o.op == "all_reduce")

    assert grad_bytes(fifo) == grad_bytes(lina) > 0
    ops, tim = lina.result.programs[0].ops, lina.result.timings[0]
    exchanges = [(t.issue, t.end) for o, t in zip(ops, tim) if o.op == "all_to_all"]
    for o, t in zip(ops, tim):
        if o.op == "all_reduce":
            assert o.priority < 0 and o.nbytes <= 8 * 2**20
            assert not any(a < t.start < b for a, b in exchanges)


@pytest.mark.parametrize("P, want_link, want_bytes_zero", [(2, "none", True), (8, "intra", False), (16, "inter", False)])
def test_packing_structure(P, want_link, want_bytes_zero):
    """PAPERS.md CAL-09: packing 2 experts per GPU on 2 GPUs is pure data parallelism (no
    all-to-all bytes); on 8 GPUs (2 nodes of 4) the expert-parallel group is one node."""
    r = simulate_lina_step(_model(P, 1), lina_cluster(), world_size=P, comm="lina", packing=2)
    assert r.a2a_link == want_link and (r.a2a_bytes == 0) == want_bytes_zero
    with pytest.raises(ValueError, match="packing=3"):
        simulate_lina_step(_model(P, 1), lina_cluster(), world_size=P, packing=3)


def test_choose_lina_evaluates_every_candidate():
    best = choose_lina(_model(4, 8), lina_cluster(), world_size=4, chunks=(None, 8 * 2**20))
    cands = best["candidates"]
    assert {(c["comm"], c["lina_chunk_bytes"], c["expert_packing"]) for c in cands} == {
        (comm, ch, p) for p in (1, 2, 4) for comm, ch in (("fifo", None), ("lina", None), ("lina", 8 * 2**20))
    }
    assert best["step_s"] == min(c["step_s"] for c in cands)
