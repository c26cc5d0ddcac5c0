"""Per-rank bodies of tests/test_plan_runtime.py (spawned gloo groups, see tests/_dist.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tritonmoe as tm

D, F, E = 8, 12, 6


def _pair(cfg_kw: dict, seed: int):
    """An expert-parallel layer with a run-time degree policy and an n = 1 twin, same weights."""
    torch.manual_seed(seed)
    ep = tm.MoELayer(tm.MoEConfig(D, F, E, 2, **cfg_kw), ep_group=dist.group.WORLD, dtype=torch.float64)
    torch.manual_seed(seed)
    ref = tm.MoELayer(tm.MoEConfig(D, F, E, 2), ep_group=dist.group.WORLD, dtype=torch.float64)
    return ep, ref


def _step(layer, x, dy):
    x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(dy)
    return out.detach(), x.grad, layer.w1.grad.clone(), layer.router.weight.grad.clone()


def agreement(rank: int, P: int, cost_path: str) -> dict:
    """A cost-model file missing on one rank fails on every rank (none hangs); then 'auto' and
    'search' with different token counts per rank: every rank runs the same degree each step,
    and the result equals the unpipelined layer bitwise (fp64)."""
    out = {"missing": missing_on_one_rank(rank, P, cost_path), "profile": tiny_profile(rank, P),
           "in_place": in_place_timing(rank, P)}
    gen = torch.Generator().manual_seed(100 + rank)
    # per step, this rank's token count (ranks differ; one rank sometimes has none)
    schedule = [(40, 3, 64), (40, 3, 64), (200, 17, 0), (40, 3, 64), (200, 17, 0), (5, 90, 33)] * 2
    for mode, kw in (("auto", dict(pipeline_degree="auto", cost_model=cost_path)), ("search", dict(pipeline_degree="search"))):
        ep, ref = _pair(kw, seed=7)
        degrees, equal = [], True
        for toks in schedule:
            T = toks[rank]
            x = torch.randn(T, D, generator=gen, dtype=torch.float64)
            dy = torch.randn(T, D, generator=gen, dtype=torch.float64)
            for lay in (ep, ref):
                lay.zero_grad(set_to_none=True)
            a, b = _step(ep, x, dy), _step(ref, x, dy)
            equal = equal and all(torch.equal(u, v) for u, v in zip(a, b))
            degrees.append(ep.expert_path.degree_used)
        pol = ep.expert_path.degree_policy
        out[mode] = dict(
            degrees=degrees,
            equal=equal,
            decided=dict(pol.cache) if mode == "auto" else dict(pol.search.C),
            profiled=getattr(pol, "steps_profiled", None),
        )
    return out


def tiny_profile(rank: int, P: int) -> dict | None:
    """``tritonmoe.plan.profile`` end to end at toy sizes (the CLI's path): the fitted model's
    JSON on rank 0."""
    from tritonmoe.plan.profile import ProfileSpec, profile

    spec = ProfileSpec(sizes=(1024, 16384, 262144), kinds=("all_to_all", "all_reduce"), reps=1, warmup=0,
                       shapes=((16, 16, 6, 2),), tokens=(8, 64), dtype=torch.float32, log=False)
    model = profile(spec)
    return model.to_json() if model is not None else None


def in_place_timing(rank: int, P: int, skew_s: float = 0.06) -> dict:
    """The profile's collective timing (``_time_group``) on a 1 KiB all-to-all: isolated (after
    a barrier), in place after a phase in which only the last rank computes for ``skew_s`` (the
    others wait for it inside the collective), and in place after a phase every rank runs
    alike (nothing to wait for)."""
    import time

    from tritonmoe.plan.profile import _collective

    fn = _collective("all_to_all", 1024, dist.group.WORLD, P, torch.device("cpu"))

    def last_rank_late():
        if rank == P - 1:
            time.sleep(skew_s)

    def all_alike():
        time.sleep(skew_s)

    from tritonmoe.plan.profile import _time_group

    grp = dist.group.WORLD
    return dict(
        isolated=_time_group(fn, grp, torch.device("cpu"), 3, 1),
        skewed=_time_group(fn, grp, torch.device("cpu"), 3, 1, phase=last_rank_late),
        alike=_time_group(fn, grp, torch.device("cpu"), 3, 1, phase=all_alike),
    )


def missing_on_one_rank(rank: int, P: int, cost_path: str) -> str:
    """A cost-model file that exists on some ranks only: every rank raises (none hangs)."""
    path = cost_path if rank != 1 else cost_path + ".missing"
    try:
        tm.MoELayer(tm.MoEConfig(D, F, E, 2, pipeline_degree="auto", cost_model=path), ep_group=dist.group.WORLD)
    except (ValueError, FileNotFoundError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
