"""Cost models: what a collective, a copy and a compute cost, fitted by least squares or derived.

A :class:`CostModel` answers three questions for the discrete-event engine
(:mod:`tritonmoe.plan.engine`):

* **Collectives and copies**: ``alpha + beta * nbytes`` seconds per (collective kind, group size,
  link class), the alpha-beta model of Parm (paper 003 Eq. 12), fitted by least squares
  (:meth:`CostModel.fit`) from timed runs (``python -m tritonmoe.plan profile``). Where a single
  line does not fit the measurements (held-out error above :data:`PIECEWISE_TRIGGER`), the fit is
  piecewise in size, as MPMoE argues for hardware that is under-used at small volumes (004 §IV-B).
  ``nbytes`` is always what each rank passes in: the whole send buffer of an all-to-all (its own
  rows included), the shard of an all-gather, the full input of a reduce-scatter or all-reduce,
  the bytes a rank sends in a point-to-point exchange, the bytes of a copy.
* **Compute**: a roofline per :class:`~tritonmoe.comm.executor.Work` kind (``"gemm"``,
  ``"elementwise"``, ``"copy"``): ``launches * launch_s + t_ideal / eff(t_ideal)`` with
  ``t_ideal = max(flops / flops_per_s, bytes / bytes_per_s)`` and an efficiency curve ``eff``
  (piecewise linear in log t_ideal; 1 when the measurements show no under-utilization).
* **Interference** (MPMoE §4.4): ``interference[(y, x)]`` is the fraction of its speed an
  operation of class y (``"comm"``, ``"comp"``, ``"mem"``) keeps while an operation of class x
  (or ``"all"``: two other classes) runs concurrently on the same rank; 1 when not given.

A cost model derived from a :class:`~tritonmoe.plan.Cluster` (``cluster.cost_model(dtype)``)
keeps the cluster and decomposes every collective into link traffic instead (all-to-all
pairwise over intra- and inter-node links, rings for all-gather / reduce-scatter, all-reduce =
RS + AG), so concurrent transfers fair-share the links they cross.

Files are versioned JSON (:data:`FORMAT`, :data:`VERSION`): :meth:`CostModel.save` /
:meth:`CostModel.load`. A missing file, another version, or a group size the model was not fitted
for is an error that names the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

from tritonmoe.comm.executor import Work

__all__ = [
    "FORMAT",
    "VERSION",
    "COLLECTIVES",
    "COPIES",
    "LINK_CLASSES",
    "OP_CLASSES",
    "CostModelError",
    "LinearFit",
    "ComputeRate",
    "CommSample",
    "ComputeSample",
    "InterferenceSample",
    "HostSample",
    "CostModel",
    "fit_linear",
]

FORMAT = "tritonmoe.plan.CostModel"
VERSION = 1

#: Collective kinds (the executor's op names).
COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "send_recv")
#: Host/device copies (the simulated executor's op names).
COPIES = ("copy_d2h", "copy_h2d")
#: Link classes of a group: every member on one node, or not.
LINK_CLASSES = ("intra", "inter")
#: Interference classes: what kind of operation runs (``"all"``: two other classes at once).
OP_CLASSES = ("comm", "comp", "mem")

#: A single alpha-beta line is replaced by a piecewise fit when its held-out relative error is
#: above this and the piecewise fit's is below PIECEWISE_MARGIN times the line's.
PIECEWISE_TRIGGER = 0.15
#: The knots are chosen by the same leave-one-out error that decides for them, so the piecewise
#: error is a minimum over many knot sets and flatters it: on a true line with 25% noise (9 sizes)
#: a piecewise fit reported 0.16 and did 0.20 on fresh samples, the line 0.21 and 0.19. It has to
#: win by this factor.
PIECEWISE_MARGIN = 0.9


class CostModelError(ValueError):
    """A cost model cannot answer (not fitted for this group size or kind) or its file is not a
    cost model of this version. The message names the file and the fix."""


# ---------------------------------------------------------------------------------------------
# Least squares
# ---------------------------------------------------------------------------------------------


def _wls(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """(a, b) minimizing sum(((t - a - b x) / t)^2): relative residuals, so a 1 KiB message
    weighs as much as a 64 MiB one; a >= 0 and b >= 0 (a negative intercept is refitted at 0)."""
    w = [1.0 / max(t, 1e-12) ** 2 for t in ts]
    sw = sum(w)
    swx = sum(wi * x for wi, x in zip(w, xs))
    swxx = sum(wi * x * x for wi, x in zip(w, xs))
    swt = sum(wi * t for wi, t in zip(w, ts))
    swxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    det = sw * swxx - swx * swx
    if len(xs) >= 2 and det > 1e-300 * max(1.0, sw * swxx):
        a = (swxx * swt - swx * swxt) / det
        b = (sw * swxt - swx * swt) / det
    else:
        a, b = (statistics.fmean(ts), 0.0) if xs else (0.0, 0.0)
    if b < 0:  # time falling with size: noise; a constant fits better
        a, b = swt / sw, 0.0
    if a < 0:
        a = 0.0
        b = swxt / swxx if swxx > 0 else 0.0
    return a, max(b, 0.0)


def _r2(ts: Sequence[float], preds: Sequence[float]) -> float:
    mean = statistics.fmean(ts)
    ss_tot = sum((t - mean) ** 2 for t in ts)
    ss_res = sum((t - p) ** 2 for t, p in zip(ts, preds))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


@dataclass(frozen=True)
class LinearFit:
    """``alpha + beta * x`` seconds, piecewise in x when ``pieces`` has several entries.

    Attributes:
        pieces: ``(x_upper, alpha, beta)`` sorted by ``x_upper``; a size uses the first piece
            whose upper bound is >= it (the last one beyond).
        r2: coefficient of determination on the fitted points (None: not fitted, e.g. derived).
        heldout_rel_err: median leave-one-out relative error |pred - t| / t (None: not fitted).
        n_points: samples fitted; ``x_range``: smallest and largest fitted size.
    """

    pieces: tuple[tuple[float, float, float], ...]
    r2: Optional[float] = None
    heldout_rel_err: Optional[float] = None
    n_points: int = 0
    x_range: Optional[tuple[float, float]] = None
    #: The pieces join at their breakpoints and none falls with size (what :func:`fit_linear`
    #: fits): the startup of every size is the time at the smallest fitted size, and the rest of
    #: t(x) is the size-proportional part. Older files hold independent pieces (False): each
    #: piece's own intercept is its startup.
    continuous: bool = False

    @classmethod
    def line(cls, alpha: float, beta: float, **kw) -> "LinearFit":
        return cls(((math.inf, float(alpha), float(beta)),), **kw)

    @property
    def alpha(self) -> float:
        """The intercept of the first piece (the startup time of small messages)."""
        return self.pieces[0][1]

    @property
    def beta(self) -> float:
        """The slope of the last piece (seconds per unit at large sizes)."""
        return self.pieces[-1][2]

    def _piece(self, x: float) -> tuple[float, float]:
        for upper, a, b in self.pieces:
            if x <= upper:
                return a, b
        return self.pieces[-1][1], self.pieces[-1][2]

    def split(self, x: float) -> tuple[float, float]:
        """``(startup, size-proportional part)`` of a message of ``x`` (the engine shares only the
        latter between concurrent transfers). A continuous fit's startup is its time at the
        smallest measured size (all of t(x) below it): extrapolating to t(0) through a steep
        first piece would count measured small-message latency as shareable data. Otherwise the
        ``(alpha, beta * x)`` of the piece ``x`` falls in."""
        a, b = self._piece(x)
        if self.continuous:
            t = a + b * x
            lo = self.x_range[0] if self.x_range else 0.0
            if x <= lo:
                return t, 0.0
            a0, b0 = self._piece(lo)
            start = min(t, a0 + b0 * lo)
            return start, max(0.0, t - start)
        return a, b * x

    def __call__(self, x: float) -> float:
        a, bx = self.split(x)
        return a + bx

    def to_json(self) -> dict:
        return {
            "pieces": [[_num(u), a, b] for u, a, b in self.pieces],
            "r2": self.r2,
            "heldout_rel_err": self.heldout_rel_err,
            "n_points": self.n_points,
            "x_range": list(self.x_range) if self.x_range else None,
            "continuous": self.continuous,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "LinearFit":
        return cls(
            tuple((_unnum(u), float(a), float(b)) for u, a, b in d["pieces"]),
            d.get("r2"),
            d.get("heldout_rel_err"),
            int(d.get("n_points", 0)),
            tuple(d["x_range"]) if d.get("x_range") else None,
            bool(d.get("continuous", False)),
        )


def _num(v: float):
    return "inf" if math.isinf(v) else v


def _unnum(v) -> float:
    return math.inf if v == "inf" else float(v)


def _solve(m: list[list[float]], v: list[float]) -> Optional[list[float]]:
    """Gaussian elimination with partial pivoting for a small square system; None if singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    # a pivot that elimination reduced to rounding noise of the input means singular (measured
    # against the input's entries: after elimination a singular row is all noise)
    tol = 1e-10 * max((abs(x) for row in m for x in row), default=0.0)
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[piv][c]) <= tol or a[piv][c] == 0.0:
            return None
        a[c], a[piv] = a[piv], a[c]
        for r in range(n):
            if r != c and a[r][c] != 0.0:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c])]
    return [a[i][n] / a[i][i] for i in range(n)]


