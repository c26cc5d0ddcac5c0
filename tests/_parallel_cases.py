"""Per-rank bodies of the data-parallel x expert-parallel tests (run by tests/test_parallel.py in
spawned gloo groups; see tests/_dist.py).

Reference design: every rank builds, from one seed, the distributed model (MoE layers on a
:class:`MoEMesh`) and a single-process model holding every expert; thanks to the
layout-independent initialization they start with the same global weights, with no copying.
Rank r trains on batch r (the mean loss over its tokens); the reference trains on the
concatenation of every rank's batch (the mean loss over all tokens, equal token counts per
rank). After the optimizer step every dense parameter must equal the reference's and every
local expert the reference's expert of the same global index, to 1e-12 in fp64.

Communication is observed, not reported: :class:`Recorder` wraps ``torch.distributed``'s
``all_reduce`` and ``all_to_all_single`` in the rank's process and records the group, the bytes,
the buffer address and the start and end of every call, so the tests count micro-op sizes and
boundaries and check the schedule's ordering from what actually went to the backend.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import tritonmoe as tm
from tritonmoe.parallel import (
    ExpertParallelWrapError,
    MoEMesh,
    data_parallel,
    full_state_dict,
    fully_shard_moe,
    load_full_state_dict,
)

D_MODEL, D_FFN, NUM_EXPERTS, OUT = 8, 6, 8, 3
F64 = torch.float64
TOL = 1e-12
SEED = 7
TOKENS = 5  # per rank


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class Net(nn.Module):
    """dense -> MoE -> dense -> MoE (pipelined when expert-parallel) -> dense, fp64."""

    def __init__(self, mesh=None, *, pipeline_degree: int = 2, sleeper=None) -> None:
        super().__init__()
        c1 = tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 2, activation="swiglu")
        ep = mesh is not None and mesh.size("ep") > 1
        c2 = tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 2, activation="gelu", pipeline_degree=pipeline_degree if ep else 1)
        self.inp = nn.Linear(D_MODEL, D_MODEL, dtype=F64)
        self.moe1 = tm.MoELayer(c1, mesh=mesh, dtype=F64)
        self.mid = nn.Linear(D_MODEL, D_MODEL, dtype=F64)
        self.moe2 = tm.MoELayer(c2, mesh=mesh, dtype=F64)
        self.out = nn.Linear(D_MODEL, OUT, dtype=F64)
        self.sleeper = sleeper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.moe1(h)
        if self.sleeper is not None:
            h = _Sleep.apply(h, self.sleeper)
        h = torch.tanh(self.mid(h))
        h = h + self.moe2(h)
        return self.out(h)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward call ``sleeper()`` (random delays on one rank)."""

    @staticmethod
    def forward(ctx, x, sleeper):
        ctx.sleeper = sleeper
        sleeper()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.sleeper()
        return g, None


def batches(P: int, steps: int = 1, seed: int = 1):
    """Per step, every rank's (inputs, targets) ([TOKENS, d], [TOKENS, OUT])."""
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(TOKENS, D_MODEL, dtype=F64, generator=g), torch.randn(TOKENS, OUT, dtype=F64, generator=g)) for _ in range(P)]
        for _ in range(steps)
    ]


def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


def reference_params(steps_data, lr: float = 0.1, optim=torch.optim.SGD) -> dict[str, torch.Tensor]:
    """The single-process model trained on the concatenated global batches."""
    torch.manual_seed(SEED)
    ref = Net(None)
    opt = optim(ref.parameters(), lr=lr)
    for data in steps_data:
        opt.zero_grad()
        loss_fn(ref(torch.cat([x for x, _ in data])), torch.cat([t for _, t in data])).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def local_view(model: Net, name: str, full: torch.Tensor) -> torch.Tensor:
    """The part of a global parameter ``full`` this rank holds under ``name``."""
    layer_name, _, pname = name.rpartition(".")
    layer = model.get_submodule(layer_name) if layer_name else model
    if isinstance(layer, tm.MoELayer) and pname in layer.expert_parameter_names:
        return full[layer.expert_start : layer.expert_start + layer.num_local_experts]
    return full


