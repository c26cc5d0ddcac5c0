"""MPMoE memory reuse and restore strategies (paper 004; tritonmoe.comm.programs.memory_reuse, tritonmoe.sim.memory_model).

The distributed checks run in one spawned gloo group per size (tests/_memory_cases.py): every
strategy x degree bitwise equal to the unmanaged n = 1 layer in fp64 (outputs and every gradient,
ragged batches, a rank with zero tokens, capacity drops, biases), the saved bytes counted with
saved_tensors_hooks against the model, "auto" under a budget, and a budget below every candidate.
"""

from __future__ import annotations

import math
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _memory_cases
import tritonmoe as tm
from _dist import run_group, values_or_fail
from tritonmoe.comm.programs.memory_reuse import STRATEGIES, memory_layout, restore_schedule
from tritonmoe.policy.memory_strategy import check_offload, pinned_memory_available
from tritonmoe.experts import LocalExperts
from tritonmoe.sim.memory_model import (
    MemoryBudgetError,
    choose_memory,
    expert_block_bytes,
    paper_memory,
    search_joint,
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_strategies_bitwise_equal_and_saved_bytes_match_the_model(world_size):
    results, _ = run_group(world_size, _memory_cases.table, deadline_s=300, pg_timeout_s=60)
    vals = values_or_fail(results)
    failures = [f for v in vals for f in v["failures"]]
    assert not failures, "\n".join(failures[:30])
    acct = [a for v in vals for a in v["accounting"]]
    # every (case, n, strategy) on every rank was measured, and reuse saved memory where it can
    assert len(acct) == world_size * len(_memory_cases.CASES[world_size]) * 4 * len(_memory_cases.CONFIGS)
    for a in acct:
        assert a["measured"] == a["model"], a  # saved_tensors_hooks bytes: exactly the model's
    # reuse keeps the largest micro-op's rows in 2 DI buffers + 1 MI buffer: less than "keep" for
    # balanced micro-ops at n >= 2 (at n = 2 the MI half), possibly more for very unbalanced ones
    # (the model says which); a second MI buffer saves less from n = 3 on, nothing at n = 2
    by = {(a["case"], a["n"], a["strategy"], a["mi"], a["rank"]): a for a in acct}
    for (ci, n, s, mi, r), a in by.items():
        rows = a["rows"]
        keep = by[(ci, n, "keep", 1, r)]["measured"]
        if s != "keep" and n >= 2 and min(rows) > 0 and max(rows) <= 1.2 * min(rows) and (mi == 1 or n >= 3):
            assert a["measured"] < keep, a
        if mi == 2 and n >= 3 and max(rows) > 0:
            assert by[(ci, n, s, 1, r)]["measured"] < a["measured"], a
    assert any(a["measured"] < by[(a["case"], a["n"], "keep", 1, a["rank"])]["measured"] for a in acct)
    if world_size == 2:
        # a cost model missing on rank 1 only: a ValueError on every rank at construction
        msgs = [v["auto"]["missing_cost_model"] for v in vals]
        assert all(m.startswith("ValueError") and "memory_policy" in m for m in msgs), msgs
        assert ".missing does not exist" in msgs[1] and "does not exist" not in msgs[0], msgs
    if world_size == 2:  # MPMoE-pb online: all ranks ran the same candidates and decided alike
        runs = [v["auto"]["search"] for v in vals]
        assert all(r["ran"] == runs[0]["ran"] and r["decided"] == runs[0]["decided"] for r in runs), runs
        assert runs[0]["decided"], runs[0]
        assert len({s for _, s in runs[0]["ran"]}) == 5  # every strategy was measured
        assert runs[0]["profiled"] < 7 * 5  # fewer than the exhaustive (degree 2..8) x strategy profiles
    if world_size == 2:
        check_allocator_held([v["held"] for v in vals])
    for v in vals:
        auto = v["auto"]
        assert auto["chosen"] != "keep" and auto["budget"] < auto["keep_bytes"], auto
        assert auto["tiny"] is not None and "memory_budget_bytes=1" in auto["tiny"], auto


def check_allocator_held(per_rank: list) -> None:
    """Issue 35: the bytes held between forward and backward by the allocator's count (malloc's
    counters on CPU, on the second pass; tests/_memory_cases.allocator_held at HELD_SPEC, E=8,
    SwiGLU, k=2, n=4, fp32) on every rank. What MPMoE's strategies promise, against "keep":
    "recompute" and "recomm" below 0.95x, "recomm_recompute" below 0.85x. Beside it the hooks'
    count of the block's saved storages after the forward, which must equal the model's held
    bytes, and the allocator's saving, which must equal the model's (the held bytes less the host
    copies, which on a CPU device are in the same memory) to 10% of what "keep" holds."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc's counters are read through glibc's mallinfo2")
    for r, h in enumerate(per_rank):
        assert h["readable"], f"rank {r}: mallinfo2 unreadable"
        alloc, hooks, model = h["allocator"], h["hooks"], h["model"]
        keep = alloc["keep"]
        table = {s: f"{b / 2**20:.2f} MiB ({b / keep:.3f}x)" for s, b in alloc.items()}
        assert keep >= model["keep"]["held"] > 0, (r, table, model)  # "keep" holds at least its DI and MI
        assert alloc["recompute"] < 0.95 * keep, (r, table)
        assert alloc["recomm"] < 0.95 * keep, (r, table)
        assert alloc["recomm_recompute"] < 0.85 * keep, (r, table)
        for s in alloc:
            assert hooks[s] == model[s]["held"], (r, s, hooks, model)
            saving = model["keep"]["held"] - model[s]["held"] - model[s]["host"]
            # 10%: malloc's counters read up to ~1 MiB (9% of "keep" here) high now and then, a
            # buffer of a finished all-to-all still held by a gloo thread; a buffer the block
            # failed to free, or host copies it did not report, are 20% and more
            assert abs((keep - alloc[s]) - saving) <= 0.10 * keep, (r, s, table, saving, model)


# -- the restore schedule and the model ---------------------------------------------------------


@pytest.mark.parametrize("n,slots,want", [(1, 1, ()), (2, 2, ()), (2, 1, (0, 1)), (3, 2, (0, 2)), (4, 2, (0, 1, 2, 3)),
                                          (5, 2, (0, 1, 2, 3, 4)), (3, 3, ())])
def test_restore_schedule(n, slots, want):
    assert restore_schedule(n, slots) == want


@settings(max_examples=25)
@given(n=st.integers(1, 12), slots=st.integers(1, 4))
def test_restore_schedule_is_what_a_slot_simulation_loses(n, slots):
    """Replay forward writes and backward reads with buffers holding micro-op ids: a micro-op is
    restored exactly when its buffer holds another id at its read."""
    need = set(restore_schedule(n, slots))
    bufs = [None] * slots
    for i in range(n):
        bufs[i % slots] = i
    for i in range(n):
        assert (bufs[i % slots] != i) == (i in need)
        bufs[i % slots] = i


@given(rows=st.lists(st.integers(0, 50), min_size=1, max_size=8), d=st.integers(1, 16), n1=st.integers(1, 32))
def test_expert_block_bytes(rows, d, n1):
    keep = expert_block_bytes(rows, d, n1, "keep", 4)
    assert keep["device"] == keep["held"] == 4 * sum(rows) * (d + n1) and keep["host"] == 0
    n = len(rows)
    for s in ("offload", "recomm", "recompute", "recomm_recompute"):
        b = expert_block_bytes(rows, d, n1, s, 4)
        assert b["device"] == 4 * max(rows) * (min(n, 2) * d + n1)  # DI double-, MI single-buffered
        # held after the forward: the buffers with one occupant (their contents are read as they
        # are): n = 1 both, n = 2 the two DI buffers, n = 3 DI buffer 1, n >= 4 none
        held_di = {1: 1, 2: 2, 3: 1}.get(n, 0)
        assert b["held"] == 4 * max(rows) * (held_di * d + (n == 1) * n1)
        lay = memory_layout(s, n)
        host = 4 * (sum(rows[i] for i in lay.di_offloaded) * d + sum(rows[i] for i in lay.mi_offloaded) * n1)
        assert b["host"] == host
        # two MI buffers: MI double-buffered too; the same micro-ops' DI are restored, MI only
        # those a second buffer does not keep (none at n = 2), so at most the same host bytes
        b2 = expert_block_bytes(rows, d, n1, s, 4, 2)
        assert b2["device"] == 4 * max(rows) * min(n, 2) * (d + n1)
        assert b2["held"] == 4 * max(rows) * held_di * (d + n1)  # MI double-buffered like DI
        lay2 = memory_layout(s, n, 2)
        assert lay2.di_restore == lay.di_restore and lay2.mi_restore == restore_schedule(n, 2)
        assert b2["host"] <= b["host"]
    assert expert_block_bytes(rows, d, n1, "recomm_recompute", 4)["host"] == 0


@given(M=st.integers(64, 4096), ratio=st.integers(1, 8), B=st.integers(1, 1 << 16), E=st.integers(1, 128))
def test_paper_model_properties(M, ratio, B, E):
    """Eq. 6: phi grows with n (n >= 2) and with B, stays below the large-B limit; the T_DI term
    vanishes at n = 2; nothing is saved at n = 1."""
    H = ratio * M
    phis = [paper_memory(M, H, E, B, n)["phi"] for n in range(1, 9)]
    assert phis[0] == 0.0
    assert all(a <= b + 1e-15 for a, b in zip(phis[1:], phis[2:]))
    assert paper_memory(M, H, E, 2 * B, 4)["phi"] >= paper_memory(M, H, E, B, 4)["phi"]
    for n in range(2, 9):
        limit = (2 * M * (n - 2) / n + H * (n - 1) / n) / (4 * M + H)
        assert phis[n - 1] <= limit + 1e-12
    assert paper_memory(M, H, E, B, 2)["dM_act"] == pytest.approx(B * H / 2)


def test_paper_trend_cal12():
    """CAL-12: the paper's average reductions -23/-34/-38% at n = 2/4/8 (Fig. 11, vs PMoE), from
    Eq. 6 averaged over the Table III layers (E = 64) and the calibration's B sweep (1k..32k
    tokens, doubling; not tuned). n = 4 and 8 land within 25% of the paper (-3%, +9%); n = 2 gives
    16.5%, 28% below the paper's 23% (Eq. 6's n = 2 saving is only the MI buffer, and small B
    weigh as much as large ones in the sweep). The trend (monotone, flattening) holds."""
    from tritonmoe.plan.calibrate import mpmoe_memory_trend

    phi = mpmoe_memory_trend()
    assert phi[2] < phi[4] < phi[8]
    assert phi[4] - phi[2] > phi[8] - phi[4]  # flattening, as 23 -> 34 -> 38
    for n, paper in ((4, 0.34), (8, 0.38)):
        assert abs(phi[n] / paper - 1) <= 0.25, (n, phi[n], paper)
    assert abs(phi[2] / 0.23 - 1) == pytest.approx(0.281, abs=0.005)  # the known miss, recorded


def test_cal13_planner_degree_trend():
    """CAL-13 (GPT-XL on Adira, no reuse, n in {2, 4, 8}): the planner's degree grows with the
    tokens per GPU through 2, 4 and 8, as in the paper's Fig. 14. (The switch points land at
    ~3k and ~10k tokens rather than the paper's 8k and 22k; see the calibration table.)"""
    from tritonmoe.sim.cost_model import Cluster

    cfg = tm.MoEConfig(2048, 8192, 64, 2, activation="gelu")
    c = Cluster.preset("mpmoe-adira")
    picks = []
    for B in (1024, 8192, 32768):
        p = choose_memory(cfg, B, c, degrees=(2, 4, 8), strategies=("keep",), dtype="float16", mode="symmetric")
        picks.append(p.pipeline_degree)
    assert picks == [2, 4, 8], picks


