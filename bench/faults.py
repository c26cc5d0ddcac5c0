"""Fault table of expert parallelism: what every rank sees when one rank fails, and how soon.

``python -m bench faults`` runs every case of :data:`CASES` on spawned gloo groups of 2 and 4
ranks (CPU, loopback) and prints, per case and world size, each rank's outcome (a result and
whether it is right, a typed or untyped exception, an injected exit, a crash, or a hang) and the
time to it. ``tests/test_faults.py`` runs the same table and asserts the goal:

* every **fault** ends, on every rank, in a *typed* exception (anything but a bare
  ``RuntimeError`` / ``Exception``: ``ValueError``, ``TypeError``, torch's ``DistError`` family,
  tritonmoe's ``ScheduleError``...) within the process-group timeout + 5 s; the rank the fault
  is injected into may instead exit (that is the fault);
* every **legal** case (zero tokens, ragged batches, a straggler) gives every rank the right
  result: output, input gradient and its experts' weight gradients equal (fp64, to 1e-10) to a
  single-process layer holding all experts, applied to each rank's batch;
* nothing hangs: the parent kills a rank that stays in one case past the case's limit plus a
  slack and reports it as "hang".

Adding a case is one entry: a :class:`FaultCase` whose ``run(ctx)`` executes on every rank,
usually :func:`ep_step` with a fault armed on the victim rank by :func:`inject` (an exit, an
exception or a sleep before any method's n-th matching call). A rank dying inside a
Lina-scheduled gradient allreduce, for instance::

    def _exit_in_allreduce(ctx):
        def arm(c, layer, x):
            inject(RealExecutor, "all_reduce", action=c.exit, when=lambda ex, *a, **k: ex.phase == "bwd")
            return x

        return ep_step(ctx, before=on_victim(arm))  # plus the layer options that schedule it

    register(FaultCase("exit in a scheduled allreduce", "rank 1 dies inside the gradient allreduce",
                       _exit_in_allreduce, victims=(1,)))

Ranks rendezvous on a TCPStore the parent serves on a port the kernel assigned as it bound it
(a free port chosen by the parent and bound later by rank 0 could be taken in between by the
sockets of the other groups running at once). Every case runs in its own process group (a fault leaves a gloo group unusable) except the
``shared`` ones, whose outcome leaves the group healthy (legal cases and errors that every rank
raises together); those of one world size share one group, run one after the other. Groups run
concurrently (``parallel``): each rank times its case from a barrier after start-up, so
start-up contention does not count. Ranks initialize with a long timeout and run each case on a
new group created with the long timeout (its creation connects ranks that arrive at different
times on a busy machine) and then given the short one (``pg_timeout_s``), so slow start-up is
not a timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pickle
import signal
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tritonmoe.comm.rendezvous import init_local, local_store

__all__ = [
    "FaultCase",
    "RankCtx",
    "Outcome",
    "Row",
    "CASES",
    "REFUSED_ROWS",
    "register",
    "inject",
    "InjectedFault",
    "ep_step",
    "on_victim",
    "run_table",
    "format_table",
    "markdown_table",
    "markdown_rows",
    "docs_table_lines",
    "write_docs",
    "DOCS_BEGIN",
    "DOCS_END",
    "main",
]

#: Exit status of a rank that leaves on purpose (an injected exit).
EXIT_INJECTED = 77
#: Exception classes that say nothing about what failed: an error of exactly one of these
#: types does not meet the goal (subclasses do).
UNTYPED = ("builtins.RuntimeError", "builtins.Exception", "builtins.BaseException", "builtins.OSError")
#: Start-up allowance (forks, rendezvous, warm-up) of a group, and between two of its cases.
INIT_TIMEOUT_S = 180.0
#: How far past its limit a rank may run a case before the parent kills it as a hang.
HANG_SLACK_S = 20.0

# Shape of the expert-parallel layer every case uses (tiny: the table is about control flow).
D_MODEL, D_FFN, TOP_K, SEED = 8, 12, 2, 1234
TOL = dict(rtol=1e-10, atol=1e-10)


class InjectedFault(RuntimeError):
    """The error a fault case raises on purpose on its victim rank."""


@dataclass
class RankCtx:
    """What a case's ``run`` gets on each rank.

    Attributes:
        rank, world_size: this rank and P.
        group: the case's process group (timeout ``pg_timeout_s``); pass it as ``ep_group``.
        is_victim: whether the case injects its fault on this rank.
        case: the case's name; ``marker_dir``: where :meth:`exit` leaves its marker.
    """

    rank: int
    world_size: int
    group: Any
    pg_timeout_s: float
    is_victim: bool
    case: str
    marker_dir: str
    t0: float = field(default_factory=time.monotonic)

    t_end: Optional[float] = None

    def start_clock(self) -> None:
        """Restart the case's clock once every rank is set up (a barrier on the case's group):
        the time to an outcome then counts from the step the fault hits, not from the setup."""
        dist.barrier(group=self.group)
        self.t0 = time.monotonic()

    def stop_clock(self) -> None:
        """The step is done: checking its result is not timed."""
        self.t_end = time.monotonic()

    def exit(self, *args, **kwargs) -> None:
        """Leave now, as a crashing rank would (no cleanup, no collective), after writing a
        marker so the table can tell an injected exit from a crash. Usable as an ``inject``
        action (ignores its arguments)."""
        with open(os.path.join(self.marker_dir, f"{_slug(self.case)}.rank{self.rank}.exited"), "w"):
            pass
        os._exit(EXIT_INJECTED)

    def raise_fault(self, *args, **kwargs) -> None:
        """Raise :class:`InjectedFault` (an ``inject`` action)."""
        raise InjectedFault(f"injected fault on rank {self.rank} ({self.case})")

    def default_group_timeout(self) -> None:
        """Give the default group the case's timeout (``pg_timeout_s``), as a user's
        ``init_process_group(timeout=...)`` would: for cases whose library-made groups are carved
        out of the default group (they must inherit its timeout). The harness starts the default
        group with the long start-up timeout; each case runs in its own processes, so this is
        never undone."""
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.pg_timeout_s), None)


def inject(owner: Any, attr: str, *, action: Callable[..., Any], when: Optional[Callable[..., bool]] = None,
           nth: int = 1) -> None:
    """Wrap ``owner.attr`` (a function, method or class attribute) in this process so that the
    ``nth`` call for which ``when(*args, **kwargs)`` holds (every call when ``when`` is None)
    first runs ``action(*args, **kwargs)``: ``ctx.exit``, ``ctx.raise_fault``, or e.g.
    ``lambda *a, **k: time.sleep(5)`` (the call then proceeds). Patching a class attribute
    affects every instance; ``args`` then start with ``self``. Only the victim calls this, in
    its own process, so nothing needs undoing."""
    original = getattr(owner, attr)
    seen = [0]

    def wrapper(*args, **kwargs):
        if when is None or when(*args, **kwargs):
            seen[0] += 1
            if seen[0] == nth:
                action(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, attr, wrapper)


@dataclass(frozen=True)
class FaultCase:
    """One row of the table.

    Attributes:
        name: the row's label (unique).
        why: what it models.
        run: ``run(ctx) -> dict`` on every rank; for legal cases the dict has ``correct`` (bool)
            and ``max_err``; a fault shows as the exception it raises (or the rank's exit).
        legal: every rank must return a correct result (else: every rank must end in a typed
            exception, or the victim in its injected exit).
        victims: ranks the fault is injected on (``ctx.is_victim``).
        shared: its outcome leaves the group healthy, so it may share a group with other
            shared cases of the same world size.
        extra_s: waiting the case adds on purpose (a straggler's sleep), added to its limit.
        stays_up: the victim's process lives on after its outcome (it caught the error), past
            its peers' timeout, keeping its connections open: the peers can only time out.
            Otherwise it ends at once, as an uncaught exception ends a training process.
        setup_delay_s: the victims reach the creation of the case's group this much later than
            the others (a harness self-test: on a busy machine ranks arrive seconds apart).
    """

    name: str
    why: str
    run: Callable[[RankCtx], dict]
    legal: bool = False
    victims: tuple[int, ...] = ()
    shared: bool = False
    extra_s: float = 0.0
    stays_up: bool = False
    setup_delay_s: float = 0.0


CASES: dict[str, FaultCase] = {}


def register(case: FaultCase) -> FaultCase:
    """Add a case to :data:`CASES` (names are unique)."""
    if case.name in CASES:
        raise ValueError(f"fault case {case.name!r} is already registered")
    CASES[case.name] = case
    return case


# ---------------------------------------------------------------------------------------------
# The expert-parallel step every case runs
# ---------------------------------------------------------------------------------------------


def ep_step(
    ctx: RankCtx,
    *,
    tokens: Optional[Sequence[int]] = None,
    pipeline_degree: int = 2,
    dtype: torch.dtype = torch.float64,
    pipeline_degrees: Optional[Sequence[int]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    before: Optional[Callable[[RankCtx, Any, torch.Tensor], torch.Tensor]] = None,
    ep_capacity: Optional[int] = None,
    build_dtype: Optional[torch.dtype] = None,
) -> dict:
    """One forward + backward of an expert-parallel MoELayer (E = 2P experts, top-2, fp64) on
    ``ctx.group``, checked against a single-process layer holding all experts on every rank's
    batch (built from the same seeds on every rank).

    Args:
        tokens: tokens per rank (default 6 each).
        pipeline_degrees, dtypes: per-rank overrides of the layer's pipeline degree and dtype
            (ranks that disagree: construction must refuse it on every rank).
        before: ``before(ctx, layer, x) -> x`` runs after construction, before the forward (the
            place to inject a fault on the victim or change its input).
        ep_capacity: the static expert-parallel mode (``MoEConfig(ep_capacity=C)``, pipeline
            degree 1); the reference drops the same slots (its capacity is C).
        build_dtype: every rank builds its layer in this dtype and casts it to ``dtype`` after
            construction (as ``model.to(dtype)`` after building does).

    Returns: ``{"correct": bool, "max_err": float}`` (output, input gradient, this rank's
    experts' weight gradients).
    """
    import tritonmoe as tm

    P, r = ctx.world_size, ctx.rank
    tokens = tuple(tokens) if tokens is not None else (6,) * P
    E = 2 * P
    n = pipeline_degrees[r] if pipeline_degrees is not None else pipeline_degree
    layer_dtype = dtypes[r] if dtypes is not None else dtype
    torch.manual_seed(SEED)
    static = {} if ep_capacity is None else {"ep_capacity": ep_capacity}
    if static:
        n = 1
    ref = tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, E, TOP_K, **static), dtype=dtype)
    layer = tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, E, TOP_K, pipeline_degree=n, **static), ep_group=ctx.group,
                        dtype=build_dtype or layer_dtype)
    if build_dtype is not None:
        layer.to(layer_dtype)
    L = E // P
    mine = slice(r * L, (r + 1) * L)
    with torch.no_grad():
        layer.router.weight.copy_(ref.router.weight)
        layer.w1.copy_(ref.w1[mine])
        layer.w2.copy_(ref.w2[mine])
    gen = torch.Generator().manual_seed(SEED + 1)
    xs = [torch.randn(T, D_MODEL, generator=gen, dtype=dtype) for T in tokens]
    gs = [torch.randn(T, D_MODEL, generator=gen, dtype=dtype) for T in tokens]
    x = xs[r].clone()
    if before is not None:
        x = before(ctx, layer, x)
    x.requires_grad_()
    ctx.start_clock()
    out = layer(x)
    (out * gs[r].to(out.dtype)).sum().backward()
    ctx.stop_clock()

    errs = []
    for s in range(P):
        xr = xs[s].clone().requires_grad_()
        o = ref(xr)
        (o * gs[s]).sum().backward()
        if s == r:
            errs += [(out.detach(), o.detach()), (x.grad, xr.grad)]
    errs += [(layer.w1.grad, ref.w1.grad[mine]), (layer.w2.grad, ref.w2.grad[mine])]
    correct, max_err = True, 0.0
    for got, want in errs:
        if got.shape != want.shape or got.dtype != want.dtype:
            correct = False
            continue
        if got.numel():
            max_err = max(max_err, float((got - want).abs().max()))
        correct = correct and torch.allclose(got, want, **TOL)
    return {"correct": correct, "max_err": max_err}


def on_victim(fn: Callable[[RankCtx, Any, torch.Tensor], torch.Tensor]):
    """An :func:`ep_step` ``before`` hook that runs ``fn(ctx, layer, x) -> x`` on the case's
    victim ranks only (the others keep their input)."""

    def before(ctx: RankCtx, layer, x):
        return fn(ctx, layer, x) if ctx.is_victim else x

    return before


def _executor():
    from tritonmoe.comm.executor import RealExecutor

    return RealExecutor


# ---------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------


def _raise_before_dispatch(ctx: RankCtx) -> dict:
    def arm(c, layer, x):
        inject(layer.dispatcher, "exchange_counts", action=c.raise_fault)
        return x

    return ep_step(ctx, before=on_victim(arm))


def _exit_mid_forward(ctx: RankCtx) -> dict:
    def arm(c, layer, x):
        inject(_executor(), "all_to_all", action=c.exit,
               when=lambda ex, *a, **k: ex.phase == "fwd" and k.get("kind") == "dispatch" and k.get("micro_op") == 1)
        return x

    return ep_step(ctx, before=on_victim(arm))


def _exit_mid_backward(ctx: RankCtx) -> dict:
    def arm(c, layer, x):
        inject(_executor(), "all_to_all", action=c.exit, when=lambda ex, *a, **k: ex.phase == "bwd")
        return x

    return ep_step(ctx, before=on_victim(arm))


def _straggler(ctx: RankCtx) -> dict:
    def arm(c, layer, x):
        inject(_executor(), "compute", action=lambda *a, **k: time.sleep(5.0),
               when=lambda ex, *a, **k: k.get("kind") == "expert")
        return x

    return ep_step(ctx, before=on_victim(arm))


def _cast_after_construction(ctx: RankCtx) -> dict:
    def cast(c, layer, x):
        layer.float()
        return x.float()

    return ep_step(ctx, before=on_victim(cast))


def _input_dtype(ctx: RankCtx) -> dict:
    return ep_step(ctx, before=on_victim(lambda c, layer, x: x.float()))


def _zero_tokens(ctx: RankCtx) -> dict:
    return ep_step(ctx, tokens=[0] + [5 + 2 * s for s in range(1, ctx.world_size)])


def _ragged(ctx: RankCtx) -> dict:
    return ep_step(ctx, tokens=[(3, 17, 1, 9)[s % 4] for s in range(ctx.world_size)], pipeline_degree=4)


def _pipeline_mismatch(ctx: RankCtx) -> dict:
    return ep_step(ctx, pipeline_degrees=[3 if s == 1 else 2 for s in range(ctx.world_size)])


def _dtype_at_construction(ctx: RankCtx) -> dict:
    return ep_step(ctx, dtypes=[torch.float32 if s == 1 else torch.float64 for s in range(ctx.world_size)])


def _exit_in_lina_allreduce(ctx: RankCtx) -> dict:
    """A data-parallel step (4 dense params and an MoE layer, replicated: dp = P) whose gradient
    allreduce runs in Lina's micro-ops on the scheduler's lane; the victim dies in its first
    gradient micro-op. The mesh spans the default group (its timeout is the long start-up one;
    a dead peer is reported at once)."""
    return _lina_step(ctx, arm_exit=True)


def _lina_step(ctx: RankCtx, arm_exit: bool = False) -> dict:
    import tritonmoe as tm
    from tritonmoe.comm.priority import CommScheduler
    from tritonmoe.parallel import MoEMesh, data_parallel

    P = ctx.world_size
    mesh = MoEMesh.build(dp=P, ep=1)
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(
        torch.nn.Linear(D_MODEL, D_MODEL, dtype=torch.float64),
        tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, 2 * P, TOP_K), mesh=mesh, dtype=torch.float64),
    )
    ddp = data_parallel(model, mesh, comm="lina", chunk_bytes=256)
    if ctx.is_victim and arm_exit:
        inject(CommScheduler, "_reduce", action=ctx.exit)
    x = torch.randn(6, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED + ctx.rank))
    ctx.start_clock()
    try:
        ddp(x).square().sum().backward()
    finally:
        ddp._tritonmoe_data_parallel.scheduler.close()
    ctx.stop_clock()
    return {"correct": True, "max_err": 0.0}


def _exit_in_saa(ctx: RankCtx) -> dict:
    """Parm's S2 with MP = 2 over the P ranks (ParmLayout.make(2, P, 1)): the victim dies inside
    the SAA collective (between two of its point-to-point phases) of its forward."""
    import tritonmoe as tm
    from tritonmoe.comm.executor import RealExecutor
    from tritonmoe.parm_layout import ParmLayout

    P = ctx.world_size
    lay = ParmLayout.make(2, P, 1)
    groups = lay.process_groups()
    torch.manual_seed(SEED)
    layer = tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, 2 * P, TOP_K, parm_schedule="s2"), parm_groups=groups,
                        dtype=torch.float64)
    torch.manual_seed(SEED + lay.mp_group[groups.rank])  # the MP group's ranks hold the same tokens
    x = torch.randn(8, D_MODEL, dtype=torch.float64, requires_grad=True)
    if ctx.is_victim:
        inject(RealExecutor, "send_recv", action=ctx.exit, nth=2)
    ctx.start_clock()
    layer(x).sum().backward()
    ctx.stop_clock()
    return {"correct": True, "max_err": 0.0}


STATIC_C = 4  # the static cases' ep_capacity (slots per expert and rank)


def _static_ragged(ctx: RankCtx) -> dict:
    return ep_step(ctx, tokens=[(3, 17, 1, 9)[s % 4] for s in range(ctx.world_size)], ep_capacity=STATIC_C)


def _static_cast_everywhere(ctx: RankCtx) -> dict:
    return ep_step(ctx, ep_capacity=STATIC_C, build_dtype=torch.float32)


def _static_dtype_at_construction(ctx: RankCtx) -> dict:
    return ep_step(ctx, ep_capacity=STATIC_C,
                   dtypes=[torch.float32 if s == 1 else torch.float64 for s in range(ctx.world_size)])


def _static_cast_after_construction(ctx: RankCtx) -> dict:
    def cast(c, layer, x):
        layer.float()
        return x.float()

    return ep_step(ctx, ep_capacity=STATIC_C, before=on_victim(cast))


def _parm_groups(ctx: RankCtx):
    """Parm's groups for MP = 2 over the P ranks (ParmLayout.make(2, P, 1)), carved out of the
    default group, which has the case's timeout."""
    from tritonmoe.parm_layout import ParmLayout

    dist.barrier()  # the ranks arrive together at the group creation, which the short timeout bounds
    ctx.default_group_timeout()
    lay = ParmLayout.make(2, ctx.world_size, 1)
    return lay, lay.process_groups()


def _parm_step(ctx: RankCtx, lay, groups) -> dict:
    import tritonmoe as tm

    torch.manual_seed(SEED)
    layer = tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, 2 * ctx.world_size, TOP_K, parm_schedule="s2"),
                        parm_groups=groups, dtype=torch.float64)
    torch.manual_seed(SEED + lay.mp_group[groups.rank])  # the MP group's ranks hold the same tokens
    x = torch.randn(8, D_MODEL, dtype=torch.float64, requires_grad=True)
    ctx.start_clock()
    if ctx.is_victim:
        ctx.raise_fault()  # before the forward's first collective, on Parm's groups
    layer(x).sum().backward()
    ctx.stop_clock()
    return {"correct": True, "max_err": 0.0}


def _parm_peer_absent(ctx: RankCtx) -> dict:
    lay, groups = _parm_groups(ctx)
    return _parm_step(ctx, lay, groups)


def _hier_groups(ctx: RankCtx):
    from tritonmoe.comm import hierarchical_groups

    return hierarchical_groups(2, group=ctx.group)  # node groups of 2 ranks (and rails for P = 4)


def _hier_exchange(ctx: RankCtx, groups, *, victim_raises: bool = False) -> dict:
    from tritonmoe.comm import hierarchical_all_to_all

    P = ctx.world_size
    splits = [2] * P
    x = torch.randn(2 * P, D_MODEL, dtype=torch.float64, requires_grad=True)
    ctx.start_clock()
    if ctx.is_victim and victim_raises:
        ctx.raise_fault()
    # Splits given and unchecked: the first collective is the step-size exchange on a node group.
    hierarchical_all_to_all(x, splits, splits, groups=groups, check=False).sum().backward()
    ctx.stop_clock()
    return {"correct": True, "max_err": 0.0}


def _hier_peer_absent(ctx: RankCtx) -> dict:
    return _hier_exchange(ctx, _hier_groups(ctx), victim_raises=True)


def _hier_exit(ctx: RankCtx) -> dict:
    groups = _hier_groups(ctx)
    if ctx.is_victim:
        inject(_executor(), "all_to_all", action=ctx.exit)  # inside the two-step exchange
    return _hier_exchange(ctx, groups)


def _grad_lane_cannot_start(ctx: RankCtx) -> dict:
    """The Lina data-parallel step of :func:`_exit_in_lina_allreduce`, but the victim's gradient
    lane cannot start its worker thread (a process out of threads)."""
    import threading

    def no_thread(th, *a, **k):
        raise RuntimeError("can't start new thread")

    if ctx.is_victim:
        inject(threading.Thread, "start", action=no_thread, when=lambda th, *a, **k: th.name == "tritonmoe-grad-lane")
    return _lina_step(ctx)


def _refused(ctx: RankCtx, bad: Callable[[int, torch.Tensor], tuple], parm: Optional[str] = None,
             fitted: bool = False) -> dict:
    """One forward of an expert-parallel layer (pipeline degree 2; Parm with MP = 2 and schedule
    ``parm`` when given) in which the victims call ``layer(*bad(rank, x))`` instead of ``layer(x)``: input
    that the layer refuses on those ranks only. Every rank must end in the same
    ``RankInputError`` (raised at the counts exchange, which carries the refusal). ``fitted``:
    Parm "auto" is given a cost model first (as after its first fit)."""
    import tritonmoe as tm

    P = ctx.world_size
    torch.manual_seed(SEED)
    cfg = tm.MoEConfig(D_MODEL, D_FFN, 2 * P, TOP_K, pipeline_degree=1 if parm else 2,
                       **({"parm_schedule": parm} if parm else {}))
    if parm:
        from tritonmoe.parm_layout import ParmLayout

        lay = ParmLayout.make(2, P, 1)
        groups = lay.process_groups()
        layer = tm.MoELayer(cfg, parm_groups=groups, dtype=torch.float64)
        seed = SEED + lay.mp_group[groups.rank]  # the MP group's ranks hold the same tokens
        if fitted:
            from tritonmoe.policy.parm_schedule import COLLECTIVES, AlphaBeta, ParmCostModel

            ab = AlphaBeta(1e-5, 1e-9)
            layer.expert_path.cost_model = ParmCostModel(ag_mp=ab, a2a=ab, overlap=ab,
                                                         collectives={k: ab for k in COLLECTIVES})
    else:
        layer, seed = tm.MoELayer(cfg, ep_group=ctx.group, dtype=torch.float64), SEED + ctx.rank
    x = torch.randn(6, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    args = bad(ctx.rank, x) if ctx.is_victim else (x,)
    ctx.start_clock()
    layer(*args)
    ctx.stop_clock()
    return {"correct": False, "max_err": float("nan")}  # a refused input must never return


def _refused_dtype(ctx: RankCtx) -> dict:
    return _refused(ctx, lambda r, x: (x.float(),))


def _refused_shape(ctx: RankCtx) -> dict:
    return _refused(ctx, lambda r, x: (x[:, :-1],))


def _refused_mask(ctx: RankCtx) -> dict:
    return _refused(ctx, lambda r, x: (x, torch.ones(x.shape[0], dtype=torch.int64)))


def _refused_two_ranks(ctx: RankCtx) -> dict:
    return _refused(ctx, lambda r, x: (x.float(),) if r == 0 else (x[:, :3],))


def _refused_parm(ctx: RankCtx) -> dict:
    return _refused(ctx, lambda r, x: (x.float(),), parm="s2")


def _refused_parm_baseline(ctx: RankCtx) -> dict:
    return _refused(ctx, lambda r, x: (x.float(),), parm="baseline")


def _refused_parm_auto(ctx: RankCtx) -> dict:
    """Parm with ``parm_schedule="auto"`` before its first fit (no cost model): the schedule
    agreement's all-reduce carries the refusal, before the fit's probes."""
    return _refused(ctx, lambda r, x: (x.float(),), parm="auto")


def _refused_parm_auto_fitted(ctx: RankCtx) -> dict:
    """As :func:`_refused_parm_auto`, with a cost model set (as after the first fit)."""
    return _refused(ctx, lambda r, x: (x.float(),), parm="auto", fitted=True)


def _static_layer(ctx: RankCtx):
    """A static expert-parallel layer (``ep_capacity`` = :data:`STATIC_C`, fp64) and its
    single-process reference with the same weights."""
    import tritonmoe as tm

    P, r = ctx.world_size, ctx.rank
    E, L = 2 * P, 2
    torch.manual_seed(SEED)
    cfg = tm.MoEConfig(D_MODEL, D_FFN, E, TOP_K, ep_capacity=STATIC_C)
    ref = tm.MoELayer(cfg, dtype=torch.float64)
    layer = tm.MoELayer(cfg, ep_group=ctx.group, dtype=torch.float64)
    with torch.no_grad():
        layer.router.weight.copy_(ref.router.weight)
        layer.w1.copy_(ref.w1[r * L:(r + 1) * L])
        layer.w2.copy_(ref.w2[r * L:(r + 1) * L])
    x = torch.randn(6, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED + r))
    return layer, ref, x


def _static_refused(ctx: RankCtx) -> dict:
    """Static expert parallelism (validation on, the default): the victim feeds fp32 tokens to
    its fp64 layer; its stand-in batch's status rows tell every rank at the end of the forward."""
    layer, _, x = _static_layer(ctx)
    ctx.start_clock()
    layer(x.float() if ctx.is_victim else x)
    ctx.stop_clock()
    return {"correct": False, "max_err": float("nan")}  # a refused input must never return


def _static_refused_unchecked(ctx: RankCtx) -> dict:
    """Static expert parallelism with validation off (no host sync in the forward): a healthy
    inference step, then one in which the victim feeds fp32 tokens. The victim must raise its
    own TypeError (the layer's message, no RankInputError); every peer's output must equal,
    bitwise, its output of the healthy step (its tokens do not depend on the victim's) and the
    single-process layer's on its tokens (fp64 tolerance)."""
    import tritonmoe as tm
    from tritonmoe.comm import RankInputError

    layer, ref, x = _static_layer(ctx)
    with tm.validation(False), torch.no_grad():
        healthy = layer(x)
        ctx.start_clock()
        try:
            out = layer(x.float() if ctx.is_victim else x)
        except TypeError as e:
            ctx.stop_clock()
            ok = ctx.is_victim and not isinstance(e, RankInputError) and "x is torch.float32" in str(e)
            return {"correct": ok, "max_err": 0.0, "raised": f"{type(e).__name__}: {e}"}
        ctx.stop_clock()
        want = ref(x)
    err = float((out - want).abs().max())
    ok = not ctx.is_victim and torch.equal(out, healthy) and torch.allclose(out, want, **TOL)
    return {"correct": ok, "max_err": err}


def _refused_counts(ctx: RankCtx, *, wrong_experts: bool) -> dict:
    """The dispatcher's counts exchange called directly (``AllToAllDispatcher.exchange_counts``,
    2 micro-ops): the victim passes float counts, or counts for one expert too many."""
    from tritonmoe.comm import AllToAllDispatcher

    E = 2 * ctx.world_size
    disp = AllToAllDispatcher(E, ctx.group)
    counts = torch.randint(0, 4, (2, E), generator=torch.Generator().manual_seed(SEED + ctx.rank))
    if ctx.is_victim:
        counts = torch.ones(2, E + 1, dtype=torch.int64) if wrong_experts else counts.double()
    ctx.start_clock()
    disp.exchange_counts(counts)
    ctx.stop_clock()
    return {"correct": False, "max_err": float("nan")}


def _refused_float_counts(ctx: RankCtx) -> dict:
    return _refused_counts(ctx, wrong_experts=False)


def _refused_expert_count(ctx: RankCtx) -> dict:
    return _refused_counts(ctx, wrong_experts=True)


def _replicated(ctx: RankCtx, *, seed: int = SEED, activation: str = "swiglu"):
    import tritonmoe as tm
    from tritonmoe.inference import ReplicatedMoELayer

    torch.manual_seed(seed)
    layer = tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, 2 * ctx.world_size, TOP_K, activation=activation),
                        dtype=torch.float64)
    ctx.start_clock()
    return ReplicatedMoELayer(layer, ctx.group)


