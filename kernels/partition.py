"""Partition/concat launcher: :func:`copy_segments`, with the signature of
:func:`tritonmoe.reference.copy_segments`.

It packs a micro-op's per-destination chunks into one contiguous all-to-all send buffer and
unpacks a receive buffer into the layout the experts need, in one launch instead of one copy per
chunk. The kernel is in ``_partition_kernels.py``.

Config policy: a segment copy is bandwidth-bound and has no reduction, so one heuristic tile
(:func:`select_config`) is used everywhere; nothing is autotuned (``TRITONMOE_AUTOTUNE`` has
nothing to switch off here). Tests pin a tile with
``tritonmoe.kernels.config.override("partition", cfg)`` (old spelling: :func:`override_config`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from . import config as CF
from ._host import cdiv, next_power_of_2
from ._partition_kernels import _copy_segments_kernel

__all__ = ["copy_segments", "PartitionConfig", "select_config", "override_config"]


@dataclass(frozen=True)
class PartitionConfig:
    """Tile of :func:`copy_segments`: BLOCK_R output rows x BLOCK_D columns per program."""

    block_r: int
    block_d: int
    num_warps: int = 4


CF.register("partition", PartitionConfig, probe=PartitionConfig(1, 16), doc="copy_segments' tile (select_config)")


def select_config(d: int, element_size: int) -> PartitionConfig:
    """The tile for rows of ``d`` elements of ``element_size`` bytes: up to 512 bytes of a row per
    program (coalesced 16-byte vectors across a warp) and about 16 KiB per tile; a
    ``tritonmoe.kernels.config.override("partition", ...)`` replaces it."""
    block_d = min(next_power_of_2(max(d, 1)), max(16, 512 // element_size))
    block_r = max(1, min(64, (16384 // element_size) // block_d))
    cfg, forced = CF.resolve("partition", PartitionConfig(block_r=block_r, block_d=block_d, num_warps=4))
    CF.note("partition", {"D": int(d), "elem": int(element_size)}, cfg, "override" if forced else "heuristic")
    return cfg


@contextlib.contextmanager
def override_config(config: PartitionConfig) -> Iterator[None]:
    """Use ``config`` for every :func:`copy_segments` launch in the block (tests). Deprecated
    spelling of ``tritonmoe.kernels.config.override("partition", config)``."""
    CF.deprecated("partition.override_config(cfg)", 'override("partition", cfg)')
    with CF.override("partition", config):
        yield


def _launch(
    src_RD: torch.Tensor,
    src_starts_C: torch.Tensor,
    dst_starts_C: torch.Tensor,
    lengths_C: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    D = src_RD.shape[1]
    out = torch.empty((num_rows, D), dtype=src_RD.dtype, device=src_RD.device)
    C = lengths_C.shape[0]
    if num_rows == 0 or D == 0:
        return out
    if C == 0:
        return out.zero_()
    if src_RD.stride(1) != 1:
        src_RD = src_RD.contiguous()
    lengths = lengths_C.to(torch.int64)
    # Sort the segments by destination start so a program can binary-search its rows' segment;
    # empty segments get the key num_rows, past every row, so they never capture one.
    keys = torch.where(lengths > 0, dst_starts_C.to(torch.int64), torch.full_like(lengths, num_rows))
    keys, order = torch.sort(keys, stable=True)
    seg_src = src_starts_C.to(torch.int64)[order].contiguous()
    seg_len = lengths[order].contiguous()
    cfg = select_config(D, src_RD.element_size())
    top = 1 << (C.bit_length() - 1)  # largest power of two <= C
    grid = (cdiv(num_rows, cfg.block_r), cdiv(D, cfg.block_d))
    _copy_segments_kernel[grid](
        src_RD,
        out,
        keys.contiguous(),
        seg_src,
        seg_len,
        num_rows,
        C,
        D,
        src_RD.stride(0),
        out.stride(0),
        BLOCK_R=cfg.block_r,
        BLOCK_D=cfg.block_d,
        TOP_STEP=top,
        SEARCH_STEPS=top.bit_length(),
        num_warps=cfg.num_warps,
    )
    return out


class _CopySegments(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_RD, src_starts_C, dst_starts_C, lengths_C, num_rows):
        ctx.save_for_backward(src_starts_C, dst_starts_C, lengths_C)
        ctx.src_rows = src_RD.shape[0]
        return _launch(src_RD, src_starts_C, dst_starts_C, lengths_C, num_rows)

    @staticmethod
    def backward(ctx, grad_out):
        src_starts_C, dst_starts_C, lengths_C = ctx.saved_tensors
        # The segments are disjoint on both sides, so the gradient is the reverse copy; the op is
        # linear, so running it through apply() keeps double backward exact.
        grad_src = _CopySegments.apply(grad_out, dst_starts_C, src_starts_C, lengths_C, ctx.src_rows)
        return grad_src, None, None, None, None


def copy_segments(
    src_RD: torch.Tensor,
    src_starts_C: torch.Tensor,
    dst_starts_C: torch.Tensor,
    lengths_C: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    """out[dst_starts[c] + i] = src[src_starts[c] + i] for i < lengths[c]; uncovered rows zero.
    See :func:`tritonmoe.reference.copy_segments`. Differentiable in ``src_RD``; no host sync."""
    return _CopySegments.apply(src_RD, src_starts_C, dst_starts_C, lengths_C, num_rows)