def test_budget_forces_reuse_and_reports_rejected():
    from tritonmoe.sim.cost_model import Cluster

    cfg = tm.MoEConfig(1024, 4096, 16, 2, activation="gelu")
    c = Cluster.preset("mpmoe-valor")
    free = choose_memory(cfg, 4096, c, degrees=(2, 4), dtype="float16", mode="symmetric")
    keep4 = next(k for k in free.candidates if k.strategy == "keep" and k.pipeline_degree == 4)
    budget = keep4.device_bytes - 1
    p = choose_memory(cfg, 4096, c, degrees=(2, 4), dtype="float16", mode="symmetric", budget_bytes=budget)
    assert p.device_bytes <= budget and p.strategy != "keep"
    rejected = p.rejected
    assert rejected and all(k.device_bytes > budget and k.step_time > 0 for k in rejected)
    # rejected: "keep" only; every reuse strategy fits at n = 2 too (the single MI buffer holds
    # one micro-op's MI where "keep" holds two)
    assert {k.pipeline_degree for k in rejected if k.strategy == "keep"} >= {4}
    assert all(k.strategy == "keep" for k in rejected)
    assert "chosen" in p.table() and "budget" in p.table()
    # every restore path costs time in the simulator: keep is the fastest without a budget
    t = {(k.pipeline_degree, k.strategy): k.step_time for k in free.candidates}
    for n in (2, 4):
        assert all(t[(n, s)] >= t[(n, "keep")] for s in ("offload", "recomm", "recompute", "recomm_recompute"))
    assert t[(4, "recomm_recompute")] > t[(4, "keep")]


