"""The performance targets of ``make gpu-check``: one table, and how a result row is judged.

Every target names the result row it reads (suite, mode, implementation and a subset of the
row's ``params``), a metric of that row and a goal. Metrics are ratios to roofs and baselines
measured in the same run, except the router's absolute time (the issue's goal is a time):

* ``time_us``: median time per call in microseconds (device time for rows measured in
  interleaved rounds: targets stated in kernel terms);
* ``eager_us``: median *eager* time per call in microseconds (``row["timing"]["eager_s"]``: the
  event interval of one ordinary call, launch gaps included), for targets about what a user's
  eager call costs;
* ``mm_roof``: TFLOP/s over the run's dense bf16 8192^3 matmul roof (for rows measured in
  interleaved rounds, the median of per-round fractions of the roof timed in the same rounds,
  ``row["roof_fracs"]``; likewise ``mem_roof``);
* ``mem_roof``: GB/s (useful bytes read + written, :mod:`bench.work`) over the run's
  device-to-device copy roof;
* ``eager_ratio``: this row's median eager time over the median eager time of the row of the
  target's ``versus`` implementation in the same case and mode (the router's call against
  ``torch.softmax`` + ``torch.topk``: what the user's eager call costs beside the floor);
* ``x_torch`` / ``x_gmm`` / ``x_liger``: speedup over the reference path / ``torch._grouped_mm``
  / Liger-Kernel's fused MoE on the same inputs (the median of per-round ratios for rows
  measured in interleaved rounds).

Beside each value the table prints the row's per-clock efficiency (FLOPs per SM clock over the
tensor-core peak per clock, from the SM clock sampled at every rep: ``row["per_clock_eff"]``),
so a result reads the same at any clock.

:func:`evaluate` turns a run's rows into one line per target: the value, the goal, and "met",
"not met", "not measured" (no such ok row, e.g. a section skipped for time or an error) or
"skipped" (CPU mode). The goals are the GPU-readiness issue's (H100/H200, bf16); change them
here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: Preset names of the shapes the targets are stated at.
MIXTRAL = "mixtral-8x7b-like"
QWEN3 = "qwen3-30b-a3b-like"

METRICS = ("time_us", "eager_us", "eager_ratio", "mm_roof", "mem_roof", "x_torch", "x_gmm", "x_liger")


@dataclass(frozen=True)
class Target:
    """One goal on one result row.

    name: what the final table prints. suite / mode / impl: the row's. match: params the row must
    have (a subset of ``row["params"]``). metric: one of :data:`METRICS`. op: "<=" or ">=".
    """

    name: str
    suite: str
    mode: str
    impl: str
    metric: str
    op: str
    goal: float
    match: dict = field(default_factory=dict)
    versus: str | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"Target {self.name!r}: metric {self.metric!r} is not one of {METRICS}")
        if self.op not in ("<=", ">="):
            raise ValueError(f"Target {self.name!r}: op {self.op!r} must be '<=' or '>='")
        if (self.metric == "eager_ratio") != (self.versus is not None):
            raise ValueError(f"Target {self.name!r}: metric 'eager_ratio' needs versus=<impl> (the row it divides "
                             f"by) and no other metric takes one (metric {self.metric!r}, versus {self.versus!r})")

    def selects(self, row: dict) -> bool:
        if (row["suite"], row["mode"], row["impl"]) != (self.suite, self.mode, self.impl):
            return False
        params = row.get("params") or {}
        return all(params.get(k) == v for k, v in self.match.items())


def _router(T: int, E: int) -> dict:
    return dict(T=T, E=E, k=8, score_func="softmax", expert_bias=False, n_groups=None)


def _grouped_ffn() -> list[Target]:
    """grouped_ffn over a permuted buffer: the GEMMs against CUTLASS (torch._grouped_mm), and the
    forward against the dense matmul roof."""
    out = []
    for preset, T, roof in ((MIXTRAL, 16384, 0.78), (QWEN3, 32768, 0.63)):
        short, m = preset.split("-")[0], dict(op="grouped_ffn", preset=preset, T=T)
        out.append(Target(f"grouped FFN fwd {short} T={T}, x torch._grouped_mm", "ffn", "fwd", "triton", "x_gmm",
                          ">=", 1.0, m))
        out.append(Target(f"grouped FFN fwd+bwd {short} T={T}, x torch._grouped_mm", "ffn", "fwd+bwd", "triton",
                          "x_gmm", ">=", 1.15, m))
        out.append(Target(f"grouped FFN fwd {short} T={T}, of matmul roof", "ffn", "fwd", "triton", "mm_roof", ">=",
                          roof, m))
    return out


def _moe_ffn() -> list[Target]:
    """The routed FFN x -> out (gather, FFN, weighted scatter) against the torch._grouped_mm
    pipeline and Liger-Kernel's fused MoE on the same inputs: at the bench sizes forward and
    forward+backward, at decode sizes forward only."""
    runs = [(MIXTRAL, 16384, "fwd"), (MIXTRAL, 16384, "fwd+bwd"), (QWEN3, 32768, "fwd"), (QWEN3, 32768, "fwd+bwd")]
    runs += [(p, T, "fwd") for p in (MIXTRAL, QWEN3) for T in (1, 8, 64)]
    out = []
    for preset, T, mode in runs:
        short = preset.split("-")[0]
        label = f"{'decode ' if T <= 64 else ''}moe_ffn {mode} {short} T={T}"
        m = dict(op="moe_ffn", preset=preset, T=T)
        out.append(Target(f"{label}, x torch._grouped_mm pipeline", "ffn", mode, "triton-fused", "x_gmm", ">=", 1.2, m))
        out.append(Target(f"{label}, x Liger fused MoE", "ffn", mode, "triton-fused", "x_liger", ">=", 1.2, m))
    return out


#: The targets, in the order the final table prints them (issue 29: one target per preset,
#: direction and peer; H100/H200, bf16, device time in interleaved rounds).
TARGETS: tuple[Target, ...] = (
    Target("router fwd softmax E=128 k=8 T=4096, time (us)", "route", "fwd", "triton", "time_us", "<=", 6.3,
           _router(4096, 128)),
    Target("router fwd softmax E=128 k=8 T=4096, eager call / torch.softmax+topk's", "route", "fwd", "triton",
           "eager_ratio", "<=", 1.5, _router(4096, 128), versus="softmax_topk"),
    *_grouped_ffn(),
    *_moe_ffn(),
    Target("unpermute qwen3 T=16384, of copy roof", "permute", "fwd", "triton", "mem_roof", ">=", 0.8,
           dict(op="unpermute", preset=QWEN3, T=16384)),
    Target("decode moe_ffn mixtral T=64, of copy roof", "ffn", "fwd", "triton-fused", "mem_roof", ">=", 0.7,
           dict(op="moe_ffn", preset=MIXTRAL, T=64)),
    Target("decode moe_ffn qwen3 T=64, of copy roof", "ffn", "fwd", "triton-fused", "mem_roof", ">=", 0.7,
           dict(op="moe_ffn", preset=QWEN3, T=64)),
)


def metric_value(row: dict, metric: str, roofs: dict) -> float | None:
    """The value of ``metric`` for a measured row (None when the row or a roof lacks it)."""
    if row.get("status") != "ok" or not row.get("time_s"):
        return None
    if metric == "time_us":
        return row["time_s"]["median"] * 1e6
    if metric == "eager_us":
        eager = (row.get("timing") or {}).get("eager_s")
        return eager["median"] * 1e6 if eager else None
    per_round = (row.get("roof_fracs") or {}).get({"mm_roof": "matmul", "mem_roof": "copy"}.get(metric, ""))
    if per_round:  # measured in interleaved rounds: the median of per-round fractions of that roof
        return per_round["median"]
    if metric == "mm_roof":
        mm = roofs.get(f"matmul_{(row.get('params') or {}).get('dtype')}") or roofs.get("matmul_bfloat16")
        return row["tflops"] / mm["tflops"] if row.get("tflops") and mm and mm.get("tflops") else None
    if metric == "mem_roof":
        cp = roofs.get("copy")
        return row["gbps"] / cp["gbps"] if row.get("gbps") and cp and cp.get("gbps") else None
    if metric == "eager_ratio":
        return None  # a ratio of two rows: evaluate() computes it
    baseline = {"x_torch": "torch", "x_gmm": "grouped_mm", "x_liger": "liger"}[metric]
    return (row.get("speedup") or {}).get(baseline)


def _eager_ratio(row: dict, rows: list[dict], versus: str) -> tuple[float | None, str | None]:
    """This row's median eager time over that of the ``versus`` row of the same case and mode."""
    other = [r for r in rows if r.get("status") == "ok" and r["impl"] == versus
             and (r["suite"], r["case"], r["mode"]) == (row["suite"], row["case"], row["mode"])]
    if not other:
        return None, f"no {versus} row in the same case"
    mine = ((row.get("timing") or {}).get("eager_s") or {}).get("median")
    theirs = ((other[0].get("timing") or {}).get("eager_s") or {}).get("median")
    if not mine or not theirs:
        return None, "the rows have no eager time"
    return mine / theirs, None


