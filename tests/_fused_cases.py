"""Per-rank bodies of SE-MoE's fusion communication tests (tests/test_fused.py; spawned gloo
groups of tests/_dist.py).

Collectives are counted, not reported: :class:`Counter` replaces ``torch.distributed``'s
``all_reduce``, ``all_gather_into_tensor`` (and ``all_gather_single`` where it exists) and
``all_to_all_single`` in the rank's process and logs every call (op, group ranks, bytes, buffer
address) into one event log shared with the tests' gradient-ready hooks.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import tritonmoe as tm
from tritonmoe.comm import (
    BucketPlan,
    BucketPlanMismatchError,
    GradientBuckets,
    bucketed_all_reduce,
    fused_all_gather,
)
from tritonmoe.parallel import MoEMesh, data_parallel

F64 = torch.float64
_OPS = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_to_all_single")


class Counter:
    """Wraps the collectives of ``_OPS`` in this process; ``log`` holds (op, ranks, nbytes, ptr)
    / dtype / shape
    tuples and whatever else the test appends (e.g. ("ready", i))."""

    def __init__(self) -> None:
        self.log: list = []
        self._saved: dict = {}
        self._lock = threading.Lock()

    def __enter__(self) -> "Counter":
        for name in _OPS:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved[name] = real
            setattr(dist, name, self._wrap(name, real))
        return self

    def _wrap(self, name, real):
        def ranks(group):
            return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))

        def fn(*args, **kwargs):
            t = args[1] if name != "all_reduce" else args[0]  # the input tensor
            group = kwargs.get("group")
            with self._lock:
                self.log.append((name.replace("_into_tensor", "").replace("_single", "") if name.startswith("all_gather") else name,
                                 ranks(group), t.numel() * t.element_size(), t.data_ptr(), t.dtype, tuple(t.shape)))
            return real(*args, **kwargs)

        return fn

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)

    def count(self, op: str) -> int:
        return sum(1 for e in self.log if e[0] == op)

    def clear(self) -> None:
        self.log = []


def greedy(nbytes: list[int], cap: int, keys: Optional[list] = None) -> list[list[int]]:
    """The test's own statement of the greedy bucket rule (not the library's code)."""
    out: list[list[int]] = []
    for i, nb in enumerate(nbytes):
        if nb == 0:
            continue
        if out and sum(nbytes[j] for j in out[-1]) + nb <= cap and (keys is None or keys[out[-1][-1]] == keys[i]):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _raises(fn) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the type
        return type(e).__name__, str(e), time.monotonic() - t0
    return "", "", time.monotonic() - t0


def _shapes():
    return [(3, 4), (0, 5), (), (7,), (2, 0, 3), (1, 1, 2), (5, 2)]


def gather_cases(rank: int, P: int, failures: list, info: dict) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    ts = [torch.randn(s, dtype=F64, generator=g) for s in _shapes()]
    with Counter() as c:
        got = fused_all_gather(ts)
    info["gather_calls"] = c.count("all_gather")
    info["gather_other"] = len(c.log) - c.count("all_gather")
    for i, t in enumerate(ts):
        src = t.reshape(1) if t.dim() == 0 else t
        want = src.new_empty((P * src.shape[0],) + tuple(src.shape[1:]))
        dist.all_gather_into_tensor(want, src.contiguous())
        if got[i].shape != want.shape or not torch.equal(got[i], want):
            failures.append(f"fused_all_gather tensor {i} {tuple(t.shape)}: not bitwise equal to all_gather_into_tensor")
    # non-contiguous inputs and fp32
    base = torch.randn(6, 4, generator=g)
    nc = [base.t(), base[:, 1]]
    got = fused_all_gather(nc)
    for i, t in enumerate(nc):
        want = t.new_empty((P * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(want, t.contiguous())
        if not torch.equal(got[i], want):
            failures.append(f"fused_all_gather non-contiguous input {i}: wrong")
    with Counter() as c:
        empty = fused_all_gather([torch.empty(0, 3, dtype=F64)])
        none = fused_all_gather([])
    info["gather_empty_calls"] = len(c.log)
    if empty[0].shape != (0, 3) or none != []:
        failures.append(f"fused_all_gather of empty tensors: shapes {[tuple(e.shape) for e in empty]}, {none}")
    # check=True: the same error on every rank when one rank differs or passes junk
    bad_shape = [torch.zeros(3 + (rank == 1), dtype=F64)]
    info["gather_mismatch"] = _raises(lambda: fused_all_gather(bad_shape, check=True))
    junk = [torch.zeros(2, dtype=F64)] if rank != 0 else [torch.zeros(2, dtype=F64), "x"]
    info["gather_junk"] = _raises(lambda: fused_all_gather(junk, check=True))
    info["gather_dtypes"] = _raises(lambda: fused_all_gather([torch.zeros(2), torch.zeros(2, dtype=F64)]))


def reduce_cases(rank: int, P: int, failures: list, info: dict) -> None:
    g = torch.Generator().manual_seed(200 + rank)
    shapes = [(3,), (5, 4), (0,), (40,), (), (2, 2), (1,), (300,), (6, 7)]
    ts = [torch.randn(s, dtype=F64, generator=g) for s in shapes]
    ints = [torch.randint(-1000, 1000, s, generator=g).to(F64) for s in shapes]
    counts = {}
    for cap in (1, 8, 64, 200, 400, 10**6):
        nb = [t.numel() * 8 for t in ts]
        want_buckets = greedy(nb, cap)
        with Counter() as c:
            got = bucketed_all_reduce(ts, None, cap)
            got_i = bucketed_all_reduce(ints, None, cap)
        counts[cap] = (c.count("all_reduce") // 2, len(want_buckets), len(c.log) - c.count("all_reduce"))
        for i, t in enumerate(ts):
            want = t.clone()
            dist.all_reduce(want)
            tol = 8 * P * torch.finfo(F64).eps * max(1.0, want.abs().max().item() if want.numel() else 1.0)
            if got[i].shape != t.shape or (t.numel() and (got[i] - want).abs().max().item() > tol):
                failures.append(f"bucketed_all_reduce cap={cap} tensor {i}: differs from the per-tensor all_reduce")
            wi = ints[i].clone()
            dist.all_reduce(wi)
            if not torch.equal(got_i[i], wi):
                failures.append(f"bucketed_all_reduce cap={cap} integer-valued tensor {i}: not bitwise equal")
    info["reduce_counts"] = counts
    # mixed dtypes: a dtype change closes a bucket
    mixed = [torch.ones(2), torch.ones(2), torch.ones(3, dtype=F64), torch.ones(1)]
    with Counter() as c:
        out = bucketed_all_reduce(mixed, None, 10**6)
    info["mixed"] = (c.count("all_reduce"), len(greedy([8, 8, 24, 4], 10**6, [t.dtype for t in mixed])))
    if any(not torch.equal(o, torch.full_like(m, P)) for o, m in zip(out, mixed)) or [o.dtype for o in out] != [m.dtype for m in mixed]:
        failures.append("bucketed_all_reduce with mixed dtypes: wrong values or dtypes")
    inputs_before = [t.clone() for t in ts]
    bucketed_all_reduce(ts, None, 64)
    if any(not torch.equal(a, b) for a, b in zip(ts, inputs_before)):
        failures.append("bucketed_all_reduce modified its inputs")
    # a rank with nothing: every rank passes only empty tensors -> no collective at all
    with Counter() as c:
        out = bucketed_all_reduce([torch.empty(0, dtype=F64), torch.empty(0, 2, dtype=F64)], None, 64)
    info["reduce_empty_calls"] = len(c.log)
    info["reduce_bad_cap"] = _raises(lambda: bucketed_all_reduce(ts, None, 0))
    info["reduce_bad_cap_type"] = _raises(lambda: bucketed_all_reduce(ts, None, 1.5))
    info["reduce_not_list"] = _raises(lambda: bucketed_all_reduce(ts[0], None, 64))
    swapped = list(ts)
    if rank == P - 1:
        swapped[0], swapped[1] = swapped[1], swapped[0]
    info["reduce_mismatch"] = _raises(lambda: bucketed_all_reduce(swapped, None, 64, check=True))
    # a bucket plan agreed at construction: a rank with one more tensor, another capacity
    extra = ts + ([torch.zeros(1, dtype=F64)] if rank == 0 else [])
    info["plan_extra"] = _raises(lambda: BucketPlan(extra, 64))
    info["plan_cap"] = _raises(lambda: BucketPlan(ts, 64 if rank else 128))
    plan = BucketPlan(ts, 64)
    with Counter() as c:
        got = plan.all_reduce(ts)
    info["plan_calls"] = (c.count("all_reduce"), len(plan), len(greedy([t.numel() * 8 for t in ts], 64)))
    info["plan_wrong_local"] = _raises(lambda: plan.all_reduce(ts[:-1]))


class Small(nn.Module):
    """Many small parameters (norms, biases, a gate) and one large weight; ``gate`` is used only
    when the batch is not empty (a rank with no tokens leaves it without a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 6, dtype=F64)
        self.norm = nn.LayerNorm(6, dtype=F64)
        self.big = nn.Linear(6, 40, dtype=F64)
        self.lin2 = nn.Linear(40, 3, dtype=F64)
        self.gate = nn.Parameter(torch.ones(3, dtype=F64))

    def forward(self, x):
        h = self.lin2(torch.tanh(self.big(self.norm(torch.tanh(self.lin1(x))))))
        if x.shape[0] > 0:
            h = h * self.gate
        return h


