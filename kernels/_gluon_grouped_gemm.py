"""A warp-specialized persistent grouped GEMM for Hopper, in Gluon (issue 29, item 3).

``out[r, :] = x[r, :] @ w[e(r)]`` over the rows of a grouped-GEMM row space (E expert segments
given by offsets), for the ``mm`` kind (GEMM2 and dX: no activation, no bias, no gather or
scatter). It is the schedule CUTLASS's Hopper grouped GEMM uses, written with Gluon
(``triton.experimental.gluon``: explicit layouts, shared-memory buffers, mbarriers, TMA and
``warpgroup_mma``):

* **a producer warp** (a worker partition of one warp, its registers lowered with
  ``setmaxnreg``) walks the work items and issues the TMA loads of every K step of every tile
  into a ring of ``NUM_BUF`` shared-memory stages, each guarded by an *empty* and a *ready*
  mbarrier (the TMA's byte count completes *ready*);
* **two consumer warpgroups** (the default partition, 8 warps: 64 rows of the 128-row tile
  each) wait on *ready*, issue ``wgmma`` asynchronously with one group in flight, and release
  each stage (*empty*) as soon as the MMA that read it has retired;
* while the consumers run a tile's epilogue (downcast and masked store of the rows of its
  segment), the producer already fills the ring with the next tile's operands: the epilogue
  overlaps the next tile's loads, which the cp.async tile kernel cannot do.

The work list is the launch's tile map (``kernels/grouped_gemm.py``: entry ``(expert or -1,
first row, segment end)`` per BM-row tile, ``count`` on the device), read by both partitions, so
they agree on every tile without communicating; program ``p`` takes items ``p, p + P, ...`` of
``count * tiles_n``. No per-tile segment search remains in the main loop.

The weight operand is read through a 2-D TMA descriptor over ``w.view(E * K, N)`` with a
``[BK, BN]`` box at row ``e * K + k``: exact only when ``BK`` divides ``K`` (the launcher
checks; real models' d_model and d_ffn are multiples of 64). Rows past ``R`` are zero-filled by
the TMA; rows of the next segment inside a tile are read but never stored.

Gluon is experimental: its API differs between Triton releases, it does not run under Triton's
interpreter, and a kernel here is only proven by the ahead-of-time compile
(``tests/test_aot_gluon.py``: setmaxnreg partitions, TMA, wgmma, no spills) and by a GPU test
against the reference. Its algorithm (tile map, work order, masks) is the persistent Triton
kernel's (``_grouped_gemm_persistent_kernels``), which the interpreter tests run. The module
imports on every Triton; :data:`AVAILABLE` says whether Gluon's Hopper API is present.
"""

from __future__ import annotations

import torch

try:  # Gluon's Hopper API (triton >= 3.5); absent on older releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # TMA global -> shared copy: ``tma.async_load`` since triton 3.7 (where the old name raises),
    # ``tma.async_copy_global_to_shared`` before; same arguments (descriptor, coordinates,
    # mbarrier, destination).
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed triton
    AVAILABLE = False

#: Registers of the producer warp (setmaxnreg): it only computes addresses and tile-map reads.
PRODUCER_REGS = 40

