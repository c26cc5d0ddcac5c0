"""Expert parallelism with a static per-expert capacity: :class:`StaticExpertParallelExperts`."""

from __future__ import annotations

from typing import Any

import torch

from tritonmoe import reference
from tritonmoe.comm import check_agreement
from tritonmoe.comm.all_to_all import AllToAllFunction
from tritonmoe.comm.compat import all_gather_single
from tritonmoe.comm.errors import ScheduleError, backend_errors, input_status, new_group, raise_rank_input_error
from tritonmoe.comm.splits import comm_device, group_rank_size
from tritonmoe.config import MoEConfig
from tritonmoe.core.settings import validation_enabled
from tritonmoe.core.types import Routing

from .base import DTYPE_CODES, ExpertPath, ExpertWeights, dtype_code


class StaticExpertParallelExperts(ExpertPath):
    """Expert parallelism with static shapes (``config.ep_capacity`` = C; Megatron's
    pad-to-capacity): rank r of P owns the experts [r*E/P, (r+1)*E/P) as in
    :class:`ExpertParallelExperts`, but every rank sends exactly C rows to every expert (its
    first C kept slots, then zero rows). The exchanges are equal-split all-to-alls of E*C rows
    whose sizes are known on the host (the dispatch adds one status row per peer), so there is
    no counts exchange and no host synchronization in the forward or the backward with
    validation off (with it on, one: the read of the P refused-input status words at the end of
    the forward, skipped during a CUDA-graph capture; see below), capturable in a CUDA graph;
    the experts run as one batched GEMM pair over [E/P, P*C] rows. The price is the padding:
    E*C rows per rank per exchange whatever the routing.

    Semantics: routing keeps at most C slots per expert on each rank (``config.capacity`` is C;
    later slots are dropped, weight 0), so the layer equals a single-process layer with the same
    config applied to each rank's batch; padding rows never reach an output.

    Construction is collective (one small all-to-all checks that the ranks agree on the config).

    Dtype of the rows: the ranks agree on it at construction, and the equal-split exchanges move
    rows of that dtype with no counts exchange to compare it in. A rank whose rows have another
    dtype at a forward (it cast its layer and input after construction) first re-agrees on a
    control group of the same ranks (one small all-gather and a host sync, only on that forward):
    when every rank cast the same way they all re-agree and go on; otherwise every rank ends in a
    typed error before any row of the wrong size moves, the ranks that changed in a ``TypeError``
    naming every rank's dtype, the others in :class:`~tritonmoe.comm.ScheduleError` (their
    exchange's peer never joined) within the group's timeout. The forward whose dtype is the
    agreed one costs nothing more (a host-side dtype comparison).

    A rank that refused its input (docs/rank-input.md) runs the step on an empty stand-in batch
    (every slot of its send buffer empty), so its peers' exchanges complete and their outputs are
    exactly those of their own tokens, and carries its status word in the dispatch: each
    destination's block of the first exchange has one more row, whose first element is the
    sender's :func:`~tritonmoe.comm.errors.input_status` (0 on a healthy rank; written on the
    device from a host int, no sync). With validation on (:func:`tritonmoe.validation`) and
    outside a CUDA-graph capture, every rank reads the P words it received at the end of the
    forward (one host read of P values) and, when any is set, every rank raises the same
    :class:`~tritonmoe.comm.errors.RankInputError` (the failing ranks' messages gathered on the
    control group). With validation off the forward has no host sync: the peers return their
    (right) outputs and only the failing rank raises, its own error.
    """

    #: a refused input on this rank runs the step on an empty batch (see the class docstring)
    reports_input_errors = True

    def __init__(self, config: MoEConfig, group: Any, dtype: torch.dtype) -> None:
        super().__init__(config)

        rank, P = group_rank_size(group)
        E = config.num_experts
        check_agreement(
            {**config.agreement_values(), "dtype": dtype_code(dtype)},
            group=group, what="the static expert-parallel MoEConfig",
            labels={**config.agreement_labels(), "dtype": str(dtype)},
        )
        if E % P:
            raise ValueError(f"num_experts={E} is not divisible by the expert-parallel group size {P}")
        self.group, self.rank, self.world_size = group, rank, P
        self.num_local_experts = E // P
        self.expert_start = rank * self.num_local_experts
        #: the dtype of the exchanged rows every rank of the group agreed on
        self.wire_dtype = dtype
        self._control = _control_group(group)

    def _check_wire_dtype(self, dtype: torch.dtype) -> None:
        """Re-agree on the rows' dtype when this rank's changed (see the class docstring)."""
        if dtype == self.wire_dtype:
            return

        P = self.world_size
        code = dtype_code(dtype)
        mine = torch.tensor([code], dtype=torch.int64, device=comm_device(self._control))
        table = torch.empty(P, dtype=torch.int64, device=mine.device)
        try:
            with backend_errors("the static expert-parallel dtype re-agreement", self._control):
                all_gather_single(table, mine, group=self._control)
        except ScheduleError as e:
            raise TypeError(
                f"rank {self.rank}'s expert-parallel rows are {dtype} but the group agreed on {self.wire_dtype}, and the "
                "other ranks did not re-agree (their rows kept the agreed dtype, or they failed): cast every rank's "
                f"layer and input the same way ({type(e).__name__}: {str(e)[:200]})"
            ) from e
        codes = table.tolist()  # host sync: only on a forward whose dtype changed
        if len(set(codes)) > 1:
            names = ", ".join(
                f"rank {r}: {str(DTYPE_CODES[c]).replace('torch.', '') if c >= 0 else 'unsupported'}"
                for r, c in enumerate(codes)
            )
            raise TypeError(
                f"the ranks of the static expert-parallel group would exchange rows of different dtypes ({names}); "
                "cast every rank's layer and input the same way"
            )
        if code < 0:
            raise TypeError(f"static expert parallelism exchanges rows of {DTYPE_CODES}, got {dtype}")
        self.wire_dtype = dtype

    def _check_words(self, words: torch.Tensor) -> None:
        """Raise the same RankInputError on every rank when a rank's status word (received in the
        dispatch) is set: with validation on and outside a CUDA-graph capture only (a host read of
        the P words). A rank that refused its input and does not check returns; the layer then
        raises its own error."""
        capturing = words.is_cuda and torch.cuda.is_current_stream_capturing()
        if not validation_enabled() or capturing:
            return
        # host sync (validation on only): the P status words, read at the end of the forward
        if not bool(words.any()) and self.input_error is None:
            return
        raise_rank_input_error([int(w) for w in words.tolist()], self.input_error, self._control,
                               "the static expert-parallel dispatch (its status rows)")

    def send_rows(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dest [T*k], valid [T*k])``: the row of the [E*C] send buffer each slot goes to
        (expert e's block [e*C, (e+1)*C), its kept slots in slot order) and whether it is sent;
        slots not sent point at row E*C. Device ops only (a stable sort, a scatter-add, a cumsum):
        no host sync."""
        E, C = self.config.num_experts, self.config.ep_capacity
        ids = routing.topk_ids.reshape(-1).long()
        S = ids.shape[0]
        valid = (ids >= 0) & (ids < E)
        key = torch.where(valid, ids, torch.full_like(ids, E))
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(key)
        pos[order] = torch.arange(S, device=ids.device) - starts[key[order]]
        valid = valid & (pos < C)  # routing kept at most C per expert; a longer list is cut, never overflows
        dest = torch.where(valid, key * C + pos, torch.full_like(key, E * C))
        return dest, valid

    def __call__(self, x_TD: torch.Tensor, routing: Routing, weights: ExpertWeights) -> torch.Tensor:

        c = self.config
        self.path_used = "expert_parallel_static"
        E, C, P, L = c.num_experts, c.ep_capacity, self.world_size, self.num_local_experts
        T, d = x_TD.shape
        self._check_wire_dtype(x_TD.dtype)  # before any row moves; free unless the dtype changed
        k = routing.topk_ids.shape[1]
        dest, valid = self.send_rows(routing)
        x_slots = x_TD.unsqueeze(1).expand(T, k, d).reshape(T * k, d)
        # The send buffer: per destination, its L*C rows then one status row (element 0: this
        # rank's status word); the last row takes the unsent slots. dest (the combine's layout,
        # L*C rows per peer) shifts by one row per block before it.
        B = L * C + 1
        base = x_TD.new_zeros(P * B + 1, d)
        status = input_status(self.input_error)
        if status:  # a host int written on the device: no sync (a healthy rank's words are the zeros)
            base[L * C: P * B: B, 0] = status
        send = base.index_add(0, dest + torch.div(dest, L * C, rounding_mode="floor"), x_slots)[: P * B]
        splits = [B] * P
        recv = AllToAllFunction.apply(send, splits, splits, self.group).view(P, B, d)  # [P (source), L*C + 1, d]
        words = recv[:, L * C, 0].detach()  # each source's status word
        recv = recv[:, : L * C]
        x_LRD = recv.reshape(P, L, C, d).transpose(0, 1).reshape(L, P * C, d)
        h = torch.bmm(x_LRD, weights.w1)
        if weights.b1 is not None:
            h = h + weights.b1.unsqueeze(1)
        a = reference._activation(h, c.activation, c.swiglu_limit, c.swiglu_alpha, scalar=False)
        y = torch.bmm(a, weights.w2)
        if weights.b2 is not None:
            y = y + weights.b2.unsqueeze(1)
        y = y.view(L, P, C, d).transpose(0, 1).reshape(P * L * C, d)
        splits = [L * C] * P
        back = AllToAllFunction.apply(y, splits, splits, self.group)  # [E*C, d]: this rank's rows, back
        self._check_words(words)
        acc = torch.float64 if x_TD.dtype == torch.float64 else torch.float32
        back = torch.cat([back, back.new_zeros(1, d)], dim=0)
        w = torch.where(valid.view(T, k), routing.topk_weights.to(acc), torch.zeros((), dtype=acc, device=x_TD.device))
        return (back[dest].view(T, k, d).to(acc) * w.unsqueeze(-1)).sum(1).to(x_TD.dtype)


#: control groups of expert-parallel groups: id(group) -> (group, control group); one per group,
#: however many layers use it (the group is kept to tell a recycled id from the same group)
_CONTROL_GROUPS: dict[int, tuple[Any, Any]] = {}


def _control_group(group: Any) -> Any:
    """A second process group with ``group``'s ranks and timeout, for agreements that must not
    be matched against ``group``'s data exchanges (created once per group; collective over its
    ranks only)."""
    import torch.distributed as dist


    hit = _CONTROL_GROUPS.get(id(group))
    if hit is None or hit[0] is not group:
        control = new_group(dist.get_process_group_ranks(group), parent=group, use_local_synchronization=True)
        hit = _CONTROL_GROUPS[id(group)] = (group, control)
    return hit[1]


