"""Charts of a committed GPU result file: tritonmoe's speedup over each peer, and its fraction of
the roofline, per shape.

    python scripts/plot_speedup.py bench/results/nvidia-h100-80gb-hbm3-2026-11-26-2.json \
        --speedup docs/img/speedup-h100.png --roofline docs/img/roofline-h100.png

Every number comes from the result file (its ``speedup`` and ``roof_frac`` fields, measured in
that run against baselines run on the same inputs and roofs measured at its start); nothing is
computed here but the layout. Needs matplotlib (``pip install 'tritonmoe[plot]'``, which
``make setup`` installs). The committed PNGs under docs/img/ were made by this command.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

OURS = ("triton", "triton-fused")
#: The peers a speedup is charted against (the plain-PyTorch reference, "torch", is not a peer).
PEERS = {"grouped_mm": "torch._grouped_mm", "loop": "per-expert torch.matmul loop"}
SUITES = ("ffn", "layer", "permute", "route")


def load_rows(doc: dict) -> list[dict]:
    """Our implementations' measured entries, in the file's order, with their peers' ratios."""
    rows = []
    for r in doc["results"]:
        if r.get("status") != "ok" or r.get("impl") not in OURS or r.get("suite") not in SUITES:
            continue
        rows.append({
            "suite": r["suite"],
            "label": ("MoELayer " if r["suite"] == "layer" else "") + f"{r['case'].replace(' uniform', '')} {r['mode']} [{r['impl']}]",
            "speedup": {k: v for k, v in (r.get("speedup") or {}).items() if k in PEERS and v},
            "roof": r.get("roof_frac"),
            "bound": r.get("roof_bound"),
        })
    return rows


def title(doc: dict) -> str:
    env = doc.get("env") or {}
    date = str(env.get("date_utc") or "")[:10]
    commit = str(env.get("git_commit") or "")[:7]
    return f"{env.get('gpu_name') or env.get('device')}, {date}, commit {commit}, {doc['config'].get('dtype')}"


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_speedup: matplotlib is not installed; run `make setup` or pip install 'tritonmoe[plot]'")
    return plt


def plot_speedup(doc: dict, path: pathlib.Path) -> None:
    plt = _plt()
    rows = [r for r in load_rows(doc) if r["speedup"]]
    if not rows:
        sys.exit("plot_speedup: no entry with a speedup over torch._grouped_mm or the per-expert loop")
    suites = [s for s in SUITES if any(r["suite"] == s for r in rows)]
    heights = [sum(r["suite"] == s for r in rows) for s in suites]
    fig, axes = plt.subplots(len(suites), 1, figsize=(12, 1.2 + 0.33 * sum(heights) + 0.6 * len(suites)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    colors = {"grouped_mm": "tab:blue", "loop": "tab:orange"}
    hi = max(v for r in rows for v in r["speedup"].values())
    lo = min(v for r in rows for v in r["speedup"].values())
    for ax, suite in zip(axes[:, 0], suites):
        sub = [r for r in rows if r["suite"] == suite][::-1]
        peers = [p for p in PEERS if any(p in r["speedup"] for r in sub)]
        width = 0.8 / len(peers)
        for j, peer in enumerate(peers):
            ys = [i + (j - (len(peers) - 1) / 2) * width for i in range(len(sub))]
            vals = [r["speedup"].get(peer, 0.0) for r in sub]
            bars = ax.barh(ys, vals, height=width, color=colors[peer], label=f"x {PEERS[peer]}")
            for bar, v in zip(bars, vals):
                if v:
                    ax.text(v * 1.03, bar.get_y() + bar.get_height() / 2, f"{v:.2f}x", va="center", fontsize=7)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log")
        ax.set_xlim(min(0.5, lo / 1.3), hi * 2.0)
        ax.set_yticks(range(len(sub)))
        ax.set_yticklabels([r["label"] for r in sub], fontsize=7)
        ax.set_title(f"{suite} suite: tritonmoe's speedup (> 1: tritonmoe faster; black line: 1)", fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(axis="x", which="both", alpha=0.3)
    fig.suptitle(f"tritonmoe speedup per shape: {title(doc)}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_roofline(doc: dict, path: pathlib.Path) -> None:
    plt = _plt()
    rows = [r for r in load_rows(doc) if r["roof"] is not None and r["suite"] in ("ffn", "layer", "permute")][::-1]
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.3 * len(rows)))
    colors = ["tab:red" if r["bound"] == "compute" else "tab:purple" for r in rows]
    bars = ax.barh(range(len(rows)), [r["roof"] for r in rows], color=colors)
    for bar, r in zip(bars, rows):
        ax.text(r["roof"] + 0.01, bar.get_y() + bar.get_height() / 2, f"{r['roof']:.2f}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["label"] for r in rows], fontsize=7)
    ax.set_xlim(0, 1.08)
    ax.axvline(1.0, color="black", lw=1)
    roofs = doc.get("roofs") or {}
    mm = next((v for k, v in roofs.items() if k.startswith("matmul")), None)
    cp = roofs.get("copy")
    def _val(x, key, unit):
        return f"{x[key]:.0f} {unit}" if isinstance(x, dict) and key in x else "?"
    ax.set_xlabel(f"fraction of the roof measured in the same run (red: compute-bound, of the bf16 matmul "
                  f"{_val(mm, 'tflops', 'TFLOP/s')}; purple: memory-bound, of the copy {_val(cp, 'gbps', 'GB/s')})",
                  fontsize=8)
    ax.set_title(f"tritonmoe fraction of roofline: {title(doc)}", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=pathlib.Path, help="a results JSON (bench/schema.py), e.g. bench/results/<gpu>-<date>.json")
    p.add_argument("--speedup", type=pathlib.Path, help="write the speedup bar chart (PNG) here")
    p.add_argument("--roofline", type=pathlib.Path, help="write the fraction-of-roofline chart (PNG) here")
    args = p.parse_args(argv)
    doc = json.loads(args.results.read_text())
    if not load_rows(doc):
        sys.exit(f"plot_speedup: {args.results} has no measured tritonmoe entry to chart")
    if args.speedup:
        plot_speedup(doc, args.speedup)
        print(f"speedup chart: {args.speedup}")
    if args.roofline:
        plot_roofline(doc, args.roofline)
        print(f"roofline chart: {args.roofline}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