def test_budget_below_every_candidate_is_a_value_error():
    cfg = tm.MoEConfig(64, 128, 8, 2)
    with pytest.raises(MemoryBudgetError, match=r"memory_budget_bytes=100 is below the smallest candidate's need"):
        choose_memory(cfg, 256, None, budget_bytes=100, world_size=2, time_fn=lambda n, s: 1.0)
    assert issubclass(MemoryBudgetError, ValueError)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(degrees=[0]), ValueError, "degrees holds 0"),
    (dict(degrees=[]), ValueError, "degrees is empty"),
    (dict(degrees=[-2]), ValueError, "degrees holds -2"),
    (dict(degrees=[2.0]), TypeError, "degrees holds 2.0"),
    (dict(strategies="keep"), TypeError, "strategies='keep' is a string"),
    (dict(strategies=[]), ValueError, "strategies is empty"),
    (dict(world_size=None), ValueError, "world_size=None"),
    (dict(time_fn=lambda n, s: float("nan") if n == 1 else 1.0), ValueError, r"time_fn\(1, 'keep'\) returned nan"),
    (dict(time_fn=lambda n, s: -1.0), ValueError, "returned -1.0"),
    (dict(mi_buffers=(1, 2)), ValueError, "cannot tell MI buffer counts apart"),
    (dict(mi_buffers="2"), TypeError, "mi_buffers must be an int or a sequence"),
    (dict(mi_buffers=(1, 3)), ValueError, "memory_mi_buffers=3"),
    (dict(mi_buffers=()), ValueError, "mi_buffers is empty"),
])
def test_choose_memory_bad_arguments_are_typed_errors(kw, exc, match):
    cfg = tm.MoEConfig(64, 128, 8, 2)
    kw = dict(dict(world_size=2, time_fn=lambda n, s: 1.0), **kw)
    with pytest.raises(exc, match=match):
        choose_memory(cfg, 256, None, **kw)