def _replicated_refused(ctx: RankCtx) -> dict:
    rep = _replicated(ctx)
    x = torch.randn(6, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(SEED + ctx.rank))
    ctx.start_clock()
    with torch.no_grad():
        rep(x.float() if ctx.is_victim else x)
    ctx.stop_clock()
    return {"correct": False, "max_err": float("nan")}


def _replicated_seed(ctx: RankCtx) -> dict:
    _replicated(ctx, seed=SEED + ctx.is_victim)
    ctx.stop_clock()
    return {"correct": False, "max_err": float("nan")}


def _replicated_activation(ctx: RankCtx) -> dict:
    _replicated(ctx, activation="relu" if ctx.is_victim else "gelu")
    ctx.stop_clock()
    return {"correct": False, "max_err": float("nan")}


#: torch.distributed functions that are collectives (what :func:`_healthy_step_collectives` counts)
_COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_object",
                "all_reduce", "broadcast", "broadcast_object_list", "barrier", "reduce_scatter_tensor", "send", "recv",
                "isend", "irecv", "batch_isend_irecv", "gather", "scatter")


def _healthy_step_collectives(ctx: RankCtx) -> dict:
    """A healthy expert-parallel step (pipeline degree 2, forward + backward) with every
    ``torch.distributed`` collective counted by a wrapper: the refusal's status word rides in the
    counts exchange, so the step makes exactly the calls it made before the word existed, counted
    the same way on the code before it (P = 2 and 4): the clock's barrier and 11 all-to-alls (the
    counts exchange, the forward's dispatch and combine of 2 micro-ops, the backward's 6), and
    nothing else. Right when the result is right and the counts are exactly these."""
    counts: dict[str, int] = {}
    originals = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def counted(name, fn):
        def wrapper(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)

        return wrapper

    for n, fn in originals.items():
        setattr(dist, n, counted(n, fn))
    try:
        out = ep_step(ctx, pipeline_degree=2)
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    want = {"barrier": 1, "all_to_all_single": 11}
    return {"correct": out["correct"] and counts == want, "max_err": out["max_err"], "collectives": counts}


