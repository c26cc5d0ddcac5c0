"""Parm's schedules for MoE layers under model + expert + expert-sharding parallelism, as
executor code (paper 003; PAPERS.md 3.1-3.4).

Layout (:mod:`tritonmoe.parm_layout`): P = n_ep * n_esp ranks; EP rank a owns experts
[a*L, (a+1)*L), L = E/n_ep; the n_esp ranks of an ESP group each hold a slice of those experts'
hidden units (partial outputs); an MP group of n_mp ranks holds one batch (replicated input).

Three schedules of one MoE layer (names: PAPERS.md 0 "name collision": Parm's S1/S2 are called
:data:`PAUSE_BEFORE_GATE` / :data:`PAUSE_AFTER_GATE` here; ``MoEConfig.parm_schedule`` spells
them "s1" / "s2"):

* :data:`BASELINE` (DeepSpeed-MoE's order; every MP rank processes its copy of the batch):
  gate -> ESP all-gather of the tokens -> EP all-to-all -> expert shards -> ESP all-reduce of the
  partial outputs -> EP all-to-all -> ESP split. Backward: the mirror collectives (PAPERS.md 3.2
  ambiguity 5): split -> ESP all-gather of the output gradients, all-reduce -> identity,
  all-to-all -> all-to-all, all-gather -> ESP reduce-scatter of the input gradients.
* :data:`PAUSE_BEFORE_GATE` (S1): MP split of the tokens (each MP rank routes 1/n_mp of them) ->
  gate -> Dump (each routed row copied once per ESP shard of its expert) -> one all-to-all over
  all P ranks (EP&ESP) -> expert shards -> the reverse all-to-all -> local combine (the n_esp
  partials summed in shard order) -> MP all-gather. Backward: MP all-gather -> split, all-to-all
  -> all-to-all, Dump -> sum of the copies, MP split -> MP all-gather of the input gradients.
* :data:`PAUSE_AFTER_GATE` (S2): gate on every token, then MP split of each expert's rows (MP
  rank m sends the m-th contiguous part of every expert's rows, PAPERS.md 3.2 ambiguity 2) ->
  Dump -> EP&ESP all-to-all -> expert shards -> SAA (the reverse all-to-all overlapped with the MP
  all-gather of what it returns, :mod:`tritonmoe.comm.programs.saa`) -> local combine of every row.
  Backward: all-gather -> split (the gradient is replicated over MP), all-to-all -> all-to-all,
  MP split -> MP all-gather of the row gradients.

This module holds the plans (every split derives from one table of per-rank counts, so splits
agree by construction) and each communication step as a function of an
:class:`~tritonmoe.comm.executor.Executor`: the layer's autograd functions run them on a
:class:`~tritonmoe.comm.RealExecutor`, the simulator (:mod:`tritonmoe.policy.parm_schedule`) runs the same
functions on a :class:`~tritonmoe.plan.SimExecutor`. The local work around them (routing,
permute, Dump, combine, unpermute) is in :mod:`tritonmoe.experts.model_parallel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from tritonmoe.core.autograd import first_order
from tritonmoe.core.exact import WeightGradStore
from tritonmoe.core.validation import GLU_ACTIVATIONS

from tritonmoe.comm.executor import Executor, Handle, RealExecutor, VirtualTensor, Work
from tritonmoe.comm.programs.saa import rows_of, saa_schedule

__all__ = [
    "BASELINE",
    "ffn_shard_work",
    "PAUSE_BEFORE_GATE",
    "PAUSE_AFTER_GATE",
    "SCHEDULES",
    "ranges",
    "PausePlan",
    "SaaPlan",
    "BaselinePlan",
    "pause_plan",
    "saa_plan",
    "baseline_plan",
    "ExpertShard",
    "pause_forward",
    "pause_backward",
    "baseline_forward",
    "baseline_backward",
    "run_collective",
    "ParmBlockState",
    "parm_block",
]

BASELINE = "baseline"
PAUSE_BEFORE_GATE = "pause_before_gate"
PAUSE_AFTER_GATE = "pause_after_gate"
SCHEDULES = (BASELINE, PAUSE_BEFORE_GATE, PAUSE_AFTER_GATE)


def ranges(starts: Sequence[int], lengths: Sequence[int], device=None) -> torch.Tensor:
    """int64 concatenation of ``arange(starts[c], starts[c] + lengths[c])`` over c."""
    ln = torch.tensor(list(lengths), dtype=torch.int64)
    st = torch.tensor(list(starts), dtype=torch.int64)
    total = int(ln.sum()) if ln.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    seg = torch.repeat_interleave(torch.arange(ln.numel()), ln)
    first = torch.cumsum(ln, 0) - ln
    out = st[seg] + torch.arange(total) - first[seg]
    return out.to(device) if device is not None else out


def _excl(xs: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return out


def part_bounds(count: int, n: int, m: int) -> tuple[int, int]:
    """Part m of n of ``count`` rows: contiguous, sizes differing by at most one (the first
    ``count % n`` one longer) -- the same rule as the token micro-batches."""
    base, extra = divmod(count, n)
    lo = m * base + min(m, extra)
    return lo, lo + base + (1 if m < extra else 0)


# ---------------------------------------------------------------------------------------------
# Plans: every split of one forward, from one table of per-rank counts
# ---------------------------------------------------------------------------------------------


@dataclass
class PausePlan:
    """One rank's exchange under PauseMP (S1 and S2): the rows it sends are its permuted buffer
    (S1: its token slice's rows; S2: its part of every expert's rows), grouped by expert.

    Attributes:
        counts: rows per global expert of this rank's buffer (host ints, [E]).
        send_splits: rows to each of the P ranks (the buffer's block of the destination's
            experts, once per ESP shard: the Dump); recv_splits: rows from each source.
        recv_counts: int64 [P, L] rows received per (source, local expert).
        dump_index: int64 [R_send]: the buffer row of each sent row (send order).
        combine_pos: int64 [R, n_esp]: for each buffer row, the positions of its n_esp copies
            (shard order) in the send buffer, which the reverse all-to-all returns in place.
        wgrad_groups: the sources in the order their rows enter the weight gradients (MP group,
            then MP rank: the order of the unscheduled computation's tokens).
    """

    counts: list[int]
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts: torch.Tensor
    dump_index: torch.Tensor
    combine_pos: torch.Tensor
    wgrad_groups: list[int]
    recv_counts_list: Optional[list] = None  # recv_counts as host ints (no device read needed)

    @property
    def rows(self) -> int:
        return sum(self.counts)

    @property
    def send_rows(self) -> int:
        return sum(self.send_splits)

    @property
    def recv_rows(self) -> int:
        return sum(self.recv_splits)


def pause_plan(
    layout, rank: int, table: Sequence[Sequence[int]], num_experts: int, device=None, *, indices: bool = True
) -> PausePlan:
    """The :class:`PausePlan` of ``rank`` when layout rank j's buffer holds ``table[j][e]`` rows
    of expert e. ``indices=False`` skips the row indices (the simulator needs the splits only)."""
    P, E = layout.P, num_experts
    L = E // layout.n_ep
    c = [int(v) for v in table[rank]]
    off = _excl(c) + [sum(c)]
    bs = [off[(a + 1) * L] - off[a * L] for a in range(layout.n_ep)]
    bst = [off[a * L] for a in range(layout.n_ep)]
    send = [bs[layout.ep[d]] for d in range(P)]
    a_me = layout.ep[rank]
    recv_counts = [[int(table[j][a_me * L + l]) for l in range(L)] for j in range(P)]
    recv = [sum(r) for r in recv_counts]
    dump = pos = None
    if indices:
        dump = ranges([bst[layout.ep[d]] for d in range(P)], send).to(device)
        cs = _excl(send)
        pos = torch.zeros(sum(c), layout.n_esp, dtype=torch.int64)
        for a in range(layout.n_ep):
            if bs[a]:
                r = torch.arange(bs[a])
                for s in range(layout.n_esp):
                    pos[bst[a] : bst[a] + bs[a], s] = cs[layout.holder(a, s)] + r
        pos = pos.to(device)
    order = sorted(range(P), key=lambda j: (layout.mp_group[j], layout.mp_rank[j]))
    return PausePlan(
        counts=c, send_splits=send, recv_splits=recv,
        recv_counts=torch.tensor(recv_counts, dtype=torch.int64, device=device).view(P, L),
        dump_index=dump, combine_pos=pos, wgrad_groups=order, recv_counts_list=recv_counts,
    )


@dataclass
class SaaPlan:
    """S2's split and gather of one rank, from its batch's per-expert counts (the same on every
    rank of the MP group).

    Attributes:
        part_index: int64 [R_part]: the rows of the batch's permuted buffer that form this MP
            rank's part (part m of every expert's rows, expert by expert).
        part_counts: per MP rank q, its part's rows per expert (host ints, [n_mp][E]).
        mp_peers: the layout ranks of the MP group, in MP-rank order.
        peer_recv_splits: per MP rank q, the rows its reverse all-to-all receives from each
            layout rank (= its dispatch send splits).
        full_pos: int64 [R, n_esp]: for each row of the batch's permuted buffer, the positions of
            its n_esp partial outputs in the gathered buffer SAA returns.
        part_rows: per MP rank q, the rows of its part.
    """

    part_index: torch.Tensor
    part_counts: list[list[int]]
    mp_peers: list[int]
    peer_recv_splits: list[list[int]]
    full_pos: torch.Tensor
    part_rows: list[int]


def s2_part_counts(batch_counts: Sequence[int], n_mp: int, m: int) -> list[int]:
    """Rows per expert of MP rank m's part (S2's split of each expert's rows)."""
    out = []
    for c in batch_counts:
        lo, hi = part_bounds(int(c), n_mp, m)
        out.append(hi - lo)
    return out