def test_search_joint_finds_the_oracle_argmin():
    """MPMoE-pb: Algorithm 1 per strategy, then the best strategy, on a convex oracle."""
    best_n = {"keep": 2, "offload": 3, "recomm": 5, "recompute": 4, "recomm_recompute": 6}
    base = {"keep": 1.3, "offload": 1.0, "recomm": 0.9, "recompute": 1.1, "recomm_recompute": 1.2}

    def prof(B, n, s):
        return base[s] * (1 + 0.1 * (n - best_n[s]) ** 2) * B

    searches: dict = {}
    n, s, per = search_joint(1000.0, prof, searches=searches)
    assert (n, s) == (5, "recomm")
    assert {k: v[0] for k, v in per.items()} == best_n
    calls = []
    again = search_joint(1000.0, lambda B, n, s: calls.append((n, s)) or prof(B, n, s), searches=searches)
    assert again[:2] == (5, "recomm") and len(calls) == 5  # cached per strategy: one measurement each


# -- bad input ---------------------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match=r"memory_strategy='swap' is not a memory strategy; use one of"):
        tm.MoEConfig(8, 8, 4, 1, memory_strategy="swap")
    with pytest.raises(TypeError, match="memory_strategy must be a str"):
        tm.MoEConfig(8, 8, 4, 1, memory_strategy=1)
    with pytest.raises(ValueError, match="memory_budget_bytes=0 must be > 0"):
        tm.MoEConfig(8, 8, 4, 1, memory_strategy="auto", memory_budget_bytes=0)
    with pytest.raises(TypeError, match="memory_budget_bytes must be an int"):
        tm.MoEConfig(8, 8, 4, 1, memory_strategy="auto", memory_budget_bytes=1.5)
    with pytest.raises(ValueError, match="is used by memory_strategy='auto'"):
        tm.MoEConfig(8, 8, 4, 1, memory_strategy="offload", memory_budget_bytes=10)
    with pytest.raises(ValueError, match="ep_capacity"):
        tm.MoEConfig(8, 8, 4, 1, memory_strategy="keep", ep_capacity=4)
    # without ep_group a memory strategy is the single-process reference's no-op (test_layer: one config, any world size)
    assert isinstance(tm.MoELayer(tm.MoEConfig(8, 8, 4, 1, memory_strategy="recompute")).expert_path, LocalExperts)
    assert tm.MoEConfig(8, 8, 4, 1, memory_strategy="auto", memory_mi_buffers=2).memory_mi_buffers == 2
    with pytest.raises(ValueError, match=r"memory_mi_buffers=3: use 1 \(the paper's single T_M buffer"):
        tm.MoEConfig(8, 8, 4, 1, memory_strategy="offload", memory_mi_buffers=3)
    with pytest.raises(TypeError, match="memory_mi_buffers must be an int"):
        tm.MoEConfig(8, 8, 4, 1, memory_strategy="offload", memory_mi_buffers="2")
    for s in (None, "keep"):
        with pytest.raises(ValueError, match=f"memory_strategy={s!r} shares none"):
            tm.MoEConfig(8, 8, 4, 1, memory_strategy=s, memory_mi_buffers=2)


