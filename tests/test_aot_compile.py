"""Every Triton kernel variant the launchers use on an H100/H200, compiled for sm_90a without a GPU.

The interpreter (which the rest of the suite runs on CPU) accepts code the compiler rejects and
cannot see registers, spills, shared memory or which MMA instructions a kernel gets. This module
lists each kernel specialization the launchers emit on sm90 (the flags, dtypes and pointer
arguments of their launch sites, at the configs their own config functions choose for sm90:
``route_config``, ``metadata_config`` / ``rows_config``, ``partition.select_config``,
``_gemm_config.select`` and ``combine_config``, for shapes of real models), compiles them all in
one subprocess without ``TRITON_INTERPRET`` through :mod:`aot_compile`, and checks per variant:

* it compiles (front end, LLVM, ptxas), and its shared memory fits sm90 (227 KiB);
* routing, permutation and partition kernels spill at most a couple of registers (their configs
  are sized to keep their tiles in registers; see ``route_config``, ``metadata_config``,
  ``rows_config``, ``partition.select_config``);
* grouped GEMMs: tensor cores for 16-bit and TF32 operands, as wgmma for tiles of BM >= 64 and
  mma.sync below (none for IEEE fp32); every ``tl.dot`` operand loaded through a cp.async pipeline
  (real model shapes: N and K multiples of 16); epilogues may spill (SwiGLU holds two
  accumulators), main loops may not. The autotuner's deepest pipeline of the large tiles too.
* the persistent grouped GEMM (``TRITONMOE_GEMM_VARIANT=persistent``) at the Mixtral-like and
  Qwen3-30B-A3B-like presets: wgmma, no spilled register at all, TMA loads (and TMA stores where
  the launcher gives descriptors), and the epilogue's stores inside the pipelined MMA loop where
  the launch fuses the tile and K loops.

Run by hand (prints one JSON line per variant; optional name filters)::

    python tests/test_aot_compile.py [substring ...]
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pkgutil
import sys
from types import SimpleNamespace
from typing import Any, Iterator, Optional
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aot_compile as aot  # noqa: E402
from _aot_fp8_cases import fp8_cases  # noqa: E402

from tritonmoe.kernels import _fp8_kernels as FK  # noqa: E402
from tritonmoe.kernels import _gemm_config as C  # noqa: E402
from tritonmoe.kernels import _grouped_gemm_kernels as GK  # noqa: E402
from tritonmoe.kernels import _grouped_gemm_persistent as PG  # noqa: E402
from tritonmoe.kernels import _grouped_gemm_persistent_kernels as PGK  # noqa: E402
from tritonmoe.kernels import _partition_kernels as XK  # noqa: E402
from tritonmoe.kernels import _permute_kernels as PK  # noqa: E402
from tritonmoe.kernels import _routing_kernels as RK  # noqa: E402
from tritonmoe.kernels import grouped_gemm as gg  # noqa: E402
from tritonmoe.kernels import partition as kx  # noqa: E402
from tritonmoe.kernels import permute as kp  # noqa: E402
from tritonmoe.kernels import routing as kr  # noqa: E402

ARCH = 90
KERNEL_MODULES = (RK, PK, XK, GK, PGK, FK)
H100_SMS = 132  # H100 SXM and H200 both have 132 SMs

P = aot.Ptr

#: Stack (spilled registers) allowed in the routing, permutation and partition kernels, whose
#: configs are sized to keep their tiles in registers. ptxas may still park a couple of values on
#: the stack: 8 bytes in _block_rank_kernel and the grouped-router backward with Triton 3.9, in
#: _block_scan_kernel and the dw-only fp32 scatter (reloaded once per loop step) with Triton 3.6.
#: These kernels are bandwidth-bound, so that costs nothing measurable; more than a few
#: registers means a tile no longer fits.
SMALL_KERNEL_STACK = 16
_TL_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel specialization and what it must satisfy once compiled.

    max_stack_bytes: bound on the spilled bytes (None: unbounded); spill_free_loops: no spill
    code inside a loop (the GEMMs' main loop). wgmma / mma_sync: required (True), forbidden
    (False) or not checked (None). async_loads: at least this many distinct loads pipelined
    through cp.async. main_loop_int_divs: exact number of integer division / remainder
    instructions allowed in the MMA loop (None: not checked). min_wgmma_wait_depth: the MMA loop's
    ``wgmma.wait_group`` depth must be at least this (None: not checked). min_pipeline_buffers:
    the pipelined operand tiles need at least this many shared-memory buffers each. max_barriers:
    at most this many CTA-wide barriers in the PTX (None: not checked); max_main_loop_barriers:
    at most this many inside the main loop (None: not checked).
    """

    name: str
    fn: Any
    args: dict
    num_warps: int
    num_stages: int = 3  # Triton's launch default
    max_stack_bytes: Optional[int] = SMALL_KERNEL_STACK
    spill_free_loops: bool = False
    wgmma: Optional[bool] = None
    mma_sync: Optional[bool] = None
    async_loads: int = 0
    main_loop_int_divs: Optional[int] = None
    max_barriers: Optional[int] = None
    max_main_loop_barriers: Optional[int] = None
    min_wgmma_wait_depth: Optional[int] = None
    min_pipeline_buffers: int = 0


@contextlib.contextmanager
def sm90_device() -> Iterator[torch.device]:
    """A CUDA device as the config functions see an H100/H200 (capability 9.0, 132 SMs), without
    one: patches the two functions that would ask the driver."""
    with mock.patch.object(C, "_capability", lambda index: (9, 0)), \
            mock.patch.object(C, "_num_sms", lambda index: H100_SMS), \
            mock.patch.object(kp, "_num_sms", lambda index: H100_SMS):
        yield torch.device("cuda", 0)


# ---------------------------------------------------------------------------------------------
# Routing (kernels/routing.py: _forward, _backward)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Router:
    name: str
    E: int
    k: int
    G: int = 1
    topk_groups: int = 1
    softmax: bool = True
    bias: bool = False
    capacity: bool = False
    aux: bool = False
    renormalize: bool = True
    dtype: str = "bf16"
    sqrtsp: bool = False  # score_func="sqrtsoftplus" (softmax False)


# Routers of real models, and the odd shapes the tests pin (prime-ish E, groups, no renorm).
ROUTERS = [
    _Router("mixtral_E8_k2", 8, 2),
    _Router("qwen3_E128_k8_aux", 128, 8, aux=True),
    _Router("qwen3_E128_k8", 128, 8),
    _Router("deepseek_v3_E256_k8_g8", 256, 8, G=8, topk_groups=4, softmax=False, bias=True),
    _Router("E64_k6_capacity", 64, 6, capacity=True),
    _Router("E64_k1_capacity", 64, 1, capacity=True),
    _Router("E8_k2_fp32_norenorm", 8, 2, dtype="fp32", renormalize=False),
    _Router("E67_k5_fp16", 67, 5, dtype="fp16"),
    _Router("E60_k4_g6_sigmoid_capacity_aux", 60, 4, G=6, topk_groups=3, softmax=False, capacity=True, aux=True),
    _Router("E512_k8", 512, 8),
    _Router("E64_k4_sqrtsoftplus_aux", 64, 4, softmax=False, aux=True, sqrtsp=True),
    _Router("E8192_k8_max_lanes", 8192, 8),
]


