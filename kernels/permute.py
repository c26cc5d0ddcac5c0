"""Token permutation and unpermutation on Triton: the launchers of ``permute`` and ``unpermute``.

:func:`permute` and :func:`unpermute` have exactly the signatures and results of
:func:`tritonmoe.reference.permute` / :func:`tritonmoe.reference.unpermute` (metadata bit-exact,
permuted rows bit-exact, the weighted combine accumulated per token in fp32, fp64 for fp64) and
are registered in :data:`tritonmoe.backends.OPS`. They assume validated arguments (the
public :func:`tritonmoe.permute` / :func:`tritonmoe.unpermute` check them).

Building blocks, usable on their own (meant for the expert-parallel and pipelining code):

* :func:`permute_metadata` - ids -> :class:`PermuteInfo` on the device, deterministic, no host sync.
* :func:`permute_rows` - the autograd-capable permutation of x into a buffer of a given row count;
  with ``num_rows`` given (e.g. the static bound :func:`max_permuted_rows`) permutation needs no
  host synchronization at all.
* :func:`scatter_rows` / :func:`gather_rows` - the raw (not autograd) row movers, with ``out=``.

Host synchronization: :func:`permute` with ``num_rows=None`` must return x_perm with exactly
R = ``expert_offsets[E]`` rows, and R depends on the ids (slots with id -1 and the padding), so it
reads R back once after the metadata kernels (see :func:`_read_num_rows`). Nothing else
synchronizes. **The sync-free path** (the one MoELayer's expert path calls)::

    x_perm, info = permute(x, topk_ids, E, pad_to=p, num_rows=max_permuted_rows(T, k, E, p))

returns a buffer of the static worst-case size with zero rows past R: the grouped GEMM contract
treats rows at or past offsets[E] as zero, :func:`unpermute` reads only routed rows (the public
unpermute accepts such a buffer; grouped_gemm's value validation, when on, still insists on
exactly R rows), and with ``pad_to == 1`` and no id -1 the bound is exactly R = T * k.
(``permute_metadata`` + ``permute_rows(x, info, num_rows=...)`` are the same two steps.)

Config: every tile size, warp count and grid split is chosen in :func:`metadata_config` and
:func:`rows_config` below (a tuned table's entry for the shape first, targets ``permute.metadata``
/ ``permute.scatter`` / ``permute.gather``); tests override them with
``tritonmoe.kernels.config.override`` (old spelling: :func:`config_override`). These kernels are
memory bound and their configs are computed, not autotuned, so ``TRITONMOE_AUTOTUNE`` does not
affect them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Iterator

import torch
import triton.language as tl

from tritonmoe.core import validation as V
from tritonmoe.core.types import PermuteInfo, max_permuted_rows

from . import config as CF
from ._host import cdiv, device_ctx, next_power_of_2
from ._permute_kernels import (
    _block_hist_kernel,
    _block_rank_kernel,
    _block_scan_kernel,
    _gather_rows_kernel,
    _metadata_fused_kernel,
    _scatter_rows_kernel,
)

__all__ = [
    "permute",
    "unpermute",
    "permute_metadata",
    "permute_rows",
    "scatter_rows",
    "gather_rows",
    "max_permuted_rows",
    "MetadataConfig",
    "RowsConfig",
    "metadata_config",
    "rows_config",
    "rows_key",
    "config_override",
]


# ---------------------------------------------------------------------------------------------
# Config policy (the one place where tile sizes, warps and grid splits are chosen)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MetadataConfig:
    """Launch parameters of the metadata kernels.

    fused: one program computes everything (one launch; for small S * E) instead of the three
        block kernels (histogram, scan, rank).
    block_s: slots per block (per loop step when fused).
    block_e: experts per tile (the one-hot tiles are [block_s, block_e]).
    block_b: blocks per step of the scan over the block histograms.
    scan_e: counts per step when a rank program sums the padded counts of earlier experts.
    num_warps: warps of every metadata program.
    """

    fused: bool
    block_s: int
    block_e: int
    block_b: int
    num_warps: int
    scan_e: int = 1024


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """Launch parameters of a row mover (scatter: permute forward / unpermute backward; gather:
    unpermute forward / permute backward).

    block_d: columns per program step; rows wider than that are done in a loop.
    nsplit: programs per row along d (grid axis 1); each takes every nsplit-th chunk.
    num_warps: warps per program.
    tail_rows: rows per "tail" program of the scatter (zeroing rows at or past offsets[E]).
    """

    block_d: int
    nsplit: int
    num_warps: int
    tail_rows: int = 256


CF.register("permute.metadata", MetadataConfig, probe=MetadataConfig(True, 16, 16, 16, 1),
            doc="permute metadata kernels (metadata_config)")
CF.register("permute.scatter", RowsConfig, probe=RowsConfig(16, 1, 1), doc="permute's row scatter (rows_config)")
CF.register("permute.gather", RowsConfig, probe=RowsConfig(16, 1, 1), doc="unpermute's row gather (rows_config)")


@contextlib.contextmanager
def config_override(*, metadata: dict | None = None, scatter: dict | None = None, gather: dict | None = None) -> Iterator[None]:
    """Override fields of the chosen configs inside a block (for tests), e.g.
    ``config_override(metadata={"fused": False, "block_s": 16})``. Scoped to the block and the
    current context; nothing global is modified. Old spelling of
    ``tritonmoe.kernels.config.override("permute.metadata", fused=False, block_s=16)`` (and
    ``"permute.scatter"`` / ``"permute.gather"``). Deprecated."""
    CF.deprecated("permute.config_override(metadata=..., ...)", 'override("permute.metadata", **fields)')
    with contextlib.ExitStack() as stack:
        for kind, fields in (("metadata", metadata), ("scatter", scatter), ("gather", gather)):
            if fields:
                stack.enter_context(CF.override(f"permute.{kind}", **fields))
        yield


def _choose(target: str, device: torch.device, exact: dict, bucket: int, heuristic):
    """Table entry (else ``heuristic``), then an override; the choice is noted for recordings."""
    tbl = CF.table_for(device)
    cfg = tbl.lookup(target, exact, bucket) if tbl is not None else None
    source = "table" if cfg is not None else "heuristic"
    if cfg is None:
        cfg = heuristic
    cfg, forced = CF.resolve(target, cfg)
    source = "override" if forced else source
    CF.note(target, exact, cfg, source, bucket=bucket)
    return cfg


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def metadata_config(num_slots: int, num_experts: int, device: torch.device) -> MetadataConfig:
    """Metadata launch parameters for S = T * k slots and E experts.

    GPU: the fused single program walks S twice per chunk of experts, so it only wins while S * E
    is small and launch latency (~2-3 us per kernel) dominates: up to 2^15 slot-experts (e.g.
    T = 128, k = 4, E = 64), with [128, 32] one-hot tiles at 4 warps. Above that the three block
    kernels spread the work over cdiv(S, 256) * cdiv(E, 32) programs with [256, 32] tiles at 8
    warps (32 int32 per thread; the rank kernel spills 8 bytes outside its loop on Triton 3.9,
    the scan 8 bytes inside its loop on 3.6, see tests/test_aot_compile.py); the scan runs one program per 32 experts over
    [block_b <= 128, 32] tiles of the [NB, E] histograms (T = 4096, k = 8, E = 256: 128 blocks, one
    step).
    Interpreter: whole-tile numpy ops are cheap and programs run one at a time, so one fused
    program with large tiles.
    """
    E_pow2 = next_power_of_2(max(num_experts, 1))
    nb_pow2 = next_power_of_2(cdiv(max(num_slots, 1), 256))
    if device.type == "cuda":
        if num_slots * num_experts <= 1 << 15:
            cfg = MetadataConfig(True, 128, min(32, E_pow2), 16, 4)
        else:
            cfg = MetadataConfig(False, 256, min(32, E_pow2), min(128, nb_pow2), 8)
    else:
        block_s = min(256, next_power_of_2(max(num_slots, 1)))
        cfg = MetadataConfig(True, block_s, min(64, E_pow2), min(256, nb_pow2), 4)
    return _choose("permute.metadata", device, {"E": int(num_experts)}, int(num_slots), cfg)


def gather_block_d(top_k: int, d: int, elem_size: int) -> int:
    """Columns per step of the gather (see :func:`rows_config`): the [next_pow2(k), block_d] fp32
    tile is at most 8K elements, and block_d at most 8 KiB of the row."""
    block_k = next_power_of_2(max(top_k, 1))
    return min(next_power_of_2(max(d, 1)), max(16, 8192 // block_k), max(16, 8192 // elem_size))


def rows_config(kind: str, num_tokens: int, top_k: int, d: int, elem_size: int, device: torch.device) -> RowsConfig:
    """Row-mover launch parameters for ``kind`` "scatter" or "gather".

    Scatter programs read a chunk of one token's row once and store it to k rows: block_d is 4 KiB
    of the row (2048 bf16, 1024 fp32 columns), i.e. two 16-byte vectors per thread at 4 warps.
    Gather programs hold a [next_pow2(k), block_d] fp32 tile: block_d is capped so the tile is
    at most 8K elements, e.g. 1024 columns for k = 8. Their warps lie along the columns only: one
    warp covers 32 threads x 16 bytes = 512 bytes of a row, so at most block_d * elem_size / 512
    warps; more would put slots of the same column in different warps, and the sum over slots
    would go through shared memory with a barrier per chunk (the 8 warps this had for k = 8 bf16
    did that: 10 barriers per program, and 0.42-0.52 of the copy roof for the Qwen3-like
    unpermute on an H100 against 0.92-0.96 at Mixtral's k = 2). Both split a row
    over grid axis 1 only when there are too few tokens to fill the GPU (fewer than 4 programs per
    SM), and loop over the remaining chunks of the row otherwise.
    """
    d_pow2 = next_power_of_2(max(d, 1))
    if kind == "scatter":
        block_d = min(d_pow2, max(16, 4096 // elem_size))
        num_warps = max(1, min(8, block_d * elem_size // 1024))
    elif kind == "gather":
        block_k = next_power_of_2(max(top_k, 1))
        block_d = gather_block_d(top_k, d, elem_size)
        num_warps = max(1, min(8, block_k * block_d // 1024, block_d * elem_size // 512))
    else:
        raise ValueError(f"rows_config kind={kind!r}; use 'scatter' or 'gather'")
    chunks = cdiv(max(d, 1), block_d)
    nsplit = min(chunks, max(1, cdiv(4 * _sms(device), max(num_tokens, 1))))
    cfg = RowsConfig(block_d, nsplit, num_warps)
    return _choose(f"permute.{kind}", device, rows_key(top_k, d, elem_size), int(num_tokens), cfg)


def rows_key(top_k: int, d: int, elem_size: int) -> dict:
    """Exact fields of a ``permute.scatter`` / ``permute.gather`` table key (the bucket is T)."""
    return {"k": int(top_k), "D": int(d), "elem": int(elem_size)}


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _acc_tl(dtype: torch.dtype):
    """Accumulation dtype of the kernels: fp64 for fp64 data, fp32 otherwise."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _read_num_rows(info: PermuteInfo) -> int:
    """R = expert_offsets[E], needed on the host to allocate x_perm with exactly R rows."""
    if info.slot_rows.numel() == 0:
        return 0  # nothing routed and nothing padded (counts are all zero): no sync needed
    # Host sync (the only one of permute): R depends on how many slots are routed and how much
    # padding they need, and the contract returns x_perm with exactly R rows.
    return int(info.expert_offsets[-1])


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def permute_metadata(topk_ids: torch.Tensor, num_experts: int, pad_to: int = 1) -> PermuteInfo:
    """Routing metadata of a permutation, computed on the device without host synchronization.

    Args:
        topk_ids: [T, k] integer ids in [-1, E) (validated by the caller; ids outside are treated
            as -1 and never read out of bounds).
        num_experts: E >= 1.
        pad_to: each expert's segment is padded up to a multiple of this.

    Returns: :class:`PermuteInfo` with ``counts`` int32 [E], ``expert_offsets`` int64 [E+1]
    (padded segment starts, offsets[E] = R) and ``slot_rows`` int64 [T, k] (-1 for id -1), equal
    to :func:`tritonmoe.reference.permute`'s. Deterministic: a fixed-order scan, no atomics.
    """
    T, K = topk_ids.shape
    E = num_experts
    S = T * K
    dev = topk_ids.device
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    offsets = torch.empty(E + 1, dtype=torch.int64, device=dev)
    rows = torch.empty(T, K, dtype=torch.int64, device=dev)
    if S == 0:
        counts.zero_()
        offsets.zero_()
        return PermuteInfo(expert_offsets=offsets, slot_rows=rows, counts=counts, num_tokens=T, pad_to=pad_to)
    ids = topk_ids.contiguous()
    cfg = metadata_config(S, E, dev)
    with device_ctx(dev):
        if cfg.fused:
            _metadata_fused_kernel[(1,)](
                ids, counts, offsets, rows, S, E, pad_to,
                BLOCK_S=cfg.block_s, BLOCK_E=cfg.block_e, num_warps=cfg.num_warps,
            )
        else:
            nb = cdiv(S, cfg.block_s)
            n_ec = cdiv(E, cfg.block_e)
            hist = torch.empty(nb, E, dtype=torch.int32, device=dev)
            _block_hist_kernel[(nb, n_ec)](
                ids, hist, S, E, BLOCK_S=cfg.block_s, BLOCK_E=cfg.block_e, num_warps=cfg.num_warps
            )
            _block_scan_kernel[(n_ec,)](
                hist, counts, nb, E, BLOCK_B=cfg.block_b, BLOCK_E=cfg.block_e, num_warps=cfg.num_warps
            )
            _block_rank_kernel[(nb, n_ec)](
                ids, hist, counts, offsets, rows, S, E, pad_to,
                BLOCK_S=cfg.block_s, BLOCK_E=cfg.block_e, SCAN_E=cfg.scan_e, num_warps=cfg.num_warps,
            )
    return PermuteInfo(expert_offsets=offsets, slot_rows=rows, counts=counts, num_tokens=T, pad_to=pad_to)


# ---------------------------------------------------------------------------------------------
# Raw row movers (no autograd)
# ---------------------------------------------------------------------------------------------


def _scatter(
    src_TD: torch.Tensor,
    slot_rows: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    out: torch.Tensor | None,
    weights_TK: torch.Tensor | None = None,
    dot_RD: torch.Tensor | None = None,
    tail: bool = True,
) -> torch.Tensor | None:
    """Launch the scatter kernel. Writes every row of ``out`` (if given) and returns the fp32/fp64
    row dot products [T, K] with ``dot_RD`` when given (else None). ``tail=False`` when out is
    known to have exactly R rows (skips the programs that zero rows at or past offsets[E])."""
    T, D = src_TD.shape
    K = slot_rows.shape[1]
    E = counts.shape[0]
    dev = src_TD.device
    write = out is not None
    # Rows a slot may touch: out's (written), else dot_RD's (read); slots outside are skipped.
    num_rows = out.shape[0] if write else (dot_RD.shape[0] if dot_RD is not None else 0)
    fp64 = src_TD.dtype == torch.float64 or (dot_RD is not None and dot_RD.dtype == torch.float64)
    acc_torch = torch.float64 if fp64 else torch.float32
    elem = max(src_TD.element_size(), dot_RD.element_size() if dot_RD is not None else 1)
    cfg = rows_config("scatter", T, K, D, elem, dev)
    n_tail = cdiv(num_rows, cfg.tail_rows) if (write and tail) else 0
    n_pad = E if write else 0
    grid = (T + n_pad + n_tail, cfg.nsplit)
    if D == 0 or grid[0] == 0:
        return torch.zeros(T, K, dtype=acc_torch, device=dev) if dot_RD is not None else None
    rows = slot_rows.contiguous()
    w = weights_TK.contiguous() if weights_TK is not None else rows
    dw = torch.empty(cfg.nsplit, T, K, dtype=acc_torch, device=dev) if dot_RD is not None else None
    dummy = src_TD  # stands in for the pointers a constexpr flag switches off
    with device_ctx(dev):
        _scatter_rows_kernel[grid](
            src_TD, src_TD.stride(0), src_TD.stride(1),
            rows, w, offsets, counts,
            out if write else dummy, D,
            dot_RD if dot_RD is not None else dummy,
            dot_RD.stride(0) if dot_RD is not None else 0,
            dot_RD.stride(1) if dot_RD is not None else 0,
            dw if dw is not None else dummy,
            T, K, E, D, num_rows, cfg.nsplit, cfg.tail_rows,
            HAS_W=weights_TK is not None, HAS_DOT=dot_RD is not None, WRITE_OUT=write,
            ACC=tl.float64 if fp64 else tl.float32,
            BLOCK_K=next_power_of_2(max(K, 1)), BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
        )
    if dw is None:
        return None
    return dw[0] if cfg.nsplit == 1 else dw.sum(0)  # fixed-order sum of the per-split partials


def scatter_rows(
    src_TD: torch.Tensor,
    info: PermuteInfo,
    weights_TK: torch.Tensor | None = None,
    *,
    num_rows: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[slot_rows[t, j]] = src[t] (times weights[t, j], computed in fp32, if given); every row
    no slot owns (padding, and rows at or past expert_offsets[E]) is written as zeros. No autograd.

    ``out`` (contiguous [N, d], e.g. a reused buffer) or ``num_rows`` N gives the row count;
    default R (one host sync). N must be at least R: pass :func:`max_permuted_rows` when R is not
    known on the host.
    """
    T, D = src_TD.shape
    exact = out is None and num_rows is None
    if out is None:
        n = _read_num_rows(info) if num_rows is None else num_rows
        out = torch.empty(n, D, dtype=src_TD.dtype, device=src_TD.device)
    elif out.dim() != 2 or not out.is_contiguous() or out.shape[1] != D:
        raise ValueError(f"out must be a contiguous [N, {D}] tensor, got shape {tuple(out.shape)}")
    _scatter(src_TD, info.slot_rows, info.expert_offsets, info.counts, out, weights_TK, tail=not exact)
    return out


def _gather(
    src_RD: torch.Tensor, slot_rows: torch.Tensor, weights_TK: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """Launch the gather kernel into ``out`` (contiguous [T, d])."""
    rows = slot_rows.contiguous()
    T, K = rows.shape
    D = src_RD.shape[1]
    if T == 0 or D == 0:
        return out
    dev = src_RD.device
    cfg = rows_config("gather", T, K, D, src_RD.element_size(), dev)
    w = weights_TK.contiguous() if weights_TK is not None else rows
    with device_ctx(dev):
        _gather_rows_kernel[(T, cfg.nsplit)](
            src_RD, src_RD.stride(0), src_RD.stride(1), rows, w, out,
            T, K, D, src_RD.shape[0], cfg.nsplit,
            HAS_W=weights_TK is not None, ACC=_acc_tl(src_RD.dtype),
            BLOCK_K=next_power_of_2(max(K, 1)), BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
        )
    return out


def gather_rows(
    src_RD: torch.Tensor,
    info: PermuteInfo,
    weights_TK: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum over routed j of (weights[t, j] *) src[slot_rows[t, j]], accumulated in fp32
    (fp64 for fp64 src), written in ``out``'s dtype (default src's). No atomics, no autograd.
    ``out``: an optional contiguous [T, d] buffer."""
    T = info.slot_rows.shape[0]
    D = src_RD.shape[1]
    if out is None:
        out = torch.empty(T, D, dtype=src_RD.dtype, device=src_RD.device)
    elif not out.is_contiguous() or tuple(out.shape) != (T, D):
        raise ValueError(f"out must be a contiguous [{T}, {D}] tensor, got shape {tuple(out.shape)}")
    return _gather(src_RD, info.slot_rows, weights_TK, out)


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


class _PermuteRows(torch.autograd.Function):
    """x [T, d] -> x_perm [N, d]; backward: d(x)[t] = sum over routed j of d(x_perm)[slot_rows[t, j]]
    (a gather, fp32 accumulation, deterministic)."""

    @staticmethod
    def forward(ctx, x_TD, slot_rows, offsets, counts, num_rows: int, exact: bool):
        out = torch.empty(num_rows, x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device)
        _scatter(x_TD, slot_rows, offsets, counts, out, tail=not exact)
        ctx.save_for_backward(slot_rows, offsets, counts)
        ctx.x_dtype = x_TD.dtype
        return out

    @staticmethod
    def backward(ctx, g_ND):
        if torch.is_grad_enabled():  # create_graph: the same gather as an unpermute with unit weights, recorded
            slot_rows, offsets, counts = ctx.saved_tensors
            ones = torch.ones(slot_rows.shape, dtype=torch.float32, device=g_ND.device)
            return _UnpermuteRows.apply(g_ND, ones, slot_rows, offsets, counts), None, None, None, None, None
        slot_rows = ctx.saved_tensors[0]
        T = slot_rows.shape[0]
        dx = torch.empty(T, g_ND.shape[1], dtype=ctx.x_dtype, device=g_ND.device)
        return _gather(g_ND, slot_rows, None, dx), None, None, None, None, None, None, None, None, None


class _UnpermuteRows(torch.autograd.Function):
    """y_perm [N, d], w [T, k] -> out [T, d]; backward: d(y_perm)[slot_rows[t, j]] = w[t, j] *
    d(out)[t] (other rows zero) and d(w)[t, j] = <d(out)[t], y_perm[slot_rows[t, j]]> (fp32), from
    one scatter pass."""

    @staticmethod
    def forward(ctx, y_RD, w_TK, slot_rows, offsets, counts):
        out = torch.empty(slot_rows.shape[0], y_RD.shape[1], dtype=y_RD.dtype, device=y_RD.device)
        _gather(y_RD, slot_rows, w_TK, out)
        ctx.save_for_backward(y_RD, w_TK, slot_rows, offsets, counts)
        return out

    @staticmethod
    def backward(ctx, g_TD):
        y_RD, w_TK, slot_rows, offsets, counts = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the same products, recorded (double backward exact)
            return _unpermute_backward_recorded(ctx, g_TD, y_RD, w_TK, slot_rows, offsets, counts)
        need_dy, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = torch.empty_like(y_RD, memory_format=torch.contiguous_format) if need_dy else None
        dw = None
        if need_dy or need_dw:
            dw = _scatter(
                g_TD, slot_rows, offsets, counts, dy, weights_TK=w_TK, dot_RD=y_RD if need_dw else None
            )
        if dw is not None:
            dw = dw.to(w_TK.dtype)
        return dy, dw, None, None, None


def _unpermute_backward_recorded(ctx, g_TD, y_RD, w_TK, slot_rows, offsets, counts):
    """:class:`_UnpermuteRows`'s backward in recorded ops: d(y_perm) = permute(d(out)) times each
    row's weight (the permute kernel, itself twice differentiable), d(w)[t, j] =
    <d(out)[t], y_perm[slot_rows[t, j]]> (fp32; fp64 for fp64)."""
    N = y_RD.shape[0]
    acc = torch.float64 if y_RD.dtype == torch.float64 else torch.float32
    rows = slot_rows.long()
    routed = (rows >= 0) & (rows < N)
    safe = torch.where(routed, rows, torch.full_like(rows, N))
    dy = dw = None
    if ctx.needs_input_grad[0]:
        p = _PermuteRows.apply(g_TD, slot_rows, offsets, counts, N, False)
        w_row = torch.zeros(N + 1, dtype=acc, device=y_RD.device).index_put(
            (safe.reshape(-1),), w_TK.to(acc).reshape(-1))
        dy = (p.to(acc) * w_row[:N, None]).to(y_RD.dtype)
    if ctx.needs_input_grad[1]:
        y_ext = torch.cat([y_RD.to(acc), y_RD.new_zeros(1, y_RD.shape[1], dtype=acc)])
        dw = (g_TD.to(acc).unsqueeze(1) * y_ext[safe]).sum(-1).to(w_TK.dtype)
    return dy, dw, None, None, None


# ---------------------------------------------------------------------------------------------
# The ops (same signatures as tritonmoe.reference)
# ---------------------------------------------------------------------------------------------


def permute_rows(x_TD: torch.Tensor, info: PermuteInfo, *, num_rows: int | None = None) -> torch.Tensor:
    """Gather x rows into a permuted buffer described by ``info`` (from :func:`permute_metadata`),
    autograd-capable.

    Returns [N, d] with x_perm[slot_rows[t, j]] == x[t] bit-exactly and every other row zero. N =
    ``num_rows`` if given, which must be at least R (e.g. :func:`max_permuted_rows`; then no
    host sync), else R read back from the device (one sync).
    """
    exact = num_rows is None
    if exact:
        num_rows = _read_num_rows(info)
    else:
        bound = max_permuted_rows(info.num_tokens, info.top_k, info.num_experts, info.pad_to)
        if not V.is_int(num_rows):
            raise TypeError(f"num_rows must be an int or None, got {type(num_rows).__name__}")
        if num_rows < bound:
            raise ValueError(
                f"num_rows={num_rows!r} may be smaller than R; without reading R from the device only "
                f"num_rows >= max_permuted_rows(T, k, E, pad_to) = {bound} is safe. Pass that, or None"
            )
    return _PermuteRows.apply(x_TD, info.slot_rows, info.expert_offsets, info.counts, num_rows, exact)


def permute(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int, *, pad_to: int = 1, num_rows: int | None = None
) -> tuple[torch.Tensor, PermuteInfo]:
    """Triton :func:`tritonmoe.reference.permute`: gather token rows into expert-grouped order.

    Metadata on the device (:func:`permute_metadata`), then one scatter kernel that reads each
    token row once and writes its k rows and the zero padding rows.

    ``num_rows=None``: x_perm has exactly R rows, which costs one host sync (R is read back
    after the metadata kernels). ``num_rows=N`` with N >= :func:`max_permuted_rows` (T, k, E,
    pad_to): x_perm has N rows, rows past R are zero, and nothing synchronizes (the layer's
    path: every downstream op treats rows at or past ``expert_offsets[E]`` as zero).
    """
    info = permute_metadata(topk_ids_TK, num_experts, pad_to)
    if num_rows is not None:
        return permute_rows(x_TD, info, num_rows=num_rows), info
    x_perm = _PermuteRows.apply(x_TD, info.slot_rows, info.expert_offsets, info.counts, _read_num_rows(info), True)
    return x_perm, info


def unpermute(y_perm_RD: torch.Tensor, info: PermuteInfo, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Triton :func:`tritonmoe.reference.unpermute`: out[t] = sum over routed j of
    topk_weights[t, j] * y_perm[slot_rows[t, j]], accumulated per token in fp32 (fp64 for fp64),
    in y_perm's dtype. No atomics; no host sync."""
    return _UnpermuteRows.apply(y_perm_RD, topk_weights_TK, info.slot_rows, info.expert_offsets, info.counts)
