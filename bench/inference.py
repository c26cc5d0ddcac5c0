"""Inference: Lina's placement against EPLB and the contiguous layout, popularity estimation,
and SE-MoE's ring-memory offloading (``python -m bench inference``; standalone
``python -m bench.inference [--quick] [--json PATH]``).

Figures (each a dict with ``figure``):

* ``balance``: per batch, max/mean tokens per device for one MoE layer (E = 16 experts, top-1
  routing as in Lina's inference, Zipf popularity with max/min expected load 5.56, Lina's
  skew), on P = 16 (Lina's N = E) and P = 4 devices, over many batches of a synthetic trace
  whose layers are correlated (a token keeps its "successor" expert with probability 0.5,
  else draws from the layer's Zipf law; the marginal of every layer stays Zipf). Placements:
  ``contiguous`` (before), ``lina-phase1`` (planned from the path estimate only), ``lina``
  (two-phase: re-planned when the estimated top-2 differ from the actual), ``lina-actual``
  (planned from the actual counts: the bound of re-planning every batch), ``eplb`` (from the
  running mean of the previous batches' loads, E + P physical slots: one redundant expert per
  device), ``eplb-E-slots`` (the same with E slots: balanced packing without redundancy). Mean
  and p95 over batches, and Lina's re-plan rate.
* ``two-phase``: phase two's trigger rate (estimated top-2 != actual top-2) and the phase-one
  balance against the path length m = 0 (the marginal) .. 3 on the same trace, P = 16.
* ``latency-gloo``: p50/p95 of the layer's forward (max over ranks per batch) on P = 4 gloo
  ranks with :class:`~tritonmoe.inference.ReplicatedMoELayer` serving each placement (``lina``:
  re-planned every batch through :class:`~tritonmoe.inference.LinaScheduler` from the actual
  counts, its swap-in included; ``lina-fixed``: planned once from the expected popularity;
  ``eplb`` from the expected popularity; the router samples Zipf routing exactly: Gumbel
  features in x), and the most rows any rank computed (mean over batches). On a CPU machine
  with fewer cores than ranks the ranks' compute does not run in parallel, so balance moves
  the latency less than it would on GPUs.
* ``serving-memory``: per rank, the device bytes held by each variant's expert weights after the
  gloo run (the slot buffers' storages: the hosted experts only, replicas included) against the
  all-resident E experts (the wrapped layer's expert tensors).
* ``replan-load``: bytes :class:`~tritonmoe.inference.ReplicatedMoELayer` copies from host
  memory on a placement change (counted by wrapping its copy function: only the experts newly
  hosted on the rank) and the time of ``set_placement``, per rank, for explicit changes between
  the contiguous, Lina and EPLB placements (two rounds, median and max), and per forward of the
  ``lina`` variant (re-planned by the scheduler every batch: loads, bytes and seconds per
  forward, against its forward's p50).
* ``latency-sim``: the same placements' forward time in the simulator
  (:func:`tritonmoe.sim.simulate`, Lina's testbed preset ``lina_cluster()``, 16 GPUs, fp16,
  BERT-Large-like widths): a placement becomes an expert-parallel layer of P*M "physical
  experts" (M the most experts a device hosts) with the rows each rank sends to each replica.
* ``estimation``: mean L1 error (normalized loads) of the conditional estimate (path length 3)
  and of the unconditional frequency, per batch and layer >= 1, and the top-2 accuracy, on
  routing recorded from two stacks of :class:`~tritonmoe.MoELayer`\\ s: ``correlated`` (each
  router a row permutation of the previous one, small expert outputs: a token's choice in
  layer l+1 follows from its choice in layer l) and ``uncorrelated`` (independent routers).
* ``offload``: forward time of a stack of N = 8 layers, all resident vs
  :class:`~tritonmoe.inference.OffloadedExperts` with K = 2 slots from host memory and from a
  file on disk through a two-layer host cache (every layer is re-read: the worst case), the
  fraction of copy time hidden behind compute (worker thread on CPU) and the disk reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from typing import Optional

import torch

__all__ = ["run_inference", "DEFAULTS", "zipf_exponent"]

DEFAULTS = dict(
    experts=16, skew=5.56, batches=200, tokens=512, corr=0.5, layers=4,
    gloo_world=4, gloo_tokens=512, gloo_d=256, gloo_f=1024, gloo_batches=30,
    sim_world=16, sim_tokens=2048, sim_d=1024, sim_f=4096, sim_batches=40,
    est_layers=4, est_experts=8, est_d=32, est_profile=64, est_batches=50, est_tokens=32,
    off_layers=8, off_slots=2, off_d=256, off_f=512, off_experts=8, off_tokens=256, off_reps=8,
)
QUICK = dict(batches=40, gloo_batches=8, gloo_tokens=128, gloo_d=128, gloo_f=512, sim_batches=8, est_profile=16, est_batches=10, off_reps=3,
             off_layers=4, off_d=128)


def zipf_exponent(num_experts: int, max_over_min: float) -> float:
    """s with p_e proportional to (e+1)^-s and p_0 / p_{E-1} = ``max_over_min``."""
    return math.log(max_over_min) / math.log(num_experts)


def _zipf(E: int, s: float) -> torch.Tensor:
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    return p / p.sum()


def _pctl(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _summary(xs: list[float]) -> dict:
    return dict(mean=statistics.fmean(xs), p50=_pctl(xs, 0.5), p95=_pctl(xs, 0.95), n=len(xs))


def zipf_trace(T: int, L: int, E: int, s: float, corr: float, g: torch.Generator) -> torch.Tensor:
    """int64 [T, L] top-1 choices: layer l's marginal is Zipf(s) over a per-layer permutation of
    the experts; with probability ``corr`` a token keeps the expert of the same popularity rank
    as its previous choice (else draws afresh), which preserves the marginal."""
    p = _zipf(E, s)
    perms = [torch.randperm(E, generator=torch.Generator().manual_seed(7 + l)) for l in range(L)]
    rank = torch.multinomial(p, T, replacement=True, generator=g)
    out = torch.empty(T, L, dtype=torch.int64)
    out[:, 0] = perms[0][rank]
    for l in range(1, L):
        fresh = torch.multinomial(p, T, replacement=True, generator=g)
        keep = torch.rand(T, generator=g) < corr
        rank = torch.where(keep, rank, fresh)
        out[:, l] = perms[l][rank]
    return out


# ---------------------------------------------------------------------------------------------
# balance
# ---------------------------------------------------------------------------------------------


def run_balance(spec: dict) -> list[dict]:
    from tritonmoe.inference import (PopularityEstimator, Placement, eplb_placement, lina_placement, top_k_match)

    E, L, T = spec["experts"], spec["layers"], spec["tokens"]
    s = zipf_exponent(E, spec["skew"])
    g = torch.Generator().manual_seed(0)
    est = PopularityEstimator(L, E, path_length=3, k_est=2)
    est.record(zipf_trace(20 * T, L, E, s, spec["corr"], g))  # profiling
    out = []
    l = L - 1  # the layer with a full path of 3
    for P in (16, 4):
        ratios: dict[str, list[float]] = {k: [] for k in ("contiguous", "lina-phase1", "lina", "lina-actual", "eplb",
                                                           "eplb-E-slots")}
        replans, history = 0, torch.zeros(E, dtype=torch.float64)
        t_plan = []
        for b in range(spec["batches"]):
            tr = zipf_trace(T, L, E, s, spec["corr"], g)
            actual = torch.bincount(tr[:, l], minlength=E).to(torch.float64)
            t0 = time.perf_counter()
            guess = est.estimate(l, tr[:, :l])
            phase1 = lina_placement(guess, P)
            t_plan.append(time.perf_counter() - t0)
            final = phase1
            if not top_k_match(guess, actual, 2):
                replans += 1
                final = lina_placement(actual, P)
            ratios["contiguous"].append(Placement.contiguous(E, P).imbalance(actual))
            ratios["lina-phase1"].append(phase1.imbalance(actual))
            ratios["lina"].append(final.imbalance(actual))
            ratios["lina-actual"].append(lina_placement(actual, P).imbalance(actual))
            if b > 0:
                ratios["eplb"].append(eplb_placement(history / b, P).imbalance(actual))
                ratios["eplb-E-slots"].append(eplb_placement(history / b, P, num_replicas=E).imbalance(actual))
            history += actual
        for name, xs in ratios.items():
            out.append(dict(figure="balance", world_size=P, experts=E, placement=name, tokens=T, zipf_s=s,
                            max_over_mean=_summary(xs),
                            replan_rate=replans / spec["batches"] if name == "lina" else None,
                            plan_s_median=statistics.median(t_plan) if name.startswith("lina") else None))
    # phase two's trigger rate against the path length (the paper's Table 5 trend), P = 16
    profile = zipf_trace(20 * T, L, E, s, spec["corr"], torch.Generator().manual_seed(5))
    for m in range(0, l + 1):
        e_m = PopularityEstimator(L, E, path_length=m, k_est=2)
        e_m.record(profile)
        g_m = torch.Generator().manual_seed(6)
        miss, ratios1 = 0, []
        for _ in range(spec["batches"]):
            tr = zipf_trace(T, L, E, s, spec["corr"], g_m)
            actual = torch.bincount(tr[:, l], minlength=E).to(torch.float64)
            guess = e_m.estimate(l, tr[:, :l])
            miss += not top_k_match(guess, actual, 2)
            ratios1.append(lina_placement(guess, 16).imbalance(actual))
        out.append(dict(figure="two-phase", world_size=16, experts=E, path_length=m, tokens=T,
                        replan_rate=miss / spec["batches"], phase1_max_over_mean=statistics.fmean(ratios1)))
    return out


# ---------------------------------------------------------------------------------------------
# latency on gloo
# ---------------------------------------------------------------------------------------------


def _gumbel_layer(E: int, d: int, f: int, s: float):
    """A top-1 fp32 MoELayer whose router samples Zipf(s) routing exactly: logits = x[:, :E] +
    log p, and x[:, :E] holds Gumbel noise (the Gumbel-max trick)."""
    import tritonmoe as tm

    torch.manual_seed(0)
    layer = tm.MoELayer(tm.MoEConfig(d, f, E, 1, activation="gelu", router_bias=True))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :E] = torch.eye(E)
        layer.router.bias.copy_(torch.log(_zipf(E, s)).float())
    return layer


def _gumbel_tokens(T: int, E: int, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(T, d, generator=g) * 0.1
    u = torch.rand(T, E, generator=g).clamp_(1e-12, 1 - 1e-7)
    x[:, :E] = -torch.log(-torch.log(u))
    return x


def _measure_gloo(rank: int, P: int, spec: dict, device, progress) -> dict:
    import torch.distributed as dist

    from tritonmoe.inference import (LinaScheduler, Placement, PopularityEstimator, ReplicatedMoELayer, eplb_placement,
                                     lina_placement)

    E, d, f, T = spec["experts"], spec["gloo_d"], spec["gloo_f"], spec["gloo_tokens"]
    s = zipf_exponent(E, spec["skew"])
    layer = _gumbel_layer(E, d, f, s)
    expected = _zipf(E, s) * T * P
    variants = {
        "contiguous": ReplicatedMoELayer(layer, placement=Placement.contiguous(E, P)),
        "eplb": ReplicatedMoELayer(layer, placement=eplb_placement(expected, P)),
        "lina": ReplicatedMoELayer(layer, scheduler=LinaScheduler(PopularityEstimator(1, E), P), layer_index=0),
        "lina-fixed": ReplicatedMoELayer(layer, placement=lina_placement(expected, P)),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    rows: dict[str, list[float]] = {k: [] for k in variants}
    base = (variants["lina"].loads, variants["lina"].load_bytes, variants["lina"].load_s)  # the construction's load
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for b in range(spec["gloo_batches"] + 2):
            x = _gumbel_tokens(T, E, d, g)
            for name, rep in variants.items():  # round-robin: the same load on the machine for each
                dist.barrier()
                t0 = time.perf_counter()
                rep(x)
                dt = torch.tensor([time.perf_counter() - t0, float(rep.rows_served)], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if b >= 2:  # warm-up
                    times[name].append(float(dt[0]))
                    rows[name].append(float(dt[1]))
            progress()
    # device memory held by experts, measured from the slot buffers' storages, against all E
    from tritonmoe.inference.replicated import EXPERT_TENSORS

    all_resident = _storage_bytes([getattr(layer, n) for n in EXPERT_TENSORS if getattr(layer, n) is not None])
    held = {name: _storage_bytes(rep.expert_weights.values()) for name, rep in variants.items()}
    sch_rep = variants["lina"]
    sched = dict(loads=sch_rep.loads - base[0], load_bytes=sch_rep.load_bytes - base[1], load_s=sch_rep.load_s - base[2],
                 forwards=spec["gloo_batches"] + 2)
    # explicit placement changes: bytes copied from host memory (counted by wrapping the copy)
    # and the time of set_placement (its copies waited for on CUDA)
    seq = {"contiguous": Placement.contiguous(E, P), "lina": lina_placement(expected, P),
           "eplb": eplb_placement(expected, P)}
    rep = ReplicatedMoELayer(layer, placement=seq["contiguous"])
    changes = []
    with _CountCopies() as cc:
        for a, b in [("contiguous", "lina"), ("lina", "eplb"), ("eplb", "contiguous"), ("contiguous", "eplb"),
                     ("eplb", "lina"), ("lina", "contiguous")] * 2:
            rep.set_placement(seq[a], check=False)  # the same seq on every rank: time the loads alone
            _sync(device)
            cc.bytes = 0
            t0 = time.perf_counter()
            rep.set_placement(seq[b], check=False)
            _sync(device)
            changes.append(dict(frm=a, to=b, bytes=cc.bytes, seconds=time.perf_counter() - t0))
    return dict(times=times, max_rows=rows, held=held, all_resident=all_resident, sched=sched, changes=changes,
                expert_bytes=rep.expert_bytes)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (measured from the tensors)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class _CountCopies:
    """Count the bytes ReplicatedMoELayer copies from host memory (wraps its copy function)."""

    def __enter__(self):
        import tritonmoe.inference.replicated as R

        self.R, self.orig, self.bytes = R, R._copy_expert, 0

        def counting(dst, src, non_blocking):
            self.bytes += sum(t.numel() * t.element_size() for t in src)
            self.orig(dst, src, non_blocking)

        R._copy_expert = counting
        return self

    def __exit__(self, *a):
        self.R._copy_expert = self.orig


def run_gloo_latency(spec: dict, timeout_s: float = 300.0) -> list[dict]:
    from .ep import _run_spawned

    P = spec["gloo_world"]
    per_rank = _run_spawned(P, spec, timeout_s, measure=_measure_gloo, what="bench.inference")
    r0 = per_rank[0]
    base = statistics.median(r0["times"]["contiguous"])
    base95 = _pctl(r0["times"]["contiguous"], 0.95)
    out = []
    for name, ts in r0["times"].items():
        out.append(dict(figure="latency-gloo", world_size=P, placement=name, tokens_per_rank=spec["gloo_tokens"],
                        d_model=spec["gloo_d"], d_ffn=spec["gloo_f"], experts=spec["experts"], times_s=ts,
                        p50_s=statistics.median(ts), p95_s=_pctl(ts, 0.95),
                        p50_speedup_vs_contiguous=base / statistics.median(ts),
                        p95_speedup_vs_contiguous=base95 / _pctl(ts, 0.95),
                        max_rows_per_rank_mean=statistics.fmean(r0["max_rows"][name])))
    for name in r0["held"]:
        held = [r["held"][name] for r in per_rank]
        out.append(dict(figure="serving-memory", world_size=P, placement=name, experts=spec["experts"],
                        expert_bytes=r0["expert_bytes"], device_expert_bytes_per_rank=held,
                        all_resident_bytes=r0["all_resident"], max_fraction_of_all=max(held) / r0["all_resident"]))
    fw = r0["sched"]["forwards"]
    out.append(dict(figure="replan-load", world_size=P, change="lina scheduler, per forward",
                    loads_per_forward=[r["sched"]["loads"] / fw for r in per_rank],
                    bytes_per_forward=[r["sched"]["load_bytes"] / fw for r in per_rank],
                    seconds_per_forward=[r["sched"]["load_s"] / fw for r in per_rank],
                    forward_p50_s=statistics.median(r0["times"]["lina"])))
    pairs = {}
    for r in per_rank:
        for c in r["changes"]:
            pairs.setdefault((c["frm"], c["to"]), []).append(c)
    for (a, b), cs in pairs.items():
        out.append(dict(figure="replan-load", world_size=P, change=f"{a} -> {b}",
                        bytes_per_rank=_per_rank(cs, "bytes", P),
                        max_bytes=max(c["bytes"] for c in cs), all_resident_bytes=r0["all_resident"],
                        seconds_median=statistics.median(c["seconds"] for c in cs),
                        seconds_max=max(c["seconds"] for c in cs)))
    return out


def _per_rank(cs: list, key: str, P: int) -> list:
    """``cs``: the changes of one pair, rank-major (each rank's repetitions in a row): the first
    repetition's value per rank."""
    reps = len(cs) // P
    return [cs[r * reps][key] for r in range(P)]


# ---------------------------------------------------------------------------------------------
# latency in the simulator
# ---------------------------------------------------------------------------------------------


def _sim_counts(pl, per_rank_counts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int64 [P, 1, P*M]: the rows source s sends to device d's j-th hosted expert."""
    P, M = pl.num_devices, pl.max_hosted
    out = torch.zeros(P, 1, P * M, dtype=torch.int64)
    for src in range(P):
        sc = pl.send_counts(per_rank_counts[src].tolist(), src)
        for d, row in enumerate(sc):
            for j, n in enumerate(row):
                out[src, 0, d * M + j] = n
    return out, M


def run_sim_latency(spec: dict) -> list[dict]:
    import tritonmoe as tm
    from tritonmoe.inference import Placement, eplb_placement, lina_placement
    from tritonmoe.sim.simulate import simulate
    from tritonmoe.plan.lina import lina_cluster

    E, P, T = spec["experts"], spec["sim_world"], spec["sim_tokens"]
    s = zipf_exponent(E, spec["skew"])
    p = _zipf(E, s)
    cluster = lina_cluster()
    g = torch.Generator().manual_seed(1)
    eplb = eplb_placement(p * T * P, P)
    times: dict[str, list[float]] = {"contiguous": [], "lina": [], "eplb": []}
    for _ in range(spec["sim_batches"]):
        counts = torch.stack([torch.bincount(torch.multinomial(p, T, replacement=True, generator=g), minlength=E)
                              for _ in range(P)])
        actual = counts.sum(0).to(torch.float64)
        for name, pl in (("contiguous", Placement.contiguous(E, P)), ("lina", lina_placement(actual, P)), ("eplb", eplb)):
            c, M = _sim_counts(pl, counts)
            cfg = tm.MoEConfig(spec["sim_d"], spec["sim_f"], P * M, 1, activation="gelu")
            tl = simulate(cfg, T, cluster, world_size=P, routing=c, pipeline_degree=1, dtype="float16", mode="full")
            times[name].append(tl.step_time("fwd"))
    base, base95 = statistics.median(times["contiguous"]), _pctl(times["contiguous"], 0.95)
    return [dict(figure="latency-sim", cluster=cluster.name, world_size=P, placement=name, tokens_per_rank=T,
                 d_model=spec["sim_d"], d_ffn=spec["sim_f"], experts=E, p50_s=statistics.median(ts), p95_s=_pctl(ts, 0.95),
                 p50_speedup_vs_contiguous=base / statistics.median(ts), p95_speedup_vs_contiguous=base95 / _pctl(ts, 0.95))
            for name, ts in times.items()]


# ---------------------------------------------------------------------------------------------
# estimation on recorded routing
# ---------------------------------------------------------------------------------------------


def _stack(correlated: bool, L: int, E: int, d: int):
    import tritonmoe as tm

    torch.manual_seed(3)
    layers = [tm.MoELayer(tm.MoEConfig(d, 16, E, 2, router_bias=True), dtype=torch.float64) for _ in range(L)]
    bias = torch.log(_zipf(E, 1.0))
    with torch.no_grad():
        for i, lay in enumerate(layers):
            if correlated:
                if i > 0:  # a row permutation of the previous router: choice l+1 follows from choice l
                    perm = torch.randperm(E, generator=torch.Generator().manual_seed(50 + i))
                    lay.router.weight.copy_(layers[i - 1].router.weight[perm])
                    lay.router.bias.copy_(layers[i - 1].router.bias[perm])
                else:
                    lay.router.bias.copy_(bias)
                lay.w2.mul_(0.01)  # small expert outputs: the hidden state barely moves
            else:
                lay.router.bias.copy_(bias[torch.randperm(E, generator=torch.Generator().manual_seed(90 + i))])
    return layers


def run_estimation(spec: dict) -> list[dict]:
    from tritonmoe.inference import PopularityEstimator, choices_from_layers, l1_error, top_k_match

    L, E, d = spec["est_layers"], spec["est_experts"], spec["est_d"]
    out = []
    for kind in ("correlated", "uncorrelated"):
        layers = _stack(kind == "correlated", L, E, d)
        g = torch.Generator().manual_seed(11)

        def record(T: int) -> torch.Tensor:
            h = torch.randn(T, d, dtype=torch.float64, generator=g)
            with torch.no_grad():
                for lay in layers:
                    h = h + lay(h)
            return choices_from_layers(layers)

        est = PopularityEstimator(L, E, path_length=3, k_est=None)
        top2 = PopularityEstimator(L, E, path_length=3, k_est=2)
        for _ in range(spec["est_profile"]):
            c = record(64)
            est.record(c)
            top2.record(c)
        err_c, err_u, acc_c, acc_u = [], [], [], []
        for _ in range(spec["est_batches"]):
            c = record(spec["est_tokens"])
            for l in range(1, L):
                actual = torch.bincount(c[:, l], minlength=E)
                cond, unc = est.estimate(l, c[:, :l]), est.unconditional(l)
                err_c.append(l1_error(cond, actual))
                err_u.append(l1_error(unc, actual))
                acc_c.append(top_k_match(top2.estimate(l, c[:, :l]), actual, 2))
                acc_u.append(top_k_match(unc, actual, 2))
        out.append(dict(figure="estimation", stack=kind, layers=L, experts=E, path_length=3,
                        l1_conditional=statistics.fmean(err_c), l1_unconditional=statistics.fmean(err_u),
                        top2_accuracy_conditional=statistics.fmean(acc_c),
                        top2_accuracy_unconditional=statistics.fmean(acc_u),
                        batches=spec["est_batches"], tokens=spec["est_tokens"]))
    return out


# ---------------------------------------------------------------------------------------------
# offloading
# ---------------------------------------------------------------------------------------------


def run_offload(spec: dict) -> list[dict]:
    import tritonmoe as tm
    from tritonmoe.inference import OffloadedExperts

    N, K, d, f, E, T = (spec[k] for k in ("off_layers", "off_slots", "off_d", "off_f", "off_experts", "off_tokens"))
    torch.manual_seed(0)

    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleList([tm.MoELayer(tm.MoEConfig(d, f, E, 2)) for _ in range(N)])

    x = torch.randn(T, d)

    def forward(m):
        h = x
        for lay in m:
            h = h + lay(h)
        return h

    out = []
    resident = model()
    with torch.no_grad():
        want = forward(resident)
    with tempfile.TemporaryDirectory() as tmp:
        models = {"resident": resident, "host": model(), "disk": model()}
        stacks = {"host": OffloadedExperts(list(models["host"]), slots=K),
                  "disk": OffloadedExperts(list(models["disk"]), slots=K, disk_path=os.path.join(tmp, "experts.bin"))}
        try:
            times: dict[str, list[float]] = {k: [] for k in models}
            with torch.no_grad():
                for rep in range(spec["off_reps"] + 1):
                    for tier, m in models.items():  # round-robin: the same machine load for each tier
                        t0 = time.perf_counter()
                        forward(m)
                        if rep:  # the first pass is the warm-up (and the first ring pass)
                            times[tier].append(time.perf_counter() - t0)
                same = {tier: bool(torch.equal(forward(models[tier]), want)) for tier in stacks}
            ref = statistics.median(times["resident"])
            out.append(dict(figure="offload", tier="resident", layers=N, slots=None, forward_s=ref,
                            times_s=times["resident"]))
            for tier, stack in stacks.items():
                med = statistics.median(times[tier])
                row = dict(figure="offload", tier=tier, layers=N, slots=K, forward_s=med, times_s=times[tier],
                           slowdown_vs_resident=med / ref, overlap_fraction=stack.overlap_fraction(),
                           waits=sum(stack.waits), calls=len(stack.waits), resident_expert_bytes=stack.resident_bytes(),
                           all_layers_bytes=N * stack.slot_bytes, equal_to_resident=same[tier])
                if stack.cache is not None:
                    row.update(cache_bytes=stack.cache.capacity * stack.expert_bytes, disk_reads=stack.cache.fills,
                               cache_hits=stack.cache.requests - stack.cache.misses)
                out.append(row)
        finally:
            for stack in stacks.values():
                stack.close()
    return out


# ---------------------------------------------------------------------------------------------


def run_inference(*, quick: bool = False, parts=("balance", "estimation", "offload", "sim", "gloo"),
                  timeout_s: float = 300.0, **overrides) -> list[dict]:
    spec = dict(DEFAULTS)
    if quick:
        spec.update(QUICK)
    spec.update(overrides)
    out: list[dict] = []
    runners = dict(balance=run_balance, estimation=run_estimation, offload=run_offload, sim=run_sim_latency,
                   gloo=lambda sp: run_gloo_latency(sp, timeout_s))
    for part in parts:
        t0 = time.perf_counter()
        try:
            rows = runners[part](spec)
        except Exception as exc:  # one failed part does not lose the others
            rows = [dict(figure=part, error=f"{type(exc).__name__}: {exc}")]
        for r in rows:
            r["part_s"] = time.perf_counter() - t0
        out += rows
    return out


def _fmt(r: dict) -> str:
    f = r["figure"]
    if "error" in r:
        return f"{f}: ERROR {r['error']}"
    if f == "balance":
        m = r["max_over_mean"]
        extra = f" replan {r['replan_rate']:.0%}" if r.get("replan_rate") is not None else ""
        return f"balance P={r['world_size']:<2} {r['placement']:<12} max/mean mean {m['mean']:.3f} p95 {m['p95']:.3f}{extra}"
    if f == "two-phase":
        return (f"two-phase P=16 path length {r['path_length']}: re-plan rate {r['replan_rate']:.0%}, phase-one "
                f"max/mean {r['phase1_max_over_mean']:.3f}")
    if f.startswith("latency"):
        return (f"{f} P={r['world_size']} {r['placement']:<10} p50 {r['p50_s'] * 1e3:.3f} ms p95 {r['p95_s'] * 1e3:.3f} ms "
                f"(x{r['p50_speedup_vs_contiguous']:.2f} / x{r['p95_speedup_vs_contiguous']:.2f} vs contiguous)")
    if f == "serving-memory":
        kb = [b / 1e3 for b in r["device_expert_bytes_per_rank"]]
        return (f"serving-memory P={r['world_size']} {r['placement']:<10} device expert KB per rank "
                f"{' / '.join(f'{x:.0f}' for x in kb)} (all-resident {r['all_resident_bytes'] / 1e3:.0f} KB; "
                f"max {r['max_fraction_of_all']:.0%})")
    if f == "replan-load":
        if "bytes_per_forward" in r:
            return (f"replan-load P={r['world_size']} {r['change']}: loads {max(r['loads_per_forward']):.2f}, "
                    f"max KB {max(r['bytes_per_forward']) / 1e3:.0f}, max ms {max(r['seconds_per_forward']) * 1e3:.2f} "
                    f"(forward p50 {r['forward_p50_s'] * 1e3:.1f} ms)")
        return (f"replan-load P={r['world_size']} {r['change']:<22} KB per rank "
                f"{' / '.join(f'{b / 1e3:.0f}' for b in r['bytes_per_rank'])} of {r['all_resident_bytes'] / 1e3:.0f}; "
                f"median {r['seconds_median'] * 1e3:.2f} ms, max {r['seconds_max'] * 1e3:.2f} ms")
    if f == "estimation":
        return (f"estimation {r['stack']:<12} L1 conditional {r['l1_conditional']:.3f} unconditional "
                f"{r['l1_unconditional']:.3f}; top-2 accuracy {r['top2_accuracy_conditional']:.0%} vs "
                f"{r['top2_accuracy_unconditional']:.0%}")
    if f == "offload":
        s = f"offload {r['tier']:<8} forward {r['forward_s'] * 1e3:.2f} ms"
        if r["tier"] != "resident":
            s += (f" (x{r['slowdown_vs_resident']:.2f} vs resident), hidden {r['overlap_fraction']:.0%}, "
                  f"expert bytes {r['resident_expert_bytes']} of {r['all_layers_bytes']}, equal {r['equal_to_resident']}")
            if "disk_reads" in r:
                s += f", disk reads {r['disk_reads']}"
        return s
    return json.dumps(r)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches and smaller shapes")
    ap.add_argument("--parts", default="balance,estimation,offload,sim,gloo")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    rows = run_inference(quick=args.quick, parts=tuple(args.parts.split(",")))
    for r in rows:
        print(_fmt(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
