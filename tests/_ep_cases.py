"""Per-rank bodies of the expert-parallel MoELayer tests (run by tests/test_ep.py in spawned
gloo groups; see tests/_dist.py).

Reference design: each rank routes its own batch (capacity from its own token count), so the
expert-parallel layer on P ranks equals a single-process layer holding all E experts applied to
each rank's batch separately. Every rank builds every rank's batch and the full weights from
the same seeds, runs its expert-parallel forward+backward and the single-process reference on
all P batches, and compares: its output, input gradient and router gradient against the
reference on its own batch; its w1/w2 gradients against the reference's (summed over all
batches) for its local experts. In fp64, a pipelined layer (n > 1) must also equal the n = 1
expert-parallel layer bitwise (torch.equal), output and every gradient.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import tritonmoe as tm

import _fp8_ep_cases
from tritonmoe.comm import Timeline

from _double_backward_cases import ep_penalty

D_MODEL, D_FFN, NUM_EXPERTS = 8, 12, 8
ACTIVATIONS = ("swiglu", "gelu", "relu")
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}

# Per-rank token counts (ragged; a rank with zero tokens; tiny batches): case i uses pattern i % len.
TOKEN_PATTERNS = {
    2: [(6, 13), (0, 9), (7, 0), (3, 3), (1, 17)],
    4: [(9, 0, 14, 5), (3, 8, 0, 11), (6, 6, 6, 6), (0, 1, 12, 2), (10, 4, 7, 0)],
}


@dataclass(frozen=True)
class Case:
    """One expert-parallel equality case; ``why`` says what it covers beyond the grid."""

    pipeline_degree: int
    top_k: int
    dtype: torch.dtype
    capacity_factor: Optional[float]
    activation: str
    dead_expert: Optional[int]  # an expert the selection bias keeps empty
    aux_loss_coef: float
    tokens: tuple[int, ...]
    seed: int
    why: str = ""
    #: the layers real models use: expert biases, GPT-OSS's clamped SwiGLU, a router bias, a
    #: routed scaling factor, DeepSeek-V2's group score, a gated shared expert
    features: bool = False


def cases(world_size: int) -> list[Case]:
    """EP size x pipeline degree {1, 2, 4} x top_k {1, 2} x {fp64, fp32} x {dropless, capacity},
    with activations, an empty expert, the aux loss and ragged / zero-token ranks rotated in."""
    out = []
    grid = itertools.product((1, 2, 4), (1, 2), (torch.float64, torch.float32), (None, 1.25))
    patterns = TOKEN_PATTERNS[world_size]
    for i, (n, k, dt, cf) in enumerate(grid):
        tokens = patterns[i % len(patterns)]
        dead = (3 * i) % NUM_EXPERTS if i % 3 == 0 else None
        why = []
        if 0 in tokens:
            why.append("a rank with zero tokens")
        if dead is not None:
            why.append(f"expert {dead} receives nothing")
        if max(tokens) < n:
            why.append("empty micro-batches")
        features = i % 4 in (1, 2)
        if features:
            why.append("expert/router biases, swiglu_oai, scaling, group score max, gated shared expert")
        out.append(
            Case(
                pipeline_degree=n,
                top_k=k,
                dtype=dt,
                capacity_factor=cf,
                activation="swiglu_oai" if features else ACTIVATIONS[i % 3],
                dead_expert=dead,
                aux_loss_coef=0.01 if i % 2 else 0.0,
                tokens=tokens,
                seed=1000 + i,
                why=", ".join(why),
                features=features,
            )
        )
    return out


def _config(c: Case, pipeline_degree: int = 1) -> tm.MoEConfig:
    return tm.MoEConfig(
        D_MODEL,
        D_FFN,
        NUM_EXPERTS,
        c.top_k,
        activation=c.activation,
        capacity_factor=c.capacity_factor,
        aux_loss_coef=c.aux_loss_coef,
        expert_bias=c.dead_expert is not None,
        pipeline_degree=pipeline_degree,
        **(dict(swiglu_limit=0.6, swiglu_alpha=1.3, expert_ffn_bias=True, router_bias=True, routed_scaling_factor=1.5,
                n_groups=4, topk_groups=2, group_score="max", shared_d_ffn=6, shared_expert_gate=True)
           if c.features else {}),
    )


def _close(failures: list[str], label: str, got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    if got.shape != want.shape:
        failures.append(f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    try:
        torch.testing.assert_close(got, want, **TOL[dtype])
    except AssertionError as e:
        failures.append(f"{label}: {str(e).splitlines()[0]} / {' '.join(str(e).split()[-12:])}")


def run_case(rank: int, P: int, c: Case) -> tuple[list[str], Optional[float]]:
    """(failures, forward+backward pipelining efficiency) of one case on this rank."""
    failures: list[str] = []
    label = f"P={P} n={c.pipeline_degree} k={c.top_k} {c.dtype} cf={c.capacity_factor} {c.activation} ({c.why})"
    torch.manual_seed(c.seed)
    ref = tm.MoELayer(_config(c), dtype=c.dtype)
    if c.dead_expert is not None:
        ref.expert_bias[c.dead_expert] = -1e4  # selection only: scores stay in [0, 1]
    ep = tm.MoELayer(_config(c, c.pipeline_degree), ep_group=dist.group.WORLD, dtype=c.dtype)
    L = NUM_EXPERTS // P
    mine = slice(rank * L, (rank + 1) * L)
    with torch.no_grad():
        ep.router.weight.copy_(ref.router.weight)
        ep.w1.copy_(ref.w1[mine])
        ep.w2.copy_(ref.w2[mine])
        if c.dead_expert is not None:
            ep.expert_bias.copy_(ref.expert_bias)
        if c.features:  # non-zero biases (they start at zero), shared expert and router bias as ref's
            ref.b1.copy_(torch.randn(ref.b1.shape, generator=torch.Generator().manual_seed(c.seed + 7)) * 0.3)
            ref.b2.copy_(torch.randn(ref.b2.shape, generator=torch.Generator().manual_seed(c.seed + 8)) * 0.3)
            ep.b1.copy_(ref.b1[mine])
            ep.b2.copy_(ref.b2[mine])
            ep.router.bias.copy_(ref.router.bias)
            ep.shared_experts.load_state_dict(ref.shared_experts.state_dict())
    gen = torch.Generator().manual_seed(c.seed + 1)
    xs = [torch.randn(T, D_MODEL, generator=gen, dtype=c.dtype) for T in c.tokens]
    grads = [torch.randn(T, D_MODEL, generator=gen, dtype=c.dtype) for T in c.tokens]

    ep.timeline = Timeline()
    x = xs[rank].clone().requires_grad_()
    out = ep(x)
    ((out * grads[rank]).sum() + ep.aux_loss).backward()

    for r in range(P):
        xr = xs[r].clone().requires_grad_()
        ref.router.weight.grad = None
        if c.features:
            ref.router.bias.grad = None
            ref.shared_experts.zero_grad(set_to_none=True)
        o = ref(xr)
        ((o * grads[r]).sum() + ref.aux_loss).backward()
        if r == rank:
            want = (o.detach(), xr.grad, ref.router.weight.grad.clone(), ref.aux_loss.detach())
            if c.features:
                want += (ref.router.bias.grad.clone(),
                         {n_: p_.grad.clone() for n_, p_ in ref.shared_experts.named_parameters()})
    _close(failures, f"{label}: output", out.detach(), want[0], c.dtype)
    _close(failures, f"{label}: x.grad", x.grad, want[1], c.dtype)
    _close(failures, f"{label}: router.grad", ep.router.weight.grad, want[2], c.dtype)
    _close(failures, f"{label}: aux_loss", ep.aux_loss.detach(), want[3], want[3].dtype)
    _close(failures, f"{label}: w1.grad", ep.w1.grad, ref.w1.grad[mine], c.dtype)
    _close(failures, f"{label}: w2.grad", ep.w2.grad, ref.w2.grad[mine], c.dtype)
    if c.features:
        _close(failures, f"{label}: b1.grad", ep.b1.grad, ref.b1.grad[mine], c.dtype)
        _close(failures, f"{label}: b2.grad", ep.b2.grad, ref.b2.grad[mine], c.dtype)
        _close(failures, f"{label}: router.bias.grad", ep.router.bias.grad, want[4], c.dtype)
        for n_, p_ in ep.shared_experts.named_parameters():
            _close(failures, f"{label}: shared {n_}.grad", p_.grad, want[5][n_], c.dtype)

    if c.dtype == torch.float64 and c.pipeline_degree > 1:
        # Pipelining changes the schedule, not the result: bitwise equal to n = 1 in fp64.
        one = tm.MoELayer(_config(c, 1), ep_group=dist.group.WORLD, dtype=c.dtype)
        one.load_state_dict(ep.state_dict())
        x1 = xs[rank].clone().requires_grad_()
        out1 = one(x1)
        ((out1 * grads[rank]).sum() + one.aux_loss).backward()
        for name, a, b in (
            ("output", out.detach(), out1.detach()),
            ("x.grad", x.grad, x1.grad),
            ("router.grad", ep.router.weight.grad, one.router.weight.grad),
            ("w1.grad", ep.w1.grad, one.w1.grad),
            ("w2.grad", ep.w2.grad, one.w2.grad),
        ) + ((("b1.grad", ep.b1.grad, one.b1.grad), ("b2.grad", ep.b2.grad, one.b2.grad)) if c.features else ()):
            if not torch.equal(a, b):
                failures.append(f"{label}: {name} not bitwise equal to n=1 (max diff {(a - b).abs().max():.3g})")

    spans = ep.timeline.spans()
    n = c.pipeline_degree
    for phase in ("fwd", "bwd"):
        kinds = [s.kind for s in spans if s.phase == phase]
        if kinds.count("dispatch") != n or kinds.count("combine") != n or kinds.count("expert") != n:
            failures.append(f"{label}: timeline {phase} has {kinds}")
    eff = ep.timeline.pipeline_efficiency()
    if eff is None or not 0.0 <= eff <= 1.0:
        failures.append(f"{label}: pipeline efficiency {eff}")
    return failures, eff


def layer_table(rank: int, P: int) -> dict:
    """Every case of :func:`cases` on this rank: failures and efficiencies."""
    failures, effs = [], {}
    table = cases(P)
    for c in table:
        f, eff = run_case(rank, P, c)
        failures += f
        effs.setdefault(c.pipeline_degree, []).append(eff)
    # the FP8 expert-parallel checks ride on this group (tests/_fp8_ep_cases.py)
    fp8 = _fp8_ep_cases.fp8_ep_table(rank, P)
    return {"failures": failures, "num_cases": len(table), "efficiency": effs, "errors": layer_errors(rank, P),
            "fp8_failures": fp8, "double_backward": ep_penalty(rank, P)}


def peer_exit(rank: int, P: int, victim: int) -> dict:
    """Rank ``victim`` dies inside the expert-parallel forward (after the counts exchange, before
    its first dispatch); the others report how their forward ended and how long it took."""
    torch.manual_seed(0)
    cfg = tm.MoEConfig(D_MODEL, D_FFN, 2 * P, 2, pipeline_degree=2)
    layer = tm.MoELayer(cfg, ep_group=dist.group.WORLD, dtype=torch.float64)
    x = torch.randn(10, D_MODEL, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()  # a healthy step first
    if rank == victim:
        disp = layer.dispatcher
        real = disp.run_pipelined

        def die(*args, **kwargs):
            os._exit(3)

        disp.run_pipelined = die
        del real
    t0 = time.monotonic()
    try:
        layer(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - the survivor's outcome is the result
        return {"raised": type(e).__name__, "message": str(e)[:300], "elapsed": time.monotonic() - t0}
    return {"raised": None, "elapsed": time.monotonic() - t0}


def layer_errors(rank: int, P: int) -> list[str]:
    """Construction errors that need a live group (returned as messages, for the parent)."""
    msgs = []
    try:
        tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, 2 * P + 1, 1), ep_group=dist.group.WORLD)
    except ValueError as e:
        msgs.append(str(e))
    try:  # rank 1 uses another pipeline degree: the same error on every rank, at construction
        n = 3 if rank == 1 else 2
        tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 1, pipeline_degree=n), ep_group=dist.group.WORLD)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


# ---------------------------------------------------------------------------------------------
# The static expert-parallel mode (MoEConfig.ep_capacity)
# ---------------------------------------------------------------------------------------------

#: Ops that make the host wait for the device: a scalar read (item / tolist / bool / int all
#: lower to _local_scalar_dense) or an output whose size depends on tensor values.
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
            "unique_dim", "repeat_interleave", "masked_scatter", "bincount")


class SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the host-synchronizing ops (:data:`SYNC_OPS`) dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


STATIC_CASES = [
    # (top_k, ep_capacity, activation, features, tokens per rank pattern index, why)
    (2, 2, "swiglu", False, 0, "capacity 2: most experts drop slots"),
    (1, 9, "gelu", False, 1, "capacity above every count: padding only, a rank with zero tokens"),
    (2, 4, "swiglu_oai", True, 2, "expert biases, clamped SwiGLU, shared expert"),
]


def static_table(rank: int, P: int) -> dict:
    """The static mode against a single-process layer with the same config on each rank's batch
    (fp64: output, input, router and expert gradients); and the host syncs of its expert path,
    forward and backward, counted by a dispatch mode (with the dynamic path as the control)."""
    failures: list[str] = []
    syncs = {}
    for i, (k, C, act, features, pat, why) in enumerate(STATIC_CASES):
        tokens = TOKEN_PATTERNS[P][pat]
        opts = dict(activation=act, ep_capacity=C, aux_loss_coef=0.01)
        if features:
            opts.update(expert_ffn_bias=True, swiglu_limit=0.7, shared_d_ffn=5, routed_scaling_factor=1.5)
        cfg = tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, k, **opts)
        label = f"static P={P} k={k} C={C} {act} ({why})"
        torch.manual_seed(50 + i)
        ref = tm.MoELayer(cfg, dtype=torch.float64)
        if features:
            with torch.no_grad():
                ref.b1.normal_(0, 0.3)
                ref.b2.normal_(0, 0.3)
        ep = tm.MoELayer(cfg, ep_group=dist.group.WORLD, dtype=torch.float64)
        L = NUM_EXPERTS // P
        mine = slice(rank * L, (rank + 1) * L)
        with torch.no_grad():
            for name, p in ep.named_parameters():
                src = dict(ref.named_parameters())[name]
                p.copy_(src[mine] if name in ("w1", "w2", "b1", "b2") else src)
        gen = torch.Generator().manual_seed(60 + i)
        xs = [torch.randn(T, D_MODEL, generator=gen, dtype=torch.float64) for T in tokens]
        gs = [torch.randn(T, D_MODEL, generator=gen, dtype=torch.float64) for T in tokens]
        x = xs[rank].clone().requires_grad_()
        out = ep(x)
        ((out * gs[rank]).sum() + ep.aux_loss).backward()
        if ep.ffn_path_used != "expert_parallel_static":
            failures.append(f"{label}: path {ep.ffn_path_used}")
        for r in range(P):
            xr = xs[r].clone().requires_grad_()
            ref.router.weight.grad = None
            o = ref(xr)
            ((o * gs[r]).sum() + ref.aux_loss).backward()
            if r == rank:
                want = (o.detach(), xr.grad, ref.router.weight.grad.clone())
        tol = TOL[torch.float64]
        for name, a, b in (("output", out.detach(), want[0]), ("x.grad", x.grad, want[1]),
                           ("router.grad", ep.router.weight.grad, want[2])):
            _close(failures, f"{label}: {name}", a, b, torch.float64)
        for name in ("w1", "w2") + (("b1", "b2") if features else ()):
            _close(failures, f"{label}: {name}.grad", getattr(ep, name).grad, getattr(ref, name).grad[mine], torch.float64)
        del tol

        # Host syncs of the expert path (routing decided before), forward and backward: none with
        # validation off; with it on, exactly one (the read of the P status words at the end of
        # the forward: docs/rank-input.md).
        x2 = xs[rank].clone().requires_grad_()
        _, routing = ep.route(x2)
        with tm.validation(False), SyncCounter() as counter:
            y = ep.expert_path(x2, routing, ep.expert_weights())
            y.sum().backward()
        syncs[f"static case {i}"] = list(counter.syncs)
        x2 = xs[rank].clone().requires_grad_()
        _, routing = ep.route(x2)
        with tm.validation(True), SyncCounter() as counter:
            y = ep.expert_path(x2, routing, ep.expert_weights())
            y.sum().backward()
        syncs[f"static case {i}, validation on"] = list(counter.syncs)
    # The dynamic path at pipeline degree 3: its permutes size their buffers from the slot count,
    # so none reads R back (its one sync, the counts exchange's tolist, is not a dispatched op).
    dyn = tm.MoELayer(tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 2, pipeline_degree=3, capacity_factor=1.0),
                      ep_group=dist.group.WORLD, dtype=torch.float64)
    x3 = torch.randn(7, D_MODEL, dtype=torch.float64, requires_grad=True)
    _, routing = dyn.route(x3)
    with SyncCounter() as counter:
        dyn.expert_path(x3, routing, dyn.expert_weights()).sum().backward()
    syncs["dynamic"] = list(counter.syncs)
    # Control: a permute without num_rows reads R back from the device, and the counter sees it.
    with SyncCounter() as counter:
        tm.permute(x3.detach(), routing.topk_ids, NUM_EXPERTS)
    syncs["control"] = list(counter.syncs)
    return {"failures": failures, "syncs": syncs}


#: Config fields that change what a rank computes, each with a value per rank (rank r takes
#: entry r % 2), for the agreement check (issue 35 item 1): every one refused at construction.
DISAGREEING_FIELDS = {
    "top_k": (1, 2),
    "d_ffn": (D_FFN, D_FFN + 4),
    "activation": ("relu", "gelu"),
    "score_func": ("softmax", "sigmoid"),
    "capacity_factor": (None, 1.5),
    "expert_ffn_bias": (False, True),
    "routed_scaling_factor": (1.0, 2.5),
    "aux_loss_coef": (0.0, 0.01),
}


def config_disagreements(rank: int, P: int) -> dict:
    """For each field of DISAGREEING_FIELDS, every rank builds an EP layer whose config differs
    from rank 0's in that field alone (odd ranks take the second value); the message each rank
    got (or "built" when it built), and whether rank-local fields (backend, ffn_path) are
    accepted when they differ."""
    out = {}
    for name, values in DISAGREEING_FIELDS.items():
        kw = {name: values[rank % 2]}
        d_ffn = kw.pop("d_ffn", D_FFN)
        top_k = kw.pop("top_k", 1)
        try:
            tm.MoELayer(tm.MoEConfig(D_MODEL, d_ffn, NUM_EXPERTS, top_k, **kw), ep_group=dist.group.WORLD,
                        dtype=torch.float64)
            out[name] = "built"
        except ValueError as e:
            out[name] = str(e)
    torch.manual_seed(0)  # the refused builds drew different amounts of randomness per rank
    local = tm.MoEConfig(D_MODEL, D_FFN, NUM_EXPERTS, 1, backend=("torch", "auto")[rank % 2],
                         ffn_path=("auto", "unfused")[rank % 2])
    tm.MoELayer(local, ep_group=dist.group.WORLD, dtype=torch.float64)
    out["rank_local_ok"] = True
    return out