def compare(failures: list, label: str, model: Net, want: dict, *, exact: bool = False, tol: float = TOL) -> None:
    for n, p in model.named_parameters():
        w = local_view(model, n, want[n])
        got = p.detach()
        if hasattr(got, "full_tensor"):  # FSDP: compare the whole (unsharded) parameter
            got = got.full_tensor()
        if got.shape != w.shape:
            failures.append(f"{label}: {n} shape {tuple(got.shape)} != {tuple(w.shape)}")
            continue
        diff = (got - w).abs().max().item() if got.numel() else 0.0
        if (exact and not torch.equal(got, w)) or diff > tol:
            failures.append(f"{label}: {n} differs by {diff:.3g}{' (bitwise required)' if exact else ''}")


# ---------------------------------------------------------------------------------------------
# Observing what reaches the backend
# ---------------------------------------------------------------------------------------------


@dataclass
class Call:
    op: str
    ranks: tuple
    nbytes: int
    ptr: int
    start: float
    end: float = float("nan")
    thread: str = ""


@dataclass
class Recorder:
    """Wraps torch.distributed.all_reduce / all_to_all_single in this process (see the module
    docstring). ``sleep`` (optional) is called before every all_reduce (delays on one rank)."""

    calls: list = field(default_factory=list)
    sleep: Optional[object] = None
    _saved: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> "Recorder":
        self._saved = {"all_reduce": dist.all_reduce, "all_to_all_single": dist.all_to_all_single}
        real_ar, real_a2a = self._saved["all_reduce"], self._saved["all_to_all_single"]

        def ranks(group):
            return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if self.sleep is not None:
                self.sleep()
            c = Call("all_reduce", ranks(group), tensor.numel() * tensor.element_size(), tensor.data_ptr(), time.perf_counter(),
                     thread=threading.current_thread().name)
            work = real_ar(tensor, op=op, group=group, async_op=async_op)
            self._close(c, work, async_op)
            return work

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            c = Call("all_to_all", ranks(group), input.numel() * input.element_size(), input.data_ptr(), time.perf_counter(),
                     thread=threading.current_thread().name)
            work = real_a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
            self._close(c, work, async_op)
            return work

        dist.all_reduce = all_reduce
        dist.all_to_all_single = all_to_all_single
        return self

    def _close(self, c: Call, work, async_op: bool) -> None:
        with self._lock:
            self.calls.append(c)
        if async_op and work is not None:
            work.get_future().add_done_callback(lambda _f: setattr(c, "end", time.perf_counter()))
        else:
            c.end = time.perf_counter()

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._saved["all_reduce"]
        dist.all_to_all_single = self._saved["all_to_all_single"]

    def clear(self) -> None:
        with self._lock:
            self.calls = []


def grad_ranges(model: nn.Module) -> list[tuple[int, int, str]]:
    """(first byte address, end address, name) of every parameter's gradient."""
    out = []
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None and g.numel():
            out.append((g.data_ptr(), g.data_ptr() + g.numel() * g.element_size(), n))
    return out


def check_micro_ops(failures: list, label: str, calls: list, ranges: list, chunk_bytes: Optional[int]) -> dict:
    """Every gradient all_reduce lies inside one gradient (Lina) and is at most chunk_bytes; the
    calls tile every reduced gradient exactly once. Returns counts for the parent."""
    reds = [c for c in calls if c.op == "all_reduce"]
    covered: dict[str, int] = {}
    spans_two = 0
    for c in reds:
        lo, hi = c.ptr, c.ptr + c.nbytes
        inside = [n for a, b, n in ranges if a <= lo and hi <= b]
        touching = [n for a, b, n in ranges if lo < b and a < hi]
        if len(touching) > 1:
            spans_two += 1
        if chunk_bytes is not None:
            if c.nbytes > chunk_bytes:
                failures.append(f"{label}: a gradient micro-op of {c.nbytes} bytes > chunk_bytes={chunk_bytes}")
            if len(inside) != 1:
                failures.append(f"{label}: a gradient micro-op [{lo:#x}, {hi:#x}) spans {touching}")
        for a, b, n in ranges:
            overlap = min(b, hi) - max(a, lo)
            if overlap > 0:
                covered[n] = covered.get(n, 0) + overlap
    for a, b, n in ranges:
        if n in covered and covered[n] != b - a:
            failures.append(f"{label}: gradient {n} covered {covered[n]} of {b - a} bytes")
    return {"micro_ops": len(reds), "spans_two": spans_two, "max_bytes": max((c.nbytes for c in reds), default=0),
            "reduced": sorted(covered)}


