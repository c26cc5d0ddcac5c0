"""Old path of the ``gemm`` suite, which now lives in :mod:`bench.suites.gemm` (one module per suite);
kept so ``from bench import gemm_variants`` goes on working."""

from __future__ import annotations

from .suites.gemm import DEFAULT_SHAPES, OPS, VARIANT_IMPLS, gemm_work, plan_gemm, policy_configs

__all__ = ["DEFAULT_SHAPES", "OPS", "VARIANT_IMPLS", "gemm_work", "plan_gemm", "policy_configs"]
