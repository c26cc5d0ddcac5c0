"""The tuner's device timer: interleaved rounds of CUDA-graph replays timed with events.

:func:`interleaved` is the one function the tuner calls (through :data:`MEASURE`, which the
harness may point at another timer with the same signature, e.g. ``bench.timing``'s, without
touching the tuner). Method (issue 28's):

* each candidate's launch is captured ``n`` times into one CUDA graph, ``n`` chosen so that a
  replay lasts at least ``min_replay_s`` (about 1 ms), then warmed up for ``warmup_s`` in total;
* each round replays every candidate once, in an order rotated by one per round (so no
  candidate always runs first or right after the same neighbour), each replay between two CUDA
  events; the per-call time is the replay time over ``n``;
* where a launch cannot be captured (e.g. it synchronizes with the host), the candidate is timed
  as ``n`` eager calls between the same events instead (its times are then launch-bound too).

On CPU (the Triton interpreter) the same rounds use ``time.perf_counter`` around single calls:
that time says nothing about a GPU and only serves to exercise the tuner end to end in tests.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

__all__ = ["interleaved", "MEASURE"]


def _cuda_round_setup(fn: Callable[[], object], min_replay_s: float, max_calls: int, pool):
    """(replay callable, calls per replay, captured?)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        fn()
    b.record()
    b.synchronize()
    per = max(a.elapsed_time(b) / 3e3, 1e-7)
    n = int(min(max_calls, max(1, math.ceil(min_replay_s / per))))
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            for _ in range(n):
                fn()
        torch.cuda.synchronize()
        return g.replay, n, True
    except Exception:  # noqa: BLE001 - capture refused (host sync, unsupported op): time eager calls
        torch.cuda.synchronize()

        def eager():
            for _ in range(n):
                fn()

        return eager, n, False


def interleaved(fns: Sequence[Callable[[], object]], *, device: torch.device, rounds: int,
                min_replay_s: float = 1e-3, warmup_s: float = 0.2, max_calls: int = 1000) -> list[list[float]]:
    """Seconds per call of each ``fns[i]`` in each of ``rounds`` rotated rounds:
    ``result[i][r]``. See the module docstring."""
    m = len(fns)
    out: list[list[float]] = [[] for _ in range(m)]
    if m == 0 or rounds <= 0:
        return out
    if device.type != "cuda":
        for f in fns:
            f()
        for r in range(rounds):
            for j in range(m):
                i = (j + r) % m
                t0 = time.perf_counter()
                fns[i]()
                out[i].append(time.perf_counter() - t0)
        return out
    pool = torch.cuda.graph_pool_handle()
    setups = [_cuda_round_setup(f, min_replay_s, max_calls, pool) for f in fns]
    t_end = time.perf_counter() + warmup_s
    while time.perf_counter() < t_end:  # warm-up: clocks, caches, the graphs' first replays
        for replay, _, _ in setups:
            replay()
        torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(m)]
    for r in range(rounds):
        for j in range(m):
            i = (j + r) % m
            a, b = ev[i]
            a.record()
            setups[i][0]()
            b.record()
        torch.cuda.synchronize()
        for i in range(m):
            a, b = ev[i]
            out[i].append(a.elapsed_time(b) / 1e3 / setups[i][1])
    del setups
    return out


#: The timer the tuner uses (same signature as :func:`interleaved`).
MEASURE = interleaved
