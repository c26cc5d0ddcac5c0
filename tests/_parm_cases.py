"""Per-rank bodies of the Parm tests (run by tests/test_parm.py in one spawned gloo group per
world size; see tests/_dist.py).

Reference (:func:`reference_step`): one process, the unsharded experts, the de-duplicated tokens
(one batch per MP group). Each batch is routed on its own (capacity from its token count), the
routed rows of all batches are gathered expert by expert (batch 0's rows of expert e, then batch
1's, ...) and run through one grouped FFN, and each batch is unpermuted; the loss is
sum_g (out_g * grad_g).sum() + aux_g. Router gradients are per batch (a copy of the router weight
per batch), expert gradients summed over the batches.

Every rank builds every batch and the full weights from the same seeds, runs its layer (its
batch, its expert shard) forward and backward, and compares against the reference: output, input
gradient, router gradient and auxiliary loss of its batch, expert gradients of its shard, and
the routing decisions. While it runs, the rank counts what it sends: every torch.distributed
collective the step calls is wrapped (op, group, dtype, bytes), and so is the grouped FFN (rows
per call); the expected volumes are computed here from the reference's routing and the paper's
description of each schedule, independently of the code under test.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import tritonmoe as tm
from tritonmoe import reference
from tritonmoe.layer import router_logits
from tritonmoe.experts.model_parallel import shard_expert_weights
from tritonmoe.parm_layout import ParmLayout

D_MODEL, D_FFN, NUM_EXPERTS = 8, 24, 8
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=3e-5, atol=3e-5)}
SCHEDULES = ("baseline", "s1", "s2")


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------


def reference_step(cfg: tm.MoEConfig, batches, grads, W, bias, w1, w2) -> dict:
    G = len(batches)
    E = cfg.num_experts
    xs = [b.clone().requires_grad_() for b in batches]
    Ws = [W.clone().requires_grad_() for _ in range(G)]
    W1, W2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    need = cfg.aux_loss_coef > 0 or cfg.z_loss_coef > 0
    perms, infos, routs, auxes = [], [], [], []
    for g in range(G):
        logits = router_logits(xs[g], Ws[g])
        r = reference.route(
            logits, cfg.top_k, score_func=cfg.score_func, renormalize=cfg.renormalize, expert_bias=bias,
            capacity=cfg.capacity(xs[g].shape[0]), with_aux=need,
        )
        aux = torch.zeros((), dtype=torch.float32)
        if cfg.aux_loss_coef > 0:
            aux = aux + cfg.aux_loss_coef * reference.load_balancing_loss(logits, r)
        if cfg.z_loss_coef > 0:
            aux = aux + cfg.z_loss_coef * reference.z_loss(logits, r)
        p, info = reference.permute(xs[g], r.topk_ids, E)
        perms.append(p)
        infos.append(info)
        routs.append(r)
        auxes.append(aux)
    base = [0]
    for p in perms:
        base.append(base[-1] + p.shape[0])
    idx, offs = [], [0]
    for e in range(E):
        for g in range(G):
            o = infos[g].expert_offsets
            idx += range(base[g] + int(o[e]), base[g] + int(o[e + 1]))
        offs.append(len(idx))
    idx_t = torch.tensor(idx, dtype=torch.long)
    Y = reference.grouped_ffn(torch.cat(perms)[idx_t], torch.tensor(offs), W1, W2, cfg.activation)
    inv = torch.empty_like(idx_t)
    inv[idx_t] = torch.arange(len(idx))
    Ycat = Y[inv]
    outs, loss = [], 0
    for g in range(G):
        o = reference.unpermute(Ycat[base[g] : base[g + 1]], infos[g], routs[g].topk_weights)
        outs.append(o)
        loss = loss + (o * grads[g]).sum() + auxes[g]
    loss.backward()
    return dict(
        out=[o.detach() for o in outs], x_grad=[x.grad for x in xs], router_grad=[w.grad for w in Ws],
        aux=[a.detach() for a in auxes], w1_grad=W1.grad, w2_grad=W2.grad,
        ids=[r.topk_ids for r in routs], counts=[info.counts.tolist() for info in infos],
    )


# ---------------------------------------------------------------------------------------------
# Counting what a rank sends
# ---------------------------------------------------------------------------------------------


@dataclass
class Sent:
    op: str  # all_to_all | all_gather | all_reduce | reduce_scatter | p2p
    group: tuple  # global ranks of the group
    dtype: str
    bytes: int
    phase: str
    pg: object = None  # the process group object (two groups may have the same members)


class Counter:
    """Wraps the torch.distributed calls a schedule makes (this process only) and records what
    this rank sends: the input of each collective, the sent tensors of point-to-point batches;
    and the rows of every grouped-FFN call."""

    NAMES = {
        "all_to_all_single": "all_to_all", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
        "all_reduce": "all_reduce",
        "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter", "batch_isend_irecv": "p2p",
    }

    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.ffn_rows: list[tuple[int, str]] = []
        self.phase = "off"

    @staticmethod
    def _group(g) -> tuple:
        return tuple(dist.get_process_group_ranks(g)) if g is not None else tuple(range(dist.get_world_size()))

    def _wrap(self, name, fn):
        op = self.NAMES[name]

        def wrapper(*args, **kwargs):
            if self.phase != "off":
                if op == "p2p":
                    ops = args[0]
                    for o in ops:
                        if o.op is dist.isend or getattr(o.op, "__name__", "") == "isend":
                            self.sent.append(Sent("p2p", self._group(o.group), str(o.tensor.dtype),
                                                  o.tensor.numel() * o.tensor.element_size(), self.phase, o.group))
                else:
                    t = args[1] if op in ("all_to_all", "all_gather", "reduce_scatter") else args[0]
                    self.sent.append(Sent(op, self._group(kwargs.get("group")), str(t.dtype),
                                          t.numel() * t.element_size(), self.phase))
            return fn(*args, **kwargs)

        return wrapper

    @contextmanager
    def installed(self):
        from tritonmoe import backends as dispatch

        # (all_gather_single exists from torch 2.12; tritonmoe.comm.compat calls it where it does)
        saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        spec = dispatch.OPS["grouped_ffn"]
        ffn = spec.reference

        def counting_ffn(x, *args, **kwargs):
            if self.phase != "off":
                self.ffn_rows.append((x.shape[0], self.phase))
            return ffn(x, *args, **kwargs)

        counting_ffn.defers_weight_grad = getattr(ffn, "defers_weight_grad", False)
        for n in saved:
            setattr(dist, n, self._wrap(n, saved[n]))
        dispatch.OPS["grouped_ffn"] = dataclasses.replace(spec, reference=counting_ffn)
        try:
            yield self
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)
            dispatch.OPS["grouped_ffn"] = spec


def _members(lay: ParmLayout, i: int, role: str) -> frozenset:
    """Global ranks of rank i's group ``role`` ("mp", "ep", "esp", "all")."""
    fn = {"mp": lay.mp_group_of, "ep": lay.ep_group_of, "esp": lay.esp_group_of}.get(role)
    members = fn(i) if fn is not None else range(lay.P)
    return frozenset(lay.ranks[j] for j in members)


