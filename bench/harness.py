"""Timing, statistics, result rows and the environment record of the benchmark harness.

How one benchmark is measured (:meth:`Timer.measure`):

1. ``warmup`` calls (Triton compiles and autotunes on the first call; caches warm up).
2. ``reps`` timed calls (at least 20 by default). On a GPU each call is preceded by writing a
   256 MiB buffer, which evicts the 50-60 MiB L2 so every rep starts cold, and is timed with CUDA
   events recorded on the current stream around the call (the flush is outside the events). On
   CPU each call is timed with ``time.perf_counter`` (no cache flush).
3. The NVML sampler (:mod:`bench.telemetry`) runs during the timed calls.
4. One more call measures the peak allocated bytes (``torch.cuda.max_memory_allocated`` after
   ``reset_peak_memory_stats``), excluding the harness's own flush buffer; None on CPU.

Results are plain dicts (one per benchmark and implementation, see :mod:`bench.schema`) so they
serialize to JSON as they are.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib.metadata
import math
import os
import platform
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

#: Bytes written between reps to flush the GPU's L2 (H100/H200 L2 is 50-60 MiB).
FLUSH_BYTES = 256 * 2**20

#: The quantiles every timing reports besides the median.
QUANTILES = (0.2, 0.8)

#: Default number of timed repetitions; the CLI refuses fewer than MIN_REPS.
DEFAULT_REPS = 20
MIN_REPS = 3

#: Implementations that are baselines (a row's ``speedup`` is measured against these).
BASELINE_IMPLS = ("torch", "loop", "grouped_mm", "liger", "softmax_topk")

REPO_ROOT = Path(__file__).resolve().parent.parent


class Unavailable(Exception):
    """An implementation that cannot run here (no kernel yet, no torch._grouped_mm, ...).

    The entry is recorded with status "unavailable" and its message; the run goes on. A
    NotImplementedError from tritonmoe (``backend="triton"`` for an op without a kernel) is
    treated the same way.
    """


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolation quantile of sorted values (numpy's default method)."""
    if not sorted_xs:
        raise ValueError("quantile of no values")
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(times_s: list[float]) -> dict:
    """median / p20 / p80 / min / max / mean and the number of reps of a list of seconds."""
    xs = sorted(float(t) for t in times_s)
    return {
        "median": quantile(xs, 0.5),
        "p20": quantile(xs, QUANTILES[0]),
        "p80": quantile(xs, QUANTILES[1]),
        "min": xs[0],
        "max": xs[-1],
        "mean": sum(xs) / len(xs),
        "reps": len(xs),
    }


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    times_s: list[float]
    peak_bytes: int | None = None
    peak_extra_bytes: int | None = None
    telemetry: dict | None = None


class Timer:
    """Times callables on one device (see the module docstring for the method)."""

    def __init__(
        self,
        device: torch.device,
        *,
        reps: int = DEFAULT_REPS,
        warmup: int = 3,
        flush: bool = True,
        telemetry=None,
    ) -> None:
        if reps < 1:
            raise ValueError(f"reps={reps} must be >= 1")
        if warmup < 0:
            raise ValueError(f"warmup={warmup} must be >= 0")
        self.device = torch.device(device)
        self.reps = reps
        self.warmup = warmup
        self.telemetry = telemetry
        self.is_cuda = self.device.type == "cuda"
        self._flush_buf = None
        if self.is_cuda and flush:
            self._flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=self.device)

    @property
    def flushes(self) -> bool:
        return self._flush_buf is not None

    def _flush(self) -> None:
        if self._flush_buf is not None:
            self._flush_buf.zero_()

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any], reps: int | None = None) -> list[float]:
        """Seconds per call of ``fn`` over ``reps`` calls (after no warm-up)."""
        reps = self.reps if reps is None else reps
        out: list[float] = []
        if self.is_cuda:
            stream = torch.cuda.current_stream(self.device)
            for _ in range(reps):
                self._flush()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                out.append(start.elapsed_time(end) * 1e-3)
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out

    def peak_memory(self, fn: Callable[[], Any]) -> tuple[int | None, int | None]:
        """(peak allocated bytes during one call, excluding the flush buffer; the part of it
        allocated by the call itself). (None, None) on CPU."""
        if not self.is_cuda:
            return None, None
        self._sync()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        self._sync()
        peak = torch.cuda.max_memory_allocated(self.device)
        own = FLUSH_BYTES if self._flush_buf is not None else 0
        return peak - own, peak - before

    def measure(self, fn: Callable[[], Any]) -> Measurement:
        for _ in range(self.warmup):
            fn()
        self._sync()
        if self.telemetry is not None:
            self.telemetry.start()
        try:
            times = self.time(fn)
        finally:
            tel = self.telemetry.stop() if self.telemetry is not None else None
        peak, extra = self.peak_memory(fn)
        return Measurement(times, peak, extra, tel)


