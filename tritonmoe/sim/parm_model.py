"""Parm's schedules on the simulator: one program per rank from the executor code that runs them
(:mod:`tritonmoe.comm.programs.model_parallel`), the step time of each schedule on a cluster or
cost model, and the offline choice among them (paper 003; PAPERS.md 3.1-3.4).

The run-time choice (:func:`tritonmoe.policy.parm_schedule.choose_schedule`, Parm's Algorithm 1
over a measured alpha-beta model) lives in :mod:`tritonmoe.policy.parm_schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tritonmoe.comm.executor import VirtualTensor, Work
from tritonmoe.comm.programs.hierarchical import hierarchical_plan, hierarchical_schedule
from tritonmoe.comm.programs.model_parallel import (
    ExpertShard,
    baseline_backward,
    baseline_forward,
    baseline_plan,
    ffn_shard_work,
    pause_backward,
    pause_forward,
    pause_plan,
    run_collective,
    s2_part_counts,
    saa_plan,
)
from tritonmoe.comm.programs.pipeline import micro_batch_bounds
from tritonmoe.parm_layout import ParmGroups

from . import engine
from .executor import SimExecutor, VirtualGroup
from .simulate import parse_dtype, resolve_cost

# ---------------------------------------------------------------------------------------------
# The schedules on the simulator: one program per rank, from the same executor code
# ---------------------------------------------------------------------------------------------


def sim_groups(layout, rank: int):
    """The :class:`~tritonmoe.parm_layout.ParmGroups` of layout rank ``rank`` with
    :class:`~tritonmoe.plan.VirtualGroup` members (None for groups of one rank)."""

    def vg(members):
        return VirtualGroup(tuple(layout.ranks[j] for j in members)) if len(members) > 1 else None

    mp = vg(layout.mp_group_of(rank))
    return ParmGroups(
        layout=layout, rank=rank, mp=mp, ep=vg(layout.ep_group_of(rank)), esp=vg(layout.esp_group_of(rank)),
        ep_esp=vg(tuple(range(layout.P))), mp_lane=mp,
    )


def _slice_counts(batch_counts: Sequence[int], n_mp: int, m: int) -> list[int]:

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
    ranks: Optional[Sequence[int]] = None,
):
    """The forward + backward of one Parm MoE layer step, recorded for every rank of
    ``layout`` (or the layout ranks in ``ranks``) on :class:`~tritonmoe.plan.SimExecutor` (one :class:`~tritonmoe.plan.Program`
    per layout rank, global ranks ``layout.ranks``).

    The communication steps are the functions the real layer runs (:mod:`tritonmoe.comm.programs.model_parallel`,
    :mod:`tritonmoe.comm.programs.saa`), in the order autograd runs them; the local work around them
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

    if schedule not in ("baseline", "s1", "s2"):
        raise ValueError(f"schedule={schedule!r}; use 'baseline', 's1' or 's2'")
    c = config
    E, K, D = c.num_experts, c.top_k, c.d_model
    lay = layout
    layout.check_model(E, c.d_ffn)
    P = lay.P
    world = VirtualGroup(tuple(lay.ranks))
    local = _LocalWork(E, D, dtype, torch.empty((), dtype=dtype).element_size())
    shard = ExpertShard(fn=None, work=ffn_shard_work(c, c.d_ffn // lay.n_esp, dtype))
    need_aux = c.aux_loss_coef > 0 or c.z_loss_coef > 0
    send_table, token_table = _send_tables(lay, schedule, tokens, batch_counts, slice_counts)

    programs = []
    for i in (range(P) if ranks is None else ranks):
        G = sim_groups(lay, i)
        g, m = lay.mp_group[i], lay.mp_rank[i]
        T = int(tokens[g])
        ex = SimExecutor(lay.ranks[i], world, host_compute=host_compute, phase="fwd")
        sizes = [b - a for a, b in micro_batch_bounds(T, lay.n_mp)]
        tm_ = sizes[m] if schedule == "s1" else T
        # ---- forward
        ex.compute(None, work=local.gate(tm_, False), kind="gate", out=VirtualTensor((tm_, E), torch.float32))
        if schedule == "s1" and G.mp is not None:
            if c.capacity_factor is not None or c.aux_loss_coef > 0:
                run_collective(ex, "all_gather", VirtualTensor((K, E), torch.int64), group=G.mp, kind="mp_counts")
            if need_aux:
                run_collective(ex, "all_reduce", VirtualTensor((E + 1,), torch.float32), group=G.mp, kind="mp_scores")
        if schedule == "baseline":
            plan = baseline_plan(lay, i, token_table, send_table, E, indices=False)
            _record_baseline(ex, local, plan, G, shard, T, K)
        else:
            _record_pause(ex, local, schedule, lay, i, G, shard, send_table, batch_counts[g], sizes, T)
        programs.append(ex.program)
    return programs


@dataclass(frozen=True)
class _LocalWork:
    """The rows and local work of a simulated Parm step: rows of ``D`` elements of ``dtype``
    (``item`` bytes each), row copies, and the gate's GEMM over ``E`` experts."""

    E: int
    D: int
    dtype: torch.dtype
    item: int

    def rows(self, n: int) -> VirtualTensor:
        return VirtualTensor((int(n), self.D), self.dtype)

    def copy(self, n: float) -> Work:
        return Work(bytes=2.0 * n * self.D * self.item, kind="copy")

    def gate(self, n: int, backward: bool) -> Work:
        D, E = self.D, self.E
        f = 2.0 * n * D * E * (2 if backward else 1)
        return Work(flops=f, bytes=float(self.item * (n * D + D * E + n * E)), kind="gemm")


def _send_tables(lay, schedule: str, tokens, batch_counts, slice_counts) -> tuple[list[list[int]], list[int]]:
    """What each layout rank sends -- routed rows per expert, the table every split derives
    from -- and the tokens it routes, under ``schedule``."""
    send_table, token_table = [], []
    for i in range(lay.P):
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
    return send_table, token_table


def _record_baseline(ex: SimExecutor, local: _LocalWork, plan, G, shard: ExpertShard, T: int, K: int) -> None:
    """The baseline's step on one rank after the gate's forward: the counts and ESP gathers,
    permute, the Parm block, unpermute, and their backward down to the gate's."""
    rows, copy = local.rows, local.copy
    # the counts all-gather: [tokens, status word (a refused input, docs/rank-input.md), E counts]
    run_collective(ex, "all_gather", VirtualTensor((2 + local.E,), torch.int64), group=G.ep_esp, kind="counts")
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
    ex.compute(None, work=local.gate(T, True), kind="gate", out=rows(T))


def _record_pause(ex: SimExecutor, local: _LocalWork, schedule: str, lay, i: int, G, shard: ExpertShard,
                  send_table, batch_counts_g, sizes: list[int], T: int) -> None:
    """S1's or S2's step on layout rank ``i`` after the gate's forward (and S1's MP counts and
    scores): permute, the counts exchange, Dump, the Parm block (S2 with SAA), the local combine,
    S1's MP all-gather, and their backward down to the gate's (S1: the router gradient's
    all-reduce and the input gradient's all-gather)."""
    rows, copy = local.rows, local.copy
    E, m = local.E, lay.mp_rank[i]
    tm_ = sizes[m] if schedule == "s1" else T
    R_batch = sum(int(v) for v in batch_counts_g)
    R = sum(send_table[i])
    if schedule == "s2":
        ex.compute(None, work=copy(R_batch), kind="permute", out=rows(R_batch))
    else:
        ex.compute(None, work=copy(R), kind="permute", out=rows(R))
    run_collective(ex, "all_gather", VirtualTensor((2 + E,), torch.int64), group=G.ep_esp, kind="counts")  # as above
    plan = pause_plan(lay, i, send_table, E, indices=False)
    sp = saa_plan(lay, i, batch_counts_g, E, indices=False) if schedule == "s2" and G.mp is not None else None
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
    ex.compute(None, work=local.gate(tm_, True), kind="gate", out=rows(tm_))
    if schedule == "s1" and G.mp is not None:
        run_collective(ex, "all_reduce", VirtualTensor((E, local.D), local.dtype), group=G.mp, kind="router_grad")
        run_collective(ex, "all_gather", rows(max(sizes)), group=G.mp, kind="mp_allgather_grad")


def batch_counts(config, tokens: int, *, padded: bool = False) -> list[int]:
    """Rows per expert of one batch of ``tokens`` tokens under uniform routing: ``tokens * k``
    spread evenly over the E experts (capped at the capacity), or, with ``padded``, the capacity
    ``ceil(k * f * tokens / E)`` of every expert (DeepSpeed-MoE's dispatch tensor is E x capacity
    x M whatever the routing; Parm's volumes, ``ETM``, count it so)."""
    E, k = config.num_experts, config.top_k
    cap = config.capacity(tokens)
    if padded:
        if cap is None:
            raise ValueError("padded counts need a capacity_factor")
        return [cap] * E
    base, extra = divmod(tokens * k, E)
    out = [base + (1 if e < extra else 0) for e in range(E)]
    return [min(c, cap) for c in out] if cap is not None else out


def simulate_parm(
    config,
    layout,
    schedule: str,
    cluster_or_cost,
    *,
    tokens: int,
    dtype: str = "float32",
    padded: bool = False,
    symmetric: bool = True,
):
    """One forward + backward step of a Parm schedule on every rank of ``layout`` (layout rank
    i on the cluster's GPU ``layout.ranks[i]``, node = rank // GPUs per node), through the
    discrete-event engine (:mod:`tritonmoe.sim.engine`) on ``cluster_or_cost`` (a
    :class:`~tritonmoe.plan.Cluster`, a :class:`~tritonmoe.plan.CostModel` or its file).

    Every MP group holds ``tokens`` tokens, routed uniformly (:func:`batch_counts`; ``padded``:
    capacity-padded). ``symmetric``: simulate one rank (exact here: uniform routing makes every
    rank's program the same up to its peers). Returns the engine's result
    (``.step_time()``, ``.timeline``)."""

    cost = resolve_cost(cluster_or_cost, dtype)
    dt = parse_dtype(dtype)
    counts = batch_counts(config, tokens, padded=padded)
    progs = parm_step_programs(
        config, layout, schedule, tokens=[tokens] * layout.num_batches, batch_counts=[counts] * layout.num_batches,
        dtype=dt, host_compute=False, ranks=[0] if symmetric else None,
    )
    return engine.run(progs, cost, symmetric=symmetric, timeline=not symmetric)


def choose_parm(config, layout, cluster_or_cost, *, tokens: int, dtype: str = "float32",
                padded: bool = False) -> tuple[str, dict]:
    """The Parm schedule ("baseline", "s1", "s2") the simulator predicts fastest for this layer,
    layout and batch on a cluster (every candidate simulated through the schedule code the
    layer runs), and every candidate's predicted step time."""
    t = {s: simulate_parm(config, layout, s, cluster_or_cost, tokens=tokens, dtype=dtype, padded=padded).step_time()
         for s in ("baseline", "s1", "s2")}
    return min(("s1", "s2", "baseline"), key=lambda s: t[s]), t


def simulate_all_to_all(
    send: Sequence[Sequence[int]], cluster_or_cost, *, row_bytes: int, local_size: int, hierarchical: bool,
    dtype: str = "float16",
):
    """One all-to-all of rows (``send[r][d]`` rows from rank r to rank d, ``row_bytes`` each)
    over ranks 0..P-1 of a cluster, flat or hierarchical (:func:`tritonmoe.comm.
    hierarchical_schedule` with ``local_size`` ranks per node), through the engine. Returns the
    engine's result."""

    cost = resolve_cost(cluster_or_cost, dtype)
    P = len(send)
    p = local_size
    n = P // p
    width = max(1, row_bytes // 4)
    world = VirtualGroup(tuple(range(P)))
    progs = []
    for r in range(P):
        ex = SimExecutor(r, world, host_compute=False)
        x = VirtualTensor((sum(send[r]), width), torch.float32)
        recv = [send[s][r] for s in range(P)]
        if not hierarchical or p == 1 or n == 1:
            ex.wait(ex.all_to_all(x, send[r], recv, kind="dispatch"))
        else:
            a, j = divmod(r, p)
            peer = [[send[a * p + i][b * p + j] for b in range(n)] for i in range(p)]
            plan = hierarchical_plan(send[r], recv, peer, r, p)
            intra = VirtualGroup(tuple(a * p + i for i in range(p)))
            inter = VirtualGroup(tuple(b * p + j for b in range(n)))
            ex.wait(hierarchical_schedule(ex, x, send[r], plan, intra=intra, inter=inter, local_size=p))
        progs.append(ex.program)
    return engine.run(progs, cost, timeline=False)


def choose_all_to_all(send: Sequence[Sequence[int]], cluster_or_cost, *, row_bytes: int, local_size: int,
                      dtype: str = "float16") -> tuple[str, dict]:
    """"flat" or "hierarchical": the all-to-all the cost model predicts faster for this exchange
    (SE-MoE: the hierarchical one pays where per-message inter-node costs dominate), and both
    predicted times."""
    t = {
        name: simulate_all_to_all(send, cluster_or_cost, row_bytes=row_bytes, local_size=local_size,
                                  hierarchical=name == "hierarchical", dtype=dtype).step_time()
        for name in ("flat", "hierarchical")
    }
    return min(t, key=t.get), t
