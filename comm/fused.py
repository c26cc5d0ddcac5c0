"""SE-MoE's fusion communication (PAPERS.md section 2.3): many small tensors, few collectives.

* :func:`fused_all_gather` -- the local slices of several tensors concatenated into one buffer,
  one all-gather, the result cut back by the recorded slice index. For each input it returns
  every rank's slice concatenated along dim 0 in rank order: what one
  ``all_gather_into_tensor`` per tensor gives, bitwise (an all-gather moves bytes, it adds
  nothing).
* :func:`bucketed_all_reduce` -- tensors packed in the caller's order into greedy buckets of at
  most ``bucket_bytes`` (:func:`plan_buckets`); one all-reduce per bucket and nothing else is
  communicated: the function trusts its caller's order (agree it once with :class:`BucketPlan`).
  Equal to one all-reduce per tensor up to fp rounding: a ring's summation order depends on an
  element's place in the buffer.
* :class:`BucketPlan` -- the bucket plan of a fixed list of tensors (parameters), agreed across
  the group once, when it is built: a mismatch raises :class:`BucketPlanMismatchError` on every
  rank there, before any data moves.
* :class:`GradientBuckets` -- the training side: gradients of many small parameters (expert
  biases, router weights, norms) reduced in buckets; a bucket's reduction starts when the last
  gradient in it is ready (post-accumulate-grad hooks), buckets start in plan order, on the
  gradient lane of a :class:`~tritonmoe.comm.CommScheduler` (so they yield to all-to-alls under
  Lina's policy), and gradients are final when ``backward()`` returns.
* :func:`fuse_micro_ops` -- the scheduler's rule for a buffer of many gradients: large
  gradients partitioned into micro-ops of at most ``chunk_bytes`` (Lina), consecutive small
  ones fused into one micro-op of at most ``chunk_bytes`` (SE-MoE). One scheduler decides both.

Bad arguments raise ``TypeError`` / ``ValueError`` before any collective. A local check cannot
make the other ranks raise; pass ``check=True`` (one small all-to-all of metadata first) to have
a bad input or a shape that differs across ranks raise the same error on every rank.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .compat import all_gather_single
from .priority import fuse_micro_ops
from .errors import backend_errors
from .splits import comm_device, group_rank_size

__all__ = [
    "BucketPlan",
    "BucketPlanMismatchError",
    "GradientBuckets",
    "bucketed_all_reduce",
    "fuse_micro_ops",
    "fused_all_gather",
    "plan_buckets",
]


class BucketPlanMismatchError(ValueError):
    """The ranks of a group disagree on a bucket plan (or on the tensors of a fused collective):
    raised with the same message on every rank, before any data moves."""


# ---------------------------------------------------------------------------------------------
# Validation shared by both collectives
# ---------------------------------------------------------------------------------------------


def _check_tensors(tensors: Any, what: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} takes a list or tuple of tensors, got {type(tensors).__name__}")
    out = list(tensors)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
    if out:
        devices = {t.device for t in out}
        if len(devices) > 1:
            raise ValueError(f"{what}: the tensors are on several devices {sorted(map(str, devices))}; move them to one")
    return out


def _signature(tensors: Sequence[torch.Tensor], extra: Sequence[int] = ()) -> int:
    """A 63-bit digest of the tensors' shapes and dtypes (and ``extra`` ints), equal on two ranks
    exactly when their lists describe the same collective (up to a CRC collision)."""
    text = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors) + "|" + ",".join(map(str, extra))
    return zlib.crc32(text.encode()) | (len(tensors) << 32)


def _agree(local_error: Optional[str], sig: int, group, what: str) -> None:
    """One small all-to-all: every rank's local verdict and signature; the same error on every
    rank when a rank's input is bad or the signatures differ."""
    _, P = group_rank_size(group)
    vec = torch.tensor([0 if local_error is None else 1, sig], dtype=torch.int64, device=comm_device(group))
    send = vec.repeat(P)
    recv = torch.empty_like(send)
    with backend_errors(f"the agreement check of {what}", group):
        dist.all_to_all_single(recv, send, group=group)
    table = recv.view(P, 2).tolist()  # host sync: a host verdict
    bad = [r for r in range(P) if table[r][0]]
    if bad:
        mine = f" (this rank: {local_error})" if local_error is not None else ""
        raise BucketPlanMismatchError(f"{what}: ranks {bad} passed bad input; every rank raises this before any data moves{mine}")
    sigs = [row[1] for row in table]
    if len(set(sigs)) > 1:
        groups: dict[int, list[int]] = {}
        for r, s in enumerate(sigs):
            groups.setdefault(s, []).append(r)
        raise BucketPlanMismatchError(
            f"{what}: the ranks pass different tensors (shapes, dtypes or order): rank sets {sorted(groups.values())} "
            "disagree; every rank must pass the same list in the same order"
        )


