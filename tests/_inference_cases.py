"""Rank functions of tests/test_replicated.py (run in spawned gloo processes, see _dist.py)."""

from __future__ import annotations

import traceback

import torch

import tritonmoe as tm
from tritonmoe.inference import (
    LinaScheduler,
    Placement,
    PopularityEstimator,
    ReplicatedMoELayer,
    choices_from_layers,
    eplb_placement,
    lina_placement,
)

E, D = 8, 8


def zipf_layer(seed: int, skew: float = 1.5, *, bias: bool = False, top_k: int = 2) -> tm.MoELayer:
    """A local fp64 MoELayer whose router favours low expert ids (logit bias -skew*log(e+1)):
    Zipf-like popularity. Built from ``seed``: identical on every rank."""
    torch.manual_seed(seed)
    layer = tm.MoELayer(tm.MoEConfig(D, 6, E, top_k, router_bias=True, expert_ffn_bias=bias), dtype=torch.float64)
    with torch.no_grad():
        layer.router.bias.copy_(-skew * torch.log(torch.arange(1, E + 1, dtype=torch.float64)))
        if bias:
            layer.b1.normal_()
            layer.b2.normal_()
    return layer


def _tokens(rank: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(T, D, dtype=torch.float64, generator=g)


def _global_counts(layer, x, group=None) -> torch.Tensor:
    import torch.distributed as dist

    with torch.no_grad():
        _, r = layer.route(x)
    c = r.counts.to(torch.float64)
    dist.all_reduce(c, group=group)
    return c


def _expect_error(fn, exc, match: str) -> str:
    try:
        fn()
    except exc as e:  # noqa: PERF203
        return "ok" if match in str(e) else f"wrong message: {e}"
    except Exception as e:  # noqa: BLE001
        return f"wrong type {type(e).__name__}: {e}"
    return "no error"


def replicated_cases(rank: int, P: int) -> dict:
    """Every check of test_replicated in one group: per case, whether the replicated layer's
    output equals the local layer's bitwise, and what the test inspects."""
    out: dict = {}
    T_of = {"even": [13, 13, 13, 13], "ragged": [0, 17, 3, 9]}
    top2, top1 = zipf_layer(0, bias=True), zipf_layer(1, skew=2.0, top_k=1)
    for tok_name, Ts, layer in [(t, Ts, lay) for t, Ts in T_of.items() for lay in (top2, top1)]:
        tok_name = tok_name + ("/top1" if layer is top1 else "")
        x = _tokens(rank, Ts[rank], 1)
        with torch.no_grad():
            want = layer(x)
        load = _global_counts(layer, x)
        hand = Placement(E, ((0,), (0, 1), (0, 2, 3, 4), (0, 5, 6, 7)), ((1.0,), (2.0, 1.0), (1.0,) * 4, (1.0,) * 4))
        empty_dev = Placement(E, ((0, 1, 2, 3), (), (4, 5, 6, 7), (0,)))
        cases = {
            "contiguous": Placement.contiguous(E, P),
            "lina": lina_placement(load, P),
            "eplb": eplb_placement(load, P),
            "hand": hand,
            "empty_device": empty_dev,
        }
        for name, pl in cases.items():
            try:
                rep = ReplicatedMoELayer(layer, placement=pl)
                with torch.no_grad():
                    got = rep(x)
                out[f"{tok_name}/{name}"] = dict(
                    equal=bool(torch.equal(got, want)), shape=tuple(got.shape), rows=rep.rows_served,
                    replicas=pl.num_replicas(), max_hosted=pl.max_hosted, load=load.tolist(),
                )
            except Exception:  # noqa: BLE001
                out[f"{tok_name}/{name}"] = dict(equal=False, error=traceback.format_exc())
    # a stack of three layers under the two-phase scheduler, against the local stack
    layers = [zipf_layer(10 + i) for i in range(3)]
    est = PopularityEstimator(3, E)
    with torch.no_grad():
        for b in range(4):  # profile: record routing of local batches (the same on every rank)
            h = _tokens(0, 64, 100 + b)
            for lay in layers:
                h = h + lay(h)
            est.record(choices_from_layers(layers))
    sch = LinaScheduler(est, P)
    reps = [ReplicatedMoELayer(lay, scheduler=sch, layer_index=i) for i, lay in enumerate(layers)]
    ok = True
    for b in range(3):
        x = _tokens(rank, [11, 0, 7, 20][(rank + b) % P], 200 + b)
        with torch.no_grad():
            h_ref, h = x, x
            for lay in layers:
                h_ref = h_ref + lay(h_ref)
            for rp in reps:
                h = h + rp(h)
        ok = ok and bool(torch.equal(h, h_ref))
    out["scheduler"] = dict(equal=ok, decisions=sch.decisions, resumes=sch.resumes, replans=sch.replans,
                            unplanned=sch.unplanned, hosted=[rp.placement_used.hosted for rp in reps])
    # bad input, raised on every rank before any exchange
    layer = top2
    out["bad_devices"] = _expect_error(lambda: ReplicatedMoELayer(layer, placement=Placement.contiguous(E, 2)),
                                       ValueError, "on a group of 4")
    mine = Placement.contiguous(E, P) if rank else Placement(E, ((0, 1), (2, 3), (4, 5), (6, 7, 0)))
    out["disagree"] = _expect_error(lambda: ReplicatedMoELayer(layer, placement=mine), ValueError, "disagree")
    out["not_layer"] = _expect_error(lambda: ReplicatedMoELayer(torch.nn.Linear(2, 2)), TypeError, "MoELayer")
    return out


__all__ = ["replicated_cases", "zipf_layer"]
