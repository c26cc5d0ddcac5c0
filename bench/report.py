"""Output of the harness: the table on stdout, JSON files, markdown, ``compare`` and plots.

Table columns (stdout and markdown; a column with nothing to show is left out):

* ``case``, ``mode``, ``impl``: the problem, ``fwd`` (inference forward) or ``fwd+bwd``, and the
  implementation: ``triton`` (tritonmoe's kernels), ``torch`` (tritonmoe's reference path),
  ``auto``, ``*-fused`` (tritonmoe.moe_ffn), baselines ``loop`` (per-expert torch.matmul loop)
  and ``grouped_mm`` (torch._grouped_mm), and the ep suite's ``ep-layer`` / ``all-to-all``.
* ``median``, ``p20-p80``: time per call over the timed reps.
* ``TFLOP/s``, ``GB/s``: useful FLOPs and minimum bytes (bench.work) divided by the median.
* ``roof``: the fraction of the roofline measured in the same run (C: bound by the matmul roof,
  M: bound by the copy roof).
* ``x torch``, ``x loop``, ``x gmm``: speedup over each baseline (its median / this median).
* ``peak``: peak GPU memory allocated during one call (inputs and weights included); ``/min``:
  peak over the analytic minimum (layer suite).
* ``util%``, ``W``, ``SM MHz``: mean GPU utilization, power and SM clock sampled by NVML.
* ``note``: why an entry is unavailable or failed, or suite-specific figures (e.g.
  ``layer_fwd_frac`` of the permute suite's ``metadata`` rows: their median over the MoELayer
  forward's at the same shape and backend, when the layer suite ran too).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from . import schema
from .roofs import describe

SPEEDUP_HEADERS = {"torch": "x torch", "loop": "x loop", "grouped_mm": "x gmm", "liger": "x liger",
                   "softmax_topk": "x sm+topk"}

#: Short labels of the timing modes of rows measured in interleaved rounds (bench.timing).
TIMING_LABELS = {"graph": "graph", "graph-flush": "graph-L2", "eager": "EAGER", "cpu": "cpu"}


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def fmt_time(s: float | None) -> str:
    if s is None:
        return ""
    if s >= 1.0:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def fmt_range(stats: dict | None) -> str:
    if not stats:
        return ""
    lo, hi = stats["p20"], stats["p80"]
    scale, unit = (1.0, "s") if hi >= 1.0 else (1e3, "ms") if hi >= 1e-3 else (1e6, "us")
    return f"{lo * scale:.3g}-{hi * scale:.3g} {unit}"


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return ""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= div:
            return f"{b / div:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_num(v: float | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return ""
    return f"{v:.{digits}g}"


def fmt_extra(extra: dict) -> str:
    parts = []
    for k, v in extra.items():
        parts.append(f"{k}={fmt_num(v) if isinstance(v, float) else v}")
    return " ".join(parts)


@dataclass
class Column:
    header: str
    get: Callable[[dict], str]
    right: bool = True


def _tel(metric: str, scale: float = 1.0, digits: int = 3) -> Callable[[dict], str]:
    def get(r: dict) -> str:
        t = r.get("telemetry") or {}
        m = t.get(metric)
        return fmt_num(m["mean"] * scale, digits) if m else ""

    return get


def _roof(r: dict) -> str:
    if r.get("roof_frac") is None:
        return ""
    return f"{100 * r['roof_frac']:.0f}% {'C' if r['roof_bound'] == 'compute' else 'M'}"


def _median(r: dict) -> str:
    if r["status"] != "ok":
        return r["status"]
    if r.get("time_s") is None:  # a figure without a timing (e.g. a balance ratio): in the note
        return ""
    return fmt_time(r["time_s"]["median"])


def _note(r: dict) -> str:
    if r["status"] != "ok":
        return r.get("note") or ""
    return fmt_extra(r.get("extra") or {})


def _timing(r: dict) -> str:
    """``graph x30`` (timing mode and rounds), ``!`` when the row is noisy (p80/p20 > 1.10)."""
    t = r.get("timing")
    if not t:
        return ""
    return f"{TIMING_LABELS.get(t['mode'], t['mode'])} x{t['rounds']}" + (" !" if t.get("noisy") else "")


def _eager(r: dict) -> str:
    t = (r.get("timing") or {}).get("eager_s")
    return fmt_time(t["median"]) if t else ""


def _clock(r: dict) -> str:
    c = r.get("clocks")
    if not c:
        return ""
    return f"{c['median']:.0f}" if c["max"] - c["min"] < 15 else f"{c['min']:.0f}-{c['max']:.0f}"


def _per_clock(r: dict) -> str:
    e = r.get("per_clock_eff")
    return f"{100 * e['median']:.0f}%" if e else ""


def columns(rows: list[dict]) -> list[Column]:
    """The table's columns for these rows, without the ones that would be empty."""
    cols = [
        Column("case", lambda r: r["case"], right=False),
        Column("mode", lambda r: r["mode"], right=False),
        Column("impl", lambda r: r["impl"], right=False),
        Column("median", _median),
        Column("p20-p80", lambda r: fmt_range(r.get("time_s"))),
        Column("TFLOP/s", lambda r: fmt_num(r.get("tflops"))),
        Column("GB/s", lambda r: fmt_num(r.get("gbps"))),
        Column("roof", _roof),
        Column("/clock", _per_clock),
        Column("eager", _eager),
        Column("timing", _timing, right=False),
    ]
    cols.append(Column("x best peer", lambda r: (f"{r['best_peer']['median']:.3g} {r['best_peer']['impl']}"
                                                 if r.get("best_peer") else "")))
    seen = {b for r in rows for b in (r.get("speedup") or {})}
    for b, header in SPEEDUP_HEADERS.items():
        if b in seen:
            cols.append(Column(header, lambda r, b=b: fmt_num((r.get("speedup") or {}).get(b))))
    cols += [
        Column("peak", lambda r: fmt_bytes(r["memory"]["peak_bytes"])),
        Column("/min", lambda r: fmt_num(r["memory"]["ratio"])),
        Column("util%", _tel("gpu_util_pct", digits=2)),
        Column("W", _tel("power_w")),
        Column("SM MHz", lambda r: _clock(r) or _tel("sm_clock_mhz", digits=4)(r)),
        Column("note", _note, right=False),
    ]
    return [c for c in cols if any(c.get(r) for r in rows)]