def routing_variants(T: int = 4096) -> list[Variant]:
    out = []
    for r in ROUTERS:
        S = r.E // r.G
        block_g, block_s, block_k = triton.next_power_of_2(r.G), triton.next_power_of_2(S), triton.next_power_of_2(r.k)
        cfg = kr.route_config(block_g * block_s)  # the GPU config (interpret=False)
        NB = triton.cdiv(T, cfg.block_t)
        split = cfg.scan_split_slots and r.k > 1
        shape = dict(G=r.G, S=S, K=r.k, SOFTMAX=r.softmax, RENORMALIZE=r.renormalize, BLOCK_T=cfg.block_t,
                     BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=block_k)
        out.append(Variant(f"route_fwd[{r.name}]", RK._route_fwd_kernel, dict(
            logits_ptr=P(r.dtype), bias_ptr=P("fp32"), ids_ptr=P("i32"), w_ptr=P("fp32"), counts_ptr=P("i32"),
            slot_hist_ptr=P("i32"), slot_tot_ptr=P("i32"), score_part_ptr=P("fp32"), lse_ptr=P("fp32"),
            T=T, NB=NB, stride_lt=r.E, stride_le=1, TOPK_GROUPS=r.topk_groups, HAS_BIAS=r.bias,
            HAS_CAPACITY=r.capacity, SLOT_TOTALS=r.capacity and split, WITH_AUX=r.aux, **shape,
            POISON=r.bias and not r.capacity,  # the fused non-finite bias guard, as launched
        ), cfg.num_warps))
        if r.name in ("qwen3_E128_k8", "deepseek_v3_E256_k8_g8"):  # a validated call: the fused value checks
            out.append(Variant(f"route_fwd[{r.name},checked]", RK._route_fwd_kernel, dict(
                out[-1].args, flag_ptr=P("i32"), CHECK=True), cfg.num_warps))
        # backward: the weights' gradient always; the aux gradients when the router has them
        for grads in [("dw",)] + ([("dw", "dss", "dlse"), ("dss",)] if r.aux else []):
            shape_b = dict(shape, BLOCK_T=cfg.bwd_block_t)
            out.append(Variant(f"route_bwd[{r.name},{'+'.join(grads)}]", RK._route_bwd_kernel, dict(
                logits_ptr=P(r.dtype), sel_ids_ptr=P("i32"), ids_ptr=P("i32"), dw_ptr=P("fp32"), dss_ptr=P("fp32"),
                dlse_ptr=P("fp32"), dlogits_ptr=P(r.dtype), T=T, stride_lt=r.E, stride_le=1,
                stride_dwt=r.k if "dw" in grads else 0, stride_dwk=1 if "dw" in grads else 0,
                stride_dss=1 if "dss" in grads else 0, stride_dlse=1 if "dlse" in grads else 0,
                HAS_CAPACITY=r.capacity, HAS_DW="dw" in grads, HAS_DSS="dss" in grads, HAS_DLSE="dlse" in grads,
                **shape_b,
            ), cfg.bwd_num_warps))
        if r.capacity:
            slots_per_prog = 1 if split else r.k
            out.append(Variant(f"capacity_scan[{r.name}]", RK._capacity_scan_kernel, dict(
                slot_hist_ptr=P("i32"), slot_tot_ptr=P("i32"), counts_ptr=P("i32"), selected_ptr=P("i32"),
                NB=NB, capacity=T * r.k // r.E, E=r.E, K=r.k, SLOTS_PER_PROG=slots_per_prog,
                BLOCK_R=cfg.scan_block_r, BLOCK_E=cfg.scan_block_e, BLOCK_J=min(64, block_k),
            ), 4))
            # BLOCK_KC as kernels/routing.py::_forward computes it for the keep pass
            block_kc = max(1, min(block_k, 8192 // (cfg.block_t * cfg.block_t)))
            out.append(Variant(f"capacity_keep[{r.name}]", RK._capacity_keep_kernel, dict(
                sel_ids_ptr=P("i32"), offsets_ptr=P("i32"), ids_ptr=P("i32"), w_ptr=P("fp32"), T=T, NB=NB,
                capacity=T * r.k // r.E, E=r.E, K=r.k, BLOCK_T=cfg.block_t, BLOCK_KC=block_kc,
            ), cfg.num_warps))
            # drop_policy="position": the keep pass after a K = 1 scan (kernels/routing.py)
            out.append(Variant(f"position_keep[{r.name}]", RK._position_keep_kernel, dict(
                sel_ids_ptr=P("i32"), offsets_ptr=P("i32"), ids_ptr=P("i32"), w_ptr=P("fp32"), T=T,
                capacity=T * r.k // r.E, E=r.E, K=r.k, BLOCK_T=cfg.block_t, BLOCK_E=_np2(r.E),
            ), cfg.num_warps))
        if r.aux:
            # the per-sequence / padded balance-score sums and their backward (balance_score_sums),
            # with the launcher's tiles: BLOCK_E = next_pow2(E), BLOCK_T = min(64, 4096 // BLOCK_E)
            be = _np2(r.E)
            bt = max(1, min(64, 4096 // be))
            kinds = dict(SOFTMAX=r.softmax, SQRTSP=r.sqrtsp, HAS_MASK=True,
                         E=r.E, BLOCK_T=bt, BLOCK_E=be)
            out.append(Variant(f"balance_sums_fwd[{r.name}]", RK._balance_sums_fwd_kernel, dict(
                logits_ptr=P(r.dtype), mask_ptr=P("i8"), part_ptr=P("fp32"), T=T, S=T // 4, NC=-(-(T // 4) // bt),
                stride_lt=r.E, stride_le=1, **kinds,
            ), 4))
            out.append(Variant(f"balance_sums_bwd[{r.name}]", RK._balance_sums_bwd_kernel, dict(
                logits_ptr=P(r.dtype), mask_ptr=P("i8"), g_ptr=P("fp32"), dlogits_ptr=P(r.dtype), T=T, S=T // 4,
                stride_lt=r.E, stride_le=1, **kinds,
            ), 4))
    return out


def _np2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Permutation (kernels/permute.py: permute_metadata, _scatter, _gather)
# ---------------------------------------------------------------------------------------------


def permute_variants(dev: torch.device) -> list[Variant]:
    out = []
    # metadata: a decode-sized batch takes the fused single program, a prefill batch the block kernels
    for label, T, k, E in (("decode_T128_k4_E64", 128, 4, 64), ("prefill_T4096_k8_E256", 4096, 8, 256)):
        S = T * k
        cfg = kp.metadata_config(S, E, dev)
        for pad_to in (1, 128):
            name = f"{label},pad{pad_to}"
            if cfg.fused:
                out.append(Variant(f"metadata_fused[{name}]", PK._metadata_fused_kernel, dict(
                    ids_ptr=P("i32"), counts_ptr=P("i32"), offsets_ptr=P("i64"), rows_ptr=P("i64"), S=S, E=E,
                    pad_to=pad_to, BLOCK_S=cfg.block_s, BLOCK_E=cfg.block_e), cfg.num_warps))
                continue
            if pad_to == 1:  # the histogram and the scan do not see pad_to
                out.append(Variant(f"block_hist[{label}]", PK._block_hist_kernel, dict(
                    ids_ptr=P("i32"), hist_ptr=P("i32"), S=S, E=E, BLOCK_S=cfg.block_s, BLOCK_E=cfg.block_e),
                    cfg.num_warps))
                out.append(Variant(f"block_scan[{label}]", PK._block_scan_kernel, dict(
                    hist_ptr=P("i32"), counts_ptr=P("i32"), NB=triton.cdiv(S, cfg.block_s), E=E,
                    BLOCK_B=cfg.block_b, BLOCK_E=cfg.block_e), cfg.num_warps))
            out.append(Variant(f"block_rank[{name}]", PK._block_rank_kernel, dict(
                ids_ptr=P("i32"), prefix_ptr=P("i32"), counts_ptr=P("i32"), offsets_ptr=P("i64"), rows_ptr=P("i64"),
                S=S, E=E, pad_to=pad_to, BLOCK_S=cfg.block_s, BLOCK_E=cfg.block_e, SCAN_E=cfg.scan_e),
                cfg.num_warps))

    # row movers: (launch site, HAS_W, HAS_DOT, WRITE_OUT) for the scatter; HAS_W for the gather
    scatters = [("permute", False, False, True), ("unpermute_bwd", True, True, True),
                ("unpermute_bwd_dw_only", False, True, False), ("unpermute_bwd_dy_only", True, False, True)]
    gathers = [("unpermute", True), ("permute_bwd", False)]
    E, k, D = 256, 8, 7168  # DeepSeek-V3 experts, top-k and d_model
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        dt, elem = _TL_NAME[dtype], dtype.itemsize
        acc = tl.float64 if dtype == torch.float64 else tl.float32
        acc_name = "fp64" if dtype == torch.float64 else "fp32"
        # prefill (one program per row) and, for bf16, decode (rows split over grid axis 1)
        for T in (4096, 16) if dtype == torch.bfloat16 else (4096,):
            R = T * k
            cfg = kp.rows_config("scatter", T, k, D, elem, dev)
            for site, has_w, has_dot, write in scatters:
                out.append(Variant(f"scatter_rows[{site},{dt},T{T}]", PK._scatter_rows_kernel, dict(
                    src_ptr=P(dt), stride_st=D, stride_sd=1, rows_ptr=P("i64"), w_ptr=P("fp32" if has_w else "i64"),
                    offsets_ptr=P("i64"), counts_ptr=P("i32"), out_ptr=P(dt), stride_o=D, dot_ptr=P(dt),
                    stride_yr=D if has_dot else 0, stride_yd=1 if has_dot else 0,
                    dw_ptr=P(acc_name if has_dot else dt), T=T, K=k, E=E, D=D, num_rows=R if write else 0,
                    NSPLIT=cfg.nsplit, TAIL_ROWS=cfg.tail_rows, HAS_W=has_w, HAS_DOT=has_dot, WRITE_OUT=write,
                    ACC=acc, BLOCK_K=triton.next_power_of_2(k), BLOCK_D=cfg.block_d), cfg.num_warps))
            cfg = kp.rows_config("gather", T, k, D, elem, dev)
            for site, has_w in gathers:
                out.append(Variant(f"gather_rows[{site},{dt},T{T}]", PK._gather_rows_kernel, dict(
                    src_ptr=P(dt), stride_sr=D, stride_sd=1, rows_ptr=P("i64"), w_ptr=P("fp32" if has_w else "i64"),
                    out_ptr=P(dt), T=T, K=k, D=D, num_src_rows=R, NSPLIT=cfg.nsplit, HAS_W=has_w, ACC=acc,
                    BLOCK_K=triton.next_power_of_2(k), BLOCK_D=cfg.block_d), cfg.num_warps,
                    # the k rows of a column chunk must sit in one thread: with k spread over warps
                    # the sum over slots goes through shared memory and barriers (the Qwen3 k=8
                    # unpermute ran at 0.42-0.52 of the copy roof on an H100 that way)
                    max_barriers=0))
    # k = 16 (bf16): the widest slot tile the gather holds in one thread's registers
    k16, T = 16, 4096
    cfg = kp.rows_config("gather", T, k16, D, 2, dev)
    out.append(Variant("gather_rows[unpermute,bf16,T4096,k16]", PK._gather_rows_kernel, dict(
        src_ptr=P("bf16"), stride_sr=D, stride_sd=1, rows_ptr=P("i64"), w_ptr=P("fp32"), out_ptr=P("bf16"), T=T,
        K=k16, D=D, num_src_rows=T * k16, NSPLIT=cfg.nsplit, HAS_W=True, ACC=tl.float32, BLOCK_K=k16,
        BLOCK_D=cfg.block_d), cfg.num_warps, max_barriers=0))
    return out


# ---------------------------------------------------------------------------------------------
# Partition / concat (kernels/partition.py: _launch)
# ---------------------------------------------------------------------------------------------


def partition_variants() -> list[Variant]:
    """copy_segments packing expert-parallel all-to-all buffers: one segment per destination rank
    (EP8), one per (rank, local expert) (EP8 x 32 experts), in bf16 and fp32."""
    out = []
    for dtype, D, num_segments in ((torch.bfloat16, 7168, 8), (torch.bfloat16, 7168, 256), (torch.float32, 4096, 8)):
        dt = _TL_NAME[dtype]
        cfg = kx.select_config(D, dtype.itemsize)
        top = 1 << (num_segments.bit_length() - 1)  # TOP_STEP and SEARCH_STEPS as _launch computes them
        out.append(Variant(f"copy_segments[{dt},D{D},C{num_segments}]", XK._copy_segments_kernel, dict(
            src_ptr=P(dt), out_ptr=P(dt), seg_key_ptr=P("i64"), seg_src_ptr=P("i64"), seg_len_ptr=P("i64"),
            num_rows=32768, num_segments=num_segments, D=D, stride_src=D, stride_out=D, BLOCK_R=cfg.block_r,
            BLOCK_D=cfg.block_d, TOP_STEP=top, SEARCH_STEPS=top.bit_length()), cfg.num_warps))
    return out


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs (kernels/grouped_gemm.py: _mm, _dact, _wgrad, _combine)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Gemm:
    """What a GEMM variant's main loop must look like once compiled (see :class:`Variant`)."""

    tensor_cores: bool
    wgmma: bool
    operand_tiles: int  # tl.dot operands loaded per K step (3 for the two-accumulator GLUs)
    indirect: bool = False  # the loop's loads take their rows from a load in the same loop


def _gemm_expect(cfg: C.TileConfig, dtype: torch.dtype, tf32: bool, n_operands: int, *,
                 indirect: bool = False) -> dict:
    tensor_cores = dtype != torch.float32 or tf32
    pipelined = cfg.num_stages > 1
    wgmma = tensor_cores and cfg.BM >= 64
    return dict(
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        max_stack_bytes=None,  # epilogues may spill (GLUs hold two accumulators)...
        spill_free_loops=True,  # ...the main loop may not
        wgmma=wgmma,
        mma_sync=tensor_cores and cfg.BM < 64,
        async_loads=n_operands if pipelined else 0,
        main_loop_int_divs=0,
        # Pipelined wgmma keeps the previous step's MMA in flight while issuing the next.
        min_wgmma_wait_depth=1 if (wgmma and pipelined) else None,
        # One buffer per stage for wgmma, which reads both operands from shared memory; one fewer
        # for mma.sync and FMA dots, whose operands move to registers a step ahead. Loads whose
        # rows come from an index load of the same loop (the gathered weight gradients) are
        # double-buffered whatever num_stages: Triton's pipeliner gives the index load the
        # look-ahead and issues the dependent loads one step ahead.
        min_pipeline_buffers=(min(2, cfg.num_stages) if indirect else cfg.num_stages - (0 if wgmma else 1))
        if pipelined else 0,
    )


def _mm(name, dev, dtype, *, rows, K, N, E, act=GK.ACT_NONE, store_h=False, gather_a=False, scatter=False,
        scale=False, bias=False, topk=1, transposed_b=False, tf32=False, cfg=None) -> Variant:
    """kernels/grouped_gemm.py::_mm: A [rows (or tokens), K] @ B[e] [K, N] (2N columns for GLUs);
    ``cfg`` = the decode path's (select_decode), else the policy's."""
    dual = act in GK.GLU_ACTS
    kind = gg._kind(gg._Act(act))
    if cfg is None:
        cfg = C.select(kind, rows=rows, n=N, k=K, num_experts=E, dtype=dtype, tf32=tf32, device=dev)
    dt = _TL_NAME[dtype]
    NB = 2 * N if dual else N
    split = cfg.SPLIT_K
    # B is w [E, K, NB] contiguous, or the strided view w^T of a contiguous [E, NB, K] (backward)
    b_strides = (K * NB, 1, K) if transposed_b else (K * NB, NB, 1)
    h_cols = NB if store_h else K  # h is the pre-activation [rows, N1], else A stands in
    args = dict(
        a_ptr=P(dt), b_ptr=P(dt), c_ptr=P("fp32" if split > 1 else dt), h_ptr=P(dt), bias_ptr=P(dt),
        tiles_ptr=P("i32"), count_ptr=P("i32"), row_map_ptr=P("i64"), scale_ptr=P("fp32" if scale else dt),
        N=N, K=K, ROWS_HINT=C.rows_hint(rows, E), limit=7.0, alpha=1.702,
        stride_am=K, stride_ak=1, stride_be=b_strides[0], stride_bk=b_strides[1], stride_bn=b_strides[2],
        stride_cs=rows * N if split > 1 else 0, stride_cm=N, stride_cn=1, stride_hm=h_cols, stride_hn=1,
        stride_xe=NB if bias else N, stride_xn=1,
        ACT=act, STORE_H=store_h, GATHER_A=gather_a, SCATTER_C=scatter, SCALE=scale, HAS_BIAS=bias, TOPK=topk,
        SPLIT_K=split, PREC="tf32" if (dtype != torch.float32 or tf32) else "ieee", EVEN_K=K % cfg.BK == 0,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
    )
    tag = f"{kind}{'+oai' if act == GK.ACT_SWIGLU_OAI else ''}{'+bias' if bias else ''}"
    sk = f"k{split}" if split > 1 else ""
    return Variant(f"{name}[{tag},{dt},{cfg.BM}x{cfg.BN}x{cfg.BK}{sk}w{cfg.num_warps}s{cfg.num_stages}]",
                   GK._grouped_mm_kernel, args, **_gemm_expect(cfg, dtype, tf32, 3 if dual else 2))


def _decode_cfg(dev, kind, *, T, k, E, n, K, dtype=torch.bfloat16):
    return C.select_decode(kind, tokens=T, top_k=k, n=n, k=K, num_experts=E, dtype=dtype, tf32=False, device=dev)


def _dact(name, dev, dtype, *, rows, D, F, E, act, gather=False, scale=False, dgate=False, topk=1) -> Variant:
    """kernels/grouped_gemm.py::_dact: dH = act'(H) * (dY [rows (or tokens), D] @ w2[e]^T [D, F])."""
    kind = "dact_swiglu" if act in GK.GLU_ACTS else "dact"
    cfg = C.select(kind, rows=rows, n=F, k=D, num_experts=E, dtype=dtype, tf32=False, device=dev)
    dt = _TL_NAME[dtype]
    N1 = 2 * F if act in GK.GLU_ACTS else F
    n_tiles = triton.cdiv(F, cfg.BN * (2 if act in GK.GLU_ACTS else 1))
    args = dict(
        a_ptr=P(dt), b_ptr=P(dt), h_ptr=P(dt), dh_ptr=P(dt), tiles_ptr=P("i32"), count_ptr=P("i32"),
        row_map_ptr=P("i64"), scale_ptr=P("fp32" if scale else dt), part_ptr=P("fp32" if dgate else dt),
        N=F, K=D, ROWS_HINT=C.rows_hint(rows, E), limit=7.0, alpha=1.702,
        stride_am=D, stride_ak=1, stride_be=F * D, stride_bk=1, stride_bn=D,  # w2^T: a view of [E, F, D]
        stride_hm=N1, stride_hn=1, stride_dm=N1, stride_dn=1, stride_pm=n_tiles,
        ACT=act, GATHER_A=gather, SCALE=scale, DGATE=dgate, TOPK=topk, PREC="tf32", EVEN_K=D % cfg.BK == 0,
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
    )
    tag = kind + ("+oai" if act == GK.ACT_SWIGLU_OAI else "")
    return Variant(f"{name}[{tag},{dt},{cfg.BM}x{cfg.BN}x{cfg.BK}w{cfg.num_warps}s{cfg.num_stages}]",
                   GK._grouped_mm_dact_kernel, args, **_gemm_expect(cfg, dtype, False, 3 if act in GK.GLU_ACTS else 2))


def _wgrad(name, dev, dtype, *, rows, M, N, E, gather_a=False, gather_b=False, scale_a=False, topk=1) -> Variant:
    """kernels/grouped_gemm.py::_wgrad: per expert A_e^T [M, rows_e] @ B_e [rows_e, N]."""
    cfg = C.select("wgrad", rows=rows, n=N, k=M, num_experts=E, dtype=dtype, tf32=False, device=dev)
    dt = _TL_NAME[dtype]
    args = dict(
        a_ptr=P(dt), b_ptr=P(dt), c_ptr=P(dt), offs_ptr=P("i64"), row_map_ptr=P("i64"),
        scale_ptr=P("fp32" if scale_a else dt), R=rows, M=M, N=N, ROWS_HINT=C.rows_hint(rows, E),
        stride_ar=M, stride_ac=1, stride_br=N, stride_bc=1, stride_ce=M * N, stride_cm=N, stride_cn=1,
        GATHER_A=gather_a, GATHER_B=gather_b, SCALE_A=scale_a, TOPK=topk, PREC="tf32",
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
    )
    indirect = gather_a or gather_b or scale_a  # the row map is loaded inside the row loop
    expect = _gemm_expect(cfg, dtype, False, 2, indirect=indirect)
    if scale_a:  # the scaled A goes from registers into wgmma: only B is an async-copied operand
        expect["async_loads"] = 1
    return Variant(f"{name}[wgrad{'+scale_a' if scale_a else ''},{dt},{cfg.BM}x{cfg.BN}x{cfg.BK}w{cfg.num_warps}"
                   f"s{cfg.num_stages}]", GK._grouped_wgrad_kernel, args, **expect)


def _combine(name, dev, dtype, *, T, k, D, has_w, split=1) -> Variant:
    """kernels/grouped_gemm.py::_combine: out[t] = sum_j (w *) y[t*k + j] (y: the sum of split-K
    partials when split > 1)."""
    BT, BD, warps = C.combine_config(dev)
    dt = _TL_NAME[dtype]
    return Variant(f"{name}[combine{f',k{split}' if split > 1 else ''},{dt}]", GK._combine_kernel, dict(
        buf_ptr=P("fp32" if split > 1 else dt), w_ptr=P("fp32" if has_w else dt), ids_ptr=P("i32" if has_w else dt),
        out_ptr=P(dt), T=T, D=D, E=256, stride_bs=T * k * D if split > 1 else 0, stride_bm=D, stride_bd=1,
        stride_wt=k if has_w else 0, stride_wk=1 if has_w else 0, stride_it=k if has_w else 0,
        stride_ik=1 if has_w else 0, stride_ot=D, stride_od=1, TOPK=k, SPLIT=split, HAS_W=has_w, BT=BT, BD=BD),
        warps)


def _metadata(name, dev, *, T, k, E, BM, decode) -> Variant:
    """kernels/grouped_gemm.py::route_rows / RowSpace.tile_map: the decode path's single metadata
    program, or the tile map from the router's counts (WRITE_OFFS) / from offsets."""
    BT, warps = C.tile_map_config(dev)
    S = T * k
    MT = gg.tile_bound(S, E, BM)
    if decode:
        return Variant(f"{name}[decode_meta,T{T},k{k},E{E}]", GK._decode_meta_kernel, dict(
            ids_ptr=P("i32"), counts_ptr=P("i32"), row_map_ptr=P("i64"), offs_ptr=P("i64"), tiles_ptr=P("i32"),
            count_ptr=P("i32"), S=S, E=E, MT=MT, LOG_SP=max(1, (S - 1).bit_length()), BM=BM, SEGP=gg._segp(E),
            BT=BT), warps)
    from_counts = name.endswith("counts")
    return Variant(f"{name}[tile_map,T{T},k{k},E{E},BM{BM}]", GK._tile_map_kernel, dict(
        src_ptr=P("i32" if from_counts else "i64"), offs_ptr=P("i64"), tiles_ptr=P("i32"), count_ptr=P("i32"), R=S,
        E=E, MT=MT, FROM_COUNTS=from_counts, WRITE_OFFS=from_counts, BM=BM, SEGP=gg._segp(E), BT=BT), warps)


def _colsum(name, dev, dtype, *, N, gather=False, topk=1) -> Variant:
    """kernels/grouped_gemm.py::_colsum: per-expert column sums (bias gradients)."""
    BR, BN, warps = C.colsum_config(dev)
    dt = _TL_NAME[dtype]
    return Variant(f"{name}[colsum{'+gather' if gather else ''},{dt}]", GK._segment_colsum_kernel, dict(
        b_ptr=P(dt), c_ptr=P(dt), offs_ptr=P("i64"), row_map_ptr=P("i64"), scale_ptr=P("fp32" if gather else dt),
        R=32768, N=N, stride_br=N, stride_bc=1, stride_ce=N, stride_cn=1, GATHER_B=gather, SCALE_B=gather,
        TOPK=topk, BR=BR, BN=BN), warps)


def _dgate(name, dev, dtype, *, T, k, D, E, n_tiles, has_b2) -> Variant:
    """kernels/grouped_gemm.py::_dgate: the gate-weight gradient from the dH partials (+ b2)."""
    BS, BD, warps = C.colsum_config(dev)
    dt = _TL_NAME[dtype]
    return Variant(f"{name}[dgate{'+b2' if has_b2 else ''},{dt}]", GK._dgate_kernel, dict(
        part_ptr=P("fp32"), dout_ptr=P(dt), ids_ptr=P("i32"), b2_ptr=P(dt if has_b2 else "fp32"), out_ptr=P("fp32"),
        S=T * k, D=D, E=E, NP=n_tiles, stride_ps=n_tiles, stride_pn=1, stride_dt=D, stride_dd=1, stride_it=k,
        stride_ik=1, stride_be=D if has_b2 else n_tiles, stride_bd=1, stride_ot=k, stride_ok=1, TOPK=k,
        HAS_B2=has_b2, BS=BS, BD=BD), warps)


def gemm_variants(dev: torch.device) -> list[Variant]:
    """Every launch site of kernels/grouped_gemm.py at real model shapes; a kernel specialization
    that two shapes share (same flags, tiles and argument divisibility) is compiled once."""
    bf16, S, G, O = torch.bfloat16, GK.ACT_SWIGLU, GK.ACT_GELU, GK.ACT_SWIGLU_OAI
    out = []
    # moe_ffn, SwiGLU, training: forward and backward launches in order (_MoEFFNFn).
    #   Mixtral-8x7B prefill: E=8, k=2, D=4096, F=14336, T=4096 -> 1024 rows per expert (large tiles)
    #   DeepSeek-V3 prefill:  E=256, k=8, D=7168, F=2048, T=4096 -> 128 rows per expert (mid tiles)
    for label, T, E, k, D, F in (("mixtral", 4096, 8, 2, 4096, 14336), ("deepseek", 4096, 256, 8, 7168, 2048)):
        R = T * k
        g = dict(rows=R, E=E, topk=k)
        out += [
            _mm(f"moe_ffn.gemm1.{label}", dev, bf16, K=D, N=F, act=S, store_h=True, gather_a=True, **g),
            _mm(f"moe_ffn.gemm2.{label}", dev, bf16, K=F, N=D, scatter=True, **g),
            _dact(f"moe_ffn.dact.{label}", dev, bf16, D=D, F=F, act=S, gather=True, scale=True, dgate=True, **g),
            _mm(f"moe_ffn.dx.{label}", dev, bf16, K=2 * F, N=D, scatter=True, transposed_b=True, **g),
            _wgrad(f"moe_ffn.dw1.{label}", dev, bf16, M=D, N=2 * F, gather_a=True, **g),
            _wgrad(f"moe_ffn.dw2.{label}", dev, bf16, M=F, N=D, gather_b=True, scale_a=True, **g),
        ]
    # The fused path's small kernels (DeepSeek-V3 prefill): the tile map from the router's
    # counts, the combines (weighted forward, plain dx), the gate-weight gradient.
    T, E, k, D = 4096, 256, 8, 7168
    cfg1 = C.select("swiglu", rows=T * k, n=2048, k=D, num_experts=E, dtype=bf16, tf32=False, device=dev)
    out += [
        _metadata("moe_ffn.meta.deepseek.counts", dev, T=T, k=k, E=E, BM=cfg1.BM, decode=False),
        _combine("moe_ffn.combine.deepseek", dev, bf16, T=T, k=k, D=D, has_w=True),
        _combine("moe_ffn.dx_combine.deepseek", dev, bf16, T=T, k=k, D=D, has_w=False),
        _dgate("moe_ffn.dgate.deepseek", dev, bf16, T=T, k=k, D=D, E=E, n_tiles=triton.cdiv(2048, 128), has_b2=False),
    ]
    # GPT-OSS-120B-like (E=128, k=4, D=F=2880, not multiples of 64 or 128): biases and the clamped
    # SwiGLU, forward and backward, at 128 rows per expert.
    T, E, k, D, F = 4096, 128, 4, 2880, 2880
    g = dict(rows=T * k, E=E, topk=k)
    out += [
        _mm("moe_ffn.gemm1.gptoss", dev, bf16, K=D, N=F, act=O, store_h=True, gather_a=True, bias=True, **g),
        _mm("moe_ffn.gemm2.gptoss", dev, bf16, K=F, N=D, scatter=True, bias=True, **g),
        _dact("moe_ffn.dact.gptoss", dev, bf16, D=D, F=F, act=O, gather=True, scale=True, dgate=True, **g),
        _dgate("moe_ffn.dgate.gptoss", dev, bf16, T=T, k=k, D=D, E=E, n_tiles=triton.cdiv(F, 128), has_b2=True),
        _colsum("moe_ffn.db1.gptoss", dev, bf16, N=2 * F),
        _colsum("moe_ffn.db2.gptoss", dev, bf16, N=D, gather=True, topk=k),
    ]
    # Decode (moe_ffn with T <= 64): one metadata program, GEMM1, split-K GEMM2, the combine over
    # the splits. Row tiles by the rows an expert holds (decode_bm): DeepSeek-V3 (E=256, k=8) at
    # T = 1 and 64 (2 rows per expert: BM 16, mma.sync; a 512-slot sort), Qwen3-30B-A3B (E=128,
    # k=8, about 4 rows per expert at T = 64: BM 16; the kernels of DeepSeek's T = 64, so the
    # compile cache makes it free), Mixtral (E=8, k=2) at T = 1 (2 active experts: K split 4
    # ways), GPT-OSS at T = 16.
    for label, T, E, k, D, F, act, bias, meta in (("deepseek_T1", 1, 256, 8, 7168, 2048, S, False, True),
                                                  ("deepseek_T64", 64, 256, 8, 7168, 2048, S, False, True),
                                                  ("qwen3_T64", 64, 128, 8, 2048, 768, S, False, False),
                                                  ("mixtral_T1", 1, 8, 2, 4096, 14336, S, False, False),
                                                  ("gptoss_T16", 16, 128, 4, 2880, 2880, O, True, False)):
        g = dict(rows=T * k, E=E, topk=k)
        cfg1 = _decode_cfg(dev, "swiglu", T=T, k=k, E=E, n=F, K=D)
        cfg2 = _decode_cfg(dev, "mm", T=T, k=k, E=E, n=D, K=F)
        if meta:
            out.append(_metadata(f"decode.meta.{label}", dev, T=T, k=k, E=E, BM=cfg1.BM, decode=True))
        out += [
            _mm(f"decode.gemm1.{label}", dev, bf16, K=D, N=F, act=act, gather_a=True, bias=bias, cfg=cfg1, **g),
            _mm(f"decode.gemm2.{label}", dev, bf16, K=F, N=D, scatter=True, bias=bias, cfg=cfg2, **g),
        ]
        if cfg2.SPLIT_K > 1:
            out.append(_combine(f"decode.combine.{label}", dev, bf16, T=T, k=k, D=D, has_w=True, split=cfg2.SPLIT_K))
    # Mid-size batches (T = 1024, 2048 on DeepSeek-V3: 32 and 64 rows per expert, BM 32 / 64) and
    # top-1 routing, whose GEMM2 scales by the gate weight and writes the output directly
    for label, T, E, k in (("T1024", 1024, 256, 8), ("T2048", 2048, 256, 8)):
        out.append(_mm(f"moe_ffn.gemm1.{label}", dev, bf16, rows=T * k, E=E, topk=k, K=7168, N=2048, act=S,
                       gather_a=True))
    out.append(_mm("moe_ffn.gemm2.top1", dev, bf16, rows=4096, E=16, K=8192, N=5120, scatter=True, scale=True))
    # grouped_ffn (permuted rows), GELU: the tile map from offsets, forward with H saved, backward
    # (fp16 compiles like bf16: one launch site in fp16 for the dtype's own conversions)
    g = dict(rows=8192, E=8)
    D, F = 4096, 14336
    out += [
        _metadata("grouped_ffn.meta", dev, T=8192, k=1, E=8, BM=128, decode=False),
        _mm("grouped_ffn.gemm1", dev, bf16, K=D, N=F, act=G, store_h=True, **g),
        _mm("grouped_ffn.gemm1", dev, torch.float16, K=D, N=F, act=G, store_h=True, **g),
        _mm("grouped_ffn.gemm2", dev, bf16, K=F, N=D, **g),
        _dact("grouped_ffn.dact", dev, bf16, D=D, F=F, act=G, **g),
        _mm("grouped_ffn.dx", dev, bf16, K=F, N=D, transposed_b=True, **g),
        _wgrad("grouped_ffn.dw", dev, bf16, M=D, N=F, **g),
        _colsum("grouped_gemm.db", dev, bf16, N=D),
    ]
    out.append(_dact("grouped_ffn.dact.mid", dev, bf16, rows=8192, E=64, D=2048, F=1408, act=G))
    out.append(_dact("grouped_ffn.dact.decode", dev, bf16, rows=256, E=64, D=2048, F=1408, act=S))
    out.append(_wgrad("grouped_gemm.dw.decode", dev, bf16, rows=256, E=64, M=2048, N=1408))
    # fp32 operands: TF32 when allowed, else IEEE fp32 on the FMA units (no tensor cores)
    out.append(_mm("grouped_ffn.gemm1.tf32", dev, torch.float32, rows=8192, E=8, K=4096, N=14336, act=S,
                   store_h=True, tf32=True))
    out.append(_mm("grouped_gemm.ieee", dev, torch.float32, rows=8192, E=8, K=4096, N=4096, act=GK.ACT_RELU,
                   store_h=True))
    return out + _autotune_candidates(out)


def _autotune_candidates(variants: list[Variant]) -> list[Variant]:
    """On CUDA the launches autotune the pipeline depth (_gemm_config._candidates: the policy's
    stages, one more and one fewer where the operand buffers fit the policy's budget). The
    deepest candidate of each distinct tile config, compiled with the flags of its first launch
    site above, where its operand buffers take more than 3/4 of that budget, i.e. where an
    epilogue's scratch could push it past 227 KiB (shallower or smaller ones need less of
    everything, and the autotuner skips a candidate that runs out of resources anyway)."""
    out, seen = [], set()
    for v in variants:
        a = v.args
        if v.fn not in (GK._grouped_mm_kernel, GK._grouped_mm_dact_kernel, GK._grouped_wgrad_kernel):
            continue
        dual = v.fn is GK._grouped_mm_kernel and a["ACT"] in GK.GLU_ACTS
        elem = 4 if a["a_ptr"].dtype == "fp32" else 2
        cfg = C.TileConfig(BM=a["BM"], BN=a["BN"], BK=a["BK"], GROUP_M=a["GROUP_M"], num_warps=v.num_warps,
                           num_stages=v.num_stages, SPLIT_K=a.get("SPLIT_K", 1))
        key = (v.fn, cfg, elem, dual)
        if key in seen:
            continue
        seen.add(key)
        stages = max(C._candidates(cfg, elem, dual))
        if stages != v.num_stages and C._smem_bytes(cfg, stages, elem, dual) > C._SMEM_BUDGET * 3 // 4:
            buffers = v.min_pipeline_buffers if v.min_pipeline_buffers < v.num_stages else stages
            out.append(dataclasses.replace(v, name=f"{v.name}.autotune_s{stages}", num_stages=stages,
                                           min_pipeline_buffers=buffers))
    return out


# ---------------------------------------------------------------------------------------------
# Persistent TMA grouped GEMM (kernels/_grouped_gemm_persistent.py: mm, with
# TRITONMOE_GEMM_VARIANT=persistent)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PersistentExpect:
    """What a persistent GEMM variant must show besides a Variant's checks: at least ``tma_loads``
    TMA load and ``tma_stores`` TMA store instructions, and the epilogue's stores inside the
    innermost MMA loop when the launch fuses the tile and K loops (``fused``), outside otherwise;
    ``mma_n``: every wgmma of the kernel is ``m64n<mma_n>k16`` (the "wide" SwiGLU's one MMA per
    K step over the gate and up tiles), None: not checked."""

    tma_loads: int
    tma_stores: int
    fused: bool
    mma_n: Optional[int] = None


#: name -> PersistentExpect, filled by persistent_variants().
PERSISTENT_EXPECT: dict[str, PersistentExpect] = {}


def _persistent_mm(name, dev, dtype, *, rows, K, N, E, act=GK.ACT_NONE, store_h=False, gather_a=False, scatter=False,
                   scale=False, topk=1, transposed_b=False, variant="persistent") -> Variant:
    """The persistent kernel as kernels/grouped_gemm.py::_mm launches it through PG.mm when the
    policy (TRITONMOE_GEMM_VARIANT=persistent or wide) selects it: the policy's config, the
    launcher's own operand-access rule (PG.access) on tensors with the launch's shapes and
    strides, its epilogue split and loop fusion."""
    dual = act == GK.ACT_SWIGLU
    kind = "swiglu" if dual else ("mm" if act == GK.ACT_NONE else "mm_act")
    with mock.patch.dict(os.environ, {"TRITONMOE_GEMM_VARIANT": variant}):
        cfg = C.select(kind, rows=rows, n=N, k=K, num_experts=E, dtype=dtype, tf32=False, device=dev)
    if cfg.variant != variant:
        raise RuntimeError(f"TRITONMOE_GEMM_VARIANT={variant} did not select that variant: {cfg}")
    wide = PG.glu_wide(cfg, act)
    dt = _TL_NAME[dtype]
    NB = 2 * N if dual else N

    def meta(*shape):
        return torch.empty(*shape, device="meta", dtype=dtype)

    a = meta(rows // topk if gather_a else rows, K)
    b = meta(E, NB, K).transpose(1, 2) if transposed_b else meta(E, K, NB)
    out = meta(rows // topk if (scatter and scale) else rows, N)
    h = meta(rows, NB) if store_h else None
    acc = PG.access(a, b, out, h, n=N, dual=dual, gather_a=gather_a, scatter=scatter, capable=True, wide=wide)
    opts = PG.PersistentOptions()
    split = PG.epilogue_split(cfg.BN, wide=wide)
    fused = PG.flatten(opts, gather_a=gather_a, dual=dual)
    BM, BN, BK = cfg.BM, cfg.BN, cfg.BK
    store_box = (1, 1, BM, BN // split)
    hh = h if h is not None else out
    b_box = (1, BN, BK) if acc.b_kmajor else (1, BK, BN)
    args = dict(
        a_desc=aot.Desc(dt, (BM, BK)) if acc.a else None,
        b_desc=aot.Desc(dt, b_box) if acc.b else None,
        bu_desc=aot.Desc(dt, b_box) if acc.b and dual else None,
        c_desc=aot.Desc(dt, store_box) if acc.c else None,
        h_desc=aot.Desc(dt, store_box) if acc.h else None,
        hu_desc=aot.Desc(dt, store_box) if acc.h and dual else None,
        a_ptr=P(dt), b_ptr=P(dt), c_ptr=P(dt), h_ptr=P(dt), offs_ptr=P("i64"), tiles_ptr=P("i32"),
        count_ptr=P("i32"), row_map_ptr=P("i64"),
        scale_ptr=P("fp32" if scale else dt), R=rows, N=N, K=K, E=E, NUM_PROGS=H100_SMS,
        ROWS_HINT=C.rows_hint(rows, E), stride_am=a.stride(0), stride_ak=a.stride(1), stride_be=b.stride(0),
        stride_bk=b.stride(1), stride_bn=b.stride(2), stride_cm=out.stride(0), stride_cn=out.stride(1),
        stride_hm=hh.stride(0), stride_hn=hh.stride(1), ACT=act, STORE_H=store_h, GATHER_A=gather_a,
        SCATTER_C=scatter, SCALE=scale, TOPK=topk, PREC="tf32", EVEN_K=K % BK == 0, GLU_WIDE=wide,
        B_KMAJOR=acc.b_kmajor, EPI_SPLIT=split, FLATTEN=fused, BM=BM, BN=BN, BK=BK, GROUP_M=cfg.GROUP_M,
    )
    loads = int(acc.a) + int(acc.b) * (2 if dual else 1)
    stores = int(acc.c) + int(acc.h) * (2 if dual else 1)
    full = f"{name}[{variant},{kind},{dt},{BM}x{BN}x{BK}w{cfg.num_warps}s{cfg.num_stages}]"
    PERSISTENT_EXPECT[full] = PersistentExpect(tma_loads=loads, tma_stores=stores, fused=fused,
                                               mma_n=2 * BN if wide else None)
    return Variant(full, PGK._grouped_mm_persistent_kernel, args, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages, max_stack_bytes=0, spill_free_loops=True, wgmma=True, mma_sync=False,
                   async_loads=int(not acc.a) + int(not acc.b))


def persistent_variants(dev: torch.device) -> list[Variant]:
    """The persistent variant's launches at the Mixtral-like (d=4096, f=14336, E=8, k=2, T=16k)
    and Qwen3-30B-A3B-like (d=2048, f=768, E=128, k=8, T=32k) presets, bf16. Both presets get the
    same policy configs (>= 256 rows per expert: 128x128x64 for the two-accumulator SwiGLU GEMM1,
    128x256x64 for GEMM2 and dX, 128x128x64 with 4 stages for GELU), so the list covers each
    config and launch-site flag set once: the grouped FFN's training forward and dX, its
    inference GEMM1 (no H stores) at both presets, GELU, the fused moe_ffn's gathered GEMM1 and
    scattered GEMM2, and the "wide" SwiGLU GEMM1 (one 128x256 accumulator, wgmma n256) for
    training and inference. All must compile to wgmma with TMA operands, without a single
    spilled register, within sm90's shared memory, with no CTA barrier in the main loop (the
    tile map replaced the per-tile segment search)."""
    bf16, S = torch.bfloat16, GK.ACT_SWIGLU
    mixtral = dict(rows=16384 * 2, E=8)
    qwen3 = dict(rows=32768 * 8, E=128)
    return [
        # grouped_ffn training forward (pre-activation stored) and its dX GEMM (w1^T, K-contiguous)
        _persistent_mm("grouped_ffn.gemm1_train.mixtral", dev, bf16, K=4096, N=14336, act=S, store_h=True, **mixtral),
        _persistent_mm("grouped_ffn.gemm2.mixtral", dev, bf16, K=14336, N=4096, **mixtral),
        _persistent_mm("grouped_ffn.dx.mixtral", dev, bf16, K=2 * 14336, N=4096, transposed_b=True, **mixtral),
        _persistent_mm("grouped_ffn.gemm1_gelu_train.mixtral", dev, bf16, K=4096, N=14336, act=GK.ACT_GELU,
                       store_h=True, **mixtral),
        _persistent_mm("grouped_ffn.gemm1_train.qwen3", dev, bf16, K=2048, N=768, act=S, store_h=True, **qwen3),
        _persistent_mm("grouped_ffn.gemm2.qwen3", dev, bf16, K=768, N=2048, **qwen3),
        # inference GEMM1 (store_h=False) at both presets
        _persistent_mm("grouped_ffn.gemm1_infer.mixtral", dev, bf16, K=4096, N=14336, act=S, **mixtral),
        _persistent_mm("grouped_ffn.gemm1_infer.qwen3", dev, bf16, K=2048, N=768, act=S, **qwen3),
        # moe_ffn: token rows gathered into GEMM1 (A by cp.async), GEMM2 rows scattered to slot order
        _persistent_mm("moe_ffn.gemm1_train.mixtral", dev, bf16, K=4096, N=14336, act=S, store_h=True, gather_a=True,
                       topk=2, **mixtral),
        _persistent_mm("moe_ffn.gemm2.qwen3", dev, bf16, K=768, N=2048, scatter=True, topk=8, **qwen3),
        # "wide": gate and up in one [BK, 2*BN] TMA box and one [BM, 2*BN] accumulator
        _persistent_mm("grouped_ffn.gemm1_train.mixtral", dev, bf16, K=4096, N=14336, act=S, store_h=True,
                       variant="wide", **mixtral),
        _persistent_mm("grouped_ffn.gemm1_infer.qwen3", dev, bf16, K=2048, N=768, act=S, variant="wide", **qwen3),
    ]


def fp8_variants(dev: torch.device) -> list[Variant]:
    """kernels/fp8_gemm.py's and fp8_train.py's launch sites (tests/_aot_fp8_cases.py): the GEMMs
    with no spill at all and every operand pipelined (their FP8 MMA kind:
    test_fp8_gemms_use_e4m3_tensor_cores), the quantization kernels with no spill."""
    out = []
    for c in fp8_cases(dev):
        expect = dict(max_stack_bytes=0, spill_free_loops=True)
        if c.gemm:
            n_ops = 3 if c.args.get("SWIGLU") else 2
            expect.update(wgmma=c.wgmma, mma_sync=not c.wgmma, async_loads=n_ops, main_loop_int_divs=0,
                          min_pipeline_buffers=c.num_stages - (0 if c.wgmma and not c.a_in_registers else 1))
        out.append(Variant(c.name, c.fn, c.args, c.num_warps, c.num_stages, **expect))
    return out


def all_variants() -> list[Variant]:
    with sm90_device() as dev:
        variants = routing_variants() + permute_variants(dev) + partition_variants() + gemm_variants(dev)
        variants += persistent_variants(dev)
        variants += fp8_variants(dev)
    names = [v.name for v in variants]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"variant names must be unique: {sorted(dup)}")
    return variants


# ---------------------------------------------------------------------------------------------
# Subprocess entry point: compile and print one JSON line per variant
# ---------------------------------------------------------------------------------------------


def main(filters: list[str]) -> int:
    """Compile the variants (those whose name contains one of ``filters``, or all) in forked
    workers (:func:`aot_compile.compile_many`); one JSON line per variant, then a ``done`` line."""
    return aot.compile_many({
        v.name: (v.fn, v.args, dict(num_warps=v.num_warps, num_stages=v.num_stages, arch=ARCH,
                                    loop_facts=v.fn is PGK._grouped_mm_persistent_kernel))
        for v in all_variants() if not filters or any(f in v.name for f in filters)
    })


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

VARIANTS = {v.name: v for v in all_variants()}


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Compile every variant once, in a subprocess without TRITON_INTERPRET (this process may
    run the interpreter); name -> JSON record."""
    reason = aot.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot compile for sm_{ARCH} here: {reason}")
    try:
        return aot.run_compile_script(__file__, timeout=900)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_for_sm90(compiled, name):
    v = VARIANTS[name]
    rec = compiled[name]
    assert rec["ok"], rec["error"]
    facts = {k: rec[k] for k in ("registers", "stack_bytes", "spills", "loop_spills", "shared", "wgmma", "mma_sync",
                                 "async_loads", "main_loop_int_divs", "wgmma_wait_depth", "pipeline_buffers",
                                 "num_warps", "num_stages", "barriers", "main_loop_barriers")}
    assert rec["shared"] <= aot.SM90_MAX_SHARED, f"needs {rec['shared']} B of shared memory: {facts}"
    if v.spill_free_loops:
        assert rec["loop_spills"] == 0, f"spills registers inside its main loop: {facts}"
    if v.max_stack_bytes is not None:
        assert rec["stack_bytes"] <= v.max_stack_bytes, f"spills more than {v.max_stack_bytes} B: {facts}"
    if v.wgmma is not None:
        assert rec["wgmma"] == v.wgmma, f"wgmma expected {v.wgmma}: {facts}"
    if v.mma_sync is not None:
        assert rec["mma_sync"] == v.mma_sync, f"mma.sync expected {v.mma_sync}: {facts}"
    assert rec["async_loads"] >= v.async_loads, f"expected {v.async_loads} cp.async-pipelined loads: {facts}"
    if v.main_loop_int_divs is not None:
        assert rec["main_loop_int_divs"] == v.main_loop_int_divs, (
            f"{rec['main_loop_int_divs']} integer division/remainder instructions in the MMA loop (expected "
            f"{v.main_loop_int_divs}): a runtime divisor there (e.g. slot // TOPK with TOPK not a tl.constexpr) is "
            f"a software division every K step: {facts}")
    if v.min_wgmma_wait_depth is not None:
        assert rec["wgmma_wait_depth"] is not None and rec["wgmma_wait_depth"] >= v.min_wgmma_wait_depth, (
            f"the MMA loop waits with wgmma.wait_group {rec['wgmma_wait_depth']}, expected >= "
            f"{v.min_wgmma_wait_depth}: each step's tensor-core op must finish before the next is issued (an "
            f"operand modified in registers, e.g. a rescaled B tile, is copied to shared memory every step): {facts}")
    if v.max_barriers is not None:
        assert rec["barriers"] <= v.max_barriers, (
            f"{rec['barriers']} CTA-wide barriers (expected <= {v.max_barriers}): a reduction over an axis the "
            f"layout spreads over warps (fewer warps, or the axis kept in each thread, avoids it): {facts}")
    if v.max_main_loop_barriers is not None:
        assert rec["main_loop_barriers"] <= v.max_main_loop_barriers, (
            f"{rec['main_loop_barriers']} CTA-wide barriers in the main loop (expected <= "
            f"{v.max_main_loop_barriers}): a per-tile reduction across warps runs every step: {facts}")
    assert rec["pipeline_buffers"] >= v.min_pipeline_buffers, (
        f"the operand tiles have {rec['pipeline_buffers']} shared-memory buffers, expected >= "
        f"{v.min_pipeline_buffers} for num_stages={v.num_stages}: the loads are not pipelined that deep: {facts}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PERSISTENT_EXPECT))
def test_persistent_gemm_uses_tma_and_overlaps_the_epilogue(compiled, name):
    """Besides test_compiles_for_sm90's checks (wgmma, no spill at all, shared memory): the TMA
    instructions of the operands the launcher gives descriptors, and the epilogue's stores
    inside the fused tile/K loop (the next tile's loads overlap them) where the launch fuses."""
    rec = compiled[name]
    assert rec["ok"], rec["error"]
    want = PERSISTENT_EXPECT[name]
    facts = {k: rec[k] for k in ("tma_loads", "tma_stores", "mma_loop_stores", "registers", "shared", "mma_shapes")}
    assert rec["tma_loads"] >= want.tma_loads > 0, f"TMA loads: {facts}"
    if want.mma_n is not None:
        assert rec["mma_shapes"] == [f"m64n{want.mma_n}k16"], f"one m64n{want.mma_n}k16 wgmma kind: {facts}"
    assert rec["tma_stores"] >= want.tma_stores, f"TMA stores: {facts}"
    if want.fused:
        assert rec["mma_loop_stores"] > 0, f"the epilogue is not inside the pipelined MMA loop: {facts}"
    else:
        assert rec["mma_loop_stores"] == 0, f"stores inside the MMA loop of an unfused launch: {facts}"


#: Persistent launches at E=8 and E=128 with the same config and flags (name prefix, variant).
_E_PAIRS = [(f"grouped_ffn.{g}.mixtral[", f"grouped_ffn.{g}.qwen3[") for g in ("gemm1_train", "gemm1_infer", "gemm2")]


@pytest.mark.slow
@pytest.mark.parametrize("pair", _E_PAIRS, ids=[p[0].split("[")[0] for p in _E_PAIRS])
def test_persistent_main_loop_barriers_do_not_grow_with_experts(compiled, pair):
    """The persistent kernel reads each tile's expert and rows from the precomputed tile map
    (three scalar loads), so its main loop holds the same CTA barriers (those of the epilogue's
    shared-memory staging, fused into the loop) at 128 experts as at 8; a per-tile search over
    the E segments added a cross-warp reduction there (9-12 barriers at E=128 before, 4-6 at
    E=8)."""
    small = [n for n in PERSISTENT_EXPECT if n.startswith(pair[0]) and "[persistent," in n]
    large = [n for n in PERSISTENT_EXPECT if n.startswith(pair[1]) and "[persistent," in n]
    assert len(small) == len(large) == 1, (small, large)
    a, b = compiled[small[0]], compiled[large[0]]
    assert a["ok"] and b["ok"], (a.get("error"), b.get("error"))
    assert b["main_loop_barriers"] == a["main_loop_barriers"], (a["main_loop_barriers"], b["main_loop_barriers"])
    assert b["barriers"] == a["barriers"], (a["barriers"], b["barriers"])


FP8_GEMMS = [v.name for v in VARIANTS.values() if v.fn in (FK._fp8_grouped_mm_kernel, FK._fp8_wgrad_kernel)]


@pytest.mark.slow
@pytest.mark.parametrize("name", FP8_GEMMS)
def test_fp8_gemms_use_e4m3_tensor_cores(compiled, name):
    """Besides test_compiles_for_sm90's checks: wgmma tiles (BM >= 64) multiply e4m3 operands
    into fp32 (``wgmma...f32.e4m3.e4m3``, QGMMA); the decode tiles (BM < 64) run mma.sync, for
    which Triton converts the e4m3 tiles to f16 in registers on sm90 (the weights still stream as
    e4m3: half the bytes of bf16), with fp32 accumulation; registers fit one CTA per SM."""
    v = VARIANTS[name]
    rec = compiled[name]
    assert rec["ok"], rec["error"]
    kinds = rec["mma_types"]
    if v.wgmma:
        assert kinds == ["wgmma.f32.e4m3.e4m3"], kinds
    else:
        assert kinds and all(k.startswith("mma.f32.") and k.endswith(".f32") for k in kinds), kinds
    assert rec["stack_bytes"] == 0 and rec["registers"] * 32 * v.num_warps <= 65536, rec


def test_variants_cover_every_kernel():
    """Every kernel (``_*_kernel``) of every kernel module (``kernels/_*_kernels.py``) has a
    variant, so that a new kernel cannot be added without an offline compile check."""
    import tritonmoe.kernels as pkg

    modules = {m.name for m in pkgutil.iter_modules(pkg.__path__)
               if m.name.startswith("_") and m.name.endswith("_kernels")}
    unchecked = modules - {mod.__name__.rsplit(".", 1)[1] for mod in KERNEL_MODULES}
    assert not unchecked, f"kernel modules without compile variants (add them to KERNEL_MODULES): {sorted(unchecked)}"
    kernels = {f"{mod.__name__}.{n}": getattr(mod, n) for mod in KERNEL_MODULES for n in dir(mod)
               if n.startswith("_") and n.endswith("_kernel")}
    covered = {id(v.fn) for v in VARIANTS.values()}
    missing = sorted(name for name, fn in kernels.items() if id(fn) not in covered)
    assert not missing, f"kernels without a compile variant: {missing}"


def test_specialize_like_a_launch():
    """Argument specialization follows Triton's launcher: 1 becomes a constant, multiples of 16
    and pointers are 16-divisible, do_not_specialize arguments stay plain i32, big ints are i64."""
    names = ["x_ptr", "n", "one", "m", "big", "rows", "BLOCK"]
    params = [SimpleNamespace(name=n, is_constexpr=n == "BLOCK", do_not_specialize=n == "rows",
                              do_not_specialize_on_alignment=False, has_default=False) for n in names]
    fn = SimpleNamespace(__name__="k", params=params)  # the attributes of a JITFunction it reads
    sig, consts, attrs = aot.specialize(fn, dict(x_ptr=P("bf16"), n=4096, one=1, m=17, big=2**33, rows=32, BLOCK=64))
    assert sig == dict(x_ptr="*bf16", n="i32", one="constexpr", m="i32", big="i64", rows="i32", BLOCK="constexpr")
    assert consts == dict(one=1, BLOCK=64)
    assert set(attrs) == {(0,), (1,), (4,)}  # x_ptr, n, big; not m (17) nor rows (do_not_specialize)
    with pytest.raises(TypeError, match="no value for parameter 'BLOCK'"):
        aot.specialize(fn, dict(x_ptr=P("bf16"), n=1, one=1, m=1, big=1, rows=1))


def test_sass_spill_and_loop_parsing():
    """Local-memory instructions are counted, and those between a backward branch and its target
    are in a loop; the trailing self-branch (the trap) is not a loop."""
    sass = """
        /*0000*/                   STL [R1+0x4], R22 ;
        /*0010*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0020*/              @!P0 LDL.LU R3, [R1+0x4] ;
        /*0030*/               @P1 BRA 0x10 ;
        /*0040*/                   LDL R4, [R1] ;
        /*0050*/                   EXIT ;
        /*0060*/                   BRA 0x60;
    """
    assert aot._local_memory_ops(sass) == (3, 1)
    ttgir = "\n".join([
        "%a = ttg.async_copy_global_to_local %p, %s mask %m : tensor<..> loc(#loc7)",
        "%b = ttg.async_copy_global_to_local %q, %t mask %m : tensor<..> loc(#loc8)",
        "  %c = ttg.async_copy_global_to_local %p, %s mask %m : tensor<..> loc(#loc7)",
    ])
    assert aot._async_loads(ttgir) == 2


def test_main_loop_parsing():
    """The MMA loop of a persistent GEMM is its K loop: integer divisions there count (predicated
    or not; float division does not), once-per-tile divisions and the tile loop's final
    wgmma.wait_group 0 do not. Multi-buffered tiles are [buffers, rows, cols] allocations; index
    vectors and register-staged operands (2-D) are not."""
    ptx = "\n".join([
        "\tdiv.s32 \t%r2, %r3, %r4;",
        "$L__BB0_1:",
        "\tdiv.s64 \t%rd1, %rd2, %rd3;",
        "$L__BB0_2:                              // =>This Inner Loop Header: Depth=2",
        "\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r10}, %rd5, %rd6, %p9, 1, 1, 1, 1;",
        "\twgmma.wait_group.sync.aligned 1;",
        "\t@%p1 div.u32 \t%r5, %r6, %r7;",
        "\trem.s64 \t%rd8, %rd9, %rd10;",
        "\tdiv.rn.f32 \t%f1, %f2, %f3;",
        "\t@%p2 bra \t$L__BB0_2;",
        "\twgmma.wait_group.sync.aligned 0;",
        "\t@%p3 bra \t$L__BB0_1;",
        "\tret;",
    ])
    assert aot.ptx_loops(ptx) == [(3, 9), (1, 11)]
    assert aot.main_loop_facts(ptx) == (2, 1)
    assert aot.main_loop_facts(ptx.replace("aligned 1;", "aligned 0;")) == (2, 0)
    assert aot.main_loop_facts("\tdiv.s32 \t%r2, %r3, %r4;\n\tret;") == (0, None)  # no MMA
    ttgir = "\n".join([
        "%a = ttg.local_alloc : () -> !ttg.memdesc<3x128x64xbf16, #shared, #smem, mutable> loc(#loc1)",
        "%s = ttg.local_alloc : () -> !ttg.memdesc<1x64xi64, #shared, #smem, mutable> loc(#loc2)",
        "%b = ttg.local_alloc : () -> !ttg.memdesc<2x64x256xbf16, #shared1, #smem, mutable> loc(#loc3)",
        "%c = ttg.local_alloc %x : (tensor<64x256xbf16, #blocked>) -> !ttg.memdesc<64x256xbf16, #shared1, #smem>",
    ])
    assert aot.pipeline_buffers(ttgir) == 2
    assert aot.pipeline_buffers(ttgir.splitlines()[3]) == 0


def test_sass_main_loop_spills():
    """In a kernel with MMAs, only spills in the MMA loop count as main-loop spills (not those of
    a persistent kernel's epilogue inside its tile loop)."""
    sass = """
        /*0000*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   STL [R1+0x8], R3 ;
        /*0030*/               @P1 BRA 0x10 ;
        /*0040*/                   STL [R1+0x4], R22 ;
        /*0050*/                   LDL R22, [R1+0x4] ;
        /*0060*/               @P2 BRA 0x0 ;
        /*0070*/                   EXIT ;
    """
    assert aot._local_memory_ops(sass) == (3, 1)


def test_specialize_descriptors_and_none():
    """A tensor descriptor specializes to its element type and box, None to a constexpr, as
    Triton's launcher does."""
    names = ["desc", "opt", "n"]
    params = [SimpleNamespace(name=n, is_constexpr=False, do_not_specialize=False,
                              do_not_specialize_on_alignment=False, has_default=False) for n in names]
    fn = SimpleNamespace(__name__="k", params=params)
    sig, consts, attrs = aot.specialize(fn, dict(desc=aot.Desc("bf16", (1, 64, 128)), opt=None, n=32))
    assert sig == dict(desc="tensordesc<bf16[1, 64, 128]>", opt="constexpr", n="i32")
    assert consts == dict(opt=None) and set(attrs) == {(2,)}


def test_sass_mma_loop_stores():
    """The innermost loop holding tensor-core MMAs is found, and its global stores counted; a
    wider range holding the same MMAs (an out-of-line retry branch) does not count."""
    sass = """
        /*0000*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0020*/              @!P0 BRA 0x10 ;
        /*0030*/                   STG.E.128 desc[UR4][R2.64], R8 ;
        /*0040*/                   EXIT ;
        /*0050*/                   BRA 0x0 ;
    """
    assert aot._mma_loop_stores(sass) == 0
    fused = sass.replace("/*0020*/              @!P0 BRA 0x10 ;", "/*0020*/         UTMASTG.4D [UR4], [UR6] ;")
    fused = fused.replace("/*0040*/                   EXIT ;", "/*0040*/              @!P0 BRA 0x10 ;")
    assert aot._mma_loop_stores(fused) == 2
    assert aot._mma_loop_stores("/*0000*/ EXIT ;") is None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