#: The rows of one rank's refused input (and of replicas that differ), with the error class
#: every rank must raise and the text its message must hold (tests/test_faults.py checks them).
REFUSED_ROWS = {
    "input dtype differs": ("RankTypeError", "x is torch.float32 but the layer's parameters are torch.float64"),
    "input shape differs": ("RankValueError", "x has shape (6, 7); the last dimension must be d_model=8"),
    "padding_mask refused on one rank": ("RankTypeError", "padding_mask must be a bool tensor"),
    "two ranks refuse their inputs": ("RankTypeError", "x is torch.float32"),
    "Parm: input dtype differs": ("RankTypeError", "x is torch.float32"),
    "Parm baseline: input dtype differs": ("RankTypeError", "x is torch.float32"),
    "counts exchange: float counts": ("RankValueError", "counts must be an integer tensor of shape"),
    "counts exchange: wrong expert count": ("RankValueError", "counts have "),
    "replicated: input dtype differs": ("RankTypeError", "x is torch.float32"),
    "static EP: input dtype differs": ("RankTypeError", "x is torch.float32 but the layer's parameters are "
                                                        "torch.float64"),
    "Parm auto (before its fit): input dtype differs": ("RankTypeError", "x is torch.float32"),
    "Parm auto (fitted): input dtype differs": ("RankTypeError", "x is torch.float32"),
    "replicated: weights differ": ("ValueError", "weights:w1: rank 0="),
    "replicated: activation differs": ("ValueError", "activation: rank 0='gelu', rank 1='relu'"),
}


