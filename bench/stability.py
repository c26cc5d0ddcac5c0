"""The run's stability figure: a sentinel entry re-measured at the start, middle and end of a run.

The sentinel is one fixed entry (``python -m bench check``: the grouped FFN forward at the
Mixtral-like shape, T = 4096, Triton backend, built from the same seed each time), measured by the
same device timer as the rows. Its drift is the largest relative departure of a later median from
the first one; a run whose sentinel drifts by more than :data:`DRIFT_LIMIT` (5%) is marked
unstable: its rows are not comparable with each other within that margin, even with the
interleaved rounds (which keep each comparison's implementations on the same clock, but not
different comparisons).
"""

from __future__ import annotations

from collections.abc import Callable

#: Relative drift of the sentinel above which a run is marked unstable.
DRIFT_LIMIT = 0.05


def drift(medians: list[float]) -> float | None:
    """max_i |m_i / m_0 - 1| over the medians after the first (None with fewer than two)."""
    if len(medians) < 2 or medians[0] <= 0:
        return None
    return max(abs(m / medians[0] - 1.0) for m in medians[1:])


class Sentinel:
    """``measure()`` returns ``{"median_s", "p20_s", "p80_s", "mhz", "mode", "rounds"}`` of one
    measurement of the sentinel entry; :meth:`mark` takes one at a named point of the run."""

    def __init__(self, name: str, measure: Callable[[], dict] | None) -> None:
        self.name = name
        self.measure = measure
        self.points: list[dict] = []

    def mark(self, at: str) -> dict | None:
        if self.measure is None:
            return None
        try:
            point = {"at": at, **self.measure()}
        except Exception as exc:  # a failed sentinel must not stop the run: the point says why
            point = {"at": at, "error": f"{type(exc).__name__}: {str(exc).strip()[:200]}"}
        self.points.append(point)
        return point

    def record(self) -> dict | None:
        """``check.stability``: the points, the drift and whether the run is unstable."""
        if self.measure is None:
            return None
        medians = [p["median_s"] for p in self.points if "median_s" in p]
        d = drift(medians)
        return {"sentinel": self.name, "points": self.points, "drift": d, "limit": DRIFT_LIMIT,
                "unstable": bool(d is not None and d > DRIFT_LIMIT)}

    def line(self) -> str:
        rec = self.record()
        if rec is None:
            return "stability: no sentinel"
        pts = ", ".join(f"{p['at']} {p['median_s'] * 1e6:.1f} us" + (f" @ {p['mhz']:.0f} MHz" if p.get("mhz") else "")
                        if "median_s" in p else f"{p['at']} failed ({p['error']})" for p in rec["points"])
        if rec["drift"] is None:
            return f"stability: sentinel {self.name}: {pts}; drift not measured"
        verdict = "UNSTABLE" if rec["unstable"] else "stable"
        return (f"stability: sentinel {self.name}: {pts}; drift {100 * rec['drift']:.1f}% "
                f"(limit {100 * DRIFT_LIMIT:.0f}%): {verdict}")


__all__ = ["DRIFT_LIMIT", "Sentinel", "drift"]
