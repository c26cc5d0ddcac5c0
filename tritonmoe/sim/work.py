"""The work of every operation of a MoE layer step, for the simulator's roofline.

FLOPs and bytes follow ``bench/work.py`` (the harness's analytic work of each benchmark: GEMM
FLOPs as 2 per multiply-add, bytes as what an ideal implementation reads and writes once), split
the way the schedules run the ops: the expert FFN's backward as its input-gradient part ("B")
and its weight-gradient part ("W", deferred to one step when the GEMM supports it), and the
expert op of a pipeline as re-layout + FFN + re-layout. ``tests/test_plan_work.py`` checks that
the totals equal ``bench.work``'s.

``launches`` counts kernels (or, for the plain-PyTorch reference that runs on CPU, ATen ops):
the reference launches one op per tensor expression and loops over experts, the Triton kernels
launch one or two programs per op. A fitted cost model prices each launch (``launch_s``), so
these counts are what make small micro-batches cost more than their FLOPs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tritonmoe.comm.executor import Work

__all__ = ["WorkModel", "IDS", "WEIGHTS", "ROWS", "HOST", "HOST_UNIT"]

IDS, WEIGHTS, ROWS = 4, 4, 8

#: Work kind of the host work around an expert op that is neither a kernel nor modelled by its
#: kernels' launches: the autograd recording of the forward, the ``torch.autograd.grad`` call of
#: the backward, the expert function's dispatch lookups. A fitted cost model prices one unit
#: (``launch_s`` of this kind, measured on the real expert op); clusters price it at 0.
HOST = "host"
HOST_UNIT = Work(0.0, 0.0, HOST, 1)

#: Ops launched per call, (reference, kernel): counted from tritonmoe.reference and the
#: launchers (per expert where the reference loops over experts: see WorkModel).
_LAUNCHES = {
    "router_fwd": (1, 1),
    "router_bwd": (2, 2),
    "route_fwd": (16, 2),
    "route_bwd": (8, 2),
    "permute_fwd": (30, 3),
    "permute_bwd": (4, 1),
    "unpermute_fwd": (12, 1),
    "unpermute_bwd": (10, 2),
    "relayout": (12, 1),
    "cat": (1, 1),
    "accumulate": (1, 1),
}


@dataclass(frozen=True)
class WorkModel:
    """Work of the ops of one layer shape: ``d`` model width, ``f`` expert hidden width, ``n1``
    w1's columns (2f for swiglu), ``E`` experts, ``k`` top-k, ``s`` bytes per element, ``kernels``
    (Triton kernels rather than the plain-PyTorch reference)."""

    d: int
    f: int
    n1: int
    E: int
    k: int
    s: int
    kernels: bool = False

    def _n(self, op: str) -> int:
        return _LAUNCHES[op][1 if self.kernels else 0]

    def wbytes(self, experts: int) -> int:
        """Bytes of ``experts`` experts' w1 and w2."""
        return experts * (self.d * self.n1 + self.f * self.d) * self.s

    # -- prologue / epilogue -------------------------------------------------------------------

    def router(self, T: int, *, backward: bool) -> Work:
        """The router GEMM [T, d] x [d, E] (backward: d(x) and d(w))."""
        d, E, s = self.d, self.E, self.s
        if not backward:
            return Work(2.0 * T * d * E, (T * d + d * E + T * E) * s, "gemm", self._n("router_fwd"))
        return Work(4.0 * T * d * E, 2 * (T * E + T * d + d * E) * s, "gemm", self._n("router_bwd"))

    def route(self, T: int, *, backward: bool) -> Work:
        """Scores, top-k, weights, counts (bench.work.route)."""
        E, k, s = self.E, self.k, self.s
        if not backward:
            return Work(0.0, T * E * s + T * k * (IDS + WEIGHTS) + E * 4, "elementwise", self._n("route_fwd"))
        return Work(0.0, T * k * (WEIGHTS + IDS) + 2 * T * E * s, "elementwise", self._n("route_bwd"))

    def permute(self, T: int, R: int, *, backward: bool) -> Work:
        """Gather T tokens' rows into R expert-ordered rows (bench.work.permute)."""
        d, k, E, s = self.d, self.k, self.E, self.s
        if not backward:
            return Work(0.0, T * d * s + T * k * IDS + R * d * s + T * k * ROWS + (E + 1) * 8, "copy", self._n("permute_fwd"))
        return Work(0.0, R * d * s + T * k * ROWS + T * d * s, "copy", self._n("permute_bwd"))

    def unpermute(self, T: int, R: int, *, backward: bool) -> Work:
        """Weighted sum of each token's k rows (bench.work.unpermute)."""
        d, k, s = self.d, self.k, self.s
        if not backward:
            return Work(0.0, R * d * s + T * k * (ROWS + WEIGHTS) + T * d * s, "copy", self._n("unpermute_fwd"))
        b = T * d * s + R * d * s + T * k * (ROWS + WEIGHTS) + R * d * s + T * k * WEIGHTS
        return Work(0.0, b, "copy", self._n("unpermute_bwd"))

    def cat(self, T: int) -> Work:
        """Concatenating the micro-batches' outputs (read and write [T, d])."""
        return Work(0.0, 2 * T * self.d * self.s, "copy", self._n("cat"))

    def accumulate(self, nbytes: int) -> Work:
        """``a + b`` of two ``nbytes`` tensors (a gradient accumulation)."""
        return Work(0.0, 3 * nbytes, "elementwise", self._n("accumulate"))

    # -- the expert op -------------------------------------------------------------------------

    @functools.lru_cache(maxsize=4096)
    def relayout(self, R: int, segments: int) -> Work:
        """One re-layout copy of R rows in ``segments`` segments (copy_segments)."""
        n = self._n("relayout") + (0 if self.kernels else 2 * segments)
        return Work(0.0, 2 * R * self.d * self.s, "copy", n)

    def _gemm_launches(self, experts: int) -> int:
        # reference: one matmul per expert per GEMM plus the activation's ops; kernels: one per GEMM
        return 2 if self.kernels else 2 * experts + 8

    @functools.lru_cache(maxsize=4096)
    def ffn_fwd(self, R: int, experts: int) -> Work:
        """grouped_ffn forward over R rows of ``experts`` active experts (bench.work.grouped_ffn)."""
        d, f, n1, s = self.d, self.f, self.n1, self.s
        flops = 2.0 * R * d * n1 + 2.0 * R * f * d
        return Work(flops, R * d * s + self.wbytes(experts) + R * d * s, "gemm", self._gemm_launches(experts))

    @functools.lru_cache(maxsize=4096)
    def ffn_dx(self, R: int, experts: int) -> Work:
        """The FFN's input-gradient part ("B"): d(x) through both GEMMs and the activation."""
        d, f, n1, s = self.d, self.f, self.n1, self.s
        flops = 2.0 * R * d * n1 + 2.0 * R * f * d
        b = 2 * R * d * s + self.wbytes(experts) + 2 * R * n1 * s
        return Work(flops, b, "gemm", self._gemm_launches(experts) + (0 if self.kernels else 4))

    @functools.lru_cache(maxsize=4096)
    def ffn_dw(self, R: int, experts: int) -> Work:
        """The FFN's weight-gradient part ("W"): x^T dy of both GEMMs."""
        d, f, n1, s = self.d, self.f, self.n1, self.s
        flops = 2.0 * R * d * n1 + 2.0 * R * f * d
        return Work(flops, R * d * s + self.wbytes(experts), "gemm", self._gemm_launches(experts))

    @functools.lru_cache(maxsize=4096)
    def expert_fwd(self, R: int, experts: int, segments: int) -> Work:
        """The pipeline's expert op: to expert-major, grouped FFN, back to source-major, and the
        op's own host work (autograd recording, dispatch lookups: one :data:`HOST` unit)."""
        return self.relayout(R, segments) + self.ffn_fwd(R, experts) + self.relayout(R, segments) + HOST_UNIT

    @functools.lru_cache(maxsize=4096)
    def expert_bwd(self, R: int, experts: int, segments: int, *, defer_wgrad: bool, accumulate: bool,
                   local_experts: int) -> Work:
        """The expert op's backward: the re-layouts' backward, d(x), and d(w) unless deferred to
        the W step; ``accumulate``: add this micro-op's weight gradients to the earlier ones'."""
        w = self.relayout(R, segments) + self.ffn_dx(R, experts)
        if not defer_wgrad:
            w = w + self.ffn_dw(R, experts)
            if accumulate:
                w = w + self.accumulate(self.wbytes(local_experts))
        return w + self.relayout(R, segments) + HOST_UNIT

    def wgrad_step(self, R: int, experts: int) -> Work:
        """The deferred W step over every micro-op's R rows."""
        return self.ffn_dw(R, experts)
