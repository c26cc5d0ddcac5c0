"""GPU telemetry during each benchmark, sampled with NVML (nvidia-ml-py) on a background thread.

While a benchmark's timed reps run, a daemon thread reads the GPU's utilization (%), memory in
use (bytes), power draw (W) and SM clock (MHz) every ``interval_s`` (plus once at start and
once at stop, so even a short benchmark has two samples); :meth:`Telemetry.stop` returns their
mean and max. NVML calls go through ctypes and release the GIL, so the sampler does not hold up
the thread that launches kernels.

Without a CUDA device, or when NVML cannot be loaded or initialized, :meth:`Telemetry.create`
returns a disabled sampler and prints one line saying why; a disabled sampler's ``stop()``
returns None and nothing else about the run changes.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

METRICS = ("gpu_util_pct", "mem_used_bytes", "power_w", "sm_clock_mhz")


class Telemetry:
    """Background NVML sampler for one GPU. Use :meth:`create`; ``start()`` / ``stop()`` bracket
    one benchmark."""

    def __init__(self, nvml=None, handle=None, *, interval_s: float = 0.02, reason: str | None = None) -> None:
        self.nvml = nvml
        self.handle = handle
        self.interval_s = interval_s
        self.reason = reason
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._samples: dict[str, list[float]] = {m: [] for m in METRICS}
        self._broken: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.nvml is not None and self.handle is not None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def disabled(cls, reason: str) -> "Telemetry":
        return cls(reason=reason)

    @classmethod
    def create(
        cls,
        device: torch.device,
        *,
        interval_s: float = 0.02,
        log: Callable[[str], None] = print,
        nvml=None,
    ) -> "Telemetry":
        """A sampler for ``device``, or a disabled one (announced with one ``log`` line) when
        there is no CUDA device or no working NVML. ``nvml`` replaces the pynvml module (tests)."""
        device = torch.device(device)
        if device.type != "cuda":
            t = cls.disabled("no CUDA device")
        else:
            try:
                if nvml is None:
                    import pynvml as nvml  # nvidia-ml-py
                nvml.nvmlInit()
                handle = _handle_for(nvml, device)
                t = cls(nvml, handle, interval_s=interval_s)
            except Exception as exc:  # ImportError, NVMLError (no library, no permission, ...)
                t = cls.disabled(f"NVML unavailable: {type(exc).__name__}: {exc}".strip())
        if not t.enabled:
            log(f"telemetry: off ({t.reason})")
        return t

    # -- sampling -------------------------------------------------------------------------------

    def _read(self, metric: str) -> float:
        nv, h = self.nvml, self.handle
        if metric == "gpu_util_pct":
            return float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
        if metric == "mem_used_bytes":
            return float(nv.nvmlDeviceGetMemoryInfo(h).used)
        if metric == "power_w":
            return nv.nvmlDeviceGetPowerUsage(h) / 1000.0  # milliwatts
        return float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))

    def sample(self) -> None:
        """Read every metric once; a metric the GPU does not report is dropped for good."""
        for m in METRICS:
            if m in self._broken:
                continue
            try:
                self._samples[m].append(self._read(m))
            except Exception:  # NVMLError_NotSupported and the like: stop asking for it
                self._broken.add(m)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        if not self.enabled:
            return
        self._samples = {m: [] for m in METRICS}
        self._stop.clear()
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="bench-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> dict | None:
        """Stop sampling; the summary {"samples": n, metric: {"mean", "max"} or None, ...}."""
        if not self.enabled or self._thread is None:
            return None
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._thread = None
        self.sample()
        out: dict = {"samples": max((len(v) for v in self._samples.values()), default=0)}
        for m, vals in self._samples.items():
            out[m] = {"mean": sum(vals) / len(vals), "max": max(vals)} if vals else None
        return out

    def close(self) -> None:
        if self.enabled:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # shutting down twice or a vanished driver: nothing to clean up
                pass
            self.handle = None


def _norm_uuid(u) -> str:
    s = u.decode() if isinstance(u, bytes) else str(u)
    s = s.strip().lower()
    return s[4:] if s.startswith("gpu-") else s


def _handle_for(nvml, device: torch.device):
    """The NVML handle of a torch CUDA device. NVML numbers every GPU of the machine while torch
    numbers the visible ones (CUDA_VISIBLE_DEVICES), so match by UUID, then fall back to the
    index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        want = _norm_uuid(uuid)
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            if _norm_uuid(nvml.nvmlDeviceGetUUID(h)) == want:
                return h
    return nvml.nvmlDeviceGetHandleByIndex(index)