def _run_checked(fn, check: bool, group, what: str, sig_of) -> Any:
    """``fn()`` (local validation, returns the validated value); with ``check`` the verdict and
    ``sig_of(value)`` go through :func:`_agree` first, so every rank raises together."""
    if not check:
        return fn()
    try:
        value = fn()
    except (TypeError, ValueError, IndexError) as e:
        _agree(f"{type(e).__name__}: {e}", 0, group, what)
        raise  # unreachable: _agree raises when this rank's verdict is bad
    _agree(None, sig_of(value), group, what)
    return value


# ---------------------------------------------------------------------------------------------
# Fused all-gather
# ---------------------------------------------------------------------------------------------


def fused_all_gather(tensors: Sequence[torch.Tensor], group=None, *, check: bool = False) -> list[torch.Tensor]:
    """All-gather several tensors with one collective.

    Args:
        tensors: this rank's slices (any shapes, one dtype and device; each rank passes the same
            shapes in the same order, as ``all_gather_into_tensor`` requires).
        group: the process group (None = the default group).
        check: first compare every rank's shapes and dtypes and local verdict (one small
            all-to-all), so a bad input or a mismatch raises :class:`BucketPlanMismatchError` on
            every rank instead of a backend error or an abort.

    Returns: for each input of shape ``[n, ...]``, a tensor ``[P * n, ...]`` holding every rank's
    slice in rank order (0-d inputs give ``[P]``). Exactly one all-gather (none when there is no
    element to move). The local slices are copied into one buffer and the result cut back by the
    recorded offsets (one copy in, one copy out per tensor).
    """

    def local():
        ts = _check_tensors(tensors, "fused_all_gather")
        if len({t.dtype for t in ts}) > 1:
            raise TypeError(
                f"fused_all_gather: the tensors have several dtypes {sorted({str(t.dtype) for t in ts})}; "
                "fuse each dtype separately (one buffer has one dtype)"
            )
        return ts

    ts = _run_checked(local, check, group, "fused_all_gather", lambda v: _signature(v))
    _, P = group_rank_size(group)
    if not ts:
        return []
    sizes = [t.numel() for t in ts]
    total = sum(sizes)
    outs_shape = [((P * t.shape[0],) + tuple(t.shape[1:])) if t.dim() else (P,) for t in ts]
    if total == 0:
        return [t.new_empty(s) for t, s in zip(ts, outs_shape)]
    flat = torch.cat([t.reshape(-1) for t in ts])
    gathered = flat.new_empty(P * total)
    with backend_errors("fused_all_gather", group):
        all_gather_single(gathered, flat, group=group)
    rows = gathered.view(P, total)
    outs = []
    off = 0
    for t, n, shape in zip(ts, sizes, outs_shape):
        outs.append(rows[:, off : off + n].reshape(shape))  # [P, n] -> rank-major rows, a copy
        off += n
    return outs


# ---------------------------------------------------------------------------------------------
# Buckets
# ---------------------------------------------------------------------------------------------