def _nnls(cols: list[list[float]], ts: list[float]) -> list[float]:
    """Coefficients c >= 0 minimizing sum(((t - sum_j c_j col_j) / t)^2), exactly, for the few
    columns of a piecewise fit: the optimum is the unconstrained least-squares solution on its
    own support, so every support is tried and the best feasible one kept. Each column is scaled
    to unit weighted norm first (sizes span 1 KiB to 64 MiB)."""
    n = len(cols)
    w = [1.0 / max(t, 1e-12) ** 2 for t in ts]
    norms = [math.sqrt(sum(wi * x * x for wi, x in zip(w, col))) or 1.0 for col in cols]
    cs = [[x / nrm for x in col] for col, nrm in zip(cols, norms)]
    gram = [[sum(wi * a * b for wi, a, b in zip(w, cs[i], cs[j])) for j in range(n)] for i in range(n)]
    rhs = [sum(wi * a * t for wi, a, t in zip(w, cs[i], ts)) for i in range(n)]
    best, best_res = [0.0] * n, sum(wi * t * t for wi, t in zip(w, ts))
    for mask in range(1, 1 << n):
        sup = [j for j in range(n) if mask >> j & 1]
        sol = _solve([[gram[i][j] for j in sup] for i in sup], [rhs[i] for i in sup])
        if sol is None or any(c < 0 for c in sol):
            continue
        res = sum(wi * (t - sum(c * cs[j][k] for j, c in zip(sup, sol))) ** 2
                  for k, (wi, t) in enumerate(zip(w, ts)))
        if res < best_res * (1 - 1e-12):
            best_res = res
            best = [0.0] * n
            for j, c in zip(sup, sol):
                best[j] = c
    return [c / nrm for c, nrm in zip(best, norms)]


def _fit_pieces(xs: list[float], ts: list[float], breaks: Sequence[float]) -> tuple[tuple[float, float, float], ...]:
    """A continuous fit, linear between the breakpoints: t(x) = a + sum_i s_i * (the part of
    [0, x] inside piece i), with a >= 0 and every slope s_i >= 0, so the time never falls with
    the size and never jumps at a breakpoint (relative residuals, as :func:`_wls`). Returned as
    ``(x_upper, alpha_i, s_i)`` per piece with t(x) = alpha_i + s_i * x inside it."""
    if not breaks:
        a, b = _wls(xs, ts)
        return ((math.inf, a, b),)
    bounds = [0.0] + list(breaks) + [math.inf]
    cols = [[1.0] * len(xs)]
    for lo, hi in zip(bounds, bounds[1:]):
        cols.append([min(max(x - lo, 0.0), hi - lo) for x in xs])
    coef = _nnls(cols, ts)
    a, slopes = coef[0], coef[1:]
    pieces = []
    base = a  # t at the piece's lower bound
    for (lo, hi), sl in zip(zip(bounds, bounds[1:]), slopes):
        pieces.append((hi, base - sl * lo, sl))
        if not math.isinf(hi):
            base += sl * (hi - lo)
    return tuple(pieces)


