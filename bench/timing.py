"""Device time, eager time and the NVML clock of every rep (the method of ``python -m bench check``).

Two labelled times per row:

* **device time**: the callable is captured ``N`` times into one CUDA graph, and each rep times one
  replay of that graph with CUDA events, divided by ``N``. ``N`` comes from an eager estimate made
  after the warm-up, so that one replay lasts at least :data:`REPLAY_TARGET_S` (about 1 ms): the
  launch gaps of microsecond ops vanish and the event resolution (about 0.5 us) stays under 0.1%.
  Timing mode ``graph``.
* **cold L2** (``cold_l2=True``, for microsecond ops whose inputs fit in the L2): the graph holds
  ``[flush, call] x N`` where *flush* writes a buffer of twice the L2, and a second graph holds
  ``[flush] x N``; each rep replays both, back to back, and the call's time is their difference
  over ``N`` (timing mode ``graph-flush``). We chose the subtracted flush node over the profiler's
  kernel durations: it needs no profiler (whose own overhead and buffering would cost device time
  in every round), it keeps the same replay-and-events path as the warm rows, and it stays
  inside the interleaved rounds. Its cost is the flush's own jitter, which lands on the difference:
  the flush is kept small (2 x L2, about 33 us on an H100) to bound it.
* **eager time**: the event interval of one eager call (the L2 flushed before it, outside the
  events, when ``cold_l2``), i.e. what a user's call costs on the device timeline including the
  gaps where the GPU waits for the host. The launchers' host CPU cost is measured apart
  (``python -m bench host``) and printed beside it.

When a callable cannot be captured (a host sync inside it, such as ``permute`` reading its row
count back; an out-of-memory in the graph's private pool; anything else), device time falls back
to the event interval of ``N`` eager calls (timing mode ``eager``, the capture's error in
``timing_note``). Without CUDA (the CPU stand-in shapes), both times are ``time.perf_counter``
wall times (timing mode ``cpu``).

Clocks: :class:`NvmlClock` reads the SM clock (MHz) and the clock-throttle reasons through NVML
before and after each rep, read-only (never sets a clock or any other device setting).

Everything that touches a device goes through a *backend* (:class:`CudaBackend`,
:class:`CpuBackend`, or a fake in the tests): ``elapsed(thunk)`` (seconds of one timed region),
``capture(thunk, n)`` (a replay callable, or raises), ``flush()``, ``sync()``, ``now()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

#: One replay of a captured graph lasts at least this long (``N`` calls are captured per replay).
REPLAY_TARGET_S = 1e-3
#: Most calls captured into one graph (microsecond ops reach 1 ms with a few hundred).
MAX_CALLS_PER_REPLAY = 512
#: Warm-up after the first (compiling, autotuning) call, in seconds of calls.
WARMUP_S = 0.2
#: Fallback L2 size when the device does not say (H100/H200: 50-60 MiB).
DEFAULT_L2_BYTES = 50 * 2**20

MODES = ("graph", "graph-flush", "eager", "cpu")


class CaptureError(RuntimeError):
    """A callable that cannot be captured into a CUDA graph (the row falls back to eager)."""


# ---------------------------------------------------------------------------------------------
# Backends: what touches the device
# ---------------------------------------------------------------------------------------------


class CpuBackend:
    """Wall-clock timing on the host (no graphs, no cache flush)."""

    is_cuda = False

    def now(self) -> float:
        return time.perf_counter()

    def elapsed(self, thunk: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        thunk()
        return time.perf_counter() - t0

    def capture(self, thunk: Callable[[], Any], n: int) -> Callable[[], None]:
        raise CaptureError("no CUDA device: no graphs on CPU")

    def flush(self) -> None:
        return None

    def sync(self) -> None:
        return None


class CudaBackend:
    """CUDA events on the current stream; CUDA graphs; an L2 flush of twice the L2."""

    is_cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        props = torch.cuda.get_device_properties(self.device)
        l2 = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
        self._flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device=self.device)

    def now(self) -> float:
        return time.perf_counter()

    def elapsed(self, thunk: Callable[[], Any]) -> float:
        stream = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        thunk()
        end.record(stream)
        end.synchronize()  # the one host sync per timed region: the events must be read
        return start.elapsed_time(end) * 1e-3

    def capture(self, thunk: Callable[[], Any], n: int) -> Callable[[], None]:
        """A CUDA graph of ``n`` calls of ``thunk`` (warmed on a side stream first, as torch's
        docs ask); returns its ``replay``. Any failure is a :class:`CaptureError`."""
        stream = torch.cuda.current_stream(self.device)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                for _ in range(2):
                    thunk()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(n):
                    thunk()
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # a sync inside, OOM in the pool, an op graphs refuse: eager
            # a capture that failed inside torch.cuda.graph may leave its side stream current
            # (its __exit__ stops at the failing capture_end): put the timing stream back
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize(self.device)
            raise CaptureError(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
        return graph.replay

    def flush(self) -> None:
        self._flush_buf.zero_()

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


def backend_for(device: torch.device):
    device = torch.device(device)
    return CudaBackend(device) if device.type == "cuda" else CpuBackend()


# ---------------------------------------------------------------------------------------------
# Clocks (NVML, read-only)
# ---------------------------------------------------------------------------------------------

#: NVML clock-throttle reason bits (nvmlClocksEventReasons / nvmlClocksThrottleReasons) -> name.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "app_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


class NullClock:
    """No clock readings (CPU, or NVML unavailable)."""

    enabled = False

    def read(self) -> tuple[float, int] | None:
        return None


class NvmlClock:
    """The SM clock in MHz and the throttle-reason bit mask of one GPU, read through NVML.

    Read-only: only ``nvmlDeviceGetClockInfo`` and ``nvmlDeviceGetCurrentClocksThrottleReasons``
    (or its newer name ``...ClocksEventReasons``) are called. ``handle`` comes from
    :func:`bench.telemetry` 's UUID matching; tests pass a fake ``nvml``.
    """

    enabled = True

    def __init__(self, nvml, handle) -> None:
        self.nvml, self.handle = nvml, handle
        self._reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))

    def read(self) -> tuple[float, int] | None:
        try:
            mhz = float(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
        except Exception:  # NVML error mid-run: this rep has no clock
            return None
        mask = 0
        if self._reasons is not None:
            try:
                mask = int(self._reasons(self.handle))
            except Exception:  # not supported on this GPU/driver: clocks only
                mask = 0
        return mhz, mask

    @classmethod
    def from_telemetry(cls, telemetry) -> NvmlClock | NullClock:
        """The clock of the GPU an enabled :class:`bench.telemetry.Telemetry` samples."""
        if telemetry is None or not getattr(telemetry, "enabled", False):
            return NullClock()
        return cls(telemetry.nvml, telemetry.handle)


# ---------------------------------------------------------------------------------------------
# Peak FLOP per clock per SM (for per-clock efficiency)
# ---------------------------------------------------------------------------------------------

#: Dense tensor-core FLOP per clock per SM on Hopper (sm_90), by dtype. Derived from NVIDIA's
#: H100 SXM5 datasheet peak at its boost clock: 989.4 TFLOP/s dense bf16/fp16 / (132 SMs x
#: 1.830 GHz) = 4096 FLOP/clock/SM (the PCIe card gives the same: 756 TFLOP/s / (114 x 1.620
#: GHz) = 4094); tf32 is half of it (494.7 TFLOP/s), fp8 twice (1979 TFLOP/s); the H200 is the
#: same chip (132 SMs). fp32 without tensor cores: 128 FMA = 256 FLOP per clock per SM.
HOPPER_FLOP_PER_CLOCK_SM = {"bfloat16": 4096.0, "float16": 4096.0, "tf32": 2048.0, "float8_e4m3fn": 8192.0,
                            "float32": 256.0}


def flop_per_clock_sm(capability: str | None, dtype: str | None) -> float | None:
    """Peak dense FLOP/clock/SM for a device capability ("9.0") and dtype; None where unknown
    (per-clock efficiency is then not reported rather than guessed)."""
    if capability != "9.0" or dtype is None:
        return None
    return HOPPER_FLOP_PER_CLOCK_SM.get(dtype)


def per_clock_efficiency(flops: float, seconds: float, sms: int, flop_per_clock: float, mhz: float) -> float:
    """FLOPs / time / (SMs x FLOP per clock per SM x clock): the fraction of the tensor-core peak
    at the clock the rep actually ran at."""
    return flops / seconds / (sms * flop_per_clock * mhz * 1e6)


# ---------------------------------------------------------------------------------------------
# One prepared callable
# ---------------------------------------------------------------------------------------------


@dataclass
class Rep:
    """One rep of one implementation in one round."""

    device_s: float
    eager_s: float | None = None
    mhz_before: float | None = None
    mhz_after: float | None = None
    throttle: int = 0

    @property
    def mhz(self) -> float | None:
        vals = [v for v in (self.mhz_before, self.mhz_after) if v is not None]
        return sum(vals) / len(vals) if vals else None


@dataclass
class Prepared:
    """A callable ready for the rounds: warmed up, its ``N`` chosen, captured (or not)."""

    name: str
    fn: Callable[[], Any]
    mode: str
    calls: int
    cold_l2: bool
    note: str | None = None
    replay: Callable[[], None] | None = None
    flush_replay: Callable[[], None] | None = None
    warmup_s: float = 0.0
    estimate_s: float = 0.0
    eager: bool = True
    reps: list[Rep] = field(default_factory=list)


class DeviceTimer:
    """Prepares callables (:meth:`prepare`) and times one rep of a prepared one (:meth:`rep`).

    ``min_rounds`` / ``min_device_s`` / ``max_rounds`` are the round counts the rounds runner
    (:mod:`bench.rounds`) asks of a comparison; they live here so a section configures one object.
    """

    def __init__(self, backend, clock=None, *, replay_target_s: float = REPLAY_TARGET_S,
                 max_calls: int = MAX_CALLS_PER_REPLAY, warmup_s: float = WARMUP_S, cold_l2: bool = False,
                 min_rounds: int = 30, min_device_s: float = 0.5, max_rounds: int = 1000,
                 max_case_s: float = 30.0, eager: bool = True, eager_reps: int = 30) -> None:
        if min_rounds < 1 or max_rounds < min_rounds:
            raise ValueError(f"rounds: need 1 <= min_rounds ({min_rounds}) <= max_rounds ({max_rounds})")
        self.backend = backend
        self.clock = clock or NullClock()
        self.replay_target_s = replay_target_s
        self.max_calls = max_calls
        self.warmup_s = warmup_s
        self.cold_l2 = cold_l2
        self.min_rounds, self.min_device_s, self.max_rounds = min_rounds, min_device_s, max_rounds
        self.max_case_s = max_case_s
        self.eager = eager
        self.eager_reps = eager_reps

    @property
    def device_kind(self) -> str:
        return "cuda" if self.backend.is_cuda else "cpu"

    def _call_once(self, fn: Callable[[], Any], cold: bool) -> Callable[[], None]:
        if not cold:
            return fn

        def thunk():
            self.backend.flush()
            fn()

        return thunk

    def prepare(self, name: str, fn: Callable[[], Any], *, cold_l2: bool | None = None,
                eager: bool | None = None) -> Prepared:
        """Compile (first call), warm up for ``warmup_s``, estimate one call, choose ``N`` and
        capture. ``eager=False``: no eager time (the roof pseudo-implementations). Exceptions of
        ``fn`` itself propagate (the row records them)."""
        be = self.backend
        with_eager = self.eager if eager is None else eager
        cold = self.cold_l2 if cold_l2 is None else cold_l2
        cold = cold and be.is_cuda
        fn()  # compile / autotune: not part of the warm-up
        be.sync()
        t0 = be.now()
        est = []
        while True:  # warm-up: calls until warmup_s has passed (at least two)
            est.append(be.elapsed(fn))
            if len(est) >= 2 and be.now() - t0 >= self.warmup_s:
                break
            if len(est) >= 10_000:
                break
        warm = be.now() - t0
        tail = sorted(est[len(est) // 2:])
        one = max(tail[len(tail) // 2], 1e-9)  # the median of the later half: the steady call
        if not be.is_cuda:
            return Prepared(name, fn, "cpu", 1, False, None, warmup_s=warm, estimate_s=one, eager=with_eager)
        flush_s = be.elapsed(be.flush) if cold else 0.0
        calls = max(1, min(self.max_calls, math.ceil(self.replay_target_s / max(one + flush_s, 1e-9))))
        try:
            replay = be.capture(self._call_once(fn, cold), calls)
            flush_replay = be.capture(be.flush, calls) if cold else None
        except CaptureError as exc:
            return Prepared(name, fn, "eager", calls, cold, f"graph capture failed, eager event timing: {exc}",
                            warmup_s=warm, estimate_s=one, eager=with_eager)
        return Prepared(name, fn, "graph-flush" if cold else "graph", calls, cold, None, replay, flush_replay,
                        warmup_s=warm, estimate_s=one, eager=with_eager)

    def rep(self, p: Prepared) -> Rep:
        """One rep: the clock, the device time of one replay (or its fallback), one eager call
        (in the first ``eager_reps`` reps only: eager time needs fewer samples than the device
        time's ratios, and a millisecond entry's eager call would double its cost), the clock
        again. Appended to ``p.reps`` and returned."""
        be = self.backend
        before = self.clock.read()
        if p.mode == "graph":
            dev = be.elapsed(p.replay) / p.calls
        elif p.mode == "graph-flush":
            dev = max(be.elapsed(p.replay) - be.elapsed(p.flush_replay), 0.0) / p.calls
        elif p.mode == "eager" and p.cold_l2:
            total = 0.0
            for _ in range(p.calls):
                be.flush()
                total += be.elapsed(p.fn)
            dev = total / p.calls
        elif p.mode == "eager":
            dev = be.elapsed(lambda: [p.fn() for _ in range(p.calls)]) / p.calls
        else:  # cpu
            dev = be.elapsed(p.fn)
        eager = None
        if p.eager and len(p.reps) < self.eager_reps:
            if p.mode == "cpu":
                eager = dev
            else:
                if p.cold_l2:
                    be.flush()
                eager = be.elapsed(p.fn)
        after = self.clock.read()
        rep = Rep(dev, eager, before[0] if before else None, after[0] if after else None,
                  (before[1] if before else 0) | (after[1] if after else 0))
        p.reps.append(rep)
        return rep


__all__ = [
    "HOPPER_FLOP_PER_CLOCK_SM",
    "MODES",
    "THROTTLE_REASONS",
    "CaptureError",
    "CpuBackend",
    "CudaBackend",
    "DeviceTimer",
    "NullClock",
    "NvmlClock",
    "Prepared",
    "Rep",
    "backend_for",
    "flop_per_clock_sm",
    "per_clock_efficiency",
    "throttle_names",
]