def expected_sends(sched: str, cfg, lay: ParmLayout, i: int, tokens, ref_ids, itemsize: int) -> dict:
    """What rank i sends in one step of ``sched``, from the paper's description of the
    schedule and the reference routing: ordered lists of (op, group role, bytes) per phase for
    the collectives, and per (role, phase) totals of point-to-point bytes (SAA). ``ref_ids[g]``
    are batch g's routing ids (-1: dropped)."""
    E, K, D = cfg.num_experts, cfg.top_k, cfg.d_model
    L = E // lay.n_ep
    row = D * itemsize
    P = lay.P

    def kept(g, lo=0, hi=None, experts=None) -> int:
        ids = ref_ids[g][lo:hi]
        m = ids >= 0
        if experts is not None:
            m = m & (ids >= experts[0]) & (ids < experts[1])
        return int(m.sum())

    def counts(g):
        ids = ref_ids[g]
        return [int((ids == e).sum()) for e in range(E)]

    def part(c, m):
        out = []
        for v in c:
            base, extra = divmod(v, lay.n_mp)
            out.append(base + (1 if m < extra else 0))
        return out

    def bounds(T):
        base, extra = divmod(T, lay.n_mp)
        b, s = [], 0
        for q in range(lay.n_mp):
            e = s + base + (1 if q < extra else 0)
            b.append((s, e))
            s = e
        return b

    g, m, a = lay.mp_group[i], lay.mp_rank[i], lay.ep[i]
    mine = (a * L, (a + 1) * L)
    T = tokens[g]
    fwd, bwd, p2p = [], [], {}
    counts_msg = ("all_gather", "all", (2 + E) * 8)  # tokens, the status word of a refused input, E counts
    need_aux = cfg.aux_loss_coef > 0 or cfg.z_loss_coef > 0
    if sched == "baseline":
        origins = lay.esp_group_of(i)
        tmax = max(tokens[lay.mp_group[o]] for o in origins)
        send = sum(kept(lay.mp_group[o]) for o in origins)
        recv = sum(kept(lay.mp_group[o], experts=mine) for o in range(P))  # every origin of the grid
        if P > 1:
            fwd.append(counts_msg)
        if lay.n_esp > 1:
            fwd += [("all_gather", "esp", tmax * row), ("all_gather", "esp", tmax * K * 4)]
        if lay.n_ep > 1:
            fwd.append(("all_to_all", "ep", send * row))
        if lay.n_esp > 1:
            fwd.append(("all_reduce", "esp", recv * row))
        if lay.n_ep > 1:
            fwd.append(("all_to_all", "ep", recv * row))
        if lay.n_esp > 1:
            rmax = max(kept(lay.mp_group[o]) for o in origins)
            bwd.append(("all_gather", "esp", rmax * row))
        if lay.n_ep > 1:
            bwd += [("all_to_all", "ep", send * row), ("all_to_all", "ep", recv * row)]
        if lay.n_esp > 1:
            bwd.append(("reduce_scatter", "esp", lay.n_esp * tmax * row))
        return dict(fwd=fwd, bwd=bwd, p2p=p2p, rows=recv, a2a=send)
    if sched == "s1":
        b = bounds(T)
        lo, hi = b[m]
        send = lay.n_esp * kept(g, lo, hi)
        recv = 0
        for j in range(P):
            bj = bounds(tokens[lay.mp_group[j]])[lay.mp_rank[j]]
            recv += kept(lay.mp_group[j], bj[0], bj[1], experts=mine)
        if lay.n_mp > 1 and (cfg.capacity_factor is not None or cfg.aux_loss_coef > 0):
            fwd.append(("all_gather", "mp", K * E * 8))
        if lay.n_mp > 1 and need_aux:
            fwd.append(("all_reduce", "mp", (E + 1) * itemsize))
        if P > 1:
            fwd += [counts_msg, ("all_to_all", "all", send * row), ("all_to_all", "all", recv * row)]
        tm_ = max(h - l for l, h in b)
        if lay.n_mp > 1:
            fwd.append(("all_gather", "mp", tm_ * row))
        if P > 1:
            bwd += [("all_to_all", "all", send * row), ("all_to_all", "all", recv * row)]
        if lay.n_mp > 1:
            bwd += [("all_reduce", "mp", E * D * itemsize), ("all_gather", "mp", tm_ * row)]
        return dict(fwd=fwd, bwd=bwd, p2p=p2p, rows=recv, a2a=send)
    # s2
    c = counts(g)
    pc = part(c, m)
    send = lay.n_esp * sum(pc)
    recv = sum(sum(part(counts(lay.mp_group[j]), lay.mp_rank[j])[mine[0] : mine[1]]) for j in range(P))
    if P > 1:
        fwd += [counts_msg, ("all_to_all", "all", send * row)]
    if lay.n_mp == 1:
        if P > 1:
            fwd.append(("all_to_all", "all", recv * row))
    else:
        # SAA: phase t sends to rank+t what the holder computed for it (self chunk stays local);
        # every chunk this rank receives (its own rows back) goes to its n_mp - 1 MP peers.
        self_rows = sum(part(counts(g), m)[mine[0] : mine[1]])
        p2p[("all", "fwd")] = (recv - self_rows) * row
        p2p[("mp", "fwd")] = (lay.n_mp - 1) * send * row
    if P > 1:
        bwd += [("all_to_all", "all", send * row), ("all_to_all", "all", recv * row)]
    if lay.n_mp > 1:
        pmax = max(sum(part(c, q)) for q in range(lay.n_mp))
        bwd.append(("all_gather", "mp", pmax * row))
    return dict(fwd=fwd, bwd=bwd, p2p=p2p, rows=recv, a2a=send)


