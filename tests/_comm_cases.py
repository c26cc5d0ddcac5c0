"""Per-rank bodies of the tritonmoe.comm tests (run by tests/test_comm.py in one spawned gloo
group; see tests/_dist.py). Every rank builds every rank's inputs from seeds, so it knows
exactly what it must receive and which gradients must come back."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tritonmoe import reference
from tritonmoe.comm import (
    AllToAllDispatcher,
    SplitMismatchError,
    Timeline,
    all_to_all,
    exchange_counts,
)
from tritonmoe.layer import _micro_batch_bounds


def send_table(P: int) -> list[list[int]]:
    """Rows rank s sends to rank d: uneven, with zeros, and rank 1 -> rank 0 at least 1."""
    return [[(s * 5 + d * 3 + 1) % 4 for d in range(P)] for s in range(P)]


def _rows(r: int, n: int, width: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + r)
    return torch.randn(n, width, generator=g, dtype=torch.float64)


def _check(failures: list[str], label: str, ok: bool) -> None:
    if not ok:
        failures.append(label)


def all_to_all_checks(rank: int, P: int, failures: list[str]) -> None:
    """Uneven splits: exact rows received; backward = the reverse exchange (exact gradients)."""
    S = send_table(P)
    xs = [_rows(r, sum(S[r])) for r in range(P)]
    start = [[sum(S[s][:d]) for d in range(P)] for s in range(P)]  # where s's chunk for d starts
    send, recv = S[rank], [S[s][rank] for s in range(P)]
    x = xs[rank].clone().requires_grad_()
    out = all_to_all(x, send, recv)
    want = torch.cat([xs[s][start[s][rank] : start[s][rank] + S[s][rank]] for s in range(P)])
    _check(failures, "all_to_all: received rows", torch.equal(out, want))
    grads = [_rows(100 + r, sum(S[s][r] for s in range(P))) for r in range(P)]
    (out * grads[rank]).sum().backward()
    # My chunk for rank d sits in d's output after the chunks of ranks < me.
    want_grad = torch.cat(
        [grads[d][sum(S[s][d] for s in range(rank)) :][: S[rank][d]] for d in range(P)]
    )
    _check(failures, "all_to_all: gradient is the reverse exchange", torch.equal(x.grad, want_grad))
    derived = all_to_all(xs[rank], send)  # output splits derived by exchanging the input splits
    _check(failures, "all_to_all: derived output splits", torch.equal(derived, want))
    wide = all_to_all(xs[rank].view(-1, 1, 3).expand(-1, 2, 3), send, recv)  # rows of [2, 3], non-contiguous
    _check(failures, "all_to_all: multi-dim rows", torch.equal(wide, want.view(-1, 1, 3).expand(-1, 2, 3)))


def mismatch_checks(rank: int, P: int, failures: list[str]) -> list[dict]:
    """Caller splits that disagree, in each direction: the same SplitMismatchError on every rank,
    quickly, and the group stays usable afterwards."""
    S = send_table(P)
    base_send, base_recv = S[rank], [S[s][rank] for s in range(P)]
    scenarios = []

    def expects_more(send, recv):  # rank 0 expects one row more from rank 1 than it sends
        return send, [v + 1 if (rank, s) == (0, 1) else v for s, v in enumerate(recv)]

    def expects_fewer(send, recv):  # rank 0 expects one row fewer from rank 1
        return send, [v - 1 if (rank, s) == (0, 1) else v for s, v in enumerate(recv)]

    def sends_more(send, recv):  # rank 1 sends one row more to rank 0 than rank 0 expects
        return [v + 1 if (rank, d) == (1, 0) else v for d, v in enumerate(send)], recv

    def wrong_length(send, recv):  # rank 2 passes one output split too few
        return send, (recv[:-1] if rank == 2 else recv)

    for name, make in (
        ("expects_more", expects_more),
        ("expects_fewer", expects_fewer),
        ("sends_more", sends_more),
        ("wrong_length", wrong_length),
    ):
        send, recv = make(list(base_send), list(base_recv))
        x = _rows(rank, sum(send))
        t0 = time.monotonic()
        try:
            all_to_all(x, send, recv)
            scenarios.append({"name": name, "raised": None})
        except SplitMismatchError as e:
            scenarios.append(
                {
                    "name": name,
                    "raised": "SplitMismatchError",
                    "is_value_error": isinstance(e, ValueError),
                    "message": str(e),
                    "offending": list(e.offending_ranks),
                    "elapsed": time.monotonic() - t0,
                }
            )
        healthy = all_to_all(_rows(rank, sum(base_send)), base_send, base_recv)
        _check(failures, f"group usable after {name}", healthy.shape[0] == sum(base_recv))
    return scenarios


def counts_checks(rank: int, P: int, failures: list[str]) -> dict:
    """exchange_counts: the plan's splits and received counts match every sender's counts."""
    N, E = 3, 2 * P
    L = E // P
    counts = [torch.randint(0, 4, (N, E), generator=torch.Generator().manual_seed(200 + r)) for r in range(P)]
    plan = exchange_counts(counts[rank].to(torch.int32))
    for i in range(N):
        want_send = [int(counts[rank][i, d * L : (d + 1) * L].sum()) for d in range(P)]
        want_recv_counts = torch.stack([counts[s][i, rank * L : (rank + 1) * L] for s in range(P)])
        _check(failures, f"plan.send_splits[{i}]", plan.send_splits[i] == want_send)
        _check(failures, f"plan.recv_counts[{i}]", torch.equal(plan.recv_counts[i], want_recv_counts.long()))
        _check(failures, f"plan.recv_splits[{i}]", plan.recv_splits[i] == want_recv_counts.sum(1).tolist())
    return {"send": plan.send_splits, "recv": plan.recv_splits}


def _routed(rank: int, P: int, T: int, k: int, seed: int):
    """x [T, 4] fp64 and a capacity-limited routing (some slots dropped: id -1, weight 0)."""
    E = 2 * P
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(T, 4, generator=g, dtype=torch.float64)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    routing = reference.route(logits, k, capacity=max(1, T // 2))
    return x, routing


def round_trip_checks(rank: int, P: int, failures: list[str], backend: str) -> None:
    """dispatch -> identity expert -> combine returns every permuted row unchanged, so the
    unpermuted output is x times the sum of its kept weights; the expert-major re-layout puts
    each local expert's rows in its segment. Blocking steps and the pipelined schedule."""
    E = 2 * P
    T = (7, 0, 5, 9)[rank % 4]
    x, routing = _routed(rank, P, T, 2, seed=300)
    disp = AllToAllDispatcher(E, backend=backend)
    x_perm, info = reference.permute(x, routing.topk_ids, E)
    # Tag every permuted row with its global expert id, to check where rows land.
    tag_perm = torch.repeat_interleave(torch.arange(E, dtype=torch.float64), info.counts.long()).view(-1, 1)
    plan = disp.exchange_counts(info.counts)
    recv = disp.dispatch(torch.cat([x_perm, tag_perm], 1), plan)
    xe = disp.to_expert_major(recv, plan)
    offs = disp.expert_offsets(plan).tolist()
    for e in range(disp.num_local_experts):
        seg = xe[offs[e] : offs[e + 1], -1]
        _check(failures, f"{backend}: expert-major segment {e}", bool((seg == disp.local_expert_start + e).all()))
    back = disp.combine(disp.to_source_major(xe, plan), plan)
    _check(failures, f"{backend}: round trip returns the rows", torch.equal(back[:, :-1], x_perm))
    out = reference.unpermute(back[:, :-1].contiguous(), info, routing.topk_weights)
    want = x * routing.topk_weights.sum(-1, keepdim=True)
    _check(failures, f"{backend}: out == x * sum(kept weights)", torch.allclose(out, want, rtol=1e-12, atol=1e-12))

    # The same through the pipelined schedule, 3 micro-ops, identity expert, with gradients.
    xg = x.clone().requires_grad_()
    bounds = _micro_batch_bounds(T, 3)
    sends, infos = [], []
    for a, b in bounds:
        xp, inf = reference.permute(xg[a:b], routing.topk_ids[a:b], E)
        sends.append(xp)
        infos.append(inf)
    plan3 = disp.exchange_counts(torch.stack([inf.counts for inf in infos]))
    backs = disp.run_pipelined(sends, plan3, lambda i, r, params, wgrad: r)
    for i, (s, bk) in enumerate(zip(sends, backs)):
        _check(failures, f"{backend}: pipelined round trip micro-op {i}", torch.equal(bk, s.detach()))
    out3 = torch.cat([reference.unpermute(bk, inf, routing.topk_weights[a:b]) for bk, inf, (a, b) in zip(backs, infos, bounds)])
    out3.sum().backward()
    kept = routing.topk_weights.sum(-1, keepdim=True).expand(-1, 4)
    _check(failures, f"{backend}: pipelined x.grad == sum(kept weights)", torch.allclose(xg.grad, kept, rtol=1e-12, atol=1e-12))


