"""Parm's and SE-MoE's calibration entries (``../shared/PAPERS.md`` §6: CAL-01..06, CAL-17),
simulated from one cluster description per testbed (:data:`tritonmoe.sim.cost_model.PRESETS`:
``parm-a``, ``parm-b``, ``se-moe``) through the same schedule code the layer runs
(:func:`tritonmoe.policy.parm_schedule.simulate_parm`).

Table IV cells (CAL-01..05): the mean over the configuration grid of t(baseline) / t(schedule),
forward + backward of one MoE layer (gradient all-reduce excluded, as the paper). The grid is
the paper's Table III with the readings of PAPERS.md 3.5: B in {2, 4, 8}, L in {512, 1024, 2048},
H/N_ESP and M in {1024, 2048, 4096}, f in {1.2, 2.4}, and k in {1, 2} (free): 324 configurations,
the number the paper ran per scale. E = N_EP (one expert per EP rank, the Table V models'
reading). Free parameters, fixed for every entry and never tuned: fp32 elements (the fitted AG
betas of 003 VI-B match fp32), GELU experts, the dispatch padded to capacity (DeepSpeed-MoE's
E x capacity x M tensor, what Parm's volumes count), the ESP-inner placement (EP-inner reported
too where it differs), no GPU-memory filter (the paper's filter left all 324 per scale).

"Parm" is Parm's Algorithm 1 choosing per configuration from alpha-beta lines fitted inside the
simulator (the MP all-gather, the EP&ESP all-to-all and SAA timed on the cluster at several
sizes: :func:`fit_in_simulator`), as the paper fits them on its testbeds.

:data:`ENTRIES` lists them; :mod:`tritonmoe.plan.calibrate` registers them over the placeholders
that waited for these schedules.
"""

from __future__ import annotations

import functools
import itertools
import statistics
from typing import Callable

import torch

from .calibration_table import CalEntry
from tritonmoe.policy.parm_schedule import AlphaBeta, ParmCostModel, algorithm1, fit_alpha_beta
from tritonmoe.sim.parm_model import simulate_parm
from tritonmoe.sim.cost_model import Cluster
from tritonmoe.parm_layout import ParmLayout
from tritonmoe.config import MoEConfig
from tritonmoe.comm.executor import VirtualTensor
from tritonmoe.comm.programs.saa import saa_schedule
from tritonmoe.sim import engine
from tritonmoe.sim.parm_model import sim_groups
from tritonmoe.sim.simulate import resolve_cost
from tritonmoe.sim.executor import SimExecutor, VirtualGroup
from tritonmoe.sim.parm_model import simulate_all_to_all

__all__ = ["GRID", "table_iv_cell", "fit_in_simulator", "real_model"]

#: Table III (readings of PAPERS.md 3.5): (B, L, H/N_ESP, M, f, k).
GRID = list(itertools.product((2, 4, 8), (512, 1024, 2048), (1024, 2048, 4096), (1024, 2048, 4096), (1.2, 2.4), (1, 2)))
DTYPE = "float32"