def check_priority(failures: list, label: str, calls: list) -> dict:
    """No gradient all_reduce starts while an all-to-all is in flight; gradient micro-ops never
    overlap each other (one at a time)."""
    a2a = [(c.start, c.end) for c in calls if c.op == "all_to_all"]
    reds = sorted((c.start, c.end) for c in calls if c.op == "all_reduce")
    bad = [s for s, _ in reds for a, b in a2a if a < s < b]
    if bad:
        failures.append(f"{label}: {len(bad)} gradient micro-op(s) started while an all-to-all was in flight")
    for (s1, e1), (s2, _) in zip(reds, reds[1:]):
        if s2 < e1:
            failures.append(f"{label}: two gradient micro-ops on the network at once")
            break
    return {"a2a": len(a2a), "allreduce": len(reds)}


# ---------------------------------------------------------------------------------------------
# Training steps
# ---------------------------------------------------------------------------------------------


def train(rank: int, mesh: MoEMesh, steps_data, *, comm: str, reduction: str = "allreduce", chunk_bytes=None,
          recorder: Optional[Recorder] = None, sleeper=None, lr: float = 0.1):
    """The distributed model after ``len(steps_data)`` steps; its gradients are those of the last."""
    torch.manual_seed(SEED)
    model = Net(mesh, sleeper=sleeper)
    ddp = data_parallel(model, mesh, comm=comm, chunk_bytes=chunk_bytes, reduction=reduction, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for data in steps_data:
        opt.zero_grad()
        if recorder is not None:
            recorder.clear()
        x, t = data[rank]
        loss_fn(ddp(x), t).backward()
        opt.step()
    ddp._tritonmoe_data_parallel.scheduler.close()
    return model


def accumulation(rank: int, mesh: MoEMesh, failures: list, label: str) -> None:
    """Two micro-steps, the first under ``ddp.no_sync()`` (gradients accumulate locally, no
    communication, experts' hooks skip too), then one optimizer step: equals the single process
    stepping on the sum of the two global mean losses."""
    data = batches(dist.get_world_size(), steps=2, seed=5)
    torch.manual_seed(SEED)
    ref = Net(None)
    for d in data:
        loss_fn(ref(torch.cat([x for x, _ in d])), torch.cat([t for _, t in d])).backward()
    with torch.no_grad():
        want = {n: p - 0.1 * p.grad for n, p in ref.named_parameters()}
    torch.manual_seed(SEED)
    model = Net(mesh)
    ddp = data_parallel(model, mesh, comm="lina", chunk_bytes=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddp.no_sync():
        loss_fn(ddp(data[0][rank][0]), data[0][rank][1]).backward()
    loss_fn(ddp(data[1][rank][0]), data[1][rank][1]).backward()
    opt.step()
    ddp._tritonmoe_data_parallel.scheduler.close()
    compare(failures, label, model, want)


def training_table(rank: int, P: int, layouts: list[tuple[int, int]]) -> dict:
    """For each (dp, ep): FIFO and Lina (allreduce) vs the single-process reference; Lina vs FIFO
    bitwise with the ordered reduction; measured micro-op sizes and ordering."""
    failures: list[str] = []
    info: dict = {}
    data = batches(P, steps=1)
    want = reference_params(data)
    for dp, ep in layouts:
        mesh = MoEMesh.build(dp=dp, ep=ep)
        lab = f"dp={dp} ep={ep}"
        m = train(rank, mesh, data, comm="fifo")
        compare(failures, f"{lab} fifo", m, want)
        with Recorder() as rec:
            chunk = 96  # 12 fp64 elements: most gradients take several micro-ops
            m = train(rank, mesh, data, comm="lina", chunk_bytes=chunk, recorder=rec)
        compare(failures, f"{lab} lina", m, want)
        grad_calls = [c for c in rec.calls if c.op == "all_reduce"]
        info[f"{lab} lina"] = dict(**check_micro_ops(failures, f"{lab} lina", grad_calls, grad_ranges(m), chunk),
                                   **check_priority(failures, f"{lab} lina", rec.calls))
        with Recorder() as rec:
            m = train(rank, mesh, data, comm="fifo", recorder=rec)
        info[f"{lab} fifo"] = check_micro_ops(failures, f"{lab} fifo", [c for c in rec.calls if c.op == "all_reduce"],
                                              grad_ranges(m), None)
        fifo = train(rank, mesh, data, comm="fifo", reduction="ordered")
        lina = train(rank, mesh, data, comm="lina", reduction="ordered", chunk_bytes=40)
        for (n, a), b in zip(lina.named_parameters(), fifo.parameters()):
            if not torch.equal(a, b):
                failures.append(f"{lab} ordered: lina {n} not bitwise equal to fifo ({(a - b).abs().max().item():.3g})")
        compare(failures, f"{lab} ordered vs reference", lina, want)
        if dp > 1:
            accumulation(rank, mesh, failures, f"{lab} no_sync accumulation")
    return {"failures": failures, "info": info}


# ---------------------------------------------------------------------------------------------
# Initialization, checkpoints, misuse, FSDP (one 4-rank group)
# ---------------------------------------------------------------------------------------------


def layouts_table(rank: int, P: int, ckdir: str) -> dict:
    failures: list[str] = []
    info: dict = {}
    meshes = {ep: MoEMesh.build(dp=P // ep, ep=ep) for ep in (1, 2, 4)}
    torch.manual_seed(SEED)
    single = Net(None)
    want = {n: p.detach().clone() for n, p in single.named_parameters()}

    # Initialization: one seed, the same global model on every layout (no copying).
    for ep, mesh in meshes.items():
        torch.manual_seed(SEED)
        m = Net(mesh)
        compare(failures, f"init ep={ep}", m, want, exact=True)
        full = full_state_dict(m)
        for k, v in single.state_dict().items():
            if not torch.equal(full[k], v):
                failures.append(f"init ep={ep}: full_state_dict[{k}] differs from the single-process model")

    # Checkpoints: a trained model saved at one EP size, loaded at another into a model built
    # from another seed (so a load that did nothing would fail), outputs compared.
    data = batches(P, steps=1, seed=3)
    trained = reference_params(data)
    x_all = torch.cat([x for x, _ in data[0]])
    torch.manual_seed(SEED)
    ref = Net(None)
    ref.load_state_dict(trained, strict=False)
    with torch.no_grad():
        y_ref = ref(x_all)

    def built(ep: int, seed: int = SEED, params: Optional[dict] = None) -> Net:
        torch.manual_seed(seed)
        m = Net(meshes[ep])
        if params is not None:
            with torch.no_grad():
                for n, p in m.named_parameters():
                    p.copy_(local_view(m, n, params[n]))
        return m

    def check_outputs(label: str, m: Net) -> None:
        with torch.no_grad():
            y = m(x_all[rank * TOKENS : (rank + 1) * TOKENS])
        diff = (y - y_ref[rank * TOKENS : (rank + 1) * TOKENS]).abs().max().item()
        if diff > TOL:
            failures.append(f"{label}: outputs differ by {diff:.3g}")
        compare(failures, label, m, trained)

    import torch.distributed.checkpoint as dcp

    for save_ep, load_eps in ((2, (1, 4)), (4, (2,))):
        path = os.path.join(ckdir, f"dcp_ep{save_ep}")
        src = built(save_ep, params=trained)
        dcp.save(src.state_dict(), checkpoint_id=path)
        for load_ep in load_eps:
            dst = built(load_ep, seed=SEED + 100)
            sd = dst.state_dict()
            dcp.load(sd, checkpoint_id=path)
            dst.load_state_dict(sd)
            check_outputs(f"dcp save ep={save_ep} load ep={load_ep}", dst)

    # Plain state dicts: gather at EP=2, save from rank 0, scatter from rank 0 at EP=4 and EP=1.
    src = built(2, params=trained)
    full = full_state_dict(src)
    path = os.path.join(ckdir, "full.pt")
    if rank == 0:
        torch.save(full, path)
    dist.barrier()
    for load_ep in (4, 1):
        dst = built(load_ep, seed=SEED + 200)
        load_full_state_dict(dst, torch.load(path) if rank == 0 else None, src=0)
        check_outputs(f"full state dict ep=2 -> ep={load_ep}", dst)
    # A full global tensor also loads directly (this rank's experts sliced from it).
    dst = built(4, seed=SEED + 300)
    dst.load_state_dict(torch.load(path))
    check_outputs("load_state_dict(full) at ep=4", dst)

    # Optimizer state across layouts: an Adam step at EP=2, model and optimizer saved with DCP,
    # loaded at EP=4 into a model from another seed, a second step: equals the single process
    # taking both steps (Adam's per-expert moments must land on the experts' new owners).
    from tritonmoe.parallel import load_optimizer_state_dict, optimizer_state_dict

    adam_data = batches(P, steps=2, seed=9)
    want_adam = reference_params(adam_data, lr=1e-2, optim=torch.optim.Adam)

    def adam_step(ep: int, seed: int, data):
        m = built(ep, seed=seed)
        ddp = data_parallel(m, meshes[ep])
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        return m, ddp, opt

    m, ddp, opt = adam_step(2, SEED, adam_data)
    loss_fn(ddp(adam_data[0][rank][0]), adam_data[0][rank][1]).backward()
    opt.step()
    path = os.path.join(ckdir, "dcp_adam_ep2")
    dcp.save({"model": m.state_dict(), "optim": optimizer_state_dict(m, opt)}, checkpoint_id=path)
    ddp._tritonmoe_data_parallel.scheduler.close()
    m, ddp, opt = adam_step(4, SEED + 500, adam_data)
    sd = {"model": m.state_dict(), "optim": optimizer_state_dict(m, opt)}
    dcp.load(sd, checkpoint_id=path)
    m.load_state_dict(sd["model"])
    load_optimizer_state_dict(m, opt, sd["optim"])
    opt.zero_grad()
    loss_fn(ddp(adam_data[1][rank][0]), adam_data[1][rank][1]).backward()
    opt.step()
    ddp._tritonmoe_data_parallel.scheduler.close()
    compare(failures, "adam step at ep=2, dcp (model + optimizer), step at ep=4", m, want_adam, tol=1e-10)

    # Misuse: plain DDP and FSDP over expert-parallel ranks.
    info["misuse"] = misuse(rank, meshes[2])

    # The FSDP2 recipe: one step equals the reference; DCP from the FSDP model into EP=4.
    step = batches(P, steps=1)
    want_step = reference_params(step)
    torch.manual_seed(SEED)
    m = Net(meshes[2])
    fully_shard_moe(m, meshes[2])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, t = step[0][rank]
    loss_fn(m(x), t).backward()
    opt.step()
    compare(failures, "fsdp recipe dp=2 ep=2", m, want_step)
    path = os.path.join(ckdir, "dcp_fsdp")
    dcp.save(m.state_dict(), checkpoint_id=path)
    dst = built(4, seed=SEED + 400)
    sd = dst.state_dict()
    dcp.load(sd, checkpoint_id=path)
    dst.load_state_dict(sd)
    compare(failures, "dcp fsdp(ep=2) -> ep=4", dst, want_step)
    # Re-initializing the sharded model (the meta-device flow: fully_shard, to_empty,
    # reset_parameters) still gives expert e the weights of (seed, e), on every shard.
    from tritonmoe.parallel.init import init_experts_

    torch.manual_seed(SEED + 600)
    for name in ("moe1", "moe2"):
        layer = getattr(m, name)
        layer.reset_parameters()
        seeds = [None] * P
        dist.all_gather_object(seeds, layer.init_seed)
        if len(set(seeds)) != 1:
            failures.append(f"fsdp reset_parameters: {name} drew different seeds on different ranks: {seeds}")
        c = layer.config
        w1 = torch.empty(c.num_experts, c.d_model, c.n1, dtype=F64)
        w2 = torch.empty(c.num_experts, c.d_ffn, c.d_model, dtype=F64)
        init_experts_(w1, w2, base_seed=layer.init_seed, expert_start=0, d_model=c.d_model, d_ffn=c.d_ffn)
        mine = slice(layer.expert_start, layer.expert_start + layer.num_local_experts)
        for pname, want_w in (("w1", w1[mine]), ("w2", w2[mine])):
            if not torch.equal(getattr(layer, pname).full_tensor(), want_w):
                failures.append(f"fsdp reset_parameters: {name}.{pname} is not the experts of (seed, e)")
    return {"failures": failures, "info": info}


def misuse(rank: int, mesh: MoEMesh) -> dict:
    """What plain DDP / FSDP over an expert-parallel model does: messages of the errors and
    warnings, per case (the parent checks they are the same on every rank)."""
    out = {}
    x = torch.randn(TOKENS, D_MODEL, dtype=F64)
    torch.manual_seed(SEED)
    m = Net(mesh)
    ddp = nn.parallel.DistributedDataParallel(m)
    try:
        ddp(x)
        out["ddp"] = None
    except ExpertParallelWrapError as e:
        out["ddp"] = str(e)
    torch.manual_seed(SEED)
    m = Net(mesh)
    names = [n for n, _ in tm.parallel.named_expert_parameters(m)]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(m, names)
    ddp = nn.parallel.DistributedDataParallel(m)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ddp(x).sum().backward()
        ddp(x)  # warned once per layer and wrapper, not every step
    out["ddp_ignored_warnings"] = [str(i.message) for i in w if issubclass(i.category, UserWarning) and "expert" in str(i.message)]
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    m = Net(mesh)
    try:
        fully_shard(m, mesh=mesh.dense_mesh)
        out["fsdp"] = None
    except ExpertParallelWrapError as e:
        out["fsdp"] = str(e)
    out["names"] = names
    return out


# ---------------------------------------------------------------------------------------------
# Skew: random sleeps on one rank at every step (no deadlock)
# ---------------------------------------------------------------------------------------------


def skew(rank: int, P: int, slow_rank: int, steps: int, seed: int) -> dict:
    """Lina over EP = P (the dense group and the expert-parallel group are the same ranks):
    ``steps`` steps with random sleeps on ``slow_rank`` before every gradient micro-op, in the
    forward and in the backward; then the same steps without sleeps. Returns whether the
    parameters are bitwise equal and how long the skewed run took."""
    mesh = MoEMesh.build(dp=1, ep=P)
    data = batches(P, steps=steps, seed=11)
    rng = random.Random(seed + rank)

    def nap() -> None:
        if rank == slow_rank:
            time.sleep(rng.uniform(0.0, 0.02))

    t0 = time.monotonic()
    with Recorder(sleep=nap) as rec:
        slow = train(rank, mesh, data, comm="lina", chunk_bytes=64, recorder=rec, sleeper=nap)
    elapsed = time.monotonic() - t0
    calm = train(rank, mesh, data, comm="lina", chunk_bytes=64)
    equal = all(torch.equal(a, b) for a, b in zip(slow.parameters(), calm.parameters()))
    failures: list[str] = []
    check_priority(failures, "skewed", rec.calls)
    from bench.lina import _measure_priority

    return {"equal": equal, "elapsed": elapsed, "failures": failures, "bench": _measure_priority(rank, P, BENCH_SPEC),
            "held": held_back(rank, P)}


def held_back(rank: int, P: int) -> dict:
    """An announced exchange that never comes: the gradient lane fails after gate_timeout_s and
    the reduction's future raises (bounded wait), on every rank."""
    from tritonmoe.comm import CommScheduler

    sched = CommScheduler.lina(64, gate_timeout_s=0.5)
    group = dist.new_group(list(range(P)))
    sched.exchange_imminent()
    t0 = time.monotonic()
    fut = sched.reduce(torch.ones(100, dtype=F64), None, group)
    try:
        fut.wait()
        out = {"raised": None}
    except RuntimeError as e:
        out = {"raised": str(e)}
    out["elapsed"] = time.monotonic() - t0
    sched.close()
    return out


#: bench.lina's all-to-all part at a tiny shape (measured by the skew group).
BENCH_SPEC = dict(a2a_mb=0.25, grad_mb=1.0, grad_tensors=4, delay_ms=1.0, chunk_mb=(0.0625,), a2a_reps=2, warmup=0,
                  d_model=16)


def new_ckdir() -> str:
    return tempfile.mkdtemp(prefix="tm_ckpt_")
