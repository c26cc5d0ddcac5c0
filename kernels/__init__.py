"""Triton kernels and their thin launchers (installed as ``tritonmoe.kernels``).

Each public op file (``routing.py``, ``permute.py``, ``grouped_gemm.py``, ``grouped_ffn.py``, ``partition.py``)
holds launchers with the same signature as the op's reference in :mod:`tritonmoe.reference`; the
``@triton.jit`` kernels live in private ``_*_kernels.py`` files beside them. Launchers assume
validated arguments and never choose a backend: :mod:`tritonmoe.backends` decides which of a
launcher and the reference runs, and imports a launcher only when it is used, so importing
tritonmoe never imports triton. This package never imports :mod:`tritonmoe.comm`.

Launch parameters are chosen in one place per family and pinned, tuned or recorded through one
mechanism, :mod:`tritonmoe.kernels.config` (overrides, the tuned table per device in
``configs/``, the record of which config ran); see docs/tuning.md.
"""
