"""Measuring a cost model on the machine this runs on (``python -m tritonmoe.plan profile``).

:func:`profile` is collective: every rank of an initialized process group calls it (torchrun,
or the self-spawning :func:`profile_spawned` on CPU). It measures

* every collective the schedules issue (all-to-all, all-gather, reduce-scatter, all-reduce,
  point-to-point) over message sizes from 1 KiB to 64 MiB per rank, on the world and on every
  power-of-two sub-group (ranks 0..g-1), timed **in place**: as in a step, each repetition runs
  a compute phase on every member (the layer's expert forward) and then the collective, and keeps
  the mean over members of each one's issue-to-completion time; the median over twice the
  repetitions is fitted (the in-place time is bimodal: the communication threads now and then
  wake late). A collective that follows compute pays what one after a barrier does not: the
  communication threads wake from idle, and the members arrive apart by their compute's jitter
  (on a CPU with fewer cores than ranks, by the scheduler's time slices), so the last member's
  arrival, which the simulator takes as the collective's start, is later than the average
  member's. ``ProfileSpec(collectives_in_place=False)`` times them in isolation instead (after a
  barrier, the slowest member's time);
* the host time to issue one asynchronous collective;
* the compute of the layer's ops at several shapes (grouped FFN forward and backward, router
  GEMM, re-layout copies, permute, unpermute, routing, gradient accumulation), with the same
  work descriptions the simulator uses (:class:`~tritonmoe.sim.work.WorkModel`): by one rank
  alone (the rates) and with **every rank computing at once**, as in a real step; on a CPU
  machine with fewer cores than ranks the slowdown between the two gives the cores the ranks
  share (``CostModel.host_cores``), so the engine slows ranks that compute at the same time;
* interference factors (MPMoE alpha(y, x)): compute while a collective runs and vice versa,
  either while a copy runs, and two collectives at once on one group (gloo runs a process
  group's asynchronous work on two threads);
* host/device copies (on CPU: a memory copy on the copy lane's worker thread);

and fits a :class:`~tritonmoe.plan.CostModel` (:meth:`CostModel.fit`).
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from tritonmoe.core.validation import GLU_ACTIVATIONS
import torch.distributed as dist

from tritonmoe.comm.splits import comm_device, new_group
from tritonmoe.comm.compat import all_gather_single, reduce_scatter_single

from tritonmoe.sim.cost_model import (
    COLLECTIVES,
    CommSample,
    ComputeSample,
    CostModel,
    HostSample,
    InterferenceSample,
)
from tritonmoe.sim.work import HOST, WorkModel
from tritonmoe.comm.executor import RealExecutor, Work
from tritonmoe.comm.timeline import Timeline
from tritonmoe import reference
from tritonmoe.comm.partition import transpose_chunks
from tritonmoe.backends import implementation
from tritonmoe.comm.rendezvous import init_local
from tritonmoe.comm.rendezvous import local_store

__all__ = ["ProfileSpec", "profile", "profile_spawned", "DEFAULT_SIZES"]

#: 1 KiB, 4 KiB, ... 64 MiB per rank (9 sizes).
DEFAULT_SIZES = tuple(1024 * 4**i for i in range(9))


@dataclass
class ProfileSpec:
    """What to measure.

    Attributes:
        sizes: bytes per rank of each collective.
        kinds: collectives to time.
        reps: repetitions per point (the median is fitted); ``warmup``: untimed repetitions.
        shapes: ``(d_model, d_ffn, num_experts, top_k)`` layer shapes whose ops are timed.
        tokens: token counts per rank at which the layer's ops are timed.
        dtype: activation dtype; ``activation``: the expert activation.
        group_sizes: group sizes to time (default: powers of two up to the world size, and it).
        collectives_in_place: time each collective right after a compute phase on every member
            (module docstring); False: after a barrier alone.
    """

    sizes: Sequence[int] = DEFAULT_SIZES
    kinds: Sequence[str] = COLLECTIVES
    reps: int = 5
    warmup: int = 1
    shapes: Sequence[tuple[int, int, int, int]] = ((256, 512, 8, 2), (512, 1024, 8, 2))
    tokens: Sequence[int] = (64, 256, 1024)
    dtype: torch.dtype = torch.float32
    activation: str = "swiglu"
    group_sizes: Optional[Sequence[int]] = None
    collectives_in_place: bool = True
    log: bool = True
    meta: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _say(spec: ProfileSpec, msg: str) -> None:
    if spec.log and dist.get_rank() == 0:
        print(f"[profile] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------


def _collective(kind: str, nbytes: int, group, g: int, device: torch.device, dtype=torch.float32):
    """A callable running one ``kind`` collective of ``nbytes`` per rank (module docstring of
    :mod:`tritonmoe.sim.cost_model` for the convention), and its buffers."""
    es = torch.empty((), dtype=dtype).element_size()
    n = max(g, (nbytes // es) // g * g)  # divisible by the group size
    x = torch.randn(n, device=device, dtype=dtype)
    grank = dist.get_rank(group)
    if kind == "all_to_all":
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x, group=group)
    if kind == "all_gather":
        y = torch.empty(n * g, device=device, dtype=dtype)
        return lambda: all_gather_single(y, x, group=group)
    if kind == "reduce_scatter":
        y = torch.empty(n // g, device=device, dtype=dtype)

        return lambda: reduce_scatter_single(y, x, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "send_recv":  # a ring step: send to the next member, receive from the previous
        y = torch.empty_like(x)
        nxt = dist.get_global_rank(group, (grank + 1) % g)
        prv = dist.get_global_rank(group, (grank - 1) % g)

        def run():
            ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, y, prv, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        return run
    raise ValueError(f"unknown collective {kind!r}")


def _time_group(fn, group, device, reps: int, warmup: int, phase=None) -> float:
    """``fn``'s time on the group's members, each rep after a barrier.

    Without ``phase``: the median over reps of the slowest member's time (they start together).
    With ``phase`` (a compute each member runs between the barrier and ``fn``): per rep, the
    mean over members of each one's time from issuing ``fn`` to its completion -- the wait a
    collective adds after compute on an average member, its arrival skew included (module
    docstring); the median over reps (the caller gives in-place timings more reps: the time is
    bimodal, the communication threads now and then waking late)."""
    times = []
    g = dist.get_world_size(group)
    for i in range(warmup + reps):
        dist.barrier(group=group)
        _sync(device)
        if phase is not None:
            phase()
            _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=comm_device(group))
        dist.all_reduce(dt, op=dist.ReduceOp.MAX if phase is None else dist.ReduceOp.SUM, group=group)
        if i >= warmup:  # a host sync per rep: the profile measures, it is not a hot path
            times.append(float(dt.item()) / (1 if phase is None else g))
    return statistics.median(times)


def _phase_tokens(spec: ProfileSpec) -> int:
    """The middle of the spec's token counts: the in-place compute phase's token count."""
    return sorted(spec.tokens)[len(spec.tokens) // 2]


def _step_phase(spec: ProfileSpec, device):
    """The compute phase a collective is timed after (in place): the layer's expert forward at
    the spec's first shape and middle token count, the same work on every rank."""
    d, f, E, k = spec.shapes[0]
    T = _phase_tokens(spec)
    ops = {name: fn for name, _w, fn in _layer_ops(spec, d, f, E, k, T, device, dist.get_world_size())}
    return ops["expert_fwd"]