#: One line per column header (the module docstring says the same at length; ``python -m bench
#: --legend`` prints it, and every run prints the lines of the columns its tables showed).
LEGEND = {
    "case": "the problem: op, preset-like shape, T = tokens (per rank in the ep suite), routing",
    "mode": "fwd (inference forward), fwd+bwd (training step), move / metadata (parts of permute)",
    "impl": "triton = tritonmoe's kernels, *-fused = tritonmoe.moe_ffn, torch = tritonmoe's reference "
            "path; baselines: loop = per-expert torch.matmul, grouped_mm = torch._grouped_mm, liger = "
            "Liger-Kernel's fused MoE, softmax_topk = torch.softmax + torch.topk",
    "median": "time per call, median over the timed reps (warm-up first; on GPU: CUDA events, L2 flushed)",
    "p20-p80": "the 20th-80th percentile of the time per call (the spread; wide = noisy or host-bound)",
    "TFLOP/s": "useful FLOPs (bench/work.py) / median",
    "GB/s": "minimum bytes moved (bench/work.py) / median",
    "roof": "fraction of the roofline measured in this run: C = of the matmul roof (compute-bound), "
            "M = of the device copy roof (memory-bound); 100% = the hardware's measured best",
    "x torch": "speedup over tritonmoe's reference path (its median / this median; > 1 = this is faster)",
    "x loop": "speedup over the per-expert torch.matmul loop (> 1 = this is faster)",
    "x gmm": "speedup over torch._grouped_mm (> 1 = this is faster)",
    "x liger": "speedup over Liger-Kernel's fused MoE (> 1 = this is faster)",
    "x sm+topk": "speedup over torch.softmax + torch.topk (> 1 = this is faster)",
    "peak": "peak device memory allocated during one call (inputs and weights included)",
    "/min": "peak over the layer's analytic minimum memory (1.0 = nothing extra)",
    "util%": "mean GPU utilization sampled by NVML during the entry",
    "W": "mean GPU power (NVML)",
    "SM MHz": "mean SM clock (NVML)",
    "note": "why an entry is unavailable or failed, or suite-specific figures",
}


def legend_lines(headers=None) -> list[str]:
    """The legend of ``headers`` (default: every column), one ``header: meaning`` line each."""
    keys = [h for h in LEGEND if headers is None or h in set(headers)]
    width = max((len(k) for k in keys), default=0)
    return [f"  {k.rjust(width)}  {LEGEND[k]}" for k in keys]


def print_legend(rows: list[dict], file: TextIO | None = None) -> None:
    """Print the legend of the columns that ``rows``' tables show (nothing without rows)."""
    if not rows:
        return
    file = file or sys.stdout
    print("\nColumns (python -m bench --legend; docs/bench-columns.md):", file=file)
    print("\n".join(legend_lines([c.header for c in columns(rows)])), file=file)


