"""Persistent grouped GEMM with TMA (launcher in :mod:`tritonmoe.kernels._grouped_gemm_persistent`).

The same GEMM as :func:`tritonmoe.kernels._grouped_gemm_kernels._grouped_mm_kernel` (ragged row
segments of a row space, one expert's weights per segment, the same fused epilogues and flags),
scheduled differently:

* **Persistent.** The grid is ``NUM_PROGS`` programs (one per SM on a GPU). Program ``p`` walks
  the output tiles ``p, p + NUM_PROGS, p + 2 * NUM_PROGS, ...`` in grouped order, and no program
  is launched only to find it has no tile.
* **Precomputed tile map.** The M tiles are the entries of the row space's tile map (built once
  per call and BM by ``_tile_map_kernel``, shared with the tile kernel and the backward): a
  tile's expert, first row and segment end are three scalar loads, so the loop holds no search
  over the E segments (a per-tile reduction over a 2E-lane vector put 9-12 CTA barriers in the
  pipelined loop at E=128). The map's zero head and tail entries (rows outside the segments)
  are zeroed before the loop; its expert entries lie between them.
* **Epilogue overlapped with the next tile's loads.** The tile loop and the K loop are written as
  a nest whose inner trip count does not depend on the tile, so ``tl.range(..., flatten=True)``
  fuses them into one software-pipelined loop: the loads of the next tile's first K steps are
  issued while the current tile's epilogue runs (the design of Triton's persistent matmul
  tutorial and of triton_kernels' ``_p_matmul_ogs``).
* **TMA.** Operands are read with tensor descriptors (``cp.async.bulk.tensor``, one instruction
  per tile instead of per-thread address arithmetic) when their layout allows it, and with masked
  pointer loads otherwise (token gathers, unaligned strides); each operand is chosen on its own by
  the launcher (a descriptor argument that is ``None`` selects the pointer path).

Row space and segment bounds. Segment e is rows [offsets[e], offsets[e+1]) of the R-row space; the
rows [offsets[E], R) are the *tail* (zeros in C and H). A tile never straddles two segments: its
rows are ``[row0, row0 + BM)`` with row0 inside one segment, and only the rows before the
segment's end are valid. TMA zero-fills only at a tensor's bounds, not at a segment's, so:

* A (``[R, K]`` descriptor over the whole buffer): rows of the box past the segment end are the
  next segment's rows (or tail rows, which may hold anything, NaN included). They are loaded and
  multiplied, but row r of ``A @ B`` depends on row r of A only, so they reach only accumulator
  rows that are never stored. Past R and past K the descriptor zero-fills.
* B (``[E, K, N]`` descriptor, box ``[1, BK, BN]``, or ``[E, N, K]`` for K-contiguous weights):
  expert and K bounds are the tensor's bounds, so K tails read zeros, never the next expert. For
  SwiGLU the gate and up halves have a descriptor each (``N`` columns each), so a gate tile past
  column N reads zeros, not up columns.
* C and H stores use a *ragged* descriptor (Triton's ``triton.tools.ragged_tma`` construction):
  two leading dimensions whose strides cancel modulo 2**64, so that the box's third coordinate
  ``2**30 - (seg_end - row0) + i`` is in bounds exactly for ``row0 + i < seg_end``. The hardware
  then drops the rows past the segment end: no store ever touches another segment's rows. Column
  bounds are the tensor's (N, or each SwiGLU half's N for H).

Worked example (BM=4, E=2, offsets=[0, 6, 9], R=11, one column tile): tile map [(0, 0, 6),
(0, 4, 6), (1, 6, 9), (-1, 9, 11)], count 4, no head tile, one tail tile; expert tiles: 0 ->
rows 0..3 of expert 0, 1 -> rows 4..5 (box rows 6..7 are expert 1's: loaded, never stored),
2 -> rows 6..8 of expert 1 (box row 9 is a tail row); the zero loop writes rows 9..10.
With NUM_PROGS=2, program 0 runs tiles 0 and 2, program 1 runs tile 1.

The fused path's row space (``GATHER_A``: rows are slots, A rows the tokens ``slot // TOPK``;
``SCATTER_C``: outputs to slot rows) has its unrouted slots in the zero head [0, offsets[0]).

Shape letters: BM/BN/BK tile sizes; ``K`` the GEMM depth; ``TOPK`` slots per token (a constexpr:
the gather's ``slot // TOPK`` is a multiply-shift, computed once per tile).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._grouped_gemm_kernels import _GELU, _RELU, _SWIGLU, _gelu, _sigmoid

#: Rows of a ragged descriptor's third dimension (triton.tools.ragged_tma's "billion"): row
#: counts must stay below it.
RAGGED_ROWS = 2**30
_RAGGED = tl.constexpr(RAGGED_ROWS)

_ROW_ARGS = ["R", "E", "NUM_PROGS", "ROWS_HINT"]


@triton.jit
def _tile_of(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering of the persistent tile index (int32): GROUP_M consecutive M tiles sweep
    the N tiles together, so the NUM_PROGS tiles in flight share weight panels and row tiles in
    L2."""
    width = GROUP_M * num_pid_n
    group = tile // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    return pid_m, pid_n


