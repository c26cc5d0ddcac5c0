"""Parm's automatic schedule choice: alpha-beta costs fitted by least squares and Algorithm 1
(paper 003 section V; PAPERS.md 3.4).

Each collective costs ``alpha + beta * x`` seconds for x elements (Eq. 12). Parm fits one
(alpha, beta) per collective and group from measured times at a few sizes, then compares

* ``t_D1 = 2 * A2A(y / N_MP) + AG_MP(x)`` (S1: two EP&ESP all-to-alls of the dumped slice,
  and the MP all-gather of the output, x = B*L*M elements gathered), and
* ``t_D2 = A2A(y / N_MP) + Overlap(y / N_MP)`` (S2: the dispatch all-to-all and SAA),

with ``y = k * f * B * L * M * N_ESP`` the dumped dispatch tensor of a batch (E experts times
capacity T = k*f*B*L/E rows of M, once per shard), picking S1 when ``t_D1 <= t_D2``.

Readings of the garbled text (PAPERS.md 3.4 ambiguities 1-4): T = k*f*B*L/E (not times M), the
all-to-all size keeps N_ESP, t_D2 has no separate AG term (Overlap already is the concurrent
all-to-all and all-gather), and Overlap is fitted against the same size it is evaluated at, the
all-to-all's input y/N_MP. Sizes are per-rank input elements for the all-to-alls and gathered
(output) elements for the all-gather. Dropless routing uses f = 1.

:func:`algorithm1` is the paper's selector; :func:`choose_schedule` is what ``parm_schedule=
"auto"`` calls (Algorithm 1, or, with a cost model that carries backward and local-compute fits,
the same comparison over the whole forward + backward step: PAPERS.md 3.4 ambiguity 6 allows the
gate as an optional term, and the backward mirrors the collectives, 3.2 ambiguity 5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

__all__ = [
    "AlphaBeta",
    "ParmCostModel",
    "fit_alpha_beta",
    "algorithm1",
    "step_times",
    "choose_schedule",
    "measure_cost_model",
]


@dataclass(frozen=True)
class AlphaBeta:
    """``alpha + beta * x`` seconds for x elements (alpha: startup seconds, beta: seconds per
    element)."""

    alpha: float
    beta: float

    def __call__(self, x: float) -> float:
        return self.alpha + self.beta * x


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + beta * x`` (both clamped at >= 0: a negative startup or
    per-element time is noise). One size gives alpha = 0."""
    if len(sizes) != len(times) or not sizes:
        raise ValueError(f"need matching, non-empty sizes and times, got {len(sizes)} and {len(times)}")
    x = torch.tensor([float(s) for s in sizes], dtype=torch.float64)
    t = torch.tensor([float(v) for v in times], dtype=torch.float64)
    if len(sizes) == 1 or float(x.max() - x.min()) == 0.0:
        return AlphaBeta(0.0, max(0.0, float(t.mean() / max(float(x.mean()), 1.0))))
    A = torch.stack([torch.ones_like(x), x], dim=1)
    sol = torch.linalg.lstsq(A, t.unsqueeze(1)).solution.squeeze(1)
    alpha, beta = float(sol[0]), float(sol[1])
    if beta < 0:
        return AlphaBeta(max(0.0, float(t.mean())), 0.0)
    if alpha < 0:  # refit through the origin
        return AlphaBeta(0.0, max(0.0, float((x * t).sum() / (x * x).sum())))
    return AlphaBeta(alpha, beta)


@dataclass(frozen=True)
class ParmCostModel:
    """The fitted costs Algorithm 1 needs, per (collective, group) of one layout.

    Attributes:
        ag_mp: MP all-gather, by gathered elements.
        a2a: EP&ESP all-to-all, by per-rank input elements.
        overlap: SAA (the all-to-all with the MP all-gather of its output), by per-rank input.
        local: optional per-row cost of the local work around the exchanges (routing, permute,
            Dump, combine, unpermute: seconds per token row and per routed row), the extension of
            PAPERS.md 3.4 ambiguity 6; None: communication only, as the paper.
        source: where the fits come from ("measured on ...", a calibration entry).
    """

    ag_mp: AlphaBeta
    a2a: AlphaBeta
    overlap: AlphaBeta
    local: Optional[AlphaBeta] = None
    source: str = ""


def _sizes(tokens: int, d_model: int, num_experts: int, top_k: int, capacity_factor: Optional[float], n_esp: int):
    f = 1.0 if capacity_factor is None else float(capacity_factor)
    x = float(tokens) * d_model  # B*L*M
    y = top_k * f * tokens * d_model * n_esp  # E * T * M * N_ESP with T = k*f*B*L/E
    return x, y


def algorithm1(
    model: ParmCostModel,
    *,
    tokens: int,
    d_model: int,
    num_experts: int,
    top_k: int,
    capacity_factor: Optional[float],
    n_esp: int,
    n_mp: int,
) -> str:
    """Parm's Algorithm 1 (with the readings of the module docstring): "s1" or "s2"."""
    if n_mp == 1:
        return "s1"  # no MP: S1 and S2 are the same schedule (no MP split, no all-gather)
    x, y = _sizes(tokens, d_model, num_experts, top_k, capacity_factor, n_esp)
    t_d1 = 2 * model.a2a(y / n_mp) + model.ag_mp(x)
    t_d2 = model.a2a(y / n_mp) + model.overlap(y / n_mp)
    return "s1" if t_d1 <= t_d2 else "s2"


