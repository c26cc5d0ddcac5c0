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
* ``x_torch`` / ``x_gmm``: speedup over the reference path / ``torch._grouped_mm`` on the same
  inputs (their median over this row's median).

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

METRICS = ("time_us", "eager_us", "mm_roof", "mem_roof", "x_torch", "x_gmm")


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

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"Target {self.name!r}: metric {self.metric!r} is not one of {METRICS}")
        if self.op not in ("<=", ">="):
            raise ValueError(f"Target {self.name!r}: op {self.op!r} must be '<=' or '>='")

    def selects(self, row: dict) -> bool:
        if (row["suite"], row["mode"], row["impl"]) != (self.suite, self.mode, self.impl):
            return False
        params = row.get("params") or {}
        return all(params.get(k) == v for k, v in self.match.items())


def _router(T: int, E: int, deepseek: bool) -> dict:
    if deepseek:
        return dict(T=T, E=E, k=8, score_func="sigmoid", expert_bias=True, n_groups=8, topk_groups=4)
    return dict(T=T, E=E, k=8, score_func="softmax", expert_bias=False, n_groups=None)


def _router_speedups() -> list[Target]:
    out = []
    for deepseek in (False, True):
        for E in (128, 256):
            for T in (4096, 16384):
                label = f"router fwd+bwd {'DeepSeek-V3-like' if deepseek else 'softmax'} E={E} k=8 T={T}"
                out.append(Target(f"{label}, x reference", "route", "fwd+bwd", "triton", "x_torch", ">=", 3.0,
                                  _router(T, E, deepseek)))
    return out


def _movement() -> list[Target]:
    out = []
    for preset, T in ((MIXTRAL, 16384), (QWEN3, 16384)):
        short = preset.split("-like")[0]
        out.append(Target(f"permute rows {short} T={T}, of copy roof", "permute", "move", "triton", "mem_roof", ">=",
                          0.8, dict(op="permute", preset=preset, T=T)))
        out.append(Target(f"unpermute {short} T={T}, of copy roof", "permute", "fwd", "triton", "mem_roof", ">=", 0.8,
                          dict(op="unpermute", preset=preset, T=T)))
    return out


#: The targets, in the order the final table prints them.
TARGETS: tuple[Target, ...] = (
    Target("router fwd softmax E=128 k=8 T=4096, time (us)", "route", "fwd", "triton", "time_us", "<=", 6.3,
           _router(4096, 128, False)),
    *_router_speedups(),
    *_movement(),
    Target("grouped FFN fwd mixtral T=16384, of matmul roof", "ffn", "fwd", "triton", "mm_roof", ">=", 0.78,
           dict(op="grouped_ffn", preset=MIXTRAL, T=16384)),
    Target("grouped FFN fwd+bwd mixtral T=16384, of matmul roof", "ffn", "fwd+bwd", "triton", "mm_roof", ">=", 0.65,
           dict(op="grouped_ffn", preset=MIXTRAL, T=16384)),
    Target("grouped FFN fwd qwen3 T=32768, of matmul roof", "ffn", "fwd", "triton", "mm_roof", ">=", 0.63,
           dict(op="grouped_ffn", preset=QWEN3, T=32768)),
    Target("grouped FFN fwd+bwd qwen3 T=32768, of matmul roof", "ffn", "fwd+bwd", "triton", "mm_roof", ">=", 0.55,
           dict(op="grouped_ffn", preset=QWEN3, T=32768)),
    Target("grouped FFN fwd qwen3 T=32768, x torch._grouped_mm", "ffn", "fwd", "triton", "x_gmm", ">=", 1.2,
           dict(op="grouped_ffn", preset=QWEN3, T=32768)),
    Target("grouped FFN fwd+bwd qwen3 T=32768, x torch._grouped_mm", "ffn", "fwd+bwd", "triton", "x_gmm", ">=", 1.2,
           dict(op="grouped_ffn", preset=QWEN3, T=32768)),
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
    baseline = {"x_torch": "torch", "x_gmm": "grouped_mm"}[metric]
    return (row.get("speedup") or {}).get(baseline)


def evaluate(rows: list[dict], roofs: dict, *, targets: tuple[Target, ...] = TARGETS,
             skipped_reason: str | None = None) -> list[dict]:
    """One dict per target: name, metric, op, goal, value (None if not measured), status ("met",
    "not met", "not measured", "skipped"), the row it read (name and impl) and a note.

    ``skipped_reason`` (CPU mode) marks every target "skipped" with that note. Exactly one row
    may match a target; several (a plan that measured the shape twice) take the first and say so.
    """
    out = []
    for t in targets:
        res = {"name": t.name, "metric": t.metric, "op": t.op, "goal": t.goal, "value": None, "row": None,
               "status": "skipped" if skipped_reason else "not measured", "note": skipped_reason}
        if skipped_reason is None:
            found = [r for r in rows if t.selects(r)]
            ok = [r for r in found if r.get("status") == "ok"]
            if found:
                res["row"] = f"{found[0]['name']} [{found[0]['impl']}]"
            if not ok:
                res["note"] = (f"{found[0]['status']}: {found[0].get('note')}" if found
                               else "no result row: its section did not run")
            else:
                v = metric_value(ok[0], t.metric, roofs)
                res["row"] = f"{ok[0]['name']} [{ok[0]['impl']}]"
                if v is None or not math.isfinite(v):
                    res["note"] = f"the row has no {t.metric} (missing roof or baseline)"
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
    if metric in ("x_torch", "x_gmm"):
        return f"{v:.3g}x"
    return f"{v:.3f}"


def table_rows(results: list[dict]) -> list[list[str]]:
    """[target, value, goal, status] cells of the final table."""
    return [[r["name"], fmt_value(r["metric"], r["value"]), f"{r['op']} {fmt_value(r['metric'], r['goal'])}",
             r["status"] + (f" ({r['note']})" if r["note"] and r["status"] in ("not met", "not measured") else "")]
            for r in results]


def render_text(results: list[dict]) -> str:
    headers = ["target", "value", "goal", "status"]
    rows = table_rows(results)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers[:3])]

    def line(vals):
        return "  ".join([vals[0].ljust(widths[0]), vals[1].rjust(widths[1]), vals[2].rjust(widths[2]), vals[3]]).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths] + ["------"]), *(line(r) for r in rows)])


def render_markdown(results: list[dict]) -> str:
    body = ["| target | value | goal | status |", "| --- | ---: | ---: | --- |"]
    body += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in table_rows(results)]
    return "\n".join(body)


def summary(results: list[dict]) -> dict:
    """Counts of each status."""
    out: dict = {}
    for r in results:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out
