"""Host-side helpers for the launchers, in plain Python: integer arithmetic and the launch device.

``triton.cdiv`` is a ``constexpr_function`` in recent Triton (3.5+): called from host code it
unwraps its arguments through Triton's JIT machinery, about 6 us per call on a 2-core CPU, and
a launcher calls it several times per op. These two give the same results for the
non-negative ints the launchers pass, at the cost of a Python expression. Use them outside
``@triton.jit`` code only (inside a kernel, keep ``tl.cdiv``).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["cdiv", "next_power_of_2", "device_ctx"]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (b > 0), as ``triton.cdiv``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, as ``triton.next_power_of_2`` (which gives 0 for n <= 0)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def device_ctx(device: torch.device):
    """Triton launches on the current CUDA device: make it ``device`` (the tensors'; autograd runs
    a backward on its forward's device) for the launches inside; nothing on other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