# ---------------------------------------------------------------------------------------------
# The equality + accounting table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    n_mp: int
    n_esp: int
    placement: str
    top_k: int
    activation: str
    capacity_factor: Optional[float]
    aux: bool
    dead_expert: Optional[int]
    tokens_kind: str  # "even" | "ragged"
    dtype: torch.dtype
    seed: int

    def label(self, P: int) -> str:
        cf = "dropless" if self.capacity_factor is None else f"cf={self.capacity_factor}"
        return (f"P={P} mp={self.n_mp} ep={P // self.n_esp} esp={self.n_esp} {self.placement} k={self.top_k} "
                f"{self.activation} {cf} aux={self.aux} dead={self.dead_expert} {self.tokens_kind} {self.dtype}")


def layouts(P: int) -> list[tuple[int, int, str]]:
    """Every (n_mp, n_esp) the reading allows (n_ep * n_esp = P, n_mp | P), ESP-inner; and at
    P = 4 EP-inner too where it differs (both groups larger than one). P = 8 runs ESP-inner only
    (the test-time budget: 8 processes on 2 cores; the placement's logic is the same)."""
    out = []
    divs = [d for d in range(1, P + 1) if P % d == 0]
    for n_esp in divs:
        for n_mp in divs:
            out.append((n_mp, n_esp, "esp_inner"))
            if 1 < n_esp < P and P <= 4:
                out.append((n_mp, n_esp, "ep_inner"))
    return out


