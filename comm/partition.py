"""Partition/concat of all-to-all buffers: the public, validating entry points.

A received all-to-all buffer is grouped by source rank, then local expert ("source-major":
chunk (s, e) holds ``counts_PL[s, e]`` rows); the grouped expert FFN wants it grouped by expert,
then source ("expert-major"). :func:`transpose_chunks` moves between the two layouts with one
segment copy (:func:`copy_segments`, a Triton kernel on CUDA, the reference on CPU), as
Megatron-Core's all-to-all dispatcher does with its ``sort_chunks_by_idxs`` after the exchange.
Rows keep their order inside a chunk, so the expert-major buffer of one expert lists its rows
source by source, in each source's permuted order.
"""

from __future__ import annotations

import torch

from tritonmoe.core import validation as V
from tritonmoe.core.settings import validation_enabled
from tritonmoe.backends import implementation

__all__ = ["copy_segments", "transpose_chunks", "chunk_transpose_segments"]


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def chunk_transpose_segments(counts_AB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src_starts, dst_starts, lengths), int64 [A*B], of the segment copy that turns chunks
    stored in (a, b) order into (b, a) order. No host sync."""
    c_AB = counts_AB.to(torch.int64)
    A, B = c_AB.shape
    lengths = c_AB.reshape(-1)
    src_starts = _exclusive_cumsum(lengths)
    dst_starts = _exclusive_cumsum(c_AB.t().reshape(-1)).view(B, A).t().reshape(-1)
    return src_starts, dst_starts, lengths


def _segments_values(name: str, starts: torch.Tensor, lengths: torch.Tensor, rows: int) -> None:
    """Segments inside [0, rows) and pairwise disjoint (reads the tensors: a sync)."""
    # Host sync: value validation of caller-supplied segments (public entry only, skipped with
    # set_validation(False); the dispatcher builds its own segments and never calls this).
    s = starts.to(torch.int64).cpu()
    n = lengths.to(torch.int64).cpu()
    if bool((s < 0).any()) or bool(((s + n) > rows).any()):
        c = int(torch.nonzero((s < 0) | ((s + n) > rows))[0, 0])
        raise IndexError(
            f"segment {c} covers {name} rows [{int(s[c])}, {int(s[c] + n[c])}) outside [0, {rows}); "
            "fix its start or length"
        )
    keep = n > 0
    s, n = s[keep], n[keep]
    order = torch.argsort(s)
    s, n = s[order], n[order]
    if s.numel() > 1 and bool(((s[:-1] + n[:-1]) > s[1:]).any()):
        raise ValueError(f"segments overlap in {name}; each row may belong to at most one segment")


def copy_segments(
    src: torch.Tensor,
    src_starts: torch.Tensor,
    dst_starts: torch.Tensor,
    lengths: torch.Tensor,
    num_rows: int,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Copy row segments into a new buffer: ``out[dst_starts[c] + i] = src[src_starts[c] + i]``
    for ``i < lengths[c]``; rows no segment covers are zero.

    Args:
        src: [R, D] float rows.
        src_starts, dst_starts, lengths: integer [C] (any order of segments); segments must be
            disjoint in ``src`` and in the output.
        num_rows: rows of the output.

    Differentiable in ``src`` (the gradient is the reverse copy). The value checks (bounds,
    disjointness) run while validation is on.
    """
    V.float_tensor("src", src, 2)
    for name, t in (("src_starts", src_starts), ("dst_starts", dst_starts), ("lengths", lengths)):
        V.int_tensor(name, t, 1)
    if not (src_starts.shape == dst_starts.shape == lengths.shape):
        raise ValueError(
            f"src_starts {tuple(src_starts.shape)}, dst_starts {tuple(dst_starts.shape)} and lengths "
            f"{tuple(lengths.shape)} must have the same shape [C]"
        )
    V.positive_int("num_rows", num_rows, minimum=0)
    V.same_device(src=src, src_starts=src_starts, dst_starts=dst_starts, lengths=lengths)
    if validation_enabled():
        if bool((lengths < 0).any()):
            raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
        _segments_values("src", src_starts, lengths, src.shape[0])
        _segments_values("the output", dst_starts, lengths, num_rows)
    return implementation("copy_segments", backend, src.device)(src, src_starts, dst_starts, lengths, num_rows)


def transpose_chunks(x: torch.Tensor, counts_AB: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Reorder the chunks of ``x`` from (a, b) order to (b, a) order.

    ``x`` [R, D] holds A*B consecutive chunks, chunk (a, b) of ``counts_AB[a, b]`` rows, in
    row-major (a, b) order; the result holds the same chunks in (b, a) order. The inverse is
    ``transpose_chunks(y, counts_AB.t())``. Differentiable; no host sync (one segment-copy launch).
    """
    V.float_tensor("x", x, 2)
    V.int_tensor("counts", counts_AB, 2)
    V.same_device(x=x, counts=counts_AB)
    if validation_enabled():
        total = int(counts_AB.sum())
        if bool((counts_AB < 0).any()) or total != x.shape[0]:
            raise ValueError(
                f"counts must be >= 0 and sum to the {x.shape[0]} rows of x, got sum {total}"
            )
    return transpose_chunks_unchecked(x, counts_AB, backend)


def transpose_chunks_unchecked(x: torch.Tensor, counts_AB: torch.Tensor, backend: str | None) -> torch.Tensor:
    """:func:`transpose_chunks` without the checks (the dispatcher's counts are valid by
    construction)."""
    A, B = counts_AB.shape
    if A == 1 or B == 1:
        return x  # (a, b) and (b, a) orders coincide
    src_starts, dst_starts, lengths = chunk_transpose_segments(counts_AB)
    return implementation("copy_segments", backend, x.device)(x, src_starts, dst_starts, lengths, x.shape[0])
