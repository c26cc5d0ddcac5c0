"""SE-MoE's embedding partition in data parallelism (PAPERS.md 2.7; 002 section 4.3, Fig. 9).

The table ``[V, H]`` is split by rows over the N ranks of a data-parallel group, which still see
different data. Rank r holds the contiguous rows ``[r * S, min(V, (r + 1) * S))`` with
``S = ceil(V / N)`` (``torch.chunk``'s and DTensor ``Shard(0)``'s layout: the last shard is
ragged when ``V mod N != 0``, and with ``V < N * S`` trailing ranks may hold fewer or no rows).

Forward of :class:`PartitionedEmbedding` (per call, every rank of the group, in the same order):

0. a small all-to-all of split sizes: how many ids this rank sends to each owner, plus a flag
   for a bad id (out of range, or ids that are not integers) so that every rank raises the same
   ``IndexError`` / ``TypeError`` before any id moves;
1. all-to-all #1: the ids to the ranks that own their rows (``owner = id // S``);
2. a local lookup in the shard;
3. all-to-all #2: the rows back (the inverse exchange).

Backward: all-to-all #3 carries the output gradients to the owners (the reverse of #2), and the
local lookup's backward accumulates them into the shard (duplicates summed). No all-reduce
touches the table: each rank's shard gradient is those rows of the gradient that an all-reduce
(sum) of the replicated table's gradients would give, divided by ``grad_divisor`` (1 by
default; :func:`tritonmoe.parallel.data_parallel` sets it to the data-parallel size so it
matches the mean-of-losses convention of the other parameters).

``dedup=True`` sends each distinct id once (``torch.unique``) and expands the rows after
all-to-all #2; it changes no result (gradients of repeated ids are summed by autograd in the
expansion instead of in the lookup's backward, the same sum over the same values).

Checkpoints. ``state_dict()`` holds ``weight`` as a DTensor of the global ``[V, H]`` table
(``Shard(0)`` on the group's 1-D mesh, no copy), so ``torch.distributed.checkpoint`` saves each
row once and reshards across group sizes; ``load_state_dict`` accepts such a DTensor, a full
``[V, H]`` tensor, or this rank's shard. :func:`tritonmoe.parallel.full_state_dict` returns the
full table and :func:`tritonmoe.parallel.optimizer_state_dict` describes the optimizer's
per-row states the same way.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tritonmoe.comm.all_to_all import all_to_all
from tritonmoe.comm.errors import backend_errors
from tritonmoe.comm.splits import check_agreement, comm_device, group_rank_size

from .init import draw_seed, expert_seed

__all__ = ["PartitionedEmbedding", "shard_range"]

_BLOCK = 256  # rows per initialization generator (layout-independent init)
_OK, _OUT_OF_RANGE, _NOT_INT = 0, 1, 2


def shard_range(num_embeddings: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first row, end row) that rank ``rank`` of ``world_size`` holds (module docstring)."""
    per = -(-num_embeddings // world_size)
    return min(num_embeddings, rank * per), min(num_embeddings, (rank + 1) * per)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class _Announce(torch.autograd.Function):
    """Identity whose backward calls ``fn()``: marks where the backward reaches a point."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.fn()
        return g, None


class PartitionedEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows are partitioned over a data-parallel group (see the module
    docstring). Collective: construction (one agreement check) and every forward and backward.

    Args:
        num_embeddings: V; embedding_dim: H.
        group: the data-parallel process group (None = the default group).
        padding_idx: as ``nn.Embedding`` (its row starts at zero and gets no gradient).
        dtype, device: of the shard.
        dedup: send each distinct id once per forward.

    Attributes:
        weight: this rank's shard ``[rows, H]``; local_rows: int64 ``[rows]``, the global row ids
        it holds; row_start, row_end; grad_divisor.
    """

    partitioned_parameter_names = ("weight",)
    #: Buffers that differ per rank (data-parallel wrappers must not broadcast them).
    partitioned_buffer_names = ("local_rows",)

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, padding_idx: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device=None, *, dedup: bool = False, _init: bool = True) -> None:
        super().__init__()
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
                raise TypeError(f"padding_idx must be an int or None, got {type(padding_idx).__name__}")
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise IndexError(f"padding_idx={padding_idx} is outside [-{num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings
        rank, P = group_rank_size(group)
        base_seed = draw_seed() if _init else 0
        # Sizes fix every later collective's shape: a disagreement would abort gloo, so check once.
        check_agreement({"num_embeddings": num_embeddings, "embedding_dim": embedding_dim,
                         "padding_idx": -1 if padding_idx is None else padding_idx,
                         "dtype": zlib.crc32(str(dtype or torch.get_default_dtype()).encode()), "init_seed": base_seed},
                        group=group, what="the PartitionedEmbedding table")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.group, self.rank, self.world_size = group, rank, P
        self.rows_per_shard = -(-num_embeddings // P)
        self.row_start, self.row_end = shard_range(num_embeddings, P, rank)
        self.dedup = bool(dedup)
        self.grad_divisor = 1.0
        #: A :class:`~tritonmoe.comm.CommScheduler` (set by ``data_parallel``): under Lina's policy
        #: the backward's all-to-all #3 holds gradient micro-ops back, like the MoE layers' exchanges.
        self.comm_scheduler = None
        self.weight = nn.Parameter(torch.empty(self.row_end - self.row_start, embedding_dim, dtype=dtype, device=device))
        self.register_buffer("local_rows", torch.arange(self.row_start, self.row_end, device=device), persistent=False)
        if _init:
            self._init_rows(base_seed)
        self._register_state_dict_hook(_state_dict_hook)
        self._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)

    @torch.no_grad()
    def _init_rows(self, base_seed: int) -> None:
        """N(0, 1) like ``nn.Embedding``; row i's value depends on the seed and i alone (block
        b = i // 256 draws from its own generator), so any group size holds the same table."""
        w = self.weight
        for b in range(self.row_start // _BLOCK, -(-self.row_end // _BLOCK)):
            g = torch.Generator(device=w.device).manual_seed(expert_seed(base_seed, b))
            block = torch.randn(_BLOCK, self.embedding_dim, generator=g, dtype=w.dtype, device=w.device)
            lo, hi = max(self.row_start, b * _BLOCK), min(self.row_end, (b + 1) * _BLOCK)
            w[lo - self.row_start : hi - self.row_start] = block[lo - b * _BLOCK : hi - b * _BLOCK]
        if self.padding_idx is not None and self.row_start <= self.padding_idx < self.row_end:
            w[self.padding_idx - self.row_start].zero_()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, *, dedup: bool = False) -> "PartitionedEmbedding":
        """This rank's shard of a full ``nn.Embedding`` (every rank passes the same table)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"from_embedding takes an nn.Embedding, got {type(embedding).__name__}")
        if embedding.max_norm is not None or embedding.sparse or embedding.scale_grad_by_freq:
            raise ValueError("from_embedding supports plain nn.Embedding (no max_norm, sparse or scale_grad_by_freq)")
        V, H = embedding.weight.shape
        m = cls(V, H, group, embedding.padding_idx, embedding.weight.dtype, embedding.weight.device, dedup=dedup, _init=False)
        with torch.no_grad():
            m.weight.copy_(embedding.weight[m.row_start : m.row_end])
        return m

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.row_start}, {self.row_end}) of rank {self.rank}/"
                f"{self.world_size}" + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")
                + (", dedup" if self.dedup else ""))

    def _exchange_counts(self, counts: list[int], flag: int) -> list[int]:
        """The split-size all-to-all (with the bad-id flag): the receive splits; raises on
        every rank when any rank's flag is set."""
        P = self.world_size
        send = torch.tensor([[c, flag] for c in counts], dtype=torch.int64, device=comm_device(self.group))
        recv = torch.empty_like(send)
        with backend_errors("PartitionedEmbedding's split-size exchange", self.group):
            dist.all_to_all_single(recv, send, group=self.group)
        table = recv.tolist()  # host sync: the splits of all-to-all #1 must be Python ints
        flags = [row[1] for row in table]
        bad = [r for r in range(P) if flags[r] != _OK]
        if bad:
            mine = {_OUT_OF_RANGE: "ids outside the table", _NOT_INT: "ids that are not an integer tensor"}.get(flag, "")
            msg = (f"PartitionedEmbedding({self.num_embeddings}, {self.embedding_dim}): ranks {bad} passed bad ids "
                   f"(every id must be an integer in [0, {self.num_embeddings})); no id was exchanged")
            if any(flags[r] == _NOT_INT for r in bad):
                raise TypeError(msg + (f"; this rank: {mine}" if mine else ""))
            raise IndexError(msg + (f"; this rank: {mine}" if mine else ""))
        return [row[0] for row in table]

    def _route(self, ids: torch.Tensor):
        """(ids to send, owner-major; order or None; inverse or None; counts per owner; flag)."""
        P, V = self.world_size, self.num_embeddings
        flat = ids.reshape(-1)
        if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == torch.bool:
            return flat.new_zeros(0, dtype=torch.int64), None, None, [0] * P, _NOT_INT
        flat = flat.to(device=self.weight.device, dtype=torch.int64)
        if self.dedup:
            send_ids, inverse = torch.unique(flat, sorted=True, return_inverse=True)  # sorted: owner-major already
            order = None
        else:
            inverse = None
            order = torch.argsort(flat.clamp(0, V - 1) // self.rows_per_shard, stable=True)
            send_ids = flat[order]
        counts = torch.bincount(send_ids.clamp(0, V - 1) // self.rows_per_shard, minlength=P)
        bad = ((send_ids < 0) | (send_ids >= V)).any().to(torch.int64).view(1)
        # host sync (one, with the split sizes, which must be Python ints): counts and the verdict
        host = torch.cat([counts, bad]).tolist()
        return send_ids, order, inverse, host[:P], _OUT_OF_RANGE if host[P] else _OK

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the global table for ``ids`` (any shape, integer): ``ids.shape + (H,)``."""
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
        send_ids, order, inverse, send_splits, flag = self._route(ids)
        recv_splits = self._exchange_counts(send_splits, flag)
        recv_ids = all_to_all(send_ids, send_splits, recv_splits, group=self.group, check=False)  # all-to-all #1
        local_pad = None
        if self.padding_idx is not None and self.row_start <= self.padding_idx < self.row_end:
            local_pad = self.padding_idx - self.row_start
        rows = F.embedding(recv_ids - self.row_start, self.weight, padding_idx=local_pad)
        sched = self.comm_scheduler
        if sched is not None and rows.requires_grad:  # all-to-all #3 is over: gradient micro-ops may go
            rows = _Announce.apply(rows, sched.exchanges_done)
        back = all_to_all(rows, recv_splits, send_splits, group=self.group, check=False)  # all-to-all #2 (#3 backward)
        if sched is not None and back.requires_grad:  # Lina: hold gradient micro-ops before all-to-all #3
            back = _Announce.apply(back, sched.exchange_imminent)
        if self.grad_divisor != 1:
            back = _ScaleGrad.apply(back, 1.0 / self.grad_divisor)
        if inverse is not None:
            out = back[inverse]
        else:
            out = back.new_empty(back.shape).index_copy(0, order, back) if back.shape[0] else back
        return out.reshape(tuple(ids.shape) + (self.embedding_dim,))


# ---------------------------------------------------------------------------------------------
# Checkpoints: the shard as a DTensor of the global table
# ---------------------------------------------------------------------------------------------


def _mesh(module: PartitionedEmbedding):
    mesh = getattr(module, "_tm_mesh", None)
    if mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        group = module.group if module.group is not None else dist.distributed_c10d._get_default_group()
        mesh = DeviceMesh.from_group(group, module.weight.device.type)
        module._tm_mesh = mesh
    return mesh


def to_global(module: PartitionedEmbedding, value: torch.Tensor):
    """``value`` (a tensor shaped like this rank's shard) as a DTensor of the global table."""
    from torch.distributed.tensor import DTensor, Shard

    shape = (module.num_embeddings,) + tuple(value.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(value, _mesh(module), (Shard(0),), run_check=False, shape=shape, stride=stride)


def to_local(module: PartitionedEmbedding, value: Any, key: str):
    """``value`` for the shard (a DTensor of this layout, a full ``[V, ...]`` tensor) as this
    rank's rows; None when it already has the shard's shape (or a shape to report)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        mine = to_global(module, module.weight.detach())
        if value.device_mesh != mine.device_mesh or value.placements != mine.placements or value.shape[0] != module.num_embeddings:
            raise ValueError(
                f"{key} is a DTensor for another layout ({value.device_mesh}, {value.placements}); load it into this "
                "module's own state_dict() with torch.distributed.checkpoint.load (which reshards), or pass the full table"
            )
        return value.to_local()
    n = module.row_end - module.row_start
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == module.num_embeddings and n != module.num_embeddings:
        return value[module.row_start : module.row_end]
    return None


def _state_dict_hook(module, state_dict: dict, prefix: str, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict and module.world_size > 1:
        state_dict[key] = to_global(module, state_dict[key])


def _load_pre_hook(module, state_dict: dict, prefix: str, *args) -> None:
    key = prefix + "weight"
    if key in state_dict and module.world_size > 1:
        local = to_local(module, state_dict[key], key)
        if local is not None:
            state_dict[key] = local


def replicated_bytes(module: PartitionedEmbedding) -> int:
    """Bytes of the full table (what one replica would hold)."""
    return module.num_embeddings * module.embedding_dim * module.weight.element_size()

