"""Per-rank bodies of tests/test_rank_input.py (spawned gloo groups, tests/_dist.py).

One group per world size runs every scenario in turn on the same process group (each scenario
ends symmetrically, so the group stays healthy for the next one):

* the collective calls of a healthy expert-parallel forward, counted by a wrapper around
  ``torch.distributed`` (the status word rides in the counts exchange: no collective added);
* one rank's bad input (dtype, shape, padding mask; two ranks at once) on the expert-parallel
  layer, on Parm (S2 and the baseline) and on the replicated inference layer: every rank must
  raise the same typed error naming the failing ranks, fast (well inside the pg timeout);
* a healthy forward after them (the group is still usable, the result unchanged);
* replicated layers that disagree at construction (different seeds, different activation):
  every rank raises a ValueError naming the differing fields and each rank's value.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import tritonmoe as tm
from tritonmoe.comm.errors import RankInputError

D, F, K, SEED = 8, 12, 2, 4321

#: torch.distributed calls that are collectives (what the counting wrapper counts)
COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "all_reduce", "broadcast", "broadcast_object_list", "barrier", "reduce_scatter_tensor",
               "reduce_scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter")


class CountCollectives:
    """Counts every call of the :data:`COLLECTIVES` of ``torch.distributed`` while active."""

    def __enter__(self):
        self.counts: dict[str, int] = {}
        self._orig = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn

            def wrapper(*a, _fn=fn, _name=name, **k):
                self.counts[_name] = self.counts.get(_name, 0) + 1
                return _fn(*a, **k)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)
        return False


def _outcome(fn) -> dict:
    """Run ``fn()``; the exception's class (and RankInputError's fields) and the seconds taken."""
    dist.barrier()
    t0 = time.monotonic()
    try:
        fn()
        return {"error": None, "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return {"error": type(e).__name__, "seconds": time.monotonic() - t0, "message": str(e),
                "failing": getattr(e, "failing_ranks", None), "bases": [b.__name__ for b in type(e).__mro__],
                "rank_input": isinstance(e, RankInputError)}


def _x(rank: int, T: int = 6, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(T, D, dtype=dtype, generator=torch.Generator().manual_seed(SEED + rank))


def _bad(victims, good, bad):
    """The input of this rank: ``bad`` on ``victims``, else ``good``."""
    return lambda rank: bad(rank) if rank in victims else good(rank)


def _ep(rank: int, P: int, out: dict) -> None:
    torch.manual_seed(SEED)
    layer = tm.MoELayer(tm.MoEConfig(D, F, 2 * P, K, pipeline_degree=2), ep_group=dist.group.WORLD,
                        dtype=torch.float64)
    x = _x(rank)
    with CountCollectives() as cc:
        y0 = layer(x)
    out["healthy_counts"] = cc.counts
    last = P - 1
    inputs = {
        "dtype": _bad({last}, _x, lambda r: _x(r, dtype=torch.float32)),
        "shape": _bad({0}, _x, lambda r: torch.randn(6, D + 1, dtype=torch.float64)),
        "two ranks": _bad({0, last}, _x, lambda r: _x(r).float() if r == 0 else _x(r)[:, :3]),
    }
    for name, make in inputs.items():
        out[f"ep {name}"] = _outcome(lambda: layer(make(rank)))
    mask = torch.ones(6, dtype=torch.int64) if rank == 1 else torch.ones(6, dtype=torch.bool)
    out["ep padding_mask"] = _outcome(lambda: layer(x, padding_mask=mask))
    out["ep after"] = torch.equal(layer(x), y0)


def _parm(rank: int, P: int, out: dict) -> None:
    from tritonmoe.parm_layout import ParmLayout

    lay = ParmLayout.make(2, P, 1)
    groups = lay.process_groups()
    for sched in ("s2", "baseline"):
        torch.manual_seed(SEED)
        layer = tm.MoELayer(tm.MoEConfig(D, F, 2 * P, K, parm_schedule=sched), parm_groups=groups,
                            dtype=torch.float64)
        x = _x(lay.mp_group[groups.rank])  # the MP group's ranks hold the same tokens
        y0 = layer(x)
        out[f"parm {sched} dtype"] = _outcome(lambda: layer(x.float() if rank == 1 else x))
        out[f"parm {sched} after"] = torch.equal(layer(x), y0)


def _replicated(rank: int, P: int, out: dict) -> None:
    from tritonmoe.inference import ReplicatedMoELayer

    torch.manual_seed(SEED)
    rep = ReplicatedMoELayer(tm.MoELayer(tm.MoEConfig(D, F, 2 * P, K), dtype=torch.float64))
    x = _x(rank)
    with torch.no_grad():
        y0 = rep(x)
        out["replicated dtype"] = _outcome(lambda: rep(x.float() if rank == P - 1 else x))
        out["replicated after"] = torch.equal(rep(x), y0)

    def build(seed: int, activation: str = "swiglu"):
        torch.manual_seed(seed)
        return lambda: ReplicatedMoELayer(tm.MoELayer(tm.MoEConfig(D, F, 2 * P, K, activation=activation),
                                                      dtype=torch.float64))

    out["replicated seeds differ"] = _outcome(build(SEED + (rank == 1)))
    out["replicated activation differs"] = _outcome(build(SEED, "relu" if rank == 1 else "gelu"))
    out["replicated same"] = _outcome(build(SEED))


def run(rank: int, P: int) -> dict:
    torch.set_default_dtype(torch.float32)
    out: dict = {}
    _ep(rank, P, out)
    _parm(rank, P, out)
    _replicated(rank, P, out)
    return out