for _case in (
    FaultCase("zero tokens on a rank", "rank 0 has no tokens (it still takes part in every exchange)",
              _zero_tokens, legal=True, shared=True),
    FaultCase("ragged batches", "3, 17, 1, 9 tokens per rank, pipeline degree 4 (empty micro-batches)",
              _ragged, legal=True, shared=True),
    FaultCase("straggler sleeps 5 s", "rank 1 sleeps 5 s in its first expert compute; the others wait in the combine "
              "(legal while the process-group timeout exceeds 5 s)",
              _straggler, legal=True, victims=(1,), shared=True, extra_s=5.0),
    FaultCase("pipeline_degree differs", "rank 1 builds its layer with pipeline_degree=3, the others with 2",
              _pipeline_mismatch, victims=(1,), shared=True),
    FaultCase("dtype differs at construction", "rank 1 builds its layer in fp32, the others in fp64",
              _dtype_at_construction, victims=(1,), shared=True),
    FaultCase("raise before dispatch", "rank 1 raises in its forward before any collective (a local error)",
              _raise_before_dispatch, victims=(1,)),
    FaultCase("raise before dispatch (rank stays up)",
              "as above, but the raising rank lives on (it caught the error): its peers can only time out",
              _raise_before_dispatch, victims=(1,), stays_up=True),
    FaultCase("exit mid-forward", "rank 1 exits at its forward dispatch of micro-op 1 (mid-pipeline)",
              _exit_mid_forward, victims=(1,)),
    FaultCase("exit mid-backward", "rank 1 exits at its first backward all-to-all",
              _exit_mid_backward, victims=(1,)),
    FaultCase("dtype cast after construction", "rank 1 casts its layer and input to fp32 after construction",
              _cast_after_construction, victims=(1,)),
    FaultCase("input dtype differs", "rank 1 feeds fp32 tokens to its fp64 layer (refused; the counts exchange "
              "carries the refusal to every rank)", _input_dtype, victims=(1,), shared=True),
    FaultCase("exit in a Lina allreduce", "rank 1 dies in its first gradient micro-op of a Lina-scheduled "
              "data-parallel step (data_parallel(..., comm='lina'))", _exit_in_lina_allreduce, victims=(1,)),
    FaultCase("exit in SAA", "rank 1 dies inside Parm S2's SAA collective (MP = 2)", _exit_in_saa, victims=(1,)),
    FaultCase("static EP: ragged batches", "MoEConfig(ep_capacity=4): 3, 17, 1, 9 tokens per rank (slots past "
              "the capacity dropped, as the reference drops them)", _static_ragged, legal=True, shared=True),
    FaultCase("static EP: every rank casts", "ep_capacity=4; every rank builds in fp32 and casts to fp64 after "
              "construction (the ranks re-agree on the rows' dtype)", _static_cast_everywhere, legal=True, shared=True),
    FaultCase("static EP: dtype differs at construction", "ep_capacity=4; rank 1 builds its layer in fp32, the "
              "others in fp64", _static_dtype_at_construction, victims=(1,), shared=True),
    FaultCase("static EP: dtype cast after construction", "ep_capacity=4; rank 1 casts its layer and input to fp32 "
              "after construction (no counts exchange carries the dtype)", _static_cast_after_construction,
              victims=(1,)),
    FaultCase("Parm groups: rank raises (stays up)", "rank 1 raises before its Parm S2 forward and lives on: its "
              "peers wait on Parm's groups, created from the default group (they must inherit its timeout)",
              _parm_peer_absent, victims=(1,), stays_up=True),
    FaultCase("hierarchical: rank raises (stays up)", "rank 1 raises before a hierarchical all-to-all and lives on: "
              "its peers wait on the node groups hierarchical_groups created (they must inherit the parent's "
              "timeout)", _hier_peer_absent, victims=(1,), stays_up=True),
    FaultCase("exit in a hierarchical all-to-all", "rank 1 dies inside the two-step exchange on the created node "
              "and rail groups", _hier_exit, victims=(1,)),
    FaultCase("gradient lane cannot start", "rank 1's Lina gradient lane cannot start its thread (LaneStartError) "
              "in a data-parallel step", _grad_lane_cannot_start, victims=(1,)),
    FaultCase("input shape differs", "rank 1's tokens have d_model - 1 features", _refused_shape, victims=(1,),
              shared=True),
    FaultCase("padding_mask refused on one rank", "rank 1 passes an int64 padding_mask", _refused_mask, victims=(1,),
              shared=True),
    FaultCase("two ranks refuse their inputs", "rank 0 feeds fp32 tokens, rank 1 tokens of 3 features",
              _refused_two_ranks, victims=(0, 1), shared=True),
    FaultCase("Parm: input dtype differs", "Parm S2 (MP = 2): rank 1 feeds fp32 tokens to its fp64 layer",
              _refused_parm, victims=(1,), shared=True),
    FaultCase("Parm baseline: input dtype differs", "Parm's baseline schedule (MP = 2): rank 1 feeds fp32 tokens",
              _refused_parm_baseline, victims=(1,), shared=True),
    FaultCase("counts exchange: float counts", "AllToAllDispatcher.exchange_counts called directly; rank 1 passes "
              "float64 counts", _refused_float_counts, victims=(1,), shared=True),
    FaultCase("counts exchange: wrong expert count", "AllToAllDispatcher.exchange_counts called directly; rank 1 "
              "passes counts for E + 1 experts", _refused_expert_count, victims=(1,), shared=True),
    FaultCase("replicated: input dtype differs", "ReplicatedMoELayer: rank 1 feeds fp32 tokens (its counts "
              "all-gather carries the refusal)", _replicated_refused, victims=(1,), shared=True),
    FaultCase("replicated: weights differ", "ReplicatedMoELayer: rank 1's layer is built from another seed "
              "(refused at construction)", _replicated_seed, victims=(1,), shared=True),
    FaultCase("replicated: activation differs", "ReplicatedMoELayer: rank 1's layer uses relu, the others gelu",
              _replicated_activation, victims=(1,), shared=True),
    FaultCase("static EP: input dtype differs", "ep_capacity=4, validation on: rank 1 feeds fp32 tokens (its stand-in "
              "batch's status rows in the dispatch tell every rank)", _static_refused, victims=(1,), shared=True),
    FaultCase("static EP (validation off): input refused", "ep_capacity=4 under tm.validation(False) (no host sync): "
              "rank 1 feeds fp32 tokens and raises its own TypeError; its peers' outputs are bitwise those of a "
              "healthy step and the single-process layer's", _static_refused_unchecked, legal=True, victims=(1,),
              shared=True),
    FaultCase("Parm auto (before its fit): input dtype differs", "parm_schedule='auto' (MP = 2), no cost model yet: "
              "rank 1 feeds fp32 tokens (the schedule agreement carries the refusal, before the fit's probes)",
              _refused_parm_auto, victims=(1,), shared=True),
    FaultCase("Parm auto (fitted): input dtype differs", "parm_schedule='auto' (MP = 2) with a cost model set (as "
              "after its fit): rank 1 feeds fp32 tokens", _refused_parm_auto_fitted, victims=(1,), shared=True),
    FaultCase("step after refused inputs", "a healthy step on the group the refused-input rows left (shared): the "
              "refusals end symmetrically, so the group stays usable", _ragged, legal=True, shared=True),
    FaultCase("healthy step: collectives counted", "the status word adds no collective: a healthy step's calls, "
              "counted by a wrapper around torch.distributed, are exactly the ones before it",
              _healthy_step_collectives, legal=True, shared=True),
):
    register(_case)


