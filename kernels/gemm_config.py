"""The grouped-GEMM configuration policy, public face: what callers outside the kernels package
(the benchmarks, a tuner) may use of :mod:`._gemm_config`: the tile configuration type, the
policy's choice per kind and shape, and the scoped override of it."""

from __future__ import annotations

from ._gemm_config import KINDS, VARIANTS, TileConfig, autotune_enabled, gemm_variant, override, select, select_decode

__all__ = ["KINDS", "VARIANTS", "TileConfig", "autotune_enabled", "gemm_variant", "override", "select", "select_decode"]