def plan_buckets(nbytes: Sequence[int], bucket_bytes: int, keys: Optional[Sequence[Any]] = None) -> list[list[int]]:
    """Greedy buckets over tensors of ``nbytes`` bytes, in the given order: a bucket closes when
    the next tensor would overflow ``bucket_bytes`` (or has another ``keys`` entry: dtype and
    device, one buffer each), so a tensor larger than a bucket travels alone. Empty tensors
    (0 bytes) join no bucket. Returns the tensor indices of each bucket."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise TypeError(f"bucket_bytes must be an int (bytes), got {type(bucket_bytes).__name__}")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    key = None
    for i, nb in enumerate(nbytes):
        if nb < 0:
            raise ValueError(f"nbytes[{i}]={nb} is negative")
        if nb == 0:
            continue
        k = None if keys is None else keys[i]
        if cur and (size + nb > bucket_bytes or k != key):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nb
        key = k
    if cur:
        buckets.append(cur)
    return buckets


def _key(t: torch.Tensor) -> tuple:
    return (t.dtype, t.device)


def bucketed_all_reduce(
    tensors: Sequence[torch.Tensor],
    group=None,
    bucket_bytes: int = 25 * 2**20,
    *,
    op=None,
    check: bool = False,
) -> list[torch.Tensor]:
    """All-reduce several tensors in greedy buckets (:func:`plan_buckets`), one collective per
    bucket and nothing else communicated per call: every rank must pass the same shapes and
    dtypes in the same order (agree a fixed list once with :class:`BucketPlan`, or pass
    ``check=True`` for one small metadata all-to-all first).

    Returns new tensors (the inputs are not modified), reduced with ``op`` (default sum), in the
    given order. Empty tensors come back empty and cost nothing. A bucket mixes no dtypes or
    devices: a change of either closes it."""

    def local():
        ts = _check_tensors(tensors, "bucketed_all_reduce")
        plan_buckets([], bucket_bytes)  # validates bucket_bytes
        return ts

    ts = _run_checked(local, check, group, "bucketed_all_reduce", lambda v: _signature(v, (bucket_bytes,)))
    op = dist.ReduceOp.SUM if op is None else op
    outs: list[Optional[torch.Tensor]] = [None] * len(ts)
    for b in plan_buckets([t.numel() * t.element_size() for t in ts], bucket_bytes, [_key(t) for t in ts]):
        flat = torch.cat([ts[i].reshape(-1) for i in b])
        with backend_errors(f"bucketed_all_reduce (bucket of {len(b)} tensors)", group):
            dist.all_reduce(flat, op=op, group=group)
        off = 0
        for i in b:
            n = ts[i].numel()
            outs[i] = flat[off : off + n].view(ts[i].shape)
            off += n
    return [o if o is not None else t.clone() for o, t in zip(outs, ts)]


@dataclass(frozen=True)
class _Slot:
    bucket: int
    offset: int
    numel: int


class BucketPlan:
    """The bucket plan of a fixed, ordered list of tensors (e.g. parameters), agreed across
    ``group`` when it is built.

    Args:
        tensors: the tensors, in the order every rank reduces them.
        bucket_bytes: the greedy bucket capacity (:func:`plan_buckets`).
        group: the process group (None = the default group).
        agree: compare the plan across the group now (one small all-to-all); a mismatch (other
            shapes, dtypes, order, count or capacity) raises :class:`BucketPlanMismatchError` on
            every rank. False only for a group of one or a plan checked elsewhere.

    Attributes:
        buckets: tensor indices per bucket; ``bucket_numel``: elements per bucket;
        ``slots``: per tensor, (bucket, offset, numel) or None for an empty tensor.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], bucket_bytes: int, group=None, *, agree: bool = True,
                 check_local=None) -> None:
        def local():
            ts = _check_tensors(tensors, "BucketPlan")
            if check_local is not None:  # the caller's own checks: their verdict is agreed too
                check_local(ts)
            return ts, plan_buckets([t.numel() * t.element_size() for t in ts], bucket_bytes, [_key(t) for t in ts])

        if agree:
            ts, buckets = _run_checked(
                local, True, group, "the bucket plan", lambda v: _signature(v[0], [bucket_bytes] + [len(b) for b in v[1]])
            )
        else:
            ts, buckets = local()
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.buckets = buckets
        self.shapes = [tuple(t.shape) for t in ts]
        self.dtypes = [t.dtype for t in ts]
        self.slots: list[Optional[_Slot]] = [None] * len(ts)
        self.bucket_numel: list[int] = []
        for j, b in enumerate(buckets):
            off = 0
            for i in b:
                self.slots[i] = _Slot(j, off, ts[i].numel())
                off += ts[i].numel()
            self.bucket_numel.append(off)

    def __len__(self) -> int:
        return len(self.buckets)

    def __repr__(self) -> str:
        return f"BucketPlan({len(self.shapes)} tensors in {len(self.buckets)} buckets of <= {self.bucket_bytes} bytes)"

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, op=None) -> list[torch.Tensor]:
        """:func:`bucketed_all_reduce` of ``tensors`` (shapes and dtypes of the plan; checked
        locally) with this plan's buckets; no communication besides one collective per bucket."""
        ts = _check_tensors(tensors, "BucketPlan.all_reduce")
        got = [(tuple(t.shape), t.dtype) for t in ts]
        want = list(zip(self.shapes, self.dtypes))
        if got != want:
            raise ValueError(f"BucketPlan.all_reduce: the tensors {got[:4]}... do not match the plan's {want[:4]}...; build a new plan")
        return bucketed_all_reduce(ts, self.group, self.bucket_bytes, op=op)


