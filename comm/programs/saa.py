"""SAA: an all-to-all over one group simultaneously with an all-gather of its result over another
(Parm, paper 003 section III-D; PAPERS.md 3.3).

``saa(x)`` returns ``all_gather(all_to_all(x), group=mp_group)``: every rank of an MP group ends
with the all-to-all outputs of all its MP peers, concatenated in MP-rank order. Instead of running
the two collectives back to back (the inter-node all-to-all, then the intra-node all-gather), SAA
cuts the all-to-all into P pairwise-exchange phases (phase t: send to rank+t, receive from
rank-t, one communication lane) and all-gathers each received chunk over the MP group on a second
lane while the next phase runs::

    phase 0: own chunk (local)
    for t in 1..P-1:
        lane A (group):    send x[to rank+t], receive chunk_t from rank-t
        lane B (mp group): send chunk_{t-1} to every MP peer, receive theirs
    lane B: all-gather chunk_{P-1}
    assemble: per MP peer, its chunks in source-rank order

The lanes are two process groups (torch.distributed point-to-point ops: ``batch_isend_irecv``),
so on NCCL they are two streams and on gloo two sets of worker threads: the two transfers really
run at the same time. :func:`saa_schedule` is that schedule as executor code (the simulator runs it
too); :func:`saa` is the differentiable collective for callers.

Splits may be uneven (zero included): each rank passes its own all-to-all splits, and the
receive sizes of its MP peers' chunks come from one small exchange (or from the caller, in
:func:`saa_schedule`, when a counts exchange already gave them).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from tritonmoe.core.autograd import first_order
from tritonmoe.comm.compat import all_gather_single
from tritonmoe.comm.errors import backend_errors
from tritonmoe.comm.executor import COMM, COMM2, Executor, Handle, RealExecutor, VirtualTensor, Work
from tritonmoe.comm.splits import as_int_list, check_splits, comm_device, exchange_splits, group_rank_size
from tritonmoe.comm.all_to_all import all_to_all_raw

__all__ = ["saa", "saa_schedule", "rows_of", "empty_rows"]

_NO_WORK = Work(launches=0)


def rows_of(v: Any, a: int, b: int) -> Any:
    """Rows [a, b) of a tensor, or a VirtualTensor of b - a rows (the simulator's)."""
    if isinstance(v, VirtualTensor):
        return v.with_rows(b - a)
    return v[a:b]


def empty_rows(v: Any, n: int) -> Any:
    """A buffer of n rows shaped like ``v``'s rows (a VirtualTensor for the simulator)."""
    if isinstance(v, VirtualTensor):
        return v.with_rows(n)
    return v.new_empty((n,) + tuple(v.shape[1:]))


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def saa_schedule(
    ex: Executor,
    x: Any,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    *,
    group: Any,
    rank: int,
    mp_group: Any,
    mp_peers: Sequence[int],
    peer_recv_splits: Sequence[Sequence[int]],
    kind: str = "combine",
    gather_kind: str = "mp_allgather",
) -> Handle:
    """SAA as executor code; returns a handle of the gathered buffer.

    Args:
        x: the all-to-all input (a tensor, VirtualTensor or a handle of one), rows for rank j
            being ``send_splits[j]`` consecutive rows.
        send_splits, recv_splits: this rank's all-to-all splits over ``group`` (P ranks).
        group: the all-to-all's group (lane ``comm``); ``rank``: this rank in it.
        mp_group: the all-gather's group (lane ``comm2``; another process group than ``group``).
        mp_peers: the all-to-all ranks of the MP group's members, in MP-rank order (this rank
            included).
        peer_recv_splits: per MP member (MP-rank order), its ``recv_splits``.

    Returns: a handle of ``[sum over members and sources of peer_recv_splits, ...]`` rows: member
    q's all-to-all output (its chunks in source order), for q in MP-rank order.
    """
    P = len(send_splits)
    src = x.value if isinstance(x, Handle) else x
    x_dep = (x,) if isinstance(x, Handle) else ()
    me_mp = list(mp_peers).index(rank)
    n_mp = len(mp_peers)
    send_off = _offsets(send_splits)
    # chunks[q][t]: member q's chunk of phase t (received from (peer_q - t) % P); values or handles
    chunks: list[list[Any]] = [[None] * P for _ in range(n_mp)]
    own = rows_of(src, send_off[rank], send_off[rank] + send_splits[rank])
    chunks[me_mp][0] = own
    prev_a: Optional[Handle] = None
    prev_b: Optional[Handle] = None
    issued: list[Handle] = []  # every point-to-point batch: the result waits for all (sends too)

    def gather_step(t: int, chunk: Any, chunk_deps: tuple) -> None:
        nonlocal prev_b
        sends, recvs, who = [], [], []
        n_own = recv_splits[(rank - t) % P]
        for q, peer in enumerate(mp_peers):
            if q == me_mp:
                continue
            if n_own:
                sends.append((chunk, q))
            n = peer_recv_splits[q][(peer - t) % P]
            if n:
                recvs.append((empty_rows(src, n), q))
                who.append(q)
        if not sends and not recvs:
            return
        after = chunk_deps + ((prev_b,) if prev_b is not None else ())
        h = ex.send_recv(sends, recvs, group=mp_group, kind=gather_kind, micro_op=t, lane=COMM2, after=after)
        prev_b = h
        issued.append(h)
        for j, q in enumerate(who):
            chunks[q][t] = (h, j)

    for t in range(1, P + 1):
        if t < P:  # lane A: phase t of the pairwise exchange
            dst, frm = (rank + t) % P, (rank - t) % P
            sends = [(rows_of(src, send_off[dst], send_off[dst] + send_splits[dst]), dst)] if send_splits[dst] else []
            recvs = [(empty_rows(src, recv_splits[frm]), frm)] if recv_splits[frm] else []
            if sends or recvs:
                after = x_dep + ((prev_a,) if prev_a is not None else ())
                h = ex.send_recv(sends, recvs, group=group, kind=kind, micro_op=t, lane=COMM, after=after)
                prev_a = h
                issued.append(h)
                if recvs:
                    chunks[me_mp][t] = (h, 0)
        # lane B: all-gather the chunk of phase t - 1 over the MP group while phase t runs
        if n_mp > 1:
            c = chunks[me_mp][t - 1]
            if isinstance(c, tuple):
                h, j = c
                chunk = ex.compute(
                    lambda v, j=j: v[j], h, work=_NO_WORK, kind="saa_chunk", micro_op=t - 1, lane=COMM2,
                    out=empty_rows(src, recv_splits[(rank - t + 1) % P]),
                )
                gather_step(t - 1, chunk, ())
            else:
                gather_step(t - 1, c if c is not None else empty_rows(src, 0), x_dep)

    return _assemble(ex, chunks, src, mp_peers, peer_recv_splits, after=x_dep + tuple(issued))


def _assemble(ex: Executor, chunks: list[list[Any]], src: Any, mp_peers: Sequence[int],
              peer_recv_splits: Sequence[Sequence[int]], *, after: tuple) -> Handle:
    """SAA's output from its chunks (``chunks[q][t]``: MP member q's chunk of phase t, a value,
    a ``(handle, index)`` of a point-to-point batch's output, or None): one copy (kind
    ``saa_assemble``) concatenating member q's all-to-all output (its chunks in source order),
    for q in MP-rank order, after ``after``."""
    P = len(chunks[0])
    order = []  # (q, t) in the output order: member q, then source rank 0..P-1
    for q, peer in enumerate(mp_peers):
        for s in range(P):
            order.append((q, (peer - s) % P))
    parts = [chunks[q][t] for q, t in order]
    handles = []
    index = []
    for p in parts:
        if isinstance(p, tuple):
            handles.append(p[0])
            index.append(("h", len(handles) - 1, p[1]))
        else:
            index.append(("v", p))
    total = sum(peer_recv_splits[q][s] for q in range(len(mp_peers)) for s in range(P))

    def assemble(*vals):
        pieces = []
        for item in index:
            if item[0] == "h":
                pieces.append(vals[item[1]][item[2]])
            elif item[1] is not None and item[1].shape[0]:
                pieces.append(item[1])
        if not pieces:
            return src.new_empty((0,) + tuple(src.shape[1:]))
        return torch.cat(pieces, dim=0)

    row_bytes = src.row_bytes() if isinstance(src, VirtualTensor) else src.element_size() * math.prod(src.shape[1:])
    return ex.compute(
        assemble, *handles, work=Work(bytes=2.0 * total * row_bytes, kind="copy"), kind="saa_assemble",
        out=empty_rows(src, total), after=after,
    )


# ---------------------------------------------------------------------------------------------
# The differentiable collective
# ---------------------------------------------------------------------------------------------


class _SAA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, rank, mp_group, mp_peers, peer_recv, replicated_grad):
        ex = RealExecutor(x.device)
        h = saa_schedule(
            ex, x.contiguous(), send, recv, group=group, rank=rank, mp_group=mp_group, mp_peers=mp_peers,
            peer_recv_splits=peer_recv,
        )
        out = ex.wait(h)
        ctx.args = (send, recv, group, rank, mp_group, mp_peers, peer_recv, replicated_grad)
        return out

    @staticmethod
    @first_order("the SAA (shortcut-connected) schedule")
    def backward(ctx, grad):
        send, recv, group, rank, mp_group, mp_peers, peer_recv, replicated_grad = ctx.args

        me = list(mp_peers).index(rank)
        sizes = [sum(r) for r in peer_recv]
        starts = _offsets(sizes)
        grad = grad.contiguous()
        if replicated_grad or len(mp_peers) == 1:
            mine = grad[starts[me] : starts[me] + sizes[me]]
        else:
            # The all-gather's adjoint: every member's gradient of my part, summed in MP-rank order.
            n_mp = len(mp_peers)
            parts, _ = all_to_all_raw(grad, sizes, [sizes[me]] * n_mp, mp_group)
            pieces = parts.view(n_mp, sizes[me], *grad.shape[1:]) if sizes[me] else None
            mine = grad.new_zeros((sizes[me],) + tuple(grad.shape[1:]))
            if pieces is not None:
                for q in range(n_mp):
                    mine = mine + pieces[q]
        gx, _ = all_to_all_raw(mine, recv, send, group)
        return gx, None, None, None, None, None, None, None, None