def _sin_expert(disp: AllToAllDispatcher, plan):
    """A row-independent expert: y = sin(x) * (1 + local expert index), on the expert-major rows."""

    def fn(i, recv, params, wgrad):
        xe = disp.to_expert_major(recv, plan, i)
        counts = plan.recv_counts[i].sum(0)
        scale = 1.0 + torch.repeat_interleave(torch.arange(disp.num_local_experts, dtype=xe.dtype), counts)
        return disp.to_source_major(torch.sin(xe) * scale[:, None], plan, i)

    return fn


def _ffn_expert(disp: AllToAllDispatcher, plan, activation: str):
    """The layer's expert compute: grouped FFN on the expert-major rows."""

    def fn(i, recv, params, wgrad):
        w1, w2 = params
        xe = disp.to_expert_major(recv, plan, i)
        y = reference.grouped_ffn(xe, disp.expert_offsets(plan, i), w1, w2, activation, wgrad=wgrad)
        return disp.to_source_major(y, plan, i)

    return fn


def _block(disp, x, routing, n: int, make_expert, params, timeline=None):
    """Route-free expert-parallel block (permute, pipelined exchange, unpermute) at degree n."""
    E = disp.num_experts
    bounds = _micro_batch_bounds(x.shape[0], n)
    sends, infos = [], []
    for a, b in bounds:
        xp, inf = reference.permute(x[a:b], routing.topk_ids[a:b], E)
        sends.append(xp)
        infos.append(inf)
    plan = disp.exchange_counts(torch.stack([inf.counts for inf in infos]))
    disp.timeline = timeline
    backs = disp.run_pipelined(sends, plan, make_expert(disp, plan), params)
    disp.timeline = None
    w = routing.topk_weights
    return torch.cat([reference.unpermute(bk, inf, w[a:b]) for bk, inf, (a, b) in zip(backs, infos, bounds)])


