"""Triton kernel of the partition/concat op (segment copy); the launcher is in ``partition.py``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _copy_segments_kernel(
    src_ptr,
    out_ptr,
    seg_key_ptr,  # int64 [C] sorted destination starts; an empty segment has key num_rows
    seg_src_ptr,  # int64 [C] source starts, in the order of seg_key
    seg_len_ptr,  # int64 [C] lengths, in the order of seg_key
    num_rows,
    num_segments,
    D,
    stride_src,
    stride_out,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOP_STEP: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """Segment copy: out[key[c] + i] = src[src_start[c] + i] for i < len[c]; other rows zero.

    Grid: (cdiv(num_rows, BLOCK_R), cdiv(D, BLOCK_D)). One program owns BLOCK_R consecutive
    output rows and BLOCK_D columns: it finds each row's segment by a binary search over the
    sorted keys (``SEARCH_STEPS`` = bit length of C probes, largest step ``TOP_STEP``), gathers
    the source row, and writes the tile once (zeros where no segment covers the row), so the
    op is deterministic and needs no atomics or zero-fill pass.

    Example: keys [0, 3], src_starts [5, 0], lengths [3, 2], num_rows 6: out rows 0-2 come from
    src rows 5-7, rows 3-4 from src rows 0-1, row 5 is zero.
    """
    pid_r = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # [BR]
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)  # [BD]

    # pos = number of segments whose key is <= row (keys ascending): a branch-free binary search.
    pos = tl.zeros([BLOCK_R], dtype=tl.int64)
    for it in tl.static_range(SEARCH_STEPS):
        probe = pos + (TOP_STEP >> it)
        in_range = probe <= num_segments
        key = tl.load(seg_key_ptr + probe - 1, mask=in_range, other=0)
        pos = tl.where(in_range & (key <= rows), probe, pos)
    has_seg = pos > 0
    seg = tl.where(has_seg, pos - 1, 0)
    start = tl.load(seg_key_ptr + seg, mask=has_seg, other=0)
    src_start = tl.load(seg_src_ptr + seg, mask=has_seg, other=0)
    length = tl.load(seg_len_ptr + seg, mask=has_seg, other=0)
    row_ok = rows < num_rows
    covered = has_seg & row_ok & (rows < start + length)
    src_rows = src_start + (rows - start)

    col_ok = cols < D
    vals = tl.load(
        src_ptr + src_rows[:, None] * stride_src + cols[None, :],
        mask=covered[:, None] & col_ok[None, :],
        other=0.0,
    )  # [BR, BD]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], vals, mask=row_ok[:, None] & col_ok[None, :])