# ---------------------------------------------------------------------------------------------
# Running groups
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One rank's outcome of one case.

    status: "result", "error", "exited (injected)", "crashed (SIGABRT)" / "died (exit N)",
    "hang" (killed by the parent past the deadline), "not run (an earlier case hung)" or
    "set-up failed" (the harness's start-up or the case's group creation failed). ``exc`` is the exception's qualified class
    name, ``typed`` whether it is more specific than :data:`UNTYPED`, ``seconds`` the time from
    the case's start barrier (None when the rank did not report)."""

    status: str
    seconds: Optional[float] = None
    exc: Optional[str] = None
    typed: Optional[bool] = None
    message: str = ""
    value: Optional[dict] = None

    def short(self) -> str:
        t = f"{self.seconds:.1f}s" if self.seconds is not None else ""
        if self.status == "result":
            ok = self.value is not None and self.value.get("correct")
            return f"result ({'right' if ok else 'WRONG'}) {t}"
        if self.status == "error":
            name = self.exc.rsplit(".", 1)[-1] if self.exc else "?"
            return f"{name}{'' if self.typed else ' (untyped)'} {t}"
        return self.status


@dataclass
class Row:
    """One (case, world size): every rank's outcome and whether the goal is met."""

    case: str
    world_size: int
    legal: bool
    outcomes: list[Outcome]
    limit_s: float
    ok: bool = False
    verdict: str = ""

    def describe(self) -> str:
        per_rank = "; ".join(f"rank {r}: {o.short()}" + (f" [{o.message[:160]}]" if o.message else "")
                             for r, o in enumerate(self.outcomes))
        return f"{self.case} (P={self.world_size}): {self.verdict} -- {per_rank}"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _qualname(e: BaseException) -> str:
    return f"{type(e).__module__}.{type(e).__qualname__}"


