"""The sizing search (tritonmoe.plan.sizing): it returns the best candidate under the simulator
(checked by brute force over the same space, each candidate simulated on its own), detects ties
within the simulator's error and recommends the simpler candidate, its sentences carry the
breakdown's numbers, the CLI routes `plan --model` to it, and bad input gets typed errors."""

from __future__ import annotations

import dataclasses
import io
import json
import contextlib

import pytest
import torch

from tritonmoe.config import MoEConfig
from tritonmoe.plan.__main__ import main
from tritonmoe.plan.memory_budget import TrainingSetup, memory_per_gpu
from tritonmoe.plan.models import ModelSpec
from tritonmoe.plan import sizing
from tritonmoe.plan.lina import LinaModel, simulate_lina_step
from tritonmoe.experts.model_parallel import shard_expert_weights
from tritonmoe.parm_layout import ParmLayout
from tritonmoe.plan.sizing import SIMPLER, TIE_TOLERANCE, SizingError, dense_work, size
from tritonmoe.sim.parm_model import simulate_parm
from tritonmoe.sim.cost_model import Cluster
from tritonmoe.sim.planner import choose
from tritonmoe.sim.simulate import simulate

TINY = ModelSpec(name="tiny", num_layers=3, moe_layers=2, d_model=64, d_ffn=32, num_experts=8, top_k=2,
                 vocab_size=128, n_heads=2, n_kv_heads=2, head_dim=32, dense_d_ffn=96)


def _moe_cfg(cf):
    return MoEConfig(TINY.d_model, TINY.d_ffn, TINY.num_experts, TINY.top_k, activation="swiglu", capacity_factor=cf)