def step_times(
    model: ParmCostModel,
    *,
    tokens: int,
    d_model: int,
    num_experts: int,
    top_k: int,
    capacity_factor: Optional[float],
    n_esp: int,
    n_mp: int,
) -> dict[str, float]:
    """Predicted forward + backward communication (and, with ``model.local``, local work) of S1
    and S2: the forward terms of Algorithm 1 plus their mirrors (S1's backward: two all-to-alls
    and the all-gather of the input gradient, x; S2's: two all-to-alls and the all-gather of the
    routed rows' gradients, y / N_ESP gathered) and the local work (S1 on T/N_MP tokens, S2 on
    all T)."""
    x, y = _sizes(tokens, d_model, num_experts, top_k, capacity_factor, n_esp)
    a = model.a2a(y / n_mp)
    if n_mp == 1:
        t = 4 * a
        return {"s1": t, "s2": t}
    s1 = 2 * a + model.ag_mp(x) + 2 * a + model.ag_mp(x)
    s2 = a + model.overlap(y / n_mp) + 2 * a + model.ag_mp(y / n_esp)
    if model.local is not None:
        f = 1.0 if capacity_factor is None else float(capacity_factor)
        rows1 = tokens / n_mp * (1 + top_k * f)
        rows2 = tokens * (1 + top_k * f)
        s1 += model.local(rows1)
        s2 += model.local(rows2)
    return {"s1": s1, "s2": s2}


def choose_schedule(model: ParmCostModel, config, layout, tokens: int, *, dtype=None) -> str:
    """The schedule ``parm_schedule="auto"`` runs for a batch of ``tokens`` tokens per MP group:
    Algorithm 1 when ``model.local`` is None, else the cheaper of :func:`step_times`."""
    kw = dict(
        tokens=tokens, d_model=config.d_model, num_experts=config.num_experts, top_k=config.top_k,
        capacity_factor=config.capacity_factor, n_esp=layout.n_esp, n_mp=layout.n_mp,
    )
    if model.local is None:
        return algorithm1(model, **kw)
    t = step_times(model, **kw)
    return "s1" if t["s1"] <= t["s2"] else "s2"


# ---------------------------------------------------------------------------------------------
# Fitting on the real groups
# ---------------------------------------------------------------------------------------------


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def measure_cost_model(
    groups,
    *,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
    d_model: int = 64,
    rows: Sequence[int] = (16, 128, 512),
    reps: int = 5,
) -> ParmCostModel:
    """Fit :class:`ParmCostModel` on this rank's groups (:class:`~tritonmoe.parm_layout.ParmGroups`)
    by timing the MP all-gather, the EP&ESP all-to-all and SAA at a few sizes (``rows`` rows of
    ``d_model`` per rank and peer). Collective over the P ranks: every rank measures, the
    medians are max-reduced over the P ranks, so every rank fits the same model (and takes the
    same decisions)."""
    import torch.distributed as dist

    from tritonmoe.comm.splits import comm_device

    from ..comm.executor import RealExecutor
    from ..comm.saa import saa_schedule

    lay = groups.layout
    P = lay.P
    dev = device if device is not None else comm_device(groups.ep_esp)
    ms = list(lay.mp_group_of(groups.rank))
    ag, a2a, ov = [], [], []
    for r in rows:
        x = torch.randn(r * P, d_model, dtype=dtype, device=dev)
        if groups.ep_esp is not None:
            a2a.append(_time(lambda: dist.all_to_all_single(torch.empty_like(x), x, group=groups.ep_esp), reps))
        else:
            a2a.append(0.0)
        if groups.mp_lane is not None and lay.n_mp > 1:
            y = torch.randn(r * P // lay.n_mp, d_model, dtype=dtype, device=dev)
            out = y.new_empty((r * P,) + tuple(y.shape[1:]))
            ag.append(_time(lambda: dist.all_gather_into_tensor(out, y, group=groups.mp_lane), reps))

            def run_saa():
                ex = RealExecutor(dev)
                ex.wait(saa_schedule(
                    ex, x, [r] * P, [r] * P, group=groups.ep_esp, rank=groups.rank, mp_group=groups.mp_lane,
                    mp_peers=ms, peer_recv_splits=[[r] * P for _ in ms],
                ))

            ov.append(_time(run_saa, reps))
        else:
            ag.append(0.0)
            ov.append(a2a[-1])
    t = torch.tensor(ag + a2a + ov, dtype=torch.float64, device=comm_device(groups.ep_esp))
    if groups.ep_esp is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.ep_esp)
    vals = t.tolist()  # host sync: the fit is a host computation
    n = len(rows)
    ag_t, a2a_t, ov_t = vals[:n], vals[n : 2 * n], vals[2 * n :]
    a2a_x = [r * P * d_model for r in rows]  # per-rank input elements
    ag_x = [r * P * d_model for r in rows]  # gathered elements
    return ParmCostModel(
        ag_mp=fit_alpha_beta(ag_x, ag_t), a2a=fit_alpha_beta(a2a_x, a2a_t), overlap=fit_alpha_beta(a2a_x, ov_t),
        source=f"measured on {lay.describe()} ({dtype}, rows {list(rows)})",
    )
