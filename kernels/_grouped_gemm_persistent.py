"""Launcher of the persistent TMA grouped GEMM (``_grouped_gemm_persistent_kernels``).

:func:`tritonmoe.kernels.grouped_gemm._mm` calls :func:`mm` instead of the one-tile-per-program
kernel when the config policy's :class:`~tritonmoe.kernels._gemm_config.TileConfig` says
``variant="persistent"`` (``TRITONMOE_GEMM_VARIANT=persistent``, a tuned table's entry, or a
config given to ``tritonmoe.kernels.config.override("gemm.<kind>", ...)``). It takes the same arguments and writes the same outputs (same
epilogues, same flags: activation, pre-activation store, token gather, slot scatter, gate
scaling; K-contiguous weights, which is how the dX GEMM sees ``w^T``).

Operand access is chosen per operand from shapes, strides and pointer alignment (no device
value is read; :func:`access` is the rule, exposed for tests and the offline compile check):

* A by a ``[R, K]`` tensor descriptor unless rows are gathered (``gather_a``: token rows come
  through ``row_map``; Hopper's TMA has no row gather) or the layout does not allow TMA;
* B by ``[E, K, N]`` (N-contiguous) or ``[E, N, K]`` (K-contiguous) descriptors, one per SwiGLU
  half (the "wide" SwiGLU, one ``[BK, 2*BN]`` weight tile per K step, reads B by pointers:
  cp.async copies land in the MMA's shared-memory layout, a TMA box over the ``[E, K, 2, N]``
  view does not);
* C and H by ragged 4-D descriptors unless C rows are scattered (``scatter``) or
  :class:`PersistentOptions` ``tma_store`` is off.

TMA needs (checked here): a CUDA device of capability >= 9 (or the interpreter, which emulates
descriptors), a unit last stride, 16-byte aligned base and other strides, and for the ragged
stores fewer than 2**30 rows. Anything else runs through masked pointer accesses in the same
persistent kernel, so every call is served; only the speed differs.

Triton versions: the host-side ``triton.tools.tensor_descriptor.TensorDescriptor`` (passed as a
kernel argument, encoded into a ``CUtensorMap`` at launch) and the device-side
``desc.load`` / ``desc.store`` are the same in Triton 3.6 and 3.9, and need no global scratch
allocator (device-side ``tl.make_tensor_descriptor`` would: ``triton.set_allocator``). The one
version guard is :data:`TensorDescriptor` below: where it cannot be imported, every operand takes
the pointer path.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from . import _gemm_config as C
from . import config as CF
from ._host import cdiv
from ._grouped_gemm_kernels import ACT_SWIGLU
from ._grouped_gemm_persistent_kernels import RAGGED_ROWS, _grouped_mm_persistent_kernel

try:  # the one Triton-version guard (module docstring)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton < 3.3
    TensorDescriptor = None

__all__ = [
    "Access",
    "PersistentOptions",
    "access",
    "current_options",
    "epilogue_split",
    "flatten",
    "glu_wide",
    "mm",
    "num_programs",
    "options",
]

#: Programs of a persistent launch in the interpreter: small, but more than one, so that tests
#: see programs that own several tiles and programs that own none.
INTERPRETER_PROGRAMS = 3

#: A ragged descriptor's outer dimensions (triton.tools.ragged_tma): large, below 2**31.
_RAGGED_OUTER = 0x7FFF0000


@dataclass(frozen=True)
class PersistentOptions:
    """Schedule options of the persistent kernel that do not change results.

    flatten: fuse the tile loop and the K loop into one pipelined loop (the next tile's loads
    overlap the current tile's epilogue). tma_store: write C and H through ragged TMA
    descriptors where possible (else masked pointer stores; triton_kernels stores with pointers
    on Hopper, TMA on Blackwell). epilogue_split: column slices of the epilogue's stores (1 or
    2; None: the config's ``TileConfig.EPI_SPLIT`` (a tuned table's), else
    :func:`epilogue_split`'s rule). The defaults are reasoned, not measured.
    """

    flatten: bool = True
    tma_store: bool = True
    epilogue_split: Optional[int] = None

    def __post_init__(self) -> None:
        if self.epilogue_split not in (None, 1, 2):
            raise ValueError(f"epilogue_split={self.epilogue_split!r}; use 1, 2 or None (automatic)")


_DEFAULT_OPTIONS = PersistentOptions()
CF.register("persistent", PersistentOptions, probe=_DEFAULT_OPTIONS, doc="schedule options of the persistent GEMM")


@contextlib.contextmanager
def options(**changes) -> Iterator[PersistentOptions]:
    """Use :class:`PersistentOptions` with ``changes`` inside the block. Deprecated spelling of
    ``tritonmoe.kernels.config.override("persistent", **changes)``."""
    CF.deprecated("_grouped_gemm_persistent.options(**kw)", 'override("persistent", **kw)')
    with CF.override("persistent", **changes):
        yield current_options()


def current_options() -> PersistentOptions:
    return CF.resolve("persistent", _DEFAULT_OPTIONS)[0]


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device, max_tiles: int) -> int:
    """Grid size: one program per SM on a GPU (fewer when there are fewer tiles), a few in the
    interpreter."""
    if device.type != "cuda":
        cap = INTERPRETER_PROGRAMS
    else:
        cap = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(cap, max_tiles))


def flatten(opts: PersistentOptions, *, gather_a: bool, dual: bool) -> bool:
    """Whether the launch fuses the tile and K loops: as ``opts`` says, except for SwiGLU over
    gathered token rows, whose two accumulators and per-thread gather addresses do not fit the
    register file in the fused loop (it spills there, not in the nested form; checked by
    tests/test_aot_compile.py)."""
    return opts.flatten and not (gather_a and dual)


def epilogue_split(BN: int, *, wide: bool = False) -> int:
    """Column slices the epilogue stores a tile in: 2 for 256-wide tiles (a 128x256 pointer-store
    epilogue spills inside the pipelined loop, and a whole-tile TMA staging buffer takes the
    shared memory of a pipeline stage; checked by tests/test_aot_compile.py) and for the "wide"
    SwiGLU (its 128x256 accumulator: whole 128x128 output slices take it to the 255-register
    ceiling, two 64-column slices leave it at 240 without spilling, sm_90a, Triton 3.9), else
    1."""
    return 2 if BN >= 256 or wide else 1


def _tma_capable(device: torch.device) -> bool:
    if TensorDescriptor is None:
        return False
    if device.type != "cuda":
        return True  # the interpreter emulates descriptors (and checks the same alignment rules)
    return C._capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def _aligned(t: torch.Tensor, *strides: int, offset: int = 0) -> bool:
    """Base (plus ``offset`` elements) and ``strides`` (elements) are multiples of 16 bytes."""
    s = t.element_size()
    return (t.data_ptr() + offset * s) % 16 == 0 and all((x * s) % 16 == 0 for x in strides)


@dataclass(frozen=True)
class Access:
    """Which operands a persistent launch reads / writes through TMA descriptors (the others
    through masked pointers). ``b_kmajor``: the weights are K-contiguous (``[E, N, K]``
    storage, e.g. ``w.transpose(1, 2)`` in the dX GEMM)."""

    a: bool
    b: bool
    b_kmajor: bool
    c: bool
    h: bool


def access(
    a: torch.Tensor,
    b_EKN: torch.Tensor,
    out: torch.Tensor,
    h: Optional[torch.Tensor],
    *,
    n: int,
    dual: bool,
    gather_a: bool,
    scatter: bool,
    tma_store: bool = True,
    capable: Optional[bool] = None,
    wide: bool = False,
) -> Access:
    """The operand-access rule of the module docstring, from shapes, strides and alignment.
    ``capable``: whether the device has TMA (default: asked of ``a.device``). ``wide``: the
    "wide" SwiGLU (:func:`glu_wide`), whose weights are read by pointers (the cp.async copies
    land in the MMA's layout; a TMA box would not, see ``_load_b_wide``) and whose inference
    output (no H) is stored by pointers (the TMA staging buffer takes it to the register ceiling;
    with H, TMA stores keep it from spilling: sm_90a, Triton 3.9)."""
    K = b_EKN.shape[1]
    if capable is None:
        capable = _tma_capable(a.device)
    ok = capable and K > 0 and n > 0
    a_tma = ok and not gather_a and a.stride(1) == 1 and _aligned(a, a.stride(0))
    sbe, sbk, sbn = b_EKN.stride()
    b_kmajor = sbk == 1 and sbn != 1
    if b_kmajor:  # [E, N, K] storage; the up half starts n rows of it later
        b_tma = ok and _aligned(b_EKN, sbe, sbn) and (not dual or _aligned(b_EKN, offset=n * sbn))
    else:  # [E, K, N] storage; the up half starts n columns later
        b_tma = ok and sbn == 1 and _aligned(b_EKN, sbe, sbk) and (not dual or _aligned(b_EKN, offset=n))

    def ragged_ok(t: torch.Tensor, halves: bool) -> bool:
        return (ok and tma_store and t.stride(1) == 1 and t.shape[0] < RAGGED_ROWS and _aligned(t, t.stride(0))
                and (not halves or _aligned(t, offset=n)))

    if wide:
        b_tma = False
    c_tma = not scatter and ragged_ok(out, False) and not (wide and h is None)
    h_tma = h is not None and ragged_ok(h, dual)
    return Access(a=a_tma, b=b_tma, b_kmajor=b_kmajor, c=c_tma, h=h_tma)


def _ragged_desc(t: torch.Tensor, col0: int, ncols: int, BM: int, BN: int):
    """A ragged store descriptor over columns [col0, col0 + ncols) of the 2-D ``t``
    (triton.tools.ragged_tma.create_ragged_descriptor's construction, rows bounded per store
    by the kernel's coordinates)."""
    rs = t.stride(0)
    base = t[:, col0:] if col0 else t
    return TensorDescriptor(base, [_RAGGED_OUTER, _RAGGED_OUTER, RAGGED_ROWS, ncols], [2**34 - rs, rs, rs, 1],
                            [1, 1, BM, BN])


def _weight_desc(b: torch.Tensor, col0: int, n: int, kmajor: bool, BK: int, BN: int):
    """Weights ``[E, K, *]`` (columns [col0, col0 + n)) as a 3-D descriptor: ``[E, K, n]`` with
    box ``[1, BK, BN]``, or for K-contiguous storage ``[E, n, K]`` with box ``[1, BN, BK]``."""
    E, K, _ = b.shape
    sbe, sbk, sbn = b.stride()
    view = b[:, :, col0:] if col0 else b
    if kmajor:
        return TensorDescriptor(view, [E, n, K], [sbe, sbn, 1], [1, BN, BK])
    return TensorDescriptor(view, [E, K, n], [sbe, sbk, 1], [1, BK, BN])


def glu_wide(cfg: "C.TileConfig", act: int) -> bool:
    """Whether a launch runs the GLU as one ``[BM, 2 * BN]`` accumulator (config variant
    ``"wide"``, SwiGLU only)."""
    return cfg.variant == "wide" and act == ACT_SWIGLU


def mm(
    a: torch.Tensor,
    offsets: torch.Tensor,
    tiles: torch.Tensor,
    count: torch.Tensor,
    b_EKN: torch.Tensor,
    out: torch.Tensor,
    cfg: "C.TileConfig",
    *,
    rows: int,
    act: int,
    h: Optional[torch.Tensor] = None,
    row_map: Optional[torch.Tensor] = None,
    topk: int = 1,
    gather_a: bool = False,
    scatter: bool = False,
    scale: Optional[torch.Tensor] = None,
    prec: str = "tf32",
) -> None:
    """``out[row] = act(a[row'] @ b[seg(row)])`` over a row space of ``rows`` rows, as
    :func:`tritonmoe.kernels.grouped_gemm._mm` (whose arguments it takes, with the config, the
    dot precision that function chose, and the row space's tile map for ``cfg.BM``: ``tiles``
    [MT, 3], ``count`` [1]), with the persistent kernel. ``rows > 0``, N > 0."""
    E, K, NB = b_EKN.shape
    dual = act == ACT_SWIGLU
    wide = glu_wide(cfg, act)
    N = NB // 2 if dual else NB
    BM, BN, BK = cfg.BM, cfg.BN, cfg.BK
    dev = a.device
    opts = current_options()
    acc = access(a, b_EKN, out, h, n=N, dual=dual, gather_a=gather_a, scatter=scatter, tma_store=opts.tma_store,
                 wide=wide)
    a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [BM, BK]) if acc.a else None
    b_desc = bu_desc = None
    if acc.b:
        b_desc = _weight_desc(b_EKN, 0, N, acc.b_kmajor, BK, BN)
        if dual:
            bu_desc = _weight_desc(b_EKN, N, N, acc.b_kmajor, BK, BN)
    # an override, the config's, the rule
    split = opts.epilogue_split or cfg.EPI_SPLIT or epilogue_split(BN, wide=wide)
    c_desc = _ragged_desc(out, 0, N, BM, BN // split) if acc.c else None
    h_desc = hu_desc = None
    if acc.h:
        h_desc = _ragged_desc(h, 0, N, BM, BN // split)
        if dual:
            hu_desc = _ragged_desc(h, N, N, BM, BN // split)
    hh = h if h is not None else out  # never dereferenced without STORE_H
    max_tiles = tiles.shape[0] * cdiv(N, BN)
    progs = num_programs(dev, max_tiles)
    C.launch(
        _grouped_mm_persistent_kernel, (progs,), cfg, ("N", "K", "ROWS_HINT"), dev, a.element_size(), dual,
        a_desc, b_desc, bu_desc, c_desc, h_desc, hu_desc,
        a, b_EKN, out, hh, offsets, tiles, count, row_map if row_map is not None else offsets,
        scale if scale is not None else out,
        rows, N, K, E, progs, C.rows_hint(rows, E),
        a.stride(0), a.stride(1),
        b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
        out.stride(0), out.stride(1),
        hh.stride(0), hh.stride(1),
        ACT=act, STORE_H=h is not None, GATHER_A=gather_a, SCATTER_C=scatter, SCALE=scale is not None,
        TOPK=topk, PREC=prec, EVEN_K=K % BK == 0, GLU_WIDE=wide,
        B_KMAJOR=acc.b_kmajor, EPI_SPLIT=split, FLATTEN=flatten(opts, gather_a=gather_a, dual=dual),
    )
