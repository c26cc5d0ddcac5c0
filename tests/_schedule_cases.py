"""Per-rank bodies of tests/test_schedule.py (spawned gloo groups, see tests/_dist.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import tritonmoe as tm
from tritonmoe.comm import VirtualTensor, plan_from_counts
from tritonmoe.comm.programs.pipeline import backward_pass, forward_pass
from tritonmoe.experts import micro_batch_bounds
from tritonmoe.plan import SimExecutor, VirtualGroup

D, F, E = 6, 5, 6
TOKENS = {3: (7, 0, 12)}


def _counts_NE(topk_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Rows per (micro-batch, expert) as the expert path's permute counts them."""
    rows = []
    for a, b in micro_batch_bounds(topk_ids.shape[0], n):
        ids = topk_ids[a:b].reshape(-1).long()
        ids = ids[ids >= 0]
        rows.append(torch.bincount(ids, minlength=E))
    return torch.stack(rows)


def swap_executors(rank: int, P: int) -> dict:
    """The real executor inside the expert-parallel layer and the simulated executor running the
    same schedule functions on the same plan issue the same operations per lane, in the same
    order; the simulator's plan, rebuilt from every rank's counts, equals the exchanged one."""
    out = {}
    for n in (1, 2, 4):
        torch.manual_seed(5)
        cfg = tm.MoEConfig(D, F, E, 2, pipeline_degree=n)
        layer = tm.MoELayer(cfg, ep_group=dist.group.WORLD, dtype=torch.float64)
        layer.expert_path.trace = []
        x = torch.randn(TOKENS[P][rank], D, dtype=torch.float64, requires_grad=True)
        layer(x).sum().backward()
        real = layer.expert_path.trace

        counts = _counts_NE(layer.last_routing.topk_ids, n)
        table = [torch.empty_like(counts) for _ in range(P)]
        dist.all_gather(table, counts)
        plan = plan_from_counts(torch.stack(table), rank)
        exchanged = layer.dispatcher.exchange_counts(counts)
        same_plan = (
            plan.send_splits == exchanged.send_splits
            and plan.recv_splits == exchanged.recv_splits
            and torch.equal(plan.recv_counts, exchanged.recv_counts)
        )

        world = VirtualGroup(tuple(range(P)))
        ex = SimExecutor(rank, world, host_compute=True)
        sends = [VirtualTensor((plan.send_rows(i), D), torch.float64) for i in range(n)]
        like = lambda i: VirtualTensor((plan.recv_rows(i), D), torch.float64)  # noqa: E731
        backs = forward_pass(ex, sends, plan, None, out_like=like)
        ex.phase = "bwd"
        backward_pass(ex, backs, plan, None, out_like=like)
        sim_order = ex.lane_order()
        real_order = {}
        for e in real:
            real_order.setdefault(e.lane, []).append((e.op, e.kind, e.micro_op, e.phase))
        out[n] = dict(same_plan=same_plan, real=real_order, sim=sim_order, n_ops=len(ex.program.ops))
    return out
