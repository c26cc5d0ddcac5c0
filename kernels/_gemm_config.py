"""Config policy of the grouped-GEMM kernels: tile shapes, warps, stages, autotuning.

This is the one place where launch parameters are chosen. :func:`select` maps a GEMM *kind* and
its shape to a :class:`TileConfig`; the launchers in :mod:`tritonmoe.kernels.grouped_gemm` never
pick numbers themselves.

Kinds:

* ``"mm"``          - ``[rows, K] @ w[e] [K, N]``, plain or scaled epilogue (the second FFN GEMM,
  grad-input GEMMs).
* ``"mm_act"``      - the first FFN GEMM with GELU or ReLU in the epilogue.
* ``"swiglu"``      - the first FFN GEMM with SwiGLU: two accumulators (gate and up, ``BN``
  columns each), so the tile is effectively ``BM x 2*BN``.
* ``"dact"``        - ``dY @ w2^T`` with the GELU/ReLU backward in the epilogue (reads the
  pre-activation tile; the fused path also reduces the gate-weight gradient there).
* ``"dact_swiglu"`` - the same for SwiGLU: two ``BN``-column accumulators over one ``dY`` tile
  (so a work item covers ``2*BN`` columns and reads each ``dY`` tile once for them), whose
  epilogues run one after the other (each reads two pre-activation tiles and writes two gradient
  tiles, so one 128-wide accumulator would spill hundreds of bytes).
* ``"wgrad"``       - per-expert ``X_e^T @ dY_e`` (weight gradients): output ``[M, N]`` per
  expert, the reduction runs over the expert's rows.

"swiglu" and "dact_swiglu" also serve GPT-OSS's clamped SwiGLU ("swiglu_oai"): same operands,
a few more epilogue instructions.

Policy (:func:`select`), keyed by the device, the dtype, the kind and the average rows per expert
(``rows / E``, known from shapes, so choosing never synchronizes with the device), then clamped to
N, K and the rows per expert:

* Triton interpreter (CPU tensors): one small config (16x16x16; 32x32 output tiles for the
  weight gradients), so that tests exercise multiple tiles, partial tiles and the K remainder on
  tiny shapes.
* sm90 (H100/H200), 16-bit inputs, >= 256 rows per expert (prefill/training): the large point of
  the Hopper Triton matmul space, 128x256x64 tiles, 8 warps (two warpgroups of wgmma), 3 stages
  (144 KiB of the 227 KiB shared memory), grouped tile ordering (GROUP_M=8) so that programs
  running together reuse weight panels and row tiles from L2; 128x128 / 128x64 for the kinds whose
  epilogues hold more live tiles (see ``_SM90_LARGE``). 64..255 rows: BM=64, 4 stages (8 warps
  for the kinds with heavy epilogues).
  Fewer (decode): BM 16/32/64 to cover an expert's few rows, 64x128 weight panels streamed with
  4 stages. TF32 halves BK; IEEE fp32 (no tensor cores) uses 64-wide N tiles.
* sm80 and other CUDA GPUs: 128x128x32 tiles (128x64 for the two-accumulator kinds), 8 warps
  (4 spill with these pointer-based loads and epilogues), 4 stages; 64x64x32 with 2 stages
  before sm80.

Evidence: every sm90 variant was compiled offline for sm_90a with Triton 3.9 and 3.6 and ptxas
(no GPU was available; tests/test_aot_compile.py): all use wgmma except tiles below 64 rows
(mma.sync), both operands go through cp.async pipelines when N and K are multiples of 16 (Triton
then specializes them; otherwise the masked weight loads cannot be vectorized and stay
synchronous), the MMA loop keeps the previous step's wgmma in flight (``wgmma.wait_group`` >= 1),
has no integer division and no spill, and every operand tile has one shared-memory buffer per
stage (one fewer for mma.sync; two for the gathered weight-gradient loads, whose row indices are
loaded in the same loop). The GEMMs are persistent (a tile loop around the K loop), which keeps
the pipeline's shared-memory addresses live through the epilogue: epilogues may spill a little
(Triton 3.9 / 3.6): large SwiGLU forward 48 / 32 bytes, large SwiGLU backward 24 / 48, TF32
SwiGLU 184 / 176, top-1 scaled GEMM2 0 / 88, everything else 0-8. Unaligned K or N (not
multiples of 16) lose the cp.async pipelines: real models avoid them, and the policy has no
separate config for them. The speed of these choices is NOT measured: re-derive them with the
benchmark harness on an H100/H200.

Variants (``TileConfig.variant``): ``"tile"`` launches one program per output tile
(``_grouped_gemm_kernels``, cp.async pipelines); ``"persistent"`` launches one program per SM
that loops over the tile map's tiles with TMA tensor descriptors and its tile and K loops fused
into one pipelined loop, so the next tile's loads overlap the current tile's epilogue
(``_grouped_gemm_persistent_kernels``, launcher ``_grouped_gemm_persistent``); ``"wide"`` is
the persistent kernel with the SwiGLU GEMM1's gate and up tiles in one ``[BK, 2*BN]`` weight
tile and one ``[BM, 2*BN]`` accumulator (one ``wgmma m64n256k16`` per K step at BN=128; the
other kinds run it as "persistent"). Only the kinds in :data:`PERSISTENT_KINDS` (the forward
GEMMs and dX) have a persistent kernel; the backward kinds ("dact", "dact_swiglu", "wgrad") take
their tiles from the tuned table too, with the tile kernel. The choice is table-driven: a tuned
table's row carries its variant, so the persistent (or wide) kernel runs exactly where the table
measured it faster; without a row the policy chooses :data:`DEFAULT_VARIANT` = ``"tile"``
(unchanged until a GPU run has measured the variants per shape), and
``TRITONMOE_GEMM_VARIANT=persistent|wide`` switches the kinds that have them over with the same
tile shapes. Compiled offline for sm_90a (Triton 3.6 and 3.9, docs/kernels-aot.md) the
persistent kernel fits these tiles (at most 180 KiB of shared memory, TMA stores of 256-wide
tiles in two 128-column slices) without spilling a register, with the same main-loop barriers
at E=128 as at E=8.

Autotuning: on CUDA, unless ``TRITONMOE_AUTOTUNE=0``, a launch autotunes over the *pipeline
depth* of the chosen config only (num_stages; tile shape, warps and ordering fixed). Pipelining
does not change the sequence of MMAs that produce an output element, so whichever candidate wins
the results are the same bits: the kernels stay deterministic run to run. Every kernel here
writes each output element exactly once (no read-modify-write, no atomics), so trial runs cannot
accumulate into outputs and no ``reset_to_zero`` is needed. ``TRITONMOE_AUTOTUNE=0`` launches the
policy's config directly (no benchmarking on a shape's first call).

Tuned tables and overrides (:mod:`tritonmoe.kernels.config`, the one mechanism of all kernels):
each choice is the running device's tuned table entry for the shape's bucket when there is one
(targets ``gemm.<kind>`` keyed by precision, E, N, K and rows per expert; ``decode.<kind>`` by
precision, E, N, K, top-k and tokens), else the policy above; ``config.override("gemm.<kind>",
...)`` replaces it or changes fields of it (an override's configs carry their own ``variant``).
Tile sizes are clamped to the problem whatever the source. :func:`override`,
:func:`force_decode` and :func:`preact_mode` below are the old spellings, kept as aliases of it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch
import triton

from . import config as CF
from ._host import cdiv, next_power_of_2

__all__ = [
    "DECODE_KINDS",
    "DECODE_MAX_TOKENS",
    "KINDS",
    "PERSISTENT_KINDS",
    "PERSISTENT_VARIANTS",
    "PREACT_MODES",
    "VARIANTS",
    "WIDE_KINDS",
    "TileConfig",
    "autotune_enabled",
    "colsum_config",
    "combine_config",
    "decode_path",
    "decode_key",
    "ffn_preact_mode",
    "force_decode",
    "gemm_key",
    "launch",
    "max_programs",
    "override",
    "preact_mode",
    "precision_name",
    "rows_hint",
    "select",
    "select_decode",
    "tile_map_config",
]

KINDS = ("mm", "mm_act", "swiglu", "dact", "dact_swiglu", "wgrad")

#: Kernel variants of a GEMM: "tile" (one output tile per program, cp.async pipelines) or
#: "persistent" (one program per SM looping over tiles, TMA descriptors, the next tile's loads
#: overlapping the epilogue; ``kernels/_grouped_gemm_persistent_kernels.py``).
#: "wide" is the persistent kernel with the SwiGLU GEMM's gate and up tiles in one [BK, 2*BN]
#: weight tile and one [BM, 2*BN] accumulator (one MMA of width 2*BN per K step; ``BN`` stays
#: the width of each half); kinds without a GLU run it as "persistent".
VARIANTS = ("tile", "persistent", "wide")
#: The variants served by the persistent kernel (``kernels/_grouped_gemm_persistent.py``).
PERSISTENT_VARIANTS = ("persistent", "wide")
#: The kinds that have a persistent variant: the forward GEMMs and the dX GEMM (a plain "mm"
#: with transposed weights). The backward-epilogue and weight-gradient kinds are tile-only:
#: their tiles (and pipeline depth) still come from the tuned table, whose "persistent" or
#: "wide" rows for them select the tile kernel with the row's tiles.
PERSISTENT_KINDS = ("mm", "mm_act", "swiglu")
#: The kinds whose "wide" variant differs from "persistent" (one 2*BN accumulator).
WIDE_KINDS = ("swiglu",)


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one GEMM: tile ``BM x BN`` (per accumulator), K step ``BK``, grouped
    ordering width ``GROUP_M`` (in M tiles), warps, software-pipelining stages, ``SPLIT_K`` (K
    splits whose fp32 partials a fixed-order reduction sums; only the decode path's second GEMM,
    whose combine does that reduction, uses more than 1) and the kernel ``variant`` (see
    :data:`VARIANTS`; ``"persistent"`` only with ``SPLIT_K == 1``), and for the persistent
    variant ``EPI_SPLIT``, the column slices its epilogue stores a tile in (1 or 2; 0: the
    launcher's rule, :func:`tritonmoe.kernels._grouped_gemm_persistent.epilogue_split`).

    ``source`` (not part of equality or hashing) says where the config came from: "heuristic",
    "table" or "override" (:data:`tritonmoe.kernels.config.SOURCES`)."""

    BM: int
    BN: int
    BK: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    SPLIT_K: int = 1
    variant: str = "tile"
    EPI_SPLIT: int = 0
    source: str = field(default="heuristic", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"TileConfig.variant={self.variant!r}; use one of {VARIANTS}")
        if self.EPI_SPLIT not in (0, 1, 2):
            raise ValueError(f"TileConfig.EPI_SPLIT={self.EPI_SPLIT!r}; use 0 (automatic), 1 or 2")
        if self.source not in CF.SOURCES:
            raise ValueError(f"TileConfig.source={self.source!r}; use one of {CF.SOURCES}")
        for name in ("BM", "BN", "BK"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name}={v} must be a power of two >= 16 (tl.dot's minimum)")
        if self.GROUP_M < 1 or self.num_warps < 1 or self.num_stages < 1 or self.SPLIT_K < 1:
            raise ValueError(f"TileConfig {self} needs GROUP_M, num_warps, num_stages and SPLIT_K >= 1")


#: The interpreter's config: small enough that tiny test shapes span several tiles.
INTERPRETER_CONFIG = TileConfig(BM=16, BN=16, BK=16, GROUP_M=2, num_warps=1, num_stages=1)
#: ... and for the weight gradients, whose grid has a program per output tile and expert (the
#: interpreter runs programs one at a time): 32 x 32 output tiles still split the tests' d <= 40.
INTERPRETER_WGRAD_CONFIG = TileConfig(BM=32, BN=32, BK=16, GROUP_M=2, num_warps=1, num_stages=1)

#: The GEMM kinds of the decode path (target ``decode.<kind>``).
DECODE_KINDS = ("swiglu", "mm_act", "mm")

for _k in KINDS:
    CF.register(f"gemm.{_k}", TileConfig, probe=INTERPRETER_CONFIG, doc=f"grouped GEMM kind {_k!r} (select)")
for _k in DECODE_KINDS:
    CF.register(f"decode.{_k}", TileConfig, probe=INTERPRETER_CONFIG, doc=f"decode-path GEMM kind {_k!r} (select_decode)")


@contextlib.contextmanager
def override(config: TileConfig | None = None, **per_kind: TileConfig) -> Iterator[None]:
    """Use ``config`` for every kind (or ``per_kind`` configs, e.g. ``wgrad=TileConfig(...)``)
    inside the block, on both paths (``gemm.<kind>`` and ``decode.<kind>``). Tile sizes are
    still clamped to the problem like the policy's.

    Deprecated spelling of ``tritonmoe.kernels.config.override(("gemm", "decode"), cfg)`` (or
    ``override(("gemm.<kind>", "decode.<kind>"), cfg)``)."""
    CF.deprecated("_gemm_config.override(cfg, **per_kind)", 'override(("gemm", "decode"), cfg)')
    for kind in per_kind:
        if kind not in KINDS:
            raise ValueError(f"unknown GEMM kind {kind!r}; use one of {KINDS}")
    table = {k: config for k in KINDS} if config is not None else {}
    table.update(per_kind)
    with contextlib.ExitStack() as stack:
        for kind, cfg in table.items():
            stack.enter_context(CF.override(f"gemm.{kind}", cfg))
            if kind in DECODE_KINDS:
                stack.enter_context(CF.override(f"decode.{kind}", cfg))
        yield


def _interpreting(device: torch.device) -> bool:
    return device.type != "cuda"


autotune_enabled = CF.autotune_enabled  # the one switch (TRITONMOE_AUTOTUNE); kept under its old name


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, next_power_of_2(max(1, n)))


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _arch(device: torch.device) -> tuple[int, int] | None:
    if _interpreting(device):
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