def saa_plan(
    layout, rank: int, batch_counts: Sequence[int], num_experts: int, device=None, *, indices: bool = True
) -> SaaPlan:
    """The :class:`SaaPlan` of ``rank``, whose MP group's batch has ``batch_counts[e]`` routed
    rows of expert e (its permuted buffer, grouped by expert). ``indices=False`` skips the row
    indices."""
    E, P = num_experts, layout.P
    L = E // layout.n_ep
    n_mp = layout.n_mp
    peers = list(layout.mp_group_of(rank))
    m = layout.mp_rank[rank]
    c = [int(v) for v in batch_counts]
    off = _excl(c)
    bounds = [[part_bounds(c[e], n_mp, q) for e in range(E)] for q in range(n_mp)]
    part_counts = [[hi - lo for lo, hi in bounds[q]] for q in range(n_mp)]
    part_index = ranges([off[e] + bounds[m][e][0] for e in range(E)], part_counts[m]) if indices else None
    peer_send = []
    for q in range(n_mp):
        pc = part_counts[q]
        bs = [sum(pc[a * L : (a + 1) * L]) for a in range(layout.n_ep)]
        peer_send.append([bs[layout.ep[d]] for d in range(P)])
    part_rows = [sum(pc) for pc in part_counts]
    base = _excl([sum(s) for s in peer_send])
    if not indices:
        return SaaPlan(part_index=None, part_counts=part_counts, mp_peers=peers, peer_recv_splits=peer_send,
                       full_pos=None, part_rows=part_rows)
    pos = torch.zeros(sum(c), layout.n_esp, dtype=torch.int64)
    for q in range(n_mp):
        pc = part_counts[q]
        poff = _excl(pc)
        cs = _excl(peer_send[q])
        for e in range(E):
            lo, hi = bounds[q][e]
            if hi == lo:
                continue
            a = e // L
            within = poff[e] - poff[a * L]  # row of the part inside its block of EP rank a
            rows = torch.arange(hi - lo)
            for s in range(layout.n_esp):
                d = layout.holder(a, s)
                pos[off[e] + lo : off[e] + hi, s] = base[q] + cs[d] + within + rows
    return SaaPlan(
        part_index=part_index.to(device), part_counts=part_counts, mp_peers=peers, peer_recv_splits=peer_send,
        full_pos=pos.to(device), part_rows=part_rows,
    )