def _cells(rows: list[dict], cols: list[Column]) -> list[list[str]]:
    return [[c.get(r) for c in cols] for r in rows]


def render_text(rows: list[dict]) -> str:
    """A plain fixed-width table."""
    if not rows:
        return "(no results)"
    cols = columns(rows)
    cells = _cells(rows, cols)
    widths = [max(len(c.header), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(vals):
        out = []
        for i, (c, v) in enumerate(zip(cols, vals)):
            last = i == len(cols) - 1
            out.append(v.rjust(widths[i]) if c.right else (v if last else v.ljust(widths[i])))
        return "  ".join(out).rstrip()

    out = [line([c.header for c in cols]), line(["-" * w for w in widths])]
    prev_case = None
    for r, vals in zip(rows, cells):
        if prev_case is not None and r["case"] != prev_case:
            out.append("")
        prev_case = r["case"]
        out.append(line(vals))
    return "\n".join(out)


def render_markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no results)"
    cols = columns(rows)
    head = "| " + " | ".join(c.header for c in cols) + " |"
    sep = "| " + " | ".join("---:" if c.right else "---" for c in cols) + " |"
    body = ["| " + " | ".join(v.replace("|", "\\|") for v in vals) + " |" for vals in _cells(rows, cols)]
    return "\n".join([head, sep, *body])


def _rich_console(file: TextIO):
    """A rich Console when rich is installed and the output is a terminal, else None."""
    if not (hasattr(file, "isatty") and file.isatty()):
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=file)


def print_suite(rows: list[dict], title: str, file: TextIO | None = None) -> None:
    """Print one suite's table: with rich when it is installed, the output is a terminal and the
    table fits its width (rich would otherwise cut cells short); else as plain text."""
    file = file or sys.stdout
    console = _rich_console(file)
    if console is not None and rows:
        from rich.table import Table

        cols = columns(rows)
        cells = _cells(rows, cols)
        needed = sum(max(len(c.header), *(len(v[i]) for v in cells)) + 3 for i, c in enumerate(cols)) + 1
        if needed <= console.width:
            table = Table(title=title, title_justify="left")
            for c in cols:
                table.add_column(c.header, justify="right" if c.right else "left", no_wrap=True)
            for vals in cells:
                table.add_row(*vals)
            console.print(table)
            return
    print(f"\n== {title}", file=file)
    print(render_text(rows), file=file)


# ---------------------------------------------------------------------------------------------
# Documents (JSON, markdown)
# ---------------------------------------------------------------------------------------------


def header_lines(doc: dict) -> list[str]:
    env, cfg = doc["env"], doc["config"]
    mode = env["mode"]
    lines = [
        f"command: {env['command']}",
        f"mode: {mode.upper()}"
        + (f" on {env['gpu_name']} (driver {env['driver']}, CUDA {env['cuda']})" if env["gpu_name"] else ""),
        f"versions: torch {env['torch']}, triton {env['triton']}, tritonmoe {env['tritonmoe']}, python {env['python']}",
        f"commit: {env['git_commit'] or 'unknown'}{' (dirty)' if env['git_dirty'] else ''}, date {env['date_utc']}",
        f"dtype {cfg['dtype']}, reps {cfg['reps']} (warm-up {cfg['warmup']}), "
        f"L2 flush {'on' if cfg['l2_flush'] else 'off'}, backends {','.join(cfg['backends'])}, "
        f"baselines {','.join(cfg['baselines']) or 'none'}",
    ]
    lines += describe(doc.get("roofs") or {})
    return lines


