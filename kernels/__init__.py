"""Triton kernels and their thin launchers (installed as ``tritonmoe.kernels``).

Each public op file (``routing.py``, ``permute.py``, ...) holds launchers with the same signature
as the op's reference in :mod:`tritonmoe.reference`; the ``@triton.jit`` kernels live in private
``_*_kernels.py`` files beside them. This package never imports :mod:`tritonmoe.comm`.

:data:`KERNEL_OPS` maps an op name to the (module, attribute) of its launcher. The backend
selection in :mod:`tritonmoe._settings` imports a launcher only when it is used, so importing
tritonmoe never imports triton.
"""

KERNEL_OPS: dict[str, tuple[str, str]] = {
    "route": ("tritonmoe.kernels.routing", "route"),
    "permute": ("tritonmoe.kernels.permute", "permute"),
    "unpermute": ("tritonmoe.kernels.permute", "unpermute"),
    "grouped_gemm": ("tritonmoe.kernels.grouped_gemm", "grouped_gemm"),
    "grouped_ffn": ("tritonmoe.kernels.grouped_gemm", "grouped_ffn"),
    "moe_ffn": ("tritonmoe.kernels.grouped_gemm", "moe_ffn"),
    "copy_segments": ("tritonmoe.kernels.partition", "copy_segments"),
}