def _predict(pieces, x: float) -> float:
    return LinearFit(pieces, continuous=True)(x)


def _loo(xs: list[float], ts: list[float], breaks: Sequence[float]) -> float:
    """Median leave-one-out relative error of the (piecewise) fit with these breakpoints."""
    if len(xs) < 3:
        return math.nan
    errs = []
    for i in range(len(xs)):
        xr = xs[:i] + xs[i + 1 :]
        tr = ts[:i] + ts[i + 1 :]
        # a piece left with fewer than 2 points borrows its neighbour's line
        bs = [b for b in breaks if sum(1 for x in xr if x <= b) >= 2 and sum(1 for x in xr if x > b) >= 2]
        pieces = _fit_pieces(xr, tr, bs)
        errs.append(abs(_predict(pieces, xs[i]) - ts[i]) / ts[i])
    return statistics.median(errs)


def fit_linear(
    sizes: Iterable[float], seconds: Iterable[float], *, piecewise: bool = True, max_pieces: int = 3
) -> LinearFit:
    """Least-squares ``alpha + beta * size`` (relative residuals, alpha, beta >= 0).

    With ``piecewise`` and at least 6 distinct sizes, if the single line's held-out error is
    above :data:`PIECEWISE_TRIGGER`, knots at and halfway between the measured sizes (2 or 3
    pieces, each spanning at least two sizes) are tried and the best by leave-one-out error is
    kept when it beats the line by :data:`PIECEWISE_MARGIN`. The pieces join at the knots and no
    slope is negative (:func:`_fit_pieces`): independent lines per piece, as fitted before,
    predicted a 50 KiB send 3x faster than a 40 KiB one on this machine's gloo profile. Reports
    R^2 and the median leave-one-out relative error (for a piecewise fit, that of the chosen
    knots: the selection makes it somewhat optimistic)."""
    xs = [float(x) for x in sizes]
    ts = [float(t) for t in seconds]
    if len(xs) != len(ts) or not xs:
        raise ValueError(f"fit_linear needs equally many sizes and times (got {len(xs)} and {len(ts)}), at least one")
    if any(t <= 0 or not math.isfinite(t) for t in ts):
        raise ValueError("fit_linear: every measured time must be finite and > 0")
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    xs = [xs[i] for i in order]
    ts = [ts[i] for i in order]
    best_breaks: list[float] = []
    line_err = best_err = _loo(xs, ts, [])
    distinct = sorted(set(xs))
    if piecewise and len(distinct) >= 6 and best_err > PIECEWISE_TRIGGER:
        # knots at the measured sizes (a regime change between two sizes becomes a ramp between
        # them) and halfway between them (a knee between two sizes); every piece spans >= 2
        # distinct sizes, its knots included
        mids = [(distinct[i] + distinct[i + 1]) / 2 for i in range(1, len(distinct) - 2)]
        cands = sorted(distinct[1:-1] + mids)
        trials = [[c] for c in cands]
        if max_pieces >= 3:
            trials += [[c1, c2] for c1 in cands for c2 in cands if c1 < c2]
        for br in trials:
            err = _loo(xs, ts, br)
            if err < best_err:
                best_err, best_breaks = err, br
        if best_breaks and not best_err < PIECEWISE_MARGIN * line_err:
            best_err, best_breaks = line_err, []
    pieces = _fit_pieces(xs, ts, best_breaks)
    preds = [_predict(pieces, x) for x in xs]
    return LinearFit(
        pieces,
        r2=_r2(ts, preds),
        heldout_rel_err=None if math.isnan(best_err) else best_err,
        n_points=len(xs),
        x_range=(xs[0], xs[-1]),
        continuous=True,
    )