# sm90 tiles for 16-bit inputs, by kind and by average rows per expert (>= 256, >= 64, fewer).
# Chosen so that every variant compiles to wgmma (BM >= 64) with multi-stage cp.async pipelines
# and no register spills in the main loop (checked offline with ptxas for sm_90a, Triton 3.9 and
# 3.6, 8 warps; tests/test_aot_compile.py): 128x256 for plain epilogues; 128x128 where the
# epilogue holds more live tiles (GELU: erf; SwiGLU: two accumulators). The SwiGLU backward
# ("dact_swiglu") runs two 64-column accumulators over one 128-row dY tile (128 columns per work
# item, so dY is read F/128 times, not F/64 as with one 128x64 tile) and finishes them one after
# the other: 255 registers and a 24-byte epilogue spill on Triton 3.9 (152 bytes for GPT-OSS's
# clamped SwiGLU), where a single 128x128 accumulator spills 660-1600 bytes; at 64 rows per tile
# it needs 8 warps (170-183 registers, no spill; 4 warps spill 8-160 bytes).
_SM90_LARGE = {
    "mm": TileConfig(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
    "mm_act": TileConfig(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4),
    "swiglu": TileConfig(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
    "dact": TileConfig(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
    "dact_swiglu": TileConfig(BM=128, BN=64, BK=64, GROUP_M=8, num_warps=8, num_stages=4),  # x2 accumulators
    "wgrad": TileConfig(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3),
}
_SM90_MID = {
    "mm": TileConfig(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=4),
    "mm_act": TileConfig(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=4),
    "swiglu": TileConfig(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4),
    "dact": TileConfig(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4),
    "dact_swiglu": TileConfig(BM=64, BN=64, BK=64, GROUP_M=8, num_warps=8, num_stages=4),  # x2 accumulators
}


def _policy(kind: str, avg_rows: float, dtype: torch.dtype, tf32: bool, arch: tuple[int, int] | None) -> TileConfig:
    """The policy's config before clamping; ``arch`` is the CUDA capability, None in the
    interpreter."""
    if arch is None:
        return INTERPRETER_WGRAD_CONFIG if kind == "wgrad" else INTERPRETER_CONFIG
    major = arch[0]
    if major >= 9:
        if dtype == torch.float32 and not tf32:  # IEEE fp32: FMA, no tensor cores
            return TileConfig(BM=128 if avg_rows >= 128 or kind == "wgrad" else 64, BN=64, BK=32,
                              GROUP_M=8, num_warps=8, num_stages=3)
        if kind == "wgrad" or avg_rows >= 256:
            cfg = _SM90_LARGE[kind]
        elif avg_rows >= 64:
            cfg = _SM90_MID[kind]
        else:
            # Decode-like: an expert holds a few rows and the GEMM streams its weights; BM only
            # has to cover them (mma.sync below 64 rows), K steps are long.
            bm = 16 if avg_rows <= 16 else (32 if avg_rows <= 32 else 64)
            cfg = TileConfig(BM=bm, BN=64, BK=128, GROUP_M=4, num_warps=4, num_stages=4)
        if dtype == torch.float32:  # TF32: 4-byte operands, halve the K step to keep the smem
            cfg = replace(cfg, BK=cfg.BK // 2)
            if kind == "dact" and cfg.BM == 128:  # fp32 pre-activation tiles: 128x128 spills
                cfg = replace(cfg, BN=64)
        return cfg
    if major >= 8:
        dual = kind in ("swiglu", "dact_swiglu")
        return TileConfig(BM=128 if avg_rows >= 64 else 64, BN=64 if dual else 128, BK=32,
                          GROUP_M=8, num_warps=8, num_stages=4 if dtype != torch.float32 else 3)
    return TileConfig(BM=64, BN=64, BK=32, GROUP_M=8, num_warps=4, num_stages=2)


#: The variant the policy chooses when TRITONMOE_GEMM_VARIANT is unset. "tile" until a GPU run of
#: ``python -m bench gemm`` has measured the persistent variant against it per shape.
DEFAULT_VARIANT = "tile"


def gemm_variant() -> str:
    """The GEMM kernel variant for the kinds in :data:`PERSISTENT_KINDS`:
    ``TRITONMOE_GEMM_VARIANT`` (``tile`` / ``persistent``), else :data:`DEFAULT_VARIANT`. A
    config given to :func:`override` carries its own ``variant`` and ignores this."""
    v = os.environ.get("TRITONMOE_GEMM_VARIANT", "").strip().lower()
    if not v:
        return DEFAULT_VARIANT
    if v not in VARIANTS:
        raise ValueError(f"TRITONMOE_GEMM_VARIANT={v!r}; use one of {VARIANTS}")
    return v


def select(
    kind: str,
    *,
    rows: int,
    n: int,
    k: int,
    num_experts: int,
    dtype: torch.dtype,
    tf32: bool,
    device: torch.device,
) -> TileConfig:
    """The config for one GEMM of ``kind`` (see the module docstring).

    ``rows`` is the row count of the ragged operand (R); ``n`` and ``k`` are the output columns
    and the reduction depth as the kernel sees them (for ``wgrad``: ``n`` = output columns, ``k``
    = output rows M). Tile sizes are clamped to the problem (never wider than the next power of
    two of N, K, or the average rows per expert), so tiny problems do not waste a 128-wide tile.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown GEMM kind {kind!r}; use one of {KINDS}")
    avg_rows = rows / max(1, num_experts)
    target = f"gemm.{kind}"
    exact = gemm_key(dtype, tf32, num_experts, n, k)
    cfg, source = _tabled(target, device, exact, avg_rows)
    if cfg is None and not CF.replaced(target):  # (an override's whole config needs no policy)
        cfg = _policy(kind, avg_rows, dtype, tf32, _arch(device))
        variant = gemm_variant()
        if kind in PERSISTENT_KINDS and variant != "tile":
            cfg = replace(cfg, variant=variant)  # same tiles: their smem fits (module docstring)
    cfg, forced = CF.resolve(target, cfg)
    if forced:
        source = "override"
    if kind not in PERSISTENT_KINDS and cfg.variant != "tile":  # no persistent kernel for this kind
        cfg = replace(cfg, variant="tile")
    elif cfg.variant == "wide" and kind not in WIDE_KINDS:  # one accumulator already: the same kernel
        cfg = replace(cfg, variant="persistent")
    if kind == "wgrad":
        # BM tiles the output rows (k here), BN its columns, BK the expert's rows.
        cfg = replace(cfg, BM=min(cfg.BM, _pow2_at_least(k)), BN=min(cfg.BN, _pow2_at_least(n)),
                      BK=min(cfg.BK, _pow2_at_least(int(avg_rows))), source=source)
    else:
        cfg = replace(cfg, BM=min(cfg.BM, _pow2_at_least(int(avg_rows))), BN=min(cfg.BN, _pow2_at_least(n)),
                      BK=min(cfg.BK, _pow2_at_least(k)), source=source)
    CF.note(target, exact, cfg, source, M=avg_rows)
    return cfg


def precision_name(dtype: torch.dtype, tf32: bool) -> str:
    """The precision part of a table key: bf16, fp16, tf32 (fp32 operands on TF32 tensor cores)
    or fp32 (IEEE)."""
    if dtype == torch.float32:
        return "tf32" if tf32 else "fp32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))


def gemm_key(dtype: torch.dtype, tf32: bool, num_experts: int, n: int, k: int) -> dict:
    """Exact fields of a ``gemm.<kind>`` table key (the bucket is ``M``, rows per expert):
    ``n``, ``k`` as :func:`select` takes them."""
    return {"dtype": precision_name(dtype, tf32), "E": int(num_experts), "N": int(n), "K": int(k)}


def decode_key(dtype: torch.dtype, tf32: bool, num_experts: int, n: int, k: int, top_k: int) -> dict:
    """Exact fields of a ``decode.<kind>`` table key (the bucket is ``T``, tokens)."""
    return {**gemm_key(dtype, tf32, num_experts, n, k), "topk": int(top_k)}


def _tabled(target: str, device: torch.device, exact: dict, bucket: float) -> tuple[TileConfig | None, str]:
    """The tuned table's config for ``target`` at this key (source "table"), or (None,
    "heuristic")."""
    tbl = CF.table_for(device)
    cfg = tbl.lookup(target, exact, bucket) if tbl is not None else None
    return (cfg, "table") if cfg is not None else (None, "heuristic")


# ---------------------------------------------------------------------------------------------
# Decode (few tokens): which calls take the decode path, and its tiles
# ---------------------------------------------------------------------------------------------

#: Fused ``moe_ffn`` calls with at most this many tokens take the decode path (one metadata
#: program, tiles that hold an expert's rows in one M tile, split-K second GEMM).
DECODE_MAX_TOKENS = 64
#: ... and at most this many slots (T * k): the decode metadata program sorts them in registers.
DECODE_MAX_SLOTS = 4096

def _check_decode(v) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"force_decode expects a bool, got {type(v).__name__}")


CF.register("ffn.decode", check=_check_decode, doc="force (True) or avoid (False) the fused FFN's decode path")


@contextlib.contextmanager
def force_decode(enabled: bool) -> Iterator[None]:
    """Inside the block, fused calls take (True) or avoid (False) the decode path whatever their
    token count (tests run both paths on small shapes). Calls with more than
    :data:`DECODE_MAX_SLOTS` slots never take it. Deprecated spelling of
    ``config.override("ffn.decode", enabled)``."""
    CF.deprecated("_gemm_config.force_decode(b)", 'override("ffn.decode", b)')
    with CF.override("ffn.decode", enabled):
        yield


def decode_path(tokens: int, top_k: int) -> bool:
    """Whether a fused call over ``tokens`` tokens with ``top_k`` slots each takes the decode
    path: T <= :data:`DECODE_MAX_TOKENS` (unless :func:`force_decode` says otherwise) and
    T * k <= :data:`DECODE_MAX_SLOTS`."""
    if tokens <= 0 or tokens * top_k > DECODE_MAX_SLOTS:
        return False
    forced = CF.value("ffn.decode")
    if forced is not None:
        return forced
    return tokens <= DECODE_MAX_TOKENS


#: Shared memory the decode tiles' operand buffers may take (the tiles are weight panels
#: streamed from HBM: 2-4 stages of 128-deep K steps keep enough bytes in flight per SM).
_DECODE_SMEM = 160 * 1024


def select_decode(
    kind: str,
    *,
    tokens: int,
    top_k: int,
    n: int,
    k: int,
    num_experts: int,
    dtype: torch.dtype,
    tf32: bool,
    device: torch.device,
) -> TileConfig:
    """Tiles of the decode path's GEMMs (``kind`` "swiglu" / "mm_act" for the first, "mm" for
    the second), which stream the weights of the active experts and do little arithmetic.

    * BM = the next power of two of T (16..64): an expert holds at most T rows (a token's k ids
      are distinct), so one M tile covers them and each weight panel is read from HBM once; the
      wasted MMA rows cost nothing in a bandwidth-bound GEMM.
    * Enough programs stream at once: at most ``A = min(E, T * k)`` experts are active (a shape
      bound, no sync); the N tile is the widest that still gives ``A * cdiv(n, BN) >= 2 * SMs``
      work items (first GEMM: 64 or 32 columns per accumulator for the GLUs, 128..32 otherwise;
      second GEMM: 128 or 64), and the second GEMM splits K in 2, 4 or 8 while that is still
      short (each split keeping >= 4 K steps): e.g. T = 1 on a Mixtral-like layer (2 active
      experts, d = 4096, 14336-deep K) has 2 x 64 N tiles of 64 and runs 4 splits (512 items).
      The combine sums the splits' fp32 partials in a fixed order.
    * BK = 128 (64 for fp32), stages: as many as fit 160 KiB (at most 4).
    The interpreter gets 16-wide N and K tiles and 2 K splits when K > 16 (so tests exercise
    the split-K reduction). Speed NOT measured (no GPU yet).
    """
    if kind not in DECODE_KINDS:
        raise ValueError(f"decode GEMM kind {kind!r}; use 'swiglu', 'mm_act' or 'mm'")
    target = f"decode.{kind}"
    exact = decode_key(dtype, tf32, num_experts, n, k, top_k)
    bm = _pow2_at_least(min(max(tokens, 1), 64))
    cfg, source = _tabled(target, device, exact, tokens)
    if cfg is None and not CF.replaced(target):
        cfg = _decode_policy(kind, tokens, top_k, n, k, num_experts, dtype, device, bm)
    elif cfg is not None:
        cfg = replace(cfg, BM=bm, BN=min(cfg.BN, _pow2_at_least(n)), BK=min(cfg.BK, _pow2_at_least(k)))
    forced_cfg, forced = CF.resolve(target, cfg)
    if forced:
        source = "override"
        cfg = replace(forced_cfg, BM=bm, BN=min(forced_cfg.BN, _pow2_at_least(n)),
                      BK=min(forced_cfg.BK, _pow2_at_least(k)))
    cfg = replace(cfg, source=source)
    CF.note(target, exact, cfg, source, T=tokens)
    return cfg


def _decode_policy(kind: str, tokens: int, top_k: int, n: int, k: int, num_experts: int, dtype: torch.dtype,
                   device: torch.device, bm: int) -> TileConfig:
    """The decode tiles of :func:`select_decode`'s docstring (no table, no override)."""
    if _interpreting(device):
        split = 2 if kind == "mm" and k > 16 else 1  # two K steps of 16 or more: split them
        return TileConfig(BM=bm, BN=16, BK=16, GROUP_M=1, num_warps=1, num_stages=1, SPLIT_K=split)
    dual = kind == "swiglu"
    elem = 4 if dtype == torch.float32 else 2
    active = max(1, min(num_experts, tokens * top_k))
    want = 2 * _sms(device)
    bk = min(128 if elem == 2 else 64, _pow2_at_least(k))
    # The second GEMM reaches its item count by splitting K and keeps 64-column (128-byte) rows;
    # the first (whose activation needs whole sums) narrows N instead; two-accumulator tiles at
    # most 64 wide, so that 3-4 stages fit.
    widths = (128, 64) if kind == "mm" else ((64, 32) if dual else (128, 64, 32))
    bn = widths[-1]
    for cand in widths:
        if active * cdiv(n, cand) >= want:
            bn = cand
            break
    bn = min(bn, _pow2_at_least(n))
    split = 1
    if kind == "mm":
        while split < 8 and active * cdiv(n, bn) * split < want and cdiv(k, bk) >= 8 * split:
            split *= 2
    cfg = TileConfig(BM=bm, BN=bn, BK=bk, GROUP_M=1, num_warps=4, num_stages=2, SPLIT_K=split)
    for stages in (4, 3, 2):
        if _smem_bytes(cfg, stages, elem, dual) <= _DECODE_SMEM:
            return replace(cfg, num_stages=stages)
    return cfg


# ---------------------------------------------------------------------------------------------
# Grid of the persistent GEMMs, tile maps, small kernels
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


#: Shared memory per SM by major capability (sm90: 228 KiB, sm80: 164 KiB); others 96 KiB.
_SMEM_PER_SM = {9: 228 * 1024, 8: 164 * 1024}

#: Programs of a persistent GEMM in the interpreter: a few, so that tests run programs that take
#: several work items, and rounds where some programs have none.
INTERPRETER_PROGRAMS = 3


def max_programs(device: torch.device, cfg: TileConfig, elem_size: int, dual: bool) -> int:
    """Upper bound on the programs of a persistent GEMM launch: the programs resident at once
    (SMs x CTAs per SM, limited by 64 warps and the shared memory per SM; registers are not
    known before compiling, so this may overestimate, and the extra programs then start as the
    first ones finish, each with the same number of work items +-1)."""
    if _interpreting(device):
        return INTERPRETER_PROGRAMS
    smem = max(1, _smem_bytes(cfg, cfg.num_stages, elem_size, dual))
    per_sm = _SMEM_PER_SM.get(_arch(device)[0], 96 * 1024)
    ctas = max(1, min(4, 64 // cfg.num_warps, per_sm // smem))
    return _sms(device) * ctas


def tile_map_config(device: torch.device) -> tuple[int, int]:
    """(BT, num_warps) of the tile-map kernels: BT tiles per step against all E + 2 segments
    (a [BT, next_pow2(E + 2)] comparison: 16K lanes for E = 256 at BT = 32)."""
    if _interpreting(device):
        return 16, 1
    return 32, 4


def colsum_config(device: torch.device) -> tuple[int, int, int]:
    """(BR, BN, num_warps) of the per-expert column sums (bias gradients) and of the gate-weight
    gradient reduction: a memory-bound sweep with [BR, BN] fp32 tiles (64 values per thread)."""
    if _interpreting(device):
        return 16, 32, 1
    return 32, 256, 4


def rows_hint(rows: int, num_experts: int) -> int:
    """Autotune key for the row dimension: average rows per expert, rounded up to a power of two
    (so that a new batch size re-tunes only when its rows-per-expert bucket changes)."""
    return next_power_of_2(max(1, rows // max(1, num_experts)))


def _smem_bytes(cfg: TileConfig, stages: int, elem: int, dual: bool) -> int:
    b_tiles = 2 if dual else 1
    return stages * (cfg.BM * cfg.BK + b_tiles * cfg.BK * cfg.BN) * elem


#: Shared memory a candidate's operand buffers may take (of 227 KiB on sm90, leaving room for
#: the epilogue's layout conversions).
_SMEM_BUDGET = 200 * 1024


def _candidates(cfg: TileConfig, elem: int, dual: bool) -> tuple[int, ...]:
    """num_stages values worth timing for ``cfg``: the policy's own first, then one more and one
    fewer stage where the operand buffers fit."""
    out = [cfg.num_stages]
    for s in (cfg.num_stages + 1, cfg.num_stages - 1):
        if s >= 2 and _smem_bytes(cfg, s, elem, dual) <= _SMEM_BUDGET:
            out.append(s)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _tuner(kernel, key: tuple[str, ...], cfg: TileConfig, elem: int, dual: bool):
    configs = [triton.Config({}, num_warps=cfg.num_warps, num_stages=s) for s in _candidates(cfg, elem, dual)]
    return triton.autotune(configs=configs, key=list(key))(kernel)


def launch(kernel, grid: tuple[int, ...], cfg: TileConfig, key: tuple[str, ...], device: torch.device,
           elem_size: int, dual: bool, *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, BM=.., BN=.., BK=.., GROUP_M=.., **kwargs)`` with ``cfg``'s
    warps and stages, or through an autotuner over its pipeline depth (see the module
    docstring); ``key`` names the kernel arguments the tuning is cached by (the autotuner adds
    the tensor dtypes). A tuned table's config (``cfg.source == "table"``) was measured as it
    is and launches directly."""
    tiles = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M)
    if cfg.source != "table" and autotune_enabled(device):
        _tuner(kernel, key, cfg, elem_size, dual)[grid](*args, **tiles, **kwargs)
    else:
        kernel[grid](*args, **tiles, **kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ---------------------------------------------------------------------------------------------
# Elementwise combine and the FFN backward's pre-activation policy
# ---------------------------------------------------------------------------------------------


def combine_config(device: torch.device) -> tuple[int, int, int]:
    """(BT, BD, num_warps) of the fixed-order k-way combine: a memory-bound sweep, 16-byte
    accesses along d on GPUs; small blocks in the interpreter."""
    if _interpreting(device):
        return 16, 32, 1
    return 4, 512, 4


PREACT_MODES = ("save", "recompute")


def _check_preact(mode) -> None:
    if mode not in PREACT_MODES:
        raise ValueError(f"preact mode {mode!r}; use one of {PREACT_MODES}")


CF.register("ffn.preact", check=_check_preact, doc="the FFN backward's pre-activation: 'save' or 'recompute'")


@contextlib.contextmanager
def preact_mode(mode: str) -> Iterator[None]:
    """Inside the block, the FFN forward either saves its pre-activation for backward ("save")
    or the backward recomputes it with the first GEMM ("recompute"). Deprecated spelling of
    ``config.override("ffn.preact", mode)``."""
    CF.deprecated("_gemm_config.preact_mode(m)", 'override("ffn.preact", m)')
    with CF.override("ffn.preact", mode):
        yield


def ffn_preact_mode() -> str:
    """How the FFN backward gets the first GEMM's pre-activation H [rows, n1].

    Default "save": the forward writes H (input dtype) beside the activation it writes anyway, and
    the backward reads it: that costs one [rows, n1] write and read (about 2 GB of traffic for
    Mixtral-like T=16384, under 1 ms at H200 bandwidth) and the memory of H until backward, where
    recomputing costs the first GEMM again (2/3 of the forward FLOPs for SwiGLU, ~10 ms there).
    "recompute" (``TRITONMOE_FFN_PREACT=recompute`` or :func:`preact_mode`) keeps only the
    inputs and reruns the first GEMM in backward, for memory-bound training. Both produce
    bitwise-identical gradients (the recompute uses the forward's kernel and config). This is a
    reasoned default, not yet a measured one.
    """
    mode = CF.value("ffn.preact")
    if mode is not None:
        return mode
    v = os.environ.get("TRITONMOE_FFN_PREACT", "save").strip().lower()
    if v not in PREACT_MODES:
        raise ValueError(f"TRITONMOE_FFN_PREACT={v!r}; use one of {PREACT_MODES}")
    return v