def test_search_returns_the_brute_force_best():
    """Every candidate's MoE time equals its own simulation x layers (the cache keyed right, a
    binding capacity told apart from dropless under skewed routing), its memory equals
    memory_per_gpu's, and the winner is the argmin over the fitting ones."""
    kw = dict(gpus=8, tokens_per_gpu=64, seq_len=32, capacity_factors=(None, 1.0), pipeline_degrees=(1, 2),
              memory_strategies=(None, "recompute"), routing="zipf:1.2", lina=False)
    rep = size(TINY, **kw)
    cost = Cluster.preset("dgx-h100").cost_model("bfloat16")
    assert {c.ep_size for c in rep.candidates} == {1, 2, 4, 8}
    assert len(rep.candidates) == 4 * 2 * 2 * 2
    steps = set()
    for c in rep.candidates:
        cand = {"schedule": "ep-pipeline", "pipeline_degree": c.pipeline_degree}
        if c.memory_strategy is not None:  # None: the layer's default block, no memory ops
            cand["memory_strategy"] = c.memory_strategy
        tl = simulate(_moe_cfg(c.capacity_factor), 64, cost, world_size=c.ep_size, routing="zipf:1.2", mode="symmetric",
                      candidate=cand)
        assert c.breakdown["moe_layers"] == pytest.approx(2 * tl.step_time(), rel=1e-12)
        dense = cost.compute_time(dense_work(TINY, 64, 32))
        assert c.breakdown["dense"] == pytest.approx(dense, rel=1e-12)
        # gradient all-reduces: dense (bf16) over all 8 GPUs, each rank's experts over DP = 8 / EP
        dense_p = TINY.total_params() - TINY.params_by_part()["routed_experts"]
        exp_p = 2 * (8 // c.ep_size) * TINY.expert_params_per_layer() // 8
        sync = cost.predict("all_reduce", dense_p * 2, 8, "intra") + (
            cost.predict("all_reduce", exp_p * 2, 8 // c.ep_size, "intra") if c.ep_size < 8 else 0.0)
        assert c.breakdown["grad_sync"] == pytest.approx(sync, rel=1e-12)
        backward = 2 / 3 * (dense + 2 * tl.breakdown()["compute"])
        want = 2 * tl.step_time() + dense + max(0.0, sync - backward)
        assert c.step_time == pytest.approx(want, rel=1e-12)
        est = memory_per_gpu(TINY, world_size=8, ep_size=c.ep_size, tokens_per_gpu=64, seq_len=32,
                             memory_strategy=c.memory_strategy, pipeline_degree=c.pipeline_degree,
                             capacity_factor=c.capacity_factor)
        assert c.memory.total_bytes == est.total_bytes
        steps.add((c.capacity_factor, round(c.breakdown["moe_layers"], 15)))
    # the capacity binds under zipf routing: some capacity-1.0 candidate differs from dropless
    by_cf = {cf: {s for f, s in steps if f == cf} for cf in (None, 1.0)}
    assert by_cf[None] != by_cf[1.0]
    best = min((c for c in rep.candidates if c.fits), key=lambda c: c.step_time)
    assert rep.winner.step_time == best.step_time
    fitting = [c.step_time for c in rep.fitting]
    assert fitting == sorted(fitting)


def test_tie_is_detected_and_the_simpler_recommended():
    wide = dataclasses.replace(TINY, d_model=2048, d_ffn=1024, head_dim=1024)
    rep = size(wide, gpus=1, tokens_per_gpu=8192, seq_len=1024, capacity_factors=(None,), pipeline_degrees=(1, 2),
               memory_strategies=("keep",))
    # one GPU: no communication; degree 2 splits the same GEMMs (more launches) -> within the error
    assert rep.is_tie and rep.recommended.pipeline_degree == 1
    text = " ".join(rep.explain())
    assert "TIE" in text and f"{100 * TIE_TOLERANCE:.1f}%" in text and ", ".join(SIMPLER) in text
    # a constructed tie where the faster candidate is the less simple one
    slow = rep.recommended
    fast = dataclasses.replace(slow, pipeline_degree=2, memory_strategy="recompute", step_time=slow.step_time * 0.95)
    rep2 = dataclasses.replace(rep, candidates=[fast, slow])
    assert rep2.winner is fast and rep2.recommended is slow and rep2.runner_up is slow
    text = " ".join(rep2.explain())
    assert "Recommended: the simpler one, " + slow.label() in text
    assert "+5.3%" in text  # the runner-up's cost, and the recommended one's
    # outside the error: no tie, the winner is recommended
    far = dataclasses.replace(slow, step_time=fast.step_time * (1 + TIE_TOLERANCE) * 1.01)
    rep3 = dataclasses.replace(rep, candidates=[fast, far])
    assert not rep3.is_tie and rep3.recommended is fast
    assert "leads by more than" in " ".join(rep3.explain())
    # a faster candidate over the memory is reported with its shortfall, never dropped
    over = dataclasses.replace(fast, pipeline_degree=4, step_time=fast.step_time / 2, capacity_bytes=1024)
    rep4 = dataclasses.replace(rep, candidates=[fast, slow, over])
    assert rep4.winner is fast and not over.fits and over.shortfall == over.memory.total_bytes - 1024
    text = " ".join(rep4.explain())
    assert f"Faster but over the memory: {over.label()} would take {over.step_time * 1e3:.1f} ms (-50.0%)" in text
    assert f"{over.shortfall / 2**30:.1f} GiB short" in text and "1 of 3 candidates do not fit" in text


def test_explain_carries_the_breakdown_numbers_and_provenance():
    rep = size(TINY, gpus=8, tokens_per_gpu=64, seq_len=32, capacity_factors=(None,), pipeline_degrees=(1, 2),
               memory_strategies=("keep",))
    w, b = rep.winner, rep.winner.breakdown
    text = "\n".join(rep.explain())
    for v in (w.step_time, b["moe_layer"]["step"], b["moe_layers"], b["dense"], b["comm"], b["exposed_comm"],
              b["grad_sync"], b["moe_layer"]["compute"], b["moe_layer"]["comm"]):
        assert f"{v * 1e3:.1f} ms" in text, v
    assert f"({100 * b['exposed_share']:.0f}%) is exposed" in text
    assert f"{w.memory.total_bytes / 2**30:.1f} GiB per GPU" in text
    r = rep.runner_up
    assert f"+{100 * (r.step_time / w.step_time - 1):.1f}%" in text
    assert "[assumed from a preset: dgx-h100]" in text and "measured on this machine" in text
    assert "exact" in text and "formula" in text
    assert b["exposed_share"] == pytest.approx(b["exposed_comm"] / b["comm"])


def test_mixtral_on_16_gpus_offers_ep_x_dp_not_an_error():
    rep = size("mixtral-8x7b", gpus=16, tokens_per_gpu=1024, seq_len=1024, capacity_factors=(None,),
               pipeline_degrees=(1,), memory_strategies=("keep",), setup=TrainingSetup(shard_optimizer=True))
    assert {c.ep_size for c in rep.candidates} == {1, 2, 4, 8}
    assert any(c.ep_size == 8 and c.dp_size == 2 for c in rep.candidates)
    text = " ".join(rep.explain())
    assert "EP=8 x DP=2" in text and "replication" in text
    # EP 16 spans two nodes of 8 only where E divides: not here, so no hierarchical candidate
    assert {c.all_to_all for c in rep.candidates} == {"flat"}


def test_hierarchical_candidate_where_ep_spans_nodes():
    m = dataclasses.replace(TINY, num_experts=16)
    rep = size(m, gpus=16, tokens_per_gpu=64, seq_len=32, ep_sizes=(8, 16), capacity_factors=(None,),
               pipeline_degrees=(1,), memory_strategies=("keep",), lina=False)
    assert sorted((c.ep_size, c.all_to_all) for c in rep.candidates) == [(8, "flat"), (16, "flat"),
                                                                         (16, "hierarchical")]


def test_typed_errors():
    with pytest.raises(ValueError, match="unknown model"):
        size("qwen3-30b-a3", gpus=16, tokens_per_gpu=1024)
    with pytest.raises(ValueError, match="multiple of 8"):
        size(TINY, gpus=12, tokens_per_gpu=64)
    with pytest.raises(ValueError, match="exactly one"):
        size(TINY, gpus=8)
    with pytest.raises(ValueError, match="multiple of 8"):
        size(TINY, gpus=8, tokens_per_step=100)
    with pytest.raises(ValueError, match="unknown cluster"):
        size(TINY, gpus=8, tokens_per_gpu=64, cluster="dgx-h10")
    with pytest.raises(ValueError, match="must divide"):
        size(TINY, gpus=8, tokens_per_gpu=64, ep_sizes=(3,))
    with pytest.raises(TypeError):
        size(TINY, gpus=8.0, tokens_per_gpu=64)
    with pytest.raises(ValueError, match="fewer than gpus=16"):
        size(TINY, gpus=16, tokens_per_gpu=64, cluster=Cluster.preset("dgx-h100").cost_model("bfloat16"))
    with pytest.raises(ValueError, match="sizes training"):
        size(TINY, gpus=8, tokens_per_gpu=64, setup=TrainingSetup(optimizer="none"))
    rep = size(TINY, gpus=8, tokens_per_gpu=64, seq_len=32, cluster=Cluster.preset("dgx-h100").cost_model("bfloat16"),
               pipeline_degrees=(1,), memory_strategies=("keep",), capacity_factors=(None,))
    assert rep.step_provenance == "assumed from a preset: dgx-h100"
    with pytest.raises(SizingError, match=r"nothing fits.*GiB over the 0\.0 GiB budget\. Fix: ") as e:
        size(TINY, gpus=8, tokens_per_gpu=64, seq_len=32, memory_budget_bytes=1024, pipeline_degrees=(1,),
             memory_strategies=("keep",), capacity_factors=(None,))
    assert isinstance(e.value, ValueError)
    with pytest.raises(SizingError, match="Fix: .*fits"):  # the fix names a change that makes it fit
        size("qwen3-30b-a3b", gpus=16, tokens_per_gpu=8192, pipeline_degrees=(1,), memory_strategies=("keep",),
             capacity_factors=(None,))


def test_cli_plan_model_routes_to_size_and_json():
    out = io.StringIO()
    argv = ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--tokens-per-gpu", "1024", "--seq-len", "1024",
            "--no-master-weights", "--degrees", "1", "--memory-strategies", "default,keep", "--capacity-factors", "dropless"]
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    text = out.getvalue()
    assert "<- winner" in text and "Winner: EP=" in text and "optimizer state (adam)" in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["size", *argv[1:], "--json"]) == 0
    d = json.loads(out.getvalue())
    assert {c["memory_strategy"] for c in d["candidates"]} == {None, "keep"}
    assert d["winner"]["ep_size"] in (1, 2, 4, 8) and d["candidates"][0]["breakdown"]["step"] > 0
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["plan", "--model", "nope", "--gpus", "8", "--tokens-per-gpu", "64"]) == 2
    assert "unknown model" in err.getvalue()


