"""MPMoE memory reuse and activation-restore strategies for the pipelined expert block.

Paper 004 (MPMoE) §III-C, ``PAPERS.md`` §4.3. With the pipeline of :mod:`tritonmoe.comm.programs.pipeline`
the expert block of every micro-op i keeps two activations for backward:

* **DI**: the dispatched input, micro-op i's received rows in expert-major order [R_i, d]
  (the first GEMM's input; ``dW1 = DI^T dH``);
* **MI**: the middle activation, the first GEMM's output (bias included) before the activation
  [R_i, n1] (n1 = 2*d_ffn for the GLUs; the activation is recomputed from it in backward,
  the counterpart of the paper's in-place activation).

With strategy ``"keep"`` every micro-op keeps its own DI and MI (n separate allocations: the
paper's PMoE baseline). Every other strategy **reuses memory** as paper 004 §III-C does: the DI
of micro-op i lives in one of two shared device buffers (T_DI double-buffered: i overwrites
i-2's), the MI in one shared buffer (T_M single-buffered: i overwrites i-1's; the paper's layout,
the default) or in two (``mi_buffers=2``: i overwrites i-2's, so a micro-op's MI host copy can
run beside the next micro-op's compute, in forward and in backward, for one more MI buffer of
device memory), each sized to the largest micro-op of the pass. What an overwritten micro-op
lacks in backward is **restored** (004 Table II):

================== =================== =====================
strategy           DI restored by      MI restored by
================== =================== =====================
``offload`` (S1)   host copy           host copy
``recomm`` (S2)    re-dispatch (a2a)   host copy
``recompute`` (S3) host copy           recompute FC1 from DI
``recomm_recompute`` (S4) re-dispatch  recompute FC1 from DI
================== =================== =====================

Host copies run on the executor's copy lane (a CUDA stream into pinned memory; a worker thread
on CPU) while the pipeline computes: forward copies start as soon as a micro-op's expert compute
has produced them and are waited for only before their buffer is overwritten (DI by micro-op
i+2, MI by i+1, or by i+2 with two MI buffers). In backward, DI restores are issued together
with micro-op i's first exchange, one micro-op ahead (before micro-op i-1's compute, into the
buffer micro-op i-2 has finished with); the MI restore of micro-op i is issued as early as its
buffer allows: right after the backward compute of the buffer's previous reader (micro-op i-1
with one MI buffer, i-2 with two) is issued (the first ``mi_buffers`` micro-ops' with their
first exchange), and micro-op i's compute waits for it. A re-dispatch re-permutes the
layer's input (which the router keeps for its own backward anyway) and re-runs micro-op i's
dispatch all-to-all with the forward's splits, so the rows come back in the same order; a
recompute re-runs the first GEMM on the restored DI. Only micro-ops whose buffer is really
overwritten before their backward reads it are restored (:func:`restore_schedule`).

Saved tensors go through autograd's saved-tensor machinery (``ctx.save_for_backward`` of one
custom Function per micro-op: DI, MI and the weights), so ``saved_tensors_hooks`` observe exactly
what the block keeps: separate tensors under "keep", views of the shared buffers otherwise.
Restores write into the shared buffers through aliases that do not share the saved views'
version counters (a refill is not an in-place change of the saved value, it puts it back).

Exactness: in fp64 the forward computes each micro-op's FFN with the same ops as the unmanaged
path, the backward reproduces the reference GEMMs' row-invariant input gradients and defers their
weight gradients to the pipeline's W step, so outputs and all gradients are bitwise equal across
strategies and degrees. In fp16/bf16/fp32 the forward and backward are the layer backend's
dispatched ``grouped_ffn_train`` / ``grouped_ffn_train_backward`` (the Triton grouped FFN
kernels' ``ffn_forward`` / ``ffn_backward`` on GPUs, the reference on ``backend="torch"``),
the unmanaged path's kernels, with A recomputed elementwise from the saved MI (the kernels'
saved A is not kept); they agree with the unmanaged layer to rounding.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from tritonmoe.core.autograd import first_order
from tritonmoe import reference
from tritonmoe.core.exact import WeightGradStore, grouped_wgrad, rowwise_mm

from tritonmoe.comm.executor import RealExecutor
from tritonmoe.comm.programs.pipeline import backward_pass, forward_pass, param_grads
from tritonmoe.comm.splits import DispatchPlan
from tritonmoe.comm.timeline import Timeline

__all__ = [
    "STRATEGIES",
    "RESTORE",
    "DI_SLOTS",
    "MI_SLOTS",
    "MI_BUFFER_CHOICES",
    "restore_schedule",
    "check_mi_buffers",
    "MemoryLayout",
    "memory_layout",
    "ExpertFFN",
    "run_memory_pipelined",
]

#: The restore strategies (``MoEConfig.memory_strategy`` also takes "auto": the planner's choice).
STRATEGIES = ("keep", "offload", "recomm", "recompute", "recomm_recompute")
#: strategy -> (how DI is restored, how MI is restored); None: never overwritten ("keep").
RESTORE = {
    "keep": (None, None),
    "offload": ("offload", "offload"),
    "recomm": ("recomm", "offload"),
    "recompute": ("offload", "recompute"),
    "recomm_recompute": ("recomm", "recompute"),
}
#: Shared device buffers under memory reuse (paper 004 §III-C): DI is double-buffered (the next
#: micro-op's rows arrive, or are restored, while one computes: micro-op i reuses i-2's), MI
#: single by default (the micro-ops' expert computes run one after another: i reuses i-1's).
DI_SLOTS = 2
MI_SLOTS = 1
#: Allowed MI buffer counts (``MoEConfig.memory_mi_buffers``): 1, the paper's T_M, or 2, double
#: buffered like DI (a micro-op's MI copy overlaps the next micro-op's compute).
MI_BUFFER_CHOICES = (1, 2)


def restore_schedule(n: int, slots: int) -> tuple[int, ...]:
    """The micro-ops whose buffer is overwritten before their backward reads it, with ``slots``
    shared buffers (micro-op i in buffer i % slots), the forward writing micro-ops 0..n-1 and
    the backward reading (and refilling) them in the same order. Those are the micro-ops a
    strategy must restore (and, for a host copy, copy out in forward).

    Examples: n=2 with 2 buffers: none; n=2 with 1 buffer: (0, 1); n=3 with 2 buffers: (0, 2)."""
    if slots <= 0:
        raise ValueError(f"slots must be positive, got {slots}")
    owner: list[Optional[int]] = [None] * slots
    for i in range(n):
        owner[i % slots] = i
    need = []
    for i in range(n):
        s = i % slots
        if owner[s] != i:
            need.append(i)
            owner[s] = i
    return tuple(need)


@dataclass(frozen=True)
class MemoryLayout:
    """Where a pass of n micro-ops keeps DI and MI under ``strategy``.

    Attributes:
        di_slots, mi_slots: shared buffers (n each under "keep": one per micro-op).
        di_restore, mi_restore: micro-ops restored in backward.
        di_method, mi_method: "offload", "recomm", "recompute" or None.
    """

    strategy: str
    n: int
    di_slots: int
    mi_slots: int
    di_restore: tuple[int, ...]
    mi_restore: tuple[int, ...]
    di_method: Optional[str]
    mi_method: Optional[str]

    @property
    def reuse(self) -> bool:
        return self.strategy != "keep"

    @property
    def di_offloaded(self) -> tuple[int, ...]:
        """Micro-ops whose DI is copied to the host in forward."""
        return self.di_restore if self.di_method == "offload" else ()

    @property
    def mi_offloaded(self) -> tuple[int, ...]:
        return self.mi_restore if self.mi_method == "offload" else ()

    @property
    def recommunicated(self) -> tuple[int, ...]:
        return self.di_restore if self.di_method == "recomm" else ()

    @property
    def recomputed(self) -> tuple[int, ...]:
        return self.mi_restore if self.mi_method == "recompute" else ()


def check_mi_buffers(mi_buffers: Any) -> int:
    """``mi_buffers`` as an int in :data:`MI_BUFFER_CHOICES`, or a TypeError / ValueError naming it."""
    if isinstance(mi_buffers, bool) or not isinstance(mi_buffers, numbers.Integral):
        raise TypeError(f"memory_mi_buffers must be an int (1 or 2), got {type(mi_buffers).__name__} {mi_buffers!r}")
    if mi_buffers not in MI_BUFFER_CHOICES:
        raise ValueError(f"memory_mi_buffers={mi_buffers}: use 1 (the paper's single T_M buffer: least memory) or 2 "
                         "(double-buffered: MI host copies overlap the next micro-op's compute)")
    return int(mi_buffers)


def memory_layout(strategy: str, n: int, mi_buffers: int = MI_SLOTS) -> MemoryLayout:
    """The :class:`MemoryLayout` of ``strategy`` for n micro-ops with ``mi_buffers`` shared MI
    buffers (ignored by "keep")."""
    if strategy not in RESTORE:
        raise ValueError(f"memory_strategy={strategy!r}: use one of {', '.join(STRATEGIES)} (or 'auto')")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    mi_buffers = check_mi_buffers(mi_buffers)
    di_m, mi_m = RESTORE[strategy]
    if strategy == "keep":
        return MemoryLayout(strategy, n, n, n, (), (), None, None)
    kd, km = min(n, DI_SLOTS), min(n, mi_buffers)
    return MemoryLayout(strategy, n, kd, km, restore_schedule(n, kd), restore_schedule(n, km), di_m, mi_m)


@dataclass
class ExpertFFN:
    """The expert computation of the managed block, as the expert path provides it.

    Attributes:
        activation, swiglu_limit, swiglu_alpha: the FFN's activation.
        gemm: ``gemm(x_RK, offsets, w_EKN, bias) -> [R, N]`` in x's dtype (the dispatched
            grouped GEMM of the layer's backend).
        to_expert_major, to_source_major: ``f(i, rows)``: micro-op i's received rows to the
            expert-major layout and back (each the other's adjoint: row permutations).
        offsets: ``offsets(i)`` -> int64 [L+1] segment starts of micro-op i's local experts.
        resend: ``resend(i)`` -> micro-op i's send buffer again (the permuted rows of its
            tokens), for the re-dispatch of "recomm"; None keeps the forward's send buffers.
        train, train_backward: the dispatched ``grouped_ffn_train`` / ``grouped_ffn_train_backward``
            of the layer's backend (:mod:`tritonmoe.backends`: the Triton grouped FFN kernels'
            forward and backward, or the reference), used for every dtype but fp64; None: the
            GEMM-by-GEMM forward and per-expert backward (fp64 always takes that exact path).
    """

    activation: str
    gemm: Callable[..., torch.Tensor]
    to_expert_major: Callable[[int, torch.Tensor], torch.Tensor]
    to_source_major: Callable[[int, torch.Tensor], torch.Tensor]
    offsets: Callable[[int], torch.Tensor]
    resend: Optional[Callable[[int], torch.Tensor]] = None
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    train: Optional[Callable[..., tuple]] = None
    train_backward: Optional[Callable[..., tuple]] = None

    def fused(self, dtype: torch.dtype) -> bool:
        """Whether rows of ``dtype`` run through the dispatched training ops (not fp64: fp64 takes
        the exact path, whose row-invariant input gradients and deferred weight gradients make
        every strategy and degree bitwise equal)."""
        return self.train is not None and self.train_backward is not None and dtype != torch.float64

    def act(self, h: torch.Tensor) -> torch.Tensor:
        return reference.apply_activation(h, self.activation, swiglu_limit=self.swiglu_limit,
                                          swiglu_alpha=self.swiglu_alpha).to(h.dtype)

    def forward(self, x: torch.Tensor, offs_t: torch.Tensor, w1, w2, b1, b2) -> tuple[torch.Tensor, torch.Tensor]:
        """(MI, y) of rows x: MI = FC1(x) + b1, y = FC2(act(MI)) + b2."""
        if self.fused(x.dtype):
            # the grouped FFN's fused forward (GEMM1 + bias + activation epilogue, GEMM2), as
            # the unmanaged path runs it; A is not kept (backward recomputes it from MI)
            y, _, h = self.train(x, offs_t, w1, w2, self.activation, b1, b2, swiglu_limit=self.swiglu_limit,
                                 swiglu_alpha=self.swiglu_alpha)
            return h, y
        h = self.gemm(x, offs_t, w1, b1)
        return h, self.gemm(self.act(h), offs_t, w2, b2)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _input_grad(dy: torch.Tensor, w: torch.Tensor, offs: list[int], K: int) -> torch.Tensor:
    """d(x) of a grouped GEMM: rows of expert e times w[e]^T. fp64: row by row
    (:func:`tritonmoe.core.exact.rowwise_mm`, as the reference GEMM's backward), so every row is the
    same whichever micro-op it is in."""
    R = dy.shape[0]
    exact = dy.dtype == torch.float64 and w.dtype == torch.float64
    dx = dy.new_zeros(R, K)
    for e in range(w.shape[0]):
        a, b = offs[e], offs[e + 1]
        if b > a:
            if exact:
                dx[a:b] = rowwise_mm(dy[a:b], w[e].t())
            else:
                acc = _acc(dy.dtype)
                dx[a:b] = (dy[a:b].to(acc) @ w[e].to(acc).t()).to(dx.dtype)
    return dx


class _ExpertFFN(torch.autograd.Function):
    """One micro-op's expert FFN on its DI rows; saves DI and MI (as the memory manager keeps
    them) and the weights; backward asks the manager to restore DI and MI first."""

    @staticmethod
    def forward(ctx, mgr: "_Memory", i: int, x, w1, w2, b1, b2):
        ffn = mgr.ffn
        h, y = ffn.forward(x, mgr.offsets_t[i], w1, w2, b1, b2)
        h_saved = mgr.store_mi(i, h)
        ctx.mgr, ctx.i = mgr, i
        ctx.defer = {}
        slot = mgr.wslot(i)
        if slot is not None and x.dtype == torch.float64:
            for name, p in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
                if p is not None and p.requires_grad and p.dtype == torch.float64:
                    site = slot.claim_site(p)
                    if site is not None:
                        ctx.defer[name] = (slot, site, p)  # the store matches its parameters by identity
        ctx.save_for_backward(x, h_saved, w1, w2, b1, b2)
        return y

    @staticmethod
    @first_order("the memory-reuse expert computation")
    def backward(ctx, dy):
        mgr, i = ctx.mgr, ctx.i
        mgr.ensure(i)  # refill the shared buffers with micro-op i's DI and MI where overwritten
        x, h, w1, w2, b1, b2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        ffn = mgr.ffn
        if ffn.fused(x.dtype):
            # the grouped FFN's backward (Triton kernels on the kernel backends): A again from MI
            # (elementwise), then dact, dX, dW1, dW2 and the bias sums from the saved DI and MI
            # in fp32 from the stored MI, rounded once, as the kernels' GEMM1 epilogue computes A
            a = ffn.act(h.float()).to(h.dtype)
            needs = (need[2], need[3], need[4], need[5] and b1 is not None, need[6] and b2 is not None)
            dx, dw1, dw2, db1, db2 = ffn.train_backward(
                dy.contiguous(), x, mgr.offsets_t[i], w1, w2, b1, b2, a, h, ffn.activation, needs=needs,
                swiglu_limit=ffn.swiglu_limit, swiglu_alpha=ffn.swiglu_alpha)
            return None, None, dx, dw1, dw2, db1, db2
        offs = mgr.host_offsets(i)
        L = w1.shape[0]
        acc = _acc(dy.dtype)
        dy = dy.contiguous()
        # the activation again from MI (elementwise), and its backward
        with torch.enable_grad():
            h_ = h.detach().requires_grad_(True)
            a_ = ffn.act(h_)
        a = a_.detach()
        da = _input_grad(dy, w2, offs, w2.shape[1])
        (dh,) = torch.autograd.grad(a_, h_, da)
        dx = _input_grad(dh, w1, offs, w1.shape[1]) if need[2] else None

        def wgrad(name, p, xin, d, fn):
            if p is None or not p.requires_grad:
                return None
            if name in ctx.defer:
                slot, site, p = ctx.defer[name]
                # the W step keeps these rows until after the last micro-op: a copy of a shared
                # buffer's view, whose contents the next restore replaces
                keep = xin.clone() if (mgr.layout.reuse and xin.numel()) else xin
                slot.add(p, site, keep, d, offs, fn)
                return None
            return fn(xin.to(acc), d.to(acc), offs, L).to(p.dtype)

        dw1 = wgrad("w1", w1, x, dh, grouped_wgrad)
        db1 = wgrad("b1", b1, dh.new_empty(dh.shape[0], 0), dh, reference._grouped_bias_grad)
        dw2 = wgrad("w2", w2, a, dy, grouped_wgrad)
        db2 = wgrad("b2", b2, dy.new_empty(dy.shape[0], 0), dy, reference._grouped_bias_grad)
        return None, None, dx, dw1, dw2, db1, db2


def _alias(buf: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """A [rows, width] tensor on ``buf``'s storage with its own version counter (writes through it
    do not mark the saved views of ``buf`` as modified)."""
    return torch.empty(0, dtype=buf.dtype, device=buf.device).set_(buf.untyped_storage(), 0, (rows, width), (width, 1))


@dataclass
class _Memory:
    """The memory manager of one forward/backward of the managed block."""

    layout: MemoryLayout
    ffn: ExpertFFN
    plan: DispatchPlan
    group: Any
    width: int  # d
    n1: int
    dtype: torch.dtype
    device: torch.device
    offsets_t: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    wgrads: Optional[WeightGradStore] = None
    ex: Optional[RealExecutor] = None
    params: list = field(default_factory=list)
    sends: Optional[Sequence[torch.Tensor]] = None

    def __post_init__(self) -> None:
        n = self.layout.n
        self.rows = [self.plan.recv_rows(i) for i in range(n)]
        self.offsets_t = [self.ffn.offsets(i) for i in range(n)]
        self._offs: Optional[list] = None
        top = max(self.rows) if self.rows else 0
        lay = self.layout
        if lay.reuse:
            mk = lambda w: torch.empty(top * w, dtype=self.dtype, device=self.device)  # noqa: E731
            self.di_buf = [mk(self.width) for _ in range(lay.di_slots)]
            self.mi_buf = [mk(self.n1) for _ in range(lay.mi_slots)]
        self.di_owner: list = [None] * lay.di_slots
        self.mi_owner: list = [None] * lay.mi_slots
        self.host_di: dict = {}
        self.host_mi: dict = {}
        self.recomm: dict = {}
        self.mi_pending: dict = {}  # micro-op -> its MI restore, issued after the previous reader
        self.d2h = {"di": 0, "mi": 0}  # bytes copied out (reported in the pass statistics)
        self.released: list = []  # (storage, bytes) of the buffers freed between forward and backward

    def wslot(self, i: int):
        return self.wgrads.slot(i) if self.wgrads is not None else None

    # -- forward -------------------------------------------------------------------------------

    def _evict(self, kind: str, s: int) -> None:
        """Wait for the host copy of buffer s's current occupant (it must be out before the next
        micro-op overwrites the buffer)."""
        owner = (self.di_owner if kind == "di" else self.mi_owner)[s]
        copies = self.host_di if kind == "di" else self.host_mi
        if owner is not None and owner in copies:
            self.ex.wait(copies[owner])

    def store_di(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """DI of micro-op i as it is saved: x itself ("keep") or a view of its shared buffer."""
        if not self.layout.reuse:
            return x
        s = i % self.layout.di_slots
        self._evict("di", s)
        R = x.shape[0]
        _alias(self.di_buf[s], R, self.width).copy_(x)
        self.di_owner[s] = i
        return self.di_buf[s][: R * self.width].view(R, self.width)

    def store_mi(self, i: int, h: torch.Tensor) -> torch.Tensor:
        if not self.layout.reuse:
            return h
        s = i % self.layout.mi_slots
        self._evict("mi", s)
        R = h.shape[0]
        _alias(self.mi_buf[s], R, self.n1).copy_(h)
        self.mi_owner[s] = i
        return self.mi_buf[s][: R * self.n1].view(R, self.n1)

    def offload(self, i: int) -> None:
        """Start the host copies of micro-op i's DI / MI that its backward will need."""
        lay, R = self.layout, self.rows[i]
        if i in lay.di_offloaded:
            src = _alias(self.di_buf[i % lay.di_slots], R, self.width)
            self.host_di[i] = self.ex.copy(src, to="host", kind="offload", micro_op=i)
            self.d2h["di"] += src.numel() * src.element_size()
        if i in lay.mi_offloaded:
            src = _alias(self.mi_buf[i % lay.mi_slots], R, self.n1)
            self.host_mi[i] = self.ex.copy(src, to="host", kind="offload", micro_op=i)
            self.d2h["mi"] += src.numel() * src.element_size()

    # -- backward ------------------------------------------------------------------------------

    def prefetch(self, i: int) -> list:
        """Issued with micro-op i's first backward exchange (before micro-op i-1's compute): the
        restore of its DI into buffer i % 2, which micro-op i-2 has finished with, and of its MI
        when no earlier micro-op reads its buffer in backward (i < ``mi_buffers``: the buffer is
        free)."""
        lay, R = self.layout, self.rows[i]
        works = []
        if i in lay.di_restore:
            s = i % lay.di_slots
            self.di_owner[s] = i
            if lay.di_method == "offload":
                works.append(self.ex.copy(self.host_di.pop(i), to="device", out=_alias(self.di_buf[s], R, self.width),
                                          kind="restore", micro_op=i))
            else:
                # re-dispatch: the same rows, the same splits, so the same received order
                send = self.ffn.resend(i) if self.ffn.resend is not None else self.sends[i]
                h = self.ex.all_to_all(send, self.plan.send_splits[i], self.plan.recv_splits[i], group=self.group,
                                       kind="recomm", micro_op=i)
                self.recomm[i] = h
                works.append(h)
        if i < lay.mi_slots:
            works.extend(self._restore_mi(i, ()))
        return works

    def _restore_mi(self, i: int, after: tuple) -> list:
        """The host copy of micro-op i's MI back into its buffer, after ``after``."""
        lay = self.layout
        if i >= lay.n or i not in lay.mi_restore or lay.mi_method != "offload":
            return []
        s = i % lay.mi_slots
        self.mi_owner[s] = i
        return [self.ex.copy(self.host_mi.pop(i), to="device", out=_alias(self.mi_buf[s], self.rows[i], self.n1),
                             kind="restore", micro_op=i, after=after)]

    def post_compute(self, i: int, y) -> None:
        """Right after micro-op i's backward compute is issued: it was the last reader of its MI
        buffer, so the restore of the buffer's next occupant (micro-op i+1, or i+2 with two MI
        buffers) starts now (on the copy lane, after that compute); that micro-op's compute waits
        for it (:meth:`pre_compute`)."""
        j = i + self.layout.mi_slots
        works = self._restore_mi(j, (y,))
        if works:
            self.mi_pending[j] = works

    def pre_compute(self, i: int) -> list:
        """Just before micro-op i's backward compute: the MI restore it waits for."""
        return self.mi_pending.pop(i, [])

    def host_offsets(self, i: int) -> list[int]:
        """Micro-op i's per-expert row offsets as Python ints, for the reference backward's
        per-expert slices (the kernels' backward takes the device offsets and never asks)."""
        if self._offs is None:
            # host sync (once per pass, reference backward only): the per-expert row ranges
            self._offs = [[int(v) for v in o.tolist()] for o in self.offsets_t]
        return self._offs[i]

    def ensure(self, i: int) -> None:
        """Inside micro-op i's backward compute: finish the restores that run on the compute lane
        (the re-dispatched rows' re-layout, the FC1 recompute)."""
        lay, R = self.layout, self.rows[i]
        if i in self.recomm:
            recv = self.ex.wait(self.recomm.pop(i))
            _alias(self.di_buf[i % lay.di_slots], R, self.width).copy_(self.ffn.to_expert_major(i, recv))
        if i in lay.recomputed:
            s = i % lay.mi_slots
            di = _alias(self.di_buf[i % lay.di_slots], R, self.width)
            w1, b1 = self.params[0], self.params[2]
            h = self.ffn.gemm(di, self.offsets_t[i], w1, b1)
            _alias(self.mi_buf[s], R, self.n1).copy_(h)
            self.mi_owner[s] = i

    def release(self) -> None:
        """At the end of the forward: free the shared buffers whose contents no backward reads,
        so that they are not held between forward and backward. A buffer shared by more than one
        micro-op (slot s of ``slots`` when s + slots < n) ends the forward holding its last
        occupant, whose backward restores it anyway (the backward reads micro-op s first and
        refills the buffer before each later occupant): its bytes are dead. The host copies still
        reading such a buffer are waited for first; :meth:`revive` allocates the storage again
        when the backward starts (the saved views of the buffer then see it again)."""
        lay = self.layout
        if not lay.reuse:
            return
        for kind, bufs, slots in (("di", self.di_buf, lay.di_slots), ("mi", self.mi_buf, lay.mi_slots)):
            for s, buf in enumerate(bufs):
                if s + slots < lay.n:  # more than one occupant: every one of them is restored
                    self._evict(kind, s)
                    st = buf.untyped_storage()
                    self.released.append((st, st.nbytes()))
                    st.resize_(0)

    def revive(self) -> None:
        """At the start of the backward: the storage of the buffers :meth:`release` freed, again
        (uninitialized: every micro-op in them is restored before it is read)."""
        for st, nbytes in self.released:
            st.resize_(nbytes)
        self.released = []

    def close(self) -> None:
        self.di_buf = self.mi_buf = []
        self.released = []
        self.host_di, self.host_mi, self.recomm, self.mi_pending = {}, {}, {}, {}


