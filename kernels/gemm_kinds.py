"""One grouped-GEMM kind at a time: the launches behind ``grouped_gemm`` / ``grouped_ffn``,
callable on their own (for the tuner, ``python -m bench tune``, and benchmarks of a single
kernel). Each runs with whatever config the policy chooses at its shape (a tuned table entry,
the heuristic, or a :func:`tritonmoe.kernels.config.override` of ``gemm.<kind>``).

Kinds (see :mod:`tritonmoe.kernels._gemm_config`): "mm", "mm_act", "swiglu", "dact",
"dact_swiglu", "wgrad". Arguments are not validated beyond what the launchers need: callers
build well-formed inputs (offsets [E+1] nondecreasing from 0 to at most R).

Also the public face of the GEMM config policy: :class:`TileConfig`, :func:`select`,
:func:`select_decode` and the table keys :func:`gemm_key` / :func:`decode_key`.
"""

from __future__ import annotations

import torch

from . import grouped_gemm as _G
from ._host import device_ctx
from ._gemm_config import (
    DECODE_KINDS,
    PERSISTENT_KINDS,
    WIDE_KINDS,
    TileConfig,
    decode_key,
    gemm_key,
    precision_name,
    select,
    select_decode,
)
from ._grouped_gemm_kernels import ACT_NONE

__all__ = ["KINDS", "ACTIVATIONS", "DECODE_KINDS", "PERSISTENT_KINDS", "WIDE_KINDS", "TileConfig", "decode_key",
           "gemm_key", "precision_name", "run", "select", "select_decode"]

KINDS = ("mm", "mm_act", "swiglu", "dact", "dact_swiglu", "wgrad")
#: The activation each kind runs with ("mm" and "wgrad" have none).
ACTIVATIONS = {"mm": None, "mm_act": "gelu", "swiglu": "swiglu", "dact": "gelu", "dact_swiglu": "swiglu",
               "wgrad": None}


def run(kind: str, a: torch.Tensor, offsets: torch.Tensor, b: torch.Tensor, h: torch.Tensor | None = None,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """Run one launch of ``kind`` over the rows ``a`` [R, *] in E segments (``offsets`` [E+1]):

    * "mm": ``a [R, K] @ b[e] [K, N]`` -> [R, N] (``b`` may be a strided view, e.g. the dX
      GEMM's ``w1.transpose(1, 2)``);
    * "mm_act": ``gelu(a @ b[e])`` -> [R, N];
    * "swiglu": ``silu(a @ b[e][:, :N]) * (a @ b[e][:, N:])`` -> [R, N] for ``b`` [E, K, 2N];
    * "dact" / "dact_swiglu": ``act'(h) * (a @ b[e]^T)`` for ``a`` = dY [R, D], ``b`` = w2
      [E, F, D], ``h`` the pre-activation [R, N1] -> dH [R, N1];
    * "wgrad": ``a_e^T @ h_e`` per expert for ``a`` [R, M], ``h`` [R, N] -> [E, M, N] (``b`` is
      unused: pass ``a``).

    ``out`` (mm kinds only) receives the result when given."""
    if kind not in KINDS:
        raise ValueError(f"unknown GEMM kind {kind!r}; use one of {KINDS}")
    act_name = ACTIVATIONS[kind]
    act = _G._act(act_name, 7.0, 1.702) if act_name else _G._Act(ACT_NONE)
    R = a.shape[0]
    E = offsets.shape[0] - 1
    space = _G.RowSpace(offsets, R, E)
    with device_ctx(a.device):
        if kind in ("mm", "mm_act", "swiglu"):
            n = b.shape[2] // 2 if kind == "swiglu" else b.shape[2]
            if out is None:
                out = torch.empty(R, n, device=a.device, dtype=a.dtype)
            _G._mm(a, space, b, out, act=act)
            return out
        if kind in ("dact", "dact_swiglu"):
            if h is None:
                raise ValueError(f"kind {kind!r} needs the pre-activation h")
            dh, _ = _G._dact(a, space, b.transpose(1, 2), h, act)
            return dh
        if h is None:
            raise ValueError("kind 'wgrad' needs the second operand as h [R, N]")
        return _G._wgrad(a, h, space, a.dtype)