@triton.jit
def _ragged_rows(row0, seg_end):
    """Leading coordinates of a ragged descriptor for the box at rows [row0, row0 + box) of a
    segment ending at seg_end: box row i is in bounds iff row0 + i < seg_end (module
    docstring)."""
    c0 = (row0 * 0 + _RAGGED).to(tl.int32)
    c1 = seg_end.to(tl.int32)
    c2 = (row0 - seg_end + _RAGGED).to(tl.int32)
    return c0, c1, c2


@triton.jit
def _store_slice(desc, base, row_off, row_ok, value, row0, seg_end, col0, N, stride_n, W: tl.constexpr):
    """Store ``value`` [BM, W] (output dtype) to columns [col0, col0 + W) of the tile's rows:
    through the ragged descriptor when there is one (rows past seg_end and columns past the
    descriptor's bound are dropped by the hardware), else with a masked pointer store at
    ``base + row_off[r] + col * stride_n`` (row_off: int64 element offsets of the rows)."""
    if desc is not None:
        c0, c1, c2 = _ragged_rows(row0, seg_end)
        desc.store([c0, c1, c2, col0], tl.reshape(value, (1, 1, value.shape[0], W)))
    else:
        cols = col0.to(tl.int64) + tl.arange(0, W).to(tl.int64)
        mask = row_ok[:, None] & (cols < N)[None, :]
        tl.store(base + row_off[:, None] + cols[None, :] * stride_n, value, mask=mask)