def free_memory() -> None:
    """Drop the previous benchmark's tensors before the next one allocates."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Result rows
# ---------------------------------------------------------------------------------------------


@dataclass
class Work:
    """What one call of a benchmark does: useful FLOPs and the minimum bytes it must move (both
    independent of the implementation, so throughputs compare across implementations), and for
    the layer the analytic minimum of memory it must hold."""

    flops: float | None = None
    bytes: float | None = None
    min_memory_bytes: float | None = None


def new_row(*, suite: str, case: str, mode: str, impl: str, params: dict) -> dict:
    """An empty result row (see bench.schema for every field)."""
    return {
        "suite": suite,
        "name": f"{suite}/{case}/{mode}",
        "case": case,
        "mode": mode,
        "impl": impl,
        "status": "ok",
        "note": None,
        "params": dict(params),
        "time_s": None,
        "times_s": [],
        "flops": None,
        "bytes": None,
        "tflops": None,
        "gbps": None,
        "roof_frac": None,
        "roof_bound": None,
        "speedup": {},
        "memory": {"peak_bytes": None, "peak_extra_bytes": None, "analytic_min_bytes": None, "ratio": None},
        "telemetry": None,
        "extra": {},
    }


def fill_timing(row: dict, times_s: list[float], work: Work, roofs: "dict | None") -> dict:
    """Put the timing statistics, throughputs and roofline fraction into a row."""
    row["times_s"] = [float(t) for t in times_s]
    stats = summarize(times_s)
    row["time_s"] = stats
    med = stats["median"]
    row["flops"] = work.flops
    row["bytes"] = work.bytes
    if med > 0:
        if work.flops:
            row["tflops"] = work.flops / med / 1e12
        if work.bytes:
            row["gbps"] = work.bytes / med / 1e9
    frac, bound = roofline(work, med, roofs, row["params"].get("dtype"))
    row["roof_frac"], row["roof_bound"] = frac, bound
    if work.min_memory_bytes is not None:
        row["memory"]["analytic_min_bytes"] = int(work.min_memory_bytes)
    return row


def roofline(work: Work, seconds: float, roofs: "dict | None", dtype: str | None) -> tuple[float | None, str | None]:
    """Fraction of the roofline: the time the work would take at the measured roofs (the larger
    of FLOPs / matmul roof and bytes / copy roof) divided by the measured time; and which roof
    binds ("compute" or "memory")."""
    if not roofs or seconds <= 0:
        return None, None
    mm = roofs.get(f"matmul_{dtype}") or roofs.get("matmul_bfloat16") or roofs.get("matmul_float32")
    cp = roofs.get("copy")
    t_compute = work.flops / (mm["tflops"] * 1e12) if (work.flops and mm and mm.get("tflops")) else 0.0
    t_memory = work.bytes / (cp["gbps"] * 1e9) if (work.bytes and cp and cp.get("gbps")) else 0.0
    if t_compute == 0.0 and t_memory == 0.0:
        return None, None
    bound = "compute" if t_compute >= t_memory else "memory"
    return max(t_compute, t_memory) / seconds, bound


def attach_speedups(rows: list[dict]) -> None:
    """For rows of one benchmark (same name), speedup[b] = median time of baseline b / this row's
    median time, for every baseline implementation b measured (except the row itself)."""
    ok = {r["impl"]: r["time_s"]["median"] for r in rows if r["status"] == "ok" and r["time_s"]}
    for r in rows:
        if r["status"] != "ok" or not r["time_s"]:
            continue
        mine = r["time_s"]["median"]
        r["speedup"] = {b: ok[b] / mine for b in BASELINE_IMPLS if b in ok and b != r["impl"] and mine > 0}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def is_oom(exc: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvml_driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, or an NVML error: the field stays None
        return None
    return v.decode() if isinstance(v, bytes) else str(v)


def environment(argv: list[str], device: torch.device) -> dict:
    """Where and with what a run was measured. The git commit comes from the repository the
    harness lives in; a copy of the tree without .git can name it in TRITONMOE_BENCH_COMMIT."""
    commit = _git("rev-parse", "HEAD") or os.environ.get("TRITONMOE_BENCH_COMMIT")
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        import tritonmoe

        tm_version = tritonmoe.__version__
    except ImportError:  # pragma: no cover - the harness imports tritonmoe anyway
        tm_version = None
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m bench" + ("" if not argv else " " + shlex.join(argv)),
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "mode": "gpu" if device.type == "cuda" else "cpu",
        "device": str(device),
        "gpu_name": None,
        "gpu_count": 0,
        "gpu_capability": None,
        "gpu_memory_bytes": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "tritonmoe": tm_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        # Settings that change what is measured: backend, autotuning, interpreter.
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TRITONMOE_") or k == "TRITON_INTERPRET"},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu_name=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_memory_bytes=int(props.total_memory),
            driver=nvml_driver_version(),
        )
    return env