@dataclass
class BaselinePlan:
    """The baseline's exchanges for one rank (a, s).

    The ESP group's members (a, s'), s' = 0..n_esp-1, are the *origins* whose batches this rank
    gathers; it permutes each and sends, to each EP peer (a', s), the rows of every origin for
    the experts of a' (origin by origin). A received buffer is grouped by origin (a_src, s'),
    then local expert.

    Attributes:
        origins: the layout ranks of the ESP group (the gathered batches), in ESP order.
        tokens: the tokens of each origin's batch; ``tokens_max``: their maximum (the padded
            all-gather's rows per member).
        origin_counts: per origin, rows per global expert of its permuted batch.
        send_index: int64: rows of the concatenated permuted origin batches in send order.
        send_splits, recv_splits: the EP all-to-all's splits (n_ep entries).
        recv_counts: int64 [n_ep * n_esp, L] rows received per (origin (a_src, s'), local expert).
        origin_pos: per origin, int64 positions of its permuted rows in the send buffer (the
            reverse all-to-all returns rows in place; ``origin_pos[s]`` is this rank's ESP split).
        wgrad_groups: the received origin groups whose rows enter the weight gradients, in the
            unscheduled computation's order: one copy of each batch (MP rank 0's), MP group order.
        mp_duplicates: n_mp (every batch arrives n_mp times; weight gradients that are not
            deferred are divided by it).
    """

    origins: list[int]
    tokens: list[int]
    tokens_max: int
    origin_counts: list[list[int]]
    send_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts: torch.Tensor
    origin_pos: list[torch.Tensor]
    wgrad_groups: list[int]
    mp_duplicates: int
    own: int = 0
    recv_counts_list: Optional[list] = None  # recv_counts as host ints (no device read needed)

    @property
    def own_rows(self) -> list[int]:
        return [sum(c) for c in self.origin_counts]