def _cluster(testbed: str, gpus: int):

    if testbed == "parm-a":
        return Cluster.preset("parm-a")
    return Cluster.preset("parm-b", nodes=gpus // 4)


def _layout(n_mp: int, n_esp: int, gpus: int, placement: str):

    return ParmLayout.make(n_mp, gpus // n_esp, n_esp, placement=placement)


def _config(M: int, H: int, E: int, k: int, f: float):

    return MoEConfig(M, H, E, k, activation="gelu", capacity_factor=f)


@functools.lru_cache(maxsize=None)
def fit_in_simulator(testbed: str, gpus: int, n_mp: int, n_esp: int, placement: str) -> ParmCostModel:
    """Algorithm 1's three lines fitted on the simulated cluster: the MP all-gather (gathered
    elements), the EP&ESP all-to-all and SAA (per-rank input elements), each timed at four
    sizes by the engine on this layout, one representative rank (symmetric mode)."""

    cost = resolve_cost(_cluster(testbed, gpus), DTYPE)
    lay = _layout(n_mp, n_esp, gpus, placement)
    P, width = lay.P, 1024
    G = sim_groups(lay, 0)
    world = VirtualGroup(tuple(lay.ranks))
    sizes = [16, 64, 256, 1024]  # rows per peer
    t_ag, t_a2a, t_saa = [], [], []
    for r in sizes:
        def run(build):
            ex = SimExecutor(0, world, host_compute=False)
            build(ex)
            return engine.run([ex.program], cost, symmetric=True, timeline=False).step_time()

        x = VirtualTensor((r * P, width), torch.float32)
        t_a2a.append(run(lambda ex: ex.wait(ex.all_to_all(x, [r] * P, [r] * P, group=G.ep_esp, kind="dispatch"))))
        if G.mp is not None:
            part = VirtualTensor((r * P // n_mp, width), torch.float32)
            t_ag.append(run(lambda ex: ex.wait(ex.all_gather(part, group=G.mp, kind="mp_allgather"))))
            peers = list(lay.mp_group_of(0))
            t_saa.append(run(lambda ex: ex.wait(saa_schedule(
                ex, x, [r] * P, [r] * P, group=G.ep_esp, rank=0, mp_group=G.mp, mp_peers=peers,
                peer_recv_splits=[[r] * P for _ in peers]))))
    elems = [float(r * P * width) for r in sizes]
    zero = AlphaBeta(0.0, 0.0)
    return ParmCostModel(
        ag_mp=fit_alpha_beta(elems, t_ag) if t_ag else zero, a2a=fit_alpha_beta(elems, t_a2a),
        overlap=fit_alpha_beta(elems, t_saa) if t_saa else fit_alpha_beta(elems, t_a2a),
        source=f"fitted in the simulator on {testbed} ({gpus} GPUs, {lay.describe()}, {placement})",
    )


@functools.lru_cache(maxsize=None)
def table_iv_cell(testbed: str, gpus: int, n_mp: int, n_esp: int, placement: str = "esp_inner") -> dict:
    """One Table IV cell over :data:`GRID`: mean speedups over the baseline of S1, S2 and Parm
    (Algorithm 1 on simulator-fitted lines), the oracle's (the faster of S1/S2 per
    configuration), how often each schedule wins, and the baseline's communication share."""
    cluster = _cluster(testbed, gpus)
    lay = _layout(n_mp, n_esp, gpus, placement)
    E = lay.n_ep
    model = fit_in_simulator(testbed, gpus, n_mp, n_esp, placement)
    s1, s2, parm, oracle, s1_wins, over4 = [], [], [], [], 0, 0
    for B, L, Hs, M, f, k in GRID:
        cfg = _config(M, Hs * n_esp, E, k, f)
        T = B * L
        t = {s: simulate_parm(cfg, lay, s, cluster, tokens=T, dtype=DTYPE, padded=True).step_time()
             for s in ("baseline", "s1", "s2")}
        pick = algorithm1(model, tokens=T, d_model=M, num_experts=E, top_k=k, capacity_factor=f, n_esp=n_esp, n_mp=n_mp)
        s1.append(t["baseline"] / t["s1"])
        s2.append(t["baseline"] / t["s2"])
        parm.append(t["baseline"] / t[pick])
        oracle.append(t["baseline"] / min(t["s1"], t["s2"]))
        s1_wins += t["s1"] <= t["s2"]
        over4 += parm[-1] > 4.0
    n = len(GRID)
    mean = statistics.fmean
    return dict(
        s1=mean(s1), s2=mean(s2), parm=mean(parm), oracle=mean(oracle), s1_win_frac=s1_wins / n,
        parm_over_oracle=mean(p / o for p, o in zip(parm, oracle)),
        parm_gain_over_worse=mean(p / min(a, b) for p, a, b in zip(parm, s1, s2)) - 1.0,
        parm_over_4x_frac=over4 / n, configurations=n, model=model.source,
    )


def _cell_entry(testbed: str, gpus: int, n_mp: int, n_esp: int, which: str, placement: str = "esp_inner") -> Callable[[], dict]:
    def run() -> dict:
        c = table_iv_cell(testbed, gpus, n_mp, n_esp, placement)
        detail = (f"S1 {c['s1']:.2f}x, S2 {c['s2']:.2f}x, Parm {c['parm']:.2f}x (oracle {c['oracle']:.2f}x); S1 faster "
                  f"in {c['s1_win_frac']:.0%} of {c['configurations']} configurations; {placement}")
        return {"simulated": c[which], "detail": detail}
    return run


def _summary(testbed: str, gpus: int, n_mp: int, n_esp: int) -> Callable[[], dict]:
    def run() -> dict:
        c = table_iv_cell(testbed, gpus, n_mp, n_esp, "esp_inner")
        return {"simulated": f"{c['s1']:.2f}/{c['s2']:.2f}/{c['parm']:.2f}",
                "detail": "S1 / S2 / Parm mean speedups over the baseline (the -s1/-s2/-parm rows compare each)"}
    return run


def _cal05() -> dict:
    a = table_iv_cell("parm-a", 8, 4, 2)
    b = table_iv_cell("parm-b", 32, 4, 2)
    winner = lambda c: "S1" if c["s1"] >= c["s2"] else "S2"  # noqa: E731
    return {
        "simulated": f"{winner(a)} on A, {winner(b)} on B32",
        "detail": (f"A: S1 {a['s1']:.2f}x S2 {a['s2']:.2f}x Parm {a['parm']:.2f}x ({a['parm_over_oracle']:.3f} of the "
                   f"oracle, +{100 * a['parm_gain_over_worse']:.1f}% over the worse); B32: S1 {b['s1']:.2f}x S2 "
                   f"{b['s2']:.2f}x Parm {b['parm']:.2f}x ({b['parm_over_oracle']:.3f} of the oracle, "
                   f"+{100 * b['parm_gain_over_worse']:.1f}% over the worse); paper: 3.72/3.21/3.70 on A, "
                   f"3.92/4.10/4.06 on B32, +8% / +10.5%"),
    }


@functools.lru_cache(maxsize=None)
def baseline_comm_share(testbed: str, gpus: int, n_mp: int, n_esp: int) -> tuple[float, float, float]:
    """(min, mean, max) over every 9th configuration of :data:`GRID` of the baseline's
    communication share of the simulated step (1 - compute-lane busy time / step time)."""
    cluster = _cluster(testbed, gpus)
    lay = _layout(n_mp, n_esp, gpus, "esp_inner")
    shares = []
    for B, L, Hs, M, f, k in GRID[::9]:
        res = simulate_parm(_config(M, Hs * n_esp, lay.n_ep, k, f), lay, "baseline", cluster, tokens=B * L,
                            dtype=DTYPE, padded=True)
        prog = res.programs[0]
        busy = sum(t.end - t.start for o, t in zip(prog.ops, res.timings[prog.rank]) if o.lane == "compute")
        shares.append(1.0 - busy / res.step_time())
    return min(shares), statistics.fmean(shares), max(shares)


def _comm_share() -> dict:
    lo, mean, hi = baseline_comm_share("parm-b", 32, 4, 4)
    return {"simulated": mean, "detail": f"baseline communication share {lo:.0%}..{hi:.0%} (mean {mean:.0%}) over 36 "
                                         f"configurations at N_MP = N_ESP = 4; paper 67.92%..96.02% over 324 (Fig. 1)"}


#: Table V (free: B, L, k, f -- not stated): one sequence length and batch per model.
_REAL = {"BERT-Base": (768, 3072, 8, 512), "GPT-2": (768, 3072, 8, 1024)}


@functools.lru_cache(maxsize=None)
def real_model(model: str, testbed: str) -> float:
    """Table V: Parm's speedup on one MoE layer of the model (N_MP = N_ESP = 4; E = 2 on A's 8
    GPUs, E = 8 on B's 32), k = 1, f = 1.2 (free). The dense layers (common to both, not
    simulated) would lower the iteration-level ratio."""
    M, H, B, L = _REAL[model]
    gpus = 8 if testbed == "parm-a" else 32
    lay = _layout(4, 4, gpus, "esp_inner")
    cluster = _cluster(testbed, gpus)
    cfg = _config(M, H, lay.n_ep, 1, 1.2)
    model_fit = fit_in_simulator(testbed, gpus, 4, 4, "esp_inner")
    pick = algorithm1(model_fit, tokens=B * L, d_model=M, num_experts=lay.n_ep, top_k=1, capacity_factor=1.2,
                      n_esp=4, n_mp=4)
    t = {s: simulate_parm(cfg, lay, s, cluster, tokens=B * L, dtype=DTYPE, padded=True).step_time()
         for s in ("baseline", pick)}
    return t["baseline"] / t[pick]


def _real_entry(model: str, testbed: str) -> Callable[[], dict]:
    def run() -> dict:
        M, H, B, L = _REAL[model]
        return {"simulated": real_model(model, testbed),
                "detail": f"one MoE layer (M={M}, H={H}, B={B}, L={L}, k=1, f=1.2); the dense layers are not simulated"}
    return run


def _cal17() -> dict:
    """SE-MoE: flat vs hierarchical all-to-all on 4 nodes x 8 A100 (the ``se-moe`` preset) for a
    dispatch of 4096 tokens x top-2 x 4096 fp16 elements per GPU, uniform over the 32 ranks."""

    c = Cluster.preset("se-moe")
    P = c.num_gpus
    rows = 4096 * 2
    send = [[rows // P] * P for _ in range(P)]
    t = {h: simulate_all_to_all(send, c, row_bytes=4096 * 2, local_size=c.gpus_per_node, hierarchical=h,
                                dtype="float16").step_time() for h in (False, True)}
    gain = t[False] / t[True] - 1.0
    return {"simulated": gain,
            "detail": f"flat {t[False] * 1e3:.3f} ms, hierarchical {t[True] * 1e3:.3f} ms per all-to-all (comm speedup "
                      f"{100 * gain:+.1f}%; paper +15.5%)"}


_FREE = ("grid of Table III (324 configurations: B, L, H/N_ESP, M, f, k in {1, 2}); E = N_EP; fp32; gelu; "
         "capacity-padded dispatch; ESP-inner; no memory filter")

_ENTRIES = [
    CalEntry("CAL-01", "Parm 003 Table IV", "S1 / S2 / Parm speedups over the baseline, A, 2/2", "parm-a",
             "2.10/1.99/2.10", run=_summary("parm-a", 8, 2, 2), free=_FREE),
    CalEntry("CAL-02", "Parm 003 Table IV", "S1 / S2 / Parm speedups, A, 4/4", "parm-a", "4.19/4.12/4.20",
             run=_summary("parm-a", 8, 4, 4), free=_FREE),
    CalEntry("CAL-03", "Parm 003 Table IV", "S1 / S2 / Parm speedups, B8, 4/4", "parm-b", "5.77/5.38/5.77",
             run=_summary("parm-b", 8, 4, 4), free=_FREE),
    CalEntry("CAL-04", "Parm 003 Table IV", "S1 / S2 / Parm speedups, B32, 4/4", "parm-b", "4.57/4.91/4.91",
             run=_summary("parm-b", 32, 4, 4), free=_FREE),
    CalEntry("CAL-06", "Parm 003 Table V", "real-model speedups (BERT A / BERT B / GPT-2 A / GPT-2 B)", "parm-a/parm-b",
             "3.06/2.98/3.08/3.15", run=lambda: {"simulated": "/".join(f"{real_model(m, t):.2f}" for m, t in (
                 ("BERT-Base", "parm-a"), ("BERT-Base", "parm-b"), ("GPT-2", "parm-a"), ("GPT-2", "parm-b"))),
                 "detail": "one MoE layer each (the -bert/-gpt2 rows compare each)"},
             free="one MoE layer; B=8, L=512 (BERT) / 1024 (GPT-2), k=1, f=1.2; fp32"),
    CalEntry("CAL-01-s1", "Parm 003 Table IV", "S1 speedup over the baseline, A, N_MP=2 N_ESP=2", "parm-a", 2.10,
             run=_cell_entry("parm-a", 8, 2, 2, "s1"), free=_FREE),
    CalEntry("CAL-01-s2", "Parm 003 Table IV", "S2 speedup, A, 2/2", "parm-a", 1.99, run=_cell_entry("parm-a", 8, 2, 2, "s2"),
             free=_FREE),
    CalEntry("CAL-01-parm", "Parm 003 Table IV", "Parm speedup, A, 2/2", "parm-a", 2.10,
             run=_cell_entry("parm-a", 8, 2, 2, "parm"), free=_FREE),
    CalEntry("CAL-02-s1", "Parm 003 Table IV", "S1 speedup, A, 4/4", "parm-a", 4.19, run=_cell_entry("parm-a", 8, 4, 4, "s1"),
             free=_FREE),
    CalEntry("CAL-02-s2", "Parm 003 Table IV", "S2 speedup, A, 4/4", "parm-a", 4.12, run=_cell_entry("parm-a", 8, 4, 4, "s2"),
             free=_FREE),
    CalEntry("CAL-02-parm", "Parm 003 Table IV", "Parm speedup, A, 4/4", "parm-a", 4.20,
             run=_cell_entry("parm-a", 8, 4, 4, "parm"), free=_FREE),
    CalEntry("CAL-03-s1", "Parm 003 Table IV", "S1 speedup, B8, 4/4", "parm-b", 5.77, run=_cell_entry("parm-b", 8, 4, 4, "s1"),
             free=_FREE),
    CalEntry("CAL-03-s2", "Parm 003 Table IV", "S2 speedup, B8, 4/4", "parm-b", 5.38, run=_cell_entry("parm-b", 8, 4, 4, "s2"),
             free=_FREE),
    CalEntry("CAL-03-parm", "Parm 003 Table IV", "Parm speedup, B8, 4/4", "parm-b", 5.77,
             run=_cell_entry("parm-b", 8, 4, 4, "parm"), free=_FREE),
    CalEntry("CAL-03-s1-epinner", "Parm 003 Table IV", "S1 speedup, B8, 4/4, EP-inner placement", "parm-b", 5.77,
             run=_cell_entry("parm-b", 8, 4, 4, "s1", "ep_inner"), free=_FREE.replace("ESP-inner", "EP-inner")),
    CalEntry("CAL-04-s1", "Parm 003 Table IV", "S1 speedup, B32, 4/4", "parm-b", 4.57,
             run=_cell_entry("parm-b", 32, 4, 4, "s1"), free=_FREE),
    CalEntry("CAL-04-s2", "Parm 003 Table IV", "S2 speedup, B32, 4/4", "parm-b", 4.91,
             run=_cell_entry("parm-b", 32, 4, 4, "s2"), free=_FREE),
    CalEntry("CAL-04-parm", "Parm 003 Table IV, Fig. 7", "Parm speedup, B32, 4/4", "parm-b", 4.91,
             run=_cell_entry("parm-b", 32, 4, 4, "parm"), free=_FREE),
    CalEntry("CAL-04-over4", "Parm 003 Fig. 7", "fraction of configurations where Parm > 4x, B32, 4/4", "parm-b", 0.89,
             run=_cell_entry("parm-b", 32, 4, 4, "parm_over_4x_frac"), free=_FREE),
    CalEntry("CAL-04-comm", "Parm 003 Fig. 1", "baseline communication share of the MoE layer, B32", "parm-b",
             0.82, run=_comm_share, free=_FREE + "; paper value: the middle of its 67.92%..96.02% range"),
    CalEntry("CAL-05", "Parm 003 Table IV", "the faster of S1/S2 at N_MP=4 N_ESP=2, A vs B32", "parm-a/parm-b",
             "S1 on A, S2 on B32", run=_cal05, free=_FREE),
    CalEntry("CAL-05-oracle", "PAPERS.md 6 (suggested bar)", "Parm / per-configuration oracle, B32, 4/2", "parm-b", 0.98,
             run=_cell_entry("parm-b", 32, 4, 2, "parm_over_oracle"), free=_FREE),
    CalEntry("CAL-06-bert-a", "Parm 003 Table V", "BERT-Base speedup, A", "parm-a", 3.06, run=_real_entry("BERT-Base", "parm-a"),
             free="one MoE layer; B=8, L=512, k=1, f=1.2; fp32"),
    CalEntry("CAL-06-bert-b", "Parm 003 Table V", "BERT-Base speedup, B32", "parm-b", 2.98, run=_real_entry("BERT-Base", "parm-b"),
             free="one MoE layer; B=8, L=512, k=1, f=1.2; fp32"),
    CalEntry("CAL-06-gpt2-a", "Parm 003 Table V", "GPT-2 speedup, A", "parm-a", 3.08, run=_real_entry("GPT-2", "parm-a"),
             free="one MoE layer; B=8, L=1024, k=1, f=1.2; fp32"),
    CalEntry("CAL-06-gpt2-b", "Parm 003 Table V", "GPT-2 speedup, B32", "parm-b", 3.15, run=_real_entry("GPT-2", "parm-b"),
             free="one MoE layer; B=8, L=1024, k=1, f=1.2; fp32"),
    CalEntry("CAL-17", "SE-MoE 002 §5.3", "hierarchical vs flat all-to-all: communication speedup", "se-moe", 0.155,
             run=_cal17, free="4096 tokens x top-2 x d 4096 fp16 per GPU, uniform routing over 32 GPUs"),
]

#: CAL-01..06 and CAL-17, registered by :mod:`tritonmoe.plan.calibrate` over its placeholders.
ENTRIES = tuple(_ENTRIES)