@pytest.mark.skipif(pinned_memory_available(), reason="pinned memory is available here")
def test_offload_without_pinned_memory_is_a_value_error():
    with pytest.raises(ValueError, match="pinned host memory, which is not available"):
        check_offload("offload", torch.device("cuda"))
    with pytest.raises(ValueError, match="'recomm_recompute'"):
        check_offload("recompute", torch.device("cuda"))
    check_offload("recomm_recompute", torch.device("cuda"))  # no host copies: fine
    check_offload("offload", torch.device("cpu"))  # CPU layers copy into ordinary host memory


def test_memory_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="memory_strategy='x'"):
        memory_layout("x", 2)
    with pytest.raises(ValueError, match="n must be a positive int"):
        memory_layout("keep", 0)
    with pytest.raises(ValueError, match="memory_mi_buffers=0"):
        memory_layout("offload", 4, 0)
    with pytest.raises(TypeError, match="memory_mi_buffers must be an int"):
        memory_layout("offload", 4, True)
    with pytest.raises(ValueError, match="B must be a non-negative int"):
        paper_memory(8, 8, 1, -1, 2)
    assert math.isclose(paper_memory(768, 3072, 64, 1 << 30, 8)["phi"], (6 * 8 - 8) / 64, rel_tol=1e-3)


# -- the planner's memory_strategy dimension -----------------------------------------------------


def test_planner_memory_dimension_matches_choose_memory():
    """plan.choose with memory_strategy="auto" evaluates (degree, strategy) like choose_memory:
    the same step times, bytes, rejections and choice, under a budget that rejects "keep" at n=4."""
    from tritonmoe.plan import choose
    from tritonmoe.sim.cost_model import Cluster

    c = Cluster.preset("mpmoe-valor")
    plain = tm.MoEConfig(1024, 4096, 16, 2, activation="gelu")
    p0 = choose(plain, 4096, c, pipeline_degree=(2, 4), dtype="float16", mode="symmetric")
    assert all(set(k.values) == {"schedule", "pipeline_degree"} and k.device_bytes is None for k in p0.candidates)
    assert p0.memory_strategy is None
    cfg = tm.MoEConfig(1024, 4096, 16, 2, activation="gelu", memory_strategy="auto")
    free = choose_memory(cfg, 4096, c, degrees=(2, 4), dtype="float16", mode="symmetric")
    keep4 = next(k for k in free.candidates if k.strategy == "keep" and k.pipeline_degree == 4)
    budget = keep4.device_bytes - 1
    want = choose_memory(cfg, 4096, c, degrees=(2, 4), dtype="float16", mode="symmetric", budget_bytes=budget)
    got = choose(cfg, 4096, c, pipeline_degree=(2, 4), dtype="float16", mode="symmetric", memory_budget_bytes=budget)
    assert (got.pipeline_degree, got.memory_strategy) == (want.pipeline_degree, want.strategy)
    by = {(k.values["pipeline_degree"], k.values["memory_strategy"]): k for k in got.candidates}
    assert len(by) == 2 * 5
    for k in want.candidates:
        g = by[(k.pipeline_degree, k.strategy)]
        assert g.device_bytes == k.device_bytes and g.step_time == pytest.approx(k.step_time)
        assert (g.rejected is None) == (k.rejected is None)
    assert got.rejected and all(k.device_bytes > budget for k in got.rejected)
    table = got.table()
    assert "saved MiB" in table and "rejected: needs" in table and "<- chosen" in table
    # a fixed strategy is one value; a budget without a strategy plans all five; below all: an error
    one = choose(tm.MoEConfig(1024, 4096, 16, 2, memory_strategy="recompute"), 4096, c, pipeline_degree=(4,),
                 dtype="float16", mode="symmetric")
    assert [k.values["memory_strategy"] for k in one.candidates] == ["recompute"]
    assert {k.values["memory_strategy"] for k in choose(plain, 4096, c, pipeline_degree=(4,), dtype="float16",
                                                        mode="symmetric", memory_budget_bytes=1 << 40).candidates} \
        == set(STRATEGIES)
    with pytest.raises(MemoryBudgetError, match="memory_budget_bytes=100 is below the smallest candidate's need"):
        choose(cfg, 4096, c, pipeline_degree=(2,), dtype="float16", mode="symmetric", memory_budget_bytes=100)
    with pytest.raises(ValueError, match="memory_budget_bytes must be a positive int"):
        choose(cfg, 4096, c, memory_budget_bytes=-5)