if AVAILABLE:

    @gluon.jit
    def _ws_producer(a_desc, b_desc, a_bufs, b_bufs, empty_bars, ready_bars, tiles_ptr, count_ptr, K, N,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NUM_BUF: gl.constexpr):
        """The producer warp: TMA loads of every K step of every work item of this program."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(N, BN)
        k_steps = gl.cdiv(K, BK)
        items = gl.load(count_ptr) * tiles_n
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        it = 0
        for w in range(pid, items, nprog):
            m = w // tiles_n
            e = gl.load(tiles_ptr + m * 3)
            row0 = gl.load(tiles_ptr + m * 3 + 1)
            n0 = (w % tiles_n) * BN
            if e >= 0:
                for kk in range(k_steps):
                    s = it % NUM_BUF
                    phase = (it // NUM_BUF) & 1
                    # a fresh mbarrier counts as phase 1 completed: the first round passes
                    mbarrier.wait(empty_bars.index(s), phase ^ 1)
                    mbarrier.expect(ready_bars.index(s), nbytes)
                    _tma_load(a_desc, [row0, kk * BK], ready_bars.index(s), a_bufs.index(s))
                    _tma_load(b_desc, [e * K + kk * BK, n0], ready_bars.index(s), b_bufs.index(s))
                    it += 1

    @gluon.jit
    def _ws_consumer(a_bufs, b_bufs, empty_bars, ready_bars, out_ptr, tiles_ptr, count_ptr, K, N, stride_om,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NUM_BUF: gl.constexpr,
                     num_warps: gl.constexpr):
        """The consumer warpgroups: wgmma over the stages the producer fills, then the epilogue
        (downcast, masked store of the rows of the tile's segment; zeros for a zero tile)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 16])
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        tiles_n = gl.cdiv(N, BN)
        k_steps = gl.cdiv(K, BK)
        items = gl.load(count_ptr) * tiles_n
        rows_in = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        cols_in = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
        it = 0
        for w in range(pid, items, nprog):
            m = w // tiles_n
            e = gl.load(tiles_ptr + m * 3)
            row0 = gl.load(tiles_ptr + m * 3 + 1)
            seg_end = gl.load(tiles_ptr + m * 3 + 2)
            n0 = (w % tiles_n) * BN
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            if e >= 0:
                for kk in range(k_steps):
                    s = it % NUM_BUF
                    mbarrier.wait(ready_bars.index(s), (it // NUM_BUF) & 1)
                    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                    # one wgmma group stays in flight; the one before it has retired, so its
                    # stage can be refilled
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                    mbarrier.arrive(empty_bars.index((it + NUM_BUF - 1) % NUM_BUF), count=1, pred=kk > 0)
                    it += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                mbarrier.arrive(empty_bars.index((it + NUM_BUF - 1) % NUM_BUF), count=1, pred=k_steps > 0)
            rows = row0 + rows_in
            cols = n0 + cols_in
            mask = (rows < seg_end)[:, None] & (cols < N)[None, :]
            ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :]
            gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _gluon_grouped_mm_ws_kernel(a_desc, b_desc, out_ptr, tiles_ptr, count_ptr, K, N, stride_om,
                                    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NUM_BUF: gl.constexpr,
                                    PRODUCER_NREG: gl.constexpr, num_warps: gl.constexpr):
        """Warp-specialized persistent grouped GEMM (module docstring): ``num_warps`` consumer
        warps (8: two warpgroups) and one producer warp; ``NUM_BUF`` operand stages."""
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BK, BN], b_desc.layout)
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(empty_bars.index(i), count=1)
            mbarrier.init(ready_bars.index(i), count=1)
        gl.warp_specialize([
            (_ws_consumer, (a_bufs, b_bufs, empty_bars, ready_bars, out_ptr, tiles_ptr, count_ptr, K, N, stride_om,
                            BM, BN, BK, NUM_BUF, num_warps)),
            (_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, empty_bars, ready_bars, tiles_ptr, count_ptr, K, N,
                            BM, BN, BK, NUM_BUF)),
        ], [1], [PRODUCER_NREG])


def usable(a, b_EKN, out, *, K: int, BK: int) -> str | None:
    """Why the warp-specialized kernel cannot serve this ``mm`` call (None when it can): Gluon's
    Hopper API missing, a device other than sm_90, operands that are not 16-bit, a K-contiguous
    or misaligned weight (the TMA boxes need N-contiguous weights with 16-byte aligned strides),
    or ``BK`` not dividing ``K`` (module docstring)."""
    if not AVAILABLE:
        return "this triton has no Gluon Hopper API"
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device)[0] != 9:
        return "the warp-specialized kernel is written for sm_90 (H100/H200)"
    if a.dtype not in (torch.bfloat16, torch.float16) or b_EKN.dtype != a.dtype or out.dtype != a.dtype:
        return f"operands must share a 16-bit dtype (got {a.dtype}, {b_EKN.dtype}, {out.dtype})"
    if a.stride(1) != 1 or b_EKN.stride(2) != 1 or not b_EKN.is_contiguous():
        return "x must be K-contiguous and w a contiguous [E, K, N] tensor"
    if (a.stride(0) * 2) % 16 or (b_EKN.shape[2] * 2) % 16 or a.data_ptr() % 16 or b_EKN.data_ptr() % 16:
        return "TMA needs 16-byte aligned bases and row strides"
    if K % BK:
        return f"BK={BK} does not divide K={K} (a weight box would cross into the next expert)"
    return None


def mm(a, b_EKN, out, tiles, count, *, BM: int = 128, BN: int = 256, BK: int = 64, num_buf: int = 4,
       num_programs: int) -> None:
    """``out[r] = a[r] @ b_EKN[e(r)]`` for the rows of the tile map ``(tiles, count)`` (BM-row
    tiles, ``kernels/grouped_gemm.py``'s ``TileMap``) with the warp-specialized kernel; the caller
    checked :func:`usable`. ``num_programs``: persistent programs (one per SM at most)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, K, N = b_EKN.shape
    el = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], el)
    b_layout = gl.NVMMASharedLayout.get_default_for([BK, BN], el)
    a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [BM, BK], a_layout)
    b_desc = TensorDescriptor(b_EKN, [E * K, N], [N, 1], [BK, BN], b_layout)
    _gluon_grouped_mm_ws_kernel[(num_programs,)](
        a_desc, b_desc, out, tiles, count, K, N, out.stride(0),
        BM=BM, BN=BN, BK=BK, NUM_BUF=num_buf, PRODUCER_NREG=PRODUCER_REGS, num_warps=8,
    )