@triton.jit
def _store_out(desc, base, row_off, row_ok, value, row0, seg_end, n0, N, stride_n,
               BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    """Store the [BM, BN] output tile ``value`` in SPLIT column slices (1 or 2), one after the
    other: a slice's addresses (pointer path) or staging buffer (TMA path) instead of the whole
    tile's, which keeps a 128x256 epilogue inside the registers and shared memory the
    pipelined loop leaves (the epilogue subtiling of Triton's persistent matmul)."""
    tl.static_assert(SPLIT == 1 or SPLIT == 2, "epilogue split must be 1 or 2")
    if SPLIT == 1:
        _store_slice(desc, base, row_off, row_ok, value, row0, seg_end, n0, N, stride_n, BN)
    else:
        v0, v1 = tl.split(tl.permute(tl.reshape(value, (BM, 2, BN // 2)), (0, 2, 1)))
        _store_slice(desc, base, row_off, row_ok, v0, row0, seg_end, n0, N, stride_n, BN // 2)
        _store_slice(desc, base, row_off, row_ok, v1, row0, seg_end, n0 + BN // 2, N, stride_n, BN // 2)


@triton.jit
def _load_b(desc, ptrs, mask, seg, k0, n0, B_KMAJOR: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    """One [BK, BN] weight tile of expert ``seg`` at (k0, n0): by descriptor (``[E, K, N]``, or
    ``[E, N, K]`` read as ``[BN, BK]`` and transposed when the weights are K-contiguous) or by
    masked pointer load."""
    if desc is not None:
        if B_KMAJOR:
            b = tl.trans(tl.reshape(desc.load([seg, n0, k0]), (BN, BK)))
        else:
            b = tl.reshape(desc.load([seg, k0, n0]), (BK, BN))
    else:
        b = tl.load(ptrs, mask=mask, other=0.0)
    return b


@triton.jit
def _load_b_wide(ptrs, mask):
    """The gate and up [BK, BN] weight tiles of a K step as one [BK, 2 * BN] tile (gate columns
    first) by a masked pointer load: ``ptrs`` column j points at weight column
    ``(j // BN) * N + n0 + j % BN``, runs of BN contiguous columns, so the load becomes 16-byte
    cp.async copies straight into the MMA's shared-memory layout. (A TMA box over the
    ``[E, K, 2, N]`` view of the weights lands in shared memory as ``[BK, 2, BN]``, which Triton
    3.9 reshapes to the ``[BK, 2 * BN]`` operand through registers every K step, leaving each
    MMA to finish before the next is issued: ``wgmma.wait_group 0``.)"""
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _zero_rows(c_ptr, h_ptr, row_map_ptr, offs_ptr, pid, R, E, N, n_up, num_pid_n, NUM_PROGS,
               stride_cm, stride_cn, stride_hm, stride_hn,
               ACT: tl.constexpr, STORE_H: tl.constexpr, SCATTER_C: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr):
    """Zeros to C (and H) on the rows outside the experts' segments: the head [0, offsets[0])
    (the fused path's unrouted slots) and the tail [offsets[E], R), clamped into [0, R) as the
    tile map clamps them; returns their M tiles (head_m, tail_m), which are the tile map's first
    and last entries. Visited in reversed program order, because the tile loop gives its
    remainder tiles to the low program ids."""
    head_end = tl.minimum(tl.maximum(tl.load(offs_ptr).to(tl.int64), 0), R)
    tail0 = tl.minimum(tl.maximum(tl.load(offs_ptr + E).to(tl.int64), 0), R)
    head_m = tl.cdiv(head_end, BM).to(tl.int32)
    tail_m = tl.cdiv(R - tail0, BM).to(tl.int32)
    for t in range(NUM_PROGS - 1 - pid, (head_m + tail_m) * num_pid_n, NUM_PROGS):
        m = t // num_pid_n
        in_head = m < head_m
        lo = tl.where(in_head, 0, tail0)
        hi = tl.where(in_head, head_end, R)
        rows = lo + tl.where(in_head, m, m - head_m).to(tl.int64) * BM + tl.arange(0, BM).to(tl.int64)
        cols = (t % num_pid_n).to(tl.int64) * BN + tl.arange(0, BN).to(tl.int64)
        mask = (rows < hi)[:, None] & (cols < N)[None, :]
        if SCATTER_C:
            c_rows = tl.load(row_map_ptr + rows, mask=rows < hi, other=0).to(tl.int64)
        else:
            c_rows = rows
        zero = tl.zeros((BM, BN), dtype=tl.float32)
        tl.store(c_ptr + c_rows[:, None] * stride_cm + cols[None, :] * stride_cn,
                 zero.to(c_ptr.dtype.element_ty), mask=mask)
        if STORE_H:
            h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn
            tl.store(h_ptrs, zero.to(h_ptr.dtype.element_ty), mask=mask)
            if ACT == _SWIGLU:
                tl.store(h_ptrs + n_up * stride_hn, zero.to(h_ptr.dtype.element_ty), mask=mask)
    return head_m, tail_m


@triton.jit(do_not_specialize=_ROW_ARGS)
def _grouped_mm_persistent_kernel(
    a_desc, b_desc, bu_desc, c_desc, h_desc, hu_desc,
    a_ptr, b_ptr, c_ptr, h_ptr, offs_ptr, tiles_ptr, count_ptr, row_map_ptr, scale_ptr,
    R, N, K, E, NUM_PROGS, ROWS_HINT,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn,
    stride_hm, stride_hn,
    ACT: tl.constexpr, STORE_H: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
    SCALE: tl.constexpr, TOPK: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr, GLU_WIDE: tl.constexpr,
    B_KMAJOR: tl.constexpr, EPI_SPLIT: tl.constexpr, FLATTEN: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Persistent grouped GEMM ``C[r] = act(A[r] @ B[seg(r)])`` (see the module docstring).

    Grid: ``(NUM_PROGS,)``. Program p first zeroes its share of the rows outside the segments
    (:func:`_zero_rows`), then computes the work items p, p + NUM_PROGS, ... of the
    ``(expert M tiles) x cdiv(N, BN)`` items: the M tiles are the precomputed tile map's entries
    between its zero head and zero tail (``tiles_ptr`` [MT, 3]: expert, first row, segment end;
    ``count_ptr``: valid entries; see ``_grouped_gemm_kernels``), read with three scalar loads per
    item, so the loop holds no per-tile search over the E segments (no reduction, no CTA
    barrier). Each item as the tile kernel does it: fp32 accumulation (for SwiGLU a second
    accumulator over the up columns, or with ``GLU_WIDE`` one ``[BM, 2 * BN]`` accumulator over
    the gate and up tiles loaded as one ``[BK, 2 * BN]`` tile, so each K step is one MMA of
    width 2 * BN, and the epilogue splits it into its halves), then the epilogue.

    Flags as in ``_grouped_mm_kernel`` (``ACT``, ``STORE_H``, ``GATHER_A``, ``SCATTER_C``,
    ``SCALE``); operand access: ``a_desc`` (``[R, K]``, not with ``GATHER_A``), ``b_desc`` /
    ``bu_desc`` (weights, gate / up halves; ``B_KMAJOR``: they describe ``[E, N, K]`` storage;
    with ``GLU_WIDE`` the weights are read by pointers, see :func:`_load_b_wide`),
    ``c_desc`` / ``h_desc`` / ``hu_desc`` (ragged, 4-D; not with ``SCATTER_C``); any of them
    ``None`` selects masked pointer access through the matching ``*_ptr`` and strides.
    ``EPI_SPLIT`` stores the output tiles in that many column slices. ``FLATTEN`` fuses the tile
    and K loops into one pipelined loop. Every output element is
    written by one program, once: results do not depend on NUM_PROGS or the pipelining.
    """
    A_TMA: tl.constexpr = a_desc is not None
    WIDE: tl.constexpr = GLU_WIDE and (ACT == _SWIGLU)
    ACC_N: tl.constexpr = 2 * BN if WIDE else BN
    pid = tl.program_id(0)
    n_up = pid.to(tl.int64) * 0 + N  # column offset of the up / second half, as int64
    num_pid_n = tl.cdiv(N, BN)
    head_m, tail_m = _zero_rows(c_ptr, h_ptr, row_map_ptr, offs_ptr, pid, R, E, N, n_up, num_pid_n, NUM_PROGS,
                                stride_cm, stride_cn, stride_hm, stride_hn, ACT, STORE_H, SCATTER_C, BM, BN)
    num_pid_m = tl.load(count_ptr) - head_m - tail_m  # the experts' M tiles: entries [head_m, count - tail_m)

    offs_k = tl.arange(0, BK)
    offs_w = tl.arange(0, ACC_N)
    # column j of the (wide) weight tile reads weight column w_col[j] + n0 (gate, then up)
    w_col = (offs_w // BN).to(tl.int64) * n_up + (offs_w % BN).to(tl.int64)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    for tile in tl.range(pid, num_tiles, NUM_PROGS, flatten=FLATTEN):
        # Prologue: which segment, rows and columns this tile covers (three loads of the map).
        pid_m, pid_n = _tile_of(tile, num_pid_m, num_pid_n, GROUP_M)
        entry = tiles_ptr + (head_m + pid_m).to(tl.int64) * 3
        seg = tl.maximum(tl.load(entry), 0)
        row0 = tl.load(entry + 1).to(tl.int64)
        seg_end = tl.load(entry + 2).to(tl.int64)
        seg64 = seg.to(tl.int64)
        n0 = pid_n * BN
        rows = row0 + tl.arange(0, BM).to(tl.int64)
        row_ok = rows < seg_end
        wcols = n0.to(tl.int64) + (offs_w % BN).to(tl.int64)
        col_ok = wcols < N
        if GATHER_A or SCATTER_C or SCALE:
            slot = tl.load(row_map_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        if GATHER_A:
            a_rows = slot // TOPK
        else:
            a_rows = rows
        a_base = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_base = b_ptr + seg64 * stride_be + offs_k[:, None] * stride_bk + (n0 + w_col)[None, :] * stride_bn

        acc = tl.zeros((BM, ACC_N), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            k0 = kk * BK
            if EVEN_K:
                a_mask = row_ok[:, None]
                b_mask = col_ok[None, :]
            else:
                a_mask = row_ok[:, None] & (offs_k[None, :] < K - k0)
                b_mask = (offs_k[:, None] < K - k0) & col_ok[None, :]
            if A_TMA:
                a = a_desc.load([row0.to(tl.int32), k0])  # [BM, BK]
            else:
                a = tl.load(a_base + k0 * stride_ak, mask=a_mask, other=0.0)
            if WIDE:
                b = _load_b_wide(b_base + k0 * stride_bk, b_mask)
                acc = tl.dot(a, b, acc, input_precision=PREC)  # [BM, BK] @ [BK, 2 * BN]
            else:
                b = _load_b(b_desc, b_base + k0 * stride_bk, b_mask, seg, k0, n0, B_KMAJOR, BK, BN)
                acc = tl.dot(a, b, acc, input_precision=PREC)  # [BM, BK] @ [BK, BN]
                if ACT == _SWIGLU:
                    b_up = _load_b(bu_desc, b_base + k0 * stride_bk + n_up * stride_bn, b_mask, seg, k0, n0,
                                   B_KMAJOR, BK, BN)
                    acc_up = tl.dot(a, b_up, acc_up, input_precision=PREC)  # [BM, BK] @ [BK, BN]

        # Epilogue (runs while the pipelined loop already loads the next tile's first K steps).
        if WIDE:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        else:
            gate = acc
            up = acc_up
        if STORE_H:
            hdt = h_ptr.dtype.element_ty
            h_off = rows * stride_hm
            _store_out(h_desc, h_ptr, h_off, row_ok, gate.to(hdt), row0, seg_end, n0, N, stride_hn, BM, BN, EPI_SPLIT)
            if ACT == _SWIGLU:
                _store_out(hu_desc, h_ptr + n_up * stride_hn, h_off, row_ok, up.to(hdt), row0, seg_end, n0, N,
                           stride_hn, BM, BN, EPI_SPLIT)
        if ACT == _SWIGLU:
            out = gate * _sigmoid(gate) * up
        elif ACT == _GELU:
            out = _gelu(gate)
        elif ACT == _RELU:
            out = tl.maximum(gate, 0.0)
        else:
            out = gate
        if SCALE:
            w = tl.load(scale_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
            out = out.to(a_ptr.dtype.element_ty).to(tl.float32) * w[:, None]
        if SCATTER_C:
            c_off = slot * stride_cm
        else:
            c_off = rows * stride_cm
        _store_out(c_desc, c_ptr, c_off, row_ok, out.to(c_ptr.dtype.element_ty), row0, seg_end, n0, N, stride_cn,
                   BM, BN, EPI_SPLIT)