def baseline_plan(
    layout, rank: int, tokens: Sequence[int], table: Sequence[Sequence[int]], num_experts: int, device=None, *,
    indices: bool = True,
) -> BaselinePlan:
    """The :class:`BaselinePlan` of ``rank``; layout rank j holds ``tokens[j]`` tokens whose
    permuted buffer has ``table[j][e]`` rows of expert e. ``indices=False`` skips the row
    indices."""
    E = num_experts
    L = E // layout.n_ep
    n_ep, n_esp = layout.n_ep, layout.n_esp
    a_me, s_me = layout.ep[rank], layout.esp[rank]
    origins = list(layout.esp_group_of(rank))
    oc = [[int(v) for v in table[o]] for o in origins]
    ooff = [_excl(c) + [sum(c)] for c in oc]
    base = _excl([sum(c) for c in oc])
    starts, lens = [], []
    pos_parts: list[list[tuple[int, int]]] = [[] for _ in origins]  # per origin: (send start, rows) per block
    acc = 0
    for a2 in range(n_ep):
        for k in range(n_esp):
            st, ln = ooff[k][a2 * L], ooff[k][(a2 + 1) * L] - ooff[k][a2 * L]
            starts.append(base[k] + st)
            lens.append(ln)
            pos_parts[k].append((acc, ln))
            acc += ln
    send = [sum(lens[a2 * n_esp : (a2 + 1) * n_esp]) for a2 in range(n_ep)]
    recv_counts, recv = [], []
    for a_src in range(n_ep):
        tot = 0
        for k in range(n_esp):
            o = layout.holder(a_src, k)
            row = [int(table[o][a_me * L + l]) for l in range(L)]
            recv_counts.append(row)
            tot += sum(row)
        recv.append(tot)
    origin_pos = [ranges([p for p, _ in parts], [n for _, n in parts], device) for parts in pos_parts] if indices else None
    groups = []
    for a_src in range(n_ep):
        for k in range(n_esp):
            o = layout.holder(a_src, k)
            if layout.mp_rank[o] == 0:
                groups.append((layout.mp_group[o], a_src * n_esp + k))
    return BaselinePlan(
        origins=origins, tokens=[int(tokens[o]) for o in origins], tokens_max=max(int(tokens[o]) for o in origins),
        origin_counts=oc, send_index=ranges(starts, lens, device) if indices else None, send_splits=send, recv_splits=recv,
        recv_counts=torch.tensor(recv_counts, dtype=torch.int64, device=device).view(n_ep * n_esp, L),
        origin_pos=origin_pos, wgrad_groups=[g for _, g in sorted(groups)], mp_duplicates=layout.n_mp,
        own=s_me, recv_counts_list=recv_counts,
    )


# ---------------------------------------------------------------------------------------------
# The expert shards: compute on received rows, with autograd graphs kept for the backward
# ---------------------------------------------------------------------------------------------


