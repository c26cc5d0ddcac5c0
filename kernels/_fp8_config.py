"""Config policy of the FP8 grouped GEMMs (the one place their launch parameters are chosen).

Kinds: ``"fp8_swiglu"`` (GEMM1: two e4m3 accumulators, SwiGLU epilogue, e4m3 1x128 output) and
``"fp8_mm"`` (GEMM2 and single grouped GEMMs: bf16/fp16/fp32 output).

* Interpreter: BM=16, BK=32 (so a 128-deep scale block spans four K steps and tests exercise
  the scale index inside the K loop), BN=128 for GEMM1 (its quantizing epilogue needs one 1x128
  group per row per tile) and 32 for GEMM2.
* sm89/sm90 (FP8 tensor cores): BK = 128 = one scale block per K step (DeepGEMM's recipe: one
  fp32 partial per block, scaled and added), BN = 128. By average rows per expert: >= 64 rows:
  GEMM1 64x128 over 8 warps, 4 stages (4 x 40 KiB of e4m3 operand tiles; 128x128 spills, see
  :func:`_policy`); >= 256 rows: GEMM2 128x128, 8 warps (two wgmma warpgroups), 4 stages
  (4 x 32 KiB); 64..255: GEMM2 BM 64, 4 warps, 4 stages; fewer (decode): BM = 16/32/64
  covering the expert's rows (mma.sync below 64), 4 stages, GEMM2 N tiles of 64 so that more
  programs stream the weights; the fused path's decode calls (T <= 64) take BM = next_pow2(T)
  (16..64: one M tile holds an expert's rows, so its weights stream once; 64 rows use wgmma).
  Compiled offline for sm_90a with Triton 3.9 and 3.6 (tests/test_aot_compile.py, ``fp8_*`` variants: e4m3 wgmma, no
  spill on either); speed NOT measured (no GPU run yet).
* Older GPUs: no FP8 tensor cores; the launchers refuse them (TypeError naming the capability).

:func:`tritonmoe.kernels.config.override` of ``"fp8.swiglu"`` / ``"fp8.mm"`` overrides these
(tests), BK clamped to a divisor of 128 and GEMM1's BN forced to 128. The tuned table
(:func:`tritonmoe.kernels.config.table_for`) is read first, for the non-decode calls: targets
``fp8.swiglu`` / ``fp8.mm``, exact fields :func:`fp8_key` (format as ``dtype``, E, N, K), bucket
the rows per expert; no FP8 entries are packaged yet (no GPU tuning run).

Persistent: the grouped kernel loops over work items (``for item in range(pid, items, nprog)``)
and the launcher caps the grid at the programs resident at once
(:func:`tritonmoe.kernels._gemm_config.max_programs`), so every FP8 GEMM already runs as a
persistent kernel over the tile map; it has no TMA / warp-specialized variant (operands load
through cp.async pipelines).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import _gemm_config as C
from . import config as CF
from ._host import next_power_of_2

__all__ = ["FP8_KINDS", "fp8_key", "fp8_supported", "select_fp8"]

for _k in ("swiglu", "mm"):
    CF.register(f"fp8.{_k}", C.TileConfig, probe=C.INTERPRETER_CONFIG,
                doc=f"FP8 grouped GEMM kind {_k!r} (select_fp8; tiles still clamped to the problem)")

FP8_KINDS = ("fp8_swiglu", "fp8_mm")

INTERPRETER_FP8 = {
    "fp8_swiglu": C.TileConfig(BM=16, BN=128, BK=32, GROUP_M=2, num_warps=1, num_stages=1),
    "fp8_mm": C.TileConfig(BM=16, BN=32, BK=32, GROUP_M=2, num_warps=1, num_stages=1),
}


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 or newer (or the interpreter)."""
    arch = C._arch(device)
    return arch is None or tuple(arch) >= (8, 9)


