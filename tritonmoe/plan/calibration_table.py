"""The calibration table's registry: one :class:`CalEntry` per paper number the simulator is
compared with (:mod:`tritonmoe.plan.calibrate` fills it; ``python -m tritonmoe.plan calibrate``
prints it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["CalEntry", "CALIBRATIONS", "register_calibration", "run_calibration", "format_table"]


@dataclass
class CalEntry:
    """One row of the calibration table.

    Attributes:
        id: the PAPERS.md §6 id (``"CAL-13"``), with a suffix when one id has several rows.
        paper: where the number is (paper and table/figure).
        metric: what is compared.
        testbed: the cluster preset (``""`` when none applies).
        paper_value: the paper's number (a float for ratios, else text).
        run: returns ``{"simulated": float or text, "detail": text}``; None when blocked.
        blocked: why the simulator cannot express it yet (None when it can).
        free: the free parameters chosen (not stated by the paper).
    """

    id: str
    paper: str
    metric: str
    testbed: str
    paper_value: Any
    run: Optional[Callable[[], dict]] = None
    blocked: Optional[str] = None
    free: str = ""


CALIBRATIONS: dict[str, CalEntry] = {}


def register_calibration(entry: CalEntry) -> CalEntry:
    """Add (or replace) a calibration entry."""
    if (entry.run is None) == (entry.blocked is None):
        raise ValueError(f"calibration {entry.id}: give exactly one of run and blocked")
    CALIBRATIONS[entry.id] = entry
    return entry


def run_calibration(only: Optional[list[str]] = None) -> list[dict]:
    """Run every entry (or those in ``only``); one dict per entry with the paper's and the
    simulated values, the relative difference for numeric ratios, and the wall time."""
    rows = []
    for e in CALIBRATIONS.values():
        if only and e.id not in only:
            continue
        row = {"id": e.id, "paper": e.paper, "metric": e.metric, "testbed": e.testbed, "paper_value": e.paper_value,
               "free": e.free}
        if e.blocked:
            row.update(status="not expressible yet", why=e.blocked)
        else:
            t0 = time.perf_counter()
            try:
                out = e.run()
                row.update(status="simulated", **out)
                sim, pap = out.get("simulated"), e.paper_value
                if isinstance(sim, (int, float)) and isinstance(pap, (int, float)) and pap:
                    row["rel_diff"] = sim / pap - 1.0
            except Exception as exc:  # one broken entry does not hide the others
                row.update(status="error", why=f"{type(exc).__name__}: {exc}")
            row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def format_table(rows: list[dict]) -> str:
    """The table as markdown."""
    lines = ["| id | paper | metric | testbed | paper | simulated | diff | note |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sim = _fmt(r.get("simulated", "-")) if r["status"] == "simulated" else r["status"]
        diff = f"{100 * r['rel_diff']:+.0f}%" if "rel_diff" in r else ""
        note = r.get("detail") or r.get("why", "")
        lines.append(f"| {r['id']} | {r['paper']} | {r['metric']} | {r['testbed']} | {_fmt(r['paper_value'])} | {sim} | "
                     f"{diff} | {note} |")
    return "\n".join(lines)