def pipeline_checks(rank: int, P: int, failures: list[str]) -> dict:
    """Pipelining changes the schedule, not the result: with a row-independent expert every
    output and every gradient is bitwise identical for n = 1, 2, 3, 5; so it is with the fp64
    grouped FFN (row-invariant reference GEMMs, weight gradients deferred to one W step)."""
    E = 2 * P
    T = (11, 4, 0, 9)[rank % 4]
    x0, routing0 = _routed(rank, P, T, 2, seed=400)
    disp = AllToAllDispatcher(E)
    g_out = _rows(500 + rank, T, 4)
    runs = {}
    for n in (1, 2, 3, 5):
        x = x0.clone().requires_grad_()
        w = routing0.topk_weights.clone().requires_grad_()
        routing = type(routing0)(routing0.topk_ids, w, routing0.counts, routing0.selected_counts)
        out = _block(disp, x, routing, n, _sin_expert, ())
        (out * g_out).sum().backward()
        runs[n] = (out.detach(), x.grad, w.grad)
    for n in (2, 3, 5):
        for name, a, b in zip(("out", "x.grad", "weights.grad"), runs[n], runs[1]):
            _check(failures, f"row-independent expert n={n}: {name} bitwise equal to n=1", torch.equal(a, b))

    L = E // P
    g = torch.Generator().manual_seed(600)
    w1_full = torch.randn(E, 4, 6, generator=g, dtype=torch.float64) * 0.3
    w2_full = torch.randn(E, 6, 4, generator=g, dtype=torch.float64) * 0.3
    effs = {}
    for n in (1, 2, 3):
        x = x0.clone().requires_grad_()
        w1 = w1_full[rank * L : (rank + 1) * L].clone().requires_grad_()
        w2 = w2_full[rank * L : (rank + 1) * L].clone().requires_grad_()
        tl = Timeline()
        out = _block(disp, x, routing0, n, lambda d, p: _ffn_expert(d, p, "gelu"), (w1, w2), timeline=tl)
        (out * g_out).sum().backward()
        runs[("ffn", n)] = (out.detach(), x.grad, w1.grad, w2.grad)
        effs[n] = tl.pipeline_efficiency()
        kinds = [s.kind for s in tl.spans("fwd")]
        _check(failures, f"timeline n={n}: {n} dispatch/expert/combine spans", kinds.count("expert") == n)
        _check(failures, f"timeline n={n}: partition spans", kinds.count("partition") == 2 * n)
    for n in (2, 3):
        for name, a, b in zip(("out", "x.grad", "w1.grad", "w2.grad"), runs[("ffn", n)], runs[("ffn", 1)]):
            _check(failures, f"grouped-FFN expert n={n}: {name} bitwise equal to n=1", torch.equal(a, b))
    return effs