def saa(
    x: torch.Tensor,
    input_split_sizes: Optional[Sequence[int]] = None,
    output_split_sizes: Optional[Sequence[int]] = None,
    *,
    group=None,
    mp_group=None,
    replicated_grad: bool = False,
    check: bool = True,
) -> torch.Tensor:
    """``all_gather(all_to_all(x, input_split_sizes, output_split_sizes, group), group=mp_group)``
    with the two overlapped (see the module docstring). Differentiable.

    Args:
        x: [N, ...] rows; ``input_split_sizes[j]`` consecutive rows go to rank j of ``group``.
        input_split_sizes, output_split_sizes: as in :func:`tritonmoe.comm.all_to_all` (None:
            equal splits / derived by one small exchange); uneven and zero splits are fine.
        group: the all-to-all's process group (None: the default group).
        mp_group: the all-gather's process group: a subset of ``group``'s ranks and another
            process group object than ``group`` (so the lanes are independent).
        replicated_grad: the backward of the all-gather. False (default): its adjoint, the sum
            over MP ranks of the gradients of this rank's part (a reduce-scatter). True: this
            rank's part of its own gradient (a split), correct when the computation downstream
            is replicated over the MP group, as in a tensor-parallel region (Parm's S2).
        check: compare caller-supplied splits across ``group`` first (as ``all_to_all``).

    Returns: ``[sum over MP ranks q of their received rows, ...]``: MP rank q's all-to-all output
    for q in MP-rank order. Collective over both groups; one small exchange of the peers'
    receive splits over ``mp_group`` (a host sync).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (the rows to exchange)")
    rank, P = group_rank_size(group)
    if mp_group is None:
        raise ValueError("saa needs mp_group, the process group of the all-gather")
    if mp_group is group:
        raise ValueError(
            "saa needs two process groups: pass an mp_group object other than group (create one with "
            "torch.distributed.new_group even when the members are the same), so the two lanes are independent"
        )
    if input_split_sizes is None:
        input_split_sizes = [x.shape[0] // P] * P if x.shape[0] % P == 0 else [-1] * P
    if output_split_sizes is None:
        output_split_sizes = exchange_splits(input_split_sizes, group=group, input_rows=x.shape[0])
    elif check:
        check_splits(input_split_sizes, output_split_sizes, group=group, input_rows=x.shape[0])
    send, recv = as_int_list(input_split_sizes), as_int_list(output_split_sizes)
    if send is None or recv is None:
        raise TypeError("input_split_sizes and output_split_sizes must be sequences of ints")
    _, n_mp = group_rank_size(mp_group)
    group_ranks = set(dist.get_process_group_ranks(group)) if group is not None else set(range(dist.get_world_size()))
    if not set(dist.get_process_group_ranks(mp_group)) <= group_ranks:
        raise ValueError("mp_group must be a subset of group's ranks (the all-gather forwards all-to-all chunks)")
    # The MP members' ranks in `group` and their receive splits: one small all-gather.
    mine = torch.tensor([rank] + recv, dtype=torch.int64, device=comm_device(mp_group))
    table = torch.empty(n_mp * (P + 1), dtype=torch.int64, device=mine.device)
    with backend_errors("SAA's exchange of the MP members' receive splits", mp_group):
        all_gather_single(table, mine, group=mp_group)
    rows = table.view(n_mp, P + 1).tolist()  # host sync: peer chunk sizes are host ints
    peers = [r[0] for r in rows]
    peer_recv = [r[1:] for r in rows]
    return _SAA.apply(x, send, recv, group, rank, mp_group, peers, peer_recv, replicated_grad)
