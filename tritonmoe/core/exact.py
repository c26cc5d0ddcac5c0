"""Exactness machinery: why a scheduled layer can equal the unscheduled one bit for bit.

A schedule (micro-op pipelining, memory reuse with recomputation, Parm's schedules) cuts the
rows of the expert computation into pieces and changes when each piece runs. Its results equal
the unscheduled computation's *bitwise* only if

1. every output row, and every row of the input gradient, is computed by the same arithmetic
   whichever piece it is in (**row invariance**), and
2. every reduction over rows (the weight gradients ``X_e^T dY_e``) runs over the same rows in
   the same order (**deferred weight gradients**).

Vendor BLAS GEMMs are not row-invariant (MKL and cuBLAS choose kernels by the row count of the
call, so ``x[a:b] @ w`` and ``(x @ w)[a:b]`` round differently), nor are ATen's vectorized
transcendental functions (vector and scalar-tail paths round differently by position in the
buffer). So the fp64 reference, which the tests use as the exact ground truth, computes

* its grouped GEMMs with :func:`rowwise_mm` (M independent ``[1, K] @ [K, N]`` products),
* its activations through :func:`elementwise_scalar` (ATen's scalar loop on every element),

and defers its weight gradients to a :class:`WeightGradStore` when a schedule passes one: the
GEMM's backward hands its rows (``x``, ``dy``, expert offsets) to the store instead of computing
``x^T dy`` per piece, and after the last piece :meth:`WeightGradStore.flush` (the zero-bubble "W"
step) concatenates each expert's rows of all pieces in the unscheduled order and computes each
weight gradient once.

The store is an explicit argument: a schedule creates one per backward pass and passes
``store.slot(i)`` (a :class:`WeightGradSlot`) to piece i's expert computation, which passes it as
``wgrad=`` to the GEMMs that support deferral (:func:`tritonmoe.reference.grouped_gemm` /
``grouped_ffn``; a function that does carries ``defers_weight_grad = True``). Other GEMMs compute
their weight gradients in backward as usual and a schedule sums them over pieces: equal to the
unscheduled result up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from tritonmoe.core.autograd import first_order

__all__ = [
    "rowwise_mm",
    "elementwise_scalar",
    "grouped_wgrad",
    "row_invariant_grouped_gemm",
    "WeightGradStore",
    "WeightGradSlot",
]

#: ``wgrad(x_RK, dy_RN, offsets_list, num_experts) -> [E, K, N]``: a GEMM's weight-gradient op.
WgradFn = Callable[[torch.Tensor, torch.Tensor, list, int], torch.Tensor]


def rowwise_mm(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """x @ w computed as M independent [1, K] @ [K, N] products (a bmm against an expanded, not
    copied, view of w), so that each output row depends on its input row and w only."""
    M, K = x_MK.shape
    return torch.bmm(x_MK.unsqueeze(1), w_KN.unsqueeze(0).expand(M, K, w_KN.shape[1])).squeeze(1)


def elementwise_scalar(h_RN: torch.Tensor) -> torch.Tensor:
    """h as a view with inner stride 2 (a padded copy), so that elementwise ops on it, and their
    backward, run ATen's scalar loop on every element.

    On contiguous buffers ATen runs the vectorized transcendental functions (erf, exp) on most
    elements and the scalar ones on the tail, which round differently, and the split depends on
    an element's position in the whole buffer and on how the buffer is cut across threads (at
    arbitrary positions). With no unit-stride operand there is no vectorized path, so every
    element of every row goes through the same function: the op is row-invariant.
    """
    return F.pad(h_RN.unsqueeze(-1), (0, 1))[..., 0]


def grouped_wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, offs: list, num_experts: int) -> torch.Tensor:
    """Per-expert weight gradient x_e^T @ dy_e -> [E, K, N] (the GEMM over each expert's rows)."""
    dw = x_RK.new_zeros(num_experts, x_RK.shape[1], dy_RN.shape[1])
    for e in range(num_experts):
        a, b = offs[e], offs[e + 1]
        if b > a:
            dw[e] = x_RK[a:b].t() @ dy_RN[a:b]
    return dw


@dataclass(frozen=True)
class WeightGradSlot:
    """Piece ``micro_op`` of a :class:`WeightGradStore`: what a deferring GEMM receives."""

    store: "WeightGradStore"
    micro_op: int

    def claim_site(self, w: torch.Tensor) -> Optional[int]:
        """Forward: the call-site index of a new deferring GEMM on ``w`` in this piece (the k-th
        such GEMM of the piece, which pairs it with the same GEMM of other pieces), or None when
        ``w`` is not one of the store's parameters (its gradient is then computed as usual)."""
        return self.store.claim_site(self.micro_op, w)

    def add(self, w: torch.Tensor, site: int, x: torch.Tensor, dy: torch.Tensor, offsets: list, wgrad: WgradFn) -> None:
        """Backward: record this piece's rows of the ``site``-th deferring GEMM on ``w``."""
        self.store.add(self.micro_op, w, site, x, dy, offsets, wgrad)


class WeightGradStore:
    """Weight-gradient pieces of the deferring GEMMs of N pieces, keyed by parameter.

    Args:
        params: the weights whose gradients are deferred (identity, not value, is matched).
        num_micro_ops: N.

    Row order at :meth:`flush`: piece i's rows of expert e come as G consecutive groups (source
    ranks in expert parallelism) of ``group_counts[i][g, e]`` rows, and pieces are contiguous
    token ranges, so the unscheduled order of expert e is: group g, then piece i, then the rows'
    own order.
    """

    def __init__(self, params: Sequence[torch.Tensor], num_micro_ops: int) -> None:
        self.params = list(params)
        self.num_micro_ops = num_micro_ops
        # per parameter: per call site (the k-th deferring GEMM on it in a piece): per piece
        self._pieces: dict[int, list[list[Optional[tuple]]]] = {}
        self._calls: dict[tuple[int, int], int] = {}

    def slot(self, micro_op: int) -> WeightGradSlot:
        if not 0 <= micro_op < self.num_micro_ops:
            raise IndexError(f"micro_op={micro_op} outside [0, {self.num_micro_ops})")
        return WeightGradSlot(self, micro_op)

    def _index(self, w: torch.Tensor) -> Optional[int]:
        return next((k for k, p in enumerate(self.params) if p is w), None)

    def claim_site(self, micro_op: int, w: torch.Tensor) -> Optional[int]:
        j = self._index(w)
        if j is None:
            return None
        site = self._calls.get((micro_op, j), 0)
        self._calls[(micro_op, j)] = site + 1
        return site

    def add(self, micro_op: int, w: torch.Tensor, site: int, x: torch.Tensor, dy: torch.Tensor,
            offsets: list, wgrad: WgradFn) -> None:
        j = self._index(w)
        if j is None:
            raise ValueError("add() for a weight that is not one of the store's parameters")
        sites = self._pieces.setdefault(j, [])
        while len(sites) <= site:
            sites.append([None] * self.num_micro_ops)
        sites[site][micro_op] = (x, dy, offsets, wgrad)

    def flush(
        self, group_counts: Sequence[torch.Tensor], groups: Optional[Sequence[int]] = None
    ) -> list[Optional[torch.Tensor]]:
        """The W step: per parameter, its deferred weight gradient (None when nothing deferred).

        ``group_counts[i]`` is an int [G, E] tensor: piece i's rows of expert e come as G
        consecutive groups of ``group_counts[i][g, e]`` rows. ``groups`` (default: all G in
        order) lists the groups whose rows enter the weight gradients, in the order they enter:
        a schedule that computes some rows more than once (Parm's baseline processes every token
        once per model-parallel rank) keeps one copy of each, and one whose groups arrive in
        another order than the unscheduled computation's puts them back in that order. Frees the
        recorded rows."""
        out: list[Optional[torch.Tensor]] = [None] * len(self.params)
        if not self._pieces:  # nothing deferred (the kernels' GEMMs compute their own): no sync
            self._calls = {}
            return out
        counts = [c.tolist() for c in group_counts]  # host sync: row ranges per (group, expert)
        for j, sites in sorted(self._pieces.items()):
            for per_op in sites:
                g = self._site_grad(per_op, counts, self.params[j].shape[0], groups)
                if g is not None:
                    out[j] = g if out[j] is None else out[j] + g
        self._pieces = {}
        self._calls = {}
        return out

    def _site_grad(self, per_op, counts, E: int, groups: Optional[Sequence[int]]) -> Optional[torch.Tensor]:
        ops = [i for i, piece in enumerate(per_op) if piece is not None]
        if not ops:
            return None
        wgrad = per_op[ops[0]][3]
        # Start row of each (piece, group, expert) block in the concatenated piece buffers.
        base, starts = 0, {}
        for i in ops:
            x, _, offs, _ = per_op[i]
            G = len(counts[i])
            for e in range(E):
                r = base + offs[e]
                for g in range(G):
                    starts[(i, g, e)] = r
                    r += counts[i][g][e]
                if r != base + offs[e + 1]:
                    raise RuntimeError(
                        f"piece {i}: expert {e} has {offs[e + 1] - offs[e]} rows but its groups count "
                        f"{r - base - offs[e]}; the GEMM's rows must be the expert-major received rows"
                    )
            base += x.shape[0]
        G = len(counts[ops[0]])
        order = range(G) if groups is None else groups
        index, new_offs = [], [0]
        for e in range(E):
            for g in order:
                for i in ops:
                    n = counts[i][g][e]
                    index.extend(range(starts[(i, g, e)], starts[(i, g, e)] + n))
            new_offs.append(len(index))
        idx = torch.tensor(index, dtype=torch.int64, device=per_op[ops[0]][0].device)
        x_all = torch.cat([per_op[i][0] for i in ops]).index_select(0, idx)
        dy_all = torch.cat([per_op[i][1] for i in ops]).index_select(0, idx)
        return wgrad(x_all, dy_all, new_offs, E)


class _RowInvariantGroupedGemm(torch.autograd.Function):
    """Grouped GEMM whose forward and input gradient are row-invariant (:func:`rowwise_mm`) and
    whose weight gradient is one ``x_e^T @ dy_e`` per expert, or, with a :class:`WeightGradSlot`
    whose store holds ``w``, deferred to that store."""

    @staticmethod
    def forward(x_RK, offs, w_EKN, slot):
        R = x_RK.shape[0]
        E, _, N = w_EKN.shape
        y = x_RK.new_zeros(R, N)
        for e in range(E):
            a, b = offs[e], offs[e + 1]
            if b > a:
                y[a:b] = rowwise_mm(x_RK[a:b], w_EKN[e])
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):  # a separate setup_context: torch.func can transform it
        x_RK, offs, w_EKN, slot = inputs
        ctx.offs = offs
        ctx.defer = None
        if slot is not None and w_EKN.requires_grad:
            site = slot.claim_site(w_EKN)
            if site is not None:
                # the parameter itself, not the saved copy: the store matches parameters by
                # identity, and a saved tensor comes back as another object under saved-tensor
                # hooks (non-reentrant checkpoint, save_on_cpu)
                ctx.defer = (slot, site, w_EKN)
        ctx.save_for_backward(x_RK, w_EKN)

    @staticmethod
    def backward(ctx, dy_RN):
        if ctx.defer is not None and torch.is_grad_enabled():
            # a schedule's deferred weight gradient is summed after the backward: first-order only
            return _deferred_first_order(ctx, dy_RN)
        return _row_invariant_backward(ctx, dy_RN)