def _policy(kind: str, avg_rows: float, rowwise: bool, device: torch.device) -> C.TileConfig:
    if C._arch(device) is None:
        return INTERPRETER_FP8[kind]
    dual = kind == "fp8_swiglu"
    if avg_rows >= 64:
        if dual:
            # Block-scaled SwiGLU holds the gate and up accumulators plus each K step's two fp32
            # partials: at 128x128 (8 warps) that is 4 x 64 fp32 registers a thread and ptxas
            # spills ~490 bytes inside the K loop (rowwise: 64-80 bytes in the epilogue); 64x128
            # over 8 warps fits (254 registers, no spill).
            return C.TileConfig(BM=64, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=4)
        if avg_rows >= 256:
            return C.TileConfig(BM=128, BN=128, BK=128, GROUP_M=8, num_warps=8, num_stages=4)
        return C.TileConfig(BM=64, BN=128, BK=128, GROUP_M=8, num_warps=4, num_stages=4)
    bm = 16 if avg_rows <= 16 else (32 if avg_rows <= 32 else 64)
    return _decode_tiles(bm, dual)


def _decode_tiles(bm: int, dual: bool) -> C.TileConfig:
    """Few rows per expert: BM covers them, GEMM2 N tiles of 64 (more programs stream the
    weights); 64-row SwiGLU tiles need 8 warps (4 spill ~400 bytes)."""
    return C.TileConfig(BM=bm, BN=128 if dual else 64, BK=128, GROUP_M=4, num_warps=8 if (dual and bm >= 64) else 4,
                        num_stages=4)


def fp8_key(rowwise: bool, num_experts: int, n: int, k: int) -> dict:
    """Exact fields of an ``fp8.<kind>`` table key (the bucket is ``M``, rows per expert)."""
    return {"dtype": "e4m3_rowwise" if rowwise else "e4m3_block128", "E": int(num_experts), "N": int(n), "K": int(k)}


def select_fp8(kind: str, *, rows: int, n: int, k: int, num_experts: int, rowwise: bool,
               device: torch.device, decode_tokens: int | None = None) -> C.TileConfig:
    """The config of one FP8 GEMM (see the module docstring); tiles clamped to the problem like
    :func:`tritonmoe.kernels._gemm_config.select`, BK kept a divisor of 128 (one scale block per
    K step or several steps per block) and GEMM1's BN kept 128 (its quantizing epilogue)."""
    if kind not in FP8_KINDS:
        raise ValueError(f"unknown FP8 GEMM kind {kind!r}; use one of {FP8_KINDS}")
    avg_rows = rows / max(1, num_experts)
    cfg = None
    bm_cap = max(16, next_power_of_2(max(1, int(avg_rows))))
    if decode_tokens is not None:
        # the fused path's decode calls (T <= 64 tokens): an expert holds at most T rows (a
        # token's k ids are distinct), so a BM of next_pow2(T) covers them in one M tile and each
        # expert's weights are streamed once
        bm_cap = min(64, max(16, next_power_of_2(max(1, decode_tokens))))
        if cfg is None and C._arch(device) is not None:
            cfg = _decode_tiles(bm_cap, kind == "fp8_swiglu")
    target = "fp8.swiglu" if kind == "fp8_swiglu" else "fp8.mm"
    exact = fp8_key(rowwise, num_experts, n, k)
    source = "heuristic"
    if cfg is None:
        # the tuned table (python -m bench tune; kernels/config.py): the nearest rows-per-expert
        # bucket of this (format, E, N, K); the policy where the table has none
        tbl = CF.table_for(device)
        cfg = tbl.lookup(target, exact, avg_rows) if tbl is not None else None
        source = "table" if cfg is not None else "heuristic"
    if cfg is None:
        cfg = _policy(kind, avg_rows, rowwise, device)
    # an override("fp8.swiglu" / "fp8.mm", ...) pins or changes the tiles (still clamped below)
    cfg, forced = CF.resolve(target, cfg)
    CF.note(target, exact, cfg, "override" if forced else source, M=avg_rows)
    cfg = replace(cfg, variant="tile", SPLIT_K=1)
    bm = min(cfg.BM, bm_cap) if decode_tokens is None else bm_cap
    bk = min(cfg.BK, 128, max(32, next_power_of_2(max(1, k))))  # fp8 MMAs are 32 deep
    bn = 128 if kind == "fp8_swiglu" else min(cfg.BN, max(16, next_power_of_2(max(1, n))))
    return replace(cfg, BM=bm, BN=bn, BK=bk)