def test_planner_cli_memory_budget(capsys, tmp_path):
    import json

    from tritonmoe.plan.__main__ import main

    out_json = tmp_path / "plan.json"
    args = ["plan", "--cluster", "mpmoe-valor", "--tokens", "4096", "--d-model", "1024", "--d-ffn", "4096", "-E", "16",
            "-k", "2", "--activation", "gelu", "--degrees", "4", "--dtype", "float16", "--mode", "symmetric"]
    assert main(args + ["--memory-strategies", "keep,recompute", "--memory-budget", "64MiB", "--json",
                        str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "memory_strategy" in out and "choice:" in out and "saved MiB" in out
    d = json.loads(out_json.read_text())
    assert d["budget_bytes"] == 64 << 20 and {c["values"]["memory_strategy"] for c in d["candidates"]} == {
        "keep", "recompute"}
    assert all(c["device_bytes"] > 0 for c in d["candidates"])
    rej = {c["values"]["memory_strategy"]: c["rejected"] for c in d["candidates"]}
    assert rej["keep"] is not None and rej["recompute"] is None and d["choice"]["memory_strategy"] == "recompute"
    assert main(args + ["--memory-budget", "1"]) == 2
    assert "memory_budget_bytes=1 is below" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args + ["--memory-strategies", "swap"])
    with pytest.raises(SystemExit):
        main(args + ["--memory-budget", "lots"])
    # both MI buffer counts as candidates: two buffers keep more bytes
    assert main(args + ["--memory-strategies", "offload", "--memory-mi-buffers", "1,2", "--json", str(out_json)]) == 0
    d = json.loads(out_json.read_text())
    by = {c["values"]["memory_mi_buffers"]: c["device_bytes"] for c in d["candidates"]}
    assert set(by) == {1, 2} and by[2] > by[1]
    capsys.readouterr()
    with pytest.raises(SystemExit, match="memory_mi_buffers=3"):
        main(args + ["--memory-strategies", "offload", "--memory-mi-buffers", "3"])
    with pytest.raises(SystemExit, match="needs --memory-strategies"):
        main(args + ["--memory-mi-buffers", "2"])


def test_mi_buffer_edge_cases():
    """ "keep" shares no buffer, so a plan choosing it has one MI buffer whatever the config's
    count (a config built from the plan is valid); numpy ints are counts; the HF conversion
    ignores the memory options (runtime choices, not what the block computes); the memory bench's
    configurations pair "keep" with one buffer and two buffers only from n = 3."""
    import numpy as np

    from bench.memory_strategies import configurations
    from tritonmoe.hf import _config_fields
    from tritonmoe.plan import Cluster

    cfg = tm.MoEConfig(2048, 8192, 32, 2, activation="gelu", pipeline_degree=4, memory_strategy="auto",
                       memory_mi_buffers=2)
    plan = choose_memory(cfg, 8192, Cluster.preset("dgx-h100", nodes=1), degrees=[4], strategies=("keep",))
    assert (plan.strategy, plan.mi_buffers) == ("keep", 1)
    plan = choose_memory(cfg, 8192, Cluster.preset("dgx-h100", nodes=1), degrees=[4], strategies=("offload",),
                         mi_buffers=np.int64(2))
    assert plan.mi_buffers == 2 and type(plan.mi_buffers) is int
    assert _config_fields(tm.MoEConfig(8, 8, 4, 1)) == _config_fields(
        tm.MoEConfig(8, 8, 4, 1, memory_strategy="auto", memory_budget_bytes=1 << 20, memory_mi_buffers=2))
    spec = dict(degrees=(2, 4), strategies=("keep", "offload"), mi_buffers=(2,))
    assert configurations(spec) == [(2, "keep", 1), (4, "keep", 1), (4, "offload", 2)]
    spec["mi_buffers"] = (2, 1)
    assert configurations(spec) == [(2, "keep", 1), (2, "offload", 1), (4, "keep", 1), (4, "offload", 2),
                                    (4, "offload", 1)]


# -- two MI buffers: what the simulator predicts ---------------------------------------------------


def _sim_mi(strategy: str, n: int, mi: int, cluster: str = "dgx-h100") -> "tuple[float, float]":
    """(step time, copy seconds beside compute / copy seconds) simulated for a GPT-XL-like layer."""
    from tritonmoe.comm.timeline import _intersection_length, _union
    from tritonmoe.plan import Cluster
    from tritonmoe.sim.simulate import simulate

    cfg = tm.MoEConfig(2048, 8192, 32, 2, activation="gelu", pipeline_degree=n, memory_strategy=strategy,
                       memory_mi_buffers=mi)
    tl = simulate(cfg, 8192, Cluster.preset(cluster, nodes=1),
                  candidate={"schedule": "ep-pipeline", "pipeline_degree": n, "memory_strategy": strategy},
                  dtype="bfloat16")
    spans = [sp for sp in tl.spans() if sp.rank == 0]
    cp = _union((sp.start, sp.end) for sp in spans if sp.lane == "copy")
    comp = _union((sp.start, sp.end) for sp in spans if sp.lane == "compute")
    total = sum(b - a for a, b in cp)
    return tl.step_time(), (_intersection_length(cp, comp) / total if total else 0.0)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_two_mi_buffers_overlap_the_mi_copies_in_the_simulator(n):
    """With one MI buffer a micro-op's MI copy serializes with its neighbour's compute (in
    forward the buffer store waits for the previous copy; in backward a restore starts only after
    the previous micro-op's compute); with two it runs beside the next micro-op's compute: the
    host-copying strategies get faster and more of their copy time runs beside compute; the
    recomputing ones (no MI copies) are unchanged unless the second buffer spares a recompute."""
    for s in ("offload", "recomm"):
        t1, h1 = _sim_mi(s, n, 1)
        t2, h2 = _sim_mi(s, n, 2)
        assert t2 < t1 and h2 > h1, (s, n, t1, t2, h1, h2)
    for s in ("recompute", "recomm_recompute"):
        t1, t2 = _sim_mi(s, n, 1)[0], _sim_mi(s, n, 2)[0]
        if memory_layout(s, n, 1).mi_restore == memory_layout(s, n, 2).mi_restore:
            assert t1 == t2, (s, n)  # the same recomputes, no MI copy to overlap
        else:
            assert t2 < t1, (s, n)  # n = 3: the second buffer keeps micro-op 1's MI, one recompute fewer


def test_choose_memory_compares_mi_buffer_counts():
    """mi_buffers=(1, 2): every reuse strategy is a candidate per count ("keep" once); a budget
    between the two counts' needs picks one MI buffer; without a budget the faster wins."""
    from tritonmoe.plan import Cluster

    cfg = tm.MoEConfig(2048, 8192, 32, 2, activation="gelu", pipeline_degree=4, memory_strategy="auto")
    cl = Cluster.preset("dgx-h100", nodes=1)
    strategies = ("keep", "offload", "recomm")
    plan = choose_memory(cfg, 8192, cl, degrees=[4], strategies=strategies, mi_buffers=(1, 2))
    got = [(c.strategy, c.mi_buffers) for c in plan.candidates]
    assert got == [("keep", 1), ("offload", 1), ("offload", 2), ("recomm", 1), ("recomm", 2)]
    by = {(c.strategy, c.mi_buffers): c for c in plan.candidates}
    assert by[("offload", 2)].device_bytes > by[("offload", 1)].device_bytes
    assert by[("offload", 2)].host_bytes == by[("offload", 1)].host_bytes  # at n = 4 every MI is copied
    assert by[("offload", 2)].step_time < by[("offload", 1)].step_time
    assert "MI bufs" in plan.table()
    budget = by[("offload", 1)].device_bytes
    tight = choose_memory(cfg, 8192, cl, degrees=[4], strategies=("offload", "recomm"), mi_buffers=(1, 2),
                          budget_bytes=budget)
    assert tight.mi_buffers == 1 and all(c.rejected for c in tight.candidates if c.mi_buffers == 2)
    # the config's count is the default
    one = choose_memory(cfg, 8192, cl, degrees=[4], strategies=("offload",))
    two = choose_memory(tm.MoEConfig(2048, 8192, 32, 2, activation="gelu", pipeline_degree=4, memory_strategy="auto",
                                     memory_mi_buffers=2), 8192, cl, degrees=[4], strategies=("offload",))
    assert (one.mi_buffers, two.mi_buffers) == (1, 2)
    assert two.step_time == by[("offload", 2)].step_time and one.step_time == by[("offload", 1)].step_time


def test_simulator_issues_the_runtimes_memory_operations():
    """The simulator's program issues the expert computes, exchanges, host copies and
    re-dispatches of the managed block in the runtime's order (one gloo rank; every reuse
    strategy, n = 2..5, one and two MI buffers)."""
    results, _ = run_group(1, _memory_cases.sim_vs_real, deadline_s=120, pg_timeout_s=60)
    (bad,) = values_or_fail(results)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("mi", [1, 2])
@pytest.mark.parametrize("strategy", ["recomm", "recompute"])
def test_simulated_memory_ops_wait_where_the_runtime_waits(strategy, mi):
    """The simulated timeline honours the runtime's waits ("recomm" copies only MI, "recompute"
    only DI, so each copy span is unambiguous), at a shape whose copies outlast its compute (a
    missing wait would show): forward, the MI store after its micro-op's compute and after the
    host copy of the buffer's previous occupant (i - mi_buffers), the combine after the store,
    each copy after the store; micro-op i's compute after the DI copy of i-2; backward, each
    restore after the compute of its buffer's previous reader and before its own compute; as many
    copies and restores as the layout restores."""
    from tritonmoe.plan import Cluster
    from tritonmoe.sim.simulate import simulate

    n = 4
    cfg = tm.MoEConfig(2048, 8192, 4, 2, activation="gelu", pipeline_degree=n, memory_strategy=strategy,
                       memory_mi_buffers=mi)
    tl = simulate(cfg, [8192], Cluster.preset("dgx-h100", nodes=1), dtype="bfloat16",
                  candidate={"schedule": "ep-pipeline", "pipeline_degree": n, "memory_strategy": strategy})
    sp: dict = {}
    for s in tl.spans():
        sp.setdefault((s.phase, s.kind, s.micro_op), []).append(s)
    one = {k: v[0] for k, v in sp.items()}
    lay = memory_layout(strategy, n, mi)
    copies = len(lay.di_offloaded) + len(lay.mi_offloaded)
    assert sum(len(v) for (ph, k, _), v in sp.items() if (ph, k) == ("fwd", "offload")) == copies
    assert sum(len(v) for (ph, k, _), v in sp.items() if (ph, k) == ("bwd", "restore")) == copies
    eps = 1e-12
    slots = mi if strategy == "recomm" else 2  # the copied tensor's buffer count: MI's or DI's
    for i in range(n):
        store, expert, combine = one[("fwd", "store", i)], one[("fwd", "expert", i)], one[("fwd", "combine", i)]
        assert store.start >= expert.end - eps and combine.start >= store.end - eps
        if ("fwd", "offload", i) in one:
            assert one[("fwd", "offload", i)].start >= store.end - eps
        prev = one.get(("fwd", "offload", i - slots))
        if prev is not None:
            waiter = store if strategy == "recomm" else expert  # MI: the store waits; DI: the compute
            assert waiter.start >= prev.end - eps, (i, waiter, prev)
        rest = one.get(("bwd", "restore", i))
        if rest is not None:
            assert one[("bwd", "expert", i)].start >= rest.end - eps
            if i >= slots:
                assert rest.start >= one[("bwd", "expert", i - slots)].end - eps, (i, rest)