def _warm_up() -> None:
    """One local layer step, so first-call costs (autograd engine, kernels' first dispatch) are
    not timed as part of a case."""
    import tritonmoe as tm

    layer = tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, 4, TOP_K), dtype=torch.float64)
    layer(torch.randn(6, D_MODEL, dtype=torch.float64, requires_grad=True)).sum().backward()


def _write(outdir: str, name: str, rank: int, rec: Outcome) -> None:
    base = os.path.join(outdir, f"{_slug(name)}.rank{rank}")
    with open(base + ".tmp", "wb") as f:
        pickle.dump(rec, f)
    os.replace(base + ".tmp", base + ".pkl")


def _rank_main(rank: int, P: int, port: int, cases: list[FaultCase], pg_timeout_s: float, outdir: str) -> None:
    torch.set_num_threads(1)
    import tritonmoe.comm.executor  # noqa: F401 - imported before the clock starts, not inside a case

    names = [c.name for c in cases]
    for i, case in enumerate(cases):
        name = case.name
        try:  # set-up: a failure here is the harness's, never a case's outcome
            if i == 0:
                init_local(rank, P, port, INIT_TIMEOUT_S)  # the parent serves the store on `port`
                _warm_up()
            if rank in case.victims and case.setup_delay_s:  # e.g. its warm-up took longer
                time.sleep(case.setup_delay_s)
            # Created under the start-up timeout (creation connects the ranks, who reach it at
            # different times on a busy machine), then given the case's timeout.
            dist.barrier()
            group = dist.new_group(list(range(P)), timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=pg_timeout_s), group)
            dist.barrier()  # every rank starts the case together (start-up is not timed)
        except BaseException as e:  # noqa: BLE001 - reported in the table
            for n in names[i:]:
                _write(outdir, n, rank, Outcome("set-up failed", exc=_qualname(e), message=" ".join(str(e).split())[:400]))
            os._exit(1)
        open(os.path.join(outdir, f"{_slug(name)}.rank{rank}.started"), "w").close()
        ctx = RankCtx(rank, P, group, pg_timeout_s, rank in case.victims, name, outdir)
        try:
            rec = Outcome("result", value=case.run(ctx))
        except BaseException as e:  # noqa: BLE001 - the outcome is the measurement
            rec = Outcome("error", exc=_qualname(e), typed=_qualname(e) not in UNTYPED,
                          message=" ".join(str(e).split())[:400] or traceback.format_exc(limit=2))
        rec.seconds = (ctx.t_end if rec.status == "result" and ctx.t_end is not None else time.monotonic()) - ctx.t0
        _write(outdir, name, rank, rec)
        if not case.shared:
            if rank in case.victims and case.stays_up:
                time.sleep(_linger_s(pg_timeout_s))  # keeps its connections open past the peers' timeout
            os._exit(0)  # the group may be broken: leave without touching it
    dist.barrier()  # shared cases left the group healthy: close connections only when all are done
    os._exit(0)


