"""Deferred weight gradients of grouped GEMMs (the "W" step of zero-bubble pipelines).

A pipelined expert-parallel backward runs one expert backward per micro-op. Summing per-micro-op
weight gradients ``sum_i X_i^T dY_i`` is a different reduction order than the single
``X^T dY`` of an unpipelined backward, so the results differ in the last bits. Instead, a GEMM
whose forward ran while a :class:`WeightGradStore` was recording (see :meth:`recording`), and
whose weight is one of the store's parameters, does not compute its weight gradient in
backward: it hands its rows (``x``, ``dy``, expert offsets) to the store and returns no weight
gradient (the input-gradient "B" step). After the last micro-op, :meth:`WeightGradStore.flush`
concatenates each expert's rows of all micro-ops in the order of the unpipelined buffer and runs
the GEMM's own weight-gradient op once (the "W" step), so the gradients are those of one
backward over the whole batch, bit for bit.

Row order: micro-op i's rows of expert e are grouped (by source rank in expert parallelism)
with counts ``group_counts[i][:, e]``, and micro-ops are contiguous token ranges, so the
unpipelined order of expert e is: group g, then micro-op i, then the rows' own order.

Which GEMMs defer: :func:`tritonmoe.reference.grouped_gemm`'s fp64 path. Others compute their
weight gradients in backward as usual (a pipeline then sums them over micro-ops).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional, Sequence

import torch

__all__ = ["WeightGradStore", "active_store"]

_ACTIVE: contextvars.ContextVar[Optional[tuple["WeightGradStore", int]]] = contextvars.ContextVar(
    "tritonmoe_wgrad_store", default=None
)

#: ``wgrad(x_RK, dy_RN, offsets_list, num_experts) -> [E, K, N]``: a GEMM's weight-gradient op.
WgradFn = Callable[[torch.Tensor, torch.Tensor, list, int], torch.Tensor]


def active_store(w: torch.Tensor) -> Optional[tuple["WeightGradStore", int]]:
    """(store, micro-op) that a GEMM on weight ``w`` run now should defer to, or None."""
    cur = _ACTIVE.get()
    if cur is None or not any(w is p for p in cur[0].params):
        return None
    return cur


class WeightGradStore:
    """Weight-gradient pieces of the deferring GEMMs of N micro-ops, keyed by parameter.

    Args:
        params: the weights whose gradients are deferred (identity, not value, is matched).
        num_micro_ops: N.
    """

    def __init__(self, params: Sequence[torch.Tensor], num_micro_ops: int) -> None:
        self.params = list(params)
        self.num_micro_ops = num_micro_ops
        # per parameter: per call site (the k-th deferring GEMM on it in a micro-op): per micro-op
        self._pieces: dict[int, list[list[Optional[tuple]]]] = {}
        self._calls: dict[tuple[int, int], int] = {}

    def claim_site(self, micro_op: int, w: torch.Tensor) -> int:
        """Forward: the call-site index of a new deferring GEMM on ``w`` in ``micro_op``
        (the k-th such GEMM of the micro-op), which pairs it with the same GEMM of other micro-ops."""
        j = next(k for k, p in enumerate(self.params) if p is w)
        site = self._calls.get((micro_op, j), 0)
        self._calls[(micro_op, j)] = site + 1
        return site

    @contextlib.contextmanager
    def recording(self, micro_op: int) -> Iterator[None]:
        """GEMMs run (forward) inside this block defer their weight gradients to this store."""
        token = _ACTIVE.set((self, micro_op))
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def add(self, micro_op: int, w: torch.Tensor, site: int, x: torch.Tensor, dy: torch.Tensor,
            offsets: list, wgrad: WgradFn) -> None:
        """Record micro-op ``micro_op``'s rows of the ``site``-th deferring GEMM on ``w``."""
        j = next(k for k, p in enumerate(self.params) if p is w)
        sites = self._pieces.setdefault(j, [])
        while len(sites) <= site:
            sites.append([None] * self.num_micro_ops)
        sites[site][micro_op] = (x, dy, offsets, wgrad)

    def flush(self, group_counts: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """The W step: per parameter, its deferred weight gradient (None when nothing deferred).

        ``group_counts[i]`` is an int [G, E] tensor: micro-op i's rows of expert e come as G
        consecutive groups of ``group_counts[i][g, e]`` rows. Frees the recorded rows."""
        out: list[Optional[torch.Tensor]] = [None] * len(self.params)
        counts = [c.tolist() for c in group_counts]  # host sync: row ranges per (group, expert)
        for j, sites in sorted(self._pieces.items()):
            for per_op in sites:
                g = self._site_grad(per_op, counts, self.params[j].shape[0])
                if g is not None:
                    out[j] = g if out[j] is None else out[j] + g
        self._pieces = {}
        self._calls = {}
        return out

    def _site_grad(self, per_op, counts, E: int) -> Optional[torch.Tensor]:
        ops = [i for i, piece in enumerate(per_op) if piece is not None]
        if not ops:
            return None
        wgrad = per_op[ops[0]][3]
        # Start row of each (micro-op, group, expert) block in the concatenated micro-op buffers.
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
                        f"micro-op {i}: expert {e} has {offs[e + 1] - offs[e]} rows but its groups count "
                        f"{r - base - offs[e]}; the GEMM's rows must be the expert-major received rows"
                    )
            base += x.shape[0]
        G = len(counts[ops[0]])
        index, new_offs = [], [0]
        for e in range(E):
            for g in range(G):
                for i in ops:
                    n = counts[i][g][e]
                    index.extend(range(starts[(i, g, e)], starts[(i, g, e)] + n))
            new_offs.append(len(index))
        idx = torch.tensor(index, dtype=torch.int64, device=per_op[ops[0]][0].device)
        x_all = torch.cat([per_op[i][0] for i in ops]).index_select(0, idx)
        dy_all = torch.cat([per_op[i][1] for i in ops]).index_select(0, idx)
        return wgrad(x_all, dy_all, new_offs, E)