def render_markdown(doc: dict) -> str:
    """The results as markdown: the environment, the roofs and one table per suite."""
    out = [f"# tritonmoe benchmark results ({doc['env']['mode'].upper()})", ""]
    out += [f"- {line}" for line in header_lines(doc)]
    out.append("")
    suites = []
    for r in doc["results"]:
        if r["suite"] not in suites:
            suites.append(r["suite"])
    for s in suites:
        rows = [r for r in doc["results"] if r["suite"] == s]
        out += [f"## {s}", "", render_markdown_table(rows), ""]
    out += [
        "Columns: median and p20-p80 time per call; TFLOP/s and GB/s of useful work (bench/work.py); "
        "roof = fraction of the roofline measured in the same run (C compute-bound, M memory-bound); "
        "x torch / x loop / x gmm = speedup over the reference path, the per-expert loop and "
        "torch._grouped_mm; peak = peak allocated memory, /min = peak over the analytic minimum.",
        "",
    ]
    return "\n".join(out)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _finite(o):
    """JSON has no NaN/inf: write them as null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(doc: dict, path: str | os.PathLike) -> None:
    """Validate the document against bench.schema, then write it (atomically)."""
    doc = _finite(doc)
    schema.validate(doc)
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")


def load_json(path: str | os.PathLike) -> dict:
    with open(path) as f:
        doc = json.load(f)
    schema.validate(doc)
    return doc


def merge_docs(docs: list[dict]) -> dict:
    """One document from several runs (suites measured by separate commands): the first run's
    environment, config and roofs, every run's results, and each command in ``notes``. The
    merged document is for rendering; each file keeps its own roofs and environment."""
    if len(docs) == 1:
        return docs[0]
    merged = json.loads(json.dumps(docs[0]))
    merged["results"] = [r for d in docs for r in d["results"]]
    merged["notes"] = [f"merged run {i + 1}: {d['env']['command']} ({d['env']['date_utc']})" for i, d in enumerate(docs)]
    merged["complete"] = all(d["complete"] for d in docs)
    merged["wall_time_s"] = sum(d["wall_time_s"] for d in docs)
    merged["env"]["command"] = " ; ".join(d["env"]["command"] for d in docs)
    return merged


# ---------------------------------------------------------------------------------------------
# compare
# ---------------------------------------------------------------------------------------------


def _key(r: dict) -> tuple[str, str]:
    return r["name"], r["impl"]


def compare_docs(a: dict, b: dict, *, threshold: float = 0.05) -> tuple[str, dict]:
    """Per-entry ratios of B against A (same name and impl, both measured).

    ``B/A`` is B's median time over A's (< 1: B is faster); ``speedup`` is its inverse. Entries
    whose speedup moves by more than ``threshold`` are flagged ``faster`` / ``slower``. Returns
    the printable table and a summary (matched entries, geometric-mean speedup, entries only in
    one file).
    """
    rows_a = {_key(r): r for r in a["results"]}
    rows_b = {_key(r): r for r in b["results"]}
    lines = [
        f"A: {a['env']['command']}  [{a['env']['gpu_name'] or 'CPU'}, {a['env']['git_commit'] or '?'}, {a['env']['date_utc']}]",
        f"B: {b['env']['command']}  [{b['env']['gpu_name'] or 'CPU'}, {b['env']['git_commit'] or '?'}, {b['env']['date_utc']}]",
    ]
    for what, va, vb in (
        ("mode", a["env"]["mode"], b["env"]["mode"]),
        ("GPU", a["env"]["gpu_name"], b["env"]["gpu_name"]),
        ("dtype", a["config"]["dtype"], b["config"]["dtype"]),
    ):
        if va != vb:
            lines.append(f"note: the runs differ in {what} (A {va}, B {vb})")
    lines.append("")
    table = []
    logs = []
    for key in [k for k in rows_a if k in rows_b]:
        ra, rb = rows_a[key], rows_b[key]
        if ra["status"] != "ok" or rb["status"] != "ok":
            table.append([key[0], key[1], _median(ra), _median(rb), "", "", "not comparable"])
            continue
        ta, tb = ra["time_s"]["median"], rb["time_s"]["median"]
        ratio = tb / ta
        speed = ta / tb
        logs.append(math.log(speed))
        flag = "faster" if speed > 1 + threshold else "slower" if speed < 1 / (1 + threshold) else ""
        table.append([key[0], key[1], fmt_time(ta), fmt_time(tb), f"{ratio:.3f}", f"{speed:.3f}x", flag])
    headers = ["name", "impl", "A median", "B median", "B/A", "speedup", ""]
    if table:
        widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
        fmt = lambda vals: "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths))).rstrip()  # noqa: E731
        lines += [fmt(headers), fmt(["-" * w for w in widths]), *[fmt(row) for row in table]]
    only_a = [k for k in rows_a if k not in rows_b]
    only_b = [k for k in rows_b if k not in rows_a]
    summary = {
        "matched": len(logs),
        "geomean_speedup": math.exp(sum(logs) / len(logs)) if logs else None,
        "only_in_a": [f"{n} [{i}]" for n, i in only_a],
        "only_in_b": [f"{n} [{i}]" for n, i in only_b],
    }
    lines.append("")
    if logs:
        lines.append(f"{len(logs)} entries compared; geometric-mean speedup of B over A: {summary['geomean_speedup']:.3f}x")
    else:
        lines.append("no entry was measured in both files")
    for label, keys in (("only in A", summary["only_in_a"]), ("only in B", summary["only_in_b"])):
        if keys:
            lines.append(f"{len(keys)} entries {label}: " + ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else ""))
    return "\n".join(lines), summary


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


#: Line style per implementation: tritonmoe solid, baselines broken.
_LINESTYLE = {"torch": ":", "loop": "-.", "grouped_mm": "--"}


def _roof_line(doc: dict, roofs: dict, metric: str):
    """(value, label) of the roof a panel of ``metric`` is drawn against, or None."""
    if metric == "tflops":
        mm = roofs.get(f"matmul_{doc['config']['dtype']}") or roofs.get("matmul_bfloat16") or roofs.get("matmul_float32")
        return (mm["tflops"], f"matmul roof {mm['tflops']:.3g} TFLOP/s") if mm else None
    cp = roofs.get("copy")
    return (cp["gbps"], f"copy roof {cp['gbps']:.3g} GB/s") if cp else None


def _bar_panel(ax, suite: str, mode: str, panel: dict, roof) -> None:
    """A panel whose lines each have one point: one horizontal bar per (case, T, impl)."""
    items = [(f"{family} T={pts[0][0]} [{impl}]", pts[0][1]) for (family, impl), pts in panel["lines"].items()][::-1]
    impls = [impl for (_, impl) in panel["lines"]][::-1]
    from matplotlib.patches import Patch   # only reached from plot(), which imported matplotlib

    fixed = {"triton": "tab:green", "triton-fused": "tab:purple", "triton-split": "tab:olive", "torch": "tab:orange",
             "grouped_mm": "tab:blue", "loop": "tab:red"}
    color = {i: fixed.get(i, "tab:gray") for i in impls}
    ax.barh(range(len(items)), [v for _, v in items], color=[color[i] for i in impls])
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels([k for k, _ in items], fontsize=6)
    handles = [Patch(color=c, label=i) for i, c in reversed(list(color.items()))]
    if roof:
        handles.append(ax.axvline(roof[0], ls="--", c="k", lw=2, label=roof[1]))
    ax.legend(handles=handles, fontsize=6, loc="lower right")
    ax.set_xscale("log")
    ax.set_xlabel("TFLOP/s" if panel["metric"] == "tflops" else "GB/s")
    ax.set_title(f"{suite} {mode}")
    ax.grid(True, axis="x", alpha=0.3)


def plot(doc: dict, path: str | os.PathLike) -> str | None:
    """Throughput against tokens, one panel per (suite, mode): one line per case family and
    implementation, the roof as a dashed line. Returns a note instead when matplotlib is not
    installed (``pip install tritonmoe[plot]``) or nothing can be plotted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: matplotlib is not installed (pip install 'tritonmoe[plot]'); no plot written"
    panels: dict[tuple[str, str], dict] = {}
    for r in doc["results"]:
        T = (r.get("params") or {}).get("T")
        if r["status"] != "ok" or T is None:
            continue
        metric = "tflops" if r.get("tflops") is not None and r["suite"] in ("ffn", "layer") else "gbps"
        y = r.get(metric)
        if y is None:
            continue
        family = r["case"].replace(f"T={T}", "").replace(f"T/rank={T}", "").replace("  ", " ").strip()
        series = panels.setdefault((r["suite"], r["mode"]), {"metric": metric, "lines": {}})["lines"]
        series.setdefault((family, r["impl"]), []).append((T, y))
    if not panels:
        return "plot: no result with a token count to plot"
    n = len(panels)
    ncols = min(2, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(9 * ncols, 5.5 * nrows), squeeze=False)
    roofs = doc.get("roofs") or {}
    for ax, ((suite, mode), panel) in zip(axes.flat, panels.items()):
        metric = panel["metric"]
        if all(len(pts) == 1 for pts in panel["lines"].values()):
            # One token count per line (e.g. gpu-check's shapes): bars, not lines of single dots.
            _bar_panel(ax, suite, mode, panel, _roof_line(doc, roofs, metric))
            continue
        families = list(dict.fromkeys(f for f, _ in panel["lines"]))
        colors = plt.get_cmap("tab10" if len(families) <= 10 else "tab20")
        for (family, impl), pts in panel["lines"].items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ls=_LINESTYLE.get(impl, "-"),
                    color=colors(families.index(family) % colors.N), label=f"{family} [{impl}]")
        roof = _roof_line(doc, roofs, metric)
        if roof:
            ax.axhline(roof[0], ls="--", c="k", lw=2, label=roof[1])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("TFLOP/s" if metric == "tflops" else "GB/s")
        ax.set_title(f"{suite} {mode}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="best", ncol=1 + len(panel["lines"]) // 12)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    env = doc["env"]
    fig.suptitle(f"tritonmoe bench: {env['gpu_name'] or 'CPU'}, {env['date_utc']}, {env['git_commit'] or ''}"[:120])
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