def _collective_samples(spec: ProfileSpec, device, node_of: list[int]) -> list:
    rank, P = dist.get_rank(), dist.get_world_size()
    phase = _step_phase(spec, device) if spec.collectives_in_place else None
    sizes = sorted({g for g in (spec.group_sizes or []) if 2 <= g <= P}
                   or ({2**i for i in range(1, P.bit_length()) if 2**i <= P} | {P}))
    out = []
    for g in sizes:
        members = list(range(g))
        group = dist.group.WORLD if g == P else new_group(members)  # the default group's timeout
        link = "intra" if len({node_of[r] for r in members}) == 1 else "inter"
        if rank in members:
            for kind in spec.kinds:
                for nbytes in spec.sizes:
                    reps = spec.reps if nbytes <= 4 * 2**20 else max(3, spec.reps // 2)
                    if phase is not None:  # in place the times scatter more (a late wakeup): twice the reps
                        reps = 2 * reps + 1
                    fn = _collective(kind, nbytes, group, g, device)
                    t = _time_group(fn, group, device, reps, spec.warmup, phase)
                    out.append(CommSample(kind, g, link, float(nbytes), t))
                _say(spec, f"{kind} over {g} ranks ({link}): {len(spec.sizes)} sizes")
        dist.barrier()
    return out


def _host_issue(device) -> list:
    """Host seconds per operation issued through the real executor with a timeline recording
    (as the layer runs it, e.g. under ``bench.ep``): an asynchronous 1-row all-to-all (the call
    alone, median of 30), and the executor's own cost of a compute (a no-op function)."""

    P = dist.get_world_size()
    x = torch.randn(P, 4, device=device)
    ex = RealExecutor(device, timeline=Timeline())
    comm, comp = [], []
    for _ in range(30):
        dist.barrier()
        t0 = time.perf_counter()
        h = ex.all_to_all(x, [1] * P, [1] * P, kind="dispatch")
        comm.append(time.perf_counter() - t0)
        ex.wait(h)
        t0 = time.perf_counter()
        ex.compute(lambda: None, work=Work(), kind="expert")
        comp.append(time.perf_counter() - t0)
    _sync(device)
    return [HostSample(statistics.median(comm), "comm"), HostSample(statistics.median(comp), "compute")]


# ---------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------


def _once(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _timed(fn, device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(_once(fn, device) for _ in range(reps))


def _routing_ops(router, route, permute, unpermute, *, x, logits, routing, y_perm, info, tw, k: int, E: int) -> dict:
    """The routing side's ops of :func:`_layer_ops` by name, forward and backward as a training
    step runs them (inputs that require grad, autograd recording; a backward replays one recorded
    graph): the router's GEMM, route, permute and unpermute."""
    xq = x.clone().requires_grad_()
    xg = x.clone().requires_grad_()

    def router_fwd():
        router(xg)

    lg = router(xg)
    dlg = torch.randn_like(lg)

    def router_bwd():
        torch.autograd.grad(lg, [xg, router.weight], dlg, retain_graph=True)

    def permute_fwd():
        permute(xq, routing.topk_ids, E)

    xp, inf2 = permute(xq, routing.topk_ids, E)
    dxp = torch.randn_like(xp)

    def permute_bwd():
        torch.autograd.grad(xp, [xq], dxp, retain_graph=True)

    def unpermute_fwd():
        unpermute(y_perm, info, tw)

    out = unpermute(y_perm, info, tw)
    dout = torch.randn_like(out)

    def unpermute_bwd():
        torch.autograd.grad(out, [y_perm, tw], dout, retain_graph=True)

    def route_fwd():
        route(logits, k)

    rt = route(logits, k)
    dw_ = torch.randn_like(rt.topk_weights)

    def route_bwd():
        torch.autograd.grad(rt.topk_weights, [logits], dw_, retain_graph=True)

    return {
        "router_fwd": router_fwd, "router_bwd": router_bwd, "permute_fwd": permute_fwd, "permute_bwd": permute_bwd,
        "unpermute_fwd": unpermute_fwd, "unpermute_bwd": unpermute_bwd, "route_fwd": route_fwd, "route_bwd": route_bwd,
    }


def _layer_ops(spec: ProfileSpec, d: int, f: int, E: int, k: int, T: int, device, P: int):
    """(name, kind, Work, callable) of the layer's ops at one shape and token count, on the
    implementations the layer dispatches to here."""

    dt = spec.dtype
    g = torch.Generator(device="cpu").manual_seed(T * 131 + d)
    n1 = 2 * f if spec.activation in GLU_ACTIVATIONS else f
    L = max(1, E // P)
    ffn = implementation("grouped_ffn", None, device, dt)
    W = WorkModel(d, f, n1, E, k, torch.empty((), dtype=dt).element_size(), ffn is not reference.grouped_ffn)
    R = T * k  # rows an expert op sees (tokens * top_k), spread over L local experts
    x = torch.randn(T, d, generator=g).to(device, dt)
    xr = torch.randn(R, d, generator=g).to(device, dt).requires_grad_()
    w1 = (torch.randn(L, d, n1, generator=g) / d**0.5).to(device, dt).requires_grad_()
    w2 = (torch.randn(L, f, d, generator=g) / f**0.5).to(device, dt).requires_grad_()
    offs = torch.tensor([R * e // L for e in range(L + 1)], device=device)
    counts_PL = torch.full((P, L), R // (P * L), dtype=torch.int64)
    counts_PL[-1, -1] += R - int(counts_PL.sum())
    router = torch.nn.Linear(d, E, bias=False).to(device, dt)
    logits = router(x).detach().requires_grad_()
    route = implementation("route", None, device, dt)
    permute = implementation("permute", None, device, dt)
    unpermute = implementation("unpermute", None, device, dt)
    routing = route(logits, k)
    x_perm, info = permute(x, routing.topk_ids, E)
    Rp = x_perm.shape[0]
    y_perm = torch.randn(Rp, d, generator=g).to(device, dt).requires_grad_()
    tw = routing.topk_weights.detach().requires_grad_()
    segs = int((counts_PL > 0).sum())

    # forward ops run as in a training step: inputs that require grad, autograd recording
    def ffn_fwd():
        ffn(xr, offs, w1, w2, spec.activation)

    y = ffn(xr, offs, w1, w2, spec.activation)
    dy = torch.randn_like(y)

    def ffn_bwd():
        torch.autograd.grad(y, [xr, w1, w2], dy, retain_graph=True)

    def relayout():
        transpose_chunks(xr, counts_PL)  # inside the expert op, with autograd recording

    ops = _routing_ops(router, route, permute, unpermute, x=x, logits=logits, routing=routing, y_perm=y_perm,
                       info=info, tw=tw, k=k, E=E)

    # the pipeline's expert op as it runs it: re-layout, FFN, re-layout with autograd recording,
    # and its backward through torch.autograd.grad (tritonmoe.comm.programs.pipeline / experts.py)
    def expert_forward():
        r = xr.detach().requires_grad_(True)
        y = transpose_chunks(ffn(transpose_chunks(r, counts_PL), offs, w1, w2, spec.activation), counts_PL.t())
        return r, y

    r_e, y_e = expert_forward()
    dy_e = torch.randn_like(y_e)

    def expert_backward():
        torch.autograd.grad(y_e, [r_e, w1, w2], dy_e, retain_graph=True)

    acc_a = torch.randn(L * (d * n1 + f * d), generator=g).to(device, dt)
    acc_b = torch.randn_like(acc_a)

    def accumulate():
        acc_a + acc_b

    return [
        ("ffn_fwd", W.ffn_fwd(R, L), ffn_fwd),
        ("ffn_bwd", W.ffn_dx(R, L) + W.ffn_dw(R, L), ffn_bwd),
        ("router_fwd", W.router(T, backward=False), ops["router_fwd"]),
        ("router_bwd", W.router(T, backward=True), ops["router_bwd"]),
        ("relayout", W.relayout(R, segs), relayout),
        ("permute_fwd", W.permute(T, Rp, backward=False), ops["permute_fwd"]),
        ("permute_bwd", W.permute(T, Rp, backward=True), ops["permute_bwd"]),
        ("unpermute_fwd", W.unpermute(T, Rp, backward=False), ops["unpermute_fwd"]),
        ("unpermute_bwd", W.unpermute(T, Rp, backward=True), ops["unpermute_bwd"]),
        ("route_fwd", W.route(T, backward=False), ops["route_fwd"]),
        ("route_bwd", W.route(T, backward=True), ops["route_bwd"]),
        ("accumulate", W.accumulate(acc_a.numel() * acc_a.element_size()), accumulate),
        ("expert_fwd", W.expert_fwd(R, L, segs), expert_forward),
        ("expert_bwd", W.expert_bwd(R, L, segs, defer_wgrad=False, accumulate=False, local_experts=L),
         expert_backward),
    ]


def _compute_samples(spec: ProfileSpec, device) -> tuple[list, list[float]]:
    """The layer's ops at every shape and token count, timed twice: by rank 0 alone (the others
    wait at a barrier), which gives the compute rates, and by every rank at once, as in a real
    step; the slowdown between the two (ops of >= 5 ms alone) tells how many cores the ranks
    share (CPU) or that they share nothing (one GPU each): its "together" time is the mean over
    ranks. Returns (rank 0's samples, slowdowns).

    The ops of one shape and token count are timed in rounds (medians over rounds): each round
    runs every op once on every rank at once, then every op once on rank 0 alone, so each timed
    run follows another op, as in a step, not itself with its data still in cache, and a passing
    disturbance of the machine falls on one round of many ops instead of on every repetition of
    one op. One shape and token count's tensors are alive at a time."""
    P = dist.get_world_size()
    rank = dist.get_rank()
    reps = max(3, spec.reps)
    samples, slowdowns = [], []
    for d, f, E, k in spec.shapes:
        for T in spec.tokens:
            # one (shape, token count) alive at a time: its ops in rounds, then dropped
            ops = _layer_ops(spec, d, f, E, k, T, device, P)
            t_all: list[list[float]] = [[] for _ in ops]
            t_alone: list[list[float]] = [[] for _ in ops]
            for rnd in range(spec.warmup + reps):
                for i, (_name, _work, fn) in enumerate(ops):  # every rank at once, op by op
                    dist.barrier()
                    t = _once(fn, device)
                    if rnd >= spec.warmup:
                        t_all[i].append(t)
                dist.barrier()
                if rank == 0:  # rank 0 alone, the others at the barrier: each op after another
                    for i, (_name, _work, fn) in enumerate(ops):
                        t = _once(fn, device)
                        if rnd >= spec.warmup:
                            t_alone[i].append(t)
                dist.barrier()
            # the together time of an op: the mean over ranks of each one's median (4 ranks on 2
            # cores: whichever the OS runs first is barely slowed, the last one twice)
            together_s = torch.tensor([statistics.median(ts) for ts in t_all], dtype=torch.float64,
                                      device=comm_device(None))
            dist.all_reduce(together_s)
            together_s = (together_s / P).tolist()  # host sync: profiling, once per op set
            if rank == 0:
                for (_name, work, _fn), together, alones in zip(ops, together_s, t_alone):
                    alone = statistics.median(alones)
                    leaves = work.leaves()
                    if any(lf.kind != leaves[0].kind or lf.kind == HOST for lf in leaves):  # composite
                        parts = tuple((lf.kind, lf.flops, lf.bytes, lf.launches) for lf in leaves)
                        samples.append(ComputeSample("composite", work.flops, work.bytes, work.launches, alone, parts))
                    else:
                        samples.append(ComputeSample(leaves[0].kind, work.flops, work.bytes, work.launches, alone))
                    if alone >= 5e-3:
                        slowdowns.append(together / alone)
            del ops
        _say(spec, f"compute at d={d} f={f} E={E} k={k}, T in {list(spec.tokens)}")
    return samples, slowdowns


# ---------------------------------------------------------------------------------------------
# Interference and copies
# ---------------------------------------------------------------------------------------------


def _comm_pair(device, reps: int) -> list:
    """Two equal all-to-alls issued at once on one group vs one alone (alpha(comm, comm))."""
    out = []
    P = dist.get_world_size()
    for nbytes in (2**20, 8 * 2**20):
        x = torch.randn(nbytes // 4 // P * P, device=device)
        y1, y2 = torch.empty_like(x), torch.empty_like(x)
        one, two = [], []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(y1, x)
            _sync(device)
            one.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            w1 = dist.all_to_all_single(y1, x, async_op=True)
            w2 = dist.all_to_all_single(y2, x, async_op=True)
            w1.wait()
            w2.wait()
            _sync(device)
            two.append(time.perf_counter() - t0)
        out.append(InterferenceSample("comm", "comm", 2 * statistics.median(one), statistics.median(two)))
    return out


def _interference(spec: ProfileSpec, device, reps: int) -> list:
    """alpha(y, x) for y, x in {comp, comm, mem}: each op alone, then two at once (the comm on
    gloo/NCCL's own threads or stream, the copy on a worker thread or a copy stream)."""
    P = dist.get_world_size()
    d, f, E, k = spec.shapes[-1]
    ops = {name: fn for name, _w, fn in _layer_ops(spec, d, f, E, k, max(spec.tokens), device, P)}
    comp = ops["ffn_fwd"]
    t_comp = _timed(comp, device, reps, 1)
    # a collective and a copy sized to last about as long as the compute
    probe = torch.randn(2**20 // 4 // P * P, device=device)
    probe_out = torch.empty_like(probe)
    dist.barrier()
    t_probe = _timed(lambda: dist.all_to_all_single(probe_out, probe), device, 3, 1)
    # every rank must size the collective alike: agree on the slowest rank's times
    both = torch.tensor([t_comp, t_probe], dtype=torch.float64, device=comm_device(None))
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    t_comp_max, t_probe_max = both.tolist()
    n_comm = int(min(64 * 2**20, max(2**16, 2**20 * t_comp_max / max(t_probe_max, 1e-6)))) // 4 // P * P
    cx = torch.randn(n_comm, device=device)
    cy = torch.empty_like(cx)
    src = torch.randn(max(2**16, n_comm), device=device)
    dst = torch.empty_like(src, device="cpu") if device.type == "cuda" else torch.empty_like(src)
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start_comm():
        stamp = {}
        w = dist.all_to_all_single(cy, cx, async_op=True)
        w.get_future().add_done_callback(lambda _f: stamp.setdefault("end", time.perf_counter()))
        return w, stamp

    def start_copy():
        stamp = {}
        if copy_stream is not None:
            with torch.cuda.stream(copy_stream):
                dst.copy_(src, non_blocking=True)

            def waiter():
                copy_stream.synchronize()
                stamp["end"] = time.perf_counter()
        else:
            def waiter():
                dst.copy_(src)
                stamp["end"] = time.perf_counter()
        th = threading.Thread(target=waiter)
        th.start()
        return th, stamp

    def alone(which):
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            if which == "comm":
                w, st = start_comm()
                w.wait()
                _sync(device)
                time.sleep(0)
                while "end" not in st:
                    time.sleep(1e-5)
                ts.append(st["end"] - t0)
            else:
                th, st = start_copy()
                th.join()
                ts.append(st["end"] - t0)
        return statistics.median(ts)

    def together(a, b):
        ta, tb = [], []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            handles = {}
            for which in (a, b):
                if which == "comm":
                    handles["comm"] = start_comm()
                elif which == "mem":
                    handles["mem"] = start_copy()
            if "comp" in (a, b):
                comp()
                _sync(device)
                t_c = time.perf_counter() - t0
            ends = {}
            for which, (h, st) in handles.items():
                if which == "comm":
                    h.wait()
                else:
                    h.join()
                while "end" not in st:
                    time.sleep(1e-5)
                ends[which] = st["end"] - t0
            if "comp" in (a, b):
                ends["comp"] = t_c
            ta.append(ends[a])
            tb.append(ends[b])
        return statistics.median(ta), statistics.median(tb)

    base = {"comp": t_comp, "comm": alone("comm"), "mem": alone("mem")}
    out = []
    for a, b in (("comp", "comm"), ("comp", "mem"), ("comm", "mem")):
        ta, tb = together(a, b)
        out.append(InterferenceSample(a, b, base[a], ta))
        out.append(InterferenceSample(b, a, base[b], tb))
    return out


def _copy_samples(spec: ProfileSpec, device) -> list:
    out = []
    for nbytes in spec.sizes:
        n = max(1, nbytes // 4)
        if device.type == "cuda":
            dev_t = torch.randn(n, device=device)
            host_t = torch.empty(n, pin_memory=True)
            out.append(CommSample("copy_d2h", 1, "intra", float(nbytes), _timed(lambda: host_t.copy_(dev_t, non_blocking=True), device, spec.reps, 1)))
            out.append(CommSample("copy_h2d", 1, "intra", float(nbytes), _timed(lambda: dev_t.copy_(host_t, non_blocking=True), device, spec.reps, 1)))
        else:
            a = torch.randn(n)
            b = torch.empty_like(a)
            t = _timed(lambda: b.copy_(a), device, spec.reps, 1)
            out.append(CommSample("copy_d2h", 1, "intra", float(nbytes), t))
            out.append(CommSample("copy_h2d", 1, "intra", float(nbytes), t))
    return out


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def profile(spec: Optional[ProfileSpec] = None, *, out: Optional[str] = None) -> Optional[CostModel]:
    """Measure and fit a cost model (collective: every rank calls it). Returns the model on rank
    0 (None elsewhere) and writes it to ``out`` from rank 0 when given."""
    spec = spec or ProfileSpec()
    if not dist.is_initialized():
        raise RuntimeError(
            "profile() runs on every rank of a process group: launch with torchrun, or use profile_spawned(nproc) "
            "(python -m tritonmoe.plan profile --nproc N) on one machine"
        )
    backend = str(dist.get_backend()).lower()
    device = comm_device(None)
    rank, P = dist.get_rank(), dist.get_world_size()
    t_start = time.perf_counter()
    hosts: list = [None] * P
    dist.all_gather_object(hosts, socket.gethostname())
    names = list(dict.fromkeys(hosts))
    node_of = [names.index(h) for h in hosts]
    per_node = {node_of.count(i) for i in range(len(names))}
    ranks_per_node = None if len(names) == 1 else (per_node.pop() if len(per_node) == 1 else None)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    _say(spec, f"{P} ranks on {len(names)} node(s), backend {backend}, device {device}, load {load}")
    samples: list = []
    samples += _collective_samples(spec, device, node_of)
    samples += _host_issue(device)
    samples += _comm_pair(device, max(3, spec.reps))
    compute, slowdowns = _compute_samples(spec, device)
    samples += compute
    others = _interference(spec, device, max(3, spec.reps)) + _copy_samples(spec, device)
    gathered: list = [None] * P
    dist.all_gather_object(gathered, others)
    if rank != 0:
        dist.barrier()
        return None
    allsamples = samples + [s for part in gathered for s in part]
    threads = torch.get_num_threads()
    host_cores = None
    slowdown = statistics.median(slowdowns) if slowdowns else None
    if device.type == "cpu" and slowdown is not None:
        # P ranks of `threads` threads computing at once run `slowdown` times slower than one:
        # they share P * threads / slowdown cores (at least one rank's threads, at most all)
        # (capped by the cores this process may run on: timing jitter can put the slowdown of
        # more ranks than cores below P / cores)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or P * threads)
        host_cores = min(float(P * threads), float(cores), max(float(threads), P * threads / max(slowdown, 1e-9)))
    slots = {}
    if "gloo" in backend:
        slots["comm"] = int(dist.ProcessGroupGloo._Options()._threads)
    model = CostModel.fit(
        allsamples,
        host_compute=device.type == "cpu",
        dtype=str(spec.dtype).replace("torch.", ""),
        lane_slots=slots,
        ranks_per_node=ranks_per_node,
        host_cores=host_cores,
        threads_per_rank=threads,
        source="profile",
        meta={
            "host": names[0] if len(names) == 1 else names,
            "world_size": P,
            "backend": backend,
            "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": load,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "profile_seconds": round(time.perf_counter() - t_start, 1),
            "compute_slowdown_all_ranks_at_once": slowdown,
            "load_average_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "collectives_timed": ("in place: after the expert forward at shape "
                                  f"{list(spec.shapes[0])}, {_phase_tokens(spec)} tokens, "
                                  "mean over members" if spec.collectives_in_place
                                  else "isolated: after a barrier, slowest member"),
            "shapes": [list(s) for s in spec.shapes],
            "tokens": list(spec.tokens),
            **spec.meta,
        },
    )
    if out:
        model.save(out)
    dist.barrier()
    return model


def _spawned(rank: int, P: int, port: int, spec: ProfileSpec, out: str, err_dir: str, timeout_s: float) -> None:

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    try:
        init_local(rank, P, port, timeout_s)
        profile(spec, out=out)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def profile_spawned(nproc: int, spec: Optional[ProfileSpec] = None, *, out: str, timeout_s: float = 120.0,
                    deadline_s: float = 1800.0) -> CostModel:
    """Spawn ``nproc`` local ranks on gloo (CPU tensors, ``cpu_count // nproc`` threads each, as
    the expert-parallel benchmark runs them), profile, write ``out`` and return the model."""
    import torch.multiprocessing as mp

    if nproc < 2:
        raise ValueError(f"--nproc {nproc}: profiling collectives needs at least 2 ranks")
    spec = spec or ProfileSpec()

    with tempfile.TemporaryDirectory() as err_dir:
        store = local_store(nproc, timeout_s)  # served until the ranks have ended (no free-port race)
        port = store.port
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_spawned, args=(r, nproc, port, spec, out, err_dir, timeout_s), daemon=True)
                 for r in range(nproc)]
        for p in procs:
            p.start()
        t0 = time.monotonic()
        for p in procs:
            p.join(max(0.0, t0 + deadline_s - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        del store
        errs = []
        for r in range(nproc):
            path = os.path.join(err_dir, f"rank{r}.err")
            if os.path.exists(path):
                with open(path) as f:
                    errs.append(f"rank {r}:\n{f.read()}")
        if errs or any(p.exitcode != 0 for p in procs):
            raise RuntimeError("profile failed:\n" + ("\n".join(errs) or f"exit codes {[p.exitcode for p in procs]}"))
    return CostModel.load(out)