@dataclass
class _State:
    group: Any
    plan: DispatchPlan
    ffn: ExpertFFN
    strategy: str
    n1: int
    timeline: Optional[Timeline]
    trace: Optional[list]
    scheduler: Any = None
    mi_buffers: int = MI_SLOTS
    mem: Optional[_Memory] = None
    graphs: list = field(default_factory=list)
    out_width: list = field(default_factory=list)
    stats: Optional[dict] = None


def _weights(params: Sequence[torch.Tensor], has_b1: bool, has_b2: bool) -> list:
    """(w1, w2, b1, b2) with None for absent biases."""
    w1, w2, *rest = params
    rest = list(rest)
    b1 = rest.pop(0) if has_b1 else None
    b2 = rest.pop(0) if has_b2 else None
    return [w1, w2, b1, b2]


class _MemoryPipelinedExperts(torch.autograd.Function):
    """sends (N), params -> N combined buffers; the expert block of every micro-op saves DI and
    MI as the memory strategy says; backward pipelined with the restores."""

    @staticmethod
    def forward(ctx, state: _State, has_b: tuple, *tensors):
        plan = state.plan
        n = plan.num_micro_ops
        sends, params = tensors[:n], tensors[n:]
        dparams = [p.detach().requires_grad_(p.requires_grad) for p in params]
        w = _weights(dparams, *has_b)
        want = [p for p in dparams if p.requires_grad]
        x0 = sends[0]
        mem = _Memory(memory_layout(state.strategy, n, state.mi_buffers), state.ffn, plan, state.group, x0.shape[1], state.n1,
                      x0.dtype, x0.device)
        mem.params = w
        mem.wgrads = WeightGradStore(want, n) if want else None
        if state.ffn.resend is None and mem.layout.recommunicated:
            mem.sends = [s.detach() for s in sends]  # no re-permute given: keep the send buffers
        state.mem = mem
        state.graphs = [None] * n
        ex = RealExecutor(x0.device, phase="fwd", timeline=state.timeline, scheduler=state.scheduler)
        mem.ex = ex

        def expert_fwd(i: int, recv: torch.Tensor) -> torch.Tensor:
            x = mem.store_di(i, state.ffn.to_expert_major(i, recv))
            with torch.enable_grad():
                x_leaf = x.detach().requires_grad_(True)
                y = _ExpertFFN.apply(mem, i, x_leaf, *w)
            mem.offload(i)
            out = state.ffn.to_source_major(i, y.detach())
            if out.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
                # the expert output (the paper's T_DO) is not read in backward: only its graph
                # node is kept (for autograd.grad, which needs y's metadata, not its data)
                y.untyped_storage().resize_(0)
            state.graphs[i] = (x_leaf, y)
            return out

        backs = forward_pass(ex, sends, plan, expert_fwd, group=state.group)
        mem.release()  # the shared buffers whose contents the backward restores anyway
        if state.trace is not None:
            state.trace.extend(ex.trace)
        state.out_width = [b.shape[1] for b in backs]
        ctx.state = state
        ctx.params = dparams
        ctx.want = want
        if state.stats is not None:
            state.stats.update(layout=mem.layout, rows=list(mem.rows), d2h_bytes=dict(mem.d2h))
        return tuple(backs)

    @staticmethod
    @first_order("the memory-reuse pipelined schedule")
    def backward(ctx, *grads):
        state: _State = ctx.state
        plan, mem = state.plan, state.mem
        n = plan.num_micro_ops
        if mem is None or any(not g for g in state.graphs):
            raise RuntimeError(
                "the expert-parallel block was back-propagated twice; its micro-op graphs are freed "
                "after the first backward (retain_graph is not supported through it)"
            )
        params, want = ctx.params, ctx.want
        acc: list = [None] * len(want)
        dys = []
        for i, g in enumerate(grads):
            if g is None:
                g = state.graphs[i][1].new_zeros((plan.send_rows(i), state.out_width[i]))
            dys.append(g.contiguous())
        ex = RealExecutor(dys[0].device, phase="bwd", timeline=state.timeline, scheduler=state.scheduler)
        mem.ex = ex
        mem.revive()

        def expert_bwd(i: int, dy_src: torch.Tensor) -> torch.Tensor:
            x_leaf, y = state.graphs[i]
            state.graphs[i] = ()
            dy = state.ffn.to_expert_major(i, dy_src)
            gs = torch.autograd.grad(y, [x_leaf] + want, dy, allow_unused=True)
            for j, gw in enumerate(gs[1:]):
                if gw is not None:
                    acc[j] = gw if acc[j] is None else acc[j] + gw
            dx = gs[0] if gs[0] is not None else torch.zeros_like(x_leaf)
            return state.ffn.to_source_major(i, dx)

        def weight_step() -> None:
            if mem.wgrads is None:
                return
            for j, g in enumerate(mem.wgrads.flush(plan.recv_counts)):
                if g is not None:
                    acc[j] = g if acc[j] is None else acc[j] + g

        try:
            d_sends = backward_pass(ex, dys, plan, expert_bwd, group=state.group, weight_step=weight_step,
                                    prefetch=mem.prefetch, pre_compute=mem.pre_compute,
                                    post_compute=mem.post_compute)
        finally:
            mem.close()
            state.mem = None
            if state.scheduler is not None:
                state.scheduler.exchanges_done()
        if state.trace is not None:
            state.trace.extend(ex.trace)
        return (None, None, *d_sends, *param_grads(params, acc))