@dataclass
class ExpertShard:
    """The local expert compute of a block: ``fn(recv_RD, params, wgrad) -> y_RD`` (one output
    row per received row, same order; differentiable in both), its parameters, and the cost of
    a call for the simulator: ``work(rows, step)`` with step "fwd", "bgrad" (the input gradient)
    or "wgrad" (the weight gradients)."""

    fn: Optional[Callable[..., torch.Tensor]]
    params: Sequence[Any] = ()
    work: Optional[Callable[[int, str], Work]] = None

    def cost(self, rows: int, step: str = "fwd") -> Work:
        return self.work(rows, step) if self.work is not None else Work()


@dataclass
class _Graph:
    """What the block keeps between its forward and backward."""

    params: list = field(default_factory=list)
    store: Optional[WeightGradStore] = None
    recv: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    grads: list = field(default_factory=list)  # weight gradients computed by autograd (not deferred)


def _expert_forward(shard: ExpertShard, graph: Optional[_Graph]):
    def run(recv: torch.Tensor) -> torch.Tensor:
        if graph is None:
            with torch.no_grad():
                return shard.fn(recv, list(shard.params), None)
        with torch.enable_grad():
            r = recv.detach().requires_grad_(True)
            slot = graph.store.slot(0) if graph.store is not None else None
            y = shard.fn(r, graph.params, slot)
        graph.recv, graph.out = r, y
        return y.detach()

    return run


def _expert_backward(graph: _Graph):
    def run(dy: torch.Tensor) -> torch.Tensor:
        r, y = graph.recv, graph.out
        graph.recv = graph.out = None
        want = [p for p in graph.params if p.requires_grad]
        if y is None or not y.requires_grad:
            graph.grads = [None] * len(want)
            return torch.zeros_like(r) if r is not None else dy.new_zeros(dy.shape)
        gs = torch.autograd.grad(y, [r] + want, dy, allow_unused=True)
        graph.grads = list(gs[1:])
        return gs[0] if gs[0] is not None else torch.zeros_like(r)

    return run


def _vt(x: Any) -> Any:
    """A VirtualTensor stand-in for the simulator's ``out=``, or None for a real tensor."""
    v = x.value if isinstance(x, Handle) else x
    return v if isinstance(v, VirtualTensor) else None


def _out_rows(x: Any, n: int) -> Any:
    v = x.value if isinstance(x, Handle) else x
    if isinstance(v, VirtualTensor):
        return v.with_rows(n)
    return VirtualTensor((n,) + tuple(v.shape[1:]), v.dtype)


def _a2a(ex: Executor, x: Any, send: Sequence[int], recv: Sequence[int], group: Any, kind: str, after=()) -> Any:
    """An all-to-all, or the identity on a group of one rank (group None)."""
    if group is None:
        if after:
            return ex.compute(lambda t: t, x, work=Work(launches=0), kind=kind, out=_vt(x), after=after)
        return x
    return ex.all_to_all(x, list(send), list(recv), group=group, kind=kind, after=after)


# ---------------------------------------------------------------------------------------------
# Schedules as executor code
# ---------------------------------------------------------------------------------------------


def pause_forward(
    ex: Executor,
    send: Any,
    plan: PausePlan,
    expert: Callable[[Any], Any],
    shard: ExpertShard,
    *,
    group: Any,
    saa: Optional[SaaPlan] = None,
    rank: int = 0,
    mp_group: Any = None,
) -> Any:
    """PauseMP's block (S1 without ``saa``, S2 with it): the EP&ESP all-to-all of the dumped
    rows, the expert shards, and the reverse all-to-all (S1) or SAA (S2). Returns the value of
    the rows returned to this rank: the send buffer's rows, in place (S1), or every MP rank's
    (S2: MP-rank order, each as :attr:`SaaPlan.peer_recv_splits`)."""
    recv = _a2a(ex, send, plan.send_splits, plan.recv_splits, group, "dispatch")
    y = ex.compute(
        expert, recv, work=shard.cost(plan.recv_rows), kind="expert", out=_out_rows(send, plan.recv_rows)
    )
    if saa is None or len(saa.mp_peers) == 1:
        back = _a2a(ex, y, plan.recv_splits, plan.send_splits, group, "combine")
    else:
        back = saa_schedule(
            ex, y, plan.recv_splits, plan.send_splits, group=group, rank=rank, mp_group=mp_group,
            mp_peers=saa.mp_peers, peer_recv_splits=saa.peer_recv_splits,
        )
    return ex.wait(back) if isinstance(back, Handle) else back