# ---------------------------------------------------------------------------------------------
# Training: gradient buckets
# ---------------------------------------------------------------------------------------------


class GradientBuckets:
    """Reduce the gradients of ``params`` in buckets after each backward (SE-MoE's gradient
    buckets, PAPERS.md 2.3b).

    Args:
        params: the parameters, in the order their gradients are expected to become ready
            (autograd's order is usually the reverse of registration: pass
            ``list(module.parameters())[::-1]``). The order is the bucket plan's and is agreed
            across ``group`` here (:class:`BucketPlan`): a mismatch raises
            :class:`BucketPlanMismatchError` on every rank.
        bucket_bytes: greedy bucket capacity; a parameter larger than it is a bucket alone.
        group: the reduction group (None = the default group).
        scheduler: a :class:`~tritonmoe.comm.CommScheduler`; its gradient lane runs the
            reductions (Lina: a bucket's reduction yields to all-to-alls and is cut into
            micro-ops of at most ``chunk_bytes``). None: one asynchronous ``all_reduce`` per
            bucket on the caller's thread.
        divisor: every gradient is divided by it before the sum (the data-parallel size gives
            the gradient of the mean loss).
        enabled: called at each gradient hook; False skips the reduction (``ddp.no_sync()``).

    Semantics. Each bucket has a pre-allocated flat buffer. A post-accumulate-grad hook marks a
    parameter ready; when every parameter of the next bucket in plan order is ready, its
    gradients are copied into its buffer and its reduction starts (so buckets start in the same
    order on every rank, and a bucket starts when the last gradient in it is ready, or when the
    bucket before it starts, whichever is later). At the end of the backward pass (an autograd
    final callback) the buckets not yet started start -- a parameter without a gradient on this
    rank contributes zeros, so a rank on which some parameters got no gradient (an expert bias
    with no tokens) still takes part -- the reductions are waited for, and every gradient is
    replaced by its reduced value. :meth:`watch` makes a module's forward queue that callback,
    so that a rank on which none of ``params`` got a gradient still reduces.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_bytes: int, group=None, *, scheduler=None,
                 divisor: float = 1, enabled=None) -> None:
        def check(ps: list) -> None:
            if len({id(p) for p in ps}) != len(ps):
                raise ValueError("GradientBuckets: a parameter is listed twice")
            bad = [i for i, p in enumerate(ps) if not (p.is_leaf and p.requires_grad)]
            if bad:
                raise ValueError(f"GradientBuckets: params {bad[:8]} are not leaf tensors that require grad")
            if not isinstance(divisor, (int, float)) or isinstance(divisor, bool) or not divisor > 0:
                raise ValueError(f"GradientBuckets: divisor={divisor!r} must be a positive number")

        # collective: the plan and every rank's verdict on its arguments are agreed once, here
        self.plan = BucketPlan(params, bucket_bytes, group, check_local=check)
        params = list(params)
        self.params = params
        self.group = group
        self.scheduler = scheduler
        self.divisor = divisor
        self._enabled = enabled
        dev = params[0].device if params else torch.device("cpu")  # one device: checked by BucketPlan
        self.buffers = [torch.zeros(n, dtype=params[b[0]].dtype, device=dev) for b, n in zip(self.plan.buckets, self.plan.bucket_numel)]
        self._left = [len(b) for b in self.plan.buckets]
        self._ready = [False] * len(params)
        self._next = 0
        self._pending: list[tuple[int, Any]] = []
        self._queued = False
        self.reductions_started: list[int] = []  # bucket ids in start order, last backward (for tests)
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    def __len__(self) -> int:
        return len(self.plan)

    def _make_hook(self, i: int):
        def hook(_p: torch.Tensor) -> None:
            self._on_ready(i)

        return hook

    def _queue_finish(self) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
            self.reductions_started = []

    def _on_ready(self, i: int) -> None:
        if self._enabled is not None and not self._enabled():
            return
        self._queue_finish()
        slot = self.plan.slots[i]
        if slot is None or self._ready[i]:
            return
        self._ready[i] = True
        self._left[slot.bucket] -= 1
        while self._next < len(self.buffers) and self._left[self._next] == 0:
            self._start(self._next)

    def _start(self, j: int) -> None:
        buf = self.buffers[j]
        for i in self.plan.buckets[j]:
            s = self.plan.slots[i]
            g = self.params[i].grad
            dst = buf[s.offset : s.offset + s.numel]
            if g is None:
                dst.zero_()
            else:
                dst.copy_(g.reshape(-1))
        if self.divisor != 1:
            buf.div_(self.divisor)
        self.reductions_started.append(j)
        if self.scheduler is not None:
            fut = self.scheduler.reduce(buf, None, self.group)
        else:
            with backend_errors(f"gradient bucket {j}'s all_reduce", self.group):
                fut = dist.all_reduce(buf, group=self.group, async_op=True)
        self._pending.append((j, fut))
        self._next += 1

    def _finish(self) -> None:
        """End of backward: start what is left (in plan order), wait, write the gradients back."""
        self._queued = False
        while self._next < len(self.buffers):
            self._start(self._next)
        pending, self._pending = self._pending, []
        for j, fut in pending:
            with backend_errors(f"gradient bucket {j}'s all_reduce", self.group):
                fut.wait()
            buf = self.buffers[j]
            for i in self.plan.buckets[j]:
                s = self.plan.slots[i]
                p = self.params[i]
                red = buf[s.offset : s.offset + s.numel].view(self.plan.shapes[i])
                if p.grad is None:
                    p.grad = red.clone()
                else:
                    p.grad.copy_(red)
        self._next = 0
        self._left = [len(b) for b in self.plan.buckets]
        self._ready = [False] * len(self.params)

    def watch(self, module: torch.nn.Module):
        """Queue the end-of-backward reduction from ``module``'s forward outputs (a gradient
        hook on each), so it runs on every rank whose backward passes through ``module`` even
        if none of the parameters got a gradient there. Returns the forward hook's handle."""

        def on_output(t: torch.Tensor) -> None:
            if self._enabled is None or self._enabled():
                self._queue_finish()

        def fwd_hook(_m, _inp, out):
            for t in _tensors_in(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g: (on_output(g), None)[1])
            return None

        return module.register_forward_hook(fwd_hook)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _tensors_in(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors_in(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors_in(o)]
    return []