def test_plan_candidates_carry_a_breakdown():
    plan = choose(MoEConfig(64, 32, 8, 2), 64, Cluster.preset("dgx-h100"), world_size=8, pipeline_degree=(1, 2))
    assert all(c.breakdown is not None and c.breakdown["step"] > 0 for c in plan.candidates)


# ---- Parm's EP x MP layouts and Lina's priority (issue 34, item 2) ----


def test_parm_candidates_are_priced_by_parms_model_and_the_search_is_the_argmin():
    """Brute force over a small space with Parm candidates: each EP x MP candidate's MoE time is
    the fastest of Parm's three schedules simulated on its own (MP group batch of T x MP tokens),
    its memory is memory_per_gpu's with mp_size, and the winner is the argmin of all."""
    kw = dict(gpus=8, tokens_per_gpu=64, seq_len=32, capacity_factors=(None,), pipeline_degrees=(1, 2),
              memory_strategies=(None,), mp_sizes=(2, 4), lina=False)
    rep = size(TINY, **kw)
    cost = Cluster.preset("dgx-h100").cost_model("bfloat16")
    parm = [c for c in rep.candidates if c.mp_size > 1]
    assert sorted((c.ep_size, c.mp_size, c.dp_size) for c in parm) == [
        (1, 2, 4), (1, 4, 2), (2, 2, 2), (2, 4, 1), (4, 2, 1)]
    for c in parm:
        layout = ParmLayout.make(n_mp=c.mp_size, n_ep=c.ep_size, n_esp=c.mp_size, placement="esp_inner")
        t = {s: simulate_parm(_moe_cfg(None), layout, s, cost, tokens=64 * c.mp_size, dtype="bfloat16").step_time()
             for s in ("s1", "s2", "baseline")}
        assert c.parm_schedule == min(t, key=t.get) and c.breakdown["parm"]["schedule"] == c.parm_schedule
        assert c.breakdown["moe_layers"] == pytest.approx(2 * min(t.values()), rel=1e-12)
        est = memory_per_gpu(TINY, world_size=8, ep_size=c.ep_size, tokens_per_gpu=64, seq_len=32, memory_strategy=None,
                             mp_size=c.mp_size, parm_schedule=c.parm_schedule)
        assert c.memory.total_bytes == est.total_bytes
        assert f"MP={c.mp_size}" in c.label() and repr(c.parm_schedule) in c.label()
    best = min((c for c in rep.candidates if c.fits), key=lambda c: c.step_time)
    assert rep.winner.step_time == best.step_time


