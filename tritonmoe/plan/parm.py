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


# ---------------------------------------------------------------------------------------------
# The schedules on the simulator: one program per rank, from the same executor code
# ---------------------------------------------------------------------------------------------


def sim_groups(layout, rank: int):
    """The :class:`~tritonmoe.parm_layout.ParmGroups` of layout rank ``rank`` with
    :class:`~tritonmoe.plan.VirtualGroup` members (None for groups of one rank)."""
    from ..parm_layout import ParmGroups
    from .sim_executor import VirtualGroup

    def vg(members):
        return VirtualGroup(tuple(layout.ranks[j] for j in members)) if len(members) > 1 else None

    mp = vg(layout.mp_group_of(rank))
    return ParmGroups(
        layout=layout, rank=rank, mp=mp, ep=vg(layout.ep_group_of(rank)), esp=vg(layout.esp_group_of(rank)),
        ep_esp=vg(tuple(range(layout.P))), mp_lane=mp,
    )


def _slice_counts(batch_counts: Sequence[int], n_mp: int, m: int) -> list[int]:
    from ..comm.parm import s2_part_counts

    return s2_part_counts(batch_counts, n_mp, m)


def parm_step_programs(
    config,
    layout,
    schedule: str,
    *,
    tokens: Sequence[int],
    batch_counts: Sequence[Sequence[int]],
    dtype: torch.dtype = torch.bfloat16,
    host_compute: bool = False,
    slice_counts: Optional[Sequence[Sequence[int]]] = None,
):
    """The forward + backward of one Parm MoE layer step, recorded for every rank of
    ``layout`` on :class:`~tritonmoe.plan.SimExecutor` (one :class:`~tritonmoe.plan.Program`
    per layout rank, global ranks ``layout.ranks``).

    The communication steps are the functions the real layer runs (:mod:`tritonmoe.comm.parm`,
    :mod:`tritonmoe.comm.saa`), in the order autograd runs them; the local work around them
    (gate, permute, Dump, combine, unpermute and their backward) is recorded as compute with
    its FLOPs and bytes.

    Args:
        schedule: "baseline", "s1" or "s2".
        tokens: tokens of each MP group's batch (``layout.num_batches`` entries).
        batch_counts: per batch, routed rows per expert (after capacity).
        slice_counts: S1 only: per layout rank, the routed rows per expert of its token slice
            (default: each expert's rows of the batch split like S2's parts, contiguous and
            even -- a uniform spread of the experts over the slices).
    """
    from ..comm.executor import VirtualTensor, Work
    from ..comm.parm import (
        ExpertShard, baseline_backward, baseline_forward, baseline_plan, pause_backward, pause_forward,
        pause_plan, run_collective, s2_part_counts, saa_plan,
    )
    from ..experts import micro_batch_bounds
    from ..parm_experts import _ffn_work
    from .sim_executor import SimExecutor, VirtualGroup

    if schedule not in ("baseline", "s1", "s2"):
        raise ValueError(f"schedule={schedule!r}; use 'baseline', 's1' or 's2'")
    c = config
    E, K, D = c.num_experts, c.top_k, c.d_model
    lay = layout
    layout.check_model(E, c.d_ffn)
    P = lay.P
    item = torch.empty((), dtype=dtype).element_size()
    world = VirtualGroup(tuple(lay.ranks))
    shard_w = c.d_ffn // lay.n_esp
    ffn_work = _ffn_work(c, shard_w, dtype)
    shard = ExpertShard(fn=None, work=ffn_work)
    need_aux = c.aux_loss_coef > 0 or c.z_loss_coef > 0

    def rows(n: int) -> VirtualTensor:
        return VirtualTensor((int(n), D), dtype)

    def copy(n: float) -> Work:
        return Work(bytes=2.0 * n * D * item, kind="copy")

    def gate(n: int, backward: bool) -> Work:
        f = 2.0 * n * D * E * (2 if backward else 1)
        return Work(flops=f, bytes=float(item * (n * D + D * E + n * E)), kind="gemm")

    # What each rank sends (the table every split derives from).
    send_table, token_table = [], []
    for i in range(P):
        g, m = lay.mp_group[i], lay.mp_rank[i]
        T = int(tokens[g])
        if schedule == "baseline":
            send_table.append([int(v) for v in batch_counts[g]])
            token_table.append(T)
        elif schedule == "s1":
            sc = slice_counts[i] if slice_counts is not None else _slice_counts(batch_counts[g], lay.n_mp, m)
            send_table.append([int(v) for v in sc])
            token_table.append(micro_batch_bounds(T, lay.n_mp)[m][1] - micro_batch_bounds(T, lay.n_mp)[m][0])
        else:
            send_table.append(s2_part_counts(batch_counts[g], lay.n_mp, m))
            token_table.append(T)

    programs = []
    for i in range(P):
        G = sim_groups(lay, i)
        g, m = lay.mp_group[i], lay.mp_rank[i]
        T = int(tokens[g])
        ex = SimExecutor(lay.ranks[i], world, host_compute=host_compute, phase="fwd")
        sizes = [b - a for a, b in micro_batch_bounds(T, lay.n_mp)]
        tm_ = sizes[m] if schedule == "s1" else T
        R_batch = sum(int(v) for v in batch_counts[g])
        counts_vt = VirtualTensor((1 + E,), torch.int64)
        # ---- forward
        ex.compute(None, work=gate(tm_, False), kind="gate", out=VirtualTensor((tm_, E), torch.float32))
        if schedule == "s1" and G.mp is not None:
            if c.capacity_factor is not None or c.aux_loss_coef > 0:
                run_collective(ex, "all_gather", VirtualTensor((K, E), torch.int64), group=G.mp, kind="mp_counts")
            if need_aux:
                run_collective(ex, "all_reduce", VirtualTensor((E + 1,), torch.float32), group=G.mp, kind="mp_scores")
        if schedule == "baseline":
            plan = baseline_plan(lay, i, token_table, send_table, E)
            run_collective(ex, "all_gather", counts_vt, group=G.ep_esp, kind="counts")
            if G.esp is not None:
                run_collective(ex, "all_gather", rows(plan.tokens_max), group=G.esp, kind="esp_allgather")
                run_collective(ex, "all_gather", VirtualTensor((plan.tokens_max, K), torch.int32), group=G.esp,
                               kind="esp_ids")
            n_rows = sum(plan.send_splits)
            ex.compute(None, work=copy(2 * n_rows), kind="permute", out=rows(n_rows))
            baseline_forward(ex, rows(n_rows), plan, None, shard, ep_group=G.ep, esp_group=G.esp)
            own = plan.own_rows[plan.own]
            ex.compute(None, work=copy(own + T), kind="unpermute", out=rows(T))
            # ---- backward
            ex.phase = "bwd"
            ex.compute(None, work=copy(own + T), kind="unpermute", out=rows(own))
            baseline_backward(ex, rows(own), plan, None, shard, ep_group=G.ep, esp_group=G.esp)
            ex.compute(None, work=copy(2 * n_rows), kind="permute", out=rows(len(plan.origins) * plan.tokens_max))
            if G.esp is not None:
                run_collective(ex, "reduce_scatter", rows(len(plan.origins) * plan.tokens_max), group=G.esp,
                               kind="esp_reduce_scatter")
            ex.compute(None, work=gate(T, True), kind="gate", out=rows(T))
        else:
            R = sum(send_table[i])
            if schedule == "s2":
                ex.compute(None, work=copy(R_batch), kind="permute", out=rows(R_batch))
            else:
                ex.compute(None, work=copy(R), kind="permute", out=rows(R))
            run_collective(ex, "all_gather", counts_vt, group=G.ep_esp, kind="counts")
            plan = pause_plan(lay, i, send_table, E)
            sp = saa_plan(lay, i, batch_counts[g], E) if schedule == "s2" and G.mp is not None else None
            ex.compute(None, work=copy(plan.send_rows), kind="dump", out=rows(plan.send_rows))
            back = pause_forward(ex, rows(plan.send_rows), plan, None, shard, group=G.ep_esp, saa=sp, rank=i,
                                 mp_group=G.mp_lane)
            n_comb = R_batch if sp is not None else R
            t_out = T if schedule == "s2" else sizes[m]
            ex.compute(None, work=copy(lay.n_esp * n_comb + t_out), kind="combine", out=rows(t_out))
            if schedule == "s1" and G.mp is not None:
                run_collective(ex, "all_gather", rows(max(sizes)), group=G.mp, kind="mp_allgather")
            # ---- backward
            ex.phase = "bwd"
            ex.compute(None, work=copy(lay.n_esp * n_comb + t_out), kind="combine", out=back)
            pause_backward(ex, back, plan, None, shard, group=G.ep_esp, saa=sp, rank=i)
            ex.compute(None, work=copy(plan.send_rows + R), kind="dump", out=rows(R))
            if sp is not None:
                run_collective(ex, "all_gather", rows(max(sp.part_rows)), group=G.mp, kind="mp_allgather_grad")
            ex.compute(None, work=copy(R_batch if schedule == "s2" else R), kind="permute", out=rows(t_out))
            ex.compute(None, work=gate(tm_, True), kind="gate", out=rows(tm_))
            if schedule == "s1" and G.mp is not None:
                run_collective(ex, "all_reduce", VirtualTensor((E, D), dtype), group=G.mp, kind="router_grad")
                run_collective(ex, "all_gather", rows(max(sizes)), group=G.mp, kind="mp_allgather_grad")
        programs.append(ex.program)
    return programs
