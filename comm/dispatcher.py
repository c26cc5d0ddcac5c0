"""The expert-parallel token dispatcher: communication steps, kept apart from local work.

As in Megatron-Core's token dispatchers, the layer does the local work (route, permute,
expert compute, unpermute) and the dispatcher the communication, in explicit steps that a
scheduler can split, reorder or overlap::

    layer                         dispatcher
    -----                         ----------
    route, permute micro-batches
                                  exchange_counts(counts_NE) -> plan     one small all-to-all
                                  dispatch(x_perm_i, plan, i)            all-to-all of rows
    expert FFN                    (to_expert_major / to_source_major re-layout around it)
                                  combine(y_i, plan, i)                  reverse all-to-all
    unpermute

``dispatch`` and ``combine`` are the blocking, differentiable single steps; ``run_pipelined``
runs all micro-ops' dispatch / expert / combine overlapped (:mod:`tritonmoe.comm.programs.pipeline`).

Rank r of P owns the experts [r*L, (r+1)*L), L = E/P. A received buffer is source-major (source
rank, then local expert, then the source's permuted order); the expert FFN runs on the
expert-major layout (local expert, then source rank), one segment per local expert.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .all_to_all import AllToAllFunction
from .partition import transpose_chunks_unchecked
from tritonmoe.comm.programs.pipeline import ExpertFn, run_pipelined
from .splits import DispatchPlan, exchange_counts, group_rank_size
from .timeline import Timeline

__all__ = ["AllToAllDispatcher"]


def _stream_of(x: torch.Tensor):
    """The stream a timeline span of work on ``x`` is timed on (None: the wall clock)."""
    return torch.cuda.current_stream(x.device) if x.is_cuda else None


class AllToAllDispatcher:
    """Token exchange of one expert-parallel group.

    Args:
        num_experts: E, the global number of experts; divisible by the group size P.
        group: the expert-parallel process group (None = the default group).
        backend: backend of the re-layout copies (``copy_segments``): "auto", "triton", "torch"
            or None for the process default.

    Attributes: ``rank``, ``world_size`` (P), ``num_local_experts`` (L), ``local_expert_start``
    (r*L), ``timeline``: a :class:`~tritonmoe.comm.Timeline` to record into, or None, and
    ``scheduler``: a :class:`~tritonmoe.comm.CommScheduler` the pipelined exchanges are started
    through, or None.
    """

    def __init__(self, num_experts: int, group=None, *, backend: Optional[str] = None) -> None:
        rank, P = group_rank_size(group)
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % P != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel group size {P}; "
                "use a multiple of the group size"
            )
        self.group = group
        self.rank = rank
        self.world_size = P
        self.num_experts = num_experts
        self.num_local_experts = num_experts // P
        self.local_expert_start = rank * self.num_local_experts
        self.backend = backend
        self.timeline: Optional[Timeline] = None
        self.scheduler = None

    # -- communication steps ------------------------------------------------------------------

    def exchange_counts(self, counts_NE: torch.Tensor, *, row_dtype: Optional[torch.dtype] = None,
                        row_width: Optional[int] = None, status: Optional[BaseException] = None) -> DispatchPlan:
        """Step 1: exchange per-expert row counts ([N, E] for N micro-ops, or [E]); every split
        of the following exchanges derives from this one all-to-all (one host sync). With
        ``row_dtype``/``row_width`` (the rows the exchanges will move) every rank checks that
        all ranks agree; ``status``: this rank's input-validation error, which the exchange
        carries so that every rank raises it (see :func:`comm.splits.exchange_counts`)."""
        if isinstance(counts_NE, torch.Tensor) and counts_NE.dim() in (1, 2) and counts_NE.shape[-1] != self.num_experts:
            # refused on this rank only: it still takes the exchange (zero counts of the right
            # shape) carrying the refusal, so every rank raises it instead of waiting for this one
            refused = ValueError(f"counts have {counts_NE.shape[-1]} experts, the dispatcher {self.num_experts}")
            status = status if status is not None else refused
            shape = (self.num_experts,) if counts_NE.dim() == 1 else (counts_NE.shape[0], self.num_experts)
            counts_NE = torch.zeros(shape, dtype=torch.int64, device=counts_NE.device)
        return exchange_counts(counts_NE, group=self.group, row_dtype=row_dtype, row_width=row_width, status=status)

    def dispatch(self, x_perm: torch.Tensor, plan: DispatchPlan, i: int = 0) -> torch.Tensor:
        """Step 2: send micro-op i's permuted rows to the experts' ranks; returns the received
        rows (source-major). Blocking, differentiable (backward: the reverse all-to-all)."""
        return self._exchange(x_perm, plan.send_splits[i], plan.recv_splits[i], "dispatch", i)

    def combine(self, y: torch.Tensor, plan: DispatchPlan, i: int = 0) -> torch.Tensor:
        """Step 3: return the expert outputs of micro-op i (source-major, as received) to their
        source ranks; returns rows in the order of the dispatched ``x_perm``."""
        return self._exchange(y, plan.recv_splits[i], plan.send_splits[i], "combine", i)

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int], kind: str, i: int) -> torch.Tensor:
        if x.shape[0] != sum(send):
            raise ValueError(f"{kind}: the buffer has {x.shape[0]} rows but the plan sends {sum(send)}")
        stream = _stream_of(x)
        rec = self.timeline.start(kind, i, "fwd", stream=stream) if self.timeline is not None else None
        out = AllToAllFunction.apply(x, send, recv, self.group)
        if rec is not None:
            self.timeline.stop(rec, stream=stream)
        return out

    # -- local re-layout around the expert compute --------------------------------------------

    def to_expert_major(self, recv: torch.Tensor, plan: DispatchPlan, i: int = 0, *, span: bool = True) -> torch.Tensor:
        """Received rows (source, local expert) -> (local expert, source): one segment copy.
        ``span=False``: no timeline span of its own (it runs inside the caller's, e.g. the
        expert op's in forward and backward)."""
        return self._relayout(recv, plan.recv_counts[i], i, span)

    def to_source_major(self, y: torch.Tensor, plan: DispatchPlan, i: int = 0, *, span: bool = True) -> torch.Tensor:
        """Expert-major rows back to the received (source, local expert) order for the combine."""
        return self._relayout(y, plan.recv_counts[i].t(), i, span)

    def _relayout(self, x: torch.Tensor, counts_AB: torch.Tensor, i: int, span: bool = True) -> torch.Tensor:
        if not span:
            return transpose_chunks_unchecked(x, counts_AB, self.backend)
        stream = _stream_of(x)
        rec = self.timeline.start("partition", i, "fwd", stream=stream) if self.timeline is not None else None
        out = transpose_chunks_unchecked(x, counts_AB, self.backend)
        if rec is not None:
            self.timeline.stop(rec, stream=stream)
        return out

    def expert_offsets(self, plan: DispatchPlan, i: int = 0) -> torch.Tensor:
        """int64 [L+1] segment starts of the local experts in micro-op i's expert-major buffer."""
        counts_L = plan.recv_counts[i].sum(0)
        offsets = counts_L.new_zeros(self.num_local_experts + 1)
        offsets[1:] = torch.cumsum(counts_L, 0)
        return offsets

    # -- all micro-ops, pipelined -------------------------------------------------------------

    def run_pipelined(
        self,
        sends: Sequence[torch.Tensor],
        plan: DispatchPlan,
        expert_fn: ExpertFn,
        params: Sequence[torch.Tensor] = (),
        *,
        trace: Optional[list] = None,
    ) -> list[torch.Tensor]:
        """Dispatch, ``expert_fn`` and combine of every micro-op, overlapped (forward and
        backward); see :func:`tritonmoe.comm.run_pipelined`."""
        return run_pipelined(
            sends, plan, expert_fn, params, group=self.group, timeline=self.timeline, trace=trace, scheduler=self.scheduler
        )