def _mp_context():
    """Ranks fork from a server process that has imported torch and tritonmoe once (the spawn
    method would import them again in every rank, seconds of CPU each on a small machine)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tritonmoe", "tritonmoe.comm.executor", __name__])
    return ctx


def _linger_s(pg_timeout_s: float) -> float:
    """How long a victim that stays up lives on after its outcome: past its peers' limit."""
    return pg_timeout_s + 8.0


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _case_limit_s(case: FaultCase, pg_timeout_s: float) -> float:
    """The goal's bound on a case's time to an outcome: timeout + 5 s + its deliberate waits."""
    return pg_timeout_s + 5.0 + case.extra_s


def _watch(procs: list, cases: list[FaultCase], outdir: str, pg_timeout_s: float, init_timeout_s: float,
           hang_slack_s: float) -> set[int]:
    """Wait for the ranks; kill (and return) those stuck in one case for longer than its limit +
    ``hang_slack_s`` (a victim that stays up: its linger), or between cases for longer than
    ``init_timeout_s`` (start-up, group creation)."""
    P = len(procs)
    phase = [(-1, False)] * P  # (case index, outcome written) per rank
    since = [time.monotonic()] * P
    killed: set[int] = set()
    while any(p.is_alive() for p in procs):
        time.sleep(0.05)
        now = time.monotonic()
        for r, p in enumerate(procs):
            if not p.is_alive():
                continue
            i, done = phase[r]
            nxt = i + 1 if done or i < 0 else i
            base = lambda k: os.path.join(outdir, f"{_slug(cases[k].name)}.rank{r}")  # noqa: E731
            if nxt < len(cases) and (os.path.exists(base(nxt) + ".started") or os.path.exists(base(nxt) + ".pkl")):
                i, done = nxt, False
            if 0 <= i and not done and os.path.exists(base(i) + ".pkl"):
                done = True
            if (i, done) != phase[r]:
                phase[r], since[r] = (i, done), now
                continue
            if i < 0 or (done and cases[i].shared):
                allowed = init_timeout_s
            elif done:
                allowed = (_linger_s(pg_timeout_s) if cases[i].stays_up else 0.0) + hang_slack_s
            else:
                allowed = _case_limit_s(cases[i], pg_timeout_s) + hang_slack_s
            if now - since[r] > allowed:
                p.kill()
                killed.add(r)
    for p in procs:
        p.join(5)
    return killed


def _run_group(P: int, cases: list[FaultCase], pg_timeout_s: float, init_timeout_s: float,
               hang_slack_s: float) -> dict[str, list[Outcome]]:
    """Start P ranks that run ``cases`` in order; every rank's outcome per case."""
    ctx = _mp_context()
    with tempfile.TemporaryDirectory() as outdir:
        store = local_store(P, init_timeout_s)  # lives until every rank has ended (no free-port race)
        procs = [ctx.Process(target=_rank_main, args=(r, P, store.port, cases, pg_timeout_s, outdir), daemon=True)
                 for r in range(P)]
        for p in procs:
            p.start()
        killed = _watch(procs, cases, outdir, pg_timeout_s, init_timeout_s, hang_slack_s)
        del store
        table: dict[str, list[Outcome]] = {}
        for case in cases:
            row = []
            for r, p in enumerate(procs):
                base = os.path.join(outdir, f"{_slug(case.name)}.rank{r}")
                if os.path.exists(base + ".pkl"):
                    with open(base + ".pkl", "rb") as f:
                        row.append(pickle.load(f))
                elif os.path.exists(base + ".exited"):
                    row.append(Outcome("exited (injected)"))
                elif r in killed:
                    started = os.path.exists(base + ".started")
                    row.append(Outcome("hang" if started else "not run (an earlier case hung)"))
                elif p.exitcode is not None and p.exitcode < 0:
                    row.append(Outcome(f"crashed ({_signal_name(p.exitcode)})"))
                else:
                    row.append(Outcome(f"died (exit {p.exitcode})"))
            table[case.name] = row
    return table


def _judge(case: FaultCase, row: Row) -> Row:
    bad = []
    for r, o in enumerate(row.outcomes):
        if case.legal:
            if o.status != "result":
                bad.append(f"rank {r} {o.short()}")
            elif not o.value.get("correct"):
                bad.append(f"rank {r} wrong result (max err {o.value.get('max_err'):.3g})")
        elif o.status == "exited (injected)" and r in case.victims:
            continue
        elif o.status != "error":
            bad.append(f"rank {r} {o.short()}")
        elif not o.typed:
            bad.append(f"rank {r} untyped {o.exc}")
        elif o.seconds > row.limit_s:
            bad.append(f"rank {r} took {o.seconds:.1f}s > {row.limit_s:.0f}s")
    row.ok = not bad
    row.verdict = "goal met" if row.ok else "goal NOT met: " + "; ".join(bad)
    return row