def _batch(rank: int, rows: int):
    g = torch.Generator().manual_seed(300 + rank)
    return torch.randn(rows, 6, dtype=F64, generator=g), torch.randn(rows, 3, dtype=F64, generator=g)


def gradient_bucket_cases(rank: int, P: int, failures: list, info: dict) -> None:
    for label, rows_of in (("ragged", lambda r: 2 + r), ("empty last rank", lambda r: 0 if r == P - 1 else 3)):
        x, t = _batch(rank, rows_of(rank))
        # reference: plain per-parameter all_reduce of the local gradients, divided by P
        torch.manual_seed(5)
        ref = Small()
        ((ref(x) - t) ** 2).sum().backward()
        want = {}
        for n, p in ref.named_parameters():
            gr = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            gr /= P
            dist.all_reduce(gr)
            want[n] = gr
        torch.manual_seed(5)
        m = Small()
        params = list(m.parameters())[::-1]
        names = {id(p): n for n, p in m.named_parameters()}
        with Counter() as c:
            for i, p in enumerate(params):  # registered first: runs before the bucket's hook
                p.register_post_accumulate_grad_hook(lambda _p, i=i: c.log.append(("ready", i)))
            gb = GradientBuckets(params, 400, divisor=P)
            gb.watch(m)
            c.clear()
            ((m(x) - t) ** 2).sum().backward()
        for p in params:
            w = want[names[id(p)]]
            if p.grad is None or (p.grad - w).abs().max().item() > 1e-13 * max(1.0, w.abs().max().item()):
                failures.append(f"GradientBuckets {label}: gradient of {names[id(p)]} differs from the per-tensor reduction")
        buckets = greedy([p.numel() * 8 for p in params], 400)
        reds = [e for e in c.log if e[0] == "all_reduce"]
        info[f"gb {label}"] = (len(reds), len(buckets), len(gb))
        ptrs = {buf.data_ptr(): j for j, buf in enumerate(gb.buffers)}
        started = [ptrs.get(e[3]) for e in reds]
        if started != list(range(len(buckets))):
            failures.append(f"GradientBuckets {label}: buckets started in order {started}, not plan order")
        # each bucket starts right after the ready event that completed it (and its predecessors)
        ready_seen: set = set()
        for e in c.log:
            if e[0] == "ready":
                ready_seen.add(e[1])
                continue
            j = ptrs.get(e[3])
            if j is None:
                continue
            need = set(i for b in buckets[: j + 1] for i in b)
            if rows_of(rank) > 0 and not need <= ready_seen:
                failures.append(f"GradientBuckets {label}: bucket {j} started before its gradients were ready")
        if rows_of(rank) > 0 and len(buckets) > 1:
            # the first bucket's reduction starts before the last gradient of the pass is ready
            first = next(k for k, e in enumerate(c.log) if e[0] == "all_reduce")
            last_ready = max(k for k, e in enumerate(c.log) if e[0] == "ready")
            if not first < last_ready:
                failures.append(f"GradientBuckets {label}: no bucket started before the backward ended")
        gb.remove()
    # a mismatched plan raises on every rank at construction
    m = Small()
    params = list(m.parameters())
    if rank == 0:
        params = params[::-1]
    info["gb_mismatch"] = _raises(lambda: GradientBuckets(params, 400))
    frozen = list(Small().parameters())
    if rank == P - 1:
        frozen[0].requires_grad_(False)
    info["gb_frozen"] = _raises(lambda: GradientBuckets(frozen, 400))
    info["gb_divisor"] = _raises(lambda: GradientBuckets(list(Small().parameters()), 400, divisor=0 if rank == 0 else 1))


