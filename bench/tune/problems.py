"""One tuning job's inputs, its launch and its plain-PyTorch reference.

Launches go through the kernel launchers (:mod:`tritonmoe.kernels`), not the public ops, whose
argument checks may read values back to the host and so prevent CUDA-graph capture; the inputs
here are well-formed by construction.

:func:`build` makes a :class:`Problem` for a :class:`~bench.tune.space.Job`: random inputs (never
zeros) at the job's bucket, ``run()`` (the one launch of the job's kernel, with whatever config
is active: the tuner wraps it in ``tritonmoe.kernels.config.override``) and ``check(out)``,
which compares an output with the reference computed once in fp64 (ids and permutations
exactly; floats by ``||out - ref|| / ||ref||`` under a per-dtype bound that a wrong row, tile or
expert index exceeds by orders of magnitude). Before a checked run the outputs' memory is
poisoned with NaN (:func:`poison`), so an element a candidate never writes fails the check.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tritonmoe import reference as ref
from tritonmoe.kernels import gemm_kinds as GK
from tritonmoe.kernels import grouped_ffn as kf
from tritonmoe.kernels import grouped_gemm as kg
from tritonmoe.kernels import permute as kp
from tritonmoe.kernels import routing as kr

from .space import Job

__all__ = ["Problem", "build", "TOLERANCE", "rel_error", "poison"]

#: Bound on ||out - ref|| / ||ref|| per precision (outputs rounded to the dtype once; fp32
#: accumulation). A wrong index gives errors near 1.
TOLERANCE = {"bf16": 2e-2, "fp16": 4e-3, "tf32": 4e-3, "fp32": 1e-5}


@dataclasses.dataclass
class Problem:
    """``run()`` launches once and returns the output(s); ``check(out)`` -> (ok, detail)."""

    job: Job
    run: Callable[[], Any]
    reference: Callable[[], Any]
    compare: Callable[[Any, Any], tuple[bool, str]]
    out_bytes: int
    in_bytes: int
    _ref: Any = None

    def check(self, out: Any) -> tuple[bool, str]:
        if self._ref is None:
            self._ref = self.reference()
        return self.compare(out, self._ref)


def rel_error(out: torch.Tensor, want: torch.Tensor) -> float:
    """||out - want|| / ||want|| in fp64 (inf when out has a non-finite value)."""
    o = out.double()
    if not torch.isfinite(o).all():
        return math.inf
    den = want.double().norm().item()
    return (o - want.double()).norm().item() / max(den, 1e-30)


def poison(nbytes: int, device: torch.device) -> None:
    """Fill freed memory of about ``nbytes`` with NaN, so the next allocations of that size (the
    candidate's outputs) start as NaN rather than a previous candidate's correct values."""
    if nbytes > 0:
        t = torch.full((nbytes // 4 + 1,), float("nan"), device=device, dtype=torch.float32)
        del t


def _gen(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device, generator=gen, dtype=torch.float32) * scale).to(dtype)


def _segments(E: int, M: int, device) -> torch.Tensor:
    return torch.arange(E + 1, device=device, dtype=torch.int64) * M


def _float_compare(tol: float, what: str):
    def compare(out, want) -> tuple[bool, str]:
        err = rel_error(out, want)
        return err <= tol, f"{what} rel err {err:.3g} (bound {tol:g})"

    return compare


def _gemm(job: Job, device, gen) -> Problem:
    L, dt = job.layer, job.torch_dtype
    E, M = L.E, job.bucket
    R = E * M
    offs = _segments(E, M, device)
    kind = job.kind
    prec = GK.precision_name(dt, dt == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32))
    tol = TOLERANCE[prec]
    n, k = job.gemm_nk()
    h = None
    if kind == "wgrad":  # a [R, k=M_out] , h [R, n]
        a = _randn((R, k), dt, device, gen)
        h = _randn((R, n), dt, device, gen, 1.0 / math.sqrt(max(M, 1)))
        b = a
    elif kind in ("dact", "dact_swiglu"):  # dY [R, D] @ w2^T -> [R, F]; h [R, N1]
        a = _randn((R, k), dt, device, gen)
        b = _randn((E, n, k), dt, device, gen, 1.0 / math.sqrt(k))  # w2 [E, F, D]
        h = _randn((R, 2 * n if kind == "dact_swiglu" else n), dt, device, gen)
    else:
        a = _randn((R, k), dt, device, gen)
        cols = 2 * n if kind == "swiglu" else n
        if job.op == "dx":  # w1 [E, D=n, N1=k] seen transposed: [E, k, n] with K contiguous
            b = _randn((E, cols, k), dt, device, gen, 1.0 / math.sqrt(k)).transpose(1, 2)
        else:
            b = _randn((E, k, cols), dt, device, gen, 1.0 / math.sqrt(k))

    def run():
        return GK.run(kind, a, offs, b, h=h)

    def reference():
        outs = []
        for e in range(E):
            s, t = e * M, (e + 1) * M
            ae = a[s:t].double()
            if kind == "wgrad":
                outs.append(ae.T @ h[s:t].double())
                continue
            if kind in ("dact", "dact_swiglu"):
                g = (ae @ b[e].double().T).to(dt).double()  # the kernel rounds dY @ w2^T once
                he = h[s:t].double().requires_grad_(True)
                with torch.enable_grad():
                    if kind == "dact_swiglu":
                        hg, hu = he.chunk(2, dim=1)
                        y = F.silu(hg) * hu
                    else:
                        y = F.gelu(he)
                    (dh,) = torch.autograd.grad(y, he, g)
                outs.append(dh)
                continue
            y = ae @ b[e].double()
            if kind == "swiglu":
                hg, hu = y.chunk(2, dim=1)
                y = F.silu(hg) * hu
            elif kind == "mm_act":
                y = F.gelu(y)
            outs.append(y)
        return torch.stack(outs) if kind == "wgrad" else torch.cat(outs)

    out_elems = E * k * n if kind == "wgrad" else R * (h.shape[1] if kind.startswith("dact") else n)
    in_bytes = sum(t.numel() * t.element_size() for t in (a, b, h) if t is not None)
    return Problem(job, run, reference, _float_compare(tol, kind), out_elems * dt.itemsize, in_bytes)


def _routing(L, T: int, device, gen, dt=torch.float32):
    logits = _randn((T, L.E), torch.float32, device, gen)
    return ref.route(logits, L.topk)


def _decode(job: Job, device, gen) -> Problem:
    L, dt, T = job.layer, job.torch_dtype, job.bucket
    x = _randn((T, L.D), dt, device, gen)
    w1 = _randn((L.E, L.D, L.n1), dt, device, gen, 1.0 / math.sqrt(L.D))
    w2 = _randn((L.E, L.F, L.D), dt, device, gen, 1.0 / math.sqrt(L.F))
    routing = _routing(L, T, device, gen)
    prec = GK.precision_name(dt, False)

    def run():  # the launcher itself: the public op's value checks would sync (no graph capture)
        with torch.no_grad():
            return kf.moe_ffn(x, routing, w1, w2, L.activation)

    def reference():
        r64 = dataclasses.replace(routing, topk_weights=routing.topk_weights.double())
        return ref.moe_ffn(x.double(), r64, w1.double(), w2.double(), L.activation)

    nb = (x.numel() + w1.numel() + w2.numel()) * dt.itemsize
    return Problem(job, run, reference, _float_compare(TOLERANCE[prec], "moe_ffn decode"), T * L.D * dt.itemsize, nb)


def _exact_compare(names):
    def compare(out, want) -> tuple[bool, str]:
        for name, o, w in zip(names, out, want):
            if o.shape != w.shape or not torch.equal(o.cpu(), w.cpu()):
                return False, f"{name} differs from the reference"
        return True, "exact"

    return compare


def _permute(job: Job, device, gen) -> Problem:
    L, dt = job.layer, job.torch_dtype
    T = job.bucket // L.topk if job.target == "permute.metadata" else job.bucket
    routing = _routing(L, T, device, gen)
    ids = routing.topk_ids
    if job.target == "permute.metadata":
        def run():
            info = kp.permute_metadata(ids, L.E)
            return info.counts, info.expert_offsets, info.slot_rows

        def reference():
            info = ref.permute_metadata(ids.long(), L.E)
            return info.counts.to(torch.int32), info.expert_offsets, info.slot_rows

        return Problem(job, run, reference, _exact_compare(("counts", "offsets", "slot_rows")), ids.numel() * 16,
                       ids.numel() * 4)
    x = _randn((T, L.D), dt, device, gen)
    info = ref.permute_metadata(ids.long(), L.E)
    info = dataclasses.replace(info, counts=info.counts.to(torch.int32))
    R = T * L.topk
    if job.target == "permute.scatter":
        def run():
            with torch.no_grad():
                return (kp.permute_rows(x, info, num_rows=R),)

        def reference():
            return (ref.permute_rows(x, info, R),)

        return Problem(job, run, reference, _exact_compare(("x_perm",)), R * L.D * dt.itemsize, x.numel() * dt.itemsize)
    y = _randn((R, L.D), dt, device, gen)
    w = routing.topk_weights

    def run():
        with torch.no_grad():
            return kp.unpermute(y, info, w)

    def reference():
        return ref.unpermute(y.double(), info, w.double())

    prec = GK.precision_name(dt, False)
    return Problem(job, run, reference, _float_compare(TOLERANCE[prec], "unpermute"), T * L.D * dt.itemsize,
                   y.numel() * dt.itemsize)


def _route(job: Job, device, gen) -> Problem:
    L, T = job.layer, job.bucket
    logits = _randn((T, L.E), job.torch_dtype, device, gen)

    def run():
        with torch.no_grad():
            r = kr.route(logits, L.topk)
        return r.topk_ids, r.counts, r.topk_weights

    def reference():
        r = ref.route(logits.float(), L.topk)
        return r.topk_ids, r.counts, r.topk_weights

    ids_cmp = _exact_compare(("topk_ids", "counts"))

    def compare(out, want):
        ok, why = ids_cmp(out[:2], want[:2])
        if not ok:
            return ok, why
        err = rel_error(out[2], want[2])
        return err <= 1e-5, f"weights rel err {err:.3g}"

    return Problem(job, run, reference, compare, T * L.topk * 12, logits.numel() * logits.element_size())


def build(job: Job, device: torch.device, seed: int = 0) -> Problem:
    """The problem of ``job`` on ``device`` (inputs drawn from ``seed`` and the job id)."""
    gen = _gen(zlib.crc32(f"{seed}|{job.id}".encode()) % (2**31), device)
    if job.target.startswith("gemm."):
        return _gemm(job, device, gen)
    if job.target.startswith("decode."):
        return _decode(job, device, gen)
    if job.target.startswith("permute."):
        return _permute(job, device, gen)
    return _route(job, device, gen)