def run_table(
    world_sizes: Sequence[int] = (2, 4),
    *,
    pg_timeout_s: float = 10.0,
    cases: Optional[Sequence[Union[str, FaultCase]]] = None,
    parallel: Optional[int] = None,
    init_timeout_s: float = INIT_TIMEOUT_S,
    hang_slack_s: float = HANG_SLACK_S,
) -> list[Row]:
    """Run the cases for every world size; one :class:`Row` per (case, world size), in order.

    Args:
        cases: names of :data:`CASES` or :class:`FaultCase` objects (default: all registered);
            a case's ``run`` must be importable by the ranks (a module-level function).
        parallel: groups running at once (default: all).
        init_timeout_s: start-up allowance of a group (spawn, rendezvous, warm-up), also the
            timeout of the default group the harness itself uses.
        hang_slack_s: how far past its limit a rank may run before it is killed as a hang.
    """
    for name, v in (("pg_timeout_s", pg_timeout_s), ("init_timeout_s", init_timeout_s), ("hang_slack_s", hang_slack_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name}={v!r} must be a positive finite number of seconds (a timeout of {v!r} would "
                             "fail or hang every row; e.g. 10)")
    if parallel is not None and (isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1):
        raise ValueError(f"parallel={parallel!r} must be an int >= 1 (groups running at once) or None (all)")
    chosen: list[FaultCase] = []
    for c in (list(CASES) if cases is None else list(cases)):
        if isinstance(c, FaultCase):
            chosen.append(c)
        elif c in CASES:
            chosen.append(CASES[c])
        else:
            raise ValueError(f"unknown fault case {c!r}; known: {', '.join(CASES)}")
    jobs: list[tuple[int, list[FaultCase]]] = []
    for P in world_sizes:
        if P < 2:
            raise ValueError(f"world size {P}: a fault table needs at least 2 ranks")
        shared = [c for c in chosen if c.shared]
        if shared:
            jobs.append((P, shared))
        jobs += [(P, [c]) for c in chosen if not c.shared]

    def run(job):
        P, group_cases = job
        return P, _run_group(P, group_cases, pg_timeout_s, init_timeout_s, hang_slack_s)

    with ThreadPoolExecutor(max_workers=parallel or len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    by_key = {(P, n): outs for P, table in results for n, outs in table.items()}
    rows = []
    for case in chosen:
        for P in world_sizes:
            row = Row(case.name, P, case.legal, by_key[(P, case.name)], limit_s=_case_limit_s(case, pg_timeout_s))
            rows.append(_judge(case, row))
    return rows


def format_table(rows: list[Row], pg_timeout_s: float) -> str:
    """The table as text: one line per (case, world size)."""
    lines = [
        f"expert-parallel fault table (gloo, CPU; process-group timeout {pg_timeout_s:.0f} s). Goal: faults end in a "
        f"typed exception on every rank within timeout + 5 s (the victim may exit), legal cases give the right "
        f"result, nothing hangs.",
    ]
    w = max(len(r.case) for r in rows) + 2
    for r in rows:
        outcome = " | ".join(f"r{i}: {o.short()}" for i, o in enumerate(r.outcomes))
        lines.append(f"{r.case:{w}} P={r.world_size}  {'legal' if r.legal else 'fault'}  {outcome}")
        lines.append(f"{'':{w}}       {r.verdict}")
    met = sum(r.ok for r in rows)
    lines.append(f"{met} of {len(rows)} rows meet the goal")
    return "\n".join(lines)


#: The markers around the generated table in docs/reliability.md (``--write-docs``).
DOCS_BEGIN = "<!-- fault-table: generated by python -m bench faults --write-docs -->"
DOCS_END = "<!-- end of the fault table -->"


def _outcome_name(o: Outcome) -> str:
    """An outcome without its time ("result (right)", "RankTypeError", "exited (injected)")."""
    return o.short().rsplit(" ", 1)[0] if o.seconds is not None and o.status in ("result", "error") else o.short()


def markdown_rows(rows: list[Row]) -> list[list[str]]:
    """One [case, kind, outcome on every rank, time to surface, goal] per case (its world sizes
    together): the victims' and the others' outcomes, the range of every rank's time."""
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.case, []).append(r)
    out = []
    for name, rs in by.items():
        victims = set(CASES[name].victims) if name in CASES else set()
        vic = sorted({_outcome_name(o) for r in rs for i, o in enumerate(r.outcomes) if i in victims})
        oth = sorted({_outcome_name(o) for r in rs for i, o in enumerate(r.outcomes) if i not in victims})
        if not vic or vic == oth:
            what = f"every rank: {', '.join(oth or vic)}"
        else:
            what = f"victim: {', '.join(vic)}; others: {', '.join(oth)}"
        secs = [o.seconds for r in rs for o in r.outcomes if o.seconds is not None]
        when = f"{min(secs):.1f}-{max(secs):.1f} s" if secs else "-"
        sizes = "/".join(str(r.world_size) for r in rs)
        goal = "met" if all(r.ok for r in rs) else "NOT met"
        out.append([name, "legal" if rs[0].legal else "fault", what, f"{when} (P={sizes})", goal])
    return out


def markdown_table(rows: list[Row]) -> str:
    """The table as Markdown, one line per case (what docs/reliability.md shows)."""
    body = ["| case | kind | outcome | time to surface | goal |", "| --- | --- | --- | --- | --- |"]
    body += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in markdown_rows(rows)]
    return "\n".join(body)


def docs_table_lines(text: str) -> list[str]:
    """The generated table's lines in a docs page (between :data:`DOCS_BEGIN` and :data:`DOCS_END`)."""
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError("the page has no generated fault table (its markers are missing)")
    block = text.split(DOCS_BEGIN, 1)[1].split(DOCS_END, 1)[0]
    return [ln for ln in block.strip().splitlines() if ln.startswith("|")]


def write_docs(rows: list[Row], path: str) -> None:
    """Replace the generated table of the page at ``path`` by this run's."""
    with open(path) as f:
        text = f.read()
    docs_table_lines(text)  # the markers are there
    head, rest = text.split(DOCS_BEGIN, 1)
    tail = rest.split(DOCS_END, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{DOCS_BEGIN}\n{markdown_table(rows)}\n{DOCS_END}{tail}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,4", help="ranks per group, comma-separated (default 2,4)")
    p.add_argument("--timeout", type=float, default=10.0, help="process-group timeout in seconds (default 10)")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all); --list shows them")
    p.add_argument("--parallel", type=int, default=None, help="groups running at once (default: all)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--write-docs", default=None, metavar="PAGE", nargs="?", const="docs/reliability.md",
                   help="rewrite the generated table of PAGE (default docs/reliability.md) from this run")
    args = p.parse_args(argv)
    if args.list:
        for c in CASES.values():
            print(f"{c.name:32} {'legal' if c.legal else 'fault'}  {c.why}")
        return 0
    try:
        sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--world-sizes {args.world_sizes!r} must be comma-separated integers")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        p.error(f"--timeout {args.timeout:g} must be a positive number of seconds (the process-group timeout of "
                "every case; e.g. --timeout 10)")
    if args.parallel is not None and args.parallel < 1:
        p.error(f"--parallel {args.parallel} must be >= 1 (groups running at once; leave it out for all)")
    cases = [c.strip() for c in args.cases.split(",")] if args.cases else None
    t0 = time.monotonic()
    try:
        rows = run_table(sizes, pg_timeout_s=args.timeout, cases=cases, parallel=args.parallel)
    except ValueError as e:
        p.error(str(e))
    print(format_table(rows, args.timeout))
    print(f"({time.monotonic() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    if args.write_docs:
        write_docs(rows, args.write_docs)
    return 0 if all(r.ok for r in rows) else 1