def fused_table(rank: int, P: int) -> dict:
    torch.manual_seed(0)
    failures: list[str] = []
    info: dict = {}
    gather_cases(rank, P, failures, info)
    reduce_cases(rank, P, failures, info)
    gradient_bucket_cases(rank, P, failures, info)
    return {"failures": failures, "info": info}


# ---------------------------------------------------------------------------------------------
# data_parallel(fuse_bytes=...) on the MoE model of tests/_parallel_cases.py
# ---------------------------------------------------------------------------------------------


def dp_fusion_table(rank: int, P: int) -> dict:
    import _parallel_cases as pc

    failures: list[str] = []
    info: dict = {}
    data = pc.batches(P, steps=1)
    want = pc.reference_params(data)
    dp, ep = 2, P // 2
    mesh = MoEMesh.build(dp=dp, ep=ep)
    for comm, chunk, fuse in (("fifo", None, 10**6), ("lina", 1024, 10**6), ("lina", 1024, None), ("fifo", None, None)):
        torch.manual_seed(pc.SEED)
        model = pc.Net(mesh)
        ddp = data_parallel(model, mesh, comm=comm, chunk_bytes=chunk, fuse_bytes=fuse, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, t = data[0][rank]
        with Counter() as c, pc.Recorder() as rec:
            pc.loss_fn(ddp(x), t).backward()
        opt.step()
        state = ddp._tritonmoe_data_parallel
        state.scheduler.close()
        lab = f"{comm} chunk={chunk} fuse={fuse}"
        pc.compare(failures, lab, model, want)
        if comm == "lina":  # fused buckets and micro-ops still yield to the all-to-alls, one at a time
            info[lab + " priority"] = pc.check_priority(failures, lab, rec.calls)
        exp_ranks = tuple(dist.get_process_group_ranks(state.expert_group)) if state.expert_group is not None else None
        expert_reds = [e for e in c.log if e[0] == "all_reduce" and e[1] == exp_ranks]
        dense_reds = [e for e in c.log if e[0] == "all_reduce" and e[1] != exp_ranks]
        row = {"expert_reduces": len(expert_reds), "dense_reduces": len(dense_reds),
               "max_dense_bytes": max((e[2] for e in dense_reds), default=0)}
        if fuse is not None:
            row["buckets"] = len(state.expert_sync)
            params = state.expert_sync.params
            row["greedy"] = len(greedy([p.numel() * 8 for p in params], fuse))
        row["expert_params"] = len(state.expert_names)
        info[lab] = row
    return {"failures": failures, "info": info}


def peer_dies_case(rank: int, P: int) -> dict:
    """Rank P-1 leaves before the collectives: the others' fused collectives and the embedding's
    exchange raise a typed ScheduleError within the group timeout instead of hanging."""
    import os

    from tritonmoe.parallel import PartitionedEmbedding

    torch.manual_seed(0)
    emb = PartitionedEmbedding(11, 3, dtype=F64)
    dist.barrier()
    if rank == P - 1:
        os._exit(0)
    out = {}
    for name, fn in (("reduce", lambda: bucketed_all_reduce([torch.ones(3)], None, 64)),
                     ("gather", lambda: fused_all_gather([torch.ones(3)])),
                     ("embedding", lambda: emb(torch.tensor([1, 2])))):
        t0 = time.monotonic()
        try:
            fn()
            out[name] = ("returned", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            out[name] = (type(e).__name__, time.monotonic() - t0)
    return out