# ---------------------------------------------------------------------------------------------
# Compute rates
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComputeRate:
    """Roofline of one :class:`~tritonmoe.comm.executor.Work` kind.

    ``time(w) = w.launches * launch_s + t / eff(t)``, ``t = max(w.flops / flops_per_s,
    w.bytes / bytes_per_s)`` (``combine="max"``, the roofline of a kernel that overlaps its
    memory traffic with its arithmetic, as GPU kernels do) or their sum (``combine="sum"``, what
    a fit of measurements gives when they do not overlap, e.g. CPU ATen ops); an infinite rate
    drops its term. ``curve`` is ``(t, eff)`` points, sorted by t; eff is interpolated linearly in
    log t and clamped at the ends (no curve: 1).
    """

    flops_per_s: float = math.inf
    bytes_per_s: float = math.inf
    launch_s: float = 0.0
    curve: tuple[tuple[float, float], ...] = ()
    r2: Optional[float] = None
    heldout_rel_err: Optional[float] = None
    n_points: int = 0
    combine: str = "max"

    def ideal(self, w: Work) -> float:
        a, b = w.flops / self.flops_per_s, w.bytes / self.bytes_per_s
        return a + b if self.combine == "sum" else max(a, b)

    def efficiency(self, t: float) -> float:
        c = self.curve
        if not c or t <= 0:
            return 1.0
        if t <= c[0][0]:
            return c[0][1]
        if t >= c[-1][0]:
            return c[-1][1]
        lt = math.log(t)
        for (t0, e0), (t1, e1) in zip(c, c[1:]):
            if t <= t1:
                f = (lt - math.log(t0)) / (math.log(t1) - math.log(t0))
                return e0 + f * (e1 - e0)
        return c[-1][1]

    def time(self, w: Work) -> float:
        t = self.ideal(w)
        return w.launches * self.launch_s + (t / self.efficiency(t) if t > 0 else 0.0)

    def to_json(self) -> dict:
        return {
            "flops_per_s": _num(self.flops_per_s),
            "bytes_per_s": _num(self.bytes_per_s),
            "launch_s": self.launch_s,
            "curve": [list(p) for p in self.curve],
            "r2": self.r2,
            "heldout_rel_err": self.heldout_rel_err,
            "n_points": self.n_points,
            "combine": self.combine,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "ComputeRate":
        if d.get("combine", "max") not in ("max", "sum"):
            raise ValueError(f"combine={d.get('combine')!r}")
        return cls(
            _unnum(d["flops_per_s"]),
            _unnum(d["bytes_per_s"]),
            float(d["launch_s"]),
            tuple((float(a), float(b)) for a, b in d.get("curve", [])),
            d.get("r2"),
            d.get("heldout_rel_err"),
            int(d.get("n_points", 0)),
            str(d.get("combine", "max")),
        )


def _nnls_relative(cols: list[list[float]], ts: list[float]) -> list[float]:
    """Non-negative least squares of ``t ~ sum_j c_j * cols[j]`` with relative residuals (each
    row weighted by 1/t): the best non-negative solution over every subset of the columns (a
    handful of columns, so exhaustive is exact and cheap)."""
    import itertools

    import torch

    m = len(cols)
    A = torch.tensor(cols, dtype=torch.float64).T  # [n, m]
    t = torch.tensor(ts, dtype=torch.float64)
    w = 1.0 / t
    Aw, tw = A * w[:, None], t * w
    best, best_res = [0.0] * m, float(((tw) ** 2).sum())
    for k in range(1, m + 1):
        for sub in itertools.combinations(range(m), k):
            cols_sub = Aw[:, list(sub)]
            if bool((cols_sub.abs().sum(0) == 0).any()):
                continue
            sol = torch.linalg.lstsq(cols_sub, tw[:, None]).solution[:, 0]
            if bool((sol < 0).any()):
                continue
            res = float(((cols_sub @ sol - tw) ** 2).sum())
            if res < best_res - 1e-15:
                best_res = res
                best = [0.0] * m
                for j, v in zip(sub, sol.tolist()):
                    best[j] = v
    return best


def _isotonic(ys: list[float]) -> list[float]:
    """Non-decreasing least-squares fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, c2 = blocks.pop()
            blocks[-1][0] += s2
            blocks[-1][1] += c2
    out: list[float] = []
    for s_, c in blocks:
        out += [s_ / c] * int(c)
    return out


def _fit_host(model: "CostModel", samples: list["ComputeSample"]) -> ComputeRate:
    """The per-unit time of the ``"host"`` parts of composite ops: the median over samples of
    (measured time - the other parts' fitted time) / host units, at least 0."""
    per_unit, errs = [], []
    for s in samples:
        units = sum(int(n) for k, _f, _b, n in s.parts if k == "host")
        rest = sum(model.compute[k].time(Work(f, b, k, int(n))) for k, f, b, n in s.parts if k != "host")
        if units:
            per_unit.append(max(0.0, (s.seconds - rest) / units))
    L = statistics.median(per_unit) if per_unit else 0.0
    for s in samples:
        units = sum(int(n) for k, _f, _b, n in s.parts if k == "host")
        rest = sum(model.compute[k].time(Work(f, b, k, int(n))) for k, f, b, n in s.parts if k != "host")
        errs.append(abs(rest + units * L - s.seconds) / s.seconds)
    return ComputeRate(math.inf, math.inf, L, (), None, statistics.median(errs) if errs else None, len(samples), "sum")


def _fit_compute(kind: str, samples: list["ComputeSample"]) -> ComputeRate:
    """``t = launches * L + flops / F + bytes / B`` by non-negative least squares (relative
    residuals), then, when it lowers the held-out error, an efficiency curve over the
    size-dependent part: the measured efficiency of each point, made non-decreasing in size
    (isotonic: hardware is under-used at small sizes, MPMoE §IV-B, and noise must not make a
    larger op cheaper than a smaller one)."""
    ts = [s.seconds for s in samples]
    launches = [max(1, s.launches) for s in samples]

    def fit(idx) -> tuple[float, float, float]:
        cols = [[float(launches[i]) for i in idx], [samples[i].flops for i in idx], [samples[i].bytes for i in idx]]
        L, a, b = _nnls_relative(cols, [ts[i] for i in idx])
        return L, a, b

    def make(params, curve=()):
        L, a, b = params
        return ComputeRate(1.0 / a if a > 0 else math.inf, 1.0 / b if b > 0 else math.inf, L, curve, combine="sum")

    def curve_from(model: ComputeRate, idx) -> tuple[tuple[float, float], ...]:
        pts = []
        for i in idx:
            t_ideal = model.ideal(Work(samples[i].flops, samples[i].bytes, kind, launches[i]))
            rest = ts[i] - launches[i] * model.launch_s
            if t_ideal > 0:
                pts.append((t_ideal, min(max(t_ideal / rest, 0.02), 1.5) if rest > 0 else 1.5))
        pts.sort()
        merged: list[list[float]] = []
        for t, e in pts:  # equal sizes: average
            if merged and math.isclose(merged[-1][0], t, rel_tol=1e-9):
                merged[-1][1] = (merged[-1][1] * merged[-1][2] + e) / (merged[-1][2] + 1)
                merged[-1][2] += 1
            else:
                merged.append([t, e, 1])
        effs = _isotonic([e for _, e, _ in merged])
        return tuple((t, e) for (t, _, _), e in zip(merged, effs))

    def loo(with_curve: bool) -> float:
        if len(samples) < 4:
            return math.nan
        errs = []
        for i in range(len(samples)):
            rest = [j for j in range(len(samples)) if j != i]
            m = make(fit(rest))
            if with_curve:
                m = make(fit(rest), curve_from(m, rest))
            w = Work(samples[i].flops, samples[i].bytes, kind, launches[i])
            errs.append(abs(m.time(w) - ts[i]) / ts[i])
        return statistics.median(errs)

    params = fit(range(len(samples)))
    plain, curved = loo(False), loo(True)
    use_curve = not math.isnan(curved) and plain > 0.02 and curved < 0.9 * plain  # a curve must earn its points
    model = make(params)
    if use_curve:
        model = make(params, curve_from(model, range(len(samples))))
    preds = [model.time(Work(s.flops, s.bytes, kind, n)) for s, n in zip(samples, launches)]
    err = curved if use_curve else plain
    return ComputeRate(
        model.flops_per_s, model.bytes_per_s, model.launch_s, model.curve,
        r2=_r2(ts, preds) if len(ts) > 1 else None,
        heldout_rel_err=None if math.isnan(err) else err,
        n_points=len(samples),
        combine="sum",
    )


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommSample:
    """One timed collective or copy: ``kind`` (:data:`COLLECTIVES` or :data:`COPIES`) over
    ``group_size`` ranks of link class ``link``, ``nbytes`` per rank (see the module docstring),
    ``seconds`` (the profile's in-place timing: the mean over members of each one's time from
    issuing it to its completion, after a compute phase; its isolated timing: the slowest
    member's time after a barrier)."""

    kind: str
    group_size: int
    link: str
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class ComputeSample:
    """One timed local computation with its :class:`~tritonmoe.comm.executor.Work` totals.

    A composite op (``parts``: ``(kind, flops, bytes, launches)`` of each part, e.g. the
    pipeline's expert op: re-layouts, FFN and its host work) is not fitted as one kind: after
    the kinds are fitted from single-kind samples, what its parts do not explain is the time of
    its ``"host"`` parts (:data:`tritonmoe.plan.work.HOST`)."""

    kind: str
    flops: float
    bytes: float
    launches: int
    seconds: float
    parts: tuple = ()


@dataclass(frozen=True)
class InterferenceSample:
    """An operation of class ``y`` timed alone and while an operation of class ``x`` ran on the
    same rank: the retained speed is ``alone_s / concurrent_s`` (capped at 1). For ``x == y``,
    ``alone_s`` is the fair-share time of two equal concurrent ops (twice one alone), so the
    factor is the slowdown beyond fair sharing."""

    y: str
    x: str
    alone_s: float
    concurrent_s: float


@dataclass(frozen=True)
class HostSample:
    """Host seconds to issue one operation through the executor: ``what="comm"`` an
    asynchronous collective or copy (Python + the backend's enqueue), ``"compute"`` the
    executor's own cost around a compute (on the CPU host model, paid on the issuing thread)."""

    seconds: float
    what: str = "comm"


_SAMPLE_TYPES = {c.__name__: c for c in (CommSample, ComputeSample, InterferenceSample, HostSample)}


def _sample_from_json(m: Mapping) -> Any:
    kw = {k: v for k, v in m.items() if k != "type"}
    if "parts" in kw:
        kw["parts"] = tuple(tuple(p) for p in kw["parts"])
    return _SAMPLE_TYPES[m["type"]](**kw)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


@dataclass
class CostModel:
    """What operations cost on one machine or cluster (see the module docstring).

    Attributes:
        collectives: ``(kind, group_size, link) -> LinearFit`` of seconds in bytes per rank.
        copies: ``"copy_d2h"/"copy_h2d" -> LinearFit``.
        compute: Work kind -> :class:`ComputeRate`.
        interference: ``(y, x) -> retained speed fraction`` (MPMoE's alpha(y, x)).
        host_compute: the host model of the machine (True: CPU/gloo, compute runs on the
            issuing thread; False: CUDA).
        host_op_s: host seconds to issue one collective or copy.
        compute_op_s: host seconds the executor adds around one compute (CPU host model).
        lane_slots: operations a lane may run at once (default 1: one CUDA stream; gloo runs
            a process group's asynchronous work on ``threads`` worker threads).
        ranks_per_node: ranks per node of the machine the model describes (None: every rank
            on one node, so every group is "intra").
        host_cores: CPU host model only: the cores one node's ranks share for compute (measured:
            the slowdown when every rank computes at once), None for no sharing. A compute op
            of a rank running ``threads_per_rank`` threads then uses ``threads_per_rank /
            host_cores`` of the node's CPU, so ops of several ranks fair-share it; the compute
            rates are those of one rank computing alone.
        dtype: the element type the compute rates were measured or derived in.
        cluster: the :class:`~tritonmoe.plan.Cluster` of a derived model (collectives are then
            decomposed into link traffic), else None.
        source: where the model comes from ("profile", "cluster:<name>", ...); ``meta``: free
            form (machine, versions, date, load); ``path``: the file it was loaded from.
        samples: the measurements a fitted model came from (kept in its file, so it can be
            refitted or inspected; not part of its fingerprint).
    """

    collectives: dict = field(default_factory=dict)
    copies: dict = field(default_factory=dict)
    compute: dict = field(default_factory=dict)
    interference: dict = field(default_factory=dict)
    host_compute: bool = False
    host_op_s: float = 0.0
    compute_op_s: float = 0.0
    lane_slots: dict = field(default_factory=dict)
    ranks_per_node: Optional[int] = None
    host_cores: Optional[float] = None
    threads_per_rank: int = 1
    dtype: str = "bfloat16"
    cluster: Any = None
    source: str = "synthetic"
    meta: dict = field(default_factory=dict)
    path: Optional[str] = None
    samples: list = field(default_factory=list)

    # -- fitting -------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        measurements: Iterable[Any],
        *,
        host_compute: bool = True,
        dtype: str = "float32",
        lane_slots: Optional[Mapping[str, int]] = None,
        ranks_per_node: Optional[int] = None,
        host_cores: Optional[float] = None,
        threads_per_rank: int = 1,
        source: str = "profile",
        meta: Optional[dict] = None,
        piecewise: bool = True,
    ) -> "CostModel":
        """Fit a model from :class:`CommSample`, :class:`ComputeSample`,
        :class:`InterferenceSample` and :class:`HostSample` records (any mix, any order):
        alpha/beta per (kind, group size, link) and per copy direction, a roofline per compute
        kind, the median retained speed per (y, x) and the median host issue time."""
        comm: dict[tuple, list[CommSample]] = {}
        comp: dict[str, list[ComputeSample]] = {}
        inter: dict[tuple, list[float]] = {}
        host: list[float] = []
        host_compute_s: list[float] = []
        measurements = list(measurements)
        for m in measurements:
            if isinstance(m, CommSample):
                if m.kind not in COLLECTIVES + COPIES:
                    raise ValueError(f"CommSample kind {m.kind!r} is not one of {', '.join(COLLECTIVES + COPIES)}")
                if m.link not in LINK_CLASSES:
                    raise ValueError(f"CommSample link {m.link!r} is not one of {', '.join(LINK_CLASSES)}")
                key = (m.kind,) if m.kind in COPIES else (m.kind, int(m.group_size), m.link)
                comm.setdefault(key, []).append(m)
            elif isinstance(m, ComputeSample):
                comp.setdefault(m.kind, []).append(m)
            elif isinstance(m, InterferenceSample):
                if m.y not in OP_CLASSES or m.x not in OP_CLASSES + ("all",):
                    raise ValueError(f"InterferenceSample ({m.y!r}, {m.x!r}): classes are {OP_CLASSES} (x also 'all')")
                inter.setdefault((m.y, m.x), []).append(min(1.0, m.alone_s / m.concurrent_s))
            elif isinstance(m, HostSample):
                (host_compute_s if m.what == "compute" else host).append(m.seconds)
            else:
                raise TypeError(f"CostModel.fit: unknown measurement {type(m).__name__}")
        model = cls(
            host_compute=host_compute,
            host_op_s=statistics.median(host) if host else 0.0,
            compute_op_s=statistics.median(host_compute_s) if host_compute_s else 0.0,
            lane_slots=dict(lane_slots or {}),
            ranks_per_node=ranks_per_node,
            host_cores=host_cores,
            threads_per_rank=threads_per_rank,
            dtype=dtype,
            source=source,
            meta=dict(meta or {}),
            samples=measurements,
        )
        for key, ss in comm.items():
            fit = fit_linear([s.nbytes for s in ss], [s.seconds for s in ss], piecewise=piecewise)
            if len(key) == 1:
                model.copies[key[0]] = fit
            else:
                model.collectives[key] = fit
        composite = comp.pop("composite", [])
        for kind, ss in comp.items():
            model.compute[kind] = _fit_compute(kind, ss)
        if composite:
            model.compute["host"] = _fit_host(model, composite)
        model.interference = {k: statistics.median(v) for k, v in inter.items()}
        return model

    def refit(self, **overrides: Any) -> "CostModel":
        """Fit again from :attr:`samples` (e.g. after a change of the fitting procedure), keeping
        the model's settings unless overridden."""
        if not self.samples:
            raise CostModelError(f"{self._where()} keeps no samples to refit (re-run `python -m tritonmoe.plan profile`)")
        kw = dict(host_compute=self.host_compute, dtype=self.dtype, lane_slots=self.lane_slots,
                  ranks_per_node=self.ranks_per_node, host_cores=self.host_cores,
                  threads_per_rank=self.threads_per_rank, source=self.source, meta=self.meta)
        kw.update(overrides)
        return CostModel.fit(self.samples, **kw)

    # -- questions -----------------------------------------------------------------------------

    def _where(self) -> str:
        return f"cost model file {self.path}" if self.path else f"this cost model ({self.source})"

    def group_sizes(self, kind: Optional[str] = None) -> list[int]:
        """Group sizes with a fitted collective (of ``kind`` if given)."""
        return sorted({p for (k, p, _l) in self.collectives if kind is None or k == kind})

    def collective_fit(self, kind: str, group_size: int, link_class: str = "intra") -> LinearFit:
        """The fitted line of a collective, or a :class:`CostModelError` naming the file and
        the fix."""
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; use one of {', '.join(COLLECTIVES)}")
        if link_class not in LINK_CLASSES:
            raise ValueError(f"link_class={link_class!r}; use 'intra' or 'inter'")
        if self.cluster is not None:
            return self.cluster.collective_line(kind, group_size, link_class)
        if group_size == 1:
            return LinearFit.line(0.0, 0.0)
        fit = self.collectives.get((kind, int(group_size), link_class))
        if fit is None:
            sizes = self.group_sizes(kind)
            links = sorted({l for (k, p, l) in self.collectives if k == kind and p == group_size})
            if links:
                what = f"{kind} over {group_size} ranks was fitted for link class {', '.join(links)} only"
            elif sizes:
                what = f"{kind} was fitted for group sizes {sizes}, not {group_size}"
            else:
                what = f"{kind} was not measured"
            raise CostModelError(
                f"{self._where()}: {what}. Fix: re-run `python -m tritonmoe.plan profile --nproc {group_size}` "
                f"(or under torchrun with {group_size} ranks{' across nodes' if link_class == 'inter' else ''}) and "
                "pass the new file, or describe the machine as a tritonmoe.plan.Cluster"
            )
        return fit

    def predict(self, kind: str, nbytes: float, group_size: int, link_class: str = "intra") -> float:
        """Seconds of one collective (``kind`` in :data:`COLLECTIVES`) moving ``nbytes`` per rank
        over ``group_size`` ranks of ``link_class``, or of a copy (``kind`` in :data:`COPIES`;
        group size and link ignored)."""
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        if kind in COPIES:
            return self.copy_time(kind, nbytes)
        return self.collective_fit(kind, group_size, link_class)(nbytes)

    def copy_time(self, kind: str, nbytes: float) -> float:
        if self.cluster is not None:
            return self.cluster.copy_line()(nbytes)
        fit = self.copies.get(kind)
        if fit is None:
            raise CostModelError(
                f"{self._where()}: {kind} was not measured. Fix: re-run `python -m tritonmoe.plan profile` "
                "(it times host/device copies) or describe the machine as a tritonmoe.plan.Cluster"
            )
        return fit(nbytes)

    def compute_time(self, work: Work) -> float:
        """Seconds of a compute op: the sum over its parts of each kind's roofline."""
        total = 0.0
        for w in work.leaves():
            rate = self.compute.get(w.kind)
            if rate is None and w.kind == "host":
                continue  # a model without a measured host cost prices none
            if rate is None:
                raise CostModelError(
                    f"{self._where()}: no compute rate for Work kind {w.kind!r} (has {sorted(self.compute)}). "
                    "Fix: re-run `python -m tritonmoe.plan profile`, or use a kind the model has"
                )
            total += rate.time(w)
        return total

    def node_of(self, rank: int) -> int:
        """The node a rank is on (rank // ranks_per_node; node 0 when all are on one)."""
        if self.cluster is not None:
            return self.cluster.node_of(rank)
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def cpu_share(self) -> Optional[float]:
        """Fraction of a node's CPU one rank's compute uses at full speed (CPU host model with
        ``host_cores``), else None."""
        if not self.host_compute or not self.host_cores:
            return None
        return min(1.0, self.threads_per_rank / self.host_cores)

    def retained(self, y: str, others: Iterable[str]) -> float:
        """Speed fraction an op of class ``y`` keeps while ``others`` (classes of the other
        running ops on its rank; ``y`` itself when another op of its class runs) run:
        alpha(y, "all") for two or more other classes when given, else the minimum over the
        other classes present, times alpha(y, y) when ``y`` is among them (the slowdown beyond
        the fair share of two concurrent ops of one class, e.g. two gloo collectives)."""
        xs = set(others)
        same = self.interference.get((y, y), 1.0) if y in xs else 1.0
        xs.discard(y)
        if not xs:
            return same
        if len(xs) >= 2 and (y, "all") in self.interference:
            return same * self.interference[(y, "all")]
        return same * min(self.interference.get((y, x), 1.0) for x in xs)

    def link_class(self, ranks: Sequence[int]) -> str:
        """"intra" when every rank is on one node, else "inter"."""
        if self.cluster is not None:
            return self.cluster.link_class(ranks)
        if self.ranks_per_node is None:
            return "intra"
        return "intra" if len({r // self.ranks_per_node for r in ranks}) == 1 else "inter"

    def collective_cost(
        self,
        op: str,
        ranks: Sequence[int],
        send: Sequence[Sequence[float]],
        recv: Sequence[Sequence[float]],
        *,
        members: Optional[Sequence[int]] = None,
    ) -> tuple[float, dict]:
        """``(latency_s, {resource: busy seconds})`` of one collective over the global ``ranks``
        (see :meth:`tritonmoe.plan.Cluster.collective_cost` for ``send``/``recv``/``members``).

        A fitted model prices it as its line at the largest per-rank size of any member
        (the collective ends with its slowest member) and charges the size-proportional part
        to every member's network resource ``("net", rank)``."""
        if self.cluster is not None:
            return self.cluster.collective_cost(op, ranks, send, recv, members=members)
        P = len(ranks)
        if members is None:
            members = list(range(P))
        if P == 1:
            return 0.0, {}
        if op in ("all_to_all", "send_recv"):
            x = max(max(sum(s), sum(r)) for s, r in zip(send, recv))
        else:
            x = max(float(row[0]) if len(row) else 0.0 for row in send)
        alpha, data = self.collective_fit(op, P, self.link_class(ranks)).split(x)
        if data <= 0:
            return alpha, {}
        return alpha, {("net", ranks[m]): data for m in members}

    def copy_cost(self, op: str, rank: int, nbytes: float) -> tuple[float, dict]:
        """``(latency_s, {resource: busy seconds})`` of a host<->device copy on ``rank``."""
        if self.cluster is not None:
            alpha, data = self.cluster.copy_line().split(nbytes)
            return alpha, ({self.cluster.copy_resource(rank): data} if data > 0 else {})
        if op not in self.copies:
            self.copy_time(op, nbytes)  # raises the error naming the file and the fix
        alpha, data = self.copies[op].split(nbytes)
        return alpha, ({("copy", rank): data} if data > 0 else {})

    def check_group_size(self, group_size: int, kinds: Sequence[str] = ("all_to_all",), link_class: str = "intra") -> None:
        """Raise :class:`CostModelError` when a collective the schedule uses was not fitted for
        ``group_size`` (before any simulation)."""
        for k in kinds:
            self.collective_fit(k, group_size, link_class)

    # -- persistence ---------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """A hash of the model's content (ranks compare it to know they plan with one model)."""
        d = self.to_json()
        d.pop("meta", None)
        d.pop("samples", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "dtype": self.dtype,
            "host_compute": self.host_compute,
            "host_op_s": self.host_op_s,
            "compute_op_s": self.compute_op_s,
            "lane_slots": dict(self.lane_slots),
            "ranks_per_node": self.ranks_per_node,
            "host_cores": self.host_cores,
            "threads_per_rank": self.threads_per_rank,
            "collectives": [
                {"kind": k, "group_size": p, "link": l, **f.to_json()} for (k, p, l), f in sorted(self.collectives.items())
            ],
            "copies": [{"kind": k, **f.to_json()} for k, f in sorted(self.copies.items())],
            "compute": [{"kind": k, **r.to_json()} for k, r in sorted(self.compute.items())],
            "interference": [{"y": y, "x": x, "retained": v} for (y, x), v in sorted(self.interference.items())],
            "cluster": self.cluster.to_json() if self.cluster is not None else None,
            "meta": self.meta,
            "samples": [{"type": type(m).__name__, **asdict(m)} for m in self.samples],
        }

    @classmethod
    def from_json(cls, d: Mapping, *, path: Optional[str] = None) -> "CostModel":
        where = f"cost model file {path}" if path else "cost model JSON"
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise CostModelError(
                f"{where} is not a tritonmoe cost model (no \"format\": \"{FORMAT}\"). Fix: write one with "
                "`python -m tritonmoe.plan profile --out FILE` or CostModel.save"
            )
        if d.get("version") != VERSION:
            raise CostModelError(
                f"{where} has version {d.get('version')!r}; this tritonmoe reads version {VERSION}. Fix: re-run "
                "`python -m tritonmoe.plan profile --out FILE` with this version"
            )
        try:
            cluster = None
            if d.get("cluster") is not None:
                from .cluster import Cluster

                cluster = Cluster.from_json(d["cluster"])
            return cls(
                collectives={
                    (c["kind"], int(c["group_size"]), c["link"]): LinearFit.from_json(c) for c in d["collectives"]
                },
                copies={c["kind"]: LinearFit.from_json(c) for c in d.get("copies", [])},
                compute={c["kind"]: ComputeRate.from_json(c) for c in d.get("compute", [])},
                interference={(c["y"], c["x"]): float(c["retained"]) for c in d.get("interference", [])},
                host_compute=bool(d["host_compute"]),
                host_op_s=float(d.get("host_op_s", 0.0)),
                compute_op_s=float(d.get("compute_op_s", 0.0)),
                lane_slots={k: int(v) for k, v in d.get("lane_slots", {}).items()},
                ranks_per_node=d.get("ranks_per_node"),
                host_cores=d.get("host_cores"),
                threads_per_rank=int(d.get("threads_per_rank", 1)),
                dtype=str(d.get("dtype", "bfloat16")),
                cluster=cluster,
                source=str(d.get("source", "file")),
                meta=dict(d.get("meta", {})),
                path=path,
                samples=[_sample_from_json(m) for m in d.get("samples", [])],
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CostModelError):
                raise
            raise CostModelError(
                f"{where} is damaged ({type(exc).__name__}: {exc}). Fix: re-run `python -m tritonmoe.plan profile "
                "--out FILE`"
            ) from exc

    def save(self, path: str | os.PathLike) -> None:
        """Write the model as versioned JSON (atomically)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostModel":
        """Read a model written by :meth:`save` (or ``python -m tritonmoe.plan profile``)."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"cost model file {path} does not exist. Fix: create it with `python -m tritonmoe.plan profile "
                f"--out {path}` (add --nproc N for N local ranks, or launch it with torchrun), or pass a "
                "tritonmoe.plan.Cluster instead"
            )
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as exc:
            raise CostModelError(
                f"cost model file {path} is not JSON ({exc}). Fix: re-create it with `python -m tritonmoe.plan "
                f"profile --out {path}`"
            ) from exc
        return cls.from_json(d, path=path)

    # -- reporting -----------------------------------------------------------------------------

    def describe(self) -> list[str]:
        """Human-readable lines: every fit with its R^2 and held-out error."""
        lines = [f"cost model ({self.source}{', ' + self.path if self.path else ''}), dtype {self.dtype}, "
                 f"host model {'CPU (compute on the issuing thread)' if self.host_compute else 'CUDA (asynchronous)'}"]
        if self.cluster is not None:
            lines.append(f"  derived from cluster {self.cluster.describe()}")
        for (k, p, l), f in sorted(self.collectives.items()):
            lines.append(f"  {k:15} P={p:<4} {l:5} " + _fit_line(f))
        for k, f in sorted(self.copies.items()):
            lines.append(f"  {k:15} {'':12} " + _fit_line(f))
        for k, r in sorted(self.compute.items()):
            rate = (f"{r.flops_per_s / 1e9:.2f} GFLOP/s" if math.isfinite(r.flops_per_s) else "")
            bw = (f"{r.bytes_per_s / 1e9:.2f} GB/s" if math.isfinite(r.bytes_per_s) else "")
            q = _quality(r.r2, r.heldout_rel_err)
            what = " ".join(x for x in (rate, bw) if x)
            lines.append(f"  compute {k:11} {what + ', ' if what else ''}launch {r.launch_s * 1e6:.1f} us"
                         f"{', ' + str(len(r.curve)) + '-point efficiency curve' if r.curve else ''}{q}")
        for (y, x), v in sorted(self.interference.items()):
            lines.append(f"  interference alpha({y}, {x}) = {v:.3f} (retained speed)")
        if self.host_op_s or self.compute_op_s:
            lines.append(f"  host time per operation: {self.host_op_s * 1e6:.1f} us to issue a collective, "
                         f"{self.compute_op_s * 1e6:.1f} us around a compute")
        if self.host_cores:
            lines.append(f"  compute shares {self.host_cores:.2f} effective cores per node ({self.threads_per_rank} "
                         "thread(s) per rank)")
        if self.lane_slots:
            lines.append("  lane slots " + ", ".join(f"{k}: {v}" for k, v in sorted(self.lane_slots.items())))
        return lines


def _quality(r2, held) -> str:
    parts = []
    if r2 is not None:
        parts.append(f"R^2 {r2:.4f}")
    if held is not None:
        parts.append(f"held-out rel err {100 * held:.1f}%")
    return f" ({', '.join(parts)})" if parts else ""


def _fit_line(f: LinearFit) -> str:
    def piece(u: float, b: float, alpha: str = "") -> str:
        upto = "" if math.isinf(u) else "<=" + _human(u) + ": "
        return f"{upto}{alpha}1/beta {(1 / b / 1e9) if b > 0 else math.inf:.3f} GB/s"

    if f.continuous and len(f.pieces) > 1:
        # pieces that join: the startup once, then each piece's bandwidth up to its knot
        lo = f.x_range[0] if f.x_range else 0.0
        ps = f"startup {f(lo) * 1e6:.1f} us (at {_human(lo)}), then " + "; ".join(piece(u, b) for u, _a, b in f.pieces)
    else:
        ps = "; ".join(piece(u, b, f"alpha {a * 1e6:.1f} us, ") for u, a, b in f.pieces)
    return ps + _quality(f.r2, f.heldout_rel_err)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"