def pause_backward(
    ex: Executor,
    grad: Any,
    plan: PausePlan,
    expert_bwd: Callable[[Any], Any],
    shard: ExpertShard,
    *,
    group: Any,
    saa: Optional[SaaPlan] = None,
    rank: int = 0,
    weight_step: Optional[Callable[[], None]] = None,
) -> Any:
    """The mirror of :func:`pause_forward`: ``grad`` is the gradient of the rows the forward
    returned. S2: of every MP rank's rows; the all-gather's backward is a split (this rank's
    part) because the gradient is replicated over the MP group. The reverse all-to-all brings it
    to the expert shards, their backward gives the input gradients, the dispatch's reverse
    returns them, and the W step (the deferred weight gradients) runs while it travels. Returns
    the gradient of the send buffer."""
    g = grad.value if isinstance(grad, Handle) else grad
    if saa is not None and len(saa.mp_peers) > 1:
        me = saa.mp_peers.index(rank)
        start = sum(sum(r) for r in saa.peer_recv_splits[:me])
        grad = rows_of(g, start, start + plan.send_rows)
    dy = _a2a(ex, grad, plan.send_splits, plan.recv_splits, group, "combine")
    dx = ex.compute(
        expert_bwd, dy, work=shard.cost(plan.recv_rows, "bgrad"), kind="expert", out=_out_rows(g, plan.recv_rows)
    )
    back = _a2a(ex, dx, plan.recv_splits, plan.send_splits, group, "dispatch")
    ex.compute(weight_step if weight_step is not None else _noop, work=shard.cost(plan.recv_rows, "wgrad"), kind="wgrad")
    return ex.wait(back) if isinstance(back, Handle) else back


def baseline_forward(
    ex: Executor,
    send: Any,
    plan: BaselinePlan,
    expert: Callable[[Any], Any],
    shard: ExpertShard,
    *,
    ep_group: Any,
    esp_group: Any,
) -> Any:
    """The baseline's block: EP all-to-all, expert shards, ESP all-reduce of the partial
    outputs, the reverse EP all-to-all, and the ESP split: returns this rank's own batch's rows
    (its permuted order) of what came back."""
    recv = _a2a(ex, send, plan.send_splits, plan.recv_splits, ep_group, "dispatch")
    y = ex.compute(expert, recv, work=shard.cost(sum(plan.recv_splits)), kind="expert",
                   out=_out_rows(send, sum(plan.recv_splits)))
    if esp_group is not None:
        y = ex.all_reduce(y, group=esp_group, kind="esp_allreduce")
    back = _a2a(ex, y, plan.recv_splits, plan.send_splits, ep_group, "combine")
    own = plan.origin_pos[plan.own] if plan.origin_pos is not None else None
    rows = plan.own_rows[plan.own]
    split = ex.compute(lambda t: t.index_select(0, own.to(t.device)), back, kind="esp_split",
                       work=Work(bytes=2.0 * rows * _row_bytes(send), kind="copy"), out=_out_rows(send, rows))
    return ex.wait(split)


