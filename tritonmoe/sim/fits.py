"""The fitting math of the cost model: alpha-beta lines (single or piecewise, chosen by held-out
error), compute rooflines with an efficiency curve, and the measured samples they are fitted to
(:class:`CommSample`, :class:`ComputeSample`, :class:`InterferenceSample`, :class:`HostSample`).
:class:`~tritonmoe.sim.cost_model.CostModel` holds the fits."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from tritonmoe.comm.executor import Work

__all__ = [
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
    "fit_linear",
]


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


def fit_host(model: Any, samples: list["ComputeSample"]) -> ComputeRate:
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


def fit_compute(kind: str, samples: list["ComputeSample"]) -> ComputeRate:
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
    its ``"host"`` parts (:data:`tritonmoe.sim.work.HOST`)."""

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


def sample_from_json(m: Mapping) -> Any:
    kw = {k: v for k, v in m.items() if k != "type"}
    if "parts" in kw:
        kw["parts"] = tuple(tuple(p) for p in kw["parts"])
    return _SAMPLE_TYPES[m["type"]](**kw)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