def evaluate(rows: list[dict], roofs: dict, *, targets: tuple[Target, ...] = TARGETS,
             skipped_reason: str | None = None) -> list[dict]:
    """One dict per target: name, metric, op, goal, value (None if not measured), status ("met",
    "not met", "not measured", "skipped"), the row it read (name and impl), the row's per-clock
    efficiency (median; None when not sampled) and a note.

    ``skipped_reason`` (CPU mode) marks every target "skipped" with that note. Exactly one row
    may match a target; several (a plan that measured the shape twice) take the first and say so.
    """
    out = []
    for t in targets:
        res = {"name": t.name, "metric": t.metric, "op": t.op, "goal": t.goal, "value": None, "row": None,
               "per_clock": None, "status": "skipped" if skipped_reason else "not measured", "note": skipped_reason}
        if skipped_reason is None:
            found = [r for r in rows if t.selects(r)]
            ok = [r for r in found if r.get("status") == "ok"]
            if found:
                res["row"] = f"{found[0]['name']} [{found[0]['impl']}]"
            if not ok:
                res["note"] = (f"{found[0]['status']}: {found[0].get('note')}" if found
                               else "no result row: its section did not run")
            else:
                res["row"] = f"{ok[0]['name']} [{ok[0]['impl']}]"
                res["per_clock"] = ((ok[0].get("per_clock_eff") or {}).get("median"))
                why = None
                if t.metric == "eager_ratio":
                    v, why = _eager_ratio(ok[0], rows, t.versus)
                else:
                    v = metric_value(ok[0], t.metric, roofs)
                if v is None or not math.isfinite(v):
                    res["note"] = why or f"the row has no {t.metric} (missing roof or baseline)"
                else:
                    res["value"] = v
                    met = v <= t.goal if t.op == "<=" else v >= t.goal
                    res["status"] = "met" if met else "not met"
                    if len(ok) > 1:
                        res["note"] = f"{len(ok)} rows match; the first is used"
        out.append(res)
    return out