def cases(P: int) -> list[Case]:
    out = []
    for i, (n_mp, n_esp, placement) in enumerate(layouts(P)):
        out.append(Case(
            n_mp=n_mp, n_esp=n_esp, placement=placement, top_k=(1, 2, 3)[i % 3],
            activation=("swiglu", "gelu", "relu")[(i // 3) % 3],
            capacity_factor=(None, 1.0, 1.5)[i % 3 if i % 4 else 0],
            aux=i % 2 == 1, dead_expert=(3 * i) % NUM_EXPERTS if i % 5 == 2 else None,
            tokens_kind="ragged" if i % 2 else "even", dtype=torch.float64, seed=100 + i,
        ))
    # fp32: equal to rounding everywhere (at P = 4; the P = 8 group is the longer one)
    for j, (n_mp, n_esp) in enumerate([(2, 2), (P // 2, 1)] if P <= 4 else []):
        out.append(Case(n_mp=n_mp, n_esp=n_esp, placement="esp_inner", top_k=2, activation="swiglu",
                        capacity_factor=1.25, aux=True, dead_expert=None, tokens_kind="ragged",
                        dtype=torch.float32, seed=900 + j))
    return out


def _tokens(case: Case, G: int, n_mp: int) -> list[int]:
    if case.tokens_kind == "even":
        return [4 * n_mp + 4] * G
    pattern = [11, 0, 1, 7, 13, 2, 5, 9]  # a batch with no tokens, one smaller than n_mp, ...
    return [pattern[(case.seed + g) % len(pattern)] for g in range(G)]


def _show(entries) -> list:
    return [(op, sorted(g), n) for op, g, n in entries]


def _close(failures, label, got, want, dtype, bitwise: bool) -> None:
    if got.shape != want.shape:
        failures.append(f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    if bitwise:
        if not torch.equal(got, want):
            failures.append(f"{label}: not bitwise equal (max diff {(got - want).abs().max().item():.3g})")
        return
    try:
        torch.testing.assert_close(got, want, **TOL[dtype])
    except AssertionError as e:
        failures.append(f"{label}: {' '.join(str(e).split()[:30])}")


def run_case(rank: int, P: int, case: Case, cache: dict, counter: Counter) -> dict:
    failures: list[str] = []
    lay = ParmLayout.make(case.n_mp, P // case.n_esp, case.n_esp, placement=case.placement)
    groups = lay.process_groups(cache=cache)
    i = groups.rank
    G = lay.num_batches
    g = lay.mp_group[i]
    dt = case.dtype
    gen = torch.Generator().manual_seed(case.seed)
    toks = _tokens(case, G, case.n_mp)
    batches = [torch.randn(t, D_MODEL, generator=gen, dtype=dt) for t in toks]
    grads = [torch.randn(t, D_MODEL, generator=gen, dtype=dt) for t in toks]
    W = torch.randn(NUM_EXPERTS, D_MODEL, generator=gen, dtype=dt) * 0.5
    w1 = torch.randn(NUM_EXPERTS, D_MODEL, 2 * D_FFN, generator=gen, dtype=dt) * 0.3
    w2 = torch.randn(NUM_EXPERTS, D_FFN, D_MODEL, generator=gen, dtype=dt) * 0.3
    bias = None
    if case.dead_expert is not None:
        bias = torch.zeros(NUM_EXPERTS)
        bias[case.dead_expert] = -1e4
    results = {}
    for sched in SCHEDULES:
        label = f"{case.label(P)} {sched}"
        cfg = tm.MoEConfig(
            D_MODEL, D_FFN, NUM_EXPERTS, case.top_k, activation=case.activation,
            capacity_factor=case.capacity_factor, aux_loss_coef=0.01 if case.aux else 0.0,
            z_loss_coef=0.001 if case.aux else 0.0, expert_bias=bias is not None, parm_schedule=sched,
        )
        if case.activation != "swiglu":
            w1_full = w1[..., :D_FFN]
        else:
            w1_full = w1
        ref = reference_step(cfg, batches, grads, W, bias, w1_full, w2)
        layer = tm.MoELayer(cfg, parm_groups=groups, dtype=dt)
        with torch.no_grad():
            layer.router.weight.copy_(W)
            a, b = shard_expert_weights(w1_full, w2, cfg, lay, i)
            layer.w1.copy_(a)
            layer.w2.copy_(b)
            if bias is not None:
                layer.expert_bias.copy_(bias)
        x = batches[g].clone().requires_grad_()
        counter.sent.clear()
        counter.ffn_rows.clear()
        counter.phase = "fwd"
        out = layer(x)
        loss = (out * grads[g]).sum() + layer.aux_loss
        counter.phase = "bwd"
        loss.backward()
        counter.phase = "off"
        if layer.expert_path.schedule_used != sched:
            failures.append(f"{label}: ran {layer.expert_path.schedule_used}")
        # -- equality
        exact = dt == torch.float64 and case.n_esp == 1
        _close(failures, f"{label}: output", out.detach(), ref["out"][g], dt, exact)
        _close(failures, f"{label}: x.grad", x.grad, ref["x_grad"][g], dt, exact)
        _close(failures, f"{label}: router.grad", layer.router.weight.grad, ref["router_grad"][g], dt,
               exact and (sched != "s1" or case.n_mp == 1))
        _close(failures, f"{label}: aux_loss", layer.aux_loss.detach().to(ref["aux"][g].dtype), ref["aux"][g],
               torch.float32 if dt == torch.float32 else torch.float64,
               dt == torch.float64 and (sched != "s1" or case.n_mp == 1))
        rw1, rw2 = shard_expert_weights(ref["w1_grad"], ref["w2_grad"], cfg, lay, i)
        # Weight gradients sum over the same rows in the same order (the W step's canonical
        # order): bitwise with n_esp = 1. A shard's gradient is a column slice of the full one,
        # which the BLAS may compute with another kernel (seen for gelu at n_esp = 4): rounding.
        _close(failures, f"{label}: w1.grad", layer.w1.grad, rw1, dt, exact)
        _close(failures, f"{label}: w2.grad", layer.w2.grad, rw2, dt, exact)
        # -- routing decisions: the baseline's (whole batch; S1: this rank's slice of it)
        ids = layer.last_routing.topk_ids
        want_ids = ref["ids"][g]
        if sched == "s1":
            base, extra = divmod(toks[g], case.n_mp)
            lo = lay.mp_rank[i] * base + min(lay.mp_rank[i], extra)
            want_ids = want_ids[lo : lo + base + (1 if lay.mp_rank[i] < extra else 0)]
        if not torch.equal(ids, want_ids):
            failures.append(f"{label}: routing decisions differ from the single-process layer's")
        # -- accounting
        exp = expected_sends(sched, cfg, lay, i, toks, ref["ids"], torch.empty((), dtype=dt).element_size())
        got = {"fwd": [], "bwd": []}
        p2p: dict = {}
        for s in counter.sent:
            if s.op == "p2p":
                role = "mp" if s.pg is groups.mp_lane else "all" if s.pg is groups.ep_esp else str(sorted(s.group))
                p2p[(role, s.phase)] = p2p.get((role, s.phase), 0) + s.bytes
            else:
                got[s.phase].append((s.op, frozenset(s.group), s.bytes))
        for ph in ("fwd", "bwd"):
            want = [(op, _members(lay, i, role), n) for op, role, n in exp[ph]]
            if got[ph] != want:
                failures.append(f"{label}: {ph} collectives {_show(got[ph])} != expected {_show(want)}")
        want_p2p = {(role, ph): n for (role, ph), n in exp["p2p"].items() if n}
        if p2p != want_p2p:
            failures.append(f"{label}: SAA point-to-point bytes {p2p} != expected {want_p2p}")
        fwd_rows = [r for r, ph in counter.ffn_rows if ph == "fwd"]
        if fwd_rows != [exp["rows"]]:
            failures.append(f"{label}: expert shard rows {fwd_rows} != expected [{exp['rows']}]")
        results[sched] = dict(
            a2a_bytes=exp["a2a"] * D_MODEL * torch.empty((), dtype=dt).element_size(),
            rows=fwd_rows[0] if fwd_rows else None,
            sent={ph: got[ph] for ph in got}, p2p=p2p,
        )
    return dict(failures=failures, results=results, layout=(case.n_mp, P // case.n_esp, case.n_esp, case.placement),
                tokens=toks, rank=i, itemsize=torch.empty((), dtype=dt).element_size())


# ---------------------------------------------------------------------------------------------
# SAA and the hierarchical all-to-all
# ---------------------------------------------------------------------------------------------


def _split_table(P: int, seed: int, zero_rate: float = 0.3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    S = torch.randint(0, 6, (P, P), generator=gen)
    S[torch.rand(P, P, generator=gen) < zero_rate] = 0
    return S.tolist()


def saa_checks(rank: int, P: int, cache: dict) -> list[str]:
    """SAA == all_gather(all_to_all(x)) for MP groups of 2 and P/2 consecutive ranks, uneven and
    zero splits; forward bitwise, backward bitwise against the composition's autograd."""
    from tritonmoe.comm import all_to_all
    from tritonmoe.comm.programs.saa import saa

    failures = []
    world = dist.group.WORLD
    for n_mp in sorted({2, P // 2, P}):
        if n_mp < 2:
            continue
        groups = []
        for start in range(0, P, n_mp):
            key = (tuple(range(start, start + n_mp)), "saa-test")
            if key not in cache:
                cache[key] = dist.new_group(list(key[0]))
            groups.append(cache[key])
        mp = groups[rank // n_mp]
        for seed in (1, 2):
            S = _split_table(P, 1000 * n_mp + seed)
            send = S[rank]
            recv = [S[s][rank] for s in range(P)]
            gen = torch.Generator().manual_seed(seed * 7 + rank)
            x = torch.randn(sum(send), 3, dtype=torch.float64, generator=gen)
            for replicated in (False, True):
                xa = x.clone().requires_grad_()
                got = saa(xa, send, recv, group=world, mp_group=mp, replicated_grad=replicated)
                xb = x.clone().requires_grad_()
                a2a = all_to_all(xb, send, recv, group=world, check=False)
                # reference all-gather of uneven pieces: exchange sizes, pad, gather
                n = torch.tensor([a2a.shape[0]])
                sizes = [torch.zeros_like(n) for _ in range(n_mp)]
                dist.all_gather(sizes, n, group=mp)
                sizes = [int(v) for v in sizes]
                pad = torch.zeros(max(sizes), 3, dtype=torch.float64)
                pad[: a2a.shape[0]] = a2a.detach()
                parts = [torch.zeros_like(pad) for _ in range(n_mp)]
                dist.all_gather(parts, pad, group=mp)
                want = torch.cat([p[:s] for p, s in zip(parts, sizes)])
                label = f"SAA P={P} mp={n_mp} seed={seed} replicated_grad={replicated}"
                if not torch.equal(got.detach(), want):
                    failures.append(f"{label}: output != all_gather(all_to_all(x))")
                    continue
                # backward: a gradient that differs per rank (the adjoint sums the MP ranks')
                ggen = torch.Generator().manual_seed(99 + (0 if replicated else rank))
                gy = torch.randn(got.shape, dtype=torch.float64, generator=ggen)
                got.backward(gy)
                me = rank % n_mp
                lo = sum(sizes[:me])
                if replicated:
                    g_mine = gy[lo : lo + sizes[me]]
                else:
                    # sum over MP ranks of their gradients of my part, in MP-rank order
                    allg = [torch.zeros_like(gy) for _ in range(n_mp)]
                    dist.all_gather(allg, gy.contiguous(), group=mp)
                    g_mine = torch.zeros(sizes[me], 3, dtype=torch.float64)
                    for q in range(n_mp):
                        g_mine = g_mine + allg[q][lo : lo + sizes[me]]
                a2a.backward(g_mine)
                if not torch.equal(xa.grad, xb.grad):
                    failures.append(f"{label}: gradient != the all-to-all's backward of the all-gather's adjoint")
    return failures


def hierarchical_checks(rank: int, P: int, cache: dict, counter: Counter) -> dict:
    """hierarchical_all_to_all == all_to_all (forward and backward, bitwise) on n x p virtual
    nodes with uneven and zero splits; counts inter-node messages and bytes of both."""
    from tritonmoe.comm import all_to_all, hierarchical_all_to_all, hierarchical_groups

    failures, stats = [], []
    shapes = [(2, P // 2)] + ([(P // 2, 2)] if P // 2 != 2 else [])
    for n, p in shapes:
        hg = hierarchical_groups(p, cache=cache)
        node = lambda r: r // p  # noqa: E731
        for seed in (3, 4):
            S = _split_table(P, 77 * n + seed, zero_rate=0.4 if seed == 4 else 0.2)
            if seed == 4:  # a rank that sends nothing at all
                S[P - 1] = [0] * P
            send = S[rank]
            recv = [S[s][rank] for s in range(P)]
            gen = torch.Generator().manual_seed(seed + 31 * rank)
            x = torch.randn(sum(send), 5, dtype=torch.float64, generator=gen)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            counter.sent.clear()
            counter.phase = "fwd"
            h = hierarchical_all_to_all(xa, send, recv, groups=hg, check=False)
            hier = [s for s in counter.sent if s.dtype == "torch.float64"]
            counter.sent.clear()
            f = all_to_all(xb, send, recv, check=False)
            counter.phase = "off"
            label = f"hierarchical {n}x{p} seed={seed}"
            if not torch.equal(h.detach(), f.detach()):
                failures.append(f"{label}: output differs from the flat all-to-all")
                continue
            gy = torch.randn(f.shape, dtype=torch.float64, generator=gen)
            h.backward(gy)
            f.backward(gy)
            if not torch.equal(xa.grad, xb.grad):
                failures.append(f"{label}: gradient differs from the flat all-to-all's")
            # Inter-node traffic. Flat: this rank sends to every rank of another node it has rows
            # for. Hierarchical: one rail all-to-all (n ranks, one per node) carrying what this
            # rank's node has for the ranks of its local index: sum_i S[(a, i)][(b, j)].
            a, j = divmod(rank, p)
            flat_msgs = sum(1 for d in range(P) if node(d) != node(rank) and send[d] > 0)
            flat_bytes = sum(send[d] for d in range(P) if node(d) != node(rank)) * 5 * 8
            node_to = [sum(S[a * p + i][b * p + j] for i in range(p)) for b in range(n)]
            rail = [s for s in hier if s.op == "all_to_all" and {node(r) for r in s.group} == set(range(n))
                    and len(s.group) == n]
            intra = [s for s in hier if s.op == "all_to_all" and {node(r) for r in s.group} == {a}]
            if [s.bytes for s in rail] != [sum(node_to) * 5 * 8]:
                failures.append(f"{label}: rail all-to-all bytes {[s.bytes for s in rail]} != {sum(node_to) * 40}")
            if len(intra) != 1 or intra[0].bytes != sum(send) * 5 * 8:
                failures.append(f"{label}: intra-node all-to-all {[s.bytes for s in intra]} != [{sum(send) * 40}]")
            stats.append(dict(shape=(n, p), seed=seed, rank=rank, flat_msgs=flat_msgs, flat_bytes=flat_bytes,
                              hier_msgs=sum(1 for b in range(n) if b != a and node_to[b] > 0),
                              hier_bytes=sum(node_to[b] for b in range(n) if b != a) * 5 * 8,
                              rail_calls=len(rail)))
    return dict(failures=failures, stats=stats)


# ---------------------------------------------------------------------------------------------
# Errors: the same clear error on every rank, before any data moves
# ---------------------------------------------------------------------------------------------


def error_checks(rank: int, P: int, cache: dict) -> list[tuple[str, str, str]]:
    """(case, exception type, message) per bad-input case."""
    out = []

    def attempt(name, fn):
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            out.append((name, type(e).__name__, str(e), time.monotonic() - t0))
            return
        out.append((name, None, "", time.monotonic() - t0))

    attempt("n_mp does not divide P", lambda: ParmLayout.make(3, P // 2, 2))
    lay = ParmLayout.make(2, P // 2, 2)
    groups = lay.process_groups(cache=cache)
    attempt("experts do not fit the EP size",
            lambda: tm.MoELayer(tm.MoEConfig(8, 24, P // 2 + 1, 1, parm_schedule="s1"), parm_groups=groups))
    attempt("d_ffn does not divide over ESP",
            lambda: tm.MoELayer(tm.MoEConfig(8, 25, 8, 1, parm_schedule="s1"), parm_groups=groups))
    attempt("config differs on one rank", lambda: tm.MoELayer(
        tm.MoEConfig(8, 24, 8, 1, parm_schedule="s2" if rank == 1 else "s1"), parm_groups=groups))
    # A rank passes other groups than its peers think: rank 0's ESP group is the EP group.
    G = groups
    attempt("mismatched groups", lambda: tm.MoELayer(
        tm.MoEConfig(8, 24, 8, 1, parm_schedule="s1"),
        ep_group=G.ep, mp_group=G.mp, esp_group=G.ep if rank == 0 else G.esp))
    # A layout that differs on one rank.
    other = ParmLayout.make(1 if rank == P - 1 else 2, P // 2, 2)
    attempt("layout differs on one rank", lambda: other.process_groups(cache=cache))
    # From process groups, consistent: the layout read back equals the canonical one.
    torch.manual_seed(0)  # the layer checks that its expert-parallel ranks drew the same init seed
    layer = tm.MoELayer(tm.MoEConfig(8, 24, 8, 1, parm_schedule="s1"), ep_group=G.ep, mp_group=G.mp, esp_group=G.esp)
    got = layer.expert_path.layout
    out.append(("from process groups", None, "same" if got == lay else f"{got} != {lay}", 0.0))
    # From a DeviceMesh: ("ep", "esp") over the ranks as placed, ("dp", "mp") for the dense model.
    for placement in ("esp_inner", "ep_inner"):
        want = ParmLayout.make(2, P // 2, 2, placement=placement)
        moe_mesh, dense_mesh = want.device_meshes("cpu")
        from tritonmoe.parm_layout import ParmGroups

        g2 = ParmGroups.from_device_mesh(moe_mesh, dense_mesh["mp"])
        layer = tm.MoELayer(tm.MoEConfig(8, 24, 8, 1, parm_schedule="s2"), parm_groups=g2)
        got = layer.expert_path.layout
        out.append((f"from a DeviceMesh ({placement})", None, "same" if got == want else f"{got} != {want}", 0.0))
    return out


# ---------------------------------------------------------------------------------------------
# auto, and the simulator's trace of the same schedule
# ---------------------------------------------------------------------------------------------


def auto_and_trace(rank: int, P: int, cache: dict) -> dict:
    from tritonmoe.policy.parm_schedule import step_times

    lay = ParmLayout.make(2, P // 2, 2)
    groups = lay.process_groups(cache=cache)
    i = groups.rank
    g = lay.mp_group[i]
    out = {"auto": None, "trace": {}, "failures": []}
    toks = [10 + 3 * q for q in range(lay.num_batches)]
    for sched in (("auto",) if P <= 4 else ()) + SCHEDULES:
        torch.manual_seed(5)
        cfg = tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 2, capacity_factor=1.5, aux_loss_coef=0.01, parm_schedule=sched)
        layer = tm.MoELayer(cfg, parm_groups=groups, dtype=torch.float64)
        layer.expert_path.trace = []
        torch.manual_seed(1000 + g)
        x = torch.randn(toks[g], D_MODEL, dtype=torch.float64, requires_grad=True)
        y = layer(x)
        if sched == "auto":
            # the fit's probe steps return their gradients: nothing accumulated in the parameters
            out["auto_grads_before_backward"] = [p.grad is None for p in layer.parameters()]
        (y.sum() + layer.aux_loss).backward()
        if sched == "auto":
            out["auto"] = layer.expert_path.schedule_used
            m = layer.expert_path.cost_model
            out["auto_model"] = dict(
                collectives={k: (v.alpha, v.beta) for k, v in m.collectives.items()},
                local=(m.local.alpha, m.local.beta), startup=dict(m.startup),
                rates=(m.flops_per_s, m.copy_bytes_per_s),
                steps={T: step_times(m, cfg, lay, T) for T in (8, 64, 512)},
            )
            continue
        real = [(e.lane, e.op, e.kind, e.phase) for e in layer.expert_path.trace if e.op != "compute"]
        counts = layer.last_routing.counts.tolist()
        out["trace"][sched] = (real, counts)
    return out


def sim_trace_mismatches(values: list[dict], P: int) -> list[str]:
    """Compare each rank's measured communication trace with the simulator's program of the
    same schedule (parent side: the simulator needs every rank's counts)."""
    from tritonmoe.sim.parm_model import parm_step_programs

    lay = ParmLayout.make(2, P // 2, 2)
    toks = [10 + 3 * q for q in range(lay.num_batches)]
    bad = []
    for sched in SCHEDULES:
        cfg = tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 2, capacity_factor=1.5, aux_loss_coef=0.01, parm_schedule=sched)
        bc = []
        for q in range(lay.num_batches):
            members = [j for j in range(P) if lay.mp_group[j] == q]
            per = [values[j]["auto_trace"]["trace"][sched][1] for j in members]
            # S1: each MP rank routed a slice, the batch's counts are their sum; otherwise any copy
            bc.append([sum(c[e] for c in per) for e in range(NUM_EXPERTS)] if sched == "s1" else per[0])
        progs = parm_step_programs(cfg, lay, sched, tokens=toks, batch_counts=bc, host_compute=True)
        for i in range(P):
            sim = [(o.lane, o.op, o.kind, o.phase) for o in progs[i].ops if o.op != "compute"]
            real = [tuple(e) for e in values[i]["auto_trace"]["trace"][sched][0]]
            if sim != real:
                bad.append(f"{sched} rank {i}: real {real} != simulated {sim}")
    return bad


# ---------------------------------------------------------------------------------------------
# One group per world size runs everything
# ---------------------------------------------------------------------------------------------


def parm_table(rank: int, P: int) -> dict:
    cache: dict = {}
    counter = Counter()
    t0 = time.monotonic()
    out = {"cases": [], "timing": {}}
    with counter.installed():
        for case in cases(P):
            out["cases"].append(run_case(rank, P, case, cache, counter))
        out["timing"]["cases"] = time.monotonic() - t0
        t1 = time.monotonic()
        out["saa"] = saa_checks(rank, P, cache)
        out["hier"] = hierarchical_checks(rank, P, cache, counter)
        out["timing"]["comm"] = time.monotonic() - t1
    t2 = time.monotonic()
    out["errors"] = error_checks(rank, P, cache)
    out["auto_trace"] = auto_and_trace(rank, P, cache)
    out["timing"]["rest"] = time.monotonic() - t2
    return out


# ---------------------------------------------------------------------------------------------
# Fault: a rank dies during SAA
# ---------------------------------------------------------------------------------------------


def saa_peer_exit(rank: int, P: int, victim: int) -> dict:
    """Rank ``victim`` exits in the middle of S2's SAA (after its first point-to-point batch);
    the others report how their step ended and how long it took."""
    from tritonmoe.comm import executor as executor_mod

    lay = ParmLayout.make(2, P, 1)
    groups = lay.process_groups()
    cfg = tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 2, parm_schedule="s2")
    torch.manual_seed(0)
    layer = tm.MoELayer(cfg, parm_groups=groups, dtype=torch.float64)
    torch.manual_seed(10 + lay.mp_group[groups.rank])
    x = torch.randn(12, D_MODEL, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()  # a healthy step first
    if rank == victim:
        real = executor_mod.RealExecutor.send_recv
        calls = []

        def die_mid_saa(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os._exit(3)
            return real(self, *args, **kwargs)

        executor_mod.RealExecutor.send_recv = die_mid_saa
    t0 = time.monotonic()
    try:
        layer(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - the survivor's outcome is the result
        return {"raised": type(e).__name__, "message": str(e)[:300], "elapsed": time.monotonic() - t0}
    return {"raised": None, "elapsed": time.monotonic() - t0}
