"""``python -m bench agree A.json B.json``: do two check runs agree on their median ratios?

The verification of the timing method (issue 28): two ``python -m bench check`` runs back to back
must agree within 5% on every median ratio (speedups over the other implementations of the same
rounds, roof fractions per roof) and each run's sentinel must drift by at most 5%. This compares
the ratios, not the times: a run at a lower clock has slower times but, measured in interleaved
rounds, the same ratios.

For every row present and measured in both files (same name and implementation), each of its
``peers`` medians (per-round time of another implementation over this row's) and ``roof_fracs``
medians gives ``B / A``; a ratio that moves by more than the limit is listed. Exit status 0 when
everything agrees and both runs are stable, 1 otherwise, 2 for an unreadable file.
"""

from __future__ import annotations

import argparse
import sys

from . import report

LIMIT = 0.05


def ratios(row: dict) -> dict[str, float]:
    """The median ratios of one row: ``x <impl>`` (the other implementation's time over this
    row's) and ``of <roof> roof``."""
    out = {f"x {impl}": q["median"] for impl, q in (row.get("peers") or {}).items()}
    out.update({f"of {roof} roof": q["median"] for roof, q in (row.get("roof_fracs") or {}).items()})
    return out


def compare(a: dict, b: dict, limit: float = LIMIT) -> tuple[list[str], dict]:
    """(printable lines, summary) of the ratio agreement of two result documents."""
    rows_a = {(r["name"], r["impl"]): r for r in a["results"] if r["status"] == "ok"}
    rows_b = {(r["name"], r["impl"]): r for r in b["results"] if r["status"] == "ok"}
    compared, moved = 0, []
    for key in (k for k in rows_a if k in rows_b):
        ra, rb = ratios(rows_a[key]), ratios(rows_b[key])
        for what in (w for w in ra if w in rb and ra[w] > 0):
            compared += 1
            change = rb[what] / ra[what] - 1.0
            if abs(change) > limit:
                moved.append((f"{key[0]} [{key[1]}] {what}", ra[what], rb[what], change))
    stability = {}
    for label, doc in (("A", a), ("B", b)):
        st = (doc.get("check") or {}).get("stability")
        stability[label] = None if st is None else st.get("drift")
    unstable = [k for k, d in stability.items() if d is None or d > limit]
    lines = [f"{compared} median ratios compared (limit {100 * limit:.0f}%): {len(moved)} moved"]
    for name, va, vb, change in sorted(moved, key=lambda m: -abs(m[3])):
        lines.append(f"  {change:+7.1%}  {va:.4g} -> {vb:.4g}  {name}")
    for label in ("A", "B"):
        d = stability[label]
        lines.append(f"sentinel drift {label}: " + ("not measured" if d is None else f"{100 * d:.1f}%"))
    agree = compared > 0 and not moved and not unstable
    lines.append("AGREE" if agree else "DO NOT AGREE")
    return lines, {"compared": compared, "moved": len(moved), "drift": stability, "agree": agree}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench agree", description=__doc__.split("\n\n")[0])
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.add_argument("--limit", type=float, default=LIMIT, help=f"relative change allowed (default {LIMIT})")
    args = p.parse_args(argv)
    docs = []
    for path in (args.a, args.b):
        try:
            docs.append(report.load_json(path))
        except (OSError, ValueError) as exc:  # unreadable, not JSON, or not matching the schema
            print(f"agree: {path}: {exc}", file=sys.stderr)
            return 2
    lines, summary = compare(docs[0], docs[1], args.limit)
    print("\n".join(lines))
    return 0 if summary["agree"] else 1


__all__ = ["LIMIT", "compare", "main", "ratios"]
