"""Peers timed in the same rounds as tritonmoe: Liger-Kernel's fused MoE (a pure Python + Triton
wheel), beside the ``torch._grouped_mm`` pipeline of :mod:`bench.baselines`.

Liger's ``LigerFusedMoEFunction.apply(x, gate_up_proj, down_proj, top_k_index, top_k_weights)``
computes ``sum_k w_tk * down[e] @ (silu(gate[e] x) * up[e] x)`` with ``gate_up_proj`` [E, 2F, H]
(gate rows first, then up rows, as tritonmoe's SwiGLU halves) and ``down_proj`` [E, H, F], top-k
ids int32. :func:`liger_weights` converts tritonmoe's ``w1`` [E, d, 2f] and ``w2`` [E, f, d] into
that layout once, outside the timed region; the converted tensors are the peer's own leaves, so
its forward+backward differentiates with respect to them (the same FLOPs as ours).

Liger supports SwiGLU only: any other activation makes the entry "unavailable". Its routing
metadata reads a tile count back to the host (``.item()``), so its forward cannot be captured
into a CUDA graph: its rows are timed eagerly and say so (timing mode ``eager``).

The device machine has no network: ``make peer-wheels`` downloads the wheel into ``.whl/``
(ignored by git), and the device script installs it with ``--no-deps``. On CPU the adapter runs
under Triton's interpreter when ``LIGER_FUSED_MOE_AUTOTUNE=0`` is set before liger is imported
(its autotuner cannot run there); :func:`load_liger` sets it when the interpreter is on.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from .harness import Unavailable, first_line

PEER_IMPLS = ("grouped_mm", "liger")
LIGER_DIST = "liger-kernel"


def load_liger() -> Any:
    """``liger_kernel.ops.fused_moe.LigerFusedMoEFunction``, or :class:`Unavailable` saying why.
    Under Triton's interpreter, liger's autotune is pinned off first (it must be read at import)."""
    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes"):
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
    try:
        mod = importlib.import_module("liger_kernel.ops.fused_moe")
    except Exception as exc:  # not installed, or its import fails on this triton
        raise Unavailable(f"liger-kernel is not importable ({first_line(exc)}); `make peer-wheels` then "
                          "pip install --no-deps .whl/liger_kernel-*.whl") from None
    fn = getattr(mod, "LigerFusedMoEFunction", None)
    if fn is None:
        raise Unavailable("liger_kernel.ops.fused_moe has no LigerFusedMoEFunction in this version")
    return fn


def require_liger(device: torch.device, activation: str) -> Any:
    """The liger Function when it can run a case here, else :class:`Unavailable`."""
    if activation != "swiglu":
        raise Unavailable(f"liger's fused MoE computes SwiGLU only, not {activation!r}")
    fn = load_liger()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "on", "yes"):
        raise Unavailable("liger's Triton kernels on CPU need TRITON_INTERPRET=1 (interpreter)")
    return fn


def liger_weights(w1_EDN: torch.Tensor, w2_EFD: torch.Tensor, *, requires_grad: bool = True):
    """tritonmoe's SwiGLU weights in liger's layout: (gate_up_proj [E, 2f, d], down_proj [E, d, f]),
    contiguous copies (made once, untimed), leaves that require grad when asked."""
    gate_up = w1_EDN.detach().transpose(1, 2).contiguous()
    down = w2_EFD.detach().transpose(1, 2).contiguous()
    return gate_up.requires_grad_(requires_grad), down.requires_grad_(requires_grad)


def liger_moe_ffn(fn: Any, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  gate_up_END: torch.Tensor, down_EDF: torch.Tensor) -> torch.Tensor:
    """The routed SwiGLU FFN through liger: [T, d] in x's dtype (top-k ids cast to int32, the gate
    weights to x's dtype, as liger expects)."""
    ids = topk_ids_TK if topk_ids_TK.dtype == torch.int32 else topk_ids_TK.to(torch.int32)
    w = topk_weights_TK if topk_weights_TK.dtype == x_TD.dtype else topk_weights_TK.to(x_TD.dtype)
    return fn.apply(x_TD, gate_up_END, down_EDF, ids, w)


__all__ = ["LIGER_DIST", "PEER_IMPLS", "liger_moe_ffn", "liger_weights", "load_liger", "require_liger"]
