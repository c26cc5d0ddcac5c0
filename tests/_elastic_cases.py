"""Per-rank bodies of the elastic multi-task tests (tests/test_elastic.py; spawned gloo groups).

Two tasks with different models train data-parallel on their own rank blocks (gradients reduced
with tritonmoe.comm.bucketed_all_reduce over the task's group, divided by its size). Reference:
each task's model trained in one process on the task's whole batch. After one step the ranks are
re-allocated from measured throughput (3/1 -> 2/2: rank 2 changes task) through the checkpoint
path, and a second step continues; every rank must match its task's single-process run.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from tritonmoe.comm import bucketed_all_reduce
from tritonmoe.parallel import allocate_tasks, reallocate, task_layout

F64 = torch.float64
BATCH = 12  # per task and step: divisible by every task size used


def build_model(task: int) -> nn.Module:
    torch.manual_seed(100 + task)
    if task == 0:
        return nn.Sequential(nn.Linear(4, 3, dtype=F64), nn.Tanh(), nn.Linear(3, 2, dtype=F64))
    return nn.Sequential(nn.Linear(4, 2, dtype=F64))


def build(task: int, _layout=None):
    m = build_model(task)
    return m, torch.optim.Adam(m.parameters(), lr=0.05)


def data(task: int, step: int):
    g = torch.Generator().manual_seed(1000 * task + step)
    return torch.randn(BATCH, 4, dtype=F64, generator=g), torch.randn(BATCH, 2, dtype=F64, generator=g)


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference(task: int, steps: int):
    """(params after each step, gradients of each step, optimizer states after each step)."""
    m, opt = build(task)
    params, grads, states = [], [], []
    for s in range(steps):
        opt.zero_grad()
        x, y = data(task, s)
        loss_fn(m, x, y).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        opt.step()
        params.append([p.detach().clone() for p in m.parameters()])
        states.append([{k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()])
    return params, grads, states


def dp_step(layout, model, opt, step: int):
    """One data-parallel step of this rank's task; returns the reduced gradients."""
    g = layout.task_size
    x, y = data(layout.task, step)
    lo = layout.rank_in_task * (BATCH // g)
    opt.zero_grad()
    loss_fn(model, x[lo : lo + BATCH // g], y[lo : lo + BATCH // g]).backward()  # the mean over the rank's slice
    red = bucketed_all_reduce([p.grad for p in model.parameters()], layout.group, 256)
    for p, r in zip(model.parameters(), red):
        p.grad.copy_(r / g)  # the mean over the task's ranks: the task's mean loss
    opt.step()
    return [p.grad.clone() for p in model.parameters()]


def _close(a, b, tol=1e-12):
    return a.shape == b.shape and (a - b).abs().max().item() <= tol


def elastic_case(rank: int, P: int) -> dict:
    failures: list[str] = []
    refs = {t: reference(t, 2) for t in range(2)}
    layout = task_layout(allocate_tasks([3, 1], P))
    model, opt = build(layout.task)
    grads = dp_step(layout, model, opt, 0)
    want = refs[layout.task]
    for i, (g, w) in enumerate(zip(grads, want[1][0])):
        if not _close(g, w):
            failures.append(f"task {layout.task} step 0: gradient {i} differs from the single-task run")
    first = (layout.task, layout.task_size)
    ckdir = os.path.join(tempfile.gettempdir(), f"tm_elastic_{os.getppid()}")
    # unchanged allocation: nothing moves, the same objects come back
    same = reallocate(layout, model, opt, samples_per_step=[BATCH, BATCH], samples_per_s=10.0,  # loads 3.6 : 1.2
                      checkpoint_dir=ckdir + "_same", build=build)
    if same[0] is not layout or same[1] is not model or os.path.exists(ckdir + "_same"):
        failures.append("an unchanged allocation regrouped or wrote a checkpoint")
    # measured: task 0 at 30 samples/s on 3 ranks, task 1 at 10 on 1 -> equal per-GPU rates -> 2/2
    rate = 30.0 if layout.task == 0 else 10.0
    layout2, model2, opt2 = reallocate(layout, model, opt, samples_per_step=[BATCH, BATCH], samples_per_s=rate,
                                       checkpoint_dir=ckdir, build=build)
    want = refs[layout2.task]
    for i, (p, w) in enumerate(zip(model2.parameters(), want[0][0])):
        if not _close(p.detach(), w):
            failures.append(f"rank {rank} after reallocation: parameter {i} of task {layout2.task} not carried over")
        st = opt2.state[p]
        for k, v in want[2][0][i].items():
            if k not in st or not _close(st[k].reshape(v.shape).to(v.dtype), v):
                failures.append(f"rank {rank} after reallocation: optimizer state {k} of parameter {i} not carried over")
    grads = dp_step(layout2, model2, opt2, 1)
    for i, (g, w) in enumerate(zip(grads, want[1][1])):
        if not _close(g, w):
            failures.append(f"task {layout2.task} step 1 after reallocation: gradient {i} differs from the single-task run")
    for i, (p, w) in enumerate(zip(model2.parameters(), want[0][1])):
        if not _close(p.detach(), w):
            failures.append(f"task {layout2.task} step 1 after reallocation: parameter {i} differs from the single-task run")
    return {"failures": failures, "before": first, "after": (layout2.task, layout2.task_size),
            "allocation": layout2.allocation, "kept_objects": model2 is model}


# ---------------------------------------------------------------------------------------------
# Experts shared by the tasks: one MoE layer expert-parallel over every rank, a head per task
# ---------------------------------------------------------------------------------------------


def _moe_cfg():
    import tritonmoe as tm

    return tm.MoEConfig(4, 6, 4, 2, activation="gelu", expert_ffn_bias=True)


def _forward(shared, head, x):
    return head(x + shared(x))


def shared_experts_case(rank: int, P: int) -> dict:
    import tritonmoe as tm
    from tritonmoe.parallel import MoEMesh, sync_gradients

    failures: list[str] = []
    cfg = _moe_cfg()
    # reference: one process, every expert, both heads, loss = sum over tasks of the task's mean loss
    torch.manual_seed(7)
    ref_shared = tm.MoELayer(cfg, dtype=F64)
    ref_heads = [build_model(t) for t in range(2)]
    total = sum(loss_fn(lambda x, t=t: _forward(ref_shared, ref_heads[t], x), *data(t, 0)) for t in range(2))
    total.backward()
    mesh = MoEMesh.build(dp=1, ep=P)
    torch.manual_seed(7)
    shared = tm.MoELayer(cfg, mesh=mesh, dtype=F64)
    layout = task_layout(allocate_tasks([3, 1], P))
    head = build_model(layout.task)
    g = layout.task_size
    x, y = data(layout.task, 0)
    lo = layout.rank_in_task * (BATCH // g)
    loss = loss_fn(lambda z: _forward(shared, head, z), x[lo : lo + BATCH // g], y[lo : lo + BATCH // g])
    (loss * layout.loss_scale).backward()
    expert_names = set(shared.expert_parameter_names)
    dense = [p for n, p in shared.named_parameters() if n not in expert_names]
    sync_gradients(layout, list(head.parameters()), dense, bucket_bytes=128)
    for (n, p), w in zip(head.named_parameters(), ref_heads[layout.task].parameters()):
        if not _close(p.grad, w.grad):
            failures.append(f"task {layout.task} head {n}: gradient differs from the single process")
    ref_params = dict(ref_shared.named_parameters())
    for n, p in shared.named_parameters():
        w = ref_params[n].grad
        if n in expert_names:
            w = w[shared.expert_start : shared.expert_start + shared.num_local_experts]
        if p.grad is None or not _close(p.grad, w):
            failures.append(f"shared {n}: gradient differs from the single process")
    return {"failures": failures, "experts": shared.num_local_experts, "dense": [n for n, _ in shared.named_parameters()
                                                                                 if n not in expert_names]}