def _row_invariant_backward(ctx, dy_RN):
    """The backward of :class:`_RowInvariantGroupedGemm`, in differentiable torch ops (under
    ``create_graph=True`` autograd records it: the fp64 reference is twice differentiable)."""
    x_RK, w_EKN = ctx.saved_tensors
    offs = ctx.offs
    E = w_EKN.shape[0]
    dx = dw = None
    if ctx.needs_input_grad[0]:
        if torch.is_grad_enabled():  # recorded: the same products through the Function itself
            dx = _RowInvariantGroupedGemm.apply(dy_RN, offs, w_EKN.transpose(1, 2), None)
        else:
            dx = torch.zeros_like(x_RK)
            for e in range(E):
                a, b = offs[e], offs[e + 1]
                if b > a:
                    dx[a:b] = rowwise_mm(dy_RN[a:b], w_EKN[e].t())
    if ctx.needs_input_grad[2]:
        if ctx.defer is not None:
            slot, site, w_param = ctx.defer
            slot.add(w_param, site, x_RK, dy_RN, offs, grouped_wgrad)
        else:
            dw = grouped_wgrad(x_RK, dy_RN, offs, E)
    return dx, None, dw, None


@first_order("a pipelined schedule's deferred weight gradient (fp64 reference)")
def _deferred_first_order(ctx, dy_RN):
    return _row_invariant_backward(ctx, dy_RN)


def row_invariant_grouped_gemm(
    x_RK: torch.Tensor, offs: list, w_EKN: torch.Tensor, wgrad: Optional[WeightGradSlot] = None
) -> torch.Tensor:
    """Rows [offs[e], offs[e+1]) of ``x`` times ``w[e]``, row-invariant (forward and input
    gradient), weight gradient deferred to ``wgrad``'s store when it holds ``w``."""
    return _RowInvariantGroupedGemm.apply(x_RK, offs, w_EKN, wgrad)