def fmt_value(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    if metric in ("time_us", "eager_us"):
        return f"{v:.3g} us"
    if metric in ("x_torch", "x_gmm", "x_liger", "eager_ratio"):
        return f"{v:.3g}x"
    return f"{v:.3f}"


def table_rows(results: list[dict]) -> list[list[str]]:
    """[target, value, goal, per clock, status] cells of the final table."""
    return [[r["name"], fmt_value(r["metric"], r["value"]), f"{r['op']} {fmt_value(r['metric'], r['goal'])}",
             "-" if r.get("per_clock") is None else f"{r['per_clock']:.3f}",
             r["status"] + (f" ({r['note']})" if r["note"] and r["status"] in ("not met", "not measured") else "")]
            for r in results]


def render_text(results: list[dict]) -> str:
    headers = ["target", "value", "goal", "per clock", "status"]
    rows = table_rows(results)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers[:4])]

    def line(vals):
        return "  ".join([vals[0].ljust(widths[0]), *(v.rjust(w) for v, w in zip(vals[1:4], widths[1:])),
                          vals[4]]).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths] + ["------"]), *(line(r) for r in rows)])


def render_markdown(results: list[dict]) -> str:
    body = ["| target | value | goal | per clock | status |", "| --- | ---: | ---: | ---: | --- |"]
    body += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in table_rows(results)]
    return "\n".join(body)


def summary(results: list[dict]) -> dict:
    """Counts of each status."""
    out: dict = {}
    for r in results:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out