def baseline_backward(
    ex: Executor,
    own_grad: Any,
    plan: BaselinePlan,
    expert_bwd: Callable[[Any], Any],
    shard: ExpertShard,
    *,
    ep_group: Any,
    esp_group: Any,
    weight_step: Optional[Callable[[], None]] = None,
) -> Any:
    """The baseline block's backward: the ESP split's mirror, an all-gather of every member's
    gradient of its own rows (padded to the longest), assembled into the gradient of the whole
    returned buffer; the reverse EP all-to-all; the expert shards' backward (the all-reduce's
    mirror is the identity: the gradient is already replicated over the ESP group); the
    dispatch's reverse. Returns the gradient of the send buffer."""
    R = sum(plan.send_splits)
    rb = _row_bytes(own_grad)
    if esp_group is not None:
        rmax = max(plan.own_rows)
        n = len(plan.origins)
        sizes = plan.own_rows
        pos = plan.origin_pos

        def pad(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((rmax,) + tuple(t.shape[1:]))
            out[: t.shape[0]] = t
            return out

        def assemble(t: torch.Tensor) -> torch.Tensor:
            full = t.new_zeros((R,) + tuple(t.shape[1:]))
            for k in range(n):
                if sizes[k]:
                    full[pos[k].to(t.device)] = t[k * rmax : k * rmax + sizes[k]]
            return full

        padded = ex.compute(pad, own_grad, work=Work(bytes=2.0 * rmax * rb, kind="copy"), kind="esp_split_grad",
                            out=_out_rows(own_grad, rmax))
        g = ex.all_gather(padded, group=esp_group, kind="esp_allgather_grad")
        full = ex.compute(assemble, g, work=Work(bytes=2.0 * R * rb, kind="copy"), kind="esp_split_grad",
                          out=_out_rows(own_grad, R))
    else:
        full = own_grad
    dy = _a2a(ex, full, plan.send_splits, plan.recv_splits, ep_group, "combine")
    rows = sum(plan.recv_splits)
    dx = ex.compute(expert_bwd, dy, work=shard.cost(rows, "bgrad"), kind="expert", out=_out_rows(own_grad, rows))
    back = _a2a(ex, dx, plan.recv_splits, plan.send_splits, ep_group, "dispatch")
    ex.compute(weight_step if weight_step is not None else _noop, work=shard.cost(rows, "wgrad"), kind="wgrad")
    return ex.wait(back) if isinstance(back, Handle) else back


def _row_bytes(x: Any) -> int:
    v = x.value if isinstance(x, Handle) else x
    if isinstance(v, VirtualTensor):
        return v.row_bytes()
    return v.element_size() * math.prod(v.shape[1:])


def _noop() -> None:
    return None


def run_collective(
    ex: Executor, op: str, x: Any, *, group: Any, kind: str, send: Sequence[int] = (), recv: Sequence[int] = ()
) -> Any:
    """One collective of a schedule's MP/ESP steps (``op``: "all_gather", "all_reduce",
    "reduce_scatter", "all_to_all"), waited for; the identity on a group of one (None)."""
    if group is None:
        return x.value if isinstance(x, Handle) else x
    if op == "all_gather":
        h = ex.all_gather(x, group=group, kind=kind)
    elif op == "all_reduce":
        h = ex.all_reduce(x, group=group, kind=kind)
    elif op == "reduce_scatter":
        h = ex.reduce_scatter(x, group=group, kind=kind)
    elif op == "all_to_all":
        h = ex.all_to_all(x, list(send), list(recv), group=group, kind=kind)
    else:
        raise ValueError(f"unknown collective {op!r}")
    return ex.wait(h)


# ---------------------------------------------------------------------------------------------
# The autograd block (real executor)
# ---------------------------------------------------------------------------------------------


@dataclass
class ParmBlockState:
    """Everything the block's autograd function needs besides its tensors.

    ``schedule``: one of :data:`SCHEDULES`; ``plan``: its :class:`PausePlan` or
    :class:`BaselinePlan`; ``saa``: S2's :class:`SaaPlan`; ``groups``: the rank's
    :class:`~tritonmoe.parm_layout.ParmGroups`; ``shard``: the expert compute;
    ``timeline``/``trace``: recorders (``trace`` receives every executor operation).
    """

    schedule: str
    plan: Any
    shard: ExpertShard
    groups: Any
    saa: Optional[SaaPlan] = None
    timeline: Any = None
    trace: Optional[list] = None
    graph: Optional[_Graph] = None


class _ParmBlock(torch.autograd.Function):
    """send buffer, expert params -> returned rows (see :func:`parm_block`)."""

    @staticmethod
    def forward(ctx, state: ParmBlockState, send: torch.Tensor, *params):
        graph = _Graph(params=[p.detach().requires_grad_(p.requires_grad) for p in params])
        want = [p for p in graph.params if p.requires_grad]
        if want:
            graph.store = WeightGradStore(want, 1)
        state.graph = graph
        ex = RealExecutor(send.device, phase="fwd", timeline=state.timeline)
        out = _block_forward(ex, state, send, _expert_forward(state.shard, graph))
        if state.trace is not None:
            state.trace.extend(ex.trace)
        ctx.state = state
        return out

    @staticmethod
    @first_order("the model-parallel (Parm) schedule")
    def backward(ctx, grad):
        state: ParmBlockState = ctx.state
        graph = state.graph
        if graph is None:
            raise RuntimeError("the Parm block was back-propagated twice (retain_graph is not supported through it)")
        want = [p for p in graph.params if p.requires_grad]
        deferred: list = [None] * len(want)
        plan = state.plan

        def weight_step() -> None:
            if graph.store is None:
                return
            got = graph.store.flush([plan.recv_counts], plan.wgrad_groups)
            for j, g in enumerate(got):
                deferred[j] = g

        ex = RealExecutor(grad.device, phase="bwd", timeline=state.timeline)
        grad = grad.contiguous()
        if state.schedule == BASELINE:
            d_send = baseline_backward(
                ex, grad, plan, _expert_backward(graph), state.shard,
                ep_group=state.groups.ep, esp_group=state.groups.esp, weight_step=weight_step,
            )
        else:
            d_send = pause_backward(
                ex, grad, plan, _expert_backward(graph), state.shard, group=state.groups.ep_esp,
                saa=state.saa if state.schedule == PAUSE_AFTER_GATE else None, rank=state.groups.rank,
                weight_step=weight_step,
            )
        if state.trace is not None:
            state.trace.extend(ex.trace)
        dup = plan.mp_duplicates if state.schedule == BASELINE else 1
        d_params, k = [], 0
        for p in graph.params:
            if not p.requires_grad:
                d_params.append(None)
                continue
            g_auto, g_def = graph.grads[k] if k < len(graph.grads) else None, deferred[k]
            k += 1
            if g_auto is not None and dup > 1:
                # Every batch reached the experts n_mp times (one copy per MP rank, the same
                # gradient each): count it once. Exact for powers of two; rounding otherwise.
                g_auto = g_auto / dup
            g = g_auto if g_def is None else (g_def if g_auto is None else g_auto + g_def)
            d_params.append(torch.zeros_like(p) if g is None else g)
        state.graph = None
        return (None, d_send, *d_params)


def _block_forward(ex: Executor, state: ParmBlockState, send: Any, expert: Callable) -> Any:
    if state.schedule == BASELINE:
        return baseline_forward(ex, send, state.plan, expert, state.shard,
                                ep_group=state.groups.ep, esp_group=state.groups.esp)
    saa = state.saa if state.schedule == PAUSE_AFTER_GATE else None
    return pause_forward(
        ex, send, state.plan, expert, state.shard, group=state.groups.ep_esp, saa=saa,
        rank=state.groups.rank, mp_group=state.groups.mp_lane,
    )


def parm_block(state: ParmBlockState, send: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The communication + expert part of a Parm schedule on the real executor, differentiable
    in ``send`` and ``params``: the rows the schedule returns to this rank (S1: the send
    buffer's rows; S2: every MP rank's returned rows; baseline: this rank's own origin's rows,
    after the ESP split)."""
    if torch.is_grad_enabled() and (send.requires_grad or any(p.requires_grad for p in params)):
        return _ParmBlock.apply(state, send, *params)
    ex = RealExecutor(send.device, phase="fwd", timeline=state.timeline)
    out = _block_forward(ex, state, send, _expert_forward(state.shard, None))
    if state.trace is not None:
        state.trace.extend(ex.trace)
    return out


def ffn_shard_work(config, shard_width: int, dtype: torch.dtype):
    """The :class:`Work` of one expert-shard FFN step (forward or backward) on ``rows`` rows:
    ``config``'s d_model and activation, a shard ``shard_width`` hidden units wide, ``dtype``
    elements (the annotation the executors time or simulate)."""
    d, act = config.d_model, config.activation
    n1 = 2 * shard_width if act in GLU_ACTIVATIONS else shard_width
    size = torch.empty((), dtype=dtype).element_size()

    def work(rows: int, step: str) -> Work:
        flops = 2.0 * rows * d * n1 + 2.0 * rows * shard_width * d
        if step == "fwd":
            bytes_ = size * (rows * d * 2 + rows * n1 * 2 + d * n1 + shard_width * d)
        else:
            bytes_ = size * (rows * d * 2 + rows * n1 * 3 + d * n1 + shard_width * d)
        return Work(flops=flops, bytes=float(bytes_), kind="gemm", launches=2)

    return work