def run_memory_pipelined(
    sends: Sequence[torch.Tensor],
    plan: DispatchPlan,
    ffn: ExpertFFN,
    params: Sequence[torch.Tensor],
    *,
    strategy: str,
    n1: int,
    has_b1: bool = False,
    has_b2: bool = False,
    group=None,
    timeline: Optional[Timeline] = None,
    trace: Optional[list] = None,
    scheduler: Any = None,
    stats: Optional[dict] = None,
    mi_buffers: int = MI_SLOTS,
) -> list[torch.Tensor]:
    """:func:`tritonmoe.comm.run_pipelined` with the expert FFN's activations managed by
    ``strategy`` (see the module docstring); differentiable.

    Args:
        sends, plan, group, timeline, trace, scheduler: as :func:`tritonmoe.comm.run_pipelined`.
        ffn: the :class:`ExpertFFN` of the layer (GEMM, activation, re-layouts, re-permute).
        params: ``w1, w2`` then ``b1`` / ``b2`` when ``has_b1`` / ``has_b2``.
        strategy: one of :data:`STRATEGIES`.
        n1: the first GEMM's width (MI's width).
        stats: a dict that receives the pass's :class:`MemoryLayout`, received rows per micro-op
            and the bytes copied to the host.
        mi_buffers: shared MI buffers under a reuse strategy (1: the paper's; 2: double-buffered).

    Returns: N buffers, micro-op i's expert outputs back on this rank in the order of ``sends[i]``.
    """
    n = plan.num_micro_ops
    if strategy not in RESTORE:
        raise ValueError(f"memory strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if len(sends) != n:
        raise ValueError(f"got {len(sends)} send buffers for a plan of {n} micro-ops")
    mi_buffers = check_mi_buffers(mi_buffers)
    state = _State(group, plan, ffn, strategy, int(n1), timeline, trace, scheduler, stats=stats, mi_buffers=mi_buffers)
    tensors = (*sends, *params)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_MemoryPipelinedExperts.apply(state, (has_b1, has_b2), *tensors))
    # nothing to save: the same forward without a graph
    w = _weights(list(params), has_b1, has_b2)
    offsets = [ffn.offsets(i) for i in range(n)]

    def expert(i: int, recv: torch.Tensor) -> torch.Tensor:
        _, y = ffn.forward(ffn.to_expert_major(i, recv), offsets[i], *w)
        return ffn.to_source_major(i, y)

    ex = RealExecutor(sends[0].device, phase="fwd", timeline=timeline, scheduler=scheduler)
    out = forward_pass(ex, sends, plan, expert, group=group)
    if trace is not None:
        trace.extend(ex.trace)
    return out
