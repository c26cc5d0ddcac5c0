"""Which implementation runs an op: one table from (op, backend, device, dtype) to a callable.

Every op of tritonmoe has a plain-PyTorch reference (:mod:`tritonmoe.reference`) and most have a
Triton launcher (:mod:`tritonmoe.kernels`); both take the same arguments. This module is the only
place that chooses between them. Launchers never fall back to the reference and :mod:`comm`
never reads the backend settings: they call :func:`implementation`.

The rules, in order:

1. ``backend`` is resolved: ``None`` means the process default (:func:`tritonmoe.set_backend`,
   ``TRITONMOE_BACKEND``, ``"auto"`` unless set).
2. ``"torch"`` -> the reference, on any device.
3. **fp64** -> the reference for the ops whose kernels compute on tensor cores in fp32 (route,
   grouped_gemm, grouped_ffn, moe_ffn), whatever the backend: fp64 is the exact-reference dtype
   of the tests and no kernel meets its contract (fp64 accumulation). Pure row movers
   (permute, unpermute, copy_segments, permute_metadata) run their kernels in any dtype.
4. ``"auto"`` -> the kernel for CUDA tensors when the op has one and Triton imports; the
   reference otherwise (CPU tensors, or no Triton on this machine).
5. ``"triton"`` -> the kernel; on CPU tensors only with Triton's interpreter switched on
   (``TRITON_INTERPRET=1`` before tritonmoe is imported), otherwise a clear error.

Before these rules: tensors on the ``meta`` device get the shape-only implementations of
:mod:`tritonmoe.meta` on every backend (no data, no kernels, no host syncs).

Kernel modules are imported on first use (plain imports in :func:`_kernel`), so importing
tritonmoe never imports triton, and a machine without triton still runs the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tritonmoe import fp8_reference, reference
from tritonmoe.core import settings as _settings
from tritonmoe.core.settings import resolve_backend
from tritonmoe import meta

__all__ = ["OPS", "implementation", "kernel", "uses_kernel", "has_kernel"]

_F16_BF16_F32 = frozenset({torch.float16, torch.bfloat16, torch.float32})


@dataclass(frozen=True)
class OpSpec:
    """One op: its reference, the kernel module and attribute (None: no kernel), and the dtypes
    the kernel computes (None: every dtype; other dtypes run the reference, rule 3)."""

    reference: Callable
    kernel_module: Optional[str]
    kernel_attr: Optional[str]
    kernel_dtypes: Optional[frozenset] = None


#: Every dispatched op. The kernel module names are the files of ``kernels/``.
OPS: dict[str, OpSpec] = {
    "route": OpSpec(reference.route, "routing", "route", _F16_BF16_F32),
    "balance_score_sums": OpSpec(reference.balance_score_sums, "routing", "balance_score_sums", _F16_BF16_F32),
    "permute": OpSpec(reference.permute, "permute", "permute"),
    "permute_metadata": OpSpec(reference.permute_metadata, "permute", "permute_metadata"),
    "unpermute": OpSpec(reference.unpermute, "permute", "unpermute"),
    "grouped_gemm": OpSpec(reference.grouped_gemm, "grouped_gemm", "grouped_gemm", _F16_BF16_F32),
    "grouped_ffn": OpSpec(reference.grouped_ffn, "grouped_ffn", "grouped_ffn", _F16_BF16_F32),
    "moe_ffn": OpSpec(reference.moe_ffn, "grouped_ffn", "moe_ffn", _F16_BF16_F32),
    # the training forms (tritonmoe.custom_ops' *_train custom ops): forward with saved activations, backward from them
    "grouped_ffn_train": OpSpec(reference.grouped_ffn_train, "grouped_ffn", "grouped_ffn_train", _F16_BF16_F32),
    "grouped_ffn_train_backward": OpSpec(reference.grouped_ffn_train_backward, "grouped_ffn",
                                         "grouped_ffn_train_backward", _F16_BF16_F32),
    "moe_ffn_train": OpSpec(reference.moe_ffn_train, "grouped_ffn", "moe_ffn_train", _F16_BF16_F32),
    "moe_ffn_train_backward": OpSpec(reference.moe_ffn_train_backward, "grouped_ffn", "moe_ffn_train_backward",
                                     _F16_BF16_F32),
    "copy_segments": OpSpec(reference.copy_segments, "partition", "copy_segments"),
    # FP8 experts (tritonmoe.fp8): e4m3 operands, fp32 scales; x of fp8_quantize / fp8_permute /
    # fp8_moe_ffn is 16/32-bit, the operands of fp8_grouped_mm / fp8_grouped_ffn are e4m3
    "fp8_quantize": OpSpec(fp8_reference.fp8_quantize, "fp8_gemm", "fp8_quantize", _F16_BF16_F32),
    "fp8_permute": OpSpec(fp8_reference.fp8_permute, "fp8_gemm", "fp8_permute", _F16_BF16_F32),
    "fp8_grouped_mm": OpSpec(fp8_reference.fp8_grouped_mm, "fp8_gemm", "fp8_grouped_mm"),
    "fp8_grouped_ffn": OpSpec(fp8_reference.fp8_grouped_ffn, "fp8_gemm", "fp8_grouped_ffn"),
    "fp8_moe_ffn": OpSpec(fp8_reference.fp8_moe_ffn, "fp8_gemm", "fp8_moe_ffn", _F16_BF16_F32),
    "fp8_grouped_ffn_train": OpSpec(fp8_reference.fp8_grouped_ffn_train, "fp8_train", "fp8_grouped_ffn_train",
                                    _F16_BF16_F32),
}

#: Resolved kernel callables (None: the module does not import, e.g. no triton).
_KERNELS: dict[str, Optional[Callable]] = {}


def _import_kernel_module(name: str):
    """The kernel module ``tritonmoe.kernels.<name>`` (plain imports, one per module)."""
    if name == "routing":
        from tritonmoe.kernels import routing as m
    elif name == "permute":
        from tritonmoe.kernels import permute as m
    elif name == "grouped_gemm":
        from tritonmoe.kernels import grouped_gemm as m
    elif name == "grouped_ffn":
        from tritonmoe.kernels import grouped_ffn as m
    elif name == "partition":
        from tritonmoe.kernels import partition as m
    elif name == "fp8_gemm":
        from tritonmoe.kernels import fp8_gemm as m
    elif name == "fp8_train":
        from tritonmoe.kernels import fp8_train as m
    else:  # pragma: no cover - OPS names only the modules above
        raise KeyError(name)
    return m


def kernel(op: str) -> Optional[Callable]:
    """The Triton launcher of ``op``, or None when it has none or Triton is not importable."""
    if op in _KERNELS:
        return _KERNELS[op]
    spec = _spec(op)
    fn = None
    if spec.kernel_module is not None:
        try:
            fn = getattr(_import_kernel_module(spec.kernel_module), spec.kernel_attr)
        except ImportError as exc:  # triton missing (e.g. macOS): the kernels are unavailable
            if "triton" not in str(exc):
                raise
    _KERNELS[op] = fn
    return fn


def has_kernel(op: str) -> bool:
    """Whether ``op`` has a Triton launcher that imports on this machine."""
    return kernel(op) is not None


def _spec(op: str) -> OpSpec:
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; tritonmoe dispatches {', '.join(OPS)}") from None


def implementation(
    op: str,
    backend: str | None,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> Callable:
    """The implementation of ``op`` for tensors of ``dtype`` on ``device`` (see the module
    docstring for the rules). ``dtype`` None skips rule 3 (the caller has no float input)."""
    spec = _spec(op)
    b = resolve_backend(backend)
    if device.type == "meta":  # shapes only, on every backend (tritonmoe.meta)

        return getattr(meta, op)
    if b == "torch":
        return spec.reference
    if dtype is not None and spec.kernel_dtypes is not None and dtype not in spec.kernel_dtypes:
        return spec.reference
    fn = kernel(op)
    if b == "auto":
        return fn if (fn is not None and device.type == "cuda") else spec.reference
    # b == "triton"
    if fn is None:
        raise NotImplementedError(
            f"tritonmoe has no Triton kernel for '{op}' on this machine (no kernel, or triton does not "
            "import); use backend='torch' or 'auto'"
        )
    if device.type == "cpu" and not _settings.TRITON_INTERPRET:
        raise RuntimeError(
            f"backend='triton' for '{op}' on CPU tensors needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before importing tritonmoe, or use backend='torch'"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"backend='triton' for '{op}' supports CPU (interpreter) and CUDA tensors, got {device}")
    return fn


def uses_kernel(op: str, backend: str | None, device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """Whether :func:`implementation` picks the Triton launcher (not the reference)."""
    return implementation(op, backend, device, dtype) is not _spec(op).reference
