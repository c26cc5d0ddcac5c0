"""Lina's planner options: expert packing (PAPERS.md section 1.3) and the chunk size (1.1).

**Expert packing** (001 section 4.2): with P devices and E experts, packing ``p`` puts ``p``
times as many experts on each device: the expert-parallel group shrinks to ``P / p`` ranks and
every expert gets ``p`` replicas, whose gradients are reduced over the expert-data-parallel group
(through the low-priority gradient lane, PAPERS.md 1.3 Reading). In this library that is the
mesh ``MoEMesh.build(dp=p, ep=P // p)`` (times any outer data parallelism): packing is a choice of
mesh shape, which :func:`tritonmoe.parallel.data_parallel` then runs with the right gradient
semantics. ``p = P`` is pure data parallelism (no all-to-all).

:func:`expert_packing` is the paper's rule as a pure function: starting at one (relative)
packing, double ``p`` while an FFN micro-op is shorter than an all-to-all micro-op, stopping
when it no longer is, when the next ``p`` does not fit in memory, or at ``p = P``.
:func:`packing_candidates` lists the packings a layout admits (the planner's candidate
dimension).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union
from tritonmoe.comm.executor import Work
from tritonmoe.comm.executor import VirtualTensor
from tritonmoe.comm.programs.pipeline import backward_pass, forward_pass
from tritonmoe.comm.priority import PRIORITY_EXCHANGE, PRIORITY_GRADIENT, issue_gradient_sync
from tritonmoe.sim.schedules import backward_epilogue, backward_prologue, prologue
from tritonmoe.comm.splits import plan_from_counts
from tritonmoe.comm.programs.pipeline import micro_batch_bounds
from tritonmoe.sim import engine
from tritonmoe.sim.schedules import RankStep
from tritonmoe.sim.executor import SimExecutor, VirtualGroup
from tritonmoe.sim.simulate import kernel_flags, resolve_cost, routing_counts
from tritonmoe.sim.work import WorkModel
from tritonmoe.comm.timeline import Timeline
from tritonmoe.sim.cost_model import LINKS, Cluster
from tritonmoe.config import MoEConfig

__all__ = ["PackingChoice", "packing_candidates", "expert_packing", "LINA_CHUNK_CANDIDATES"]

#: DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``).
FIRST_BUCKET_BYTES = 2**20
#: Lina chunk sizes (bytes) the planner tries: the paper's study spans 10-100 MB, default 30 MB
#: (001 section 7.2.2); None is priority without partitioning (the paper's variant (b)).
LINA_CHUNK_CANDIDATES = (None, 4 * 2**20, 10 * 2**20, 30 * 2**20, 50 * 2**20, 100 * 2**20)

Timing = Union[Callable[[int], float], Mapping[int, float]]


@dataclass(frozen=True)
class PackingChoice:
    """A packing: ``p`` replicas per expert; the mesh is (dp=p, ep=P/p) with
    ``experts_per_device`` = E / (P/p) experts on every device; ``reason`` says why the search
    stopped there; ``trace`` holds every (p, t_ffn, t_a2a) the search looked at."""

    p: int
    ep: int
    experts_per_device: int
    reason: str
    trace: tuple[tuple[int, float, float], ...]


def packing_candidates(world_size: int, num_experts: int) -> list[int]:
    """Packings ``p`` (powers of two) with ``p`` dividing P and E divisible by the
    expert-parallel size P/p, ascending."""
    if world_size < 1 or num_experts < 1:
        raise ValueError(f"world_size={world_size} and num_experts={num_experts} must be >= 1")
    out, p = [], 1
    while p <= world_size:
        if world_size % p == 0 and num_experts % (world_size // p) == 0:
            out.append(p)
        p *= 2
    return out


def _at(t: Timing, p: int, what: str) -> float:
    v = t(p) if callable(t) else t.get(p)
    if v is None:
        raise ValueError(f"no {what} time for packing p={p}; give it for every candidate the search reaches")
    v = float(v)
    if not v >= 0.0:
        raise ValueError(f"{what} time for p={p} is {v}; times must be >= 0")
    return v


def expert_packing(
    ffn_time: Timing,
    a2a_time: Timing,
    *,
    world_size: int,
    num_experts: int,
    fits: Optional[Callable[[int], bool]] = None,
) -> PackingChoice:
    """Lina's packing rule (001 section 4.2) as a pure function.

    Args:
        ffn_time, a2a_time: the time of one expert-FFN micro-op and of one all-to-all micro-op
            at packing ``p`` (callables of p, or dicts p -> seconds: measured, or simulated by
            :mod:`tritonmoe.plan`). At ``p = P`` there is no all-to-all (give 0).
        world_size: P, devices of the layer; num_experts: E.
        fits: whether packing ``p`` fits in device memory (default: always).

    Returns: the first ``p`` of :func:`packing_candidates` (walked in powers of two) whose FFN
    micro-op takes at least as long as its all-to-all micro-op; the largest that fits when
    memory stops the search first (the paper offloads to DRAM instead, which this does not
    model); ``P`` at most.
    """
    cands = packing_candidates(world_size, num_experts)
    fits = fits or (lambda p: True)
    trace = []
    chosen, reason = cands[0], ""
    for j, p in enumerate(cands):
        if j > 0 and not fits(p):
            reason = f"p={p} does not fit in memory"
            break
        chosen = p
        tf, ta = _at(ffn_time, p, "FFN"), _at(a2a_time, p, "all-to-all")
        trace.append((p, tf, ta))
        if tf >= ta:
            reason = f"the FFN micro-op ({tf:.3g} s) outlasts the all-to-all micro-op ({ta:.3g} s)"
            break
    else:
        reason = f"largest packing p={chosen} (all experts' replicas on every device)" if chosen == world_size else \
            f"largest packing the layout admits (p={chosen})"
    ep = world_size // chosen
    return PackingChoice(chosen, ep, num_experts // ep, reason, tuple(trace))


# ---------------------------------------------------------------------------------------------
# A data-parallel x expert-parallel training step in the simulator (Lina's experiments)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinaModel:
    """A transformer for Lina's step-time experiments: ``layers`` blocks of a dense part (its
    forward takes ``dense_s`` seconds per layer, its backward twice that; ``dense_grad_bytes``
    of gradients per layer) followed by an MoE layer (``config``), ``tokens`` tokens per GPU,
    activations in ``dtype``. The dense part's time is the free parameter a calibration sets
    (Lina's Table 1 gives the all-to-all's share of the step, not the model's widths)."""

    config: Any
    layers: int
    tokens: int
    dense_s: float
    dense_grad_bytes: int
    dtype: Any = None

    @classmethod
    def transformer(cls, config, *, layers: int, tokens: int, dense_s: float = 0.0, grad_bytes_per_elem: int = 4,
                    dtype=None) -> "LinaModel":
        """Attention blocks of width d = config.d_model: 4 d^2 projection weights whose gradients
        take ``grad_bytes_per_elem`` bytes (fp32 under mixed precision)."""
        d = config.d_model
        return cls(config, layers, tokens, float(dense_s), 4 * d * d * grad_bytes_per_elem, dtype)

    def with_dense_s(self, dense_s: float) -> "LinaModel":
        return LinaModel(self.config, self.layers, self.tokens, float(dense_s), self.dense_grad_bytes, self.dtype)


def _work_for(cost, seconds: float):
    """A GEMM-like Work that the cost model prices at ``seconds`` (two secant steps)."""

    if seconds <= 0:
        return Work(0.0, 0.0, "gemm", 1)
    rate = cost.compute["gemm"]
    flops = seconds * rate.flops_per_s
    for _ in range(3):
        t = cost.compute_time(Work(flops, 0.0, "gemm", 1))
        if t <= 0:
            break
        flops *= seconds / t
    return Work(flops, 0.0, "gemm", 1)


@dataclass(frozen=True)
class LinaStep:
    """What :func:`simulate_lina_step` measured on rank 0: ``step_s``; ``a2a_s`` (backward
    all-to-all spans: dispatch and combine, issue to end), ``a2a_forward_s``; ``a2a_bytes``
    (bytes rank 0 sent to other ranks in token exchanges), ``a2a_link`` ("intra"/"inter"/"none":
    the link class of the expert-parallel group); ``pipeline_efficiency``; ``grad_ops``; the
    engine's ``result``."""

    step_s: float
    a2a_s: tuple
    a2a_forward_s: tuple
    a2a_bytes: int
    a2a_link: str
    pipeline_efficiency: Optional[float]
    grad_ops: int
    result: Any


def _grad_like(nbytes: int, dtype) -> Any:
    import torch


    s = torch.empty((), dtype=dtype).element_size()
    return VirtualTensor((max(1, nbytes // s),), dtype)


def _rank_step(ex, model: LinaModel, st, cost, *, comm: str, chunk_bytes: Optional[int], bucket_bytes: int,
               dense_group, expert_group, expert_grad_bytes: int) -> int:
    """One rank's step: forward of every block, backward in reverse with the gradient
    reductions issued as the gradients become ready (FIFO: DDP-like buckets, the first of 1 MiB,
    then of ``bucket_bytes``, across layers at priority 0; Lina: each gradient in micro-ops of at most
    ``chunk_bytes`` at :data:`~tritonmoe.comm.PRIORITY_GRADIENT`), then wait for them."""


    W, d, dt, plan = st.work, st.config.d_model, st.dtype, st.plan
    rows, active, segs = st.expert_stats()
    L = plan.num_local_experts
    like = lambda i: VirtualTensor((rows[i], d), dt)  # noqa: E731
    dense_fwd = _work_for(cost, model.dense_s)
    dense_bwd = _work_for(cost, 2 * model.dense_s)
    for _ in range(model.layers):
        ex.compute(None, work=dense_fwd, kind="dense")
        sends = prologue(ex, st)
        forward_pass(ex, sends, plan, None, work=lambda i: W.expert_fwd(rows[i], active[i], segs[i]), out_like=like)
        for i, (a, b) in enumerate(st.bounds):
            ex.compute(None, work=W.unpermute(b - a, plan.send_rows(i), backward=False), kind="unpermute", micro_op=i)
    ex.phase = "bwd"
    handles: list = []
    pending: list = []  # FIFO: gradients waiting for their bucket to fill
    pending_bytes = 0
    buckets = 0  # DDP's first bucket is small (1 MiB) so that reduction starts early

    def ready(nbytes: int, group) -> None:
        nonlocal pending_bytes
        if comm == "none":
            return
        g = _grad_like(nbytes, dt)
        if comm == "lina":
            handles.extend(issue_gradient_sync(ex, [g], group=group, chunk_bytes=chunk_bytes, priority=PRIORITY_GRADIENT))
        elif group is not dense_group:  # expert replicas: their own group, reduced at once
            handles.extend(issue_gradient_sync(ex, [g], group=group, priority=PRIORITY_EXCHANGE))
        else:
            pending.append(g)
            pending_bytes += nbytes
            if pending_bytes >= (FIRST_BUCKET_BYTES if buckets == 0 else bucket_bytes):
                flush()

    def flush() -> None:
        nonlocal pending_bytes, buckets
        if pending:
            buckets += 1
            handles.extend(issue_gradient_sync(ex, pending, group=dense_group, bucket_bytes=1 << 62,
                                               priority=PRIORITY_EXCHANGE))
            pending.clear()
            pending_bytes = 0

    total_rows = sum(rows)
    any_active = int((plan.recv_counts.sum(dim=(0, 1)) > 0).sum())
    wstep = W.wgrad_step(total_rows, any_active) if st.defer_wgrad else Work(0.0, 0.0, "elementwise", 1)
    router_bytes = d * st.config.num_experts * torch_itemsize(dt)
    for _ in range(model.layers):
        grads = backward_prologue(ex, st)
        backward_pass(
            ex, grads, plan, None,
            work=lambda i: W.expert_bwd(rows[i], active[i], segs[i], defer_wgrad=st.defer_wgrad, accumulate=i > 0,
                                        local_experts=L),
            out_like=like, weight_step_work=wstep,
        )
        if expert_group is not None:
            ready(expert_grad_bytes, expert_group)
        backward_epilogue(ex, st)
        ex.compute(None, work=dense_bwd, kind="dense")
        ready(model.dense_grad_bytes + router_bytes, dense_group)
    flush()
    for h in handles:
        ex.wait(h)
    return len(handles)


def torch_itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def simulate_lina_step(
    model: LinaModel,
    cluster_or_cost: Any,
    *,
    world_size: int,
    comm: str = "lina",
    chunk_bytes: Optional[int] = 30 * 2**20,
    bucket_bytes: int = 25 * 2**20,
    packing: int = 1,
    pipeline_degree: int = 1,
    symmetric: bool = False,
) -> LinaStep:
    """Simulate one training step of ``model`` on ``world_size`` GPUs of a cluster: expert
    parallelism over ``world_size / packing`` ranks (``packing`` replicas per expert, their
    gradients reduced over the expert-data-parallel group), dense gradients over all ranks
    (mesh ``(dp=packing, ep=world_size/packing)``, ep innermost, as :class:`MoEMesh`); ``comm``
    "fifo" (DDP buckets, concurrent with the all-to-alls) or "lina" (micro-ops of at most
    ``chunk_bytes`` behind the all-to-alls; None: priority without partitioning).

    ``symmetric``: record rank 0's program only and run the engine's symmetric mode (every
    other rank mirrors it: exact under the uniform routing this step uses, since every rank
    runs the same program up to its peers; about P times cheaper). The sizing search
    (:mod:`tritonmoe.plan.sizing`) uses it."""


    if comm not in ("fifo", "lina", "none"):
        raise ValueError(f"comm={comm!r}; use 'fifo', 'lina' or 'none' (no gradient reduction: every all-to-all alone)")
    P, p = int(world_size), int(packing)
    cfg = model.config
    if p not in packing_candidates(P, cfg.num_experts):
        raise ValueError(f"packing={p} is not one of {packing_candidates(P, cfg.num_experts)} for {P} GPUs and "
                         f"{cfg.num_experts} experts")
    import torch

    dt = model.dtype or torch.float16
    cost = resolve_cost(cluster_or_cost, dt)
    ep = P // p
    n = int(pipeline_degree)
    counts = routing_counts(cfg, [model.tokens] * ep, n)
    kernels, defers = kernel_flags(cfg, dt, cost)
    s = torch_itemsize(dt)
    W = WorkModel(cfg.d_model, cfg.d_ffn, cfg.n1, cfg.num_experts, cfg.top_k, s, kernels)
    dense = VirtualGroup(tuple(range(P)))
    local_experts = cfg.num_experts // ep
    expert_grad_bytes = local_experts * (cfg.d_model * cfg.n1 + cfg.d_ffn * cfg.d_model) * s
    progs = []
    for r in (range(1) if symmetric else range(P)):
        dp_c, ep_c = divmod(r, ep)
        ep_group = VirtualGroup(tuple(dp_c * ep + j for j in range(ep)))
        expert_group = VirtualGroup(tuple(i * ep + ep_c for i in range(p))) if p > 1 else None
        plan = plan_from_counts(counts, ep_c)
        st = RankStep(cfg, ep_c, ep_group, model.tokens, micro_batch_bounds(model.tokens, n), plan, dt, W, defers,
                      {"schedule": "lina-step", "pipeline_degree": n})
        ex = SimExecutor(r, ep_group, host_compute=cost.host_compute)
        _rank_step(ex, model, st, cost, comm=comm, chunk_bytes=chunk_bytes, bucket_bytes=bucket_bytes, dense_group=dense,
                   expert_group=expert_group, expert_grad_bytes=expert_grad_bytes)
        progs.append(ex.program)
    res = engine.run(progs, cost, symmetric=bool(symmetric))
    ops, tim = progs[0].ops, res.timings[0]
    a2a = [(o, t) for o, t in zip(ops, tim) if o.op == "all_to_all" and o.kind in ("dispatch", "combine")]
    g0 = a2a[0][0].group.ranks if a2a else (0,)
    sent = sum(b for o, _ in a2a for j, b in enumerate(o.send_bytes) if o.group.ranks[j] != 0)
    link = "none" if len(g0) == 1 else (cost.cluster.link_class(g0) if cost.cluster is not None else "?")
    spans = [sp for sp in res.timeline.spans() if sp.rank == 0]

    tl = Timeline()
    for sp in spans:
        tl.add(sp)
    return LinaStep(
        step_s=res.step_time(),
        a2a_s=tuple(t.end - t.start for o, t in a2a if o.phase == "bwd"),
        a2a_forward_s=tuple(t.end - t.start for o, t in a2a if o.phase == "fwd"),
        a2a_bytes=int(sent),
        a2a_link=link,
        pipeline_efficiency=tl.pipeline_efficiency(),
        grad_ops=sum(1 for o in ops if o.op == "all_reduce"),
        result=res,
    )


# ---------------------------------------------------------------------------------------------
# Calibration entries (PAPERS.md section 6: CAL-08, CAL-09, and CAL-10 with packing)
# ---------------------------------------------------------------------------------------------

#: Free parameters of the Lina calibration (001 states none of them; chosen once, never tuned to
#: the paper's results): Transformer-XL-like blocks whose widths follow from Table 1's parameter
#: counts (12 layers, 117M parameters with 4 experts and 419M with 16 give d = 512 with f = 4d),
#: top-2, 8192 tokens per GPU, fp16 activations, fp32 gradients (mixed precision), DDP's 25 MB
#: buckets (1 MiB first), 4 GPUs per node filled in order, and PCIe 4.0 between the GPUs of a
#: node (Table 1's all-to-all takes as long on one node, 4 GPUs, as on four, 16 GPUs: the paper's
#: A100s do not talk over NVLink). The dense part's time is set so that the baseline's all-to-all
#: share of the step is Table 1's (36.7% at 4 GPUs, 39.5% at 16; 2 GPUs as 4, 8 GPUs halfway).
LINA_FREE = ("d=512, f=2048, 12 layers, top-2, gelu, 8192 tokens/GPU, fp16 activations, fp32 gradients, DDP buckets "
             "25 MB (first 1 MiB), 4 GPUs/node with PCIe 4.0 inside a node, 100 Gb/s IB; dense time per layer "
             "calibrated to Table 1's baseline all-to-all share")
_SHARE = {2: 0.367, 4: 0.367, 8: 0.381, 16: 0.395}


def lina_cluster(nodes: Optional[int] = None):
    """The Lina testbed preset with PCIe between the GPUs of a node (see :data:`LINA_FREE`)."""
    import dataclasses


    c = Cluster.preset("lina", nodes=nodes)
    return dataclasses.replace(c, name="lina-pcie", intra=LINKS["pcie4"], intra_is_pcie=True)


def _a2a_share(r: LinaStep) -> float:
    return (sum(r.a2a_s) + sum(r.a2a_forward_s)) / r.step_s


def calibrated_model(P: int, share: float, *, cluster=None, tokens: int = 8192, layers: int = 12) -> LinaModel:
    """The :data:`LINA_FREE` model with one expert per GPU whose dense time makes the FIFO
    baseline's all-to-all share ``share`` (two secant steps; 0 when the all-to-alls alone are
    already a smaller share)."""

    cluster = cluster or lina_cluster()
    m = LinaModel.transformer(MoEConfig(512, 2048, P, 2, activation="gelu"), layers=layers, tokens=tokens)
    D = 0.0
    for _ in range(3):
        r = simulate_lina_step(m, cluster, world_size=P, comm="fifo")
        A = _a2a_share(r) * r.step_s
        D = max(0.0, D + (A / share - r.step_s) / (3 * layers))
        m = m.with_dense_s(D)
    return m


def _micro_ops(model: LinaModel, chunk_bytes: int = 30 * 2**20) -> int:
    """Lina's all-to-all micro-ops: the dispatch cut into pieces of at most ``chunk_bytes``
    (PAPERS.md 1.2 reading: the same s bytes per micro-op)."""
    cfg = model.config
    rows_bytes = model.tokens * cfg.top_k * cfg.d_model * torch_itemsize(model.dtype or _fp16())
    return max(1, -(-rows_bytes // chunk_bytes))


def _fp16():
    import torch

    return torch.float16


def packing_timings(model: LinaModel, cluster, world_size: int, n: int) -> dict:
    """p -> (one expert-FFN micro-op, one all-to-all micro-op) in seconds, simulated without
    gradient traffic for every packing the layout admits (forward micro-ops, medians)."""
    import statistics

    out = {}
    for p in packing_candidates(world_size, model.config.num_experts):
        r = simulate_lina_step(model, cluster, world_size=world_size, comm="none", packing=p, pipeline_degree=n)
        ops, tim = r.result.programs[0].ops, r.result.timings[0]
        ffn = [t.end - t.start for o, t in zip(ops, tim) if o.kind == "expert" and o.phase == "fwd"]
        a2a = [t.end - t.start for o, t in zip(ops, tim) if o.kind == "dispatch" and o.phase == "fwd"]
        out[p] = (statistics.median(ffn) if ffn else 0.0, statistics.median(a2a) if (a2a and r.a2a_bytes) else 0.0)
    return out


def cal08() -> dict:
    """Step time of the FIFO baseline over Lina's priority alone and priority + 30 MB
    partitioning, one expert per GPU, 2/4/8/16 GPUs."""
    c = lina_cluster()
    gains, prio, detail = [], [], []
    for P in (2, 4, 8, 16):
        m = calibrated_model(P, _SHARE[P], cluster=c)
        base = simulate_lina_step(m, c, world_size=P, comm="fifo")
        only = simulate_lina_step(m, c, world_size=P, comm="lina", chunk_bytes=None)
        part = simulate_lina_step(m, c, world_size=P, comm="lina", chunk_bytes=30 * 2**20)
        gains.append(base.step_s / part.step_s)
        prio.append(base.step_s / only.step_s)
        detail.append(f"{P} GPUs: baseline {base.step_s * 1e3:.0f} ms (a2a share {_a2a_share(base):.1%}, dense "
                      f"{m.dense_s * 1e3:.2f} ms/layer), priority {prio[-1]:.2f}x, +partition {gains[-1]:.2f}x")
    return {"simulated": "/".join(f"{g:.2f}" for g in gains),
            "detail": "; ".join(detail) + f"; priority alone averages {sum(prio) / len(prio):.2f}x (paper: 1.24x)"}


def cal09() -> dict:
    """Full Lina (priority, 30 MB partitioning, pipelining with 30 MB micro-ops, packing) over
    the FIFO baseline (one expert per GPU, no pipelining), 2/4/8/16 GPUs; with the structural
    checks of PAPERS.md CAL-09 and the packing the rule of 001 section 4.2 picks."""
    c = lina_cluster()
    out, detail = [], []
    for P in (2, 4, 8, 16):
        m = calibrated_model(P, _SHARE[P], cluster=c)
        n = _micro_ops(m)
        base = simulate_lina_step(m, c, world_size=P, comm="fifo")
        rule = expert_packing(*_split(packing_timings(m, c, P, n)), world_size=P, num_experts=P)
        full = simulate_lina_step(m, c, world_size=P, comm="lina", packing=2, pipeline_degree=n)
        out.append(base.step_s / full.step_s)
        detail.append(f"{P} GPUs: {out[-1]:.2f}x with p=2 (a2a {full.a2a_bytes / 2**20:.0f} MiB sent, {full.a2a_link}); "
                      f"the packing rule picks p={rule.p}")
    return {"simulated": "/".join(f"{g:.2f}" for g in out), "detail": "; ".join(detail)}


def _split(t: dict) -> tuple[dict, dict]:
    return {p: v[0] for p, v in t.items()}, {p: v[1] for p, v in t.items()}


def cal10_packed() -> dict:
    """Pipelining efficiency at 16 GPUs with 2 experts per GPU, beside the same model without
    packing: the CAL-10 model of :mod:`tritonmoe.plan.calibrate` (d=1024, f=4096, top-2, 8192
    tokens per GPU, 30 MB micro-ops), one MoE layer, no gradient traffic."""

    c = lina_cluster()
    m = LinaModel.transformer(MoEConfig(1024, 4096, 16, 2, activation="gelu"), layers=1, tokens=8192)
    n = _micro_ops(m)
    eff = {p: simulate_lina_step(m, c, world_size=16, comm="none", packing=p, pipeline_degree=n).pipeline_efficiency
           for p in (1, 2)}
    return {"simulated": eff[2], "detail": f"without packing {eff[1]:.2f} (degree {n}; paper 0.33-0.36 -> 0.79-0.86)"}


def choose_lina(model: LinaModel, cluster_or_cost: Any, *, world_size: int,
                chunks: tuple = LINA_CHUNK_CANDIDATES, packings: Optional[tuple] = None) -> dict:
    """The planner for Lina's options: simulate every candidate of the dimensions ``comm``
    ("fifo", "lina"), ``lina_chunk_bytes`` (:data:`LINA_CHUNK_CANDIDATES`) and
    ``expert_packing`` (:func:`packing_candidates`; the all-to-all micro-ops are cut at the chunk
    size, PAPERS.md 1.2 reading) and return the fastest as ``{"comm", "lina_chunk_bytes",
    "expert_packing", "pipeline_degree", "step_s"}`` plus ``"candidates"``: every step time."""
    cfg = model.config
    packings = packings or tuple(packing_candidates(world_size, cfg.num_experts))
    rows = []
    for p in packings:
        rows.append(({"comm": "fifo", "lina_chunk_bytes": None, "expert_packing": p, "pipeline_degree": 1},))
        for ch in chunks:
            n = _micro_ops(model, ch) if ch is not None else 1
            rows.append(({"comm": "lina", "lina_chunk_bytes": ch, "expert_packing": p, "pipeline_degree": n},))
    results = []
    for (cand,) in rows:
        r = simulate_lina_step(model, cluster_or_cost, world_size=world_size, comm=cand["comm"],
                               chunk_bytes=cand["lina_chunk_bytes"], packing=cand["expert_packing"],
                               pipeline_degree=cand["pipeline_degree"])
        results.append(dict(cand, step_s=r.step_s))
    best = min(results, key=lambda c: c["step_s"])
    return dict(best, candidates=results)