def test_mp_layout_offered_where_experts_are_fewer_than_gpus():
    few = dataclasses.replace(TINY, num_experts=4)
    rep = size(few, gpus=8, tokens_per_gpu=64, seq_len=32, capacity_factors=(None,), pipeline_degrees=(1,),
               memory_strategies=(None,), lina=False)
    layouts = {(c.ep_size, c.mp_size, c.dp_size) for c in rep.candidates}
    assert (4, 2, 1) in layouts and (4, 1, 2) in layouts  # EP=4 x MP=2 beside EP=4 x DP=2
    assert all(e * m * d == 8 for e, m, d in layouts)
    text = " ".join(rep.explain())
    best = min((c for c in rep.candidates if c.mp_size > 1), key=lambda c: c.step_time)
    assert f"Parm (applies: E=4 experts on 8 GPUs" in text and f"Parm's schedule {best.parm_schedule!r} won" in text
    assert best.breakdown["parm"]["why"] in text
    # E >= GPUs: Parm's setting does not apply, no MP candidate unless asked
    rep = size(TINY, gpus=8, tokens_per_gpu=64, seq_len=32, capacity_factors=(None,), pipeline_degrees=(1,),
               memory_strategies=(None,), lina=False)
    assert {c.mp_size for c in rep.candidates} == {1} and "Parm (applies" not in " ".join(rep.explain())