def subgroup_checks(rank: int, P: int, failures: list[str]) -> None:
    """A process group that is not the world: ranks {0, P-1}; group ranks, not global ranks,
    index the splits and the expert ownership."""
    members = [0, P - 1]
    sub = dist.new_group(members)  # collective over the world: every rank calls it
    if rank not in members:
        return
    me = members.index(rank)
    send = [1, 2] if me == 0 else [3, 0]
    x = _rows(rank, sum(send))
    out = all_to_all(x, send, group=sub)  # output splits derived inside the sub-group
    want_rows = [1, 3] if me == 0 else [2, 0]
    _check(failures, "sub-group all_to_all rows", out.shape[0] == sum(want_rows))
    disp = AllToAllDispatcher(4, sub)
    _check(failures, "sub-group expert ownership", disp.local_expert_start == 2 * me)
    xr, routing = _routed(rank, P, 6, 2, seed=700)
    xr = xr[:, :4]
    x_perm, info = reference.permute(xr, routing.topk_ids % 4, 4)
    plan = disp.exchange_counts(info.counts)
    back = disp.combine(disp.to_source_major(disp.to_expert_major(disp.dispatch(x_perm, plan), plan), plan), plan)
    _check(failures, "sub-group round trip", torch.equal(back, x_perm))


def comm_table(rank: int, P: int) -> dict:
    failures: list[str] = []
    all_to_all_checks(rank, P, failures)
    scenarios = mismatch_checks(rank, P, failures)
    plan = counts_checks(rank, P, failures)
    round_trip_checks(rank, P, failures, backend="torch")
    round_trip_checks(rank, P, failures, backend="triton")  # copy_segments in Triton's interpreter
    effs = pipeline_checks(rank, P, failures)
    subgroup_checks(rank, P, failures)
    return {"failures": failures, "mismatch": scenarios, "plan": plan, "efficiency": effs}
