"""The roofs every result is a fraction of, measured at the start of each run on its device.

* ``matmul_<dtype>``: a dense square matmul's TFLOP/s (2*n^3 FLOPs per call). On a GPU n = 8192
  in bf16 (and in the run's dtype too when that is not bf16); on CPU n = 1024 in fp32.
* ``copy``: a large device-to-device copy (``dst.copy_(src)``) in bytes moved per second, counting
  the bytes read and the bytes written (2 * size per call), the convention every bytes/s of the
  harness follows. 1 GiB on a GPU (less if memory is short), 64 MiB on CPU.

Roofs are measured with the same :class:`bench.harness.Timer` as the benchmarks (warm-up, L2
flush, CUDA events) and take the fastest rep: a roof is what the device reached, and a slow rep
(a clock ramp, a busy neighbour on a shared CPU) must not lower it. All the reps' statistics are
kept in ``time_s``. CPU roofs are labelled as such: they put the CPU numbers in context, they are
not GPU roofs.
"""

from __future__ import annotations

from typing import Callable

import torch

from .harness import Timer, first_line, free_memory, summarize

GPU_MATMUL_N = 8192
GPU_COPY_BYTES = 2**30
CPU_MATMUL_N = 1024
CPU_COPY_BYTES = 64 * 2**20


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def measure_matmul(timer: Timer, n: int, dtype: torch.dtype) -> dict:
    dev = timer.device
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    m = timer.measure(lambda: torch.matmul(a, b, out=c))
    stats = summarize(m.times_s)
    return {
        "kind": "matmul",
        "what": f"{n}x{n}x{n} {dtype_name(dtype)} matmul on {dev.type}",
        "n": n,
        "dtype": dtype_name(dtype),
        "time_s": stats,
        "tflops": 2.0 * n**3 / stats["min"] / 1e12,
        "gbps": None,
    }


def measure_copy(timer: Timer, nbytes: int) -> dict:
    dev = timer.device
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    m = timer.measure(lambda: dst.copy_(src))
    stats = summarize(m.times_s)
    return {
        "kind": "copy",
        "what": f"{nbytes / 2**20:.0f} MiB {dev.type} copy (bytes read + written)",
        "nbytes": nbytes,
        "dtype": "uint8",
        "time_s": stats,
        "tflops": None,
        "gbps": 2.0 * nbytes / stats["min"] / 1e9,
    }


def measure_roofs(timer: Timer, dtype: torch.dtype, log: Callable[[str], None] = print) -> dict:
    """Measure the roofs for a run whose benchmarks use ``dtype``. A roof that cannot be
    measured (out of memory, say) is left out with one log line; results then report no
    fraction for it."""
    roofs: dict = {}
    if timer.device.type == "cuda":
        jobs = [("matmul_bfloat16", lambda: measure_matmul(timer, GPU_MATMUL_N, torch.bfloat16))]
        if dtype != torch.bfloat16:
            jobs.append((f"matmul_{dtype_name(dtype)}", lambda: measure_matmul(timer, GPU_MATMUL_N, dtype)))
        free = torch.cuda.mem_get_info(timer.device)[0]
        nbytes = min(GPU_COPY_BYTES, max(free // 8, 2**20))
        jobs.append(("copy", lambda: measure_copy(timer, nbytes)))
    else:
        jobs = [
            ("matmul_float32", lambda: measure_matmul(timer, CPU_MATMUL_N, torch.float32)),
            ("copy", lambda: measure_copy(timer, CPU_COPY_BYTES)),
        ]
    for key, job in jobs:
        try:
            roofs[key] = job()
        except Exception as exc:  # a roof that cannot run must not stop the benchmarks
            log(f"roof {key}: not measured ({first_line(exc)})")
        finally:
            free_memory()
    return roofs


def describe(roofs: dict) -> list[str]:
    """One line per roof: ``roof <key>: <value> (<what was measured>)``."""
    lines = []
    for key, r in roofs.items():
        value = f"{r['tflops']:.4g} TFLOP/s" if r.get("tflops") else f"{r['gbps']:.4g} GB/s"
        lines.append(f"roof {key}: {value} ({r['what']})")
    return lines