def test_parm_memory_shards_the_expert_state_by_mp():
    one = memory_per_gpu(TINY, world_size=8, ep_size=2, tokens_per_gpu=64, seq_len=32, memory_strategy=None)
    two = memory_per_gpu(TINY, world_size=8, ep_size=2, tokens_per_gpu=64, seq_len=32, memory_strategy=None, mp_size=2)
    row = lambda e, name: next(r.bytes for r in e.rows if r.name == name)  # noqa: E731
    assert 2 * row(two, "weights: routed experts") == row(one, "weights: routed experts")
    # against the shards Parm's layer holds: every rank's w1 / w2 slices of the full weights
    cfg = _moe_cfg(None)
    layout = ParmLayout.make(n_mp=2, n_ep=2, n_esp=2, placement="esp_inner")
    w1, w2 = torch.zeros(8, 64, cfg.n1, dtype=torch.bfloat16), torch.zeros(8, 32, 64, dtype=torch.bfloat16)
    held = {r: sum(t.numel() * t.element_size() for t in shard_expert_weights(w1, w2, cfg, layout, r))
            for r in range(layout.P)}
    assert set(held.values()) == {row(two, "weights: routed experts") // TINY.moe_layers}
    with pytest.raises(ValueError, match="mp_size=4 x ep_size=4 does not divide"):
        memory_per_gpu(TINY, world_size=8, ep_size=4, tokens_per_gpu=64, seq_len=32, memory_strategy=None, mp_size=4)
    with pytest.raises(ValueError, match="default expert block"):
        memory_per_gpu(TINY, world_size=8, ep_size=2, tokens_per_gpu=64, seq_len=32, memory_strategy="keep", mp_size=2)


def test_lina_symmetric_path_equals_the_full_simulation():
    m = LinaModel.transformer(MoEConfig(64, 32, 8, 2), layers=2, tokens=64, dense_s=1e-5)
    c = Cluster.preset("dgx-h100")
    for comm in ("fifo", "lina"):
        full = simulate_lina_step(m, c, world_size=8, comm=comm, packing=2)
        sym = simulate_lina_step(m, c, world_size=8, comm=comm, packing=2, symmetric=True)
        assert sym.step_s == pytest.approx(full.step_s, rel=1e-9)


def test_lina_is_simulated_for_the_top_candidates_only(monkeypatch):
    calls = []
    real = sizing.simulate_lina_step

    def counting(model, cost, **kw):
        calls.append((kw["world_size"] // kw["packing"], kw["pipeline_degree"], kw["comm"]))
        return real(model, cost, **kw)

    monkeypatch.setattr(sizing, "simulate_lina_step", counting)
    kw = dict(gpus=8, tokens_per_gpu=64, seq_len=32, capacity_factors=(None,), pipeline_degrees=(1, 2),
              memory_strategies=(None, "keep"))
    base = size(TINY, **kw, lina=False)
    assert not calls
    rep = size(TINY, **kw)
    # the top: distinct programs within the tolerance of the fastest plus the next one
    w, top = base.winner.step_time, []
    for c in base.fitting:
        top.append(c)
        if c.step_time > w * (1 + TIE_TOLERANCE) or len(top) == sizing.LINA_TOP:
            break
    keys = {(c.ep_size, c.pipeline_degree) for c in top}
    assert len(top) < len(base.fitting)  # not every candidate
    assert sorted(calls) == sorted((e, n, comm) for e, n in keys for comm in ("fifo", "lina"))
    variants = [c for c in rep.candidates if c.gradient_sync == "lina"]
    assert len(variants) == len(top)
    for v in variants:
        orig = next(c for c in base.candidates if c.program_key()[:-1] == v.program_key()[:-1])
        r = v.breakdown["lina"]
        assert v.step_time == pytest.approx(orig.step_time * r["lina_step_s"] / r["fifo_step_s"], rel=1e-12)
    assert [c.step_time for c in rep.fitting] == sorted(c.step_time for c in rep.fitting)
    text = " ".join(rep.explain())
    assert "Lina's priority" in text and "[simulated;" in text
    assert ("does not change the winner" in text) == (rep.winner.gradient_sync == "fifo")
    # a constructed case where the priority wins: the sentence says so, and by how much
    v = variants[0]
    fast = dataclasses.replace(v, step_time=rep.lina["before"].step_time * 0.8)
    rep2 = dataclasses.replace(rep, candidates=[fast, rep.lina["before"]], lina=dict(rep.lina, variants=[fast]))
    text = " ".join(rep2.explain())
    assert rep2.winner is fast and "20.0% faster" in text
    same = fast.program_key()[:-1] == rep.lina["before"].program_key()[:-1]
    assert ("keeps the winner's layout" in text) == same and ("changes the winner to" in text) == (not same)


def test_cli_mentions_parm_schedule_and_lina():
    few = ["--model", "mixtral-8x7b", "--gpus", "16", "--tokens-per-gpu", "256", "--seq-len", "256", "--zero1",
           "--checkpointing", "--degrees", "1", "--memory-strategies", "default", "--capacity-factors", "dropless",
           "--ep-sizes", "8"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["size", *few]) == 0
    text = out.getvalue()
    assert "Parm's schedule '" in text and "parm:s" in text and "EP=8 x MP=2" in text
    assert "Lina's priority" in text and "lina" in text.split("Winner:")[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["size", *few, "--mp-sizes", "", "--no-lina"]) == 0
    assert "Parm" not in out.getvalue() and "Lina" not in out.getvalue()
